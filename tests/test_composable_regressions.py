"""The composable recompute on the programs a demanding user's review found wrong, crashing or refused.

Each program runs without checkpointing (the reference) and through
``ckpt_guard.checkpoint`` (strict and fallback) and torch's checkpoint under
fallback (``ENTRIES``); each result equals the reference, or, under strict only
and where the test allows it, is a ``CheckpointCompositionError`` naming a
refusal class.  Where a test says "recomputed", the memory saving is checked to
be kept (the block ran again in the backward).  The conformance matrix
(``tests/conformance.py``) crosses these with every transform; these are the
exact shapes reported.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, _composable

pytestmark = pytest.mark.usefixtures("guard")
DTYPE = torch.float64


def plain(function, *args):
    return function(*args)


def torch_checkpoint(function, *args):
    return checkpoint(function, *args, use_reentrant=False)


ENTRIES = {"public strict": ("strict", ckpt_guard.checkpoint), "public fallback": ("fallback", ckpt_guard.checkpoint),
           "torch fallback": ("fallback", torch_checkpoint)}


def _leaves(value):
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def run(program, entry):
    policy, ckpt = ENTRIES[entry]
    with ckpt_guard.policy(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _leaves(program(ckpt))


def assert_right(program, entry, refusable=False, recomputed=None):
    """``program(ckpt)`` equals ``program(plain)``; strict may refuse (if ``refusable``)."""
    torch.manual_seed(0)
    reference = _leaves(program(plain))
    before = _composable.counters.RECOMPUTES
    torch.manual_seed(0)
    try:
        got = run(program, entry)
    except CheckpointCompositionError as refused:
        assert refusable and ENTRIES[entry][0] == "strict", f"refused where it should have run: {refused}"
        assert "refusal class" in str(refused)
        return None
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)
    if recomputed is not None:
        assert (_composable.counters.RECOMPUTES > before) == recomputed
    return got


def _linear(n=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(n, n).to(DTYPE)


X = torch.randn(2, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------
# item 5: forward mode recomputes in the caller's grad mode


LIN = _linear()


def _branching(t):  # nn.TransformerEncoder's fast-path choice, in miniature
    return torch.tanh(LIN(t)) if torch.is_grad_enabled() else torch.sin(LIN(t))


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("how", ["jvp", "jacfwd", "hessian", "jvp(grad)", "jvp then .backward()"])
def test_forward_mode_takes_the_callers_grad_mode_branch(how, entry):
    ones = torch.ones_like(X)

    def program(ckpt):
        f = lambda x: ckpt(_branching, x)  # noqa: E731
        if how == "jvp":
            return jvp(f, (X,), (ones,))
        if how == "jacfwd":
            return jacfwd(f)(X)
        if how == "hessian":
            return hessian(lambda x: f(x).pow(2).sum())(X)
        if how == "jvp(grad)":
            return jvp(grad(lambda x: f(x).pow(2).sum()), (X,), (ones,))
        LIN.zero_grad(set_to_none=True)
        out, tangent = jvp(f, (X,), (ones,))
        (out.sum() + tangent.pow(2).sum()).backward()
        return out, tangent, LIN.weight.grad

    assert_right(program, entry)


# --------------------------------------------------------------------------
# item 6: a write into a tensor the block was given


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("write", ["add_", "setitem", "copy_", "+="])
def test_a_write_into_a_given_tensor_keeps_its_gradient(write, entry):
    lin = _linear()

    def block(h, acc):
        y = torch.tanh(lin(h))
        if write == "add_":
            acc.add_(y.sum(0))
        elif write == "setitem":
            acc[0] = y.sum()
        elif write == "copy_":
            acc.copy_(y.sum(0) * 2)
        else:
            acc += y.mean(0)
        return y * acc

    def program(ckpt):
        def loss(x):
            acc = x[0] * 0.5  # made by the caller, needs a gradient
            out = ckpt(block, x, acc)
            return out.sum() + acc.pow(2).sum()  # the caller reads the updated acc too
        return grad(loss)(X)

    assert_right(program, entry, recomputed=True)


# --------------------------------------------------------------------------
# item 7: never the block's Python twice for one forward


class _SideEffects(torch.nn.Module):
    """A counter it computes with, a list it appends to, an iterator it draws from; and a read the
    run-time proof refuses partway through (a tensor reached by a lookup no walk follows)."""

    def __init__(self, lookup):
        super().__init__()
        self.lin = _linear()
        self.calls, self.log, self.steps = 0, [], iter(range(100))
        self.lookup = lookup

    def forward(self, h):
        self.calls += 1
        self.log.append(self.calls)
        step = next(self.steps)
        out = torch.tanh(self.lin(h)) * (1.0 + step) / self.calls
        return out * self.lookup()  # refused here, after every side effect


HIDDEN = torch.linspace(0.5, 1.5, 3, dtype=DTYPE).requires_grad_()


def _hidden():
    import sys

    return getattr(sys.modules[__name__], "HID" + "DEN")


@pytest.mark.parametrize("policy", ["fallback", "warn"])
def test_a_refusal_partway_keeps_the_one_plain_run(policy):
    def program(ckpt):
        block = _SideEffects(_hidden)
        g = grad(lambda x: ckpt(block, x).pow(2).sum())(X)
        return g, block.calls, len(block.log), next(block.steps)

    expected = program(plain)
    with ckpt_guard.policy(policy), pytest.warns(ckpt_guard.CheckpointCompositionWarning, match="unlifted-read"):
        got = program(ckpt_guard.checkpoint)
    torch.testing.assert_close(got[0], expected[0])
    assert got[1:] == expected[1:] == (1, 1, 1)  # each side effect once
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match="unlifted-read"):
        program(ckpt_guard.checkpoint)


# --------------------------------------------------------------------------
# item 8: rarer reads and writes


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_read_inside_disable_torch_function_is_not_a_constant(entry):
    w = torch.randn(3, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))

    def program(ckpt):
        holder = {"w": None}

        def block(h):
            with torch._C.DisableTorchFunction():
                scale = holder["w"] * 2  # unseen by any mode
            return torch.tanh(h @ scale)

        def loss(w):
            holder["w"] = w  # set by the caller: a tensor a transform differentiates
            return ckpt(block, X).pow(2).sum()

        return grad(loss)(w)

    got = assert_right(program, entry, refusable=True)
    if got is not None:
        assert got[0].abs().sum() > 0


class _ReadsInBackward(torch.autograd.Function):
    """An autograd.Function whose backward reads a tensor that requires grad (a scale it holds)."""

    scale = None

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2 * _ReadsInBackward.scale


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_an_autograd_function_reading_a_gradient_tensor_in_its_backward(entry):
    def program(ckpt):
        scale = torch.tensor(1.5, dtype=DTYPE, requires_grad=True)
        _ReadsInBackward.scale = scale
        lin = _linear()
        first = grad(lambda x: ckpt(lambda t: _ReadsInBackward.apply(lin(t)), x).sum())(X)
        first.pow(2).sum().backward()
        return first, scale.grad if scale.grad is not None else torch.zeros((), dtype=DTYPE), lin.weight.grad

    assert_right(program, entry, refusable=True)


class _NoisyFunction(torch.autograd.Function):
    generator = None

    @staticmethod
    def forward(x):
        noise = torch.rand(x.shape, generator=_NoisyFunction.generator, dtype=x.dtype)
        return x * noise, noise

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, g, _):
        (noise,) = ctx.saved_tensors
        return g * noise


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_an_autograd_function_drawing_from_its_own_generator(entry):
    lin = _linear()

    def program(ckpt):
        _NoisyFunction.generator = torch.Generator().manual_seed(7)
        g = grad(lambda x: ckpt(lambda t: _NoisyFunction.apply(lin(t))[0], x).pow(2).sum())(X)
        return g, torch.rand(1, generator=_NoisyFunction.generator, dtype=DTYPE)  # left where it was

    assert_right(program, entry, refusable=True)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_global_forward_hook_removed_before_the_recompute(entry):
    lin = _linear()

    def program(ckpt):
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o * 3 if m is lin else None)
        try:
            out, pullback = vjp(lambda x: ckpt(lin, x).tanh(), X)
        finally:
            handle.remove()
        return out, pullback(torch.ones_like(out))

    assert_right(program, entry, refusable=True)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_closure_mask_changed_in_place_before_backward_raises_as_the_plain_code(entry):
    lin = _linear()
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=DTYPE)

    def program(ckpt):
        mask.fill_(1.0)
        mask[1] = 0.0
        lin.zero_grad(set_to_none=True)
        out = vmap(lambda x: ckpt(lambda t: torch.tanh(lin(t)) * mask, x))(X)
        mask.mul_(2)  # changed after the forward, before the eager backward
        out.sum().backward()
        return lin.weight.grad

    with pytest.raises(RuntimeError):
        program(plain)
    policy, ckpt = ENTRIES[entry]
    with ckpt_guard.policy(policy), warnings.catch_warnings(), pytest.raises(RuntimeError):
        warnings.simplefilter("ignore")
        program(ckpt)


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("kind", ["float64", "int64", "bool_"])
def test_a_numpy_scalar_set_on_a_shared_module_is_replayed(kind, entry):
    numpy = pytest.importorskip("numpy")

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.t = _linear(), 0

        def forward(self, h):
            return torch.tanh(self.lin(h) * (1.0 + float(self.t)))

    values = {"float64": [numpy.float64(0.5), numpy.float64(2.0)], "int64": [numpy.int64(1), numpy.int64(3)],
              "bool_": [numpy.bool_(True), numpy.bool_(False)]}[kind]

    def program(ckpt):
        shared = Shared()

        def loss(x):
            h = x
            for value in values:
                shared.t = value
                h = ckpt(shared, h)
            return h.pow(2).sum()

        return grad(loss)(X)

    assert_right(program, entry, recomputed=True)


# --------------------------------------------------------------------------
# items 9-12: what crashed where the plain code runs


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("inner", ["grad", "jacrev", "vmap"])
def test_a_transform_inside_the_block_under_an_outer_grad(inner, entry):
    lin = _linear()

    def energy(u):
        return torch.tanh(lin(u)).pow(2).sum()

    def block(h):  # forces as -dE/dh (interatomic potentials), a Jacobian penalty, a vmap over rows
        if inner == "grad":
            return h - 0.1 * grad(energy)(h)
        if inner == "jacrev":
            return h * jacrev(lambda u: torch.tanh(lin(u)).sum(0))(h).sum(0).sum(0)
        return vmap(lambda row: torch.tanh(lin(row)))(h)

    def program(ckpt):
        return grad(lambda x: ckpt(block, x).pow(2).sum())(X)

    assert_right(program, entry, recomputed=True)


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("how", ["+=", "relu(inplace=True)"])
def test_the_blocks_input_updated_in_place(how, entry):
    lin = _linear()
    pos = torch.linspace(0, 1, 3, dtype=DTYPE)

    def block(h):
        if how == "+=":
            h += pos
        else:
            h = torch.nn.functional.relu(h, inplace=True)
        return torch.tanh(lin(h))

    def program(ckpt):
        def loss(x):
            h = x * 1.5
            out = ckpt(block, h)
            return out.sum() + h.pow(2).sum()  # the caller reads its updated h too
        return grad(loss)(X)

    assert_right(program, entry, recomputed=True)


@pytest.mark.parametrize("inside", [False, True], ids=["the block", "called by the block"])
def test_a_compiled_function_under_grad(inside):
    """torch >= 2.6 runs it eagerly inside the block (dynamo cannot trace the proof's mode over
    torch.func's wrappers); torch 2.4-2.5 refuse a compiled block (class compiled)."""
    lin = _linear()
    compiled = torch.compile(lambda t: torch.tanh(lin(t)), backend="eager")
    block = (lambda t: compiled(t) * 2) if inside else compiled
    old = not hasattr(torch.compiler, "set_stance")

    def program(ckpt):
        return grad(lambda x: ckpt(block, x).pow(2).sum())(X)

    if old and inside:
        pytest.skip("torch < 2.6 has no eager stance: a compiled function inside a block is a documented limit")
    for entry in ENTRIES:
        assert_right(program, entry, refusable=old, recomputed=None if old else True)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_kwargs_forward_hook_removed_between_vjp_and_pullback(entry):
    def program(ckpt):
        lin = _linear()
        handle = lin.register_forward_hook(lambda m, args, kwargs, out: out * 2, with_kwargs=True)
        out, pullback = vjp(lambda x: ckpt(lin, x).tanh(), X)
        handle.remove()
        return out, pullback(torch.ones_like(out))

    assert_right(program, entry, refusable=True)


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("how", ["view", "data", "slice"])
def test_a_write_into_a_closure_tensor_through_a_view(how, entry):
    lin = _linear()

    def program(ckpt):
        buffer = torch.zeros(3, dtype=DTYPE)

        def block(h):
            y = torch.tanh(lin(h))
            target = {"view": buffer.view(3), "data": buffer.data, "slice": buffer[:]}[how]
            target.add_(1.0)  # a counter kept in a closure's tensor
            return y * 2

        lin.zero_grad(set_to_none=True)
        vmap(lambda x: ckpt(block, x))(X).pow(2).sum().backward()  # (grad raises for this without checkpointing)
        return lin.weight.grad, buffer  # the counter counted once

    assert_right(program, entry, refusable=True)


# --------------------------------------------------------------------------
# false refusals


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("how", ["detach", "no_grad"])
def test_a_tensor_read_as_a_constant_is_no_refusal(how, entry):
    lin = _linear()

    def program(ckpt):
        scale = {"value": None}

        def block(h):
            s = scale["value"]
            if how == "detach":
                s = s.detach()
            else:
                with torch.no_grad():
                    s = s * 1.0
            return torch.tanh(lin(h)) * s

        def loss(x, w):
            scale["value"] = w  # a tensor a transform differentiates, read as a constant only
            return ckpt(block, x).pow(2).sum()

        return grad(loss)(X, torch.linspace(0.5, 1.5, 3, dtype=DTYPE))

    assert_right(program, entry, recomputed=True)


# --------------------------------------------------------------------------
# real blocks


class BasicBlock(torch.nn.Module):
    """torchvision's ResNet BasicBlock, its residual added in place (``out += identity``)."""

    def __init__(self, c=2):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)
        self.conv2, self.bn2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return torch.relu(out)


class CNBlock(torch.nn.Module):
    """ConvNeXt's block: ``result += input``."""

    def __init__(self, c=2):
        super().__init__()
        self.dw, self.norm, self.pw = torch.nn.Conv2d(c, c, 3, padding=1, groups=c), torch.nn.GroupNorm(1, c), torch.nn.Conv2d(c, c, 1)

    def forward(self, x):
        result = self.pw(torch.nn.functional.gelu(self.norm(self.dw(x))))
        result += x
        return result


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("make", [BasicBlock, CNBlock, lambda: torch.nn.MultiheadAttention(4, 2, batch_first=True)],
                         ids=["BasicBlock", "CNBlock", "MultiheadAttention"])
def test_per_sample_gradients_of_real_blocks_with_in_place_writes(make, entry):
    torch.manual_seed(0)
    block = make().to(DTYPE).eval() if make is BasicBlock else make().to(DTYPE)
    attention = isinstance(block, torch.nn.MultiheadAttention)
    xs = torch.randn(2, 3, 4, dtype=DTYPE) if attention else torch.randn(2, 2, 4, 4, dtype=DTYPE)
    params = {k: v.detach() for k, v in block.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in block.named_buffers()}

    def call(p, b, x):
        if attention:
            mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
            return functional_call(block, (p, b), (x, x, x), {"attn_mask": mask, "need_weights": False})[0]
        return functional_call(block, (p, b), (x,))

    def program(ckpt):
        def loss(p, b, x):
            return ckpt(lambda t: call(p, b, t), x[None]).pow(2).sum()
        return vmap(grad(loss), in_dims=(None, None, 0))(params, buffers, xs)

    assert_right(program, entry, recomputed=True)


def _pullback_cases():
    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    linear = torch.nn.Linear(4, 4).double()
    params = {k: v.detach() for k, v in linear.named_parameters()}

    def weights_as_arguments(ckpt):  # the tensors differentiated are the block's arguments
        return vjp(lambda w: ckpt(lambda h, w: torch.tanh(h @ w), x, w).sum(0), w)

    def module_through_functional_call(ckpt):  # ... or a module's parameters, swapped in
        return vjp(lambda p: ckpt(lambda h: torch.tanh(functional_call(linear, p, (h,))), x).sum(0), params)

    def input_only(ckpt):
        return vjp(lambda h: ckpt(lambda h: torch.tanh(linear(h)), h).sum(0), x)

    return {"weights as arguments": weights_as_arguments, "functional_call": module_through_functional_call,
            "input only": input_only}


@pytest.mark.parametrize("case", list(_pullback_cases()))
@pytest.mark.parametrize("entry", ["ckpt_guard.checkpoint", "torch checkpoint under fallback"])
def test_jvp_of_a_pullback_called_after_its_vjp_returned(case, entry):
    """An HVP written as ``jvp(pullback)``: the saved tensors are the vjp's dead wrappers, and the jvp's level
    may carry the dead level's number; the recompute crashed in functorch ("escaped?") before."""
    make = _pullback_cases()[case]
    cotangent = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)

    def run(ckpt):
        _, pullback = make(ckpt)
        return torch.utils._pytree.tree_leaves(jvp(pullback, (cotangent,), (cotangent.flip(0),)))

    reference = run(lambda f, *a: f(*a))
    if entry == "ckpt_guard.checkpoint":
        got = run(ckpt_guard.checkpoint)
    else:
        with ckpt_guard.policy("fallback"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = run(lambda f, *a: checkpoint(f, *a, use_reentrant=False))
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


def _no_grad_inside(block):
    def f(x):
        h = x.sin()
        with torch.no_grad():
            k = block(h)
        return (h * k).sum()

    return f


NO_GRAD_STACKS = {
    "grad(grad)": lambda f, x: grad(lambda u: grad(f)(u).pow(2).sum())(x),
    "jvp(grad(grad))": lambda f, x: jvp(grad(lambda u: grad(f)(u).pow(2).sum()), (x,), (torch.ones_like(x),)),
    "vmap(grad(grad))": lambda f, x: vmap(grad(lambda u: grad(f)(u).pow(2).sum()))(torch.stack([x, -x])),
}


@pytest.mark.parametrize("stack", list(NO_GRAD_STACKS))
@pytest.mark.parametrize("parameters", ["frozen", "requiring grad"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_block_called_under_no_grad_inside_second_order_transforms(entry, parameters, stack):
    """The reviewer's program: every element was wrong (frozen Linear), or forward AD of
    silu_backward raised (SiLU, parameters requiring grad): the block's output is a constant
    to every level, and ckpt_guard.checkpoint now returns the plain run there."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU()).double()
    block.requires_grad_(parameters == "requiring grad")
    x = torch.randn(3, 4, dtype=DTYPE)
    reference = NO_GRAD_STACKS[stack](_no_grad_inside(block), x)
    policy, ckpt = ENTRIES[entry]
    with ckpt_guard.policy(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = NO_GRAD_STACKS[stack](_no_grad_inside(lambda h: ckpt(block, h)), x)
    for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(reference)):
        torch.testing.assert_close(g, r)


class _BranchesOnRequiresGrad(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x)) if x.requires_grad else self.lin(x).sin()


@pytest.mark.parametrize("stack", ["jvp(grad)", "hessian"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_block_branching_on_requires_grad_then_backward(entry, stack):
    """The reviewer's program: forward over reverse, then ``.backward()`` into the parameters
    and the input; a recompute ran the block with ``x.requires_grad`` False (the other branch)."""
    torch.manual_seed(0)
    block = _BranchesOnRequiresGrad().double()
    x0 = torch.randn(3, 4, dtype=DTYPE)

    def run(ckpt):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()

        def f(u):
            return (ckpt(block, u) * u).sum()

        out = jvp(grad(f), (x,), (torch.ones_like(x),))[1] if stack == "jvp(grad)" else hessian(f)(x)
        out.pow(2).sum().backward()
        return [out.detach(), x.grad, block.lin.weight.grad, block.lin.bias.grad]

    reference = run(plain)
    policy, ckpt = ENTRIES[entry]
    with ckpt_guard.policy(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(ckpt)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)
