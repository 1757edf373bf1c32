"""One checkpointed call, planned: the :class:`Plan` node the recompute's Function carries.

Owns: what the call was given (lifted tensors, rebuilt arguments, the per-thread
binding of the modules' tensors), the first forward (the plain run, under the run-time
proof), what the forward kept for the recompute (RNG states, the default dtype, device
and autocast contexts, module hooks, the modules' plain values, closures' values), how a
recompute starts from the forward's inputs (a copy where the block writes in place), and
the replay of that world for each recompute.  May not touch: torch.func's transform
rules (``function``) or the decision to pack (``call``).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint as _tuc
from torch._C._functorch import current_level as _current_level
from torch._C._functorch import is_batchedtensor as _is_batched, maybe_get_level as _level_of

from . import proof as _proof
from . import binding as _rebind
from . import counters
from . import levels as _levels
from . import residuals as _residuals
from . import saving as _saving
from .. import _state
from .basics import (
    JVP_KEY, SELECTIVE_CACHING_MODE, Module, Tensor, _base, _carries_gradient, _differentiable_dtype, _reach, _version,
)
from .refusals import ChangedSinceForward, Reason
from .replay import (
    _NO_CONTEXT, _compiled_code_eager, _contents_to_replay, _forward_rng, _global_hooks, _global_hooks_as,
    _forward_mode_alive, _output_tensors, _plain_nested_checkpoints, _vmap_levels, in_default_dtype,
)


def _label(function: Any) -> str:
    """How saved_residuals names a block: ``Block.forward``, ``MLP`` (a module), ``layer``."""
    if isinstance(function, torch.nn.Module):
        return f"{type(function).__qualname__} (a module)"
    return getattr(function, "__qualname__", None) or type(function).__qualname__


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
        templates: list = []  # made once, where something is templated (a module block on tensors: nothing)

        def template(value: Any) -> Tuple[Any, bool]:
            if not templates:
                templates.append(_rebind._Rebuild({key: _rebind.Hole(i) for key, i in index.items()}))
            return templates[0](value)

        if isinstance(held.frozen, Module):  # a module is bound, never rebuilt
            self.function, function_holes = held.frozen, False
        else:
            self.function, function_holes = template(held.frozen)  # its closures frozen (see the module docstring)
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
        #: id of each input -> (a weak reference to it, its index), where the block is bound on modules: a
        #: block that writes one of the call's tensors into its own slot as it runs (higher's patched
        #: modules, each call) gets the recompute's tensor there (``binding.as_recomputed``)
        self.originals: Optional[dict] = None
        if slots or attributes:
            self.originals = {key: (weakref.ref(inputs[key]), i) for key, i in index.items()}
        #: (module, name, value): the modules' plain numbers, flags and strings at the call (a
        #: timestep set before each call of a shared module, a counter the forward increments);
        #: each run binds those that changed since, so the recompute reads what the forward read
        self.scalars = held.scalars
        #: (module, name, value with holes, always bound?): plain attributes that may hold a lifted
        #: tensor; a forward-hook dict is copied now and always bound (a hook removed after the
        #: forward still runs in the recompute, as it ran in the forward)
        self.attributes = []
        #: whether a recompute rebuilds anything (the function, its arguments, a module attribute
        #: holding a lifted tensor, a hook dict bound always): else it calls ``function`` as it is
        self.templated = function_holes or self.flat_args is None
        for module, name, value in () if held.plain_attributes else attributes:
            hooks = name in _rebind._FORWARD_HOOKS
            kept, holes = template(collections.OrderedDict(value) if hooks else value)
            # an RNN's _flat_weight_refs is bound always too: its forward re-points them at the tensors
            # a recompute binds, and left in the module they would hide its next swap from it
            always = hooks or name == "_flat_weight_refs"
            self.attributes.append((module, name, kept, always))
            self.templated = self.templated or holes or always
        #: the global module hooks (register_module_forward_hook) at the call, if any: each recompute
        #: runs under them, as the forward did, also after the user removed one
        self.global_hooks = _global_hooks()
        #: (module, name) of those plain attributes: the containers among them are watched in the forward
        self.attribute_names = [(module, name) for module, name, _ in attributes]
        self.grad_mode = torch.is_grad_enabled()
        #: the transform on top at the call (its key), and for a jvp on top the inputs it wrapped:
        #: what the block computes reads requires_grad by that level (levels.as_the_call_saw)
        top = _state.peek_interpreter_stack()
        self.top_at_call: Optional[int] = None if top is None else top.key().value
        self.wrapped_at_top: List[int] = []
        if self.top_at_call == JVP_KEY:
            level = top.level()
            self.wrapped_at_top = [
                i for i, t in enumerate(self.inputs) if _state.is_functorch_wrapped_tensor(t)
                and not _is_batched(t) and _level_of(t) == level
            ]
        #: inputs that required grad at the call: the forward makes them require grad too
        self.needs: List[bool] = []
        #: inputs a gradient or a tangent can reach: those a grad or jvp level wraps, or that
        #: require grad (a buffer's tangent is a zero the transform made up: not passed on)
        self.reachable: List[bool] = []
        #: ... of which these a tangent can reach (a grad or jvp level wraps them: eager
        #: requires_grad carries no tangent)
        self.tangent_reachable: List[bool] = []
        for t in self.inputs:  # one pass: this runs per call, and each read goes through the wrappers
            differentiable = _differentiable_dtype(t)
            reachable, tangent = _reach(t) if differentiable else (False, False)
            self.needs.append(differentiable and t.requires_grad)
            self.reachable.append(reachable)
            self.tangent_reachable.append(tangent)
        self.context_fn = context_fn
        #: the Function's operands: these inputs, then the plain run's output tensors (precomputed)
        self.n_inputs = len(self.inputs)
        #: why the plain run cannot be packed into a recompute (the run-time proof's finding), or None
        self.refusal: Optional[str] = None
        #: positions of the plain run's outputs that share memory with an input (the input itself, a
        #: view of it): the caller gets those tensors as the plain run made them (see call._run)
        self.aliases: List[int] = []
        #: the inputs those outputs alias: handed to the Function as copies (the caller may write
        #: into them through the alias, as without checkpointing; the recompute reads the copy)
        self.aliased_inputs: List[int] = []
        #: a ``later_writes.Watched`` (its index, the caller's tensor, its version) of each input handed
        #: to the Function as a copy on write: the caller may write into it after the call
        self.callers_inputs: List[Any] = []
        #: a ``later_writes.Watched`` of the tangent of each of those inputs, where a forward-mode level
        #: gave it one (a write into the input moves it too: the tangent graph may have saved it)
        self.callers_tangents: List[Any] = []
        #: (jvp level, tangents): the plain run's output tangents, where a jvp level computed them, until used
        self.tangents: Optional[tuple] = None
        #: after :func:`run`: why the plain run was the result and nothing was packed, or None (packed)
        self.unpacked: Optional[str] = None
        self.versions: List[Optional[int]] = []
        self.vmaps_at_forward: frozenset = frozenset()
        #: the versions, once the forward has run, of the inputs it read (None for the others):
        #: every recompute checks them
        self.versions_after: List[Optional[int]] = []
        #: whether an input requires grad under all its wrappers (eager autograd may differentiate
        #: a backward then: ``function._differentiated_again``); None until the forward has run
        self.eager_requires_grad: Optional[bool] = None
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
        #: the rest of the user's containers the block is given, as the call found them: one the
        #: program changes after the call (``cfg.scale = 2.0`` before the pullback) is replayed too
        self.contents_at_call: List[tuple] = []
        #: (slot, value) of each global the block's code loads, as the call found it: a recompute
        #: runs with those a script re-bound since (``W = W - lr * g``), as the forward did
        self.globals_read: List[tuple] = []
        self.autocast: Any = None
        self.default_dtype = torch.get_default_dtype()
        #: a torch.device(...) context's device at the call: the Function's forward
        #: runs without function modes, so it is re-entered there and in the recompute
        self.default_device: Any = _state.forward_device_context()
        #: called before every recompute; raises for a drift the recompute cannot undo (an
        #: optimizer step), or returns fallback's replays (a train/eval switch: see ``_drift``)
        self.check_recompute: Callable[[], Any] = lambda: None
        #: under a save policy (a selective checkpointing ``context_fn``): what it kept of the
        #: first forward, handed back to each recompute (``saving``); None: everything is recomputed
        self.saved: Optional[_saving.Saved] = None

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
        rebuild = _rebind._Rebuild({}, fill=tensors) if self.templated else None
        bindings = [(module, store, name, tensors[i]) for module, store, name, i in self.slots]
        for module, name, value in self.scalars:
            now = module.__dict__.get(name, _rebind._ABSENT)
            if now is not value and not (type(now) is type(value) and now == value):
                bindings.append((module, "__dict__", name, value))
        if rebuild is not None:
            for module, name, value, always in self.attributes:
                new, changed = rebuild(value)
                if changed or always:
                    bindings.append((module, "__dict__", name, new))
        hooks = _global_hooks_as(self.global_hooks) if self.global_hooks is not None or _global_hooks() else None
        recomputed_as = None if self.originals is None else (self.originals, tensors)
        with _rebind.bound(bindings, recomputed_as), hooks or _NO_CONTEXT, _compiled_code_eager():
            function = self.function if rebuild is None else rebuild(self.function)[0]
            if self.flat_args is not None:
                return function(*[tensors[i] for i in self.flat_args])
            args, kwargs = rebuild(self.call_args)[0]  # type: ignore[misc]
            return function(*args, **kwargs)

    def _given_containers(self) -> list:
        """The user's containers the block is given (arguments, closure, partial, module attributes)."""
        roots = _state.argument_roots(self.original_function, self.args, self.kwargs) or []
        for module, name in self.attribute_names:
            value = module.__dict__.get(name)
            if name not in _rebind._FORWARD_HOOKS and _state.holds_container(value):
                roots.append((f"{type(module).__name__}.{name}", value))
        return roots

    def pure(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The block as a function of its input tensors to its output tensors (for vjp / jvp).

        Under a save policy, what it saved in the first forward is handed back to the
        operations that made it, where that can line up (``saving``'s module docstring).
        """
        saved = self.saved
        context = _NO_CONTEXT
        if saved is not None:
            why = _saving.why_not_handed_back(saved, self.vmaps_at_forward)
            if why is None:
                context = saved.handing_back()
            elif saved.report is not None:
                saved.report.recompute(why)
        with context:
            return _levels.as_the_call_saw(self._outputs_of_call, tensors, self)

    def _outputs_of_call(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
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
        policy = None
        if self.context_fn is not None:
            forward_context, self.recompute_context = self.context_fn()
            if isinstance(forward_context, SELECTIVE_CACHING_MODE):
                # Selective checkpointing: torch's two modes line up only with torch's own
                # recompute; the policy is applied here by ``saving``'s own (its module docstring)
                policy = forward_context.policy_fn
                forward_context, self.recompute_context = contextlib.nullcontext(), _NO_CONTEXT
        if self.refusal is not None:  # no recompute will follow (see :func:`plan`): only the plain run
            with forward_context, _plain_nested_checkpoints():
                return self.original_function(*self.args, **self.kwargs)
        bases = [_base(t) for t in inputs]  # a wrapper's own version counter never moves: its base's does
        self.versions = [_version(b) for b in bases]
        self.eager_requires_grad = any(b.requires_grad for b in bases)
        self.vmaps_at_forward = _vmap_levels()
        if policy is None and _residuals.is_open():  # saved_residuals lists this block's recomputes too
            policy = _saving.nothing_saved
        if policy is not None:
            # under forward mode, tangent operations reach the recording too: each saved call keeps
            # its arguments' fingerprint, and only matching calls are handed back (``saving``)
            # so does a forward under vmap that eager autograd may differentiate outside it (MAML's
            # outer .backward()): that recompute is batched by the Function's own vmap rule
            fingerprinted = _forward_mode_alive() or bool(self.vmaps_at_forward and self.eager_requires_grad)
            self.saved = _saving.Saved(policy, fingerprinted=fingerprinted)
            self.saved.report = _residuals.block_entry(_label(self.original_function), _saving.describe(policy))
            forward_context = self.saved.recording()
        given = _state.contents_snapshot(self._given_containers())
        level = _current_level() if _state.peek_interpreter_stack() is not None else -1
        check = _proof.ReadCheck(inputs, level) if counters.PROOF else None
        with forward_context, _plain_nested_checkpoints(), _compiled_code_eager():
            if check is None:
                output = self.original_function(*self.args, **self.kwargs)
            else:
                check.given(inputs)
                with check:
                    output = self.original_function(*self.args, **self.kwargs)
        found = _output_tensors(output)
        after = [_version(b) for b in bases]
        if check is not None:
            check.check_outputs(found)
            self.generators = list(check.generators.values())
            if check.refused is not None:
                self.refusal = _describe_unlifted(self, check.refused)
                return output
            self.refusal = self._unseen_update(check, after)
            if self.refusal is not None:
                return output
            self.constants = list(check.constants.values())
            self.pre_forward = {
                i: kept for i, kept in check.before.items() if self._updated(i, kept, inputs[i], after[i])
            }
            self.rewritten = frozenset(check.rewritten)
            self.written = frozenset(self.pre_forward) | self.rewritten
            if self.pre_forward:
                self.refusal = self._overlapping_write()
                if self.refusal is not None:
                    return output
            self.read = None if check.unseen_reads else check.read
        if given:
            self.contents, self.refusal = _contents_to_replay(given)
            if self.refusal is not None:
                return output
            replayed = {id(entry[1]) for entry in self.contents}
            self.contents_at_call = [
                entry for entry in given
                if entry[2] != "tensor" and id(entry[1]) not in replayed and _state.replayable([entry])
            ]
        read = self.read  # a module's other parameters are lifted too: another's optimizer step is no change
        if read is not None and len(read) < len(inputs):
            self._bind_what_the_forward_put(read)
        self.versions_after = after if read is None else [v if i in read else None for i, v in enumerate(after)]
        #: (index, requires_grad) of each input the block read, as it read it: each recompute shows it so
        self.requires_grad_read = [(i, need) for i, need in enumerate(self.needs) if read is None or i in read]
        self.output_template = output
        self.output_ids = [id(t) for t in found]
        self.output_kept = [_differentiable_dtype(t) for t in found]
        return output

    def keep_tangents(self, output: Any) -> None:
        """The plain run's output tangents, where a jvp level computed them (``levels.tangents_computed``:
        a jvp on top, or right under the grad levels on top), for the Function's jvp rule of that
        level to hand on (``function._take_tangents``)."""
        self.tangents = _levels.tangents_computed(
            [o for o, kept in zip(_output_tensors(output), self.output_kept) if kept]
        )

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
        must not alias what it saves for backward), and its position kept in
        :attr:`aliases`: the caller gets the plain run's own tensor there, and
        the inputs it aliases are in :attr:`aliased_inputs`.
        """
        found = _output_tensors(output)
        addresses = [_proof._storage_address(t) for t in found]
        if all(a is None for a in addresses):
            return [t.detach() for t in found]
        inputs = [_proof._storage_address(i) for i in self.inputs]
        storages = set(inputs)
        self.aliases = [i for i, address in enumerate(addresses) if address is not None and address in storages]
        if not self.aliases:
            return [t.detach() for t in found]
        aliased = {addresses[i] for i in self.aliases}
        self.aliased_inputs = [j for j, address in enumerate(inputs) if address in aliased]
        return [
            (t.clone() if address is not None and address in storages else t).detach()
            for t, address in zip(found, addresses)
        ]

    def overlapping_outputs(self, found: Sequence[Tensor]) -> Optional[Reason]:
        """Why the call cannot be packed, if two of its outputs share memory (``h, h[0]``; ``h, h``).

        Without checkpointing the caller's update in place of one reaches the
        other, and autograd sees it there; the Function's outputs are tensors of
        their own, so the write would change the other's values but not its
        gradient (measured: wrong under every transform).  Disjoint parts of one
        tensor (``q, k, v = qkv.split(...)``) do not overlap: packed as usual.
        Outputs that are inputs or views of one are the plain run's own already.
        """
        if len(found) < 2:
            return None
        spans = {}
        for i, t in enumerate(found):
            if i in self.aliases or not _proof.has_graph(t):  # a constant (made under no_grad): no gradient to miss
                continue
            span = _proof.memory_span(t)
            if span is None:
                continue
            for j, other in spans.items():
                if span[0] == other[0] and span[1] < other[2] and other[1] < span[2] and _proof.share_elements(found[j], t):
                    return Reason(
                        "aliasing-outputs",
                        f"two of its outputs share memory (outputs {j} and {i}, of shapes "
                        f"{tuple(_base(found[j]).shape)} and {tuple(_base(t).shape)}): an update in place of one "
                        "would reach the other's values but not its gradient through the recompute's outputs",
                        fix="return one of them and take the other from it after the call (h[..., :2] of the "
                        "output), or return a copy (h[..., :2].clone())",
                    )
            spans[i] = span
        return None

    def forward_outputs(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The Function's forward: the plain run's outputs, as they arrive at this level (never a rerun)."""
        return tuple(t.detach() for t in tensors[self.n_inputs:])

    def for_recompute(self, tensors: Sequence[Tensor], copied: frozenset = frozenset()) -> Tuple[Tensor, ...]:
        """The saved inputs, checked: every input the forward read must still be what it read.

        An input the forward updated in place (a BatchNorm's running
        statistics, ``h += pos``) was saved as a copy of what the forward
        started from (see :func:`_run`), and each recompute updates a copy of
        that copy (:meth:`call`), so the update happens once, as without
        checkpointing; an input needing a gradient that the block rewrites
        idempotently (``rewritten``) is copied too.  Any other input whose
        version moved raises :class:`ChangedSinceForward`; one the user's saved-tensor hooks gave back
        as a copy (``copied``: ``save_on_cpu(pin_memory=True)``) is what the call saw, whatever its version.
        """
        for i, (t, was) in enumerate(zip(tensors, self.versions_after)):
            if was is not None and i not in self.pre_forward and i not in copied and _version(_base(t)) != was:
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

    def _bind_what_the_forward_put(self, read: set) -> None:
        """A slot the block filled itself, in its forward, with another of its inputs: bind that one.

        higher's patched modules put their fast weights into ``_parameters`` at each
        call; what a slot held when the call was planned (the module's last call's, or
        higher's copies) was never read.  Each recompute binds, from the start, the
        input the forward left there (the block writing it again then changes nothing),
        so a slot that is read before the block writes it keeps the plan's.
        """
        index = None
        for k, (module, store, name, i) in enumerate(self.slots):
            if i in read:
                continue
            held = (module.__dict__ if store == "__dict__" else module.__dict__[store]).get(name)
            if not isinstance(held, Tensor):
                continue
            if index is None:
                index = {id(t): j for j, t in enumerate(self.inputs)}
            j = index.get(id(held))
            if j is not None and j != i:
                self.slots[k] = (module, store, name, j)

    def _unseen_update(self, check: _proof.ReadCheck, after: List[Optional[int]]) -> Optional[str]:
        """Why the call cannot be packed, if the forward moved an input's version with no copy kept."""
        for i, (t, was, now) in enumerate(zip(self.inputs, self.versions, after)):
            if was is None or now == was or i in check.before or i in check.rewritten:
                continue
            path = _rebind.describe_path(self.original_function, self.args, self.kwargs, t)
            return Reason(
                "unseen-update",
                f"the block updated {path or 'a tensor it reads'} (a {tuple(_base(t).shape)} tensor) in place "
                "in a way the run-time proof did not see coming (a C extension, or with torch functions "
                "off), so no copy of what it started from was kept for the recompute",
            )
        return None

    def _overlapping_write(self) -> Optional[str]:
        """Why the call cannot be packed, if the forward wrote in place into an input that shares memory
        with another input a gradient may reach (overlapping views: each recompute starts from a copy
        of its own, so the write would not reach the other, nor its gradient go through the write)."""
        addresses = [_proof._storage_address(t) for t in self.inputs]
        for i in self.pre_forward:
            j = next((j for j, a in enumerate(addresses) if j != i and a is not None and a == addresses[i]), None)
            if j is None or not (self.reachable[i] or self.reachable[j]):
                continue
            t = self.inputs[j]
            path = _rebind.describe_path(self.original_function, self.args, self.kwargs, t)
            return Reason(
                "overlapping-write",
                f"the block updates in place an input that shares memory with another input it is given "
                f"({path or 'a tensor'} of shape {tuple(_base(t).shape)}): a recompute starts each from a copy "
                "of its own, so the write would not reach the other",
                fix="give the block one tensor and take the views inside it, or clone one of them before the call",
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

    def _updated(self, i: int, kept: Tensor, now: Tensor, version: Optional[int]) -> bool:
        # a kernel may write without bumping the version (BatchNorm's running statistics)
        return self.versions[i] != version or not torch.equal(_base(kept), _base(now))

    def rebuild(self, outputs: Sequence[Tensor]) -> Any:
        """The block's output with the Function's outputs in place of the forward's tensors."""
        template = self.output_template
        if isinstance(template, Tensor):  # the usual block: one tensor out
            return outputs[0]
        return _rebind.rebuild(template, dict(zip(self.output_ids, outputs)))

    @property
    def root(self) -> "Plan":
        """The plan itself: the bottom of every node derived from it (``function.Node``)."""
        return self

    def batched_over_tangents_only(self, in_dims: Sequence[Any]) -> bool:
        return False  # a plan's operands are all primals (and the plain run's outputs)

    def tangent_operands(self, inputs: Sequence[int], n_operands: int) -> Tuple[int, ...]:
        return ()  # ... no tangent among them

    def differentiable_outputs(self) -> List[bool]:
        return self.output_kept

    def differentiable_inputs(self, forward: bool = False) -> List[bool]:
        return self.tangent_reachable if forward else self.reachable

    # -- what the forward saw, and its replay

    def capture_forward_state(self, tensors: Sequence[Tensor]) -> None:
        self.default_dtype = torch.get_default_dtype()
        self.globals_read = _state.globals_read(self.original_function)
        if all(t.is_cpu for t in tensors):  # torch's answer then, without its pytree walk
            device_type = _tuc.DefaultDeviceType.get_device_type()
        else:
            device_type = _tuc._infer_device_type(*tensors)
        if _any_autocast():
            self.autocast = (device_type, *_tuc._get_autocast_kwargs(device_type))
        else:  # the usual case: none on, and nothing to put back unless a recompute finds one on
            self.autocast = (device_type, None, None)
        device_module = getattr(torch, device_type, None)
        devices, states = ([], [])
        if device_type != "cpu" and getattr(device_module, "_initialized", False):
            devices, states = _tuc.get_device_states(*tensors)
        self.rng = (torch.get_rng_state(), devices, states, device_type)

    def replay(self) -> "_Replay":
        """The forward's RNG, default dtype and device, autocast and the recompute context, around a recompute.

        Only what differs from now is entered (a recompute in the backward
        usually runs where the forward ran: same dtype, autocast off): each
        context costs microseconds, and a recompute runs per block per step.
        """
        return _Replay(self)

    def _replays(self) -> list:
        """The contexts one recompute enters, in order (see :meth:`replay`)."""
        contexts = list(self.check_recompute() or ())  # fallback: a module's train/eval mode as in the forward
        if torch.get_default_dtype() != self.default_dtype:
            contexts.append(in_default_dtype(self.default_dtype))
        if self.default_device is not None:  # a fresh context, as torch >= 2.11 does
            contexts.append(torch.device(self.default_device))
        contexts.append(_forward_rng(*self.rng))
        if self.generators:
            # the recompute draws are not the program's: each is left where the program had it
            contexts.append(_state.replaying_generators(self.generators, lock=False))
        contents = self.contents
        if self.contents_at_call:  # changed since the call by the program (the forward's own: self.contents)
            contents = contents + _state.changed_at_all(self.contents_at_call)
        if contents:
            contexts.append(_state.replaying_contents(contents, lock=False))
        if self.globals_read and any(slot.cell_contents is not was for slot, was in self.globals_read):
            contexts.append(_state.replaying_globals(self.globals_read))
        device_type, device_autocast, cpu_autocast = self.autocast
        if cpu_autocast is not None or _any_autocast():
            if cpu_autocast is None:  # none was on in the forward: whichever is on now is switched off
                device_autocast, cpu_autocast = (
                    None if kwargs is None else {**kwargs, "enabled": False}
                    for kwargs in _tuc._get_autocast_kwargs(device_type)
                )
            device_now, cpu_now = _tuc._get_autocast_kwargs(device_type)  # how torch's checkpoint records them
            if device_type != "cpu" and device_autocast is not None and device_autocast != device_now:
                contexts.append(torch.amp.autocast(device_type=device_type, **device_autocast))
            if cpu_autocast != cpu_now:
                contexts.append(torch.amp.autocast("cpu", **cpu_autocast))
        if self.recompute_context is not _NO_CONTEXT:
            contexts.append(self.recompute_context)
        contexts.append(_plain_nested_checkpoints())
        return contexts


_any_autocast = torch._C._is_any_autocast_enabled


class _Replay:
    """:meth:`Plan.replay`'s context: a class, not a generator (entered once per recompute)."""

    __slots__ = ("plan", "stack")

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        try:
            for context in self.plan._replays():
                stack.enter_context(context)
        except BaseException:  # a context that fails to enter: those entered are left
            stack.__exit__(*sys.exc_info())
            raise
        self.stack = stack

    def __exit__(self, *exc: Any) -> Any:
        suppressed = self.stack.__exit__(*exc)
        if exc[0] is None:
            counters.RECOMPUTES += 1
        return suppressed


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
