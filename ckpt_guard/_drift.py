"""The decision at recompute time: did the world the forward saw drift by the recompute?

The forward's capture (:data:`capture`: one generated tuple expression, one value per
drift rule in ``DRIFT_RULES`` order) is compared with the same capture when the
recompute starts (``checked_call``).  A change the block can see is reported under the
policy in force (:func:`report_drift`), or, under fallback, replayed: the recompute runs
in the forward's world (each rule's kind's ``replay``, ``_drift_kinds``), the user's current
state put back after.
Drift whose risk is visible already at call time (a swap, a user mode, a transform) is
anticipated there (:func:`anticipate`).  Written for speed: the capture runs on every
guarded call, the check on every recompute.

May not touch: the call-time rules (``_decide``) or the words (``_messages``), which it
calls.
"""

from __future__ import annotations

import contextlib
import dataclasses as _dataclasses
import sys
from functools import partial as _partial
from typing import Any, Optional

import torch as _torch
import torch.utils.checkpoint as _torch_checkpoint

from . import _config, _events, _files, _state
from ._composable import binding as _rebind
from ._composable.function import unbatched_vmaps_set_aside as _unbatched_vmaps_set_aside
from ._actions import NO_CHECKPOINT, PROCEED, DRIFT_HOLDS, DRIFT_NON_REENTRANT
from ._exceptions import CheckpointCompositionError
from ._drift_kinds import (
    ANTICIPATED_INDICES, BINDINGS_INDEX, CONTENTS_INDEX, DRIFT_KINDS, GENERATORS_INDEX, MODE_INDICES,
    QUIET_INDICES, SWAPS_INDEX, TRANSFORMS_INDEX, UserModes, kind_of,
)
from ._messages import (
    describe_forward_site, emit_warning, build_message,
    describe_checkpointed, describe_site, describe_variant, user_frame, your_code,
)
from ._rules import DEVICE_RULE as _DEVICE_RULE, DRIFT_RULES, NESTED_OUTPUT_RULE as _NESTED_RULE
from ._rules import BUFFER_WRITES_RULE as _BUFFERS_RULE, RNG_RULE as _RNG_RULE, Rule

_is_grad_enabled = _state.is_grad_enabled
_peek_stack = _state.peek_interpreter_stack
_NO_CONTEXT = contextlib.nullcontext()
_GONE = _state.GONE


# --------------------------------------------------------------------------
# recompute time
#
# This part runs on every guarded call (the forward capture) and every
# recompute, so it is written for speed: the capture is one generated tuple
# expression, the recompute guard one closure.

_DRIFT_READERS = tuple(kind.read for kind in DRIFT_KINDS)


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
    return _files.compile_generated(source, __file__, "capture", namespace)


#: ``capture(function, inputs=(), keywords=None)``: the recompute-relevant
#: state, one value per drift rule, in DRIFT_RULES order.
capture = _compile_capture(_DRIFT_READERS)

_CONTENTS_RULE = DRIFT_RULES[CONTENTS_INDEX]


#: recomputes of torch's checkpoint the guard has seen (the matrix reads it: a block recomputed
#: is a block whose activations the forward did not keep)
TORCH_RECOMPUTES = [0]


def reads_target(function: Any, inputs: tuple) -> Any:
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


def checked_call(
    function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, site: tuple,
    modes_managed: bool, drew: Optional[list], reads: Any, nested: Optional[list], kept: Optional[list], /,
    *args: Any, **kwargs: Any,
) -> Any:
    """Call ``function``; first compare the state with the forward's if this is a recompute.

    The non-reentrant variant calls the function it was given only to
    recompute.  The reentrant variant also runs the forward through it, but
    always under ``no_grad``, while its recompute runs under ``enable_grad``.
    ``drew`` (``preserve_rng_state=False`` only) records whether the forward
    drew random numbers; the non-reentrant forward is watched by ``_patch``.
    ``kept``: the buffers of the block's modules in training mode as the call
    found them (CKG117: each recompute runs on fresh copies of them).
    """
    if not reentrant or _is_grad_enabled():
        TORCH_RECOMPUTES[0] += 1
        state = capture_without_mode_records(reads, args, kwargs)  # the call's records are what it compares with
        replays: Any = ()
        if _differs(state, forward_state):
            replays = report_drift(reads, reentrant, config, forward_state, state, site, modes_managed)
        if drew is not None and drew[0]:
            report_unpreserved_rng(function, reentrant, config, forward_state, site)
        if kept is not None:
            if config.policy_for(_BUFFERS_RULE.id) in ("strict", "fallback"):
                replays = [*replays, _kept_buffers_bound(kept)]
            else:  # warn: torch's recompute as it is, then said
                return _reporting_buffer_writes(
                    kept, function, reentrant, config, forward_state, site,
                    lambda: _recompute(function, args, kwargs, replays, reads, config, forward_state, site, nested),
                )
        return _recompute(function, args, kwargs, replays, reads, config, forward_state, site, nested)
    if forward_state[CONTENTS_INDEX] and config.policy_for(_CONTENTS_RULE.id) == "fallback":
        return _reentrant_forward_keeping_the_cache(function, args, forward_state, drew, config, site)
    if drew is None:
        return _watch_output(function(*args, **kwargs), reads, config, forward_state, site, nested)
    before = _state.rng_states()  # the reentrant forward, preserve_rng_state=False
    result = function(*args, **kwargs)
    drew[0] = _state.drew_random(before)
    return _watch_output(result, reads, config, forward_state, site, nested)


def _recompute(
    function: Any, args: tuple, kwargs: dict, replays: Any, reads: Any, config: _config.Config,
    forward_state: tuple, site: tuple, nested: Optional[list],
) -> Any:
    """The recompute itself, inside fallback's replays (the recompute sees what the forward saw).

    A vmap level on top that batches none of its inputs is set aside for it: a batched backward
    (``autograd.grad(..., is_grads_batched=True)``, ``jacobian(..., vectorize=True)``) runs the
    recompute under the vmap of its cotangents, where the block's random draws (dropout) are refused;
    the forward ran under none, and replays its RNG state outside it.
    """
    aside = _unbatched_vmaps_set_aside([a for a in args if isinstance(a, _Tensor)]) if _peek_stack() else _NO_CONTEXT
    with contextlib.ExitStack() as stack:
        for replay in replays or ():
            stack.enter_context(replay)
        with aside, _outside_the_batched_backwards_vmap():
            output = function(*args, **kwargs)
        return _watch_output(output, reads, config, forward_state, site, nested)


@contextlib.contextmanager
def _outside_the_batched_backwards_vmap() -> Any:
    """The legacy vmap a batched backward runs under (``is_grads_batched=True``), set aside for the
    recompute: its inputs are the forward's, batched by none of it (measured: dropout raised there)."""
    nesting = _vmapmode_increment() - 1  # read, by one step up and back
    _vmapmode_decrement()
    for _ in range(nesting):
        _vmapmode_decrement()
    try:
        yield
    finally:
        for _ in range(nesting):
            _vmapmode_increment()


_vmapmode_increment, _vmapmode_decrement = _torch._C._vmapmode_increment_nesting, _torch._C._vmapmode_decrement_nesting


def _kept_buffers_bound(kept: list) -> Any:
    """CKG117 under strict and fallback: the block's buffers as the call found them, fresh copies bound
    for this recompute on its thread (what it writes there is dropped; the module keeps the forward's)."""
    fresh = [(module, name, _state.keep(copy)) for module, name, copy in kept]
    return _rebind.bound([(module, "_buffers", name, value) for module, name, value in fresh if value is not None])


def _reporting_buffer_writes(
    kept: list, function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, site: tuple,
    recompute: Any,
) -> Any:
    """CKG117 under warn: torch's recompute as it runs, then a warning naming the buffers it updated again."""
    before = _state.buffers_now(kept)
    try:
        return recompute()
    finally:  # torch's early stop ends its recompute with an exception of its own
        _report_buffer_writes(kept, before, function, reentrant, config, forward_state, site)


def _report_buffer_writes(
    kept: list, before: list, function: Any, reentrant: bool, config: _config.Config, forward_state: tuple,
    site: tuple,
) -> None:
    written = _state.written_during(kept, before)
    if written:
        forward_site_text = describe_forward_site(site)
        site_frame, _ = user_frame(sys._getframe(1))
        report_at_recompute(
            _BUFFERS_RULE, config.policy_for(_BUFFERS_RULE.id), forward_site_text,
            site=describe_site(site_frame), forward_site=forward_site_text,
            checkpointed=describe_checkpointed(function),
            transforms=_state.describe_transforms(forward_state[TRANSFORMS_INDEX]),
            variant=describe_variant(reentrant, None), source=config.source,
            change=f"the recompute updated {_state.describe_written(written)} a second time",
        )


def capture_without_mode_records(reads: Any, args: tuple = (), kwargs: Optional[dict] = None) -> tuple:
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
    contents = forward_state[CONTENTS_INDEX]
    before = _state.rng_states()
    devices, device_rng = _torch_checkpoint.get_device_states(*args)
    versions = _state.tensor_versions(function, args)
    output = function(*args)
    if not _state.changed_contents(contents):
        if drew is not None:  # preserve_rng_state=False (CKG107)
            drew[0] = _state.drew_random(before)
        return output
    modes = [forward_state[i] for i in MODE_INDICES]
    if _state.updated_in_place(versions) or _state.modes_updated_in_place(modes):
        forward_site_text = describe_forward_site(site)
        report_at_recompute(
            _CONTENTS_RULE, "fallback", forward_site_text, when="after the reentrant forward",
            site=forward_site_text, forward_site=forward_site_text, checkpointed=describe_checkpointed(function),
            transforms=_state.describe_transforms(forward_state[TRANSFORMS_INDEX]),
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
    for _, generator, state in forward_state[GENERATORS_INDEX]:
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
        forward_site_text = describe_forward_site(site)
        report_at_recompute(
            _NESTED_RULE, policy, forward_site_text,
            repaired="handed the Function its outputs flat, rebuilt after (policy fallback)" if policy == "fallback" else "",
            site=forward_site_text, checkpointed=describe_checkpointed(function),
            transforms=_state.describe_transforms(forward_state[TRANSFORMS_INDEX]),
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


def device_watched_call(
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
    forward_site_text = describe_forward_site(site)
    site_frame, _ = user_frame(sys._getframe(1))
    report_at_recompute(
        _DEVICE_RULE, config.policy_for(_DEVICE_RULE.id), forward_site_text,
        checkpointed=describe_checkpointed(function),
        repaired=f"recomputing inside torch.device({str(device)!r}), the forward's device context (policy fallback)",
        site=describe_site(site_frame), forward_site=forward_site_text,
        transforms=_state.describe_transforms(forward_state[TRANSFORMS_INDEX]),
        variant=describe_variant(True, None), source=config.source,
        change=(
            f"the forward ran inside a {device} default device and made tensors without device=; "
            "the recompute runs without that context, so they would land on the CPU"
        ),
    )


def _quiet_replays(
    function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, state: tuple,
    only: Optional[frozenset],
) -> dict:
    """``{rule index: replay}`` where only Python values changed (a counter, a log, a step, a timestep).

    Under strict and fallback, recomputing with the values the forward read
    and putting the new ones back after is the uncheckpointed program, read
    or not, so strict need not stop a program for a counter (issue 27), nor
    fallback warn about one.  Warn behaves as torch and says so where a
    gradient can depend on the change (a value replaced).
    """
    quiet = {}
    for index in QUIET_INDICES:
        kind, was, now = DRIFT_KINDS[index], forward_state[index], state[index]
        rule = kind.rule
        if (
            was
            and (only is None or index in only)
            and DRIFT_HOLDS[index]
            and (reentrant or DRIFT_NON_REENTRANT[index])
            and config.policy_for(rule.id) in ("strict", "fallback")
            and _differs(was, now)
            and kind.values_only(was, now)
        ):
            replay = kind.replay(was, now, function)
            if replay:
                quiet[index] = replay[0]
    return quiet


_CONTEXT_NOTE = (
    "; read at the call outside your context_fn's forward context, and here inside its recompute "
    "context: if those contexts set it, torch's recompute reads what the forward did, but ckpt_guard "
    "cannot tell that from a change after the call, so it does not replay it"
)


def report_drift(
    function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, state: tuple,
    site: tuple, modes_managed: bool = False, only: Optional[frozenset] = None,
) -> list:
    """Warn about, or raise for, every drift rule whose state changed (``only``: these positions).

    Returns the replays (context managers) fallback repairs them with, to be
    entered around the recompute.
    """
    changed = [
        i for i, (was, now) in enumerate(zip(forward_state, state))
        if _differs(was, now)
        and (only is None or i in only)
        and DRIFT_HOLDS[i]
        and (reentrant or DRIFT_NON_REENTRANT[i])
        and config.policy_for(DRIFT_RULES[i].id) != "off"
        and DRIFT_KINDS[i].relevant(function, was, now, modes_managed)
    ]
    quiet = {} if modes_managed else _quiet_replays(function, reentrant, config, forward_state, state, only)
    if quiet:
        changed = [index for index in changed if index not in quiet]
    if BINDINGS_INDEX in changed and _differs(forward_state[SWAPS_INDEX], state[SWAPS_INDEX]):
        # a functional_call swap began or ended between the forward and now: the tensors it swapped
        # are re-bound too, and CKG101 (the swap) is the one cause to report, not also CKG110
        changed.remove(BINDINGS_INDEX)
    if not changed:
        return list(quiet.values())
    forward_site_text = describe_forward_site(site)
    site_frame, _ = user_frame(sys._getframe(1))
    transforms = _state.describe_transforms(forward_state[TRANSFORMS_INDEX])
    variant = describe_variant(reentrant, None)
    replays = list(quiet.values())
    for index in changed:
        kind, was, now = DRIFT_KINDS[index], forward_state[index], state[index]
        rule = kind.rule
        policy = config.policy_for(rule.id)
        replay = None
        by_a_context = modes_managed and kind.set_by_a_context(was, now)
        if policy == "fallback" and not by_a_context:
            replay = kind.replay(was, now, function, modes_managed, reentrant)
        report_at_recompute(
            rule, policy, forward_site_text,
            repaired=replay[1] if replay else "",
            site=describe_site(site_frame), forward_site=forward_site_text, transforms=transforms,
            variant=variant, source=config.source,
            checkpointed=describe_checkpointed(function, roots=_state.swapped_roots(forward_state)),
            change=kind.describe(was, now, function) + (_CONTEXT_NOTE if by_a_context else ""),
            remedy=kind.case_remedy(was, now, repaired=bool(replay)),
            fallback_text=kind.case_fallback(was),
            symptom=kind.case_symptom(was, now),
        )
        if replay:
            replays.append(replay[0])
    return replays


_differs = _state.differs


def report_unpreserved_rng(
    function: Any, reentrant: bool, config: _config.Config, forward_state: tuple, site: tuple,
) -> None:
    """CKG107: the forward drew random numbers with ``preserve_rng_state=False``."""
    forward_site_text = describe_forward_site(site)
    site_frame, _ = user_frame(sys._getframe(1))
    report_at_recompute(
        _RNG_RULE, config.policy_for(_RNG_RULE.id), forward_site_text, checkpointed=describe_checkpointed(function),
        repaired="recomputing with the forward's RNG state, which it preserved (policy fallback)",
        site=describe_site(site_frame), forward_site=forward_site_text,
        transforms=_state.describe_transforms(forward_state[TRANSFORMS_INDEX]),
        variant=describe_variant(reentrant, None), source=config.source,
        change="the forward drew random numbers; preserve_rng_state=False lets the recompute draw new ones",
    )


def report_at_recompute(
    rule: Rule, policy: str, forward_site_text: str, repaired: str = "", when: str = "before the recompute ran",
    **details: Any,
) -> None:
    """Warn, or raise ``when`` (before the recompute runs); ``repaired``: what fallback already did about it."""
    if policy == "warn" or (policy == "fallback" and repaired):
        action = repaired if policy == "fallback" else "recomputing as torch would (policy warn)"
        _events.emit(rule.id, policy, "warned" if policy == "warn" else "fallback: repaired", forward_site_text, rule.stage)
        emit_warning(build_message(rule, policy=policy, action=action, worked=policy == "fallback", **details), rule,
              once=action if policy == "fallback" else "")
        return
    unforeseen = ": this drift could not be foreseen at call time" if policy == "fallback" else ""
    message = build_message(
        rule, policy=policy, action=f"raised {when} (policy {policy}{unforeseen})", **details,
    )
    _events.emit(rule.id, policy, "raised", forward_site_text, rule.stage)
    raise CheckpointCompositionError(message, rule)


def anticipated_rule(
    config: _config.Config, forward_state: tuple, modes_managed: bool = False, reentrant: Optional[bool] = None,
) -> Optional[Rule]:
    """The drift rule under fallback whose risk is visible in this forward state, or None.

    User modes that are all marked replayable (and recorded) are not a risk
    here: the recompute re-enters them (``UserModes.replay``), unless a user
    ``context_fn`` manages the recompute's modes, or the call is
    non-reentrant on a torch whose recompute hooks cannot be hidden from
    them (2.4-2.7).  ``reentrant`` None: not known (taken as non-reentrant).
    """
    modes_replayable = not modes_managed and (bool(reentrant) or _state.QUIET_RECOMPUTE_HOOKS)
    if not risk_visible(forward_state):
        return None
    for index in ANTICIPATED_INDICES:
        if (
            forward_state[index]
            and DRIFT_HOLDS[index]
            and config.policy_for(DRIFT_RULES[index].id) == "fallback"
            and (index not in MODE_INDICES or not modes_replayable or not UserModes.all_recorded(forward_state[index]))
        ):
            return DRIFT_RULES[index]
    return None


def anticipate(
    config: _config.Config, forward_state: tuple, reentrant: bool, function: Any, modes_managed: bool = False,
) -> str:
    """Fallback for drift risks visible at call time: run without checkpointing.

    A parameter swap, a user mode (not marked replayable) or a torch.func
    transform is active while grad is enabled (the patch points only ask
    then): the recompute could run after it ended, and then nothing could
    repair the gradients.
    """
    rule = anticipated_rule(config, forward_state, modes_managed, reentrant)
    if rule is None:
        return PROCEED
    kind = kind_of(rule)
    return _run_plainly_for(
        rule, config, forward_state, reentrant, function, user_frame(sys._getframe(1))[0],
        action=(
            "ran it without checkpointing (policy fallback): nothing has gone wrong, but the "
            "recompute could run after this state changed, and then nothing could repair the "
            "gradients (policy strict raises if it sees that happen at the recompute)"
        ),
        # what torch does when the recompute finds none of it (.backward() outside the transform)
        symptom=kind.case_symptom(forward_state[kind.index], ()),
    )


def anticipate_own_bindings(config: _config.Config, forward_state: tuple, reentrant: bool, function: Any) -> str:
    """Fallback for a block whose modules bind their own tensors in the forward: run without checkpointing.

    higher's patched modules set their fast weights from a box of their own at
    each call: a meta-optimizer step before the recompute makes it read other
    tensors (CKG110), and binding the forward's tensors for one recompute does
    not reach that box, so fallback could not repair it then.  Strict waits
    and raises only if the recompute finds them re-bound.
    """
    rule = DRIFT_RULES[BINDINGS_INDEX]
    if not DRIFT_HOLDS[BINDINGS_INDEX] or config.policy_for(rule.id) != "fallback":
        return PROCEED
    return _run_plainly_for(
        rule, config, forward_state, reentrant, function, user_frame(sys._getframe(1))[0],
        action=(
            "ran it without checkpointing (policy fallback): nothing has gone wrong, but its modules "
            "bind their own tensors in the forward (higher's patched modules), so a re-bind before "
            "the recompute could not be undone for it (policy strict raises if the recompute finds one)"
        ),
    )


def _run_plainly_for(
    rule: Rule, config: _config.Config, forward_state: tuple, reentrant: bool, function: Any, site_frame: Any,
    action: str, **extra: Any,
) -> str:
    """Fallback's warning and event for a call it runs without checkpointing, at the call: NO_CHECKPOINT."""
    site = describe_site(site_frame)
    message = build_message(
        rule, site=site, checkpointed=describe_checkpointed(function, site_frame),
        from_your_code=describe_site(your_code(site_frame)),
        transforms=_state.describe_transforms(forward_state[TRANSFORMS_INDEX]),
        variant=describe_variant(reentrant, None), policy="fallback", source=config.source,
        anticipated=True, worked=True, action=action, **extra,
    )
    _events.emit(rule.id, "fallback", "fallback: no checkpoint", site, "call")
    emit_warning(message, rule, once="no checkpoint")
    return NO_CHECKPOINT


def risk_visible(forward_state: tuple) -> bool:
    """Cheap pre-check for :func:`anticipate`: is any anticipated state non-empty?"""
    for index in ANTICIPATED_INDICES:
        if forward_state[index]:
            return True
    return False
