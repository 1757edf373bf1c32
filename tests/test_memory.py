"""The memory saving is kept at every order of differentiation (``benchmarks/memory.py``, medium sizes).

Each workload runs without checkpointing and with every block through
``ckpt_guard.checkpoint`` (``fallback`` for torch's own checkpoint calls where
the benchmark has that variant), each in a fresh process, peak RSS above the
set-up.  Margins are generous (the full-size targets are in the README): at
most 0.8x the no-checkpoint peak where checkpointing must save, and never more
than without it anywhere.  Results are compared in value by the other tests;
this one measures memory only.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
try:
    import memory
finally:
    sys.path.pop(0)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads peak RSS from /proc (Linux only)")


def _checked_variant(workload: str) -> str:
    variants = memory.WORKLOADS[workload][1]
    return "ckpt_guard.checkpoint" if "ckpt_guard.checkpoint" in variants else "fallback"


@pytest.fixture(scope="module")
def peaks():
    """Every (workload, variant) this file checks, measured two processes at a time (peak RSS is
    per process; their times, which nothing here checks, suffer)."""
    runs = [(w, v) for w in memory.WORKLOADS if memory._available(w) for v in ("no checkpoint", _checked_variant(w))]
    runs.append(("mlp grad", "fallback"))
    runs.append(("hvp vjp(grad)", memory.BY_HAND))
    runs += [(w, memory.SAVE_MATMULS) for w in ("mlp grad", "mlp vmap(grad) per-sample") if memory.SAVE_MATMULS in memory.WORKLOADS[w][1]]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(runs, pool.map(lambda run: memory.measure(*run, "medium"), runs)))
    return results


@pytest.mark.parametrize("workload", list(memory.WORKLOADS))
def test_checkpointing_keeps_its_memory_saving(workload, peaks):
    if not memory._available(workload):
        pytest.skip("transformers is not installed (the GPT-2 workload needs it)")
    target = memory.WORKLOADS[workload][2]
    margin = 0.8 if target < 1.0 else 1.0
    base, checked = peaks[(workload, "no checkpoint")], peaks[(workload, _checked_variant(workload))]
    assert checked["peak_mb"] <= margin * base["peak_mb"], (workload, checked, base)


def test_fallback_under_grad_keeps_the_memory_saving(peaks):
    """torch's own checkpoint under policy fallback: the composable recompute, as ckpt_guard.checkpoint."""
    base, fallback = peaks[("mlp grad", "no checkpoint")], peaks[("mlp grad", "fallback")]
    assert fallback["peak_mb"] <= 0.6 * base["peak_mb"], (fallback, base)


@pytest.mark.parametrize("workload", ["mlp grad", "mlp vmap(grad) per-sample"])
def test_a_save_policy_keeps_the_peak_below_the_uncheckpointed_one(workload, peaks):
    """Matmuls saved (a save policy, issue 31): more memory than recomputing everything, less than none."""
    if memory.SAVE_MATMULS not in memory.WORKLOADS[workload][1]:
        pytest.skip("torch before 2.5 has no create_selective_checkpoint_contexts")
    base, saving = peaks[(workload, "no checkpoint")], peaks[(workload, memory.SAVE_MATMULS)]
    recomputing = peaks[(workload, "ckpt_guard.checkpoint")]
    assert recomputing["peak_mb"] < saving["peak_mb"] < base["peak_mb"], (recomputing, saving, base)


def test_reverse_over_reverse_peaks_where_the_schedule_written_by_hand_peaks(peaks):
    """``vjp(grad)`` (issue 31): each block runs four times, and the schedule written out in plain
    autograd (``benchmarks/memory.py``'s ``4 runs by hand``: one block's activations alive at a
    time, the loss differentiated as torch.func differentiates it) is the least that costs.
    ``ckpt_guard.checkpoint`` peaks where it peaks.  A recompute's pullback that kept its graph's
    buffers until it returned (``retain_graph=True``) peaked ~5 MB higher at this size (37 MB
    against 32): the derivative's activations and their backward's temporaries, all at once."""
    by_hand = peaks[("hvp vjp(grad)", memory.BY_HAND)]
    checked = peaks[("hvp vjp(grad)", "ckpt_guard.checkpoint")]
    assert checked["peak_mb"] <= 1.05 * by_hand["peak_mb"] + 1.0, (checked, by_hand)
