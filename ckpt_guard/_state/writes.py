"""Reader: the buffers a recompute would update a second time, kept as the forward found them (CKG117).

A checkpointed block in training mode updates its modules' buffers in its forward
(BatchNorm's running statistics and ``num_batches_tracked``, a counter or an average
the user's module keeps in a buffer); torch's recompute runs that forward again, so
the update happens twice (measured: ``num_batches_tracked`` 2 after one step, the
running statistics moved twice), and a block that reads such a buffer after
updating it computes its gradients from the twice-updated value.

:func:`kept_buffers` keeps, at the call, a copy-on-write clone of each buffer of the
block's modules that are in training mode (``torch._lazy_clone``: no copy unless one
of the two is written; the forward's own update then copies that buffer once); the
decision binds a fresh clone of each for every recompute (on its thread only), so
the recompute starts from what the forward started from and writes into the clone,
and the module keeps what the forward left.  Modules in eval mode update nothing and
cost nothing.  Owns: finding those buffers (the block's module, its bound method or
partial, the modules a closure holds) and keeping them.  May not touch: the decision (``_drift`` binds them).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .basics import Module
from .modules import block_module, _structure, closure_held, modules_in_snapshot

Kept = List[Tuple[Module, str, torch.Tensor]]


def kept_buffers(function: object, training: Optional[tuple], bindings: object = None) -> Optional[Kept]:
    """``[(module, buffer name, its value now, kept copy-on-write)]`` for the block's modules in training
    mode that hold buffers; None where there is none (the usual call: a few tuple reads).

    ``bindings`` is the call's block snapshot (CKG110's part) where the caller has it: for a function
    block its :class:`ClosureRead` names the modules whose flags ``training`` joins, so they are not
    looked for a second time (and are the same modules by construction).
    """
    if not training or not any(training):
        return None
    block = block_module(function)
    if not isinstance(block, Module):  # a closure: each module it holds, its part of the flags in turn
        kept_all: Kept = []
        start = 0
        held = modules_in_snapshot(bindings)
        for module in closure_held(block) if held is None else held:
            n = len(_structure(module).paths)
            kept_all += kept_buffers(module, training[start:start + n]) or []
            start += n
        return (kept_all or None) if start == len(training) else None
    structure = _structure(block)
    wanted = [i for i, ((_, _, _, has_buffers), flag) in enumerate(zip(structure.shape, training)) if has_buffers and flag]
    if not wanted:
        return None
    modules = structure.modules(block)
    if len(modules) != len(training):
        return None
    kept: Kept = []
    seen = set()
    for i in wanted:
        module = modules[i]
        if id(module) in seen:  # a shared submodule, reached by two paths
            continue
        seen.add(id(module))
        for name, buffer in module._buffers.items():
            if isinstance(buffer, torch.Tensor):
                copy = keep(buffer)
                if copy is not None:
                    kept.append((module, name, copy))
    return kept or None


def keep(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """What ``tensor`` holds now, copied only if one of the two is written later (copy on write).

    Made with the user's and torch's dispatch modes set aside (a recompute runs inside
    selective checkpointing's caching mode, which must not see the guard's own copies).
    """
    try:
        with torch.no_grad(), _no_dispatch_modes():
            return _lazy_clone(tensor) if _lazy_clone is not None else tensor.clone()
    except Exception:  # noqa: BLE001 - a tensor torch cannot clone so (a subclass, meta): not kept
        return None


_lazy_clone = getattr(torch, "_lazy_clone", None)
_no_dispatch_modes = torch.utils._python_dispatch._disable_current_modes


def buffers_now(kept: Kept) -> list:
    """What each kept buffer's module holds now, copied on write (warn compares them around torch's
    recompute: BatchNorm's kernel updates its running statistics without moving their version)."""
    return [keep(module._buffers[name]) if isinstance(module._buffers.get(name), torch.Tensor) else None
            for module, name, _ in kept]


def written_during(kept: Kept, before: list) -> List[Tuple[Module, str]]:
    """The kept buffers whose module's own tensor now holds other values than ``before`` (:func:`buffers_now`)."""
    written = []
    for (module, name, _), was in zip(kept, before):
        now = module._buffers.get(name)
        if was is not None and isinstance(now, torch.Tensor) and not (now.shape == was.shape and torch.equal(now, was)):
            written.append((module, name))
    return written


def describe_written(written: List[Tuple[Module, str]]) -> str:
    """``running_mean, running_var, num_batches_tracked of BatchNorm1d``: per module, its buffers."""
    groups: dict = {}
    for module, name in written:
        groups.setdefault(id(module), (module, []))[1].append(name)
    return "; ".join(f"{', '.join(names)} of {type(module).__name__}" for module, names in groups.values())
