"""Reading torch's state: everything a checkpoint call and its recompute depend on.

Two kinds of reading happen here.

*Call time* (:func:`read_call_state`): the functorch interpreter stack, grad
mode, forward-mode AD, whether saved-tensor hooks are allowed, and whether the
inputs or the parameters inside the checkpointed function require grad.  The
rules in ``_rules.py`` are predicates over the resulting :class:`CallState`.
Reading all of it costs a few microseconds, so the patch points first ask
:func:`call_is_quiet`, a handful of ~50 ns queries that prove no call-time rule
can fire; only a non-quiet call pays for the full reading.

*Recompute time* (``_decide.capture``): a tuple with one value per drift rule,
read in the forward and again when the recompute starts.  A reader may carry
an ``active`` attribute, a builtin query that is falsy when its state is empty,
so the capture can skip the Python call on the usual quiet path.  torch's own
infrastructure modes (fake/functional/proxy tensors under ``torch.compile``,
selective checkpointing's caching modes, ``with torch.device(...)``) are not the
user's and are left out, so they can never cause a report.

Parameter swaps (``torch.func.functional_call``) and optimizer steps leave
no trace in torch's state: the hooks in ``_hooks`` report them here
(:func:`push_swap` / :func:`pop_swap` keep :data:`_active_swaps` current,
:func:`record_step` counts steps and logs which parameters each updated).
Dynamo skips this file; only ``_hooks`` runs inside code it compiles.

A drift reader may also carry a ``relevant(function, was, now)`` attribute:
asked only once its value changed, it says whether the change can reach the
checkpointed function (a swap of other modules, a step of another model's
optimizer cannot).
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch._C._functorch import (
    get_unwrapped,
    is_functorch_wrapped_tensor,
    peek_interpreter_stack,
)
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_len_function_stack = torch._C._len_torch_function_stack
saved_tensor_hooks_enabled: Callable[[], bool] = (
    torch._C._autograd._saved_tensors_hooks_is_enabled
)
is_grad_enabled = torch.is_grad_enabled
Tensor = torch.Tensor
Module = torch.nn.Module

# --------------------------------------------------------------------------
# functorch transforms

_TRANSFORM_NAMES = {"Grad": "grad", "Vmap": "vmap", "Jvp": "jvp", "Functionalize": "functionalize"}


def transform_stack() -> tuple[tuple[str, int], ...]:
    """The active torch.func transforms, outermost first: ``(("vmap", 1), ("grad", 2))``.

    vjp, jacrev and hessian run as ``grad``; jacfwd as ``jvp`` (+ ``vmap``).
    """
    if peek_interpreter_stack() is None:
        return ()
    return tuple(
        (_TRANSFORM_NAMES.get(i.key().name, i.key().name.lower()), i.level())
        for i in retrieve_all_functorch_interpreters()
    )


transform_stack.active = peek_interpreter_stack  # type: ignore[attr-defined]


def describe_transforms(stack: tuple[tuple[str, int], ...]) -> str:
    if not stack:
        return "none"
    return " > ".join(f"{name}(level {level})" for name, level in stack)


# --------------------------------------------------------------------------
# dispatch / function modes

# Modes that can never make a recompute wrong, matched by qualified class name
# through the MRO (so subclasses count and nothing heavy is imported):
INFRASTRUCTURE_MODES = frozenset(
    {
        # torch's own machinery: compile-time tracing, selective checkpointing,
        # `with torch.device(...)` (restored by torch itself), checkpoint(debug=True)
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "torch._subclasses.functional_tensor.FunctionalTensorMode",
        "torch.fx.experimental.proxy_tensor.ProxyTorchDispatchMode",
        "torch.fx.experimental.proxy_tensor.PreDispatchTorchFunctionMode",
        "torch.fx.experimental.proxy_tensor.ProxyFunctionMode",
        "torch.utils.checkpoint._CachingTorchDispatchMode",
        "torch.utils.checkpoint._CachedTorchDispatchMode",
        "torch.utils._device.DeviceContext",
        "torch._export.non_strict_utils._NonStrictTorchFunctionHandler",
        "torch.testing._internal.logging_tensor.LoggingTensorMode",
        # torch's observers: they count or check, never change a value
        "torch.utils.flop_counter._FlopCounterMode",
        "torch.utils.flop_counter.FlopCounterMode",  # torch 2.4: the counter is the dispatch mode itself
        "torch.distributed.tensor.debug._comm_mode.CommDebugMode",
        "torch.distributed._tools.mem_tracker.MemTracker",
        "torch.distributed._tools.memory_tracker.MemoryProfileDispatchMode",
        "torch._subclasses.schema_check_mode.SchemaCheckMode",
    }
)


@functools.lru_cache(maxsize=256)
def _is_infrastructure_class(cls: type) -> bool:
    return any(
        f"{klass.__module__}.{klass.__qualname__}" in INFRASTRUCTURE_MODES
        for klass in cls.__mro__
    )


def is_user_mode(mode: object) -> bool:
    return not _is_infrastructure_class(type(mode))


# Modes are compared by class: re-entering an equivalent mode object (a new
# instance of the same class) around .backward() or in context_fn is fine.
def user_dispatch_modes() -> tuple[type, ...]:
    if not _len_dispatch_stack():
        return ()
    return tuple(type(m) for m in _get_current_dispatch_mode_stack() if is_user_mode(m))


def user_function_modes() -> tuple[type, ...]:
    if not _len_function_stack():
        return ()
    return tuple(type(m) for m in _get_current_function_mode_stack() if is_user_mode(m))


user_dispatch_modes.active = _len_dispatch_stack  # type: ignore[attr-defined]
user_function_modes.active = _len_function_stack  # type: ignore[attr-defined]


def describe_modes(modes: tuple[type, ...]) -> str:
    return "[" + ", ".join(m.__name__ for m in modes) + "]"


# --------------------------------------------------------------------------
# parameter swaps (torch.func.functional_call)


class SwapToken:
    """One active ``_reparametrize_module`` swap; compared by identity."""

    __slots__ = ("module_name", "module", "keys")

    def __init__(self, module: object, parameters_and_buffers: object) -> None:
        self.module_name = type(module).__name__
        self.module = weakref.ref(module)
        self.keys = frozenset(parameters_and_buffers) if isinstance(parameters_and_buffers, dict) else None

    def __repr__(self) -> str:
        return f"functional_call({self.module_name})"


def _submodule_path(root: Module, target: Module) -> Optional[str]:
    for name, module in root.named_modules(remove_duplicate=False):
        if module is target:
            return name
    return None


def swap_touches(function: object, tokens: tuple[SwapToken, ...]) -> bool:
    """Whether any of these swaps replaces a tensor ``function`` may use.

    True when unsure (the function's modules cannot be seen).  Slow; only
    called once a swap difference has been seen.
    """
    modules = owning_modules(function)
    for token in tokens:
        root = token.module()
        if root is None or token.keys is None or not modules:
            return True
        for module in modules:
            path = _submodule_path(root, module)
            if path is None:
                if _submodule_path(module, root) is not None and token.keys:
                    return True  # the swapped module lives inside the function's module
                continue
            if path == "" and token.keys:
                return True
            if any(key.startswith(path + ".") for key in token.keys):
                return True
    return False


# Swaps are process-wide state (they rewrite module attributes in place), so a
# plain global list, changed only under the lock.
_active_swaps: list[SwapToken] = []
_swap_lock = threading.Lock()


def current_swaps() -> tuple[SwapToken, ...]:
    return tuple(_active_swaps)


# the capture's builtin "anything there?" query (see _decide._compile_capture)
current_swaps.active = _active_swaps.__len__  # type: ignore[attr-defined]


def _swaps_relevant(function: object, was: tuple, now: tuple) -> bool:
    return swap_touches(function, tuple(set(was) ^ set(now)))


current_swaps.relevant = _swaps_relevant  # type: ignore[attr-defined]


def _push_swap(token: SwapToken) -> None:
    with _swap_lock:
        _active_swaps.append(token)


def pop_swap(token: SwapToken) -> None:
    with _swap_lock:
        _active_swaps[:] = [t for t in _active_swaps if t is not token]


def push_swap(module: object, args: tuple, kwargs: dict) -> SwapToken:
    """A ``_reparametrize_module(module, ...)`` swap began (eager only: see ``_hooks``)."""
    token = SwapToken(module, args[0] if args else kwargs.get("parameters_and_buffers"))
    _push_swap(token)
    return token


def describe_swaps(swaps: tuple[SwapToken, ...]) -> str:
    return "functional_call active" if swaps else "no functional_call"


# --------------------------------------------------------------------------
# default dtype

default_dtype = torch.get_default_dtype


def describe_dtype(dtype: torch.dtype) -> str:
    return str(dtype)


# --------------------------------------------------------------------------
# optimizer steps: parameters updated in place between forward and recompute

_optimizer_steps = [0]
#: ``optimizer_steps()``: how many optimizer steps were taken, process-wide; a
#: builtin call, because the capture runs on every checkpoint call.
optimizer_steps = functools.partial(_optimizer_steps.__getitem__, 0)
# The latest steps, oldest first: (step number, ids of the parameters that
# step updated).  Ids are safe to compare: an entry is only consulted for
# parameters alive since before that step.
_step_log: collections.deque = collections.deque(maxlen=64)
_step_lock = threading.Lock()


def _parameters_stepped(optimizer: Any) -> frozenset:
    """Ids of the parameters an optimizer step just updated: those with a gradient.

    Every torch optimizer skips a parameter whose ``grad`` is None and updates
    (in place) every other one, fused or not, even with an all-zero gradient.
    """
    return frozenset(
        id(p)
        for group in optimizer.param_groups
        for p in group.get("params", ())
        if isinstance(p, Tensor) and p.grad is not None
    )


def record_step(optimizer: Any) -> None:
    """An optimizer step just updated its parameters (eager only: see ``_hooks.note_step``).

    Counts the step and logs what it updated: one pass over the optimizer's
    parameters per step (tens of µs for hundreds of tensors), nothing per
    checkpoint call beyond reading the count.  Never raises into the user's
    ``step()``: an optimizer this cannot read (a custom one with odd
    param_groups) is counted, with no parameters logged.
    """
    try:
        updated = _parameters_stepped(optimizer)
    except Exception:  # noqa: BLE001 - this must not break the user's step
        updated = frozenset()
    with _step_lock:
        _optimizer_steps[0] += 1
        _step_log.append((_optimizer_steps[0], updated))


_CALL_METHODS = frozenset({"forward", "__call__", "_call_impl", "_wrapped_call_impl"})


def parameters_used_by(function: object) -> tuple[list[Tensor], list[list[Tensor]]]:
    """``(surely, maybe)``: parameters ``function`` surely uses, and per module it may use in part.

    Surely: an ``nn.Module`` (or its ``forward``/``__call__``) is run whole, and
    a tensor captured by a closure or bound by a ``partial`` is used as is.
    Maybe: a module a closure captures or a ``partial`` binds, or whose other
    method is checkpointed (``checkpoint(self.generate, z)``), may be used only
    in part: a GAN's parent module holds both players.
    """
    surely: list[Tensor] = []
    maybe: list[list[Tensor]] = []
    todo: list[tuple[object, bool]] = [(function, True)]
    seen: set[int] = set()
    while todo:
        obj, whole = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Module):
            if whole:
                surely.extend(obj.parameters())
            else:
                maybe.append(list(obj.parameters()))
        elif isinstance(obj, Tensor):
            surely.append(obj)
        elif isinstance(obj, functools.partial):
            # the function runs as its own; a bound argument (a parent module,
            # as in partial(GAN.generate, gan)) may be used only in part
            todo.append((obj.func, whole))
            todo.extend((o, False) for o in (*obj.args, *obj.keywords.values()))
        elif type(obj) is _MethodType and isinstance(obj.__self__, Module):
            todo.append((obj.__self__, whole and obj.__func__.__name__ in _CALL_METHODS))
        elif obj is function and getattr(obj, "__closure__", None):
            for cell in obj.__closure__:  # type: ignore[union-attr]
                try:
                    value = cell.cell_contents
                except ValueError:  # empty cell
                    continue
                values = value if isinstance(value, (list, tuple)) else (value,)
                todo.extend((v, False) for v in values if isinstance(v, (Module, Tensor)))
    return surely, maybe


def _steps_relevant(function: object, was: int, now: int) -> bool:
    """Whether a step taken since the forward updated a parameter ``function`` uses.

    Never guesses: a module the function may use only in part counts only if
    the steps updated every one of its trainable parameters; parameters it
    cannot see at all (a module hidden in a dict) count as untouched.
    """
    with _step_lock:
        updated = frozenset().union(*(ids for number, ids in _step_log if was < number <= now))
    if not updated:
        return False
    surely, maybe = parameters_used_by(function)
    if any(id(p) in updated for p in surely):
        return True
    for params in maybe:
        trainable = [p for p in params if p.requires_grad]
        if trainable and all(id(p) in updated for p in trainable):
            return True
    return False


optimizer_steps.relevant = _steps_relevant  # type: ignore[attr-defined]


def describe_optimizer_steps(count: int) -> str:
    return f"after optimizer step {count}" if count else "before any optimizer step"


# --------------------------------------------------------------------------
# train / eval mode of the checkpointed module

_MethodType = type(Module().train)


def module_training(function: object) -> Optional[bool]:
    """``training`` of the module being checkpointed (itself, or behind a bound method).

    ``None`` for other functions: a closure's modules are not looked for on
    every call (that costs microseconds).
    """
    if isinstance(function, Module):
        return function.training
    if type(function) is _MethodType and isinstance(function.__self__, Module):
        return function.__self__.training
    return None


module_training.takes_function = True  # type: ignore[attr-defined]


def describe_training(training: Optional[bool]) -> str:
    return {True: "train mode", False: "eval mode", None: "not a module"}[training]


# --------------------------------------------------------------------------
# inputs and parameters


def requires_grad_anywhere(t: Tensor) -> bool:
    """``requires_grad`` seen through functorch wrappers (a vmapped tensor says False)."""
    while True:
        if t.requires_grad:
            return True
        if not is_functorch_wrapped_tensor(t):
            return False
        t = get_unwrapped(t)


def owning_modules(function: object) -> list[Module]:
    """The modules whose parameters ``function`` uses, as far as we can see.

    Covers an ``nn.Module``, a bound method of one, a ``functools.partial``
    holding either, and modules captured one closure level deep, alone or in
    a list or tuple (``checkpoint_sequential`` passes a closure over a list).
    """
    found: list[Module] = []
    todo = [function]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Module):
            found.append(obj)
        elif isinstance(obj, functools.partial):
            todo.append(obj.func)
            todo.extend(obj.args)
            todo.extend(obj.keywords.values())
        elif hasattr(obj, "__self__") and isinstance(obj.__self__, Module):
            found.append(obj.__self__)
        elif getattr(obj, "__closure__", None) and obj is function:
            for cell in obj.__closure__:  # type: ignore[union-attr]
                try:
                    value = cell.cell_contents
                except ValueError:  # empty cell
                    continue
                if isinstance(value, (list, tuple)):
                    todo.extend(v for v in value if isinstance(v, Module))
                else:
                    todo.append(value)
    return found


def _trained_params_of(function: object) -> Iterator[Tensor]:
    """Parameters ``function`` may train: of its modules in training mode, and captured tensors.

    A module in eval mode is being used for inference, so its parameters do
    not make a call-time rule (CKG003, CKG006) fire.
    """
    for module in owning_modules(function):
        if module.training:
            yield from module.parameters()
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, Tensor):
            yield value


def _is_dual(t: Tensor) -> bool:
    return forward_ad.unpack_dual(t).tangent is not None


@dataclass(frozen=True)
class CallState:
    """What the call-time rules look at.  Built only for non-quiet calls."""

    reentrant: bool
    transforms: tuple[tuple[str, int], ...]
    grad_enabled: bool
    forward_ad_active: bool
    # both only looked at outside torch.func transforms (CKG002 / CKG007 decide there)
    dual_args: bool  # a dual tensor among the tensor inputs
    dual_inputs: bool  # ... or among the parameters inside the function
    saved_tensor_hooks_enabled: bool
    inputs_require_grad: bool
    params_require_grad: bool

    @property
    def transform_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.transforms)


def read_call_state(reentrant: bool, function: object, args: tuple) -> CallState:
    tensors = [a for a in args if isinstance(a, Tensor)]
    params = list(_trained_params_of(function))
    transforms = transform_stack()
    forward_ad_active = forward_ad._current_level >= 0
    # unpack_dual has no batching rule: never ask a functorch-wrapped tensor
    look_for_duals = forward_ad_active and not transforms
    dual_args = look_for_duals and any(_is_dual(t) for t in tensors)
    return CallState(
        reentrant=reentrant,
        transforms=transforms,
        grad_enabled=is_grad_enabled(),
        forward_ad_active=forward_ad_active,
        dual_args=dual_args,
        dual_inputs=dual_args or (look_for_duals and any(_is_dual(p) for p in params)),
        saved_tensor_hooks_enabled=saved_tensor_hooks_enabled(),
        inputs_require_grad=any(requires_grad_anywhere(t) for t in tensors),
        params_require_grad=any(requires_grad_anywhere(p) for p in params),
    )


def call_is_quiet(reentrant: bool, inputs: tuple, grad_enabled: bool) -> bool:
    """True when no call-time rule can fire: the fast path of every call.

    A rule that reads new state must make this return False when that state is
    unusual.  Only builtin queries here; the non-reentrant variant never looks
    at the inputs.
    """
    if peek_interpreter_stack() is not None or forward_ad._current_level >= 0:
        return False
    if not reentrant:
        return not grad_enabled or saved_tensor_hooks_enabled()
    if grad_enabled:
        for a in inputs:
            if isinstance(a, Tensor) and a.requires_grad:
                return True
        return False  # CKG006 needs a look at the parameters
    return True
