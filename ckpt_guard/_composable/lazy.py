"""A recompute that skips what its backward never reads: torch's early stop, composable.

torch's eager checkpoint stops its recompute as soon as every tensor the
backward saved is filled again (*early stop*): a block ending in
``h + fc2(a)`` never runs its last matmul again, since no derivative formula
reads that matmul's output (``addmm`` saves its inputs, ``add`` nothing).
The composable recompute builds a new graph and differentiates it, so it must
run the block to its end; JAX gets the saving by dead-code elimination of the
rematerialised jaxpr.  This room gets it at run time, with a dispatch mode
under every level (it sees the primal operations on plain or physically
batched tensors, as ``saving``'s modes do):

* **Deferring.**  While the recompute's forward runs, a large matmul (``mm``,
  ``addmm``, ``bmm``, ``baddbmm`` of :data:`MIN_FLOPS` or more) is not run:
  the levels above get an uninitialised tensor of its output's shape, dtype
  and (contiguous) layout, and record the operation as its own (its
  derivative reads its inputs, never its output); the operation is kept
  *pending*.  So is a view of a pending tensor (metadata only), and an
  ``add`` / ``sub`` / ``mul`` of one with a tensor of its dtype that is
  contiguous in the output's shape or broadcast into it (a bias, a residual).
* **Running on touch.**  Any other operation given a pending tensor (matched
  by memory address, views included) first runs what is pending, into the
  memory the levels already hold (an ``out=`` kernel, below the version
  counter: the memory is filled once, as the operation would have filled it);
  so does any operation writing into memory a pending operation reads, before
  it writes.  The pullback runs under the mode too, deferring nothing: a
  derivative formula reading a pending value gets it computed first
  (``mul``'s reads both factors).
* **When the forward ends** (:meth:`Deferring.settle`).  What the pullback
  reads is what autograd saved, or what someone holds (a forward hook that kept
  an output on its module, a custom Function's ``ctx``); either holds it now.
  So a pending operation held by nothing but the mode's records and the
  recompute's own outputs (which the pullback differentiates, never reads),
  and read by no pending operation that is held, is dropped: it never runs, and
  its inputs go now, not when the backward ends.  If nothing is left pending,
  the pullback runs without the mode (its cost per operation is the early
  stop's whole cost); else under it, and a read of a dropped value raises
  (the argument above says none can happen: if one does, it is loud).
* **When the backward ends** (:meth:`Deferring.finish`): what is still pending
  and held by anything (a reference count above the mode's own, from Python or
  from C++) runs, so that nothing ever reads memory that was not computed; the
  rest never runs.

Used only where the recompute's tensors cannot outlive its backward: a
first-order pullback that nothing differentiates again, outside forward mode,
without a save policy (which decides what runs itself), on the CPU (on an
accelerator the backward runs on the device's own thread, which nothing here
has measured), and where an input is large enough for a matmul to pay for the
mode's microseconds per operation in the recompute (:data:`MIN_NUMEL`).  An operation the
mode cannot follow (a tensor that is not a plain strided one, a view that may
copy, such as ``reshape``) is simply run, after what it reads.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import counters

Tensor = torch.Tensor
aten = torch.ops.aten

#: the least floating-point operations of a matmul worth deferring (smaller ones cost less than
#: the bookkeeping); tests set it to 0 to defer every one
MIN_FLOPS = 1 << 21
#: the recompute runs under the mode only where some input has at least this many elements: the
#: mode costs about 5 µs per operation, and a block of 2 x ``Linear(256)`` on 64 rows (inputs of
#: 65536 elements at most) ran 3 % slower with it, one of 2 x ``Linear(512)`` on 256 rows (131072
#: and 262144) 9 % faster (``benchmarks/blocks.py``, 2026-12-05); tests set it to 0
MIN_NUMEL = 1 << 17
#: the switch (tests compare with and without)
ENABLED = True
#: torch lets a dispatch mode see a higher-order operator (``torch.cond``, flex attention) and run
#: it (measured: 2.13, 2.15); on torch 2.4 one under a mode fails, so the early stop is not used there
AVAILABLE = hasattr(TorchDispatchMode, "supports_higher_order_operators")

_DOTS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
_CHAINED = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor})
#: views the levels make of an output (a ``Linear`` on 3-d input is ``view``, ``addmm``, ``view``)
_VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.permute.default,
    aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default, aten.detach.default,
    aten._reshape_alias.default,
})  # never ``reshape``, which copies (reads) what it cannot view
_OUT = {
    aten.mm.default: aten.mm.out, aten.addmm.default: aten.addmm.out, aten.bmm.default: aten.bmm.out,
    aten.baddbmm.default: aten.baddbmm.out, aten.add.Tensor: aten.add.out, aten.sub.Tensor: aten.sub.out,
    aten.mul.Tensor: aten.mul.out,
}


def applies(node: Any, tensors: Sequence[Tensor]) -> bool:
    """Whether a first-order recompute of ``node`` on ``tensors`` runs under the mode: a block's own
    (vmapped or not) without a save policy, on the CPU, one of whose inputs is large (:data:`MIN_NUMEL`)."""
    if not (ENABLED and AVAILABLE):
        return False
    plan = node.base if type(node).__name__ == "_Batched" else node
    if type(plan).__name__ != "Plan" or plan.saved is not None:
        return False  # a derivative's recompute, or a save policy deciding what runs (``saving``)
    large = False
    for t in tensors:
        if not t.is_cpu:
            return False  # on an accelerator the backward runs on the device's own thread: not measured
        large = large or t.numel() >= MIN_NUMEL
    return large


class _Pending:
    """An operation not run yet, and the tensor its output goes to (or a view made of such a tensor)."""

    __slots__ = ("func", "args", "kwargs", "out", "root", "reads", "done", "__weakref__")

    def __init__(self, func: Any, args: tuple, kwargs: dict, out: Tensor, root: Optional["_Pending"] = None) -> None:
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out
        #: for a view of a pending tensor: the pending operation whose memory it views (else None;
        #: the operation does not point back: no reference cycle keeps tensors past their use)
        self.root = root
        #: the storage addresses of what it reads (a write there runs it first)
        self.reads: List[int] = []
        self.done = False


def _plain(t: Any) -> bool:
    return type(t) is Tensor and t.layout == torch.strided and not t.is_meta and t.numel() > 0


def _matmul_shape(func: Any, args: tuple) -> Optional[tuple]:
    """The output shape of a deferrable matmul, or None where it is not one (or too small)."""
    if func is aten.mm.default or func is aten.addmm.default:
        a, b = (args[0], args[1]) if func is aten.mm.default else (args[1], args[2])
        if a.dim() != 2 or b.dim() != 2:
            return None
        shape, flops = (a.shape[0], b.shape[1]), 2 * a.shape[0] * a.shape[1] * b.shape[1]
    else:  # bmm, baddbmm
        a, b = (args[0], args[1]) if func is aten.bmm.default else (args[1], args[2])
        if a.dim() != 3 or b.dim() != 3:
            return None
        shape, flops = (a.shape[0], a.shape[1], b.shape[2]), 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if flops < MIN_FLOPS:
        return None
    for t in args:  # addmm's bias too: one dtype and device, no promotion to work out
        if isinstance(t, Tensor) and (t.dtype != a.dtype or t.device != a.device):
            return None
    return shape


def _fill(entry: _Pending) -> None:
    """Run a pending operation into the memory its output already has (no version bump: the memory
    is filled once, as the operation would have filled it; nothing read it before)."""
    with _BELOW_INPLACE_OR_VIEW():
        _OUT[entry.func](*entry.args, **entry.kwargs, out=entry.out)
    entry.done = True


_BELOW_INPLACE_OR_VIEW = torch._C._AutoDispatchBelowADInplaceOrView
_OP_OVERLOAD = torch._ops.OpOverload


class Deferring(TorchDispatchMode):
    """The recompute's forward and pullback (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        #: data address of a pending output, or of a view of one -> its entry
        self.pending: Dict[int, _Pending] = {}
        #: storage addresses pending operations read -> how many of them
        self.read: Dict[int, int] = {}
        #: whether operations are deferred (the forward) or only run when touched (the pullback)
        self.deferring = True
        #: the operations deferred, in order
        self.deferred: List[_Pending] = []
        #: those :meth:`settle` found nothing could read: never run
        self.dropped: List[_Pending] = []

    #: a higher-order operator (``torch.cond``, flex attention) comes here too, and is run as it is,
    #: after everything pending (what it reads inside is not seen)
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        pending = self.pending
        if type(func) is not _OP_OVERLOAD:
            for entry in list(self.deferred):
                self._materialise(entry)
            return func(*args, **kwargs)
        if not pending:
            if self.deferring and func in _DOTS:
                deferred = self._defer_matmul(func, args, kwargs)
                if deferred is not None:
                    return deferred
            return func(*args, **kwargs)
        touched: List[_Pending] = []
        for arg in (*args, *kwargs.values()) if kwargs else args:
            for item in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(item, Tensor) and item.layout == torch.strided and not item.is_meta:
                    found = pending.get(item.data_ptr())
                    if found is not None:
                        touched.append(found)
        if self.read and func._schema.is_mutable:
            self._before_write(func, args, kwargs)
        if touched:
            if self.deferring:
                deferred = self._defer_on_pending(func, args, kwargs, touched)
                if deferred is not None:
                    return deferred
            for entry in touched:
                self._materialise(entry)
        elif self.deferring and func in _DOTS:
            deferred = self._defer_matmul(func, args, kwargs)
            if deferred is not None:
                return deferred
        return func(*args, **kwargs)

    # -- deferring

    def _defer_matmul(self, func: Any, args: tuple, kwargs: dict) -> Optional[Tensor]:
        if kwargs or not all(_plain(a) for a in args if isinstance(a, Tensor)):
            return None
        shape = _matmul_shape(func, args)
        if shape is None:
            return None
        a = args[0] if func is aten.mm.default or func is aten.bmm.default else args[1]
        return self._keep(func, args, kwargs, torch.empty(shape, dtype=a.dtype, device=a.device))

    def _defer_on_pending(self, func: Any, args: tuple, kwargs: dict, touched: List[_Pending]) -> Optional[Tensor]:
        if func in _VIEWS and len(touched) == 1:
            view = func(*args, **kwargs)  # metadata only: nothing is read
            if _plain(view):
                seen = touched[0]
                root = seen.root or seen
                self.pending[view.data_ptr()] = _Pending(func, args, kwargs, view, root)
                return view
            self._materialise(touched[0])  # an empty view, or not a tensor: its memory is filled
            return view
        if func not in _CHAINED or len(args) != 2 or any(k != "alpha" for k in kwargs):
            return None
        a, b = args
        if not (_plain(a) and _plain(b) and a.dtype == b.dtype and a.device == b.device):
            return None
        # the output's layout is known where each operand is contiguous in the output's shape or is
        # broadcast into it (a bias): then it is contiguous
        shape = a.shape if a.shape == b.shape else torch.broadcast_shapes(a.shape, b.shape)
        if a.shape != shape and b.shape != shape:
            return None
        for operand in (a, b):
            if operand.shape == shape and not operand.is_contiguous():
                return None
        return self._keep(func, args, kwargs, torch.empty(shape, dtype=a.dtype, device=a.device))

    def _keep(self, func: Any, args: tuple, kwargs: dict, out: Tensor) -> Tensor:
        entry = _Pending(func, args, kwargs, out)
        read = self.read
        for arg in args:
            if isinstance(arg, Tensor):
                address = arg.untyped_storage().data_ptr()
                entry.reads.append(address)
                read[address] = read.get(address, 0) + 1
        self.pending[out.data_ptr()] = entry
        self.deferred.append(entry)
        return out

    # -- running what is pending

    def _before_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An operation writing into memory a pending operation reads: everything pending runs first."""
        schema = func._schema.arguments
        values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
        for argument, value in zip(schema, values):
            info = argument.alias_info
            if info is None or not info.is_write:
                continue
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, Tensor) and item.layout == torch.strided and not item.is_meta:
                    if item.untyped_storage().data_ptr() in self.read:
                        for entry in list(self.deferred):
                            self._materialise(entry)
                        return

    def _materialise(self, entry: _Pending) -> None:
        """Run ``entry`` (the operation under a view), what it reads that is pending first."""
        entry = entry.root or entry
        if entry.done:
            return
        if entry.args is None:  # dropped by :meth:`settle`: nothing could read it, yet something does
            raise RuntimeError(
                f"ckpt_guard: the recompute skipped {entry.func} (nothing held its output when the block's "
                "forward ended), and an operation of the backward reads it now. This is a bug in ckpt_guard's "
                "early stop: please report it; ckpt_guard._composable.lazy.ENABLED = False switches it off"
            )
        for arg in entry.args:
            if isinstance(arg, Tensor):
                found = self.pending.get(arg.data_ptr())
                if found is not None:
                    self._materialise(found)
        _fill(entry)
        self._forget(entry)

    def _forget(self, entry: _Pending) -> None:
        """``entry`` ran: its records (and its views') go, and with them what it held."""
        pending = self.pending
        for address in [a for a, kept in pending.items() if kept is entry or kept.root is entry]:
            del pending[address]
        read = self.read
        for address in entry.reads:
            left = read[address] - 1
            if left:
                read[address] = left
            else:
                del read[address]
        self.deferred.remove(entry)
        entry.args = entry.kwargs = entry.out = None  # type: ignore[assignment]

    def settle(self, results: Sequence[Tensor]) -> bool:
        """The recompute's forward has ended (``results``: its outputs, as the vjp returns them): from here
        on nothing is deferred, and what nothing outside can read is dropped now.

        What the pullback reads is what autograd saved (a saved tensor holds what it saves) or what
        someone holds (a forward hook that kept an output on its module, a custom Function's ``ctx``):
        either holds it now.  So a pending operation held by nothing but this mode's records and the
        recompute's own outputs (which the pullback differentiates, never reads), and read by no
        operation that is held, never runs: its inputs go now, not when the backward ends (the last
        ``Linear``'s input, 4 times a transformer layer's width, would otherwise outlive the matmul's
        own backward).  Its output's memory is kept while the mode runs, so that a read of it is
        caught (never one of memory reused by another tensor).  Returns whether anything is still
        pending: if not, the pullback needs no mode, and runs without its cost per operation.
        """
        self.deferring = False
        entries = [entry for entry in self.deferred if not entry.done]
        if not entries:
            return False
        views = self._views()
        in_args = self._in_args(entries, views)
        ours = _outputs_hold(results)
        needed = set()
        for entry in entries:
            of_it = views.get(id(entry), ())
            if _held(entry.out, in_args, len(of_it), ours) or any(_held(v.out, in_args, 0, ours) for v in of_it):
                needed.add(id(entry))
        for entry in reversed(entries):  # what a needed operation reads is needed (it came before)
            if id(entry) in needed:
                for arg in entry.args:
                    found = self.pending.get(arg.data_ptr()) if isinstance(arg, Tensor) else None
                    if found is not None:
                        needed.add(id(found.root or found))
        for entry in entries:
            if id(entry) not in needed:
                self._drop(entry, views.get(id(entry), ()))
        return bool(self.deferred)

    def _drop(self, entry: _Pending, views: Sequence[_Pending]) -> None:
        """``entry`` will never run: what it reads goes (its output's memory stays, see :meth:`settle`)."""
        read = self.read
        for address in entry.reads:
            left = read[address] - 1
            if left:
                read[address] = left
            else:
                del read[address]
        self.deferred.remove(entry)
        self.dropped.append(entry)
        for kept in (entry, *views):
            kept.args = kept.kwargs = None  # type: ignore[assignment]

    def _views(self) -> Dict[int, List[_Pending]]:
        views: Dict[int, List[_Pending]] = collections.defaultdict(list)
        for kept in self.pending.values():
            if kept.root is not None:
                views[id(kept.root)].append(kept)
        return views

    @staticmethod
    def _in_args(entries: Sequence[_Pending], views: Dict[int, List[_Pending]]) -> "collections.Counter[int]":
        records = [*entries, *(v for found in views.values() for v in found)]
        return collections.Counter(
            id(a) for e in records if e.args is not None for a in e.args if isinstance(a, Tensor)
        )

    def finish(self) -> int:
        """After the pullback, the mode exited and the recompute's tensors dropped: run what is pending
        and still held by anything but this mode; the rest never runs.  Returns how many never ran.

        Held: its output (or a view made of it) is referenced from Python by more than this mode's
        records, or from C++ (a wrapper, a view, a saved tensor) by more than the views recorded here.
        """
        self.deferring = False
        views = self._views()
        in_args = self._in_args(self.deferred, views)
        for entry in list(self.deferred):
            if entry.done:
                continue
            of_it = views.get(id(entry), ())
            if _held(entry.out, in_args, len(of_it)) or any(_held(v.out, in_args, 0) for v in of_it):
                self._materialise(entry)
        skipped = len(self.deferred) + len(self.dropped)
        counters.SKIPPED_BY_EARLY_STOP += skipped
        self.deferred, self.dropped, self.pending, self.read = [], [], {}, {}
        return skipped


def _held(t: Tensor, in_args: "collections.Counter[int]", views: int, ours: Optional[tuple] = None) -> bool:
    """Whether anything but the mode's records holds ``t``: from C++, more than its Python object and
    the ``views`` recorded of it; from Python, more than its record and the records' arguments.
    ``ours``: the references the recompute's own outputs hold, from Python and from C++
    (:func:`_outputs_hold`)."""
    by_python, by_cpp = ours if ours is not None else (_NONE, _NONE)
    key = id(t)
    cpp = t._use_count()
    return cpp > 1 + views + by_cpp[key] or sys.getrefcount(t) > _RECORD_REFS[cpp > 1] + in_args[key] + by_python[key]


_NONE: "collections.Counter[int]" = collections.Counter()


def _outputs_hold(results: Sequence[Tensor]) -> tuple:
    """``(from Python, from C++)``: how many references the recompute's outputs hold to each tensor.

    ``results`` hold their tensors from Python; the vjp's level holds a wrapper of each (a C++
    reference to it), and each functorch wrapper among them (a batched tensor of a vmap outside)
    holds the tensor it wraps, down to the plain one."""
    by_python: "collections.Counter[int]" = collections.Counter()
    by_cpp: "collections.Counter[int]" = collections.Counter()
    for t in results:
        by_python[id(t)] += 1
        by_cpp[id(t)] += 1
        while _is_wrapped(t):
            t = _get_unwrapped(t)
            by_cpp[id(t)] += 1
    return by_python, by_cpp


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_get_unwrapped = torch._C._functorch.get_unwrapped


def _calibrated() -> tuple:
    """``sys.getrefcount`` of a tensor only a record holds, as :func:`_held` sees it, without and with
    a C++ holder (a view): measured, not assumed (the interpreter's references to a call's arguments
    differ between Pythons, and newer torches keep a tensor's Python object from C++ while C++ holds
    it)."""
    seen = []

    def held(t: Tensor, in_args: Any, views: int) -> bool:
        seen.append(sys.getrefcount(t))
        return False

    record = _Pending(None, (), {}, torch.empty(2))
    held(record.out, None, 0)
    view = record.out.view(2)  # noqa: F841 - a C++ holder of the record's tensor
    held(record.out, None, 1)
    return seen[0], seen[1]


_RECORD_REFS = _calibrated()
