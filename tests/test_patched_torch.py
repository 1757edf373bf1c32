"""Coexistence with a patched torch (issue 48, item 4): fire only where the torch in hand is broken.

JetBrains' opaque patches torch so that saved-tensor hooks, and so torch's non-reentrant checkpoint,
run under first-order ``vmap(grad(f))``, and so that a checkpoint's recompute re-enters
``functional_call``'s swap (``tests/patched_torch.py``, a faithful stand-in).  The table reads the
state that decides it live (CKG001 fires where saved-tensor hooks are off at the call, not by release
or by the patcher's name), and the composable recompute neither trips on the user's hooks nor
mistakes a hook's copy for an input written after the call.

Every expectation is measured on the installed torch: what raw torch does under the patches (right,
refused, or wrong), against the program without checkpointing.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch.func import functional_call, grad, vmap

import ckpt_guard
from ckpt_guard import CheckpointCompositionError
from ckpt_guard._state import vmap_switches_saved_tensor_hooks_off

import conformance as cf
from patched_torch import first_order_hooks_allowed, opaque_patches
from test_offload import per_sample as _per_sample

STRICT_TORCH = "torch checkpoint (non-reentrant), strict"  # an entry of this file's only
ENTRIES = ("ckpt_guard.checkpoint, strict", "ckpt_guard.checkpoint, fallback",
           "torch checkpoint (non-reentrant), fallback", STRICT_TORCH)
TRANSFORMS = ("grad", "vmap(grad), randomness different", "jacrev", "vjp(grad)", "hessian", "grad(grad)",
              "eager .backward()")
ACCESS = ("functional_call", "closure")


def _cells():
    """Every kind under every transform here; the entry and the way in taken in turn (a pairwise slice
    of entry × way in, each kind and transform crossed in full: 33 × 7 cells)."""
    turns = itertools.cycle(itertools.product(ENTRIES, ACCESS))
    return [cf.Cell(kind, transform, access, entry)
            for kind in cf.KINDS for transform in TRANSFORMS for entry, access in [next(turns)]]


@pytest.fixture(autouse=True)
def _uninstalled():
    ckpt_guard.uninstall()
    yield
    ckpt_guard.uninstall()


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setitem(cf.ENTRIES, STRICT_TORCH, ("strict", cf._nr))
    with opaque_patches():
        yield


def _raw(cell):
    """What torch alone does with the cell's program under the patches: "right", "raises" or "wrong"."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, _ = cf._execute(cell, cf._plain)
        try:
            got, _ = cf._execute(cell, cf.ENTRIES[cell.entry][1])
        except Exception:  # noqa: BLE001 - torch's own refusal
            return "raises"
    return "wrong" if cf._compare(got, reference) else "right"


@pytest.mark.parametrize("cell", _cells(), ids=lambda c: c.label())
def test_a_patched_torch_is_judged_by_what_it_does(patched, cell):
    outcome = cf._run_cell(cell)
    assert not outcome.failed, f"{cell.label()}: {outcome.verdict}: {outcome.detail}"
    if cell.entry != STRICT_TORCH or outcome.verdict == "n/a":
        return
    raw = _raw(cell)
    if raw == "right" and vmap_switches_saved_tensor_hooks_off() and "CKG001" in outcome.detail:
        # torch 2.4: its vmap switches the hooks off, so a pullback run later under a vmap (jacrev's)
        # would fail, and the call cannot tell; CKG001 refuses there as on the stock torch (measured)
        return
    if raw == "right":  # where the patched torch is right, strict lets it run
        assert outcome.verdict != "refused", f"{cell.label()}: the patched torch is right, strict refused: {outcome.detail}"
    elif raw == "raises":  # where it raises, strict explains first (where it is wrong, the right result
        # above is enough: strict repairs what it can, a BatchNorm's second update of its statistics)
        assert outcome.verdict == "refused", f"{cell.label()}: the patched torch raises, strict let it: {outcome.detail}"


def test_the_stand_in_changes_what_torch_does():
    """On a torch where the patch allows first-order hooks, raw checkpointing under vmap(grad) runs
    with it and raises without it; elsewhere it raises either way (the stand-in must matter)."""
    net = torch.nn.Linear(3, 3).double()
    params = {k: v.detach() for k, v in net.named_parameters()}

    def per_sample():
        loss = lambda p, x: tuc.checkpoint(  # noqa: E731
            lambda h: functional_call(net, p, (h,)), x[None], use_reentrant=False).sum()
        return vmap(grad(loss), in_dims=(None, 0))(params, torch.randn(2, 3, dtype=torch.float64))

    refused = "saved tensor hooks|_NoopSaveInputs"  # torch 2.4 refuses at the vmap first (CKG007)
    with pytest.raises(RuntimeError, match=refused):
        per_sample()
    with opaque_patches():
        allowed = first_order_hooks_allowed()
        if allowed:
            per_sample()
        else:
            with pytest.raises(RuntimeError, match=refused):
                per_sample()
    assert not first_order_hooks_allowed()  # taken off again


def test_installed_before_the_patches_too():
    """ckpt_guard.install() first, then the patcher (the other order is the matrix's)."""
    ckpt_guard.install("strict")
    cell = cf.Cell("mlp", "vmap(grad), randomness different", "functional_call", STRICT_TORCH)
    with opaque_patches(), pytest.MonkeyPatch.context() as mp:
        mp.setitem(cf.ENTRIES, STRICT_TORCH, ("strict", cf._nr))
        raw = _raw(cell)
        reference, _ = cf._execute(cell, cf._plain)
        if raw == "right":
            got, _ = cf._execute(cell, cf._nr)
            assert not cf._compare(got, reference)
        else:
            with pytest.raises(CheckpointCompositionError, match="CKG00[17]"):
                cf._execute(cell, cf._nr)


@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("policy", [None, "strict", "warn", "fallback"])
@pytest.mark.parametrize("checkpoint", [ckpt_guard.checkpoint, tuc.checkpoint],
                         ids=["ckpt_guard.checkpoint", "torch checkpoint"])
def test_offload_on_a_patched_torch_stays_the_patched_torchs(checkpoint, policy, pin_memory):
    """``save_on_cpu`` around ``vmap(grad(f))``: where the patched torch runs the uncheckpointed program,
    every checkpointed one gives its gradients (fallback once broke it: the recompute's own level
    refused the user's hooks, and a pinned copy read as an input written after the call)."""
    options = {"use_reentrant": False} if checkpoint is tuc.checkpoint else {}
    with opaque_patches():
        with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
            try:
                reference = _per_sample()
            except RuntimeError as exc:
                assert "saved tensor hooks" in str(exc)
                reference = None
        if policy is not None:
            ckpt_guard.install(policy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
                if reference is None:  # torch 2.4: vmap refuses the hooks itself, patched or not
                    with pytest.raises((RuntimeError, CheckpointCompositionError)):
                        _per_sample(checkpoint, **options)
                    return
                got = _per_sample(checkpoint, **options)
    for name in reference:
        torch.testing.assert_close(got[name], reference[name])
