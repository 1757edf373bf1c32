"""Reader's helper: what a block given as a function (or an object's method) reaches by reference.

A block given as ``lambda h: inner(h)`` reads what ``inner`` holds as much as
what it holds itself; ``def block(h): return h @ W`` reads the global ``W``
when it runs, the forward and each recompute alike; ``lambda h: layers[0](h)``
or ``holder.run`` runs modules a list or an object holds.  :func:`closure_cells`
is the one walk of the cells and globals (the block snapshot, CKG110's re-bound
values and their replay, the containers CKG112 keeps, the composable
recompute's :func:`replaying_globals`); :func:`reached_modules` the modules
whose state the snapshot watches (CKG106, CKG110, CKG112, CKG115, CKG117), by
``block_reads``' rules of what can hide a module, on every call.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from typing import Iterator

import torch

from .basics import Module, is_module
from .block_reads import (
    EVERY_NAME, LIBRARY_ROOTS, attribute_values, code_names, global_names, is_namespace, is_users_object,
    method_names, names_read, namespace_values,
)
from .peel import peel


#: how many functions a closure's cells lead to are followed for what they hold: ``lambda h:
#: inner(h)`` where ``inner`` is itself a closure over a module or a tensor (a closure of a closure)
CLOSURE_FUNCTIONS_LIMIT = 16


def closure_cells(function: types.FunctionType, with_globals: bool = True, helpers: tuple = ()) -> list:
    """``[(cell, what)]``: the function's closure cells and the globals its code loads (a
    :class:`GlobalSlot` each), then those of each function they hold, in turn, ``what`` naming it for a
    message: ``the closure variable 'w'``, ``the closure variable 'w' (of main.<locals>.inner, which
    the block calls)``, ``the global 'W' of module __main__``.

    A block ``lambda h: inner(h)`` reads what ``inner``'s cells hold as much as
    its own: a module behind it is advanced again by torch's recompute, a
    tensor re-bound there is read anew; so is a global re-bound between the
    forward and the recompute (``W = W - lr * g``), read by the block or by a
    helper it calls (held in a cell, or a function of the user's that is a
    global: ``def block(h): return helper(h)``).  Followed breadth-first,
    each function once, up to :data:`CLOSURE_FUNCTIONS_LIMIT` functions (a
    closure holding a long chain of helpers is watched in its first ones); torch's and Python's own
    functions are not followed.  A function reached through a module or a container is not
    followed; a global naming a Python module, a class or a function is not
    watched (code, not state a recompute reads anew).  ``with_globals=False``: the cells alone (the
    containers CKG112 records: a global table of a script's may be long, and is not the block's own).
    ``helpers``: more functions the block calls, followed after it (those a plain object holds).
    """
    found: list = []
    functions = [function]
    seen = {id(function)}

    def follow(value: object) -> None:
        if (
            type(value) is types.FunctionType and id(value) not in seen and (with_globals or value.__closure__)
            and (getattr(value, "__module__", None) or "").split(".")[0] not in LIBRARY_ROOTS
        ):
            seen.add(id(value))
            functions.append(value)

    for helper in helpers:
        follow(helper)
    for index, current in enumerate(functions):  # grows as it goes: breadth-first
        if index >= CLOSURE_FUNCTIONS_LIMIT:
            break
        owner = "" if current is function else f" (of {current.__qualname__}, which the block calls)"
        for cell, name in zip(current.__closure__ or (), current.__code__.co_freevars):
            found.append((cell, f"the closure variable {name!r}{owner}"))
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: reading it fails for the caller, as for the function
                continue
            follow(value)
        if not with_globals:
            continue
        namespace = current.__globals__
        for name in global_names(current.__code__):
            value = namespace.get(name, _ABSENT)
            if value is _ABSENT:
                continue
            if issubclass(type(value), _CODE):
                if type(value) is types.FunctionType and not _installed_library(value):
                    follow(value)  # a helper of the user's: what it reads is read too
            else:
                found.append((GlobalSlot(namespace, name), f"the global {name!r} of module {namespace.get('__name__')}"))
    return found


def object_slots(block: object, with_globals: bool = True) -> list:
    """``[(slot, what)]`` for a block that is a plain object's method or a callable object (not a module):
    its function's cells and globals (:func:`closure_cells`), then each attribute of the object its code
    names that the object holds (an :class:`AttributeSlot` each: ``self.calls += 1``, ``self.scale``);
    [] for anything else.  Its modules are :func:`reached_modules`' (their own snapshots)."""
    block = peel(block)  # (the guard's recorder too: a partial of its method bound to the user's block)
    kind = type(block)
    if kind is types.MethodType:
        function, instance = block.__func__, block.__self__
    elif kind is types.FunctionType or isinstance(block, Module) or not is_users_object(block):
        return []
    else:  # a callable object: its class's __call__
        function, instance = getattr(kind, "__call__", None), block
    if type(function) is not types.FunctionType or isinstance(instance, Module):
        return []
    try:
        attributes = object.__getattribute__(instance, "__dict__")
    except (AttributeError, TypeError):  # __slots__: nothing to read by name here
        attributes = None
    if type(attributes) is not dict:
        return closure_cells(function, with_globals)
    names = names_read(type(instance), method_names(function)).names
    named = [(name, attributes[name]) for name in sorted(names) if name in attributes]
    # a function the object holds and its code names (``self.step_fn(h)``) is followed as a closure's helper is
    found = closure_cells(
        function, with_globals, helpers=tuple(value for _, value in named if type(value) is types.FunctionType)
    )
    label = type(instance).__name__
    for name, value in named:
        if not issubclass(type(value), (Module, *_CODE)):
            found.append((AttributeSlot(instance, name), f"the attribute {name!r} of the {label} object the block runs"))
    return found


def block_slots(block: object) -> list:
    """``[(slot, what)]``: what a block given as code reads by name (see :func:`closure_cells` and
    :func:`object_slots`), in the order the block snapshot keeps them."""
    if type(block) is types.FunctionType:
        return closure_cells(block)
    return object_slots(block)


def _installed_library(function: types.FunctionType) -> bool:
    """Whether a function's code comes from an installed package (not the user's script or project):
    a library's helper reached as a global is not followed for the globals it loads (its module's
    tables and caches are its own business, and a re-bind there would be an alarm the user cannot act on)."""
    filename = function.__code__.co_filename
    return "site-packages" in filename or "dist-packages" in filename


_ABSENT = object()
#: globals that are code, not state: a Python module, a class, a function, a builtin
_CODE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, functools.partial)


class AttributeSlot:
    """An attribute of a plain object a block's code reads (``self.calls``), read and written as a closure
    cell is (``cell_contents``), so CKG110's reader and its replay treat it alike."""

    __slots__ = ("instance", "name")

    def __init__(self, instance: object, name: str) -> None:
        self.instance, self.name = instance, name

    @property
    def cell_contents(self) -> object:
        return object.__getattribute__(self.instance, "__dict__").get(self.name, _ABSENT)

    @cell_contents.setter
    def cell_contents(self, value: object) -> None:
        attributes = object.__getattribute__(self.instance, "__dict__")
        if value is _ABSENT:
            attributes.pop(self.name, None)
        else:
            attributes[self.name] = value


class GlobalSlot:
    """A global of a function's module, read and written as a closure cell is (``cell_contents``), so
    the readers and the replay of re-bound values (CKG110) treat both alike."""

    __slots__ = ("namespace", "name")

    def __init__(self, namespace: dict, name: str) -> None:
        self.namespace, self.name = namespace, name

    @property
    def cell_contents(self) -> object:
        return self.namespace.get(self.name, _ABSENT)

    @cell_contents.setter
    def cell_contents(self, value: object) -> None:
        if value is _ABSENT:  # it was not there: deleted again
            self.namespace.pop(self.name, None)
        else:
            self.namespace[self.name] = value


def globals_read(function: object) -> list:
    """``[(slot, value)]``: each global a function block (or a partial or bound method of one) loads,
    its helpers' too (see :func:`closure_cells`), and each attribute of a plain object whose method (or
    ``__call__``) the block is that its code names (:func:`object_slots`), with its value now."""
    function = peel(function)
    if type(function) is types.MethodType and isinstance(function.__self__, Module):
        function = function.__func__  # a module's method: the globals its code loads (its tensors are bound)
    return [(slot, slot.cell_contents) for slot, _ in block_slots(function) if type(slot) is not types.CellType]


@contextlib.contextmanager
def replaying_globals(recorded: list) -> Iterator[None]:
    """Each recorded global, re-bound since, bound to its recorded value while the block runs; what it
    holds now put back after (what the run writes there, ``global calls; calls += 1``, is dropped)."""
    changed = [(slot, was) for slot, was in recorded if slot.cell_contents is not was]
    now = [(slot, slot.cell_contents) for slot, _ in changed]
    for slot, was in changed:
        slot.cell_contents = was
    try:
        yield
    finally:
        for slot, value in now:
            slot.cell_contents = value


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
    lists, tuples, dicts and objects of the user's they hold hold in turn (an
    object's every attribute, its slots, its class's modules, and the special
    methods using it runs: ``__call__``, ``__iter__``...), and of a class or a Python
    module used as a namespace, the attributes the code holding it names (``Layers.encoder``).
    The same reach as the complete view of :func:`~.block_reads.reads_of`
    (by its rules of what cannot hide a module: torch's and Python's own
    functions and objects), bounded in depth and width instead of by a
    budget, and some ten times cheaper: this runs on every call.  A module
    is not looked into here (its own snapshot covers its submodules).
    """
    found: dict = {}
    seen: set = set()

    def visit(value: object, depth: int, names: frozenset = frozenset()) -> None:
        # names: what the code of the function holding ``value`` names (for a namespace it holds)
        if is_module(value):
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
            held_names = code_names(value.__code__)
            for item in _held_by_function(value):
                visit(item, depth - 1, held_names)
        elif kind is functools.partial:
            func = value.func
            held_names = code_names(func.__code__) if type(func) is types.FunctionType else names
            for item in (func, *value.args, *value.keywords.values()):
                visit(item, depth - 1, held_names)
        elif kind is list or kind is tuple:
            for item in value[:REACH_ITEMS]:
                visit(item, depth - 1, names)
        elif kind is dict:
            for item in itertools.islice(value.values(), REACH_ITEMS):
                visit(item, depth - 1, names)
        elif is_namespace(value):  # a class or a Python module: what the code holding it names of it
            try:
                reads, named = namespace_values(value, names)
            except Exception:  # noqa: BLE001 - a metaclass of the user's whose __mro__ raises, say
                return
            for method in reads.methods:
                visit(method, depth - 1)
            for _, item in named[:REACH_ITEMS]:
                visit(item, depth - 1, names)
        elif is_users_object(value):
            # every attribute (read past any __getattr__ of its class), a __slots__ object's slots, and the
            # special methods using it runs (__call__, __iter__, ...): not only those the block's code names,
            # as CKG108's direct view does (block_reads), for the object may be handed to a helper or a
            # module's forward that names the rest; so a spare module it holds counts too (conservative)
            reads = names_read(kind, EVERY_NAME)
            for method in reads.methods:
                visit(method, depth - 1)
            for item in itertools.islice(attribute_values(value, reads), REACH_ITEMS):
                visit(item, depth - 1)

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
