"""Patch points in Hugging Face transformers: its checkpointing glue, made to agree with torch.func.

Two things transformers does around checkpointing go wrong under a torch.func
transform, or go silent (issue 48, items 2 and 3; measured with transformers 5.25):

* ``enable_input_require_grads()``, which ``gradient_checkpointing_enable()`` calls
  for text models and PEFT, registers a forward hook on the input embeddings
  (``make_inputs_require_grads``) that calls ``output.requires_grad_(True)``.  Under
  a torch.func transform torch refuses that call ("You are attempting to call
  Tensor.requires_grad_() ... inside of a function being transformed by a functorch
  transform"), under every policy.  The hook exists for eager autograd (a frozen
  embedding's output must require grad for the gradient to reach the adapters
  through a reentrant checkpoint); under a transform torch.func tracks what it
  differentiates, so the hook has nothing to do.  Each such hook the method
  registers is wrapped so that exactly that refusal, under a live transform,
  becomes a no-op; every other outcome is the hook's own.
* ``GradientCheckpointingLayer`` checkpoints only in training mode: a model with
  checkpointing enabled and in ``eval()`` (``from_pretrained`` returns one; PEFT
  and DP code switch dropout off so) checkpoints nothing, with no word.  A layer
  put in ``eval()`` gets a forward pre-hook that says so once per layer class,
  with the fix, where its forward runs with checkpointing enabled and a gradient
  can follow; ``train()`` takes the hook off, so a training step pays nothing.

Both run inside code ``torch.compile`` traces, so this file is written to be
traced (it is not one of the files dynamo skips): under dynamo they do what
transformers does.  Applied by ``install()`` when transformers is imported, or
when it is imported later; ``uninstall()`` puts transformers' methods back, and
a hook wrapped or added while installed does nothing more once uninstalled.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable

MODELING_UTILS = "transformers.modeling_utils"
MODELING_LAYERS = "transformers.modeling_layers"
#: the words of torch's refusal of ``requires_grad_`` under a functorch transform
_REFUSAL = "You are attempting to call Tensor.requires_grad_()"
#: transformers' name for the hook (the same in every model that defines its own)
_HOOK_NAME = "make_inputs_require_grads"
#: the attribute under which a layer in eval() keeps its pre-hook's handle
_WATCH = "_ckpt_guard_eval_watch"
#: layer classes already told about (once per class)
_told: set = set()


def patch_modeling_utils(module: Any, set_attr: Callable[[Any, str, Any], None]) -> None:
    """Wrap ``PreTrainedModel.enable_input_require_grads``: the hooks it registers become transform-aware."""
    model_class = getattr(module, "PreTrainedModel", None)
    original = getattr(model_class, "enable_input_require_grads", None)
    if original is None or getattr(original, "__ckpt_guard_original__", None) is not None:
        return

    @functools.wraps(original)
    def enable_input_require_grads(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        transform_aware_hooks(self)
        return result

    enable_input_require_grads.__ckpt_guard_original__ = original  # type: ignore[attr-defined]
    set_attr(model_class, "enable_input_require_grads", enable_input_require_grads)


def transform_aware_hooks(model: Any) -> int:
    """Wrap every ``make_inputs_require_grads`` forward hook on ``model``'s modules; how many were wrapped."""
    wrapped = 0
    for module in model.modules():
        hooks = getattr(module, "_forward_hooks", None)
        if not hooks:
            continue
        for key, hook in list(hooks.items()):
            if getattr(hook, "__name__", None) == _HOOK_NAME and not hasattr(hook, "__ckpt_guard_original__"):
                hooks[key] = _transform_aware(hook)
                wrapped += 1
    return wrapped


def _transform_aware(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def make_inputs_require_grads(module: Any, inputs: Any, output: Any) -> Any:
        try:
            return hook(module, inputs, output)
        except RuntimeError as exc:
            if _REFUSAL in str(exc) and _installed() and _transform_live():
                return None  # torch.func differentiates what it was given: nothing for the hook to do
            raise

    make_inputs_require_grads.__ckpt_guard_original__ = hook  # type: ignore[attr-defined]
    return make_inputs_require_grads


def patch_modeling_layers(module: Any, set_attr: Callable[[Any, str, Any], None]) -> None:
    """Wrap ``GradientCheckpointingLayer.train``: a layer put in eval() watches for a forward that checkpoints nothing."""
    layer_class = getattr(module, "GradientCheckpointingLayer", None)
    if layer_class is None or "train" in vars(layer_class):
        return
    original = layer_class.train  # nn.Module's

    @functools.wraps(original)
    def train(self: Any, mode: bool = True) -> Any:
        result = original(self, mode)
        handle = self.__dict__.get(_WATCH)
        if mode and handle is not None:
            handle.remove()
            del self.__dict__[_WATCH]
        elif not mode and handle is None and _installed() and type(self) not in _told:
            self.__dict__[_WATCH] = self.register_forward_pre_hook(_checkpoints_nothing)
        return result

    set_attr(layer_class, "train", train)


def _checkpoints_nothing(layer: Any, inputs: Any) -> None:
    """A forward pre-hook of a layer in eval(): say once if checkpointing is enabled and a gradient can follow."""
    import torch

    if torch.compiler.is_dynamo_compiling() or not layer.gradient_checkpointing or layer.training:
        return
    if not torch.is_grad_enabled() or type(layer) in _told or not _installed():
        return
    if not (_transform_live() or any(p.requires_grad for p in layer.parameters())):
        return  # an evaluation: no backward, nothing to save
    from . import _config

    if _config.current().policy == "off":
        return
    _told.add(type(layer))
    name = type(layer).__name__
    warnings.warn(
        f"ckpt_guard: {name} has gradient checkpointing enabled but runs in eval() mode, and transformers "
        "checkpoints a layer only in training mode: these layers checkpoint nothing, and every activation "
        "is kept for the backward (no memory saving). Fix: put the model in training mode with dropout "
        "off (model.train(), and dropout probabilities 0 in its config), or switch only the "
        f"checkpointed layers to training: for layer in model.modules(): isinstance(layer, {name}) and "
        "layer.train(). (Shown once per layer class.)",
        UserWarning,
        stacklevel=2,
    )


def _installed() -> bool:
    patch = sys.modules.get(f"{__package__}._patch")
    return patch is not None and patch.is_installed()


def _transform_live() -> bool:
    from torch._C._functorch import peek_interpreter_stack

    return peek_interpreter_stack() is not None
