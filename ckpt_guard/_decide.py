"""Decisions: given what a rule found, what the policy in force makes of it.

``prepare_call`` runs at checkpoint call time, ``_checked_call`` when a
recompute starts.  Both return quietly when nothing fires; everything else
here (finding the user's call site, telling whether ``use_reentrant`` was
defaulted, writing the message, recording the event) runs only when a rule
fires, so it may be slow and thorough.
"""

from __future__ import annotations

import contextlib
import dataclasses as _dataclasses
import dis
import functools
import inspect
import os
import sys
import sysconfig
import threading
import types
import warnings
from dataclasses import replace
from functools import partial as _partial
from types import FrameType
from typing import Any, Optional, Sequence

import torch as _torch
import torch.fx._symbolic_trace as _fx_symbolic_trace
import torch.utils.checkpoint as _torch_checkpoint

from . import _composable, _config, _events, _layouts, _proof, _rebind, _state, _versions
from ._state import block_reads as _reads
from ._exceptions import CheckpointCompositionError, CheckpointCompositionWarning
from ._rules import CALL_RULES, DEVICE_RULE as _DEVICE_RULE, DRIFT_RULES, NESTED_OUTPUT_RULE as _NESTED_RULE
from ._rules import _FIX_MOVE, _GRAD_TRANSFORMS, NON_REENTRANT, RNG_RULE as _RNG_RULE, Rule, rules_on

#: The installed torch, and the call-time rules whose claim holds on it (in table order).
TORCH = _versions.installed()
CALL_RULES_HERE = rules_on(TORCH, CALL_RULES)
# per drift rule (DRIFT_RULES order): does its claim hold on this torch?
_DRIFT_HOLDS = tuple(rule.holds_on(TORCH) for rule in DRIFT_RULES)
# per drift rule: is it about the non-reentrant variant too? (CKG114 is not: a non-reentrant
# recompute started inside a reentrant backward is no business of it)
_DRIFT_NON_REENTRANT = tuple(NON_REENTRANT in rule.variants for rule in DRIFT_RULES)

# What a call-time decision asks the patch point to do.
PROCEED = "proceed"  # run torch's checkpoint as asked
NON_REENTRANT_INSTEAD = "non-reentrant"  # fallback: use_reentrant=False instead
NO_CHECKPOINT = "no-checkpoint"  # fallback: run the function without checkpointing
NO_EARLY_STOP = "no-early-stop"  # fallback: torch's checkpoint with early stop switched off (CKG009)
#: a call-time rule explains this composition, and its policy (warn or off) says: torch's
#: checkpoint as asked, and no drift rule's call-time risk stands in for it
AS_ASKED = "as-asked"

_SEVERITY = _config.SEVERITY
_is_grad_enabled = _state.is_grad_enabled

# --------------------------------------------------------------------------
# where the user called checkpoint

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# The guard's machinery; probes in _rules.py and _compositions.py count as user code.
_OWN_FILES = frozenset(
    os.path.join(_PACKAGE_DIR, name)
    for name in (
        "__init__.py", "_config.py", "_decide.py", "_events.py", "_hooks.py", "_layouts.py", "_patch.py",
        "_versions.py", *_state.FILES,
    )
)
_TORCH_DIR = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__ or "")) + os.sep
# The standard library's helpers that sit between a user's call and checkpoint
# (functools.partial, contextlib decorators, threads), by their own paths: a
# user file named my_functools.py is the user's.
_STDLIB_HELPERS = frozenset(
    os.path.abspath(module.__file__) for module in (contextlib, functools, threading) if module.__file__
)


# id(code object) -> (the code object, is it library code?).  Keyed by identity: hashing
# a code object hashes its constants, and dynamo's rewritten code can hold a dict
# (unhashable).  The entry keeps its code object alive, so the id is not reused while
# cached.  Bounded: generated code (exec, torch.fx) makes new code objects forever.
_library_codes: dict = {}
_CACHE_LIMIT = 1024


def _is_library_code(code: Any) -> bool:
    """Torch's, the guard's or a stdlib helper's code (cached per code object: hot path)."""
    known = _library_codes.get(id(code))
    if known is None or known[0] is not code:
        if len(_library_codes) >= _CACHE_LIMIT:
            _library_codes.clear()
        filename = code.co_filename
        known = _library_codes[id(code)] = (
            code, filename in _OWN_FILES or filename.startswith(_TORCH_DIR) or filename in _STDLIB_HELPERS,
        )
    return known[1]


def user_frame(start: Optional[FrameType] = None) -> tuple[Optional[FrameType], int]:
    """The innermost frame outside torch and the guard, and its depth from ``start``."""
    frame = start if start is not None else sys._getframe(1)
    depth = 0
    while frame is not None and _is_library_code(frame.f_code):
        frame = frame.f_back
        depth += 1
    return frame, depth


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
        _is_library_code(frame.f_code) or os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS)
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
    while isinstance(function, functools.partial):  # transformers: partial(layer.__call__, **kwargs)
        function = function.func
    name = getattr(function, "__qualname__", None)
    named = f"function {name}" if isinstance(name, str) else f"a {type(function).__name__} object"
    if not modules:
        return named
    module = modules[0]
    found = _placed(module, frame, roots)
    placed = type(module).__name__ if found is None else (
        f"{type(module).__name__} at {found[1]} (in {type(found[0]).__name__})")
    if isinstance(function, _torch.nn.Module) or isinstance(getattr(function, "__self__", None), _torch.nn.Module):
        return placed  # the module itself, or one of its methods
    if getattr(function, "__module__", None) == "torch._higher_order_ops.wrap":
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
    code = getattr(function, "__code__", None)
    if code is None or "run_function.<locals>" not in getattr(function, "__qualname__", ""):
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
) + tuple(rule.id for rule in DRIFT_RULES if rule.read == "transform_stack" and rule.holds_on(TORCH))


#: the words of the fix line that sends a block to ckpt_guard.checkpoint (dropped where it refused)
_SUGGESTS_CHECKPOINT = "checkpoint these blocks with ckpt_guard.checkpoint(block, *inputs)"
#: the first fix where fallback ran the composable recompute: the call is right and keeps its saving
NOTHING_TO_FIX = (
    "nothing to fix: the result is the uncheckpointed code's, and the memory saving is kept"
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
        also = f" ({', '.join(dict.fromkeys([rule.id, *fired]))} and the other torch.func rules: one round covers every transform)"
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
) -> str:
    # anticipated: fallback acted on a risk seen at call time; nothing has gone wrong yet
    lines = [f"[{rule.id}] {'risk: ' if anticipated else ''}{rule.title}"]
    if forward_site:
        lines.append(f"  checkpoint called at: {forward_site}")
        lines.append(f"  recompute reached from: {site}")
    else:
        lines.append(f"  checkpoint called at: {site}")
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


def _warn(message: str, rule: Rule, once: str = "") -> None:
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


# --------------------------------------------------------------------------
# call time


def _nothing_fires(state: _state.CallState) -> bool:
    return not any(rule.applies(state) for rule in CALL_RULES_HERE)  # type: ignore[misc]


def applying_rules(state: _state.CallState) -> list:
    """The call-time rules that hold on this torch and apply to ``state``.

    A rule that ``yields_to`` another one that applies too is left out: the
    other explains this composition on this torch.
    """
    applying = [rule for rule in CALL_RULES_HERE if rule.applies(state)]  # type: ignore[misc]
    ids = {rule.id for rule in applying}
    return [rule for rule in applying if not ids.intersection(rule.yields_to)]


def _firing(state: _state.CallState, config: _config.Config) -> list:
    """``[(rule, policy)]`` for the call-time rules that fire under ``config``."""
    return [
        (rule, config.policy_for(rule.id))
        for rule in applying_rules(state)
        if config.policy_for(rule.id) != "off"
    ]


def _deciding(firing: list) -> tuple:
    """The most severe policy among the rules that fired decides; table order breaks ties."""
    return max(firing, key=lambda rp: _SEVERITY[rp[1]])


def _where(function: Any, transforms: tuple, site_frame: Optional[FrameType]) -> dict:
    """The message lines that say where this happens."""
    return {
        "transforms": _state.describe_transforms(transforms),
        "checkpointed": describe_checkpointed(function, site_frame),
        "from_your_code": describe_site(your_code(site_frame)),
    }


def decide_call(
    reentrant: bool, function: Any, args: tuple, config: _config.Config, early_stop: bool = True, refused: str = "",
    ran: bool = False,
) -> str:
    """Apply the call-time rules to a non-quiet call; may raise or warn.

    ``refused``: why ``ckpt_guard.checkpoint``'s composable recompute could not
    run this call, added to what the user reads (whose fixes then do not
    suggest ``ckpt_guard.checkpoint``: that is what refused).  ``ran``: the
    refusal came from the run-time proof, after the block ran once, plainly:
    that run is the call's result whatever the policy (strict raises instead
    of returning it).
    """
    state = _state.read_call_state(reentrant, function, args, early_stop)
    firing = _firing(state, config)
    if not firing:
        return AS_ASKED if applying_rules(state) else PROCEED
    rule, policy = _deciding(firing)
    site_frame, _ = user_frame(sys._getframe(1))
    site = describe_site(site_frame)
    variant = (
        ("ckpt_guard.checkpoint, run without checkpointing (see the next line)" if ran else
         "ckpt_guard.checkpoint, run as torch's non-reentrant checkpoint (see the next line)") if refused
        else describe_variant(reentrant, use_reentrant_defaulted() if reentrant else False)
    )
    where = _where(function, state.transforms, site_frame)

    also = [other.id for other, _ in firing if other is not rule]
    where["remedy"] = _call_case_remedy(rule, state, refused)
    if policy == "strict":
        message = _with_refusal(build_message(
            rule, site=site, variant=variant, policy=policy, source=config.source,
            action=(
                "raised after the block ran once, plainly, which the proof needed (policy strict)" if ran
                else "raised before running the checkpointed function (policy strict)"
            ), also=also, **where,
        ), refused)
        _events.emit(rule.id, policy, "raised", site, "call")
        raise CheckpointCompositionError(message, rule)

    if policy == "warn":
        outcome = PROCEED
    elif rule.fallback_runs == "no-early-stop":
        outcome = NO_EARLY_STOP
    elif _non_reentrant_will_do(state, config, function):
        outcome = NON_REENTRANT_INSTEAD
    else:
        outcome = NO_CHECKPOINT
    # One call, one decision, one warning: the deciding rule's, naming the others;
    # every rule that fired records what actually ran.
    event, action = _OUTCOME_TEXT[outcome]
    if ran:
        outcome, event = NO_CHECKPOINT, _OUTCOME_TEXT[NO_CHECKPOINT][0]
        action = f"ran it once without checkpointing (policy {policy}): that run is the result"
    for other, other_policy in firing:
        _events.emit(other.id, other_policy, event, site, "call")
    _warn(_with_refusal(build_message(
        rule, site=site, variant=variant, policy=policy, source=config.source, action=action, also=also,
        worked=policy == "fallback", **where,
    ), refused), rule, once=action if policy == "fallback" else "")
    return AS_ASKED if outcome == PROCEED else outcome


def _call_case_remedy(rule: Rule, state: _state.CallState, refused: str) -> str:
    """A call-time remedy that fits this very case, where the rule's general one would not."""
    if rule.id == "CKG002" and "grad" in state.transform_names:
        # use_reentrant=False is refused under grad too (CKG001): the rule's first fix would lead there
        if refused:
            return f"{_FIX_MOVE} (under {_GRAD_TRANSFORMS} neither variant of torch's checkpoint works, see CKG001)"
        return (
            "checkpoint these blocks with ckpt_guard.checkpoint(block, *inputs): under "
            f"{_GRAD_TRANSFORMS} use_reentrant=False is refused too (CKG001); or {_FIX_MOVE}"
        )
    return ""


def _with_refusal(message: str, refused: str) -> str:
    """``message`` with why ckpt_guard.checkpoint's composable recompute refused (and no fix suggesting it)."""
    if not refused:
        return message
    lines = [line for line in message.splitlines() if _SUGGESTS_CHECKPOINT not in line]
    why = "  ckpt_guard.checkpoint could not use its composable recompute here: " + _composable.describe_reason(refused)
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("  variant:")), len(lines))
    lines = [*lines[:at], why, *lines[at:]]  # the cause next to the variant, before the fixes
    # the headline names what the user called, and the change that makes it work comes first
    code, _, title = lines[0].partition(" ")
    lines[0] = f"{code} ckpt_guard.checkpoint could not use its composable recompute ({title})"
    fix = getattr(refused, "fix", "")
    if fix and "  fix:" in lines:
        at = lines.index("  fix:") + 1
        lines.insert(at, f"    - {fix}")
    return "\n".join(lines)


def _non_reentrant_will_do(state: _state.CallState, config: _config.Config, function: Any) -> bool:
    """Fallback for a reentrant call: is use_reentrant=False right here?

    Only if no call-time rule would fire for it, and no drift risk would make
    fallback run it without checkpointing anyway.
    """
    return (
        state.reentrant
        and _nothing_fires(replace(state, reentrant=False))
        and _anticipated_rule(config, capture(function)) is None
    )


# outcome -> (event action, message action)
_OUTCOME_TEXT = {
    PROCEED: ("warned", "ran torch's checkpoint as asked (policy warn)"),
    NON_REENTRANT_INSTEAD: ("fallback: use_reentrant=False", "ran it with use_reentrant=False instead (policy fallback)"),
    NO_CHECKPOINT: ("fallback: no checkpoint", "ran it without checkpointing instead (policy fallback)"),
    NO_EARLY_STOP: ("fallback: no early stop", "ran torch's checkpoint with early stop switched off (policy fallback)"),
}


# --------------------------------------------------------------------------
# recompute time
#
# This part runs on every guarded call (the forward capture) and every
# recompute, so it is written for speed: the capture is one generated tuple
# expression, the recompute guard one closure.

_DRIFT_READERS = tuple(getattr(_state, rule.read) for rule in DRIFT_RULES)
_DRIFT_RENDERERS = tuple(getattr(_state, rule.render) for rule in DRIFT_RULES)
# per reader: ``describe_change(was, now)`` or None ("render(was) → render(now)")
_DRIFT_CHANGES = tuple(getattr(read, "describe_change", None) for read in _DRIFT_READERS)
# per reader: ``relevant(function, was, now)`` or None (every change matters)
_DRIFT_RELEVANCE = tuple(getattr(read, "relevant", None) for read in _DRIFT_READERS)


def _compile_capture(readers: tuple) -> Any:
    """``lambda function: (read0(), read1(function), ...)`` as one generated expression.

    A reader marked ``takes_function`` is given the checkpointed function;
    one marked ``takes_inputs`` also the call's inputs and keyword arguments.

    A reader with an ``active`` attribute (a builtin query that is falsy when
    nothing is active, see ``_state``) is only called when that query says so,
    and ``()`` is used otherwise: on the usual quiet call this costs a few
    builtin calls instead of one Python call per drift rule.

    Readers with ``part_of = (reader, index)`` are parts of one read: the
    block's snapshot (its tensors, hooks and train/eval flags) is taken once,
    and so is what the block is given (containers and user generators).
    """
    namespace: dict = {}
    parts = []
    shared: dict = {}  # a reader that is part of a shared read (``part_of``): read once, indexed
    for i, read in enumerate(readers):
        group = getattr(read, "part_of", None)
        if group is not None:
            reader, index = group
            if reader not in shared:
                shared[reader] = f"shared{len(shared)}"
                namespace[shared[reader]] = reader
            parts.append(f"{shared[reader]}_[{index}]")
            continue
        namespace[f"read{i}"] = read
        if getattr(read, "takes_inputs", False):
            call = f"read{i}(function, inputs, keywords)"
        elif getattr(read, "takes_function", False):
            call = f"read{i}(function)"
        else:
            call = f"read{i}()"
        if hasattr(read, "active"):
            namespace[f"active{i}"] = read.active
            parts.append(f"({call} if active{i}() else ())")
        else:
            parts.append(call)
    reads = "".join(
        f"    {name}_ = {name}(function{', inputs, keywords' if getattr(reader, 'takes_inputs', False) else ''})\n"
        for reader, name in shared.items()
    )
    source = f"def capture(function, inputs=(), keywords=None):\n{reads}    return ({', '.join(parts)},)\n"
    # Filed under this file: dynamo skips it, and call-site walks count it as the guard's.
    exec(compile(source, __file__, "exec"), namespace)  # noqa: S102 - generated from the rule table
    return namespace["capture"]


#: ``capture(function, inputs=(), keywords=None)``: the recompute-relevant
#: state, one value per drift rule, in DRIFT_RULES order.
capture = _compile_capture(_DRIFT_READERS)

# Drift whose risk is visible at call time (a value that is empty when nothing
# is active): fallback avoids it by not checkpointing at all.
_ANTICIPATED_INDICES = tuple(
    i for i, rule in enumerate(DRIFT_RULES)
    if rule.read in ("swapped_reads", "user_dispatch_modes", "user_function_modes", "transform_stack")
)
_TRANSFORMS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "transform_stack")
_CONTENTS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "argument_contents")
_CONTENTS_RULE = DRIFT_RULES[_CONTENTS_INDEX]
_GENERATORS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "generator_states")
_MODE_INDICES = frozenset(
    i for i, rule in enumerate(DRIFT_RULES) if rule.read in ("user_dispatch_modes", "user_function_modes")
)

# Call sites found by walking the stack: (depth from prepare_call, id(code),
# f_lasti) -> code.  The same function, at the same instruction, at the same
# depth is the same call site again (a different instruction, as when one
# function reaches checkpoint both directly and through a helper or
# checkpoint_sequential, walks again).  _site_depth: where the last walk
# found the user's frame; the usual call chain keeps one shape.
_known_sites: dict = {}
_site_depth = 1


def _walk_to_forward_site() -> tuple:
    """``(code, f_lasti)`` of the innermost user frame above ``prepare_call``; learns it."""
    global _site_depth
    depth, frame = 1, sys._getframe(2)  # 2: prepare_call's caller
    while frame is not None and _is_library_code(frame.f_code):
        frame, depth = frame.f_back, depth + 1
    if frame is None:
        return (None, 0)
    if len(_known_sites) >= _CACHE_LIMIT:  # bounded: a program has few checkpoint call sites
        _known_sites.clear()
    _known_sites[(depth, id(frame.f_code), frame.f_lasti)] = frame.f_code
    _site_depth = depth
    return (frame.f_code, frame.f_lasti)


def _describe_forward_site(site: tuple) -> str:
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


STEP_ASIDE = "step-aside"  # run torch's checkpoint exactly as asked, unguarded

_scoped_config = _config.scoped_config
_getframe = sys._getframe
_torch_compiler = _torch.compiler
_peek_interpreter_stack = _state.peek_interpreter_stack
_len_dispatch_stack = _state._len_dispatch_stack
_len_function_stack = _state._len_function_stack
_saved_tensor_hooks_enabled = _state.saved_tensor_hooks_enabled
_call_is_quiet = _state.call_is_quiet
_rrelu_training = _state.rrelu_training
_rrelu_seen = _state.rrelu_seen
_noop_context_fn = getattr(_torch_checkpoint, "noop_context_fn", None)
_forward_ad = _state.forward_ad
# Is torch.fx.symbolic_trace running?  A thread-local flag from torch 2.15 (read
# through _get_is_fx_tracing), a module global before.
_fx_tracing = getattr(_fx_symbolic_trace, "_get_is_fx_tracing", None) or (
    lambda: _fx_symbolic_trace._is_fx_tracing_flag
)


class RngWatch:
    """Returned by :func:`prepare_call` for ``preserve_rng_state=False`` (CKG107).

    The patch point hands torch ``function``, with ``preserve_rng_state`` (True
    under fallback: the safe alternative), and records in ``drew[0]`` whether
    the forward advanced the CPU or a CUDA RNG; ``early_stop_off``: fallback
    also switches early stop off (CKG009, as :class:`EarlyStopOff`).
    """

    __slots__ = ("function", "preserve_rng_state", "drew", "early_stop_off")

    def __init__(self, function: Any, preserve_rng_state: bool, drew: list, early_stop_off: bool = False) -> None:
        self.function, self.preserve_rng_state, self.drew = function, preserve_rng_state, drew
        self.early_stop_off = early_stop_off


class EarlyStopOff:
    """Returned by :func:`prepare_call` when fallback switches early stop off (CKG009): run
    torch's checkpoint over ``function`` (the guarded handle) with its frame made without it."""

    __slots__ = ("function",)

    def __init__(self, function: Any) -> None:
        self.function = function


def prepare_call(
    reentrant: bool, function: Any, args: tuple, first_input: int, context_fn: Any = None,
    preserve_rng_state: bool = True, early_stop: bool = True, kwargs: Optional[dict] = None,
) -> Any:
    """Everything the guard does when ``checkpoint`` is called, for both variants.

    Returns ``STEP_ASIDE``, ``NO_CHECKPOINT``, ``NON_REENTRANT_INSTEAD``, an
    :class:`RngWatch`, an :class:`EarlyStopOff`, or the function to hand torch instead of ``function``:
    the same function, checked against the state captured here before every
    recompute.  ``args[first_input:]`` are the inputs; ``context_fn`` is the
    non-reentrant variant's (or None).

    This runs on every checkpoint call, so the quiet case is one straight
    line through builtin queries: about 3 µs of guard time per
    non-reentrant call on this project's machine, of which ~0.5 µs are the
    state queries, ~0.5 µs the capture, ~0.4 µs the call site and ~0.4 µs the
    recompute handle (``benchmarks/overhead.py`` measures the total).
    ``kwargs``: the non-reentrant variant's keyword arguments to the function.
    """
    # Inlined: _config.current(), and torch.compiler.is_compiling() as its flag
    # (dynamo never traces this file, see _patch._skip_in_dynamo).  The flag is
    # process-wide; AOT/export tracing on *this* thread also has its fake and
    # proxy modes on this thread's dispatch stack, so another thread's
    # compilation does not switch the guard off here.
    config = _scoped_config() or _config._installed
    if not config.active or (_torch_compiler._is_compiling_flag and _len_dispatch_stack()):
        return NO_CHECKPOINT if config.plain else STEP_ASIDE
    grad = _is_grad_enabled()
    may_anticipate = config.may_fall_back
    if grad:  # what a recompute must find again (it first walks a new block, and notes an RReLU in it)
        reads = _reads_target(function, args[first_input:])
        forward_state = capture(reads, args[first_input:], kwargs)
    # Inlined call_is_quiet for the usual non-reentrant call with grad on (CKG009 looks there too).
    rrelu = not reentrant and grad and _rrelu_seen[0] and _rrelu_training(function, early_stop)
    no_early_stop = False
    if (
        reentrant or not grad or _peek_interpreter_stack() is not None or not _saved_tensor_hooks_enabled()
        or _forward_ad._current_level >= 0 or rrelu
    ):
        if rrelu or not _call_is_quiet(reentrant, args[first_input:] if reentrant else (), grad):
            if _fx_tracing() and _peek_interpreter_stack() is None and _forward_ad._current_level < 0:
                return STEP_ASIDE  # torch.fx.symbolic_trace: Proxies, tracing, not training
            # (make_fx under a transform or a dual level, as torch.func.linearize traces its jvp: real
            # values, decided as any call)
            outcome = decide_call(reentrant, function, args[first_input:], config, early_stop)
            if outcome == AS_ASKED:  # torch as asked: no drift risk stands in for the rule
                may_anticipate = False
            elif outcome == NO_EARLY_STOP:  # still guarded for drift: the handle is wrapped below
                no_early_stop = True
            elif outcome != PROCEED:
                return outcome
        if not grad:
            return STEP_ASIDE  # nothing will be recomputed
    modes_managed = (
        context_fn is not None and context_fn is not _noop_context_fn and _is_user_context_fn(context_fn)
    )
    if may_anticipate and risk_visible(forward_state):
        if anticipate(config, forward_state, reentrant, reads, modes_managed) != PROCEED:
            return NO_CHECKPOINT
    # The user's call site, for messages: (code, f_lasti); the line number is
    # worked out only if a message needs it.  Inlined fast path: a known call
    # site at the last walk's depth.  (Walking the stack costs ~3 µs; each
    # frame object made costs ~0.3 µs, so only one is.)
    depth = _site_depth
    try:
        user = _getframe(depth)
    except ValueError:
        user = None
    if user is not None and _known_sites.get((depth, id(user.f_code), user.f_lasti)) is user.f_code:
        site = (user.f_code, user.f_lasti)
    else:
        site = _walk_to_forward_site()
    drew = [False] if preserve_rng_state is False and config.policy_for(_RNG_RULE.id) != "off" else None
    # CKG010: where fallback records the structure of a nested output it flattened
    nested = [None] if reentrant and config.policy_for(_NESTED_RULE.id) != "off" else None
    guarded = _partial(
        _checked_call, function, reentrant, config, forward_state, site, modes_managed, drew, reads, nested
    )
    if nested is not None:
        guarded.nested = nested
    if reentrant and _len_function_stack():
        guarded = _watch_device(guarded, function, config, forward_state, site)
    if drew is not None:
        return RngWatch(guarded, config.policy_for(_RNG_RULE.id) == "fallback", drew, no_early_stop)
    return EarlyStopOff(guarded) if no_early_stop else guarded


def _watch_device(guarded: Any, function: Any, config: _config.Config, forward_state: tuple, site: tuple) -> Any:
    """CKG109: under a GPU default device, watch the reentrant forward for tensors made without device=."""
    device = _state.accelerator_default_device()
    if device is None or config.policy_for(_DEVICE_RULE.id) == "off":
        return guarded
    return _partial(_device_watched_call, guarded, device, function, config, forward_state, site, [False])


def _is_user_context_fn(context_fn: Any) -> bool:
    """A ``context_fn`` the user chose: not the composable API's own."""
    try:
        module = getattr(context_fn, "__module__", "")
    except Exception:  # noqa: BLE001 - a user's __getattr__ may raise anything
        return True
    return module != "torch.distributed._composable.checkpoint_activation"


def clear_caches() -> None:
    """Forget the call sites and code objects seen (``uninstall()``: the guard holds nothing)."""
    global _site_depth
    _library_codes.clear()
    _known_sites.clear()
    _site_depth = 1
    _state.clear_caches()


def forward_context_of(context_fn: Any) -> Any:
    """The forward context a user ``context_fn`` gives (``context_fn()[0]``), or None.

    Fallback runs the function without checkpointing in it, as torch's
    checkpoint would have run the forward (an autocast ``context_fn`` keeps
    its dtype).  Selective checkpointing's caching mode is left out: it only
    decides what a recompute may reuse, and there is no recompute.
    """
    if context_fn is None or context_fn is _noop_context_fn or not _is_user_context_fn(context_fn):
        return None
    forward_context = context_fn()[0]
    if isinstance(forward_context, _composable.SELECTIVE_CACHING_MODE):
        return None
    return forward_context


#: recomputes of torch's checkpoint the guard has seen (the matrix reads it: a block recomputed
#: is a block whose activations the forward did not keep)
TORCH_RECOMPUTES = [0]


def _reads_target(function: Any, inputs: tuple) -> Any:
    """What the drift rules look at: ``function``, and the modules passed to it while a swap is active.

    ``checkpoint(run_layer, layer, h)`` under a ``functional_call``: the
    recompute reads ``layer``'s tensors as they are then.  Only while some
    swap is active (one builtin read otherwise).
    """
    if _swaps_active() and any(isinstance(a, _Module) for a in inputs):
        return _partial(function, *(a for a in inputs if isinstance(a, _Module)))
    return function


_Module = _torch.nn.Module
_swaps_active = _state.swapped_reads.active


def _checked_call(
    function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, site: tuple,
    modes_managed: bool, drew: Optional[list], reads: Any, nested: Optional[list], /, *args: Any, **kwargs: Any,
) -> Any:
    """Call ``function``; first compare the state with the forward's if this is a recompute.

    The non-reentrant variant calls the function it was given only to
    recompute.  The reentrant variant also runs the forward through it, but
    always under ``no_grad``, while its recompute runs under ``enable_grad``.
    ``drew`` (``preserve_rng_state=False`` only) records whether the forward
    drew random numbers; the non-reentrant forward is watched by ``_patch``.
    """
    if not reentrant or _is_grad_enabled():
        TORCH_RECOMPUTES[0] += 1
        state = _capture_without_mode_records(reads, args, kwargs)  # the call's records are what it compares with
        replays = ()
        if _differs(state, forward_state):
            replays = report_drift(reads, reentrant, config, forward_state, state, site, modes_managed)
        if drew is not None and drew[0]:
            report_unpreserved_rng(function, reentrant, config, forward_state, site)
        if replays:  # fallback: the recompute sees what the forward saw
            with contextlib.ExitStack() as stack:
                for replay in replays:
                    stack.enter_context(replay)
                return _watch_output(function(*args, **kwargs), reads, config, forward_state, site, nested)
        return _watch_output(function(*args, **kwargs), reads, config, forward_state, site, nested)
    if forward_state[_CONTENTS_INDEX] and config.policy_for(_CONTENTS_RULE.id) == "fallback":
        return _reentrant_forward_keeping_the_cache(function, args, forward_state, drew, config, site)
    if drew is None:
        return _watch_output(function(*args, **kwargs), reads, config, forward_state, site, nested)
    before = _state.rng_states()  # the reentrant forward, preserve_rng_state=False
    result = function(*args, **kwargs)
    drew[0] = _state.drew_random(before)
    return _watch_output(result, reads, config, forward_state, site, nested)


def _capture_without_mode_records(reads: Any, args: tuple = (), kwargs: Optional[dict] = None) -> tuple:
    """:func:`capture`, taking no record of the user's replayable modes: only the call takes one (a
    record copies the mode's tensors); the recompute compares with the call's."""
    _state.RECORDING_MODES.on = False
    try:
        return capture(reads, args, kwargs)
    finally:
        _state.RECORDING_MODES.on = True


class RerunNonReentrant(Exception):
    """Raised out of a reentrant forward that put a tensor in a container it was given (CKG112, fallback):
    the patch point runs the call again with ``use_reentrant=False``, the forward's effects undone."""


def _reentrant_forward_keeping_the_cache(
    function: Any, args: tuple, forward_state: tuple, drew: Optional[list], config: _config.Config, site: tuple,
) -> Any:
    """CKG112 under fallback, the reentrant forward of a block given a container.

    The reentrant forward runs under ``no_grad``: a tensor the block puts in
    a container it was given (a KV cache entry) would carry no gradient to the
    code that reads it later, and no recompute could give it one.  If it does,
    the forward's effects are undone (the containers' contents, the CPU and
    device RNG, the user generators) and the call runs again non-reentrant,
    which keeps that gradient.  Where the forward also updated a tensor in
    place (a BatchNorm's running statistics, an input) nothing can undo it:
    raised.
    """
    contents = forward_state[_CONTENTS_INDEX]
    before = _state.rng_states()
    devices, device_rng = _torch_checkpoint.get_device_states(*args)
    versions = _state.tensor_versions(function, args)
    output = function(*args)
    if not _state.changed_contents(contents):
        if drew is not None:  # preserve_rng_state=False (CKG107)
            drew[0] = _state.drew_random(before)
        return output
    modes = [forward_state[i] for i in _MODE_INDICES]
    if _state.updated_in_place(versions) or _state.modes_updated_in_place(modes):
        forward_site_text = _describe_forward_site(site)
        _report_at_recompute(
            _CONTENTS_RULE, "fallback", forward_site_text, when="after the reentrant forward",
            site=forward_site_text, forward_site=forward_site_text, checkpointed=describe_checkpointed(function),
            transforms=_state.describe_transforms(forward_state[_TRANSFORMS_INDEX]),
            variant=describe_variant(True, None), source=config.source,
            change=(
                f"{_state.describe_contents_change(contents)}, in a reentrant forward (under no_grad: what it put "
                "there carries no gradient) that also updated a tensor in place, a buffer, an input or one a "
                "marked mode holds, where autograd sees it (it cannot run again)"
            ),
        )
    _state.restore_contents(_state.changed_at_all(contents))
    _state.put_back_modes(modes)  # a marked mode's counter, its generator, its tensors
    _torch.set_rng_state(before[0])
    if devices:
        _torch_checkpoint.set_device_states(devices, device_rng)
    for _, generator, state in forward_state[_GENERATORS_INDEX]:
        generator.set_state(state)
    raise RerunNonReentrant


def _plain_output(output: Any) -> bool:
    """A tensor, or a flat tuple (tensors and non-tensors): what an autograd.Function tracks.

    A namedtuple is a tuple to it too: its tensors get their gradients (torch hands back a
    plain tuple).
    """
    if type(output) is _Tensor or isinstance(output, _Tensor):
        return True
    if isinstance(output, tuple):
        for item in output:
            if not isinstance(item, _Tensor) and (isinstance(item, (list, tuple, dict)) or _dataclasses.is_dataclass(item)):
                return False
        return True
    return not _tree_leaves_hold_tensors(output)


def _tree_leaves_hold_tensors(output: Any) -> bool:
    from torch.utils._pytree import tree_leaves

    if _dataclasses.is_dataclass(output) and not isinstance(output, type):
        return any(isinstance(getattr(output, f.name), _Tensor) for f in _dataclasses.fields(output))
    return any(isinstance(leaf, _Tensor) for leaf in tree_leaves(output))


_Tensor = _torch.Tensor


def _watch_output(
    output: Any, function: Any, config: _config.Config, forward_state: tuple, site: tuple, nested: Optional[list],
) -> Any:
    """CKG010, in the reentrant forward and its recompute: tensors in a container carry no gradient.

    Strict raises in the forward (nothing of it is kept); fallback hands the
    Function a flat tuple and records the structure in ``nested``, which
    :func:`rebuild_nested_output` puts back after ``apply``; warn leaves it.
    """
    if nested is None or _plain_output(output):
        return output
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(_dataclass_as_dict(output))
    if not any(isinstance(leaf, _Tensor) for leaf in leaves):
        return output
    policy = config.policy_for(_NESTED_RULE.id)
    if not _is_grad_enabled():  # the forward; the recompute reports nothing twice
        forward_site_text = _describe_forward_site(site)
        _report_at_recompute(
            _NESTED_RULE, policy, forward_site_text,
            repaired="handed the Function its outputs flat, rebuilt after (policy fallback)" if policy == "fallback" else "",
            site=forward_site_text, checkpointed=describe_checkpointed(function),
            transforms=_state.describe_transforms(forward_state[_TRANSFORMS_INDEX]),
            variant=describe_variant(True, None), source=config.source,
            change=f"the function returned a {type(output).__name__} holding tensors",
        )
    if policy != "fallback":
        return output
    nested[0] = (spec, output if _dataclasses.is_dataclass(output) else None)
    return tuple(leaves)


def _dataclass_as_dict(output: Any) -> Any:
    if _dataclasses.is_dataclass(output) and not isinstance(output, type):
        return {f.name: getattr(output, f.name) for f in _dataclasses.fields(output)}
    return output


def rebuild_nested_output(outputs: Any, nested: list) -> Any:
    """After ``CheckpointFunction.apply``: a flattened output back in its structure (CKG010, fallback)."""
    from torch.utils._pytree import tree_unflatten

    spec, dataclass = nested[0]
    rebuilt = tree_unflatten(list(outputs if isinstance(outputs, tuple) else (outputs,)), spec)
    return _dataclasses.replace(dataclass, **rebuilt) if dataclass is not None else rebuilt


def _device_watched_call(
    guarded: Any, device: Any, function: Any, config: _config.Config, forward_state: tuple, site: tuple,
    made: list, /, *args: Any, **kwargs: Any,
) -> Any:
    """CKG109: the reentrant forward (grad off) is watched, its recompute (grad on) checked.

    Only a forward that made a tensor without ``device=`` is reported: the
    recompute, run without the forward's device context, would make it on the
    CPU.  Fallback re-enters the context (a fresh one, as torch >= 2.11 does
    for the non-reentrant variant).
    """
    if not _is_grad_enabled():
        with _state.FactoryWatch(made):
            return guarded(*args, **kwargs)
    if not made[0]:
        return guarded(*args, **kwargs)
    report_lost_device(function, config, forward_state, site, device)  # raises under strict
    if config.policy_for(_DEVICE_RULE.id) == "fallback":
        with _torch.device(device):
            return guarded(*args, **kwargs)
    return guarded(*args, **kwargs)


def report_lost_device(function: Any, config: _config.Config, forward_state: tuple, site: tuple, device: Any) -> None:
    """CKG109: the forward made tensors on the default device ``device``; the recompute would not."""
    forward_site_text = _describe_forward_site(site)
    site_frame, _ = user_frame(sys._getframe(1))
    _report_at_recompute(
        _DEVICE_RULE, config.policy_for(_DEVICE_RULE.id), forward_site_text,
        checkpointed=describe_checkpointed(function),
        repaired=f"recomputing inside torch.device({str(device)!r}), the forward's device context (policy fallback)",
        site=describe_site(site_frame), forward_site=forward_site_text,
        transforms=_state.describe_transforms(forward_state[_TRANSFORMS_INDEX]),
        variant=describe_variant(True, None), source=config.source,
        change=(
            f"the forward ran inside a {device} default device and made tensors without device=; "
            "the recompute runs without that context, so they would land on the CPU"
        ),
    )


def _relevant_drift(function: Any, index: int, was: Any, now: Any, modes_managed: bool) -> bool:
    """Whether a changed value can change this function's recompute."""
    if index in _MODE_INDICES:
        # a user context_fn may enter modes of its own for the recompute: then only a mode of the
        # forward's missing from the recompute matters (a context_fn that re-enters it is fine)
        return not modes_managed or any(mode not in now for mode in was)
    relevant = _DRIFT_RELEVANCE[index]
    return relevant is None or relevant(function, was, now)


def report_drift(
    function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, state: tuple,
    site: tuple, modes_managed: bool = False, only: Optional[frozenset] = None,
) -> list:
    """Warn about, or raise for, every drift rule whose state changed (``only``: these readers).

    Returns the replays (context managers) fallback repairs them with, to be
    entered around the recompute.
    """
    changed = [
        i for i, (was, now) in enumerate(zip(forward_state, state))
        if _differs(was, now)
        and (only is None or DRIFT_RULES[i].read in only)
        and _DRIFT_HOLDS[i]
        and (reentrant or _DRIFT_NON_REENTRANT[i])
        and config.policy_for(DRIFT_RULES[i].id) != "off"
        and _relevant_drift(function, i, was, now, modes_managed)
    ]
    if not changed:
        return []
    forward_site_text = _describe_forward_site(site)
    site_frame, _ = user_frame(sys._getframe(1))
    transforms = _state.describe_transforms(forward_state[_TRANSFORMS_INDEX])
    variant = describe_variant(reentrant, None)
    replays = []
    for index in changed:
        rule, render, was, now = DRIFT_RULES[index], _DRIFT_RENDERERS[index], forward_state[index], state[index]
        describe_change = _DRIFT_CHANGES[index]
        policy = config.policy_for(rule.id)
        replay = _replay(rule, was, now, function, modes_managed, reentrant) if policy == "fallback" else None
        _report_at_recompute(
            rule, policy, forward_site_text,
            repaired=replay[1] if replay else "",
            site=describe_site(site_frame), forward_site=forward_site_text, transforms=transforms,
            variant=variant, source=config.source,
            checkpointed=describe_checkpointed(function, roots=_state.swapped_roots(forward_state)),
            change=_describe_change(describe_change, was, now, function, render),
            remedy=_case_remedy(rule, was, now, repaired=bool(replay)),
            fallback_text=_case_fallback(rule, was),
            symptom=_case_symptom(rule, was, now),
        )
        if replay:
            replays.append(replay[0])
    return replays


def _describe_change(describe: Any, was: Any, now: Any, function: Any, render: Any) -> str:
    if describe is None:
        return f"{render(was)} → {render(now)}"
    if getattr(describe, "takes_function", False):
        return describe(was, now, function)
    return describe(was, now)


_differs = _state.differs


# --------------------------------------------------------------------------
# fallback's replays: the recompute sees what the forward saw


def _replay(
    rule: Rule, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
) -> Optional[tuple]:
    """``(context manager, what fallback did)`` for a drift fallback can undo, or None."""
    if rule.read in ("user_dispatch_modes", "user_function_modes"):
        dispatch = rule.read == "user_dispatch_modes"
        replayable = not modes_managed and (reentrant or _state.QUIET_RECOMPUTE_HOOKS)
        replay = _state.modes_to_replay(was, now, dispatch) if replayable else None
        if replay is None or not _state.mode_state_kept(replay):
            return None  # torch's mode above a user mode, a gradient-carrying tensor it holds updated
        popped, pushed, restated = replay
        names = ", ".join(type(mode).__name__ for mode, _ in (*restated, *pushed))
        off = (
            f"; {', '.join(type(mode).__name__ for mode in popped)} (not the forward's) taken off for it"
            if popped else ""
        )
        return _state.replaying_modes(replay, dispatch, inside_hooks=not reentrant), (
            f"recomputing under the forward's own mode objects ({names}, marked with "
            f"ckpt_guard.replayable_mode) with their attributes as the forward found them{off}; their "
            "state is put back after (policy fallback)"
        )
    if rule.read == "default_dtype":
        return _composable.default_dtype(was), f"recomputing in the forward's default dtype, {was} (policy fallback)"
    if rule.read == "module_training" and was is not None:
        modes = _state.retrained(was, function)
        if not modes:
            return None  # its modules changed since the forward: no mode to put back
        return _rebind.bound([(m, "__dict__", "training", flag) for m, flag in modes]), (
            "recomputing with each module in the train/eval mode it had in the forward, bound for this "
            "recompute on its thread (policy fallback)"
        )
    if rule.read == "argument_contents":
        changed = _state.changed_at_all(was)  # every value put back, a position counter too
        if not _state.replayable(changed):
            return None  # updated in place, or only its length kept: what the forward read is gone
        return _state.replaying_contents(changed), (
            "recomputing with the containers the block was given as the forward found them, their "
            "contents put back after the recompute (policy fallback)"
        )
    if rule.read == "generator_states":
        moved = [(generator, state) for _, generator, state in _state.moved_generators(was)]
        return _state.replaying_generators(moved), (
            "recomputing with each user generator in the state the forward found it in, its state put "
            "back after the recompute (policy fallback)"
        )
    if rule.read in ("block_bindings", "block_hooks"):
        changes = _state.rebound(was, function, hooks=rule.read == "block_hooks")
        if not changes or any(store == "new" for _, store, _, _ in changes):
            return None  # something the forward did not have: nothing to put back
        derived = _derived_bindings(changes)
        if derived is None:
            return None  # a module keeps its own view of the tensor: binding the name would not reach it
        return _forward_bindings(changes + derived), (
            "recomputing with what the forward read, bound for this recompute on its thread (policy fallback)"
        )
    return None


def _derived_bindings(changes: list) -> Optional[list]:
    """What else to bind so the recompute reads the forward's tensors; None where that is unknown.

    A module whose class has its own ``__setattr__`` may keep its own view
    of a tensor set on it: an RNN keeps ``_flat_weights`` (its forward reads
    that list, not the attributes), which is re-bound too.  Any other such
    class: no replay (fallback then raises, as strict), never a recompute
    that silently reads the new tensor.
    """
    flat_weights: dict = {}  # id(rnn) -> (rnn, its _flat_weights with the forward's tensors put back)
    for owner, store, name, value in changes:
        if store not in ("_parameters", "_buffers") or type(owner).__setattr__ is _Module.__setattr__:
            continue
        names = owner.__dict__.get("_flat_weights_names")
        flat = owner.__dict__.get("_flat_weights")
        if not (isinstance(owner, _torch.nn.RNNBase) and names is not None and flat is not None and name in names):
            return None
        _, replaced = flat_weights.setdefault(id(owner), (owner, list(flat)))
        replaced[list(names).index(name)] = value
    return [(rnn, "__dict__", "_flat_weights", replaced) for rnn, replaced in flat_weights.values()]


#: a closure cell is the function's, not the thread's: one replay at a time points cells
_CELL_LOCK = _state.REPLAY_LOCK


@contextlib.contextmanager
def _forward_bindings(changes: list) -> Any:
    """The forward's tensors and hooks where the block reads them (modules: per thread; cells: locked)."""
    from collections import OrderedDict

    bindings = [
        (owner, "__dict__", name, OrderedDict(value) if store in ("_forward_hooks", "_forward_pre_hooks") else value)
        for owner, store, name, value in changes if store != "cell"
    ]
    cells = [(cell, value) for cell, store, _, value in changes if store == "cell"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_rebind.bound(bindings))
        if cells:
            stack.enter_context(_CELL_LOCK)
            for cell, value in cells:
                held = cell.cell_contents
                cell.cell_contents = value
                stack.callback(setattr, cell, "cell_contents", held)
        yield


def _case_symptom(rule: Rule, was: Any, now: Any) -> str:
    """What torch really does in this very case, where the rule's general words would not say it."""
    if rule.read in ("user_dispatch_modes", "user_function_modes") and _state.only_state_moved(was, now):
        return (
            "returns silently wrong gradients: the recompute runs under the forward's mode object, but "
            "with the state it has now (the forward moved it on), so it computes other values"
        )
    if rule.read == "transform_stack" and any(name == "jvp" for name, _ in was) and not any(
        name == "jvp" for name, _ in now
    ):
        return (
            "raises CheckpointError: A different number of tensors was saved during the original forward "
            "and recomputation (the recompute runs without the jvp's forward-mode level, so it saves "
            "other tensors than the forward did)"
        )
    return ""


def _marked_modes_recorded(rule: Rule, was: Any) -> bool:
    """CKG102/103 where the forward's user modes include a marked one whose state was recorded."""
    return rule.read in ("user_dispatch_modes", "user_function_modes") and any(
        record is not None for record in getattr(was, "records", ())
    )


def _case_fallback(rule: Rule, was: Any) -> str:
    """What fallback does in this very case, where the rule's general words say more than fits."""
    if _marked_modes_recorded(rule, was):
        return (
            "checkpoints the block and recomputes it under the forward's own mode objects, with their "
            "attributes, tensors and generators as the forward found them, put back after"
        )
    return ""


def _case_remedy(rule: Rule, was: Any, now: Any, repaired: bool = False) -> str:
    """A remedy that fits this very case, where the rule's general one would not (``repaired``:
    fallback already made the recompute right)."""
    if _marked_modes_recorded(rule, was):
        if repaired:
            return (
                "nothing to change for correctness: the mode is marked @ckpt_guard.replayable_mode and "
                "this recompute ran under the forward's mode object with the state it had then; to save "
                "the replay's cost, keep the mode out of the checkpointed region"
            )
        return (
            "the mode is marked @ckpt_guard.replayable_mode: policy fallback for this rule (next line) "
            "makes this call right and keeps its memory saving (a non-reentrant call on torch < 2.8 "
            "runs without checkpointing); or keep the mode out of the checkpointed region"
        )
    if rule.read == "transform_stack" and any(name == "jvp" for name, _ in was):
        return (
            "checkpoint these blocks with ckpt_guard.checkpoint (or run under policy fallback): its "
            "recompute carries the jvp's tangents, and .backward() after torch.func.jvp (a MeanFlow or "
            "consistency-model loss) then keeps the memory saving"
        )
    if rule.read == "swapped_reads" and (isinstance(now, _state.SwappedReads) or _state.swaps_active_here()):
        # .backward() already runs under a functional_call, just not the forward's
        # (second-order MAML: one backward recomputes the inner and the outer step).
        return (
            "the recompute runs under another functional_call than the forward's: when one backward "
            "recomputes blocks that ran under different functional_calls (second-order MAML: the "
            "inner and the outer step), no single one can stay active for all of them. Run these "
            "blocks without checkpointing (policy fallback does), or checkpoint outside the "
            "stateless calls"
        )
    return ""


def report_unpreserved_rng(
    function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, site: tuple,
) -> None:
    """CKG107: the forward drew random numbers with ``preserve_rng_state=False``."""
    forward_site_text = _describe_forward_site(site)
    site_frame, _ = user_frame(sys._getframe(1))
    _report_at_recompute(
        _RNG_RULE, config.policy_for(_RNG_RULE.id), forward_site_text, checkpointed=describe_checkpointed(function),
        repaired="recomputing with the forward's RNG state, which it preserved (policy fallback)",
        site=describe_site(site_frame), forward_site=forward_site_text,
        transforms=_state.describe_transforms(forward_state[_TRANSFORMS_INDEX]),
        variant=describe_variant(reentrant, None), source=config.source,
        change="the forward drew random numbers; preserve_rng_state=False lets the recompute draw new ones",
    )


def _report_at_recompute(
    rule: Rule, policy: str, forward_site_text: str, repaired: str = "", when: str = "before the recompute ran",
    **details: Any,
) -> None:
    """Warn, or raise ``when`` (before the recompute runs); ``repaired``: what fallback already did about it."""
    if policy == "warn" or (policy == "fallback" and repaired):
        action = repaired if policy == "fallback" else "recomputing as torch would (policy warn)"
        _events.emit(rule.id, policy, "warned" if policy == "warn" else "fallback: repaired", forward_site_text, rule.stage)
        _warn(build_message(rule, policy=policy, action=action, worked=policy == "fallback", **details), rule,
              once=action if policy == "fallback" else "")
        return
    unforeseen = ": this drift could not be foreseen at call time" if policy == "fallback" else ""
    message = build_message(
        rule, policy=policy, action=f"raised {when} (policy {policy}{unforeseen})", **details,
    )
    _events.emit(rule.id, policy, "raised", forward_site_text, rule.stage)
    raise CheckpointCompositionError(message, rule)


def _anticipated_rule(
    config: _config.Config, forward_state: tuple, modes_managed: bool = False, reentrant: Optional[bool] = None,
) -> Optional[Rule]:
    """The drift rule under fallback whose risk is visible in this forward state, or None.

    User modes that are all marked replayable (and recorded) are not a risk
    here: the recompute re-enters them (:func:`_replay`), unless a user
    ``context_fn`` manages the recompute's modes, or the call is
    non-reentrant on a torch whose recompute hooks cannot be hidden from
    them (2.4-2.7).  ``reentrant`` None: not known (taken as non-reentrant).
    """
    modes_replayable = not modes_managed and (bool(reentrant) or _state.QUIET_RECOMPUTE_HOOKS)
    if not risk_visible(forward_state):
        return None
    for index in _ANTICIPATED_INDICES:
        if (
            forward_state[index]
            and _DRIFT_HOLDS[index]
            and config.policy_for(DRIFT_RULES[index].id) == "fallback"
            and (index not in _MODE_INDICES or not modes_replayable or not _replayable(forward_state[index]))
        ):
            return DRIFT_RULES[index]
    return None


def _replayable(modes: Any) -> bool:
    """Every user mode is marked replayable and its state was recorded at the call."""
    return all(record is not None for record in getattr(modes, "records", (None,)))


def anticipate(
    config: _config.Config, forward_state: tuple, reentrant: bool, function: Any, modes_managed: bool = False,
) -> str:
    """Fallback for drift risks visible at call time: run without checkpointing.

    A parameter swap, a user mode (not marked replayable) or a torch.func
    transform is active while grad is enabled (the patch points only ask
    then): the recompute could run after it ended, and then nothing could
    repair the gradients.
    """
    rule = _anticipated_rule(config, forward_state, modes_managed, reentrant)
    if rule is None:
        return PROCEED
    site_frame, _ = user_frame(sys._getframe(1))
    site = describe_site(site_frame)
    message = build_message(
        rule, site=site, checkpointed=describe_checkpointed(function, site_frame),
        from_your_code=describe_site(your_code(site_frame)),
        transforms=_state.describe_transforms(forward_state[_TRANSFORMS_INDEX]),
        variant=describe_variant(reentrant, None),
        policy="fallback",
        source=config.source,
        anticipated=True,
        worked=True,
        # what torch does when the recompute finds none of it (.backward() outside the transform)
        symptom=_case_symptom(rule, forward_state[DRIFT_RULES.index(rule)], ()),
        action=(
            "ran it without checkpointing (policy fallback): nothing has gone wrong, but the "
            "recompute could run after this state changed, and then nothing could repair the "
            "gradients (policy strict raises if it sees that happen at the recompute)"
        ),
    )
    _events.emit(rule.id, "fallback", "fallback: no checkpoint", site, "call")
    _warn(message, rule, once="no checkpoint")
    return NO_CHECKPOINT


def risk_visible(forward_state: tuple) -> bool:
    """Cheap pre-check for :func:`anticipate`: is any anticipated state non-empty?"""
    for index in _ANTICIPATED_INDICES:
        if forward_state[index]:
            return True
    return False


# --------------------------------------------------------------------------
# the composable recompute (fallback where torch's checkpoint cannot compose)
#
# ``checkpoint_entry`` sits where a checkpoint call's result is returned (the
# output entry, ``_layouts.find_output_entry``), patched in once a
# configuration that can fall back is in force.  It asks
# :func:`composable_instead` first; anything it leaves alone goes on to
# torch's checkpoint and the choke points, which decide as before.

#: what fallback records when it runs a block as the composable recompute
COMPOSABLE_ACTION = "fallback: composable recompute"


def checkpoint_entry(function: Any, args: tuple, kwargs: dict, options: dict, original: Any) -> Any:
    """The output entry: a composable recompute where fallback calls for one, else torch's checkpoint."""
    config = _scoped_config() or _config._installed
    if config.may_fall_back:
        use_reentrant = options.get("use_reentrant")
        reentrant = use_reentrant is None or bool(use_reentrant)
        context_fn = options.get("context_fn")
        # torch refuses keyword arguments and context_fn for the reentrant variant: leave that to it
        if not (reentrant and (kwargs or (context_fn is not None and context_fn is not _noop_context_fn))):
            context_fn = None if context_fn is _noop_context_fn else context_fn
            chosen = composable_instead(
                reentrant, function, args, kwargs, config, context_fn, options.get("preserve_rng_state", True),
            )
            if chosen is not None:
                built, announce = chosen
                try:
                    result = _composable.run(built)
                except _composable.Refused as refused:
                    announce(refused.reason)  # the block reads what the recompute could not lift
                    if refused.ran:  # the plain run is the result: never run the block twice
                        return refused.output
                    with forward_context_of(context_fn) or contextlib.nullcontext():
                        return function(*args, **kwargs)
                announce(built.unpacked)  # None: packed into the recompute
                return result
    return original()


# What the composable recompute cannot undo: it replays the RNG, the default
# dtype and autocast, and reads the tensors it lifted (swaps do not reach it),
# but a train/eval switch or an optimizer step changes what it computes.
_COMPOSABLE_DRIFT = frozenset({"module_training", "optimizer_steps"})


_COMPOSABLE_DRIFT_INDICES = frozenset(i for i, rule in enumerate(DRIFT_RULES) if rule.read in _COMPOSABLE_DRIFT)


def _composable_state(function: Any) -> tuple:
    """The drift state the composable recompute checks (the rest, as None: it may hold the call's tensors)."""
    return tuple(v if i in _COMPOSABLE_DRIFT_INDICES else None for i, v in enumerate(capture(function)))


def _check_composable_recompute(
    function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, site: tuple,
) -> list:
    state = _composable_state(function)
    if _differs(state, forward_state):
        return report_drift(function, reentrant, config, forward_state, state, site, only=_COMPOSABLE_DRIFT)
    return []


def _watch_composable_recompute(built: Any, reentrant: bool, config: _config.Config, site_frame: Any) -> None:
    """Before each recompute of ``built``: the drift it cannot undo (see ``_COMPOSABLE_DRIFT``).

    Watched through the plan's own block (its template), which reaches the
    same modules as the call's function but none of the call's tensors.
    """
    forward_site = (site_frame.f_code, site_frame.f_lasti) if site_frame is not None else (None, 0)
    built.check_recompute = _partial(
        _check_composable_recompute, built.function, reentrant, config, _composable_state(built.function), forward_site
    )


def composable_instead(
    reentrant: bool, function: Any, args: tuple, kwargs: dict, config: _config.Config,
    context_fn: Any, preserve_rng_state: bool,
) -> Any:
    """Under fallback, the composable recompute to run instead of this checkpoint call, or None.

    Chosen where fallback would otherwise run the block without checkpointing:
    a call-time rule fires under fallback (and ``use_reentrant=False`` would not
    do), or no rule fires but a parameter swap or a torch.func transform makes a
    drift risk visible.  Not for user modes (the recompute would run without
    them) nor where the recompute cannot be correct (``_composable.plan``).
    When chosen, this call's one warning and its events are emitted here.
    """
    if (_torch_compiler._is_compiling_flag and _len_dispatch_stack()) or _fx_tracing():
        return None
    grad = _is_grad_enabled()
    inputs = args if reentrant else ()
    quiet = _call_is_quiet(reentrant, inputs, grad)
    state = None if quiet else _state.read_call_state(reentrant, function, args)
    firing = _firing(state, config) if state is not None else []
    anticipated = False
    if firing:
        rule, policy = _deciding(firing)
        if policy != "fallback" or rule.fallback_runs or _non_reentrant_will_do(state, config, function):
            return None
    else:
        if not grad or (state is not None and applying_rules(state)):
            return None  # nothing will be recomputed, or the user switched off the rule for this
        # only swaps and transforms matter here, not a mode's record
        rule = _anticipated_rule(config, _capture_without_mode_records(_reads_target(function, args)))
        if rule is None or rule.read not in ("swapped_reads", "transform_stack"):
            return None
        anticipated = True
    built = _composable.plan(function, args, kwargs, context_fn=context_fn, preserve_rng_state=preserve_rng_state)
    if isinstance(built, str):
        return None  # torch's checkpoint runs next; fallback runs the block plainly and says so
    site_frame, _ = user_frame(sys._getframe(1))
    _watch_composable_recompute(built, reentrant, config, site_frame)
    site = describe_site(site_frame)
    transforms = state.transforms if state is not None else _state.transform_stack()
    variant = describe_variant(reentrant, None)
    also = [other.id for other, _ in firing if other is not rule]

    def announce(refusal: Optional[str]) -> None:
        """The call's one warning and its events, once it is known what ran."""
        if refusal is not None:
            event = "fallback: no checkpoint"
            action = (
                "ran it without checkpointing (policy fallback): ckpt_guard's composable recompute "
                f"could not be used, because {_composable.describe_reason(refusal)}"
            )
        elif anticipated:
            event = COMPOSABLE_ACTION
            action = (
                "ran it as ckpt_guard's composable recompute (policy fallback): nothing has gone wrong, "
                "but torch's recompute could run after this state changed; this one recomputes with the "
                "tensors the forward read, whenever it runs, and keeps the memory saving"
            )
        else:
            event = COMPOSABLE_ACTION
            action = (
                "ran it as ckpt_guard's composable recompute instead (policy fallback): torch.func "
                "can transform it, and it keeps the memory saving"
            )
        for fired, fired_policy in firing or [(rule, "fallback")]:
            _events.emit(fired.id, fired_policy, event, site, "call")
        # what torch does when the recompute finds none of it (.backward() outside the transform)
        symptom = _case_symptom(rule, transforms, ()) if rule.read == "transform_stack" else ""
        _warn(build_message(
            rule, site=site, variant=variant, policy="fallback", source=config.source, action=action,
            anticipated=anticipated, also=also, worked=True, symptom=symptom, saving_kept=refusal is None,
            **_where(function, transforms, site_frame),
        ), rule, once=action)

    return built, announce


def _swapped_parameters(function: Any, args: tuple = ()) -> bool:
    """Whether a module ``function`` reads (or is passed) holds a parameter that is not an ``nn.Parameter``.

    On every eager ``ckpt_guard.checkpoint`` call: about 4 µs for a transformer layer
    (``type(...) is`` first; ``isinstance`` on a Parameter goes through a metaclass).
    """
    stack = [*_reads.reads_of(function).complete().modules, *(a for a in args if isinstance(a, _torch.nn.Module))]
    while stack:
        module = stack.pop()
        if module is None:
            continue
        for tensor in module._parameters.values():
            if type(tensor) is not _Parameter and tensor is not None and not isinstance(tensor, _Parameter):
                return True
        stack.extend(module._modules.values())
    return False


_Parameter = _torch.nn.Parameter
#: keywords torch's checkpoint takes for itself on this release (the rest go to the function)
_TORCH_OPTIONS = frozenset(
    name for name, parameter in inspect.signature(_torch_checkpoint.checkpoint).parameters.items()
    if parameter.kind is parameter.KEYWORD_ONLY
)


def _untracked_swap(
    function: Any, args: tuple, kwargs: dict, block_kwargs: dict, options: dict, config: _config.Config,
    context_fn: Any, reason: str,
) -> Any:
    """CKG101 for ``ckpt_guard.checkpoint`` outside transforms, under a swap the guard did not track.

    The composable recompute refused the block, and the choke points cannot
    see this swap (no ``install()``, or a swap made without
    ``functional_call``).  Whether torch's recompute reads the swapped-in
    tensors depends on whether the swap still holds then (higher's patched
    modules keep their fast weights; a ``functional_call`` ends): so strict
    and warn run torch's checkpoint (early stop off) with the tensors needing
    a gradient that the block reads from outside recorded, and act at the
    recompute if it reads other ones than the forward; fallback runs the block
    without checkpointing (nothing could repair a recompute that reads other
    tensors).
    """
    rule = _SWAP_RULE
    policy = config.policy_for(rule.id)
    if policy == "off":
        return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
    site_frame, _ = user_frame(sys._getframe(2))
    site = describe_site(site_frame)
    details = dict(
        variant=describe_variant(False, False), source=config.source, **_where(function, (), site_frame),
    )
    refused = "\n  ckpt_guard.checkpoint could not use its composable recompute here: " + _composable.describe_reason(reason)
    if policy == "fallback":
        _events.emit(rule.id, policy, _OUTCOME_TEXT[NO_CHECKPOINT][0], site, "call")
        _warn(build_message(
            rule, site=site, policy=policy, anticipated=True, worked=True,
            action="ran it without checkpointing (policy fallback)", **details,
        ) + refused, rule, once="no checkpoint")
        with forward_context_of(context_fn) or contextlib.nullcontext():
            return function(*args, **block_kwargs)
    given = [a for a in (*args, *kwargs.values()) if isinstance(a, _Tensor)]
    recorder = _RecordedReads(given, rule, policy, site, details, refused)
    # Handed to torch as ``partial(recorder's method bound to function)``: the guard's own snapshot
    # (CKG106/110/111, when installed) still finds the user's module or function behind it.
    recorded = functools.partial(types.MethodType(_run_recorded, function), recorder)
    # Early stop off: the recompute runs to its end, so it reads everything the forward read
    with _torch_checkpoint.set_checkpoint_early_stop(False):
        return _torch_checkpoint.checkpoint(recorded, *args, **options, **kwargs)


def _refused_under_swap(function: Any, config: _config.Config, reason: str) -> None:
    """CKG101 for ``ckpt_guard.checkpoint`` outside transforms, under a swap, refused after the block ran.

    The block ran once, plainly, with the swapped-in tensors: that is right,
    and it is the call's result.  Every policy but off says so, strict too:
    nothing wrong is returned, and whether torch's own recompute would have
    read other tensors depends on the swap holding then (higher's patched
    modules keep their fast weights), which nothing here can tell.
    """
    rule = _SWAP_RULE
    policy = config.policy_for(rule.id)
    if policy == "off":
        return
    site_frame, _ = user_frame(sys._getframe(2))
    site = describe_site(site_frame)
    details = dict(
        variant="ckpt_guard.checkpoint, run without checkpointing (see the next line)", source=config.source,
        **_where(function, (), site_frame),
    )
    refused = "\n  ckpt_guard.checkpoint could not use its composable recompute here: " + _composable.describe_reason(reason)
    _events.emit(rule.id, policy, _OUTCOME_TEXT[NO_CHECKPOINT][0], site, "call")
    _warn(build_message(
        rule, site=site, policy=policy, anticipated=True, worked=True,
        action=f"ran it once without checkpointing (policy {policy}): that run is the result", **details,
    ) + refused, rule, once="ran once" if policy == "fallback" else "")


class _RecordedReads:
    """What :func:`_untracked_swap` compares: the tensors needing a gradient the forward read from outside."""

    def __init__(self, given: list, rule: Rule, policy: str, site: str, details: dict, refused: str) -> None:
        self.given, self.rule, self.policy, self.site, self.details = given, rule, policy, site, details
        self.refused = refused
        self.forward: Optional[dict] = None  # id -> tensor

    def compare(self, recompute: dict) -> None:
        forward = self.forward or {}
        other = [t for key, t in recompute.items() if forward.get(key) is not t]
        missing = [t for key, t in forward.items() if recompute.get(key) is not t]
        if not other and not missing:
            return
        parts = [f"read {len(other)} tensor(s) needing a gradient that the forward did not"] if other else []
        if missing:
            parts.append(f"did not read {len(missing)} that the forward read")
        first = (other or missing)[0]
        change = f"the recompute {' and '.join(parts)} (the first of shape {tuple(first.shape)}): the swap had ended"
        try:  # warn says so (torch's recompute ran); strict raises before the backward uses it
            _report_at_recompute(
                self.rule, self.policy, self.site, when="in torch's recompute, before the backward used it",
                site=self.site, forward_site=self.site, change=change, **self.details,
            )
        except CheckpointCompositionError as exc:
            raise CheckpointCompositionError(f"{exc}{self.refused}", self.rule) from None


def _run_recorded(function: Any, recorder: _RecordedReads, *args: Any, **kwargs: Any) -> Any:
    """The block, its outside reads recorded: the forward's kept, the recompute's compared with them."""
    reads = _proof.CapturedReads(recorder.given)
    with reads:
        output = function(*args, **kwargs)
    if recorder.forward is None:
        recorder.forward = reads.captured
    else:
        recorder.compare(reads.captured)
    return output


_SWAP_RULE = next(rule for rule in DRIFT_RULES if rule.read == "swapped_reads")


def public_checkpoint(
    function: Any, args: tuple, kwargs: dict, context_fn: Any, preserve_rng_state: bool,
) -> Any:
    """``ckpt_guard.checkpoint``: torch's non-reentrant checkpoint, or the composable recompute.

    Outside torch.func transforms (and forward-mode AD): torch's own
    ``checkpoint(use_reentrant=False)`` (guarded as any call, if installed),
    unless a ``functional_call`` swap is active (as in MAML's outer loss):
    torch's recompute would run after the swap ended and read the module's
    own parameters (CKG101), the composable one binds what the forward read.
    Installed, the guard tracks swaps; without it, a swap shows as a module
    parameter that is not an ``nn.Parameter`` (a swap that puts in another
    model's parameters is not seen then).  Under a transform: the composable
    recompute, where it is correct.
    Elsewhere the rule that explains why is applied under the policy in force:
    the scope's, else the installed one, else the environment's (default
    strict), whether or not the guard is installed.
    """
    scoped = _scoped_config()
    if scoped is not None and scoped.plain:  # inside a recompute: the outer one recomputes this too
        return function(*args, **{k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS})
    options = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if context_fn is not None:
        options["context_fn"] = context_fn
    eager = _peek_interpreter_stack() is None and _forward_ad._current_level < 0
    # a swap: seen by the guard's functional_call tracking when installed (any swap active on this
    # thread: the block may reach a swapped module any way), else by its traces
    if eager and not (_state.swaps_active_here() or _swapped_parameters(function, args)):
        return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
    installed = _config._installed  # install("off") is a policy in force, not the absence of one
    config = scoped or (installed if installed.active or installed.source != "default" else None)
    if config is None:
        config = _config.from_environment()
    # torch's own options (determinism_check, debug, ...) are for torch's checkpoint, not the block
    block_kwargs = {k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS}
    built = _composable.plan(function, args, block_kwargs, context_fn=context_fn, preserve_rng_state=preserve_rng_state)
    if not isinstance(built, str):
        site_frame, _ = user_frame(sys._getframe(1))
        _watch_composable_recompute(built, False, config, site_frame)
        try:
            return _composable.run(built)
        except _composable.Refused as refused:  # the run-time proof: decided below, as a plan refusal
            if refused.ran:
                # the block ran once, plainly, as the caller wrote it: that is the result (strict
                # raises the rule's explanation; warn and fallback say so and keep it)
                if eager:
                    _refused_under_swap(function, config, refused.reason)
                else:
                    decide_call(False, function, args, config, refused=refused.reason, ran=True)
                return refused.output
            built = refused.reason
    if eager:
        if _state.swaps_active_here():  # torch's checkpoint, guarded as any call: the guard sees this swap
            return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
        return _untracked_swap(function, args, kwargs, block_kwargs, options, config, context_fn, built)
    outcome = decide_call(False, function, args, config, refused=built)  # strict raises the rule's explanation
    if outcome == NO_CHECKPOINT:  # fallback: plainly, inside the user's forward context
        with forward_context_of(context_fn) or contextlib.nullcontext():
            return function(*args, **block_kwargs)
    return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
