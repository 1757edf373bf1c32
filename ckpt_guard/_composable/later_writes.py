"""The caller writing into a block's input after the call: ``y = ckpt(block, h); h.add_(1)``.

Without checkpointing that write is harmless unless the block's own graph saved ``h``
(``exp`` saves its output, ``sin`` its input); then autograd raises "modified by an
inplace operation" in the backward.  The recompute reads ``h`` again in the backward, so
the Function must keep what the call saw, and say what autograd says where it says it:

* each input a caller can write (not a module's parameter or buffer, whose changes are
  the drift rules' to judge; not a leaf that requires grad, which only ``no_grad`` code
  writes: an optimizer step) is handed to the Function as a copy on write
  (``torch._lazy_clone``: differentiable at every level, so gradients and tangents reach
  ``h`` through it as before).  It costs no memory until the caller writes; only then does
  ``h`` get memory of its own.  Nothing may read a clone's data address: ``data_ptr()``
  makes the copy (measured), so the recompute's one address read (``basics._storage_start``)
  names a copy on write by its storage object.  A complex input is copied through its real
  view (``_lazy_clone`` has no complex autograd formula).  Views into one storage are copied
  where the call's inputs span more than half of it together (``q, k, v = qkv.split(d, -1)``);
  a row of a larger buffer is copied at the call instead, the row only
  (:func:`_small_part_of_its_storage`): a copy on write of it would copy the whole buffer at
  each write.  A view with gaps (a column, ``buf[::3]``) is not: its copy would be laid out
  otherwise (a block may branch on ``is_contiguous()`` or read its strides), so a write after
  the call stays autograd's error there.
  The copy is a node of its own in the graph: in a second backward (reverse over reverse) the
  gradient reaching it waits in a buffer of its own before joining the caller's tensor's,
  one input-sized buffer more at the peak where the input is an uncheckpointed block's output
  (``benchmarks/memory.py``'s ``hvp vjp(grad)``, every second block: +8 MB of 421, the same
  with a view in its place: measured).
* the call keeps the caller's tensor (under its torch.func wrappers) and its version.  Where
  the version moved by the recompute, the recompute moves the version of its own wrapper of
  that input once the block has run (``levels.vjp``'s ``written``): autograd then raises its
  own "modified by an inplace operation" exactly where the block's graph saved that input or
  a view of it, as without checkpointing, and the gradient is the plain program's elsewhere.
* under forward mode a write into the input writes its tangent too (a dual's tangent is updated in
  place); where something differentiates the tangents (jvp, then ``.backward()``), autograd raises
  where the block's tangent graph saved that tangent (``exp(h)``'s, ``exp(h) * h_dot``).  The call
  keeps the caller's tangent and its version as well (:func:`tangents_written_since_call`); the jvp
  derivative's recompute moves the version of its own wrapper of that direction.  The Function's
  tangent is a copy on write of the caller's (``_lazy_clone``'s forward formula), so keeping it costs
  nothing until written.

torch has no vmap rule for ``_lazy_clone`` (its fallback copies and warns: measured on
2.4 and 2.13); :func:`_batched_lazy_clone` is one (the clone of the tensor under the batch
level, batched as the input was), registered the first time a clone is made under vmap,
unless torch has one.  torch 2.4-2.15 all have ``_lazy_clone``; a torch without it keeps
the inputs as they are (autograd's error then, as before).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch._C._functorch import _add_batch_dim, _unwrap_batched, get_interpreter_stack, maybe_get_level

from .. import _state
from .basics import VMAP_KEY, _base, _is_cow, _version
from .proof import _storage_address
from .refusals import ChangedSinceForward

Tensor = torch.Tensor

_lazy_clone = getattr(torch, "_lazy_clone", None)
_top_hooks = _state.top_saved_tensor_hooks or (lambda: None)


def copies_on_write(built: Any, operands: Sequence[Tensor]) -> Sequence[Tensor]:
    """The Function's operands, each input a caller can write handed in as a copy on write;
    ``built.found.callers_inputs`` keeps a :class:`Watched` of each."""
    if _lazy_clone is None or _top_hooks() is not None:
        return operands  # the user's saved-tensor hooks judge saved inputs by their memory (function._copied_by_hooks)
    found = built.found
    bound = {i for *_, i in found.slots}
    skipped = bound.union(found.pre_forward, found.aliased_inputs)
    read = found.read
    candidates = [
        (i, t, _base(t)) for i, t in enumerate(operands[: built.n_inputs])
        if i not in skipped and (read is None or i in read) and not (t.is_leaf and t.requires_grad)
    ]
    if not candidates:
        return operands
    # read before any copy is made: the first copy on write of a storage renames it (basics._storage_start);
    # None: no storage to read (a subclass), not copied
    storages = [_storage_address(base) for *_, base in candidates]
    together: Dict[Optional[int], int] = {}
    for (*_, base), key in zip(candidates, storages):
        together[key] = together.get(key, 0) + base.numel() * base.element_size()
    kept: Optional[List[Tensor]] = None
    callers: List[Watched] = []
    tangents: List[Watched] = []
    dual = _state.forward_ad._current_level >= 0  # a jvp or dual level: the inputs may carry tangents
    for (i, t, base), key in zip(candidates, storages):
        if key is None:
            continue
        small = _small_part_of_its_storage(base, together[key])
        if kept is None:
            kept = list(operands)
        if not small and not _LIBRARY and _under_vmap():
            _register_vmap_rule()
        try:
            clone = t.clone() if small else _copy_on_write(t)
        except Exception:  # noqa: BLE001 - a tensor torch cannot clone so (a subclass, sparse): kept as it is
            continue
        if small and not _same_layout(clone, t):
            continue  # a view with gaps (a column): a copy would change its layout, which a block may read

        callers.append(Watched(i, base, _version(base)))
        if dual:
            tangent = _tangent_of(t)
            if tangent is not None:
                tangents.append(Watched(i, tangent, _version(tangent)))
        kept[i] = clone
        built.hand_in_copy(i)
    built.watch_callers(callers, tangents)
    return operands if kept is None else kept


def _copy_on_write(t: Tensor) -> Tensor:
    """``torch._lazy_clone(t)``; a complex tensor's through its real view (``_lazy_clone`` has no complex
    autograd formula, ``view_as_real`` and ``view_as_complex`` have: measured on 2.4.1, 2.13, 2.15), a
    conjugate view's through what it conjugates (``view_as_real`` refuses it; ``conj()`` is a view both ways)."""
    if t.is_complex():
        if t.is_conj():
            return _copy_on_write(t.conj()).conj()
        return torch.view_as_complex(_lazy_clone(torch.view_as_real(t)))
    return _lazy_clone(t)


def written_since_call(root: Any, saved: Sequence[Tensor]) -> Tuple[int, ...]:
    """The inputs the caller wrote into since the call (their versions moved).

    A write that moves no version (through ``.data``, or ``.detach()``'s alias) is seen by its copy:
    the caller's tensor then has memory of its own, no longer shared with the Function's copy.  Where
    their values differ, the recompute would not read what the plain program's backward reads, so it
    stops with :class:`ChangedSinceForward` (a memory of its own with the same values: something only
    read its address, ``data_ptr()``, which makes the copy too).
    """
    written = []
    for watched in root.found.callers_inputs:
        i, (base, moved) = watched.index, watched.read()
        if moved:
            written.append(i)
        elif base is not None and _is_cow is not None and not _is_cow(base) and i < len(saved) \
                and not _same_values(base, _base(saved[i])):
            raise ChangedSinceForward(
                "ckpt_guard's composable recompute: an input of a checkpointed call (a "
                f"{tuple(base.shape)} tensor) was written after the call in a way that moves no version "
                "(through .data or a .detach() alias), so autograd cannot tell. The recompute would read "
                "the values the call saw, where the program without checkpointing reads the new ones, "
                "so it stops here. Write into the tensor itself (autograd then speaks where the block "
                "saved it), or write after the backward."
            )
    return tuple(written)


def tangents_written_since_call(root: Any) -> Tuple[int, ...]:
    """The inputs whose tangents the caller wrote into since the call (a write into a dual writes its
    tangent too: ``h.mul_(2)``, ``h.add_(1)``, measured).  Without checkpointing, autograd raises where
    the block's tangent graph saved that tangent and something differentiates the tangents (jvp, then
    ``.backward()``); the jvp derivative's recompute then moves its own copy's version the same way
    (``function._vjp``)."""
    return tuple(watched.index for watched in root.found.callers_tangents if watched.read()[1])


def _tangent_of(t: Tensor) -> Optional[Tensor]:
    """The tensor under every wrapper of ``t``'s tangent at the innermost dual level, or None."""
    try:
        tangent = _state.forward_ad.unpack_dual(t).tangent
    except Exception:  # noqa: BLE001 - a tensor forward mode cannot unpack (a subclass): not watched
        return None
    return None if tangent is None else _base(tangent)


class Watched:
    """An input handed to the Function as a copy on write (or its tangent): the caller's tensor and its
    version at the call.

    The caller's tensor is held until the first recompute has read it (until then it shares its memory
    with the copy, so holding it costs nothing), then only weakly: held through the backward, every
    block's input would stay alive until the last block's recompute, where the Function's saved copy
    is let go after its own (measured: ``benchmarks/memory.py``'s per-sample CNN peaked 80 MB higher).
    What the first recompute found written stays written.
    """

    __slots__ = ("index", "version", "written", "_held", "_ref")

    def __init__(self, index: int, tensor: Tensor, version: Optional[int]) -> None:
        self.index, self.version, self.written = index, version, False
        self._held: Optional[Tensor] = tensor
        self._ref: Any = None

    def tensor(self) -> Optional[Tensor]:
        return self._held if self._ref is None else self._ref()

    def read(self) -> Tuple[Optional[Tensor], bool]:
        """``(the caller's tensor or None once collected, whether written since the call)``, at a recompute:
        its version moved, now or at an earlier recompute (remembered); it is held weakly from then on."""
        tensor = self.tensor()
        self.let_go()
        self.written = self.written or tensor is not None and _version(tensor) != self.version
        return tensor, self.written

    def let_go(self) -> None:
        if self._held is not None:
            try:
                self._ref = weakref.ref(self._held)
            except TypeError:  # noqa: PERF203 - not weakly referable: forgotten (nothing reads it again)
                self._ref = lambda: None
            self._held = None


def _small_part_of_its_storage(base: Tensor, together: int) -> bool:
    """Whether a tensor is a view into a small part of a larger storage (a row of a cache), ``together``
    the bytes the call's inputs into that storage span with it (``q, k, v = qkv.split(d, -1)`` span all).

    A copy on write covers the whole storage: a loop writing the next row of a buffer after each
    call would copy the whole buffer once per call, each pending copy kept until its backward
    (memory quadratic in the loop's length, measured).  An input whose call spans at most half of its
    storage is copied at the call instead, itself only: at most its own size, and a loop over the rows
    of a buffer copies the buffer once in all.
    """
    try:
        return 2 * together <= base.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - no storage to read (a subclass): not cloned either way
        return True


def _same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether the block would see ``a`` laid out as ``b``: their strides as the block reads them (under vmap,
    the example's, not the batch's)."""
    try:
        return a.stride() == b.stride()
    except Exception:  # noqa: BLE001 - a tensor with no strides to read (a subclass): not the same, to be safe
        return False


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Equal in shape and value, a NaN equal to a NaN (a row holding NaN is the same row)."""
    with torch._C.DisableTorchFunction():
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
        return bool(torch.equal(a, b))


def _under_vmap() -> bool:
    return any(level.key().value == VMAP_KEY for level in get_interpreter_stack() or ())


_registered = threading.Lock()
_LIBRARY: List[Any] = []  # the registration lives as long as its Library object


def _register_vmap_rule() -> None:
    if _LIBRARY:
        return
    with _registered:
        if _LIBRARY:
            return
        if torch._C._dispatch_has_kernel_for_dispatch_key("aten::_lazy_clone", "FuncTorchBatched"):
            _LIBRARY.append(None)  # torch's own rule
            return
        library = torch.library.Library("aten", "IMPL")
        library.impl("_lazy_clone", _batched_lazy_clone, "FuncTorchBatched")
        _LIBRARY.append(library)


_NOT_BATCHED = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)


def _batched_lazy_clone(tensor: Tensor) -> Tensor:
    """``aten::_lazy_clone``'s vmap rule: the tensor under the batch level cloned, batched as it was."""
    level = maybe_get_level(tensor)
    inner, batch_dim = _unwrap_batched(tensor, level)
    with torch._C._ExcludeDispatchKeyGuard(_NOT_BATCHED):
        clone = _lazy_clone(inner)
    return _add_batch_dim(clone, batch_dim, level)
