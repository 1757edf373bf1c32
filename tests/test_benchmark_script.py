"""Smoke test: benchmarks/overhead.py --quick runs and prints its report."""

from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "overhead.py")


def test_overhead_quick_runs_and_reports():
    env = dict(os.environ)
    env.pop("CKPT_GUARD_POLICY", None)
    env.pop("CKPT_GUARD_RULES", None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| case | use_reentrant | mode | raw µs/call | guarded µs/call" in out, out
    assert "Proof: `import ckpt_guard` does not import torch" in out, out
    assert "| ratio | ratio IQR | added µs/call | target |" in out, out
    # every combination is reported: 3 sizes x 2 variants x 2 modes
    assert out.count("| Trivial x*2, 4 elements |") == 4, out
    assert out.count("| Linear+relu 64x64 |") == 4, out
    assert out.count("| Transformer block d=256 |") == 4, out


def test_memory_times_runs_the_variants_side_by_side():
    """``benchmarks/memory.py --times``: a row per workload with both times and their ratio."""
    env = dict(os.environ)
    env.pop("CKPT_GUARD_POLICY", None)
    env.pop("CKPT_GUARD_RULES", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "memory.py"),
         "--times", "--size", "quick", "--repeat", "1", "--only", "hvp"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| hvp ")]
    assert [row.split(" | ")[0] for row in rows] == ["| hvp jvp(grad)", "| hvp vjp(grad)"], proc.stdout
    for row in rows:
        base, checked, ratio = row.split(" | ")[1:4]
        assert float(base) > 0 and float(checked) > 0, row
        shown = float(ratio.split("x")[0])
        assert abs(shown - float(checked) / float(base)) <= 0.2 * shown, row  # the times are rounded
        assert ("met" if shown <= 1.5 else "MISSED") in ratio, row
