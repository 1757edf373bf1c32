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

Under forward mode (``jvp(grad)``, ``hessian``'s ``jacfwd``) forward-mode AD
computes tangents with operations that reach the same dispatch mode as the
primal ones (measured: ``jvp`` of ``tanh(x @ W)`` sends three ``mm`` down where
the primal sends one), and a tangent's ``mm`` has the primal's shapes.  So
where a forward-mode level is alive at the first forward, each saved call
also keeps a **fingerprint** of what it was given: three float64 numbers per
tensor (its sum, the sum of its even positions, its norm); a recompute's call gets the
saved outputs only if its arguments have the same fingerprint.  An operation
is a function of its arguments (random ones are never kept), so equal
arguments mean the saved outputs are its outputs, whichever primal or tangent
call this is; where they differ, nothing more is handed back.

A backward outside the forward's vmap (MAML's outer ``.backward()``) recomputes
under the Function's own vmap rule, which batches the block anew: a forward
under vmap whose inputs require grad in eager autograd keeps fingerprints too,
and that recompute is handed back what matches them.

Where the two cannot line up, nothing is handed back:

* a recompute under forward mode or under a vmap level the forward did not run
  under, of a block whose forward kept no fingerprints;
* an operation whose call does not match what the forward recorded (the block
  took another path): from there on, the rest of that run and every later
  recompute of the block compute everything.

Each of those still returns the uncheckpointed code's numbers: only memory
or time is lost.

**Names** (``ckpt_guard.checkpoint_name(t, "attn_out")`` and
``checkpoint_policies.save_only_these_names``, JAX's ``checkpoint_name``): a
name is given after the operation that made the value ran, so the recording
remembers, for each keepable call, where its output lives; naming a value
marks the call that made the memory it lives in as saved (a view of an
operation's output saves that operation's output; a value made by adding a
bias to a matrix product, as a ``Linear`` is run under vmap, saves the product,
not the ``add``).  Until the block's forward
ends, the recording holds each keepable call's arguments for that (a named
call is kept with what it was given); a name the policy lists that the block
never gives warns, naming it.

**Offloading** (``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``):
the saved outputs of a call on an accelerator are kept as CPU copies and moved
back to their device when handed back; on the CPU it is saving.
"""

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.utils.checkpoint as _tuc
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from . import counters, residuals
from .basics import _base, _storage_start
from .replay import _forward_mode_alive, _vmap_levels

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


class _Op:
    """What the modes need to know of one operation, read once from its schema (the one cache of it).

    The modes run per operation, and an ``OpOverload``'s ``__hash__`` is a Python method
    (measured: five hashes per operation and mode were a fifth of the modes' own time), so
    they look an operation up once, by ``id`` (:func:`_op`), and key their per-operation
    tables by it.
    """

    __slots__ = ("func", "key", "ignored", "keepable", "written", "computes")

    def __init__(self, func: Any) -> None:
        self.func, self.key = func, id(func)  # held: its id is not reused while it is cached here
        self.ignored = func in _IGNORED
        self.keepable = _keepable(func)
        self.written = _written_arguments(func)
        self.computes = _computes(func, self.keepable)


_ops: Dict[int, _Op] = {}


def _op(func: Any) -> _Op:
    op = _ops.get(id(func))
    if op is None or op.func is not func:
        op = _ops[id(func)] = _Op(func)
    return op


def _keepable(func: Any) -> bool:
    """An operation whose outputs may be handed back: new tensors, nothing written, no random draw."""
    schema = getattr(func, "_schema", None)
    return (
        isinstance(func, torch._ops.OpOverload) and schema is not None and not schema.is_mutable
        and all(r.alias_info is None for r in schema.returns) and _NONDETERMINISTIC not in func.tags
        and func not in _IGNORED
    )


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
        return _storage_start(t)
    except Exception:  # noqa: BLE001 - a tensor without storage of its own (a wrapper subclass): its id
        return id(t)


def _written_arguments(func: Any) -> tuple:
    """The positions of the arguments ``func`` writes into the memory of (an in-place view op,
    ``squeeze_`` under vmap, changes a view's shape, not the memory: none)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable or _INPLACE_VIEW in func.tags:
        return ()
    return tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _arguments_of(func: Any, args: tuple, kwargs: dict) -> list:
    """The values of ``func``'s schema arguments, positional then by name."""
    names = [a.name for a in func._schema.arguments]
    values = list(args) + [None] * (len(names) - len(args))
    for i, name in enumerate(names[len(args):], start=len(args)):
        values[i] = kwargs.get(name)
    return values


def _fingerprint(args: tuple, kwargs: dict) -> tuple:
    """Three float64 numbers per tensor argument: its sum, the sum of its even positions, its norm
    (the forward-mode check, see the module docstring).  Reductions that read the tensor once,
    accumulating in float64 without a copy; computed below every transform level, unseen by the
    dispatch modes below this one (a FLOP counter, a user's mode)."""
    prints = []
    with _disable_current_modes(), torch._C._DisableFuncTorch(), torch.no_grad():
        for value in (*args, *kwargs.values()):
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if not isinstance(t, Tensor):
                    continue
                if t._is_zerotensor() or t.device.type == "meta":  # forward mode's zero tangents: no data
                    prints.append(t.device.type == "meta" or "zero")
                    continue
                if t.is_complex():
                    t = torch.view_as_real(t)
                elif not t.is_floating_point():
                    t = t.to(_F64)
                flat = t.reshape(-1)
                prints.append(torch.stack((
                    flat.sum(dtype=_F64), flat[::2].sum(dtype=_F64), torch.linalg.vector_norm(flat, dtype=_F64),
                )))
    return tuple(prints)


_F64 = torch.float64


def _computes(func: Any, keepable: bool) -> bool:
    """An operation that computes new tensors (the report lists it; views, in-place ops and metadata
    queries such as ``is_same_size`` are only counted).  ``keepable``: :func:`_keepable`'s answer."""
    schema = getattr(func, "_schema", None)
    return (keepable or _NONDETERMINISTIC in getattr(func, "tags", ())) and schema is not None and any(
        str(r.type).startswith("Tensor") for r in schema.returns
    )


_ADD = torch.ops.aten.add.Tensor
#: matrix products (a naming policy keeps one of these instead of the bias ``add`` after it)
_DOTS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.bmm.default})


def _alive(ref: Any) -> Optional[Tensor]:
    """What a weak reference to a tensor made below the dispatcher holds (None: gone)."""
    out = ref()
    if out is not None and hasattr(out, "_fix_weakref"):
        out._fix_weakref()  # torch 2.4: reached through a weak reference, its ownership is fixed here
    return out


def _same_prints(given: tuple, kept: tuple) -> bool:
    with _disable_current_modes():
        return len(given) == len(kept) and all(
            type(a) is type(b) and (torch.equal(a, b) if isinstance(a, Tensor) else a == b)
            for a, b in zip(given, kept)
        )


#: what a policy decided for one call (asked in the forward only, as torch asks)
RECOMPUTE, SAVE, OFFLOAD = 0, 1, 2


class PolicyError(ValueError):
    """A save policy returned something that is not a ``CheckpointPolicy`` (nor a bool).

    Not a ``TypeError``: torch turns a ``TypeError`` raised under ``a @ b`` or ``a + b``
    into ``NotImplemented``, and Python then reports an unsupported operand instead."""


class Saved:
    """What a save policy kept of one block's first forward (see the module docstring)."""

    __slots__ = (
        "policy", "calls", "usable", "by_storage", "fingerprinted", "names", "made", "named", "report",
    )

    def __init__(self, policy: Callable[..., Any], fingerprinted: bool = False) -> None:
        self.policy = policy
        #: operation (its ``id``: see :class:`_Op`) -> for each of its calls in the forward, in order:
        #: None (recomputed) or (what it was given, its outputs, its output tensors, their versions,
        #: fingerprint, device)
        self.calls: Dict[int, List[Optional[tuple]]] = collections.defaultdict(list)
        #: False once a recompute found the block running other operations: all is recomputed then
        self.usable = True
        #: storage address -> (operation, call index) of the saved outputs living there
        self.by_storage: Dict[int, List[tuple]] = collections.defaultdict(list)
        #: a forward-mode level was alive in the first forward: each saved call keeps its arguments'
        #: fingerprint, and a recompute under forward mode is handed back only what matches it
        self.fingerprinted = fingerprinted
        #: a naming policy's names (``save_only_these_names``), else None
        self.names: Optional[frozenset] = getattr(policy, "saved_names", None)
        #: names only: storage address -> (operation, call index, its output, given, fingerprint)
        #: for each keepable call of the forward, the latest to make that memory (a weak reference)
        self.made: Dict[int, tuple] = {}
        #: the names checkpoint_name gave in the forward
        self.named: set = set()
        #: ``ckpt_guard.saved_residuals`` collecting: this block's entry of the report (set by the plan)
        self.report: Any = None

    def keep(self, func: Any, index: int, args: tuple, kwargs: dict, out: Any, offload: bool = False) -> tuple:
        """The entry for a saved call: what it was given, its outputs (the objects the operation made:
        their version counters move when anything writes into them) and their versions; offloaded
        outputs on an accelerator are kept as CPU copies instead (nothing can write into those)."""
        outputs = [out] if isinstance(out, Tensor) else [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        prints = _fingerprint(args, kwargs) if self.fingerprinted else ()
        if self.report is not None:
            self.report.saved(func, index, outputs, offload)
        given = _signature(args, kwargs)
        if offload and any(t.device.type != "cpu" for t in outputs):
            device = outputs[0].device
            return (given, tree_map(lambda t: t.to("cpu") if isinstance(t, Tensor) else t, out), [], [], prints, device)
        for t in outputs:
            self.by_storage[_address(t)].append((func, index))
        return (given, out, outputs, [t._version for t in outputs], prints, None)

    def spoil_written(self, func: Any, args: tuple, kwargs: dict, written: tuple) -> None:
        """An operation that writes into its arguments (``written``: their positions, see
        :func:`_written_arguments`): a saved output it writes into is no longer what the operation
        that made it returned; that call is computed again from now on."""
        if not self.by_storage:
            return
        values = _arguments_of(func, args, kwargs)
        for position in written:
            value = values[position]
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, Tensor):
                    for op, index in self.by_storage.pop(_address(t), ()):
                        self.calls[id(op)][index] = None
                        if self.report is not None:
                            self.report.dropped(op, index, f"{func} wrote into it in the block, after it was made")

    def decide(self, func: Any, args: tuple, kwargs: dict, out: Any) -> int:
        """What the policy does with this call of ``func``: RECOMPUTE, SAVE or OFFLOAD."""
        if self.names is not None:  # a naming policy: nothing is saved but what checkpoint_name names
            return RECOMPUTE
        if _POLICY is None:  # torch 2.4's private form: policy_fn("forward", op, ...) -> bool
            return SAVE if self.policy("forward", func, *args, **kwargs) else RECOMPUTE
        try:
            context = _CONTEXT(is_recompute=False, op_output=out)
        except TypeError:  # before op_output
            context = _CONTEXT(is_recompute=False)
        decision = self.policy(context, func, *args, **kwargs)
        if isinstance(decision, bool):
            return SAVE if decision else RECOMPUTE
        if decision in _SAVE:
            return SAVE
        if decision in _RECOMPUTE:
            return RECOMPUTE
        if decision in _OFFLOAD:
            return OFFLOAD
        choices = ", ".join(f"CheckpointPolicy.{p.name}" for p in _POLICY)
        raise PolicyError(
            f"the save policy {getattr(self.policy, '__qualname__', self.policy)!r} returned {decision!r} "
            f"for {func}: a policy returns one of {choices} (or a bool)"
        )

    def remember_made(self, func: Any, index: int, args: tuple, kwargs: dict, out: Any) -> None:
        """Names only: where this call's outputs live, should a name come for them later."""
        if not isinstance(out, Tensor):  # a name marks a single output's call
            return
        address = _address(out)
        earlier = self.made.get(address)
        if earlier is not None and _alive(earlier[2]) is not None:
            return  # memory an earlier output still owns (``_unsafe_view`` of an ``mm``): that call made it
        # a product's output is held (its view may outlive it: ``_through_bias``), the rest weakly
        ref = (lambda: out) if func in _DOTS else weakref.ref(out)
        self.made[address] = (func, index, ref, out._version, args, kwargs)

    def name(self, value: Tensor, name: str) -> None:
        """``checkpoint_name(value, name)`` in the first forward: the call that made it is saved,
        if the policy names it and that call can be kept."""
        self.named.add(name)
        if self.names is None or name not in self.names:
            return
        made = self.made.get(_address(_base(value)))
        why, key = None, None
        if made is None:
            why = "no operation of the block made it (an input, or a value made by a view or an in-place op)"
        else:
            made = self._through_bias(made)
            func, index, ref, version, args, kwargs = made
            out = _alive(ref)
            if out is None or out._version != version:
                why = "it was written into (an in-place op) after the operation made it"
            else:
                key = (func, index)
                entries = self.calls[id(func)]
                if entries[index] is None:
                    entries[index] = self.keep(func, index, args, kwargs, out)
                    counters.SAVED_BY_POLICY += 1
        if self.report is not None:
            self.report.name(name, tuple(value.shape), why, key)

    def _through_bias(self, made: tuple) -> tuple:
        """A value made by adding a bias to a matrix product (a ``Linear`` under vmap: ``mm``, then
        ``add``): the product's call is kept instead, the cheap ``add`` recomputed from it (the same
        memory; kept, the ``add``'s output would leave the ``mm`` to run again)."""
        func, _, _, _, args, _ = made
        if func is not _ADD:
            return made
        for operand in args[:2]:  # under vmap: add(bias, product) or add(product, bias)
            product = self.made.get(_address(operand)) if isinstance(operand, Tensor) else None
            if product is not None and product[0] in _DOTS and _alive(product[2]) is not None:
                return product
        return made

    def name_nothing(self, name: str, value: Any) -> None:
        """``checkpoint_name`` given no tensor: said in the report (the name was given)."""
        self.named.add(name)
        if self.report is not None:
            self.report.name(name, (), f"the value named is a {type(value).__name__}, not a tensor", None)

    def unseen_names(self) -> List[str]:
        return [] if self.names is None else sorted(self.names - self.named)

    def recording(self) -> "_Recording":
        return _Recording(self)

    def handing_back(self) -> "_HandingBack":
        return _HandingBack(self, fingerprints=self.fingerprinted)


def nothing_saved(*args: Any, **kwargs: Any) -> bool:
    """The policy of a block without one while ``saved_residuals`` reports (its recomputes are listed)."""
    return False


def describe(policy: Any) -> str:
    """How the report names a policy."""
    if policy is nothing_saved:
        return "no save policy"
    return f"policy {getattr(policy, '__qualname__', None) or repr(policy)}"


def why_not_handed_back(saved: Saved, vmaps_at_forward: frozenset) -> Optional[str]:
    """None where this recompute may be handed what the forward saved, else why not (the module docstring)."""
    if not saved.usable:
        return "an earlier recompute did not line up with the forward: everything is recomputed"
    if _forward_mode_alive() and not saved.fingerprinted:
        return (
            "forward mode differentiates this recompute but not the forward (its tangent operations "
            "would not line up): everything is recomputed"
        )
    if not saved.fingerprinted and not _vmap_levels() <= vmaps_at_forward:
        return "a vmap the forward did not run under batches this recompute: everything is recomputed"
    return None


class _Now(threading.local):
    """The recording running on this thread (the innermost), for ``checkpoint_name``."""

    def __init__(self) -> None:
        self.recordings: List["_Recording"] = []


NOW = _Now()


def checkpoint_name(value: Any, name: str) -> Any:
    """Give ``value`` a name a naming save policy can save (``save_only_these_names``); returns it."""
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name(value, name={name!r}): the name must be a str, e.g. \"attn_out\"")
    recordings = NOW.recordings
    if recordings:
        saved = recordings[-1].saved
        # what is read here (its storage, version, shape) is bookkeeping, not the block reading a
        # tensor: unseen by the run-time proof (a function mode) and by a user's function modes
        with torch._C.DisableTorchFunction():
            leaves = [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]  # JAX names pytrees too
            for t in leaves:
                saved.name(t, name)
            if not leaves:
                saved.name_nothing(name, value)
    return value


class _Recording(TorchDispatchMode):
    """The first forward: each operation run, the policy asked, the saved outputs kept."""

    def __init__(self, saved: Saved) -> None:
        super().__init__()
        self.saved = saved

    def __enter__(self) -> "_Recording":
        NOW.recordings.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        NOW.recordings.remove(self)
        saved = self.saved
        saved.made = {}
        result = super().__exit__(*exc)
        unseen = saved.unseen_names()
        if unseen and exc[0] is None:
            warnings.warn(
                f"{saved.policy!r}: the checkpointed block never named "
                f"{', '.join(map(repr, unseen))} with ckpt_guard.checkpoint_name(value, name) (it named "
                f"{sorted(saved.named) or 'nothing'}): nothing is saved for {'it' if len(unseen) == 1 else 'them'}",
                UserWarning, stacklevel=residuals.user_stacklevel(),
            )
        return result

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = _op(func)
        if op.ignored:
            return out
        saved = self.saved
        if op.written:
            saved.spoil_written(func, args, kwargs, op.written)
        entry = None
        entries = saved.calls[op.key]
        # asked about every operation, as torch asks (a policy may count them); kept where it can be
        decision = saved.decide(func, args, kwargs, out)
        if decision and op.keepable:
            entry = saved.keep(func, len(entries), args, kwargs, out, offload=decision == OFFLOAD)
            counters.SAVED_BY_POLICY += 1
        elif saved.names is not None and op.keepable:
            saved.remember_made(func, len(entries), args, kwargs, out)
        entries.append(entry)
        return out


class _HandingBack(TorchDispatchMode):
    """A recompute: the n-th call of an operation gets what its n-th forward call saved."""

    def __init__(self, saved: Saved, fingerprints: bool = False) -> None:
        super().__init__()
        self.saved = saved
        self.counts: Dict[int, int] = collections.defaultdict(int)  # by the operation's id (see _Op)
        self.lined_up = True
        #: under forward mode: each handed-back call's arguments must match the forward's fingerprint
        self.fingerprints = fingerprints
        self.report = None if saved.report is None else saved.report.recompute()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        op = _op(func)
        if op.written:
            self.saved.spoil_written(func, args, kwargs, op.written)  # a write into what was handed back
        if not self.lined_up or op.ignored:
            return self._run(func, args, kwargs)
        key = op.key
        index = self.counts[key]
        self.counts[key] = index + 1
        calls = self.saved.calls.get(key)
        if calls is None or index >= len(calls):
            return self._not_lined_up(func, args, kwargs)
        entry = calls[index]
        if entry is None:
            counters.RECOMPUTED_UNDER_POLICY[func] += 1
            return self._run(func, args, kwargs)
        given, kept, outputs, versions, prints, device = entry
        if _signature(args, kwargs) != given:
            return self._not_lined_up(func, args, kwargs)
        if self.fingerprints and not _same_prints(_fingerprint(args, kwargs), prints):
            return self._not_lined_up(func, args, kwargs)
        if [t._version for t in outputs] != versions:
            # written into since (after the block, through the tensor it returned): computed again
            calls[index] = None
            if self.saved.report is not None:
                self.saved.report.dropped(func, index, "written into after the block (through what it returned)")
            return self._run(func, args, kwargs)
        counters.HANDED_BACK += 1
        if self.report is not None:
            self.report.handed_back(func)
        if device is not None:  # offloaded: back to its device
            return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, Tensor) else t, kept)
        # a new tensor on the same memory: the levels above record this call as the operation's own
        if isinstance(kept, Tensor):
            return kept.detach()
        return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, kept)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.report is not None:
            op = _op(func)
            if not op.ignored:
                self.report.ran(func, op.computes)
        return func(*args, **kwargs)

    def _not_lined_up(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # the block runs other operations than its forward did: compute everything from here on,
        # and in every later recompute (what was handed back so far matched call by call)
        self.lined_up = False
        self.saved.usable = False
        if self.report is not None:
            self.report.not_lined_up(func)
        return self._run(func, args, kwargs)
