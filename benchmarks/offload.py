"""Activation offload with checkpointing under ``vmap(grad)``, side by side (issue 48, item 1).

    python benchmarks/offload.py                 # medium sizes, about a minute on 2 cores
    python benchmarks/offload.py --size full

Per-sample gradients of an MLP (``benchmarks/memory.py``'s ``mlp vmap(grad)``), each variant in
a fresh process, peak RSS above the set-up as ``benchmarks/memory.py`` measures it:

* ``no checkpoint``, ``ckpt_guard.checkpoint``;
* ``save_on_cpu``, ``save_on_cpu + ckpt_guard.checkpoint``, ``save_on_cpu + torch checkpoint``
  (non-reentrant, which the patched torch runs): ``torch.autograd.graph.save_on_cpu``
  around the step, on a torch patched as JetBrains' opaque patches it (``tests/patched_torch.py``;
  stock torch refuses saved-tensor hooks under ``grad``, with or without checkpointing);
* ``offload_dots``: ``ckpt_guard.checkpoint`` with the ``offload_dots`` save policy, what works
  under a transform on the stock torch (torch 2.5+).

On a machine without a GPU ``save_on_cpu`` moves tensors to where they are: what it saves is
not measured here (a GPU run is).  What this measures: combined with offload, checkpointing
keeps its saving, and the patched torch's program stays right (the suite checks the values).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(ROOT, "tests")]

import memory  # noqa: E402 - benchmarks/memory.py: its model, sizes and measurement

VARIANTS = ("no checkpoint", "ckpt_guard.checkpoint", "save_on_cpu", "save_on_cpu + ckpt_guard.checkpoint",
            "save_on_cpu + torch checkpoint", "offload_dots")


def child(variant: str, size: str) -> dict:
    import contextlib
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    patches = contextlib.ExitStack()
    step = _per_sample(torch, size, _checkpoint_for(variant))
    if variant.startswith("save_on_cpu"):
        from patched_torch import opaque_patches

        patches.enter_context(opaque_patches())
        plain = step
        step = lambda: _offloaded(torch, plain)  # noqa: E731
    with patches:
        return memory.peak_of(step)


def _checkpoint_for(variant: str):
    """``ckpt(block, h)`` for a variant: memory.py's, or ``ckpt_guard.checkpoint`` with ``offload_dots``."""
    if variant == "offload_dots":
        import ckpt_guard
        from ckpt_guard import checkpoint_policies as cp

        policy = cp.context_fn(cp.offload_dots)
        return lambda block, *args: ckpt_guard.checkpoint(block, *args, context_fn=policy)
    if variant.endswith("ckpt_guard.checkpoint"):
        return memory._ckpt_for("ckpt_guard.checkpoint")
    if variant.endswith("torch checkpoint"):  # torch's non-reentrant checkpoint, which the patched torch runs
        return memory._ckpt_for("eager checkpoint")
    return memory._ckpt_for("no checkpoint")


def _per_sample(torch, size, ckpt):
    """memory.py's per-sample MLP under ``vmap(grad)``, its blocks through ``ckpt``."""
    from torch.func import functional_call, grad, vmap

    width, depth, layers, samples, rows = memory.PER_SAMPLE_MLP[size]
    net = memory._mlp(torch, width, depth, layers, ckpt)
    data = torch.randn(samples, rows, width)
    params = {k: v.detach() for k, v in net.named_parameters()}
    loss = lambda p, x: functional_call(net, p, (x[None],)).pow(2).mean()  # noqa: E731
    return lambda: vmap(grad(loss), in_dims=(None, 0))(params, data)


def _offloaded(torch, step):
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        return step()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(memory.MLP), default="medium")
    parser.add_argument("--child", nargs=2, metavar=("UNUSED", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import json

        print(json.dumps(child(args.child[1], args.size)))
        return 0
    import platform

    import torch
    import torch.utils.checkpoint  # torch 2.4's `import torch` does not import it

    print(f"torch {torch.__version__}, Python {platform.python_version()}, 1 thread, {args.size} sizes, "
          "per-sample gradients of an MLP (vmap(grad))\n")
    print("| variant | peak MB above set-up | vs no checkpoint | time s |")
    print("|---|---:|---:|---:|")
    results = {}
    for variant in VARIANTS:
        if variant == "offload_dots" and not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
            continue
        try:
            results[variant] = memory.in_fresh_process(HERE, "unused", variant, args.size)
        except RuntimeError as exc:  # torch 2.4: its vmap refuses saved-tensor hooks, patched or not
            if "saved tensor hooks" not in str(exc):
                raise
            results[variant] = None
    base = results["no checkpoint"]["peak_mb"]
    for variant, r in results.items():
        if r is None:
            print(f"| {variant} | refused by this torch (saved tensor hooks under vmap) | | |")
        else:
            print(f"| {variant} | {r['peak_mb']:.0f} | {r['peak_mb'] / base:.2f}x | {r['seconds']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
