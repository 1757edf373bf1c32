"""The torch entry points the readers call, bound once, and the few helpers they all share.

Owns: names bound from torch (an attribute lookup costs on the hot path), the ``_GONE``
sentinel, ``requires_grad`` seen through functorch wrappers, a tensor's version.
May not touch: anything stateful; every reader may import from here, this imports none.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional

import torch
import torch.utils.checkpoint  # torch 2.4's `import torch` does not import it
from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor
from torch._C._functorch import peek_interpreter_stack  # noqa: F401 - the state package's, from here
from torch.autograd import forward_ad  # noqa: F401 - the state package's, from here


#: torch.utils.checkpoint's globals (set_checkpoint_early_stop's switch lives there)
_checkpoint = vars(torch.utils.checkpoint)
len_dispatch_stack = torch._C._len_torch_dispatch_stack
len_function_stack = torch._C._len_torch_function_stack
saved_tensor_hooks_enabled: Callable[[], bool] = (
    torch._C._autograd._saved_tensors_hooks_is_enabled
)
is_grad_enabled = torch.is_grad_enabled


def _top_hooks_reader() -> Optional[Callable[[], Any]]:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # torch 2.4-2.7 has none
        return None
    try:
        top(True)
        return lambda: top(True)
    except TypeError:  # an early form took no argument
        return top


_vmap_hooks_off: list = []


def vmap_switches_saved_tensor_hooks_off() -> bool:
    """Whether this torch's vmap switches saved-tensor hooks off for its body (2.4 does, 2.13 does not).

    Measured once, where it is asked: only where a grad transform left them on (a torch patched to
    allow them at first order): a pullback run later under vmap (``jacrev``'s) would find them off.
    """
    if not _vmap_hooks_off:
        if torch.compiler.is_compiling():  # never a vmap of the guard's own in a traced program: say so
            return True
        seen: list = []
        with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
            torch.func.vmap(lambda x: (seen.append(saved_tensor_hooks_enabled()), x)[1])(torch.zeros(1))
        _vmap_hooks_off.append(not seen[0])
    return _vmap_hooks_off[0]


#: a reader of the innermost saved-tensor hooks registered now, ``(pack, unpack)`` or None (the user's
#: ``save_on_cpu``, a library's offload, torch's own recompute hooks); None on torch 2.4-2.7, which
#: cannot tell
top_saved_tensor_hooks: Optional[Callable[[], Any]] = _top_hooks_reader()
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


def hooks_set_aside() -> List[Any]:
    """The saved-tensor hooks registered now (the user's ``save_on_cpu``), popped off torch's stack,
    innermost first, for :func:`hooks_put_back`; nothing on torch 2.4-2.7, which cannot read them back.

    Where a grad level the user did not write must run without them: the composable recompute's own
    level (a torch patched to allow hooks at first order would count it as a second order), and
    fallback's way through a transform that stock torch refuses to enter under them (CKG012).
    """
    aside: List[Any] = []
    if top_saved_tensor_hooks is not None:
        while (top := top_saved_tensor_hooks()) is not None:
            aside.append(top)
            _pop_hooks()
    return aside


def hooks_put_back(aside: List[Any]) -> None:
    """Undo :func:`hooks_set_aside`: the same hooks, in their order."""
    for pack, unpack in reversed(aside):
        _push_hooks(pack, unpack)

Tensor = torch.Tensor
Module = torch.nn.Module


def is_module(value: object) -> bool:
    """Whether ``value`` is an ``nn.Module``: by its real type, or a proxy of one (a ``wrapt.ObjectProxy``, whose
    ``__class__`` and attributes are the module's).  Not an object whose ``__class__`` only claims it (a
    ``Mock(spec=nn.Linear)`` has no module's state) or raises: ``isinstance`` alone would take the first for a
    module and raise with the second."""
    if issubclass(type(value), Module):
        return True
    if type(value) in weakref.ProxyTypes:  # (a weakref.proxy: no walk can keep a weak reference to it)
        return False
    try:
        return isinstance(value, Module) and isinstance(getattr(value, "_parameters", None), dict)
    except Exception:  # noqa: BLE001 - a __class__ or an attribute lookup of the user's that raises
        return False


_GONE = object()
_Generator = torch.Generator


def _cell_contents(cell: object) -> object:
    """A closure cell's value, or None for an empty cell (a name assigned after the function was made)."""
    try:
        return cell.cell_contents  # type: ignore[attr-defined]
    except ValueError:
        return None


def _version_of(tensor: Tensor) -> Optional[int]:
    try:
        return tensor._version
    except Exception:  # noqa: BLE001
        return None


_NO_SUBCLASS_FUNCTIONS = torch._C.DisableTorchFunctionSubclass


def requires_grad_of(t: Tensor) -> bool:
    """``t.requires_grad``, also for a subclass whose ``__torch_function__`` refuses the read.

    torch's ExpandedWeights (Opacus' per-sample gradients, ``call_for_per_sample_grads``)
    raises "cannot handle function __get__" for it: the guard's look must never be
    what fails, so it reads past the subclass there (a try costs nothing when it holds).
    """
    try:
        return t.requires_grad
    except Exception:  # noqa: BLE001 - the subclass's own refusal, not the user's error
        with _NO_SUBCLASS_FUNCTIONS():
            return t.requires_grad


def requires_grad_anywhere(t: Tensor) -> bool:
    """``requires_grad`` seen through functorch wrappers (a vmapped tensor says False)."""
    while True:
        if requires_grad_of(t):
            return True
        if not is_functorch_wrapped_tensor(t):
            return False
        t = get_unwrapped(t)
