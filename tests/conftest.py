"""Shared helpers: the three runs every differential test compares."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ckpt_guard
import process_state


def no_checkpoint(function, *args, use_reentrant=None, **kwargs):
    """The uncheckpointed reference: same call shape as checkpoint, plain call."""
    kwargs.pop("preserve_rng_state", None)
    kwargs.pop("context_fn", None)
    return function(*args, **kwargs)


def run_raw(probe, use_reentrant):
    """Raw torch: the guard is not installed at all."""
    was = ckpt_guard.is_installed()
    ckpt_guard.uninstall()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return probe(checkpoint, use_reentrant)
    finally:
        if was:
            ckpt_guard.install("strict")


def installed_under(policy, run, *args):
    """``run(*args)`` with the guard installed under ``policy`` (no per-rule overrides), then
    uninstalled: ``(result, the guard's warnings)``, every warning recorded."""
    ckpt_guard.install(policy, rules={})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run(*args)
    finally:
        ckpt_guard.uninstall()
    return result, [w.message for w in caught if issubclass(w.category, ckpt_guard.CheckpointCompositionWarning)]


def run_guarded(probe, use_reentrant, policy, rules=None):
    with ckpt_guard.policy(policy, rules=rules):
        return probe(checkpoint, use_reentrant)


def assert_all_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def all_close(actual, expected) -> bool:
    try:
        assert_all_close(actual, expected)
    except AssertionError:
        return False
    return True


def assert_all_equal(actual, expected):
    """Bitwise equal (NaN where NaN: a probe whose symptom is garbage gradients makes them NaN)."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


def leaves_and_flops(run, ops) -> tuple:
    """``run()``'s tensor leaves and the FLOPs of the operations named in ``ops`` ("aten.mm", ...) that ran.

    torch's FLOP counter's dispatch mode, without its module tracker, entered below
    whatever ``run`` pushes: an output a save policy hands back is not counted.
    """
    from torch.utils import flop_counter
    from torch.utils._python_dispatch import TorchDispatchMode

    counter = flop_counter.FlopCounterMode(display=False)
    mode = flop_counter._FlopCounterMode(counter)
    TorchDispatchMode.__enter__(mode)
    try:
        result = run()
    finally:
        TorchDispatchMode.__exit__(mode, None, None, None)
    counts = counter.get_flop_counts().get("Global", {})
    leaves = [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    return leaves, sum(n for op, n in counts.items() if str(op) in ops)


def per_sample_grads_refusal() -> str:
    """The rule the table gives vmap(grad(...)) over a non-reentrant checkpoint on this torch.

    CKG001 (grad transforms refuse saved-tensor hooks), except where torch
    refuses the vmap first (CKG007, torch < 2.12).
    """
    from ckpt_guard._rules import rule_by_id
    from ckpt_guard._versions import installed

    return "CKG007" if rule_by_id("CKG007").holds_on(installed()) else "CKG001"


@pytest.fixture
def guard():
    """The guard installed with strict for one test, and uninstalled after it."""
    ckpt_guard.install("strict", rules={})
    try:
        yield
    finally:
        ckpt_guard.uninstall()


@pytest.fixture(autouse=True)
def _leaves_process_state_as_found():
    """A test that leaves process-wide state changed fails by name, and the next test starts clean
    (tests/process_state.py: otherwise every later test fails, far from the cause)."""
    before, keys = process_state.global_state(), process_state.dispatch_keys()
    yield
    changed = process_state.put_back_if_changed(before, keys)
    if changed:
        pytest.fail(f"the test left process-wide state changed (before, after): {changed}", pytrace=False)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("CKPT_GUARD_POLICY", raising=False)
    monkeypatch.delenv("CKPT_GUARD_RULES", raising=False)
