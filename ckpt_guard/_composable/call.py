"""The entry of one call into the composable recompute: pack it, or say why not.

:func:`plan` plans the call (the walk in ``binding``) and refuses what cannot be packed
(a compiled function, TorchScript, a tensor subclass, a global tensor needing a
gradient...); :func:`run` runs the first forward, with compiled code inside the block held
eager, and packs the outputs into the Function.  May not touch:
the decision (``_decide``, ``entry``) that calls it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence, Union

import torch

from . import levels as _levels
from . import binding as _rebind
from . import shapes as _shapes
from . import counters
from . import later_writes as _later_writes
from .. import _state
from .._state.peel import function_of
from .basics import Tensor, _base, _carries_gradient
from . import function as _function  # noqa: F401 - importing it sets levels.FUNCTION
from .plan import Plan
from .refusals import NOTHING_TO_SAVE, Reason, Refused
from .replay import _SET_STANCE, _compiled, _output_tensors


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
    (its ``found.refusal`` set) and that is the result.
    """
    why = _why_not_packed(function, args, kwargs)
    held = None
    if why is None:
        held = _shapes.holdings(function, args, kwargs)  # the walk, or its answer kept from the last call
        why = _why_not_packed_held(function, held)
    if why is not None:
        if held is None:
            held = _rebind.holdings(function, args, kwargs)
        if _reverse_mode_possible(args, kwargs, held):
            return why
    built = Plan(function, args, kwargs, held, context_fn)
    if why is None:
        lifted = {id(t) for t in built.at_call.inputs}
        unlifted = [t for t in held.unbindable if _carries_gradient(t)]
        if unlifted:
            names = _global_names(function, unlifted[0])
            which = f"the global {names}" if names else "a global, a class attribute or a namespace"
            if id(unlifted[0]) in lifted:  # lifted where it is bound, but reachable where it is not
                which += " (it is given to the block another way too, but the recompute could read it there)"
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
    if why is None and built.at_call.placed_nowhere:
        why = Reason(
            "unlifted-read",
            "it is given a tensor that needs a gradient inside an object the recompute cannot rebuild with its "
            "own tensors (copying the object raised): the recompute would read the call's tensor there (its "
            "gradient would be lost)",
            fix="pass that tensor to the block as an argument of its own, or make its holder copyable (copy.copy)",
        )
        if _reverse_mode_possible(args, kwargs, held):
            return why
    if not built.at_call.inputs:
        return "it reads no tensor: there is nothing to recompute"
    built.refuse(why)  # no reverse mode can follow: the plain run is the result, whatever this says
    return built


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
            "forward-over-forward", "forward-mode AD over forward-mode AD does not differentiate through a custom jvp",
            fix=(
                "take the inner derivative by reverse mode: jacrev(jacrev(f)) for a Hessian (or a Laplacian) "
                "instead of hessian / jacfwd(jacrev(f)), grad(grad(f)) instead of jvp over jvp: the composable "
                "recompute then runs every level and keeps the memory saving (jvp(grad(loss)) over such a loss "
                "included)"
            ),
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
    autograd with a tensor it reads requiring grad).  If not, a plain run keeps nothing to save.

    Grad mode off (``torch.no_grad()`` inside ``grad(grad(f))``) is off at every level below: a
    grad level passes the caller's mode down, only ever turning it off (``GradInterpreter.lower``),
    so no grad level records the block, and nothing can differentiate it later.
    """
    if not torch.is_grad_enabled():
        return False
    if _state.grad_level_alive():
        return True
    tensors = [*held.tensors, *held.arguments, *held.unbindable]
    for module in held.modules:
        tensors += [*module.__dict__["_parameters"].values(), *module.__dict__["_buffers"].values()]
    with torch._C.DisableTorchFunctionSubclass():  # an ExpandedWeight refuses even .requires_grad
        return any(isinstance(t, Tensor) and _state.requires_grad_anywhere(t) for t in tensors)


def _global_names(function: Any, tensor: Tensor) -> str:
    """``W``, ``W, W2`` or ``Holder.w``: the module-level names (or a class's or a namespace's attribute
    held there) the block's code reads ``tensor`` through, for messages."""
    code_owners = [function, function_of(function), getattr(getattr(function, "forward", None), "__func__", None)]
    names: list = []
    for owner in code_owners:
        namespace = getattr(owner, "__globals__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in namespace.items():
            if value is tensor:
                found = [name]
            elif _rebind._user_namespace(value):
                found = [f"{name}.{attribute}" for attribute, held in list(vars(value).items()) if held is tensor]
            else:
                continue
            names += [n for n in found if n not in names]
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
        built.unpacked = built.found.refusal or NOTHING_TO_SAVE
        return output
    if built.found.refusal is not None:
        reason = built.found.refusal
        built.release()
        raise Refused(reason, output)
    precomputed = built.precomputed(output)
    overlap = built.overlapping_outputs(found)
    if overlap is not None:  # outputs sharing memory: the Function's would not, so a write into one would miss the other
        built.release()
        raise Refused(overlap, output)
    if len(built.found.aliases) == len(found):  # every output is an input or a view of one: nothing to save
        built.release()
        built.unpacked = NOTHING_TO_SAVE
        return output
    built.keep_tangents(output)
    # an output that is an input, or a view of one, is the caller's as the plain run made it: an
    # update in place of it reaches the input, as without checkpointing (a Function's output cannot
    # be a view under torch.func); its graph is a view's, or the block's in-place updates of that input
    aliases = [(i, found[i]) for i in built.found.aliases]
    del found, output  # the plain run's graph goes with them
    # an input the forward updated in place (a BatchNorm's running statistics) is handed in as the copy
    # of what the forward started from: the Function saves that, so a later update of the live one (the
    # same module called again) is no change to what this recompute reads
    operands = [built.found.pre_forward.get(i, t) for i, t in enumerate(built.at_call.inputs)] if built.found.pre_forward else built.at_call.inputs
    if built.found.read is not None and len(built.found.read) < len(operands):
        # an input the forward never read (a stale tensor an RNN's _flat_weights still holds after a
        # functional_call, a parameter of a submodule the block did not call) is handed in cut from its
        # graph: without checkpointing nothing connects it to the outputs, so neither may the Function
        # (a zero gradient into it would run its old, freed graph)
        # (an eager tensor only: a torch.func wrapper of a level gone since is left as it is, which
        # nothing differentiates, and detaching it trips functorch's "escaped?" assertion)
        operands = [
            t if i in built.found.read or _state.is_functorch_wrapped_tensor(t) or not t.requires_grad else t.detach()
            for i, t in enumerate(operands)
        ]
    if built.found.aliased_inputs:
        # an input an output aliases: the caller may write into it through that output, as without
        # checkpointing; the Function is handed a copy (connected to it), which no one else can write
        operands = list(operands)
        for i in built.found.aliased_inputs:
            if i not in built.found.pre_forward:
                operands[i] = operands[i].clone()
                built.hand_in_copy(i)
    # an input the caller may write into after the call (``h.add_(1)``): the Function keeps a copy on write
    operands = _later_writes.copies_on_write(built, operands)
    outputs = _levels.apply(built, *operands, *precomputed)
    counters.PACKED += 1
    del precomputed
    if aliases:
        outputs = list(outputs)
        for i, plain in aliases:
            outputs[i] = plain
    result = built.rebuild(outputs)
    built.release()
    return result


def _reverse_mode_can_follow(outputs: Sequence[Tensor]) -> bool:
    """Whether reverse mode may differentiate this call's outputs: a grad level, or eager autograd.

    Where neither can (``jvp``, ``jacfwd``, ``vmap`` with nothing requiring
    grad, grad mode off at the call under any transform), the plain run kept no
    activations: it is the result.  So is it where the caller's grad mode is off
    and the block turns it on inside (an energy model's inner ``autograd.grad``):
    a Function applied with grad mode off records nothing, the plain run's graph
    is the right one (kept whole: not checkpointed).
    """
    if not torch.is_grad_enabled():
        return False
    if _state.grad_level_alive():
        return True
    return any(_base(t).requires_grad for t in outputs)
