"""A Hessian-vector product, checkpointed: forward over reverse (``jvp(grad)``) against reverse over reverse (``vjp(grad)``).

Both give the same product ``H v`` of a loss's Hessian with a vector.  Under
``ckpt_guard.checkpoint`` they cost differently:

* ``jvp(grad(loss))``: forward-mode AD differentiates the recompute directly, so each
  block runs twice (the forward, the recompute under the jvp): little memory and
  about the time of the uncheckpointed product;
* ``vjp(grad(loss))``: reverse mode differentiates a backward, itself checkpointed,
  so each block runs four times: more time, and more memory (the inner backward's
  inputs are kept for the outer one).

The script checks that the four products (two ways, with and without checkpointing)
agree, then measures the peak memory and time of each, each in a fresh process
(``MALLOC_MMAP_THRESHOLD_=65536``, one thread; see ``benchmarks/memory.py``), and prints
them as ratios to the same way without checkpointing.  The same trade shows for
meta-gradients (MixFlow-MG, arXiv 2505.00793).

Run: ``python examples/hvp_forward_over_reverse.py`` (exit status 0 when the products
agree and the checkpointed ``jvp(grad)`` peaks below its uncheckpointed run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from torch.func import functional_call, grad, jvp, vjp

import ckpt_guard

WIDTH, BLOCKS, BATCH = 256, 8, 512


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.tanh(self.a(h)))


class Net(torch.nn.Module):
    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.checkpointing = checkpointing

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = ckpt_guard.checkpoint(block, h) if self.checkpointing else block(h)
        return h


def hvp(net: Net, way: str, batch: int = 64) -> dict:
    """``H v`` of the mean squared output, with respect to the parameters, ``v`` fixed by a seed."""
    torch.manual_seed(1)
    x = torch.randn(batch, WIDTH)
    params = {k: p.detach() for k, p in net.named_parameters()}
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def loss(p: dict) -> torch.Tensor:
        return functional_call(net, p, (x,)).pow(2).mean()

    if way == "jvp(grad)":
        return jvp(grad(loss), (params,), (v,))[1]
    _, pullback = vjp(grad(loss), params)
    return pullback(v)[0]


def _measure(checkpointing: bool, way: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "ckpt" if checkpointing else "plain", way],
        capture_output=True, text=True, env=env, timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.splitlines()[-1])


def _child(mode: str, way: str) -> None:
    import gc

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Net(checkpointing=mode == "ckpt")
    hvp(net, way, BATCH)  # warm-up
    gc.collect()

    def rss(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

    baseline = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    started = time.perf_counter()
    hvp(net, way, BATCH)
    seconds = time.perf_counter() - started
    print(json.dumps({"peak_mb": (rss("VmHWM") - baseline) / 1024, "seconds": seconds}))


def main() -> int:
    torch.manual_seed(0)
    checkpointed, plain = Net(checkpointing=True), Net(checkpointing=False)
    plain.load_state_dict(checkpointed.state_dict())
    reference = hvp(plain, "jvp(grad)")
    for net in (checkpointed, plain):
        for way in ("jvp(grad)", "vjp(grad)"):
            for key, value in hvp(net, way).items():
                torch.testing.assert_close(value, reference[key], rtol=1e-4, atol=1e-6)
    print("the four Hessian-vector products agree (jvp(grad) and vjp(grad), with and without checkpointing)")
    if not sys.platform.startswith("linux"):
        return 0
    print(f"one product, {BLOCKS} residual blocks of 2 x Linear({WIDTH}), batch {BATCH}, each in a fresh process:")
    runs = {(c, way): _measure(c, way) for way in ("jvp(grad)", "vjp(grad)") for c in (False, True)}
    for way in ("jvp(grad)", "vjp(grad)"):
        without, with_ = runs[False, way], runs[True, way]
        print(
            f"  {way}: checkpointed {with_['peak_mb']:.0f} MB, {with_['seconds']:.2f} s; without "
            f"{without['peak_mb']:.0f} MB, {without['seconds']:.2f} s: memory {with_['peak_mb'] / without['peak_mb']:.2f}x, "
            f"time {with_['seconds'] / without['seconds']:.2f}x"
        )
    return 0 if runs[True, "jvp(grad)"]["peak_mb"] < runs[False, "jvp(grad)"]["peak_mb"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
