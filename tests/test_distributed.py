"""The guard under real multi-process training: torchrun, 2 ranks, gloo, CPU.

Each test launches ``python -m torch.distributed.run --nproc_per_node=2
--standalone tests/distributed_worker.py SCENARIO OUT_DIR`` and reads the JSON
each rank writes:

* ``fsdp2``  FSDP2 ``fully_shard`` + composable ``checkpoint(block)``: the guard
  (strict) changes nothing, bit for bit (losses, unsharded params and grads).
* ``ddp``    DDP + ``apply_activation_checkpointing`` (NO_REENTRANT): same.
* ``refuse`` ``vmap(grad(loss))`` through a non-reentrant checkpoint at step 2:
  both ranks raise the same rule (CKG001; CKG007 on torch < 2.12) at the same
  step and shut down cleanly (no hang).

Every launch runs under a bounded timeout; on expiry the launcher's process
group and each worker's own session (torchrun starts workers with
``start_new_session``) are killed and the test fails with the output so far.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_worker.py"
ROOT = HERE.parent
TIMEOUT_S = 120
NPROC = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _worker_pids(out_dir: Path):
    pids = []
    for f in out_dir.glob("rank*.pid"):
        try:
            pids.append(int(f.read_text().strip()))
        except ValueError:
            pass
    return pids


def launch(scenario: str, tmp_path: Path):
    """Run the worker under torchrun; return (per-rank results, returncode, output, seconds)."""
    out_dir = tmp_path / scenario
    out_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_GUARD_")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        CKPT_GUARD_DIST_OUT=str(out_dir),
        PYTHONUNBUFFERED="1",
    )
    # torchrun --standalone picks its own free port; drop inherited rendezvous settings.
    for k in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={NPROC}", "--standalone",
        str(WORKER), scenario, str(out_dir),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # torchrun forwards SIGTERM to its workers; then make sure of it.
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        for pid in _worker_pids(out_dir):
            _kill_group(pid, signal.SIGKILL)  # each worker leads its own session
        pytest.fail(
            f"torchrun {scenario!r} did not finish within {TIMEOUT_S} s (hang?); "
            f"killed it. Output:\n{output[-6000:]}"
        )
    seconds = time.perf_counter() - start

    results = {}
    for rank in range(NPROC):
        path = out_dir / f"rank{rank}.json"
        assert path.exists(), (
            f"rank {rank} wrote no result (exit status {proc.returncode}). "
            f"Output:\n{output[-6000:]}"
        )
        results[rank] = json.loads(path.read_text())
    return results, proc.returncode, output, seconds


def _explain(results, output):
    lines = []
    for rank, r in results.items():
        shown = {k: v for k, v in r.items() if k not in ("param_names", "traceback")}
        lines.append(f"rank {rank}: {shown}")
        if "traceback" in r:
            lines.append(r["traceback"])
    lines.append(output[-4000:])
    return "\n".join(lines)


def _assert_guard_changes_nothing(results, returncode, output):
    msg = _explain(results, output)
    for rank, r in results.items():
        assert "exception" not in r, msg
        assert r["losses_equal"], msg
        assert r["raw_losses"] == r["guarded_losses"], msg
        assert r["params_equal"], msg
        assert r["grads_equal"], msg
        assert r["params_same_across_ranks"], msg
        # The checkpoint really ran, unguarded first and through the guard after.
        assert r["raw_ckpt_calls"] > 0 and r["raw_guarded_calls"] == 0, msg
        assert r["guarded_ckpt_calls"] == r["raw_ckpt_calls"], msg
        assert r["guarded_guarded_calls"] == r["guarded_ckpt_calls"], msg
        assert r["guard_events"] == [], msg
        assert r["ok"], msg
    # Different data per rank: the ranks really trained on different batches.
    assert results[0]["raw_losses"] != results[1]["raw_losses"], msg
    assert returncode == 0, msg


def _has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(
    not _has_fully_shard(),
    reason=f"torch {torch.__version__} has no public FSDP2 API (torch.distributed.fsdp.fully_shard)",
)
def test_fsdp2_composable_checkpoint_unchanged_by_guard(tmp_path):
    results, returncode, output, _ = launch("fsdp2", tmp_path)
    _assert_guard_changes_nothing(results, returncode, output)
    msg = _explain(results, output)
    for r in results.values():
        # Parameters really were sharded DTensors (FSDP2 on a CPU mesh).
        assert r["dtensor_params"] == r["n_tensors"] > 0, msg


def test_ddp_activation_checkpointing_unchanged_by_guard(tmp_path):
    results, returncode, output, _ = launch("ddp", tmp_path)
    _assert_guard_changes_nothing(results, returncode, output)
    msg = _explain(results, output)
    for r in results.values():
        assert r["dtensor_params"] == 0, msg


def test_refuse_same_step_same_rule_on_every_rank(tmp_path):
    results, returncode, output, _ = launch("refuse", tmp_path)
    msg = _explain(results, output)
    for rank, r in results.items():
        assert "exception" not in r, msg
        assert r["error_type"] == "CheckpointCompositionError", msg
        assert r["refused_step"] == 2, msg
        expected = r["expected_rule_id"]  # from the table for this torch: CKG001, or CKG007 before 2.12
        assert expected in ("CKG001", "CKG007"), msg
        assert r["rule_id"] == expected, msg
        assert r["steps_completed"] == [0, 1], msg
        assert r["all_ranks"] == [[2, expected]] * NPROC, msg
        assert r["ok"], msg
    assert returncode == 0, msg
