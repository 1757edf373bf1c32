"""Checkpointing that composes with torch.func: a recompute torch.func can transform.

torch's checkpoint is built on saved-tensor hooks (non-reentrant) or on an
``autograd.Function`` without ``setup_context`` (reentrant); torch.func refuses
both.  The recompute here is an ``autograd.Function`` with ``setup_context``
and ``generate_vmap_rule``, which torch.func transforms like any other
operation:

* ``forward`` runs the block under ``no_grad`` and saves only its inputs: the
  block's activations are not kept, which is the memory saving;
* ``backward`` recomputes the block and takes ``torch.func.vjp`` of it;
* ``jvp`` recomputes it under ``torch.func.jvp`` (forward mode: jvp, jacfwd,
  hessian; one forward-mode level: forward over forward would get zero tangents);
* vmap runs all of it per sample (the generated vmap rule).

Every tensor the block reads that may need a gradient must be an input, or its
gradient would be silently zero.  So the modules the block reads (see
``_reads``) have their parameters and buffers *lifted*: passed as inputs and
bound in the recompute through the reparametrization ``functional_call`` uses
(after a ``functional_call`` swap ended, the recompute still reads the
swapped-in tensors).  Tensors bound by ``functools.partial`` are inputs too,
and so are tensors the function holds in its own closure cells
(``grad(lambda w: ... checkpoint(lambda t: t @ w, x))``): each such cell is
pointed at the input while the block runs, and back after.  A closure tensor
is lifted when it needs a gradient or belongs to a torch.func level (a
batched tensor under vmap): the block runs below those levels and must not
read it directly.  Cell redirection is serialized across threads (a cell is
the function's, not the thread's).  A block that holds such a tensor
anywhere else (a global, a default argument, inside a list), reaches a
lifted one another way too (a helper's closure, an object's attribute), or
holds something the walk cannot look into, is not recomputed here:
:func:`plan` says why, and the caller falls back to running it plainly.

The backward is *non-differentiable* (recompute and vjp under ``no_grad``: the
recomputed activations are freed at once) only where nothing can
differentiate its result again: exactly one reverse-mode (grad) level and no
forward-mode or functionalize level at the call, and no tensor it reads
requiring grad outside torch.func.  Elsewhere it is differentiable: correct to
any order (grad of grad, an outer ``.backward()``), but torch.func's reverse
mode then keeps the recomputed activations until the transform exits.  The
gradients flowing into the backward are checked too: one that carries an
eager graph (a trainable layer after the block) makes it differentiable.

The recompute replays what the forward saw: the CPU and device RNG states
(dropout draws the same mask), the default dtype, a ``torch.device(...)``
context (tensors made without a device land where they did), autocast, and a
user ``context_fn``'s recompute context.  Checkpoints nested inside the block run plainly (the outer recompute
already recomputes them).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint as _tuc
from torch.utils import _pytree

from . import _config, _reads, _state

Tensor = torch.Tensor


def _differentiable_dtype(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _base(t: Tensor) -> Tensor:
    """The tensor under every torch.func wrapper."""
    while _state.is_functorch_wrapped_tensor(t):
        t = _state.get_unwrapped(t)
    return t


def _top_level(modules: Sequence[torch.nn.Module]) -> List[torch.nn.Module]:
    """The modules none of the others contains (their parameters cover the rest)."""
    kept: List[torch.nn.Module] = []
    for module in modules:
        if any(module is m for m in kept):
            continue
        if any(module is sub for other in modules if other is not module for sub in other.modules()):
            continue
        kept.append(module)
    return kept


class Plan:
    """One composable checkpoint call: what to run, what is lifted, how to replay it."""

    def __init__(
        self, function: Callable[..., Any], args: tuple, kwargs: dict, modules: List[torch.nn.Module],
        context_fn: Any, preserve_rng_state: bool, differentiable: bool, cells: Sequence[Any] = (),
    ) -> None:
        self.function = function
        self.modules = modules
        #: closure cells of ``function`` whose tensors are lifted (see the module docstring)
        self.cells = list(cells)
        # every module's parameters and buffers by name, then the call's tensors
        self.names = [
            [name for name, _ in _named_tensors(module)] for module in modules
        ]
        lifted = [tensor for module in modules for _, tensor in _named_tensors(module)]
        leaves, self.call_spec = _pytree.tree_flatten((args, kwargs))
        self.tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        self.leaves = leaves
        lifted += [cell.cell_contents for cell in self.cells]
        self.inputs: Tuple[Tensor, ...] = (*lifted, *(leaves[i] for i in self.tensor_slots))
        self.n_lifted = len(lifted)
        self.context_fn = context_fn
        self.preserve_rng_state = preserve_rng_state
        self.differentiable = differentiable
        self.output_spec: Any = None
        self.output_leaves: List[Any] = []
        self.output_slots: List[int] = []
        self.recompute_context: Any = contextlib.nullcontext()
        self.rng: Any = None
        self.autocast: Any = None
        self.default_dtype = torch.get_default_dtype()
        #: a torch.device(...) context's device at the call: the Function's forward
        #: runs without function modes, so it is re-entered there and in the recompute
        self.default_device: Any = _state.forward_device_context()
        #: called before every recompute; raises for a drift the recompute cannot
        #: undo (a train/eval switch, an optimizer step: see ``_decide``)
        self.check_recompute: Callable[[], None] = lambda: None

    # -- running the block on a given set of input tensors

    def call(self, tensors: Sequence[Tensor]) -> Any:
        lifted, rest = tensors[: self.n_lifted], tensors[self.n_lifted:]
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, rest):
            leaves[slot] = tensor
        args, kwargs = _pytree.tree_unflatten(leaves, self.call_spec)
        with contextlib.ExitStack() as stack:
            position = 0
            for module, names in zip(self.modules, self.names):
                mapping = dict(zip(names, lifted[position: position + len(names)]))
                position += len(names)
                stack.enter_context(torch.nn.utils.stateless._reparametrize_module(module, mapping, tie_weights=True))
            if self.cells:
                # a cell is the function's, not this thread's: one block at a time redirects cells
                stack.enter_context(_CELL_LOCK)
            for cell, tensor in zip(self.cells, lifted[position:]):
                stack.enter_context(_pointed_at(cell, tensor))
            return self.function(*args, **kwargs)

    def flat_outputs(self, output: Any) -> Tuple[Tensor, ...]:
        """The output's tensors (remembering the rest of its structure for :meth:`rebuild`)."""
        leaves, self.output_spec = _pytree.tree_flatten(output)
        self.output_leaves = leaves
        self.output_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        return tuple(leaves[i] for i in self.output_slots)

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        leaves = list(self.output_leaves)
        for slot, tensor in zip(self.output_slots, tensors):
            leaves[slot] = tensor
        return _pytree.tree_unflatten(leaves, self.output_spec)

    def pure(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The block as a function of its input tensors to its output tensors (for vjp / jvp)."""
        output = self.call(tensors)
        leaves = _pytree.tree_leaves(output)
        return tuple(leaf for leaf in leaves if isinstance(leaf, Tensor))

    # -- what the forward saw, and its replay

    def capture_forward_state(self, tensors: Sequence[Tensor]) -> None:
        self.default_dtype = torch.get_default_dtype()
        device_type = _tuc._infer_device_type(*tensors)
        self.autocast = (device_type, *_tuc._get_autocast_kwargs(device_type))
        if self.preserve_rng_state:
            device_module = getattr(torch, device_type, None)
            devices, states = ([], [])
            if device_type != "cpu" and getattr(device_module, "_initialized", False):
                devices, states = _tuc.get_device_states(*tensors)
            self.rng = (torch.get_rng_state(), devices, states, device_type)

    @contextlib.contextmanager
    def replay(self) -> Any:
        """The forward's RNG, default dtype and device, autocast and the recompute context, around a recompute."""
        self.check_recompute()
        device_type, device_autocast, cpu_autocast = self.autocast
        with contextlib.ExitStack() as stack:
            stack.enter_context(_default_dtype(self.default_dtype))
            if self.default_device is not None:  # a fresh context, as torch >= 2.11 does
                stack.enter_context(torch.device(self.default_device))
            if self.rng is not None:
                cpu_state, devices, states, _ = self.rng
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device_type))
                torch.set_rng_state(cpu_state)
                if devices:
                    _tuc.set_device_states(devices, states)
            if torch.amp.is_autocast_available(device_type) and device_type != "cpu":
                stack.enter_context(torch.amp.autocast(device_type=device_type, **device_autocast))
            stack.enter_context(torch.amp.autocast("cpu", **cpu_autocast))
            stack.enter_context(self.recompute_context)
            stack.enter_context(_plain_nested_checkpoints())
            yield
        global RECOMPUTES, DIFFERENTIABLE_RECOMPUTES
        RECOMPUTES += 1
        DIFFERENTIABLE_RECOMPUTES += self.differentiable


#: selective checkpointing's forward mode: fallback's plain run and the recompute here leave it out
SELECTIVE_CACHING_MODE = getattr(_tuc, "_CachingTorchDispatchMode", ())

#: Recomputes run so far, and how many of them differentiable (the matrix reads them: a
#: recompute means the block's activations were not kept by the forward).
RECOMPUTES = 0
DIFFERENTIABLE_RECOMPUTES = 0


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _plain_nested_checkpoints() -> Any:
    """Checkpoints inside the block run as plain calls (the guard's "plain" scope)."""
    token = _config.push_scope(_config.PLAIN)
    try:
        yield
    finally:
        _config.pop_scope(token)


#: Held while a block runs with its closure cells redirected (reentrant: a block may nest
#: another one).  Another thread calling the same closure meanwhile waits rather than
#: reading the other thread's tensors.
_CELL_LOCK = threading.RLock()


@contextlib.contextmanager
def _pointed_at(cell: Any, tensor: Tensor) -> Any:
    """A closure cell holding ``tensor`` while the block runs (its own tensor again after)."""
    held = cell.cell_contents
    cell.cell_contents = tensor
    try:
        yield
    finally:
        cell.cell_contents = held


def _cells_holding(function: Any, tensors: Sequence[Tensor]) -> Optional[List[Any]]:
    """The closure cells of ``function`` that hold ``tensors``, or None if one is held elsewhere."""
    code_owner = function.__func__ if isinstance(function, types.MethodType) else function
    cells = getattr(code_owner, "__closure__", None) or ()
    found = []
    for tensor in tensors:
        holding = [cell for cell in cells if _cell_holds(cell, tensor)]
        if not holding:
            return None
        found.extend(holding)
    return found


def _cell_holds(cell: Any, tensor: Tensor) -> bool:
    try:
        return cell.cell_contents is tensor
    except ValueError:  # an empty cell
        return False


def _named_tensors(module: torch.nn.Module) -> List[Tuple[str, Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _recompute_of(
    plan: Plan, tensors: Sequence[Tensor], needed: Sequence[bool],
) -> Tuple[List[int], Callable[..., Tuple[Tensor, ...]]]:
    """The slots of the inputs to differentiate, and the block as a function of those alone.

    ``needed`` says which inputs autograd wants a gradient (or a tangent) for:
    a buffer such as BatchNorm's ``running_mean`` is an input too, and some
    operations cannot be differentiated with respect to it.
    """
    wanted = [i for i, t in enumerate(tensors) if needed[i] and _differentiable_dtype(t)]

    def recompute(*differentiable: Tensor) -> Tuple[Tensor, ...]:
        full = list(tensors)
        for i, t in zip(wanted, differentiable):
            full[i] = t
        return tuple(o for o in plan.pure(full) if _differentiable_dtype(o))

    return wanted, recompute


class _Recompute(torch.autograd.Function):
    """The composable checkpoint: forward without activations, backward and jvp by recomputing."""

    generate_vmap_rule = True

    @staticmethod
    def forward(plan: Plan, *tensors: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        plan.capture_forward_state(tensors)
        forward_context = contextlib.nullcontext()
        if plan.context_fn is not None:
            forward_context, plan.recompute_context = plan.context_fn()
            if isinstance(forward_context, SELECTIVE_CACHING_MODE):
                # Selective checkpointing caches ops by their order in torch's own recompute;
                # the vjp here runs other ops, so the cache would not line up ("not found in
                # storage"). Its policy only chooses what to keep: recomputing all is correct.
                forward_context, plan.recompute_context = contextlib.nullcontext(), contextlib.nullcontext()
        device_context = contextlib.nullcontext() if plan.default_device is None else torch.device(plan.default_device)
        with torch.no_grad(), device_context, forward_context, _plain_nested_checkpoints():
            outputs = plan.flat_outputs(plan.call(tensors))
        # An input returned as is (a mask passed through) cannot also be saved for backward by a
        # Function with setup_context: return a copy of it instead (as large as that input).
        inputs = {id(t) for t in tensors}
        return tuple(o.clone() if id(o) in inputs else o for o in outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        plan, *tensors = inputs
        ctx.plan = plan
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        fixed = [o for o in output if not _differentiable_dtype(o)]
        if fixed:
            ctx.mark_non_differentiable(*fixed)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan: Plan = ctx.plan
        tensors = ctx.saved_tensors
        wanted, recompute = _recompute_of(plan, tensors, ctx.needs_input_grad[1:])
        if not wanted:
            return (None,) * (1 + len(tensors))

        cotangents = [g for g, kept in zip(grad_outputs, plan.differentiable_outputs()) if kept]

        def weighted(*differentiable: Tensor) -> Tensor:
            # <outputs, cotangents>: its gradient is the vjp, taken inside one torch.func.grad
            # call (a vjp pullback run after its level exited trips over unused inputs when
            # nested in another transform, e.g. grad(vjp(f)))
            outputs = recompute(*differentiable)
            # Re<o, c> (c conjugated for a complex output): torch's vjp convention, a real scalar
            terms = [
                (o * c.conj()).real.sum() if o.is_complex() else (o * c).sum()
                for o, c in zip(outputs, cotangents) if c is not None
            ]
            return functools.reduce(torch.add, terms) if terms else outputs[0].sum() * 0

        primals = tuple(tensors[i] for i in wanted)
        # what flows in may carry an eager graph too (a trainable layer after the block)
        differentiable = plan.differentiable or any(
            c is not None and _base(c).requires_grad for c in cotangents
        )
        plan.differentiable = differentiable  # what actually ran (for the counters)
        with plan.replay():
            if differentiable:
                grads = torch.func.grad(weighted, argnums=tuple(range(len(primals))))(*primals)
            else:  # nothing differentiates this again: no graph kept, the least memory
                with torch.no_grad():
                    outputs, pullback = torch.func.vjp(recompute, *primals)
                    grads = pullback(tuple(
                        torch.zeros_like(o) if c is None else c for o, c in zip(outputs, cotangents)
                    ))
        result: List[Optional[Tensor]] = [None] * len(tensors)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (None, *result)

    @staticmethod
    def jvp(ctx: Any, plan_tangent: Any, *tangents: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan: Plan = ctx.plan
        tensors = ctx.saved_tensors
        wanted, recompute = _recompute_of(plan, tensors, [t is not None for t in tangents])
        if not wanted:
            return tuple(None for _ in plan.differentiable_outputs())

        primals = tuple(tensors[i] for i in wanted)
        directions = tuple(tangents[i] for i in wanted)
        with plan.replay():
            _, output_tangents = torch.func.jvp(recompute, primals, directions)
        it = iter(output_tangents)
        return tuple(next(it) if kept else None for kept in plan.differentiable_outputs())


def _differentiable_outputs(self: Plan) -> List[bool]:
    return [_differentiable_dtype(self.output_leaves[i]) for i in self.output_slots]


Plan.differentiable_outputs = _differentiable_outputs  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# deciding whether the composable recompute is right for a call


def plan(
    function: Callable[..., Any], args: tuple, kwargs: dict, *, context_fn: Any = None,
    preserve_rng_state: bool = True,
) -> Union[Plan, str]:
    """A :class:`Plan` for this call, or why the composable recompute would be wrong here."""
    reads = _reads.reads_of(function).complete()
    if reads.unseen:
        return "it holds an object the guard does not look into, which may hide tensors needing a gradient"
    if _state.user_dispatch_modes() or _state.user_function_modes():
        return "a user mode is active: the recompute would run without it"
    stack = [name for name, _ in _state.transform_stack()]
    transforms = set(stack)
    if "functionalize" in transforms:
        return "functionalize does not transform custom autograd Functions"
    if stack.count("jvp") > 1:  # measured: jvp(jvp(...)), jacfwd(jacfwd(...)) get zero tangents
        return "forward-mode AD over forward-mode AD does not differentiate through a custom jvp"
    # torch.func.jvp runs inside a dual level of its own; outside it, a dual level is the user's
    if _state.forward_ad._current_level >= 0 and "jvp" not in transforms:
        return "forward-mode AD (dual_level) is active: its jvp would nest torch.func.jvp inside it"
    if isinstance(function, functools.partial):  # the bound arguments become inputs: liftable
        args = (*function.args, *args)
        kwargs = {**function.keywords, **kwargs}
        function = function.func
    bound = {id(leaf) for leaf in _pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)}
    captured = [
        tensor for tensor in reads.tensors
        if id(tensor) not in bound
        and (_state.requires_grad_anywhere(tensor) or _state.is_functorch_wrapped_tensor(tensor))
    ]
    cells = _cells_holding(function, captured) if captured else []
    if cells is None:
        return (
            "it holds a tensor that requires grad or belongs to a torch.func transform somewhere "
            "other than its own closure (a global, a default argument, inside a list): it cannot "
            "be passed as an input, so its gradient would be lost"
        )
    if cells:
        # the cells are redirected while the block runs; any other path to those tensors is not
        elsewhere = _reads.reads_of(function, skip_cells=frozenset(id(c) for c in cells)).complete()
        lifted = {id(c.cell_contents) for c in cells}
        if elsewhere.unseen or any(id(t) in lifted for t in elsewhere.tensors):
            return (
                "it reads a tensor that needs a gradient both through its own closure and another way "
                "(a helper's closure, an object's attribute): only the closure could be redirected to "
                "the recompute's input, so its gradient would be wrong"
            )
    modules = _top_level(list(reads.modules))
    # preserve_rng_state=False would let the recompute draw other numbers (CKG107): the safe choice
    built = Plan(function, args, kwargs, modules, context_fn, True, differentiable=True, cells=cells)
    built.differentiable = _may_be_differentiated_again(built.inputs)
    return built


def _may_be_differentiated_again(inputs: Sequence[Tensor]) -> bool:
    """Whether anything can differentiate the backward's result (see the module docstring).

    Outside torch.func that is eager autograd: grad mode was on when the
    outermost transform began (``prev_grad_mode``) and a tensor the block reads
    requires grad there (say, a module's own parameters, not detached).
    """
    interpreters = _state.retrieve_all_functorch_interpreters() if _state.peek_interpreter_stack() else []
    kinds = [i.key().name for i in interpreters]
    if kinds.count("Grad") != 1 or any(kind in ("Jvp", "Functionalize") for kind in kinds):
        return True
    if _state.forward_ad._current_level >= 0:
        return True
    # eager grad mode around the transforms: the grad level remembers it (vmap levels keep it)
    eager_grad_mode = bool(interpreters[kinds.index("Grad")].prev_grad_mode())
    return eager_grad_mode and any(_base(t).requires_grad for t in inputs)


def run(built: Plan) -> Any:
    """Run the block as a composable checkpoint; returns what the function returns.

    Never traced by dynamo: a compiled function called under a torch.func
    transform runs in dynamo's frame-by-frame mode, which would compile the
    recompute's frames (and the block's, with its closure cells pointed at
    the lifted inputs) and fail there.  ``torch.compile`` of code outside
    transforms never gets here (``ckpt_guard.checkpoint`` hands it torch's
    checkpoint).  Only where dynamo is loaded: importing it costs a second.
    """
    global _run_uncompiled
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return _run(built)
    if _run_uncompiled is None:
        _run_uncompiled = dynamo.disable(_run, recursive=True)
    return _run_uncompiled(built)


_run_uncompiled: Any = None


def _run(built: Plan) -> Any:
    outputs = _Recompute.apply(built, *built.inputs)
    return built.rebuild(outputs)


def checkpoint_call(
    function: Callable[..., Any], args: tuple, kwargs: dict, *, context_fn: Any = None,
    preserve_rng_state: bool = True,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` composably; ``RuntimeError`` if that would be wrong."""
    built = plan(function, args, kwargs, context_fn=context_fn, preserve_rng_state=preserve_rng_state)
    if isinstance(built, str):
        raise RuntimeError(f"ckpt_guard: cannot checkpoint this call composably: {built}")
    return run(built)
