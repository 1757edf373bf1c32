"""Checkpointing that composes with torch.func: a recompute torch.func can transform.

torch's checkpoint is built on saved-tensor hooks (non-reentrant) or on an
``autograd.Function`` without ``setup_context`` (reentrant); torch.func refuses
both.  The recompute here is an ``autograd.Function`` with ``setup_context``,
which torch.func transforms like any other operation, and whose every
transformation rule is again such a recompute, as ``jax.checkpoint``'s are.

**The first forward is the plain run.**  :func:`run` calls the block once, as
the caller wrote it, at the caller's torch.func levels, under the run-time
proof (``_proof.ReadCheck``).  That run *is* the uncheckpointed code: its
values, its grad mode, its random draws, its Python side effects, once.  Its
output tensors, cut from their graph with ``.detach()`` (which keeps every
level's batching), are then handed to ``_Recompute`` (applied by ``_levels.apply``) as operands after
the block's lifted inputs: every transform level unwraps them as it unwraps
any operand (a vmap rule sees where each is batched), and the Function's
``forward`` just returns them.  The plain run's graph goes with its outputs;
the Function saves only the inputs (the memory saving).  So:

* ``forward`` returns the plain run's outputs; the block never runs inside it;
* ``backward`` recomputes the block and takes its vjp.  When something will
  differentiate that result again (grad of grad, a jvp over a grad, an eager
  ``.backward()`` over a torch.func result, a pullback later differentiated),
  the vjp is itself a checkpointed recompute (:class:`_Derivative`): the outer
  transform keeps its inputs (primals and cotangents), never the recomputed
  activations.  Under forward mode alone (``jvp(grad)``, ``hessian``) the
  pullback runs with grad mode on, below the node's own level, so it takes the
  backward formulas the plain code takes (silu's and group_norm's plain
  kernels have no forward-mode formula) without keeping a graph;
* ``jvp`` recomputes the block under a jvp of its own, in the call's grad mode,
  with the inputs that required grad requiring grad (kernels are chosen by it);
  where the tangents will be differentiated again (a MeanFlow loss's
  ``.backward()``) that too is checkpointed;
* ``vmap`` batches the checkpoint instead of unrolling it (:class:`_Batched`):
  its forward hands on the plain run's batched outputs, its recompute runs the
  block under ``torch.vmap`` with the level's randomness.

Whether the backward or the tangents will be differentiated again is read
when they run, from the functorch levels then alive: one that is neither the
level running this backward nor dead (a pullback called after its ``vjp``
returned) will differentiate it; so will eager autograd, when grad mode is on
below every transform and a tensor involved requires grad there.  Where no
reverse mode can differentiate the call at all (``jvp``, ``jacfwd``,
``linearize``, a forward ``vmap``), the plain run kept nothing to save: it is
the result, and nothing is packed.

**What the block reads.**  Every tensor the block reads that may need a
gradient must be an input, or its gradient would silently be zero.  The walk
in ``_rebind`` lifts the parameters, buffers and plain tensor attributes of
the modules the block reaches (bound per thread, modules are never copied),
and the tensors that need a gradient held in its closures, defaults,
partials, containers, dataclasses and objects, and the call's arguments
(rebuilt as copies holding the recompute's tensors).  That walk is the fast
path; the proof watches the plain run: a tensor that carries a gradient and
was neither given nor computed makes the call *refused* (:class:`Refused`,
carrying the plain run's output and a :class:`Reason` of a listed class): the
caller returns that output (fallback, warn) or raises (strict), and never runs
the block a second time.  No wrong gradient either way.

**What the block writes.**  An input the block updates in place (BatchNorm's
running statistics, ``h += pos``) is copied just before the write, at the
caller's levels and connected to the input; the Function is handed that copy,
so each recompute starts from what the forward started from (and a later
update of the live tensor, the same module called again, changes nothing it
reads), and a gradient for it reaches the input's value before the update.
Each recompute gives the block a copy of such an input to write into.

**What the recompute replays.**  The forward's CPU and device RNG states
(dropout draws the same mask), each user ``torch.Generator`` the block drew
from (its state before the first draw, kept by the proof), default dtype,
``torch.device(...)`` context, autocast, a user ``context_fn``'s recompute
context, the global module hooks, the modules' plain numbers, flags and
strings (NumPy scalars too) as the call found them, and what the block's
closures held (frozen copies: a loop rebinding a closed-over variable is not
seen).  Checkpoints nested inside the block run plainly (the outer recompute
already recomputes them).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint as _tuc
from torch._C._functorch import _unwrap_for_grad, _wrap_for_grad, is_batchedtensor, maybe_get_level
from torch._C._functorch import current_level as _current_level
from torch._C._functorch import CGradInterpreterPtr as _CGradInterpreterPtr
from torch._C._functorch import get_interpreter_stack as _get_interpreter_stack
from torch._functorch import pyfunctorch
from torch._functorch.eager_transforms import enable_inplace_requires_grad as _enable_inplace_requires_grad
from torch._functorch.eager_transforms import _jvp_with_argnums
from torch._functorch.eager_transforms import grad_increment_nesting as _grad_increment_nesting

from . import _config, _levels, _proof, _rebind, _state

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


class Refused(Exception):
    """The composable recompute cannot be correct for this call; ``reason`` says why (for messages).

    ``output``: what the block returned, where it already ran (a refusal the
    run-time proof found during the plain run: the caller returns that, and
    never runs the block a second time); :data:`NOT_RUN` where it did not.
    """

    def __init__(self, reason: str, output: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.output = NOT_RUN if output is None else output

    @property
    def ran(self) -> bool:
        return self.output is not NOT_RUN


#: :attr:`Refused.output` where the block has not run
NOT_RUN = object()

class Reason(str):
    """Why a call cannot be packed into the recompute: the words users read, and a stable class.

    The class (``kind``) names a design decision, listed in ``REFUSAL_CLASSES``
    and, in full, in ``docs/limits.md`` ("Refusal classes"); the conformance
    matrix accepts a refusal only of a listed class.
    """

    kind: str
    #: the change to the user's code that makes the call packable, where there is one: a message's
    #: first fix line
    fix: str

    def __new__(cls, kind: str, text: str, fix: str = "") -> "Reason":
        if kind not in REFUSAL_CLASSES:
            raise ValueError(f"unknown refusal class {kind!r}")
        reason = str.__new__(cls, text)
        reason.kind = kind
        reason.fix = fix
        return reason

    def described(self) -> str:
        """The words, with the class to look up."""
        return f"{self} (refusal class {self.kind}, see docs/limits.md)"


def describe_reason(reason: str) -> str:
    return reason.described() if isinstance(reason, Reason) else reason


#: every refusal class: what it is about, in one line (docs/limits.md says why each is one)
REFUSAL_CLASSES = {
    "user-mode": "a user TorchDispatchMode or TorchFunctionMode is active: the recompute would run without it",
    "compiled": "the block is a torch.compile'd function or module (torch < 2.6 only)",
    "scripted": "the block reaches a TorchScript module (torch.jit.script / trace), which reads its own parameters",
    "functionalize": "functionalize does not transform custom autograd Functions",
    "forward-over-forward": "jvp over jvp: forward mode does not differentiate a custom jvp",
    "dual-level": "a forward-AD dual level of the user's own (not torch.func.jvp's), with reverse mode too",
    "parametrize-cached": "torch.nn.utils.parametrize.cached(): its cache would hold the recompute's tensors",
    "tensor-subclass": "a tensor subclass with its own __torch_function__ (ExpandedWeights)",
    "global-tensor": "a tensor needing a gradient read through a global or a class attribute",
    "unlifted-read": "a tensor needing a gradient read where the walk cannot bind it (found at run time)",
    "leaf-inside": "the block makes a tensor require grad (requires_grad_()): a leaf inside the checkpoint",
    "write-outside": "the block writes in place into a tensor it was neither given nor made",
    "unseen-update": "an input's memory changed in a way no torch function showed (a C extension)",
    "long-container": "the block changes a container too long to keep a copy of",
}


#: :attr:`Plan.unpacked` where no reverse mode could differentiate the call
NOTHING_TO_SAVE = (
    "no reverse mode can differentiate it here (forward mode, a forward vmap, nothing requiring grad): "
    "the plain run kept nothing a checkpoint could save"
)


class UnrepeatableForward(RuntimeError):
    """Kept for compatibility: the forward updated an input in place without the proof keeping its value.

    Since the first forward is the plain run, such a call is no longer
    raised: it keeps the plain run's result, unpacked (:class:`Refused`).
    """


class ChangedSinceForward(RuntimeError):
    """A tensor the block reads was updated in place between its forward and this recompute.

    The recompute would read the new values (an optimizer step, ``w.mul_(2)``
    between ``vjp`` and its pullback, an in-place write through a view the
    block returned) and return wrong gradients.  Autograd's own check on
    saved tensors does not see it under torch.func: it compares the
    version of the transform's wrapper, which never moves.
    """


#: selective checkpointing's forward mode: fallback's plain run and the recompute here leave it out
SELECTIVE_CACHING_MODE = getattr(_tuc, "_CachingTorchDispatchMode", ())

#: Recomputes of blocks run so far, and derivatives checkpointed in turn (a backward or
#: tangents that something differentiated again).  The matrix reads them: a recompute
#: means the block's activations were not kept by the forward.
RECOMPUTES = 0
NESTED_RECOMPUTES = 0
#: Calls packed into the recompute (their plain run's activations dropped) so far
PACKED = 0

#: The run-time proof runs on every first forward.  ``benchmarks/proof.py`` switches it off
#: to measure what it costs; nothing else may (without it a wrong gradient goes unnoticed).
PROOF = True


class Plan:
    """One composable checkpoint call: what is lifted, how to run the block on it, how to replay it."""

    def __init__(
        self, function: Callable[..., Any], args: tuple, kwargs: dict, held: _rebind.Holdings, context_fn: Any,
    ) -> None:
        #: the call as made (for messages); :meth:`release` drops it once the forward has run
        self.original_function, self.args, self.kwargs = function, args, kwargs
        slots = []  # (module, store, name, tensor): every parameter, buffer and plain tensor attribute
        for module in held.modules:
            for store in ("_parameters", "_buffers"):
                for name, tensor in module.__dict__[store].items():
                    if isinstance(tensor, Tensor):
                        slots.append((module, store, name, tensor))
        attributes = []
        for module, name, value in held.attributes:
            if isinstance(value, Tensor):
                slots.append((module, "__dict__", name, value))
            else:
                attributes.append((module, name, value))
        inputs: dict = {}
        for *_, tensor in slots:
            inputs.setdefault(id(tensor), tensor)
        for tensor in held.tensors:
            if _carries_gradient(tensor):
                inputs.setdefault(id(tensor), tensor)
        for tensor in held.arguments:
            inputs.setdefault(id(tensor), tensor)
        self.inputs: Tuple[Tensor, ...] = tuple(inputs.values())
        # The block as a graph with holes where the inputs go: the plan lives as long as the
        # backward may run, and must not hold the call's tensors (nor the graphs they hold).
        index = {key: i for i, key in enumerate(inputs)}
        template = _rebind._Rebuild({key: _rebind.Hole(i) for key, i in index.items()})
        self.function = template(held.frozen)[0]  # its closures frozen (see the module docstring)
        #: the arguments as input indices where they are all lifted tensors (``checkpoint(block, h)``,
        #: the usual call): each recompute hands them on without walking a template; else None
        self.flat_args: Optional[List[int]] = None
        if not kwargs and all(isinstance(a, Tensor) and id(a) in index for a in args):
            self.flat_args = [index[id(a)] for a in args]
            self.call_args: Any = None
        else:
            self.call_args = template((args, kwargs))[0]
        #: (module, store, name, input index)
        self.slots = [(module, store, name, index[id(tensor)]) for module, store, name, tensor in slots]
        #: (module, name, value): the modules' plain numbers, flags and strings at the call (a
        #: timestep set before each call of a shared module, a counter the forward increments);
        #: each run binds those that changed since, so the recompute reads what the forward read
        self.scalars = held.scalars
        #: (module, name, value with holes, always bound?): plain attributes that may hold a lifted
        #: tensor; a forward-hook dict is copied now and always bound (a hook removed after the
        #: forward still runs in the recompute, as it ran in the forward)
        self.attributes = [
            (module, name, template(collections.OrderedDict(value) if hooks else value)[0], hooks)
            for module, name, value in attributes
            for hooks in [name in _rebind._FORWARD_HOOKS]
        ]
        #: the global module hooks (register_module_forward_hook) at the call, if any: each recompute
        #: runs under them, as the forward did, also after the user removed one
        self.global_hooks = _global_hooks()
        #: (module, name) of those plain attributes: the containers among them are watched in the forward
        self.attribute_names = [(module, name) for module, name, _ in attributes]
        self.grad_mode = torch.is_grad_enabled()
        #: inputs that required grad at the call: the forward makes them require grad too
        self.needs = [t.requires_grad and _differentiable_dtype(t) for t in self.inputs]
        #: inputs a gradient or a tangent can reach: those a grad or jvp level wraps, or that
        #: require grad (a buffer's tangent is a zero the transform made up: not passed on)
        self.reachable = [_differentiable_dtype(t) and _tracked(t) for t in self.inputs]
        #: ... of which these a tangent can reach (a grad or jvp level wraps them: eager
        #: requires_grad carries no tangent)
        self.tangent_reachable = [r and _tracked(t, eager=False) for r, t in zip(self.reachable, self.inputs)]
        self.context_fn = context_fn
        #: the Function's operands: these inputs, then the plain run's output tensors (precomputed)
        self.n_inputs = len(self.inputs)
        #: why the plain run cannot be packed into a recompute (the run-time proof's finding), or None
        self.refusal: Optional[str] = None
        #: (jvp level, tangents): the plain run's output tangents at the top jvp level, until used
        self.tangents: Optional[tuple] = None
        #: after :func:`run`: why the plain run was the result and nothing was packed, or None (packed)
        self.unpacked: Optional[str] = None
        self.versions: List[Optional[int]] = []
        self.vmaps_at_forward: frozenset = frozenset()
        #: the versions, once the forward has run, of the inputs it read (None for the others):
        #: every recompute checks them
        self.versions_after: List[Optional[int]] = []
        #: the indices of the inputs the first forward read (None: not known, all are checked)
        self.read: Optional[set] = None
        #: input index -> its value before the forward updated it in place (see for_recompute)
        self.pre_forward: dict = {}
        #: inputs needing a gradient the forward rewrote with what a rewrite leaves as is (an
        #: Embedding's max_norm): each recompute starts from a copy of the saved one
        self.rewritten: frozenset = frozenset()
        #: (weakref, version, storage) of each tensor the forward read as a constant (a closure's
        #: mask): every recompute checks that it is still what the forward read
        self.constants: list = []
        #: the inputs the block updates in place: every recompute hands it copies of these
        self.written: frozenset = frozenset()
        self.output_template: Any = None
        self.output_ids: List[int] = []
        self.output_kept: List[bool] = []
        self.recompute_context: Any = _NO_CONTEXT
        self.rng: Any = None
        #: (generator, state) of each user torch.Generator the forward drew from, before its first draw
        self.generators: List[tuple] = []
        #: the user's containers the forward changed, as it found them (``_state.contents_snapshot``
        #: entries): every recompute runs with these contents, and puts back what they hold then
        self.contents: List[tuple] = []
        self.autocast: Any = None
        self.default_dtype = torch.get_default_dtype()
        #: a torch.device(...) context's device at the call: the Function's forward
        #: runs without function modes, so it is re-entered there and in the recompute
        self.default_device: Any = _state.forward_device_context()
        #: called before every recompute; raises for a drift the recompute cannot undo (an
        #: optimizer step), or returns fallback's replays (a train/eval switch: see ``_drift``)
        self.check_recompute: Callable[[], Any] = lambda: None

    # -- running the block on a given set of input tensors

    def release(self) -> None:
        """Forget the call's own objects once the forward has run (the recompute uses the holes)."""
        self.original_function = self.args = self.kwargs = None
        self.inputs = ()

    def call(self, tensors: Sequence[Tensor]) -> Any:
        """The block on ``tensors`` (a recompute's): its template filled in, its modules bound to them.

        An input the block updates in place is handed to it as a copy made
        here, inside what the recompute differentiates: the saved one stays as
        it is for the next recompute, and the update is one the recompute's own
        level records (a leaf of the vjp's level cannot be written in place).
        """
        if self.written:
            tensors = [t.clone() if i in self.written else t for i, t in enumerate(tensors)]
        rebuild = _rebind._Rebuild({}, fill=tensors)
        bindings = [(module, store, name, tensors[i]) for module, store, name, i in self.slots]
        for module, name, value in self.scalars:
            now = module.__dict__.get(name, _rebind._ABSENT)
            if now is not value and not (type(now) is type(value) and now == value):
                bindings.append((module, "__dict__", name, value))
        for module, name, value, always in self.attributes:
            new, changed = rebuild(value)
            if changed or always:
                bindings.append((module, "__dict__", name, new))
        with _rebind.bound(bindings), _global_hooks_as(self.global_hooks), _compiled_code_eager():
            function = rebuild(self.function)[0]
            if self.flat_args is not None:
                return function(*[tensors[i] for i in self.flat_args])
            args, kwargs = rebuild(self.call_args)[0]
            return function(*args, **kwargs)

    def _given_containers(self) -> list:
        """The user's containers the block is given (arguments, closure, partial, module attributes)."""
        roots = _state._argument_roots(self.original_function, self.args, self.kwargs) or []
        for module, name in self.attribute_names:
            value = module.__dict__.get(name)
            if name not in _rebind._FORWARD_HOOKS and _state._holds_container(value):
                roots.append((f"{type(module).__name__}.{name}", value))
        return roots

    def pure(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The block as a function of its input tensors to its output tensors (for vjp / jvp)."""
        return tuple(_output_tensors(self.call(tensors)))

    # -- the first forward: the plain run, then packed into the recompute

    def first_run(self) -> Any:
        """Run the block as the caller wrote it, at the caller's levels, under the run-time proof.

        Returns what the block returns.  This run *is* the uncheckpointed code:
        right whatever the proof finds, run once.  What the proof found is in
        :attr:`refusal` (None: the call can be packed).  The user's exceptions
        pass through untouched.
        """
        inputs = self.inputs
        self.capture_forward_state(inputs)
        forward_context = contextlib.nullcontext()
        if self.context_fn is not None:
            forward_context, self.recompute_context = self.context_fn()
            if isinstance(forward_context, SELECTIVE_CACHING_MODE):
                # Selective checkpointing caches ops by their order in torch's own recompute;
                # the vjp here runs other ops, so the cache would not line up ("not found in
                # storage"). Its policy only chooses what to keep: recomputing all is correct.
                forward_context, self.recompute_context = contextlib.nullcontext(), _NO_CONTEXT
        if self.refusal is not None:  # no recompute will follow (see :func:`plan`): only the plain run
            with forward_context, _plain_nested_checkpoints():
                return self.original_function(*self.args, **self.kwargs)
        self.versions = [_version(_base(t)) for t in inputs]  # a wrapper's own counter never moves
        self.vmaps_at_forward = _vmap_levels()
        given = _state.contents_snapshot(self._given_containers())
        level = _current_level() if _state.peek_interpreter_stack() is not None else -1
        check = _proof.ReadCheck(inputs, level) if PROOF else None
        with forward_context, _plain_nested_checkpoints(), _compiled_code_eager():
            if check is None:
                output = self.original_function(*self.args, **self.kwargs)
            else:
                check.given(inputs)
                with check:
                    output = self.original_function(*self.args, **self.kwargs)
        found = _output_tensors(output)
        if check is not None:
            check.check_outputs(found)
            self.generators = list(check.generators.values())
            if check.refused is not None:
                self.refusal = _describe_unlifted(self, check.refused)
                return output
            self.refusal = self._unseen_update(check)
            if self.refusal is not None:
                return output
            self.constants = list(check.constants.values())
            self.pre_forward = {i: kept for i, kept in check.before.items() if self._updated(i, kept, inputs[i])}
            self.rewritten = frozenset(check.rewritten)
            self.written = frozenset(self.pre_forward) | self.rewritten
            self.read = None if check.unseen_reads else check.read
        if given:
            self.contents, self.refusal = _contents_to_replay(given)
            if self.refusal is not None:
                return output
        read = self.read  # a module's other parameters are lifted too: another's optimizer step is no change
        self.versions_after = [
            _version(_base(t)) if read is None or i in read else None for i, t in enumerate(inputs)
        ]
        self.output_template = output
        self.output_ids = [id(t) for t in found]
        self.output_kept = [_differentiable_dtype(t) for t in found]
        return output

    def keep_tangents(self, output: Any) -> None:
        """Where the top level is a jvp: the plain run's output tangents, cut from its graph, for
        the Function's jvp rule of that level to hand on (see :meth:`take_tangents`)."""
        self.tangents = None
        top = _state.peek_interpreter_stack()
        if top is None or top.key().name != "Jvp":
            return
        level = top.level()
        tangents = []
        for o, kept in zip(_output_tensors(output), self.output_kept):
            if not kept:
                continue
            tangent = _state.forward_ad.unpack_dual(o).tangent
            if tangent is None:
                return  # an output the duals do not reach: the recompute makes its zero tangent
            tangents.append(_unwrap_for_grad(tangent, level).detach())
        self.tangents = (level, tuple(tangents))

    def take_tangents(self, level: Optional[int]) -> Optional[Tuple[Tensor, ...]]:
        """The plain run's tangents for the jvp rule of ``level``, once (a later call recomputes)."""
        kept, self.tangents = self.tangents, None
        if kept is None or kept[0] != level:
            return None
        return kept[1]

    def ran_under(self, level: int, batch_size: int, randomness: str) -> bool:
        """Whether the plain run ran under this vmap (its random draws were batched by it)."""
        return (level, batch_size, randomness) in self.vmaps_at_forward

    def precomputed(self, output: Any) -> List[Tensor]:
        """The plain run's output tensors, cut from its graph, to hand to the recompute's Function.

        Handed in as operands, they reach the Function's forward through every
        level's own unwrapping (a vmap rule sees where each is batched); the
        forward returns them, so the block never runs inside the Function.
        ``.detach()`` keeps the batching and drops the autograd history at every
        level, so nothing holds the plain run's activations once it returns.
        An output sharing memory with an input is copied (the Function's output
        must not alias what it saves for backward).
        """
        found = _output_tensors(output)
        storages = None
        kept = []
        for t in found:
            if storages is None and any(_proof._storage_address(t) is not None for t in found):
                storages = {_proof._storage_address(i) for i in self.inputs}
            if storages and _proof._storage_address(t) in storages:
                t = t.clone()
            kept.append(t.detach())
        return kept

    def forward_outputs(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The Function's forward: the plain run's outputs, as they arrive at this level (never a rerun)."""
        return tuple(t.detach() for t in tensors[self.n_inputs:])

    def for_recompute(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The saved inputs, checked: every input the forward read must still be what it read.

        An input the forward updated in place (a BatchNorm's running
        statistics, ``h += pos``) was saved as a copy of what the forward
        started from (see :func:`_run`), and each recompute updates a copy of
        that copy (:meth:`call`), so the update happens once, as without
        checkpointing; an input needing a gradient that the block rewrites
        idempotently (``rewritten``) is copied too.  Any other input whose
        version moved raises :class:`ChangedSinceForward`.
        """
        for i, (t, was) in enumerate(zip(tensors, self.versions_after)):
            if was is not None and i not in self.pre_forward and _version(_base(t)) != was:
                self.check_recompute()  # a drift rule that explains it (an optimizer step: CKG108) speaks first
                raise self._changed_since_forward(i, t, was)
        for ref, was, _ in self.constants:
            constant = ref()
            if constant is not None and _version(_base(constant)) != was:
                self.check_recompute()
                raise ChangedSinceForward(
                    f"ckpt_guard's composable recompute: a tensor the checkpointed block reads as a constant "
                    f"(a {tuple(_base(constant).shape)} tensor that needs no gradient, a mask or a table it "
                    f"holds) was updated in place after the block's forward and before this recompute (its "
                    f"version was {was}, now {_version(_base(constant))}). The recompute would read the new "
                    "values, so it stops here, as autograd stops the same program without checkpointing where "
                    "an operation saved it ('modified by an inplace operation'). Update a copy instead, or "
                    "take the gradient before the update."
                )
        return tuple(tensors)

    def _unseen_update(self, check: _proof.ReadCheck) -> Optional[str]:
        """Why the call cannot be packed, if the forward moved an input's version with no copy kept."""
        for i, (t, was) in enumerate(zip(self.inputs, self.versions)):
            if was is None or _version(_base(t)) == was or i in check.before or i in check.rewritten:
                continue
            path = _rebind.describe_path(self.original_function, self.args, self.kwargs, t)
            return Reason(
                "unseen-update",
                f"the block updated {path or 'a tensor it reads'} (a {tuple(_base(t).shape)} tensor) in place "
                "in a way the run-time proof did not see coming (a C extension, or with torch functions "
                "off), so no copy of what it started from was kept for the recompute",
            )
        return None

    def _changed_since_forward(self, i: int, t: Tensor, was: int) -> ChangedSinceForward:
        held = [self._slot_name(module, name) for module, _, name, index in self.slots if index == i]
        what = f"{held[0]}, which the checkpointed block reads" if held else "a tensor the checkpointed block reads"
        return ChangedSinceForward(
            f"ckpt_guard's composable recompute: {what} "
            f"(a {tuple(_base(t).shape)} tensor) was updated in place after the block's forward and "
            f"before this recompute (its version was {was}, now {_version(_base(t))}). The recompute would "
            "read the new values and return wrong gradients, so it stops here. Take the gradient "
            "(backward, the vjp's pullback) before updating it (optimizer.step() after loss.backward()), "
            "update a copy instead (w = w * 2, not w.mul_(2)), or call the block without checkpointing."
        )

    def _slot_name(self, module: Any, name: str) -> str:
        """``Net.stage2.lin.weight``: the attribute's path from the outermost module the block reaches."""
        best = ""
        for outer in {id(m): m for m, *_ in self.slots}.values():
            for path, sub in outer.named_modules():
                if sub is module and path and len(path) > len(best.split(".", 1)[-1]):
                    best = f"{type(outer).__name__}.{path}"
        return f"{best or type(module).__name__}.{name}"

    def _updated(self, i: int, kept: Tensor, now: Tensor) -> bool:
        # a kernel may write without bumping the version (BatchNorm's running statistics)
        return self.versions[i] != _version(_base(now)) or not torch.equal(_base(kept), _base(now))

    def rebuild(self, outputs: Sequence[Tensor]) -> Any:
        """The block's output with the Function's outputs in place of the forward's tensors."""
        return _rebind.rebuild(self.output_template, dict(zip(self.output_ids, outputs)))

    def differentiable_outputs(self) -> List[bool]:
        return self.output_kept

    def differentiable_inputs(self, forward: bool = False) -> List[bool]:
        return self.tangent_reachable if forward else self.reachable

    # -- what the forward saw, and its replay

    def capture_forward_state(self, tensors: Sequence[Tensor]) -> None:
        self.default_dtype = torch.get_default_dtype()
        if all(t.device.type == "cpu" for t in tensors):  # torch's answer then, without its pytree walk
            device_type = _tuc.DefaultDeviceType.get_device_type()
        else:
            device_type = _tuc._infer_device_type(*tensors)
        self.autocast = (device_type, *_tuc._get_autocast_kwargs(device_type))
        device_module = getattr(torch, device_type, None)
        devices, states = ([], [])
        if device_type != "cpu" and getattr(device_module, "_initialized", False):
            devices, states = _tuc.get_device_states(*tensors)
        self.rng = (torch.get_rng_state(), devices, states, device_type)

    @contextlib.contextmanager
    def replay(self) -> Any:
        """The forward's RNG, default dtype and device, autocast and the recompute context, around a recompute.

        Only what differs from now is entered (a recompute in the backward
        usually runs where the forward ran: same dtype, autocast off): each
        context costs microseconds, and a recompute runs per block per step.
        """
        replays = self.check_recompute() or ()
        device_type, device_autocast, cpu_autocast = self.autocast
        with contextlib.ExitStack() as stack:
            for replay in replays:  # fallback: a module's train/eval mode as in the forward
                stack.enter_context(replay)
            if torch.get_default_dtype() != self.default_dtype:
                stack.enter_context(default_dtype(self.default_dtype))
            if self.default_device is not None:  # a fresh context, as torch >= 2.11 does
                stack.enter_context(torch.device(self.default_device))
            stack.enter_context(_forward_rng(*self.rng))
            if self.generators:
                # the recompute draws are not the program's: each is left where the program had it
                stack.enter_context(_state.replaying_generators(self.generators, lock=False))
            if self.contents:
                stack.enter_context(_state.replaying_contents(self.contents, lock=False))
            device_now, cpu_now = _tuc._get_autocast_kwargs(device_type)  # how torch's checkpoint records them
            if device_type != "cpu" and device_autocast is not None and device_autocast != device_now:
                stack.enter_context(torch.amp.autocast(device_type=device_type, **device_autocast))
            if cpu_autocast != cpu_now:
                stack.enter_context(torch.amp.autocast("cpu", **cpu_autocast))
            if self.recompute_context is not _NO_CONTEXT:
                stack.enter_context(self.recompute_context)
            stack.enter_context(_plain_nested_checkpoints())
            yield
        global RECOMPUTES
        RECOMPUTES += 1


_NO_CONTEXT = contextlib.nullcontext()


@contextlib.contextmanager
def _forward_rng(cpu_state: Tensor, devices: list, states: list, device_type: str) -> Any:
    """The forward's RNG states while a recompute runs, the program's back afterwards (``fork_rng``'s job,
    for the devices the forward's inputs were on)."""
    device_module = getattr(torch, device_type, None) if devices else None
    program_cpu = torch.get_rng_state()
    program_devices = [device_module.get_rng_state(d) for d in devices] if devices else []
    torch.set_rng_state(cpu_state)
    if devices:
        _tuc.set_device_states(devices, states)
    try:
        yield
    finally:
        torch.set_rng_state(program_cpu)
        for device, state in zip(devices, program_devices):
            device_module.set_rng_state(state, device)


def _contents_to_replay(given: tuple) -> Tuple[List[tuple], Optional[str]]:
    """What the recompute must replay of the containers the forward changed, and why it cannot, if so.

    Each recompute starts from what the forward found, and puts back what
    is there then (a counter, a log, a KV cache changes once, as without
    checkpointing).  The plain run changed the user's own containers; a
    tensor it put there belongs to the plain run's graph, which the code
    reading it differentiates as it would without checkpointing.  Only a
    container too long to keep a copy of cannot be replayed.  A tensor in
    them updated in place is the proof's.
    """
    changed = [entry for entry in _state.changed_at_all(given) if entry[2] != "tensor"]
    for path, value, kind, recorded in changed:
        if not _state.replayable([(path, value, kind, recorded)]):
            return [], Reason("long-container", f"it changes {path}, a container too long to keep a copy of")
    return changed, None


def _output_tensors(output: Any) -> List[Tensor]:
    """The tensors in a block's output (any structure: containers, dataclasses, objects), once each."""
    found: dict = {}

    def visit(obj: Any, bindable: bool) -> None:
        if isinstance(obj, Tensor):
            found.setdefault(id(obj), obj)

    _rebind._Rebuild({}, visit)(output)
    return list(found.values())


class _Derivative:
    """The vjp (``"vjp"``) or the tangents (``"jvp"``) of a plan, as a block of its own.

    Its inputs: all the base's inputs, then the cotangents present (vjp) or the
    tangents of the ``wanted`` inputs (jvp).  Checkpointed like any block, so a
    derivative that is differentiated again keeps its inputs, not its activations.
    """

    def __init__(self, base: Any, kind: str, wanted: List[int], present: Sequence[bool]) -> None:
        self.base, self.kind, self.wanted, self.present = base, kind, wanted, list(present)
        self.output_kept: List[bool] = []
        self.n_inputs = sys.maxsize  # all its operands are inputs: it computes its outputs

    def _function(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        n = len(tensors) - (sum(self.present) if self.kind == "vjp" else len(self.wanted))
        primals, extra = self.base.for_recompute(tensors[:n]), tensors[n:]
        with self.base.replay():
            if self.kind == "jvp":
                return _jvp(self.base, primals, self.wanted, extra)
            outputs, pullback = _vjp(self.base, primals, self.wanted)
            given = iter(extra)
            cotangents = tuple(next(given) if p else torch.zeros_like(o) for p, o in zip(self.present, outputs))
            return tuple(pullback(cotangents))

    def forward_outputs(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        if self.n_inputs < len(tensors):  # the plain run's tangents, handed in (see _Recompute.jvp)
            outputs = tuple(t.detach() for t in tensors[self.n_inputs:])
            self.output_kept = [_differentiable_dtype(o) for o in outputs]
            return outputs
        global NESTED_RECOMPUTES
        NESTED_RECOMPUTES += 1
        with torch.no_grad():  # torch.func's transforms inside ignore it; no eager graph is kept
            outputs = self._function(tensors)
        self.output_kept = [_differentiable_dtype(o) for o in outputs]
        passed = {id(t) for t in tensors}
        return tuple(o.clone() if id(o) in passed else o.detach() for o in outputs)

    def pure(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        return self._function(tensors)

    def replay(self) -> Any:
        return contextlib.nullcontext()  # its function replays the base

    def for_recompute(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        return tuple(tensors)  # its function asks the base

    def differentiable_outputs(self) -> List[bool]:
        return self.output_kept

    def differentiable_inputs(self, forward: bool = False) -> List[bool]:
        extra = sum(self.present) if self.kind == "vjp" else len(self.wanted)
        return [*self.base.differentiable_inputs(forward), *([True] * extra)]


class _Batched:
    """A node vmapped: the block under ``torch.vmap``, checkpointed whole (vmap of a checkpoint).

    Over a plan, its forward hands on the plain run's outputs (batched where
    ``precomputed_dims`` says); its recompute runs the block under
    ``torch.vmap`` with the level's randomness.
    """

    def __init__(
        self, base: Any, in_dims: Sequence[Optional[int]], randomness: str, batch_size: int = 0,
        precomputed_dims: Sequence[Optional[int]] = (),
    ) -> None:
        self.base, self.in_dims, self.batch_size = base, tuple(in_dims), batch_size
        self.n_inputs = base.n_inputs
        if (
            isinstance(base, _Derivative) and all(d is None for d in self.in_dims[: _primal_count(base, in_dims)])
            and not _root(base).ran_under(_vmap_level_of_rule(), batch_size, randomness)
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
        found: List[bool] = []
        in_dims, operands = self.in_dims, tuple(tensors)
        if all(d is None for d in in_dims):
            # only the block's random draws are batched (randomness="different" over unbatched
            # inputs): torch.vmap needs a batched operand to know the batch size
            in_dims, operands = (*in_dims, 0), (*operands, torch.empty(self.batch_size, 0))

        def per_sample(*ts: Tensor) -> Tuple[Tensor, ...]:
            outputs = inner(ts[: len(tensors)])
            level = _current_level()
            found[:] = [_batched_at(o, level) for o in outputs]
            return outputs

        outputs = torch.vmap(per_sample, in_dims=in_dims, randomness=self.randomness)(*operands)
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

    def out_dims(self) -> Tuple[Optional[int], ...]:
        return tuple(0 if batched else None for batched in self.out_batched)

    def replay(self) -> Any:
        return self.base.replay()

    def for_recompute(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        return self.base.for_recompute(tensors)

    def differentiable_outputs(self) -> List[bool]:
        return self.base.differentiable_outputs()

    def differentiable_inputs(self, forward: bool = False) -> List[bool]:
        return self.base.differentiable_inputs(forward)


_GLOBAL_HOOKS = tuple(
    name for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                      "_global_forward_hooks_always_called")
    if hasattr(torch.nn.modules.module, name)
)
_GLOBAL_HOOKS_LOCK = __import__("threading").Lock()


def _global_hooks() -> Optional[tuple]:
    """A copy of each global module-hook dict, or None where all are empty (the usual case)."""
    module = torch.nn.modules.module
    dicts = [getattr(module, name) for name in _GLOBAL_HOOKS]
    if not any(dicts):
        return None
    return tuple(dict(d) for d in dicts)


@contextlib.contextmanager
def _global_hooks_as(recorded: Optional[tuple]) -> Any:
    """The global module hooks as the forward found them, for one recompute (where they changed since).

    They are process-wide: while they are put back, under a lock, another
    thread's module calls see the forward's hooks too.
    """
    module = torch.nn.modules.module
    dicts = [getattr(module, name) for name in _GLOBAL_HOOKS]
    if recorded is None:
        if not any(dicts):
            yield
            return
        recorded = tuple({} for _ in dicts)
    if all(dict(d) == r for d, r in zip(dicts, recorded)):
        yield
        return
    with _GLOBAL_HOOKS_LOCK:
        now = [dict(d) for d in dicts]
        for d, r in zip(dicts, recorded):
            d.clear()
            d.update(r)
        try:
            yield
        finally:
            for d, n in zip(dicts, now):
                d.clear()
                d.update(n)


def _vmap_level_of_rule() -> int:
    """The level of the vmap whose rule is running (it has been lowered: the one above the top)."""
    return (_current_level() if _state.peek_interpreter_stack() is not None else 0) + 1


def _vmap_levels() -> frozenset:
    """(level, batch size, randomness) of each vmap alive now."""
    if not any(name == "Vmap" for name, _ in _state.interpreter_levels()):
        return frozenset()
    return frozenset(
        (i.level(), i.batch_size(), i.randomness())
        for i in pyfunctorch.retrieve_all_functorch_interpreters() if i.key().name == "Vmap"
    )


def _primal_count(derivative: _Derivative, in_dims: Sequence[Any]) -> int:
    return len(in_dims) - (sum(derivative.present) if derivative.kind == "vjp" else len(derivative.wanted))


def _recompute_of(plan: Any) -> Callable[..., Tuple[Tensor, ...]]:
    """The block as a function of all its inputs to its differentiable outputs."""

    def recompute(*tensors: Tensor) -> Tuple[Tensor, ...]:
        return tuple(o for o in plan.pure(tensors) if _differentiable_dtype(o))

    return recompute


def _vjp(plan: Any, tensors: Sequence[Tensor], wanted: Sequence[int]) -> Tuple[Tuple[Tensor, ...], Callable[..., Any]]:
    """``(outputs, pullback)`` of the block with respect to the ``wanted`` inputs.

    Every input is wrapped at the new grad level (as ``torch.func.grad`` wraps
    all its arguments), so a block that updates a buffer in place (BatchNorm's
    ``num_batches_tracked``) does what it does without checkpointing.
    """
    return _levels.vjp(_recompute_of(plan), tensors, wanted)


def _jvp(
    plan: Any, tensors: Sequence[Tensor], wanted: Sequence[int], directions: Sequence[Tensor],
) -> Tuple[Tensor, ...]:
    """The output tangents of the block along ``directions`` (of the ``wanted`` inputs).

    The other inputs stay as they are (constants of the jvp level): wrapped at
    it without a tangent, an RNN's forward-mode formula mixes batched and
    unbatched tangents in place (under jacfwd) and fails.
    """
    recompute = _recompute_of(plan)
    root = _root(plan)
    grad_mode = root.grad_mode  # the call's: a block may branch on it (nn.TransformerEncoder's fast path)
    # the inputs that required grad at the call require grad here too (kernels are chosen by it:
    # an LSTM's fused one has a forward-mode formula that fails under jacfwd), under a throwaway
    # grad level below the jvp's, whose graph goes when it exits
    needed = [i for i, need in enumerate(root.needs[: len(tensors)]) if need] if grad_mode else []

    def along(*full: Tensor) -> Tuple[Tensor, ...]:
        with torch.set_grad_enabled(grad_mode):
            return recompute(*full)

    with contextlib.ExitStack() as stack:
        given = list(tensors)
        level = None
        if needed:
            level = stack.enter_context(_grad_increment_nesting())
            stack.enter_context(torch.enable_grad())
            given = [_wrap_for_grad(t, level) for t in given]
            with _enable_inplace_requires_grad(True):
                for i in needed:
                    if i not in wanted and _differentiable_dtype(given[i]):
                        given[i].requires_grad_()
        # a dual's primal cannot overlap itself (a cotangent of .sum() is an expanded one)
        for i in wanted:
            given[i] = _unexpanded(given[i])
        # every input wrapped at the jvp's level, the wanted ones as duals (as jacfwd wraps its
        # arguments): a BatchNorm's running statistics are then its own to update, not captured
        output_tangents = _jvp_with_argnums(along, tuple(given), tuple(directions), tuple(wanted), has_aux=False)[1]
        if level is not None:
            output_tangents = tuple(_unwrap_for_grad(t, level) for t in output_tangents)
    return tuple(output_tangents)


def _root(node: Any) -> Plan:
    while not isinstance(node, Plan):
        node = node.base
    return node


def _unexpanded(t: Tensor) -> Tensor:
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return t.clone()
    return t


# --------------------------------------------------------------------------
# will anything differentiate this backward (or these tangents) again?

_GRAD = "Grad"


def _own_level(tensors: Sequence[Tensor]) -> Optional[int]:
    """The live grad or jvp level the saved tensors are wrapped at (the node's own), or None."""
    level = None
    for t in tensors:
        if _state.is_functorch_wrapped_tensor(t) and not is_batchedtensor(t):
            found = maybe_get_level(t)  # -2: a dead wrapper (its transform has exited)
            if found >= 0 and (level is None or found > level):
                level = found
    return level


def _differentiated_again(
    saved: Sequence[Tensor], incoming: Sequence[Optional[Tensor]], own: Any = "saved",
) -> bool:
    """Whether reverse mode (a live grad level, or eager autograd) will differentiate what this derivative returns.

    Forward mode (a jvp level, a dual level) differentiates it too, but as it
    runs, keeping nothing: computed directly, it costs one recompute less than
    checkpointed, and no more memory (``jvp(grad)``, ``hessian``).
    """
    if own == "saved":  # the level whose node this is: the saved tensors' (a jvp passes its own)
        own = _own_level(saved)
    eager_grad_mode = None
    for interpreter in _get_interpreter_stack() or ():  # C interpreters: cheap to read
        if interpreter.key().name == _GRAD:
            if interpreter.level() != own:
                return True
            if eager_grad_mode is None:
                eager_grad_mode = _CGradInterpreterPtr(interpreter).prevGradMode()
    if eager_grad_mode is None:
        eager_grad_mode = torch.is_grad_enabled()
    return bool(eager_grad_mode) and any(t is not None and _base(t).requires_grad for t in (*saved, *incoming))


def _batched_at(t: Tensor, level: int) -> bool:
    while _state.is_functorch_wrapped_tensor(t):
        if is_batchedtensor(t) and maybe_get_level(t) == level:
            return True
        t = _state.get_unwrapped(t)
    return False


@contextlib.contextmanager
def _unbatched_vmaps_set_aside(primals: Sequence[Tensor]) -> Any:
    """Pop the vmap levels on top of the stack that batch none of ``primals`` (a jacrev's).

    The forward never ran under them, so the recompute's linearization must not
    either (its random draws would be refused or batched); the pullback, which
    takes the batched cotangents, runs under them as usual.
    """
    with contextlib.ExitStack() as stack:
        while _state.peek_interpreter_stack() is not None:
            top = pyfunctorch.retrieve_current_functorch_interpreter()
            if top.key().name != "Vmap" or any(_batched_at(p, top.level()) for p in primals):
                break
            stack.enter_context(pyfunctorch.temporarily_pop_interpreter_stack())
        yield


class _Recompute(torch.autograd.Function):
    """The composable checkpoint: forward without activations, every rule a recompute.

    Operands: the node (a :class:`Plan`, or a :class:`_Derivative` /
    :class:`_Batched` of one), its ``node.n_inputs`` inputs, then, for a plan,
    the plain run's outputs (precomputed: the forward returns them).  Only the
    inputs are saved, and only they get gradients or tangents.
    """

    @staticmethod
    def forward(node: Any, *tensors: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
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
        ctx.save_for_backward(*inputs_only)
        ctx.save_for_forward(*inputs_only)
        fixed = [o for o in output if not _differentiable_dtype(o)]
        if fixed:
            ctx.mark_non_differentiable(*fixed)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan = ctx.plan
        tensors = plan.for_recompute(ctx.saved_tensors)
        extra = (None,) * (len(ctx.needs_input_grad) - 1 - len(tensors))  # the precomputed outputs
        needed = ctx.needs_input_grad[1:]
        reachable = plan.differentiable_inputs()
        wanted = [i for i, t in enumerate(tensors) if needed[i] and reachable[i] and _differentiable_dtype(t)]
        if not wanted:
            return (None,) * (1 + len(tensors)) + extra
        cotangents = [g for g, kept in zip(grad_outputs, plan.differentiable_outputs()) if kept]
        if _differentiated_again(tensors, cotangents):
            derivative = _Derivative(plan, "vjp", wanted, [c is not None for c in cotangents])
            grads = _levels.apply(derivative, *tensors, *(c for c in cotangents if c is not None))
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
            with _unbatched_vmaps_set_aside(tensors), plan.replay(), torch.no_grad():
                outputs, pullback = _vjp(plan, tensors, wanted)
            with torch.set_grad_enabled(building):  # no graph of the vjp otherwise: it would keep the recompute alive
                grads = pullback(tuple(torch.zeros_like(o) if c is None else c for o, c in zip(outputs, cotangents)))
        result: List[Optional[Tensor]] = [None] * len(tensors)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (None, *result) + extra

    @staticmethod
    def jvp(ctx: Any, plan_tangent: Any, *tangents: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan = ctx.plan
        tensors = plan.for_recompute(ctx.saved_tensors)
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
        # jacfwd): handed on, not recomputed (the recompute's graph would double the block's peak)
        precomputed = plan.take_tangents(own) if isinstance(plan, Plan) else None
        if _differentiated_again(tensors, directions, own):
            derivative = _Derivative(plan, "jvp", wanted, ())
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


_levels.FUNCTION = _Recompute  # applied level by level without torch's per-call class (see _levels)


def _forward_mode_alive() -> bool:
    """Whether forward-mode AD is differentiating what runs now (a jvp level, or a dual level)."""
    if _state.forward_ad._current_level >= 0:
        return True
    if _state.peek_interpreter_stack() is None:
        return False
    return any(name == "Jvp" for name, _ in _state.interpreter_levels())


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Any:
    """``torch.set_default_dtype(dtype)`` for a block (the recompute's; fallback's CKG105 replay)."""
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


# --------------------------------------------------------------------------
# deciding whether the composable recompute is right for a call


def plan(
    function: Callable[..., Any], args: tuple, kwargs: dict, *, context_fn: Any = None,
    preserve_rng_state: bool = True,
) -> Union[Plan, str]:
    """A :class:`Plan` for this call, or why the composable recompute would be wrong here.

    ``preserve_rng_state=False`` would let the recompute draw other numbers
    (CKG107): the forward's RNG is always replayed.  Where no reverse mode can
    differentiate the call (``jvp``, ``jacfwd``, ``linearize``, a forward
    ``vmap``), nothing would be recomputed: a reason that is only about the
    recompute does not refuse the call then; the plan runs the block plainly
    (its :attr:`Plan.refusal` set) and that is the result.
    """
    why = _why_not_packed(function, args, kwargs)
    held = None
    if why is None:
        held = _rebind.holdings(function, args, kwargs)
        why = _why_not_packed_held(function, held)
    if why is not None:
        if held is None:
            held = _rebind.holdings(function, args, kwargs)
        if _reverse_mode_possible(args, kwargs, held):
            return why
    built = Plan(function, args, kwargs, held, context_fn)
    if why is None:
        lifted = {id(t) for t in built.inputs}
        unlifted = [t for t in held.unbindable if id(t) not in lifted and _carries_gradient(t)]
        if unlifted:
            names = _global_names(function, unlifted[0])
            which = f"the global {names}" if names else "a global"
            why = Reason(
                "global-tensor",
                f"it reads a tensor that needs a gradient through {which}, which cannot be passed to "
                "the recompute as an input (its gradient would be lost)",
                fix=(
                    f"pass {names or 'that tensor'} to the block as an argument: ckpt_guard.checkpoint(block, x, "
                    f"{names.split('.')[-1] if names else 'w'}) with block(x, {names.split('.')[-1] if names else 'w'}): "
                    "the composable recompute then lifts it, and its gradient is kept"
                ),
            )
            if _reverse_mode_possible(args, kwargs, held):
                return why
    if not built.inputs:
        return "it reads no tensor: there is nothing to recompute"
    built.refusal = why  # no reverse mode can follow: the plain run is the result, whatever this says
    return built


def _compiled(function: Any) -> bool:
    """A ``torch.compile``'d function or module (the function itself, or bound in a partial)."""
    function = getattr(function, "func", function)
    return hasattr(function, "_torchdynamo_orig_callable") or hasattr(function, "_orig_mod")


_SET_STANCE = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6


def _compiled_code_eager() -> Any:
    """Compiled code the block calls runs eagerly, where dynamo is loaded (torch >= 2.6).

    Dynamo traces the run-time proof's mode and cannot make fake tensors of
    torch.func's wrappers under it; and a compiled recompute under torch.func
    runs frame by frame anyway.  The values are the same.  The stance is
    process-wide: while a block runs, another thread's compiled code runs
    eagerly too.
    """
    if _SET_STANCE is None or "torch._dynamo" not in sys.modules:
        return _NO_CONTEXT
    return _EAGER_STANCE


class _SharedEagerStance:
    """``set_stance("force_eager")`` shared by every block running now, on any thread: the first in
    sets it, the last out puts back what was there (set_stance itself restores in its own order,
    which two threads interleave).

    Set through dynamo's own ``_set_stance`` with the force_eager stance made
    once, where torch has it: ``torch.compiler.set_stance`` builds and checks
    a stance object per call, and a block enters this twice per step (its
    forward and its recompute).
    """

    def __init__(self) -> None:
        self.lock = __import__("threading").Lock()
        self.users = 0
        self.undo: Any = None
        self.force_eager: Any = None  # dynamo's force_eager stance object, once made

    def __enter__(self) -> None:
        with self.lock:
            if self.users == 0:
                self.undo = self._set()
            self.users += 1

    def __exit__(self, *exc: Any) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                undo, self.undo = self.undo, None
                undo()

    def _set(self) -> Callable[[], Any]:
        """Set the stance; returns what undoes it.  The first time (or where dynamo has no
        ``_set_stance``) through ``torch.compiler.set_stance``, keeping the stance object it made."""
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        set_raw = getattr(eval_frame, "_set_stance", None)
        if set_raw is None or self.force_eager is None:
            stance = _SET_STANCE("force_eager")
            stance.__enter__()
            if set_raw is not None:
                self.force_eager = getattr(eval_frame, "_stance", None)
            return lambda: stance.__exit__(None, None, None)
        prior = set_raw(self.force_eager)
        return lambda: set_raw(prior)


_EAGER_STANCE = _SharedEagerStance()


def _why_not_packed(function: Any, args: tuple, kwargs: dict) -> Optional[str]:
    """A reason, read from torch's state, why no recompute of this call could be right (or None)."""
    if _SET_STANCE is None and _compiled(function):
        return Reason(
            "compiled",
            "the block is a torch.compile'd function: dynamo would trace the run-time proof's mode (torch "
            "2.6 and later run it eagerly instead; here, checkpoint the uncompiled function)",
        )
    if _state.user_dispatch_modes() or _state.user_function_modes():
        return Reason("user-mode", "a user mode is active: the recompute would run without it")
    stack = [name for name, _ in _state.transform_stack()]
    transforms = set(stack)
    if "functionalize" in transforms:
        return Reason("functionalize", "functionalize does not transform custom autograd Functions")
    if stack.count("jvp") > 1:  # measured: jvp(jvp(...)), jacfwd(jacfwd(...)) get zero tangents
        return Reason(
            "forward-over-forward", "forward-mode AD over forward-mode AD does not differentiate through a custom jvp"
        )
    # torch.func.jvp runs inside a dual level of its own; outside it, a dual level is the user's
    if _state.forward_ad._current_level >= 0 and "jvp" not in transforms:
        return Reason(
            "dual-level", "forward-mode AD (dual_level) is active: its jvp would nest torch.func.jvp inside it"
        )
    if _parametrization_cache_enabled():
        return Reason(
            "parametrize-cached",
            "torch.nn.utils.parametrize.cached() is active: the block's forward would fill its cache "
            "with tensors computed below the transforms, which the code after the block reads",
        )
    return None


def _why_not_packed_held(function: Any, held: _rebind.Holdings) -> Optional[str]:
    scripted = next((m for m in held.modules if isinstance(m, _SCRIPT_MODULE)), None)
    if scripted is not None:
        original = getattr(scripted, "original_name", None)
        which = f" ({type(scripted).__name__} of {original})" if original else ""
        return Reason(
            "scripted",
            f"it runs a TorchScript module{which}: TorchScript reads the module's own parameters, which no "
            "recompute can bind to the tensors of a call",
            fix="checkpoint the module before scripting it (the nn.Module, not its torch.jit.script / trace)",
        )
    subclass = _tensor_subclass_in(held)
    if subclass is not None:
        return Reason(
            "tensor-subclass",
            f"it reads a {subclass.__name__}, a tensor subclass with its own __torch_function__, which "
            "a recompute under other torch.func levels cannot pass through",
        )
    return None


def _reverse_mode_possible(args: tuple, kwargs: dict, held: _rebind.Holdings) -> bool:
    """Before the block runs: whether reverse mode might differentiate it (a grad level, or eager
    autograd with a tensor it reads requiring grad).  If not, a plain run keeps nothing to save."""
    if _state.peek_interpreter_stack() is not None:
        if any(name == _GRAD for name, _ in _state.interpreter_levels()):
            return True
    if not torch.is_grad_enabled():
        return False
    tensors = [*held.tensors, *held.arguments, *held.unbindable]
    for module in held.modules:
        tensors += [*module.__dict__["_parameters"].values(), *module.__dict__["_buffers"].values()]
    with torch._C.DisableTorchFunctionSubclass():  # an ExpandedWeight refuses even .requires_grad
        return any(isinstance(t, Tensor) and _state.requires_grad_anywhere(t) for t in tensors)


def _global_names(function: Any, tensor: Tensor) -> str:
    """``W`` or ``W, W2``: the module-level names the block's code reads ``tensor`` through, for messages."""
    code_owners = [function, getattr(function, "func", None), getattr(getattr(function, "forward", None), "__func__", None)]
    names = []
    for owner in code_owners:
        namespace = getattr(owner, "__globals__", None)
        if isinstance(namespace, dict):
            names += [name for name, value in namespace.items() if value is tensor and name not in names]
    return ", ".join(names)


_SCRIPT_MODULE = torch.jit.ScriptModule
_PLAIN_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def _tensor_subclass_in(held: _rebind.Holdings) -> Optional[type]:
    """A tensor type among what the block reads with a ``__torch_function__`` of its own (ExpandedWeight), if any.

    Looked up on the type only: such a tensor may refuse even ``.requires_grad``.
    """
    tensors = [*held.tensors, *held.arguments]
    for module in held.modules:
        tensors += [*module.__dict__["_parameters"].values(), *module.__dict__["_buffers"].values()]
    for t in tensors:
        kind = type(t)
        if kind is torch.Tensor or t is None:
            continue
        handler = kind.__torch_function__
        if getattr(handler, "__func__", handler) not in _PLAIN_TORCH_FUNCTIONS:
            return kind
    return None


def _parametrization_cache_enabled() -> bool:
    parametrize = sys.modules.get("torch.nn.utils.parametrize")
    return bool(parametrize is not None and getattr(parametrize, "_cache_enabled", 0))


def run(built: Plan) -> Any:
    """Run the block as a composable checkpoint; returns what the function returns.

    Raises :class:`Refused` when the run-time proof finds the block reading a
    tensor that needs a gradient and was not lifted: nothing of the block's
    effect is kept then except in-place updates it made before that read (a
    BatchNorm's running statistics, as any recompute repeats them), and the RNG
    is as the forward found it.

    Never traced by dynamo: a compiled function called under a torch.func
    transform runs in dynamo's frame-by-frame mode, which would compile the
    recompute's frames and fail there.  ``torch.compile`` of code outside
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
    output = built.first_run()
    found = _output_tensors(output)
    if not _reverse_mode_can_follow(found):  # forward mode and vmap keep nothing: nothing to save
        built.release()
        built.unpacked = built.refusal or NOTHING_TO_SAVE
        return output
    if built.refusal is not None:
        reason = built.refusal
        built.release()
        raise Refused(reason, output)
    precomputed = built.precomputed(output)
    built.keep_tangents(output)
    del found, output  # the plain run's graph goes with them
    # an input the forward updated in place (a BatchNorm's running statistics) is handed in as the copy
    # of what the forward started from: the Function saves that, so a later update of the live one (the
    # same module called again) is no change to what this recompute reads
    operands = [built.pre_forward.get(i, t) for i, t in enumerate(built.inputs)] if built.pre_forward else built.inputs
    outputs = _levels.apply(built, *operands, *precomputed)
    global PACKED
    PACKED += 1
    del precomputed
    result = built.rebuild(outputs)
    built.release()
    built.output_template = None  # the forward's outputs: the backward does not need them
    return result


def _reverse_mode_can_follow(outputs: Sequence[Tensor]) -> bool:
    """Whether reverse mode may differentiate this call's outputs: a grad level, or eager autograd.

    Where neither can (``jvp``, ``jacfwd``, ``vmap`` with nothing requiring
    grad), the plain run kept no activations: it is the result.
    """
    if _state.peek_interpreter_stack() is not None:
        if any(name == _GRAD for name, _ in _state.interpreter_levels()):
            return True
    return any(_base(t).requires_grad for t in outputs)


def _describe_unlifted(built: Plan, read: _proof.Unlifted) -> Reason:
    tensor = read.tensor
    path = _rebind.describe_path(built.original_function, built.args, built.kwargs, tensor)
    if _state.is_functorch_wrapped_tensor(tensor):
        what = "a tensor a torch.func transform is differentiating or batching"
    else:
        what = "a tensor that requires grad"
    shape = tuple(_base(tensor).shape)
    where = f"{path}" if path else f"a tensor the guard cannot name (shape {shape})"
    if read.operation == "Tensor.requires_grad_":
        return Reason(
            "leaf-inside",
            f"the block makes {where} require grad (requires_grad_() at {read.site}): a leaf made inside "
            "a checkpoint gets no gradient from its recompute, and torch.func refuses requires_grad_() "
            "there (make it require grad outside the block and pass it in)",
        )
    if read.outside:
        return Reason(
            "write-outside",
            f"the block writes in place into {where}, a tensor it was neither given nor made by a "
            f"torch operation (through {read.operation} at {read.site}): the recompute would write it a "
            "second time and start from what the forward wrote (pass it to the block as an argument; "
            "one the block makes with torch.Tensor(...) or from NumPy: make it with torch.zeros or torch.tensor)",
        )
    how = "returned it" if read.operation == "returned" else f"passed it to {read.operation}"
    return Reason(
        "unlifted-read",
        f"the block reads {what} that was not lifted into the recompute's inputs: {where}; "
        f"it {how} at {read.site} (its gradient would have been lost)",
    )


def checkpoint_call(
    function: Callable[..., Any], args: tuple, kwargs: dict, *, context_fn: Any = None,
    preserve_rng_state: bool = True,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` composably; :class:`Refused` if that would be wrong."""
    built = plan(function, args, kwargs, context_fn=context_fn, preserve_rng_state=preserve_rng_state)
    if isinstance(built, str):
        raise Refused(built)
    return run(built)
