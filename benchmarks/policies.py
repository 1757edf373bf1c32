"""Peak memory and time of save policies (selective checkpointing) on a small transformer, under torch.func.

    python benchmarks/policies.py --size quick                 # well under a minute on 2 cores
    python benchmarks/policies.py --size medium                # a few minutes
    python benchmarks/policies.py --size medium --plot docs/policies.png   # and the plot (needs matplotlib)

The model: a stack of pre-LayerNorm encoder blocks written by hand, each
``h + attn(LN(h))`` then ``h + mlp(LN(h))``: q, k, v ``Linear``, attention as
explicit batched matmuls (``softmax(q @ k^T / sqrt(d_head)) @ v``, which reach
the dispatcher as ``bmm``; no ``scaled_dot_product_attention``), an output
``Linear``; the MLP ``Linear(d, 4d)``, GELU, ``Linear(4d, d)``.  Every block is
called as ``ckpt(block, h)``; the loss is ``mean(out^2)`` through
``functional_call``.  Two values are named with ``ckpt_guard.checkpoint_name``:

* ``"attn_out"``: the attention's output, after the output ``Linear`` (before
  the residual add);
* ``"mlp_hidden"``: the MLP's hidden, the output of ``Linear(d, 4d)`` *before*
  GELU.  Named after GELU it would save little: GELU's backward needs its input,
  so the recompute would run ``Linear(d, 4d)`` (the block's largest matmul) anyway.

Variants (``ckpt`` per block):

* ``no checkpoint``: ``block(h)``;
* ``save nothing``: ``ckpt_guard.checkpoint(block, h)`` (recompute everything);
* ``save matmuls``: ``context_fn=cp.context_fn(cp.dots_saveable)`` (``mm``,
  ``addmm``, ``bmm``, ... kept, the rest recomputed);
* ``save named``: ``context_fn=cp.context_fn(cp.save_only_these_names("attn_out",
  "mlp_hidden"))``: the two named values kept (per block one ``(B, S, d)`` and one
  ``(B, S, 4d)`` tensor), the rest recomputed.

Workloads: ``grad`` (the loss over a batch), ``vmap(grad)`` (per-sample
gradients, ``in_dims=(None, 0)``), ``jvp(grad)`` (a Hessian-vector product,
``jvp(lambda p: grad(loss)(p, x), (p,), (v,))``; under forward mode a saved call
is handed back only where its arguments' fingerprint matches, which costs time:
``ckpt_guard/_composable/saving.py``).  Under ``vmap`` a ``Linear`` runs as
``mm`` + bias ``add``: a name there keeps the ``mm``'s output (the ``add`` is
recomputed from it), as ``addmm``'s under ``grad``.

Peaks as in ``benchmarks/memory.py``: each variant in a fresh process, one
thread, ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc gives freed blocks back, RSS
tells the truth); after the set-up and one warm-up step the peak RSS is reset
(``/proc/self/clear_refs``), the step runs once more, and the peak RSS above the
set-up is reported.  These processes run after every time is taken, ``--jobs``
at a time (a process's peak RSS is its own).  Times: in this process, one
thread, per workload the variants taking turns step by step (``--repeat``
rounds after a warm-up), the fastest step of each, as a ratio of ``no
checkpoint``'s (the machine's drift cancels).  The warm-up's results are
compared: every variant's must equal ``no checkpoint``'s
(``torch.testing.assert_close``), else "results equal: NO" and exit status 1.

This is a report, not a test: it exits 0 whatever the numbers are.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import sys
import time
import warnings

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
import memory  # noqa: E402 - beside this script: its peak measurement and fresh-process runner

#: per size: (d_model, heads, blocks, sequence, batch for grad, batch for vmap(grad), batch for jvp(grad))
SIZES = {"quick": (64, 2, 2, 32, 8, 4, 4), "medium": (256, 4, 4, 128, 16, 8, 8)}
VARIANTS = ("no checkpoint", "save nothing", "save matmuls", "save named")
WORKLOADS = ("grad", "vmap(grad)", "jvp(grad)")
NAMES = ("attn_out", "mlp_hidden")


def _ckpt_for(variant: str):
    """``ckpt(block, h)`` for a variant."""
    import ckpt_guard
    from ckpt_guard import checkpoint_policies as cp

    if variant == "no checkpoint":
        return lambda block, h: block(h)
    if variant == "save nothing":
        return ckpt_guard.checkpoint
    policy = cp.dots_saveable if variant == "save matmuls" else cp.save_only_these_names(*NAMES)
    context_fn = cp.context_fn(policy)
    return lambda block, h: ckpt_guard.checkpoint(block, h, context_fn=context_fn)


def _model(torch, d: int, heads: int, depth: int, ckpt):
    import ckpt_guard

    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h):
            b, s, _ = h.shape
            x = self.ln1(h)
            q, k, v = (m(x).view(b, s, heads, d // heads).transpose(1, 2) for m in (self.q, self.k, self.v))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // heads)  # bmm
            context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)  # bmm
            attn = ckpt_guard.checkpoint_name(self.o(context), "attn_out")
            h = h + attn
            hidden = ckpt_guard.checkpoint_name(self.fc1(self.ln2(h)), "mlp_hidden")
            return h + self.fc2(torch.nn.functional.gelu(hidden))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))

        def forward(self, h):
            for block in self.blocks:
                h = ckpt(block, h)
            return h

    torch.manual_seed(0)
    return Model()


def setup(torch, size: str, workload: str, variant: str):
    """The step (a function of nothing) of one workload and variant; same weights and data for every variant."""
    from torch.func import functional_call, grad, jvp, vmap

    d, heads, depth, seq, b_grad, b_vmap, b_jvp = SIZES[size]
    net = _model(torch, d, heads, depth, _ckpt_for(variant))
    params = {k: v.detach() for k, v in net.named_parameters()}
    batch = {"grad": b_grad, "vmap(grad)": b_vmap, "jvp(grad)": b_jvp, ".backward()": b_grad}[workload]
    gen = torch.Generator().manual_seed(1)
    data = torch.randn(batch, seq, d, generator=gen)
    if workload == ".backward()":  # no transform: torch's own checkpoint (memory.py --compile's anchor)
        leaves = list(net.parameters())
        return lambda: torch.autograd.grad(net(data).pow(2).mean(), leaves)

    def loss(p, x):
        return functional_call(net, p, (x,)).pow(2).mean()

    if workload == "grad":
        return lambda: grad(loss)(params, data)
    if workload == "vmap(grad)":
        return lambda: vmap(grad(lambda p, x: loss(p, x[None])), in_dims=(None, 0))(params, data)
    direction = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    return lambda: jvp(lambda p: grad(loss)(p, data), (params,), (direction,))


def child(workload: str, variant: str, size: str) -> dict:
    """One variant in this (fresh) process: peak RSS above the set-up of one step (``memory.peak_of``)."""
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    return memory.peak_of(setup(torch, size, workload, variant))


def measure(workload: str, variant: str, size: str) -> float:
    return memory.in_fresh_process(HERE, workload, variant, size)["peak_mb"]


def side_by_side(workload: str, size: str, repeat: int):
    """Fastest of ``repeat`` steps per variant, taking turns; checks each result against no checkpoint's."""
    import gc

    import torch

    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = {v: setup(torch, size, workload, v) for v in VARIANTS}
        results = {v: step() for v, step in steps.items()}  # the warm-up, and the results compared
    for variant in VARIANTS[1:]:
        try:
            torch.testing.assert_close(results[variant], results["no checkpoint"])
        except AssertionError as error:
            raise AssertionError(f"{workload}: '{variant}' differs from 'no checkpoint':\n{error}") from None
    del results
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeat):
        for variant, step in steps.items():
            gc.collect()
            started = time.perf_counter()
            result = step()
            best[variant] = min(best[variant], time.perf_counter() - started)
            del result
    notes = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught
                    if not issubclass(w.category, DeprecationWarning)})  # torch's own, from its imports
    return best, notes


def plot(rows: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("--plot needs matplotlib, which ckpt_guard does not depend on: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.8), squeeze=False)
    for ax, (workload, by_variant) in zip(axes[0], rows.items()):
        base = by_variant["no checkpoint"]["peak_mb"]
        for variant, r in by_variant.items():
            x, y = r["time_ratio"], r["peak_mb"] / base
            ax.plot(x, y, "o")
            ax.annotate(variant, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_title(f"{workload} (no checkpoint: {base:.0f} MB)", fontsize=10)
        ax.set_xlabel("time (x no checkpoint)")
        ax.set_ylabel("peak memory (x no checkpoint)")
        ax.margins(0.25)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="quick", help="model and batch sizes")
    parser.add_argument("--only", default="", help="run only the workloads whose name contains this")
    parser.add_argument("--repeat", type=int, default=5, help="rounds of timed steps (the fastest counts)")
    parser.add_argument("--plot", metavar="PNG", help="write a memory-vs-time plot (needs matplotlib)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="peak-measuring processes at a time, after the times (default 2)")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, size=args.size)))
        return 0
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit("--plot needs matplotlib, which ckpt_guard does not depend on: pip install matplotlib")

    import platform

    import torch

    d, heads, depth, seq, b_grad, b_vmap, b_jvp = SIZES[args.size]
    print(f"torch {torch.__version__}, Python {platform.python_version()}, 1 thread, {args.size} sizes: "
          f"{depth} blocks, d={d}, {heads} heads, sequence {seq}; batch {b_grad} (grad), {b_vmap} (vmap(grad)), "
          f"{b_jvp} (jvp(grad)); save named = {', '.join(NAMES)}; times: fastest of {args.repeat}, side by side\n")
    rows, failed, timed = {}, False, {}
    for workload in (w for w in WORKLOADS if args.only in w):  # first the times, nothing else running
        try:
            timed[workload] = side_by_side(workload, args.size, args.repeat)
        except AssertionError as error:
            print(f"### {workload}\n\nresults equal: NO\n{error}\n", flush=True)
            failed = True
    # then the peaks, each in its own process (a process's peak RSS is its own: they may run side by side)
    pairs = [(w, v) for w in timed for v in VARIANTS]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        peaks = dict(zip(pairs, pool.map(lambda pair: measure(*pair, args.size), pairs)))
    for workload, (best, notes) in timed.items():
        base_peak, base_time = peaks[workload, "no checkpoint"], best["no checkpoint"]
        rows[workload] = {v: {"peak_mb": peaks[workload, v], "time_ratio": best[v] / base_time} for v in VARIANTS}
        print(f"### {workload}\n\nresults equal: yes\n")
        print("| variant | peak MB | peak vs no checkpoint | time s | time vs no checkpoint |")
        print("|---|---:|---:|---:|---:|")
        for v in VARIANTS:
            print(f"| {v} | {peaks[workload, v]:.0f} | {peaks[workload, v] / base_peak:.2f}x | {best[v]:.3f} | "
                  f"{best[v] / base_time:.2f}x |")
        for note in notes:
            print(f"\nwarning seen: {note}")
        print(flush=True)
    if args.plot and rows:
        plot(rows, args.plot)
    if failed:
        print("results differ: see above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
