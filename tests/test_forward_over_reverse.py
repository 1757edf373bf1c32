"""Forward over reverse (``jvp(grad)``, ``hessian``): each block's tangents are the plain run's, handed on.

Under ``jvp(grad(loss))`` a checkpointed block's plain run goes through the grad level
on top and the jvp level under it, so its outputs carry that jvp's tangents: exactly
the uncheckpointed code's.  The Function's jvp rule hands them on instead of running
the block again under a jvp of its own, so a Hessian-vector product runs each block
twice (the plain run, the backward's recompute), not three times.

The cross: every module kind of the conformance matrix × the transforms whose plain
run has grad levels over a jvp, each cell compared with the plain code by the
matrix's own comparison, and no block's jvp rule recomputing; then the stacks the
matrix does not have (two grad levels over the jvp, a vmap between them, a vmap
over it), against the uncheckpointed code.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, jacfwd, jvp, vmap

import ckpt_guard
import conformance as matrix
from ckpt_guard import _composable

#: the matrix's transforms whose plain run has a grad level over a jvp level
GRAD_OVER_JVP = ("jvp(grad)", "hessian")
ENTRY = "ckpt_guard.checkpoint, strict"


@pytest.mark.parametrize("transform", GRAD_OVER_JVP)
@pytest.mark.parametrize("kind", list(matrix.KINDS))
def test_every_kind_hands_on_the_plain_runs_tangents(kind, transform):
    counters = _composable.counters
    before = counters.TANGENT_RECOMPUTES, counters.RECOMPUTES
    outcome = matrix.run_cell(matrix.Cell(kind, transform, "functional_call", ENTRY))
    if outcome.verdict == "n/a":
        pytest.skip(f"not a cell of the matrix: {outcome.detail}")
    if outcome.verdict == "plain" and outcome.refusal == "forward-only":
        pytest.skip("nothing to save: the block's output is a view of its input (the plain run is the result)")
    if outcome.verdict in ("plain", "refused") and outcome.refusal == "aliasing-outputs":
        pytest.skip("refused by design: its outputs share memory and the caller writes one (docs/limits.md)")
    assert outcome.verdict == "checkpointed", outcome
    assert counters.RECOMPUTES > before[1]  # the backward recomputed the blocks: the memory saving is kept
    assert counters.TANGENT_RECOMPUTES == before[0], "a block's jvp rule ran it again instead of handing on"


def _net() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU(), torch.nn.Dropout(0.2), torch.nn.Linear(4, 4))
        for _ in range(3)
    ).double()


def _loss(net: torch.nn.ModuleList, checkpointed: bool):
    def loss(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)  # the same dropout masks for both programs
        h = x
        for block in net:
            h = ckpt_guard.checkpoint(block, h) if checkpointed else block(h)
        return h.tanh().pow(2).sum()

    return loss


X = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64).reshape(2, 4)
V = torch.linspace(0.5, -0.3, 8, dtype=torch.float64).reshape(2, 4)

#: stacks the matrix does not have; each runs ``loss`` (checkpointed or not) and returns numbers
STACKS = {
    "jvp(grad(norm of grad))": lambda loss: jvp(lambda t: grad(lambda u: grad(loss)(u).pow(2).sum())(t), (X,), (V,)),
    "jvp(vmap(grad))": lambda loss: jvp(vmap(grad(loss), randomness="same"), (X.unsqueeze(1),), (V.unsqueeze(1),)),
    "vmap(jvp(grad))": lambda loss: vmap(lambda t, s: jvp(grad(loss), (t,), (s,)), randomness="same")(X, V),
    "jacfwd(grad)": lambda loss: jacfwd(grad(loss), randomness="same")(X),
}


@pytest.mark.parametrize("stack", list(STACKS))
def test_other_stacks_over_a_jvp_equal_the_plain_code(stack):
    net = _net()
    counters = _composable.counters
    with ckpt_guard.policy("strict"):
        before = counters.RECOMPUTES
        got = STACKS[stack](_loss(net, checkpointed=True))
        assert counters.RECOMPUTES > before
    torch.testing.assert_close(got, STACKS[stack](_loss(net, checkpointed=False)))


def test_a_hessian_vector_product_differentiated_again_by_eager_autograd():
    """Parameters that require grad outside the transforms: each block's backward may be differentiated
    again by eager autograd, so it is a checkpointed derivative of its own, run once at the caller's
    levels for the jvp's tangents; the ``.backward()`` over the product then differentiates that."""
    net = _net()
    x = X.clone().requires_grad_()
    params = dict(net.named_parameters())
    direction = {name: torch.linspace(-0.5, 0.5, p.numel(), dtype=p.dtype).reshape(p.shape) for name, p in params.items()}

    def run(checkpointed):
        for leaf in (x, *params.values()):
            leaf.grad = None

        def loss(p):
            torch.manual_seed(1)
            h = x
            for i, block in enumerate(net):
                own = {k.split(".", 1)[1]: t for k, t in p.items() if k.startswith(f"{i}.")}
                call = (torch.func.functional_call, block, own, (h,))
                h = ckpt_guard.checkpoint(*call) if checkpointed else call[0](*call[1:])
            return h.tanh().pow(2).sum()

        gradient, product = jvp(grad(loss), (params,), (direction,))
        (sum(t.pow(2).sum() for t in product.values()) + sum(t.sum() for t in gradient.values())).backward()
        return [product[k].detach() for k in product], [x.grad, *(p.grad for p in params.values())]

    counters = _composable.counters
    with ckpt_guard.policy("strict"):
        before = counters.TANGENT_RECOMPUTES, counters.NESTED_RECOMPUTES
        got = run(checkpointed=True)
        assert counters.NESTED_RECOMPUTES > before[1]  # the backward was a checkpointed derivative
        assert counters.TANGENT_RECOMPUTES == before[0]  # its tangents were handed on
    torch.testing.assert_close(got, run(checkpointed=False))


def test_a_block_the_tangents_never_reach_runs_no_more_than_twice():
    """An additive loss of two branches, jvp along the first's parameters only, parameters requiring
    grad outside: the second branch's backward is run once at the caller's levels, finds no tangent,
    and is still handed on (its tangents are recomputed, not the whole derivative a third time)."""
    runs = {"a": 0, "b": 0}

    class Counted(torch.nn.Sequential):
        def __init__(self, tag):
            super().__init__(torch.nn.Linear(4, 4), torch.nn.SiLU(), torch.nn.Linear(4, 4))
            self.tag = tag

        def forward(self, x):
            runs[self.tag] += 1
            return super().forward(x)

    torch.manual_seed(0)
    a, b = Counted("a").double(), Counted("b").double()
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    direction = {k: torch.ones_like(v) for k, v in pa.items()}

    def loss(qa, qb, checkpointed):
        call = ckpt_guard.checkpoint if checkpointed else (lambda f, *rest: f(*rest))
        return (call(torch.func.functional_call, a, qa, (X,)).tanh().pow(2).sum()
                + call(torch.func.functional_call, b, qb, (V,)).tanh().pow(2).sum())

    def step(checkpointed):
        return jvp(lambda qa: grad(loss, argnums=(0, 1))(qa, pb, checkpointed), (pa,), (direction,))

    with ckpt_guard.policy("strict"):
        got = step(True)
    assert runs == {"a": 2, "b": 2}, runs  # the plain run, then the backward's once (3 for b before)
    torch.testing.assert_close(got, step(False))
