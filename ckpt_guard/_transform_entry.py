"""The decision where a torch.func transform is entered: saved-tensor hooks around it (CKG012).

Torch's grad transforms (``grad``, ``vjp``, ``jacrev``, ``hessian``, ``vmap`` over
them; on torch 2.4 ``vmap`` and ``jvp`` too) switch saved-tensor hooks off for their
body through ``torch.autograd.graph.disable_saved_tensors_hooks``, which refuses a
hooks stack that is not empty.  So ``save_on_cpu`` (or a library's offload hooks)
around the transform fails at its entry, with or without checkpointing, before any
checkpoint call the guard could see, and torch's words name neither the offload nor
what works instead.  The hooks may also be torch's non-reentrant checkpoint's own: a
transform called inside a checkpointed block (forces from an energy, pytorch#122729);
where torch can say whose hooks they are (2.8+), the words are a checkpoint's.

``_hooks`` wraps the generator behind that context manager (the function dynamo
recognises by identity stays torch's) and hands exactly one thing here: torch
refusing, with functorch's own message.  Everything else passes through untouched:
the quiet path (one generator frame per transform call), another library's
``disable_saved_tensors_hooks``, and a torch patched to allow the hooks at first order
(JetBrains' opaque), which does not refuse.

By policy (the rule's own, as every rule's):

* strict: :class:`CheckpointCompositionError`, raised from torch's refusal, naming the
  transform's call site, the transforms around it and what works instead;
* warn: the warning, then torch's refusal;
* fallback: the hooks are set aside while the transform runs and put back after it:
  correct, nothing inside the transform is offloaded (its own checkpointed blocks keep
  their saving) or, for a checkpoint's hooks, what the transform saves is kept.  Torch 2.4-2.7 cannot read its hooks stack, so nothing can be put
  back: there fallback raises strict's error and says why;
* off: torch's refusal.
"""

from __future__ import annotations

import dataclasses
import sys
from types import FrameType
from typing import Callable, Iterator, Optional, Tuple

from . import _config, _events, _state
from ._exceptions import CheckpointCompositionError
from ._messages import build_message, describe_site, emit_warning, user_frame
from ._rules import OFFLOAD_RULE

#: what fallback does where it cannot read torch's hooks stack (torch 2.4-2.7)
_CANNOT_SET_ASIDE = (
    "raised at the transform's entry (policy fallback: torch {version} cannot read its saved-tensor "
    "hooks stack, so it cannot set the offload aside and put it back; torch >= 2.8 can)"
)
_VARIANT = "any (the transform's entry is refused before a checkpoint call)"

_functorch_message: list = []


def transform_message() -> str:
    """The message functorch's grad transforms give ``disable_saved_tensors_hooks`` on this torch
    (read from its decorator, so a release that rewords it is still recognised)."""
    if not _functorch_message:
        text = ""
        try:
            from torch._functorch.vmap import doesnt_support_saved_tensors_hooks

            decorated = doesnt_support_saved_tensors_hooks(lambda: None)
            cells = dict(zip(decorated.__code__.co_freevars, decorated.__closure__ or ()))
            text = cells["message"].cell_contents if "message" in cells else ""
        except (ImportError, AttributeError, TypeError, ValueError):  # pragma: no cover - a torch without it
            pass
        _functorch_message.append(text or "don't yet support saved tensor hooks")
    return _functorch_message[0]


#: functorch's decorated functions, by name, as a user calls them
_ENTERED = {
    "grad_and_value_impl": "grad", "_vjp_with_argnums": "vjp (or jacrev, hessian)",
    "_flat_vmap": "vmap", "restore_vmap": "vmap", "_jvp_with_argnums": "jvp (or jacfwd)",  # torch 2.4
}


def _entered_transform(frame: Optional[FrameType]) -> str:
    """The transform being entered: functorch's decorator holds the function it wraps as ``f``."""
    for _ in range(6):
        if frame is None:
            break
        if frame.f_code.co_name == "fn" and "_functorch" in frame.f_code.co_filename:
            wrapped = frame.f_locals.get("f")
            name = getattr(wrapped, "__name__", "")
            return _ENTERED.get(name, name)
        frame = frame.f_back
    return ""


#: where the hooks on the stack are torch's non-reentrant checkpoint's own (``_checkpoint_hook``, its
#: recompute's ``_recomputation_hook``): the transform runs inside a checkpointed block (pytorch#122729)
_CHECKPOINTS_OWN = (
    "a block of torch's non-reentrant checkpoint (ckpt_guard.checkpoint outside torch.func is torch's) "
    "around this transform: the saved-tensor hooks on the stack are that checkpoint's own, not an offload"
)
_CHECKPOINTS_OWN_REMEDY = (
    "checkpoint that block with use_reentrant=True (its forward saves nothing through saved-tensor hooks, "
    "so the transform inside runs), or move the transform out of the checkpointed block, or use policy "
    "fallback (next line)"
)
_CHECKPOINTS_OWN_FALLBACK = (
    "sets the checkpoint's hooks aside while the transform runs: correct; what the transform saves "
    "for the block's gradient is kept, not recomputed (torch >= 2.8)"
)


def _checkpoints_own_hooks() -> bool:
    """Whether the innermost saved-tensor hooks are torch's checkpoint's (torch >= 2.8 can read them)."""
    top = _state.top_saved_tensor_hooks() if _state.top_saved_tensor_hooks is not None else None
    pack = top[0] if top else None
    return getattr(pack, "__module__", "") == "torch.utils.checkpoint"


def entered_despite(
    error_message: str, refusal: RuntimeError, torch_generator: Callable[[str], Iterator[None]],
) -> Tuple[Iterator[None], Optional[Callable[[], None]]]:
    """Torch refused ``disable_saved_tensors_hooks(error_message)``: decide, by CKG012's policy.

    Returns the entered generator of torch's context manager and what puts the user's hooks back
    after it (fallback), or raises (torch's refusal, or the guard's error).
    """
    config = _config.current()
    if error_message != transform_message() or not config.active:
        raise refusal
    rule = OFFLOAD_RULE
    policy = config.policy_for(rule.id)
    if policy == "off":
        raise refusal
    frame, _ = user_frame(sys._getframe(1))
    site = describe_site(frame)
    set_aside = policy == "fallback" and fallback_can_set_aside()
    # torch 2.4-2.7: nothing to set the hooks aside with, so nothing fallback can do (no fix leads there)
    words = rule if fallback_can_set_aside() else dataclasses.replace(rule, fallback_helps=False)
    around = _state.describe_transforms(_state.transform_stack())
    entering = _entered_transform(sys._getframe(1))
    checkpoints = _checkpoints_own_hooks()
    details = dict(
        site=site, site_label="torch.func transform entered at",
        transforms=f"entering {entering or 'a grad transform'} (around it: {around})",
        variant=_VARIANT, source=config.source,
        remedy=_CHECKPOINTS_OWN_REMEDY if checkpoints else "",
        checkpointed=_CHECKPOINTS_OWN if checkpoints else "",
        fallback_text=_CHECKPOINTS_OWN_FALLBACK if checkpoints else "",
    )
    if policy == "warn" or set_aside:
        action = (
            f"set the {'checkpoint' if checkpoints else 'offload'} hooks aside while the transform runs (policy "
            f"fallback): nothing inside it {'is checkpointed' if checkpoints else 'is offloaded'}"
            if set_aside else "entering the transform as torch would (policy warn)"
        )
        _events.emit(rule.id, policy, "fallback: repaired" if set_aside else "warned", site, rule.stage)
        emit_warning(build_message(words, policy=policy, action=action, worked=set_aside, **details), rule,
                     once=action if set_aside else "")
        if not set_aside:
            raise refusal
        aside = _state.hooks_set_aside()
        try:
            inner = torch_generator(error_message)
            next(inner)
        except BaseException:
            _state.hooks_put_back(aside)
            raise
        return inner, lambda: _state.hooks_put_back(aside)
    if policy == "fallback":
        import torch

        action = _CANNOT_SET_ASIDE.format(version=torch.__version__)
    else:
        action = "raised at the transform's entry (policy strict)"
    _events.emit(rule.id, policy, "raised", site, rule.stage)
    raise CheckpointCompositionError(build_message(words, policy=policy, action=action, **details), rule) from refusal


def fallback_can_set_aside() -> bool:
    """Whether fallback repairs CKG012 on this torch (it reads the hooks stack: torch >= 2.8)."""
    return _state.top_saved_tensor_hooks is not None

