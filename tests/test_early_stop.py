"""The recompute's early stop (``ckpt_guard._composable.lazy``): what no derivative reads is never run.

Differential: every block kind below, under every transform whose backward runs
a first-order recompute, checkpointed with every matmul deferred (the thresholds
at 0), against the same program checkpointed without the early stop (bitwise) and
without checkpointing (``assert_close``: reverse over reverse sums in another order).  The kinds are
the ways a deferred value can be needed after all: read by a derivative formula
(in the forward, or in the pullback), by a Python branch, written around (a write
into what a deferred matmul reads), kept on the module by a forward hook; and the ways it is not (a residual block's
tail, a block ending in a ``Linear``).  Where nothing reads the tail, the tests
also see that it was skipped (else this file would pass with the early stop
switched off).  The mode's own two checks (what is held when the forward ends, what
is still held when the backward ends) are also tested on the mode itself.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

import ckpt_guard
from ckpt_guard._composable import counters, lazy

#: the thresholds as shipped (the fixture below sets them to 0)
DEFAULTS = lazy.MIN_FLOPS, lazy.MIN_NUMEL


@pytest.fixture(autouse=True)
def every_matmul_deferred():
    saved = lazy.MIN_FLOPS, lazy.MIN_NUMEL, lazy.ENABLED
    lazy.MIN_FLOPS = lazy.MIN_NUMEL = 0
    lazy.ENABLED = True
    try:
        yield
    finally:
        lazy.MIN_FLOPS, lazy.MIN_NUMEL, lazy.ENABLED = saved


D = 6


class Residual(nn.Module):
    """``h + b(tanh(a(h)))``: the last matmul and the add are read by no derivative."""

    skips = True

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, h):
        return h + self.b(torch.tanh(self.a(h)))


class EndsInLinear(Residual):
    """``b(tanh(a(h)))``: the block's output is a matmul's."""

    def forward(self, h):
        return self.b(torch.tanh(self.a(h)))


class ReadByItsDerivative(Residual):
    """``exp(b(tanh(a(h))))``: exp's derivative reads its output, computed from the matmul's."""

    skips = False

    def forward(self, h):
        return torch.exp(self.b(torch.tanh(self.a(h))))


class ReadInThePullback(Residual):
    """``h * b(tanh(a(h)))``: the product is deferred too, and its derivative reads the matmul's output."""

    skips = False

    def forward(self, h):
        return h * self.b(torch.tanh(self.a(h)))


class ReadByAPythonBranch(Residual):
    """A branch on the matmul's value: its sum is computed, so the matmul runs first."""

    skips = False

    def forward(self, h):
        y = self.b(torch.tanh(self.a(h)))
        return y * 2 if y.sum() > 0 else h - y


class WrittenAround(nn.Module):
    """``addmm(c, h, w)`` deferred, then ``c`` written in place: the addmm, run when tanh reads its sum,
    must read ``c`` as it was."""

    skips = False

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D)
        self.bias = nn.Parameter(torch.randn(D))

    def forward(self, h):
        rows = h.reshape(-1, D)
        c = (self.bias * 1.0).expand(rows.shape[0], D).contiguous()
        y = torch.addmm(c, rows, self.w)
        c.add_(1.0)
        return torch.tanh(y + c).reshape(h.shape)


class KeptOnItsModule(Residual):
    """A forward hook keeps ``b``'s output on the block (an activation-capturing hook): after the backward,
    the block holds the recompute's, which must be its value, not memory the early stop never filled."""

    def __init__(self):
        super().__init__()
        self.b.register_forward_hook(lambda module, args, out: setattr(self, "seen", out))


KINDS = [Residual, EndsInLinear, KeptOnItsModule, ReadByItsDerivative, ReadInThePullback, ReadByAPythonBranch, WrittenAround]


class Model(nn.Module):
    def __init__(self, kind, checkpointed):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(kind() for _ in range(2))
        self.checkpointed = checkpointed

    def forward(self, h):
        for block in self.blocks:
            h = ckpt_guard.checkpoint(block, h) if self.checkpointed else block(h)
        return h


def _loss(model, params, x):
    return functional_call(model, params, (x,)).pow(2).mean()


def _grad(model, params, x):
    return grad(lambda p: _loss(model, p, x))(params)


def _per_sample(model, params, x):
    return vmap(grad(lambda p, s: _loss(model, p, s[None])), in_dims=(None, 0))(params, x)


def _jacrev(model, params, x):
    return jacrev(lambda p: functional_call(model, p, (x,)).sum(0))(params)


def _vjp(model, params, x):
    out, pullback = vjp(lambda p: functional_call(model, p, (x,)), params)
    return pullback(torch.ones_like(out))[0]


def _hvp(model, params, x):  # reverse over reverse: each derivative's own recompute is first order
    direction = {k: torch.ones_like(v) for k, v in params.items()}
    _, pullback = vjp(lambda p: _grad(model, p, x), params)
    return pullback(direction)[0]


TRANSFORMS = {"grad": _grad, "vmap(grad)": _per_sample, "jacrev": _jacrev, "vjp": _vjp, "vjp(grad)": _hvp}


def _run(kind, transform, checkpointed):
    model = Model(kind, checkpointed)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 3, D, generator=torch.Generator().manual_seed(1))
    return TRANSFORMS[transform](model, params, x), model


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_every_number_is_the_plain_codes(kind, transform):
    try:
        plain, plain_model = _run(kind, transform, checkpointed=False)
    except RuntimeError as error:  # vmap refuses a data-dependent branch: so does the checkpointed code
        with pytest.raises(type(error)):
            _run(kind, transform, checkpointed=True)
        return
    lazy.ENABLED = False
    without, _ = _run(kind, transform, checkpointed=True)
    lazy.ENABLED = True
    before = counters.SKIPPED_BY_EARLY_STOP
    actual, model = _run(kind, transform, checkpointed=True)
    skipped = counters.SKIPPED_BY_EARLY_STOP - before
    assert plain.keys() == actual.keys() == without.keys()
    for name in plain:
        # the same bits as the recompute that runs everything; the plain code's numbers (reverse over
        # reverse sums in another order: equal to rounding)
        assert torch.equal(actual[name], without[name]), name
        torch.testing.assert_close(actual[name], plain[name])
    if kind is KeptOnItsModule and transform == "grad":
        for block, plain_block in zip(model.blocks, plain_model.blocks):
            assert torch.equal(block.seen, plain_block.seen), "a hook kept memory the early stop never filled"
    if transform in ("grad", "vjp") and kind.skips and lazy.AVAILABLE:
        assert skipped > 0, "nothing was skipped: the early stop did not run"


def test_off_below_its_thresholds_and_switched_off():
    """At the default thresholds a tiny block runs as before (no mode); the switch turns it off."""
    lazy.MIN_FLOPS, lazy.MIN_NUMEL = DEFAULTS
    before = counters.SKIPPED_BY_EARLY_STOP
    _run(Residual, "grad", checkpointed=True)
    assert counters.SKIPPED_BY_EARLY_STOP == before
    lazy.MIN_FLOPS = lazy.MIN_NUMEL = 0
    lazy.ENABLED = False
    _run(Residual, "grad", checkpointed=True)
    assert counters.SKIPPED_BY_EARLY_STOP == before


def test_a_save_policy_decides_alone():
    """Under a save policy the recompute runs what the policy did not save: no early stop on top."""
    tuc = pytest.importorskip("torch.utils.checkpoint")
    if not hasattr(tuc, "create_selective_checkpoint_contexts"):
        pytest.skip("selective checkpointing (create_selective_checkpoint_contexts) is torch 2.5+")
    import functools

    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    block = Residual()
    params = {k: v.detach() for k, v in block.named_parameters()}
    x = torch.randn(4, D)
    before = counters.SKIPPED_BY_EARLY_STOP
    got = grad(lambda p: ckpt_guard.checkpoint(
        lambda h: functional_call(block, p, (h,)), x, context_fn=context_fn).pow(2).mean())(params)
    want = grad(lambda p: functional_call(block, p, (x,)).pow(2).mean())(params)
    assert counters.SKIPPED_BY_EARLY_STOP == before
    for name in want:
        torch.testing.assert_close(got[name], want[name])


@pytest.mark.parametrize("holder", ["nothing", "the matmul", "the sum", "a view made while deferring", "a view made after"])
def test_what_is_still_held_when_the_recompute_ends_is_run_the_rest_never(holder):
    """The mode itself (on every torch: only its use is switched off where it is not AVAILABLE)."""
    a, b, c = (torch.randn(*shape, generator=torch.Generator().manual_seed(i)) for i, shape in
               enumerate([(4, 5), (5, 3), (4, 3)]))
    mode = lazy.Deferring()
    with mode:
        product = torch.mm(a, b)
        total = product + c
        flat = total.view(-1)
        mode.deferring = False
    kept, expected = {
        "nothing": (None, None),
        "the matmul": (product, a @ b),
        "the sum": (total, a @ b + c),
        "a view made while deferring": (flat, (a @ b + c).view(-1)),
        "a view made after": (total.view(3, 4), (a @ b + c).view(3, 4)),
    }[holder]
    del product, total, flat
    never_ran = mode.finish()
    if kept is None:
        assert never_ran == 2
    else:
        assert torch.equal(kept, expected)
        assert never_ran == (1 if holder == "the matmul" else 0)


def test_available_where_a_mode_can_run_a_higher_order_operator():
    """The early stop is used where torch lets the mode see ``torch.cond`` and run it; a block calling
    one then computes what it computes without the mode (on torch 2.4, where a mode cannot, it is off)."""
    if not lazy.AVAILABLE:
        assert not lazy.applies(None, [torch.ones(1)])
        pytest.skip("this torch's dispatch modes do not pass higher-order operators: the early stop is off")
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    with lazy.Deferring():
        product = torch.mm(a, b)
        out = torch.cond(torch.tensor(True), lambda x: x.sin(), lambda x: x.cos(), (product,))
    assert torch.equal(out, (a @ b).sin())


def test_what_only_the_outputs_hold_when_the_forward_ends_never_runs_and_a_read_of_it_is_refused():
    a, b, c = torch.randn(4, 5), torch.randn(5, 3), torch.randn(4, 3)
    mode = lazy.Deferring()
    with mode:
        product = torch.mm(a, b)
        outputs = (product + c,)  # the recompute's outputs, as the vjp returns them
        held = torch.mm(a, b)  # held by this test past the forward: kept
        del product
        mode.settle(outputs)
        assert len(mode.dropped) == 2 and len(mode.deferred) == 1
        assert torch.equal(held * 1, a @ b)  # read: run now
        with pytest.raises(RuntimeError, match="skipped aten.add"):
            outputs[0] * 1  # the early stop found nothing could read it: a read is a bug, said loudly
    del outputs
    assert mode.finish() == 2
