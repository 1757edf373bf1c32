"""Overhead of ckpt_guard versus raw torch checkpointing.

Runs everything in ONE process and interleaves batches of raw checkpointing
(guard uninstalled) with guarded checkpointing (``ckpt_guard.install("strict")``,
no rule firing), swapping the order every other round to cancel drift.
Prints a Markdown table that can be pasted into the README.

This is a report, not a test: it exits 0 whatever the numbers are.

    python benchmarks/overhead.py            # full run
    python benchmarks/overhead.py --quick    # smoke run (2 rounds, 5 iters)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

TABLE_HEADER = (
    "| case | use_reentrant | mode | raw µs/call | guarded µs/call "
    "| ratio | ratio IQR | added µs/call | target |"
)
NO_TORCH_LINE_OK = "Proof: `import ckpt_guard` does not import torch"


# --------------------------------------------------------------------------
# import cost (subprocesses, before torch is imported here; order irrelevant)
# --------------------------------------------------------------------------

def _time_subprocess(code: str, runs: int) -> float:
    times = []
    env = dict(os.environ)
    env.pop("CKPT_GUARD_POLICY", None)
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure_import(runs: int):
    # one throwaway run of each to warm the page cache
    _time_subprocess("pass", 1)
    _time_subprocess("import ckpt_guard", 1)
    bare = _time_subprocess("pass", runs)
    imp = _time_subprocess("import ckpt_guard", runs)
    out = subprocess.run(
        [sys.executable, "-c", 'import sys, ckpt_guard; print("torch" in sys.modules)'],
        cwd=REPO_ROOT, check=True, capture_output=True, text=True,
    ).stdout.strip()
    return bare, imp, out


# --------------------------------------------------------------------------
# checkpoint timing
# --------------------------------------------------------------------------

def build_cases(torch):
    nn = torch.nn

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Block(nn.Module):
        def __init__(self, d=256, heads=4, hidden=1024):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class Trivial(nn.Module):
        def forward(self, x):
            return x * 2

    torch.manual_seed(0)
    return [
        # the guard's fixed cost per call, with torch's own work as small as it gets
        ("Trivial x*2, 4 elements", Trivial(), torch.randn(4, requires_grad=True)),
        ("Linear+relu 64x64", Small(), torch.randn(64, 64, requires_grad=True)),
        ("Transformer block d=256", Block(), torch.randn(1, 128, 256, requires_grad=True)),
    ]


def make_batch(torch, module, x, use_reentrant, backward, iters):
    cp = torch.utils.checkpoint  # attribute looked up per call: sees any patch

    if backward:
        def batch():
            t0 = time.perf_counter()
            for _ in range(iters):
                cp.checkpoint(module, x, use_reentrant=use_reentrant).sum().backward()
            return time.perf_counter() - t0
    else:
        def batch():
            t0 = time.perf_counter()
            for _ in range(iters):
                cp.checkpoint(module, x, use_reentrant=use_reentrant)
            return time.perf_counter() - t0
    return batch


def bench_one(ckpt_guard, batch, iters, rounds):
    """Per round a raw and a guarded batch back to back (order swapped every other
    round); returns per-call medians and the per-round (paired) ratios and
    differences, which cancel the machine's slow drift."""
    def raw():
        ckpt_guard.uninstall()
        return batch()

    def guarded():
        ckpt_guard.install("strict")
        try:
            return batch()
        finally:
            ckpt_guard.uninstall()

    raw()
    guarded()  # warm-up, discarded
    raw_t, grd_t = [], []
    for r in range(rounds):
        if r % 2 == 0:
            raw_t.append(raw())
            grd_t.append(guarded())
        else:
            grd_t.append(guarded())
            raw_t.append(raw())
    return Result(
        raw_us=statistics.median(raw_t) / iters * 1e6,
        guarded_us=statistics.median(grd_t) / iters * 1e6,
        ratios=[g / r for g, r in zip(grd_t, raw_t)],
        added_us=[(g - r) / iters * 1e6 for g, r in zip(grd_t, raw_t)],
    )


class Result:
    def __init__(self, raw_us, guarded_us, ratios, added_us):
        self.raw_us, self.guarded_us, self.ratios, self.added_us = raw_us, guarded_us, ratios, added_us

    def ratio(self):
        return statistics.median(self.ratios)

    def ratio_iqr(self):
        """Quartiles of the paired ratios (both the median when there are too few rounds)."""
        if len(self.ratios) < 4:
            return self.ratio(), self.ratio()
        q1, _, q3 = statistics.quantiles(self.ratios, n=4)
        return q1, q3

    def verdict(self, limit):
        q1, q3 = self.ratio_iqr()
        if q3 <= limit:
            return "met"
        if q1 > limit:
            return "NOT met"
        return "within noise"


TARGETS = {
    ("Linear+relu 64x64", False, "forward"): ("<= 1.02x", 1.02),
    ("Transformer block d=256", False, "forward+backward"): ("<= 1.005x", 1.005),
    ("Transformer block d=256", True, "forward+backward"): ("<= 1.005x", 1.005),
}


def cpu_name() -> str:
    name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name or "unknown CPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300, help="calls per batch (default 300)")
    p.add_argument("--big-iters", type=int, default=None,
                   help="calls per batch for the transformer block "
                        "(default iters // 5: one call is ~50x the small case)")
    p.add_argument("--rounds", type=int, default=15, help="raw/guarded batch pairs (default 15)")
    p.add_argument("--import-runs", type=int, default=10,
                   help="subprocess runs for the import-cost measurement (default 10)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, 5 iters")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.rounds, args.import_runs = 5, 2, 2
    if args.big_iters is None:
        args.big_iters = max(1, args.iters // 5)

    bare_ms, imp_ms, torch_loaded = measure_import(args.import_runs)

    import torch
    import torch.utils.checkpoint  # noqa: F401 - torch < 2.5 does not import it with torch
    import ckpt_guard

    torch.set_num_threads(1)
    ckpt_guard.uninstall()
    warnings.simplefilter("ignore")  # keep torch's own warnings out of the timing

    started = time.perf_counter()
    rows = []
    sizes = ((args.iters, 2 * args.rounds), (args.iters, args.rounds), (args.big_iters, args.rounds))
    for (name, module, x), (iters, rounds) in zip(build_cases(torch), sizes):
        for use_reentrant in (False, True):
            for backward in (False, True):
                mode = "forward+backward" if backward else "forward"
                batch = make_batch(torch, module, x, use_reentrant, backward, iters)
                rows.append((name, use_reentrant, mode, bench_one(ckpt_guard, batch, iters, rounds)))
    elapsed = time.perf_counter() - started

    print(
        f"Machine: {cpu_name()} ({platform.machine()}), os.cpu_count()={os.cpu_count()}, "
        f"torch.get_num_threads()={torch.get_num_threads()}, torch {torch.__version__}, "
        f"Python {platform.python_version()} ({platform.system()})"
    )
    print(
        f"Method: one process, {args.rounds} rounds x {args.iters} calls per batch "
        f"({2 * args.rounds} rounds for the trivial block, {args.big_iters} calls for the transformer "
        f"block); per round a raw and a guarded batch back to back (order swapped every other "
        f"round); µs/call are medians over rounds, ratio and added µs/call the medians of the "
        f"per-round pairs, with the ratios' interquartile range; a target is met when the whole "
        f"range is under it; guard = ckpt_guard.install(\"strict\"), no rule firing. "
        f"Timing took {elapsed:.0f} s."
    )
    print()
    print(TABLE_HEADER)
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for name, ur, mode, result in rows:
        target, limit = TARGETS.get((name, ur, mode), ("", None))
        if limit is not None:
            target = f"{target} ({result.verdict(limit)})"
        q1, q3 = result.ratio_iqr()
        print(f"| {name} | {ur} | {mode} | {result.raw_us:.1f} | {result.guarded_us:.1f} | "
              f"{result.ratio():.4f}x | {q1:.4f}–{q3:.4f} | "
              f"{statistics.median(result.added_us):+.1f} | {target} |")
    print()
    print("| startup | median ms (subprocess) |")
    print("|---|---:|")
    print(f"| `python -c pass` | {bare_ms:.1f} |")
    print(f"| `python -c \"import ckpt_guard\"` | {imp_ms:.1f} |")
    print(f"| added by `import ckpt_guard` | {imp_ms - bare_ms:+.1f} |")
    print()
    print(f'`import sys, ckpt_guard; print("torch" in sys.modules)` -> {torch_loaded}')
    if torch_loaded == "False":
        print(NO_TORCH_LINE_OK + ".")
    else:
        print("WARNING: `import ckpt_guard` DID import torch.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
