"""The world a recompute runs in: what the forward had, put back for each recompute.

Owns: the forward's RNG states (a device's too), the containers to replay, the
global module hooks as the forward found them, the live vmap levels, the default
dtype, nested checkpoints run plainly, and compiled code inside a block held eager
(one shared stance for all threads).  May not touch: the plan (``plan``) or the
Function (``function``), which use these.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.utils.checkpoint as _tuc
from torch._C._functorch import current_level as _current_level
from torch._C._functorch import CVmapInterpreterPtr as _CVmapInterpreterPtr
from torch._C._functorch import get_interpreter_stack as _get_interpreter_stack

from . import binding as _rebind
from .. import _config, _state
from .._state.peel import peel
from .basics import RANDOMNESS_NAMES, VMAP_KEY, Tensor
from .refusals import Reason


_NO_CONTEXT = contextlib.nullcontext()


class _ForwardRng:
    """The forward's RNG states while a recompute runs, the program's back afterwards (``fork_rng``'s job,
    for the devices the forward's inputs were on).  A class, not a generator: entered per recompute."""

    __slots__ = ("cpu_state", "devices", "states", "device_type", "program")

    def __init__(self, cpu_state: Tensor, devices: list, states: list, device_type: str) -> None:
        self.cpu_state, self.devices, self.states, self.device_type = cpu_state, devices, states, device_type

    def __enter__(self) -> None:
        devices = self.devices
        device_module = getattr(torch, self.device_type, None) if devices else None
        self.program = (
            torch.get_rng_state(), device_module, [device_module.get_rng_state(d) for d in devices] if devices else [],
        )
        torch.set_rng_state(self.cpu_state)
        if devices:
            _tuc.set_device_states(devices, self.states)

    def __exit__(self, *exc: Any) -> None:
        program_cpu, device_module, program_devices = self.program
        torch.set_rng_state(program_cpu)
        for device, state in zip(self.devices, program_devices):
            device_module.set_rng_state(state, device)


_forward_rng = _ForwardRng


def _contents_to_replay(given: tuple) -> Tuple[List[tuple], Optional[str]]:
    """What the recompute must replay of the containers the forward changed, and why it cannot, if so.

    Each recompute starts from what the forward found, and puts back what
    is there then (a counter, a log, a KV cache changes once, as without
    checkpointing).  The plain run changed the user's own containers; a
    tensor it put there belongs to the plain run's graph, which the code
    reading it differentiates as it would without checkpointing.  Only a
    container too long to keep a copy of cannot be replayed.  A tensor in
    them updated in place is the proof's.
    """
    changed = [entry for entry in _state.changed_at_all(given) if entry[2] != "tensor"]
    for path, value, kind, recorded in changed:
        if not _state.replayable([(path, value, kind, recorded)]):
            return [], Reason("long-container", f"it changes {path}, a container too long to keep a copy of")
    return changed, None


def _output_tensors(output: Any) -> List[Tensor]:
    """The tensors in a block's output (any structure: containers, dataclasses, objects), once each."""
    if isinstance(output, Tensor):  # the usual block: one tensor out
        return [output]
    found: dict = {}

    def visit(obj: Any, bindable: bool) -> None:
        if isinstance(obj, Tensor):
            found.setdefault(id(obj), obj)

    _rebind._Rebuild({}, visit)(output)
    return list(found.values())


_GLOBAL_HOOKS = tuple(
    name for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                      "_global_forward_hooks_always_called")
    if hasattr(torch.nn.modules.module, name)
)
_GLOBAL_HOOKS_LOCK = __import__("threading").Lock()


_MODULE_GLOBALS = vars(torch.nn.modules.module)


def _global_hooks() -> Optional[tuple]:
    """A copy of each global module-hook dict, or None where all are empty (the usual case)."""
    names = _MODULE_GLOBALS
    for name in _GLOBAL_HOOKS:
        if names[name]:
            return tuple(dict(names[name]) for name in _GLOBAL_HOOKS)
    return None


@contextlib.contextmanager
def _global_hooks_as(recorded: Optional[tuple]) -> Any:
    """The global module hooks as the forward found them, for one recompute (where they changed since).

    They are process-wide: while they are put back, under a lock, another
    thread's module calls see the forward's hooks too.
    """
    module = torch.nn.modules.module
    dicts = [getattr(module, name) for name in _GLOBAL_HOOKS]
    if recorded is None:
        if not any(dicts):
            yield
            return
        recorded = tuple({} for _ in dicts)
    if all(dict(d) == r for d, r in zip(dicts, recorded)):
        yield
        return
    with _GLOBAL_HOOKS_LOCK:
        now = [dict(d) for d in dicts]
        for d, r in zip(dicts, recorded):
            d.clear()
            d.update(r)
        try:
            yield
        finally:
            for d, n in zip(dicts, now):
                d.clear()
                d.update(n)


def _vmap_level_of_rule() -> int:
    """The level of the vmap whose rule is running (it has been lowered: the one above the top)."""
    return (_current_level() if _state.peek_interpreter_stack() is not None else 0) + 1




def _vmap_levels() -> frozenset:
    """(level, batch size, randomness) of each vmap alive now, read off the C interpreters."""
    stack = _get_interpreter_stack()
    if not stack:
        return frozenset()
    found = []
    for interpreter in stack:
        if interpreter.key().value == VMAP_KEY:
            vmap = _CVmapInterpreterPtr(interpreter)
            found.append((interpreter.level(), vmap.batchSize(), RANDOMNESS_NAMES[vmap.randomness()]))
    return frozenset(found)


def _forward_mode_alive() -> bool:
    """Whether forward-mode AD is differentiating what runs now (a jvp level, or a dual level)."""
    if _state.forward_ad._current_level >= 0:
        return True
    if _state.peek_interpreter_stack() is None:
        return False
    return any(name == "Jvp" for name, _ in _state.interpreter_levels())


@contextlib.contextmanager
def in_default_dtype(dtype: torch.dtype) -> Any:
    """``torch.set_default_dtype(dtype)`` for a block (the recompute's; fallback's CKG105 replay)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _PlainNestedCheckpoints:
    """Checkpoints inside the block run as plain calls (the guard's "plain" scope)."""

    __slots__ = ("token",)

    def __enter__(self) -> None:
        self.token = _push_scope(_PLAIN)

    def __exit__(self, *exc: Any) -> None:
        _pop_scope(self.token)


_plain_nested_checkpoints = _PlainNestedCheckpoints


_push_scope, _pop_scope, _PLAIN = _config.push_scope, _config.pop_scope, _config.PLAIN


def _compiled(function: Any) -> bool:
    """A ``torch.compile``'d function or module (the function itself, or in a partial: :func:`peel`)."""
    function = peel(function)
    return hasattr(function, "_torchdynamo_orig_callable") or hasattr(function, "_orig_mod")


_SET_STANCE = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6


def _compiled_code_eager() -> Any:
    """Compiled code the block calls runs eagerly, where dynamo is loaded (torch >= 2.6).

    Dynamo traces the run-time proof's mode and cannot make fake tensors of
    torch.func's wrappers under it; and a compiled recompute under torch.func
    runs frame by frame anyway.  The values are the same.  The stance is the
    block's thread's (:class:`_ThreadEagerStance`): another thread's compiled
    code keeps its compiled speed meanwhile.
    """
    if "torch._dynamo" not in sys.modules:
        return _NO_CONTEXT
    return _EagerFrames()


class _EagerFrames:
    """The block's frames run eagerly: compiled code it calls (the stance, torch >= 2.6), and its own
    frames, which a ``torch.compile`` region running around the call would compile.

    Such a region, breaking its graph at the checkpoint call (a block that breaks the graph itself),
    runs the call eagerly with its frame callback still set, and would compile the block's frames,
    the recompute's included, over torch.func's wrappers (measured: dynamo fails faking them).  That
    callback is this thread's, read where the region was entered: a stance set inside does not reach
    it, so it is taken off while the block runs.
    """

    __slots__ = ("prior",)

    def __enter__(self) -> None:
        if _SET_STANCE is not None:
            _EAGER_STANCE.__enter__()
        self.prior = _set_eval_frame(None)

    def __exit__(self, *exc: Any) -> None:
        _set_eval_frame(self.prior)
        if _SET_STANCE is not None:
            _EAGER_STANCE.__exit__()


def _set_eval_frame(callback: Any) -> Any:
    return torch._C._dynamo.eval_frame.set_eval_frame(callback)


class _Forced(threading.local):
    depth = 0  # blocks running on this thread with their compiled code eager


_forced = _Forced()


class _ThreadEagerStance:
    """``force_eager`` for the threads running a block, and only for them.

    Dynamo asks ``eval_frame._callback_from_stance(callback)`` (by its global name) for the frame
    callback each time a compiled function is entered; under ``force_eager`` it answers None (run
    eagerly).  While any block runs that function is wrapped to answer None on a thread running one
    and to ask the stance that is set everywhere else: the first block in (on any thread) wraps it,
    the last out puts dynamo's back.  Neither another thread's compiled code nor a stance another
    thread sets or puts back meanwhile changes what a block's thread runs.  Where dynamo has no such
    function, ``torch.compiler.set_stance``, which is process-wide.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.undo: Any = None

    def __enter__(self) -> None:
        _forced.depth += 1
        with self.lock:
            if self.users == 0:
                self.undo = self._set()
            self.users += 1

    def __exit__(self, *exc: Any) -> None:
        _forced.depth -= 1
        with self.lock:
            self.users -= 1
            if self.users == 0:
                undo, self.undo = self.undo, None
                undo()

    @staticmethod
    def _set() -> Callable[[], Any]:
        """Wrap dynamo's stance reading; returns what puts it back."""
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        dynamos = getattr(eval_frame, "_callback_from_stance", None)
        if dynamos is None:
            stance = _SET_STANCE("force_eager")
            stance.__enter__()
            return lambda: stance.__exit__(None, None, None)

        def callback_from_stance(callback: Any) -> Any:
            return None if _forced.depth else dynamos(callback)  # None: what force_eager answers

        eval_frame._callback_from_stance = callback_from_stance

        def undo() -> None:
            if eval_frame._callback_from_stance is callback_from_stance:
                eval_frame._callback_from_stance = dynamos

        return undo


_EAGER_STANCE = _ThreadEagerStance()
