"""Tensor helpers every part of the composable recompute shares.

Owns: what counts as differentiable, a view's base, whether a tensor carries a
gradient through functorch's wrappers, its version, where its storage starts, and selective checkpointing's
forward mode (left out of fallback's plain run and the recompute).  May not touch:
anything stateful.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.utils.checkpoint as _tuc
from torch._C._functorch import is_batchedtensor

from .. import _state


Tensor = torch.Tensor
Module = torch.nn.Module


def _differentiable_dtype(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _base(t: Tensor) -> Tensor:
    """The tensor under every torch.func wrapper."""
    while _is_wrapped(t):
        t = _unwrapped(t)
    return t


def _carries_gradient(t: Tensor) -> bool:
    return _state.requires_grad_anywhere(t) or _state.is_functorch_wrapped_tensor(t)


def _version(t: Tensor) -> Optional[int]:
    try:
        return t._version
    except Exception:  # noqa: BLE001 - a functorch wrapper has no version counter of its own
        return None


#: whether a tensor shares its memory copy on write (``torch._lazy_clone``, see ``later_writes``);
#: None on a torch that cannot tell
_is_cow = getattr(torch._C, "_is_cow_tensor", None)


def _storage_start(t: Tensor) -> int:
    """Where a tensor's storage starts (a tensor under no torch.func wrapper), as the recompute compares
    memory.  A copy on write (and the tensor it was made from) is named by its storage object instead:
    ``data_ptr()`` would make the copy (measured), and until a write the two share no element a write
    could reach."""
    storage = t.untyped_storage()
    if _is_cow is not None and _is_cow(t):
        return storage._cdata
    return storage.data_ptr()


def _reach(t: Tensor) -> Tuple[bool, bool]:
    """``(reachable, tangent reachable)``: whether a grad or jvp level wraps ``t`` (at any depth, through
    vmap's wrappers) or it requires grad; and whether such a level wraps it (eager requires_grad
    carries no tangent).  One walk down its wrappers."""
    requires_grad = False
    while True:
        if t.requires_grad:
            requires_grad = True
        if not _is_wrapped(t):
            return requires_grad, False
        if not is_batchedtensor(t):
            return True, True
        t = _unwrapped(t)


_is_wrapped, _unwrapped = torch._C._functorch.is_functorch_wrapped_tensor, torch._C._functorch.get_unwrapped


#: a functorch interpreter's ``key().value`` for each transform (comparing ints: ``key().name``
#: builds a string per call), read in the levels, the rules and the plan
GRAD_KEY = int(torch._C._functorch.TransformType.Grad)
JVP_KEY = int(torch._C._functorch.TransformType.Jvp)
VMAP_KEY = int(torch._C._functorch.TransformType.Vmap)


#: a vmap interpreter's randomness, as torch.func spells it (``VmapInterpreter.randomness()``)
RANDOMNESS_NAMES = {
    torch._C._functorch.RandomnessType.Error: "error", torch._C._functorch.RandomnessType.Same: "same",
    torch._C._functorch.RandomnessType.Different: "different",
}


#: selective checkpointing's forward mode: fallback's plain run and the recompute here leave it out
SELECTIVE_CACHING_MODE = getattr(_tuc, "_CachingTorchDispatchMode", ())
