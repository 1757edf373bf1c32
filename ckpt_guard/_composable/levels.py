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
unwrapped, as ``Function.apply`` does), or, where nothing there can
differentiate it (no operand requires grad, no dual level: the bottom of a
``torch.func.grad``), its ``forward`` alone, as that ``apply`` would run it.

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
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch._C._functorch as _functorch_c
from torch._C._functorch import _add_batch_dim, _remove_batch_dim, _unwrap_batched, _unwrap_for_grad, _wrap_for_grad
from torch._C._functorch import get_interpreter_stack as _get_interpreter_stack
from torch._C._functorch import peek_interpreter_stack as _peek_interpreter_stack
from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack as _temporarily_pop_interpreter_stack
from torch._functorch import eager_transforms as _eager
from torch._functorch import vmap as _torch_vmap
from torch._functorch.autograd_function import VmapInfo as _VmapInfo
from torch._functorch.autograd_function import custom_function_call
from torch._C._functorch import unwrap_if_dead as _unwrap_if_dead
from torch.autograd import forward_ad as _forward_ad
from torch.autograd.function import _SingleLevelFunction
from torch.autograd.graph import _engine_run_backward

from .basics import GRAD_KEY as _GRAD, JVP_KEY as _JVP, RANDOMNESS_NAMES, VMAP_KEY as _VMAP
from .. import _state

Tensor = torch.Tensor

_transforms_active = torch._C._are_functorch_transforms_active
_increment_version = torch._C._increment_version
_pop_dynamic_layer_stack, _push_dynamic_layer_stack = (
    _functorch_c.pop_dynamic_layer_stack, _functorch_c.push_dynamic_layer_stack,
)
_is_fwd_grad_enabled, _set_fwd_grad = torch._C._is_fwd_grad_enabled, torch._C._set_fwd_grad_enabled
_single_level_allowed = _functorch_c.get_single_level_autograd_function_allowed
_allow_single_level = _functorch_c.set_single_level_autograd_function_allowed
#: the levels :func:`apply` applies itself, and how each lifts an operand (torch's ``process``)
_LIFTS = {_GRAD: _functorch_c.CGradInterpreterPtr, _JVP: _functorch_c.CJvpInterpreterPtr}

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
        if _forward_ad._current_level < 0 and not any(t.requires_grad for t in tensors):
            return _forward_only(node, tensors)
        return _plain_apply(FUNCTION, node, *tensors)
    top = _peek_interpreter_stack()
    key = top.key().value
    lift = _LIFTS.get(key)
    if lift is not None:
        # every operand is the level's from here on (torch's interpreter.lift): a tensor the level
        # does not wrap yet (a buffer) is wrapped, so what the Function saves is the level's wrapper
        lift = lift(top).lift
        tensors = [lift(t) for t in tensors]
        allowed = _single_level_allowed()  # torch's enable_single_level_autograd_function(), in C
        _allow_single_level(True)
        try:
            return _plain_apply(_AtGradLevel, node, *tensors)
        finally:
            _allow_single_level(allowed)
    if key == _VMAP:
        return _at_vmap_level(top, node, tensors)
    return custom_function_call(FUNCTION, node, *tensors)  # functionalize: torch's own rule


def _at_vmap_level(top: Any, node: Any, tensors: Sequence[Any]) -> Tuple[Tensor, ...]:
    """torch's ``custom_function_call_vmap`` for FUNCTION: its ``vmap`` rule on the operands unbatched
    at this level (skipped where none is batched there), the outputs batched by its out_dims."""
    level = top.level()
    unwrapped, in_dims = [], [None]  # the node is not batched
    for t in tensors:
        u, d = _unwrap_batched(t, level) if isinstance(t, Tensor) else (t, None)
        unwrapped.append(u)
        in_dims.append(d)
    saved = _pop_dynamic_layer_stack()  # the level lowered (its interpreter's lower(), in C)
    try:
        if all(d is None for d in in_dims):
            return apply(node, *tensors)
        vmap = _functorch_c.CVmapInterpreterPtr(top)
        info = _VmapInfo(batch_size=vmap.batchSize(), randomness=RANDOMNESS_NAMES[vmap.randomness()])
        outputs, out_dims = FUNCTION.vmap(info, tuple(in_dims), node, *unwrapped)
    finally:
        _push_dynamic_layer_stack(saved)
    given = {id(u): o for u, o in zip(unwrapped, tensors)}
    return tuple(
        given[id(o)] if id(o) in given else (o if d is None else _add_batch_dim(o, d, level))
        for o, d in zip(outputs, out_dims)
    )


def _forward_only(node: Any, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """``FUNCTION.apply(node, *tensors)`` where nothing can differentiate it: no transform, no
    dual level, no operand requiring grad (the level under ``grad`` in a ``torch.func.grad`` of
    ``functional_call``, where every block ends).  The C ``apply`` would record nothing there:
    it runs ``forward`` with grad and forward grad off, and calls ``setup_context`` for a
    backward that cannot come.  That is done here without it (~10 µs per block and step; the
    outputs are never operands, so no identity is to keep).
    """
    grad, forward_grad = _is_grad_enabled(), _is_fwd_grad_enabled()
    _set_grad_enabled(False)
    _set_fwd_grad(False)
    try:
        return FUNCTION.forward(node, *tensors)
    finally:
        _set_fwd_grad(forward_grad)
        _set_grad_enabled(grad)


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
        top = _peek_interpreter_stack()
        level = top.level()
        unwrapped = [_unwrap_for_grad(t, level) if isinstance(t, Tensor) else t for t in operands]
        # torch's generated forward runs under enable_grad and forward grad enabled, then lowers the
        # level (its interpreter's lower(): a grad level whose prior grad mode was off lowers under
        # no_grad, a jvp level likewise for forward grad); done here with the C calls those make
        key = top.key().value
        inside_grad = key != _GRAD or _functorch_c.CGradInterpreterPtr(top).prevGradMode()
        inside_fwd = key != _JVP or _functorch_c.CJvpInterpreterPtr(top).prevFwdGradMode()
        grad_before, fwd_before = _is_grad_enabled(), _is_fwd_grad_enabled()
        _set_grad_enabled(inside_grad)
        _set_fwd_grad(inside_fwd)
        saved = _pop_dynamic_layer_stack()
        try:
            outputs = apply(node, *unwrapped)
        finally:
            _push_dynamic_layer_stack(saved)
            _set_fwd_grad(fwd_before)
            _set_grad_enabled(grad_before)
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

# torch's own context managers for these are generators (``contextlib.contextmanager``): a few
# microseconds each, entered several times per block and step.  The C calls they make, here:
_hooks_disabled_message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
_disable_hooks = torch._C._autograd._saved_tensors_hooks_disable
_enable_hooks = torch._C._autograd._saved_tensors_hooks_enable
_inplace_requires_grad_allowed = _functorch_c.get_inplace_requires_grad_allowed
_allow_inplace_requires_grad = _functorch_c.set_inplace_requires_grad_allowed
_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled


_hooks_set_aside = _state.hooks_set_aside  # the user's hooks, off the recompute's own level (see vjp)
_hooks_put_back = _state.hooks_put_back


def _hooks_back(previous: Any) -> None:
    """Saved-tensor hooks as they were before ``_disable_hooks`` (torch's disable_saved_tensors_hooks' exit)."""
    if previous is None:
        _enable_hooks()
    else:
        _disable_hooks(previous)


def vjp(
    function: Callable[..., Tuple[Tensor, ...]], tensors: Sequence[Tensor], wanted: Sequence[int],
    marked: Sequence[int] = (), written: Sequence[int] = (),
) -> Tuple[Tuple[Tensor, ...], Callable[[Sequence[Tensor]], Tuple[Tensor, ...]]]:
    """``(outputs, pullback)`` of ``function(*tensors)`` with respect to ``tensors[i]`` for ``i`` in ``wanted``.

    What ``torch.func``'s ``_vjp_with_argnums(function, *tensors, argnums=wanted)``
    does: every tensor wrapped at a new grad level (a buffer updated in place
    is the level's own to update), the wanted ones requiring grad, the outputs
    unwrapped; the pullback (called after the level has exited, as torch's is)
    takes the cotangents in the outputs' order and returns one gradient per
    wanted tensor, a zero where the output does not depend on it.  ``marked``: more
    tensors made to require grad at the level, not differentiated (the block read them
    requiring grad at its call: it sees them so again, see :func:`as_the_call_saw`).  ``written``:
    tensors whose wrappers' versions are moved once ``function`` ran (the caller wrote into the
    input since its call: the pullback then raises autograd's "modified by an inplace operation"
    where the graph saved one, see ``later_writes``).
    """
    aside = _hooks_set_aside()
    hooks = _hooks_disabled_message()
    _disable_hooks(_NO_SAVED_TENSOR_HOOKS)
    try:
        level = _functorch_c._grad_increment_nesting()
        grad_mode = _is_grad_enabled()
        try:
            _set_grad_enabled(True)
            primals = [_wrap_for_grad(t, level) for t in tensors]
            inplace = _inplace_requires_grad_allowed()
            _allow_inplace_requires_grad(True)
            try:
                differentiated = [primals[i].requires_grad_() for i in wanted]
                for i in marked:
                    primals[i].requires_grad_()
            finally:
                _allow_inplace_requires_grad(inplace)
            outputs = tuple(function(*primals))
            for i in written:
                _increment_version(primals[i])
            results = tuple(_unwrap_for_grad(o, level) for o in outputs)
        finally:
            _set_grad_enabled(grad_mode)
            _functorch_c._grad_decrement_nesting()
    finally:
        _hooks_back(hooks)
        _hooks_put_back(aside)

    def pullback(cotangents: Sequence[Tensor], unreached: str = "zeros") -> Tuple[Optional[Tensor], ...]:
        """The gradients (the level has exited: its wrappers are dead, the gradients are the level
        below's); where the outputs do not reach a wanted tensor, a zero (torch.func's answer), or
        None with ``unreached="none"`` (eager autograd's: a leaf's ``.grad`` stays None)."""
        create_graph = torch.is_grad_enabled()
        aside = _hooks_set_aside()
        try:
            with torch.autograd.graph.disable_saved_tensors_hooks(_NO_SAVED_TENSOR_HOOKS), _disable_inference_mode():
                grads = _gradients(outputs, differentiated, cotangents, create_graph)
        finally:
            _hooks_put_back(aside)
        if unreached == "zeros":
            return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, differentiated))
        return grads

    return results, pullback


def _gradients(
    outputs: Sequence[Tensor], inputs: Sequence[Tensor], cotangents: Sequence[Tensor], create_graph: bool,
) -> Tuple[Optional[Tensor], ...]:
    """torch.func's ``_autograd_grad`` without its zeros: None for an input the outputs do not reach,
    and an output without a cotangent (None: the caller did not use it) left out, as autograd does
    (a zero cotangent would make its inputs' gradients depend on it: zeros where plain leaves None)."""
    # what autograd can differentiate: an output with a graph, or a differentiated input returned as
    # is (a view made under no_grad at a grad level reads requires_grad=True without a grad_fn)
    given = {id(t) for t in inputs}
    pairs = [
        (o, c) for o, c in zip(outputs, cotangents)
        if c is not None and o.requires_grad and (o.grad_fn is not None or id(o) in given)
    ]
    if not pairs:
        return (None,) * len(inputs)
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    disabled = getattr(compiled, "_disable", None)  # as torch's: never compiled autograd in here
    # retain_graph=False: each pullback runs once, so autograd frees each node's buffers as the node
    # runs (with create_graph the new graph holds what it needs); kept until the end, a derivative's
    # activations and all their backward's temporaries were alive at once: reverse over reverse
    # peaked 5 MB above the schedule written by hand at benchmarks/memory.py's medium size
    # autograd's engine called as torch.autograd.grad calls it, without its Python checks (~4 µs per
    # block): the cotangents are never None here, no operand is a tensor subclass (refused), and the
    # engine itself still checks each cotangent's shape against its output
    with disabled() if disabled is not None else contextlib.nullcontext():
        return _engine_run_backward(
            tuple(o for o, _ in pairs), tuple(c for _, c in pairs), False, create_graph, tuple(inputs), True,
            accumulate_grad=False,
        )


def as_the_call_saw(run: Callable[[Sequence[Tensor]], Tuple[Tensor, ...]], tensors: Sequence[Tensor], plan: Any) -> Tuple[Tensor, ...]:
    """``run(tensors)``, the block seeing ``requires_grad`` as it did at the call.

    A block may branch on it (``if x.requires_grad``; nn.MultiheadAttention's
    fast-path test), and a recompute's levels are not the call's: its vjp level
    makes what it differentiates read True, a vmap or jvp level on top makes
    what it wraps read False, whatever lies below.  What the block reads is
    decided by the level on top (a wrapper reads its own level's flag, and what
    the block computes is wrapped at the top level), so where the recompute's
    top is not the call's kind, or an input the block read (``plan.found.requires_grad_read``:
    a module's parameters a ``functional_call`` swapped out are lifted, never
    read) reads otherwise, the block runs under one more level on top, of the
    call's kind: a grad level whose wrappers require grad where the call's
    inputs did, or a jvp level (no tangent) wrapping the inputs the call's jvp
    level wrapped (``plan.at_call.wrapped_at_top``).  Nothing differentiates that level:
    its graph goes when it exits.  Usually nothing differs (``grad``,
    ``vmap(grad)``: :func:`vjp` marks what the call saw requiring grad): a peek
    and one flag read per input.  (A vmap on top at the call is not made again:
    what it wraps reads False, as under the recompute's own vmap.)
    """
    call_top = plan.at_call.top_at_call
    top = _peek_interpreter_stack()
    now = None if top is None else top.key().value
    if call_top == _JVP and now != _JVP:
        return _under_a_jvp_level(run, tensors, plan.at_call.wrapped_at_top)
    if call_top == _GRAD and now != _GRAD:
        return _under_a_grad_level(run, tensors, plan.at_call.needs)
    for i, need in plan.found.requires_grad_read:
        if tensors[i].requires_grad is not need:
            return _under_a_grad_level(run, tensors, plan.at_call.needs)
    return run(tensors)


def _under_a_grad_level(
    run: Callable[[Sequence[Tensor]], Tuple[Tensor, ...]], tensors: Sequence[Tensor], needs: Sequence[bool],
) -> Tuple[Tensor, ...]:
    level = _functorch_c._grad_increment_nesting()
    try:
        given = [_wrap_for_grad(t, level) for t in tensors]
        inplace = _inplace_requires_grad_allowed()
        _allow_inplace_requires_grad(True)
        try:
            for t, need in zip(given, needs):
                if need:
                    t.requires_grad_()
        finally:
            _allow_inplace_requires_grad(inplace)
        return tuple(_unwrap_for_grad(o, level) for o in run(given))
    finally:
        _functorch_c._grad_decrement_nesting()


def _under_a_jvp_level(
    run: Callable[[Sequence[Tensor]], Tuple[Tensor, ...]], tensors: Sequence[Tensor], wrapped: Sequence[int],
) -> Tuple[Tensor, ...]:
    level = _functorch_c._jvp_increment_nesting()
    try:
        given = list(tensors)
        for i in wrapped:
            given[i] = _wrap_for_grad(given[i], level)
        return tuple(_unwrap_for_grad(o, level) for o in run(given))
    finally:
        _functorch_c._jvp_decrement_nesting()


#: torch 2.4-2.7's vmap disables saved-tensor hooks inside it (its _flat_vmap is wrapped so)
_VMAP_DISABLES_HOOKS = hasattr(_torch_vmap._flat_vmap, "__wrapped__")
_VMAP_HOOKS_MESSAGE = (
    "torch.func transforms don't yet support saved tensor hooks. Please open an issue with your use case."
)


def vmap(
    function: Callable[..., Tuple[Tensor, ...]], tensors: Sequence[Tensor], in_dims: Sequence[Optional[int]],
    batch_size: int, randomness: str,
) -> Tuple[Tuple[Tensor, ...], List[bool]]:
    """``torch.vmap(function, in_dims, randomness=randomness)(*tensors)`` for a function of a flat
    tuple of tensors to a tuple of tensors, and which outputs the batch reached.

    What ``torch.func``'s ``_flat_vmap`` does (a new vmap level, each tensor
    given a batch dimension where ``in_dims`` says, each output's moved to
    the front, an output the batch did not reach expanded), without the pytree
    walks and checks a general ``vmap`` needs: about 50 µs less per call, and
    the composable recompute vmaps once per block and step under ``vmap(grad)``.
    """
    _torch_vmap.lazy_load_decompositions()
    hooks = None
    if _VMAP_DISABLES_HOOKS:
        hooks = _hooks_disabled_message()
        _disable_hooks(_VMAP_HOOKS_MESSAGE)
    try:
        level = _functorch_c._vmap_increment_nesting(batch_size, randomness)
        try:
            outputs = tuple(function(*[
                t if d is None else _add_batch_dim(t, d, level) for t, d in zip(tensors, in_dims)
            ]))
            batched = [_batched_at(o, level) for o in outputs]
            results = tuple(_remove_batch_dim(o, level, batch_size, 0) for o in outputs)
        finally:
            _functorch_c._vmap_decrement_nesting()
    finally:
        if _VMAP_DISABLES_HOOKS:
            _hooks_back(hooks)
    return results, batched


def _batched_at(t: Tensor, level: int) -> bool:
    """Whether ``t`` is batched at the vmap ``level`` (under any wrappers above it)."""
    while _functorch_c.is_functorch_wrapped_tensor(t):
        if _functorch_c.is_batchedtensor(t) and _functorch_c.maybe_get_level(t) == level:
            return True
        t = _functorch_c.get_unwrapped(t)
    return False


def jvp_under_grad_levels() -> Optional[Tuple[int, List[int]]]:
    """``(jvp level, grad levels above it, top first)`` where the top levels are grad levels
    (or none) over a jvp level; else None (a vmap on top, no jvp, eager)."""
    stack = _get_interpreter_stack() or ()
    above = len(stack)
    while above and stack[above - 1].key().value == _GRAD:
        above -= 1
    if not above or stack[above - 1].key().value != _JVP:
        return None
    return stack[above - 1].level(), [interpreter.level() for interpreter in reversed(stack[above:])]


def tangents_computed(outputs: Sequence[Tensor]) -> Optional[Tuple[int, Tuple[Tensor, ...]]]:
    """``(jvp level, tangents)`` of ``outputs`` computed at the caller's levels, or None.

    Where a jvp level is on top, or right under the grad levels on top
    (``jvp(grad)``, hessian's ``jacfwd(jacrev)``), a run at these levels went
    through it, so its outputs carry that jvp's tangents under their grad
    wrappers: the Function's jvp rule of that level can hand them on instead of
    running the block again under a jvp.  Cut from their graph.  None where no
    such jvp level is alive (a vmap on top).  An output that carries no tangent
    (the duals do not reach it, or an operation without a forward-mode formula
    made it: a torch.library custom_op with only register_autograd) has a zero
    one, as torch.func.jvp gives the plain program (a recompute under a grad
    level for it would fail where such an op refuses one).
    """
    found = jvp_under_grad_levels()
    if found is None:
        return None
    level, grad_levels = found
    with contextlib.ExitStack() as popped:
        for _ in grad_levels:  # the jvp level on top, as for its own unpacking
            popped.enter_context(_temporarily_pop_interpreter_stack())
        tangents = []
        for o in outputs:
            for grad_level in grad_levels:
                o = _unwrap_for_grad(o, grad_level)
            primal, tangent = _state.forward_ad.unpack_dual(o)
            if tangent is None:
                tangents.append(torch.zeros_like(_unwrap_for_grad(primal, level)).detach())
                continue
            tangents.append(_unwrap_for_grad(tangent, level).detach())
    return level, tuple(tangents)
