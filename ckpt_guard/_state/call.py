"""The call-time read: the :class:`CallState` the call rules in ``_rules.py`` are predicates over.

Owns: the functorch stack and grad mode at the call, forward-mode AD, whether saved
tensor hooks are allowed, whether inputs or parameters inside the block require grad,
the quiet-call test (:func:`call_is_quiet`, a handful of ~50 ns queries that prove no
call rule can fire), the device context, tensor versions and RNG states.  May not
touch: the recompute-time readers (their own modules).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch._C._functorch import peek_interpreter_stack
from torch.autograd import forward_ad
from torch.overrides import _get_current_function_mode_stack
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext, _device_constructors

from . import block_reads as _reads
from .basics import (
    Module, Tensor, _checkpoint, len_function_stack, _version_of, is_grad_enabled, requires_grad_anywhere,
    saved_tensor_hooks_enabled,
)
from .modes import _infrastructure_classes
from .modules import (
    block_module, _block_structure, _mode_dependent_classes, _snapshots, _structure, block_snapshot as _block_snapshot,
    root_hooks_run_inside,
)
from .transforms import transform_stack


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
    dual_args: bool  # a dual tensor among the tensor inputs (CKG004, CKG007)
    dual_held: bool  # ... among the tensors the function reads besides them (CKG008)
    saved_tensor_hooks_enabled: bool
    inputs_require_grad: bool
    params_require_grad: bool
    #: the block holds an nn.RReLU in training mode, and early stop is on (CKG009)
    rrelu_training: bool = False
    #: a module the call runs carries Opacus' grad-sample forward hook, in training mode (CKG011)
    grad_sample_hooks: bool = False

    @property
    def transform_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.transforms)


def rrelu_training(function: object, early_stop: bool = True) -> bool:
    """CKG009: a module the call runs holds an nn.RReLU in training mode, with early stop on.

    Only where the module is plain to see (the module, its bound method, a
    partial of either): this runs on every non-reentrant call, so it reads
    the block's cached structure (the RReLU modules found once).
    """
    function = block_module(function)
    if not isinstance(function, Module):
        return False
    rrelus = _structure(function).rrelus
    if not rrelus or not early_stop or _checkpoint.get("_enable_checkpoint_early_stop", True) is False:
        return False
    for ref in rrelus:
        m = ref()
        if m is not None and m.training:
            return True
    return False


def grad_sample_hooked(function: object, hooks: object = None) -> bool:
    """CKG011: a module the call runs carries Opacus' grad-sample forward hook, and it would take.

    Opacus' GradSampleModule registers its bound method ``capture_activations_hook``
    (beside ``capture_backprops_hook``) on every layer it computes per-sample
    gradients for; the hook takes nothing while its hooks are disabled, or for a
    layer in eval mode or without a trainable parameter of its own, and those are
    left out.  ``hooks``: the hook part of the call's block snapshot (taken anyway:
    the decision asks only when it holds one); read here if not given.  Only where
    the module is plain to see (the module, its bound method, a partial of either),
    as CKG009; the block's own hooks count only where they run inside the checkpoint
    (not for ``partial(forward, layer)``, as transformers 5 checkpoints a layer).
    """
    if hooks is None:
        hooks = _block_snapshot(function)[1]
    if not hooks:
        return False
    found = [i // 2 for i in range(1, len(hooks), 2) if any(map(_takes_grad_samples, hooks[i].values()))]
    if not found:
        return False
    block = block_module(function)
    if not isinstance(block, Module):
        return False
    modules = _structure(block).modules(block)
    inside = root_hooks_run_inside(function)
    for i in found:
        if i >= len(modules):
            return True  # a module the snapshot saw and this walk does not: as if it takes
        if i == 0 and not inside:
            continue
        module = modules[i]
        if module.training and any(p is not None and p.requires_grad for p in module._parameters.values()):
            return True
    return False


def _takes_grad_samples(hook: object) -> bool:
    """Opacus' ``capture_activations_hook``, bound to a GradSampleModule whose hooks are enabled."""
    if getattr(hook, "__name__", "") != "capture_activations_hook":
        return False
    owner = getattr(hook, "__self__", None)
    return hasattr(owner, "capture_backprops_hook") and getattr(owner, "hooks_enabled", True) is not False


def read_call_state(reentrant: bool, function: object, args: tuple, early_stop: bool = True) -> CallState:
    tensors = [a for a in args if issubclass(type(a), Tensor)]  # (its real type: a __class__ may raise)
    params = list(_reads.trainable_tensors(function))
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
        dual_held=look_for_duals and any(_is_dual(t) for t in _reads.held_tensors(function)),
        saved_tensor_hooks_enabled=saved_tensor_hooks_enabled(),
        inputs_require_grad=any(requires_grad_anywhere(t) for t in tensors),
        params_require_grad=any(requires_grad_anywhere(p) for p in params),
        rrelu_training=not reentrant and rrelu_training(function, early_stop),
        grad_sample_hooks=not reentrant and grad_sample_hooked(function),
    )


def forward_device_context() -> Optional[torch.device]:
    """The device of the innermost ``torch.device(...)`` / ``set_default_device`` context, or None."""
    if not len_function_stack():
        return None
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


def accelerator_default_device() -> Optional[torch.device]:
    """Where factory calls without a device go, if a device context sends them off the CPU."""
    device = forward_device_context()
    return None if device is None or device.type == "cpu" else device


class FactoryWatch(TorchFunctionMode):
    """Records in ``made[0]`` whether a tensor (not a 0-dim one) was made without ``device=`` (CKG109).

    Pushed over the reentrant forward only when a GPU default device is active:
    every torch call of that forward passes through it, which costs time there
    and nowhere else.
    """

    def __init__(self, made: list) -> None:
        super().__init__()
        self.made = made
        self.constructors = _device_constructors()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        # a 0-dim CPU tensor mixes with GPU tensors (torch.tensor(0.5) as a factor): not a problem;
        # nor is the empty dummy a nested checkpoint makes (torch < 2.12)
        if (
            func in self.constructors and kwargs.get("device") is None and isinstance(result, Tensor)
            and result.dim() and sys._getframe(1).f_globals.get("__name__") != "torch.utils.checkpoint"
        ):
            self.made[0] = True
        return result


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


def tensor_versions(function: object, inputs: tuple) -> tuple:
    """``((tensor, version), ...)`` for each tensor the block can update in place, as far as can be seen: its modules'
    parameters and buffers (whatever the path to them), the tensors it holds, its tensor inputs."""
    reads = _reads.reads_of(function).complete()
    tensors = [t for m in (*reads.whole, *reads.partial) for t in (*m.parameters(), *m.buffers())]
    tensors += [*reads.tensors, *(t for t in inputs if isinstance(t, Tensor))]
    return tuple((t, _version_of(t)) for t in tensors)


def updated_in_place(versions: tuple) -> bool:
    """Whether a tensor of :func:`tensor_versions` was updated in place since."""
    return any(_version_of(t) != version for t, version in versions)


def rng_states() -> tuple:
    """The CPU generator's state, and each CUDA device's once CUDA is in use (CKG107 compares them).

    Reading a CUDA generator's state reads its seed and offset on the host: no
    synchronisation.  Not while a CUDA graph is being captured (torch's own
    ``preserve_rng_state=False`` path reads nothing there either), and other
    accelerators' generators are not read.
    """
    cpu = torch.get_rng_state()
    if not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
        return (cpu,)
    return (cpu, *torch.cuda.get_rng_state_all())


def drew_random(before: tuple) -> bool:
    """Whether any generator read by :func:`rng_states` moved since ``before``."""
    now = rng_states()
    return len(now) != len(before) or not all(torch.equal(was, is_) for was, is_ in zip(before, now))


def clear_caches() -> None:
    """Forget what was learnt about classes (``uninstall()``: the guard holds nothing)."""
    _infrastructure_classes.clear()
    _block_structure.clear()
    _snapshots.clear()
    _mode_dependent_classes.clear()
    _reads.clear_caches()
