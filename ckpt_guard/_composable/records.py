"""What a checkpointed call keeps, in three records, each with one writer.

A :class:`~.plan.Plan` is the node the recompute's Function carries.  What it
knows comes in three kinds, written at three moments and read by every recompute:

=================  =======================================================================
``at_call``        :class:`CallRecord`: what the call is (its inputs, the block as a template
                   with holes where they go, the module slots it binds, what each input may
                   receive).  Made whole by its constructor, at plan time; never written after
                   (:meth:`CallRecord.release` only lets go of the call's own objects).
``found``          :class:`ForwardRecord`: what the first forward found (what it read and
                   wrote, the versions it left, its outputs, the inputs the caller may write
                   into after the call).  Written by the plan's forward and packing
                   (``plan.py``), read-only once the Function is applied.
``world``          :class:`ReplayWorld`: the world each recompute replays (RNG, default dtype
                   and device, autocast, generators, containers, globals, the global module
                   hooks, a save policy's record, the drift check).  Written by the plan as
                   the forward runs (``plan.py``); entered by ``Plan.replay``.
=================  =======================================================================

``tests/test_architecture.py`` checks that no other file assigns to a record's fields.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch._C._functorch import is_batchedtensor as _is_batched, maybe_get_level as _level_of

from . import binding as _rebind
from . import saving as _saving
from .. import _state
from .basics import JVP_KEY, Module, Tensor, _carries_gradient, _differentiable_dtype, _reach
from .replay import _NO_CONTEXT, _global_hooks


class CallRecord:
    """What the call is: its lifted inputs, the block with holes where they go, what each input may receive.

    Holds none of the call's tensors once :meth:`release` ran (the plan lives as long as the
    backward may run, and must not hold the call's tensors, nor the graphs they hold): the
    block and its arguments are templates (``binding._Rebuild`` with holes), filled in by each
    recompute with its own tensors.
    """

    def __init__(
        self, function: Callable[..., Any], args: tuple, kwargs: dict, held: _rebind.Holdings, context_fn: Any,
    ) -> None:
        #: the call as made (for messages and the first forward); :meth:`release` drops it
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
        #: the lifted tensors, in the Function's operand order
        self.inputs: Tuple[Tensor, ...] = tuple(inputs.values())
        self.n_inputs = len(self.inputs)
        index = {key: i for i, key in enumerate(inputs)}
        templates: list = []  # made once, where something is templated (a module block on tensors: nothing)

        def template(value: Any) -> Tuple[Any, bool]:
            if not templates:
                templates.append(_rebind._Rebuild({key: _rebind.Hole(i) for key, i in index.items()}))
            return templates[0](value)

        #: the block: a module is bound, never rebuilt; a function is a template (its closures frozen)
        self.function: Any
        if isinstance(held.frozen, Module):
            self.function, function_holes = held.frozen, False
        else:
            self.function, function_holes = template(held.frozen)
        #: the arguments as input indices where they are all lifted tensors (``checkpoint(block, h)``,
        #: the usual call): each recompute hands them on without walking a template; else None
        self.flat_args: Optional[List[int]] = None
        #: ``(args, kwargs)`` with holes, where ``flat_args`` is None
        self.call_args: Any = None
        if not kwargs and all(issubclass(type(a), Tensor) and id(a) in index for a in args):
            self.flat_args = [index[id(a)] for a in args]
        else:
            self.call_args = template((args, kwargs))[0]
        #: (module, store, name, input index) of each module slot bound to an input, as planned
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
        self.attributes: List[tuple] = []
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
        #: (module, name) of those plain attributes: the containers among them are watched in the forward
        self.attribute_names = [(module, name) for module, name, _ in attributes]
        #: lifted inputs needing a gradient that no binding places (a module slot, the flat arguments, a hole in
        #: the templates: an object holding one that copying refuses stays as it is): the recompute would read
        #: the call's own tensor there, its gradient lost (``call.plan`` refuses)
        placed = {id(t) for *_, t in slots} | set(templates[0].placed if templates else ())
        placed |= {id(self.inputs[i]) for i in self.flat_args or ()}
        self.placed_nowhere = [t for key, t in inputs.items() if key not in placed and _carries_gradient(t)]
        #: the call's grad mode: a block may branch on it (nn.TransformerEncoder's fast path)
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
        #: the user's ``context_fn`` (torch's checkpoint's), or None
        self.context_fn = context_fn

    def release(self) -> None:
        """Forget the call's own objects once the forward has run (the recompute uses the holes)."""
        self.original_function = self.args = self.kwargs = None
        self.inputs = ()


class ForwardRecord:
    """What the first forward found, and what packing its outputs decided: written by the plan only
    (``Plan.first_run``, ``Plan.precomputed``, and what ``call`` and ``later_writes`` ask of it through
    ``Plan.refuse``, ``Plan.hand_in_copy``, ``Plan.watch_callers``), then read by every recompute."""

    def __init__(self, slots: Sequence[tuple]) -> None:
        #: why the plain run cannot be packed into a recompute (the plan's, or the run-time proof's
        #: finding), or None
        self.refusal: Any = None
        #: (module, store, name, input index) of each module slot, as the forward left it bound (a slot
        #: the block filled itself with another input, see ``Plan._bind_what_the_forward_put``)
        self.slots: List[tuple] = list(slots)
        #: the inputs' versions (under every wrapper) before the forward
        self.versions: List[Optional[int]] = []
        #: whether an input requires grad under all its wrappers (eager autograd may differentiate
        #: a backward then: ``function._differentiated_again``); None until the forward has run
        self.eager_requires_grad: Optional[bool] = None
        #: (level, batch size, randomness) of each vmap the forward ran under
        self.vmaps_at_forward: frozenset = frozenset()
        #: the indices of the inputs the first forward read (None: not known, all are checked)
        self.read: Optional[set] = None
        #: input index -> its value before the forward updated it in place (see ``Plan.for_recompute``)
        self.pre_forward: dict = {}
        #: inputs needing a gradient the forward rewrote with what a rewrite leaves as is (an
        #: Embedding's max_norm): each recompute starts from a copy of the saved one
        self.rewritten: frozenset = frozenset()
        #: the inputs the block updates in place: every recompute hands it copies of these
        self.written: frozenset = frozenset()
        #: (weakref, version, storage) of each tensor the forward read as a constant (a closure's
        #: mask): every recompute checks that it is still what the forward read
        self.constants: list = []
        #: the versions, once the forward has run, of the inputs it read (None for the others, and for an
        #: input handed to the Function as a copy no one else writes): every recompute checks them
        self.versions_after: List[Optional[int]] = []
        #: (index, requires_grad) of each input the block read, as it read it: each recompute shows it so
        self.requires_grad_read: List[Tuple[int, bool]] = []
        #: the block's output with its tensors (the Function's outputs replace them: ``Plan.rebuild``)
        self.output_template: Any = None
        self.output_ids: List[int] = []
        #: per output tensor: differentiable (a float or complex dtype)
        self.output_kept: List[bool] = []
        #: positions of the plain run's outputs that share memory with an input (the input itself, a
        #: view of it): the caller gets those tensors as the plain run made them (see ``call._run``)
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


class ReplayWorld:
    """The world each recompute replays, as the forward found it (``Plan.replay`` enters it)."""

    def __init__(self) -> None:
        self.default_dtype = torch.get_default_dtype()
        #: a torch.device(...) context's device at the call: the Function's forward
        #: runs without function modes, so it is re-entered there and in the recompute
        self.default_device: Any = _state.forward_device_context()
        #: the global module hooks (register_module_forward_hook) at the call, if any: each recompute
        #: runs under them, as the forward did, also after the user removed one
        self.global_hooks: Any = _global_hooks()
        #: (CPU RNG state, devices, their states, device type) before the forward
        self.rng: Any = None
        #: (device type, device autocast kwargs, CPU autocast kwargs) at the forward (None: off)
        self.autocast: Any = None
        #: (slot, value) of each global the block's code loads, as the call found it: a recompute
        #: runs with those a script re-bound since (``W = W - lr * g``), as the forward did
        self.globals_read: List[tuple] = []
        #: (generator, state) of each user torch.Generator the forward drew from, before its first draw
        self.generators: List[tuple] = []
        #: the user's containers the forward changed, as it found them (``_state.contents_snapshot``
        #: entries): every recompute runs with these contents, and puts back what they hold then
        self.contents: List[tuple] = []
        #: the rest of the user's containers the block is given, as the call found them: one the
        #: program changes after the call (``cfg.scale = 2.0`` before the pullback) is replayed too
        self.contents_at_call: List[tuple] = []
        #: a user ``context_fn``'s recompute context (``_NO_CONTEXT``: none)
        self.recompute_context: Any = _NO_CONTEXT
        #: called before every recompute; raises for a drift the recompute cannot undo (an
        #: optimizer step), or returns fallback's replays (a train/eval switch: see ``_decide``)
        self.check_recompute: Callable[[], Any] = lambda: None
        #: under a save policy (a selective checkpointing ``context_fn``): what it kept of the
        #: first forward, handed back to each recompute (``saving``); None: everything is recomputed
        self.saved: Optional[_saving.Saved] = None
