"""Reading torch's state: everything a checkpoint call and its recompute depend on.

Two kinds of reading happen here.

*Call time* (:func:`read_call_state`): the functorch interpreter stack, grad
mode, forward-mode AD, whether saved-tensor hooks are allowed, and whether the
inputs or the parameters inside the checkpointed function require grad.  The
rules in ``_rules.py`` are predicates over the resulting :class:`CallState`.
Reading all of it costs a few microseconds, so the patch points first ask
:func:`call_is_quiet`, a handful of ~50 ns queries that prove no call-time rule
can fire; only a non-quiet call pays for the full reading.

*Recompute time* (``_decide.capture``): a tuple with one value per drift rule,
read in the forward and again when the recompute starts.  A reader may carry
an ``active`` attribute, a builtin query that is falsy when its state is empty,
so the capture can skip the Python call on the usual quiet path.  torch's own
infrastructure modes (fake/functional/proxy tensors under ``torch.compile``,
selective checkpointing's caching modes, ``with torch.device(...)``) are not the
user's and are left out, so they can never cause a report.

Parameter swaps (``torch.func.functional_call``) and optimizer steps leave
no trace in torch's state: the hooks in ``_hooks`` report them here
(:func:`push_swap` / :func:`pop_swap` keep :data:`_active_swaps` current,
:func:`record_step` counts steps and logs which parameters each updated).
Dynamo skips this file; only ``_hooks`` runs inside code it compiles.

A drift reader may also carry a ``relevant(function, was, now)`` attribute:
asked only once its value changed, it says whether the change can reach the
checkpointed function (a swap of other modules, a step of another model's
optimizer cannot).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import inspect
import itertools
import operator
import os
import sys
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch._C._functorch import (
    get_unwrapped,
    is_functorch_wrapped_tensor,
    peek_interpreter_stack,
)
from torch._C._functorch import get_interpreter_stack as _get_interpreter_stack
from torch.autograd import forward_ad
from torch.overrides import _get_current_function_mode_stack
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext, _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from . import _reads

import torch.utils.checkpoint  # noqa: E402 - torch 2.4's `import torch` does not import it

#: torch.utils.checkpoint's globals (set_checkpoint_early_stop's switch lives there)
_checkpoint = vars(torch.utils.checkpoint)
_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_len_function_stack = torch._C._len_torch_function_stack
saved_tensor_hooks_enabled: Callable[[], bool] = (
    torch._C._autograd._saved_tensors_hooks_is_enabled
)
is_grad_enabled = torch.is_grad_enabled
Tensor = torch.Tensor
Module = torch.nn.Module

# --------------------------------------------------------------------------
# functorch transforms

_TRANSFORM_NAMES = {"Grad": "grad", "Vmap": "vmap", "Jvp": "jvp", "Functionalize": "functionalize"}


def transform_stack() -> tuple[tuple[str, int], ...]:
    """The active torch.func transforms, outermost first: ``(("vmap", 1), ("grad", 2))``.

    vjp, jacrev and hessian run as ``grad``; jacfwd as ``jvp`` (+ ``vmap``).
    """
    if peek_interpreter_stack() is None:
        return ()
    return tuple(
        (_TRANSFORM_NAMES.get(name, name.lower()), level) for name, level in interpreter_levels()
    )


def interpreter_levels() -> tuple[tuple[str, int], ...]:
    """``(("Vmap", 1), ("Grad", 2))``: each live torch.func interpreter's key and level, outermost
    first, read off the C stack (a Python interpreter object per level costs microseconds, and the
    composable recompute asks several times per block)."""
    stack = _get_interpreter_stack()
    if not stack:
        return ()
    return tuple([(i.key().name, i.level()) for i in stack])


transform_stack.active = peek_interpreter_stack  # type: ignore[attr-defined]


def describe_transforms(stack: tuple[tuple[str, int], ...]) -> str:
    if not stack:
        return "none"
    return " > ".join(f"{name}(level {level})" for name, level in stack)


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
    if not _len_dispatch_stack():
        return ()
    return _user_modes(_get_current_dispatch_mode_stack())


def user_function_modes() -> tuple[type, ...]:
    if not _len_function_stack():
        return ()
    return _user_modes(_get_current_function_mode_stack())


user_dispatch_modes.active = _len_dispatch_stack  # type: ignore[attr-defined]
user_function_modes.active = _len_function_stack  # type: ignore[attr-defined]
user_dispatch_modes.describe_change = user_function_modes.describe_change = (  # type: ignore[attr-defined]
    lambda was, now: describe_mode_change(was, now)
)


def describe_modes(modes: tuple[type, ...]) -> str:
    return "[" + ", ".join(m.__name__ for m in modes) + "]"


# --------------------------------------------------------------------------
# parameter swaps (torch.func.functional_call)
#
# What matters for a recompute is not whether a swap is active but which
# tensors the block reads: the recompute reads whatever its modules hold when
# it runs.  So the forward records, only while a swap is active on its thread
# and has replaced a tensor the block reads, the identity of every tensor the
# block's modules hold; the recompute compares them with what the modules hold
# then.  functional_call(net, dict(net.named_parameters())) swaps in the very
# same tensors (nothing at risk), a parameter-free block reads no module
# tensor, and another thread's swap is that thread's business.

_swap_numbers = itertools.count(1)


class SwapToken:
    """One active functional_call swap, made on one thread."""

    __slots__ = ("number", "module_name", "module", "changed")

    def __init__(self, module: object, mapping: object) -> None:
        self.number = next(_swap_numbers)
        self.module_name = type(module).__name__
        self.module = weakref.ref(module)
        #: ids of the tensors swapped in in place of a different tensor
        self.changed = frozenset(
            id(new) for key, new in (mapping.items() if isinstance(mapping, dict) else ())
            if isinstance(new, Tensor) and _lookup(module, key) is not new
        )

    def __repr__(self) -> str:
        return f"functional_call #{self.number} ({self.module_name})"


def _lookup(module: object, path: str) -> object:
    """``module.a.b.weight`` for ``"a.b.weight"``, or None."""
    try:
        return functools.reduce(getattr, path.split("."), module)
    except Exception:  # noqa: BLE001 - a missing key (allow_missing) or an odd module
        return None


_swaps_here = threading.local()  # .active: this thread's swaps, innermost last
#: how many swaps are active, on all threads: the capture's builtin gate
_swap_count = [0]
_swap_lock = threading.Lock()


def begin_swap(module: object, args: tuple, kwargs: dict) -> SwapToken:
    """Before ``_reparametrize_module(module, ...)`` swaps: what will it change? (eager only: ``_hooks``)"""
    return SwapToken(module, args[0] if args else kwargs.get("parameters_and_buffers"))


def push_swap(token: SwapToken) -> None:
    """The swap is in place (until :func:`pop_swap`, on this thread)."""
    active = getattr(_swaps_here, "active", None)
    if active is None:
        active = _swaps_here.active = []
    active.append(token)
    with _swap_lock:
        _swap_count[0] += 1


def swaps_active_here() -> bool:
    """Whether a functional_call swap is active on this thread."""
    return bool(getattr(_swaps_here, "active", None))


def pop_swap(token: SwapToken) -> None:
    active = getattr(_swaps_here, "active", [])
    if token in active:
        active.remove(token)
        with _swap_lock:
            _swap_count[0] -= 1


class SwappedReads:
    """The tensors a block's modules held at one moment, with where each came from.

    Captured only when some of them were swapped in by a ``functional_call``
    on this thread (in place of another tensor).  Compared by identity: the
    recompute check (:func:`_swapped_reads_relevant`) compares the tensors.
    """

    __slots__ = ("reads", "swaps", "unseen")

    def __init__(self, reads: tuple, swaps: tuple, unseen: bool) -> None:
        # (path, owner, store name, name, weakref to the tensor, origin)
        self.reads, self.swaps = reads, swaps
        #: the block may read module tensors the guard cannot see (see _reads)
        self.unseen = unseen

    def differences(self) -> list:
        """``(path, origin then, origin now)`` for every tensor the modules now hold instead.

        What the guard cannot see counts as changed once a swap that changed
        tensors is no longer active on this thread (conservative).
        """
        now_swaps = tuple(getattr(_swaps_here, "active", ()))
        found = []
        for path, owner, store, name, ref, origin in self.reads:
            current = getattr(owner, store).get(name)
            if current is not ref():
                found.append((self._path_in_swapped_module(owner, name, path), origin, _origin(current, now_swaps)))
        if self.unseen:
            ended = [token for token in self.swaps if token.changed and token not in now_swaps]
            if ended:
                found.append((
                    "module tensors the guard cannot see (an object it does not look into)",
                    ", ".join(map(repr, ended)), "that swap ended",
                ))
        return found

    def _path_in_swapped_module(self, owner: object, name: str, fallback: str) -> str:
        """``blocks.0.norm1.weight``: the name functional_call's dict used, where it can be found."""
        for token in self.swaps:
            root = token.module()
            if root is not None:
                for prefix, module in root.named_modules():
                    if module is owner:
                        return f"{prefix}.{name}" if prefix else name
        return fallback


def _origin(tensor: object, swaps: tuple) -> str:
    for token in reversed(swaps):
        if id(tensor) in token.changed:
            return repr(token)
    return "the module's own tensor"


def swapped_reads(function: object) -> object:
    """:class:`SwappedReads` for ``function``, or ``()`` when no tensor it reads is swapped in here."""
    swaps = tuple(getattr(_swaps_here, "active", ()))
    if not swaps:
        return ()
    changed = frozenset().union(*(token.changed for token in swaps))
    if not changed:  # every swap put the very same tensors in place
        return ()
    found = _reads.reads_of(function).complete()
    reads = []
    at_risk = found.unseen
    for path, owner, store, name, tensor in found.named_module_tensors():
        origin = _origin(tensor, swaps) if id(tensor) in changed else "the module's own tensor"
        at_risk = at_risk or id(tensor) in changed
        reads.append((path, owner, store, name, weakref.ref(tensor), origin))
    return SwappedReads(tuple(reads), swaps, found.unseen) if at_risk else ()


swapped_reads.takes_function = True  # type: ignore[attr-defined]
swapped_reads.active = functools.partial(_swap_count.__getitem__, 0)  # type: ignore[attr-defined]


def _swapped_reads_relevant(function: object, was: object, now: object) -> bool:
    """Whether the recompute would read other tensors than the forward did."""
    if isinstance(was, SwappedReads):
        return bool(was.differences())
    return True  # the forward read none of the tensors a swap now puts in place


swapped_reads.relevant = _swapped_reads_relevant  # type: ignore[attr-defined]


def describe_swap_change(was: object, now: object) -> str:
    """The change line for CKG101: which tensors, from where, to where."""
    if isinstance(was, SwappedReads):
        differences = was.differences()
        groups: dict = {}
        for path, then, later in differences:
            groups.setdefault((then, later), []).append(path)
        parts = []
        for (then, later), paths in groups.items():
            shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
            parts.append(f"{shown}: {then} at the forward → {later} now")
        return "; ".join(parts) or "the tensors the block reads"
    swaps = ", ".join(map(repr, now.swaps)) if isinstance(now, SwappedReads) else "a functional_call"
    return f"the module's own tensors at the forward → tensors swapped in by {swaps} now"


swapped_reads.describe_change = describe_swap_change  # type: ignore[attr-defined]


def swapped_roots(state: tuple) -> list:
    """The modules the swaps recorded in a captured state belong to (for messages)."""
    roots = []
    for value in state:
        if isinstance(value, SwappedReads):
            roots += [module for module in (token.module() for token in value.swaps) if module is not None]
    return roots


def describe_swaps(value: object) -> str:
    if isinstance(value, SwappedReads):
        return "reads tensors swapped in by " + ", ".join(map(repr, value.swaps))
    return "reads the module's own tensors"


# --------------------------------------------------------------------------
# default dtype

default_dtype = torch.get_default_dtype


def describe_dtype(dtype: torch.dtype) -> str:
    return str(dtype)


# --------------------------------------------------------------------------
# optimizer steps: parameters updated in place between forward and recompute

_optimizer_steps = [0]
#: ``optimizer_steps()``: how many optimizer steps were taken, process-wide; a
#: builtin call, because the capture runs on every checkpoint call.
optimizer_steps = functools.partial(_optimizer_steps.__getitem__, 0)
# The latest steps, oldest first: (step number, ids of the parameters that
# step updated).  Ids are safe to compare: an entry is only consulted for
# parameters alive since before that step.
_step_log: collections.deque = collections.deque(maxlen=64)
_step_lock = threading.Lock()


def _parameters_stepped(optimizer: Any) -> frozenset:
    """Ids of the parameters an optimizer step just updated: those with a gradient.

    Every torch optimizer skips a parameter whose ``grad`` is None and updates
    (in place) every other one, fused or not, even with an all-zero gradient.
    """
    return frozenset(
        id(p)
        for group in optimizer.param_groups
        for p in group.get("params", ())
        if isinstance(p, Tensor) and p.grad is not None
    )


def record_step(optimizer: Any) -> None:
    """An optimizer step just updated its parameters (eager only: see ``_hooks.note_step``).

    Counts the step and logs what it updated: one pass over the optimizer's
    parameters per step (tens of µs for hundreds of tensors), nothing per
    checkpoint call beyond reading the count.  Never raises into the user's
    ``step()``: an optimizer this cannot read (a custom one with odd
    param_groups) is counted, with no parameters logged.
    """
    try:
        updated = _parameters_stepped(optimizer)
    except Exception:  # noqa: BLE001 - this must not break the user's step
        updated = frozenset()
    with _step_lock:
        _optimizer_steps[0] += 1
        _step_log.append((_optimizer_steps[0], updated))


def _steps_relevant(function: object, was: int, now: int) -> bool:
    """Whether a step taken since the forward updated a parameter ``function`` uses.

    Never guesses: a module the function may use only in part counts only if
    the steps updated every one of its trainable parameters; parameters it
    cannot see at all (a module hidden in a dict) count as untouched.
    """
    with _step_lock:
        updated = frozenset().union(*(ids for number, ids in _step_log if was < number <= now))
    if not updated:
        return False
    reads = _reads.reads_of(function)
    surely = [*(p for m in reads.whole for p in m.parameters()), *reads.tensors]
    if any(id(p) in updated for p in surely):
        return True
    for module in reads.partial:  # used in part, maybe: count it only when all of it moved
        trainable = [p for p in module.parameters() if p.requires_grad]
        if trainable and all(id(p) in updated for p in trainable):
            return True
    return False


optimizer_steps.relevant = _steps_relevant  # type: ignore[attr-defined]


def describe_optimizer_steps(count: int) -> str:
    return f"after optimizer step {count}" if count else "before any optimizer step"


# --------------------------------------------------------------------------
# the backward a reentrant recompute runs in (CKG114)
#
# torch's reentrant checkpoint takes the block's gradients with a backward of its
# own, which builds no graph whatever the backward running it was asked for.  Under
# ``.backward(create_graph=True)`` the gradients through the block are then constants:
# a gradient penalty or a Hessian-vector product loses the block's terms, silently.
# Grad mode when ``CheckpointFunction.backward`` starts is the engine's create_graph;
# ``_layouts.guard_backward`` notes it here for the recompute to read.

_REENTRANT_BACKWARD = threading.local()
#: reentrant backwards building a graph now, on any thread: the capture's cheap gate (a
#: missing attribute of a threading.local costs ~0.6 µs to ask for; this, ~0.04 µs)
_GRAPH_BUILDING = [0]
_GRAPH_BUILDING_LOCK = threading.Lock()


def reentrant_backward_builds_graph() -> object:
    """True inside a reentrant checkpoint's backward asked to build a graph on this thread, else ``()``."""
    return True if getattr(_REENTRANT_BACKWARD, "builds_graph", False) else ()


reentrant_backward_builds_graph.active = functools.partial(list.__getitem__, _GRAPH_BUILDING, 0)  # type: ignore[attr-defined]
# only a recompute inside such a backward matters: a block whose forward ran inside one (nested in a
# recompute) and is recomputed by the inner, graph-free backward is what torch does without the guard
reentrant_backward_builds_graph.relevant = lambda function, was, now: now is True and was is not True  # type: ignore[attr-defined]


@contextlib.contextmanager
def reentrant_backward(builds_graph: bool) -> Iterator[None]:
    """While a reentrant checkpoint's backward runs: whether it was asked to build a graph."""
    outer = getattr(_REENTRANT_BACKWARD, "builds_graph", False)
    _REENTRANT_BACKWARD.builds_graph = builds_graph
    if builds_graph:
        with _GRAPH_BUILDING_LOCK:
            _GRAPH_BUILDING[0] += 1
    try:
        yield
    finally:
        _REENTRANT_BACKWARD.builds_graph = outer
        if builds_graph:
            with _GRAPH_BUILDING_LOCK:
                _GRAPH_BUILDING[0] -= 1


reentrant_backward_builds_graph.describe_change = lambda was, now: (  # type: ignore[attr-defined]
    "the backward running the recompute was asked to build a graph (create_graph=True); the "
    "reentrant recompute's own backward builds none"
)


def describe_backward_graph(builds_graph: object) -> str:
    if builds_graph is True:
        return "a backward that builds a graph (create_graph=True)"
    return "a forward outside such a backward"


# --------------------------------------------------------------------------
# what the block reads by reference, re-bound between forward and recompute (CKG110)
#
# A meta-optimizer (torchopt's MetaSGD, higher's differentiable optimizers)
# writes new, non-leaf tensors into a module's ``_parameters`` after the inner
# forward; a one-shot forward hook (nnsight) is removed after it; a loop
# rebinds a variable a checkpointed lambda closes over.  The recompute then
# reads other tensors, or runs other hooks, than the forward did.  The
# capture keeps what the block reads by reference: the entries of its
# modules' parameter, buffer and forward-hook dicts (for a module, its bound
# method, or a partial of either), or the contents of a function's closure
# cells.  Compared by identity.


_TENSOR_STORES = ("_parameters", "_buffers")
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_GONE = object()
#: set once a checkpointed block holding an nn.RReLU is seen: until then CKG009 costs one read
rrelu_seen = [False]


class _Structure:
    """A checkpointed module's shape, walked once per module (a block keeps its shape).

    It holds no module (a weak reference to check the id, the submodules'
    paths): the guard must never keep a model alive.  ``snapshot(module)`` is
    generated for the shape and shared by every module of that shape (no loop,
    no per-module call: it runs on every checkpoint call).  It walks from the
    module to each submodule by name, as the forward will, and returns
    ``(copies of each module's parameter and buffer dicts, copies of its
    forward (pre-)hook dicts or None when there are none, each module's
    training flag)``, or None when the module no longer has this shape (a
    submodule added, removed or replaced by one of another shape): the
    structure is then walked again.
    """

    __slots__ = ("ref", "paths", "shape", "rrelus", "generators", "snapshot")

    def __init__(self, module: Module) -> None:
        self.ref = weakref.ref(module)
        named = _every_path(module)
        self.paths = tuple(path for path, _ in named)
        self.rrelus = [weakref.ref(m) for _, m in named if isinstance(m, torch.nn.RReLU)]  # CKG009's
        if self.rrelus:
            rrelu_seen[0] = True
        self.generators = _generator_attributes(module)  # CKG113's
        # per module: (path, number of children, has parameters, has buffers)
        shape = self.shape = tuple(
            (path, len(m._modules), bool(m._parameters), bool(m._buffers)) for path, m in named
        )
        self.snapshot = _snapshots.get(shape) or _compile_snapshot(shape)

    def modules(self, module: Module) -> list:
        """The modules in snapshot order (for messages and replays, not the hot path); [] if the shape changed."""
        try:
            return [module.get_submodule(path) for path in self.paths]
        except AttributeError:
            return []

    def owners(self, module: Module, hooks: bool) -> list:
        """``[(module, dict name)]`` in the order of the snapshot's tensor part (or its hook part)."""
        modules = self.modules(module)
        if hooks:
            return [(m, store) for m in modules for store in _HOOK_DICTS]
        return [
            (m, store) for m, (_, _, has_parameters, has_buffers) in zip(modules, self.shape)
            for store, has in (("_parameters", has_parameters), ("_buffers", has_buffers)) if has
        ]


def _every_path(module: Module) -> list:
    """``named_modules()`` with every path to a shared submodule (each can be re-bound on its own).

    A module graph with a cycle has endless paths: then each module once.
    """
    unique = list(module.named_modules())
    try:
        every = list(itertools.islice(module.named_modules(remove_duplicate=False), 4 * len(unique) + 64))
    except RecursionError:
        return unique
    return unique if len(every) > 4 * len(unique) + 63 else every


# the module's shape -> its generated snapshot
_snapshots: dict = {}


def _compile_snapshot(shape: tuple) -> Callable[[Module], Optional[tuple]]:
    # Each module's __dict__ is read once and subscripted: an attribute read on a
    # module goes through nn.Module's __getattr__ hook, several times slower.  A
    # parameter or buffer dict empty when the shape was taken is checked to be
    # empty still (part of the shape), not copied.
    index = {path: i for i, (path, *_) in enumerate(shape)}
    walk, same, tensors, hooks, any_hook, flags = [], [], [], [], [], []
    for i, (path, children, has_parameters, has_buffers) in enumerate(shape):
        if i:
            parent, _, name = path.rpartition(".")
            walk.append(f"        d{i} = d{index[parent]}['_modules'][{name!r}].__dict__\n")
        same.append(f"len(d{i}['_modules']) == {children}" if children else f"not d{i}['_modules']")
        for store, has in (("_parameters", has_parameters), ("_buffers", has_buffers)):
            if has:
                tensors.append(f"copy(d{i}[{store!r}]), ")
            else:
                same.append(f"not d{i}[{store!r}]")
        hooks.append(f"copy(d{i}['_forward_pre_hooks']), copy(d{i}['_forward_hooks']), ")
        any_hook.append(f"d{i}['_forward_pre_hooks'] or d{i}['_forward_hooks']")
        flags.append(f"d{i}['training'], ")
    source = (
        "def snapshot(m0):\n"
        "    try:\n"
        "        d0 = m0.__dict__\n"
        f"{''.join(walk)}"
        f"        if not ({' and '.join(same) or 'True'}):\n"
        "            return None\n"
        f"        return ({''.join(tensors)}), (({''.join(hooks)}) if {' or '.join(any_hook)} else None), "
        f"({''.join(flags)})\n"
        "    except (KeyError, AttributeError, TypeError):  # a submodule gone or None, or a module unlike\n"
        "        # nn.Module's (torch.jit.script's dicts are wrappers dict.copy does not take)\n"
        "        return None\n"
    )
    namespace: dict = {"copy": dict.copy}  # a plain dict of each (OrderedDict's copy is slower)
    # Filed under this file: dynamo skips it (torch 2.4's dynamo, tracing a generated file, fails on dict.copy)
    exec(compile(source, __file__, "exec"), namespace)  # noqa: S102 - from the module's shape
    if len(_snapshots) >= 1024:
        _snapshots.clear()
    snapshot = _snapshots[shape] = namespace["snapshot"]
    return snapshot


def _read_snapshot(module: Module) -> tuple:
    """What a generated snapshot returns, read plainly (a module its code cannot read, say a property ``training``)."""
    modules = list(module.modules())
    hooks = [getattr(m, store) for m in modules for store in _HOOK_DICTS]
    return (
        tuple(dict(getattr(m, store)) for m in modules for store in _TENSOR_STORES if getattr(m, store)),
        tuple(dict(h) for h in hooks) if any(hooks) else None,
        tuple(bool(m.training) for m in modules),
    )


# id(module) -> its _Structure (whose weak reference tells a new module at the same id)
_block_structure: dict = {}


def _structure(module: Module) -> _Structure:
    entry = _block_structure.get(id(module))
    if entry is None or entry.ref() is not module:
        if len(_block_structure) >= 4096:
            _block_structure.clear()
        entry = _block_structure[id(module)] = _Structure(module)
    return entry


def _block_module(function: object) -> object:
    """The module a call runs (itself, behind a bound method or a partial of either), else the function."""
    while True:  # the guard's recorder is a partial of a method bound to the user's block
        if type(function) is functools.partial:
            function = function.func
        elif type(function) is _MethodType and isinstance(
            function.__self__, (Module, types.FunctionType, _MethodType, functools.partial)
        ):
            function = function.__self__
        else:
            return function


_NOTHING = ((), (), None)


def block_snapshot(function: object) -> tuple:
    """What the block reads by reference, its hooks and its modules' train/eval flags, in one read.

    ``(tensors, hooks, training)``: for a module (itself, its bound method, a
    partial of either) a shallow copy of each of its modules' parameter and
    buffer dicts, of their forward (pre-)hook dicts (C-level copies: names and
    values, the cheapest way to keep them), and each module's ``training``;
    for a function its closure cells' contents, ``()`` and None.  Read on
    every checkpoint call.  Compared as plain tuples: an entry that is the
    same object compares equal without looking at it; one that is another
    tensor cannot be compared (:func:`differs` says so).
    """
    kind = type(function)  # _block_module inlined: this runs on every checkpoint call
    while kind is functools.partial or kind is _MethodType:  # the guard's recorder wraps one in another
        function = function.func if kind is functools.partial else function.__self__
        kind = type(function)
    if isinstance(function, Module):
        entry = _block_structure.get(id(function))
        if entry is None or entry.ref() is not function:
            entry = _structure(function)
        snapshot = entry.snapshot(function)
        if snapshot is None:  # its shape changed since it was walked
            _block_structure.pop(id(function), None)
            snapshot = _structure(function).snapshot(function)
            if snapshot is None:
                try:
                    return _read_snapshot(function)
                except Exception:  # noqa: BLE001 - a module the guard cannot read (a C++ one): nothing to compare
                    return _NOTHING
        return snapshot
    if kind is types.FunctionType and function.__closure__:
        try:
            return tuple([cell.cell_contents for cell in function.__closure__]), (), None
        except ValueError:  # an empty cell: a name assigned after the function was made
            return _NOTHING
    return _NOTHING


def differs(was: object, now: object) -> bool:
    """``was != now`` for captured state, as Python compares containers: identical entries are equal
    without a look.  A tensor that is another object is compared by ``==`` (a kernel, on drift
    only): one of several elements cannot be (so it differs), a one-element one equal in value
    counts as the same (its recompute computes the same numbers)."""
    try:
        return bool(was != now)
    except Exception:  # noqa: BLE001 - a tensor compared with another: ambiguous, so not the same
        return True


def block_bindings(function: object) -> object:
    """CKG110's part of :func:`block_snapshot`: the tensors (or closure values) the block reads."""
    return block_snapshot(function)[0]


def block_hooks(function: object) -> object:
    """CKG111's part of :func:`block_snapshot`: its modules' forward hooks and pre-hooks."""
    return block_snapshot(function)[1]


block_bindings.part_of = (block_snapshot, 0)  # type: ignore[attr-defined]
block_hooks.part_of = (block_snapshot, 1)  # type: ignore[attr-defined]
block_bindings.takes_function = block_hooks.takes_function = True  # type: ignore[attr-defined]


def rebound(was: object, function: object, hooks: bool = False) -> list:
    """``[(owner, store, name, forward value)]`` for what differs now from the forward's ``was``.

    ``store``: "cell" (owner a cell), "_parameters" / "_buffers" (a tensor
    re-bound, deleted, or moved to a plain attribute: the forward value is
    what to read again), a hook dict's name (name is that too, value the
    forward's dict), or "new" (an entry the forward did not have: nothing
    to replay).
    """
    block = _block_module(function)
    if not isinstance(block, Module):
        cells = getattr(block, "__closure__", None) or ()
        if len(cells) != len(was):
            return []
        return [
            (cell, "cell", name, old)
            for cell, name, old in zip(cells, block.__code__.co_freevars, was)
            if cell.cell_contents is not old
        ]
    owners = _structure(block).owners(block, hooks)
    dicts = [getattr(m, store) for m, store in owners]
    changes: list = []
    if was is None:  # the forward ran without any hook
        was = tuple({} for _ in dicts)
    if len(dicts) != len(was):
        return changes
    for (module, store), forward, current in zip(owners, was, dicts):
        same = len(forward) == len(current) and all(current.get(k, _GONE) is v for k, v in forward.items())
        if same:
            continue
        if hooks:
            changes.append((module, store, store, forward))
            continue
        changes += [(module, store, name, value) for name, value in forward.items() if current.get(name, _GONE) is not value]
        changes += [(module, "new", name, _GONE) for name in current if name not in forward]
    return changes


def describe_bindings(value: object) -> str:
    return "what the block reads by reference" if value else "nothing watched"


def describe_rebinding(was: object, now: object, function: object = None) -> str:
    """CKG110's change line: ``Linear.weight re-bound (another tensor, not updated in place)``."""
    parts = []
    for owner, store, name, _ in rebound(was, function):
        if store == "cell":
            parts.append(f"the closure variable {name!r} re-bound")
        elif store == "new":
            parts.append(f"{type(owner).__name__}.{name} added")
        else:
            parts.append(f"{type(owner).__name__}.{name} re-bound (another tensor, not updated in place)")
    return "; ".join(parts) or "what the block reads changed"


def describe_hook_change(was: object, now: object, function: object = None) -> str:
    """CKG111's change line: ``forward hooks of Linear added or removed``."""
    parts = [
        f"{'forward pre-hooks' if store == '_forward_pre_hooks' else 'forward hooks'} of {type(owner).__name__} "
        "added or removed"
        for owner, store, _, _ in rebound(was, function, hooks=True)
    ]
    return "; ".join(parts) or "the block's hooks changed"


block_bindings.describe_change = describe_rebinding  # type: ignore[attr-defined]
block_hooks.describe_change = describe_hook_change  # type: ignore[attr-defined]
describe_rebinding.takes_function = describe_hook_change.takes_function = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# a list, dict or object the block is given, changed before its recompute (CKG112)
#
# A KV cache passed to a checkpointed attention block (pytorch#155171) grows
# in the block's own forward: the recompute then reads the grown cache and
# appends to it again.  The capture keeps the shallow contents of each such
# container the block is given (its arguments, what a partial of it binds,
# its closure cells), to a small depth: the items of a list, the entries of
# a dict, an object's attributes; the versions of the tensors in them.
# Compared by identity, as the block snapshot is.

#: values that cannot be, or hold, a container the block could change
_ATOMS = frozenset({
    Tensor, torch.nn.Parameter, type(None), bool, int, float, complex, str, bytes,
    torch.dtype, torch.device, torch.Size,
})
_SCALARS = _ATOMS - {Tensor, torch.nn.Parameter}
_Generator = torch.Generator
#: how many containers deep, and how many containers and tensors per root, the capture looks
_CONTENTS_DEPTH, _CONTENTS_BUDGET = 4, 256
#: a container longer than this is recorded by its length and last values (a per-call
#: copy of a long list of token ids would cost more than the block); fallback cannot
#: put such a record back, so it raises for it as strict
_LONG, _LONG_TAIL = 256, 8
LONG_MARK = "<long container>"


def _is_long(record: object) -> bool:
    """A container record that keeps only its length and last values (see :func:`_shallow`)."""
    return type(record) is tuple and bool(record) and record[0] is LONG_MARK
#: one replay of the user's shared objects at a time (containers, closure cells, generators)
REPLAY_LOCK = threading.RLock()


def _object_state(value: object) -> Optional[dict]:
    """An object's own ``__dict__``, or None (none, or one its class hides behind ``__getattr__``)."""
    try:
        state = object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 - __slots__, a __getattr__ of its own: not watched
        return None
    return state if type(state) is dict else None


def _container_kind(value: object) -> Optional[str]:
    """"list", "dict" or "object" for a value whose contents the block could change in place; else None."""
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, (Tensor, Module, tuple, type, types.FunctionType, types.MethodType, functools.partial)):
        return None
    root = (getattr(type(value), "__module__", None) or "").split(".")[0]
    if root in _reads._LIBRARY_ROOTS or _object_state(value) is None:
        return None
    return "object"


def _argument_roots(
    function: object, inputs: tuple, keywords: Optional[dict], modules: Optional[list] = None,
) -> Optional[list]:
    """``[(label, value)]`` for the containers and generators the block is given; None when there is none.

    ``modules``: where to list the modules it is given (arguments, closure
    cells, what a partial binds), for their generators.
    """
    roots: list = []
    values = [(f"its argument {i + 1}", value) for i, value in enumerate(inputs)]
    values += [(f"its keyword argument {name!r}", value) for name, value in (keywords or {}).items()]
    while type(function) is functools.partial:
        values += [(f"argument {i + 1} bound by a functools.partial", v) for i, v in enumerate(function.args)]
        values += [(f"keyword argument {k!r} bound by a functools.partial", v) for k, v in function.keywords.items()]
        function = function.func
    if type(function) is types.FunctionType and function.__closure__:
        for name, cell in zip(function.__code__.co_freevars, function.__closure__):
            try:
                values.append((f"the closure variable {name!r}", cell.cell_contents))
            except ValueError:  # an empty cell
                continue
    for label, value in values:
        if type(value) in _ATOMS:
            continue
        if modules is not None and isinstance(value, Module):
            modules.append(value)
        elif _holds_container(value):
            roots.append((label, value))
    return roots or None


def _holds_container(value: object) -> bool:
    if type(value) is tuple:  # a tuple of tensors (rotary embeddings) is the usual non-tensor argument
        for item in value:
            if type(item) not in _ATOMS and _holds_container(item):
                return True
        return False
    return type(value) is _Generator or _container_kind(value) is not None


def _full(value: object, kind: str) -> tuple:
    """A container's items, read through the base class (a subclass's own ``__iter__`` or ``items`` may do anything)."""
    if kind == "list":
        return tuple(list.__getitem__(value, slice(None)))  # type: ignore[arg-type]
    if kind == "dict":
        return tuple(dict.items(value))  # type: ignore[arg-type]
    return tuple((_object_state(value) or {}).items())


def _shallow(value: object, kind: str) -> tuple:
    """What the capture keeps of a container: its items (a list's) or ``(key, value)`` pairs."""
    items = _full(value, kind)
    if len(items) > _LONG:  # its length and last values only
        tail = items[-_LONG_TAIL:] if kind == "list" else tuple(v for _, v in items[-_LONG_TAIL:])
        return (LONG_MARK, len(items), *tail)
    return items


def _step(path: str, key: object, kind: str) -> str:
    return f"{path}.{key}" if kind == "object" else f"{path}[{key!r}]"


def contents_snapshot(roots: list, generators: Optional[list] = None, unrecorded: Optional[list] = None) -> tuple:
    """``((path, container, kind, shallow contents) | (path, tensor, "tensor", version), ...)``.

    Depth-first from each root, each container once, at most
    ``_CONTENTS_DEPTH`` containers deep and ``_CONTENTS_BUDGET`` containers
    and tensors per root.  ``path``: the root's label, then the way in
    (``its argument 2.layers[0]``).  A user ``torch.Generator`` met on the way
    is appended to ``generators`` as ``(path, generator)``, if given.
    ``unrecorded``, if given, gets the path of each value whose state the
    walk did not record (too deep, past the budget, or of a kind it does not
    record, other than functions, classes and torch's operators).
    """
    entries: list = []
    seen: set = set()
    for label, root in roots:
        stack = [(root, 0, label)]
        budget = _CONTENTS_BUDGET
        while stack:
            if budget <= 0:
                if unrecorded is not None:
                    unrecorded.append(stack[-1][2])
                break
            value, depth, path = stack.pop()
            if type(value) in _SCALARS or id(value) in seen:
                continue
            if isinstance(value, Tensor):
                seen.add(id(value))
                budget -= 1
                if depth:  # an argument tensor itself: torch checks its version
                    try:
                        entries.append((path, value, "tensor", value._version))
                    except Exception:  # noqa: BLE001 - a torch.func wrapper has no version counter
                        pass
                continue
            if type(value) is tuple:
                stack.extend((item, depth, f"{path}[{i}]") for i, item in reversed(list(enumerate(value))))
                continue
            if type(value) is _Generator:
                seen.add(id(value))
                if generators is not None and is_user_generator(value):
                    generators.append((path, value))
                continue
            kind = _container_kind(value)
            if kind is None or depth >= _CONTENTS_DEPTH:
                if unrecorded is not None and (kind is not None or not _stateless(value)):
                    unrecorded.append(path)
                continue
            seen.add(id(value))
            budget -= 1
            contents = _shallow(value, kind)
            entries.append((path, value, kind, contents))
            if _is_long(contents):
                stack.extend((item, depth + 1, f"{path}[…]") for item in reversed(contents[2:]))
            else:
                pairs = enumerate(contents) if kind == "list" else contents
                stack.extend((item, depth + 1, _step(path, key, kind)) for key, item in reversed(list(pairs)))
    return tuple(entries)


#: values a mode may hold whose own state cannot change what it computes (identity is recorded):
#: functions (looked into by _stateless), classes, torch's operators and their namespaces
_STATELESS = (
    types.FunctionType, types.BuiltinFunctionType, type,
    torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops._OpNamespace,
    # a C class's methods (typing.Generic's on Python 3.13)
    types.MethodDescriptorType, types.ClassMethodDescriptorType, types.WrapperDescriptorType,
    types.GetSetDescriptorType,
)
#: where code the replay trusts lives: torch's package and Python's standard library (not the
#: site-packages below it)
_TRUSTED_CODE_ROOTS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (torch.__file__, functools.__file__)
)


def _cell_contents(cell: Any) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _wrapper_held(value: object, depth: int, seen: set) -> bool:
    """What a wrapper of torch's or Python's holds may stay: its own bookkeeping (an object of a
    torch or standard-library class: dynamo's context, dataclasses' recursion guard, typing's
    cache), unless it holds a function of the user's, which is looked into; an object of the
    user's own class is state the record cannot see."""
    if type(value) is types.FunctionType:
        return _stateless(value, depth, seen)
    if _immutable(value) or isinstance(value, _STATELESS):
        return True
    if type(value) in (dict, list, tuple, set, frozenset):
        items = value.values() if type(value) is dict else value  # type: ignore[attr-defined]
        return len(items) <= _CONTENTS_BUDGET and all(  # type: ignore[arg-type]
            _wrapper_held(item, depth - 1, seen) for item in items  # type: ignore[union-attr]
        )
    root = (getattr(type(value), "__module__", "") or "").split(".")[0]
    return root == "torch" or root in _reads._LIBRARY_ROOTS


def _trusted_code(function: types.FunctionType) -> bool:
    """A function of torch's or of Python's own library (a decorator's wrapper: torch's dynamo
    disable on ``__torch_dispatch__``, ``torch.no_grad()``, dataclasses' repr guard)."""
    filename = function.__code__.co_filename
    if filename.startswith(_TRUSTED_CODE_ROOTS[0]):
        return True
    return filename.startswith(_TRUSTED_CODE_ROOTS[1]) and "-packages" not in filename[len(_TRUSTED_CODE_ROOTS[1]):]


def _stateless(value: object, depth: int = 4, seen: Optional[set] = None) -> bool:
    """A function whose defaults hold nothing mutable, whose attributes and closure cells hold only
    such functions, classes or operators (``super()``'s ``__class__`` cell is fine; a number in a
    cell is not: ``nonlocal n; n += 1`` rebinds it), a static or class method or property made of
    such functions, a class, an operator, a module; a function of torch's or Python's own library.
    What a function reads through its globals is not seen."""
    if type(value) is types.FunctionType:
        seen = set() if seen is None else seen
        if id(value) in seen:
            return True  # already being looked at (a wrapper and the function it wraps refer to each other)
        seen.add(id(value))
        if depth <= 0:
            return False
        if _trusted_code(value):  # a wrapper of torch's or Python's: what it wraps is looked into
            held = [*value.__dict__.values(), *(_cell_contents(cell) for cell in value.__closure__ or ())]
            return all(_wrapper_held(h, depth - 1, seen) for h in held)
        if not all(_stateless(v, depth - 1, seen) for v in value.__dict__.values()):
            return False  # an attribute of its own: a counter (f.calls += 1); functools.wraps' __wrapped__ is looked into
        defaults = (*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values())
        if not all(_immutable(d) for d in defaults):
            return False
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell: it may be filled later
                return False
            if not (name == "__class__" or _stateless(content, depth - 1, seen)):
                return False
        return True
    if isinstance(value, (staticmethod, classmethod)):
        return _stateless(value.__func__, depth, seen)
    if isinstance(value, property):
        return all(f is None or _stateless(f, depth, seen) for f in (value.fget, value.fset, value.fdel))
    if isinstance(value, functools.cached_property):  # it stores into the instance __dict__, which is recorded
        return _stateless(value.func, depth, seen)
    if isinstance(value, types.ModuleType):  # a namespace anyone may write to: torch's are taken as constant
        return (value.__name__ or "").split(".")[0] == "torch"
    if isinstance(value, types.BuiltinFunctionType):  # len, math.sqrt; not log.append or rng.random
        owner = getattr(value, "__self__", None)
        return owner is None or isinstance(owner, types.ModuleType)
    return isinstance(value, _STATELESS)


def _immutable(value: object) -> bool:
    """A number, string, dtype, shape, enum member, or a tuple / frozenset of such values or of
    operators and classes."""
    if type(value) in (tuple, frozenset):
        return all(_immutable(item) or isinstance(item, _STATELESS[2:]) for item in value)  # type: ignore[attr-defined]
    return type(value) in _SCALARS or isinstance(value, enum.Enum)


_NO_ARGUMENT_STATE = ((), ())


def argument_state(function: object, inputs: tuple = (), keywords: Optional[dict] = None) -> tuple:
    """``(contents, generators)``: CKG112's and CKG113's reads of what the block is given, in one walk.

    On every checkpoint call: a module or bound method given tensors only returns
    after one look at each input (and one flag: has any block held a generator?).
    """
    kind = type(function)
    if not keywords and kind is not functools.partial and (kind is not types.FunctionType or not function.__closure__):
        for value in inputs:
            if type(value) not in _ATOMS:
                break
        else:
            if not module_generators_seen[0]:
                return _NO_ARGUMENT_STATE
            return (), _generator_states(_module_generators(function))
    modules: list = []
    roots = _argument_roots(function, inputs, keywords, modules)
    found: list = _module_generators(function, modules)
    contents = contents_snapshot(roots, found) if roots else ()
    return contents, _generator_states(found) if found else ()


argument_state.takes_inputs = True  # type: ignore[attr-defined]


def argument_contents(function: object, inputs: tuple = (), keywords: Optional[dict] = None) -> tuple:
    """CKG112's part of :func:`argument_state`: the contents of the containers the block is given."""
    return argument_state(function, inputs, keywords)[0]


argument_contents.part_of = (argument_state, 0)  # type: ignore[attr-defined]


def _now(entry: tuple) -> object:
    _, value, kind, _ = entry
    return _version_of(value) if kind == "tensor" else _shallow(value, kind)


def _same(now: object, was: object) -> bool:
    """Two records of one container (or one tensor's versions) hold the same values, by identity."""
    if type(now) is not tuple or type(was) is not tuple:
        return now == was
    return len(now) == len(was) and all(
        _same_value(a, b)
        or (type(a) is tuple and type(b) is tuple and len(a) == 2 == len(b) and a[0] == b[0] and a[1] is b[1])
        for a, b in zip(now, was)
    )


def changed_at_all(was: tuple) -> list:
    """The entries of ``was`` not as they were then: any value came, went or was replaced."""
    return [entry for entry in was if not _same(_now(entry), entry[3])]


def changed_contents(was: tuple) -> list:
    """The entries of ``was`` changed in a way a gradient can depend on.

    A tensor updated in place; in a container, a value replaced (a counter,
    a position: the block may compute with it), or a tensor (or a container,
    which may hold one) that came or went.  A log the block appends devices
    or Python numbers to is not counted (fallback's replay puts such values
    back all the same).
    """
    return [
        entry for entry in changed_at_all(was)
        if entry[2] == "tensor" or _counts(_shallow(entry[1], entry[2]), entry[3], entry[2])
    ]


def _same_value(a: object, b: object) -> bool:
    """The same object, or equal immutable values (a number, a shape, a tuple of them made anew)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) in _SCALARS:
        return a == b
    return type(a) in (tuple, frozenset) and _immutable(a) and _immutable(b) and a == b


def _counts(now: tuple, was: tuple, kind: str) -> bool:
    """Whether a change between two shallow contents is one a gradient can depend on (see :func:`changed_contents`)."""
    if _is_long(was) or _is_long(now):
        return any(_may_hold_tensors(item) for item in _moved(now, was, kind))
    if kind == "list":
        common = min(len(now), len(was))
        if not all(_same_value(a, b) for a, b in zip(now[:common], was[:common])):
            return True  # a value replaced in place (a counter in a box: counter[0] += 1)
        return any(_may_hold_tensors(item) for item in (*now[common:], *was[common:]))
    before, after = dict(was), dict(now)
    for key, value in after.items():
        if key in before:
            if not _same_value(value, before[key]):
                return True  # an entry or attribute replaced: a counter, a position, a flag
        elif _may_hold_tensors(value):
            return True
    return any(_may_hold_tensors(value) for key, value in before.items() if key not in after)


def carries_gradient(value: object) -> bool:
    """A tensor that requires grad (through torch.func's wrappers), or a container holding one."""
    if isinstance(value, Tensor):
        return requires_grad_anywhere(value)
    return any(kind == "tensor" and requires_grad_anywhere(t) for _, t, kind, _ in contents_snapshot([("", value)]))


def _moved(now: tuple, was: tuple, kind: str) -> list:
    """The values that came, went or were replaced between two shallow contents."""
    if kind == "list" or _is_long(was) or _is_long(now):
        moved = [a for a, b in zip(now, was) if a is not b]
        moved += [b for a, b in zip(now, was) if a is not b]
        return moved + list(now[len(was):]) + list(was[len(now):])
    before, after = dict(was), dict(now)
    moved = [value for key, value in after.items() if before.get(key, _GONE) is not value]
    return moved + [value for key, value in before.items() if after.get(key, _GONE) is not value]


def _may_hold_tensors(value: object) -> bool:
    return isinstance(value, Tensor) or (
        type(value) is tuple and any(_may_hold_tensors(item) for item in value)
    ) or _container_kind(value) is not None


def _version_of(tensor: Tensor) -> Optional[int]:
    try:
        return tensor._version
    except Exception:  # noqa: BLE001
        return None


def describe_contents(value: object) -> str:
    return "what the block was given" if value else "nothing watched"


def describe_contents_change(was: tuple, now: tuple = ()) -> str:
    """CKG112's change line: ``its argument 2.keys (a list): 1 item → 2 items``."""
    parts = []
    for path, value, kind, recorded in changed_contents(was):
        if kind == "tensor":
            parts.append(f"the tensor {path} was updated in place")
            continue
        what = f"a {type(value).__name__}" if kind == "object" else f"a {kind}"
        current = _shallow(value, kind)
        if kind == "object" and not _is_long(recorded):
            before, after = dict(recorded), dict(current)
            names = [k for k in {**before, **after} if after.get(k, _GONE) is not before.get(k, _GONE)]
            parts.append(f"{path} ({what}): {', '.join(map(str, names)) or 'attributes'} changed")
            continue
        was_len = recorded[1] if _is_long(recorded) else len(recorded)
        now_len = current[1] if _is_long(current) else len(current)
        parts.append(f"{path} ({what}): {_count(was_len)} → {_count(now_len)}" + (
            "" if now_len != was_len else ", other values"
        ))
    return "; ".join(parts) or "what the block was given changed"


def _count(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


argument_contents.describe_change = describe_contents_change  # type: ignore[attr-defined]
argument_contents.relevant = lambda function, was, now: bool(changed_contents(was))  # type: ignore[attr-defined]


def restore_contents(entries: list) -> None:
    """Put each container of ``entries`` back to its recorded contents (not tensors, nor long records)."""
    for _, value, kind, recorded in entries:
        if kind == "tensor" or _is_long(recorded):
            continue
        if kind == "list":
            list.__setitem__(value, slice(None), recorded)  # type: ignore[arg-type]
        elif kind == "dict":
            dict.clear(value)  # type: ignore[arg-type]
            dict.update(value, recorded)  # type: ignore[arg-type]
        else:
            state = _object_state(value)
            if state is not None:
                state.clear()
                state.update(recorded)


def replayable(entries: list) -> bool:
    """Whether :func:`replaying_contents` can put these back: no tensor updated in place, no long record."""
    return not any(kind == "tensor" or _is_long(recorded) for _, _, kind, recorded in entries)


@contextlib.contextmanager
def replaying_contents(entries: list, lock: bool = True) -> Iterator[None]:
    """The recorded contents in these containers while the block runs; what they hold now, after.

    The containers are the user's objects, seen by every thread: with
    ``lock``, one replay at a time (a rare repair: CKG112 under fallback).
    The composable recompute replays without it, for every log or counter a
    block keeps: a block that waits for another thread's block (a barrier)
    must not wait for this lock too.  What they hold now is copied whole.
    """
    with REPLAY_LOCK if lock else contextlib.nullcontext():
        now = [(path, value, kind, _full(value, kind)) for path, value, kind, _ in entries if kind != "tensor"]
        restore_contents(entries)
        try:
            yield
        finally:
            restore_contents(now)


@contextlib.contextmanager
def replaying_generators(generators: Sequence[tuple], lock: bool = True) -> Iterator[None]:
    """Each ``(generator, state)`` at that state while the block runs; where it is now, after.

    As torch does for the default generators: the recompute draws what the
    forward drew, and the program's next draw is the one it would have made.
    ``lock``: as for :func:`replaying_contents`.
    """
    with REPLAY_LOCK if lock else contextlib.nullcontext():
        now = [(generator, generator.get_state()) for generator, _ in generators]
        for generator, state in generators:
            generator.set_state(state)
        try:
            yield
        finally:
            for generator, state in now:
                generator.set_state(state)


# --------------------------------------------------------------------------
# a user torch.Generator the block draws from (CKG113)
#
# torch's checkpoint preserves the default generators (CPU and the device's)
# for the recompute, never one of the user's: a block that draws from its own
# generator (``torch.randn(..., generator=g)``, a dropout of its own) draws
# the next numbers in the recompute.  The capture keeps the state of each
# user generator the block can reach: given to it (found as CKG112 finds
# containers, and inside them) or held as an attribute of one of its modules.

#: set once a checkpointed module holding a torch.Generator attribute is walked: until then
#: CKG113 costs nothing for modules.  The capture reads the block snapshot (which walks a
#: new module) before this, so a module's first call is seen too.
module_generators_seen = [False]


def _device_default_generators() -> tuple:
    """The default generators of the initialised accelerators (CUDA, XPU): torch's RNG replay's, not the user's."""
    found: tuple = ()
    for name in ("cuda", "xpu"):
        device = getattr(torch, name, None)
        if device is not None and getattr(device, "is_initialized", lambda: False)():
            found += tuple(getattr(device, "default_generators", ()))
    return found


def is_user_generator(generator: object) -> bool:
    return generator is not torch.default_generator and not any(
        generator is default for default in _device_default_generators()
    )


def _generator_attributes(module: Module) -> list:
    """``[(path, name)]``: the plain attributes of ``module`` and its submodules that hold a torch.Generator."""
    found = [
        (path, name) for path, m in module.named_modules()
        for name, value in vars(m).items() if type(value) is _Generator
    ]
    if found:
        module_generators_seen[0] = True
    return found


def _module_generators(function: object, given: Sequence[Module] = ()) -> list:
    """``[(label, generator)]`` held by the block's module (itself, its bound method, a partial of
    either) or by a module it is given (an argument, a closure cell, what a partial binds)."""
    block = _block_module(function)
    modules = [block] if isinstance(block, Module) and module_generators_seen[0] else []
    modules += [m for m in given if m is not block]
    found = []
    for module in modules:
        for path, name in _structure(module).generators:
            try:
                value = vars(module.get_submodule(path) if path else module).get(name)
            except AttributeError:
                continue
            if type(value) is _Generator and is_user_generator(value):
                found.append((f"{type(module).__name__}{'.' + path if path else ''}.{name}", value))
    return found


def _generator_states(found: list) -> tuple:
    return tuple((label, generator, generator.get_state()) for label, generator in found)


def generator_states(function: object, inputs: tuple = (), keywords: Optional[dict] = None) -> tuple:
    """CKG113's part of :func:`argument_state`: ``((label, generator, state), ...)``."""
    return argument_state(function, inputs, keywords)[1]


generator_states.part_of = (argument_state, 1)  # type: ignore[attr-defined]


def moved_generators(was: tuple) -> list:
    """The entries of ``was`` whose generator is not in the state it was then (the block drew from it)."""
    return [entry for entry in was if not torch.equal(entry[1].get_state(), entry[2])]


def describe_generators(value: object) -> str:
    return "the user generators the block can draw from" if value else "no user generator"


def describe_generator_change(was: tuple, now: tuple) -> str:
    """CKG113's change line: ``the torch.Generator its argument 2 moved on since the forward``."""
    labels = [label for label, _, _ in moved_generators(was)]
    return "; ".join(
        f"the torch.Generator {label} moved on since the forward (the block drew from it, or code between "
        "the forward and the backward did)" for label in labels
    ) or (
        "a user generator moved on"
    )


generator_states.describe_change = describe_generator_change  # type: ignore[attr-defined]
generator_states.relevant = lambda function, was, now: bool(moved_generators(was))  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# a user mode fallback re-enters for the recompute (CKG102/103)
#
# A mode the forward ran under and the recompute runs without makes the
# recompute save other tensors.  Re-entering the forward's mode object is
# right only if the mode computes the same thing the second time: it must
# depend on nothing but its own attributes (a scale, a counter, a generator),
# which fallback puts back to what the call found for the recompute and to
# what they hold now after it.  The guard cannot see that a mode reads a
# global or another object, so the user says it: ``ckpt_guard.replayable_mode``.

#: the class attribute ``replayable_mode`` sets, holding the class itself (a subclass is not marked)
REPLAYABLE_MODE_MARK = "__ckpt_guard_replayable_mode__"


def mark_replayable_mode(cls: type) -> type:
    """``ckpt_guard.replayable_mode``: mark a user mode class fallback may re-enter in the recompute."""
    if not isinstance(cls, type) or not issubclass(cls, (TorchDispatchMode, TorchFunctionMode)):
        raise TypeError(
            f"ckpt_guard.replayable_mode({cls!r}): expected a TorchDispatchMode or TorchFunctionMode "
            "subclass (the class, not an instance)"
        )
    setattr(cls, REPLAYABLE_MODE_MARK, cls)
    return cls


def is_replayable_mode(mode: object) -> bool:
    cls = type(mode)
    return cls.__dict__.get(REPLAYABLE_MODE_MARK) is cls


#: the tensors a replayable mode holds that need no gradient are copied at each call (their value
#: is what the recompute must see: a dispatch mode's in-place update moves no version counter);
#: more bytes than this make the mode unrecordable (fallback then runs the block plainly)
_MODE_COPY_LIMIT = 1 << 20


#: what the base classes' __init__ and __enter__ keep on a mode: pushed and popped in pairs
_MODE_BASE_ATTRIBUTES = frozenset({
    "old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
    "old_without_ignore_compile_internals_dispatch_mode_flags", "old_dispatch_mode_flag",
    "_dispatch_key", "_mode_key",
})


class ModeRecord(NamedTuple):
    """What fallback needs to recompute under a replayable mode as the forward did."""

    contents: tuple  # as CKG112 records a container: the mode object, what its attributes hold
    copies: tuple  # ((tensor, its value at the call), ...) for the tensors that need no gradient
    generators: tuple  # ((label, generator, state), ...)
    class_values: tuple = ()  # ((class, name, value), ...): numbers its classes hold (type(self).n += 1)


@contextlib.contextmanager
def _user_modes_off() -> Iterator[None]:
    """The guard's own tensor work (copies, comparisons) unseen by the user's modes."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        yield


def mode_record(mode: object) -> Optional[ModeRecord]:
    """:func:`_mode_record`, unseen by the user's modes (a function mode sees a tensor's ``_version`` read)."""
    with _user_modes_off():
        return _mode_record(mode)


def _mode_record(mode: object) -> Optional[ModeRecord]:
    """A replayable mode's state as the call finds it, or None if it cannot be put back.

    Its instance attributes and what they hold, four containers deep; a copy
    of each tensor among them that needs no gradient (a scale, a history);
    the state of each user generator among them.  None where some of its
    state could not be put back, or might live elsewhere: fallback then runs
    the block plainly.  See :func:`_unrecordable_class` and :func:`_stateless`
    for what counts.
    """
    cls = type(mode)
    if _object_state(mode) is None or _unrecordable_class(cls):
        return None
    label = cls.__name__
    own = _shallow(mode, "object")
    if _is_long(own):
        return None
    entries: list = [(label, mode, "object", own)]
    roots, found = [], []
    attributes = [(f"{label}.{name}", value) for name, value in own if name not in _MODE_BASE_ATTRIBUTES]
    budget = _CONTENTS_BUDGET
    while attributes:  # tensors among its attributes, in tuples too (the walk below records deeper ones)
        budget -= 1
        if budget < 0:
            return None  # more than the walk keeps: not all of its state could be put back
        path, value = attributes.pop()
        if isinstance(value, Tensor):
            entries.append((path, value, "tensor", _version_of(value)))
        elif type(value) is tuple:
            attributes += [(f"{path}[{i}]", item) for i, item in enumerate(value)]
        elif type(value) not in _ATOMS:
            roots.append((path, value))
    unrecorded: list = []
    entries += contents_snapshot(roots, found, unrecorded) if roots else ()
    if unrecorded or any(kind != "tensor" and _is_long(recorded) for _, _, kind, recorded in entries):
        return None  # state the replay could not put back: a deque, a module, another library's object
    tensors = [value for _, value, kind, _ in entries if kind == "tensor"]
    copies = _copies(tensors, dispatch=isinstance(mode, TorchDispatchMode))
    if copies is None:
        return None
    return ModeRecord(tuple(entries), copies, _generator_states(found), _class_values(cls))


#: what Python and typing keep in a class's own namespace: no state of the mode's
_CLASS_BOOKKEEPING = frozenset({
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
    "__orig_bases__", "__parameters__", "__firstlineno__", "__static_attributes__", "__type_params__",
    "__abstractmethods__", "_abc_impl", "__slots__", "__dataclass_fields__", "__dataclass_params__",
    "__match_args__", REPLAYABLE_MODE_MARK,
})


#: mode class -> _unrecordable_class's answer, worked out on its first record (weak: a user's class
#: must not outlive its last use)
_unrecordable_classes: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _unrecordable_class(cls: type) -> bool:
    known = _unrecordable_classes.get(cls)
    if known is None:
        known = _unrecordable_classes[cls] = _keeps_state_outside(cls)
    return known


def _user_classes(cls: type) -> list:
    return [
        klass for klass in cls.__mro__
        if klass is not object and (getattr(klass, "__module__", "") or "").split(".")[0] != "torch"
    ]


def _class_values(cls: type) -> tuple:
    """``((owner, name, value), ...)``: the plain values (numbers, strings, tuples of them) the mode's
    own classes hold now, and those its methods (and the functions they wrap) hold as attributes.

    A method that rebinds one (``type(self).calls += 1``, also creating it on
    a subclass; ``wrapper.calls = getattr(wrapper, "calls", 0) + 1`` in a
    decorator) changes the mode's state as an attribute of its own does.
    """
    functions, classes = _reachable_from(cls)
    owners = [*classes, *functions]
    return tuple(
        (owner, name, value) for owner in owners for name, value in vars(owner).items()
        if name not in _CLASS_BOOKKEEPING and not (name.startswith("__") and type(owner) is types.FunctionType)
        and _immutable(value)
    )


def _class_values_moved(values: tuple, cls: Optional[type] = None) -> bool:
    if cls is not None and len(_class_values(cls)) != len(values):
        return True  # a plain value came (a subclass's own counter, a decorator's first count) or went
    return any(not _same_value(vars(owner).get(name, _GONE), value) for owner, name, value in values)


#: mode class -> (its methods and the functions they wrap or close over, the user classes it and
#: they refer to: a nested ``class State: calls = 0``, a class in a closure)
_reachable: "weakref.WeakKeyDictionary[type, tuple]" = weakref.WeakKeyDictionary()


def _user_class(value: object) -> bool:
    if not isinstance(value, type):
        return False
    root = (getattr(value, "__module__", "") or "").split(".")[0]
    return root != "torch" and root not in _reads._LIBRARY_ROOTS


def _reachable_from(cls: type) -> tuple:
    """``(functions, classes)`` the mode class reaches through its classes' namespaces, its
    functions' attributes and closure cells, and the classes found there (bounded)."""
    known = _reachable.get(cls)
    if known is not None:
        return known
    functions: list = []
    classes: list = list(_user_classes(cls))
    seen: set = {id(c) for c in classes}
    stack = [value for klass in classes for value in vars(klass).values()]
    while stack and len(seen) <= _CONTENTS_BUDGET:
        value = stack.pop()
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            stack += [f for f in (value.fget, value.fset, value.fdel) if f is not None]
            continue
        if id(value) in seen:
            continue
        if type(value) is types.FunctionType:
            seen.add(id(value))
            functions.append(value)
            stack += [*value.__dict__.values(), *map(_cell_contents, value.__closure__ or ())]
        elif _user_class(value):
            for klass in value.__mro__:
                if _user_class(klass) and id(klass) not in seen:
                    seen.add(id(klass))
                    classes.append(klass)
                    stack += list(vars(klass).values())
    known = _reachable[cls] = (tuple(functions), tuple(classes))
    return known


def _set_class_values(values: Sequence[tuple]) -> None:
    for klass, name, value in values:
        if value is _GONE:
            if name in vars(klass):
                delattr(klass, name)
        else:
            setattr(klass, name, value)


def _keeps_state_outside(cls: type) -> bool:
    """Whether a mode class may keep state outside its instance ``__dict__``: slots, a mutable value
    held by a class of its own (a list shared by its instances, a mixin's), a method with a mutable
    default or a closure over one; so may a class it refers to (a nested one, one in a closure).
    torch's classes are not looked at.  Looked at once per class (a class given a mutable
    attribute after its first use is not seen)."""
    for klass in _reachable_from(cls)[1]:
        if set(vars(klass).get("__slots__", ())) - {"__dict__", "__weakref__"}:
            return True
        for name, value in vars(klass).items():
            if name in _CLASS_BOOKKEEPING or _immutable(value) or _stateless(value):
                continue
            return True
    return False


def _copies(tensors: list, dispatch: bool) -> Optional[tuple]:
    """``((tensor, copy), ...)`` for the tensors that need no gradient; None if they cannot be kept.

    A tensor that needs a gradient is not copied (the recompute must use that
    very tensor), and a dispatch mode may not hold one: an update inside
    ``__torch_dispatch__`` moves no version counter, so it could not be seen.
    Only plain dense tensors are copied (the replay writes the copy back into
    the tensor itself, so the block sees it too, if it reads it), none
    sharing memory with another held one or overlapping itself, within
    ``_MODE_COPY_LIMIT``.
    """
    copies, storages, size = [], set(), 0
    with _user_modes_off():
        for tensor in tensors:
            if requires_grad_anywhere(tensor):
                if dispatch:
                    return None
                continue
            if (
                type(tensor) not in (Tensor, torch.nn.Parameter) or is_functorch_wrapped_tensor(tensor)
                or tensor.layout is not torch.strided or tensor.is_meta
                or any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape))
            ):
                return None
            storage = tensor.untyped_storage().data_ptr()
            size += tensor.numel() * tensor.element_size()
            if storage in storages or size > _MODE_COPY_LIMIT:
                return None
            storages.add(storage)
            copies.append((tensor, tensor.detach().clone()))
    return tuple(copies)


def _same_bits(tensor: Tensor, copy: Tensor) -> bool:
    """Bitwise equal (NaN where NaN), unseen by the user's modes."""
    with _user_modes_off():
        if tensor.shape != copy.shape or tensor.dtype != copy.dtype:
            return False
        if tensor.numel() == 0:
            return True
        return torch.equal(tensor.detach().reshape(-1).view(torch.uint8), copy.reshape(-1).view(torch.uint8))


def _mode_moved(record: ModeRecord) -> bool:
    """Whether a replayable mode's state changed since ``record`` in a way its results can depend on."""
    with _user_modes_off():  # the comparisons (tensor versions, generator states) unseen by the user's modes
        return _mode_state_moved(record)


def _mode_state_moved(record: ModeRecord) -> bool:
    return (
        bool(changed_at_all(record.contents))  # a log it appends to too: the mode may read its length
        or bool(moved_generators(record.generators))
        or any(not _same_bits(tensor, copy) for tensor, copy in record.copies)
        or _class_values_moved(record.class_values, type(record.contents[0][1]))
    )


def modes_to_replay(was: object, now: object, dispatch: bool) -> Optional[tuple]:
    """``(popped, pushed, restated)``: how fallback gives the recompute the forward's user modes; None if it cannot.

    The recompute runs under the forward's modes alone, as the forward did:
    ``popped``, the user modes on top of the stack that are not the
    forward's (one around the backward only, another object of its class),
    taken off for the recompute; ``pushed``, the forward's replayable modes
    then missing, each ``(mode, record)``; ``restated``, its replayable modes
    still on the stack (the same objects), whose state is put back.  None
    when a mode to take off is not on top of the stack (torch's own mode
    above it) or a mode to push was not recorded.
    """
    instances, records = getattr(was, "instances", ()), getattr(was, "records", ())
    others = tuple(getattr(now, "instances", ()))
    if not instances:
        return None
    common = 0
    while common < min(len(instances), len(others)) and others[common] is instances[common]:
        common += 1
    popped = others[common:]
    pushed = list(zip(instances[common:], records[common:]))
    if any(record is None for _, record in pushed):
        return None
    if popped:
        stack = _get_current_dispatch_mode_stack() if dispatch else _get_current_function_mode_stack()
        top = stack[len(stack) - len(popped):]
        if len(top) != len(popped) or any(a is not b for a, b in zip(top, popped)):
            return None  # torch's own mode sits above one to take off: it cannot be popped alone
    restated = [(mode, record) for mode, record in zip(instances[:common], records[:common]) if record is not None]
    if not (popped or pushed or restated):
        return None
    return popped, pushed, restated


def mode_state_kept(replay: tuple) -> bool:
    """Whether the state recorded for a replay's modes can be put back (:func:`_records_kept`)."""
    _, pushed, restated = replay
    return _records_kept([record for _, record in (*pushed, *restated)])


def modes_updated_in_place(modes: Sequence[object]) -> bool:
    """Whether a marked mode of these stacks updated a tensor it holds where autograd sees it, or
    resized one, since the call: no forward can run again from the call's state then."""
    records = [record for stack in modes for record in getattr(stack, "records", ()) if record is not None]
    return not _records_kept(records)


def _records_kept(records: Sequence[ModeRecord]) -> bool:
    """Whether these records can be put back: no held tensor updated in place where autograd sees
    it since the call (:func:`_held_tensors_updated`), none resized or re-typed in place."""
    return not _held_tensors_updated(records) and all(
        tensor.shape == copy.shape and tensor.dtype == copy.dtype and tensor.stride() == copy.stride()
        for record in records for tensor, copy in record.copies
    )  # a held tensor resized or re-typed in place: its old value cannot be written back into it


def _held_tensors_updated(records: Sequence[ModeRecord]) -> bool:
    """Any tensor a mode holds updated in place where autograd sees it (its version moved) since the call.

    One that needs a gradient: the recompute must use that very tensor.  One
    that needs none: without checkpointing, a backward through an operation
    that saved it would raise ("modified by an inplace operation"); the
    replay's quiet write-back would hide that and use the new value.  (An
    update inside ``__torch_dispatch__`` moves no version, and is replayed.)
    """
    return any(
        kind == "tensor" and _version_of(value) != version
        for record in records for _, value, kind, version in record.contents
    )


def describe_mode_change(was: object, now: object) -> str:
    """CKG102/103's change line: the modes missing or added, or the replayable mode whose state moved."""
    parts = [f"{describe_modes(was)} → {describe_modes(now)}"] if tuple.__ne__(was, now) else []  # type: ignore[arg-type]
    others = getattr(now, "instances", ())
    for i, (mode, record) in enumerate(zip(getattr(was, "instances", ()), getattr(was, "records", ()))):
        if record is None:
            continue
        name = type(mode).__name__
        if i < len(others) and others[i] is not mode:
            parts.append(f"another {name} object than the forward's is active at the recompute")
        elif _mode_moved(record):
            what = [_describe_state_change(record.contents)] if changed_at_all(record.contents) else []
            what += ["a tensor it holds changed"] if any(not _same_bits(t, c) for t, c in record.copies) else []
            what += ["its generator moved on"] if moved_generators(record.generators) else []
            what += [
                f"{owner.__qualname__}.{name} changed" for owner, name, value in record.class_values
                if not _same_value(vars(owner).get(name, _GONE), value)
            ] or (["a value its class or a method holds came or went"] if _class_values_moved(
                record.class_values, type(mode)) else [])
            parts.append(f"the {name} mode's state moved on since the forward: " + "; ".join(what))
    return "; ".join(parts) or "the user modes changed"


def _describe_state_change(contents: tuple) -> str:
    """``Scaler.calls changed; Scaler.log: 2 items → 3 items``: what moved in a mode's recorded state."""
    parts = []
    for path, value, kind, recorded in changed_at_all(contents):
        if kind == "tensor":
            parts.append(f"{path} updated in place")
        elif kind == "object":
            before, after = dict(recorded), dict(_full(value, kind))
            names = [k for k in {**before, **after} if not _same_value(after.get(k, _GONE), before.get(k, _GONE))]
            parts.append(", ".join(f"{path}.{name}" for name in names) + " changed")
        else:
            parts.append(f"{path}: {_count(len(recorded))} → {_count(len(_full(value, kind)))}")
    return "; ".join(parts)


def only_state_moved(was: object, now: object) -> bool:
    """The recompute runs under the forward's very mode objects; only a replayable one's state moved."""
    others = getattr(now, "instances", ())
    instances = getattr(was, "instances", ())
    return len(others) == len(instances) and all(a is b for a, b in zip(others, instances))


def _write_quietly(pairs: Sequence[tuple]) -> None:
    """Each ``(tensor, value)``: the tensor's values set to ``value``'s as a dispatch mode's own update
    sets them: no version counter moves (a saved tensor stays valid), unseen by the user's modes."""
    if not pairs:
        return
    with _user_modes_off(), torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        for tensor, value in pairs:
            tensor.copy_(value)


@contextlib.contextmanager
def _tensor_values(copies: Sequence[tuple]) -> Iterator[None]:
    """Each ``(tensor, value)``: the tensor holds that value while the block runs, its own value after."""
    with _user_modes_off():
        now = [(tensor, tensor.detach().clone()) for tensor, _ in copies]
    try:
        _write_quietly(copies)
        yield
    finally:
        _write_quietly(now)


@contextlib.contextmanager
def _class_values_replayed(records: list) -> Iterator[None]:
    """The plain values the modes' classes held at the call while the block runs; today's after."""
    now = {cls: _class_values(cls) for cls in {type(mode) for mode, _ in records}}
    try:
        for mode, record in records:
            _put_class_values(type(mode), record.class_values)
        yield
    finally:
        for cls, values in now.items():
            _put_class_values(cls, values)


def _put_class_values(cls: type, values: Sequence[tuple]) -> None:
    """The mode's classes' plain values as ``values`` has them: set, and those that came since removed."""
    kept = {(klass, name) for klass, name, _ in values}
    for klass, name, _ in _class_values(cls):
        if (klass, name) not in kept:
            delattr(klass, name)
    _set_class_values(values)


def put_back_modes(modes: Sequence[object]) -> None:
    """Each replayable mode of these stacks back to its state at the call (a forward that must run again)."""
    for stack in modes:
        for record in getattr(stack, "records", ()):
            if record is None:
                continue
            restore_contents(changed_at_all(record.contents))
            for _, generator, state in record.generators:
                generator.set_state(state)
            _write_quietly(record.copies)
        for mode, record in zip(getattr(stack, "instances", ()), getattr(stack, "records", ())):
            if record is not None:
                _put_class_values(type(mode), record.class_values)


def _read_top_hooks() -> Optional[Callable[[], Any]]:
    """A reader of the innermost saved-tensor hooks (torch >= 2.8), or None (torch 2.4-2.7 has none)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        top(True)
        return lambda: top(True)
    except TypeError:  # an early form took no argument
        return lambda: top()


_top_hooks = _read_top_hooks()

#: whether fallback can re-enter a replayable mode for a non-reentrant recompute: that recompute
#: runs torch's pack hook (``x.detach()``) for each saved tensor, which the mode must not see (the
#: forward's pack hook runs no operation); hiding it needs the hook, read off the hook stack
QUIET_RECOMPUTE_HOOKS = _top_hooks is not None


@contextlib.contextmanager
def _recompute_hooks_unseen(dispatch: bool) -> Iterator[None]:
    """Run torch's recompute pack and unpack hooks with the user's modes off (see QUIET_RECOMPUTE_HOOKS)."""
    top = _top_hooks() if _top_hooks is not None else None
    if top is None:
        yield
        return
    pack, unpack = top
    if dispatch:
        from torch.utils._python_dispatch import _disable_current_modes as modes_off
    else:
        modes_off = torch._C.DisableTorchFunction

    def quiet_pack(x: Tensor) -> Any:
        with modes_off():
            return pack(x)

    def quiet_unpack(x: Any) -> Any:
        with modes_off():
            return unpack(x)

    with torch.autograd.graph.saved_tensors_hooks(quiet_pack, quiet_unpack):
        yield


@contextlib.contextmanager
def replaying_modes(replay: tuple, dispatch: bool, inside_hooks: bool = False) -> Iterator[None]:
    """The forward's modes for the recompute: the others taken off the top of the stack, the missing
    ones pushed back (innermost last), each one's state as the call found it; all as before, after.

    A tensor the mode holds that needs no gradient holds its value at the
    call again (written in place, as the mode's own update writes it: the
    block sees it too where it reads that tensor), and its current value
    after.  Pushed by the base class's ``__enter__``:
    the mode's own ``__enter__`` and ``__exit__`` (a report printed at exit,
    a counter reset) run once, as without checkpointing.  ``inside_hooks``: a
    non-reentrant recompute, whose saved-tensor hooks the modes must not see.
    """
    popped, pushed, restated = replay
    records = [record for _, record in (*pushed, *restated)]
    contents = [entry for record in records for entry in record.contents if entry[2] != "tensor"]
    generators = [(g, state) for record in records for _, g, state in record.generators]
    copies = [pair for record in records for pair in record.copies]
    base = TorchDispatchMode if dispatch else TorchFunctionMode
    if dispatch:
        from torch.utils._python_dispatch import _pop_mode_temporarily
    else:
        from torch.overrides import _pop_mode_temporarily  # type: ignore[no-redef]
    with contextlib.ExitStack() as stack:
        for _ in popped:
            stack.enter_context(_pop_mode_temporarily())
        stack.enter_context(replaying_contents(contents))
        stack.enter_context(replaying_generators(generators))
        stack.enter_context(_tensor_values(copies))
        stack.enter_context(_class_values_replayed([*pushed, *restated]))
        for mode, _ in pushed:
            base.__enter__(mode)
            stack.callback(base.__exit__, mode, None, None, None)
        if inside_hooks:
            stack.enter_context(_recompute_hooks_unseen(dispatch))
        yield


# --------------------------------------------------------------------------
# train / eval mode of the checkpointed module

_MethodType = type(Module().train)


def module_training(function: object) -> Optional[tuple]:
    """CKG106's part of :func:`block_snapshot`: each of the checkpointed module's modules' ``training``.

    Every submodule's, so that fallback can recompute each in the mode it had
    (a frozen BatchNorm in eval inside a training model).  ``None`` for other
    functions: a closure's modules are not looked for on every call.
    """
    return block_snapshot(function)[2]


module_training.part_of = (block_snapshot, 2)  # type: ignore[attr-defined]
module_training.takes_function = True  # type: ignore[attr-defined]

# module class -> does its code depend on train/eval mode?  Weak, as above.
_mode_dependent_classes: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _class_depends_on_mode(cls: type) -> bool:
    """Whether a module class behaves differently in train and eval mode.

    Read from its code: a ``forward`` that mentions ``training`` (dropout,
    batch norm, RNNs with dropout, attention with dropout, and the user's own
    layers alike), or a ``train()`` of its own.  A class whose source cannot
    be read counts as dependent.
    """
    known = _mode_dependent_classes.get(cls)
    if known is None:
        if getattr(cls, "train", Module.train) is not Module.train:
            known = True
        else:
            try:
                known = "training" in inspect.getsource(cls.forward)
            except (OSError, TypeError, AttributeError):
                known = True
        _mode_dependent_classes[cls] = known
    return known


def _training_relevant(function: object, was: object, now: object) -> bool:
    """A train/eval switch matters only to a module some part of which behaves differently."""
    module = function if isinstance(function, Module) else getattr(function, "__self__", None)
    if not isinstance(module, Module):
        return True
    return any(_class_depends_on_mode(type(m)) for m in module.modules())


module_training.relevant = _training_relevant  # type: ignore[attr-defined]


def describe_training(training: Optional[tuple]) -> str:
    if training is None:
        return "not a module"
    if all(training):
        return "train mode"
    if not any(training):
        return "eval mode"
    return f"mixed ({sum(training)} of {len(training)} modules in train mode)"


def retrained(was: tuple, function: object) -> list:
    """``[(module, forward flag)]`` for each module whose train/eval mode differs now from ``was``."""
    block = _block_module(function)
    modules = _structure(block).modules(block)
    if len(modules) != len(was):
        return []
    return [(m, flag) for m, flag in zip(modules, was) if m.training != flag]


# --------------------------------------------------------------------------
# inputs and parameters


def requires_grad_anywhere(t: Tensor) -> bool:
    """``requires_grad`` seen through functorch wrappers (a vmapped tensor says False)."""
    while True:
        if t.requires_grad:
            return True
        if not is_functorch_wrapped_tensor(t):
            return False
        t = get_unwrapped(t)


def _is_dual(t: Tensor) -> bool:
    return forward_ad.unpack_dual(t).tangent is not None


@dataclass(frozen=True)
class CallState:
    """What the call-time rules look at.  Built only for non-quiet calls."""

    reentrant: bool
    transforms: tuple[tuple[str, int], ...]
    grad_enabled: bool
    forward_ad_active: bool
    # both only looked at outside torch.func transforms (CKG002 / CKG007 decide there)
    dual_args: bool  # a dual tensor among the tensor inputs (CKG004, CKG007)
    dual_held: bool  # ... among the tensors the function reads besides them (CKG008)
    saved_tensor_hooks_enabled: bool
    inputs_require_grad: bool
    params_require_grad: bool
    #: the block holds an nn.RReLU in training mode, and early stop is on (CKG009)
    rrelu_training: bool = False

    @property
    def transform_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.transforms)


def rrelu_training(function: object, early_stop: bool = True) -> bool:
    """CKG009: a module the call runs holds an nn.RReLU in training mode, with early stop on.

    Only where the module is plain to see (the module, its bound method, a
    partial of either): this runs on every non-reentrant call, so it reads
    the block's cached structure (the RReLU modules found once).
    """
    function = _block_module(function)
    if not isinstance(function, Module):
        return False
    rrelus = _structure(function).rrelus
    if not rrelus or not early_stop or _checkpoint.get("_enable_checkpoint_early_stop", True) is False:
        return False
    for ref in rrelus:
        m = ref()
        if m is not None and m.training:
            return True
    return False


def read_call_state(reentrant: bool, function: object, args: tuple, early_stop: bool = True) -> CallState:
    tensors = [a for a in args if isinstance(a, Tensor)]
    params = list(_reads.trainable_tensors(function))
    transforms = transform_stack()
    forward_ad_active = forward_ad._current_level >= 0
    # unpack_dual has no batching rule: never ask a functorch-wrapped tensor
    look_for_duals = forward_ad_active and not transforms
    dual_args = look_for_duals and any(_is_dual(t) for t in tensors)
    return CallState(
        reentrant=reentrant,
        transforms=transforms,
        grad_enabled=is_grad_enabled(),
        forward_ad_active=forward_ad_active,
        dual_args=dual_args,
        dual_held=look_for_duals and any(_is_dual(t) for t in _reads.held_tensors(function)),
        saved_tensor_hooks_enabled=saved_tensor_hooks_enabled(),
        inputs_require_grad=any(requires_grad_anywhere(t) for t in tensors),
        params_require_grad=any(requires_grad_anywhere(p) for p in params),
        rrelu_training=not reentrant and rrelu_training(function, early_stop),
    )


def forward_device_context() -> Optional[torch.device]:
    """The device of the innermost ``torch.device(...)`` / ``set_default_device`` context, or None."""
    if not _len_function_stack():
        return None
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


def accelerator_default_device() -> Optional[torch.device]:
    """Where factory calls without a device go, if a device context sends them off the CPU."""
    device = forward_device_context()
    return None if device is None or device.type == "cpu" else device


class FactoryWatch(TorchFunctionMode):
    """Records in ``made[0]`` whether a tensor (not a 0-dim one) was made without ``device=`` (CKG109).

    Pushed over the reentrant forward only when a GPU default device is active:
    every torch call of that forward passes through it, which costs time there
    and nowhere else.
    """

    def __init__(self, made: list) -> None:
        super().__init__()
        self.made = made
        self.constructors = _device_constructors()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        # a 0-dim CPU tensor mixes with GPU tensors (torch.tensor(0.5) as a factor): not a problem;
        # nor is the empty dummy a nested checkpoint makes (torch < 2.12)
        if (
            func in self.constructors and kwargs.get("device") is None and isinstance(result, Tensor)
            and result.dim() and sys._getframe(1).f_globals.get("__name__") != "torch.utils.checkpoint"
        ):
            self.made[0] = True
        return result


def call_is_quiet(reentrant: bool, inputs: tuple, grad_enabled: bool) -> bool:
    """True when no call-time rule can fire: the fast path of every call.

    A rule that reads new state must make this return False when that state is
    unusual.  Only builtin queries here; the non-reentrant variant never looks
    at the inputs.
    """
    if peek_interpreter_stack() is not None or forward_ad._current_level >= 0:
        return False
    if not reentrant:
        return not grad_enabled or saved_tensor_hooks_enabled()
    if grad_enabled:
        for a in inputs:
            if isinstance(a, Tensor) and a.requires_grad:
                return True
        return False  # CKG006 needs a look at the parameters
    return True


def tensor_versions(function: object, inputs: tuple) -> tuple:
    """``((tensor, version), ...)`` for each tensor the block can update in place, as far as can be seen: its modules'
    parameters and buffers (whatever the path to them), the tensors it holds, its tensor inputs."""
    reads = _reads.reads_of(function).complete()
    tensors = [t for m in (*reads.whole, *reads.partial) for t in (*m.parameters(), *m.buffers())]
    tensors += [*reads.tensors, *(t for t in inputs if isinstance(t, Tensor))]
    return tuple((t, _version_of(t)) for t in tensors)


def updated_in_place(versions: tuple) -> bool:
    """Whether a tensor of :func:`tensor_versions` was updated in place since."""
    return any(_version_of(t) != version for t, version in versions)


def rng_states() -> tuple:
    """The CPU generator's state, and each CUDA device's once CUDA is in use (CKG107 compares them).

    Reading a CUDA generator's state reads its seed and offset on the host: no
    synchronisation.  Not while a CUDA graph is being captured (torch's own
    ``preserve_rng_state=False`` path reads nothing there either), and other
    accelerators' generators are not read.
    """
    cpu = torch.get_rng_state()
    if not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
        return (cpu,)
    return (cpu, *torch.cuda.get_rng_state_all())


def drew_random(before: tuple) -> bool:
    """Whether any generator read by :func:`rng_states` moved since ``before``."""
    now = rng_states()
    return len(now) != len(before) or not all(torch.equal(was, is_) for was, is_ in zip(before, now))


def clear_caches() -> None:
    """Forget what was learnt about classes (``uninstall()``: the guard holds nothing)."""
    _infrastructure_classes.clear()
    _block_structure.clear()
    _snapshots.clear()
    _mode_dependent_classes.clear()
    _reads.clear_caches()
