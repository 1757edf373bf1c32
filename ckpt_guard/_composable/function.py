"""The recompute as an ``autograd.Function`` torch.func can transform: its rules per transform.

``_Recompute``'s ``forward`` hands on the plain run's outputs; ``backward`` recomputes
the block and takes its vjp, itself a checkpointed recompute (:class:`_Derivative`)
where something will differentiate it again; ``jvp`` hands on the tangents the plain run
(or a derivative run at the caller's levels) computed, else recomputes under a jvp of its own;
``vmap`` batches the checkpoint (:class:`_Batched`) instead of unrolling it.  Applied
level by level by ``levels.apply``.  Owns: those rules, reading which functorch levels
are alive, the global module hooks a recompute runs under.  May not touch: planning
a call (``plan``, ``call``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch
from torch._C._functorch import _unwrap_for_grad, is_batchedtensor, maybe_get_level
from torch._C._functorch import CGradInterpreterPtr as _CGradInterpreterPtr
from torch._C._functorch import get_interpreter_stack as _get_interpreter_stack
from torch._functorch import pyfunctorch
from torch._functorch.eager_transforms import _jvp_with_argnums

from . import levels as _levels
from . import counters
from . import later_writes as _later_writes
from .. import _state
from .basics import GRAD_KEY, VMAP_KEY, Tensor, _base, _differentiable_dtype
from .plan import Plan
from .proof import _storage_address
from .replay import _forward_mode_alive, _vmap_level_of_rule


class Node(Protocol):
    """What ``_Recompute`` and its rules ask of the node it is applied to.

    Three kinds: a :class:`Plan` (a checkpointed call), a :class:`_Derivative` (a node's vjp or
    tangents, checkpointed as a block of its own) and a :class:`_Batched` (a node under vmap).
    A derived node answers from its ``base``; ``root`` is the Plan at the bottom, whose
    forward state (grad mode, the vmaps it ran under, the caller's inputs) every rule reads.
    """

    #: its operands that are inputs (those after them: the plain run's outputs, handed on)
    n_inputs: int
    #: whether the call's inputs required grad in eager autograd (a Plan's; None for a derived node)
    eager_requires_grad: Optional[bool]

    @property
    def root(self) -> Plan: ...

    def forward_outputs(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]: ...

    def pure(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]: ...

    def replay(self) -> Any: ...

    def for_recompute(self, tensors: Sequence[Tensor], copied: frozenset = frozenset()) -> Tuple[Tensor, ...]: ...

    def differentiable_outputs(self) -> List[bool]: ...

    def differentiable_inputs(self, forward: bool = False) -> List[bool]: ...

    def batched_over_tangents_only(self, in_dims: Sequence[Any]) -> bool:
        """Whether vmap's ``in_dims`` batch none of this node's primals: only a derivative's
        cotangents or tangents (jacrev's vmap over a pullback)."""

    def tangent_operands(self, inputs: Sequence[int], n_operands: int) -> Tuple[int, ...]:
        """The positions, among this node's ``n_operands`` operands, of the tangents of the call's
        ``inputs`` (a jvp derivative's directions); ``()`` for a node that takes none."""


class _Derivative:
    """The vjp (``"vjp"``) or the tangents (``"jvp"``) of a plan, as a block of its own.

    Its inputs: all the base's inputs, then the cotangents present (vjp) or the
    tangents of the ``wanted`` inputs (jvp).  Checkpointed like any block, so a
    derivative that is differentiated again keeps its inputs, not its activations.
    """

    def __init__(
        self, base: Node, kind: str, wanted: List[int], present: Sequence[bool], copied: frozenset = frozenset(),
    ) -> None:
        self.base, self.kind, self.wanted, self.present = base, kind, wanted, list(present)
        #: the base's inputs that came back from the user's saved-tensor hooks as copies (checked once)
        self.copied = copied
        self.output_kept: List[bool] = []
        self.n_inputs = sys.maxsize  # all its operands are inputs: it computes its outputs
        #: (jvp level, tangents) of its outputs, computed where it ran at the caller's levels, until used
        self.tangents: Optional[tuple] = None

    eager_requires_grad = None

    @property
    def root(self) -> Plan:
        return self.base.root

    @property
    def n_extra(self) -> int:
        """How many operands follow the base's inputs: the cotangents present (vjp), the tangents (jvp)."""
        return sum(self.present) if self.kind == "vjp" else len(self.wanted)

    def batched_over_tangents_only(self, in_dims: Sequence[Any]) -> bool:
        return all(d is None for d in in_dims[: len(in_dims) - self.n_extra])

    def tangent_operands(self, inputs: Sequence[int], n_operands: int) -> Tuple[int, ...]:
        if self.kind != "jvp" or self.base is not self.root:
            # a derivative of a derivative: its directions are the tangents of its base's operands at
            # a level of its own, not the call's (not watched: see later_writes)
            return ()
        first = n_operands - self.n_extra  # the directions follow the base's inputs, in wanted's order
        return tuple(first + k for k, i in enumerate(self.wanted) if i in inputs)

    def _function(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        n = len(tensors) - self.n_extra
        primals, extra = self.base.for_recompute(tensors[:n], self.copied), tensors[n:]
        with self.base.replay():
            if self.kind == "jvp":
                return _jvp(self.base, primals, self.wanted, extra)
            outputs, pullback = _vjp(self.base, primals, self.wanted)
            given = iter(extra)
            cotangents = tuple(next(given) if p else None for p in self.present)  # an unused output: none
            return tuple(pullback(cotangents))

    def run_for_tangents(self, operands: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """Where a jvp level will differentiate this derivative (``jvp(grad)`` with parameters eager
        autograd may differentiate too): run it here, at the caller's levels, once.

        Its outputs then carry that jvp's tangents (``levels.tangents_computed``), kept for the
        jvp rule to hand on (where one output carries none, the jvp rule recomputes them); the
        outputs, cut from their graph, are returned to be handed to the Function as precomputed
        (its forward returns them).  Where no such jvp level is alive nothing is run, and ``()``
        is returned: the Function's forward computes the derivative below the levels.
        """
        if _levels.jvp_under_grad_levels() is None:
            return ()
        if any(_levels._without_dead_wrappers(t) is not t for t in operands):
            return ()  # a pullback called after its vjp returned: the Function's forward unwraps them
        counters.NESTED_RECOMPUTES += 1
        # in the call's grad mode, as the jvp rule would run it: the pullback under the jvp then takes
        # the backward formulas the plain code takes (silu's plain kernel has no forward-mode formula);
        # what eager autograd records goes with the outputs, cut below
        with torch.set_grad_enabled(self.root.at_call.grad_mode):
            outputs = self._function(operands)
        kept = [_differentiable_dtype(o) for o in outputs]
        # None where an output carries no tangent (one the duals do not reach): the jvp rule then
        # recomputes the tangents, but the outputs computed here are still handed on (no third run)
        self.tangents = _levels.tangents_computed([o for o, k in zip(outputs, kept) if k])
        self.output_kept = kept
        self.n_inputs = len(operands)
        return _cut_from(outputs, operands)

    def forward_outputs(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        if self.n_inputs < len(tensors):  # the plain run's tangents, or outputs, handed in (see run_for_tangents)
            outputs = tuple(t.detach() for t in tensors[self.n_inputs:])
            self.output_kept = [_differentiable_dtype(o) for o in outputs]
            return outputs
        counters.NESTED_RECOMPUTES += 1
        with torch.no_grad():  # torch.func's transforms inside ignore it; no eager graph is kept
            outputs = self._function(tensors)
        self.output_kept = [_differentiable_dtype(o) for o in outputs]
        return _cut_from(outputs, tensors)

    def pure(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        return self._function(tensors)

    def replay(self) -> Any:
        return contextlib.nullcontext()  # its function replays the base

    def for_recompute(self, tensors: Sequence[Tensor], copied: frozenset = frozenset()) -> Tuple[Tensor, ...]:
        self.copied = self.copied | copied  # its first operands are the base's inputs, in their order
        return tuple(tensors)  # its function asks the base

    def differentiable_outputs(self) -> List[bool]:
        return self.output_kept

    def differentiable_inputs(self, forward: bool = False) -> List[bool]:
        return [*self.base.differentiable_inputs(forward), *([True] * self.n_extra)]


class _Batched:
    """A node vmapped: the block under ``torch.vmap``, checkpointed whole (vmap of a checkpoint).

    Over a plan, its forward hands on the plain run's outputs (batched where
    ``precomputed_dims`` says); its recompute runs the block under
    ``torch.vmap`` with the level's randomness.
    """

    def __init__(
        self, base: Node, in_dims: Sequence[Optional[int]], randomness: str, batch_size: int = 0,
        precomputed_dims: Sequence[Optional[int]] = (),
    ) -> None:
        self.base, self.in_dims, self.batch_size = base, tuple(in_dims), batch_size
        self.n_inputs = base.n_inputs
        if base.batched_over_tangents_only(self.in_dims) and not base.root.ran_under(
            _vmap_level_of_rule(), batch_size, randomness,
        ):
            # a derivative vmapped over its cotangents / tangents alone, under a vmap the forward did
            # not run under (jacrev's, over the pullback): its block's random draws replay an
            # unbatched forward, so they are drawn unbatched too (under jacfwd's vmap the plain
            # run drew them as that vmap's randomness says: they are drawn so again)
            randomness = "same"
        self.randomness = randomness

        #: per output: batched (a leading batch dimension) or not (as the block made it)
        self.out_batched: List[bool] = [d is not None for d in precomputed_dims]

    def _vmapped(self, inner: Callable[..., Tuple[Tensor, ...]], tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        in_dims, operands = self.in_dims, tuple(tensors)
        if all(d is None for d in in_dims):
            # only the block's random draws are batched (randomness="different" over unbatched
            # inputs): torch.vmap needs a batched operand to know the batch size
            in_dims, operands = (*in_dims, 0), (*operands, torch.empty(self.batch_size, 0))
        n = len(tensors)
        outputs, found = _levels.vmap(lambda *ts: inner(ts[:n]), operands, in_dims, self.batch_size, self.randomness)
        if not self.out_batched:
            self.out_batched = found
        # an output the batch did not reach stays as it was: torch.vmap expands it (stride 0), and
        # an expanded tangent or cotangent cannot be written to
        return tuple(o if batched else o.select(0, 0) for o, batched in zip(outputs, self.out_batched))

    def forward_outputs(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        if self.n_inputs < len(tensors):  # a plan's: the plain run's outputs, handed on
            return self.base.forward_outputs(tensors)
        return self._vmapped(self.base.forward_outputs, tensors)

    def pure(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        return self._vmapped(self.base.pure, tensors)

    eager_requires_grad = None

    @property
    def root(self) -> Plan:
        return self.base.root

    def batched_over_tangents_only(self, in_dims: Sequence[Any]) -> bool:
        return False

    def tangent_operands(self, inputs: Sequence[int], n_operands: int) -> Tuple[int, ...]:
        return self.base.tangent_operands(inputs, n_operands)

    def out_dims(self) -> Tuple[Optional[int], ...]:
        return tuple(0 if batched else None for batched in self.out_batched)

    def replay(self) -> Any:
        return self.base.replay()

    def for_recompute(self, tensors: Sequence[Tensor], copied: frozenset = frozenset()) -> Tuple[Tensor, ...]:
        return self.base.for_recompute(tensors, copied)

    def differentiable_outputs(self) -> List[bool]:
        return self.base.differentiable_outputs()

    def differentiable_inputs(self, forward: bool = False) -> List[bool]:
        return self.base.differentiable_inputs(forward)


def _cut_from(outputs: Sequence[Tensor], operands: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """A derivative's outputs cut from their graph, for its Function's forward to return: one
    sharing memory with an operand (the operand itself, a view of it: a cotangent passed through)
    is copied, as :meth:`Plan.precomputed` copies the plain run's, since a Function's output must
    not alias what it saves for backward."""
    ids = {id(t) for t in operands}
    storages = {address for address in map(_storage_address, operands) if address is not None}
    return tuple(
        o.clone().detach() if id(o) in ids or (storages and _storage_address(o) in storages) else o.detach()
        for o in outputs
    )


def _take_tangents(node: Node, level: Optional[int]) -> Optional[Tuple[Tensor, ...]]:
    """The tangents a plan's plain run (or a derivative's run at the caller's levels) computed, kept
    in ``node.tangents`` as ``(jvp level, tangents)``, for the jvp rule of ``level``: once (a later
    call recomputes them)."""
    kept, node.tangents = node.tangents, None
    if kept is None or kept[0] != level:
        return None
    return kept[1]


def _recompute_of(plan: Node) -> Callable[..., Tuple[Tensor, ...]]:
    """The block as a function of all its inputs to its differentiable outputs."""

    def recompute(*tensors: Tensor) -> Tuple[Tensor, ...]:
        return tuple(o for o in plan.pure(tensors) if _differentiable_dtype(o))

    return recompute


def _vjp(plan: Node, tensors: Sequence[Tensor], wanted: Sequence[int]) -> Tuple[Tuple[Tensor, ...], Callable[..., Any]]:
    """``(outputs, pullback)`` of the block with respect to the ``wanted`` inputs.

    Every input is wrapped at the new grad level (as ``torch.func.grad`` wraps
    all its arguments), so a block that updates a buffer in place (BatchNorm's
    ``num_batches_tracked``) does what it does without checkpointing; those that
    required grad at the call require grad there too, differentiated or not
    (what the block reads, and the kernels, are then the call's).
    """
    # the plan's inputs come first (a derivative's cotangents follow); those the block never read (a
    # module's own parameters a functional_call swapped out) are not marked: nothing would see them
    root = plan.root
    # an input the caller wrote into since the call: the recompute read the call's copy, and autograd
    # raises where the block saved it, as without checkpointing (later_writes)
    written = _later_writes.written_since_call(root, tensors) if root.found.callers_inputs else ()
    if root.found.callers_tangents:
        # ... or into its tangent, where this node computes tangents from a copy of it (jvp, then .backward())
        written += plan.tangent_operands(_later_writes.tangents_written_since_call(root), len(tensors))
    if written:
        # ... where the plain run's graph saved it: that graph tracked only what this level differentiates,
        # so nothing more is marked here (the block still reads requires_grad as the call saw it, on a
        # level of its own that nothing differentiates: levels.as_the_call_saw)
        return _levels.vjp(_recompute_of(plan), tensors, wanted, (), written)
    marked = [i for i, need in root.found.requires_grad_read if need and i not in wanted]
    return _levels.vjp(_recompute_of(plan), tensors, wanted, marked)


def _jvp(
    plan: Node, tensors: Sequence[Tensor], wanted: Sequence[int], directions: Sequence[Tensor],
) -> Tuple[Tensor, ...]:
    """The output tangents of the block along ``directions`` (of the ``wanted`` inputs).

    The other inputs stay as they are (constants of the jvp level): wrapped at
    it without a tangent, an RNN's forward-mode formula mixes batched and
    unbatched tangents in place (under jacfwd) and fails.
    """
    recompute = _recompute_of(plan)
    root = plan.root
    grad_mode = root.at_call.grad_mode  # the call's: a block may branch on it (nn.TransformerEncoder's fast path)
    # (under the jvp every input reads requires_grad=False: the block sees what it saw at the call
    # through levels.as_the_call_saw, and kernels are chosen by it: an LSTM's fused one has a
    # forward-mode formula that fails under jacfwd)

    def along(*full: Tensor) -> Tuple[Tensor, ...]:
        with torch.set_grad_enabled(grad_mode):
            return recompute(*full)

    # a dual's primal cannot overlap itself (a cotangent of .sum() is an expanded one)
    given = list(tensors)
    for i in wanted:
        given[i] = _unexpanded(given[i])
    # every input wrapped at the jvp's level, the wanted ones as duals (as jacfwd wraps its
    # arguments): a BatchNorm's running statistics are then its own to update, not captured
    output_tangents = _jvp_with_argnums(along, tuple(given), tuple(directions), tuple(wanted), has_aux=False)[1]
    return tuple(output_tangents)


def _unexpanded(t: Tensor) -> Tensor:
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return t.clone()
    return t


# --------------------------------------------------------------------------
# will anything differentiate this backward (or these tangents) again?



def _own_level(tensors: Sequence[Tensor]) -> Optional[int]:
    """The live grad or jvp level the saved tensors are wrapped at (the node's own), or None."""
    level = None
    wrapped = _state.is_functorch_wrapped_tensor
    for t in tensors:
        if wrapped(t) and not is_batchedtensor(t):
            found = maybe_get_level(t)  # -2: a dead wrapper (its transform has exited)
            if found >= 0 and (level is None or found > level):
                level = found
    return level


def _differentiated_again(
    saved: Sequence[Tensor], incoming: Sequence[Optional[Tensor]], own: Any = "saved",
    saved_require_grad: Optional[bool] = None,
) -> bool:
    """Whether reverse mode (a live grad level, or eager autograd) will differentiate what this derivative returns.

    Forward mode (a jvp level, a dual level) differentiates it too, but as it
    runs, keeping nothing: computed directly, it costs one recompute less than
    checkpointed, and no more memory (``jvp(grad)``, ``hessian``).
    ``saved_require_grad``: whether a saved tensor requires grad under all its
    wrappers, where the node knows (a plan read it at its forward).
    """
    if own == "saved":  # the level whose node this is: the saved tensors' (a jvp passes its own)
        own = _own_level(saved)
    eager_grad_mode = None
    for interpreter in _get_interpreter_stack() or ():  # C interpreters: cheap to read
        if interpreter.key().value == GRAD_KEY:
            if interpreter.level() != own:
                return True
            if eager_grad_mode is None:
                eager_grad_mode = _CGradInterpreterPtr(interpreter).prevGradMode()
    if eager_grad_mode is None:
        eager_grad_mode = torch.is_grad_enabled()
    if not eager_grad_mode:
        return False
    if saved_require_grad is None:
        saved_require_grad = any(_base(t).requires_grad for t in saved)
    return saved_require_grad or any(t is not None and _base(t).requires_grad for t in incoming)




def _unbatched_vmaps_set_aside(primals: Sequence[Tensor]) -> Any:
    """Pop the vmap levels on top of the stack that batch none of ``primals`` (a jacrev's).

    The forward never ran under them, so the recompute's linearization must not
    either (its random draws would be refused or batched); the pullback, which
    takes the batched cotangents, runs under them as usual.  (Usually there is
    none: a context that does nothing, without a generator.)
    """
    top = _state.peek_interpreter_stack()
    if top is None or top.key().value != VMAP_KEY or any(_levels._batched_at(p, top.level()) for p in primals):
        return _NO_CONTEXT
    return _vmaps_set_aside(primals)


#: the public name (torch's own recompute, run by the guard under a batched backward, sets them aside too)
unbatched_vmaps_set_aside = _unbatched_vmaps_set_aside


@contextlib.contextmanager
def _vmaps_set_aside(primals: Sequence[Tensor]) -> Any:
    with contextlib.ExitStack() as stack:
        while _state.peek_interpreter_stack() is not None:
            top = pyfunctorch.retrieve_current_functorch_interpreter()
            if top.key().value != VMAP_KEY or any(_levels._batched_at(p, top.level()) for p in primals):
                break
            stack.enter_context(pyfunctorch.temporarily_pop_interpreter_stack())
        yield


_NO_CONTEXT = contextlib.nullcontext()



# torch 2.4-2.7 cannot tell: there inputs are checked as without hooks (stock torch refuses the user's
# hooks under torch.func there: vmap switches them off too)
_top_hooks = _state.top_saved_tensor_hooks or (lambda: None)


def _copied_by_hooks(ctx: Any, saved: Sequence[Tensor]) -> frozenset:
    """The inputs the user's saved-tensor hooks gave back in other memory than the input's.

    ``save_on_cpu(pin_memory=True)`` packs a copy (its version counter moved by the copy), which
    holds the input as the call saw it: what the recompute must read, whatever the caller wrote into
    the input since.  Its version says nothing, so it is not checked.  An input given back in its own
    memory (``save_on_cpu`` on the CPU returns an alias, which shares its version counter) is checked
    as without hooks: autograd itself checks no version of what hooks packed (a write after the call
    is torch's silent wrong gradient there), the recompute still does.  Memory is told by its address,
    read at the call while the input was alive (a copy made then cannot share it).
    """
    if ctx.originals is None:
        return frozenset()
    return frozenset(
        i for i, (address, t) in enumerate(zip(ctx.originals, saved))
        if address is not None and _storage_address(t) != address
    )


class _Recompute(torch.autograd.Function):
    """The composable checkpoint: forward without activations, every rule a recompute.

    Operands: the node (a :class:`Plan`, or a :class:`_Derivative` /
    :class:`_Batched` of one), its ``node.n_inputs`` inputs, then, for a plan,
    the plain run's outputs (precomputed: the forward returns them).  Only the
    inputs are saved, and only they get gradients or tangents.
    """

    @staticmethod
    def forward(node: Node, *tensors: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        return node.forward_outputs(tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        node, *tensors = inputs
        ctx.plan = node
        # an input with no tangent gets None, not a zero made up in its shape: duals are made of the
        # inputs that have one (an RNN's forward-mode formula fails mixing made-up unbatched zeros
        # with batched tangents, under jacfwd); a missing cotangent is a zero the backward makes
        ctx.set_materialize_grads(False)
        inputs_only = tensors[: node.n_inputs]
        # under the user's saved-tensor hooks (save_on_cpu) what comes back may be the hook's copy, made
        # as the call saw the input: see :func:`_copied_by_hooks`
        ctx.originals = None if _top_hooks() is None else [_storage_address(t) for t in inputs_only]
        ctx.save_for_backward(*inputs_only)
        ctx.save_for_forward(*inputs_only)
        fixed = [o for o in output if not _differentiable_dtype(o)]
        if fixed:
            ctx.mark_non_differentiable(*fixed)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan = ctx.plan
        saved = ctx.saved_tensors  # unpacked once: through the user's hooks, each unpack may copy
        copied = _copied_by_hooks(ctx, saved)
        tensors = plan.for_recompute(saved, copied)
        extra = (None,) * (len(ctx.needs_input_grad) - 1 - len(tensors))  # the precomputed outputs
        needed = ctx.needs_input_grad[1:]
        reachable = plan.differentiable_inputs()
        wanted = [i for i, t in enumerate(tensors) if needed[i] and reachable[i] and _differentiable_dtype(t)]
        if not wanted:
            return (None,) * (1 + len(tensors)) + extra
        cotangents = [g for g, kept in zip(grad_outputs, plan.differentiable_outputs()) if kept]
        if _differentiated_again(tensors, cotangents, saved_require_grad=plan.eager_requires_grad):
            derivative = _Derivative(plan, "vjp", wanted, [c is not None for c in cotangents], copied)
            operands = (*tensors, *(c for c in cotangents if c is not None))
            grads = _levels.apply(derivative, *operands, *derivative.run_for_tangents(operands))
        else:  # nothing differentiates this again: no graph kept, the least memory
            # ... except under forward mode (jvp(grad), hessian), which differentiates the pullback as
            # it runs: it must take the backward formulas the plain code takes, which autograd picks
            # by grad mode (silu's and group_norm's plain kernels have no forward-mode formula)
            building = _forward_mode_alive()
            if building:
                # ... below this node's own grad level, which would otherwise record the pullback (and
                # keep the recompute alive): nothing differentiates this backward there
                own = _own_level(tensors)
                if own is not None:
                    tensors = tuple(_unwrap_for_grad(t, own) for t in tensors)
                    cotangents = [None if c is None else _unwrap_for_grad(c, own) for c in cotangents]
                # a pullback called after its vjp returned, under a jvp (``jvp(pullback)``): the saved
                # tensors are that vjp's dead wrappers, and the live jvp level may carry the dead level's
                # number (functorch's "escaped?" assertion): the recompute starts from what they wrap
                tensors = tuple(_levels._without_dead_wrappers(t) for t in tensors)
            with _unbatched_vmaps_set_aside(tensors), plan.replay(), torch.no_grad():
                outputs, pullback = _vjp(plan, tensors, wanted)
            # no graph of the vjp otherwise: it would keep the recompute alive; an input the outputs do
            # not reach gets None, as from plain autograd (an eager leaf's .grad stays None)
            with torch.set_grad_enabled(building):
                grads = pullback(cotangents, unreached="none")  # an output the caller left unused: none
        result: List[Optional[Tensor]] = [None] * len(tensors)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (None, *result) + extra

    @staticmethod
    def jvp(ctx: Any, plan_tangent: Any, *tangents: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan = ctx.plan
        saved = ctx.saved_tensors  # unpacked once: through the user's hooks, each unpack may copy
        copied = _copied_by_hooks(ctx, saved)
        tensors = plan.for_recompute(saved, copied)
        tangents = tangents[: len(tensors)]  # the precomputed outputs carry none
        kept = plan.differentiable_outputs()
        reachable = plan.differentiable_inputs(forward=True)
        wanted = [
            i for i, t in enumerate(tangents) if t is not None and reachable[i] and _differentiable_dtype(tensors[i])
        ]
        if not wanted:
            return tuple(None for _ in kept)
        # the saved tensors and tangents are wrapped at this jvp's own level, alive: below it, or
        # the recompute would carry that level's tangents too (wasted, and refused by some ops)
        own = _own_level(tensors)
        if own is not None:
            tensors = tuple(_unwrap_for_grad(t, own) for t in tensors)
            tangents = tuple(None if t is None else _unwrap_for_grad(t, own) for t in tangents)
        directions = tuple(tangents[i] for i in wanted)
        # the plain run computed these tangents already, where this jvp was on top (a MeanFlow loss,
        # jacfwd) or right under the grad levels on top (jvp(grad), hessian): handed on, not
        # recomputed (a recompute under the jvp costs time, and its graph would double the peak)
        precomputed = None
        if isinstance(plan, (Plan, _Derivative)):
            precomputed = _take_tangents(plan, own)
            counters.TANGENT_RECOMPUTES += precomputed is None
        if _differentiated_again(tensors, directions, own):
            derivative = _Derivative(plan, "jvp", wanted, (), copied)
            if precomputed is not None:
                derivative.n_inputs = len(tensors) + len(directions)
            output_tangents = _levels.apply(derivative, *tensors, *directions, *(precomputed or ()))
        elif precomputed is not None:
            output_tangents = precomputed
        else:
            with plan.replay():
                output_tangents = _jvp(plan, tensors, wanted, directions)
        it = iter(output_tangents)
        return tuple(next(it) if k else None for k in kept)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Any, ...], node: Any, *tensors: Tensor) -> Any:
        n = node.n_inputs
        batched = _Batched(node, in_dims[1: 1 + n], info.randomness, info.batch_size, in_dims[1 + n:])
        # the precomputed outputs with their batch dimension first, as the recompute makes them
        precomputed = [t if d is None else t.movedim(d, 0) for t, d in zip(tensors[n:], in_dims[1 + n:])]
        outputs = _levels.apply(batched, *tensors[:n], *precomputed)
        return outputs, batched.out_dims()


_levels.FUNCTION = _Recompute  # applied level by level without torch's per-call class (see levels)
