"""The guard's per-call cost, before and after a change: this tree against a git revision.

    python benchmarks/compare.py 947493e          # this working tree vs that commit
    python benchmarks/compare.py HEAD~1 --rounds 20

The brief's rule for the hot path: benchmark before and after.  Two versions of
the package cannot live in one process, so each round runs one subprocess per
version, in alternating order; each subprocess times the same checkpoint calls
raw (guard uninstalled) and guarded (``install("strict")``, no rule firing) in batches back to back
(nine rounds, order swapped every other round) and reports the median µs the
guard adds per call.  The medians over rounds, and their
ratio, are printed side by side; the machine's noise shows in the spread.

The revision is checked out with ``git worktree`` into a temporary folder and
removed afterwards.  This is a report, not a test: it exits 0 whatever the
numbers are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a subprocess with the package from argv[1] first on sys.path.
_MEASURE = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch, ckpt_guard
from torch.utils.checkpoint import checkpoint
torch.set_num_threads(1)
assert ckpt_guard.__file__.startswith(sys.argv[1]), ckpt_guard.__file__

class Trivial(torch.nn.Module):
    def forward(self, x):
        return x * 2

class Block(torch.nn.Module):  # a few modules: the snapshot walks each
    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)
    def forward(self, x):
        return self.norm(self.b(torch.relu(self.a(x))))

def batch(call, n=300):  # CPU time: a busy neighbour's steal time on a shared machine is not counted
    start = time.process_time()
    for _ in range(n):
        call()
    return (time.process_time() - start) / n * 1e6

results = {}
closure = (lambda block: lambda h: block(h))(Block())  # a function block: its closure's modules are walked
helper_block = (lambda helper: lambda h: helper(h))(closure)  # a block calling a helper: the helper's too
for name, module, shape in (("trivial", Trivial(), (4,)), ("3-module block", Block(), (4, 16)),
                            ("lambda h: block(h)", closure, (4, 16)), ("lambda h: helper(h)", helper_block, (4, 16))):
    x = torch.randn(*shape, requires_grad=True)
    for reentrant in (False, True):
        call = lambda: checkpoint(module, x, use_reentrant=reentrant)
        batch(call)  # warm-up
        added = []
        for round_ in range(9):  # raw and guarded back to back, order swapped every other round
            times = {}
            for guarded in ((False, True) if round_ % 2 == 0 else (True, False)):
                if guarded:
                    ckpt_guard.install("strict")
                times[guarded] = batch(call)
                ckpt_guard.uninstall()
            added.append(times[True] - times[False])
        results[f"{name}, use_reentrant={reentrant}"] = statistics.median(added)
print(json.dumps(results))
"""


def _measure(tree: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, tree], check=True, capture_output=True, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("CKPT_GUARD")},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the git revision to compare this working tree against")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        before_tree = os.path.join(scratch, "before")
        subprocess.run(
            ["git", "-C", REPO_ROOT, "worktree", "add", "--detach", "--quiet", before_tree, args.revision],
            check=True,
        )
        try:
            before: list = []
            after: list = []
            for round_ in range(args.rounds):
                pair = [(before, before_tree), (after, REPO_ROOT)]
                for sink, tree in pair if round_ % 2 == 0 else pair[::-1]:
                    sink.append(_measure(tree))
        finally:
            subprocess.run(["git", "-C", REPO_ROOT, "worktree", "remove", "--force", before_tree], check=False)
    print(f"µs the guard adds per checkpoint call (forward only), medians over {args.rounds} rounds")
    print(f"before = {args.revision}, after = this working tree; the IQR of each is in brackets\n")
    print("| case | before µs | after µs | after / before |")
    print("|---|---:|---:|---:|")
    for case in before[0]:
        b = [r[case] for r in before]
        a = [r[case] for r in after]
        qb, qa = statistics.quantiles(b, n=4), statistics.quantiles(a, n=4)
        mb, ma = statistics.median(b), statistics.median(a)
        print(
            f"| {case} | {mb:.1f} [{qb[0]:.1f}–{qb[2]:.1f}] | {ma:.1f} [{qa[0]:.1f}–{qa[2]:.1f}] "
            f"| {ma / mb if mb > 0 else float('nan'):.2f}x |"
        )


if __name__ == "__main__":
    main()
