"""``respect_saved_tensors_hooks`` (pytorch#190581, tracking #191236): ckpt_guard.checkpoint never sets off
torch's FutureWarning, and passes the option only where the installed torch has it (issue 27, section 5).

Torch 2.15 added the option: with selective checkpointing (``context_fn``) under a user's
``saved_tensors_hooks`` (``save_on_cpu``), left unset, torch warns that the tensors it saves bypass
the hooks and that a later release routes them through.  ckpt_guard.checkpoint passes ``True``
(torch's announced default) unless told otherwise; before 2.15, where those tensors always bypass
the hooks, it passes nothing and ``True`` is an error.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc

import ckpt_guard

needs_selective = pytest.mark.skipif(
    not hasattr(tuc, "create_selective_checkpoint_contexts"),
    reason="selective checkpointing (create_selective_checkpoint_contexts) is new in torch 2.5",
)

#: the installed torch's checkpoint has the option (read off its signature, as the guard reads it)
HAS_OPTION = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters


def _run(call):
    """``(gradients, how many tensors the user's pack hook saw, the FutureWarnings)``."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    sac = functools.partial(
        tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
    )
    packed = []

    def pack(t):
        packed.append(t)
        return t

    def block(t):
        return torch.tanh(linear(t)).sin()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = call(block, x, sac) if call else block(x)
        y.pow(2).sum().backward()
    future = [w for w in caught if issubclass(w.category, FutureWarning) and "saved_tensors_hooks" in str(w.message)]
    return [y.detach(), x.grad, *(p.grad for p in linear.parameters())], len(packed), future


@needs_selective
def test_torch_warns_where_it_has_the_option():
    """The claim, measured: raw torch warns under a user hook with the option unset, where it has the option."""
    _, _, future = _run(lambda f, x, sac: tuc.checkpoint(f, x, use_reentrant=False, context_fn=sac))
    assert bool(future) == HAS_OPTION


@needs_selective
@pytest.mark.parametrize("value", [None, True, False], ids=["left-out", "True", "False"])
def test_ckpt_guard_checkpoint_never_warns_and_routes_as_asked(value):
    reference, _, _ = _run(None)
    _, legacy_packed, _ = _run(lambda f, x, sac: tuc.checkpoint(f, x, use_reentrant=False, context_fn=sac))
    option = {} if value is None else {"respect_saved_tensors_hooks": value}
    if value is True and not HAS_OPTION:
        with pytest.raises(ValueError, match=r"respect_saved_tensors_hooks=True[\s\S]*no such option"):
            _run(lambda f, x, sac: ckpt_guard.checkpoint(f, x, context_fn=sac, **option))
        return
    got, packed, future = _run(lambda f, x, sac: ckpt_guard.checkpoint(f, x, context_fn=sac, **option))
    assert not future
    torch.testing.assert_close(got, reference)
    respected = HAS_OPTION and value is not False
    # respected: the tensors selective checkpointing saves (the mm's output) pass through the hook too
    assert (packed > legacy_packed) if respected else (packed == legacy_packed)


def test_a_value_that_is_not_a_bool_is_one_clear_error():
    with pytest.raises(TypeError, match=r"respect_saved_tensors_hooks='yes'.*expected True, False or None"):
        ckpt_guard.checkpoint(torch.tanh, torch.randn(2, requires_grad=True), respect_saved_tensors_hooks="yes")
