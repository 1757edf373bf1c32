"""A torch patched as JetBrains' opaque patches it, for the coexistence tests (issue 48, item 4).

A faithful stand-in of the two opaque patches that change what checkpointing does under torch.func
(JetBrains-Research/opaque, Apache-2.0, ``packages/opaque-patches/src/opaque/api/patches/torch/
checkpoint/``; read at commit 2a2c5de9):

* ``saved_tensor_hooks_guard``: torch.func's ``grad`` and ``vjp`` switch saved-tensor hooks off only
  at higher order (another grad or jvp level below them) or while compiling; at first order they are
  allowed, so torch's non-reentrant checkpoint (and ``save_on_cpu``) run under ``vmap(grad(f))``;
* ``reparametrize_recompute``: ``functional_call``'s swaps are recorded while active, and a
  checkpoint's recompute re-enters those recorded at its forward;
* and ``save_on_cpu``, which opaque applies with the first: its pinned copy made by ``empty_like``,
  which vmap batches (torch's ``empty(size)`` is not, and the copy into it fails under vmap).

The real patches were also run by hand against ckpt_guard (the closing note of 2026-12-06 says
where); CI cannot reach the repository, so the tests use this stand-in.  ``opaque_patches()`` applies
them and takes them off again.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, List, Tuple

import torch

_HIGHER_ORDER = (
    "torch.func transforms (grad, vjp, jacrev, hessian) don't support saved tensor hooks under "
    "higher-order differentiation such as grad(grad) or hessian (opaque's scoped guard)"
)
_COMPILE = "torch.func transforms don't support saved tensor hooks under torch.compile (opaque's scoped guard)"


def _scoped_hooks_guard(unguarded: Any) -> Any:
    """opaque's ``_disable_saved_tensor_hooks_for_higher_order``."""

    @functools.wraps(unguarded)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            with torch.autograd.graph.disable_saved_tensors_hooks(_COMPILE):
                return unguarded(*args, **kwargs)
        from torch._C._functorch import TransformType, get_interpreter_stack

        stack = get_interpreter_stack()
        if stack and any(i.key() in (TransformType.Grad, TransformType.Jvp) for i in stack):
            with torch.autograd.graph.disable_saved_tensors_hooks(_HIGHER_ORDER):
                return unguarded(*args, **kwargs)
        return unguarded(*args, **kwargs)

    return dispatch


@contextlib.contextmanager
def opaque_patches() -> Iterator[None]:
    """torch as opaque's ``apply_checkpoint_patch`` leaves it (the two patches above), for the block."""
    import torch._functorch.eager_transforms as eager
    import torch.nn.utils.stateless as stateless
    from torch.utils.checkpoint import _CheckpointFrame

    undo: List[Tuple[Any, str, Any]] = []
    for name in ("grad_and_value_impl", "_vjp_with_argnums"):
        current = getattr(eager, name)
        unguarded = getattr(current, "__wrapped__", None)
        if unguarded is not None:
            undo.append((eager, name, current))
            setattr(eager, name, _scoped_hooks_guard(unguarded))

    active = threading.local()

    def stack() -> list:
        if not hasattr(active, "stack"):
            active.stack = []
        return active.stack

    original_reparametrize = stateless._reparametrize_module

    @contextlib.contextmanager
    def _reparametrize_module(module, parameters_and_buffers, tie_weights=False, strict=False, stack_weights=False):
        params = (
            stateless._untie_named_tensors_map(module, parameters_and_buffers) if tie_weights
            else parameters_and_buffers
        )
        stack().append((module, params))
        try:
            with original_reparametrize(module, parameters_and_buffers, tie_weights=tie_weights, strict=strict,
                                        stack_weights=stack_weights):
                yield
        finally:
            stack().pop()

    undo.append((stateless, "_reparametrize_module", original_reparametrize))
    stateless._reparametrize_module = _reparametrize_module

    original_init = _CheckpointFrame.__init__

    def __init__(self, recompute_fn, *args, **kwargs):
        snapshot = list(stack())
        if snapshot:
            def rebinding_recompute(*a, _fn=recompute_fn, _snapshot=snapshot):
                with contextlib.ExitStack() as entered:
                    for module, params in _snapshot:
                        entered.enter_context(original_reparametrize(module, params, tie_weights=False))
                    return _fn(*a)

            recompute_fn = rebinding_recompute
        original_init(self, recompute_fn, *args, **kwargs)

    undo.append((_CheckpointFrame, "__init__", original_init))
    _CheckpointFrame.__init__ = __init__

    import torch.autograd.graph as graph

    original_save_on_cpu = graph.save_on_cpu

    class _VmapSaveOnCpu(original_save_on_cpu):  # type: ignore[misc, valid-type]
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            device_module = getattr(torch, device_type, torch.cuda)

            def pack_to_cpu(tensor):
                if not pin_memory:
                    return (tensor.device, tensor.cpu())
                pinnable = device_module.is_available() and not tensor.is_sparse
                packed = torch.empty_like(tensor, device="cpu", pin_memory=pinnable)
                packed.copy_(tensor, non_blocking=pinnable)
                return (tensor.device, packed)

            def unpack_from_cpu(packed):
                device, tensor = packed
                return tensor.to(device, non_blocking=pin_memory)

            torch.autograd.graph.saved_tensors_hooks.__init__(self, pack_to_cpu, unpack_from_cpu)

    undo.append((graph, "save_on_cpu", original_save_on_cpu))
    graph.save_on_cpu = _VmapSaveOnCpu
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def first_order_hooks_allowed() -> bool:
    """Whether saved-tensor hooks are on inside ``vmap(grad(f))`` on this torch, measured.

    Under the patches on torch 2.13 they are; on torch 2.4, ``vmap`` switches them off itself (a
    guard opaque does not scope), so the patched torch refuses what the stock one does.
    """
    seen = []

    def f(x):
        seen.append(torch._C._autograd._saved_tensors_hooks_is_enabled())
        return x.sin().sum()

    torch.func.vmap(torch.func.grad(f))(torch.ones(2, 1))
    return seen[0]
