"""Per-sample gradients through torch's ExpandedWeights (``call_for_per_sample_grads``, Opacus' "ew" mode).

``call_for_per_sample_grads(net)(x)`` swaps ExpandedWeights in for the module's
parameters for the forward only (a ``functional_call``): torch's recompute, in
the backward, reads the module's own parameters, so the per-sample gradients
come out wrong (non-reentrant) or missing (reentrant), silently.  The guard read
``.requires_grad`` on an ExpandedWeight, which its ``__torch_function__``
refuses ("cannot handle function __get__"): ``ckpt_guard.checkpoint`` without
``install()`` crashed there, and so did an installed guard on a reentrant call
(issue 27, section 3).  Now: strict explains (a rule from the table), fallback
gives the uncheckpointed per-sample gradients, with and without ``install()``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_all_close
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning


class Net(torch.nn.Module):
    """An embedding layer, a checkpointed block, a head: the block's input requires grad (or not)."""

    def __init__(self, how, input_requires_grad=True):
        super().__init__()
        self.embed, self.inner, self.head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        self.how, self.input_requires_grad = how, input_requires_grad

    def block(self, t):
        return torch.tanh(self.inner(t))

    def forward(self, x):
        h = self.embed(x) if self.input_requires_grad else x
        if self.how == "plain":
            h = self.block(h)
        elif self.how == "ckpt_guard.checkpoint":
            h = ckpt_guard.checkpoint(self.block, h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.how == "reentrant")
        return self.head(h)


def per_sample_grads(how, input_requires_grad=True):
    torch.manual_seed(0)
    net = Net(how, input_requires_grad)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    call_for_per_sample_grads(net)(x).sum().backward()
    return [getattr(p, "grad_sample", None) for p in net.inner.parameters()]


def _exact(got, reference):
    return all(g is not None for g in got) and all(torch.allclose(g, r) for g, r in zip(got, reference))


HOWS = ["non-reentrant", "reentrant", "ckpt_guard.checkpoint"]


@pytest.mark.parametrize("input_requires_grad", [True, False], ids=["input-requires-grad", "input-without-grad"])
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_raw_torch_is_silently_wrong_here(how, input_requires_grad):
    """The claim the rules make (CKG101: silently wrong, CKG006 where no input requires grad), measured here."""
    reference = per_sample_grads("plain", input_requires_grad)
    ckpt_guard.uninstall()
    assert not _exact(per_sample_grads(how, input_requires_grad), reference)


# torch's own checkpoint is guarded where install() patched it; ckpt_guard.checkpoint either way
GUARDED = [(how, True) for how in HOWS] + [("ckpt_guard.checkpoint", False)]


@pytest.mark.parametrize("input_requires_grad", [True, False], ids=["input-requires-grad", "input-without-grad"])
@pytest.mark.parametrize(("how", "installed"), GUARDED, ids=[f"{h}-{'installed' if i else 'not-installed'}" for h, i in GUARDED])
def test_strict_explains_and_fallback_is_exact(how, installed, input_requires_grad, monkeypatch):
    reference = per_sample_grads("plain", input_requires_grad)
    for policy in ("strict", "fallback"):
        monkeypatch.setenv("CKPT_GUARD_POLICY", policy)
        ckpt_guard.uninstall()
        if installed:
            ckpt_guard.install(policy)
        try:
            if policy == "strict":
                with pytest.raises(CheckpointCompositionError, match=r"\[CKG(101|006)\]"):
                    per_sample_grads(how, input_requires_grad)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", CheckpointCompositionWarning)
                    got = per_sample_grads(how, input_requires_grad)
                assert all(g is not None for g in got)
                assert_all_close(got, reference)
        finally:
            ckpt_guard.uninstall()


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_warn_behaves_as_torch(how):
    """Warn: the rule's warning, then torch's own outcome (the guard's look at an ExpandedWeight never fails)."""
    ckpt_guard.uninstall()
    raw = per_sample_grads(how)
    ckpt_guard.install("warn")
    try:
        with pytest.warns(CheckpointCompositionWarning, match=r"\[CKG101\]"):
            guarded = per_sample_grads(how)
    finally:
        ckpt_guard.uninstall()
    assert [g is None for g in guarded] == [g is None for g in raw]
    for g, r in zip(guarded, raw):
        if r is not None:
            assert torch.equal(g, r)
