"""``ckpt_guard.checkpoint``: torch's non-reentrant checkpoint, or the composable recompute."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from typing import Any, Optional

import torch as _torch
import torch.utils.checkpoint as _torch_checkpoint

from . import _composable, _config, _events, _state
from ._composable import proof as _proof
from ._actions import NO_CHECKPOINT
from ._decide import OUTCOME_TEXT, decide_call, forward_context_of, prepare_call, run_composable, where_lines
from ._drift import report_at_recompute
from ._drift_kinds import SWAPS_INDEX
from ._exceptions import CheckpointCompositionError
from ._layouts import kept_inputs
from ._messages import emit_warning, build_message, describe_site, describe_variant, user_frame
from ._rules import DRIFT_RULES
from ._rules import Rule
from .checkpoint_policies import is_policy_not_context_fn, names_policy_of
from ._state import block_reads as _reads
from ._state import is_module as _is_module

_Tensor = _torch.Tensor
_forward_ad, _peek_interpreter_stack = _state.forward_ad, _state.peek_interpreter_stack


def _swapped_parameters(function: Any, args: tuple = ()) -> bool:
    """Whether a module ``function`` reads (or is passed) holds a parameter that is not an ``nn.Parameter``.

    On every eager ``ckpt_guard.checkpoint`` call: about 4 µs for a transformer layer
    (``type(...) is`` first; ``isinstance`` on a Parameter goes through a metaclass).
    """
    stack = [*_reads.reads_of(function).complete().modules, *(a for a in args if _is_module(a))]
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


#: torch's checkpoint routes what selective checkpointing saves through the user's
#: saved_tensors_hooks when asked (pytorch#190581, torch 2.15); unasked, it warns
_RESPECTS_HOOKS = "respect_saved_tensors_hooks" in _TORCH_OPTIONS


def saved_tensors_hooks_option(value: Optional[bool]) -> dict:
    """The ``respect_saved_tensors_hooks`` keyword ckpt_guard.checkpoint hands torch's checkpoint.

    Where the installed torch has it: the caller's value, else ``True`` (torch's
    announced default, and never its FutureWarning).  Where it does not:
    nothing (those tensors bypass the hooks there), and ``True`` is an error.
    """
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"ckpt_guard.checkpoint(..., respect_saved_tensors_hooks={value!r}): expected True, False or "
            "None (left out: True where torch has the option)"
        )
    if _RESPECTS_HOOKS:
        return {"respect_saved_tensors_hooks": True if value is None else value}
    if value:
        raise ValueError(
            f"ckpt_guard.checkpoint(..., respect_saved_tensors_hooks=True): torch {_torch.__version__}'s "
            "checkpoint has no such option (it is newer: pytorch#190581, in torch 2.15.0): here the tensors "
            "selective checkpointing saves always bypass saved_tensors_hooks; leave it out, or pass False"
        )
    return {}


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
        variant=describe_variant(False, False), source=config.source, **where_lines(function, (), site_frame),
    )
    refused = "\n  ckpt_guard.checkpoint could not use its composable recompute here: " + _composable.describe_reason(reason)
    if policy == "fallback":
        _events.emit(rule.id, policy, OUTCOME_TEXT[NO_CHECKPOINT][0], site, "call")
        emit_warning(build_message(
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
        **where_lines(function, (), site_frame),
    )
    refused = "\n  ckpt_guard.checkpoint could not use its composable recompute here: " + _composable.describe_reason(reason)
    _events.emit(rule.id, policy, OUTCOME_TEXT[NO_CHECKPOINT][0], site, "call")
    emit_warning(build_message(
        rule, site=site, policy=policy, anticipated=True, worked=True,
        action=f"ran it once without checkpointing (policy {policy}): that run is the result", **details,
    ) + refused, rule, once="ran once" if policy == "fallback" else "")


class _RecordedReads:
    """What :func:`_untracked_swap` compares: the tensors needing a gradient the forward read from outside."""

    def __init__(self, given: list, rule: Rule, policy: str, site: str, details: dict, refused: str) -> None:
        self.given, self.rule, self.policy, self.site, self.details = given, rule, policy, site, details
        self.refused = refused
        self.forward: Optional[dict] = None  # id -> tensor

    def compare(self, recompute: dict, stopped: bool = False) -> None:
        """Report the recompute's reads that differ from the forward's (``stopped``: it raised part-way,
        so what it did not reach yet is not missing)."""
        forward = self.forward or {}
        other = [t for key, t in recompute.items() if forward.get(key) is not t]
        missing = [] if stopped else [t for key, t in forward.items() if recompute.get(key) is not t]
        if not other and not missing:
            return
        parts = [f"read {len(other)} tensor(s) needing a gradient that the forward did not"] if other else []
        if missing:
            parts.append(f"did not read {len(missing)} that the forward read")
        first = (other or missing)[0]
        change = f"the recompute {' and '.join(parts)} (the first of shape {tuple(first.shape)}): the swap had ended"
        try:  # warn says so (torch's recompute ran); strict raises before the backward uses it
            report_at_recompute(
                self.rule, self.policy, self.site, when="in torch's recompute, before the backward used it",
                site=self.site, forward_site=self.site, change=change, **self.details,
            )
        except CheckpointCompositionError as exc:
            raise CheckpointCompositionError(f"{exc}{self.refused}", self.rule) from None


def _run_recorded(function: Any, recorder: _RecordedReads, *args: Any, **kwargs: Any) -> Any:
    """The block, its outside reads recorded: the forward's kept, the recompute's compared with them."""
    reads = _proof.CapturedReads(recorder.given)
    if recorder.forward is None:
        with reads:
            output = function(*args, **kwargs)
        recorder.forward = reads.captured
        return output
    try:
        with reads:
            output = function(*args, **kwargs)
    except Exception:
        # torch (or a subclass: ExpandedWeights) raised part-way through a recompute that read other
        # tensors: the rule explains why (strict raises it; warn says it, then torch's error goes on)
        recorder.compare(reads.captured, stopped=True)
        raise
    recorder.compare(reads.captured)
    return output


_SWAP_RULE = DRIFT_RULES[SWAPS_INDEX]


def _checked_without_install(
    function: Any, args: tuple, kwargs: dict, options: dict, preserve_rng_state: bool,
    scoped: Optional[_config.Config] = None,
) -> Any:
    """Torch's checkpoint for ``ckpt_guard.checkpoint`` outside torch.func, with nothing installed:
    each recompute is checked as an installed guard checks it (the drift rules, under the
    policy in force, a ``policy()`` scope's else the environment's: a parameter a
    meta-optimizer re-bound, a train/eval switch, a module's timestep set before each call).

    The guard's own call preparation runs here under that policy, as a patch point would run
    it; torch calls the block once for the forward (as given) and once per recompute (checked
    against the forward's state: strict raises the rule, fallback replays the forward's
    world, warn warns).  What needs a patch point (a watch on ``preserve_rng_state=False``'s
    forward, early stop switched off) is left to torch, as before.
    """
    token = _config.push_scope(scoped or _config.from_environment())
    try:
        guarded = prepare_call(
            False, function, args, 0, options.get("context_fn"), preserve_rng_state, True, kwargs,
        )
    finally:
        _config.pop_scope(token)
    if guarded == NO_CHECKPOINT:  # fallback: a call rule says checkpointing here is not safe
        # the user's forward context (an autocast context_fn) wraps it, as torch's forward would
        forward_context = forward_context_of(options.get("context_fn")) or contextlib.nullcontext()
        with forward_context:
            return function(*args, **{k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS})
    if not isinstance(guarded, functools.partial):  # nothing to check, or what needs a patch point
        return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
    forward = [True]
    # fallback: torch saves copies on write of the inputs for its recompute (see kept_inputs); the
    # forward runs on the caller's own
    saved = kept_inputs(args) if getattr(guarded, "keep_inputs", False) else args

    def block(*inner_args: Any, **inner_kwargs: Any) -> Any:
        if forward[0]:  # torch's forward: the block as given, on the caller's tensors
            forward[0] = False
            output = function(*args, **inner_kwargs)
            after = getattr(guarded, "after_forward", None)
            if after is not None:  # its modules bound their own tensors in the forward: re-read
                after()
            return output
        return guarded(*inner_args, **inner_kwargs)  # a recompute: checked first

    return _torch_checkpoint.checkpoint(block, *saved, **options, **kwargs)


def _names_not_kept(names: Any, reason: Any, instead: str) -> None:
    """A naming policy outside torch.func whose block ckpt_guard's recompute cannot take: said, once per site."""
    import warnings

    warnings.warn(
        f"ckpt_guard.checkpoint with {names!r}: ckpt_guard's recompute cannot take this block ({reason}); "
        f"{instead}, and nothing is saved by name", UserWarning, stacklevel=4,
    )


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
    if context_fn is not None and is_policy_not_context_fn(context_fn):
        name = getattr(context_fn, "__name__", None) or repr(context_fn)
        raise TypeError(
            f"ckpt_guard.checkpoint(..., context_fn={name}): that is a save policy, not a context_fn; "
            f"pass context_fn=checkpoint_policies.context_fn({name})"
        )
    scoped = _config.scoped_config()
    if scoped is not None and scoped.plain:  # inside a recompute: the outer one recomputes this too
        return function(*args, **{k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS})
    options = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if context_fn is not None:
        options["context_fn"] = context_fn
    eager = _peek_interpreter_stack() is None and _forward_ad._current_level < 0
    # a swap: seen by the guard's functional_call tracking when installed (any swap active on this
    # thread: the block may reach a swapped module any way), else by its traces
    swapped = eager and (_state.swaps_active_here() or _swapped_parameters(function, args))
    # a naming policy: torch's selective checkpointing cannot see checkpoint_name, this recompute can
    names = names_policy_of(context_fn) if context_fn is not None else None
    if eager and not swapped and names is None:
        if not _config.installed().active:  # no patch point guards torch's call here
            return _checked_without_install(function, args, kwargs, options, preserve_rng_state, scoped)
        return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
    named_eager = eager and not swapped  # (names is not None)
    config = _config.for_ckpt_guard_checkpoint(scoped)
    # torch's own options (determinism_check, debug, ...) are for torch's checkpoint, not the block
    block_kwargs = {k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS}
    built = _composable.plan(function, args, block_kwargs, context_fn=context_fn, preserve_rng_state=preserve_rng_state)
    if not isinstance(built, str):
        site_frame, _ = user_frame(sys._getframe(1))
        came = run_composable(built, False, config, site_frame)
        if came.refusal is None:
            return came.output
        if came.ran:
            # the block ran once, plainly, as the caller wrote it: that is the result (strict
            # raises the rule's explanation; warn and fallback say so and keep it)
            if named_eager:
                _names_not_kept(names, came.refusal, "it ran without checkpointing (its result is right)")
            elif eager:
                _refused_under_swap(function, config, came.refusal)
            else:
                decide_call(False, function, args, config, refused=came.refusal, ran=True)
            return came.output
        built = came.refusal  # the run-time proof's refusal: decided below, as a plan refusal
    if named_eager:
        _names_not_kept(names, built, "torch's checkpoint runs it, which cannot see the names")
        names._warned = True  # said here: not again by the policy, whose advice is this call
        return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
    if eager:
        if _state.swaps_active_here():  # torch's checkpoint, guarded as any call: the guard sees this swap
            return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
        return _untracked_swap(function, args, kwargs, block_kwargs, options, config, context_fn, built)
    outcome = decide_call(False, function, args, config, refused=built)  # strict raises the rule's explanation
    if outcome == NO_CHECKPOINT:  # fallback: plainly, inside the user's forward context
        with forward_context_of(context_fn) or contextlib.nullcontext():
            return function(*args, **block_kwargs)
    return _torch_checkpoint.checkpoint(function, *args, **options, **kwargs)
