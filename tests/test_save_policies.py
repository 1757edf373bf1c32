"""Save policies (torch's selective checkpointing) under torch.func: what the policy saves is not run again.

Each test runs a model of residual blocks three ways: without checkpointing
(the reference), checkpointed without a policy, and checkpointed with a
policy passed as torch's own ``context_fn=functools.partial(
create_selective_checkpoint_contexts, policy)``; results equal the reference,
and the matmul FLOPs that actually ran are counted by torch's FLOP counter (a
dispatch mode below the recompute's: an output handed back is not counted).
With matmuls saved, a first-order step runs exactly the reference's matmul
FLOPs; without the policy it runs more (so the count can tell).  The
conformance matrix crosses both policies ("save matmuls", "save everything")
with every module kind and transform for correctness.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev, jvp, stack_module_state, vjp, vmap

import ckpt_guard
from conftest import leaves_and_flops
from ckpt_guard._composable import counters
from ckpt_guard._composable.saving import PolicyError

pytestmark = [
    pytest.mark.usefixtures("guard"),
    pytest.mark.skipif(
        not hasattr(tuc, "create_selective_checkpoint_contexts"),  # the same as _HAS_POLICIES below
        reason=f"torch {torch.__version__} has only the compile-only private form of selective checkpointing "
        "(_pt2_selective_checkpoint_context_fn_gen); the conformance matrix runs that one",
    ),
]
DTYPE = torch.float64
aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def _policy(keep):
    def policy(ctx, op, *args, **kwargs):
        return tuc.CheckpointPolicy.MUST_SAVE if keep(op) else tuc.CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(tuc.create_selective_checkpoint_contexts, policy)


_HAS_POLICIES = hasattr(tuc, "create_selective_checkpoint_contexts")  # torch 2.5+
SAVE_MATMULS = _policy(lambda op: op in MATMULS) if _HAS_POLICIES else None
SAVE_EVERYTHING = _policy(lambda op: True) if _HAS_POLICIES else None


class Block(nn.Module):
    def __init__(self, in_place: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 6)
        self.in_place, self.dropout = in_place, dropout

    def forward(self, h):
        inner = self.a(h)
        if self.in_place:  # torchvision's BasicBlock writes into what a layer made (not idempotently here)
            inner.mul_(0.5).add_(0.25)
        inner = torch.tanh(inner)
        if self.dropout:
            inner = F.dropout(inner, self.dropout, training=True)
        return h + self.b(inner)


class Model(nn.Module):
    def __init__(self, **block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(**block) for _ in range(3))
        self.ckpt = None

    def forward(self, h):
        for block in self.blocks:
            h = block(h) if self.ckpt is None else self.ckpt(block, h)
        return h


def _ckpt(context_fn=None, through="ckpt_guard.checkpoint"):
    if through == "torch":
        return lambda block, h: tuc.checkpoint(block, h, use_reentrant=False, context_fn=context_fn or tuc.noop_context_fn)
    if context_fn is None:
        return ckpt_guard.checkpoint
    return lambda block, h: ckpt_guard.checkpoint(block, h, context_fn=context_fn)


def _loss(model):
    def loss(p, x):
        return functional_call(model, p, (x,)).tanh().pow(2).sum()
    return loss


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


STEPS = {
    "grad": lambda m, p, x: grad(_loss(m))(p, x),
    "vmap(grad)": lambda m, p, x: vmap(grad(_loss(m)), in_dims=(None, 0), randomness="different")(p, x.unsqueeze(1)),
    "jacrev": lambda m, p, x: jacrev(lambda p: functional_call(m, p, (x,)).sum(0))(p),
    "ensemble": lambda m, p, x: vmap(grad(_loss(m)), in_dims=(0, None), randomness="different")(
        stack_module_state([_with(m, p), _with(m, {k: v * 1.1 for k, v in p.items()})])[0], x),
    "vjp(grad)": lambda m, p, x: vjp(lambda p: grad(_loss(m))(p, x), p)[1](p),
    "grad(grad)": lambda m, p, x: grad(lambda p: sum(g.pow(2).sum() for g in grad(_loss(m))(p, x).values()))(p),
    "jvp(grad)": lambda m, p, x: jvp(lambda p: grad(_loss(m))(p, x), (p,), (p,)),
    "hessian": lambda m, p, x: hessian(lambda p: _loss(m)(p, x))(p),
}
FIRST_ORDER = ("grad", "vmap(grad)", "jacrev", "ensemble")


def _with(model, params):
    copy = Model().to(DTYPE)
    copy.load_state_dict(params)
    return copy


def _matmul_flops(run):
    """``run()``'s leaves and the matmul FLOPs that ran (FLOP counter's dispatch mode, without its module tracker)."""
    return leaves_and_flops(run, {str(op.overloadpacket) for op in MATMULS})


def _three_runs(step, ckpt_with_policy, **block):
    """(reference, its flops), (no policy, flops), (policy, flops): same seeds, same model."""
    torch.manual_seed(0)
    model = Model(**block).to(DTYPE)
    params = _params(model)
    x = torch.randn(4, 6, dtype=DTYPE)
    runs = []
    for ckpt in (None, _ckpt(), ckpt_with_policy):
        model.ckpt = ckpt
        torch.manual_seed(1)
        runs.append(_matmul_flops(lambda: STEPS[step](model, params, x)))
    return runs


def _assert_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("step", FIRST_ORDER)
def test_first_order_runs_no_saved_matmul_again(step):
    (reference, plain_flops), (no_policy, recompute_flops), (saved, saved_flops) = _three_runs(
        step, _ckpt(SAVE_MATMULS)
    )
    _assert_equal(no_policy, reference)
    _assert_equal(saved, reference)
    assert recompute_flops > plain_flops, "without a policy the recompute runs the matmuls again"
    assert saved_flops == plain_flops, f"a saved matmul ran again: {saved_flops} FLOPs against {plain_flops}"


@pytest.mark.parametrize("step", FIRST_ORDER)
def test_torchs_checkpoint_under_fallback_honours_the_policy(step):
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (reference, plain_flops), _, (saved, saved_flops) = _three_runs(step, _ckpt(SAVE_MATMULS, through="torch"))
    _assert_equal(saved, reference)
    assert saved_flops == plain_flops


@pytest.mark.parametrize("step", ["vjp(grad)", "grad(grad)"])
def test_reverse_over_reverse_hands_back_at_every_order(step):
    before_handed, before_ran = counters.HANDED_BACK, dict(counters.RECOMPUTED_UNDER_POLICY)
    (reference, _), (no_policy, recompute_flops), (saved, saved_flops) = _three_runs(step, _ckpt(SAVE_MATMULS))
    _assert_equal(no_policy, reference)
    _assert_equal(saved, reference)
    # each block is recomputed once for the first order and again for the second: 2 matmuls each time
    assert counters.HANDED_BACK - before_handed >= 3 * 2 * 2
    ran = {op: n - before_ran.get(op, 0) for op, n in counters.RECOMPUTED_UNDER_POLICY.items()}
    assert not any(ran.get(op) for op in MATMULS), ran
    assert saved_flops < recompute_flops


@pytest.mark.parametrize("step", ["jvp(grad)", "hessian"])
def test_under_forward_mode_no_saved_matmul_runs_again(step):
    """Forward over reverse (jvp(grad), hessian = jacfwd(jacrev)): the tangents' matmuls are saved and
    handed back too, matched by their arguments' fingerprints: exactly the reference's matmul FLOPs."""
    before = counters.HANDED_BACK
    (reference, plain_flops), (no_policy, recompute_flops), (saved, saved_flops) = _three_runs(
        step, _ckpt(SAVE_MATMULS)
    )
    _assert_equal(no_policy, reference)
    _assert_equal(saved, reference)
    assert counters.HANDED_BACK > before
    assert recompute_flops > plain_flops
    assert saved_flops == plain_flops, f"a saved matmul ran again: {saved_flops} FLOPs against {plain_flops}"


@pytest.mark.parametrize("step", ["jvp(grad)", "hessian"])
def test_under_forward_mode_a_saved_output_written_in_place_is_computed_again(step):
    (reference, _), _, (saved, _) = _three_runs(step, _ckpt(SAVE_MATMULS), in_place=True)
    _assert_equal(saved, reference)


def test_a_tangent_matmul_is_never_handed_to_a_primal_one():
    """Forward under jvp (primal and tangent matmuls, same shapes and strides, interleaved), backward of
    the primal output only (no forward mode: primal matmuls alone).  Matched by call count, the second
    primal matmul would get the first one's tangent product (measured: wrong gradients); the
    fingerprint check sees other arguments and computes it."""
    torch.manual_seed(0)
    a = torch.randn(6, 6, dtype=DTYPE, requires_grad=True)
    b = torch.randn(6, 6, dtype=DTYPE, requires_grad=True)
    x, v = torch.randn(4, 6, dtype=DTYPE), torch.randn(4, 6, dtype=DTYPE)
    da, db = torch.randn(6, 6, dtype=DTYPE), torch.randn(6, 6, dtype=DTYPE)

    def block(h, a, b):
        return torch.tanh(torch.tanh(h @ a) @ b)

    results = []
    for ckpt in (lambda f, *t: f(*t), lambda f, *t: ckpt_guard.checkpoint(f, *t, context_fn=SAVE_MATMULS)):
        a.grad = b.grad = None
        out, _ = jvp(lambda h, a_, b_: ckpt(block, h, a_, b_), (x, a, b), (v, da, db))
        out.pow(2).sum().backward()
        results.append((a.grad.clone(), b.grad.clone()))
    _assert_equal(results[1], results[0])


def _eager_after_vmap(model, how):
    """functorch's MAML (inner grad step per task under vmap, outer .backward()) or vmap then .backward()."""
    params = dict(model.named_parameters())
    xs = torch.randn(3, 4, 6, dtype=DTYPE, generator=torch.Generator().manual_seed(2))

    def task(x):
        if how == "vmap, then .backward()":
            return _loss(model)(params, x)
        inner = grad(_loss(model))(params, x)
        return _loss(model)({k: params[k] - 0.1 * inner[k] for k in params}, x)

    model.zero_grad()
    vmap(task)(xs).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["MAML", "vmap, then .backward()"])
def test_a_backward_outside_the_forwards_vmap_runs_no_saved_matmul_again(how):
    """The recompute there is batched by the Function's own vmap rule: matched by fingerprints."""
    torch.manual_seed(0)
    model = Model().to(DTYPE)
    runs = []
    for ckpt in (None, _ckpt()):
        model.ckpt = ckpt
        runs.append(_matmul_flops(lambda: _eager_after_vmap(model, how)))
    before_handed, before_ran = counters.HANDED_BACK, dict(counters.RECOMPUTED_UNDER_POLICY)
    model.ckpt = _ckpt(SAVE_MATMULS)
    report = ckpt_guard.saved_residuals(_matmul_flops, lambda: _eager_after_vmap(model, how))
    runs.append(report.result)
    (reference, plain_flops), (no_policy, recompute_flops), (saved, saved_flops) = runs
    _assert_equal(no_policy, reference)
    _assert_equal(saved, reference)
    assert counters.HANDED_BACK > before_handed
    # every recompute of every block (the eager backward's, batched by the vmap rule, among them)
    # was handed back every value its block's forward saved
    recomputes = [(len(block.values), r) for block in report.blocks for r in block.recomputes]
    assert any("vmap" in r.levels and "grad" in r.levels.split(">")[0] for _, r in recomputes)
    for n, r in recomputes:
        assert sum(r.handed_back.values()) == n and not r.note, (r.levels, r.handed_back, r.note)
    ran = {op: n - before_ran.get(op, 0) for op, n in counters.RECOMPUTED_UNDER_POLICY.items()}
    assert not any(ran.get(op) for op in MATMULS), ran
    assert saved_flops < recompute_flops
    if how != "MAML":  # MAML's outer step recomputes the inner backward's own matmuls (reverse over reverse)
        assert saved_flops == plain_flops


@pytest.mark.parametrize("step", ["grad", "vmap(grad)", "vjp(grad)"])
def test_a_saved_output_written_in_place_is_computed_again(step):
    """``mul_`` into a saved matmul's output: the saved value is no longer the matmul's; recomputed, right."""
    (reference, _), _, (saved, _) = _three_runs(step, _ckpt(SAVE_MATMULS), in_place=True)
    _assert_equal(saved, reference)


@pytest.mark.parametrize("step", ["grad", "vmap(grad)", "vjp(grad)"])
def test_saving_everything_keeps_random_draws_and_views_right(step):
    """Random ops are never handed back (the RNG is replayed from the block's start), nor views."""
    (reference, _), _, (saved, _) = _three_runs(step, _ckpt(SAVE_EVERYTHING), dropout=0.5)
    _assert_equal(saved, reference)


class TwoDraws(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, h):
        first = self.a(h) * torch.rand_like(h)  # two out-of-place draws (dropout's bernoulli_ is in place)
        return torch.tanh(first) * torch.rand_like(h)


def test_a_saved_random_draw_is_drawn_again_so_the_next_draw_matches():
    """A policy saving the first of two random draws: handing it back would skip a draw and move the second."""
    draws = []

    def first_draw_only(ctx, op, *args, **kwargs):
        if torch.Tag.nondeterministic_seeded in op.tags:
            draws.append(op)
            return tuc.CheckpointPolicy.MUST_SAVE if len(draws) % 2 == 1 else tuc.CheckpointPolicy.PREFER_RECOMPUTE
        return tuc.CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block = TwoDraws().to(DTYPE)
    params = _params(block)
    x = torch.randn(4, 6, dtype=DTYPE)
    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, first_draw_only)
    results = []
    for ckpt in (None, lambda f, h: ckpt_guard.checkpoint(f, h, context_fn=context_fn)):
        def loss(p):
            call = (lambda h: functional_call(block, p, (h,)))
            return (call(x) if ckpt is None else ckpt(call, x)).pow(2).sum()

        torch.manual_seed(1)
        results.append(grad(loss)(params))
    assert draws, "the policy was asked about the random draws"
    _assert_equal(list(results[1].values()), list(results[0].values()))


def test_a_policy_returning_something_else_is_named_in_a_clear_error():
    def confused(ctx, op, *args, **kwargs):
        return "save"

    model = Model().to(DTYPE)
    model.ckpt = _ckpt(functools.partial(tuc.create_selective_checkpoint_contexts, confused))
    with pytest.raises(PolicyError, match=r"returned 'save' for aten\.\w+.*CheckpointPolicy\.MUST_SAVE"):
        STEPS["grad"](model, _params(model), torch.randn(4, 6, dtype=DTYPE))
