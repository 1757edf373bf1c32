"""transformers' checkpointing glue under the guard (issue 48, items 2 and 3).

Differential: the same model with checkpointing disabled is the reference; the
transformers way (``gradient_checkpointing_enable()``, nothing else) is run raw
(torch's refusal, measured here on the installed torch) and guarded.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap

import ckpt_guard

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (CI installs it where Python >= 3.10)"
)

POLICIES = ("strict", "warn", "fallback")


def _gpt2(gradient_checkpointing: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).double()
    model.train()
    if gradient_checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5: the name is deprecated
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


TOKENS = torch.randint(0, 50, (3, 6), generator=torch.Generator().manual_seed(1))


def _per_sample(model: torch.nn.Module) -> dict:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, sample):
        batch = sample.unsqueeze(0)
        return functional_call(model, p, (batch,), {"labels": batch}).loss

    return vmap(grad(loss), in_dims=(None, 0))(params, TOKENS)


def _grad(model: torch.nn.Module) -> dict:
    params = {k: v.detach() for k, v in model.named_parameters()}
    return grad(lambda p: functional_call(model, p, (TOKENS,), {"labels": TOKENS}).loss)(params)


@pytest.fixture(autouse=True)
def _uninstalled():
    ckpt_guard.uninstall()
    yield
    ckpt_guard.uninstall()


@pytest.mark.parametrize("transform", [_per_sample, _grad], ids=["vmap(grad)", "grad"])
def test_raw_torch_refuses_the_input_require_grads_hook_under_a_transform(transform):
    """What the guard's no-op is for: torch refuses the hook's requires_grad_ inside the transform."""
    with pytest.raises(RuntimeError, match=r"requires_grad_\(\)"):
        transform(_gpt2(True))


@pytest.mark.parametrize("transform", [_per_sample, _grad], ids=["vmap(grad)", "grad"])
def test_gradient_checkpointing_enable_alone_gives_the_uncheckpointed_gradients(transform):
    reference = transform(_gpt2(False))
    ckpt_guard.install("fallback")
    model = _gpt2(True)  # enabled after install(): its hook is made transform-aware
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt_guard.CheckpointCompositionWarning)
        got = transform(model)
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], msg=name)


@pytest.mark.parametrize("transform", [_per_sample, _grad], ids=["vmap(grad)", "grad"])
def test_warn_gets_past_the_hook_to_what_torch_does_with_the_checkpoint(transform):
    """warn behaves as torch: past the hook (a no-op), torch's own checkpoint refusal, warned first."""
    ckpt_guard.install("warn")
    model = _gpt2(True)
    with pytest.warns(ckpt_guard.CheckpointCompositionWarning, match="CKG001"):
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            transform(model)


def test_strict_raises_its_own_error_not_torchs_hook_refusal():
    ckpt_guard.install("strict")
    model = _gpt2(True)
    with pytest.raises(ckpt_guard.CheckpointCompositionError, match="CKG00"):
        _per_sample(model)


def test_the_hook_still_works_in_eager_and_after_uninstall():
    """Outside a transform the hook is transformers' own: a frozen embedding's output requires grad."""
    ckpt_guard.install("fallback")
    model = _gpt2(True)
    model.transformer.wte.requires_grad_(False)
    out = model.transformer.wte(TOKENS)
    assert out.requires_grad  # the hook ran
    hooks = list(model.transformer.wte._forward_hooks.values())
    assert [h.__name__ for h in hooks] == ["make_inputs_require_grads"]
    assert hasattr(hooks[0], "__ckpt_guard_original__")
    ckpt_guard.uninstall()
    with pytest.raises(RuntimeError, match=r"requires_grad_\(\)"):  # uninstalled: torch's refusal again
        _per_sample(model)


def test_uninstall_puts_transformers_methods_back():
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.modeling_utils import PreTrainedModel

    before = (PreTrainedModel.enable_input_require_grads, vars(GradientCheckpointingLayer).get("train"))
    ckpt_guard.install("fallback")
    assert PreTrainedModel.enable_input_require_grads is not before[0]
    assert "train" in vars(GradientCheckpointingLayer)
    ckpt_guard.uninstall()
    assert (PreTrainedModel.enable_input_require_grads, vars(GradientCheckpointingLayer).get("train")) == before


def _checkpoint_calls(model, run) -> int:
    """How many checkpoint calls transformers makes in ``run(model)`` (its layers' checkpoint function, counted)."""
    calls = []
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    originals = [layer._gradient_checkpointing_func for layer in layers]
    for layer, original in zip(layers, originals):
        layer._gradient_checkpointing_func = lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k)
    try:
        run(model)
    finally:
        for layer, original in zip(layers, originals):
            layer._gradient_checkpointing_func = original
    return len(calls)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["eager .backward()", "grad"])
def test_eval_with_checkpointing_enabled_is_said_once_with_the_fix(policy, how):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from ckpt_guard import _huggingface

    _huggingface._told.discard(GPT2Block)
    ckpt_guard.install(policy)
    model = _gpt2(True)
    model.eval()  # what PEFT and DP code do to switch dropout off

    def step(m):
        if how == "grad":
            return _grad(m)
        m(TOKENS, labels=TOKENS).loss.backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model)
        step(model)
    said = [w for w in caught if "runs in eval() mode" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    text = str(said[0].message)
    assert "GPT2Block" in text and "checkpoint nothing" in text.replace("checkpoints nothing", "checkpoint nothing")
    assert "model.train()" in text
    # measured: in eval() transformers makes no checkpoint call at all; in train() it does
    assert _checkpoint_calls(model, lambda m: m(TOKENS, labels=TOKENS).loss.backward()) == 0
    model.train()
    assert "_ckpt_guard_eval_watch" not in vars(model.transformer.h[0])  # training pays nothing
    assert _checkpoint_calls(model, lambda m: m(TOKENS, labels=TOKENS).loss.backward()) > 0


def test_eval_without_a_gradient_is_quiet():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from ckpt_guard import _huggingface

    _huggingface._told.discard(GPT2Block)
    ckpt_guard.install("fallback")
    model = _gpt2(True)
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(TOKENS)
        model.requires_grad_(False)
        model(TOKENS)  # nothing requires grad: no backward can follow
        _gpt2(False).eval()(TOKENS)  # checkpointing not enabled
    assert not [w for w in caught if "eval() mode" in str(w.message)]
