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
from ckpt_guard._state import vmap_switches_saved_tensor_hooks_off

torch.manual_seed(0)
NET = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
PARAMS = {k: v.detach() for k, v in NET.named_parameters()}
XS = torch.randn(3, 4, dtype=torch.float64)


def per_sample(checkpoint=None, **options):
    """Per-sample gradients of NET by ``vmap(grad)``, its one block checkpointed by ``checkpoint``
    (``tests/test_patched_torch.py`` runs the same program on a patched torch)."""
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
            per_sample(counted, **options)
    assert calls == []  # refused at the transform's entry: no checkpoint call was reached


@pytest.mark.skipif(not hasattr(tuc, "create_selective_checkpoint_contexts"),
                    reason="save policies need torch's selective checkpointing (torch 2.5+)")
@pytest.mark.skipif(not hasattr(getattr(tuc, "CheckpointPolicy", None), "MUST_CPU_OFFLOAD"),
                    reason="this torch's CheckpointPolicy has no MUST_CPU_OFFLOAD")
def test_offload_by_a_save_policy_under_the_transform_gives_the_uncheckpointed_gradients():
    reference = per_sample()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        got = per_sample(ckpt_guard.checkpoint, context_fn=cp.context_fn(cp.offload_dots))
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], msg=name)


# --------------------------------------------------------------------------
# the user's save_on_cpu where torch allows it: around a vmap or jvp, then an eager .backward()

import itertools  # noqa: E402

import conformance as cf  # noqa: E402 - the matrix's kinds and its judge

OFFLOADED_TRANSFORMS = ("vmap, then .backward()", "jvp, then .backward()", "eager .backward()")


def _offloaded_cells():
    """Every kind under every transform here, pinned (the copy that once read as a write); the entry
    taken in turn, and every third cell unpinned (an alias, whose version is still checked)."""
    entries = itertools.cycle(("ckpt_guard.checkpoint, strict", "ckpt_guard.checkpoint, fallback"))
    pinning = itertools.cycle((True, True, False))
    return [(kind, transform, next(entries), next(pinning)) for kind in cf.KINDS for transform in OFFLOADED_TRANSFORMS]


@pytest.mark.parametrize("kind, transform, entry, pin_memory", _offloaded_cells(),
                         ids=lambda v: v if isinstance(v, str) else ("pinned" if v else "not pinned"))
def test_save_on_cpu_around_the_program_keeps_it_right(kind, transform, entry, pin_memory):
    """Every kind, the whole program (the uncheckpointed reference too) inside ``save_on_cpu``.

    A pinned copy (``pin_memory=True``, whose copy moves the copy's version) once read to the
    composable recompute as an input written in place after the call: ChangedSinceForward where the
    plain program is right.  What the user's hooks give back as a copy is what the call saw.
    """
    cell = cf.Cell(kind, transform, "module", entry)
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
        outcome = cf._run_cell(cell)
    assert not outcome.failed, f"{cell.label()}: {outcome.verdict}: {outcome.detail}"


def test_a_write_after_the_call_is_still_caught_under_hooks_that_give_the_input_back():
    """``save_on_cpu`` on the CPU gives the input back as itself: a write into it after the call is
    still the recompute's ChangedSinceForward (torch's autograd checks no version of what hooks packed:
    without checkpointing this program is torch's silent wrong gradient; the guard stops it)."""
    lin = torch.nn.Linear(3, 3).double()
    xs = torch.randn(2, 3, dtype=torch.float64)
    if vmap_switches_saved_tensor_hooks_off():
        pytest.skip("this torch's vmap refuses saved-tensor hooks (torch 2.4, measured): the program cannot run")
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        h = vmap(lin)(xs)
        out = vmap(lambda t: ckpt_guard.checkpoint(lambda u: torch.exp(0.5 * u), t))(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="updated in place after the block's forward"):
        out.sum().backward()
