"""transformers' decoder layers, checkpointed per layer the transformers way, under torch.func.

Tiny random-weight LLaMA, Mistral and Qwen2 models (SiLU gated MLPs, RMSNorm,
rotary attention), float64, with ``gradient_checkpointing_enable()``: torch's
checkpoint under ``install("fallback")``, or ``ckpt_guard.checkpoint`` handed to
transformers as the checkpointing function.  Per-sample gradients, a
Hessian-vector product through ``jvp(grad)`` (forward over reverse: SiLU's
backward crashed there) and ``hessian`` with respect to the input embeddings,
each against the same model with checkpointing disabled.  Skipped where
transformers is not installed (CI's Python 3.11 job has it).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call, grad, hessian, jvp, vmap

import ckpt_guard
from ckpt_guard import _composable

transformers = pytest.importorskip("transformers", reason="the real-block tests need transformers")

DTYPE = torch.float64


def _model(name: str):
    torch.manual_seed(0)
    common = dict(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                  attn_implementation="eager")  # sdpa has no forward-mode formula (jvp(grad), hessian)
    if name == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaModel(config)
    elif name == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralModel(config)
    else:
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2Model(config)
    return model.to(DTYPE).train()


def _enable(model, entry: str) -> None:
    if entry == "none":
        return
    if entry == "torch checkpoint, fallback":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable()
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=ckpt_guard.checkpoint)
    model.disable_input_require_grads()  # its hook calls requires_grad_(), which torch.func refuses


def _program(name: str, how: str, entry: str):
    model = _model(name)
    _enable(model, entry)
    params = {k: v.detach() for k, v in model.named_parameters()}
    embeds = torch.randn(2, 5, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(1))

    def loss(p, e):
        return functional_call(model, p, (), {"inputs_embeds": e[None]}).last_hidden_state.pow(2).mean()

    if how == "vmap(grad)":
        return vmap(grad(loss), in_dims=(None, 0))(params, embeds)
    if how == "jvp(grad)":
        return jvp(lambda e: grad(loss, argnums=1)(params, e), (embeds[0],), (torch.ones_like(embeds[0]),))
    return hessian(loss, argnums=1)(params, embeds[0, :2])


ENTRIES = {"ckpt_guard.checkpoint": "strict", "torch checkpoint, fallback": "fallback"}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("how", ["vmap(grad)", "jvp(grad)", "hessian"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_decoder_layers_checkpointed_equal_the_plain_model(name, how, entry):
    reference = torch.utils._pytree.tree_leaves(_program(name, how, "none"))
    before = _composable.counters.PACKED
    ckpt_guard.install(ENTRIES[entry], rules={})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.utils._pytree.tree_leaves(_program(name, how, entry))
    finally:
        ckpt_guard.uninstall()
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)
    assert _composable.counters.PACKED > before  # checkpointed, not run plainly
