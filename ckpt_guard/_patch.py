"""Patch points: where every checkpoint call passes, and how they are swapped.

Every way into activation checkpointing ends in one of two internal choke
points of ``torch.utils.checkpoint``, both looked up *at call time* as module
globals:

* reentrant: ``CheckpointFunction.apply(function, preserve_rng_state, *args)``;
  we shadow the inherited classmethod on ``CheckpointFunction`` only;
* non-reentrant: ``_checkpoint_without_reentrant_generator(fn, ..., *args,
  **kwargs)``; we replace the module global (and the copy that
  ``torch.distributed._composable.checkpoint_activation`` imported).

So ``checkpoint``, ``checkpoint_sequential``, names bound before ``install()``
(``from torch.utils.checkpoint import checkpoint``, ``functools.partial``,
``checkpoint_wrapper``) and the composable ``checkpoint(module)`` are all
covered, while the public ``checkpoint`` function, which dynamo recognises by
identity, is never touched.

Smaller patches feed the messages and the drift rules:

* ``torch.utils.checkpoint.warnings`` becomes a proxy whose ``warn`` marks the
  calling ``checkpoint`` frame when torch warns that ``use_reentrant`` was not
  passed (so messages can say torch *defaulted* to the reentrant variant);
* the generator inside ``torch.nn.utils.stateless._reparametrize_module`` (the
  swap behind ``torch.func.functional_call``) is wrapped through the closure
  cell of its ``@contextmanager`` wrapper, so parameter swaps become visible
  while the function object dynamo recognises stays the same;
* global optimizer pre- and post-step hooks count optimizer steps and what
  they updated (CKG108).

And dynamo is told to skip the guard's files, as it skips torch's own
checkpoint internals.

``install()`` works before ``import torch``: a wrapt post-import hook on
``torch`` applies the patches once torch has finished importing.  Hooks cannot
be unregistered, so the hook checks whether the guard is still installed.
``uninstall()`` puts back every replaced object, identical by ``is``.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import sys
import threading
import warnings
from typing import Any, Callable, List

from . import _config

MIN_TORCH = (2, 4)

_lock = threading.RLock()
_installed = False
_hooks_registered: set = set()
# how to undo each patch currently applied, in the order applied
_applied: List[Callable[[], None]] = []


class _Missing(Exception):
    """A choke point is not where this torch version was expected to have it."""


def _warn_unguarded(what: str, why: str) -> None:
    warnings.warn(
        f"ckpt_guard: cannot patch {what} on torch {_torch_version()} ({why}); "
        f"calls through it stay unguarded. Everything else is guarded.",
        RuntimeWarning,
        stacklevel=3,
    )


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", "?")


def check_torch_version(version: str) -> None:
    """Raise one clear error for a torch older than the minimum we support."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return  # a dev build with an odd version string: try our best
    if (major, minor) < MIN_TORCH:
        raise RuntimeError(
            f"ckpt_guard: torch {version} (torch.__version__) is not supported; "
            f"ckpt_guard needs torch >= {'.'.join(map(str, MIN_TORCH))}. "
            "Upgrade torch, or do not install the guard."
        )


# --------------------------------------------------------------------------
# the guarded choke points


def _count_fixed_params(function: Callable[..., Any]) -> int:
    """How many positional parameters precede ``*args`` (6 on torch 2.13)."""
    params = inspect.signature(function).parameters.values()
    fixed = 0
    for param in params:
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            return fixed
        if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            fixed += 1
    raise _Missing("its signature has no *args")


def _no_checkpoint_generator():
    """Stands in for torch's generator when the fallback runs without checkpointing."""
    yield


def _watch_forward_rng(inner: Any, drew: list):
    """torch's generator, plus: did the forward (run between its two steps) draw random numbers?

    Same protocol as torch's: ``next`` before the forward, ``next`` after it
    (ending the generator), ``throw`` if the forward raised.
    """
    import torch

    value = next(inner)
    before = torch.get_rng_state()
    try:
        yield value
    except BaseException as exc:  # the forward raised: hand it to torch's generator as is
        try:
            value = inner.throw(exc)
        except StopIteration:
            return
        yield value
        return
    drew[0] = not torch.equal(before, torch.get_rng_state())
    yield from inner


def make_guarded_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    from . import _decide

    n_fixed = _count_fixed_params(original)
    names = list(inspect.signature(original).parameters)[:n_fixed]
    context_index = names.index("context_fn") if "context_fn" in names else None
    prepare, STEP_ASIDE, NO_CHECKPOINT = _decide.prepare_call, _decide.STEP_ASIDE, _decide.NO_CHECKPOINT
    RngWatch = _decide.RngWatch

    def _checkpoint_without_reentrant_generator(fn: Any, *args: Any, **kwargs: Any):
        # args: torch's parameters after fn (preserve_rng_state, context_fn, ...), then the inputs
        context_fn = args[context_index - 1] if context_index is not None and len(args) >= context_index else None
        preserve = args[0] if args else True
        decision = prepare(False, fn, args, n_fixed - 1, context_fn, preserve)
        if decision is STEP_ASIDE:
            return original(fn, *args, **kwargs)
        if decision is NO_CHECKPOINT:
            return _no_checkpoint_generator()
        if type(decision) is RngWatch:  # preserve_rng_state=False: watch the forward
            inner = original(decision.function, decision.preserve_rng_state, *args[1:], **kwargs)
            return _watch_forward_rng(inner, decision.drew)
        return original(decision, *args, **kwargs)

    _checkpoint_without_reentrant_generator.__ckpt_guard_original__ = original  # type: ignore[attr-defined]
    return _checkpoint_without_reentrant_generator


def make_guarded_apply(raw_apply: Callable[..., Any]) -> classmethod:
    from . import _decide

    prepare, STEP_ASIDE, NO_CHECKPOINT = _decide.prepare_call, _decide.STEP_ASIDE, _decide.NO_CHECKPOINT
    NON_REENTRANT_INSTEAD = _decide.NON_REENTRANT_INSTEAD

    RngWatch = _decide.RngWatch

    def apply(cls, function, preserve_rng_state, *args):
        decision = prepare(True, function, args, 0, None, preserve_rng_state)
        if type(decision) is RngWatch:  # preserve_rng_state=False: the forward runs through it
            return raw_apply(cls, decision.function, decision.preserve_rng_state, *args)
        if decision is STEP_ASIDE:
            return raw_apply(cls, function, preserve_rng_state, *args)
        if decision is NO_CHECKPOINT:
            return function(*args)
        if decision is NON_REENTRANT_INSTEAD:
            import torch.utils.checkpoint as tuc

            return tuc.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)
        return raw_apply(cls, decision, preserve_rng_state, *args)

    apply.__ckpt_guard_original__ = raw_apply  # type: ignore[attr-defined]
    return classmethod(apply)


class _WarningsProxy:
    """Stands in for ``warnings`` inside ``torch.utils.checkpoint``.

    When torch warns that ``use_reentrant`` was not passed, mark the warning
    frame (``checkpoint`` or ``checkpoint_sequential``) so a later message can
    say torch defaulted to the reentrant variant.  The mark lives in the
    frame's locals and dies with the frame; nothing else changes.
    """

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def warn(self, message: Any, category: Any = None, stacklevel: int = 1, source: Any = None, **kwargs: Any) -> None:
        if isinstance(message, str) and "use_reentrant parameter should be passed explicitly" in message:
            from ._decide import DEFAULTED_MARK

            sys._getframe(1).f_locals[DEFAULTED_MARK] = True
        self._real.warn(message, category, stacklevel + 1, source, **kwargs)


# --------------------------------------------------------------------------
# applying and undoing


def _set_attr(obj: Any, name: str, value: Any) -> None:
    """Replace ``obj.name`` and remember how to put the original back."""
    had = name in vars(obj)
    original = vars(obj).get(name)
    setattr(obj, name, value)

    def restore() -> None:
        if had:
            setattr(obj, name, original)
        else:
            delattr(obj, name)

    _applied.append(restore)


def _patch_checkpoint_module() -> None:
    import torch.utils.checkpoint as tuc

    original_generator = getattr(tuc, "_checkpoint_without_reentrant_generator", None)
    if original_generator is None or not inspect.isgeneratorfunction(original_generator):
        _warn_unguarded(
            "torch.utils.checkpoint._checkpoint_without_reentrant_generator",
            "not found" if original_generator is None else "not a generator function",
        )
    else:
        try:
            guarded = make_guarded_generator(original_generator)
        except _Missing as exc:
            _warn_unguarded("torch.utils.checkpoint._checkpoint_without_reentrant_generator", str(exc))
        else:
            _set_attr(tuc, "_checkpoint_without_reentrant_generator", guarded)
            composable = sys.modules.get(_COMPOSABLE)
            if composable is not None and getattr(
                composable, "_checkpoint_without_reentrant_generator", None
            ) is original_generator:
                _set_attr(composable, "_checkpoint_without_reentrant_generator", guarded)
            else:
                # Imported later, it copies the guarded generator from
                # torch.utils.checkpoint: put torch's back there on uninstall.
                _applied.append(lambda: _restore_late_copy(guarded, original_generator))

    function_class = getattr(tuc, "CheckpointFunction", None)
    apply_descriptor = inspect.getattr_static(function_class, "apply", None) if function_class else None
    if not isinstance(apply_descriptor, classmethod):
        _warn_unguarded(
            "torch.utils.checkpoint.CheckpointFunction.apply",
            "CheckpointFunction not found" if function_class is None else "apply is not a classmethod",
        )
    else:
        _set_attr(function_class, "apply", make_guarded_apply(apply_descriptor.__func__))

    if getattr(tuc, "warnings", None) is warnings:
        _set_attr(tuc, "warnings", _WarningsProxy(warnings))


_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


def _restore_late_copy(guarded: Any, original: Any) -> None:
    composable = sys.modules.get(_COMPOSABLE)
    if composable is not None and getattr(composable, "_checkpoint_without_reentrant_generator", None) is guarded:
        composable._checkpoint_without_reentrant_generator = original


def _patch_reparametrize() -> None:
    from . import _state

    try:
        import torch.nn.utils.stateless as stateless

        cell = stateless._reparametrize_module.__closure__[0]  # type: ignore[index]
        original = cell.cell_contents
        if not inspect.isgeneratorfunction(original):
            raise TypeError("its @contextmanager closure does not hold a generator function")
    except (ImportError, AttributeError, TypeError, IndexError, ValueError) as exc:
        _warn_unguarded("torch.nn.utils.stateless._reparametrize_module", str(exc))
        return
    cell.cell_contents = _state.make_tracked_reparametrize(original)

    def restore() -> None:
        cell.cell_contents = original

    _applied.append(restore)


def _watch_optimizer_steps() -> None:
    """Global optimizer step hooks count steps, and what they updated, for CKG108."""
    from . import _state

    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    except ImportError as exc:
        _warn_unguarded("torch.optim.optimizer's global step hooks", str(exc))
        return
    for handle in (
        register_optimizer_step_pre_hook(_state.note_step_start),
        register_optimizer_step_post_hook(_state.note_step_end),
    ):
        _applied.append(handle.remove)


# The guard's code that runs inside a checkpoint call.  Dynamo must never
# trace it, just as it never traces torch's own checkpoint internals.  Not
# _state.py: its functional_call and optimizer-step hooks run inside code
# dynamo traces, so they are written to be traced (see is_compiling there).
# Paths as dynamo compares them: POSIX-style, also on Windows.
_DYNAMO_SKIPPED_FILES = tuple(
    pathlib.Path(os.path.abspath(__file__)).with_name(name).as_posix()
    for name in ("_patch.py", "_decide.py", "_config.py", "_events.py")
)
_TRACE_RULES = "torch._dynamo.trace_rules"


def _skip_in_dynamo(trace_rules: Any = None) -> None:
    """Have dynamo skip the guard's files, as it skips torch's checkpoint generator.

    Without this, dynamo inlines our patched generator where it reaches it
    (the composable ``checkpoint(module)`` hooks under ``torch.compile``) and
    fails on, or graph-breaks at, our bookkeeping instead of at torch's
    generator: a different error, or a different graph, than without the
    guard.  Runs now if dynamo is loaded, else when it is (importing it here
    would cost a second).  ``FORCE_SKIP_FILES`` is private: if it is missing,
    say so once and carry on.
    """
    with _lock:
        if not _installed:
            return
        trace_rules = trace_rules or sys.modules.get(_TRACE_RULES)
        if trace_rules is None:
            _register_hook(_skip_in_dynamo, _TRACE_RULES)
            return
        skipped = getattr(trace_rules, "FORCE_SKIP_FILES", None)
        if not isinstance(skipped, set):
            warnings.warn(
                f"ckpt_guard: torch._dynamo.trace_rules.FORCE_SKIP_FILES not found on torch "
                f"{_torch_version()}; under torch.compile, dynamo may trace into the guard's code "
                f"where it would stop at torch's checkpoint generator. Everything else is guarded.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        added = [name for name in _DYNAMO_SKIPPED_FILES if name not in skipped]
        skipped.update(added)
        _applied.append(lambda: skipped.difference_update(added))


def _apply_patches() -> None:
    """Patch torch (which must be fully imported); idempotent."""
    with _lock:
        if not _installed or _applied:
            return
        import torch

        check_torch_version(torch.__version__)
        _patch_checkpoint_module()
        _patch_reparametrize()
        _watch_optimizer_steps()
        _skip_in_dynamo()


def _on_torch_imported(module: Any) -> None:
    """wrapt post-import hook: patch once torch is importable (never raise into an import)."""
    try:
        _apply_patches()
    except RuntimeError as exc:
        warnings.warn(f"{exc} The guard stays inactive.", RuntimeWarning, stacklevel=2)


def _register_hook(hook: Callable[[Any], None], module_name: str) -> None:
    """wrapt post-import hook, once per module name (hooks cannot be unregistered)."""
    if module_name in _hooks_registered:
        return
    import wrapt

    wrapt.register_post_import_hook(hook, module_name)
    _hooks_registered.add(module_name)


def install(config: _config.Config) -> None:
    global _installed
    with _lock:
        _config.set_installed(config)
        if _installed:
            return
        if "torch" in sys.modules and getattr(sys.modules["torch"], "__version__", None):
            # torch is (fully) imported: patch now, and let a bad version raise here.
            _installed = True
            try:
                _apply_patches()
            except BaseException:
                _installed = False
                _undo()
                raise
            return
        _installed = True
        _register_hook(_on_torch_imported, "torch")


def _undo() -> None:
    while _applied:
        _applied.pop()()


def uninstall() -> None:
    global _installed
    with _lock:
        _installed = False
        _undo()
        _config.set_installed(_config.Config("off"))


def is_installed() -> bool:
    return _installed
