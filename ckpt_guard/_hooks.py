"""The guard's hooks inside torch code that ``torch.compile`` traces.

Every other file of the guard is skipped by dynamo (``_patch`` tells it so),
as torch's own checkpoint internals are.  These run inside code dynamo
compiles, so they are written to be traced:

* :func:`make_tracked_reparametrize` wraps the generator behind
  ``torch.func.functional_call``'s parameter swap
  (``torch.nn.utils.stateless._reparametrize_module``), or, on torch 2.5–2.6
  where that swap is a class, :func:`make_tracked_swap_methods` its
  ``__enter__`` / ``__exit__``;
* :func:`note_step` stands in for ``Optimizer._optimizer_step_code``, the
  empty method every optimizer step calls after updating;
* :func:`make_watched_hooks_disable` wraps the generator behind
  ``torch.autograd.graph.disable_saved_tensors_hooks``, which torch.func's grad
  transforms enter (dynamo models that context manager itself, by identity).

Under dynamo ``torch.compiler.is_dynamo_compiling()`` reads True (eager code,
even while another thread compiles, reads False) and they do exactly what
torch's own code does: a compiled graph has no checkpoint recompute to drift
from, and a compiled ``step()`` keeps its graph.  In eager mode they hand the
bookkeeping to ``_state``, in a file dynamo skips: after a graph break dynamo
would otherwise try to compile that bookkeeping frame by frame (and, on torch
2.4, count graph breaks there that raw torch does not have).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from . import _state


def make_tracked_reparametrize(original_generator: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """Wrap the generator behind ``_reparametrize_module`` so swaps are visible.

    ``_patch`` puts the result into the closure cell of torch's
    ``@contextmanager`` wrapper, which keeps ``_reparametrize_module`` itself
    (the object dynamo recognises by identity) untouched.
    """
    original_cm = contextlib.contextmanager(original_generator)

    @functools.wraps(original_generator)
    def tracked_reparametrize(module, *args, **kwargs):
        if torch.compiler.is_dynamo_compiling():
            with original_cm(module, *args, **kwargs) as value:
                yield value
            return
        token = _state.begin_swap(module, args, kwargs)
        with original_cm(module, *args, **kwargs) as value:
            _state.push_swap(token)
            try:
                yield value
            finally:
                _state.pop_swap(token)

    tracked_reparametrize.__ckpt_guard_original__ = original_generator  # type: ignore[attr-defined]
    return tracked_reparametrize


def make_watched_hooks_disable(original_generator: Callable[[str], Iterator[None]]) -> Callable[[str], Iterator[None]]:
    """Wrap the generator behind ``torch.autograd.graph.disable_saved_tensors_hooks`` (CKG012).

    torch.func's grad transforms enter it at their entry; it refuses when saved-tensor
    hooks are registered (``save_on_cpu`` around the transform).  Only that refusal is
    handed to ``_transform_entry``; otherwise this is torch's generator, one frame more.
    ``_patch`` puts it into the closure cell of torch's ``@contextmanager`` wrapper, so
    the function dynamo recognises (and models itself, never running this) stays torch's.
    """

    @functools.wraps(original_generator)
    def disable_saved_tensors_hooks(error_message: str) -> Iterator[None]:
        inner = original_generator(error_message)
        put_back = None
        try:
            next(inner)
        except RuntimeError as refusal:
            if torch.compiler.is_dynamo_compiling():
                raise
            from . import _transform_entry

            inner, put_back = _transform_entry.entered_despite(error_message, refusal, original_generator)
        try:
            yield
        finally:
            inner.close()  # torch's own exit: the hooks' previous state back
            if put_back is not None:
                put_back()

    disable_saved_tensors_hooks.__ckpt_guard_original__ = original_generator  # type: ignore[attr-defined]
    return disable_saved_tensors_hooks


def make_tracked_swap_methods(swap_class: type) -> tuple:
    """``(__enter__, __exit__)`` for torch 2.5–2.6's ``_ReparametrizeModule`` class.

    There ``_reparametrize_module`` returns an instance of that class instead
    of a generator-based context manager; ``_patch`` sets these two methods on
    the class, so every swap becomes visible the same way.
    """
    original_enter, original_exit = swap_class.__enter__, swap_class.__exit__

    def __enter__(self):
        if torch.compiler.is_dynamo_compiling():
            return original_enter(self)
        token = _state.begin_swap(self.accessor.module, (self.untied_parameters_and_buffers,), {})
        value = original_enter(self)
        self._ckpt_guard_swap = token
        _state.push_swap(token)
        return value

    def __exit__(self, exception_type, exception_value, traceback):
        try:
            return original_exit(self, exception_type, exception_value, traceback)
        finally:
            if not torch.compiler.is_dynamo_compiling():
                token = vars(self).pop("_ckpt_guard_swap", None)
                if token is not None:
                    _state.pop_swap(token)

    return __enter__, __exit__


def note_step(optimizer: Any) -> None:
    """Every optimizer step calls this after updating: count it (CKG108).

    Not a global step hook: dynamo traces the hook loop of ``step()`` and, on
    Python 3.13, stops compiling ``step()`` when that loop is not empty.  A
    step that raised never gets here, so it leaves nothing behind.
    """
    if torch.compiler.is_dynamo_compiling():
        return
    _state.record_step(optimizer)
