"""What the composable recompute's run-time proof costs, per checkpointed block under a transform.

    python benchmarks/proof.py            # full run (about a minute on 2 CPU cores)
    python benchmarks/proof.py --quick    # smoke run

One process, one thread.  Each round times a batch of ``grad`` steps through
``ckpt_guard.checkpoint`` with the proof (as it always runs) and a batch with
it switched off (``_composable.counters.PROOF = False``, a switch for this measurement
only), in alternating order, and prints per-block medians, the median of the
per-round ratios with its interquartile range, and the µs the proof adds per
checkpointed block.  Outside transforms ``ckpt_guard.checkpoint`` is torch's own
checkpoint and the proof never runs: it costs nothing there.

This is a report, not a test: it exits 0 whatever the numbers are.
"""

from __future__ import annotations

import argparse
import statistics
import time


def build_cases(torch):
    torch.manual_seed(0)
    tiny = torch.nn.Linear(8, 8)
    mlp = torch.nn.Sequential(*[m for _ in range(2) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())])
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    return [
        ("Linear 8x8, 4 rows", tiny, torch.randn(4, 8), 4),
        ("MLP block 2x Linear(256), 256 rows", mlp, torch.randn(256, 256), 4),
        ("Transformer layer d=256, 4x64 tokens", layer, torch.randn(4, 64, 256), 2),
    ]


def make_step(torch, ckpt_guard, module, x, blocks):
    """``grad`` over ``functional_call`` of a model that checkpoints ``blocks`` copies of ``module`` (torch.func's idiom)."""
    from torch.func import functional_call, grad

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(module for _ in range(blocks))  # one module, shared

        def forward(self, t):
            for block in self.blocks:
                t = ckpt_guard.checkpoint(block, t)
            return t.pow(2).mean()

    model = Model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    return lambda: grad(lambda p: functional_call(model, p, (x,)))(params)


def timed(step, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    import torch

    import ckpt_guard
    from ckpt_guard import _composable

    torch.set_num_threads(1)
    rounds, iters = (2, 3) if args.quick else (15, 20)
    print(f"torch {torch.__version__}, {rounds} rounds x {iters} grad steps, one thread")
    print()
    print("| block | blocks per step | with proof µs/block | without µs/block | ratio | ratio IQR | added µs/block |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, module, x, blocks in build_cases(torch):
        step = make_step(torch, ckpt_guard, module, x, blocks)
        step()  # warm-up
        with_proof, without, ratios = [], [], []
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            times = {}
            for proof in order:
                _composable.counters.PROOF = proof
                times[proof] = timed(step, iters) / (iters * blocks) * 1e6
            _composable.counters.PROOF = True
            with_proof.append(times[True])
            without.append(times[False])
            ratios.append(times[True] / times[False])
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        a, b = statistics.median(with_proof), statistics.median(without)
        print(f"| {name} | {blocks} | {a:.1f} | {b:.1f} | {statistics.median(ratios):.3f}x | {q[0]:.3f}–{q[2]:.3f} | {a - b:+.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
