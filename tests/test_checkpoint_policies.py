"""Ready save policies (``ckpt_guard.checkpoint_policies``), names, and ``ckpt_guard.saved_residuals``.

Each policy is crossed with the transforms it is meant for and compared with
the uncheckpointed code (``torch.testing.assert_close``); what runs again is
counted with torch's FLOP counter (below the recompute: an output handed back
is not counted) or read from the recompute's counters.  The conformance
matrix crosses ``dots_saveable``-like and save-everything policies with every
module kind; here each ready policy gets the transforms.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap

import ckpt_guard
from conftest import leaves_and_flops
from ckpt_guard._composable import counters

HAS_POLICIES = hasattr(tuc, "create_selective_checkpoint_contexts")  # torch 2.5+
pytestmark = pytest.mark.usefixtures("guard")
needs_policies = pytest.mark.skipif(
    not HAS_POLICIES,
    reason=f"torch {torch.__version__} has no selective checkpointing API (2.5+): ready policies refuse "
    "(test_context_fn_needs_torch_2_5 checks the error)",
)
DTYPE = torch.float64


class Block(nn.Module):
    """Linear, tanh (named "inner"), Linear; optionally naming a view of the first matmul's output."""

    def __init__(self, name_a_view: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 6)
        self.name_a_view = name_a_view

    def forward(self, h):
        made = self.a(h)
        if self.name_a_view:
            ckpt_guard.checkpoint_name(made.view(-1), "flat")
        inner = ckpt_guard.checkpoint_name(torch.tanh(made), "inner")
        return h + self.b(inner)


class Model(nn.Module):
    def __init__(self, **block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(**block) for _ in range(2))
        self.context_fn = None  # None: no checkpoint

    def forward(self, h):
        for block in self.blocks:
            h = block(h) if self.context_fn is None else ckpt_guard.checkpoint(block, h, context_fn=self.context_fn)
        return h


def _loss(model):
    return lambda p, x: functional_call(model, p, (x,)).tanh().pow(2).sum()


STEPS = {
    "grad": lambda m, p, x: grad(_loss(m))(p, x),
    "vmap(grad)": lambda m, p, x: vmap(grad(_loss(m)), in_dims=(None, 0))(p, x.unsqueeze(1)),
    "jvp(grad)": lambda m, p, x: jvp(lambda p: grad(_loss(m))(p, x), (p,), (p,)),
    "vjp(grad)": lambda m, p, x: vjp(lambda p: grad(_loss(m))(p, x), p)[1](p),
}


def _runs(step, *context_fns, **block):
    """(leaves, matmul FLOPs) for: no checkpoint, then each context_fn (None: no policy)."""
    torch.manual_seed(0)
    model = Model(**block).to(DTYPE)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(4, 6, dtype=DTYPE)
    runs = []
    for context_fn in ("reference", *context_fns):
        model.context_fn = None if context_fn == "reference" else context_fn or tuc.noop_context_fn
        runs.append(leaves_and_flops(lambda: STEPS[step](model, params, x), {"aten.mm", "aten.addmm"}))
    return runs


def _assert_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def _policies():
    from ckpt_guard import checkpoint_policies as cp

    return cp


@needs_policies
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("name", ["dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable",
                                  "everything_saveable", "names"])
def test_each_ready_policy_under_each_transform(name, step):
    cp = _policies()
    policy = cp.save_only_these_names("inner") if name == "names" else getattr(cp, name)
    (reference, plain), (no_policy, recomputed), (got, flops) = _runs(step, None, cp.context_fn(policy))
    _assert_equal(no_policy, reference)
    _assert_equal(got, reference)
    if name in ("dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable") and step != "vjp(grad)":
        assert flops == plain, f"{name}: a saved matmul ran again"
    elif name in ("nothing_saveable", "names"):
        assert flops == recomputed, f"{name} saves no matmul: every one runs again"


@needs_policies
@pytest.mark.parametrize("step", ["grad", "jvp(grad)"])
def test_a_named_value_is_handed_back_and_its_producer_not_run_again(step):
    cp = _policies()
    ran = dict(counters.RECOMPUTED_UNDER_POLICY)
    handed = counters.HANDED_BACK
    (reference, _), (got, _) = _runs(step, cp.context_fn(cp.save_only_these_names("inner")))
    _assert_equal(got, reference)
    assert counters.HANDED_BACK > handed
    tanh = torch.ops.aten.tanh.default
    assert counters.RECOMPUTED_UNDER_POLICY.get(tanh, 0) == ran.get(tanh, 0), "the named tanh ran again"


@needs_policies
@pytest.mark.parametrize("step, product", [("grad", "aten.addmm.default"), ("vmap(grad)", "aten.mm.default")])
def test_naming_a_view_of_a_linears_output_keeps_its_matrix_product(step, product):
    """Named: a view of the first Linear's output.  Under grad that output is addmm's; under vmap a Linear
    runs as mm, then a bias add: the mm is kept (the add is recomputed from it), not the add."""
    cp = _policies()
    report = ckpt_guard.saved_residuals(
        _runs, step, None, cp.context_fn(cp.save_only_these_names("flat")), name_a_view=True,
    )
    (reference, plain), (_, recomputed), (got, flops) = report.result
    _assert_equal(got, reference)
    kept = [v.op for b in report.blocks for v in b.values]
    assert kept and set(kept) == {product}, kept
    assert plain < flops < recomputed, "the named Linear's matrix product ran again"


@needs_policies
def test_a_listed_name_the_block_never_gives_warns_naming_it():
    cp = _policies()
    with pytest.warns(UserWarning, match=r"never named 'attn_out'.*it named \['inner'\]") as caught:
        (reference, _), (got, _) = _runs("grad", cp.context_fn(cp.save_only_these_names("inner", "attn_out")))
    _assert_equal(got, reference)
    assert {os.path.basename(w.filename) for w in caught if "attn_out" in str(w.message)} == {"test_checkpoint_policies.py"}


@needs_policies
def test_a_named_input_is_reported_not_saved():
    cp = _policies()

    def block(h):
        ckpt_guard.checkpoint_name(h, "given")
        return torch.tanh(h)

    x = torch.randn(3, dtype=DTYPE)
    context_fn = cp.context_fn(cp.save_only_these_names("given"))
    report = ckpt_guard.saved_residuals(grad(lambda x: ckpt_guard.checkpoint(block, x, context_fn=context_fn).sum()), x)
    torch.testing.assert_close(report.result, 1 - torch.tanh(x) ** 2)
    assert report.blocks[0].names["given"][1].startswith("no operation of the block made it")


@needs_policies
def test_names_outside_torch_func_are_kept_by_ckpt_guard_checkpoint():
    """torch's selective checkpointing cannot see names: ckpt_guard.checkpoint runs its own recompute."""
    cp = _policies()
    torch.manual_seed(0)
    model = Model().to(DTYPE)
    x = torch.randn(4, 6, dtype=DTYPE)
    grads = []
    handed = counters.HANDED_BACK
    for context_fn in (None, cp.context_fn(cp.save_only_these_names("inner"))):
        model.context_fn = context_fn
        model.zero_grad()
        model(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    _assert_equal(grads[1], grads[0])
    assert counters.HANDED_BACK - handed == 2, "each block's named tanh handed back once"


@needs_policies
def test_names_given_to_torchs_own_checkpoint_warn_that_nothing_is_saved():
    cp = _policies()
    block = Block().to(DTYPE)
    x = torch.randn(4, 6, dtype=DTYPE, requires_grad=True)
    context_fn = cp.context_fn(cp.save_only_these_names("inner"))
    with ckpt_guard.policy("off"), pytest.warns(UserWarning, match="torch's selective checkpointing cannot see"):
        out = tuc.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    torch.testing.assert_close(out, block(x))


@needs_policies
def test_saved_residuals_lists_each_block_what_it_saved_and_each_recompute():
    cp = _policies()
    torch.manual_seed(0)
    model = Model().to(DTYPE)
    model.context_fn = cp.context_fn(cp.dots_saveable)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(4, 6, dtype=DTYPE)
    report = ckpt_guard.saved_residuals(grad(_loss(model)), params, x)
    _assert_equal(list(report.result.values()), list(STEPS["grad"](model, params, x).values()))
    assert len(report.blocks) == 2
    first = report.blocks[0]
    assert [(v.op, v.shape, v.nbytes) for v in first.values] == [
        ("aten.addmm.default", (4, 12), 4 * 12 * 8), ("aten.addmm.default", (4, 6), 4 * 6 * 8),
    ]
    assert {v.where for v in first.values} == {f"test_checkpoint_policies.py:{Block.forward.__code__.co_firstlineno + 1}",
                                               f"test_checkpoint_policies.py:{Block.forward.__code__.co_firstlineno + 5}"}
    assert "grad(level 1)" in first.levels
    [recompute] = first.recomputes
    assert recompute.handed_back == {"aten.addmm.default": 2}
    assert recompute.ran["aten.tanh.default"] == 1 and "aten.addmm.default" not in recompute.ran
    text = str(report)
    assert "aten.addmm.default" in text and "(4, 12)" in text and "handed back: aten.addmm.default x2" in text
    assert report.saved_bytes == 2 * (4 * 12 + 4 * 6) * 8


def test_saved_residuals_without_a_policy_lists_what_ran_again():
    torch.manual_seed(0)
    block = Block().to(DTYPE)
    params = {k: v.detach() for k, v in block.named_parameters()}
    x = torch.randn(4, 6, dtype=DTYPE)

    def loss(p):
        return ckpt_guard.checkpoint(lambda h: functional_call(block, p, (h,)), x).sum()

    report = ckpt_guard.saved_residuals(grad(loss), params)
    [entry] = report.blocks
    assert entry.values == [] and "no save policy" in entry.policy
    [recompute] = entry.recomputes
    assert recompute.ran["aten.addmm.default"] == 2 and not recompute.handed_back
    assert "saved in the forward: nothing" in str(report)


def test_saved_residuals_says_when_no_block_went_through_the_composable_recompute():
    block = Block().to(DTYPE)
    x = torch.randn(4, 6, dtype=DTYPE, requires_grad=True)
    report = ckpt_guard.saved_residuals(lambda: ckpt_guard.checkpoint(block, x).sum().backward())
    assert report.blocks == [] and "no block went through" in str(report)


def test_bad_input_is_named():
    assert ckpt_guard.PolicyError.__module__ == "ckpt_guard._composable.saving"
    with pytest.raises(TypeError, match=r"checkpoint_name\(value, name=3\): the name must be a str"):
        ckpt_guard.checkpoint_name(torch.ones(1), 3)
    if not HAS_POLICIES:
        return
    cp = _policies()
    with pytest.raises(TypeError, match=r"context_fn\('dots'\).*dots_saveable"):
        cp.context_fn("dots")
    with pytest.raises(TypeError, match=r"save_only_these_names\(\).*one or more names"):
        cp.save_only_these_names()
    with pytest.raises(TypeError, match=r"save_only_these_names\(3,\)"):
        cp.save_only_these_names(3)


@pytest.mark.skipif(HAS_POLICIES, reason="torch has the selective checkpointing API: context_fn works")
def test_context_fn_needs_torch_2_5():
    cp = _policies()
    with pytest.raises(RuntimeError, match=rf"torch >= 2.5.*torch {re.escape(torch.__version__)}"):
        cp.context_fn(lambda *a: True)


@needs_policies
def test_offload_dots_on_the_cpu_is_dots_saveable():
    cp = _policies()
    if not hasattr(tuc.CheckpointPolicy, "MUST_CPU_OFFLOAD"):
        with pytest.raises(RuntimeError, match=f"torch {re.escape(torch.__version__)}'s CheckpointPolicy has no MUST_CPU_OFFLOAD"):
            cp.offload_dots(None, torch.ops.aten.mm.default)
        return
    (reference, plain), (got, flops) = _runs("grad", cp.context_fn(cp.offload_dots))
    _assert_equal(got, reference)
    assert flops == plain


@needs_policies
@pytest.mark.skipif(not torch.cuda.is_available(), reason="moving saved values to the CPU needs an accelerator")
def test_offload_dots_keeps_cpu_copies_of_device_matmuls():  # pragma: no cover - no accelerator in CI
    cp = _policies()
    if not hasattr(tuc.CheckpointPolicy, "MUST_CPU_OFFLOAD"):
        pytest.skip(f"torch {torch.__version__} has no CPU offload policy")
    torch.manual_seed(0)
    model = Model().to(DTYPE).cuda()
    model.context_fn = cp.context_fn(cp.offload_dots)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(4, 6, dtype=DTYPE, device="cuda")
    report = ckpt_guard.saved_residuals(grad(_loss(model)), params, x)
    assert all(v.offloaded for b in report.blocks for v in b.values)
    model.context_fn = None
    _assert_equal(list(report.result.values()), list(grad(_loss(model))(params, x).values()))


@needs_policies
def test_torch_compile_of_a_block_with_names_and_a_ready_policy_is_the_eager_result():
    """Under torch.compile ckpt_guard.checkpoint is torch's own (a higher-order op); names are no-ops there."""
    cp = _policies()
    torch.manual_seed(0)
    model = Model().to(DTYPE)
    model.context_fn = cp.context_fn(cp.dots_saveable)
    x = torch.randn(4, 6, dtype=DTYPE)
    results = []
    for run in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad()
        out = run(x)
        out.pow(2).sum().backward()
        results.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
    _assert_equal(results[1], results[0])


GLOBAL_WEIGHT = torch.randn(6, 6, dtype=DTYPE, requires_grad=True)


@needs_policies
def test_names_on_a_block_ckpt_guards_recompute_refuses_warn_and_the_result_is_torchs():
    """A block reading a global tensor that needs a gradient (refusal class global-tensor): torch's checkpoint
    runs it, which cannot see names; the warning says so, and the gradient is right."""
    cp = _policies()

    def block(h):
        return ckpt_guard.checkpoint_name(torch.tanh(h @ GLOBAL_WEIGHT), "inner")

    x = torch.randn(4, 6, dtype=DTYPE)
    GLOBAL_WEIGHT.grad = None
    block(x).sum().backward()
    expected = GLOBAL_WEIGHT.grad.clone()
    GLOBAL_WEIGHT.grad = None
    context_fn = cp.context_fn(cp.save_only_these_names("inner"))
    with pytest.warns(UserWarning, match=r"save_only_these_names\('inner'\): ckpt_guard's recompute cannot take this "
                                         r"block .*nothing is saved by name"):
        ckpt_guard.checkpoint(block, x, context_fn=context_fn).sum().backward()
    torch.testing.assert_close(GLOBAL_WEIGHT.grad, expected)


@needs_policies
def test_a_policy_error_under_the_matmul_operator_is_not_turned_into_an_operand_error():
    """torch turns a TypeError raised under ``a @ b`` into NotImplemented: PolicyError is a ValueError."""
    cp = _policies()
    w = torch.randn(4, 4, dtype=DTYPE)

    def block(x, w):
        return torch.tanh(x @ w) @ w

    context_fn = cp.context_fn(lambda ctx, op, *args, **kwargs: "save")
    with pytest.raises(ckpt_guard.PolicyError, match=r"returned 'save' for aten\.mm\.default.*CheckpointPolicy\.MUST_SAVE"):
        grad(lambda w: ckpt_guard.checkpoint(block, torch.ones(2, 4, dtype=DTYPE), w, context_fn=context_fn).sum())(w)


def _named_grad_report(block, x, w, *names):
    """``saved_residuals`` of grad over ``w`` of ``block(x, w)`` (summed), checkpointed with a policy saving
    ``names``; its gradient checked against the uncheckpointed one."""
    context_fn = _policies().context_fn(_policies().save_only_these_names(*names))
    report = ckpt_guard.saved_residuals(grad(lambda w: ckpt_guard.checkpoint(block, x, w, context_fn=context_fn).sum()), w)
    torch.testing.assert_close(report.result, grad(lambda w: block(x, w).sum())(w))
    return report


@needs_policies
def test_a_saved_value_written_in_place_after_it_was_named_is_reported_not_kept():
    w = torch.randn(4, 4, dtype=DTYPE)

    def block(x, w):
        h = ckpt_guard.checkpoint_name(torch.mm(x, w), "h")
        h.mul_(2)
        return torch.tanh(h)

    report = _named_grad_report(block, torch.randn(3, 4, dtype=DTYPE), w, "h")
    [entry] = report.blocks
    assert report.saved_bytes == 0 and entry.kept == []
    assert entry.values[0].dropped.startswith("aten.mul_.Tensor wrote into it")
    assert "not saved: aten.mul_.Tensor wrote into it" in str(report) and "NOT kept" in str(report)


@needs_policies
def test_context_fn_takes_a_list_of_operations_and_names_a_policy_given_as_context_fn():
    cp = _policies()
    (reference, plain), (got, flops) = _runs("grad", cp.context_fn([torch.ops.aten.addmm.default, torch.ops.aten.mm.default]))
    _assert_equal(got, reference)
    assert flops == plain
    with pytest.raises(TypeError, match=r"context_fn\(\[.*not 'mm'"):
        cp.context_fn([torch.ops.aten.mm.default, "mm"])
    x = torch.randn(4, 6, dtype=DTYPE)
    with pytest.raises(TypeError, match=r"context_fn=dots_saveable\): that is a save policy.*checkpoint_policies\.context_fn\(dots_saveable\)"):
        ckpt_guard.checkpoint(Block().to(DTYPE), x, context_fn=cp.dots_saveable)
    with pytest.raises(TypeError, match=r"separate arguments: save_only_these_names\(\*\['a', 'b'\]\)"):
        cp.save_only_these_names(["a", "b"])


@needs_policies
def test_names_on_a_pytree_name_each_tensor_and_a_non_tensor_is_reported():
    w = torch.randn(4, 4, dtype=DTYPE)

    def block(x, w):
        a, b = ckpt_guard.checkpoint_name((torch.mm(x, w), torch.mm(w, x.T)), "pair")
        ckpt_guard.checkpoint_name(3, "three")
        return torch.tanh(a).sum() + torch.tanh(b).sum()

    report = _named_grad_report(block, torch.randn(4, 4, dtype=DTYPE), w, "pair", "three")
    [entry] = report.blocks
    assert [v.op for v in entry.kept] == ["aten.mm.default", "aten.mm.default"]
    assert "not a tensor" in entry.names["three"][1]
