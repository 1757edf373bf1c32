"""Reader's helper: what a block given as a function (or an object's method) reaches by reference.

A block given as ``lambda h: inner(h)`` reads what ``inner`` holds as much as
what it holds itself, and ``lambda h: layers[0](h)`` or ``holder.run`` runs
modules a list or an object holds.  :func:`closure_cells` is the one walk of
the cells (the block snapshot, CKG110's re-bound values, the containers CKG112
keeps); :func:`reached_modules` the one walk to the modules whose state the
snapshot watches (CKG106, CKG110, CKG112, CKG115, CKG117).
"""

from __future__ import annotations

import functools
import itertools
import types

import torch

from .basics import Module


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


#: how far from the block's closure cells (or the object whose method it is) modules are looked for:
#: ``lambda h: layers[0](h)`` (a list), ``holder.run`` (an object's attribute), ``lambda h: f(h)`` with
#: ``f = block.forward`` (a bound method) are each one step
REACH_DEPTH = 3
#: how many entries of one list, tuple, dict or object's attributes are looked at
REACH_ITEMS = 64

_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def reached_modules(values: tuple) -> list:
    """The modules ``values`` (a closure's cell contents, or the object whose method the block is)
    lead to, each once, in the order met: through functions' closures, bound methods, partials,
    lists, tuples, dicts and plain objects' attributes, up to :data:`REACH_DEPTH` steps.

    A module is not looked into here (its own snapshot covers its submodules); nor are a class, a
    Python module, a tensor or an object without a ``__dict__`` of its own.
    """
    found: dict = {}
    seen: set = set()

    def visit(value: object, depth: int) -> None:
        if isinstance(value, Module):
            found.setdefault(id(value), value)
            return
        kind = type(value)
        if depth <= 0 or kind in _SCALARS or id(value) in seen:
            return
        seen.add(id(value))
        if kind is types.MethodType:
            visit(value.__self__, depth)  # a bound method is its object
        elif kind is types.FunctionType:
            for cell in value.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth - 1)
                except ValueError:  # an empty cell
                    continue
        elif kind is functools.partial:
            for item in (value.func, *value.args, *value.keywords.values()):
                visit(item, depth - 1)
        elif kind is list or kind is tuple:
            for item in value[:REACH_ITEMS]:
                visit(item, depth - 1)
        elif kind is dict:
            for item in itertools.islice(value.values(), REACH_ITEMS):
                visit(item, depth - 1)
        elif not isinstance(value, (type, types.ModuleType, torch.Tensor)):
            try:  # an object's own attributes, read past any __getattr__ of its class
                attributes = object.__getattribute__(value, "__dict__")
            except (AttributeError, TypeError):
                return
            if type(attributes) is dict:
                for item in itertools.islice(attributes.values(), REACH_ITEMS):
                    visit(item, depth - 1)

    for value in values:
        visit(value, REACH_DEPTH)
    return list(found.values())

