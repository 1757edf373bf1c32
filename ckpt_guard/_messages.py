"""The words users read: every message the guard writes, and nothing that decides.

Owns: where the user called checkpoint (:func:`user_frame`, :func:`describe_site`) and
what they checkpointed (:func:`describe_checkpointed`: ``GPT2Block at transformer.h.0``),
how a variant is named, the fix lines (:func:`_fixes`: what works first, then the remedy,
then the policy changes, each written for the channel that set the policy), the message
itself (:func:`build_message`), the per-case symptom, remedy and fallback texts of the
drift rules, and the warning that attributes itself to the user's line.  The CLI's
``explain`` and the decision both read here.  May not touch: what fires or what the
policy makes of it (``_decide``, ``_drift``); it is given those and writes them down.
"""

from __future__ import annotations

import dis
import functools
import os
import sys
import sysconfig
import warnings
from types import CodeType, FrameType
from typing import Any, Optional, Sequence

import torch as _torch
import torch.utils.checkpoint as _torch_checkpoint

from . import _composable, _config, _files, _layouts, _state
from ._actions import CALL_RULES_HERE, TORCH
from ._exceptions import CheckpointCompositionWarning
from ._drift_kinds import TRANSFORMS_RULE
from ._rules import FIX_MOVE, GRAD_TRANSFORMS, Rule
from ._state import block_reads as _reads
from ._state.peel import peel as _peel


# --------------------------------------------------------------------------
# where the user called checkpoint

#: the one definition of the user's line, and its per-code cache (see ``_files``)
is_library_code, library_codes, CACHE_LIMIT = _files.is_library_code, _files.library_codes, _files.CACHE_LIMIT


def user_frame(start: Optional[FrameType] = None) -> tuple[Optional[FrameType], int]:
    """The innermost frame outside torch and the guard, and its depth from ``start`` (``_files.user_frame``)."""
    return _files.user_frame(start if start is not None else sys._getframe(1))


# Where installed libraries live (site-packages, the standard library): a frame
# there is not the user's own code, even when it is not torch's.
_LIBRARY_DIRS = tuple(sorted({
    os.path.abspath(path) + os.sep
    for key in ("purelib", "platlib", "stdlib", "platstdlib")
    for path in [sysconfig.get_paths().get(key)]
    if path
}))


def your_code(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The first frame from ``frame`` outward that is in none of the installed libraries."""
    while frame is not None and (
        is_library_code(frame.f_code) or os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS)
    ):
        frame = frame.f_back
    return frame


def _module_path(root: Any, target: Any) -> Optional[str]:
    for name, module in root.named_modules():
        if module is target:
            return name
    return None


def describe_checkpointed(function: Any, frame: Optional[FrameType] = None, roots: Sequence[Any] = ()) -> str:
    """What is checkpointed: ``GPT2Block at transformer.h.3 (in GPT2LMHeadModel)``, or the function.

    The module's path is found in the outermost module (``self``) on the
    stack from ``frame`` outward, else in one of ``roots`` (the modules a
    ``functional_call`` swapped); only when a rule fires, so it may be slow.
    """
    segment = _sequential_segment(function)
    if segment is not None:  # checkpoint_sequential: its closure holds every layer, it runs a few
        first, last = _placed(segment[0], frame, roots), _placed(segment[-1], frame, roots)
        if first is None or last is None or first[0] is not last[0]:
            return f"a checkpoint_sequential segment of {len(segment)} modules"
        span = first[1] if len(segment) == 1 else f"{first[1]}–{last[1]}"
        return f"checkpoint_sequential segment {span} (in {type(first[0]).__name__})"
    reads = _reads.reads_of(function)
    modules = reads.whole or reads.partial
    function = _peel(function)  # transformers: partial(layer.__call__, **kwargs); the guard's recorder
    name = _reads.attribute(function, "__qualname__")  # (never the user's error: _reads' BROKEN instead)
    named = f"function {name}" if isinstance(name, str) else f"a {type(function).__name__} object"
    if not modules:
        return named
    module = modules[0]
    found = _placed(module, frame, roots)
    placed = type(module).__name__ if found is None else (
        f"{type(module).__name__} at {found[1]} (in {type(found[0]).__name__})")
    if isinstance(function, _torch.nn.Module) or isinstance(_reads.attribute(function, "__self__"), _torch.nn.Module):
        return placed  # the module itself, or one of its methods
    if _reads.attribute(function, "__module__") == "torch._higher_order_ops.wrap":
        graph = found[1] if found is not None else type(module).__name__  # the wrapper runs the traced graph
        return f"a block traced by torch.compile (graph {graph})"
    return f"{named}, which reads {placed}"  # a closure or lambda: not the module it reads


def _placed(module: Any, frame: Optional[FrameType], roots: Sequence[Any]) -> Optional[tuple]:
    """``(outermost module holding it, its path there)``: from the ``self`` on the stack from
    ``frame`` outward, else from one of ``roots``; None if neither holds it."""
    found = None
    while frame is not None:
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, _torch.nn.Module) and owner is not module:
            path = _module_path(owner, module)
            if path:
                found = (owner, path)  # keep going: the outermost module gives the full path
        frame = frame.f_back
    for root in roots if found is None else ():
        path = _module_path(root, module) if root is not module else None
        if path:
            return root, path
    return found


def _sequential_segment(function: Any) -> Optional[list]:
    """The modules one ``checkpoint_sequential`` segment runs (``functions[start:end + 1]`` in the
    closure of torch's ``run_function``), or None for any other function."""
    code, name = _reads.attribute(function, "__code__"), _reads.attribute(function, "__qualname__")
    if not isinstance(code, CodeType) or not isinstance(name, str) or "run_function.<locals>" not in name:
        return None
    cells = dict(zip(code.co_freevars, function.__closure__ or ()))
    try:
        functions, start, end = (cells[name].cell_contents for name in ("functions", "start", "end"))
        segment = list(functions)[start:end + 1]
    except (KeyError, ValueError, TypeError):
        return None
    return segment if segment and all(isinstance(m, _torch.nn.Module) for m in segment) else None


def describe_site(frame: Optional[FrameType]) -> str:
    if frame is None:
        return "<unknown: no user frame on this thread's stack>"
    return _format_site(frame.f_code, frame.f_lineno)


def _format_site(code: Any, line: int) -> str:
    return f"{code.co_filename}:{line} in {code.co_name}"


# --------------------------------------------------------------------------
# was use_reentrant passed?

DEFAULTED_MARK = "__ckpt_guard_use_reentrant_defaulted__"


def use_reentrant_defaulted() -> Optional[bool]:
    """Whether the checkpoint call on this stack got ``use_reentrant`` by default.

    ``_patch`` marks the frame that warns (``checkpoint`` or
    ``_checkpoint_impl``, ``checkpoint_sequential``) when torch warns that
    ``use_reentrant`` was not passed.  ``None`` when no such frame is on the
    stack (the composable API, for example).
    """
    codes = _layouts.default_warning_codes(_torch_checkpoint)
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
    """``defaulted`` is None where the call's frame is gone (at the recompute)."""
    if not reentrant:
        return "non-reentrant (use_reentrant=False)"
    if defaulted:
        return "reentrant (use_reentrant was not passed: torch defaulted to use_reentrant=True)"
    return "reentrant (use_reentrant=True)"


# --------------------------------------------------------------------------
# messages


#: rules whose fallback is the composable recompute: under torch.func one program often trips
#: several of them at different calls (MAML: CKG001 in the inner grad, CKG003 under the
#: outer vmap), so a fix line names them all at once
_TRANSFORM_RULE_IDS = tuple(
    rule.id for rule in CALL_RULES_HERE if rule.composable_helps
) + ((TRANSFORMS_RULE.id,) if TRANSFORMS_RULE.holds_on(TORCH) else ())


#: the words of the fix line that sends a block to ckpt_guard.checkpoint (dropped where it refused)
_SUGGESTS_CHECKPOINT = "checkpoint these blocks with ckpt_guard.checkpoint(block, *inputs)"
#: the first fix where fallback ran the composable recompute: the call is right and keeps its saving
NOTHING_TO_FIX = (
    "none needed: the result is the uncheckpointed code's, and the memory saving is kept"
)


def _fixes(
    rule: Rule, policy: str, source: str, remedy: str = "", worked: bool = False, fired: Sequence[str] = (),
    fallback_text: str = "", saving_kept: bool = False,
) -> list[str]:
    """What works first, then the remedy (``remedy`` where one fits this case better), then the policy changes.

    Each written for the channel that set the policy (environment,
    ``install()``, a ``policy()`` scope, a pytest marker or option, the ``run``
    launcher's flags); per-rule settings, because they win over any base
    policy.  A line never leads somewhere worse than where the user is:
    where fallback ``worked`` (this call now runs correctly), no line turns
    the rule to warn or off (torch's error or wrong values would come back),
    only how to keep this without the warning; where it also kept the
    memory saving (``saving_kept``: the composable recompute ran) there is
    nothing to fix.  Under a torch.func transform the lines that keep
    checkpointing working come first (``ckpt_guard.checkpoint``, fallback),
    before the remedy that moves or drops the checkpoint.  ``fired``: every
    rule this call broke, named together so one change fixes them all.
    ``fallback_text``: what fallback does in this very case, where the
    rule's general words would not fit.
    """
    set_rule = functools.partial(_config.how_to_set, source)
    silence = (
        "to keep this without the warning: warnings.filterwarnings('ignore', "
        f"category=ckpt_guard.CheckpointCompositionWarning, message=r'\\[{rule.id}\\]')"
    )
    if worked and saving_kept:
        return [NOTHING_TO_FIX, silence]
    fixes = [remedy or rule.remedy]
    ids = list(dict.fromkeys([rule.id, *fired]))
    also = ""
    if rule.id in _TRANSFORM_RULE_IDS:  # the next transform in the program trips the next one of these
        ids += [i for i in _TRANSFORM_RULE_IDS if i not in ids]
        also = f" ({', '.join(dict.fromkeys([rule.id, *fired]))} and the other torch.func rules, so that the next transform in this program is covered too)"
    if rule.fallback_helps and policy != "fallback":
        working = [
            f"use fallback, {set_rule('fallback', ids)}{also} (or for all rules: {set_rule('fallback')}); "
            f"fallback {fallback_text or rule.fallback}"
        ]
        if rule.id in _TRANSFORM_RULE_IDS and "ckpt_guard.checkpoint" not in fixes[0]:
            working.insert(0, (
                f"{_SUGGESTS_CHECKPOINT}: the composable recompute under torch.func (it keeps the memory "
                "saving), torch's own checkpoint elsewhere, whatever the policy"
            ))
            fixes = [*working, "or " + fixes[0]]  # what keeps checkpointing working leads
        else:
            fixes += working
    if worked:
        fixes.append(silence)
        return fixes
    if policy == "fallback" and rule.stage == "recompute":  # a risk seen at call time
        fixes.append(
            f"or keep checkpointing and raise only if the drift really happens: {set_rule('strict', rule.id)}"
        )
    if policy == "warn":
        fixes.append(f"or silence it (torch does the same, without the warning): {set_rule('off', rule.id)}")
    elif rule.always_raises and policy == "strict":
        fixes.append(
            f"or, to get torch's own error instead of this one: {set_rule('off', rule.id)}"
        )
    return fixes


def build_message(
    rule: Rule,
    *,
    site: str,
    transforms: str,
    variant: str,
    policy: str,
    source: str = "env",
    change: str = "",
    action: str = "",
    forward_site: str = "",
    anticipated: bool = False,
    remedy: str = "",
    also: Sequence[str] = (),
    checkpointed: str = "",
    from_your_code: str = "",
    worked: bool = False,
    symptom: str = "",
    fallback_text: str = "",
    saving_kept: bool = False,
    site_label: str = "checkpoint called at",
) -> str:
    # anticipated: fallback acted on a risk seen at call time; nothing has gone wrong yet
    # site_label: what ``site`` is, where it is not a checkpoint call (a transform's entry)
    lines = [f"[{rule.id}] {'risk: ' if anticipated else ''}{rule.title}"]
    if forward_site:
        lines.append(f"  checkpoint called at: {forward_site}")
        lines.append(f"  recompute reached from: {site}")
    else:
        lines.append(f"  {site_label}: {site}")
    if checkpointed:
        lines.append(f"  checkpointed: {checkpointed}")
    if from_your_code and from_your_code != site:
        lines.append(f"  from your code: {from_your_code}")
    lines.append(f"  torch.func transforms: {transforms}")
    lines.append(f"  variant: {variant}")
    if change:
        lines.append(f"  changed since the forward: {change}")
    lines.append(f"  without the guard torch {symptom or rule.symptom}")
    if also:
        lines.append(f"  also applies here: {', '.join(also)} (python -m ckpt_guard explain ID)")
    if action:
        lines.append(f"  ckpt_guard: {action}")
    lines.append("  fix:")
    lines.extend(
        f"    - {fix}" for fix in _fixes(rule, policy, source, remedy, worked, also, fallback_text, saving_kept)
    )
    lines.append(f"  details: python -m ckpt_guard explain {rule.id}")
    return "\n".join(lines)


def emit_warning(message: str, rule: Rule, once: str = "") -> None:
    """Warn, attributing the warning to the user's line (as a normal warning would).

    ``once``: what fallback did about it; such a warning is given once per
    rule, call site and action until the next ``install()`` (a loop over
    layers, step after step, would otherwise say the same thing per block per
    step).  The events (``ckpt_guard.record()``) still record every call.
    """
    frame, depth = user_frame(sys._getframe(1))
    if once and frame is not None:
        key = (_config.installs[0], rule.id, frame.f_code, frame.f_lasti, once)
        if key in _warned_once:
            return
        if len(_warned_once) >= 4096:  # a program generating code: forget, rather than grow
            _warned_once.clear()
        _warned_once.add(key)
        message += (
            "\n  (shown once for this call site: later calls here, other blocks and later steps included, that "
            "fallback handles the same way are not warned about again; `with ckpt_guard.record() as events:` collects every call)"
        )
    warnings.warn(CheckpointCompositionWarning(message, rule), stacklevel=depth + 2)


#: (install generation, rule id, code, instruction, action) of each fallback warning given
_warned_once: set = set()


def call_case_remedy(rule: Rule, state: _state.CallState, refused: str) -> str:
    """A call-time remedy that fits this very case, where the rule's general one would not."""
    if rule.id == "CKG002" and "grad" in state.transform_names:
        # use_reentrant=False is refused under grad too (CKG001): the rule's first fix would lead there
        if refused:
            return f"{FIX_MOVE} (under {GRAD_TRANSFORMS} neither variant of torch's checkpoint works, see CKG001)"
        return (
            "checkpoint these blocks with ckpt_guard.checkpoint(block, *inputs): under "
            f"{GRAD_TRANSFORMS} use_reentrant=False is refused too (CKG001); or {FIX_MOVE}"
        )
    return ""


def with_refusal(message: str, refused: str) -> str:
    """``message`` with why ckpt_guard.checkpoint's composable recompute refused (and no fix suggesting it)."""
    if not refused:
        return message
    lines = [line for line in message.splitlines() if _SUGGESTS_CHECKPOINT not in line]
    why = "  ckpt_guard.checkpoint could not use its composable recompute here: " + _composable.describe_reason(refused)
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("  variant:")), len(lines))
    lines = [*lines[:at], why, *lines[at:]]  # the cause next to the variant, before the fixes
    # the headline names what the user called, and the change that makes it work comes first
    code, _, title = lines[0].partition(" ")
    kind = getattr(refused, "kind", "")  # the refusal class first: it is why (a new user read past the rule's title)
    because = f": {kind}" if kind else ""
    lines[0] = f"{code} ckpt_guard.checkpoint could not use its composable recompute{because} ({title})"
    fix = getattr(refused, "fix", "")
    if fix and "  fix:" in lines:
        at = lines.index("  fix:") + 1
        lines.insert(at, f"    - {fix}")
    return "\n".join(lines)


def describe_forward_site(site: tuple) -> str:
    code, lasti = site
    if code is None:
        return "<unknown: no user frame on the forward's stack>"
    line = code.co_firstlineno
    for start, number in dis.findlinestarts(code):  # (offset, line), in offset order
        if start > lasti:
            break
        if number is not None:
            line = number
    return _format_site(code, line)
