"""Reader: the user's dispatch and function modes on torch's mode stacks (CKG102, CKG103).

Owns: telling the user's modes from torch's infrastructure modes (fake, functional and
proxy tensors, selective checkpointing's caching modes, ``torch.device(...)``), the
``ModeStack`` a drift reader returns, and how modes are written for the user.  What a
*marked* mode holds, and how its state is put back for a replay, is ``mode_records``'.
"""

from __future__ import annotations

import threading
import weakref

from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .basics import len_dispatch_stack, len_function_stack
from .mode_records import _mode_moved, is_replayable_mode, mode_record


# --------------------------------------------------------------------------
# dispatch / function modes

# Modes that can never make a recompute wrong, matched by qualified class name
# through the MRO (so subclasses count and nothing heavy is imported):
INFRASTRUCTURE_MODES = frozenset(
    {
        # torch's own machinery: compile-time tracing, selective checkpointing,
        # `with torch.device(...)` (restored by torch itself), checkpoint(debug=True)
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "torch._subclasses.functional_tensor.FunctionalTensorMode",
        "torch.fx.experimental.proxy_tensor.ProxyTorchDispatchMode",
        "torch.fx.experimental.proxy_tensor.PreDispatchTorchFunctionMode",
        "torch.fx.experimental.proxy_tensor.ProxyFunctionMode",
        "torch.fx.experimental.proxy_tensor.TorchFunctionMetadataMode",  # make_fx (torch.func.linearize)
        "torch.utils.checkpoint._CachingTorchDispatchMode",
        "torch.utils.checkpoint._CachedTorchDispatchMode",
        "torch.utils._device.DeviceContext",
        "ckpt_guard._state.FactoryWatch",  # the guard's own (CKG109)
        # the composable recompute's save policy (selective checkpointing under torch.func)
        "ckpt_guard._composable.saving._Recording",
        "ckpt_guard._composable.saving._HandingBack",
        "torch._export.non_strict_utils._NonStrictTorchFunctionHandler",
        "torch.testing._internal.logging_tensor.LoggingTensorMode",
        # torch's observers: they count or check, never change a value
        "torch.utils.flop_counter._FlopCounterMode",
        "torch.utils.flop_counter.FlopCounterMode",  # torch 2.4: the counter is the dispatch mode itself
        "torch.distributed.tensor.debug._comm_mode.CommDebugMode",
        "torch.distributed._tools.mem_tracker.MemTracker",
        "torch.distributed._tools.memory_tracker.MemoryProfileDispatchMode",
        "torch._subclasses.schema_check_mode.SchemaCheckMode",
    }
)


# mode class -> is it torch's infrastructure?  Weak: a user's mode class (and
# what its methods close over) must not outlive its last use.
_infrastructure_classes: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _is_infrastructure_class(cls: type) -> bool:
    known = _infrastructure_classes.get(cls)
    if known is None:
        known = _infrastructure_classes[cls] = any(
            f"{klass.__module__}.{klass.__qualname__}" in INFRASTRUCTURE_MODES
            for klass in cls.__mro__
        )
    return known


def is_user_mode(mode: object) -> bool:
    return not _is_infrastructure_class(type(mode))


class ModeStack(tuple):
    """The user modes' classes, innermost last, holding the mode objects and their replay records.

    Compared (and shown) by class: re-entering an equivalent mode object (a
    new instance of the same class) around .backward() or in context_fn is
    fine.  ``instances``: the mode objects; ``records``: for each, what
    fallback puts back to recompute under it (:func:`mode_record`), or None
    where its class is not marked with :func:`ckpt_guard.replayable_mode`.
    """

    instances: tuple
    records: tuple

    # A replayable mode also differs when another object of its class stands in
    # for it or its state moved on (the recompute would run under other state).
    def __eq__(self, other: object) -> bool:
        return tuple.__eq__(self, other) is True and not (
            _replayable_state_moved(self, other)
            or (isinstance(other, ModeStack) and _replayable_state_moved(other, self))
        )

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = tuple.__hash__


def _replayable_state_moved(was: "ModeStack", now: object) -> bool:
    others = getattr(now, "instances", ())
    return any(
        record is not None and (i >= len(others) or others[i] is not mode or _mode_moved(record))
        for i, (mode, record) in enumerate(zip(was.instances, was.records))
    )


class _Recording(threading.local):
    """False on a thread while its recompute reads the state: it compares with the call's records,
    and needs none of its own (another thread's call, meanwhile, records as usual)."""

    on = True


RECORDING_MODES = _Recording()


def _user_modes(stack: list) -> tuple:
    modes = [m for m in stack if is_user_mode(m)]
    if not modes:
        return ()
    found = ModeStack(type(m) for m in modes)
    found.instances = tuple(modes)
    record = RECORDING_MODES.on
    found.records = tuple(mode_record(m) if record and is_replayable_mode(m) else None for m in modes)
    return found


def user_dispatch_modes() -> tuple[type, ...]:
    if not len_dispatch_stack():
        return ()
    return _user_modes(_get_current_dispatch_mode_stack())


def user_function_modes() -> tuple[type, ...]:
    if not len_function_stack():
        return ()
    return _user_modes(_get_current_function_mode_stack())


user_dispatch_modes.active = len_dispatch_stack  # type: ignore[attr-defined]
user_function_modes.active = len_function_stack  # type: ignore[attr-defined]
