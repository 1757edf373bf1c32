"""Decisions: given what a rule found, what the policy in force makes of it.

``decide_call`` runs at checkpoint call time, ``Recompute.check`` when a
recompute starts.  Both return quietly when nothing fires; everything else
here (finding the user's call site, telling whether ``use_reentrant`` was
defaulted, writing the message, recording the event) runs only when a rule
fires, so it may be slow and thorough.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import replace
from types import FrameType
from typing import Any, Optional

from . import _config, _events, _state
from ._exceptions import CheckpointCompositionError, CheckpointCompositionWarning
from ._rules import CALL_RULES, DRIFT_RULES, NON_REENTRANT, REENTRANT, Rule

# What a call-time decision asks the patch point to do.
PROCEED = "proceed"  # run torch's checkpoint as asked
NON_REENTRANT_INSTEAD = "non-reentrant"  # fallback: use_reentrant=False instead
NO_CHECKPOINT = "no-checkpoint"  # fallback: run the function without checkpointing

_SEVERITY = _config.SEVERITY

# --------------------------------------------------------------------------
# where the user called checkpoint

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# The guard's machinery; probes in _rules.py count as user code.
_OWN_FILES = frozenset(
    os.path.join(_PACKAGE_DIR, name)
    for name in ("_patch.py", "_decide.py", "_state.py", "_config.py", "_events.py", "__init__.py")
)
_TORCH_DIR = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__ or "")) + os.sep
_STDLIB_HELPERS = ("contextlib.py", "functools.py", "threading.py")


def _is_library_frame(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    return (
        filename in _OWN_FILES
        or filename.startswith(_TORCH_DIR)
        or filename.endswith(_STDLIB_HELPERS)
    )


def user_frame(start: Optional[FrameType] = None) -> tuple[Optional[FrameType], int]:
    """The innermost frame outside torch and the guard, and its depth from ``start``."""
    frame = start if start is not None else sys._getframe(1)
    depth = 0
    while frame is not None and _is_library_frame(frame):
        frame = frame.f_back
        depth += 1
    return frame, depth


def describe_site(frame: Optional[FrameType]) -> str:
    if frame is None:
        return "<unknown: no user frame on this thread's stack>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


# --------------------------------------------------------------------------
# was use_reentrant passed?

DEFAULTED_MARK = "__ckpt_guard_use_reentrant_defaulted__"


def _checkpoint_codes() -> tuple:
    import inspect

    import torch.utils.checkpoint as tuc

    # checkpoint is wrapped by torch._disable_dynamo: look for the inner function's frame.
    return tuple(inspect.unwrap(f).__code__ for f in (tuc.checkpoint, tuc.checkpoint_sequential))


def use_reentrant_defaulted() -> Optional[bool]:
    """Whether the checkpoint call on this stack got ``use_reentrant`` by default.

    ``_patch`` marks the frame of ``checkpoint`` / ``checkpoint_sequential``
    when torch warns that ``use_reentrant`` was not passed.  ``None`` when no
    such frame is on the stack (the composable API, for example).
    """
    codes = _checkpoint_codes()
    frame: Optional[FrameType] = sys._getframe(1)
    found = False
    while frame is not None:
        if frame.f_code in codes:
            found = True
            if frame.f_locals.get(DEFAULTED_MARK):
                return True
        frame = frame.f_back
    return False if found else None


def describe_variant(reentrant: bool, defaulted: Optional[bool]) -> str:
    if not reentrant:
        return "non-reentrant (use_reentrant=False)"
    if defaulted is None:
        return "reentrant"
    if defaulted:
        return "reentrant (use_reentrant was not passed: torch defaulted to use_reentrant=True)"
    return "reentrant (use_reentrant=True)"


# --------------------------------------------------------------------------
# messages


def _fixes(rule: Rule) -> list[str]:
    return [
        rule.remedy,
        f"set CKPT_GUARD_POLICY=fallback: it {rule.fallback}",
        f"or override this one rule: CKPT_GUARD_RULES={rule.id}=warn (or =off)",
    ]


def build_message(
    rule: Rule,
    *,
    site: str,
    transforms: str,
    variant: str,
    change: str = "",
    action: str = "",
    forward_site: str = "",
) -> str:
    lines = [f"[{rule.id}] {rule.title}"]
    if forward_site:
        lines.append(f"  checkpoint called at: {forward_site}")
        lines.append(f"  recompute reached from: {site}")
    else:
        lines.append(f"  checkpoint called at: {site}")
    lines.append(f"  torch.func transforms: {transforms}")
    lines.append(f"  variant: {variant}")
    if change:
        lines.append(f"  changed since the forward: {change}")
    lines.append(f"  without the guard torch {rule.symptom}")
    if action:
        lines.append(f"  ckpt_guard: {action}")
    lines.append("  fix:")
    lines.extend(f"    - {fix}" for fix in _fixes(rule))
    lines.append(f"  details: python -m ckpt_guard explain {rule.id}")
    return "\n".join(lines)


def _warn(message: str, rule: Rule) -> None:
    """Warn, attributing the warning to the user's line (as a normal warning would)."""
    _, depth = user_frame(sys._getframe(1))
    warnings.warn(CheckpointCompositionWarning(message, rule), stacklevel=depth + 2)


# --------------------------------------------------------------------------
# call time


def _nothing_fires(state: _state.CallState) -> bool:
    return not any(rule.applies(state) for rule in CALL_RULES)  # type: ignore[misc]


def decide_call(reentrant: bool, function: Any, args: tuple, config: _config.Config) -> str:
    """Apply the call-time rules to a non-quiet call; may raise or warn."""
    state = _state.read_call_state(reentrant, function, args)
    firing = [
        (rule, config.policy_for(rule.id))
        for rule in CALL_RULES
        if config.policy_for(rule.id) != "off" and rule.applies(state)  # type: ignore[misc]
    ]
    if not firing:
        return PROCEED
    # The most severe policy among the rules that fired decides; table order breaks ties.
    rule, policy = max(firing, key=lambda rp: _SEVERITY[rp[1]])
    site_frame, _ = user_frame(sys._getframe(1))
    site = describe_site(site_frame)
    variant = describe_variant(reentrant, use_reentrant_defaulted() if reentrant else False)
    transforms = _state.describe_transforms(state.transforms)

    if policy == "strict":
        message = build_message(
            rule, site=site, transforms=transforms, variant=variant,
            action="raised before running the checkpointed function (policy strict)",
        )
        _events.emit(rule.id, policy, "raised", site, "call")
        raise CheckpointCompositionError(message, rule)

    outcome = PROCEED
    if policy == "fallback":
        if reentrant and _nothing_fires(replace(state, reentrant=False)):
            outcome, action = NON_REENTRANT_INSTEAD, "ran it with use_reentrant=False instead (policy fallback)"
        else:
            outcome, action = NO_CHECKPOINT, "ran it without checkpointing instead (policy fallback)"
    for other, other_policy in firing:
        if other_policy == "warn" or other is rule:
            this_action = (
                action if other is rule and policy == "fallback"
                else "ran torch's checkpoint as asked (policy warn)"
            )
            _events.emit(other.id, other_policy, _action_name(outcome if other is rule else PROCEED), site, "call")
            _warn(
                build_message(other, site=site, transforms=transforms, variant=variant, action=this_action),
                other,
            )
    return outcome


def _action_name(outcome: str) -> str:
    return {
        PROCEED: "warned",
        NON_REENTRANT_INSTEAD: "fallback: use_reentrant=False",
        NO_CHECKPOINT: "fallback: no checkpoint",
    }[outcome]


# --------------------------------------------------------------------------
# recompute time

_DRIFT_READERS = tuple(getattr(_state, rule.read) for rule in DRIFT_RULES)
_DRIFT_RENDERERS = tuple(getattr(_state, rule.render) for rule in DRIFT_RULES)


def capture() -> tuple:
    """The recompute-relevant state, one value per drift rule (forward time)."""
    return tuple([read() for read in _DRIFT_READERS])  # type: ignore[misc]


def call_site_now() -> tuple[str, int, str]:
    """Cheap forward-time record of the user's call site: (file, line, function)."""
    frame, _ = user_frame(sys._getframe(2))
    if frame is None:
        return ("<unknown>", 0, "?")
    code = frame.f_code
    return (code.co_filename, frame.f_lineno, code.co_name)


class Recompute:
    """Everything the recompute check needs, captured in the forward.

    The recompute may run on an autograd worker thread, which inherits neither
    ``threading.local`` nor ``contextvars``: so the configuration in force and
    the call site travel here too.
    """

    __slots__ = ("reentrant", "config", "forward_state", "site")

    def __init__(self, reentrant: bool, config: _config.Config) -> None:
        self.reentrant = reentrant
        self.config = config
        self.forward_state = capture()
        self.site = call_site_now()

    def wrap(self, function: Any, *, skip_first_call: bool) -> Any:
        """``function``, checked before every recompute.

        The reentrant variant calls the same function for the forward and the
        recompute, so its first call is skipped; the non-reentrant variant only
        uses the function it is given for recomputing.
        """
        check = self.check
        if skip_first_call:
            calls = [0]

            def guarded_function(*args, **kwargs):
                if calls[0]:
                    check()
                calls[0] += 1
                return function(*args, **kwargs)

        else:

            def guarded_function(*args, **kwargs):
                check()
                return function(*args, **kwargs)

        return guarded_function

    def check(self) -> None:
        now = capture()
        if now == self.forward_state:
            return
        config = self.config
        for rule, render, was, is_now in zip(DRIFT_RULES, _DRIFT_RENDERERS, self.forward_state, now):
            if was == is_now:
                continue
            policy = config.policy_for(rule.id)
            if policy == "off":
                continue
            change = f"{render(was)} → {render(is_now)}"
            site_frame, _ = user_frame(sys._getframe(1))
            forward_site = "{}:{} in {}".format(*self.site)
            variant = describe_variant(self.reentrant, None)
            if policy == "warn":
                message = build_message(
                    rule, site=describe_site(site_frame), forward_site=forward_site,
                    transforms=_state.describe_transforms(self.forward_state_transforms()),
                    variant=variant, change=change,
                    action="recomputing as torch would (policy warn)",
                )
                _events.emit(rule.id, policy, "warned", forward_site, "recompute")
                _warn(message, rule)
                continue
            message = build_message(
                rule, site=describe_site(site_frame), forward_site=forward_site,
                transforms=_state.describe_transforms(self.forward_state_transforms()),
                variant=variant, change=change,
                action=(
                    f"raised before the recompute ran (policy {policy}"
                    + (": this drift could not be foreseen at call time" if policy == "fallback" else "")
                    + ")"
                ),
            )
            _events.emit(rule.id, policy, "raised", forward_site, "recompute")
            raise CheckpointCompositionError(message, rule)

    def forward_state_transforms(self) -> tuple:
        return self.forward_state[_TRANSFORMS_INDEX]

    @property
    def anticipated_risk(self) -> Optional[Rule]:
        """A drift rule under fallback whose risk is visible now.

        A parameter swap, a user mode or a torch.func transform is active while
        grad is enabled: the recompute may run after it ended.  (Grad is known
        to be enabled: the patch points build a Recompute only then.)
        """
        state = self.forward_state
        for index in _ANTICIPATED_INDICES:
            if state[index] and self.config.policy_for(DRIFT_RULES[index].id) == "fallback":
                return DRIFT_RULES[index]
        return None


# Drift whose risk is visible at call time: fallback avoids it by not checkpointing.
_ANTICIPATED_INDICES = tuple(
    i for i, rule in enumerate(DRIFT_RULES)
    if rule.read in ("current_swaps", "user_dispatch_modes", "user_function_modes", "transform_stack")
)
_TRANSFORMS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "transform_stack")


def anticipate(recompute: Recompute, reentrant: bool) -> str:
    """Fallback for drift risks visible at call time: run without checkpointing."""
    rule = recompute.anticipated_risk
    if rule is None:
        return PROCEED
    site_frame, _ = user_frame(sys._getframe(1))
    site = describe_site(site_frame)
    message = build_message(
        rule, site=site,
        transforms=_state.describe_transforms(recompute.forward_state_transforms()),
        variant=describe_variant(reentrant, None),
        action=(
            "ran it without checkpointing (policy fallback): the recompute could run after "
            "this state changed, and then nothing could repair the gradients"
        ),
    )
    _events.emit(rule.id, "fallback", "fallback: no checkpoint", site, "call")
    _warn(message, rule)
    return NO_CHECKPOINT
