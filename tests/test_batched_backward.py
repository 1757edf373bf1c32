"""A batched backward over checkpointed blocks that draw random numbers (issue 46, item 9).

``torch.autograd.grad(..., is_grads_batched=True)`` and
``torch.autograd.functional.jacobian/hessian(..., vectorize=True)`` run the backward under
a vmap of the cotangents; torch's recompute, run there, draws its dropout mask under that
vmap, which refuses random operations ("We do not yet support calling random operations
inside of vmap"), with or without fallback.  The forward drew outside it, and the
recompute replays the forward's RNG state: under strict and fallback the guard runs the
recompute outside that vmap (its inputs are the forward's, batched by none of it).  Each
case: the uncheckpointed reference, raw torch (raises), guarded (equal to the reference).
"""

from __future__ import annotations

import pytest
import torch

import ckpt_guard

DTYPE = torch.float64


def _block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Tanh()).to(DTYPE)


def _torchs(function, x):
    return torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False)


def _plain(function, x):
    return function(x)


def _grads_batched(ckpt):
    block = _block()
    x = torch.linspace(-1.0, 1.0, 12, dtype=DTYPE).reshape(3, 4).requires_grad_()
    torch.manual_seed(1)
    y = ckpt(block, x)
    return torch.autograd.grad(y, x, torch.eye(12, dtype=DTYPE).reshape(12, 3, 4), is_grads_batched=True)[0]


def _jacobian_vectorized(ckpt):
    block = _block()
    x = torch.linspace(-1.0, 1.0, 12, dtype=DTYPE).reshape(3, 4)

    def f(t):
        torch.manual_seed(1)  # the same mask for every evaluation (jacobian calls f once)
        return ckpt(block, t)

    return torch.autograd.functional.jacobian(f, x, vectorize=True)


def _hessian_vectorized(ckpt):
    block = _block()
    x = torch.linspace(-1.0, 1.0, 12, dtype=DTYPE).reshape(3, 4)

    def f(t):
        torch.manual_seed(1)
        return ckpt(block, t).pow(2).sum()

    return torch.autograd.functional.hessian(f, x, vectorize=True)


PROGRAMS = {"is_grads_batched": _grads_batched, "jacobian(vectorize=True)": _jacobian_vectorized,
            "hessian(vectorize=True)": _hessian_vectorized}


@pytest.mark.parametrize("policy", ["strict", "fallback"])
@pytest.mark.parametrize("entry", ["torch checkpoint", "ckpt_guard.checkpoint"])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_dropout_under_a_batched_backward_replays_the_forwards_mask(program, entry, policy):
    run = PROGRAMS[program]
    reference = run(_plain)
    with pytest.raises(RuntimeError, match="random operations inside of vmap"):
        run(_torchs)  # torch alone
    if entry == "ckpt_guard.checkpoint":
        with ckpt_guard.policy(policy):
            got = run(ckpt_guard.checkpoint)
    else:
        ckpt_guard.install(policy, rules={})
        try:
            got = run(_torchs)
        finally:
            ckpt_guard.uninstall()
    torch.testing.assert_close(got, reference)
