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
    ckpt_guard.install(policy, rules={})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = per_sample_grads(*args)
    finally:
        ckpt_guard.uninstall()
    return result, [w.message for w in caught if issubclass(w.category, CheckpointCompositionWarning)]


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
