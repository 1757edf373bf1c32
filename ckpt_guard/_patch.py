"""Patch points: swapping the guard into torch, and putting torch back.

Where every checkpoint call passes differs between torch releases; which
attribute to replace, and with what, is ``_layouts``' business.  This module
applies what ``_layouts`` finds, says truthfully what it could not patch, and
undoes everything on ``uninstall()``:

* the non-reentrant choke point, in ``torch.utils.checkpoint`` and in the copy
  that ``torch.distributed._composable.checkpoint_activation`` imported (also
  when that module is imported after ``install()``);
* a classmethod shadowing ``CheckpointFunction.apply`` (the reentrant one), and a
  staticmethod shadowing its ``backward``, which notes whether the engine runs it
  building a graph (CKG114).

So ``checkpoint``, its curried form, ``checkpoint_sequential``, names bound
before ``install()`` (``from torch.utils.checkpoint import checkpoint``,
``functools.partial``, ``checkpoint_wrapper``) and the composable
``checkpoint(module)`` are all covered, while the public ``checkpoint``
function, which dynamo recognises by identity, is never touched.

If a choke point cannot be found, a ``RuntimeWarning`` names the entry points
that stay unguarded.  If neither can, ``install()`` under a policy that
includes ``strict`` raises :class:`UnsupportedTorchError`; otherwise it warns
once.  :func:`interception` reports the state for the matrix's first line.

Smaller patches feed the messages and the drift rules:

* ``torch.utils.checkpoint.warnings`` becomes a proxy whose ``warn`` marks the
  calling frame when torch warns that ``use_reentrant`` was not passed (so
  messages can say torch *defaulted* to the reentrant variant);
* the generator inside ``torch.nn.utils.stateless._reparametrize_module`` (the
  swap behind ``torch.func.functional_call``) is wrapped through the closure
  cell of its ``@contextmanager`` wrapper, so parameter swaps become visible
  while the function object dynamo recognises stays the same;
* the generator inside ``torch.autograd.graph.disable_saved_tensors_hooks``
  (torch.func's grad transforms enter it) is wrapped the same way, so that
  torch's refusal of offload hooks at a transform's entry is decided by CKG012;
* ``Optimizer._optimizer_step_code`` (empty, called after every step) counts
  optimizer steps and what they updated (CKG108);
* transformers' checkpointing glue (``_huggingface``): its input-require-grads
  hook made a no-op where torch.func refuses it, and a word where a layer with
  checkpointing enabled runs in ``eval()`` and checkpoints nothing.

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
import sys
import threading
import warnings
from typing import Any, Callable, List

from . import _config, _files, _layouts, _versions

MIN_TORCH = _versions.MIN_TORCH

_lock = threading.RLock()
_installed = False
_hooks_registered: set = set()
# how to undo each patch currently applied, in the order applied
_applied: List[Callable[[], None]] = []
# what the last patching found: one line per choke point (see interception())
_interception: List[str] = []
_unguarded: List[str] = []
_unguarded_entry_points: List[str] = []
# whether the output entry (for the composable recompute) is patched in
_output_entry: List[str] = []


class UnsupportedTorchError(RuntimeError):
    """This torch is too old, or its checkpoint has no choke point the guard knows."""


def _outside_the_guard() -> int:
    """The ``stacklevel`` that attributes a warning to the first frame outside this package."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def _warn_unguarded(what: str, why: str, entry_points: str = "") -> None:
    stays = f"these stay unguarded: {entry_points}" if entry_points else "calls through it stay unguarded"
    warnings.warn(
        f"ckpt_guard: cannot patch {what} on torch {_torch_version()} ({why}); {stays}. "
        "Everything else is guarded.",
        RuntimeWarning,
        stacklevel=_outside_the_guard(),
    )


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", "?")


def check_torch_version(version: str) -> None:
    """Raise one clear error for a torch older than the minimum we support."""
    parsed = _versions.parse(version)
    if parsed is not None and parsed < MIN_TORCH:
        raise UnsupportedTorchError(
            f"ckpt_guard: torch {version} (torch.__version__) is not supported; "
            f"ckpt_guard needs torch >= {'.'.join(map(str, MIN_TORCH))}. "
            "Upgrade torch, or do not install the guard."
        )


def interception() -> str:
    """One line: whether checkpoint calls reach the guard on this torch, and if not, why."""
    with _lock:
        if not _installed:
            return "not installed"
        if not _interception and not _unguarded:
            return "installed; torch not imported yet"
        if not _unguarded:
            return "working: " + "; ".join(_interception)
        if not _interception:
            return "NOT WORKING, nothing is guarded: " + "; ".join(_unguarded)
        return "PARTIAL: " + "; ".join(_interception) + "; NOT guarded: " + "; ".join(_unguarded)


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
            from ._messages import DEFAULTED_MARK

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


_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


def _patch_non_reentrant(tuc: Any) -> None:
    try:
        layout, original = _layouts.find_non_reentrant(tuc)
    except _layouts.Unsupported as exc:
        _unguarded.append(f"non-reentrant checkpoint: {exc}")
        _unguarded_entry_points.append(_layouts.NON_REENTRANT_ENTRY_POINTS)
        return
    from . import _decide

    guarded = layout.guard(original, _decide)
    guarded.__ckpt_guard_original__ = original  # type: ignore[attr-defined]
    _set_attr(tuc, layout.attribute, guarded)
    composable = sys.modules.get(_COMPOSABLE)
    if composable is not None and getattr(composable, layout.attribute, None) is original:
        _set_attr(composable, layout.attribute, guarded)
    else:
        # Imported later, it copies the guarded function from
        # torch.utils.checkpoint: put torch's back there on uninstall.
        _applied.append(lambda: _restore_late_copy(layout.attribute, guarded, original))
    _interception.append(f"non-reentrant via {layout.attribute} ({layout.releases} layout)")


def _patch_reentrant(tuc: Any) -> None:
    try:
        function_class, raw_apply = _layouts.find_reentrant(tuc)
    except _layouts.Unsupported as exc:
        _unguarded.append(f"reentrant checkpoint: {exc}")
        _unguarded_entry_points.append(_layouts.REENTRANT_ENTRY_POINTS)
        return
    from . import _decide

    _set_attr(function_class, "apply", _layouts.guard_apply(raw_apply, _decide))
    backward = inspect.getattr_static(function_class, "backward", None)
    if isinstance(backward, staticmethod):  # CKG114 reads how the engine runs it
        from . import _state

        _set_attr(function_class, "backward", _layouts.guard_backward(backward.__func__, _state.reentrant_backward))
    else:
        _unguarded.append(f"CheckpointFunction.backward is a {type(backward).__name__}, not a staticmethod")
        _unguarded_entry_points.append("a reentrant checkpoint under .backward(create_graph=True) (CKG114)")
    _interception.append("reentrant via CheckpointFunction.apply")


def _patch_checkpoint_module() -> None:
    import torch.utils.checkpoint as tuc

    _patch_non_reentrant(tuc)
    _patch_reentrant(tuc)
    if not _interception:
        return  # nothing to guard: the caller refuses or warns
    if _unguarded:
        _warn_unguarded(
            "part of torch.utils.checkpoint", "; ".join(_unguarded), "; ".join(_unguarded_entry_points)
        )
    if getattr(tuc, "warnings", None) is warnings:
        _set_attr(tuc, "warnings", _WarningsProxy(warnings))


def _restore_late_copy(attribute: str, guarded: Any, original: Any) -> None:
    composable = sys.modules.get(_COMPOSABLE)
    if composable is not None and getattr(composable, attribute, None) is guarded:
        setattr(composable, attribute, original)


def _generator_cell(context_manager: Any) -> Any:
    """The closure cell of a ``@contextmanager`` function that holds its generator function.

    Swapping what the cell holds changes what the context manager runs while the
    function object (which dynamo recognises by identity) stays torch's.
    """
    closure = getattr(context_manager, "__closure__", None)
    if not closure:
        raise TypeError("it is not a @contextmanager")
    cell = closure[0]
    if not inspect.isgeneratorfunction(cell.cell_contents):
        raise TypeError("its @contextmanager closure does not hold a generator function")
    return cell


def _swap_generator(cell: Any, wrap: Callable[[Any], Any]) -> None:
    original = cell.cell_contents
    cell.cell_contents = wrap(original)

    def restore() -> None:
        cell.cell_contents = original

    _applied.append(restore)


def _patch_reparametrize() -> None:
    """Make ``functional_call``'s parameter swaps visible (CKG101).

    torch 2.5–2.6: ``_reparametrize_module`` returns a ``_ReparametrizeModule``
    instance, whose ``__enter__`` / ``__exit__`` are wrapped.  Other releases:
    it is a ``@contextmanager`` whose generator is swapped in its closure cell.
    """
    from . import _hooks

    what = "torch.nn.utils.stateless._reparametrize_module"
    try:
        import torch.nn.utils.stateless as stateless

        swap_class = getattr(stateless, "_ReparametrizeModule", None)
        if isinstance(swap_class, type):
            enter, exit_ = _hooks.make_tracked_swap_methods(swap_class)
            _set_attr(swap_class, "__enter__", enter)
            _set_attr(swap_class, "__exit__", exit_)
            return
        cell = _generator_cell(stateless._reparametrize_module)
    except (ImportError, AttributeError, TypeError, IndexError, ValueError) as exc:
        _warn_unguarded(what, str(exc), "functional_call parameter swaps (CKG101)")
        return
    _swap_generator(cell, _hooks.make_tracked_reparametrize)


def _watch_transform_entry() -> None:
    """Make torch.func's refusal of offload hooks at a transform's entry the guard's to decide (CKG012).

    ``torch.autograd.graph.disable_saved_tensors_hooks`` is a ``@contextmanager``
    whose generator is swapped in its closure cell: the function functorch's
    decorator calls (and dynamo recognises) stays torch's.
    """
    from . import _hooks

    what = "torch.autograd.graph.disable_saved_tensors_hooks"
    try:
        import torch.autograd.graph as graph

        cell = _generator_cell(graph.disable_saved_tensors_hooks)
    except (ImportError, AttributeError, TypeError, IndexError, ValueError) as exc:
        _warn_unguarded(what, str(exc), "activation offload around a torch.func transform (CKG012)")
        return
    _swap_generator(cell, _hooks.make_watched_hooks_disable)


def _watch_optimizer_steps() -> None:
    """Count optimizer steps, and what they updated, for CKG108.

    Through ``Optimizer._optimizer_step_code``, an empty method every step
    calls after updating (global step hooks would change what dynamo compiles
    of a ``step()`` on Python 3.13).
    """
    from . import _hooks

    try:
        from torch.optim import Optimizer

        if not callable(getattr(Optimizer, "_optimizer_step_code", None)):
            raise AttributeError("torch.optim.Optimizer has no _optimizer_step_code")
    except (ImportError, AttributeError) as exc:
        _warn_unguarded("the optimizer step count (CKG108)", str(exc))
        return
    _set_attr(Optimizer, "_optimizer_step_code", _hooks.note_step)


_DYNAMO_SKIPPED_FILES = _files.DYNAMO_SKIPPED  # the guard's code dynamo must never trace (see _files)
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


def _patch_huggingface(module: Any = None) -> None:
    """transformers' checkpointing glue (``_huggingface``): now where imported, else when it is."""
    with _lock:
        if not _installed:
            return
        from . import _huggingface

        for name, patch in ((_huggingface.MODELING_UTILS, _huggingface.patch_modeling_utils),
                            (_huggingface.MODELING_LAYERS, _huggingface.patch_modeling_layers)):
            loaded = sys.modules.get(name)
            if loaded is not None:  # idempotent; a module still importing lacks the class and waits for its hook
                patch(loaded, _set_attr)
        for name in (_huggingface.MODELING_UTILS, _huggingface.MODELING_LAYERS):
            _register_hook(_patch_huggingface, name)


def _apply_patches() -> None:
    """Patch torch (which must be fully imported); idempotent.

    Raises :class:`UnsupportedTorchError` when torch is too old, or when no
    choke point can be patched and the policy includes ``strict`` (then
    nothing stays patched).
    """
    with _lock:
        if not _installed or _applied:
            return
        import torch

        check_torch_version(torch.__version__)
        del _interception[:], _unguarded[:], _unguarded_entry_points[:]
        _patch_checkpoint_module()
        if not _interception:
            _refuse_or_warn_unsupported()
            return
        _patch_reparametrize()
        _watch_transform_entry()
        _watch_optimizer_steps()
        _patch_huggingface()
        _skip_in_dynamo()
        if _config.installed().may_fall_back:
            enable_composable_fallback()


def _refuse_or_warn_unsupported() -> None:
    """No choke point was found: nothing at all would be guarded."""
    message = (
        f"ckpt_guard: torch {_torch_version()} has no checkpoint choke point ckpt_guard knows, so "
        f"no checkpoint call would be guarded ({'; '.join(_unguarded)}). ckpt_guard "
        f"supports torch >= {'.'.join(map(str, MIN_TORCH))} (tested up to {_versions.NEWEST_TESTED}): "
        "install a tested torch, or a newer ckpt_guard; 'python -m ckpt_guard' shows what this "
        "torch does without the guard."
    )
    config = _config.installed()
    if "strict" in (config.policy, *config.overrides.values()):
        _undo()
        raise UnsupportedTorchError(message + " (Raised because the policy is strict.)")
    warnings.warn(message, RuntimeWarning, stacklevel=_outside_the_guard())


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

    _hooks_registered.add(module_name)  # first: wrapt calls a hook at once where the module is imported
    wrapt.register_post_import_hook(hook, module_name)


def enable_composable_fallback() -> None:
    """Patch in the output entry, so fallback can run blocks as the composable recompute.

    Only once a configuration that can fall back is in force (``install``, a
    ``policy()`` scope): the entry adds a Python call to every checkpoint
    call, which strict and warn do not need.  Stays until ``uninstall()``.
    Without it (a torch layout the guard does not know), fallback runs such
    blocks without checkpointing, as before.
    """
    with _lock:
        if not _installed or _output_entry or "torch.utils.checkpoint" not in sys.modules:
            return
        import torch.utils.checkpoint as tuc

        from . import _decide

        try:
            entry = _layouts.find_output_entry(tuc)
        except _layouts.Unsupported:
            return
        _applied.append(entry.attach(tuc, _decide.checkpoint_entry))
        _applied.append(_output_entry.clear)
        _output_entry.append(f"{entry.name} ({entry.releases} layout)")


def install(config: _config.Config) -> None:
    global _installed
    with _lock:
        _config.set_installed(config)
        if _installed:
            if config.may_fall_back and _applied:
                enable_composable_fallback()
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
        _config.set_installed(_config.Config("off", source="default"))
        decide = sys.modules.get(f"{__package__}._decide")
        if decide is not None:  # what the guard learnt while installed: nothing may outlive it
            decide.clear_caches()


def is_installed() -> bool:
    return _installed
