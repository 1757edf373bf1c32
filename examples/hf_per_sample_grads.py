"""Per-sample gradients of a Hugging Face model with gradient checkpointing enabled.

A small GPT-2 with random weights (nothing is downloaded), checkpointing
enabled the transformers way, per-sample gradients with
``vmap(grad(functional_call(model, ...)))`` (DP-SGD style):

0. ``gradient_checkpointing_enable()`` registers a hook that calls
   ``requires_grad_()`` on the embeddings' output, which torch.func refuses,
   with or without ckpt_guard.  ``model.disable_input_require_grads()`` after
   enabling checkpointing removes it; nothing else needs it under torch.func;
1. torch without the guard: its saved-tensor-hooks error;
2. ckpt_guard ``strict``: the explanation, naming the checkpointed block
   (``GPT2Block at transformer.h.0``) and the line of this file;
3. ckpt_guard ``fallback``: per-sample gradients equal to the same model with
   checkpointing disabled.

Run: ``python examples/hf_per_sample_grads.py`` (needs ``transformers``; exit
status 0 when run 3 is correct).
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.func import functional_call, grad, vmap

import ckpt_guard


def small_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: vmap would need randomness=
        bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    model.train()  # transformers checkpoints only in training mode
    return model


def per_sample_grads(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, sample):
        batch = sample.unsqueeze(0)
        return functional_call(model, p, (batch,), {"labels": batch}).loss

    return vmap(grad(loss), in_dims=(None, 0))(params, tokens)


def main() -> int:
    model = small_gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.randint(0, 100, (4, 8))

    print("0) gradient_checkpointing_enable() alone, under torch.func:")
    try:
        per_sample_grads(model, tokens)
    except RuntimeError as exc:
        print(f"   RuntimeError: {str(exc)[:110]}...")
    model.disable_input_require_grads()  # the one extra line torch.func needs
    print("   fix: model.disable_input_require_grads() after gradient_checkpointing_enable()")

    print("\n1) torch without the guard:")
    try:
        per_sample_grads(model, tokens)
        print("   (no error)")
    except RuntimeError as exc:
        print(f"   RuntimeError: {exc}")

    ckpt_guard.install("strict")
    print("\n2) ckpt_guard, policy strict:")
    try:
        per_sample_grads(model, tokens)
    except ckpt_guard.CheckpointCompositionError as exc:
        print("   " + str(exc).replace("\n", "\n   "))

    print("\n3) ckpt_guard, policy fallback:")
    with ckpt_guard.policy("fallback"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded = per_sample_grads(model, tokens)
    rules = sorted({w.message.rule.id for w in caught if issubclass(w.category, ckpt_guard.CheckpointCompositionWarning)})
    model.gradient_checkpointing_disable()
    reference = per_sample_grads(model, tokens)
    for name in reference:
        torch.testing.assert_close(guarded[name], reference[name])
    print(f"   warned: {', '.join(rules)}; per-sample gradients of all {len(reference)} parameters match "
          f"the model without checkpointing (one of them: {tuple(guarded['transformer.wte.weight'].shape)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
