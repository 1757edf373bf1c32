"""Adapters: where each torch release's checkpoint passes, and how to guard it there.

Every way into activation checkpointing (``checkpoint``, its curried form,
``checkpoint_sequential``, names bound before ``install()``, partials,
``checkpoint_wrapper`` / ``apply_activation_checkpointing``, the composable
``checkpoint(module)``) ends in one of two internal *choke points* of
``torch.utils.checkpoint``, looked up at call time as module globals.  Their
names and signatures move between torch releases; this module is the one place
that knows how.  The rest of the guard sees one interface: "this call is about
to checkpoint ``function`` over these inputs; what do I run instead?"
(``_decide.prepare_call``, which ``_patch`` hands to the guards built here:
this module knows where torch's calls pass, not how they are decided).

Non-reentrant layouts, detected by feature (the attribute and its signature),
never by version number, newest first:

``generator_impl`` (torch 2.14+)
    ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *,
    preserve_rng_state, context_fn, determinism_check, debug, early_stop, ...)``,
    called by ``_checkpoint_impl`` (behind ``checkpoint``, its curried form and
    ``checkpoint_sequential``) and imported by the composable API.  The old
    name survives as a shim over it that torch itself no longer calls.
``generator_args_kwargs`` (torch main after 2.15, read in its source; unreleased)
    the 2.4–2.13 name with the 2.14 signature: ``_checkpoint_without_reentrant_generator(fn,
    args, kwargs, *, preserve_rng_state, context_fn, ...)``, called by
    ``_checkpoint_impl``; guarded as ``generator_impl`` is.
``generator`` (torch 2.4–2.13)
    ``_checkpoint_without_reentrant_generator(fn, preserve_rng_state,
    context_fn, determinism_check, debug[, early_stop], *args, **kwargs)``,
    called by ``checkpoint`` and imported by the composable API.

A name with a signature none of these has is not guessed at: the layout is
reported unsupported (and the entry points it serves unguarded), never
half-guarded.  All are generators with one protocol: ``next`` before the forward, the
forward itself (run by the caller), ``next`` after it, ``throw`` if the forward
raised (2.13+).  The guarded replacement keeps that protocol.

The reentrant choke point is ``CheckpointFunction.apply(function,
preserve_rng_state, *args)``, inherited from ``torch.autograd.Function``: a
Python ``classmethod`` up to 2.13, a C ``classmethod_descriptor`` from 2.14.
Either way a classmethod set on ``CheckpointFunction`` shadows it and sees
every reentrant call; the original is called as ``raw(cls, *args)``.

A torch whose checkpoint matches none of these is reported, naming the entry
points that stay unguarded (:data:`NON_REENTRANT_ENTRY_POINTS`,
:data:`REENTRANT_ENTRY_POINTS`), by ``_patch``.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Tuple

#: What stays unguarded when a choke point cannot be patched.
NON_REENTRANT_ENTRY_POINTS = (
    "checkpoint(use_reentrant=False) (also curried), checkpoint_sequential(use_reentrant=False), "
    "checkpoint_wrapper / apply_activation_checkpointing with NO_REENTRANT (their default), "
    "the composable checkpoint(module)"
)
REENTRANT_ENTRY_POINTS = (
    "checkpoint(use_reentrant=True, or not passed), checkpoint_sequential(use_reentrant=True, "
    "or not passed), checkpoint_wrapper(checkpoint_impl=REENTRANT)"
)

#: The public functions that warn when ``use_reentrant`` is not passed (the
#: frame that calls ``warnings.warn``): ``checkpoint`` up to 2.13,
#: ``_checkpoint_impl`` from 2.14, ``checkpoint_sequential`` in all.
_DEFAULT_WARNING_FUNCTIONS = ("checkpoint", "_checkpoint_impl", "checkpoint_sequential")


class Unsupported(Exception):
    """This torch has no choke point where any known layout expects one."""


# --------------------------------------------------------------------------
# generator stand-ins (same protocol as torch's generator)


def run_plainly(forward_context: Any = None) -> Iterator[None]:
    """Stands in for torch's generator when fallback runs without checkpointing.

    The user's forward context (``context_fn()[0]``, e.g. autocast) still wraps
    the forward, as it would under torch's checkpoint.
    """
    if forward_context is None:
        yield
        return
    with forward_context:
        yield


def without_early_stop(start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """torch's generator (``start()``), its checkpoint frame made with early stop switched off (CKG009).

    The frame reads the switch when torch's generator first runs, so only
    that step is wrapped; the protocol is torch's.
    """
    import torch.utils.checkpoint as tuc

    with tuc.set_checkpoint_early_stop(False):
        inner = start()
        value = next(inner)
    yield from _around_forward(inner, value)


def _around_forward(inner: Iterator[Any], value: Any, after: Optional[Callable[[], None]] = None) -> Iterator[Any]:
    """The rest of torch's generator protocol, once its first step gave ``value``: the forward runs
    while this yields it; ``throw`` if the forward raised (handed to torch's generator as is), else
    ``after()`` and torch's second step.  The wrappers here differ only in their first step and ``after``.
    """
    try:
        yield value
    except BaseException as exc:  # the forward raised: hand it to torch's generator as is
        try:
            value = inner.throw(exc)
        except StopIteration:
            return
        yield value
        return
    if after is not None:
        try:
            after()
        except BaseException:  # the guard's own look failed: torch's generator still gets to clean up
            inner.close()
            raise
    yield from inner


def watch_forward_rng(inner: Iterator[Any], drew: list) -> Iterator[Any]:
    """torch's generator, plus: did the forward (run between its two steps) draw random numbers?

    Same protocol as torch's: ``next`` before the forward, ``next`` after it
    (ending the generator), ``throw`` if the forward raised.
    """
    from ._state import drew_random, rng_states

    value = next(inner)
    before = rng_states()

    def note() -> None:
        drew[0] = drew_random(before)

    yield from _around_forward(inner, value, note)


def after_forward_of(decision: Any) -> Any:
    """What to call when the forward has run (the guarded handle's ``after_forward``), or None."""
    return getattr(getattr(decision, "function", decision), "after_forward", None)


def then_after_forward(inner: Iterator[Any], after: Callable[[], None]) -> Iterator[Any]:
    """torch's generator, plus ``after()`` once the forward (run between its two steps) has returned."""
    yield from _around_forward(inner, next(inner), after)


def _with_after_forward(decision: Any, generator: Iterator[Any]) -> Iterator[Any]:
    after = after_forward_of(decision)
    return generator if after is None else then_after_forward(generator, after)


# --------------------------------------------------------------------------
# non-reentrant layouts


@dataclass(frozen=True)
class NonReentrantLayout:
    """One internal layout of the non-reentrant choke point."""

    name: str
    releases: str  # which torch releases have it (documentation)
    attribute: str  # the module global in torch.utils.checkpoint (and the composable API)
    #: ``mismatch(original)``: None if ``original`` has this layout, else why not
    mismatch: Callable[[Callable[..., Any]], Optional[str]]
    #: ``guard(original, decide)``: the replacement, same signature and protocol, asking
    #: ``decide`` (the ``_decide`` module, handed over by ``_patch``) what to run
    guard: Callable[[Callable[..., Any]], Callable[..., Any]]


def _fixed_positional(function: Callable[..., Any]) -> Optional[list]:
    """Names of the positional parameters before ``*args``; None without ``*args``."""
    names = []
    for param in inspect.signature(function).parameters.values():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            return names
        if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(param.name)
    return None


def _generator_mismatch(original: Callable[..., Any]) -> Optional[str]:
    names = _fixed_positional(original)
    if names is None:
        return "its signature has no *args"
    if names[:2] != ["fn", "preserve_rng_state"] or "context_fn" not in names:
        return f"its parameters before *args are {names}, not (fn, preserve_rng_state, context_fn, ...)"
    return None


def _guard_generator(original: Callable[..., Any], decide: Any) -> Callable[..., Any]:
    """torch 2.4–2.13: ``(fn, preserve_rng_state, context_fn, ..., *args, **kwargs)``."""
    names = _fixed_positional(original) or []
    n_options = len(names) - 1  # the options between fn and the inputs
    context_index = names.index("context_fn") - 1
    early_stop_index = names.index("early_stop") - 1 if "early_stop" in names else None  # torch 2.5+
    prepare, STEP_ASIDE, NO_CHECKPOINT, EarlyStopOff, RngWatch = (
        decide.prepare_call, decide.STEP_ASIDE, decide.NO_CHECKPOINT, decide.EarlyStopOff, decide.RngWatch
    )

    def _checkpoint_without_reentrant_generator(fn: Any, *args: Any, **kwargs: Any):
        # args: torch's options after fn (preserve_rng_state, context_fn, ...), then the inputs
        context_fn = args[context_index] if len(args) > context_index else None
        early_stop = args[early_stop_index] if early_stop_index is not None and len(args) > early_stop_index else True
        decision = prepare(False, fn, args, n_options, context_fn, args[0] if args else True, early_stop, kwargs)
        if decision is STEP_ASIDE:
            return original(fn, *args, **kwargs)
        if decision is NO_CHECKPOINT:
            return run_plainly(decide.forward_context_of(context_fn))
        if type(decision) is EarlyStopOff:
            return _with_after_forward(decision, without_early_stop(lambda: original(decision.function, *args, **kwargs)))
        if type(decision) is RngWatch:  # preserve_rng_state=False: watch the forward
            def start() -> Iterator[Any]:
                return original(decision.function, decision.preserve_rng_state, *args[1:], **kwargs)

            return _with_after_forward(decision, watch_forward_rng(
                without_early_stop(start) if decision.early_stop_off else start(), decision.drew
            ))
        if getattr(decision, "keep_inputs", False):  # fallback: the recompute starts from copies on write
            args = (*args[:n_options], *kept_inputs(args[n_options:]))
        generator = original(decision, *args, **kwargs)
        after = getattr(decision, "after_forward", None)  # the usual call: one look, no wrapper
        return generator if after is None else then_after_forward(generator, after)

    return _checkpoint_without_reentrant_generator


def _generator_impl_mismatch(original: Callable[..., Any]) -> Optional[str]:
    params = list(inspect.signature(original).parameters.values())
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keywords = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    if positional != ["fn", "args", "kwargs"]:
        return f"its positional parameters are {positional}, not (fn, args, kwargs)"
    if not {"preserve_rng_state", "context_fn"} <= keywords:
        return "it takes no keyword-only preserve_rng_state and context_fn"
    return None


def _guard_generator_impl(original: Callable[..., Any], decide: Any) -> Callable[..., Any]:
    """torch 2.14+: ``(fn, args, kwargs, *, preserve_rng_state, context_fn, ...)``."""
    prepare, STEP_ASIDE, NO_CHECKPOINT, EarlyStopOff, RngWatch = (
        decide.prepare_call, decide.STEP_ASIDE, decide.NO_CHECKPOINT, decide.EarlyStopOff, decide.RngWatch
    )

    def _checkpoint_without_reentrant_generator_impl(fn: Any, args: Any, kwargs: Any, **options: Any):
        context_fn = options.get("context_fn")
        decision = prepare(
            False, fn, args, 0, context_fn, options.get("preserve_rng_state", True), options.get("early_stop", True),
            kwargs,
        )
        if decision is STEP_ASIDE:
            return original(fn, args, kwargs, **options)
        if decision is NO_CHECKPOINT:
            return run_plainly(decide.forward_context_of(context_fn))
        if type(decision) is EarlyStopOff:
            return _with_after_forward(decision, without_early_stop(lambda: original(decision.function, args, kwargs, **options)))
        if type(decision) is RngWatch:  # preserve_rng_state=False: watch the forward
            options["preserve_rng_state"] = decision.preserve_rng_state

            def start() -> Iterator[Any]:
                return original(decision.function, args, kwargs, **options)

            return _with_after_forward(decision, watch_forward_rng(
                without_early_stop(start) if decision.early_stop_off else start(), decision.drew
            ))
        if getattr(decision, "keep_inputs", False):  # fallback: the recompute starts from copies on write
            args = kept_inputs(args)
        generator = original(decision, args, kwargs, **options)
        after = getattr(decision, "after_forward", None)  # the usual call: one look, no wrapper
        return generator if after is None else then_after_forward(generator, after)

    return _checkpoint_without_reentrant_generator_impl


def kept_inputs(inputs: Any) -> tuple:
    """The call's tensor inputs as torch's non-reentrant checkpoint saves them for its recompute, under
    strict and fallback: copies on write (``torch._lazy_clone``, connected to each input as the input is), so a
    write into an input after the forward read it (the block's own ``F.relu(h, inplace=True)``, the
    caller's ``h.add_(1)`` after the call) copies that input once and leaves the recompute what the
    forward read, where torch would raise that a saved tensor was modified in place.  The forward
    itself runs on the inputs as given (torch's ``checkpoint`` calls the block with its own)."""
    import torch
    from torch._C._functorch import is_functorch_wrapped_tensor
    from torch.utils._python_dispatch import _disable_current_modes

    lazy = getattr(torch, "_lazy_clone", None)
    if lazy is None:
        return tuple(inputs)
    kept = []
    for value in inputs:
        # a plain tensor (not a Parameter: an optimizer step before the backward is CKG108's; not a
        # torch.func wrapper: there the composable recompute keeps its own), copied where no mode of
        # the user's sees it (the copy is the guard's, not the program's)
        if type(value) is torch.Tensor and not is_functorch_wrapped_tensor(value):
            try:
                with torch._C.DisableTorchFunction(), _disable_current_modes():
                    with torch.set_grad_enabled(value.requires_grad):
                        value = lazy(value)
            except Exception:  # noqa: BLE001 - a tensor torch cannot clone so: saved as it is
                pass
        kept.append(value)
    return tuple(kept)



#: Newest first: a torch that has both names (2.14+ keeps the old one as a shim) uses the new one.
NON_REENTRANT_LAYOUTS: Tuple[NonReentrantLayout, ...] = (
    NonReentrantLayout(
        name="generator_impl",
        releases="torch 2.14+",
        attribute="_checkpoint_without_reentrant_generator_impl",
        mismatch=_generator_impl_mismatch,
        guard=_guard_generator_impl,
    ),
    NonReentrantLayout(
        name="generator_args_kwargs",
        releases="torch main after 2.15 (unreleased)",
        attribute="_checkpoint_without_reentrant_generator",
        mismatch=_generator_impl_mismatch,
        guard=_guard_generator_impl,
    ),
    NonReentrantLayout(
        name="generator",
        releases="torch 2.4–2.13",
        attribute="_checkpoint_without_reentrant_generator",
        mismatch=_generator_mismatch,
        guard=_guard_generator,
    ),
)


def find_non_reentrant(module: Any) -> Tuple[NonReentrantLayout, Callable[..., Any]]:
    """The layout ``torch.utils.checkpoint`` has, and torch's own choke point.

    Also right while the guard is installed (it sees through the guarded
    function).  Raises :class:`Unsupported` saying what was looked for and
    what was found.
    """
    found = []
    for layout in NON_REENTRANT_LAYOUTS:
        original = getattr(module, layout.attribute, None)
        original = getattr(original, "__ckpt_guard_original__", original)  # seen through an installed guard
        if original is None:
            found.append(f"no {layout.attribute} ({layout.releases})")
            continue
        if not inspect.isgeneratorfunction(original):
            found.append(f"{layout.attribute} is not a generator function ({layout.releases} layout expected one)")
            continue
        why = layout.mismatch(original)
        if why is None:
            return layout, original
        found.append(f"{layout.attribute}: {why}")
    raise Unsupported("; ".join(found))


# --------------------------------------------------------------------------
# the reentrant choke point


def find_reentrant(module: Any) -> Tuple[type, Callable[..., Any]]:
    """``(CheckpointFunction, raw)``, ``raw(cls, function, preserve_rng_state, *args)`` being torch's apply.

    Raises :class:`Unsupported` if ``apply`` is neither kind of classmethod.
    """
    function_class = getattr(module, "CheckpointFunction", None)
    if function_class is None:
        raise Unsupported("no CheckpointFunction")
    descriptor = inspect.getattr_static(function_class, "apply", None)
    if isinstance(descriptor, classmethod):  # torch <= 2.13: Function.apply in Python
        return function_class, descriptor.__func__
    if isinstance(descriptor, types.ClassMethodDescriptorType):  # torch 2.14+: in C, callable as (cls, *args)
        return function_class, descriptor
    raise Unsupported(
        f"CheckpointFunction.apply is a {type(descriptor).__name__}, neither a classmethod nor a "
        "classmethod_descriptor"
    )


def guard_backward(original: Callable[..., Any], reentrant_backward: Callable[[bool], Any]) -> staticmethod:
    """The staticmethod that shadows ``CheckpointFunction.backward``: it notes whether the engine
    runs it building a graph (grad mode on entry is ``create_graph``), for CKG114's recompute read."""
    from torch import is_grad_enabled

    def backward(ctx, *grad_outputs):
        with reentrant_backward(is_grad_enabled()):
            return original(ctx, *grad_outputs)

    backward.__ckpt_guard_original__ = original  # type: ignore[attr-defined]
    return staticmethod(backward)


def guard_apply(raw_apply: Callable[..., Any], decide: Any) -> classmethod:
    """The classmethod that shadows ``CheckpointFunction.apply``."""
    prepare, STEP_ASIDE, NO_CHECKPOINT, RngWatch = (
        decide.prepare_call, decide.STEP_ASIDE, decide.NO_CHECKPOINT, decide.RngWatch
    )
    NON_REENTRANT_INSTEAD = decide.NON_REENTRANT_INSTEAD
    rebuild_nested_output = decide.rebuild_nested_output
    RerunNonReentrant = decide.RerunNonReentrant

    def non_reentrant(function: Any, preserve_rng_state: bool, args: tuple) -> Any:
        import torch.utils.checkpoint as tuc

        return tuc.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)

    def apply(cls, function, preserve_rng_state, *args):
        decision = prepare(True, function, args, 0, None, preserve_rng_state)
        if type(decision) is RngWatch:  # preserve_rng_state=False: the forward runs through it
            try:
                outputs = raw_apply(cls, decision.function, decision.preserve_rng_state, *args)
            except RerunNonReentrant:  # CKG112 under fallback: the forward put a tensor in a cache
                return non_reentrant(function, decision.preserve_rng_state, args)
            after = after_forward_of(decision)
            if after is not None:
                after()
            return outputs
        if decision is STEP_ASIDE:
            return raw_apply(cls, function, preserve_rng_state, *args)
        if decision is NO_CHECKPOINT:
            return function(*args)
        if decision is NON_REENTRANT_INSTEAD:
            return non_reentrant(function, preserve_rng_state, args)
        try:
            outputs = raw_apply(cls, decision, preserve_rng_state, *args)
        except RerunNonReentrant:  # CKG112 under fallback: the forward put a tensor in a cache
            return non_reentrant(function, preserve_rng_state, args)
        after = after_forward_of(decision)
        if after is not None:  # the block's modules bound their own tensors in the forward: re-read
            after()
        nested = getattr(decision, "nested", None)
        if nested is not None and nested[0] is not None:  # CKG010 under fallback: its structure back
            return rebuild_nested_output(outputs, nested)
        return outputs

    apply.__ckpt_guard_original__ = raw_apply  # type: ignore[attr-defined]
    return classmethod(apply)


# --------------------------------------------------------------------------
# telling whether use_reentrant was passed


def default_warning_codes(module: Any) -> tuple:
    """Code objects of the functions that warn when ``use_reentrant`` was not passed."""
    return tuple(
        inspect.unwrap(getattr(module, name)).__code__  # checkpoint is wrapped by torch._disable_dynamo
        for name in _DEFAULT_WARNING_FUNCTIONS
        if callable(getattr(module, name, None))
    )


# --------------------------------------------------------------------------
# the output entry: where a checkpoint call's result can be replaced
#
# The choke points above decide, but neither can change what ``checkpoint``
# returns (the non-reentrant generator only brackets the forward, which
# ``checkpoint`` runs itself).  Running a block as the composable recompute
# (``_composable``) instead needs the call one level up, where the result is
# returned.  Patched only once a configuration that can fall back is in force.


@dataclass(frozen=True)
class OutputEntry:
    """Where to put ``entry(function, args, kwargs, options, original)`` in this torch's layout."""

    name: str
    releases: str
    #: ``attach(module, entry)``: patches it in; returns how to undo that
    attach: Callable[[Any, Callable[..., Any]], Callable[[], None]]


def _attach_checkpoint_impl(module: Any, entry: Callable[..., Any]) -> Callable[[], None]:
    """torch 2.14+: ``_checkpoint_impl(function, args, kwargs, *, use_reentrant, ...)``, a module global
    that ``checkpoint`` and its curried form call at call time."""
    original = module._checkpoint_impl

    def _checkpoint_impl(function: Any, args: Any, kwargs: Any, **options: Any) -> Any:
        return entry(function, args, kwargs, options, lambda: original(function, args, kwargs, **options))

    _checkpoint_impl.__ckpt_guard_original__ = original  # type: ignore[attr-defined]
    module._checkpoint_impl = _checkpoint_impl

    def restore() -> None:
        module._checkpoint_impl = original

    return restore


def _checkpoint_cell(module: Any) -> Any:
    """The closure cell of ``checkpoint``'s dynamo-disabling wrapper that holds the real function."""
    wrapper = module.checkpoint
    names = wrapper.__code__.co_freevars
    if "fn" not in names or not wrapper.__closure__:
        raise Unsupported("checkpoint is not wrapped by torch._disable_dynamo as expected")
    return wrapper.__closure__[names.index("fn")]


def _attach_checkpoint_cell(module: Any, entry: Callable[..., Any]) -> Callable[[], None]:
    """torch 2.4–2.13: the function inside ``checkpoint``'s ``torch._disable_dynamo`` wrapper
    (a closure cell), so the object dynamo recognises and names bound to it stay as they are."""
    cell = _checkpoint_cell(module)
    original = cell.cell_contents
    # checkpoint's own keywords; preserve_rng_state travels in **kwargs up to 2.13
    option_names = frozenset(
        p.name for p in inspect.signature(original).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    ) | {"preserve_rng_state"}

    @functools.wraps(original, updated=())  # not __dict__: it caches torch's dynamo-disabled original
    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        options = {k: kwargs.pop(k) for k in option_names & kwargs.keys()}
        return entry(function, args, kwargs, options, lambda: original(function, *args, **options, **kwargs))

    checkpoint.__ckpt_guard_original__ = original  # type: ignore[attr-defined]
    cell.cell_contents = checkpoint

    def restore() -> None:
        cell.cell_contents = original

    return restore


def find_output_entry(module: Any) -> OutputEntry:
    """This torch's output entry; :class:`Unsupported` if it has none the guard knows."""
    impl = getattr(module, "_checkpoint_impl", None)
    if callable(impl):
        params = list(inspect.signature(getattr(impl, "__ckpt_guard_original__", impl)).parameters)
        if params[:3] == ["function", "args", "kwargs"]:
            return OutputEntry("_checkpoint_impl", "torch 2.14+", _attach_checkpoint_impl)
    try:
        _checkpoint_cell(module)
    except (AttributeError, Unsupported) as exc:
        raise Unsupported(f"no _checkpoint_impl(function, args, kwargs, ...) and {exc}") from None
    return OutputEntry("checkpoint (inside torch._disable_dynamo)", "torch 2.4–2.13", _attach_checkpoint_cell)
