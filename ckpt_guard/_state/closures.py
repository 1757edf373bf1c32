"""Reader's helper: what a block given as a function (or an object's method) reaches by reference.

A block given as ``lambda h: inner(h)`` reads what ``inner`` holds as much as
what it holds itself, and ``lambda h: layers[0](h)`` or ``holder.run`` runs
modules a list or an object holds.  :func:`closure_cells` is the one walk of
the cells (the block snapshot, CKG110's re-bound values, the containers CKG112
keeps); :func:`reached_modules` the modules whose state the snapshot watches
(CKG106, CKG110, CKG112, CKG115, CKG117), by ``block_reads``' rules of what can
hide a module, on every call.
"""

from __future__ import annotations

import functools
import itertools
import types

import torch

from .basics import Module
from .block_reads import LIBRARY_ROOTS, global_names, is_users_object


#: how many functions a closure's cells lead to are followed for what they hold: ``lambda h:
#: inner(h)`` where ``inner`` is itself a closure over a module or a tensor (a closure of a closure)
CLOSURE_FUNCTIONS_LIMIT = 16


def closure_cells(function: types.FunctionType) -> list:
    """``[(cell, name)]``: the function's closure cells, then those of each function they hold, in turn
    (named ``"'w' (of main.<locals>.inner, which the block calls)"`` past the block's own).

    A block ``lambda h: inner(h)`` reads what ``inner``'s cells hold as much as
    its own: a module behind it is advanced again by torch's recompute, a
    tensor re-bound there is read anew.  Followed breadth-first, each function
    once, up to :data:`CLOSURE_FUNCTIONS_LIMIT` functions (a closure holding
    a long chain of helpers is watched in its first ones).  A function
    reached through a module, a container or a global is not followed.
    """
    found: list = []
    queue, seen = [function], {id(function)}
    while queue and len(seen) <= CLOSURE_FUNCTIONS_LIMIT:
        current = queue.pop(0)
        owner = "" if current is function else f" (of {current.__qualname__}, which the block calls)"
        for cell, name in zip(current.__closure__ or (), current.__code__.co_freevars):
            found.append((cell, repr(name) + owner))
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: reading it fails for the caller, as for the function
                continue
            if type(value) is types.FunctionType and value.__closure__ and id(value) not in seen:
                seen.add(id(value))
                queue.append(value)
    return found


#: how far from the block modules are looked for: ``lambda h: layers[0](h)`` (a list),
#: ``holder.run`` (an object's attribute), ``lambda h: f(h)`` with ``f = block.forward`` (a bound
#: method), ``lambda h: inner(h)`` (a function's closure) are each one step
REACH_DEPTH = 3
#: how many entries of one list, tuple, dict or object's attributes are looked at
REACH_ITEMS = 64

_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def reached_modules(function: object) -> list:
    """The modules a block given as a function (or an object's method, or a callable object) runs or
    may run, each once, in the order met.

    What its closure cells, default arguments and globals hold, and, up to
    :data:`REACH_DEPTH` steps, what the functions, bound methods, partials,
    lists, tuples, dicts and objects of the user's they hold hold in turn.
    The same reach as the complete view of :func:`~.block_reads.reads_of`
    (by its rules of what cannot hide a module: torch's and Python's own
    functions and objects), bounded in depth and width instead of by a
    budget, and some ten times cheaper: this runs on every call.  A module
    is not looked into here (its own snapshot covers its submodules).
    """
    found: dict = {}
    seen: set = set()

    def visit(value: object, depth: int) -> None:
        if isinstance(value, Module):
            found.setdefault(id(value), value)
            return
        kind = type(value)
        if depth <= 0 or kind in _SCALARS or kind is torch.Tensor or id(value) in seen:
            return
        seen.add(id(value))
        if kind is types.MethodType:
            visit(value.__self__, depth)  # a bound method is its object, and its function
            visit(value.__func__, depth)
        elif kind is types.FunctionType:
            if (getattr(value, "__module__", None) or "").split(".")[0] in LIBRARY_ROOTS:
                return  # torch's or Python's own: holds no module of the user's
            for item in _held_by_function(value):
                visit(item, depth - 1)
        elif kind is functools.partial:
            for item in (value.func, *value.args, *value.keywords.values()):
                visit(item, depth - 1)
        elif kind is list or kind is tuple:
            for item in value[:REACH_ITEMS]:
                visit(item, depth - 1)
        elif kind is dict:
            for item in itertools.islice(value.values(), REACH_ITEMS):
                visit(item, depth - 1)
        elif is_users_object(value) and not isinstance(value, (type, types.ModuleType, torch.Tensor)):
            try:  # an object's own attributes, read past any __getattr__ of its class
                attributes = object.__getattribute__(value, "__dict__")
            except (AttributeError, TypeError):
                return
            if type(attributes) is dict:
                for item in itertools.islice(attributes.values(), REACH_ITEMS):
                    visit(item, depth - 1)
                visit(getattr(type(value), "__call__", None), depth - 1)

    visit(function, REACH_DEPTH + 1)
    return list(found.values())


def _held_by_function(function: types.FunctionType) -> list:
    """A function's closure cells' contents, default arguments, and the globals its code loads."""
    held = []
    for cell in function.__closure__ or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    held += function.__defaults__ or ()
    held += (function.__kwdefaults__ or {}).values()
    namespace = function.__globals__
    held += [namespace[name] for name in global_names(function.__code__) if name in namespace]
    return held
