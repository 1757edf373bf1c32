"""What a checkpointed callable runs, past the wrappers around it: the one peel.

A block reaches ``checkpoint`` wrapped.  ``functools.partial`` binds arguments
(transformers checkpoints ``partial(layer.__call__, **kwargs)`` and, in 5.x,
``partial(forward, layer, ...)``), and the guard's own recorder is a partial of
its method bound to the user's block (``partial(MethodType(_run_recorded,
block), recorder)``, ``_entry``).  Every reader that asks "what does this block
run" peels them the same way, here:

* :func:`peel`: the module, bound method, function or callable object past
  every partial and every method bound to a function, a method or a partial
  (or whose function is the guard's);
* :func:`innermost_partial`: the last partial met on the way (the one that
  binds the user's arguments), for :func:`~.modules.block_module`'s rule that
  ``partial(forward, layer)`` runs ``layer``;
* :func:`function_of`: the Python function that runs (a bound method's
  ``__func__``), for the names its code reads.

And :func:`member_functions`, the same question of a class's member: the
functions a static or class method, a property or a cached property runs.

The walks of what a block reaches (``block_reads``, ``closures``, the
composable recompute's binding) open a partial or a method one level at a time
instead: they need each part with the edge it was found on.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Optional

_PARTIAL, _METHOD = functools.partial, types.MethodType
#: what a method's ``__self__`` may be for the method to be a wrapper around it (the guard's recorder)
_WRAPPED = (types.FunctionType, types.MethodType, functools.partial)


def _wraps(method: types.MethodType) -> bool:
    """Whether a bound method wraps its ``__self__``: bound to a function, method or partial, or the guard's."""
    return isinstance(method.__self__, _WRAPPED) or (
        getattr(method.__func__, "__module__", None) or "").startswith("ckpt_guard.")


def peel(block: Any) -> Any:
    """What ``block`` runs past its partials and the methods wrapping it (see the module docstring)."""
    while True:
        kind = type(block)
        if kind is _PARTIAL:
            block = block.func
        elif kind is _METHOD and _wraps(block):
            block = block.__self__
        else:
            return block


def innermost_partial(block: Any) -> Optional[functools.partial]:
    """The last ``functools.partial`` :func:`peel` opens on its way through ``block``, or None."""
    last = None
    while True:
        kind = type(block)
        if kind is _PARTIAL:
            last, block = block, block.func
        elif kind is _METHOD and _wraps(block):
            block = block.__self__
        else:
            return last


def function_of(block: Any) -> Optional[types.FunctionType]:
    """The Python function ``block`` runs past its wrappers (a bound method's ``__func__``), or None."""
    runs = peel(block)
    if type(runs) is _METHOD:
        runs = runs.__func__
    return runs if isinstance(runs, types.FunctionType) else None


def member_functions(member: Any, reading: bool = False) -> tuple:
    """The Python functions a class member may run: a plain function itself, a static or class method's
    ``__func__``, a property's getter, setter and deleter (``reading``: its getter only, what reading the
    attribute runs), a ``functools.cached_property``'s function; ``()`` for anything else (a value, a
    descriptor of the user's, whose ``__get__`` a reader may follow on its own terms)."""
    kind = type(member)
    if kind is types.FunctionType:
        return (member,)
    if issubclass(kind, (staticmethod, classmethod)):
        function = member.__func__
        return (function,) if type(function) is types.FunctionType else ()
    if issubclass(kind, property):
        accessors = (member.fget,) if reading else (member.fget, member.fset, member.fdel)
        return tuple(f for f in accessors if type(f) is types.FunctionType)
    if issubclass(kind, functools.cached_property):
        return (member.func,) if type(member.func) is types.FunctionType else ()
    return ()
