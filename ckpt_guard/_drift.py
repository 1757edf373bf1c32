"""The decision at recompute time: did the world the forward saw drift by the recompute?

The forward's capture (:data:`capture`: one generated tuple expression, one value per
drift rule in ``DRIFT_RULES`` order) is compared with the same capture when the
recompute starts (``checked_call``).  A change the block can see is reported under the
policy in force (:func:`report_drift`), or, under fallback, replayed: the recompute runs
in the forward's world (:func:`_replay`), the user's current state put back after.
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

from . import _composable, _config, _events, _files, _state
from ._composable import binding as _rebind
from ._composable.function import unbatched_vmaps_set_aside as _unbatched_vmaps_set_aside
from ._actions import NO_CHECKPOINT, PROCEED, DRIFT_HOLDS, DRIFT_NON_REENTRANT
from ._exceptions import CheckpointCompositionError
from ._messages import (
    case_fallback, case_remedy, case_symptom, describe_forward_site, emit_warning, build_message,
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
    return _files.compile_generated(source, __file__, "capture", namespace)


#: ``capture(function, inputs=(), keywords=None)``: the recompute-relevant
#: state, one value per drift rule, in DRIFT_RULES order.
capture = _compile_capture(_DRIFT_READERS)

# Drift whose risk is visible at call time (a value that is empty when nothing
# is active): fallback avoids it by not checkpointing at all.
_ANTICIPATED_INDICES = tuple(
    i for i, rule in enumerate(DRIFT_RULES)
    if rule.read in ("swapped_reads", "user_dispatch_modes", "user_function_modes", "transform_stack")
)
TRANSFORMS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "transform_stack")
_SWAPS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "swapped_reads")
BINDINGS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "block_bindings")
HOOKS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "block_hooks")
_CONTENTS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "argument_contents")
_CONTENTS_RULE = DRIFT_RULES[_CONTENTS_INDEX]
_GENERATORS_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "generator_states")
_ATTRIBUTES_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "module_attributes")
_TRAINING_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "module_training")
_DTYPE_INDEX = next(i for i, rule in enumerate(DRIFT_RULES) if rule.read == "default_dtype")
_MODE_INDICES = frozenset(
    i for i, rule in enumerate(DRIFT_RULES) if rule.read in ("user_dispatch_modes", "user_function_modes")
)


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
    if forward_state[_CONTENTS_INDEX] and config.policy_for(_CONTENTS_RULE.id) == "fallback":
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


def _relevant_drift(function: Any, index: int, was: Any, now: Any, modes_managed: bool) -> bool:
    """Whether a changed value can change this function's recompute."""
    if index in _MODE_INDICES:
        # a user context_fn may enter modes of its own for the recompute: then only a mode of the
        # forward's missing from the recompute matters (a context_fn that re-enters it is fine)
        return not modes_managed or any(mode not in now for mode in was)
    relevant = _DRIFT_RELEVANCE[index]
    return relevant is None or relevant(function, was, now)


#: per drift rule whose Python-values-only changes strict and fallback replay without a word (the
#: replay is the uncheckpointed program): ``values_only(was, now)``
_QUIET_WHEN = {
    _CONTENTS_INDEX: lambda was, now: _state.values_only(was),
    _ATTRIBUTES_INDEX: _state.attributes_values_only,
    BINDINGS_INDEX: _state.bindings_values_only,
}


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
    for index, values_only in _QUIET_WHEN.items():
        rule, was, now = DRIFT_RULES[index], forward_state[index], state[index]
        if (
            was
            and (only is None or rule.read in only)
            and DRIFT_HOLDS[index]
            and (reentrant or DRIFT_NON_REENTRANT[index])
            and config.policy_for(rule.id) in ("strict", "fallback")
            and _differs(was, now)
            and values_only(was, now)
        ):
            replay = _replay(rule, was, now, function)
            if replay:
                quiet[index] = replay[0]
    return quiet


_CONTEXT_NOTE = (
    "; read at the call outside your context_fn's forward context, and here inside its recompute "
    "context: if those contexts set it, torch's recompute reads what the forward did, but ckpt_guard "
    "cannot tell that from a change after the call, so it does not replay it"
)


def _set_by_a_context(index: int, was: Any, now: Any) -> bool:
    """Under a user ``context_fn``, whether this change may be its contexts' own doing.

    The forward's state is read at the call, outside the forward context; the
    recompute's inside the recompute context.  A context that sets a Python
    value the block reads (a global scale, a module's flag, the default dtype)
    for both runs shows here as a change torch recomputes right, and one the
    program made after the call looks the same: no replay can tell them apart,
    so none is made, quietly or under fallback (strict and fallback raise, warn
    warns).  A tensor re-bound is no context's doing: replayed as ever.
    """
    if index == _DTYPE_INDEX:
        return True
    values_only = _QUIET_WHEN.get(index)
    return values_only is not None and values_only(was, now)


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
        and DRIFT_HOLDS[i]
        and (reentrant or DRIFT_NON_REENTRANT[i])
        and config.policy_for(DRIFT_RULES[i].id) != "off"
        and _relevant_drift(function, i, was, now, modes_managed)
    ]
    quiet = {} if modes_managed else _quiet_replays(function, reentrant, config, forward_state, state, only)
    if quiet:
        changed = [index for index in changed if index not in quiet]
    if BINDINGS_INDEX in changed and _differs(forward_state[_SWAPS_INDEX], state[_SWAPS_INDEX]):
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
        rule, render, was, now = DRIFT_RULES[index], _DRIFT_RENDERERS[index], forward_state[index], state[index]
        describe_change = _DRIFT_CHANGES[index]
        policy = config.policy_for(rule.id)
        replay = None
        by_a_context = modes_managed and _set_by_a_context(index, was, now)
        if policy == "fallback" and not by_a_context:
            replay = _replay(rule, was, now, function, modes_managed, reentrant)
        report_at_recompute(
            rule, policy, forward_site_text,
            repaired=replay[1] if replay else "",
            site=describe_site(site_frame), forward_site=forward_site_text, transforms=transforms,
            variant=variant, source=config.source,
            checkpointed=describe_checkpointed(function, roots=_state.swapped_roots(forward_state)),
            change=_describe_change(describe_change, was, now, function, render) + (
                _CONTEXT_NOTE if by_a_context else ""
            ),
            remedy=case_remedy(rule, was, now, repaired=bool(replay)),
            fallback_text=case_fallback(rule, was),
            symptom=case_symptom(rule, was, now),
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
        return _composable.in_default_dtype(was), f"recomputing in the forward's default dtype, {was} (policy fallback)"
    if rule.read == "module_training" and was is not None:
        modes = _state.retrained(was, function)
        if not modes:
            return None  # its modules changed since the forward: no mode to put back
        return _rebind.bound([(m, "__dict__", "training", flag) for m, flag in modes]), (
            "recomputing with each module in the train/eval mode it had in the forward, bound for this "
            "recompute on its thread (policy fallback)"
        )
    if rule.read == "module_attributes":
        changes = _state.reattributed(was, function)
        if not changes or any(value is _GONE for _, _, value in changes):
            return None  # an attribute the forward did not have: nothing to put back
        return _rebind.bound([(module, "__dict__", name, value) for module, name, value in changes]), (
            "recomputing with each attribute as the forward found it, bound for this recompute on its "
            "thread (what the recompute writes there is dropped) (policy fallback)"
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
    # its _flat_weight_refs too: the recompute's forward re-points them at the tensors it binds, and
    # left in the module they would make its next forward think its weights unchanged (and keep
    # reading the flat weights of the meta-optimizer's step, whose graph is gone)
    import weakref

    bindings = []
    for rnn, replaced in flat_weights.values():
        bindings.append((rnn, "__dict__", "_flat_weights", replaced))
        refs = rnn.__dict__.get("_flat_weight_refs")
        if refs is not None:
            bindings.append((rnn, "__dict__", "_flat_weight_refs", [None if w is None else weakref.ref(w) for w in replaced]))
    return bindings


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
    # ... and in its parameter or buffer dict where the name is still there: what reads the dict (a
    # checkpoint nested in this recompute asking whether its parameters were swapped) sees them too
    bindings += [
        (owner, store, name, value) for owner, store, name, value in changes
        if store in ("_parameters", "_buffers") and name in owner.__dict__.get(store, ())
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
            and DRIFT_HOLDS[index]
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
    rule = anticipated_rule(config, forward_state, modes_managed, reentrant)
    if rule is None:
        return PROCEED
    return _run_plainly_for(
        rule, config, forward_state, reentrant, function, user_frame(sys._getframe(1))[0],
        action=(
            "ran it without checkpointing (policy fallback): nothing has gone wrong, but the "
            "recompute could run after this state changed, and then nothing could repair the "
            "gradients (policy strict raises if it sees that happen at the recompute)"
        ),
        # what torch does when the recompute finds none of it (.backward() outside the transform)
        symptom=case_symptom(rule, forward_state[DRIFT_RULES.index(rule)], ()),
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
    for index in _ANTICIPATED_INDICES:
        if forward_state[index]:
            return True
    return False
