"""The decision at call time: what fires, and what the policy in force makes of it.

``prepare_call`` runs on every guarded checkpoint call.  It returns quietly when
nothing fires (a handful of builtin queries prove it: ``_state.call_is_quiet``), else
reads the call's state, applies the call rules that hold on the installed torch, and
acts by policy: raise (strict), warn and run as asked (warn), warn and run the safest
correct alternative (fallback: use_reentrant=False, the composable recompute, or no
checkpoint).  Where the call goes on checkpointed, it arms the recompute-time check
(``_drift``).  ``composable_instead`` is fallback's way into ckpt_guard's composable
recompute.  Everything past the quiet test (finding the user's call site, writing the
message, recording the event) runs only when a rule fires, so it may be thorough.

Owns: the action names (``PROCEED``, ``NO_CHECKPOINT``...), the per-call preparation and
its fast paths.  May not touch: the words (``_messages``) or torch's state (``_state``)
other than through their functions.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from functools import partial as _partial
from types import FrameType
from typing import Any, NamedTuple, Optional

import torch as _torch
import torch.fx._symbolic_trace as _fx_symbolic_trace
import torch.utils.checkpoint as _torch_checkpoint

from . import _composable, _config, _events, _state, _versions
from ._actions import AS_ASKED, CALL_RULES_HERE, NON_REENTRANT_INSTEAD, NO_CHECKPOINT, NO_EARLY_STOP, PROCEED
from ._drift_kinds import (
    BINDINGS_INDEX, COMPOSABLE_AVOIDS, DRIFT_KINDS, HOOKS_INDEX, STEPS_INDEX, TRAINING_INDEX, TRANSFORMS_INDEX,
)
from ._drift import (
    anticipated_rule, capture_without_mode_records, checked_call, device_watched_call,
    reads_target, anticipate, anticipate_own_bindings, capture, report_drift,
    risk_visible,
)
from ._exceptions import CheckpointCompositionError
from ._layouts import kept_inputs
from ._messages import (
    CACHE_LIMIT, call_case_remedy, is_library_code, library_codes, emit_warning, with_refusal,
    build_message, describe_checkpointed, describe_site, describe_variant, use_reentrant_defaulted,
    user_frame, your_code,
)
from ._rules import CALL_RULES, DEVICE_RULE as _DEVICE_RULE, DRIFT_RULES, NESTED_OUTPUT_RULE as _NESTED_RULE
from ._rules import BUFFER_WRITES_RULE as _BUFFERS_RULE, RNG_RULE as _RNG_RULE

# The patch points (``_layouts``' guards, handed this module by ``_patch``) reach the
# recompute side through here too: one module to hand over.
from ._drift import RerunNonReentrant, rebuild_nested_output  # noqa: E402,F401

_SEVERITY = _config.SEVERITY


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


def where_lines(function: Any, transforms: tuple, site_frame: Optional[FrameType]) -> dict:
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
    where = where_lines(function, state.transforms, site_frame)

    also = [other.id for other, _ in firing if other is not rule]
    where["remedy"] = call_case_remedy(rule, state, refused)
    if policy == "strict":
        message = with_refusal(build_message(
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
    event, action = OUTCOME_TEXT[outcome]
    if ran:
        outcome, event = NO_CHECKPOINT, OUTCOME_TEXT[NO_CHECKPOINT][0]
        action = f"ran it once without checkpointing (policy {policy}): that run is the result"
    for other, other_policy in firing:
        _events.emit(other.id, other_policy, event, site, "call")
    emit_warning(with_refusal(build_message(
        rule, site=site, variant=variant, policy=policy, source=config.source, action=action, also=also,
        worked=policy == "fallback", **where,
    ), refused), rule, once=action if policy == "fallback" else "")
    return AS_ASKED if outcome == PROCEED else outcome


def _non_reentrant_will_do(state: _state.CallState, config: _config.Config, function: Any) -> bool:
    """Fallback for a reentrant call: is use_reentrant=False right here?

    Only if no call-time rule would fire for it, and no drift risk would make
    fallback run it without checkpointing anyway.
    """
    return (
        state.reentrant
        and _nothing_fires(replace(state, reentrant=False))
        and anticipated_rule(config, capture(function)) is None
    )


# outcome -> (event action, message action)
OUTCOME_TEXT = {
    PROCEED: ("warned", "ran torch's checkpoint as asked (policy warn)"),
    NON_REENTRANT_INSTEAD: ("fallback: use_reentrant=False", "ran it with use_reentrant=False instead (policy fallback)"),
    NO_CHECKPOINT: ("fallback: no checkpoint", "ran it without checkpointing instead (policy fallback)"),
    NO_EARLY_STOP: ("fallback: no early stop", "ran torch's checkpoint with early stop switched off (policy fallback)"),
}

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
    while frame is not None and is_library_code(frame.f_code):
        frame, depth = frame.f_back, depth + 1
    if frame is None:
        return (None, 0)
    if len(_known_sites) >= CACHE_LIMIT:  # bounded: a program has few checkpoint call sites
        _known_sites.clear()
    _known_sites[(depth, id(frame.f_code), frame.f_lasti)] = frame.f_code
    _site_depth = depth
    return (frame.f_code, frame.f_lasti)


STEP_ASIDE = "step-aside"  # run torch's checkpoint exactly as asked, unguarded

_getframe = sys._getframe
_torch_compiler = _torch.compiler
_peek_interpreter_stack = _state.peek_interpreter_stack
_differs, _is_grad_enabled = _state.differs, _state.is_grad_enabled
_len_dispatch_stack = _state.len_dispatch_stack
_len_function_stack = _state.len_function_stack
_saved_tensor_hooks_enabled = _state.saved_tensor_hooks_enabled
_call_is_quiet = _state.call_is_quiet
_rrelu_training = _state.rrelu_training
_rrelu_seen = _state.rrelu_seen
_grad_sample_hooked = _state.grad_sample_hooked
_needs_refresh = _state.needs_refresh
_kept_buffers = _state.kept_buffers
_Tensor = _torch.Tensor
_is_wrapped = _state.is_functorch_wrapped_tensor
_modes_off = _torch._C.DisableTorchFunction
_no_dispatch_modes = _torch.utils._python_dispatch._disable_current_modes
_bindings_here = _composable.binding.bindings_here
#: CKG117's claim holds on this torch (a recompute updates the block's buffers again)
_BUFFERS_WATCHED = _BUFFERS_RULE.holds_on(_versions.installed())
_MAY_NEED_REFRESH = _state.MAY_NEED_REFRESH
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
    config = _config.current()
    if not config.active or (_torch_compiler._is_compiling_flag and _len_dispatch_stack()):
        if config.active and _peek_interpreter_stack() is not None and not reentrant:
            return _compiling_under_a_transform(config, function)
        return NO_CHECKPOINT if config.plain else STEP_ASIDE
    if not reentrant and getattr(function, "__module__", None) == _DYNAMO_BODY and _peek_interpreter_stack() is not None \
            and config.policy_for(_CKG001.id) != "warn":
        # backend "eager" runs dynamo's checkpoint op by calling torch's checkpoint on the traced body: the
        # same composition, at run time (a composable recompute's wrapped outputs would reach dynamo's next frame);
        # warn takes the usual path (CKG001's warning naming the traced block, then torch's error)
        return _compiling_under_a_transform(config, function)
    grad = _is_grad_enabled()
    may_anticipate = config.may_fall_back
    if grad:  # what a recompute must find again (it first walks a new block, and notes an RReLU in it)
        reads = reads_target(function, args[first_input:])
        forward_state = capture(reads, args[first_input:], kwargs)
    # Inlined call_is_quiet for the usual non-reentrant call with grad on (CKG009 looks there too, ...
    rrelu = not reentrant and grad and _rrelu_seen[0] and _rrelu_training(function, early_stop)
    # ... and CKG011 (Opacus' grad-sample hooks), looked for only in a block whose snapshot holds hooks
    hooked = not reentrant and grad and bool(forward_state[HOOKS_INDEX]) and _grad_sample_hooked(
        function, forward_state[HOOKS_INDEX]
    )
    no_early_stop = False
    if (
        reentrant or not grad or _peek_interpreter_stack() is not None or not _saved_tensor_hooks_enabled()
        or _forward_ad._current_level >= 0 or rrelu or hooked
    ):
        if rrelu or hooked or not _call_is_quiet(reentrant, args[first_input:] if reentrant else (), grad):
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
    if may_anticipate and risk_visible(forward_state) and not _no_gradient_can_follow(function, args[first_input:]):
        if anticipate(config, forward_state, reentrant, reads, modes_managed) != PROCEED:
            return NO_CHECKPOINT
    bindings = forward_state[BINDINGS_INDEX]
    own_bindings = type(bindings) in _MAY_NEED_REFRESH and _needs_refresh(bindings)
    if own_bindings and may_anticipate and anticipate_own_bindings(config, forward_state, reentrant, reads) != PROCEED:
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
    # CKG117: the buffers of its modules in training mode, kept as the call found them (copy on write)
    kept = _kept_buffers(reads, forward_state[TRAINING_INDEX], bindings) if _BUFFERS_WATCHED and config.policy_for(
        _BUFFERS_RULE.id
    ) != "off" else None
    guarded = _partial(
        checked_call, function, reentrant, config, forward_state, site, modes_managed, drew, reads, nested, kept
    )
    if reentrant and _len_function_stack():
        guarded = _watch_device(guarded, function, config, forward_state, site)
    # set on the handle the patch point gets (a device watch above wraps the one prepared)
    if nested is not None:
        guarded.nested = nested
    outer = _bindings_here()
    if outer is not None:
        # called inside a recompute that replays the forward's world (a checkpoint nested in one whose
        # module a meta-optimizer re-bound): this call's own recompute comes later, outside it, and is
        # run inside the same bindings again, so it reads what this forward read
        guarded = _partial(_inside, outer, guarded)
    afters = []
    if not reentrant and config.policy in ("strict", "fallback"):
        # torch saves the inputs for its recompute as copies on write: the block's own write into one
        # (F.relu(h, inplace=True) first) leaves the recompute what the forward read, where torch
        # alone raises that a saved tensor was modified; each recompute is given copies on write of
        # those in turn (a double backward recomputes twice).  A write after the forward (the caller's)
        # is what autograd refuses without checkpointing where the block saved the input: raised so.
        given = _input_versions(args[first_input:])
        if given:
            after: list = []
            guarded = _partial(_on_copies, guarded, given, after)
            guarded.keep_inputs = True
            afters.append(_partial(_versions_after, given, after))
    if own_bindings:
        # its modules bind their own tensors in the forward (higher's): the patch point re-reads them
        # when the forward ends, and the recompute compares with what the forward read
        afters.append(_partial(_state.refresh_after_forward, reads, bindings))
    if afters:
        guarded.after_forward = afters[0] if len(afters) == 1 else _partial(_each, afters)
    if drew is not None:
        return RngWatch(guarded, config.policy_for(_RNG_RULE.id) == "fallback", drew, no_early_stop)
    return EarlyStopOff(guarded) if no_early_stop else guarded


def _no_gradient_can_follow(function: Any, inputs: tuple) -> bool:
    """No transform runs, and nothing the call reads requires grad (an evaluation under a swap with
    detached parameters): no backward can follow, so no recompute can drift (issue 48: fallback
    warned of a risk there).  Asked only where a risk is visible at call time."""
    if _peek_interpreter_stack() is not None or _forward_ad._current_level >= 0:
        return False
    if not all(issubclass(type(value), _SEEN_THROUGH) for value in inputs):
        return False  # an object the walk does not look into may hold a trainable tensor
    # every tensor the call may read (a module passed as an argument, one in eval mode: its parameters too),
    # read where no mode of the user's sees the guard's reads
    with _modes_off():
        held = _state.block_reads.held_tensors(_partial(function, *inputs))
        return not any(_state.requires_grad_anywhere(t) for t in held) and not any(
            isinstance(t, _Tensor) and _state.requires_grad_anywhere(t) for t in inputs
        )


#: arguments whose tensors the reads walk sees (a module's, a container's), or that hold none
_SEEN_THROUGH = (_Tensor, _torch.nn.Module, list, tuple, dict, int, float, bool, str, type(None))


def _compiling_under_a_transform(config: _config.Config, function: Any) -> Any:
    """torch's checkpoint traced by AOTAutograd while a torch.func transform runs around the compiled
    code (``torch.compile(grad(f), backend="aot_eager"/"inductor")``): torch's own fails there ("don't
    yet support saved tensor hooks").  Fallback traces the block plainly (right, its activations kept),
    saying so; strict raises CKG001 saying what works; warn says so and steps aside (torch's error)."""
    rule = _CKG001
    policy = config.policy_for(rule.id)
    if policy == "off" or not rule.holds_on(_versions.installed()):
        return STEP_ASIDE
    words = (
        "torch's checkpoint inside torch.compile, under a torch.func transform that runs around the compiled "
        "code: torch's recompute fails there (saved tensor hooks under a grad transform), and ckpt_guard's "
        "composable recompute cannot run inside a compiled region"
    )
    import warnings

    from ._exceptions import CheckpointCompositionWarning

    if policy == "warn":
        warnings.warn(CheckpointCompositionWarning(
            f"[{rule.id}] {words}: torch's checkpoint runs as asked (policy warn), and torch's error follows. "
            "Policy fallback runs the block plainly there; docs/compile.md says what keeps the saving.", rule,
        ), stacklevel=3)
        return STEP_ASIDE
    if policy == "fallback":
        warnings.warn(CheckpointCompositionWarning(
            f"[{rule.id}] {words}: ran the block without checkpointing, traced with the rest (policy fallback). "
            "The result is the uncheckpointed program's; its activations are kept (no memory saving for it). "
            "docs/compile.md says what keeps the saving.", rule,
        ), stacklevel=3)
        return NO_CHECKPOINT
    raise CheckpointCompositionError(
        f"[{rule.id}] {rule.title}\n  {words}.\n  fix:\n    - checkpoint with ckpt_guard.checkpoint, which runs the "
        "block plainly there (and says so), or use policy fallback, which does the same for torch's checkpoint\n"
        "    - or compile the block rather than the transform (grad(f), f calling a torch.compile'd block): "
        "the composable recompute then keeps the memory saving\n  details: python -m ckpt_guard explain "
        f"{rule.id}, docs/compile.md", rule,
    )


_CKG001 = next(rule for rule in CALL_RULES if rule.id == "CKG001")
#: the module of the wrapper through which dynamo's checkpoint op calls torch's checkpoint on its traced body
_DYNAMO_BODY = "torch._higher_order_ops.wrap"


def _inside(bindings: list, guarded: Any, *args: Any, **kwargs: Any) -> Any:
    """A recompute inside the bindings its call was made in (see :func:`prepare_call`)."""
    with _composable.binding.bound(bindings):
        return guarded(*args, **kwargs)


def _input_versions(inputs: tuple) -> list:
    """``[(position, tensor, version)]`` of the call's plain tensor inputs (what ``kept_inputs`` copies).

    The tensors are held (torch's frame holds them too, until the backward), so that a write
    into one after the forward is seen even where the caller dropped its last name for it.
    """
    if not _len_function_stack():
        return [(i, t, t._version) for i, t in enumerate(inputs) if type(t) is _Tensor and not _is_wrapped(t)]
    with _modes_off():  # a version read is a torch function: no mode of the user's sees the guard's
        return [(i, t, t._version) for i, t in enumerate(inputs) if type(t) is _Tensor and not _is_wrapped(t)]


def _versions_after(given: list, after: list) -> None:
    """When the forward has run: each input's version then (the block's own writes counted)."""
    with _modes_off():
        after[:] = [t._version for _, t, _ in given]


def _each(calls: list) -> None:
    for call in calls:
        call()


def _on_copies(guarded: Any, given: list, after: list, *args: Any, **kwargs: Any) -> Any:
    """A non-reentrant recompute that reads each input as the forward read it.

    An input the block wrote in place in its forward (``F.relu(h, inplace=True)``
    first) is recomputed from a copy on write of what the call found (``kept_inputs``:
    torch saved those); any other is the caller's own tensor, as torch would hand it
    (a marked mode writing into it during the forward and its replay see the same
    tensor).  An input written after the forward (by the caller) is recomputed from a copy
    on write of what the forward read, and raised, as autograd raises without
    checkpointing, where the block saved it (or a view of it): the recompute, which saves
    what the forward saved, is watched for that.  A torch without a way to read its
    recompute's saved-tensor hooks (``_top_saved_tensors_default_hooks``: 2.4) raises there.
    """
    args = list(args)
    with _modes_off():
        now = [tensor._version for _, tensor, _ in given]
    written_after = []
    for (i, tensor, before), version, current in zip(given, after, now):
        if current != version:
            if _top_hooks is None or not (i < len(args) and isinstance(args[i], _Tensor)):
                raise _written_after(tensor, version, current)
            args[i] = kept_inputs((args[i],))[0]  # what the call found (torch saved a copy on write of it)
            written_after.append((args[i], tensor, version, current))
            continue
        if i < len(args) and isinstance(args[i], _Tensor):
            if version == before:  # not written by the forward: the tensor itself, as torch would read it
                if _forward_ad._current_level >= 0 and _forward_ad.unpack_dual(tensor).tangent is not None:
                    args[i] = tensor  # a dual: as it is (a detached one has no tangent, and the recompute
                    continue  # would save fewer tensors than the forward: "a different number ... saved")
                with _modes_off(), _no_dispatch_modes():  # the guard's own detach: no user mode sees it
                    args[i] = tensor.detach().requires_grad_(args[i].requires_grad)
            else:  # the forward wrote it: a fresh copy on write of what the call found
                args[i] = kept_inputs((args[i],))[0]
    if written_after:
        return _recompute_unless_saved(guarded, args, kwargs, written_after)
    return guarded(*args, **kwargs)


_top_hooks = getattr(_torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _recompute_unless_saved(guarded: Any, args: list, kwargs: dict, written_after: list) -> Any:
    """The recompute from what the call found, raised where the block saved an input the caller wrote since
    (without checkpointing autograd raises there; where the block saved none, the plain program runs)."""
    hooks = _top_hooks(False)  # torch's recomputation hook, around this call
    if hooks is None:
        _, tensor, version, current = written_after[0]
        raise _written_after(tensor, version, current)
    pack, unpack = hooks
    copies = [copy for copy, _, _, _ in written_after]
    saved: list = []

    def watch(x: Any) -> Any:
        if not saved:
            for k, copy in enumerate(copies):
                if x is copy or getattr(x, "_base", None) is copy:
                    saved.append(k)
                    break
        return pack(x)

    try:
        with _torch.autograd.graph.saved_tensors_hooks(watch, unpack):
            return guarded(*args, **kwargs)
    finally:
        if saved:  # raised even where torch stops the recompute early (once it has what it needs)
            _, tensor, version, current = written_after[saved[0]]
            raise _written_after(tensor, version, current)


def _written_after(tensor: Any, version: int, current: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: an input of a checkpointed call (a {tuple(tensor.shape)} tensor) was written in "
        f"place after the block's forward read and saved it (its version was {version}, now {current}). "
        "Without checkpointing autograd raises the same here; ckpt_guard: update a copy, or write after "
        "the backward"
    )


def _watch_device(guarded: Any, function: Any, config: _config.Config, forward_state: tuple, site: tuple) -> Any:
    """CKG109: under a GPU default device, watch the reentrant forward for tensors made without device=."""
    device = _state.accelerator_default_device()
    if device is None or config.policy_for(_DEVICE_RULE.id) == "off":
        return guarded
    return _partial(device_watched_call, guarded, device, function, config, forward_state, site, [False])


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
    library_codes.clear()
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
    config = _config.current()
    if config.may_fall_back:
        use_reentrant = options.get("use_reentrant")
        reentrant = use_reentrant is None or bool(use_reentrant)
        context_fn = options.get("context_fn")
        # torch refuses keyword arguments and context_fn for the reentrant variant: leave that to it
        if not (reentrant and (kwargs or (context_fn is not None and context_fn is not _noop_context_fn))):
            context_fn = None if context_fn is _noop_context_fn else context_fn
            chosen = composable_instead(
                reentrant, function, args, kwargs, config, context_fn, options.get("preserve_rng_state", True),
                defaulted=use_reentrant is None,  # the entry runs before torch warns (and marks the frame)
            )
            if chosen is not None:
                built, announce, site_frame = chosen
                came = run_composable(built, reentrant, config, site_frame)
                if came.refusal is None:
                    announce(built.unpacked)  # None: packed into the recompute
                    return came.output
                announce(came.refusal)  # the block reads what the recompute could not lift
                if came.ran:  # the plain run is the result: never run the block twice
                    return came.output
                with forward_context_of(context_fn) or contextlib.nullcontext():
                    return function(*args, **kwargs)
    return original()


# What the composable recompute cannot undo: it replays the RNG, the default
# dtype and autocast, and reads the tensors it lifted (swaps do not reach it),
# but a train/eval switch or an optimizer step changes what it computes.
_TRANSFORMS_ID = DRIFT_RULES[TRANSFORMS_INDEX].id

# (their places in a capture, read directly before each recompute)
_COMPOSABLE_DRIFT = frozenset({TRAINING_INDEX, STEPS_INDEX})
_module_training, _optimizer_steps = _state.module_training, _state.optimizer_steps


def _composable_state(training: Any, steps: int, transforms: Any = None) -> tuple:
    """The drift state the composable recompute checks, as a capture has it, with the transforms the
    forward ran under for the message (the rest, as None: it may hold the call's tensors)."""
    state: list = [None] * len(DRIFT_RULES)
    state[TRAINING_INDEX], state[STEPS_INDEX], state[TRANSFORMS_INDEX] = training, steps, transforms
    return tuple(state)


def _check_composable_recompute(
    function: Any, reentrant: bool, config: _config.Config, training: Any, steps: int, site: tuple,
    transforms: Any,
) -> list:
    # only its two reads, compared as they are (this runs before every recompute); a full state on drift
    training_now, steps_now = _module_training(function), _optimizer_steps()
    if steps_now != steps or _differs(training_now, training):
        return report_drift(
            function, reentrant, config, _composable_state(training, steps, transforms),
            _composable_state(training_now, steps_now, transforms), site, only=_COMPOSABLE_DRIFT,
        )
    return []


class ComposableRun(NamedTuple):
    """What one call through the composable recompute came to (see :func:`run_composable`)."""

    #: what the call returns where ``ran``: the recompute's packed outputs, or the plain run's
    output: Any
    #: None where the outputs were packed into the recompute; else why it could not take the call
    #: (a ``_composable.Reason``: the run-time proof's, found during the plain run, or the plan's)
    refusal: Any
    #: whether the block ran, once, as the caller wrote it: then ``output`` is the call's result,
    #: and the block must not run again
    ran: bool


def run_composable(built: Any, reentrant: bool, config: _config.Config, site_frame: Any) -> ComposableRun:
    """The one door into the composable recompute, for both entries: ``ckpt_guard.checkpoint`` (``_entry``)
    and fallback's (:func:`checkpoint_entry`).  Each keeps only its words for what came of it.

    ``built`` is ``_composable.plan``'s plan for the call.  Before each of its recomputes the drift it
    cannot undo is checked (:func:`watch_composable_recompute`); then the block runs once, plainly,
    under the run-time proof, and its outputs are packed, or the proof refuses the call.
    """
    watch_composable_recompute(built, reentrant, config, site_frame)
    try:
        return ComposableRun(_composable.run(built), None, True)
    except _composable.Refused as refused:  # the run-time proof: decided by the caller, as a plan refusal
        return ComposableRun(refused.output, refused.reason, refused.ran)


def watch_composable_recompute(built: Any, reentrant: bool, config: _config.Config, site_frame: Any) -> None:
    """Before each recompute of ``built``: the drift it cannot undo (see ``_COMPOSABLE_DRIFT``).

    Watched through the plan's own block (its template), which reaches the
    same modules as the call's function but none of the call's tensors.
    """
    forward_site = (site_frame.f_code, site_frame.f_lasti) if site_frame is not None else (None, 0)
    function = built.at_call.function
    built.before_each_recompute(_partial(
        _check_composable_recompute, function, reentrant, config, _module_training(function), _optimizer_steps(),
        forward_site, _state.transform_stack(),  # the transforms: for the message only (about 2 µs)
    ))


def composable_instead(
    reentrant: bool, function: Any, args: tuple, kwargs: dict, config: _config.Config,
    context_fn: Any, preserve_rng_state: bool, defaulted: Optional[bool] = None,
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
        if not grad or (state is not None and applying_rules(state)) or _no_gradient_can_follow(function, args):
            return None  # nothing will be recomputed, or the user switched off the rule for this
        # only swaps and transforms matter here, not a mode's record
        rule = anticipated_rule(config, capture_without_mode_records(reads_target(function, args)))
        if rule is None or rule.id not in COMPOSABLE_AVOIDS:  # what fallback runs as the composable recompute
            return None
        anticipated = True
    built = _composable.plan(function, args, kwargs, context_fn=context_fn, preserve_rng_state=preserve_rng_state)
    if isinstance(built, str):
        return None  # torch's checkpoint runs next; fallback runs the block plainly and says so
    site_frame, _ = user_frame(sys._getframe(1))
    site = describe_site(site_frame)
    transforms = state.transforms if state is not None else _state.transform_stack()
    if defaulted is None:  # ``defaulted``: whether use_reentrant was not passed, where the caller knows
        defaulted = use_reentrant_defaulted() if reentrant else False
    variant = describe_variant(reentrant, reentrant and defaulted)  # as strict says it
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
        symptom = DRIFT_KINDS[TRANSFORMS_INDEX].case_symptom(transforms, ()) if rule.id == _TRANSFORMS_ID else ""
        emit_warning(build_message(
            rule, site=site, variant=variant, policy="fallback", source=config.source, action=action,
            anticipated=anticipated, also=also, worked=True, symptom=symptom, saving_kept=refusal is None,
            **where_lines(function, transforms, site_frame),
        ), rule, once=action)

    return built, announce, site_frame
