"""Checkpointing that composes with torch.func: a recompute torch.func can transform.

torch's checkpoint is built on saved-tensor hooks (non-reentrant) or on an
``autograd.Function`` without ``setup_context`` (reentrant); torch.func refuses
both.  The recompute here is an ``autograd.Function`` with ``setup_context``,
which torch.func transforms like any other operation, and whose every
transformation rule is again such a recompute, as ``jax.checkpoint``'s are:

* ``forward`` runs the block on its lifted inputs and keeps nothing of it but
  those inputs (the memory saving);
* ``backward`` recomputes the block and takes its vjp.  When something will
  differentiate that result again (grad of grad, a jvp over a grad, an eager
  ``.backward()`` over a torch.func result, a pullback later differentiated),
  the vjp is itself a checkpointed recompute: the outer transform keeps its
  inputs (primals and cotangents), never the recomputed activations;
* ``jvp`` recomputes the block under ``torch.func.jvp`` (forward mode: jvp,
  jacfwd, hessian); where the tangents will be differentiated again (a
  MeanFlow loss's ``.backward()``, ``jvp(grad)``) that too is checkpointed;
* ``vmap`` batches the checkpoint instead of unrolling it: the vmapped block
  becomes one checkpointed recompute (unbatched inputs stay unbatched).

Whether the backward or the tangents will be differentiated again is read
when they run, from the functorch levels then alive: one that is neither the
level running this backward nor dead (a pullback called after its ``vjp``
returned) will differentiate it; so will eager autograd, when grad mode is on
below every transform and a tensor involved requires grad there.

**What the block reads.**  Every tensor the block reads that may need a
gradient must be an input, or its gradient would silently be zero.  The walk
in ``_rebind`` lifts the parameters, buffers and plain tensor attributes of
the modules the block reaches (bound per thread, modules are never copied),
and the tensors that need a gradient held in its closures, defaults,
partials, containers, dataclasses and objects, and the call's arguments
(rebuilt as copies holding the recompute's tensors).  That walk is the fast
path; the proof is ``_proof.ReadCheck``: during the forward, any tensor that
carries a gradient and was neither given nor computed stops the call before
the operation runs (:class:`Refused`), and the caller refuses the call or
runs the block another way.  No wrong gradient either way.

**What the recompute replays.**  The forward's CPU and device RNG states
(dropout draws the same mask), each user ``torch.Generator`` the block drew
from (its state before the first draw, kept by the proof), default dtype, ``torch.device(...)`` context,
autocast, a user ``context_fn``'s recompute context, and what the block's
closures held (frozen copies: a loop rebinding a closed-over variable is not
seen).  The forward runs in the grad mode of the call, with the inputs that
required grad there requiring grad (under a throwaway grad level), so a
module that branches on ``torch.is_grad_enabled()`` or ``requires_grad``
(``nn.TransformerEncoder``'s fast path) takes the same path as without
checkpointing.  Checkpoints nested inside the block run plainly (the outer
recompute already recomputes them).
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
from torch._functorch import pyfunctorch
from torch._functorch.eager_transforms import enable_inplace_requires_grad as _enable_inplace_requires_grad
from torch._functorch.eager_transforms import _vjp_with_argnums
from torch._functorch.eager_transforms import grad_increment_nesting as _grad_increment_nesting

from . import _config, _proof, _rebind, _state

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
    """The composable recompute cannot be correct for this call; ``reason`` says why (for messages)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnrepeatableForward(RuntimeError):
    """The forward updated an input in place without the proof keeping its value first.

    The run-time proof's net under its in-place tracking: the input's version
    counter moved, and no copy of what it held was kept, so a recompute would
    start from the updated value.  Raised whatever the policy: the forward has
    already run (its update cannot be undone), so running the block again
    plainly would update it twice.
    """


class ChangedSinceForward(RuntimeError):
    """A tensor the block reads was updated in place between its forward and this recompute.

    The recompute would read the new values (an optimizer step, ``w.mul_(2)``
    between ``vjp`` and its pullback, an in-place write through a view the
    block returned) and return wrong gradients.  Autograd's own check on
    saved tensors does not see it under torch.func: it compares the
    version of the transform's wrapper, which never moves.
    """


#: the plain values of a module's attributes a recompute puts back as the call found them
_SCALARS = frozenset({int, float, bool, str, complex, type(None)})


#: selective checkpointing's forward mode: fallback's plain run and the recompute here leave it out
SELECTIVE_CACHING_MODE = getattr(_tuc, "_CachingTorchDispatchMode", ())

#: Recomputes of blocks run so far, and derivatives checkpointed in turn (a backward or
#: tangents that something differentiated again).  The matrix reads them: a recompute
#: means the block's activations were not kept by the forward.
RECOMPUTES = 0
NESTED_RECOMPUTES = 0

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
        self.call_args = template((args, kwargs))[0]
        #: (module, store, name, input index)
        self.slots = [(module, store, name, index[id(tensor)]) for module, store, name, tensor in slots]
        #: (module, name, value): the modules' plain numbers, flags and strings at the call (a
        #: timestep set before each call of a shared module, a counter the forward increments);
        #: each run binds those that changed since, so the recompute reads what the forward read
        self.scalars = [
            (module, name, value) for module in held.modules for name, value in module.__dict__.items()
            if type(value) in _SCALARS and name not in _rebind._MODULE_INTERNALS
        ]
        #: (module, name, value with holes, always bound?): plain attributes that may hold a lifted
        #: tensor; a forward-hook dict is copied now and always bound (a hook removed after the
        #: forward still runs in the recompute, as it ran in the forward)
        self.attributes = [
            (module, name, template(collections.OrderedDict(value) if hooks else value)[0], hooks)
            for module, name, value in attributes
            for hooks in [name in _rebind._FORWARD_HOOKS]
        ]
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
        self.checked = False  # the run-time proof has run (on the first forward)
        self.check: Optional[_proof.ReadCheck] = None  # the forward's, while it runs
        self.versions: List[Optional[int]] = []
        #: the versions, once the forward has run, of the inputs it read (None for the others):
        #: every recompute checks them
        self.versions_after: List[Optional[int]] = []
        #: the indices of the inputs the first forward read (None: not known, all are checked)
        self.read: Optional[set] = None
        #: input index -> its value before the forward updated it in place (see for_recompute)
        self.pre_forward: dict = {}
        self.output_template: Any = None
        self.output_ids: List[int] = []
        self.output_kept: List[bool] = []
        self.recompute_context: Any = contextlib.nullcontext()
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
        #: optimizer step), or returns fallback's replays (a train/eval switch: see ``_decide``)
        self.check_recompute: Callable[[], Any] = lambda: None

    # -- running the block on a given set of input tensors

    def release(self) -> None:
        """Forget the call's own objects once the forward has run (the recompute uses the holes)."""
        self.original_function = self.args = self.kwargs = None
        self.inputs = ()

    def call(self, tensors: Sequence[Tensor], check: Optional[_proof.ReadCheck] = None) -> Any:
        rebuild = _rebind._Rebuild({}, fill=tensors)
        bindings = [(module, store, name, tensors[i]) for module, store, name, i in self.slots]
        for module, name, value in self.scalars:
            now = module.__dict__.get(name, _rebind._ABSENT)
            if now is not value and not (type(now) is type(value) and now == value):
                bindings.append((module, "__dict__", name, value))
        attributes = []  # (label, value): the module attributes the block reads, as it reads them
        for module, name, value, always in self.attributes:
            new, changed = rebuild(value)
            if changed or always:
                bindings.append((module, "__dict__", name, new))
            if name not in _rebind._FORWARD_HOOKS:
                attributes.append((f"{type(module).__name__}.{name}", new if changed else getattr(module, name, new)))
        with _rebind.bound(bindings):
            function = rebuild(self.function)[0]
            args, kwargs = rebuild(self.call_args)[0]
            if check is None:
                return function(*args, **kwargs)
            given = _state.contents_snapshot(
                (_state._argument_roots(function, args, kwargs) or [])
                + [(label, value) for label, value in attributes if _state._holds_container(value)]
            )
            check.given(tensors)
            with check:
                output = function(*args, **kwargs)
            check.raise_refusal()  # one the block's own ``except Exception`` caught
            check.check_outputs(_output_tensors(output))
            if given:
                self.contents = _contents_to_replay(given, self._own_containers())
            return output

    def _own_containers(self) -> set:
        """The ids of the user's own containers the block is given (not the copies a call makes)."""
        roots = (_state._argument_roots(self.function, *self.call_args) or []) + [
            (name, value) for _, name, value, _ in self.attributes if _state._holds_container(value)
        ]
        return {id(entry[1]) for entry in _state.contents_snapshot(roots)}

    def pure(
        self, tensors: Sequence[Tensor], check: Optional[_proof.ReadCheck] = None, first: bool = False,
    ) -> Tuple[Tensor, ...]:
        """The block as a function of its input tensors to its output tensors (for vjp / jvp).

        ``first``: the forward, which remembers the output's structure.
        """
        output = self.call(tensors, check)
        if first:
            self.output_template = output
            found = _output_tensors(output)
            self.output_ids = [id(t) for t in found]
            self.output_kept = [_differentiable_dtype(t) for t in found]
            return tuple(found)
        return tuple(_output_tensors(output))

    def forward_outputs(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The first run of the block: checked, in the call's grad mode, remembered for replay."""
        self.capture_forward_state(tensors)
        forward_context = contextlib.nullcontext()
        if self.context_fn is not None:
            forward_context, self.recompute_context = self.context_fn()
            if isinstance(forward_context, SELECTIVE_CACHING_MODE):
                # Selective checkpointing caches ops by their order in torch's own recompute;
                # the vjp here runs other ops, so the cache would not line up ("not found in
                # storage"). Its policy only chooses what to keep: recomputing all is correct.
                forward_context, self.recompute_context = contextlib.nullcontext(), contextlib.nullcontext()
        device_context = contextlib.nullcontext() if self.default_device is None else torch.device(self.default_device)
        check = None if self.checked or not PROOF else _proof.ReadCheck(tensors)
        self.versions = [_version(_base(t)) for t in tensors]  # a wrapper's own counter never moves
        self.check = check
        given = [t.detach() for t in tensors]  # new objects: a read of the original is not a read of these
        needed = [i for i, need in enumerate(self.needs) if need] if self.grad_mode else []
        with device_context, forward_context, _plain_nested_checkpoints():
            if needed:
                # the inputs that required grad at the call require grad here too, under a
                # throwaway grad level (its graph goes when the level exits)
                with _grad_increment_nesting() as level, torch.enable_grad():
                    wrapped = [_wrap_for_grad(t, level) for t in given]
                    with _enable_inplace_requires_grad(True):
                        for i in needed:
                            wrapped[i].requires_grad_()
                    outputs = tuple(_unwrap_for_grad(o, level) for o in self.pure(wrapped, check, first=True))
            else:
                with torch.set_grad_enabled(self.grad_mode):
                    outputs = self.pure(given, check, first=True)
        self.checked = True
        if check is not None:  # what the block updated in place: the recompute starts from the forward's values
            self.generators = list(check.generators.values())
            self._no_unseen_updates(tensors, check)
            self.pre_forward = {i: kept for i, kept in check.before.items() if self._updated(i, kept, tensors[i])}
            self.read = None if check.unseen_reads else check.read
            self.check = None
        read = self.read  # a module's other parameters are lifted too: another's optimizer step is no change
        self.versions_after = [
            _version(_base(t)) if read is None or i in read else None for i, t in enumerate(tensors)
        ]
        # An input returned as is (a mask passed through) cannot also be saved for backward by a
        # Function with setup_context: return a copy of it instead (as large as that input).
        passed = {id(t) for t in (*tensors, *given)}
        final = tuple(o.clone() if id(o) in passed else o.detach() for o in outputs)
        # the output's structure, holding these (not the forward's own tensors: under the grad level
        # above they hold its whole graph)
        self.output_template = _rebind.rebuild(self.output_template, dict(zip(self.output_ids, final)))
        self.output_ids = [id(t) for t in final]
        return final

    def for_recompute(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The saved inputs, with the forward's starting values of those it updated in place.

        A BatchNorm's running statistics are updated once, as without
        checkpointing (each recompute updates a copy).  An input that needs
        a gradient is left as it is (it is what the recompute differentiates).
        """
        for i, (t, was) in enumerate(zip(tensors, self.versions_after)):
            if was is not None and i not in self.pre_forward and _version(_base(t)) != was:
                self.check_recompute()  # a drift rule that explains it (an optimizer step: CKG108) speaks first
                raise self._changed_since_forward(i, t, was)
        if not self.pre_forward:
            return tuple(tensors)
        return tuple(
            self.pre_forward[i].clone() if i in self.pre_forward and not self.needs[i] else t
            for i, t in enumerate(tensors)
        )

    def undo_updates(self, tensors: Sequence[Tensor]) -> None:
        """After a refused forward: put back what it updated in place (the plain run updates it again)."""
        check = self.check
        if check is None:
            return
        with torch.no_grad():
            for i, kept in check.before.items():
                if self._updated(i, kept, tensors[i]):
                    tensors[i].copy_(kept)

    def _no_unseen_updates(self, tensors: Sequence[Tensor], check: _proof.ReadCheck) -> None:
        """Raise :class:`UnrepeatableForward` if the forward moved an input's version with no copy kept.

        Also for an input that needs a gradient: the recompute differentiates
        it as it is now, not as the forward found it.
        """
        for i, (t, was) in enumerate(zip(tensors, self.versions)):
            if was is None or _version(_base(t)) == was or (i in check.before and not self.needs[i]):
                continue
            how = (
                "an input that needs a gradient" if self.needs[i]
                else "in a way the run-time proof did not see coming (a C extension, say)"
            )
            path = None
            if self.original_function is not None and i < len(self.inputs):
                path = _rebind.describe_path(self.original_function, self.args, self.kwargs, self.inputs[i])
            raise UnrepeatableForward(
                f"ckpt_guard's composable recompute: the checkpointed block updated "
                f"{path or 'a tensor it reads'} (a {tuple(_base(t).shape)} tensor) in place, {how}. "
                "Its recompute would start from the "
                "updated value and return wrong gradients, so the call stops here (the forward has "
                "already updated it: it is not run again). Pass the block a copy (x.clone()), or make "
                "the update outside the checkpointed block."
            )

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
        return self.versions[i] != _version(_base(now)) or not torch.equal(kept, now)

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
        device_type = _tuc._infer_device_type(*tensors)
        self.autocast = (device_type, *_tuc._get_autocast_kwargs(device_type))
        device_module = getattr(torch, device_type, None)
        devices, states = ([], [])
        if device_type != "cpu" and getattr(device_module, "_initialized", False):
            devices, states = _tuc.get_device_states(*tensors)
        self.rng = (torch.get_rng_state(), devices, states, device_type)

    def restore_rng(self) -> None:
        """The RNG as the forward found it (fallback's plain run after a refusal draws the same)."""
        if self.rng is not None:
            cpu_state, devices, states, _ = self.rng
            torch.set_rng_state(cpu_state)
            if devices:
                _tuc.set_device_states(devices, states)
        for generator, state in (self.check.generators.values() if self.check is not None else self.generators):
            generator.set_state(state)

    @contextlib.contextmanager
    def replay(self) -> Any:
        """The forward's RNG, default dtype and device, autocast and the recompute context, around a recompute."""
        replays = self.check_recompute() or ()
        device_type, device_autocast, cpu_autocast = self.autocast
        with contextlib.ExitStack() as stack:
            for replay in replays:  # fallback: a module's train/eval mode as in the forward
                stack.enter_context(replay)
            stack.enter_context(default_dtype(self.default_dtype))
            if self.default_device is not None:  # a fresh context, as torch >= 2.11 does
                stack.enter_context(torch.device(self.default_device))
            cpu_state, devices, states, _ = self.rng
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device_type))
            torch.set_rng_state(cpu_state)
            if devices:
                _tuc.set_device_states(devices, states)
            if self.generators:
                # the recompute draws are not the program's: each is left where the program had it
                stack.enter_context(_state.replaying_generators(self.generators, lock=False))
            if self.contents:
                stack.enter_context(_state.replaying_contents(self.contents, lock=False))
            if torch.amp.is_autocast_available(device_type) and device_type != "cpu":
                stack.enter_context(torch.amp.autocast(device_type=device_type, **device_autocast))
            stack.enter_context(torch.amp.autocast("cpu", **cpu_autocast))
            stack.enter_context(self.recompute_context)
            stack.enter_context(_plain_nested_checkpoints())
            yield
        global RECOMPUTES
        RECOMPUTES += 1


class ChangedContainer(Exception):
    """The forward changed a list, dict or object the block was given (a KV cache it appends to)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _contents_to_replay(given: tuple, own: set) -> List[tuple]:
    """What the recompute must replay of the containers the forward changed; :class:`ChangedContainer` where
    no replay can be right (their contents put back first: the caller may run the block again).

    A change is replayed (each recompute starts from what the forward found,
    and puts back what is there then: a counter, a log of detached tensors
    changes once) unless the block changed a copy the call made (the user's
    own container would never see it) or put in a tensor that carries a
    gradient, alone or in a container (a KV cache entry: no gradient can
    leave a checkpoint that way).  A tensor in them updated in place is the
    proof's.
    """
    changed = [entry for entry in _state.changed_at_all(given) if entry[2] != "tensor"]
    why = ""
    for path, value, kind, recorded in changed:
        if id(value) not in own:
            why = f"it changes {path}, which the call hands it as a copy (the user's own would not change)"
        elif not _state.replayable([(path, value, kind, recorded)]):
            why = f"it changes {path}, a container too long to keep a copy of"
        elif any(
            _state.carries_gradient(item) for item in _state._moved(_state._shallow(value, kind), recorded, kind)
        ):
            what = _state.describe_contents_change(((path, value, kind, recorded),))
            why = f"it puts a tensor that carries a gradient there ({what}): no gradient can leave a checkpoint that way"
        if why:
            break
    if not why:
        return changed
    _state.restore_contents(changed)
    raise ChangedContainer(f"the block changes a container it is given: {why}")


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
        global NESTED_RECOMPUTES
        NESTED_RECOMPUTES += 1
        with torch.no_grad():  # torch.func's transforms inside ignore it; no eager graph is kept
            outputs = self._function(tensors)
        self.output_kept = [_differentiable_dtype(o) for o in outputs]
        passed = {id(t) for t in tensors}
        return tuple(o.clone() if id(o) in passed else o.detach() for o in outputs)

    def pure(self, tensors: Sequence[Tensor], check: Any = None) -> Tuple[Tensor, ...]:
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
    """A plan vmapped: the block under ``torch.vmap``, checkpointed whole (vmap of a checkpoint)."""

    def __init__(self, base: Any, in_dims: Sequence[Optional[int]], randomness: str) -> None:
        self.base, self.in_dims = base, tuple(in_dims)
        if isinstance(base, _Derivative) and all(d is None for d in self.in_dims[: _primal_count(base, in_dims)]):
            # a derivative vmapped over its cotangents / tangents alone (jacrev, jacfwd): its
            # block's random draws replay an unbatched forward, so they are drawn unbatched too
            randomness = "same"
        self.randomness = randomness

        #: per output: batched (a leading batch dimension) or not (as the block made it)
        self.out_batched: List[bool] = []

    def _vmapped(self, inner: Callable[..., Tuple[Tensor, ...]], tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        found: List[bool] = []

        def per_sample(*ts: Tensor) -> Tuple[Tensor, ...]:
            outputs = inner(ts)
            level = _current_level()
            found[:] = [_batched_at(o, level) for o in outputs]
            return outputs

        outputs = torch.vmap(per_sample, in_dims=self.in_dims, randomness=self.randomness)(*tensors)
        if not self.out_batched:
            self.out_batched = found
        # an output the batch did not reach stays as it was: torch.vmap expands it (stride 0), and
        # an expanded tangent or cotangent cannot be written to
        return tuple(o if batched else o.select(0, 0) for o, batched in zip(outputs, self.out_batched))

    def forward_outputs(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        return self._vmapped(self.base.forward_outputs, tensors)

    def pure(self, tensors: Sequence[Tensor], check: Any = None) -> Tuple[Tensor, ...]:
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
    return _vjp_with_argnums(_recompute_of(plan), *tensors, argnums=tuple(wanted))


def _jvp(
    plan: Any, tensors: Sequence[Tensor], wanted: Sequence[int], directions: Sequence[Tensor],
) -> Tuple[Tensor, ...]:
    """The output tangents of the block along ``directions`` (of the ``wanted`` inputs).

    The other inputs stay as they are (constants of the jvp level): wrapped at
    it without a tangent, an RNN's forward-mode formula mixes batched and
    unbatched tangents in place (under jacfwd) and fails.
    """
    recompute = _recompute_of(plan)

    def along(*chosen: Tensor) -> Tuple[Tensor, ...]:
        full = list(tensors)
        for i, t in zip(wanted, chosen):
            full[i] = t
        return recompute(*full)

    # a dual's primal cannot overlap itself (a cotangent of .sum() is an expanded one)
    chosen = tuple(_unexpanded(tensors[i]) for i in wanted)
    return tuple(torch.func.jvp(along, chosen, tuple(directions))[1])


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
    interpreters = pyfunctorch.retrieve_all_functorch_interpreters() if _state.peek_interpreter_stack() else []
    if own == "saved":  # the level whose node this is: the saved tensors' (a jvp passes its own)
        own = _own_level(saved)
    eager_grad_mode = None
    for interpreter in interpreters:
        if interpreter.key().name == _GRAD:
            if interpreter.level() != own:
                return True
            if eager_grad_mode is None:
                eager_grad_mode = interpreter.prev_grad_mode()
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
    """The composable checkpoint: forward without activations, every rule a recompute."""

    @staticmethod
    def forward(plan: Any, *tensors: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        return plan.forward_outputs(tensors)

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
        plan = ctx.plan
        tensors = plan.for_recompute(ctx.saved_tensors)
        needed = ctx.needs_input_grad[1:]
        reachable = plan.differentiable_inputs()
        wanted = [i for i, t in enumerate(tensors) if needed[i] and reachable[i] and _differentiable_dtype(t)]
        if not wanted:
            return (None,) * (1 + len(tensors))
        cotangents = [g for g, kept in zip(grad_outputs, plan.differentiable_outputs()) if kept]
        if _differentiated_again(tensors, cotangents):
            derivative = _Derivative(plan, "vjp", wanted, [c is not None for c in cotangents])
            grads = _Recompute.apply(derivative, *tensors, *(c for c in cotangents if c is not None))
        else:  # nothing differentiates this again: no graph kept, the least memory
            with _unbatched_vmaps_set_aside(tensors), plan.replay(), torch.no_grad():
                outputs, pullback = _vjp(plan, tensors, wanted)
            with torch.no_grad():  # no graph of the vjp either: it would keep the recompute alive
                grads = pullback(tuple(torch.zeros_like(o) if c is None else c for o, c in zip(outputs, cotangents)))
        result: List[Optional[Tensor]] = [None] * len(tensors)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (None, *result)

    @staticmethod
    def jvp(ctx: Any, plan_tangent: Any, *tangents: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan = ctx.plan
        tensors = plan.for_recompute(ctx.saved_tensors)
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
        if _differentiated_again(tensors, directions, own):
            output_tangents = _Recompute.apply(_Derivative(plan, "jvp", wanted, ()), *tensors, *directions)
        else:
            with plan.replay():
                output_tangents = _jvp(plan, tensors, wanted, directions)
        it = iter(output_tangents)
        return tuple(next(it) if k else None for k in kept)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Any, ...], plan: Any, *tensors: Tensor) -> Any:
        batched = _Batched(plan, in_dims[1:], info.randomness)
        outputs = _Recompute.apply(batched, *tensors)
        return outputs, batched.out_dims()


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
    (CKG107): the forward's RNG is always replayed.
    """
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
    if _parametrization_cache_enabled():
        return (
            "torch.nn.utils.parametrize.cached() is active: the block's forward would fill its cache "
            "with tensors computed below the transforms, which the code after the block reads"
        )
    held = _rebind.holdings(function, args, kwargs)
    subclass = _tensor_subclass_in(held)
    if subclass is not None:
        return (
            f"it reads a {subclass.__name__}, a tensor subclass with its own __torch_function__, which "
            "a recompute under other torch.func levels cannot pass through"
        )
    built = Plan(function, args, kwargs, held, context_fn)
    lifted = {id(t) for t in built.inputs}
    unlifted = [t for t in held.unbindable if id(t) not in lifted and _carries_gradient(t)]
    if unlifted:
        names = _global_names(function, unlifted[0])
        which = f"the global {names}" if names else "a global"
        return (
            f"it reads a tensor that needs a gradient through {which}, which cannot be passed to "
            "the recompute as an input (its gradient would be lost); pass it to the block as an "
            "argument instead: ckpt_guard.checkpoint(block, x, w) with block(x, w)"
        )
    if not built.inputs:
        return "it reads no tensor: there is nothing to recompute"
    return built


def _global_names(function: Any, tensor: Tensor) -> str:
    """``W`` or ``W, W2``: the module-level names the block's code reads ``tensor`` through, for messages."""
    code_owners = [function, getattr(function, "func", None), getattr(getattr(function, "forward", None), "__func__", None)]
    names = []
    for owner in code_owners:
        namespace = getattr(owner, "__globals__", None)
        if isinstance(namespace, dict):
            names += [name for name, value in namespace.items() if value is tensor and name not in names]
    return ", ".join(names)


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
    try:
        outputs = _Recompute.apply(built, *built.inputs)
    except (_proof.Unlifted, ChangedContainer) as read:
        built.undo_updates(built.inputs)
        built.restore_rng()
        reason = read.reason if isinstance(read, ChangedContainer) else _describe_unlifted(built, read)
        built.release()
        raise Refused(reason) from None
    output = built.rebuild(outputs)
    built.release()
    built.output_template = None  # the forward's outputs: the backward does not need them
    return output


def _describe_unlifted(built: Plan, read: _proof.Unlifted) -> str:
    tensor = read.tensor
    path = _rebind.describe_path(built.original_function, built.args, built.kwargs, tensor)
    if _state.is_functorch_wrapped_tensor(tensor):
        what = "a tensor a torch.func transform is differentiating or batching"
    else:
        what = "a tensor that requires grad"
    shape = tuple(_base(tensor).shape)
    where = f"{path}" if path else f"a path the guard cannot name (shape {shape})"
    if read.outside:
        return (
            f"the block writes in place into {where}, a tensor it was neither given nor made by a "
            f"torch operation (through {read.operation} at {read.site}): the recompute would write it a "
            "second time and start from what the forward wrote (pass it to the block as an argument; "
            "one the block makes with torch.Tensor(...) or from NumPy: make it with torch.zeros or torch.tensor)"
        )
    if read.write:
        return (
            f"the block writes in place into {where}, an input a torch.func transform batches or "
            f"differentiates (through {read.operation} at {read.site}): no copy of what the forward "
            "started from can be kept for the recompute"
        )
    how = "returned it" if read.operation == "returned" else f"passed it to {read.operation}"
    return (
        f"the block reads {what} that was not lifted into the recompute's inputs: {where}; "
        f"it {how} at {read.site} (its gradient would have been lost)"
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
