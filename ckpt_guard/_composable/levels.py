"""The recompute's ``autograd.Function`` applied level by level, without torch's per-call class.

torch.func transforms an ``autograd.Function`` with ``setup_context`` through
a higher-order operator (``torch._functorch.autograd_function``): at a grad or
jvp level it builds a *new* ``_SingleLevelFunction`` subclass for that call
(``generate_single_level_function``), whose forward unwraps the operands one
level, applies the Function again one level down and wraps the outputs; at a
vmap level it calls the Function's ``vmap`` staticmethod.  Per call that is a
class made with ``type()``, ``inspect.signature`` of ``forward`` twice, and
pytree walks of the operands at each level: about half of what the composable
recompute cost per block in a ``grad`` step (``benchmarks/blocks.py``).

:func:`apply` does the same walk down the levels with one class made once
(:class:`_AtGradLevel`): its forward reads the level it runs at from the
interpreter on top of the stack (the one torch would have closed over), and
its ``setup_context`` / ``backward`` / ``jvp`` are the Function's own, as in
the class torch generates.  Before it, as torch's dispatch does, a dead
wrapper is unwrapped and every operand lifted to the level (a tensor the
level does not wrap yet, a buffer, is wrapped: the Function then saves the
level's wrapper, whose version an in-place update of the buffer does not
move, so the recompute's own check on the buffer speaks, not autograd's).
A vmap level calls the Function's ``vmap`` rule as torch's
``custom_function_call_vmap`` does (operands unbatched at the level, the
level skipped where none is batched there, outputs batched by the rule's
out_dims); a functionalize level goes through torch's own rule.  With no
transform active it is the Function's plain ``apply`` (dead wrappers
unwrapped, as ``Function.apply`` does).

:func:`vjp` is ``torch.func``'s ``vjp`` (``_vjp_with_argnums``) for a function
of a flat tuple of tensors to a tuple of tensors, which is what every
recompute is: the same level, wrapping, ``requires_grad_`` and
``_autograd_grad``, without the pytree walks a general ``vjp`` needs.

The Function this serves takes its operands flat (a node, then tensors) and
returns a tuple of tensors, so no pytree is needed: the operands are unwrapped
and the outputs wrapped by a loop.  An output that *is* one of the unwrapped
operands is given back as that operand (the identity torch's
``wrap_outputs_maintaining_identity`` keeps).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence, Tuple

import torch
import torch._C._functorch as _functorch_c
from torch._C._functorch import _add_batch_dim, _unwrap_batched, _unwrap_for_grad, _wrap_for_grad
from torch._C._functorch import peek_interpreter_stack as _peek_interpreter_stack
from torch._functorch import pyfunctorch
from torch._functorch import eager_transforms as _eager
from torch._functorch.autograd_function import VmapInfo as _VmapInfo
from torch._functorch.autograd_function import custom_function_call
from torch._C._functorch import unwrap_if_dead as _unwrap_if_dead
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch.autograd.function import _SingleLevelFunction

Tensor = torch.Tensor

_transforms_active = torch._C._are_functorch_transforms_active
#: the levels :func:`apply` applies itself, and how each lifts an operand (torch's ``process``)
_LIFTS = {"Grad": _functorch_c.CGradInterpreterPtr, "Jvp": _functorch_c.CJvpInterpreterPtr}

#: the Function class :func:`apply` serves (set by ``_composable``, which defines it)
FUNCTION: Any = None


def _without_dead_wrappers(t: Tensor) -> Tensor:
    """``t`` with every dead wrapper around it unwrapped, not only the outermost as torch's
    ``unwrap_dead_wrappers`` does (torch's dispatcher unwraps one at each level it passes).

    A tensor a transform left behind in a module after it exited (an RNN's ``_flat_weights``
    after ``jacrev(jacrev(...))`` of a ``functional_call``: measured) is a dead wrapper of a
    dead wrapper: lifted half-unwrapped, it fails functorch's "escaped?" assertion.
    """
    inner = _unwrap_if_dead(t)
    while inner is not t:
        t, inner = inner, _unwrap_if_dead(inner)
    return t


def apply(node: Any, *tensors: Tensor) -> Tuple[Tensor, ...]:
    """``FUNCTION.apply(node, *tensors)``, as torch.func would run it at the levels alive now."""
    # a wrapper of a level that has exited (a pullback called after its vjp returned) is unwrapped
    # first, at every level: torch's dispatch_functorch does it, where the C dispatcher would
    tensors = [_without_dead_wrappers(t) for t in tensors]
    if not _transforms_active():
        return _plain_apply(FUNCTION, node, *tensors)
    top = _peek_interpreter_stack()
    lift = _LIFTS.get(top.key().name)
    if lift is not None:
        # every operand is the level's from here on (torch's interpreter.lift): a tensor the level
        # does not wrap yet (a buffer) is wrapped, so what the Function saves is the level's wrapper
        lift = lift(top).lift
        tensors = [lift(t) for t in tensors]
        with enable_single_level_autograd_function():
            return _plain_apply(_AtGradLevel, node, *tensors)
    if top.key().name == "Vmap":
        return _at_vmap_level(top, node, tensors)
    return custom_function_call(FUNCTION, node, *tensors)  # functionalize: torch's own rule


def _at_vmap_level(top: Any, node: Any, tensors: Sequence[Any]) -> Tuple[Tensor, ...]:
    """torch's ``custom_function_call_vmap`` for FUNCTION: its ``vmap`` rule on the operands unbatched
    at this level (skipped where none is batched there), the outputs batched by its out_dims."""
    interpreter = pyfunctorch.coerce_cinterpreter(top)
    level = top.level()
    unwrapped, in_dims = [], [None]  # the node is not batched
    for t in tensors:
        u, d = _unwrap_batched(t, level) if isinstance(t, Tensor) else (t, None)
        unwrapped.append(u)
        in_dims.append(d)
    if all(d is None for d in in_dims):
        with interpreter.lower():
            return apply(node, *tensors)
    info = _VmapInfo(batch_size=interpreter.batch_size(), randomness=interpreter.randomness())
    with interpreter.lower():
        outputs, out_dims = FUNCTION.vmap(info, tuple(in_dims), node, *unwrapped)
    given = {id(u): o for u, o in zip(unwrapped, tensors)}
    return tuple(
        given[id(o)] if id(o) in given else (o if d is None else _add_batch_dim(o, d, level))
        for o, d in zip(outputs, out_dims)
    )


def _plain_apply(cls: Any, *operands: Any) -> Any:
    """The C ``apply`` of ``cls``: what ``Function.apply`` ends in, without binding default arguments
    (the operands are positional, with no defaults) or routing through torch.func again."""
    return super(_SingleLevelFunction, cls).apply(*operands)


class _AtGradLevel(_SingleLevelFunction):
    """The grad (or jvp) level on top of the stack, for FUNCTION: what torch generates per call, once.

    ``forward`` runs with that level's interpreter still on top: it unwraps the
    operands from it, applies FUNCTION one level down (grad and forward grad
    enabled, as torch's generated forward does), and wraps the outputs at it.
    """

    @staticmethod
    def forward(node: Any, *operands: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        interpreter = pyfunctorch.retrieve_current_functorch_interpreter()
        level = interpreter.level()
        unwrapped = [_unwrap_for_grad(t, level) if isinstance(t, Tensor) else t for t in operands]
        with torch.enable_grad(), _set_fwd_grad_enabled(True), interpreter.lower():
            outputs = apply(node, *unwrapped)
        given = {id(u): o for u, o in zip(unwrapped, operands)}
        return tuple(given[id(o)] if id(o) in given else _wrap_for_grad(o, level) for o in outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        return FUNCTION.setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        return FUNCTION.backward(ctx, *grads)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:  # type: ignore[override]
        return FUNCTION.jvp(ctx, *tangents)


_NO_SAVED_TENSOR_HOOKS = (
    "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. "
    "Please open an issue with your use case."
)  # torch's own message (torch._functorch.vmap.doesnt_support_saved_tensors_hooks)
_disable_inference_mode = getattr(_eager, "_disable_inference_mode", contextlib.nullcontext)


def vjp(
    function: Callable[..., Tuple[Tensor, ...]], tensors: Sequence[Tensor], wanted: Sequence[int],
) -> Tuple[Tuple[Tensor, ...], Callable[[Sequence[Tensor]], Tuple[Tensor, ...]]]:
    """``(outputs, pullback)`` of ``function(*tensors)`` with respect to ``tensors[i]`` for ``i`` in ``wanted``.

    What ``torch.func``'s ``_vjp_with_argnums(function, *tensors, argnums=wanted)``
    does: every tensor wrapped at a new grad level (a buffer updated in place
    is the level's own to update), the wanted ones requiring grad, the outputs
    unwrapped; the pullback (called after the level has exited, as torch's is)
    takes the cotangents in the outputs' order and returns one gradient per
    wanted tensor, a zero where the output does not depend on it.
    """
    with torch.autograd.graph.disable_saved_tensors_hooks(_NO_SAVED_TENSOR_HOOKS):
        with _eager.grad_increment_nesting() as level, torch.enable_grad():
            primals = [_wrap_for_grad(t, level) for t in tensors]
            with _eager.enable_inplace_requires_grad(True):
                differentiated = [primals[i].requires_grad_() for i in wanted]
            outputs = tuple(function(*primals))
            results = tuple(_unwrap_for_grad(o, level) for o in outputs)

    def pullback(cotangents: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        create_graph = torch.is_grad_enabled()
        with torch.autograd.graph.disable_saved_tensors_hooks(_NO_SAVED_TENSOR_HOOKS), _disable_inference_mode():
            return _eager._autograd_grad(
                outputs, differentiated, tuple(cotangents), retain_graph=True, create_graph=create_graph,
            )  # the level has exited: its wrappers are dead, the gradients are the level below's

    return results, pullback
