"""Peak memory of checkpointing under torch.func: no checkpoint / ckpt_guard fallback / eager.

    python benchmarks/memory.py                  # the full table (a few minutes on 2 CPU cores)
    python benchmarks/memory.py --size quick     # small sizes: a smoke run (too small to show a saving)

Each variant runs in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536`` so that
glibc gives freed blocks back and RSS tells the truth).  After the set-up
(model, data, ``import torch``) the process resets its peak RSS
(``/proc/self/clear_refs``) after one warm-up step, runs the step once more and
reports its peak RSS above the set-up and its time.  Variants:

* ``no checkpoint``: the model without checkpointing, under the transform;
* ``fallback``: the model with ``checkpoint(block, h, use_reentrant=False)`` in
  its forward, under the transform, with ``ckpt_guard.install("fallback")``
  (which runs each block as the composable recompute);
* ``eager checkpoint``: the same checkpointed model trained eagerly on the
  same batch (``loss.backward()``): the physical reference of what
  checkpointing saves.  Under ``vmap(grad)`` it computes one batch gradient,
  not per-sample ones, so it shows the activation saving alone, without the
  per-sample gradients that the other two variants hold.

Workloads: ``grad`` and ``vmap(grad)`` (per-sample gradients) of a deep MLP
through ``functional_call``, and ``vmap(grad)`` of a small random-weight
Hugging Face GPT-2 with gradient checkpointing enabled (skipped without
transformers).  Targets: fallback under grad at most 0.3x the no-checkpoint
peak and at most 1.3x its time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------
# the child: one variant, one process


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


#: (width, blocks, Linear layers per block, batch): grad, then vmap(grad) (samples of 32 rows)
MLP_SIZES = {
    "quick": ((128, 4, 2, 512), (128, 4, 2, 8)),
    "medium": ((512, 4, 2, 2048), (256, 4, 2, 16)),
    "full": ((512, 8, 4, 8192), (256, 4, 2, 64)),
}
#: (layers, width, batch, tokens)
GPT2_SIZES = {"quick": (2, 64, 2, 32), "medium": (4, 128, 4, 64), "full": (6, 256, 8, 128)}


def _mlp_setup(size: str, per_sample: bool):
    import torch
    from torch.utils.checkpoint import checkpoint

    width, depth, layers, batch = MLP_SIZES[size][per_sample]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
                for _ in range(depth)
            )
            self.checkpointing = True

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    net = Net()
    data = torch.randn(batch, 32, width) if per_sample else torch.randn(batch, width)
    return net, data


def _gpt2_setup(size: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    layers, width, batch, tokens = GPT2_SIZES[size]
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=1000, n_positions=tokens,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()
    return model, torch.randint(0, 1000, (batch, tokens))


def child(workload: str, variant: str, size: str) -> dict:
    import gc

    import torch
    from torch.func import functional_call, grad, vmap

    import ckpt_guard

    torch.set_num_threads(1)
    if workload == "gpt2 vmap(grad)":
        model, data = _gpt2_setup(size)
        if variant == "no checkpoint":
            model.gradient_checkpointing_disable()

        def loss(params, sample):
            batch = sample.unsqueeze(0)
            return functional_call(model, params, (batch,), {"labels": batch}).loss
    else:
        model, data = _mlp_setup(size, per_sample=workload == "mlp vmap(grad)")
        model.checkpointing = variant != "no checkpoint"

        def loss(params, x):
            return functional_call(model, params, (x.unsqueeze(0) if workload == "mlp vmap(grad)" else x,))

    params = {k: v.detach() for k, v in model.named_parameters()}
    if variant == "fallback":
        ckpt_guard.install("fallback")

    def step():
        if variant == "eager checkpoint":
            model.zero_grad(set_to_none=True)
            if workload == "gpt2 vmap(grad)":
                model(data, labels=data).loss.backward()
            else:
                model(data).backward()  # the whole batch at once: the activation saving alone
            return None
        if workload == "mlp grad":
            return grad(loss)(params, data)
        return vmap(grad(loss), in_dims=(None, 0))(params, data)

    import warnings

    warnings.simplefilter("ignore")
    step()  # a warm-up: lazy imports and caches belong to the set-up, not to the step
    gc.collect()
    baseline = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak RSS to the current RSS
    started = time.perf_counter()
    result = step()
    seconds = time.perf_counter() - started
    peak = _rss_kib("VmHWM")
    del result
    return {"peak_mb": (peak - baseline) / 1024, "seconds": seconds}


# --------------------------------------------------------------------------
# the parent: every variant in its own process, then the table


VARIANTS = ("no checkpoint", "fallback", "eager checkpoint")


def measure(workload: str, variant: str, size: str) -> dict:
    """One variant in a fresh process: ``{"peak_mb": ..., "seconds": ...}``."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    env.pop("CKPT_GUARD_POLICY", None)
    env.pop("CKPT_GUARD_RULES", None)
    proc = subprocess.run(
        [sys.executable, HERE, "--child", workload, variant, "--size", size],
        capture_output=True, text=True, env=env, timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{workload} / {variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(MLP_SIZES), default="full", help="model and batch sizes")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, size=args.size)))
        return 0

    import platform

    import torch

    workloads = ["mlp grad", "mlp vmap(grad)"]
    try:
        import transformers  # noqa: F401

        workloads.append("gpt2 vmap(grad)")
    except ImportError:
        print("(transformers not installed: the GPT-2 workload is skipped)")
    results = {w: {v: measure(w, v, args.size) for v in VARIANTS} for w in workloads}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"torch {torch.__version__}, Python {platform.python_version()}, 1 thread, {args.size} sizes\n")
    print("| workload | variant | peak MB above set-up | vs no checkpoint | time s | vs no checkpoint |")
    print("|---|---|---:|---:|---:|---:|")
    verdicts = []
    for workload, by_variant in results.items():
        base = by_variant["no checkpoint"]
        for variant, r in by_variant.items():
            print(f"| {workload} | {variant} | {r['peak_mb']:.0f} | {r['peak_mb'] / base['peak_mb']:.2f}x | "
                  f"{r['seconds']:.2f} | {r['seconds'] / base['seconds']:.2f}x |")
        fb, eager = by_variant["fallback"], by_variant["eager checkpoint"]
        memory_ratio, time_ratio = fb["peak_mb"] / base["peak_mb"], fb["seconds"] / base["seconds"]
        line = f"{workload}: fallback peak {memory_ratio:.2f}x no-checkpoint, time {time_ratio:.2f}x"
        if workload == "mlp grad":  # the targets are set for grad; under vmap(grad) per-sample gradients dominate
            line = (
                f"{workload}: fallback peak {memory_ratio:.2f}x no-checkpoint (target <= 0.3x: "
                f"{'met' if memory_ratio <= 0.3 else 'missed'}), time {time_ratio:.2f}x (target <= 1.3x: "
                f"{'met' if time_ratio <= 1.3 else 'missed'}; eager checkpointing: "
                f"{eager['seconds'] / base['seconds']:.2f}x)"
            )
        verdicts.append(line)
    print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
