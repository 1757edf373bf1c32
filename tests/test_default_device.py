"""CKG109 on a CPU-only machine: the mechanism, measured, and the guard's decisions.

The symptom (a recompute that makes CPU tensors next to GPU ones) needs a GPU:
``tests/test_rules.py`` and ``python -m ckpt_guard`` measure it there.  What
causes it is measurable here with the ``meta`` device: the reentrant recompute
runs without the forward's ``torch.device(...)`` context (on every release),
the non-reentrant one re-enters it from torch 2.11 on.  The guard's decisions
are checked under a ``meta`` device context too: nothing in these blocks makes
a tensor, so they compute on the CPU as usual.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401 - torch 2.8 cannot import it lazily inside a device context (circular import)
import torch.utils.checkpoint as tuc
from torch.func import vjp

import ckpt_guard
from ckpt_guard import _composable
from ckpt_guard import CheckpointCompositionError
from ckpt_guard._rules import rule_by_id
from ckpt_guard._versions import installed

HERE = installed()
pytestmark = pytest.mark.usefixtures("guard")

NR_KEEPS_IT = HERE >= (2, 11)  # measured: torch 2.10's checkpoint has no DeviceContext, 2.11's recompute keeps it


def _block(seen: list, makes: str = "a tensor"):
    """A Linear + tanh block; ``makes`` a tensor without device= and records where it landed.

    ``"a tensor"``: one element, which CKG109 counts; its device also picks the
    output's factor (under ``meta`` it cannot take part in a computation with
    CPU tensors), so a recompute on another device computes something else.
    ``"a 0-dim tensor"``: which mixes with GPU tensors, so CKG109 does not
    count it.  ``"no tensor"``: records nothing.
    """
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)

    def block(t):
        if makes == "no tensor":
            return torch.tanh(linear(t))
        made = torch.zeros(1) if makes == "a tensor" else torch.tensor(0.5)
        seen.append(made.device.type)
        factor = 2.0 if made.device.type == "meta" or makes != "a tensor" else 3.0
        return torch.tanh(linear(t)) * factor

    return linear, block


@pytest.mark.parametrize("reentrant", [True, False], ids=["R", "NR"])
def test_the_recompute_loses_the_device_context_as_the_table_says(reentrant):
    """Raw torch: the forward inside ``torch.device("meta")``, the backward outside it."""
    ckpt_guard.uninstall()
    seen: list = []
    _, block = _block(seen)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.device("meta"):
        y = tuc.checkpoint(block, x, use_reentrant=reentrant)
    y.sum().backward()
    keeps = NR_KEEPS_IT and not reentrant
    assert seen == ["meta", "meta" if keeps else "cpu"]
    assert rule_by_id("CKG109").variants == ("reentrant",)  # the table claims the reentrant half only


def test_reentrant_recompute_loses_it_even_with_the_backward_inside():
    ckpt_guard.uninstall()
    seen: list = []
    _, block = _block(seen)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.device("meta"):
        tuc.checkpoint(block, x, use_reentrant=True).sum().backward()
    assert seen == ["meta", "cpu"]


def _checkpointed_in_meta(block, x, linear):
    """Gradients of a reentrant checkpoint called inside ``torch.device("meta")``, backward outside."""
    with torch.device("meta"):
        y = tuc.checkpoint(block, x, use_reentrant=True)
    return _loss_and_grads(lambda _: y, x, linear)


def _loss_and_grads(run, x, linear):
    linear.zero_grad()
    x.grad = None
    run(x).pow(2).sum().backward()
    return [x.grad.clone(), linear.weight.grad.clone(), linear.bias.grad.clone()]


def test_strict_raises_at_the_recompute():
    seen: list = []
    _, block = _block(seen)
    x = torch.randn(2, 4, requires_grad=True)
    with ckpt_guard.policy("strict"), ckpt_guard.record() as events:
        with torch.device("meta"):
            y = tuc.checkpoint(block, x, use_reentrant=True)
        with pytest.raises(CheckpointCompositionError) as info:
            y.sum().backward()
    assert info.value.rule.id == "CKG109" and seen == ["meta"]  # raised before the recompute ran
    message = str(info.value)
    assert "the forward ran inside a meta default device and made tensors without device=" in message
    assert "pass use_reentrant=False" in message
    assert [(e.rule_id, e.action, e.stage) for e in events] == [("CKG109", "raised", "recompute")]


def test_raw_torch_recompute_takes_the_other_branch():
    """What the guard prevents, on the CPU: the recompute's tensor lands elsewhere, the gradient is off."""
    ckpt_guard.uninstall()
    seen: list = []
    linear, block = _block(seen)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.device("meta"):
        reference = _loss_and_grads(block, x, linear)
    got = _checkpointed_in_meta(block, x, linear)
    assert seen[-2:] == ["meta", "cpu"]
    assert not torch.allclose(got[0], reference[0])


@pytest.mark.parametrize(
    "case", [
        "non-reentrant", "cpu device context", "no grad", "no device context", "block makes no tensor",
        "block makes a 0-dim tensor",  # CPU scalars mix with GPU tensors: torch.tensor(0.5) as a factor is fine
    ],
)
def test_no_alarm_where_the_recompute_is_fine(case):
    seen: list = []
    makes = {"block makes no tensor": "no tensor", "block makes a 0-dim tensor": "a 0-dim tensor"}.get(case, "a tensor")
    linear, block = _block(seen, makes)
    x = torch.randn(2, 4, requires_grad=True)
    device = "cpu" if case in ("cpu device context", "no device context") else "meta"
    with torch.device(device):
        reference = _loss_and_grads(block, x, linear) if case != "no grad" else None
    with ckpt_guard.policy("strict"), ckpt_guard.record() as events:
        with torch.device(device), torch.set_grad_enabled(case != "no grad"):
            y = tuc.checkpoint(block, x, use_reentrant=case != "non-reentrant")
        if reference is not None:
            linear.zero_grad()
            x.grad = None
            y.pow(2).sum().backward()
            if case != "non-reentrant" or HERE >= (2, 11):  # the non-reentrant recompute keeps it from 2.11
                torch.testing.assert_close(x.grad, reference[0])
    assert [e.rule_id for e in events] == []


def test_fallback_recomputes_inside_the_forward_device_context():
    seen: list = []
    linear, block = _block(seen)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.device("meta"):
        reference = _loss_and_grads(block, x, linear)
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events:
        with pytest.warns(ckpt_guard.CheckpointCompositionWarning, match=r"\[CKG109\]"):
            got = _checkpointed_in_meta(block, x, linear)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b)
    assert seen[-2:] == ["meta", "meta"]  # the recompute ran: the memory saving is kept
    assert [(e.rule_id, e.action) for e in events] == [("CKG109", "fallback: repaired")]


def test_warn_warns_then_behaves_like_torch():
    seen: list = []
    linear, block = _block(seen)
    x = torch.randn(2, 4, requires_grad=True)
    with ckpt_guard.policy("warn"):
        with torch.device("meta"):
            y = tuc.checkpoint(block, x, use_reentrant=True)
        with pytest.warns(ckpt_guard.CheckpointCompositionWarning, match=r"\[CKG109\]"):
            y.sum().backward()
    assert seen == ["meta", "cpu"]


def test_composable_recompute_re_enters_the_forward_device_context():
    """vjp's backward runs after the context closed; the recompute still sees it."""
    seen: list = []
    _, block = _block(seen)
    x = torch.randn(2, 4)
    with torch.device("meta"):
        out, pullback = vjp(lambda t: ckpt_guard.checkpoint(block, t), x)
        _, plain_pullback = vjp(block, x)
    recomputes = _composable.counters.RECOMPUTES
    (grad_x,) = pullback(torch.ones_like(out))
    assert _composable.counters.RECOMPUTES == recomputes + 1  # it ran (on the CPU it could not mix with the meta output)
    # forward, the plain forward; the recompute's own entry is undone after it, as every change to a
    # list the block is given (what the block does to it happens once, as without checkpointing)
    assert seen == ["meta", "meta"]
    torch.testing.assert_close(grad_x, plain_pullback(torch.ones_like(out))[0])


def test_the_forward_watch_is_not_a_user_mode_to_nested_checkpoints():
    """A checkpoint nested in the watched forward sees no new function mode (no CKG103)."""
    torch.manual_seed(0)
    inner, outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    def block(t):
        return outer(tuc.checkpoint(inner, t, use_reentrant=False))

    with torch.device("meta"):
        reference = _loss_and_grads(block, x, outer)
    with ckpt_guard.policy("strict"), ckpt_guard.record() as events:
        got = _checkpointed_in_meta(block, x, outer)
    assert [e.rule_id for e in events] == []
    torch.testing.assert_close(got[0], reference[0])
