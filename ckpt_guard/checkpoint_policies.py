"""Ready save policies for checkpointing, with JAX's meaning (``jax.checkpoint_policies``).

A save policy decides, per operation of a checkpointed block, whether the
forward keeps its output or the backward computes it again.  These are
torch's own selective-checkpointing policies (torch >= 2.5), so they work with
torch's checkpoint as well as with ``ckpt_guard.checkpoint``, which also keeps
them under torch.func transforms (``docs/save-policies.md``)::

    import ckpt_guard
    from ckpt_guard import checkpoint_policies as cp

    h = ckpt_guard.checkpoint(block, h, context_fn=cp.context_fn(cp.dots_saveable))

    # or by name, in the block: attn = ckpt_guard.checkpoint_name(attn, "attn_out")
    h = ckpt_guard.checkpoint(block, h, context_fn=cp.context_fn(cp.save_only_these_names("attn_out")))

============================================  ==========================================
``everything_saveable``                       keep every output (no recompute; the memory
                                              of no checkpoint, for comparisons)
``nothing_saveable``                          keep nothing: plain checkpointing
``dots_saveable``                             keep matrix products (``mm``, ``addmm``,
                                              ``bmm``, ``baddbmm``, ``mv``, ``addmv``, ``dot``)
``dots_with_no_batch_dims_saveable``          keep ``mm``/``addmm``/``mv``/``addmv``/``dot``
                                              only (not ``bmm``: attention's products)
``offload_dots``                              matrix products kept as CPU copies while a
                                              device computes (torch with CPU offload)
``save_only_these_names(*names)``             keep the values named with
                                              ``ckpt_guard.checkpoint_name``
============================================  ==========================================

Names are seen by ``ckpt_guard.checkpoint`` only: a name is given after the
operation that made the value ran, which torch's own selective checkpointing
cannot look back to.  ``ckpt_guard.checkpoint`` with a naming policy therefore
runs its own recompute outside torch.func too; torch's checkpoint given one
warns that it saves nothing.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, FrozenSet

import torch
import torch.utils.checkpoint as _tuc

__all__ = [
    "context_fn",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "offload_dots",
    "save_only_these_names",
]

_aten = torch.ops.aten
#: torch >= 2.5: policies return a CheckpointPolicy
_POLICY = getattr(_tuc, "CheckpointPolicy", None)

#: matrix products with a batch dimension (attention's scores and values)
BATCHED_DOTS: FrozenSet[Any] = frozenset({_aten.bmm.default, _aten.baddbmm.default})
#: matrix products without one (a Linear layer's)
UNBATCHED_DOTS: FrozenSet[Any] = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.mv.default, _aten.addmv.default, _aten.dot.default,
})
DOTS: FrozenSet[Any] = BATCHED_DOTS | UNBATCHED_DOTS


def _needs_policies(what: str) -> None:
    if _POLICY is None:
        raise RuntimeError(
            f"ckpt_guard.checkpoint_policies.{what}: save policies need torch >= 2.5 (selective "
            f"checkpointing's API, torch.utils.checkpoint.CheckpointPolicy); torch {torch.__version__} has "
            "only a compile-only private form. Upgrade torch, or checkpoint without a policy"
        )


def _save_if(keep: bool) -> Any:
    return _POLICY.MUST_SAVE if keep else _POLICY.PREFER_RECOMPUTE


def everything_saveable(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep every output: nothing is recomputed (JAX's ``everything_saveable``)."""
    return _POLICY.MUST_SAVE


def nothing_saveable(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep nothing: every operation is recomputed (JAX's ``nothing_saveable``; plain checkpointing)."""
    return _POLICY.PREFER_RECOMPUTE


def dots_saveable(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep the outputs of matrix products, recompute the rest (JAX's ``dots_saveable``)."""
    return _save_if(op in DOTS)


def dots_with_no_batch_dims_saveable(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep matrix products without a batch dimension (JAX's ``dots_with_no_batch_dims_saveable``)."""
    return _save_if(op in UNBATCHED_DOTS)


def offload_dots(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep matrix products as CPU copies while a device computes; on the CPU it is ``dots_saveable``."""
    if op not in DOTS:
        return _POLICY.PREFER_RECOMPUTE
    offload = getattr(_POLICY, "MUST_CPU_OFFLOAD", None)
    if offload is None:
        raise RuntimeError(
            f"ckpt_guard.checkpoint_policies.offload_dots: torch {torch.__version__}'s CheckpointPolicy has no "
            "MUST_CPU_OFFLOAD (a newer torch has it); use dots_saveable to keep them on the device"
        )
    return offload


class save_only_these_names:  # noqa: N801 - named as JAX's function, and used like one
    """Keep only the values named with ``ckpt_guard.checkpoint_name(value, name)`` (JAX's meaning).

    Naming a value keeps the output of the operation that made it (a view of an
    operation's output keeps that output); everything else is recomputed.  A
    listed name the block never gives warns, naming it.
    """

    def __init__(self, *names: str) -> None:
        bad = [n for n in names if not isinstance(n, str)]
        if bad or not names:
            hint = ""
            if len(names) == 1 and isinstance(names[0], (list, tuple, set, frozenset)):
                hint = f"; pass them as separate arguments: save_only_these_names(*{list(names[0])!r})"
            raise TypeError(
                f"save_only_these_names{names!r}: give one or more names (str), as passed to "
                f"ckpt_guard.checkpoint_name(value, name){hint}"
            )
        self.saved_names: FrozenSet[str] = frozenset(names)
        self._warned = False

    def __repr__(self) -> str:
        return f"save_only_these_names({', '.join(map(repr, sorted(self.saved_names)))})"

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        # only torch's own selective checkpointing calls this (ckpt_guard's reads saved_names)
        if not self._warned:
            self._warned = True
            from ._composable.residuals import user_stacklevel

            warnings.warn(
                f"{self!r} under torch's own checkpoint: torch's selective checkpointing cannot see "
                "ckpt_guard.checkpoint_name (a name comes after the operation ran), so nothing is saved by "
                "name here; use ckpt_guard.checkpoint(block, ..., context_fn=...), which does",
                UserWarning, stacklevel=user_stacklevel(),
            )
        return _POLICY.PREFER_RECOMPUTE if _POLICY is not None else False


def context_fn(policy: Any) -> Callable[[], Any]:
    """The ``context_fn`` that applies ``policy`` (torch's ``create_selective_checkpoint_contexts``):
    a policy function, or a list of operations to save (``[torch.ops.aten.mm.default, ...]``)."""
    _needs_policies("context_fn")
    if isinstance(policy, (list, tuple, set, frozenset)):
        bad = [op for op in policy if not isinstance(op, torch._ops.OpOverload)]
        if bad:
            raise TypeError(
                f"checkpoint_policies.context_fn({policy!r}): a list of operations holds OpOverloads such as "
                f"torch.ops.aten.mm.default, not {bad[0]!r}"
            )
        policy = list(policy)
    elif not callable(policy):
        raise TypeError(
            f"checkpoint_policies.context_fn({policy!r}): a policy is a function (ctx, op, *args, **kwargs) -> "
            "CheckpointPolicy, e.g. checkpoint_policies.dots_saveable, or a list of operations to save"
        )
    return functools.partial(_tuc.create_selective_checkpoint_contexts, policy)


def is_policy_not_context_fn(value: Any) -> bool:
    """Whether ``value``, given as ``context_fn``, is one of this module's policies (not a context_fn)."""
    return isinstance(value, save_only_these_names) or value in _READY


#: the policies of this module (a ``context_fn=`` given one of these forgot ``context_fn(...)``)
_READY = (
    everything_saveable, nothing_saveable, dots_saveable, dots_with_no_batch_dims_saveable, offload_dots,
)


def names_policy_of(context_fn: Any) -> Any:
    """The naming policy a ``context_fn`` applies (``save_only_these_names``), else None."""
    if isinstance(context_fn, functools.partial) and context_fn.args:
        policy = context_fn.args[0]
        if isinstance(policy, save_only_these_names):
            return policy
    return None
