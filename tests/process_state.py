"""The process-wide state a test must leave as it found it, read and put back.

A test that leaves grad mode off, a torch.func layer's dispatch keys, or saved-tensor hooks disabled
does not fail itself: every test after it does, far from the cause (at 0d7e5da and e92e4e4, 1,477 and
1,651 later tests). ``tests/conftest.py`` reads this state around every test and the matrix around
every cell (``conformance.run_cell``); a change fails the test or cell that made it, by name, and is
put back so that the next ones start clean.

One known source is torch's own: ``Tensor.__repr__`` (``torch._tensor_str._str``) keeps a
``_DisableFuncTorch`` guard in a local variable. Where the repr raises, the guard lives as long as the
traceback; on releases whose dispatch-key guards restore a snapshot (measured: 2.13, 2.15; not 2.4.1),
freeing it later puts back the dispatch keys of the moment it was made. A compile that fails inside a
torch.func transform does this (tests/test_reliability.py measures it on the installed torch).
"""

from __future__ import annotations

import torch

import ckpt_guard

#: global_state()'s names for the thread's dispatch keys (included, excluded)
DISPATCH_KEY_STATE = ("dispatch keys included", "dispatch keys excluded")
#: guards that set the thread's dispatch keys back, kept so that they are never exited
_FORCED_DISPATCH_KEYS: list = []


def dispatch_keys() -> tuple:
    """The thread's own dispatch keys, included and excluded (torch.func's layers change them)."""
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


def global_state() -> tuple:
    """The process-wide state, as (name, value) pairs that compare with ==."""
    from torch._C._functorch import peek_interpreter_stack

    from ckpt_guard import _state

    hooks = _state.top_saved_tensor_hooks
    return (
        ("grad mode", torch.is_grad_enabled()),
        ("inference mode", torch.is_inference_mode_enabled()),
        ("forward grad", torch._C._is_fwd_grad_enabled()),
        ("forward AD level", torch.autograd.forward_ad._current_level),
        ("torch.func transforms", peek_interpreter_stack() is not None),
        ("dispatch modes", torch._C._len_torch_dispatch_stack()),
        ("function modes", torch._C._len_torch_function_stack()),
        ("saved-tensor hooks", None if hooks is None else hooks() is not None),
        ("saved-tensor hooks enabled", torch._C._autograd._saved_tensors_hooks_is_enabled()),
        ("default dtype", torch.get_default_dtype()),
        ("guard installed", ckpt_guard.is_installed()),
        # by name: DispatchKeySet has no == before torch 2.5 (measured on 2.4.1)
        *zip(DISPATCH_KEY_STATE, map(str, dispatch_keys())),
    )


def put_back_if_changed(before: tuple, keys: tuple) -> dict:
    """What differs now from a global_state() reading, as name -> (before, now), after putting back
    what can be put back (see restore)."""
    after = global_state()
    changed = {name: (was, now) for (name, was), (_, now) in zip(before, after) if was != now}
    if changed:
        restore(before, keys)
    return changed


def force_dispatch_keys(keys: tuple) -> None:
    """Set the thread's dispatch keys to ``keys`` for good: a guard entered and never exited (up to
    torch 2.4 its constructor sets them, later releases set them on __enter__: measured on 2.4.1, 2.15)."""
    guard = torch._C._ForceDispatchKeyGuard(*keys)
    guard.__enter__()
    _FORCED_DISPATCH_KEYS.append(guard)


def restore(state: tuple, keys: tuple) -> None:
    """Put back what can be put back of a global_state() reading and the dispatch_keys() taken with it
    (a torch.func layer, a mode or a forward-AD level left open cannot be closed from outside)."""
    values = dict(state)
    if tuple(map(str, dispatch_keys())) != tuple(map(str, keys)):
        force_dispatch_keys(keys)
    torch.set_grad_enabled(values["grad mode"])
    torch._C._set_fwd_grad_enabled(values["forward grad"])
    if values["saved-tensor hooks enabled"] and not torch._C._autograd._saved_tensors_hooks_is_enabled():
        torch._C._autograd._saved_tensors_hooks_enable()
    torch.set_default_dtype(values["default dtype"])
    if ckpt_guard.is_installed() != values["guard installed"]:
        ckpt_guard.uninstall() if not values["guard installed"] else ckpt_guard.install("strict", rules={})
