"""ckpt_guard: activation checkpointing that refuses to silently compute wrong gradients.

Quick start::

    import ckpt_guard
    ckpt_guard.install()            # policy from CKPT_GUARD_POLICY, default "strict"

Policies: ``strict`` raises :class:`CheckpointCompositionError`, ``warn`` emits
:class:`CheckpointCompositionWarning` and does what torch would, ``fallback``
warns and runs the safest correct alternative, ``off`` does nothing.

Importing this package imports neither torch nor the guard's machinery: the
pytest plugin (a submodule, auto-loaded in every pytest session) runs this
file, so everything beyond the two exception classes is imported on first use.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Mapping, Optional, Union

from ._exceptions import CheckpointCompositionError, CheckpointCompositionWarning

if TYPE_CHECKING:  # pragma: no cover
    from . import checkpoint_policies
    from ._composable.saving import PolicyError
    from ._events import Event
    from ._rules import Rule

__all__ = [
    "CheckpointCompositionError",
    "CheckpointCompositionWarning",
    "Event",
    "PolicyError",
    "Rule",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_policies",
    "current_config",
    "install",
    "is_installed",
    "policy",
    "record",
    "replayable_mode",
    "rules",
    "saved_residuals",
    "uninstall",
]

__version__ = "0.1.0"

RulesArg = Optional[Union[Mapping[str, str], str]]


def install(policy: Optional[str] = None, *, rules: RulesArg = None) -> None:
    """Guard every checkpoint call in this process.

    ``policy``: ``"off"``, ``"warn"``, ``"fallback"`` or ``"strict"``; ``None``
    reads ``CKPT_GUARD_POLICY`` (default ``"strict"``).  ``rules``: per-rule
    overrides ``{"CKG003": "warn"}`` (or ``"CKG003=warn,..."``); ``None`` reads
    ``CKPT_GUARD_RULES``.  Calling it again replaces the configuration (a
    warning names both where they differ).  Works
    before ``import torch``: patching then happens once torch is imported.
    Raises ``ValueError`` for a bad configuration.
    """
    from . import _config, _patch

    config = _config.build_config(policy, rules, read_env=True)
    for warning in _config.install_warnings(config, policy, is_installed()):
        warnings.warn(warning, UserWarning, stacklevel=2)
    _patch.install(config)


def uninstall() -> None:
    """Put back everything ``install()`` replaced.  Safe to call twice, from any thread."""
    if f"{__name__}._patch" in sys.modules:  # else never imported: nothing was ever installed
        from . import _patch  # waits if another thread is still importing it (its first install())

        _patch.uninstall()


def is_installed() -> bool:
    if f"{__name__}._patch" not in sys.modules:
        return False
    from . import _patch  # waits if another thread is still importing it

    return _patch.is_installed()


@contextlib.contextmanager
def policy(policy: str, *, rules: RulesArg = None) -> Iterator[None]:
    """Use ``policy`` (and ``rules`` overrides) for checkpoint calls made in this block.

    The scope replaces the installed configuration entirely (installed
    per-rule overrides do not leak in) and is private to the current thread /
    asyncio task.  ``ckpt_guard.checkpoint`` calls follow it whether or not the
    guard is installed; torch's own checkpoint calls only while it is
    (``install()``): without it, ``current_config()`` names the scope's policy,
    but nothing intercepts torch's checkpoint.
    """
    from . import _config

    config = _config.build_config(policy, rules, read_env=False, source="scope")
    if config.may_fall_back and is_installed():
        from . import _patch

        _patch.enable_composable_fallback()
    _config.installs[0] += 1  # fallback's once-per-call-site warnings start afresh in a new scope
    token = _config.push_scope(config)
    try:
        yield
    finally:
        _config.pop_scope(token)


def checkpoint(
    function: Callable[..., Any], *args: Any, context_fn: Any = None, preserve_rng_state: bool = True, **kwargs: Any,
) -> Any:
    """Activation checkpointing for code written for ``torch.func``: ``checkpoint(function, *args, **kwargs)``.

    Outside torch.func transforms it is torch's own non-reentrant checkpoint.
    Under a transform (grad, vjp, jacrev, hessian, vmap, jvp, jacfwd) it is
    ckpt_guard's composable recompute: the block's activations are not kept,
    and torch.func transforms it correctly (every tensor the block reads that
    may need a gradient is passed to it explicitly, modules' parameters and
    buffers included).  Where neither is correct (the block captures a tensor
    that needs a gradient, a user mode is active, ...) the rule that explains
    why applies, under the policy in force (default ``strict``: it raises).
    ``context_fn`` and ``preserve_rng_state`` are torch's checkpoint options;
    so are the other keywords torch's checkpoint takes for itself on the
    installed release (``determinism_check``, ``debug``, ...): they go to
    torch's checkpoint where it runs, never to ``function``.
    ``use_reentrant=False`` is accepted (it is what this is); ``True`` is an error.

    ``respect_saved_tensors_hooks`` (torch >= 2.15, pytorch#190581): whether the
    tensors selective checkpointing (``context_fn``) saves go through the
    ``saved_tensors_hooks`` around the call (``save_on_cpu``), as every other
    saved tensor does.  Left out, ckpt_guard.checkpoint passes ``True``, the
    default torch has announced, so it never triggers torch's FutureWarning
    about the change; ``False`` keeps torch's old behaviour.  Before 2.15 those
    tensors always bypass the hooks: ``True`` is then an error.
    """
    use_reentrant = kwargs.pop("use_reentrant", None)
    if use_reentrant:
        raise ValueError(
            f"ckpt_guard.checkpoint(..., use_reentrant={use_reentrant!r}): it is torch's non-reentrant "
            "checkpoint (or a recompute that composes with torch.func); pass use_reentrant=False or "
            "leave it out, or call torch.utils.checkpoint.checkpoint for the reentrant variant"
        )
    import torch

    if torch.compiler.is_compiling():
        # traced by dynamo: torch's checkpoint (its own higher-order op), or, under a torch.func
        # transform running around the compiled code, the block plainly (_composable/compiled.py)
        from ._composable import compiled as _compiled

        return _compiled.traced_checkpoint(function, args, kwargs, context_fn, preserve_rng_state)
    from ._entry import saved_tensors_hooks_option

    kwargs.update(saved_tensors_hooks_option(kwargs.pop("respect_saved_tensors_hooks", None)))
    from . import _entry

    return _entry.public_checkpoint(function, args, kwargs, context_fn, preserve_rng_state)


def checkpoint_name(value: Any, name: str) -> Any:
    """Name a value inside a checkpointed block, for a policy that saves it by name; returns ``value``.

    JAX's ``checkpoint_name``: with ``context_fn=checkpoint_policies.context_fn(
    checkpoint_policies.save_only_these_names("attn_out"))`` the output of the
    operation that made ``value`` is kept by the forward instead of being
    recomputed (under torch.func transforms too).  Outside a checkpointed
    block's first forward it does nothing (under ``torch.compile`` too: torch's own
    checkpoint runs there, and a name is for ckpt_guard's recompute).
    """
    import torch

    if torch.compiler.is_compiling():
        return value
    from ._composable.saving import checkpoint_name as _name

    return _name(value, name)


def saved_residuals(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` once; print what each checkpointed block saved and recomputed.

    JAX's ``print_saved_residuals``, measured: per ``ckpt_guard.checkpoint``
    block call (under torch.func, or with a naming policy), the values its save
    policy kept (operation, shape, dtype, bytes, the line of your code), what
    each name did, and per recompute (one per order that differentiates it)
    what was handed back and what ran again.  Returns the report (its
    ``.blocks``, ``.saved_bytes`` and ``.result``, what ``function`` returned).
    """
    from ._composable.residuals import saved_residuals as _report

    return _report(function, *args, **kwargs)


def replayable_mode(cls: type) -> type:
    """Mark a ``TorchDispatchMode`` / ``TorchFunctionMode`` class as safe for fallback to re-enter in a recompute.

    Use as a class decorator.  It says: what this mode computes depends on
    nothing but its own instance attributes (numbers, flags, containers,
    tensors, its own ``torch.Generator``), not on a global, a class attribute
    or another object.  Under policy ``fallback`` a checkpointed block that
    runs under such modes is then checkpointed (its memory saving kept)
    instead of run plainly: the recompute runs under the forward's mode
    objects alone, with their attributes as the forward found them (pushed by
    the base class: the mode's own ``__enter__``/``__exit__`` do not run
    again), and their current state is put back after.  State the guard
    cannot record keeps the plain run (docs/limits.md lists it).  Subclasses
    are not marked.  Returns ``cls``; a non-mode class is a ``TypeError``.
    """
    from . import _state

    return _state.mark_replayable_mode(cls)


def rules() -> "tuple[Rule, ...]":
    """The rule table, in the order rules are evaluated."""
    from ._rules import RULES

    return RULES


def record() -> "contextlib.AbstractContextManager[List[Event]]":
    """``with ckpt_guard.record() as events:`` collects every decision the guard makes."""
    from ._events import record as _record

    return _record()


def current_config() -> str:
    """The configuration in force here, e.g. ``"strict (rules: CKG003=warn)"``."""
    from . import _config

    return _config.current().describe()


def __getattr__(name: str) -> Any:
    """``ckpt_guard.Event``, ``Rule``, ``PolicyError`` and ``checkpoint_policies``, imported on first use."""
    if name == "Event":
        from ._events import Event

        return Event
    if name == "Rule":
        from ._rules import Rule

        return Rule
    if name == "PolicyError":
        from ._composable.saving import PolicyError

        return PolicyError
    if name == "checkpoint_policies":  # a submodule: imported, not "from . import"ed (that asks here again)
        import importlib

        return importlib.import_module(f"{__name__}.checkpoint_policies")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    """The public names (with the lazy ``Event`` and ``Rule``), not this file's imports."""
    return sorted([*__all__, "__version__"])
