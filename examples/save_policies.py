"""Save policies under torch.func: keep the matmuls (or named values), recompute the rest.

A residual MLP's blocks are checkpointed with ``ckpt_guard.checkpoint``; three ways of
choosing what the forward keeps are compared with the same model without
checkpointing, under ``grad`` (a training step), ``vmap(grad)`` (per-sample gradients)
and ``jvp(grad)`` (a Hessian-vector product):

* no policy: every operation of a block runs again in the backward;
* ``dots_saveable`` (JAX's): the matrix products are kept, the rest runs again;
* ``save_only_these_names("hidden")``: the value the block names with
  ``ckpt_guard.checkpoint_name`` is kept.

Then ``ckpt_guard.saved_residuals`` prints what each block kept and what its recompute
ran again.  Needs torch >= 2.5 (selective checkpointing's API).

Run: ``python examples/save_policies.py`` (exit status 0 when every result equals the
uncheckpointed one).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

import ckpt_guard
from ckpt_guard import checkpoint_policies as cp


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h):
        hidden = ckpt_guard.checkpoint_name(self.up(h), "hidden")
        return h + self.down(torch.tanh(hidden))


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.context_fn = None  # "plain": no checkpoint

    def forward(self, h):
        for block in self.blocks:
            if self.context_fn == "plain":
                h = block(h)
            else:
                h = ckpt_guard.checkpoint(block, h, context_fn=self.context_fn)
        return h


def main() -> int:
    torch.manual_seed(0)
    model = MLP().double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(8, 16, dtype=torch.float64)

    def loss(p, x):
        return functional_call(model, p, (x,)).pow(2).mean()

    steps = {
        "grad": lambda: grad(loss)(params, x),
        "vmap(grad)": lambda: vmap(grad(loss), in_dims=(None, 0))(params, x.unsqueeze(1)),
        "jvp(grad)": lambda: jvp(lambda p: grad(loss)(p, x), (params,), (params,)),
    }
    policies = {
        "no policy": None,
        "dots_saveable": cp.context_fn(cp.dots_saveable),
        "save_only_these_names('hidden')": cp.context_fn(cp.save_only_these_names("hidden")),
    }
    for step_name, step in steps.items():
        model.context_fn = "plain"
        reference = torch.utils._pytree.tree_leaves(step())
        for policy_name, context_fn in policies.items():
            model.context_fn = context_fn
            got = torch.utils._pytree.tree_leaves(step())
            for g, r in zip(got, reference):
                torch.testing.assert_close(g, r)
            print(f"{step_name:<11} {policy_name:<32} equals the uncheckpointed result")
    print()
    model.context_fn = cp.context_fn(cp.dots_saveable)
    ckpt_guard.saved_residuals(grad(loss), params, x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
