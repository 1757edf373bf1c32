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
    assert [row.split(" | ")[0] for row in rows] == [
        "| hvp jvp(grad)", "| hvp vjp(grad)", "| hvp vjp(grad), every second block", "| hvp vjp(grad), 4 runs by hand",
    ], proc.stdout
    for row in rows:
        base, checked, ratio = row.split(" | ")[1:4]
        assert float(base) > 0 and float(checked) > 0, row
        shown = float(ratio.split("x")[0])
        assert abs(shown - float(checked) / float(base)) <= 0.2 * shown, row  # the times are rounded
        assert ("met" if shown <= 1.5 else "MISSED") in ratio, row


def test_the_hand_written_recompute_computes_the_same_hessian_vector_product():
    """``4 runs by hand`` and ``every second block`` are timed against torch.func's ``vjp(grad)``:
    they must compute what it computes, or their times say nothing."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("memory_benchmark", os.path.join(REPO_ROOT, "benchmarks", "memory.py"))
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    setup = memory.WORKLOADS["hvp vjp(grad)"][0]
    (reference,) = setup(torch, "quick", "no checkpoint")()
    gradient, by_hand = setup(torch, "quick", memory.BY_HAND)()
    (every_second,) = setup(torch, "quick", memory.EVERY_SECOND)()
    assert by_hand.keys() == every_second.keys() == reference.keys()
    for name, value in reference.items():
        assert value.abs().max() > 0, name
        torch.testing.assert_close(by_hand[name], value, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(every_second[name], value, rtol=1e-4, atol=1e-7)
    # its first output, the gradient itself, as the set-up builds the model and data
    width, depth, batch = memory.HVP["quick"]
    net = memory._mlp(torch, width, depth, 4, lambda block, h: block(h))
    data = torch.randn(batch, width)
    params = {k: v.detach() for k, v in net.named_parameters()}
    expected = torch.func.grad(lambda p: torch.func.functional_call(net, p, (data,)).pow(2).mean())(params)
    assert gradient.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(gradient[name], value)


def test_policies_quick_measures_every_variant_and_their_results_agree():
    """``benchmarks/policies.py --size quick``: a table per workload, every variant's result equal."""
    import pytest
    import torch.utils.checkpoint as tuc

    if not hasattr(tuc, "create_selective_checkpoint_contexts"):
        pytest.skip("save policies need torch >= 2.5 (the script's ready policies refuse older releases)")
    env = dict(os.environ)
    env.pop("CKPT_GUARD_POLICY", None)
    env.pop("CKPT_GUARD_RULES", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "policies.py"), "--size", "quick", "--repeat", "1"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("results equal: yes") == 3, proc.stdout
    for variant in ("no checkpoint", "save nothing", "save matmuls", "save named"):
        assert proc.stdout.count(f"| {variant} | ") == 3, proc.stdout


def test_blocks_rows_runs_the_residual_blocks_under_grad_only():
    """``benchmarks/blocks.py --rows N``: the residual small blocks at N rows, grad only (per-sample
    gradients of every row would take gigabytes), with the save policy's share of the recompute's cost."""
    import torch.utils.checkpoint as tuc

    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "blocks.py"), "--rows", "16", "--repeat", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "residual: 6 x 2 x Linear(256), 16 rows" in out, out
    assert "ckpt_guard.checkpoint under grad       adds" in out, out
    assert "vmap(grad)" not in out and "tiny" not in out and "medium" not in out, out
    # torch 2.5+ has selective checkpointing: the policy's line is there
    assert ("with matmuls saved" in out) == hasattr(tuc, "create_selective_checkpoint_contexts"), out


def test_blocks_compiled_sets_compiled_blocks_beside_eager_ones():
    """``benchmarks/blocks.py --compiled`` (issue 47, item 3): each block ``torch.compile``'d, the same
    steps side by side with eager blocks, the grad steps' gradients equal (backend aot_eager here:
    inductor's compiles take minutes on CI's cores; the benchmark's default is inductor)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "blocks.py"), "--compiled", "--quick",
         "--backend", "aot_eager"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    import torch

    for step in ("eager", "eager checkpoint", "grad", "grad, {}, ckpt_guard.checkpoint"):
        for blocks in ("eager blocks", "compiled blocks"):
            label = step.format(blocks) if "{}" in step else f"{step}, {blocks}"
            # torch < 2.6 refuses a compiled block under a transform (class compiled), and says so
            runs = label != "grad, compiled blocks, ckpt_guard.checkpoint" or hasattr(torch.compiler, "set_stance")
            assert (f"  {label} " in out) == runs, (label, out)
    assert ("refused (class compiled: torch < 2.6)" in out) == (not hasattr(torch.compiler, "set_stance")), out
    assert "gradients equal across the grad steps: yes" in out, out
    assert "compiling the blocks: the .backward() step" in out, out


def test_offload_with_checkpointing_keeps_checkpointings_saving():
    """benchmarks/offload.py: on a torch patched to allow saved-tensor hooks under vmap(grad), offload
    and ckpt_guard.checkpoint together peak below offload alone (checkpointing's saving is kept);
    where this torch refuses the hooks under vmap (2.4), the rows say so."""
    import re

    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_GUARD_")}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "offload.py"), "--size", "medium"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    peaks = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| ([^|]+) \| (\d+) \|", proc.stdout, re.M)}
    assert peaks["ckpt_guard.checkpoint"] < 0.7 * peaks["no checkpoint"], proc.stdout
    if "save_on_cpu" in peaks:
        assert peaks["save_on_cpu + ckpt_guard.checkpoint"] < 0.9 * peaks["save_on_cpu"], proc.stdout
    else:
        assert "refused by this torch" in proc.stdout, proc.stdout
