"""Activation offload with checkpointing under torch.func (issue 48, item 1), measured on the installed torch.

``torch.autograd.graph.save_on_cpu`` around a torch.func transform is refused by torch at the
transform's entry ("don't yet support saved tensor hooks"), with or without checkpointing and
before any checkpoint call: no code of the guard runs there, under any policy, so the error stays
torch's (docs/limits.md says so, with what works).  What works under the transform is offload by a
save policy: ``context_fn=checkpoint_policies.context_fn(checkpoint_policies.offload_dots)``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch.func import functional_call, grad, vmap

import ckpt_guard
from ckpt_guard import checkpoint_policies as cp

torch.manual_seed(0)
NET = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
PARAMS = {k: v.detach() for k, v in NET.named_parameters()}
XS = torch.randn(3, 4, dtype=torch.float64)


def _per_sample(checkpoint=None, **options):
    def loss(p, x):
        block = lambda h: functional_call(NET, p, (h,))  # noqa: E731
        out = block(x[None]) if checkpoint is None else checkpoint(block, x[None], **options)
        return out.pow(2).sum()

    return vmap(grad(loss), in_dims=(None, 0))(PARAMS, XS)


@pytest.fixture(autouse=True)
def _uninstalled():
    ckpt_guard.uninstall()
    yield
    ckpt_guard.uninstall()


@pytest.mark.parametrize("policy", [None, "strict", "warn", "fallback"])
@pytest.mark.parametrize("checkpoint", [None, ckpt_guard.checkpoint, tuc.checkpoint],
                         ids=["no checkpoint", "ckpt_guard.checkpoint", "torch checkpoint"])
def test_save_on_cpu_around_a_transform_is_torchs_refusal_with_or_without_checkpointing(checkpoint, policy):
    if policy is not None:
        ckpt_guard.install(policy)
    options = {"use_reentrant": False} if checkpoint is tuc.checkpoint else {}
    calls = []
    counted = None if checkpoint is None else (lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            _per_sample(counted, **options)
    assert calls == []  # refused at the transform's entry: no checkpoint call was reached


@pytest.mark.skipif(not hasattr(tuc, "create_selective_checkpoint_contexts"),
                    reason="save policies need torch's selective checkpointing (torch 2.5+)")
@pytest.mark.skipif(not hasattr(getattr(tuc, "CheckpointPolicy", None), "MUST_CPU_OFFLOAD"),
                    reason="this torch's CheckpointPolicy has no MUST_CPU_OFFLOAD")
def test_offload_by_a_save_policy_under_the_transform_gives_the_uncheckpointed_gradients():
    reference = _per_sample()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        got = _per_sample(ckpt_guard.checkpoint, context_fn=cp.context_fn(cp.offload_dots))
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], msg=name)
