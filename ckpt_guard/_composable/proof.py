"""The run-time proof behind the composable recompute: the block read only what it was given.

The composable recompute (``_composable``) runs a block below the torch.func
levels that called it, on the tensors it lifted out of the block (its
arguments, its modules' parameters and buffers, the tensors its closures and
containers hold).  A walk over what a function holds can never be complete:
classes, module namespaces, descriptors, C-level bound methods, objects of
any shape can hide a tensor.  A tensor that needs a gradient and that the
block reaches past the walk would be read *as a constant*: its gradient would
silently come back zero or wrong.

So while the block's first forward runs (the plain run: the block as the
caller wrote it, at the caller's torch.func levels), :class:`ReadCheck` (a
``TorchFunctionMode``) looks at every tensor handed to a torch operation, and
at every tensor the block returns.  A tensor that carries a gradient (it
requires grad, or a torch.func level wraps it) must be one the block was
given or one it computed; anything else is recorded as a refusal
(:class:`Unlifted`).  Nothing is raised and nothing is stopped: the plain run
is the uncheckpointed code, right whatever the proof finds, so a refused call
keeps its result and only loses its memory saving (the caller does not pack
it into a recompute).  Tensors that carry no gradient (a mask, a constant)
are read as they are: they are constants for every transform.  So is a
gradient-carrying tensor read only through ``.detach()`` or under
``torch.no_grad()``, where no torch.func level batches it.

"Computed" is decided by identity first: the outputs of every operation are
recorded.  A tensor alive before the forward began can never share an id
with one made during it, so a captured tensor is never taken for a computed
one.  A tensor made where no ``__torch_function__`` sees it (autograd's
engine inside a ``torch.func.grad`` the block calls, the unwrapping at the
end of a ``vmap`` inside it) is computed if its autograd node was made
during the forward: autograd numbers its nodes in order, per thread, and the
forward's first number is read when it starts.  A torch.func wrapper the
block's own transforms made (a level above the call's) stands for the tensor
it wraps.  Anything else that needs a gradient is refused: a lost memory
saving, never a wrong gradient.

Only the forward is checked: the recompute runs the same code on the same
tensors, with the forward's RNG, dtype and device replayed.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch
from torch._C._autograd import _get_sequence_nr
from torch._C._functorch import get_unwrapped as _get_unwrapped, is_batchedtensor, is_functorch_wrapped_tensor
from torch._C._functorch import maybe_get_level as _maybe_get_level
from torch.overrides import TorchFunctionMode

from .. import _files
from .._state import is_user_generator, member_functions, requires_grad_anywhere, requires_grad_of
from .basics import _storage_start

Tensor = torch.Tensor


class Unlifted(Exception):
    """The block read a tensor that needs a gradient and was not given to it (not a user error)."""

    def __init__(self, tensor: Tensor, operation: str, site: str, write: bool = False, outside: bool = False) -> None:
        super().__init__(operation)
        self.tensor = tensor
        self.operation = operation  # "torch.matmul", or "returned" for an output
        self.site = site  # the block's line that read it
        #: not a read: a write into an input a torch.func level wraps (no copy can be kept of it)
        self.write = write
        #: not a read: a write into a tensor the block was not given (nor made): the recompute
        #: would write it again and read what the forward wrote
        self.outside = outside


def _requires_grad_or_wrapped(tensor: Tensor) -> bool:
    return tensor.requires_grad or is_functorch_wrapped_tensor(tensor)



class ReadCheck(TorchFunctionMode):
    """Records the first operation on a tensor that needs a gradient and is neither given nor computed.

    It also keeps, before an operation that may update one of the given
    tensors in place (``add_``, ``inplace=True``, ``out=``, BatchNorm's running
    statistics, through the tensor itself, a view of it or its ``.data``), a
    copy of what that given tensor stands for, so that the recompute can start
    from what the forward started from.  ``sources`` are those tensors (the
    recompute's inputs, index for index with the given ones); ``before`` maps
    an input's index to the copy kept of it (made at the caller's levels,
    differentiable: the recompute's gradient for that input reaches what it
    was before the write).

    The first refusal lands in ``refused``; after it the mode only runs the
    operations (the call will not be packed, so nothing more is needed).

    A ``torch.Generator`` the block draws from (``generator=g``) has its state
    kept in ``generators`` before its first draw: the recompute replays it,
    as it replays the default generators.
    """

    def __init__(self, sources: Sequence[Any] = (), call_level: int = -1) -> None:
        super().__init__()
        self.known: set = set()
        self.sources = sources
        #: the functorch level the block was called at: wrappers above it are the block's own
        self.call_level = call_level
        #: autograd's next node number when the forward began (see the module docstring)
        self.first_node = _get_sequence_nr()
        self.index_of: dict = {}  # id(given tensor) -> its input index
        self.index_of_storage: Optional[dict] = None  # storage address -> input indices (made on first need)
        self.before: dict = {}
        #: id -> (weakref, version, storage address) of each tensor read as a constant (neither given
        #: nor computed, needing no gradient: a mask a closure holds): every recompute checks its
        #: version, and a write into its memory is a write outside the block
        self.constants: dict = {}
        #: the indices of given tensors that need a gradient and that the block rewrote idempotently
        self.rewritten: set = set()
        self.refused: Optional[Unlifted] = None
        self.generators: dict = {}  # id(generator) -> (generator, its state before the block's first draw)
        self.read: set = set()  # the indices of the given tensors an operation took (or the block returned)
        #: the autograd.Function classes the block applied (each looked at once)
        self.functions: set = set()
        #: an operation ran whose reads it cannot see (an autograd.Function's forward, whole): ``read``
        #: then says nothing about what the block did not read
        self.unseen_reads = False
        #: autograd's next node number when the last operation the mode saw returned: a node made
        #: between two operations was made where no mode sees it (see :meth:`check_outputs`)
        self.next_node = self.first_node
        self.unseen_nodes = False
        self.given_tensors: Sequence[Any] = ()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.refused is not None:  # the call will not be packed: run it as it is
            return func(*args, **kwargs)
        if _get_sequence_nr() != self.next_node:
            self.unseen_nodes = True
        kind = _KINDS.get(func)
        if kind is None:
            kind = _kind_of(func)
        if kind is _REQUIRES_GRAD_KIND and args and self._at_call_level(args[0]):
            # a leaf made inside the block: no recompute under a transform can make it again
            # (torch.func refuses requires_grad_() there), nor give it a gradient (a torch.func.grad
            # inside the block marks its own level's wrappers: those are fine)
            self._refuse(args[0], "Tensor.requires_grad_")
        if kwargs:
            generator = kwargs.get("generator")
            if type(generator) is _Generator and id(generator) not in self.generators:
                self._keep_generator(generator)
        unseen = kind is _UNSEEN or kind is _UNSEEN_UPDATES
        if unseen:
            self._note_function(func, args)
        index_of = self.index_of
        if index_of:
            if unseen:
                self.unseen_reads = True
            if kind is _UPDATES or kind is _UNSEEN_UPDATES or (
                kind is _DEPENDS and _may_update(func, args, kwargs)
            ) or (kwargs and ("out" in kwargs or kwargs.get("inplace") is True)):
                self._keep_before(func, args, kwargs)
                self._refuse_outside_writes(func, args, kwargs)
        # one pass: a given tensor is noted as read, any other tensor not known is looked at
        known, read = self.known, self.read
        for arg in (*args, *kwargs.values()) if kwargs else args:
            if type(arg) is _Generator:  # torch.poisson(rates, g)
                if id(arg) not in self.generators:
                    self._keep_generator(arg)
                continue
            for item in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(item, Tensor):
                    key = id(item)
                    i = index_of.get(key)
                    if i is not None:
                        read.add(i)
                    elif key not in known:
                        self._unknown(item, func)
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            known.add(id(out))
        elif isinstance(out, (tuple, list)):  # torch.return_types (max, sort, topk, ...) are tuples too
            for item in out:
                if isinstance(item, Tensor):
                    known.add(id(item))
        self.next_node = _get_sequence_nr()
        return out

    def _note_function(self, func: Any, args: tuple) -> None:
        """An autograd.Function the block applies: a tensor needing a gradient that its class holds
        (read by its backward, which runs unseen, in the recompute as anywhere) is refused."""
        cls = args[0] if getattr(func, "__name__", None) == "custom_function_call" and args else getattr(
            func, "__self__", None
        )
        if not isinstance(cls, type) or cls in self.functions:
            return
        self.functions.add(cls)
        for value in _held_by_function_class(cls):
            if type(value) is _Generator:
                # its forward runs with torch function modes off: a generator it holds may be drawn
                # from unseen, so its state is kept now (replaying an undrawn one changes nothing)
                if id(value) not in self.generators:
                    self._keep_generator(value)
            elif id(value) not in self.known and _requires_grad_or_wrapped(value):
                self._refuse(value, f"{cls.__qualname__} (an autograd.Function whose class holds it)")
                return

    def _unknown(self, tensor: Tensor, func: Any) -> None:
        """A tensor neither given nor computed: refused if it carries a gradient, else a constant."""
        if _requires_grad_or_wrapped(tensor):
            if not self._readable(tensor, func):
                self._refuse(tensor, _name(func))
        elif id(tensor) not in self.constants and not self._computed(tensor):
            try:
                self.constants[id(tensor)] = (weakref.ref(tensor), _version_of(tensor), _storage_address(tensor))
            except TypeError:  # a tensor that cannot be weakly referenced: not watched
                pass

    def constant_storages(self) -> set:
        return {address for _, _, address in self.constants.values() if address}

    def _at_call_level(self, tensor: Tensor) -> bool:
        """Not a wrapper of a level the block's own transforms made."""
        return not is_functorch_wrapped_tensor(tensor) or _maybe_get_level(tensor) <= self.call_level

    def _readable(self, tensor: Tensor, func: Any) -> bool:
        """Whether an operation may take ``tensor``, unknown by identity: computed by the block, or
        read as a constant (``.detach()``, or under ``torch.no_grad()``, where no level batches it)."""
        if self._computed(tensor):
            return True
        if _batched_below(tensor):
            return False
        return getattr(func, "__name__", None) == "detach" or not torch.is_grad_enabled()

    def _computed(self, tensor: Tensor) -> bool:
        """Whether ``tensor``, unknown by identity, was computed by the block (see the module docstring).

        A wrapper of the block's own levels stands for what it wraps (as a
        batched wrapper does); an autograd node made since the forward began
        proves the tensor was made since.
        """
        t = tensor
        while True:
            if id(t) in self.known:
                return True
            node = t.grad_fn
            if node is not None:
                return node._sequence_nr() >= self.first_node
            if not is_functorch_wrapped_tensor(t) or (
                not is_batchedtensor(t) and _maybe_get_level(t) <= self.call_level
            ):
                return False
            t = _get_unwrapped(t)

    def _note_reads(self, args: tuple, kwargs: Optional[dict]) -> None:
        index_of, read = self.index_of, self.read
        for arg in (*args, *(kwargs.values() if kwargs else ())):
            for item in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                if isinstance(item, Tensor):
                    i = index_of.get(id(item))
                    if i is not None:
                        read.add(i)

    def _keep_generator(self, generator: Any) -> None:
        """A user generator's state before the block's first draw from it.  A default generator
        passed by name is left out: the recompute replays those from the forward's start."""
        if not is_user_generator(generator):
            return
        self.generators[id(generator)] = (generator, generator.get_state())

    def _refuse(
        self, tensor: Tensor, operation: str, write: bool = False, outside: bool = False, site: Optional[str] = None,
    ) -> None:
        if self.refused is None:
            self.refused = Unlifted(tensor, operation, site or _block_site(), write, outside)

    def given(self, tensors: Sequence[Any]) -> None:
        """Tensors the block is given (the recompute's inputs, at the caller's levels)."""
        self.known.update(id(t) for t in tensors if isinstance(t, Tensor))
        self.given_tensors = tensors
        if self.sources:
            self.index_of = {id(t): i for i, t in enumerate(tensors) if isinstance(t, Tensor)}

    def _keep_before(self, func: Any, args: tuple, kwargs: Optional[dict]) -> None:
        """Copy each given tensor the coming operation may write into (at most once per input).

        Matched by identity, or by memory (a view of a given tensor, its
        ``.data``, another input on the same storage: each is copied).  The
        copy is differentiable (:func:`_differentiable_copy`), so an input that
        needs a gradient (``h += pos``, ``nn.ReLU(inplace=True)`` first in the
        block) is recomputed from what it was and its gradient reaches that; a
        write known to leave what it wrote as it is (``rewritten``) keeps none.
        """
        name = getattr(func, "__name__", None)
        targets = _written(func, args, kwargs)
        if not targets:  # nothing plain from the call (an autograd.Function's apply): any argument may be written
            targets = [item for arg in (*args, *(kwargs or {}).values())
                       for item in (arg if isinstance(arg, (list, tuple)) else (arg,))]
        for item in targets:
            if isinstance(item, Tensor):
                i = self.index_of.get(id(item))
                indices = [i] if i is not None else self._storages().get(_storage_address(item), ())
                for i in indices:
                    if i in self.before:
                        continue
                    source = self.sources[i]
                    if name in _IDEMPOTENT_NO_GRAD_WRITES and requires_grad_anywhere(source):
                        # no part of what is differentiated, and a no-op on what it wrote: the
                        # recompute starts from the current value (a copy of it)
                        self.rewritten.add(i)
                        continue
                    self.before[i] = _differentiable_copy(source)
                    for j in self._storages().get(_storage_address(source), ()):  # its storage's other inputs
                        if j not in self.before:
                            self.before[j] = _differentiable_copy(self.sources[j])

    def _refuse_outside_writes(self, func: Any, args: tuple, kwargs: Optional[dict]) -> None:
        """Refuse a write into a tensor the block was neither given nor made (a closure's buffer).

        No copy of it is kept (it is no input), so the recompute would start from
        what the forward wrote: spectral_norm's power iteration into buffers passed
        to ``functional_call`` that no transform was given gave wrong gradients.
        """
        for target in _written(func, args, kwargs):
            if not isinstance(target, Tensor) or id(target) in self.index_of:
                continue
            address = _storage_address(target)
            if address in self._storages():
                continue
            if (id(target) not in self.known and not self._computed(target)) or (
                self.constants and address in self.constant_storages()  # through a view, .data, [:]
            ):
                self._refuse(target, _name(func), write=True, outside=True)

    def _storages(self) -> dict:
        """Storage address -> the indices of the inputs on it (made on first need)."""
        if self.index_of_storage is None:
            found: dict = {}
            for i, source in enumerate(self.sources):
                address = _storage_address(source) if isinstance(source, Tensor) else None
                if address:
                    found.setdefault(address, []).append(i)
            self.index_of_storage = found
        return self.index_of_storage

    def check_outputs(self, tensors: Iterable[Any]) -> None:
        tensors = list(tensors)
        self._note_reads(tuple(tensors), None)  # an input returned as is
        for t in tensors:
            if isinstance(t, Tensor) and id(t) not in self.known and _requires_grad_or_wrapped(t) and not self._computed(t):
                self._refuse(t, "returned")
        if self.refused is None and (self.unseen_nodes or _get_sequence_nr() != self.next_node):
            self._check_graph(tensors)

    def _check_graph(self, outputs: Sequence[Any]) -> None:
        """Where the block made autograd nodes no mode saw, what its outputs' graph reaches.

        Operations run with torch functions off (``torch._C.DisableTorchFunction()``,
        a C extension) read tensors the mode never sees, and their results count
        as computed (their nodes are new).  Their reads still show in the graph:
        walking back from the outputs through the nodes the forward made, every
        path must end in a node of a given tensor or in a leaf that was given.
        A leaf, or an older node, of anything else is a tensor needing a gradient
        read unseen: refused.  Walked only where such nodes were made (a
        ``torch.func.grad`` inside the block makes them too, legitimately).
        """
        given = [t for t in self.given_tensors if isinstance(t, Tensor)]
        given_ids = {id(t) for t in given}
        nodes_alive = [t.grad_fn for t in given]  # held: the ids below stay theirs while this runs
        given_nodes = {id(n): t for t, n in zip(given, nodes_alive) if n is not None}
        # seen: id -> node, each node held while this runs (a node's Python object is made on access and
        # freed after; a freed one's id is reused by the next: measured on Python 3.9, which then skipped
        # the leaf that the block read unseen and returned a wrong gradient)
        first, seen, index_of, read = self.first_node, {}, self.index_of, self.read
        for output in outputs:
            if not isinstance(output, Tensor) or output.grad_fn is None:
                continue
            stack = [output.grad_fn]
            while stack:
                node = stack.pop()
                if node is None or id(node) in seen:
                    continue
                seen[id(node)] = node
                owner = given_nodes.get(id(node))
                if owner is not None:  # a given tensor's history: read (unseen) by the block
                    if id(owner) in index_of:
                        read.add(index_of[id(owner)])
                    continue
                variable = getattr(node, "variable", None)
                if variable is not None:  # AccumulateGrad: a leaf
                    if id(variable) in index_of:
                        read.add(index_of[id(variable)])
                    elif id(variable) not in given_ids and id(variable) not in self.known:
                        self._refuse(variable, _UNSEEN_OPERATION, site=_UNSEEN_SITE)
                        return
                elif node._sequence_nr() < first:  # made before the forward: an outside tensor's history
                    self._refuse(output, f"{_UNSEEN_OPERATION}, and returned what it computed", site=_UNSEEN_SITE)
                    return
                else:
                    stack.extend(n for n, _ in node.next_functions)
        del nodes_alive


_UNSEEN_OPERATION = "an operation run with torch functions off (torch._C.DisableTorchFunction(), a C extension)"
_UNSEEN_SITE = "a line of the block no mode sees (found in the graph of what it returned)"


def _differentiable_copy(source: Tensor) -> Tensor:
    """A copy of what ``source`` holds now, at the caller's levels, connected to it.

    Made by ``clone()`` with grad on, it keeps the batching, the tangent and
    the autograd edge to ``source`` as it is before the write: the recompute
    starts from it, and what it differentiates flows back into ``source``'s
    value before the update (the update itself stays in the plain run's graph,
    for code that reads the updated tensor).
    """
    with torch.enable_grad():
        return source.clone()


def _version_of(t: Tensor) -> int:
    while is_functorch_wrapped_tensor(t):
        t = _get_unwrapped(t)
    return t._version


def _batched_below(t: Tensor) -> bool:
    while is_functorch_wrapped_tensor(t):
        if is_batchedtensor(t):
            return True
        t = _get_unwrapped(t)
    return False


def _held_by_function_class(cls: type) -> list:
    """The tensors and generators an autograd.Function's class holds: class attributes, and what its
    methods' closures and the globals their code names hold (one level into a class found there)."""
    found: dict = {}

    def take(value: Any, depth: int) -> None:
        if isinstance(value, (Tensor, _Generator)):
            found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)) and depth:
            for item in value[:64]:
                take(item, depth - 1)
        elif isinstance(value, type) and depth and value.__module__ not in ("builtins", "typing"):
            for item in list(vars(value).values())[:256]:
                take(item, depth - 1)

    for klass in cls.__mro__:
        if klass.__module__.startswith("torch"):
            break
        for value in list(vars(klass).values()):
            functions = member_functions(value)
            for function in functions:
                for cell in function.__closure__ or ():
                    try:
                        take(cell.cell_contents, 2)
                    except ValueError:  # an empty cell
                        pass
                namespace = function.__globals__
                for name in function.__code__.co_names:
                    if name in namespace:
                        take(namespace[name], 2)
            if not functions:
                take(value, 1)
    return list(found.values())


class CapturedReads(TorchFunctionMode):
    """Records, without refusing anything, the tensors needing a gradient the block reads from outside.

    For torch's own checkpoint where the composable recompute could not be
    used: ``captured`` holds each tensor that requires grad and that the block
    was neither given nor computed (a parameter, a swapped-in fast weight),
    in the order first read.  A recompute that reads one the forward did not
    read recomputes with other tensors than the forward.
    """

    def __init__(self, given: Iterable[Any]) -> None:
        super().__init__()
        self.known = {id(t) for t in given if isinstance(t, Tensor)}
        self.captured: dict = {}  # id -> tensor (held: compared by identity later)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        known, captured = self.known, self.captured
        for arg in (*args, *(kwargs or {}).values()):
            for item in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                if isinstance(item, Tensor) and id(item) not in known and requires_grad_of(item):
                    captured.setdefault(id(item), item)
        out = func(*args, **(kwargs or {}))
        for item in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(item, Tensor):
                known.add(id(item))
        return out


_Generator = torch.Generator
_REQUIRES_GRAD_ = Tensor.requires_grad_


def _storage_address(tensor: Tensor) -> Optional[int]:
    """Where a tensor's memory starts (through torch.func's wrappers, ``basics._storage_start``); None
    where there is none to read."""
    try:
        while is_functorch_wrapped_tensor(tensor):
            tensor = _get_unwrapped(tensor)
        return _storage_start(tensor) or None
    except Exception:  # noqa: BLE001 - a tensor without storage (meta, a subclass): matched by identity only
        return None


def memory_span(tensor: Tensor) -> Optional[tuple]:
    """``(storage address, first byte, end byte)`` a tensor's elements lie in (through torch.func's
    wrappers: a batched one spans its whole batch); None where there is none to read."""
    try:
        while is_functorch_wrapped_tensor(tensor):
            tensor = _get_unwrapped(tensor)
        address = _storage_start(tensor)
        if not address or tensor.numel() == 0:
            return None
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        extent = sum((n - 1) * abs(stride) for n, stride in zip(tensor.shape, tensor.stride())) + 1
        return address, start, start + extent * size
    except Exception:  # noqa: BLE001 - a tensor without storage (meta, a subclass): not compared
        return None


def _bottom(tensor: Tensor) -> Tensor:
    while is_functorch_wrapped_tensor(tensor):
        tensor = _get_unwrapped(tensor)
    return tensor


def share_elements(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors whose memory spans overlap (:func:`memory_span`) share an element.

    Exact for views of one tensor with the same strides (``qkv.split(...)``, ``chunk``,
    ``narrow``: disjoint column blocks interleave in memory but share nothing); any other
    pair whose spans overlap counts as sharing (``h`` and ``h.view(-1)``: they do).
    """
    a, b = _bottom(a), _bottom(b)
    if a.stride() != b.stride() or a.dim() != b.dim():
        return True
    difference = b.storage_offset() - a.storage_offset()
    dims = sorted(
        ((abs(st), na, nb) for st, na, nb in zip(a.stride(), a.shape, b.shape) if max(na, nb) > 1 and st),
        reverse=True,
    )
    if any(st < 0 for st in a.stride()):
        return True
    reach = [0] * (len(dims) + 1)  # how far the dims after k can move an offset either way
    for k in range(len(dims) - 1, -1, -1):
        st, na, nb = dims[k]
        reach[k] = reach[k + 1] + st * max(na - 1, nb - 1)
    steps = [0]

    def meets(k: int, rest: int) -> bool:  # rest = sum over dims k.. of (i - j) * stride, i in a, j in b
        if k == len(dims):
            return rest == 0
        st, na, nb = dims[k]
        low = max(-(nb - 1), -((reach[k + 1] - rest) // st))
        high = min(na - 1, (rest + reach[k + 1]) // st)
        for c in range(low, high + 1):
            steps[0] += 1
            if steps[0] > 4096 or meets(k + 1, rest - c * st):
                return True  # found one (or too many to look at: counted as sharing)
        return False

    return meets(0, difference)


def has_graph(tensor: Tensor) -> bool:
    """Whether some level of ``tensor`` (itself, or what torch.func's wrappers hold) was made by autograd."""
    while True:
        if tensor.grad_fn is not None:
            return True
        if not is_functorch_wrapped_tensor(tensor):
            return False
        tensor = _get_unwrapped(tensor)


_UPDATING = frozenset({
    "instance_norm", "native_batch_norm", "_native_batch_norm_legit", "__setitem__",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})


#: calls that write into a tensor under a torch.no_grad() of their own, writing what a second call
#: leaves as it is (nn.Embedding's max_norm renorm of its weight)
_IDEMPOTENT_NO_GRAD_WRITES = frozenset({"embedding"})

#: in-place methods that write no data (torch.func.grad inside the block marks its own inputs)
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "detach_"})


def _may_update(func: Any, args: tuple, kwargs: Optional[dict]) -> bool:
    """Whether ``func`` may write into one of its arguments.

    An ``_`` method, ``out=``, ``inplace=True`` (``torch.nn.functional`` hands
    it on as a keyword), BatchNorm's running statistics (in training only),
    ``x[i] = ...``.
    """
    name = getattr(func, "__name__", "") or ""
    if name in _NOT_WRITES:
        return False
    if name == "batch_norm":  # F.batch_norm and torch.batch_norm: ``training`` is the sixth either way
        return bool(kwargs["training"] if kwargs and "training" in kwargs else len(args) > 5 and args[5])
    if name == "embedding" and getattr(func, "__module__", "") == "torch.nn.functional":  # max_norm renorms
        return (kwargs or {}).get("max_norm", args[2] if len(args) > 2 else None) is not None
    if (name.endswith("_") and not name.endswith("__")) or name in _UPDATING:
        return True
    if kwargs and ("out" in kwargs or kwargs.get("inplace") is True):
        return True
    schema = getattr(func, "_schema", None)  # torch.ops.aten.add_.Tensor: its schema says what it writes
    if schema is not None:
        return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    # autograd.Function.apply, where a release hands it to the mode whole: its forward runs unseen
    return name == "apply"


#: what :class:`ReadCheck` needs to know of an operation before looking at its arguments, worked out
#: once per function (an op is called thousands of times a step): it writes into an argument
#: (``_UPDATES``), only with some arguments (``_DEPENDS``: BatchNorm in training, Embedding with
#: max_norm), runs an autograd.Function's forward unseen (``_UNSEEN``), makes a leaf
#: (``requires_grad_``), or none of these (``out=`` and ``inplace=True`` are looked for at each call)
_NEVER, _UPDATES, _DEPENDS, _REQUIRES_GRAD_KIND = "never", "updates", "depends", "leaf"
#: ... and of the unseen ones, ``apply`` (handed to the mode whole) may write into any argument
_UNSEEN, _UNSEEN_UPDATES = "unseen", "unseen, may write"
_KINDS: dict = {}


def _kind_of(func: Any) -> str:
    name = getattr(func, "__name__", "") or ""
    if func is _REQUIRES_GRAD_:
        kind = _REQUIRES_GRAD_KIND
    elif _runs_unseen(func):
        kind = _UNSEEN_UPDATES if _may_update(func, (), None) else _UNSEEN
    elif name in _NOT_WRITES:
        kind = _NEVER
    elif name in ("batch_norm", "embedding"):
        kind = _DEPENDS
    elif _may_update(func, (), None):
        kind = _UPDATES
    else:
        kind = _NEVER
    if kind is _UNSEEN or kind is _UNSEEN_UPDATES:
        return kind  # rare; an autograd.Function's bound apply would keep its class alive here
    try:
        if len(_KINDS) < 65536:
            _KINDS[func] = kind
    except TypeError:  # an unhashable callable: worked out at each call
        pass
    return kind


def _runs_unseen(func: Any) -> bool:
    """An autograd.Function's forward runs inside it, its reads unseen (``custom_function_call``
    under a transform; ``apply`` where a release hands it to the mode whole)."""
    return getattr(func, "__name__", None) in ("custom_function_call", "apply")


def _written(func: Any, args: tuple, kwargs: Optional[dict]) -> list:
    """The tensors an updating ``func`` writes into, where that is plain from the call (else none).

    Lists are flattened (``torch._foreach_add_``); an aten overload says what it
    writes in its schema.
    """
    name = getattr(func, "__name__", "") or ""
    kwargs = kwargs or {}
    schema = getattr(func, "_schema", None)
    if schema is not None:  # torch.ops.aten.add_.Tensor, whose name is "add_.Tensor"
        found = []
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                found.append(args[i] if i < len(args) else kwargs.get(argument.name))
    elif name == "embedding" and getattr(func, "__module__", "") == "torch.nn.functional":
        max_norm = kwargs.get("max_norm", args[2] if len(args) > 2 else None)
        found = [kwargs.get("weight", args[1] if len(args) > 1 else None)] if max_norm is not None else []
    elif name in ("batch_norm", "instance_norm", "native_batch_norm", "_native_batch_norm_legit"):
        first = 1 if getattr(func, "__module__", "") == "torch.nn.functional" else 3  # the running statistics
        found = [kwargs.get(key, args[i] if len(args) > i else None)
                 for key, i in (("running_mean", first), ("running_var", first + 1))]
    elif "out" in kwargs:
        found = [kwargs["out"]]
    elif (name.endswith("_") and not name.endswith("__")) or name in _UPDATING or kwargs.get("inplace") is True:
        found = [args[0] if args else kwargs.get("input", kwargs.get("self"))]
    else:
        return []
    return [t for item in found for t in (item if isinstance(item, (list, tuple)) else (item,))]


def _name(func: Any) -> str:
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if module.startswith("torch") and "." not in name:
        return f"torch.{name}" if module in ("torch", "torch._C._VariableFunctions") else f"{module}.{name}"
    return name if not module else f"{module}.{name}"


def _block_site() -> str:
    """The innermost frame that is neither torch's nor the guard's: the block's line that read it."""
    frame, _ = _files.user_frame(sys._getframe(2))
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
