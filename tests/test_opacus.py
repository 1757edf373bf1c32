"""Opacus' grad-sample hooks with non-reentrant checkpointing (CKG011; issue 27, section 4).

DP fine-tuning pairs Opacus' ``GradSampleModule`` with transformers'
``gradient_checkpointing_enable()``, whose default is non-reentrant.  Opacus' forward
hook takes each layer's input and counts the forward; non-reentrant checkpointing
runs it again in the recompute, so the count never comes back to zero and the
per-sample gradients are never published (Opacus' optimizer then fails with "N
parameters without grad_sample").  Reentrant checkpointing runs its forward under
no_grad, where the hook takes nothing: exact.  Each case runs three ways: without
checkpointing (the reference), raw torch, and guarded; expectations come from the
table (CKG011's claim on the installed torch).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import installed_under
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning
from ckpt_guard._rules import rule_by_id
from ckpt_guard._versions import installed

opacus = pytest.importorskip("opacus", reason="opacus is a test extra (torch >= 2.6; 1.5.x below); not installed here")

RULE = rule_by_id("CKG011")
HOLDS = RULE.holds_on(installed())


def _llama(variant: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra on Python >= 3.10")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config).train()
    if variant != "plain":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": variant == "reentrant"})
    return model


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class _Mlp(torch.nn.Module):
    """Two residual blocks a user checkpoints by hand, between an embedding layer and a head."""

    def __init__(self, variant: str):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        self.blocks = torch.nn.ModuleList([_Residual(), _Residual()])
        self.variant = variant

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.variant == "plain" else checkpoint(block, h, use_reentrant=self.variant == "reentrant")
        return self.head(h)


def per_sample_grads(model_kind: str, variant: str, mode: str = "hooks") -> tuple:
    """(per-sample gradient or None per trainable parameter, .grad per parameter) after one backward."""
    model = _llama(variant) if model_kind == "llama" else _Mlp(variant)
    gsm = opacus.GradSampleModule(model, strict=False, force_functorch=mode == "functorch")
    torch.manual_seed(1)
    if model_kind == "llama":
        ids = torch.randint(0, 64, (3, 8))
        gsm(input_ids=ids, labels=ids).loss.backward()
    else:
        x, y = torch.randn(5, 4), torch.randn(5, 1)
        ((gsm(x) - y) ** 2).mean().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return [getattr(p, "grad_sample", None) for p in params], [p.grad for p in params]


def _under(policy: str, *args):
    return installed_under(policy, per_sample_grads, *args)


def _assert_exact(got, reference):
    for g, r in zip(got[0], reference[0]):
        assert g is not None, "a parameter without grad_sample"
        torch.testing.assert_close(g, r)
    for g, r in zip(got[1], reference[1]):
        torch.testing.assert_close(g, r)


MODELS = ["llama", "mlp"]


@pytest.mark.parametrize("model_kind", MODELS)
def test_non_reentrant_loses_per_sample_gradients_strict_explains_fallback_is_exact(model_kind):
    reference = per_sample_grads(model_kind, "plain")
    assert all(g is not None for g in reference[0])
    raw = per_sample_grads(model_kind, "non-reentrant")
    if not HOLDS:
        pytest.skip(f"CKG011's claim does not hold on torch {installed()} (the table: {RULE.torch_versions})")
    missing = sum(g is None for g in raw[0])
    assert missing > 0  # torch (and Opacus) silently: per-sample gradients never published
    for g, r in zip(raw[1], reference[1]):
        torch.testing.assert_close(g, r)  # the ordinary .grad is right: only the DP part breaks
    with pytest.raises(CheckpointCompositionError, match=r"\[CKG011\]") as info:
        _under("strict", model_kind, "non-reentrant")
    message = str(info.value)
    assert "use_reentrant=True" in message and "gradient_checkpointing_kwargs" in message
    warned, messages = _under("warn", model_kind, "non-reentrant")
    assert messages and {m.rule.id for m in messages} == {"CKG011"}
    assert sum(g is None for g in warned[0]) == missing  # warn: what torch does
    repaired, messages = _under("fallback", model_kind, "non-reentrant")
    assert {m.rule.id for m in messages} == {"CKG011"}
    _assert_exact(repaired, reference)


@pytest.mark.parametrize("model_kind", MODELS)
def test_reentrant_is_exact_and_the_guard_stays_silent(model_kind):
    """The remedy the rule gives: use_reentrant=True, exact, and no rule fires on it (bitwise torch's)."""
    reference = per_sample_grads(model_kind, "plain")
    raw = per_sample_grads(model_kind, "reentrant")
    _assert_exact(raw, reference)
    (guarded, messages) = _under("strict", model_kind, "reentrant")
    assert messages == []
    for g, r in zip(guarded[0] + guarded[1], raw[0] + raw[1]):
        assert torch.equal(g, r)


def test_opacus_functorch_mode_is_caught_too_and_fallback_is_exact():
    """Opacus' functorch mode registers the same forward hook: under non-reentrant checkpointing it
    loses the per-sample gradients (or raises inside the recompute); the rule fires on it as well."""
    reference = per_sample_grads("mlp", "plain", "functorch")
    if not HOLDS:
        pytest.skip(f"CKG011's claim does not hold on torch {installed()}")
    try:
        raw = per_sample_grads("mlp", "non-reentrant", "functorch")
        assert any(g is None for g in raw[0])
    except RuntimeError:
        pass  # torch.func inside the recompute: loud, and nothing names checkpointing
    with pytest.raises(CheckpointCompositionError, match=r"\[CKG011\]"):
        _under("strict", "mlp", "non-reentrant", "functorch")
    repaired, _ = _under("fallback", "mlp", "non-reentrant", "functorch")
    _assert_exact(repaired, reference)


def test_a_block_without_opacus_hooks_is_not_looked_at_twice():
    """Hooks of other kinds (a logging forward hook) are no CKG011: strict is silent, bitwise torch's."""
    def run():
        torch.manual_seed(0)
        block = _Residual()
        seen = []
        block.up.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        x = torch.randn(5, 8, requires_grad=True)
        checkpoint(block, x, use_reentrant=False).pow(2).sum().backward()
        return [x.grad, *(p.grad for p in block.parameters())], len(seen)

    raw, raw_seen = run()
    ckpt_guard.install("strict")
    try:
        guarded, guarded_seen = run()
    finally:
        ckpt_guard.uninstall()
    assert raw_seen == guarded_seen == 2  # the forward and the recompute, as torch runs them
    for g, r in zip(guarded, raw):
        assert torch.equal(g, r)


class _GuardedMlp(_Mlp):
    """The same net through ``ckpt_guard.checkpoint``, with nothing installed."""

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = ckpt_guard.checkpoint(block, h)
        return self.head(h)


def test_ckpt_guard_checkpoint_without_install_applies_the_rule(monkeypatch):
    assert not ckpt_guard.is_installed()
    reference = per_sample_grads("mlp", "plain")
    if not HOLDS:
        pytest.skip(f"CKG011's claim does not hold on torch {installed()}")

    def run():
        model = _GuardedMlp("guard")
        gsm = opacus.GradSampleModule(model, strict=False)
        torch.manual_seed(1)
        x, y = torch.randn(5, 4), torch.randn(5, 1)
        ((gsm(x) - y) ** 2).mean().backward()
        params = [p for p in model.parameters() if p.requires_grad]
        return [getattr(p, "grad_sample", None) for p in params], [p.grad for p in params]

    monkeypatch.setenv("CKPT_GUARD_POLICY", "strict")
    with pytest.raises(CheckpointCompositionError, match=r"\[CKG011\]"):
        run()
    monkeypatch.setenv("CKPT_GUARD_POLICY", "fallback")
    with pytest.warns(CheckpointCompositionWarning, match=r"\[CKG011\]"):
        repaired = run()
    _assert_exact(repaired, reference)


def _outcome(run):
    try:
        return run(), None
    except Exception as error:  # noqa: BLE001 - Opacus' own error, compared below
        return None, (type(error), str(error))


def _silent_and_bitwise(run):
    """``run()`` under strict is silent and torch's: bitwise the same values, or Opacus' same error."""
    raw, raw_error = _outcome(run)
    ckpt_guard.install("strict", rules={})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)
            guarded, guarded_error = _outcome(run)
    finally:
        ckpt_guard.uninstall()
    assert guarded_error == raw_error
    for g, r in zip(guarded or (), raw or ()):
        assert (g is None and r is None) or torch.equal(g, r)


@pytest.mark.parametrize("case", ["hooks disabled", "parameters frozen", "eval mode", "no grad"])
def test_where_opacus_hook_takes_nothing_no_rule_fires(case):
    """Review of d8b2762: Opacus' hook returns early with its hooks disabled, for a layer without a
    trainable parameter, in eval mode and without grad: nothing is counted twice, CKG011 is silent
    (frozen after wrapping and eval mode end in Opacus' own "No activations detected", with or
    without checkpointing: the guard leaves that error as it is)."""
    def run():
        model = _Mlp("non-reentrant")
        gsm = opacus.GradSampleModule(model, strict=False)
        if case == "hooks disabled":
            gsm.disable_hooks()
        elif case == "parameters frozen":
            for block in model.blocks:
                block.requires_grad_(False)
        elif case == "eval mode":
            gsm.eval()
        torch.manual_seed(1)
        x, y = torch.randn(5, 4), torch.randn(5, 1)
        if case == "no grad":
            with torch.no_grad():
                return [gsm(x)]
        ((gsm(x) - y) ** 2).mean().backward()
        return [p.grad for p in model.parameters()]

    _silent_and_bitwise(run)


def test_the_blocks_own_hook_outside_the_checkpoint_is_no_case():
    """``checkpoint(partial(Linear.forward, lin), x)``: the hook on ``lin`` itself runs outside the
    checkpoint (transformers 5 checkpoints its layers so): counted once, exact, no rule."""
    def run():
        torch.manual_seed(0)
        lin, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        holder = torch.nn.Sequential(lin, head)
        gsm = opacus.GradSampleModule(holder, strict=False)
        torch.manual_seed(1)
        x = torch.randn(5, 4, requires_grad=True)
        import functools

        h = checkpoint(functools.partial(torch.nn.Linear.forward, lin), x, use_reentrant=False)
        head(h).sum().backward()
        del gsm
        return [getattr(lin.weight, "grad_sample", None), lin.weight.grad, x.grad]

    _silent_and_bitwise(run)


def test_a_users_own_method_of_that_name_is_not_opacus():
    """Matched by Opacus' pair of hook methods, not by one name."""
    class Recorder:
        def capture_activations_hook(self, module, inputs, output):
            self.seen = output.shape

    def run():
        torch.manual_seed(0)
        block = _Residual()
        block.up.register_forward_hook(Recorder().capture_activations_hook)
        x = torch.randn(5, 8, requires_grad=True)
        checkpoint(block, x, use_reentrant=False).sum().backward()
        return [x.grad, *(p.grad for p in block.parameters())]

    _silent_and_bitwise(run)


def test_fallback_without_install_runs_the_block_in_its_context_fn(monkeypatch):
    """Review of d8b2762: run plainly by fallback, ``ckpt_guard.checkpoint``'s block lost the forward
    context of its ``context_fn`` (an autocast), which torch's forward and an installed fallback keep."""
    if not HOLDS:
        pytest.skip(f"CKG011's claim does not hold on torch {installed()}")
    import contextlib
    import functools

    def autocast_context():
        return torch.autocast("cpu", dtype=torch.bfloat16), contextlib.nullcontext()

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8))
    opacus.GradSampleModule(torch.nn.Sequential(block), strict=False)
    x = torch.randn(5, 8, requires_grad=True)
    raw = checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(autocast_context))
    assert raw.dtype == torch.bfloat16  # torch's forward runs in the context
    monkeypatch.setenv("CKPT_GUARD_POLICY", "fallback")
    with pytest.warns(CheckpointCompositionWarning, match=r"\[CKG011\]"):
        out = ckpt_guard.checkpoint(block, x, context_fn=functools.partial(autocast_context))
    assert out.dtype == torch.bfloat16
