"""What checkpointing adds per block and per step: the composable recompute against torch's eager checkpoint.

    python benchmarks/blocks.py             # about a minute on 2 CPU cores
    python benchmarks/blocks.py --quick     # smoke run
    python benchmarks/blocks.py --profile   # cProfile of the tiny grad step (what the time goes to)
    python benchmarks/blocks.py --rows 1024 # the residual small blocks with 1024 rows, grad only
    python benchmarks/blocks.py --compiled  # each block torch.compile'd (inductor; --backend to change)

One process, one thread.  Four steps per model, taking turns (the machine's
drift cancels), the fastest of ``--repeat`` rounds each:

* ``eager``: ``loss.backward()`` of the model, blocks called plainly;
* ``eager checkpoint``: the same with torch's ``checkpoint(block, h,
  use_reentrant=False)`` per block (guard not installed): the reference for what
  checkpointing costs;
* ``grad`` / ``vmap(grad)``: ``torch.func.grad`` (per-sample: ``vmap(grad)``) of
  ``functional_call`` of the model, blocks called plainly, and through
  ``ckpt_guard.checkpoint``;
* ``save matmuls`` (torch 2.5+): the same through ``ckpt_guard.checkpoint`` with a
  save policy keeping the matmuls (``docs/save-policies.md``).

Printed per model: each step's time, the time checkpointing adds per block
(``ckpt_guard.checkpoint`` under a transform, torch's eager checkpoint
outside), their ratio (the target: at most 2x), and each checkpointed step's
time as a ratio of its uncheckpointed one.  The tiny model (8 x ``Linear(8, 8)``,
4 rows) makes the ops nearly free, so what is added is fixed cost; the
residual models are the README's (2 x ``Linear(256)`` + tanh per block) at the
sizes of ``benchmarks/memory.py``.

``--compiled`` (issue 47, item 3): every block ``torch.compile``'d on its own, the
residual small model, the same steps side by side with the eager blocks'.  Under a
``.backward()`` step the compiled code runs (plainly, and inside torch's checkpoint);
under an eager ``grad`` torch itself runs a compiled function's code eagerly
("Calling torch.func.grad(compiled_fn) function from eager mode is not supported",
pytorch#128711), checkpointed or not, so there the compiled blocks cost what the eager
ones do, and ``ckpt_guard.checkpoint`` adds what it adds to eager blocks.  The lines
printed say both, measured.

This is a report, not a test: it exits 0 whatever the numbers are.
"""

from __future__ import annotations

import argparse
import time


def build(torch, width, depth, rows, residual):
    torch.manual_seed(0)
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(width, width)
            self.b = nn.Linear(width, width) if residual else None

        def forward(self, h):
            if self.b is None:
                return torch.tanh(self.a(h))
            return h + self.b(torch.tanh(self.a(h)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.ckpt = None

        def forward(self, h):
            for block in self.blocks:
                h = block(h) if self.ckpt is None else self.ckpt(block, h)
            return h.pow(2).mean()

    return Model(), torch.randn(rows, width)


def steps(torch, model, x, per_sample=True):
    import ckpt_guard
    from torch.func import functional_call, grad, vmap
    from torch.utils.checkpoint import checkpoint

    params = {k: v.detach() for k, v in model.named_parameters()}
    eager_ckpt = lambda block, h: checkpoint(block, h, use_reentrant=False)  # noqa: E731

    def eager(ckpt):
        def step():
            model.ckpt = ckpt
            model.zero_grad(set_to_none=True)
            model(x).backward()
        return step

    def transformed(ckpt, per_sample):
        def loss(p, data):
            model.ckpt = ckpt
            return functional_call(model, p, (data,))

        if per_sample:
            g = vmap(grad(lambda p, sample: loss(p, sample[None])), in_dims=(None, 0))
        else:
            g = grad(loss)
        return lambda: g(params, x)

    found = {
        "eager": eager(None),
        "eager checkpoint": eager(eager_ckpt),
        "grad": transformed(None, False),
        "grad, ckpt_guard.checkpoint": transformed(ckpt_guard.checkpoint, False),
    }
    if per_sample:
        found["vmap(grad)"] = transformed(None, True)
        found["vmap(grad), ckpt_guard.checkpoint"] = transformed(ckpt_guard.checkpoint, True)
    context_fn = save_matmuls_context(torch)
    if context_fn is not None:  # a save policy (issue 31): matmuls kept, the rest recomputed
        saving = lambda block, h: ckpt_guard.checkpoint(block, h, context_fn=context_fn)  # noqa: E731
        found["grad, save matmuls"] = transformed(saving, False)
        if per_sample:
            found["vmap(grad), save matmuls"] = transformed(saving, True)
    return found


def save_matmuls_context(torch):
    """torch's selective checkpointing ``context_fn`` saving matmuls (JAX's dots_saveable), or None before 2.5."""
    import functools

    import torch.utils.checkpoint as tuc

    if not hasattr(tuc, "create_selective_checkpoint_contexts"):
        return None
    aten = torch.ops.aten
    return functools.partial(tuc.create_selective_checkpoint_contexts, [aten.mm.default, aten.addmm.default])


def measure(torch, model, x, repeat, inner, per_sample=True):
    runs = steps(torch, model, x, per_sample)
    for step in runs.values():
        step()  # warm-up
    best = {name: float("inf") for name in runs}
    for _ in range(repeat):
        for name, step in runs.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
            best[name] = min(best[name], (time.perf_counter() - t0) / inner)
    return best


def compiled_steps(torch, model, x, backend):
    """The eager and grad steps with eager blocks, and the same with each block ``torch.compile``'d
    (a separate compiled module per block: the blocks keep their own parameters)."""
    import ckpt_guard
    from torch.func import grad
    from torch.utils.checkpoint import checkpoint

    params = {k: v.detach() for k, v in model.named_parameters()}
    eager_blocks = list(model.blocks)
    compiled_blocks = [torch.compile(block, backend=backend) for block in eager_blocks]
    eager_ckpt = lambda block, h: checkpoint(block, h, use_reentrant=False)  # noqa: E731

    def run(blocks, ckpt, h):
        for block in blocks:
            h = block(h) if ckpt is None else ckpt(block, h)
        return h.pow(2).mean()

    def eager(blocks, ckpt):
        def step():
            model.zero_grad(set_to_none=True)
            run(blocks, ckpt, x).backward()
        return step

    def under_grad(blocks, ckpt):
        def loss(p):
            with torch.nn.utils.stateless._reparametrize_module(model, p):  # functional_call's swap, kept
                return run(blocks, ckpt, x)
        g = grad(loss)
        return lambda: g(params)

    found = {}
    for label, blocks in (("eager blocks", eager_blocks), ("compiled blocks", compiled_blocks)):
        found[f"eager, {label}"] = eager(blocks, None)
        found[f"eager checkpoint, {label}"] = eager(blocks, eager_ckpt)
        found[f"grad, {label}"] = under_grad(blocks, None)
        if blocks is eager_blocks or compiled_blocks_run(torch):
            found[f"grad, {label}, ckpt_guard.checkpoint"] = under_grad(blocks, ckpt_guard.checkpoint)
    return found


def compiled_blocks_run(torch) -> bool:
    """torch >= 2.6: ckpt_guard.checkpoint runs a compiled block under a transform (eagerly, on its
    thread); before, it refuses one (class ``compiled``: no stance to run it eagerly with)."""
    return hasattr(torch.compiler, "set_stance")


def report_compiled(torch, repeat, backend, quick):
    """``--compiled``: the residual small model, eager blocks against compiled ones, side by side."""
    from torch._dynamo.utils import counters

    name, spec = next((n, s) for n, s in MODELS.items() if "small" in n)
    if quick:
        spec = {**spec, "depth": 2, "rows": 16}
        name = f"residual: 2 x 2 x Linear({spec['width']}), 16 rows"
    model, x = build(torch, **spec)
    runs = compiled_steps(torch, model, x, backend)
    started = time.perf_counter()
    gradients = {step: run() for step, run in runs.items()}  # warm-up: the compiles happen here
    compiling = time.perf_counter() - started
    reference = gradients["grad, eager blocks"]
    equal = all(
        torch.allclose(got[k], reference[k], rtol=1e-4, atol=1e-6) for step, got in gradients.items()
        if step.startswith("grad") for k in reference
    )
    best = {step: float("inf") for step in runs}
    for _ in range(repeat):
        for step, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(5):
                run()
            best[step] = min(best[step], (time.perf_counter() - t0) / 5)
    depth = spec["depth"]
    refused = sum(v for k, v in counters["unimplemented"].items() if "torch.func.grad(compiled_fn)" in k)
    print(f"\n{name}, each block torch.compile'd (backend {backend!r}; warm-up and compiles {compiling:.0f} s)")
    for step, seconds in best.items():
        print(f"  {step:48} {seconds * 1e3:9.3f} ms")
    for label in ("eager blocks", "compiled blocks"):
        eager_added = (best[f"eager checkpoint, {label}"] - best[f"eager, {label}"]) / depth
        checkpointed = best.get(f"grad, {label}, ckpt_guard.checkpoint")
        added = "refused (class compiled: torch < 2.6)" if checkpointed is None else (
            f"{(checkpointed - best[f'grad, {label}']) / depth * 1e6:8.1f} µs"
        )
        print(f"  {label:15}: torch's eager checkpoint adds {eager_added * 1e6:8.1f} µs per block, "
              f"ckpt_guard.checkpoint under grad {added}")
    compiled_checkpointed = best.get("grad, compiled blocks, ckpt_guard.checkpoint")
    print(f"  compiling the blocks: the .backward() step {best['eager, compiled blocks'] / best['eager, eager blocks']:.2f}x, "
          f"the grad step {best['grad, compiled blocks'] / best['grad, eager blocks']:.2f}x"
          + ("" if compiled_checkpointed is None else
             f", the checkpointed grad step {compiled_checkpointed / best['grad, eager blocks, ckpt_guard.checkpoint']:.2f}x")
          + " of the same with eager blocks")
    print(f"  gradients equal across the grad steps: {'yes' if equal else 'NO'}")
    print(f"  under grad, dynamo declined the compiled blocks {refused} time(s): 'Calling torch.func.grad(compiled_fn) "
          "from eager mode is not supported' (pytorch#128711), checkpointed or not")


MODELS = {
    "tiny: 8 x Linear(8, 8), 4 rows": dict(width=8, depth=8, rows=4, residual=False),
    "residual, small: 6 x 2 x Linear(256), 64 rows": dict(width=256, depth=6, rows=64, residual=True),
    "residual, medium: 8 x 2 x Linear(512), 256 rows": dict(width=512, depth=8, rows=256, residual=True),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="tottime", help="with --profile: the pstats sort key")
    parser.add_argument(
        "--rows", type=int, help="only the residual small blocks, with this many rows, under grad (where a save "
        "policy's saving grows with the matmuls; per-sample gradients of every row would take gigabytes)",
    )
    parser.add_argument("--compiled", action="store_true", help="each block torch.compile'd, against eager blocks")
    parser.add_argument("--backend", default="inductor", help="with --compiled: torch.compile's backend")
    args = parser.parse_args()
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if args.profile:
        import cProfile
        import pstats

        model, x = build(torch, **MODELS["tiny: 8 x Linear(8, 8), 4 rows"])
        step = steps(torch, model, x)["grad, ckpt_guard.checkpoint"]
        step()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            step()
        profile.disable()
        pstats.Stats(profile).sort_stats(args.sort).print_stats(40)
        return 0
    repeat = 3 if args.quick else args.repeat
    print(f"torch {torch.__version__}, one thread, fastest of {repeat} rounds, steps taking turns")
    if args.compiled:
        report_compiled(torch, repeat, args.backend, args.quick)
        return 0
    models = MODELS
    if args.rows is not None:
        small = next(spec for name, spec in MODELS.items() if "small" in name)
        models = {f"residual: {small['depth']} x 2 x Linear({small['width']}), {args.rows} rows": {**small, "rows": args.rows}}
    for name, spec in models.items():
        if args.quick and "medium" in name:
            continue
        model, x = build(torch, **spec)
        inner = 20 if spec["width"] <= 8 else (2 if spec["width"] >= 512 or spec["rows"] >= 1024 else 5)
        best = measure(torch, model, x, repeat, inner, per_sample=args.rows is None)
        depth = spec["depth"]
        eager_added = (best["eager checkpoint"] - best["eager"]) / depth
        print(f"\n{name}")
        for step, seconds in best.items():
            print(f"  {step:36} {seconds * 1e3:9.3f} ms")
        print(f"  torch's eager checkpoint adds {eager_added * 1e6:8.1f} µs per block "
              f"({best['eager checkpoint'] / best['eager']:.2f}x the eager step)")
        for kind in ("grad", "vmap(grad)"):
            if kind not in best:
                continue
            added = (best[f"{kind}, ckpt_guard.checkpoint"] - best[kind]) / depth
            print(f"  ckpt_guard.checkpoint under {kind:10} adds {added * 1e6:8.1f} µs per block: "
                  f"{added / eager_added:.2f}x torch's eager checkpoint's (target <= 2); "
                  f"step {best[f'{kind}, ckpt_guard.checkpoint'] / best[kind]:.2f}x the uncheckpointed {kind} step")
            if f"{kind}, save matmuls" in best:
                saving = (best[f"{kind}, save matmuls"] - best[kind]) / depth
                print(f"    with matmuls saved (a save policy) it adds {saving * 1e6:8.1f} µs per block: "
                      f"{saving / added:.2f}x what recomputing everything adds (target <= 0.5); "
                      f"step {best[f'{kind}, save matmuls'] / best[kind]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
