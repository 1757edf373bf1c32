"""Forward-mode AD over what a block holds (CKG008), in the shapes users write it.

torch's tutorial for forward AD with modules puts dual weights on the module
with ``setattr``; ``functional_call`` with dual parameters does it through a
swap. Either way no *input* of the checkpoint is dual, and the reentrant
checkpoint drops the tangent without a word. Each case is a differential
test: the uncheckpointed reference, raw torch checkpointing, and the guarded
run, with expectations read from the rule table for the installed torch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard._rules import rule_by_id
from ckpt_guard._versions import installed

RULE = rule_by_id("CKG008")
pytestmark = pytest.mark.skipif(
    not RULE.holds_on(installed()), reason=f"CKG008 does not hold on torch {torch.__version__} (table: {RULE.torch_range})"
)


class Net(torch.nn.Module):
    """A model that checkpoints its body inside forward, as gradient checkpointing does."""

    def __init__(self, run) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 2)
        self.run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(self.body, x))


def _model(run, training: bool) -> Net:
    torch.manual_seed(0)
    return Net(run).train(training)


def _tangents(model):
    torch.manual_seed(1)
    return {name: torch.randn_like(p) for name, p in model.named_parameters()}


def jvp_setattr(run, training: bool):
    """torch's forward-AD-with-modules recipe: dual weights set as plain attributes."""
    model = _model(run, training)
    tangents = _tangents(model)
    params = {name: p.detach() for name, p in model.named_parameters()}
    x = torch.randn(5, 3)
    with fwAD.dual_level():
        for name, p in params.items():
            path, _, attr = name.rpartition(".")
            owner = model.get_submodule(path)
            delattr(owner, attr)
            setattr(owner, attr, fwAD.make_dual(p, tangents[name]))
        primal, tangent = fwAD.unpack_dual(model(x))
    return primal, tangent


def jvp_functional_call(run, training: bool):
    """functional_call with dual parameters; the checkpoint runs inside the swapped forward."""
    model = _model(run, training)
    tangents = _tangents(model)
    x = torch.randn(5, 3)
    with fwAD.dual_level():
        duals = {name: fwAD.make_dual(p.detach(), tangents[name]) for name, p in model.named_parameters()}
        primal, tangent = fwAD.unpack_dual(functional_call(model, duals, (x,)))
    return primal, tangent


CASES = [
    pytest.param(jvp_setattr, True, id="setattr-train"),
    pytest.param(jvp_setattr, False, id="setattr-eval"),
    pytest.param(jvp_functional_call, True, id="functional_call-train"),
    pytest.param(jvp_functional_call, False, id="functional_call-eval"),
]

#: What fallback runs: use_reentrant=False, except inside functional_call's swap,
#: where a backward after the swap ends would recompute with other tensors
#: (CKG101's risk), so it runs the block without checkpointing.
FALLBACK_ACTION = {
    jvp_setattr: "fallback: use_reentrant=False",
    jvp_functional_call: "fallback: no checkpoint",
}


def _plain(block, x):
    return block(x)


def _reentrant(block, x):
    return checkpoint(block, x, use_reentrant=True)


def _non_reentrant(block, x):
    return checkpoint(block, x, use_reentrant=False)


@contextlib.contextmanager
def _guard(policy):
    ckpt_guard.install(policy, rules={})
    try:
        yield
    finally:
        ckpt_guard.uninstall()


@pytest.mark.parametrize("case, training", CASES)
def test_raw_reentrant_drops_the_tangent_as_the_table_says(case, training):
    assert RULE.symptom_for("reentrant") == "silently wrong"
    ref_primal, ref_tangent = case(_plain, training)
    assert ref_tangent is not None and ref_tangent.abs().sum() > 0
    primal, tangent = case(_reentrant, training)
    torch.testing.assert_close(primal, ref_primal)
    # the symptom: the body's part of the JVP is missing (only the head's is left), nothing raised
    assert tangent is not None and not torch.allclose(tangent, ref_tangent)


@pytest.mark.parametrize("case, training", CASES)
def test_strict_raises_ckg008(case, training):
    with _guard("strict"), pytest.raises(ckpt_guard.CheckpointCompositionError, match=r"\[CKG008\]") as info:
        case(_reentrant, training)
    assert info.value.rule.id == "CKG008"


@pytest.mark.parametrize("case, training", CASES)
def test_fallback_gives_the_reference_tangent(case, training):
    ref_primal, ref_tangent = case(_plain, training)
    with _guard("fallback"), ckpt_guard.record() as events:
        with pytest.warns(ckpt_guard.CheckpointCompositionWarning, match=r"\[CKG008\]"):
            primal, tangent = case(_reentrant, training)
    torch.testing.assert_close(primal, ref_primal)
    torch.testing.assert_close(tangent, ref_tangent)
    assert [(e.rule_id, e.action) for e in events] == [("CKG008", FALLBACK_ACTION[case])]


@pytest.mark.parametrize("case, training", CASES)
def test_non_reentrant_is_untouched(case, training):
    """No rule fires for use_reentrant=False here: the guarded result is torch's, bit for bit."""
    raw_primal, raw_tangent = case(_non_reentrant, training)
    with _guard("strict"), ckpt_guard.record() as events:
        primal, tangent = case(_non_reentrant, training)
    assert events == []
    assert torch.equal(primal, raw_primal) and torch.equal(tangent, raw_tangent)


def test_dual_input_is_ckg004_not_ckg008():
    """A dual input makes torch raise (CKG004); CKG008 is only about tangents inside the block."""
    w = torch.randn(3, 3)
    with fwAD.dual_level():
        dual_w = fwAD.make_dual(w, torch.randn(3, 3))
        dual_x = fwAD.make_dual(torch.randn(4, 3), torch.randn(4, 3))
        with _guard("strict"), pytest.raises(ckpt_guard.CheckpointCompositionError) as info:
            checkpoint(lambda u: u @ dual_w, dual_x, use_reentrant=True)
    assert info.value.rule.id == "CKG004"


def test_no_dual_anywhere_stays_quiet():
    """Inside a dual level, a block that reads no dual tensor loses nothing: no alarm, same result."""
    model = _model(_reentrant, True)
    x = torch.randn(5, 3, requires_grad=True)
    with fwAD.dual_level():
        raw = model(x)
        with _guard("strict"), ckpt_guard.record() as events:
            guarded = model(x)
    assert events == []
    assert torch.equal(raw, guarded)


# --------------------------------------------------------------------------
# issue 46, item 11: a torch.library custom_op with only register_autograd, under forward mode

def _custom_op():
    name = "ckpt_guard_tests::sin_with_backward_only"
    if _CUSTOM_OP:
        return _CUSTOM_OP[0]
    def sin(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)

    # the schema spelt out: under ``from __future__ import annotations`` torch 2.4 cannot read the hints
    op = torch.library.custom_op(name, mutates_args=(), schema="(Tensor x) -> Tensor")(sin)
    op.register_fake(lambda x: torch.empty_like(x))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x)

    op.register_autograd(backward, setup_context=setup_context)
    _CUSTOM_OP.append(op)
    return op


_CUSTOM_OP: list = []  # defined once per process (a library op's name is global)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_a_custom_op_without_a_forward_formula_under_forward_mode_is_the_plain_program(transform, policy):
    """Its output carries no tangent (torch.func.jvp gives the plain program a zero one); the block is
    packed (its Linear's parameters require grad: an eager backward may follow), and the jvp rule
    recomputed it under a grad level to make that zero, which such an op refuses ("must override the
    setup_context staticmethod"). The zero is handed on instead."""
    if not hasattr(torch.library, "custom_op"):
        pytest.skip("torch.library.custom_op is torch 2.4's newest API; not on this torch")
    op = _custom_op()
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    v = torch.randn(2, 3, dtype=torch.float64)

    def run(ckpt):
        def f(t):
            return ckpt(lambda u: op(lin(u)), t)

        if transform == "jvp":
            return torch.func.jvp(f, (x,), (v,))
        return torch.func.jacfwd(f)(x)

    try:
        reference = run(lambda block, t: block(t))
    except RuntimeError as plain:  # torch 2.4: such an op refuses forward mode in the plain program too
        with ckpt_guard.policy(policy), pytest.raises(RuntimeError, match="setup_context"):
            run(ckpt_guard.checkpoint)
        assert "setup_context" in str(plain)
        return
    with ckpt_guard.policy(policy):
        got = run(ckpt_guard.checkpoint)
    for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(reference)):
        torch.testing.assert_close(g, r)
