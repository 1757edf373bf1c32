"""Checkpointing that works under torch.func: the composable recompute.

Differential, as everywhere: the uncheckpointed reference, and the composable
recompute (through ``fallback`` or ``ckpt_guard.checkpoint``), compared with
``assert_close``; the events say which path ran.  Memory is measured in a
subprocess (``benchmarks/memory.py``), not timed here.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import warnings

import pytest
import torch
from conftest import assert_all_close
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning, _composable
from ckpt_guard._decide import COMPOSABLE_ACTION

pytestmark = pytest.mark.usefixtures("guard")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quiet(run):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run()


def _block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))


# The transforms torch.func users compose with checkpointing: f maps a (4, 3) input to a scalar
# through the block; each entry returns what the transform computes.
TRANSFORMS = {
    "grad": lambda f, x: grad(f)(x),
    "vjp": lambda f, x: vjp(f, x)[1](torch.ones(()))[0],
    "jacrev": lambda f, x: jacrev(f)(x),
    "vmap(grad)": lambda f, x: vmap(grad(lambda row: f(row[None])))(x),
    "hessian": lambda f, x: hessian(f)(x[:1]),
    "grad(grad)": lambda f, x: grad(lambda y: grad(f)(y).pow(2).sum())(x),
    "jacrev(jacrev)": lambda f, x: jacrev(jacrev(f))(x[:1]),
    "jvp": lambda f, x: jvp(f, (x,), (torch.ones_like(x),))[1],
    "jacfwd": lambda f, x: jacfwd(f)(x),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_public_checkpoint_under_transforms_matches_the_reference(transform):
    block, x = _block(), torch.randn(4, 3)
    run = TRANSFORMS[transform]
    reference = run(lambda t: torch.tanh(block(t)).sum(), x)
    got = run(lambda t: torch.tanh(ckpt_guard.checkpoint(block, t)).sum(), x)
    torch.testing.assert_close(got, reference)


def test_public_checkpoint_outside_transforms_is_torchs_own():
    """Bitwise what torch.utils.checkpoint(use_reentrant=False) gives, and no decision at all."""
    block = _block()

    def step(ckpt):
        torch.manual_seed(1)
        x = torch.randn(4, 3, requires_grad=True)
        block.zero_grad(set_to_none=True)
        y = ckpt(block, x)
        y.pow(2).sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in block.parameters())]

    raw = step(lambda f, t: checkpoint(f, t, use_reentrant=False))
    with ckpt_guard.record() as events:
        got = step(ckpt_guard.checkpoint)
    assert events == []
    for g, r in zip(got, raw):
        assert torch.equal(g, r)


def test_public_checkpoint_vmap_forward_then_backward_outside():
    block = _block()
    x = torch.randn(4, 3, requires_grad=True)
    y = vmap(lambda t: ckpt_guard.checkpoint(block, t))(x)
    y.pow(2).sum().backward()
    got = [x.grad, *(p.grad for p in block.parameters())]
    x2 = x.detach().requires_grad_()
    block.zero_grad(set_to_none=True)
    block(x2).pow(2).sum().backward()
    assert_all_close(got, [x2.grad, *(p.grad for p in block.parameters())])


def test_public_checkpoint_lifts_a_tensor_held_in_a_list():
    """A tensor being differentiated, held in a list the block closes over: lifted (a copy of the list)."""
    w = torch.randn(3)
    x = torch.randn(4, 3)

    def loss(weight, checkpointed=True):
        held = [weight]
        block = lambda t: (t * held[0]).sin()  # noqa: E731
        return (ckpt_guard.checkpoint(block, x) if checkpointed else block(x)).sum()

    before = _composable.counters.RECOMPUTES
    got = grad(loss)(w)
    assert _composable.counters.RECOMPUTES > before
    torch.testing.assert_close(got, grad(lambda v: loss(v, checkpointed=False))(w))


class _ClassHeld:
    weight = None


def test_public_checkpoint_refuses_what_it_cannot_lift_and_names_it():
    """A class attribute cannot be rebound for one call: the walk finds it through the class the block's
    code names and refuses before anything runs (the class global-tensor), naming the attribute."""
    x = torch.randn(4, 3)

    def loss(weight):
        _ClassHeld.weight = weight
        try:
            return ckpt_guard.checkpoint(lambda t: (t * _ClassHeld.weight).sin(), x).sum()
        finally:
            _ClassHeld.weight = None

    with pytest.raises(CheckpointCompositionError) as info:
        grad(loss)(torch.randn(3))
    message = str(info.value)
    assert info.value.rule.id == "CKG001"
    assert "could not use its composable recompute here: it reads a tensor that needs a gradient through" in message
    assert "the global _ClassHeld.weight" in message and "(refusal class global-tensor" in message
    assert "raised before running the checkpointed function" in message


_GLOBAL_WEIGHT = None


def _reads_the_global(t):
    return (t @ _GLOBAL_WEIGHT).sin()


def test_a_tensor_read_through_a_global_is_named_with_the_fix_next_to_the_variant():
    """The refusal names the global right after the variant line (which says ckpt_guard.checkpoint, not
    use_reentrant=False); the headline names ckpt_guard.checkpoint (what the user called), and the first
    fix is passing the global as an argument (a user found it buried mid-message)."""
    global _GLOBAL_WEIGHT
    x = torch.randn(4, 3)

    def loss(weight):
        global _GLOBAL_WEIGHT
        _GLOBAL_WEIGHT = weight
        try:
            return ckpt_guard.checkpoint(_reads_the_global, x).sum()
        finally:
            _GLOBAL_WEIGHT = None

    with pytest.raises(CheckpointCompositionError) as info:
        grad(loss)(torch.randn(3, 3))
    lines = str(info.value).splitlines()
    variant = next(i for i, line in enumerate(lines) if line.startswith("  variant:"))
    assert lines[variant] == "  variant: ckpt_guard.checkpoint, run as torch's non-reentrant checkpoint (see the next line)"
    assert "through the global _GLOBAL_WEIGHT" in lines[variant + 1], lines
    assert lines[0].startswith("[CKG001] ckpt_guard.checkpoint could not use its composable recompute"), lines[0]
    first_fix = lines[lines.index("  fix:") + 1]
    assert first_fix.startswith("    - pass _GLOBAL_WEIGHT to the block as an argument: ckpt_guard.checkpoint("), first_fix


_W = torch.randn(3, 3)
_X = torch.randn(4, 3)
_BATCH = torch.randn(5)


def _closure_loss(checkpointed: bool):
    """A JAX-style loss: the block closes over the weight being differentiated."""

    def loss(w):
        def block(t):
            return torch.tanh(t @ w)

        out = ckpt_guard.checkpoint(block, _X) if checkpointed else block(_X)
        return out.pow(2).sum()

    return loss


def _scaled_loss(checkpointed: bool):
    """The block closes over a per-sample scale (batched under vmap, never differentiated)."""

    def loss(x, scale):
        def block(t):
            return torch.tanh(t @ _W) * scale

        return (ckpt_guard.checkpoint(block, x) if checkpointed else block(x)).sum()

    return loss


_CLOSURE_TRANSFORMS = {
    "grad": lambda loss: grad(loss)(_W),
    "jacrev": lambda loss: jacrev(loss)(_W),
    "hessian": lambda loss: hessian(loss)(_W),
    "vmap(grad)": lambda loss: vmap(grad(loss))(torch.stack([_W, 2 * _W])),
    "jvp": lambda loss: jvp(loss, (_W,), (torch.ones(3, 3),))[1],
}


@pytest.mark.parametrize("name", list(_CLOSURE_TRANSFORMS))
def test_closure_tensors_are_lifted(name):
    """The tensor a closure holds is an input of the recompute: its gradient is the reference's."""
    transform = _CLOSURE_TRANSFORMS[name]
    reference = transform(_closure_loss(False))
    before = _composable.counters.RECOMPUTES
    torch.testing.assert_close(transform(_closure_loss(True)), reference)
    if name != "jvp":  # reverse mode differentiated the block: by recomputing it
        assert _composable.counters.RECOMPUTES > before


def test_batched_closure_tensor_under_vmap_grad():
    """Before, a batched tensor a closure held tripped an internal assert in torch (wrapper == nullptr)."""
    reference = vmap(grad(_scaled_loss(False)), in_dims=(None, 0))(_X, _BATCH)
    got = vmap(grad(_scaled_loss(True)), in_dims=(None, 0))(_X, _BATCH)
    torch.testing.assert_close(got, reference)


def test_closure_cell_is_restored():
    """The cell points at the recompute's tensor only while the block runs."""
    w = torch.randn(3, 3)

    def block(t):
        return torch.tanh(t @ w)

    grad(lambda v: ckpt_guard.checkpoint(block, v).sum())(_X)
    assert block.__closure__[0].cell_contents is w


# --------------------------------------------------------------------------
# fallback: over the fuzz generator's transform stacks


def _stacks():
    from fuzz_compositions import TRANSFORMS as names

    ones = [(t,) for t in names]
    twos = [pair for pair in itertools.product(names, repeat=2) if "functionalize" not in pair]
    return ones + twos


@pytest.mark.parametrize("transforms", _stacks(), ids=lambda t: "-".join(t))
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_fallback_over_transform_stacks_matches_the_reference(transforms, use_reentrant):
    """Every stack: fallback equals the uncheckpointed reference; the events say which path ran."""
    from fuzz_compositions import Comp, all_close, run

    comp = Comp(transforms=transforms, use_reentrant=use_reentrant)
    reference = run(comp, "reference")
    if reference.error is not None:
        pytest.skip(f"the uncheckpointed program itself raises: {reference.error!r}")
    with ckpt_guard.record() as events:
        fallback = run(comp, "fallback")
    assert fallback.error is None, fallback.describe()
    assert all_close(fallback.values, reference.values)
    actions = {e.action for e in events}
    forward_levels = sum(name in ("jvp", "jacfwd") for name in transforms)
    if "functionalize" in transforms or forward_levels > 1:
        # no composable recompute there (functionalize does not transform it; forward over
        # forward mode would get zero tangents through its jvp): plainly, as before
        assert actions <= {"fallback: no checkpoint"}, actions
    else:
        assert actions == {COMPOSABLE_ACTION}, actions  # checkpointing kept, torch.func transformed it


def test_fallback_composable_keeps_the_memory_saving_at_every_order():
    """grad over detached parameters: one recompute; grad(grad): its backward checkpointed in turn."""
    from ckpt_guard import _composable

    model = _Wrapped(_block())
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(4, 3)

    def loss(p, t):
        return functional_call(model, p, (t,))

    before = (_composable.counters.RECOMPUTES, _composable.counters.NESTED_RECOMPUTES)
    with ckpt_guard.policy("fallback"), pytest.warns(CheckpointCompositionWarning, match="keeps the memory saving"):
        grad(loss)(params, x)
    assert _composable.counters.RECOMPUTES == before[0] + 1 and _composable.counters.NESTED_RECOMPUTES == before[1]
    # grad of grad: the backward is differentiated again, so it is checkpointed in turn
    with ckpt_guard.policy("fallback"), pytest.warns(CheckpointCompositionWarning, match="keeps the memory saving"):
        grad(lambda t: grad(lambda u: loss(params, u))(t).sum())(x)
    assert _composable.counters.NESTED_RECOMPUTES > before[1]


class _Wrapped(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.tanh(checkpoint(self.block, x, use_reentrant=False)).sum()


# --------------------------------------------------------------------------
# second order under fallback


SECOND_ORDER = {
    "grad(grad)": lambda f, x: grad(lambda y: grad(f)(y).pow(2).sum())(x),
    "jacrev(jacrev)": lambda f, x: jacrev(jacrev(f))(x[:1]),
    "hessian": lambda f, x: hessian(f)(x[:1]),
}


@pytest.mark.parametrize("order", list(SECOND_ORDER))
def test_fallback_second_order_is_right(order):
    block, x = _block(), torch.randn(4, 3)
    run = SECOND_ORDER[order]
    reference = run(lambda t: torch.tanh(block(t)).sum(), x)
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        got = run(lambda t: torch.tanh(checkpoint(block, t, use_reentrant=False)).sum(), x)
    torch.testing.assert_close(got, reference)
    assert {e.action for e in events} == {COMPOSABLE_ACTION}


def test_fallback_eager_create_graph_over_a_torch_func_result():
    """torch.func.grad inside, eager double backward outside: the recompute must stay differentiable."""
    block = _block()
    x = torch.randn(4, 3, requires_grad=True)

    def run(ckpt):
        g = grad(lambda t: torch.tanh(ckpt(block, t)).sum())(x)
        return torch.autograd.grad(g.pow(2).sum(), [x, *block.parameters()])

    reference = run(lambda f, t: f(t))
    with _fallback_quietly():
        got = run(lambda f, t: checkpoint(f, t, use_reentrant=False))
    assert_all_close(got, reference)


def test_fallback_maml_outer_loop_is_right():
    """Per-task adaptation through functional_call (create_graph), meta-gradient of the outer loss."""
    torch.manual_seed(0)
    net = _Wrapped(_block())

    def meta_gradient(model):
        params = dict(model.named_parameters())
        inner = functional_call(model, params, (torch.randn(4, 3),))
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        adapted = {k: v - 0.1 * g for (k, v), g in zip(params.items(), grads)}
        outer = functional_call(model, adapted, (torch.randn(4, 3),))
        return torch.autograd.grad(outer, list(params.values()))

    torch.manual_seed(1)
    with ckpt_guard.policy("off"):
        plain = _Plain(net.block)
        reference = meta_gradient(plain)
    torch.manual_seed(1)
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        got = meta_gradient(net)
    assert_all_close(got, reference)
    assert COMPOSABLE_ACTION in {e.action for e in events}


class _Plain(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.tanh(self.block(x)).sum()


# --------------------------------------------------------------------------
# what a block can be


def test_non_tensor_arguments_keywords_and_structured_outputs():
    block = _block()
    bias = torch.randn(3)

    def fn(u, scale, *, shift, tag):
        h = block(u)
        return {"out": torch.tanh(h) * scale + shift, "extra": (h.sum(0), tag, torch.arange(3))}

    def loss(ckpt, t):
        out = ckpt(fn, t, 0.5, shift=bias, tag="kept")
        assert out["extra"][1] == "kept" and out["extra"][2].dtype == torch.int64
        return out["out"].pow(2).sum() + out["extra"][0].sin().sum()

    x = torch.randn(4, 3)
    reference = grad(lambda t: loss(lambda f, *a, **k: f(*a, **k), t))(x)
    got = grad(lambda t: loss(ckpt_guard.checkpoint, t))(x)
    torch.testing.assert_close(got, reference)


@pytest.mark.parametrize("holder", ["module", "bound-method", "partial", "partial-of-method", "hf-style-partial"])
def test_callables_and_buffers(holder):
    """Parameters and buffers are lifted wherever the module sits; integer tensors ride along."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

        def forward(self, x, position_ids=None, offset=0.0):
            h = self.lin(x) * self.scale + offset
            return h if position_ids is None else h + position_ids.float()[:, None]

    torch.manual_seed(0)
    layer = Layer()
    positions = torch.arange(4)
    function = {
        "module": layer,
        "bound-method": layer.forward,
        "partial": functools.partial(layer, offset=0.5),
        "partial-of-method": functools.partial(layer.forward, offset=0.5),
        # transformers 5.x: partial(forward, self, **kwargs), integer positions among the kwargs
        "hf-style-partial": functools.partial(Layer.forward, layer, position_ids=positions, offset=0.5),
    }[holder]
    params = {k: v.detach() for k, v in layer.named_parameters()}
    x = torch.randn(4, 3)

    def loss(ckpt, p):
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(layer, p):
            return torch.tanh(ckpt(function, x)).sum()

    reference = grad(lambda p: loss(lambda f, t: f(t), p))(params)
    got = grad(lambda p: loss(ckpt_guard.checkpoint, p))(params)
    assert_all_close(list(got.values()), list(reference.values()))


def test_dropout_draws_the_same_numbers_in_the_recompute():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)

    def run(ckpt):
        torch.manual_seed(7)
        return grad(lambda t: ckpt(block, t).pow(2).sum())(x)

    reference = run(lambda f, t: f(t))
    got = run(ckpt_guard.checkpoint)
    torch.testing.assert_close(got, reference)
    # the test can fail: another mask gives other gradients
    torch.manual_seed(8)
    other = grad(lambda t: block(t).pow(2).sum())(x)
    assert not torch.allclose(other, reference)


def test_nested_checkpoints_inside_run_plainly():
    inner, outer = _block(), torch.nn.Linear(3, 3)

    def block(t):
        return outer(checkpoint(inner, t, use_reentrant=False))

    x = torch.randn(4, 3)
    reference = grad(lambda t: torch.tanh(outer(inner(t))).sum())(x)
    with ckpt_guard.record() as events:
        got = grad(lambda t: torch.tanh(ckpt_guard.checkpoint(block, t)).sum())(x)
    torch.testing.assert_close(got, reference)
    assert events == []


def test_drift_the_recompute_cannot_undo_is_still_caught():
    """A train/eval switch before backward (CKG106); a default-dtype switch is replayed."""
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    params = {k: v.detach() for k, v in block.named_parameters()}
    x = torch.randn(2, 4)

    def loss(p):
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(block, p):
            out = ckpt_guard.checkpoint(block, x)
        block.eval()  # between the forward and the recompute
        return out.sum()

    with pytest.raises(CheckpointCompositionError) as info:
        grad(loss)(params)
    assert info.value.rule.id == "CKG106"
    block.train()


# --------------------------------------------------------------------------
# blocks that reach their layer through functions they hold


def _checkpointer(how: str, **options):
    """``ckpt_guard.checkpoint``, or torch's non-reentrant checkpoint (for policy fallback to reroute)."""
    if how == "fallback":
        return functools.partial(checkpoint, use_reentrant=False, **options)
    return functools.partial(ckpt_guard.checkpoint, **options)


@contextlib.contextmanager
def _fallback_quietly():
    """Policy fallback, its warnings (tested elsewhere) silenced."""
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        yield


def _wrapped(fn):
    """A functools.wraps decorator (a NaN check, a timer): the block is its wrapper."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class _HelperBuilt(torch.nn.Module):
    """Its checkpointed block is built by helpers: the layer sits two function hops away."""

    def __init__(self, shape: str, checkpointed=None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.checkpointed = checkpointed
        layer = self.layer
        if shape == "helper":
            def inner(t):
                return torch.tanh(layer(t))

            self.block = lambda t: inner(t) * 2
        else:
            self.block = _wrapped(lambda t: torch.tanh(layer(t)))

    def forward(self, x):
        return self.checkpointed(self.block, x) if self.checkpointed else self.block(x)


@pytest.mark.parametrize("shape", ["helper", "decorator"])
@pytest.mark.parametrize("how", ["ckpt_guard.checkpoint", "fallback"])
def test_layers_behind_held_functions_are_lifted(shape, how):
    """Before, the layer was not found: zero gradients under grad, an internal assert under vmap(grad)."""
    torch.manual_seed(0)
    run = _checkpointer(how)
    model, plain = _HelperBuilt(shape, run), _HelperBuilt(shape)
    plain.load_state_dict(model.state_dict())
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs = torch.randn(3, 4)

    def batch(net):
        return grad(lambda p: functional_call(net, p, (xs,)).pow(2).sum())(params)

    with _fallback_quietly():
        got = [_per_sample_grads(model, params, xs), batch(model)]
    reference = [_per_sample_grads(plain, params, xs), batch(plain)]
    for g, r in zip(got, reference):
        assert all(v.abs().sum() > 0 for v in r.values())
        torch.testing.assert_close(g, r)


def test_long_helper_chains_are_walked_and_huge_holdings_are_bounded():
    """A chain of pure helpers is walked to its end (nothing unseen); a block holding a huge
    list stops the walk at its budget and says so."""
    import time

    from ckpt_guard._state import block_reads as _reads

    layer = torch.nn.Linear(4, 4)

    def innermost(t):
        return layer(t)

    chain = innermost
    for _ in range(10):
        chain = (lambda f: lambda t: f(t))(chain)
    found = _reads.reads_of(chain).complete()
    assert not found.unseen and found.modules == (layer,)
    # the helpers the block calls are its reads (CKG108 missed a step of ``layer`` once): the rules count it, as
    # a module the block may use only in part
    assert _reads.reads_of(chain).partial == (layer,)

    class Holder:
        pass

    holder = Holder()
    holder.items = list(range(1_000_000))
    started = time.perf_counter()
    found = _reads.reads_of(lambda t: holder.items and t).complete()
    assert found.unseen and time.perf_counter() - started < 0.5


class _TiedLM(torch.nn.Module):
    """Embedding and output layer share one weight, the body checkpointed."""

    def __init__(self, checkpointed=None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.checkpointed = checkpointed

    def body(self, ids):
        return self.head(torch.tanh(self.emb(ids)))

    def forward(self, ids):
        return self.checkpointed(self.body, ids) if self.checkpointed else self.body(ids)


@pytest.mark.parametrize("how", ["ckpt_guard.checkpoint", "fallback"])
def test_tied_weights_get_both_shares_of_the_gradient(how):
    """Before, the second alias read the original tensor: its share of the gradient was lost."""
    torch.manual_seed(0)
    run = _checkpointer(how)
    model, plain = _TiedLM(run), _TiedLM()
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 10, (5,))
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert list(params) == ["emb.weight"]

    def grads(net):
        return grad(lambda p: functional_call(net, p, (ids,)).logsumexp(-1).sum())(params)

    with _fallback_quietly():
        got = grads(model)
    torch.testing.assert_close(got, grads(plain))


def _per_sample_grads(net, params, xs, *extra):
    def loss(p, x):
        return functional_call(net, p, (x[None], *extra)).pow(2).sum()

    return vmap(grad(loss), in_dims=(None, 0))(params, xs)


class _FrozenNormNet(torch.nn.Module):
    """Linear + BatchNorm in eval mode (frozen statistics, as DP-SGD fine-tuning does)."""

    def __init__(self, checkpointed=None) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh())
        self.checkpointed = checkpointed

    def forward(self, x):
        return self.checkpointed(self.block, x) if self.checkpointed else self.block(x)


@pytest.mark.parametrize("how", ["ckpt_guard.checkpoint", "fallback"])
def test_eval_batchnorm_buffers_are_not_differentiated(how):
    """Before: 'native_batch_norm' is not differentiable with respect to argument 'running_mean'."""
    torch.manual_seed(0)
    run = _checkpointer(how)
    model, plain = _FrozenNormNet(run), _FrozenNormNet()
    with torch.no_grad():
        model.block[1].running_mean.uniform_(-1, 1)
        model.block[1].running_var.uniform_(0.5, 2)
    plain.load_state_dict(model.state_dict())
    model.eval(), plain.eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs = torch.randn(3, 4)
    with _fallback_quietly():
        got = _per_sample_grads(model, params, xs)
    torch.testing.assert_close(got, _per_sample_grads(plain, params, xs))


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("how", ["ckpt_guard.checkpoint", "fallback"])
def test_an_input_returned_as_is(how, mask_dtype):
    """A block that passes its mask through: before, torch refused ('returned as-is as output')."""
    run = _checkpointer(how)
    x, mask = torch.randn(3, 4), torch.ones(3, 4, dtype=mask_dtype)

    def block(h, m):
        return torch.tanh(h) * m, m

    def loss(h, checkpointed):
        out, m = run(block, h, mask) if checkpointed else block(h, mask)
        return (out * m).sum()

    with _fallback_quietly():
        got = grad(lambda h: loss(h, True))(x)
    torch.testing.assert_close(got, grad(lambda h: loss(h, False))(x))


def test_complex_output_differentiated_twice():
    """Before: 'grad can be implicitly created only for real scalar outputs' (a complex <o, c>)."""
    x = torch.randn(3, 4)

    def inner(checkpointed):
        block = (lambda t: ckpt_guard.checkpoint(torch.fft.fft, t)) if checkpointed else torch.fft.fft
        return lambda t: block(t).abs().pow(2).sum()

    got = grad(lambda h: grad(inner(True))(h).pow(2).sum())(x)
    torch.testing.assert_close(got, grad(lambda h: grad(inner(False))(h).pow(2).sum())(x))


class _MetaNet(torch.nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.b1 = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh())
        self.b2 = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.out = torch.nn.Linear(16, 1)
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in (self.b1, self.b2):
            x = ckpt_guard.checkpoint(block, x) if self.checkpointed else block(x)
        return self.out(x)


def _meta_gradients(checkpointed: bool):
    """MAML: two inner steps under torch.func.grad, the outer loss on the adapted weights, .backward()."""
    torch.manual_seed(0)
    net = _MetaNet(checkpointed)
    xs, ys, xq, yq = torch.randn(8, 4), torch.randn(8, 1), torch.randn(8, 4), torch.randn(8, 1)
    fast = dict(net.named_parameters())
    for _ in range(2):
        g = grad(lambda p: ((functional_call(net, p, (xs,)) - ys) ** 2).mean())(fast)
        fast = {k: fast[k] - 0.1 * g[k] for k in fast}
    ((functional_call(net, fast, (xq,)) - yq) ** 2).mean().backward()
    return {k: v.grad for k, v in net.named_parameters()}


@pytest.mark.parametrize("policy", [None, "strict"])
def test_public_checkpoint_in_mamls_outer_loss(policy):
    """Outside transforms, under a functional_call swap: before, torch's recompute ran after the
    swap ended, on the module's own weights (silently wrong without install, CKG101 under strict)."""
    reference = _meta_gradients(False)
    ckpt_guard.uninstall()
    with (ckpt_guard.policy(policy) if policy else contextlib.nullcontext()):
        got = _meta_gradients(True)
    torch.testing.assert_close(got, reference)


def test_public_checkpoint_without_a_swap_is_torchs():
    """No swap, no transform: torch's own non-reentrant checkpoint runs (bitwise), not the recompute here."""
    block = _block()
    x = torch.randn(4, 3, requires_grad=True)
    before = _composable.counters.RECOMPUTES
    ckpt_guard.checkpoint(block, x).pow(2).sum().backward()
    got = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
    assert _composable.counters.RECOMPUTES == before
    x.grad = None
    block.zero_grad(set_to_none=True)
    checkpoint(block, x, use_reentrant=False).pow(2).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(got, [x.grad, *(p.grad for p in block.parameters())]))


@pytest.mark.parametrize("where", ["eager", "under grad"])
def test_public_checkpoint_takes_torchs_options_the_same_way_everywhere(where):
    """use_reentrant=False and torch's own options are options in both paths, never the block's."""
    block = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    seen = []

    def run(t):
        return ckpt_guard.checkpoint(
            lambda u, scale: (seen.append(scale), block(u) * scale)[1], t, scale=2.0,
            use_reentrant=False, determinism_check="none", debug=False,
        ).sum()

    if where == "eager":
        x.requires_grad_()
        run(x).backward()
    else:
        grad(run)(x)
    assert seen and all(s == 2.0 for s in seen)


def test_public_checkpoint_refuses_use_reentrant_true():
    with pytest.raises(ValueError, match=r"use_reentrant=True\): it is torch's non-reentrant checkpoint"):
        ckpt_guard.checkpoint(torch.sin, torch.randn(2), use_reentrant=True)


@pytest.mark.parametrize("how", ["ckpt_guard.checkpoint", "fallback"])
def test_selective_checkpointing_context_fn_under_grad(how):
    """Before: torch's SAC cache could not line up with a functional recompute ("not found in storage").
    The policy is now kept by the composable recompute's own modes (tests/test_save_policies.py)."""
    import torch.utils.checkpoint as tuc

    if not hasattr(tuc, "create_selective_checkpoint_contexts"):
        pytest.skip(f"torch {torch.__version__} has no selective activation checkpointing")

    def keep_matmuls(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return tuc.CheckpointPolicy.MUST_SAVE if keep else tuc.CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, keep_matmuls)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 4)
    params = {k: v.detach() for k, v in mlp.named_parameters()}
    run = _checkpointer(how, context_fn=context_fn)

    def loss(p, checkpointed):
        return (functional_call(mlp, p, (x,)) if not checkpointed else run(lambda t: functional_call(mlp, p, (t,)), x)).pow(2).sum()

    with _fallback_quietly():
        got = grad(lambda p: loss(p, True))(params)
    torch.testing.assert_close(got, grad(lambda p: loss(p, False))(params))


class _Scaler:
    """A callable object of the user's: a number, and a layer, in its attributes."""

    def __init__(self, layer, k: float) -> None:
        self.layer = layer
        self.k = k

    def __call__(self, t):
        return torch.tanh(self.layer(t)) * self.k


@pytest.mark.parametrize("how", ["ckpt_guard.checkpoint", "fallback"])
def test_callable_objects_are_looked_into(how):
    """Before, any object of the user's class was unseen: the composable recompute refused it
    (strict raised CKG001; fallback ran it without checkpointing)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    scaler = _Scaler(layer, 2.0)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    xs = torch.randn(4, 3)
    run = _checkpointer(how)

    def per_sample(checkpointed):
        def loss(p, x):
            return _with_params(layer, p, lambda: (run(scaler, x) if checkpointed else scaler(x)).sum())

        return vmap(grad(loss), in_dims=(None, 0))(params, xs)

    before = _composable.counters.RECOMPUTES
    with ckpt_guard.policy("strict" if how == "ckpt_guard.checkpoint" else "fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        got = per_sample(True)
    assert _composable.counters.RECOMPUTES > before
    torch.testing.assert_close(got, per_sample(False))


def _with_params(module, params, thunk):
    """Run ``thunk`` with ``module``'s parameters swapped for ``params`` (functional_call's swap)."""
    with torch.nn.utils.stateless._reparametrize_module(module, params):
        return thunk()


def _make_helper(weight):
    def helper(t):
        return t @ weight

    return helper


class _Box:
    pass


@pytest.mark.parametrize("other_path", ["a helper's closure", "an object's attribute"])
def test_a_lifted_closure_tensor_reachable_another_way_is_lifted_there_too(other_path):
    """The block's graph is rebuilt with the lifted tensor wherever it holds it (before: refused, and
    before that silently wrong gradients, or torch's internal assert)."""
    x = torch.randn(4, 3)

    def loss(w, checkpointed=True):
        if other_path == "a helper's closure":
            helper = _make_helper(w)
        else:
            box = _Box()
            box.w = w
            helper = lambda t: t @ box.w  # noqa: E731
        block = lambda t: torch.tanh(t @ w + helper(t))  # noqa: E731
        return (ckpt_guard.checkpoint(block, x) if checkpointed else block(x)).sum()

    w = torch.randn(3, 3)
    before = _composable.counters.RECOMPUTES
    with ckpt_guard.policy("strict"):
        got = grad(loss)(w)
    assert _composable.counters.RECOMPUTES > before
    torch.testing.assert_close(got, grad(lambda v: loss(v, checkpointed=False))(w))


def test_public_checkpoint_under_a_swap_of_another_models_parameters_when_installed():
    """A functional_call that swaps in another model's nn.Parameters, .backward() after it: the
    installed guard tracks the swap, so ckpt_guard.checkpoint uses the recompute that binds them."""
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    x = torch.randn(5, 4)

    class Outer(torch.nn.Module):
        def __init__(self, checkpointed):
            super().__init__()
            self.net = student
            self.checkpointed = checkpointed

        def forward(self, t):
            return ckpt_guard.checkpoint(self.net, t) if self.checkpointed else self.net(t)

    def teacher_grads(checkpointed):
        teacher.zero_grad(set_to_none=True)
        out = functional_call(Outer(checkpointed), {f"net.{k}": v for k, v in teacher.named_parameters()}, (x,))
        out.pow(2).sum().backward()
        return [p.grad for p in teacher.parameters()]

    reference = teacher_grads(False)
    ckpt_guard.install("strict")
    torch.testing.assert_close(teacher_grads(True), reference)
