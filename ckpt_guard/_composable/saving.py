"""Selective checkpointing under torch.func: what a save policy keeps, handed back to each recompute.

torch's selective checkpointing (``context_fn=functools.partial(
create_selective_checkpoint_contexts, policy)``) decides per operation whether
the forward keeps its output (``MUST_SAVE`` / ``PREFER_SAVE``) or the backward
computes it again.  torch implements it with two dispatch modes sharing a
store, keyed by operation and call count, that line up only with torch's own
recompute.  The composable recompute runs the block again inside a ``vjp``,
and once more at each higher order; this room gives it the same choice:

* **Recording.**  The first forward (the plain run, at the caller's levels)
  runs under :class:`_Recording`, a dispatch mode: it sees each operation as
  it reaches the bottom of the dispatcher (under ``grad`` and ``vmap``, the
  primal operation on plain or physically batched tensors: measured), asks
  the policy, and keeps the outputs of those it saves, with what the
  operation was given (shapes, strides, dtypes; the numbers).
* **Handing back.**  Each recompute of the block (every order: a recompute
  of a recompute runs the block's operations again, in the same order) runs
  under :class:`_HandingBack`: the n-th call of an operation whose n-th
  forward call was saved gets the saved outputs instead of running, after
  checking it was given the same shapes, strides, dtypes and numbers; the
  levels above it (the recompute's grad level, a vmap) still record the
  operation, so its gradient is the operation's own.  Nothing is consumed: the
  next order gets them again.

What is never kept, whatever the policy says: an operation that returns a
view or writes into its arguments (handing back a copy would break the
aliasing the levels above rely on), one that draws random numbers (the
recompute replays the forward's RNG from the block's start: skipping a draw
would move every later draw), and the operations torch's own selective
checkpointing ignores (``detach``, metadata queries).

Where the two cannot line up, nothing is handed back:

* a ``jvp`` level alive (``jvp(grad)``, ``hessian``'s ``jacfwd``): forward-mode
  AD computes tangents with operations that reach the same dispatch mode as
  the primal ones (measured: ``jvp`` of ``tanh(x @ W)`` sends three ``mm`` down
  where the primal sends one), so a store keyed by call count would hand a
  tangent the primal's output; the policy is not applied and every operation
  is recomputed, as before;
* a recompute under a vmap level the forward did not run under (the
  Function's own vmap rule, which batches the recompute differently);
* an operation whose call does not match what the forward recorded (the block
  took another path): from there on, the rest of that run and every later
  recompute of the block compute everything.

Each of those still returns the uncheckpointed code's numbers: only memory
or time is lost.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.utils.checkpoint as _tuc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from . import counters

Tensor = torch.Tensor

#: torch 2.5+: policies return a CheckpointPolicy and take a SelectiveCheckpointContext
_POLICY = getattr(_tuc, "CheckpointPolicy", None)
_CONTEXT = getattr(_tuc, "SelectiveCheckpointContext", None)
_SAVE = () if _POLICY is None else (_POLICY.MUST_SAVE, _POLICY.PREFER_SAVE)
_RECOMPUTE = () if _POLICY is None else (_POLICY.MUST_RECOMPUTE, _POLICY.PREFER_RECOMPUTE)
#: offloading to the CPU (newer torches): kept, as saving (on the device it was made on)
_OFFLOAD = () if _POLICY is None else tuple(
    getattr(_POLICY, name) for name in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD") if hasattr(_POLICY, name)
)

#: the operations torch's selective checkpointing never caches (its recompute runs them a different
#: number of times); ``prim.device`` and the functional tensors' metadata queries among them
_IGNORED = frozenset(
    getattr(_tuc, "SAC_IGNORED_OPS", None) or getattr(_tuc, "_ignored_ops", None)
    or {torch.ops.aten.detach.default}
)
_NONDETERMINISTIC = torch.Tag.nondeterministic_seeded
_INPLACE_VIEW = torch.Tag.inplace_view


_keepable_cache: Dict[Any, bool] = {}


def _keepable(func: Any) -> bool:
    """An operation whose outputs may be handed back: new tensors, nothing written, no random draw."""
    known = _keepable_cache.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = (
            isinstance(func, torch._ops.OpOverload) and schema is not None and not schema.is_mutable
            and all(r.alias_info is None for r in schema.returns) and _NONDETERMINISTIC not in func.tags
            and func not in _IGNORED
        )
        _keepable_cache[func] = known
    return known


_PLAIN = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _describe(value: Any) -> Any:
    if isinstance(value, Tensor):
        return (value.shape, value.stride(), value.dtype, value.device)
    if value is None or isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):  # an operation's arguments hold lists one level deep (sizes, tensors)
        return tuple(_describe(v) for v in value)
    return type(value)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What an operation was given, as far as handing back its outputs depends on it (runs per operation:
    no pytree)."""
    described = [_describe(a) for a in args]
    if kwargs:
        described += [(name, _describe(v)) for name, v in kwargs.items()]
    return tuple(described)


def _address(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage of its own (a wrapper subclass): its id
        return id(t)


_written_cache: Dict[Any, tuple] = {}


def _written_arguments(func: Any) -> tuple:
    """The positions of the arguments ``func`` writes into the memory of (an in-place view op,
    ``squeeze_`` under vmap, changes a view's shape, not the memory: none)."""
    known = _written_cache.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = () if schema is None or not schema.is_mutable or _INPLACE_VIEW in func.tags else tuple(
            i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _written_cache[func] = known
    return known


def _arguments_of(func: Any, args: tuple, kwargs: dict) -> list:
    """The values of ``func``'s schema arguments, positional then by name."""
    names = [a.name for a in func._schema.arguments]
    values = list(args) + [None] * (len(names) - len(args))
    for i, name in enumerate(names[len(args):], start=len(args)):
        values[i] = kwargs.get(name)
    return values


class PolicyError(TypeError):
    """A save policy returned something that is not a ``CheckpointPolicy`` (nor a bool)."""


class Saved:
    """What a save policy kept of one block's first forward (see the module docstring)."""

    __slots__ = ("policy", "calls", "usable", "by_storage")

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy
        #: operation -> for each of its calls in the forward, in order: None (recomputed) or
        #: (what it was given, its outputs, its output tensors, their versions)
        self.calls: Dict[Any, List[Optional[tuple]]] = collections.defaultdict(list)
        #: False once a recompute found the block running other operations: all is recomputed then
        self.usable = True
        #: storage address -> (operation, call index) of the saved outputs living there
        self.by_storage: Dict[int, List[tuple]] = collections.defaultdict(list)

    def keep(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple:
        """The entry for a saved call: what it was given, its outputs (the objects the operation made:
        their version counters move when anything writes into them) and their versions."""
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        index = len(self.calls[func])
        for t in outputs:
            self.by_storage[_address(t)].append((func, index))
        return (_signature(args, kwargs), out, outputs, [t._version for t in outputs])

    def spoil_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An operation that writes into its arguments: a saved output it writes into is no longer
        what the operation that made it returned; that call is computed again from now on."""
        if not self.by_storage:
            return
        written = _written_arguments(func)
        if not written:
            return
        values = _arguments_of(func, args, kwargs)
        for position in written:
            value = values[position]
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, Tensor):
                    for op, index in self.by_storage.pop(_address(t), ()):
                        self.calls[op][index] = None

    def decide(self, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        """Whether the policy saves this call of ``func`` (asked in the forward only, as torch does)."""
        if _POLICY is None:  # torch 2.4's private form: policy_fn("forward", op, ...) -> bool
            return bool(self.policy("forward", func, *args, **kwargs))
        try:
            context = _CONTEXT(is_recompute=False, op_output=out)
        except TypeError:  # before op_output
            context = _CONTEXT(is_recompute=False)
        decision = self.policy(context, func, *args, **kwargs)
        if isinstance(decision, bool):
            return decision
        if decision in _SAVE or decision in _OFFLOAD:
            return True
        if decision in _RECOMPUTE:
            return False
        choices = ", ".join(f"CheckpointPolicy.{p.name}" for p in _POLICY)
        raise PolicyError(
            f"the save policy {getattr(self.policy, '__qualname__', self.policy)!r} returned {decision!r} "
            f"for {func}: a policy returns one of {choices} (or a bool)"
        )

    def recording(self) -> "_Recording":
        return _Recording(self)

    def handing_back(self) -> "_HandingBack":
        return _HandingBack(self)


class _Recording(TorchDispatchMode):
    """The first forward: each operation run, the policy asked, the saved outputs kept."""

    def __init__(self, saved: Saved) -> None:
        super().__init__()
        self.saved = saved

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _IGNORED:
            return out
        saved = self.saved
        saved.spoil_written(func, args, kwargs)
        entry = None
        # asked about every operation, as torch asks (a policy may count them); kept where it can be
        if saved.decide(func, args, kwargs, out) and _keepable(func):
            entry = saved.keep(func, args, kwargs, out)
            counters.SAVED_BY_POLICY += 1
        saved.calls[func].append(entry)
        return out


class _HandingBack(TorchDispatchMode):
    """A recompute: the n-th call of an operation gets what its n-th forward call saved."""

    def __init__(self, saved: Saved) -> None:
        super().__init__()
        self.saved = saved
        self.counts: Dict[Any, int] = collections.defaultdict(int)
        self.lined_up = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        self.saved.spoil_written(func, args, kwargs)  # a write into what was handed back
        if not self.lined_up or func in _IGNORED:
            return func(*args, **kwargs)
        index = self.counts[func]
        self.counts[func] = index + 1
        calls = self.saved.calls.get(func)
        if calls is None or index >= len(calls):
            return self._not_lined_up(func, args, kwargs)
        entry = calls[index]
        if entry is None:
            counters.RECOMPUTED_UNDER_POLICY[func] += 1
            return func(*args, **kwargs)
        given, kept, outputs, versions = entry
        if _signature(args, kwargs) != given:
            return self._not_lined_up(func, args, kwargs)
        if [t._version for t in outputs] != versions:
            # written into since (after the block, through the tensor it returned): computed again
            calls[index] = None
            return func(*args, **kwargs)
        counters.HANDED_BACK += 1
        # a new tensor on the same memory: the levels above record this call as the operation's own
        return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, kept)

    def _not_lined_up(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # the block runs other operations than its forward did: compute everything from here on,
        # and in every later recompute (what was handed back so far matched call by call)
        self.lined_up = False
        self.saved.usable = False
        return func(*args, **kwargs)
