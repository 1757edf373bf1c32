"""Reader: parameter swaps (``torch.func.functional_call``) that leave no trace in torch (CKG101).

``_hooks`` reports each swap here (:func:`push_swap` / :func:`pop_swap`); the drift
reader :func:`swapped_reads` says which tensors the block would read from a swap now
active, and whether a change can reach the checkpointed function.  May not touch: the
module's own tensors (``modules`` reads those).
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref

from . import block_reads as _reads
from .basics import Tensor


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
    recompute check (:func:`swapped_reads_relevant`) compares the tensors.
    """

    __slots__ = ("reads", "swaps", "unseen")

    def __init__(self, reads: tuple, swaps: tuple, unseen: bool) -> None:
        # (path, owner, store name, name, weakref to the tensor, origin)
        self.reads, self.swaps = reads, swaps
        #: the block may read module tensors the guard cannot see (see block_reads)
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


def swapped_reads_relevant(function: object, was: object, now: object) -> bool:
    """Whether the recompute would read other tensors than the forward did."""
    if isinstance(was, SwappedReads):
        return bool(was.differences())
    return True  # the forward read none of the tensors a swap now puts in place




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
