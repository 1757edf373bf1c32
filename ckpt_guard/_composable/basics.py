"""Tensor helpers every part of the composable recompute shares.

Owns: what counts as differentiable, a view's base, whether a tensor carries a
gradient through functorch's wrappers, its version, and selective checkpointing's
forward mode (left out of fallback's plain run and the recompute).  May not touch:
anything stateful.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint as _tuc
from torch._C._functorch import is_batchedtensor

from .. import _state


Tensor = torch.Tensor


def _differentiable_dtype(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _base(t: Tensor) -> Tensor:
    """The tensor under every torch.func wrapper."""
    while _state.is_functorch_wrapped_tensor(t):
        t = _state.get_unwrapped(t)
    return t


def _carries_gradient(t: Tensor) -> bool:
    return _state.requires_grad_anywhere(t) or _state.is_functorch_wrapped_tensor(t)


def _version(t: Tensor) -> Optional[int]:
    try:
        return t._version
    except Exception:  # noqa: BLE001 - a functorch wrapper has no version counter of its own
        return None


def _tracked(t: Tensor, eager: bool = True) -> bool:
    """Whether a grad or jvp level wraps ``t`` (at any depth), or (``eager``) it requires grad."""
    while True:
        if eager and t.requires_grad:
            return True
        if not _state.is_functorch_wrapped_tensor(t):
            return False
        if not is_batchedtensor(t):
            return True
        t = _state.get_unwrapped(t)


#: selective checkpointing's forward mode: fallback's plain run and the recompute here leave it out
SELECTIVE_CACHING_MODE = getattr(_tuc, "_CachingTorchDispatchMode", ())
