"""A MeanFlow / consistency-model loss over a checkpointed network: jvp, then ``.backward()``.

The loss needs the network's value and its time derivative at once:
``u, dudt = torch.func.jvp(net, (z, t), (v, 1))``; the target is built from
``dudt.detach()`` and the loss is trained with an eager ``.backward()``
(random weights, nothing downloaded).  Three runs of the same computation:

1. without the guard: torch's own error (the recompute runs without the
   jvp's forward-mode level, so it saves other tensors than the forward);
2. under ``strict``: ckpt_guard's explanation and what to do;
3. under ``fallback``: gradients equal to the network without checkpointing,
   and the peak memory of a training step with and without checkpointing,
   each measured in a fresh process.

Run: ``python examples/meanflow_loss.py`` (exit status 0 when run 3 is correct
and saves memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import torch
from torch.utils.checkpoint import checkpoint

import ckpt_guard

WIDTH, BLOCKS = 256, 6


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH), torch.nn.SiLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.SiLU()
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.body(h)


class Net(torch.nn.Module):
    """u(z, t): a residual MLP whose blocks are checkpointed (torch's non-reentrant checkpoint)."""

    def __init__(self, checkpointing: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(WIDTH + 1, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.checkpointing = checkpointing

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.embed(torch.cat([z, t], 1))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointing else block(h)
        return h


def meanflow_step(net: Net, batch: int = 64) -> list:
    """One training step's gradients: jvp for u and du/dt, a target from du/dt.detach(), .backward()."""
    torch.manual_seed(1)
    z, t, v = torch.randn(batch, WIDTH), torch.rand(batch, 1), torch.randn(batch, WIDTH)
    net.zero_grad(set_to_none=True)
    u, dudt = torch.func.jvp(net, (z, t), (v, torch.ones_like(t)))
    target = (v - t * dudt).detach()
    (u - target).pow(2).mean().backward()
    return [p.grad for p in net.parameters()]


def _peak_mb(checkpointing: bool) -> float:
    """Peak RSS of one step above the set-up, in a fresh process (see benchmarks/memory.py)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    mode = "fallback" if checkpointing else "plain"
    proc = subprocess.run([sys.executable, __file__, "--peak", mode], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.splitlines()[-1])["peak_mb"]


def _child(mode: str) -> None:
    import gc

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Net(checkpointing=mode == "fallback")
    if mode == "fallback":
        ckpt_guard.install("fallback")
        warnings.simplefilter("ignore")
    meanflow_step(net, batch=2048)  # warm-up
    gc.collect()

    def rss(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

    baseline = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    meanflow_step(net, batch=2048)
    print(json.dumps({"peak_mb": (rss("VmHWM") - baseline) / 1024}))


def main() -> int:
    torch.manual_seed(0)
    net, plain = Net(), Net(checkpointing=False)
    plain.load_state_dict(net.state_dict())

    print("1) torch without the guard:")
    try:
        meanflow_step(net)
        print("   (no error)")
    except Exception as exc:  # noqa: BLE001 - torch's own error, whatever it is on this release
        print(f"   {type(exc).__name__}: {str(exc).splitlines()[0]}")

    ckpt_guard.install("strict")
    print("\n2) ckpt_guard, policy strict:")
    try:
        meanflow_step(net)
        print("   (no error)")
    except ckpt_guard.CheckpointCompositionError as exc:
        print("   " + str(exc).replace("\n", "\n   "))

    print("\n3) ckpt_guard, policy fallback:")
    with ckpt_guard.policy("fallback"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded = meanflow_step(net)
    rules = sorted({w.message.rule.id for w in caught if issubclass(w.category, ckpt_guard.CheckpointCompositionWarning)})
    reference = meanflow_step(plain)
    for g, r in zip(guarded, reference):
        torch.testing.assert_close(g, r)
    ckpt_guard.uninstall()
    print(f"   warned: {', '.join(rules) or 'nothing'}; gradients of all {len(reference)} parameters "
          "match the network without checkpointing")
    if sys.platform.startswith("linux"):
        with_checkpointing, without = _peak_mb(True), _peak_mb(False)
        print(f"   peak memory of a step (batch 2048): {with_checkpointing:.0f} MB under fallback, "
              f"{without:.0f} MB without checkpointing ({with_checkpointing / without:.2f}x)")
        if with_checkpointing >= without:
            return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peak":
        _child(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
