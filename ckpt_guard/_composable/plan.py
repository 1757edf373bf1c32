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

import contextlib
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint as _tuc
from torch._C._functorch import current_level as _current_level

from . import proof as _proof
from . import binding as _rebind
from . import paths as _paths
from . import counters
from . import levels as _levels
from . import residuals as _residuals
from . import saving as _saving
from .. import _state
from .basics import SELECTIVE_CACHING_MODE, Tensor, _base, _differentiable_dtype, _version
from .records import CallRecord, ForwardRecord, ReplayWorld
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
        #: what the call is (``records``): made whole here, never written after
        self.at_call = CallRecord(function, args, kwargs, held, context_fn)
        #: what the first forward found: written by this class's forward and packing, then only read
        self.found = ForwardRecord(self.at_call.slots)
        #: the world each recompute replays: captured by this class as the forward runs
        self.world = ReplayWorld()
        #: (jvp level, tangents): the plain run's output tangents, where a jvp level computed them, until
        #: the Function's jvp rule takes them (``function._take_tangents``)
        self.tangents: Optional[tuple] = None
        #: after ``call.run``: why the plain run was the result and nothing was packed, or None (packed)
        self.unpacked: Optional[str] = None

    # -- what others tell the plan (its records' one writer is this class)

    def refuse(self, why: Any) -> None:
        """At plan time (``call.plan``): a reason no recompute could be right; the first forward is then
        only the plain run, the result (no reverse mode can follow it)."""
        self.found.refusal = why

    def before_each_recompute(self, check: Callable[[], Any]) -> None:
        """``check`` runs before every recompute (the drift watch, ``_decide``): it raises for a drift the
        recompute cannot undo, or returns fallback's replays."""
        self.world.check_recompute = check

    def hand_in_copy(self, i: int) -> None:
        """Input ``i`` is handed to the Function as a copy no one else writes: its version is not checked."""
        self.found.versions_after[i] = None

    def watch_callers(self, inputs: List[Any], tangents: List[Any]) -> None:
        """The inputs (and their tangents) the caller may write into after the call (``later_writes``)."""
        self.found.callers_inputs, self.found.callers_tangents = inputs, tangents

    @property
    def n_inputs(self) -> int:
        """The Function's operands that are inputs (the plain run's output tensors follow: precomputed)."""
        return self.at_call.n_inputs

    @property
    def eager_requires_grad(self) -> Optional[bool]:
        """Whether an input required grad under all its wrappers at the forward (``function.Node``)."""
        return self.found.eager_requires_grad

    # -- running the block on a given set of input tensors

    def release(self) -> None:
        """Forget the call's own objects and the forward's outputs once the forward has run (the recompute
        uses the holes; the backward needs no output)."""
        self.at_call.release()
        self.found.output_template = None

    def call(self, tensors: Sequence[Tensor]) -> Any:
        """The block on ``tensors`` (a recompute's): its template filled in, its modules bound to them.

        An input the block updates in place is handed to it as a copy made
        here, inside what the recompute differentiates: the saved one stays as
        it is for the next recompute, and the update is one the recompute's own
        level records (a leaf of the vjp's level cannot be written in place).
        """
        if self.found.written:
            tensors = [t.clone() if i in self.found.written else t for i, t in enumerate(tensors)]
        rebuild = _rebind._Rebuild({}, fill=tensors) if self.at_call.templated else None
        bindings = [(module, store, name, tensors[i]) for module, store, name, i in self.found.slots]
        for module, name, value in self.at_call.scalars:
            now = module.__dict__.get(name, _rebind._ABSENT)
            if now is not value and not (type(now) is type(value) and now == value):
                bindings.append((module, "__dict__", name, value))
        if rebuild is not None:
            for module, name, value, always in self.at_call.attributes:
                new, changed = rebuild(value)
                if changed or always:
                    bindings.append((module, "__dict__", name, new))
        hooks = _global_hooks_as(self.world.global_hooks) if self.world.global_hooks is not None or _global_hooks() else None
        recomputed_as = None if self.at_call.originals is None else (self.at_call.originals, tensors)
        with _rebind.bound(bindings, recomputed_as), hooks or _NO_CONTEXT, _compiled_code_eager():
            function = self.at_call.function if rebuild is None else rebuild(self.at_call.function)[0]
            if self.at_call.flat_args is not None:
                return function(*[tensors[i] for i in self.at_call.flat_args])
            args, kwargs = rebuild(self.at_call.call_args)[0]  # type: ignore[misc]
            return function(*args, **kwargs)

    def _given_containers(self) -> list:
        """The user's containers the block is given (arguments, closure, partial, module attributes)."""
        roots = _state.argument_roots(self.at_call.original_function, self.at_call.args, self.at_call.kwargs) or []
        for module, name in self.at_call.attribute_names:
            value = module.__dict__.get(name)
            if name not in _rebind._FORWARD_HOOKS and _state.holds_container(value):
                roots.append((f"{type(module).__name__}.{name}", value))
        return roots

    def pure(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The block as a function of its input tensors to its output tensors (for vjp / jvp).

        Under a save policy, what it saved in the first forward is handed back to the
        operations that made it, where that can line up (``saving``'s module docstring).
        """
        saved = self.world.saved
        context = _NO_CONTEXT
        if saved is not None:
            why = _saving.why_not_handed_back(saved, self.found.vmaps_at_forward)
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
        ``found.refusal`` (None: the call can be packed).  The user's exceptions
        pass through untouched.
        """
        inputs = self.at_call.inputs
        self.capture_forward_state(inputs)
        forward_context = contextlib.nullcontext()
        policy = None
        if self.at_call.context_fn is not None:
            forward_context, self.world.recompute_context = self.at_call.context_fn()
            if isinstance(forward_context, SELECTIVE_CACHING_MODE):
                # Selective checkpointing: torch's two modes line up only with torch's own
                # recompute; the policy is applied here by ``saving``'s own (its module docstring)
                policy = forward_context.policy_fn
                forward_context, self.world.recompute_context = contextlib.nullcontext(), _NO_CONTEXT
        if self.found.refusal is not None:  # no recompute will follow (see :func:`plan`): only the plain run
            with forward_context, _plain_nested_checkpoints():
                return self.at_call.original_function(*self.at_call.args, **self.at_call.kwargs)
        bases = [_base(t) for t in inputs]  # a wrapper's own version counter never moves: its base's does
        self.found.versions = [_version(b) for b in bases]
        self.found.eager_requires_grad = any(b.requires_grad for b in bases)
        self.found.vmaps_at_forward = _vmap_levels()
        if policy is None and _residuals.is_open():  # saved_residuals lists this block's recomputes too
            policy = _saving.nothing_saved
        if policy is not None:
            # under forward mode, tangent operations reach the recording too: each saved call keeps
            # its arguments' fingerprint, and only matching calls are handed back (``saving``)
            # so does a forward under vmap that eager autograd may differentiate outside it (MAML's
            # outer .backward()): that recompute is batched by the Function's own vmap rule
            fingerprinted = _forward_mode_alive() or bool(self.found.vmaps_at_forward and self.found.eager_requires_grad)
            self.world.saved = _saving.Saved(policy, fingerprinted=fingerprinted)
            self.world.saved.report = _residuals.block_entry(_label(self.at_call.original_function), _saving.describe(policy))
            forward_context = self.world.saved.recording()
        given = _state.contents_snapshot(self._given_containers())
        level = _current_level() if _state.peek_interpreter_stack() is not None else -1
        check = _proof.ReadCheck(inputs, level) if counters.PROOF else None
        with forward_context, _plain_nested_checkpoints(), _compiled_code_eager():
            if check is None:
                output = self.at_call.original_function(*self.at_call.args, **self.at_call.kwargs)
            else:
                check.given(inputs)
                with check:
                    output = self.at_call.original_function(*self.at_call.args, **self.at_call.kwargs)
        found = _output_tensors(output)
        after = [_version(b) for b in bases]
        if check is not None:
            check.check_outputs(found)
            self.world.generators = list(check.generators.values())
            if check.refused is not None:
                self.found.refusal = _describe_unlifted(self, check.refused)
                return output
            self.found.refusal = self._unseen_update(check, after)
            if self.found.refusal is not None:
                return output
            self.found.constants = list(check.constants.values())
            self.found.pre_forward = {
                i: kept for i, kept in check.before.items() if self._updated(i, kept, inputs[i], after[i])
            }
            self.found.rewritten = frozenset(check.rewritten)
            self.found.written = frozenset(self.found.pre_forward) | self.found.rewritten
            if self.found.pre_forward:
                self.found.refusal = self._overlapping_write()
                if self.found.refusal is not None:
                    return output
            self.found.read = None if check.unseen_reads else check.read
        if given:
            self.world.contents, self.found.refusal = _contents_to_replay(given)
            if self.found.refusal is not None:
                return output
            replayed = {id(entry[1]) for entry in self.world.contents}
            self.world.contents_at_call = [
                entry for entry in given
                if entry[2] != "tensor" and id(entry[1]) not in replayed and _state.replayable([entry])
            ]
        read = self.found.read  # a module's other parameters are lifted too: another's optimizer step is no change
        if read is not None and len(read) < len(inputs):
            self._bind_what_the_forward_put(read)
        self.found.versions_after = after if read is None else [v if i in read else None for i, v in enumerate(after)]
        #: (index, requires_grad) of each input the block read, as it read it: each recompute shows it so
        self.found.requires_grad_read = [(i, need) for i, need in enumerate(self.at_call.needs) if read is None or i in read]
        self.found.output_template = output
        self.found.output_ids = [id(t) for t in found]
        self.found.output_kept = [_differentiable_dtype(t) for t in found]
        return output

    def keep_tangents(self, output: Any) -> None:
        """The plain run's output tangents, where a jvp level computed them (``levels.tangents_computed``:
        a jvp on top, or right under the grad levels on top), for the Function's jvp rule of that
        level to hand on (``function._take_tangents``)."""
        self.tangents = _levels.tangents_computed(
            [o for o, kept in zip(_output_tensors(output), self.found.output_kept) if kept]
        )

    def ran_under(self, level: int, batch_size: int, randomness: str) -> bool:
        """Whether the plain run ran under this vmap (its random draws were batched by it)."""
        return (level, batch_size, randomness) in self.found.vmaps_at_forward

    def precomputed(self, output: Any) -> List[Tensor]:
        """The plain run's output tensors, cut from its graph, to hand to the recompute's Function.

        Handed in as operands, they reach the Function's forward through every
        level's own unwrapping (a vmap rule sees where each is batched); the
        forward returns them, so the block never runs inside the Function.
        ``.detach()`` keeps the batching and drops the autograd history at every
        level, so nothing holds the plain run's activations once it returns.
        An output sharing memory with an input is copied (the Function's output
        must not alias what it saves for backward), and its position kept in
        ``found.aliases``: the caller gets the plain run's own tensor there, and
        the inputs it aliases are in ``found.aliased_inputs``.
        """
        found = _output_tensors(output)
        addresses = [_proof._storage_address(t) for t in found]
        if all(a is None for a in addresses):
            return [t.detach() for t in found]
        inputs = [_proof._storage_address(i) for i in self.at_call.inputs]
        storages = set(inputs)
        self.found.aliases = [i for i, address in enumerate(addresses) if address is not None and address in storages]
        if not self.found.aliases:
            return [t.detach() for t in found]
        aliased = {addresses[i] for i in self.found.aliases}
        self.found.aliased_inputs = [j for j, address in enumerate(inputs) if address in aliased]
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
            if i in self.found.aliases or not _proof.has_graph(t):  # a constant (made under no_grad): no gradient to miss
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
        for i, (t, was) in enumerate(zip(tensors, self.found.versions_after)):
            if was is not None and i not in self.found.pre_forward and i not in copied and _version(_base(t)) != was:
                self.world.check_recompute()  # a drift rule that explains it (an optimizer step: CKG108) speaks first
                raise self._changed_since_forward(i, t, was)
        for ref, was, _ in self.found.constants:
            constant = ref()
            if constant is not None and _version(_base(constant)) != was:
                self.world.check_recompute()
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
        for k, (module, store, name, i) in enumerate(self.found.slots):
            if i in read:
                continue
            held = (module.__dict__ if store == "__dict__" else module.__dict__[store]).get(name)
            if not isinstance(held, Tensor):
                continue
            if index is None:
                index = {id(t): j for j, t in enumerate(self.at_call.inputs)}
            j = index.get(id(held))
            if j is not None and j != i:
                self.found.slots[k] = (module, store, name, j)

    def _unseen_update(self, check: _proof.ReadCheck, after: List[Optional[int]]) -> Optional[str]:
        """Why the call cannot be packed, if the forward moved an input's version with no copy kept."""
        for i, (t, was, now) in enumerate(zip(self.at_call.inputs, self.found.versions, after)):
            if was is None or now == was or i in check.before or i in check.rewritten:
                continue
            path = _paths.describe_path(self.at_call.original_function, self.at_call.args, self.at_call.kwargs, t)
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
        addresses = [_proof._storage_address(t) for t in self.at_call.inputs]
        for i in self.found.pre_forward:
            j = next((j for j, a in enumerate(addresses) if j != i and a is not None and a == addresses[i]), None)
            if j is None or not (self.at_call.reachable[i] or self.at_call.reachable[j]):
                continue
            t = self.at_call.inputs[j]
            path = _paths.describe_path(self.at_call.original_function, self.at_call.args, self.at_call.kwargs, t)
            return Reason(
                "overlapping-write",
                f"the block updates in place an input that shares memory with another input it is given "
                f"({path or 'a tensor'} of shape {tuple(_base(t).shape)}): a recompute starts each from a copy "
                "of its own, so the write would not reach the other",
                fix="give the block one tensor and take the views inside it, or clone one of them before the call",
            )
        return None

    def _changed_since_forward(self, i: int, t: Tensor, was: int) -> ChangedSinceForward:
        held = [self._slot_name(module, name) for module, _, name, index in self.found.slots if index == i]
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
        for outer in {id(m): m for m, *_ in self.found.slots}.values():
            for path, sub in outer.named_modules():
                if sub is module and path and len(path) > len(best.split(".", 1)[-1]):
                    best = f"{type(outer).__name__}.{path}"
        return f"{best or type(module).__name__}.{name}"

    def _updated(self, i: int, kept: Tensor, now: Tensor, version: Optional[int]) -> bool:
        # a kernel may write without bumping the version (BatchNorm's running statistics)
        return self.found.versions[i] != version or not torch.equal(_base(kept), _base(now))

    def rebuild(self, outputs: Sequence[Tensor]) -> Any:
        """The block's output with the Function's outputs in place of the forward's tensors."""
        template = self.found.output_template
        if isinstance(template, Tensor):  # the usual block: one tensor out
            return outputs[0]
        return _rebind.rebuild(template, dict(zip(self.found.output_ids, outputs)))

    @property
    def root(self) -> "Plan":
        """The plan itself: the bottom of every node derived from it (``function.Node``)."""
        return self

    def batched_over_tangents_only(self, in_dims: Sequence[Any]) -> bool:
        return False  # a plan's operands are all primals (and the plain run's outputs)

    def tangent_operands(self, inputs: Sequence[int], n_operands: int) -> Tuple[int, ...]:
        return ()  # ... no tangent among them

    def differentiable_outputs(self) -> List[bool]:
        return self.found.output_kept

    def differentiable_inputs(self, forward: bool = False) -> List[bool]:
        return self.at_call.tangent_reachable if forward else self.at_call.reachable

    # -- what the forward saw, and its replay

    def capture_forward_state(self, tensors: Sequence[Tensor]) -> None:
        self.world.default_dtype = torch.get_default_dtype()
        self.world.globals_read = _state.globals_read(self.at_call.original_function)
        if all(t.is_cpu for t in tensors):  # torch's answer then, without its pytree walk
            device_type = _tuc.DefaultDeviceType.get_device_type()
        else:
            device_type = _tuc._infer_device_type(*tensors)
        if _any_autocast():
            self.world.autocast = (device_type, *_tuc._get_autocast_kwargs(device_type))
        else:  # the usual case: none on, and nothing to put back unless a recompute finds one on
            self.world.autocast = (device_type, None, None)
        device_module = getattr(torch, device_type, None)
        devices, states = ([], [])
        if device_type != "cpu" and getattr(device_module, "_initialized", False):
            devices, states = _tuc.get_device_states(*tensors)
        self.world.rng = (torch.get_rng_state(), devices, states, device_type)

    def replay(self) -> "_Replay":
        """The forward's RNG, default dtype and device, autocast and the recompute context, around a recompute.

        Only what differs from now is entered (a recompute in the backward
        usually runs where the forward ran: same dtype, autocast off): each
        context costs microseconds, and a recompute runs per block per step.
        """
        return _Replay(self)

    def _replays(self) -> list:
        """The contexts one recompute enters, in order (see :meth:`replay`)."""
        contexts = list(self.world.check_recompute() or ())  # fallback: a module's train/eval mode as in the forward
        if torch.get_default_dtype() != self.world.default_dtype:
            contexts.append(in_default_dtype(self.world.default_dtype))
        if self.world.default_device is not None:  # a fresh context, as torch >= 2.11 does
            contexts.append(torch.device(self.world.default_device))
        contexts.append(_forward_rng(*self.world.rng))
        if self.world.generators:
            # the recompute draws are not the program's: each is left where the program had it
            contexts.append(_state.replaying_generators(self.world.generators, lock=False))
        contents = self.world.contents
        if self.world.contents_at_call:  # changed since the call by the program (the forward's own: self.world.contents)
            contents = contents + _state.changed_at_all(self.world.contents_at_call)
        if contents:
            contexts.append(_state.replaying_contents(contents, lock=False))
        if self.world.globals_read and any(slot.cell_contents is not was for slot, was in self.world.globals_read):
            contexts.append(_state.replaying_globals(self.world.globals_read))
        device_type, device_autocast, cpu_autocast = self.world.autocast
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
        if self.world.recompute_context is not _NO_CONTEXT:
            contexts.append(self.world.recompute_context)
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
    path = _paths.describe_path(built.at_call.original_function, built.at_call.args, built.at_call.kwargs, tensor)
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
