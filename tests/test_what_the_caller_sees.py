"""What a checkpointed block hands its caller is what the plain block hands it: aliases, and no made-up gradients.

Two ways a caller sees more than numbers, each crossed with the transforms a
torch.func user differentiates through:

* **an output that is the block's input, or a view of it** (``nn.Identity``,
  ``nn.Flatten``, a block returning its input after updating it in place, a
  tuple with a view): the caller may update it in place, and without
  checkpointing that update reaches the input.  The composable recompute hands
  the caller the plain run's own tensor there (a Function's output cannot be a
  view under torch.func): before, it handed a copy, and every later read of the
  input was wrong, under strict too;
* **``.grad`` left None** where the loss does not reach a parameter: an eager
  ``.backward()`` over a torch.func result (a gradient penalty) leaves plain
  autograd's None, never a zeros tensor (an optimizer with weight decay steps a
  parameter whose ``.grad`` is a tensor, and skips one whose ``.grad`` is None).

Each program runs without checkpointing (the reference), through
``ckpt_guard.checkpoint`` (strict), and through torch's checkpoint (under the
guard's fallback); the results are compared with the reference.  Where the
plain code raises eagerly (the tuple's Linear saved the input the caller then
writes into), torch's own checkpoint, which ``ckpt_guard.checkpoint`` is outside
torch.func, raises the same error.  (Under torch.func the Function is handed a
copy of an aliased input: where the plain backward saved that input, the plain
code raises and the checkpointed one returns the gradient of the values its
forward saw: ``docs/limits.md``.)
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, hessian, jacrev, jvp, vjp, vmap
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_guard

DTYPE = torch.float64


def _plain(function, *args):
    return function(*args)


def _torch(function, *args):
    return torch_checkpoint(function, *args, use_reentrant=False)


#: entry -> (policy, checkpoint function)
ENTRIES = {"ckpt_guard strict": ("strict", ckpt_guard.checkpoint), "torch, guard fallback": ("fallback", _torch)}


# --------------------------------------------------------------------------
# blocks returning an alias of their input


def _identity(x):
    return x


def _view(x):  # nn.Flatten then nn.Unflatten
    return x.reshape(-1).view(x.shape)


def _updated_then_returned(x):  # an in-place block returning its input (ReLU(inplace=True) on a copy)
    x.mul_(2.0)
    return x


LINEAR = torch.nn.Linear(4, 4).to(DTYPE)


def _pair(x):  # an output it computes, and a view of its input
    return torch.tanh(LINEAR(x)), x[..., :2]


ALIASING = {"identity": _identity, "view": _view, "updated then returned": _updated_then_returned, "pair": _pair}


def _caller(block, ckpt):
    """The caller updates the block's aliasing output in place, then reads the block's input."""

    def loss(x):
        h = x * 1.5
        out = ckpt(block, h)
        alias = out[1] if isinstance(out, tuple) else out
        alias.mul_(3.0)
        made = out[0].pow(2).sum() if isinstance(out, tuple) else 0.0
        return (torch.sin(h) * h).sum() + made

    return loss


X = torch.linspace(-1.0, 1.0, 12, dtype=DTYPE).reshape(3, 4)
V = torch.linspace(0.5, -0.5, 12, dtype=DTYPE).reshape(3, 4)

TRANSFORMS = {
    "grad": lambda f: grad(f)(X),
    "vmap(grad)": lambda f: vmap(grad(f))(torch.stack([X, 2 * X])),
    "jacrev": lambda f: jacrev(f)(X),
    "jvp(grad)": lambda f: jvp(grad(f), (X,), (V,)),
    "hessian": lambda f: hessian(f)(X),
    "vjp(grad)": lambda f: vjp(grad(f), X)[1](V),
    "grad(grad)": lambda f: grad(lambda u: grad(f)(u).pow(2).sum())(X),
    ".backward()": lambda f: _eager_grad(f),
}


def _eager_grad(f):
    x = X.clone().requires_grad_()
    f(x).backward()
    return x.grad


def _leaves(value):
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("block", list(ALIASING))
def test_an_output_aliasing_the_input_updated_in_place_reaches_the_input(block, transform, entry):
    policy, ckpt = ENTRIES[entry]
    run = TRANSFORMS[transform]
    try:
        reference = _leaves(run(_caller(ALIASING[block], _plain)))
    except RuntimeError as plain_error:  # the write reaches a tensor autograd saved: the checkpointed code raises too
        assert "modified by an inplace operation" in str(plain_error)
        ckpt_guard.install(policy, rules={})
        try:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                run(_caller(ALIASING[block], ckpt))
        finally:
            ckpt_guard.uninstall()
        return
    ckpt_guard.install(policy, rules={})
    try:
        got = _leaves(run(_caller(ALIASING[block], ckpt)))
    finally:
        ckpt_guard.uninstall()
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("block", ["identity", "view", "updated then returned"])
def test_a_block_returning_only_aliases_is_not_packed(block):
    """Every output an input or a view of one: nothing to save, the plain run is the result (no Function)."""
    from ckpt_guard import _composable

    packed = _composable.counters.PACKED
    reference = grad(_caller(ALIASING[block], _plain))(X)
    got = grad(_caller(ALIASING[block], ckpt_guard.checkpoint))(X)
    torch.testing.assert_close(got, reference)
    assert _composable.counters.PACKED == packed


def test_an_identity_blocks_output_is_its_input():
    """Under grad, the block's output is the caller's tensor itself, as without checkpointing."""
    seen = []

    def loss(x):
        h = x * 1.5
        seen.append((ckpt_guard.checkpoint(_identity, h), h))
        return seen[-1][0].sum()

    grad(loss)(X)
    out, h = seen[0]
    assert out is h


# --------------------------------------------------------------------------
# .grad left None where the loss does not reach a parameter


def _gradient_penalty(model, ckpt):
    """A linear block: its gradient with respect to the input does not depend on its bias."""

    def loss(x):
        return ckpt(model, x).sum()

    return loss


PENALTIES = {
    "grad": lambda f: grad(f)(X).pow(2).sum(),
    "vmap(grad)": lambda f: vmap(grad(f))(torch.stack([X, 2 * X])).pow(2).sum(),
    "jacrev": lambda f: jacrev(f)(X).pow(2).sum(),
    "vjp": lambda f: vjp(f, X)[1](torch.ones((), dtype=DTYPE))[0].pow(2).sum(),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("transform", list(PENALTIES))
def test_a_parameter_the_loss_does_not_reach_keeps_grad_none(transform, entry):
    policy, ckpt = ENTRIES[entry]
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4).to(DTYPE)
        if checkpointed:
            ckpt_guard.install(policy, rules={})
        try:
            PENALTIES[transform](_gradient_penalty(model, ckpt if checkpointed else _plain)).backward()
        finally:
            if checkpointed:
                ckpt_guard.uninstall()
        results.append((model.weight.grad, model.bias.grad))
    (weight, bias), (weight_ckpt, bias_ckpt) = results
    assert bias is None  # the program's own fact, measured: the penalty does not reach the bias
    assert bias_ckpt is None, f"the bias's .grad is {bias_ckpt!r} where the plain code leaves None"
    torch.testing.assert_close(weight_ckpt, weight)


# --------------------------------------------------------------------------
# what the block computes reads requires_grad as at the call


def _branches_on_an_intermediate(x, w):
    h = x @ w
    return h.sin() if h.requires_grad else 2 * h.cos()


W = torch.linspace(-0.8, 0.9, 16, dtype=DTYPE).reshape(4, 4)
XS = torch.stack([X, X.flip(0)])


def _maml(ckpt, w):
    def task(x):  # an inner grad step per task (vmap on top of grad at the call), the outer loss eager
        inner = grad(lambda v: ckpt(_branches_on_an_intermediate, x, v).pow(2).sum())(w)
        return ckpt(_branches_on_an_intermediate, x, w - 0.1 * inner).pow(2).sum()

    return vmap(task)(XS).sum()


def _jvp_then_backward(ckpt, w):
    out, tangent = jvp(lambda x: ckpt(_branches_on_an_intermediate, x, w), (X,), (V,))
    return out.pow(2).sum() + tangent.pow(2).sum()


def _jvp_primal_then_backward(ckpt, w):
    out, _ = jvp(lambda x: ckpt(_branches_on_an_intermediate, x, w), (X,), (V,))
    return out.pow(2).sum()


INTERMEDIATE_FLOWS = {
    "MAML": _maml,
    "jvp, its primal then .backward()": _jvp_primal_then_backward,
    "vmap, then .backward()": lambda ckpt, w: vmap(lambda x: ckpt(_branches_on_an_intermediate, x, w))(XS).pow(2).sum(),
    "grad, then .backward()": lambda ckpt, w: grad(lambda x: ckpt(_branches_on_an_intermediate, x, w).sum())(X).pow(2).sum(),
    "jvp, then .backward()": pytest.param(_jvp_then_backward, marks=pytest.mark.xfail(
        strict=True, reason="known limit (docs/limits.md): the tangent's recompute runs under its own jvp level, "
        "which wraps every input, so a parameter the call read requiring grad reads False there")),
}


@pytest.mark.parametrize("flow", INTERMEDIATE_FLOWS.values(), ids=list(INTERMEDIATE_FLOWS))
def test_a_block_branching_on_an_intermediates_requires_grad(flow):
    """The recompute's top level is the call's kind (MAML's outer backward recomputes the inner step
    with a vmap on top, where the call had its grad level on top): ``x @ w`` reads as it did."""
    results = []
    for ckpt in (_plain, ckpt_guard.checkpoint):
        w = W.clone().requires_grad_()
        flow(ckpt, w).backward()
        results.append(w.grad)
    torch.testing.assert_close(results[1], results[0])


def _two_outputs(first, second):
    def block(x):
        return torch.tanh(first(x)), second(x)

    return block


UNUSED_FLOWS = {
    "vmap, then .backward()": lambda block, ckpt: vmap(lambda x: ckpt(block, x)[0].pow(2).sum())(XS).sum(),
    "grad, then .backward()": lambda block, ckpt: grad(lambda x: ckpt(block, x)[0].pow(2).sum())(X).pow(2).sum(),
    "jvp, then .backward()": lambda block, ckpt: sum(
        t.pow(2).sum() for t in jvp(lambda x: ckpt(block, x)[0], (X,), (V,))
    ),
}


@pytest.mark.parametrize("flow", list(UNUSED_FLOWS))
def test_an_output_the_caller_ignores_leaves_its_parameters_grad_none(flow):
    """The block's second output is never used: plain autograd leaves its Linear's ``.grad`` None."""
    results = []
    for ckpt in (_plain, ckpt_guard.checkpoint):
        torch.manual_seed(0)
        first, second = torch.nn.Linear(4, 4).to(DTYPE), torch.nn.Linear(4, 4).to(DTYPE)
        UNUSED_FLOWS[flow](_two_outputs(first, second), ckpt).backward()
        results.append((first.weight.grad, second.weight.grad))
    (first_plain, second_plain), (first_ckpt, second_ckpt) = results
    assert second_plain is None  # measured: the plain program leaves it None
    assert second_ckpt is None, f"the unused output's Linear got .grad {second_ckpt!r}"
    torch.testing.assert_close(first_ckpt, first_plain)


def _with_a_no_grad_view(x):
    y = torch.sin(x)
    with torch.no_grad():
        constant = y[0]  # a view made under no_grad: a constant to the caller
    return y, constant


@pytest.mark.parametrize("transform", ["grad", "vmap(grad)", "jacrev", "jvp(grad)", "grad(grad)"])
def test_an_output_made_under_no_grad_is_a_constant(transform):
    """At a grad level such a view reads requires_grad=True without a grad_fn: the recompute's
    backward raised "does not require grad and does not have a grad_fn" (review finding)."""

    def caller(ckpt):
        def loss(x):
            y, constant = ckpt(_with_a_no_grad_view, x * 1.0)
            return (y * constant).sum()

        return loss

    reference = _leaves(TRANSFORMS[transform](caller(_plain)))
    got = _leaves(TRANSFORMS[transform](caller(ckpt_guard.checkpoint)))
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


def _writes_one_view_reads_another(a, b):
    a.mul_(2.0)  # writes a, and so b's first row
    return b.sin(), a * 1.0


@pytest.mark.parametrize("transform", ["grad", "vmap(grad)", "jvp(grad)", "grad(grad)"])
def test_a_write_into_an_input_overlapping_another_is_refused(transform):
    """Overlapping views given as two inputs, one written in place: each recompute starts from a
    copy of its own, so the gradient skipped the write (review finding, wrong in every element).
    Refused (class overlapping-write): strict raises, fallback's result is the plain run."""

    def caller(ckpt):
        def loss(x):
            h = x * 1.0
            s, o = ckpt(_writes_one_view_reads_another, h[0], h[0:2])
            return s.pow(2).sum() + o.pow(2).sum() + (h.cos() * h).sum()

        return loss

    reference = _leaves(TRANSFORMS[transform](caller(_plain)))
    with pytest.raises(ckpt_guard.CheckpointCompositionError, match="overlapping-write"):
        TRANSFORMS[transform](caller(ckpt_guard.checkpoint))
    with ckpt_guard.policy("fallback"), pytest.warns(ckpt_guard.CheckpointCompositionWarning, match="overlapping-write"):
        got = _leaves(TRANSFORMS[transform](caller(ckpt_guard.checkpoint)))
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)
