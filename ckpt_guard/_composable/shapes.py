"""A module block's walk, kept between its calls: checked and re-read, not walked again.

``binding.holdings`` walks everything a block reaches, on every call: its
modules, each module's attributes one by one (is it a tensor, a number, a
container to walk?), the call's arguments.  For a transformer-sized model
that is tens of microseconds of Python per block and step, and the answer is
almost always the one the last step got: a model's modules, their parameter
names and their attributes' kinds do not change between steps; only the
tensors in them do (``functional_call`` swaps new ones in at every step).

So for the usual block, an ``nn.Module`` called on tensors, the walk's
answer is kept as a :class:`Shape` (one per module, by id, holding its
modules only through weak references: the guard never keeps a model alive).
At each call the shape is *checked*, exhaustively, and the current tensors
and numbers *re-read* from the modules, in one pass:

* the same module objects, of the same classes, reached by the same names
  (each module's ``_modules`` has the same names, holding the same children);
* each module's ``__dict__`` has as many entries as when the shape was taken,
  and every attribute the walk classified is still there and of its kind:
  a tensor (re-read), a plain number, flag or string (re-read: the recompute
  puts the forward's back), an immutable value (a tuple of numbers, a dtype:
  the same object), or a short list or dict of plain values (the same object,
  its items looked at again);
* the same parameter and buffer names (their tensors re-read), and no forward
  hook on any module.

Anything else (a container holding tensors or modules, an object of the
user's class, a function, a forward hook, a TorchScript module, an argument
that is not a tensor, keyword arguments) is not kept: those blocks are walked
at every call, as before.  A check that fails walks the block again and
takes the shape anew.  Nothing is assumed that is not checked, so the
:class:`~ckpt_guard._composable.binding.Holdings` a checked shape returns is
the one ``holdings`` would have returned for the call (when a shape is
taken, the two are compared, and a block where they differ is never kept).
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import binding as _rebind

Tensor = torch.Tensor
Module = torch.nn.Module

# the kinds of a module attribute the walk classified
_TENSOR, _SCALAR, _SAME, _SAME_WALKED, _ITEMS = range(5)

#: immutable values the walk finds nothing in: kept by identity
_IMMUTABLE_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format)
#: how long a list or dict of plain values may be to be looked at again on each call
_MAX_ITEMS = 16
#: how many modules a block may reach to be kept (a whole model checkpointed as one block is walked)
_MAX_MODULES = 256


class _Entry:
    """One module of a shape: how to check it and what to re-read from it."""

    __slots__ = ("ref", "cls", "n_keys", "children", "parameters", "buffers", "attributes")

    def __init__(self, module: Module) -> None:
        self.ref = weakref.ref(module)
        self.cls = type(module)
        self.n_keys = len(module.__dict__)
        #: (name, index of the child's entry, or -1 for None), in ``_modules`` order
        self.children: Tuple[Tuple[str, int], ...] = ()
        self.parameters = tuple(module.__dict__["_parameters"])
        self.buffers = tuple(module.__dict__["_buffers"])
        #: (name, kind, the value kept for _SAME / _SAME_WALKED / _ITEMS), in ``__dict__`` order
        self.attributes: List[Tuple[str, int, Any]] = []


def _immutable(value: Any, depth: int = 0) -> bool:
    """A value nothing can be put into later and that holds no tensor or module."""
    kind = type(value)
    if kind in _rebind._SCALARS or isinstance(value, _IMMUTABLE_TYPES):
        return True
    if (kind is tuple or kind is torch.Size or kind is frozenset) and depth < 3 and len(value) <= _MAX_ITEMS:
        return all(_immutable(item, depth + 1) for item in value)
    return False


def _library_function(value: Any) -> bool:
    """torch's own function held as an attribute (``nn.TransformerEncoderLayer.activation = F.relu``):
    no closure, defaults of plain values; the walk finds nothing in it (nor in its globals: not the user's)."""
    return (
        type(value) is types.FunctionType and not value.__closure__ and not _rebind._user_function(value)
        and all(_immutable(d) for d in value.__defaults__ or ())
        and all(_immutable(d) for d in (value.__kwdefaults__ or {}).values())
    )


#: plain values the walk nevertheless walks (what they hold may reach a tensor)
_WALKED_PLAIN = (types.FunctionType, functools.partial)


def _classify(name: str, value: Any) -> Optional[Tuple[int, Any]]:
    """How a module attribute is kept (as ``binding.holdings``' loop reads it); None: torch's
    bookkeeping, which the walk skips; raises :class:`_NotKept` for what a shape does not keep."""
    if name in _rebind._SKIPPED_INTERNALS:
        return None
    if name in _rebind._FORWARD_HOOKS:
        if value:
            raise _NotKept
        return _SAME, None  # an empty forward-hook dict: checked to be empty still
    if isinstance(value, Tensor):
        return _TENSOR, None
    if type(value) in _rebind._SCALARS or _rebind._numpy_scalar(value):
        return _SCALAR, None
    if isinstance(value, _rebind._reads.HOLDS_NOTHING) and not isinstance(value, _WALKED_PLAIN):
        return _SAME, value  # the walk passes over it: its identity is checked
    if _immutable(value) or _library_function(value):
        return _SAME_WALKED, value  # walked, nothing in it: an attribute of the walk's
    scalars = _rebind._SCALARS
    if type(value) is list and len(value) <= _MAX_ITEMS and all(type(v) in scalars for v in value):
        return _ITEMS, value
    if type(value) is dict and len(value) <= _MAX_ITEMS and all(
        type(k) in scalars and type(v) in scalars for k, v in value.items()
    ):
        return _ITEMS, value
    raise _NotKept


class _NotKept(Exception):
    """A block a shape does not keep (see the module docstring)."""


class Shape:
    """What ``holdings`` finds for one module block, checked and re-read at each call (module docstring)."""

    __slots__ = ("entries",)

    def __init__(self, entries: List[_Entry]) -> None:
        self.entries = entries

    def holdings(self, args: tuple) -> Optional[_rebind.Holdings]:
        """The walk's answer for the block called on ``args`` (tensors), or None if the shape no longer holds."""
        modules: List[Module] = []
        for entry in self.entries:
            module = entry.ref()
            if module is None or type(module) is not entry.cls:
                return None
            modules.append(module)
        attributes: List[Tuple[Module, str, Any]] = []
        scalars: List[Tuple[Module, str, Any]] = []
        scalar_types, numpy_scalar, absent = _rebind._SCALARS, _rebind._numpy_scalar, _ABSENT
        for module, entry in zip(modules, self.entries):
            d = module.__dict__
            if len(d) != entry.n_keys:
                return None
            children = d["_modules"]
            if len(children) != len(entry.children):
                return None
            for name, index in entry.children:
                if children.get(name, absent) is not (None if index < 0 else modules[index]):
                    return None
            if tuple(d["_parameters"]) != entry.parameters or tuple(d["_buffers"]) != entry.buffers:
                return None
            for name, kind, kept in entry.attributes:
                value = d.get(name, absent)
                if kind == _TENSOR:
                    if not isinstance(value, Tensor):
                        return None
                    attributes.append((module, name, value))
                elif kind == _SCALAR:
                    if type(value) not in scalar_types and not numpy_scalar(value):
                        return None
                    scalars.append((module, name, value))
                elif kind == _SAME:
                    if kept is None:  # a forward-hook dict: empty still
                        if value is absent or value:
                            return None
                    elif value is not kept:
                        return None
                elif kind == _SAME_WALKED:
                    if value is not kept:
                        return None
                    attributes.append((module, name, value))
                else:  # _ITEMS: the same short list or dict, of plain values still
                    if value is not kept or len(value) > _MAX_ITEMS:
                        return None
                    if type(value) is list:
                        if not all(type(v) in scalar_types for v in value):
                            return None
                    elif not all(type(k) in scalar_types and type(v) in scalar_types for k, v in value.items()):
                        return None
                    attributes.append((module, name, value))
        arguments: Dict[int, Tensor] = {}
        for arg in args:
            arguments.setdefault(id(arg), arg)
        return _rebind.Holdings(modules[0], modules, [], list(arguments.values()), [], attributes, False, scalars, True)


_ABSENT = _rebind._ABSENT


def take(module: Module) -> Optional[Shape]:
    """The block's shape, taken now, or None where it is not a block a shape keeps."""
    if isinstance(module, torch.jit.ScriptModule):
        return None
    try:
        found = list(module.named_modules())  # the walk's order: preorder, each module once
    except Exception:  # noqa: BLE001 - a module graph torch itself cannot walk: walked as before
        return None
    if len(found) > _MAX_MODULES:
        return None
    index = {id(m): i for i, (_, m) in enumerate(found)}
    entries: List[_Entry] = []
    try:
        for _, current in found:
            if not isinstance(current.__dict__.get("_modules"), dict):
                return None
            entry = _Entry(current)
            entry.children = tuple(
                (name, -1 if child is None else index[id(child)]) for name, child in current.__dict__["_modules"].items()
            )
            for name, value in current.__dict__.items():
                kept = _classify(name, value)
                if kept is not None:
                    entry.attributes.append((name, *kept))
            entries.append(entry)
    except (_NotKept, KeyError, TypeError):
        return None
    return Shape(entries)


def _same(a: _rebind.Holdings, b: _rebind.Holdings) -> bool:
    """Whether two walks found the same modules, tensors, attributes and numbers (by identity)."""
    def ids(items: list) -> list:
        return sorted(tuple(map(id, item)) if isinstance(item, tuple) else (id(item),) for item in items)

    return (
        a.frozen is b.frozen and [id(m) for m in a.modules] == [id(m) for m in b.modules]
        and ids(a.tensors) == ids(b.tensors) and [id(t) for t in a.arguments] == [id(t) for t in b.arguments]
        and ids(a.unbindable) == ids(b.unbindable) and ids(a.attributes) == ids(b.attributes)
        and ids(a.scalars) == ids(b.scalars) and a.exhausted == b.exhausted
    )


#: id(block module) -> (a weak reference to it, its Shape or None: walked at every call)
_kept: Dict[int, Tuple[Any, Optional[Shape]]] = {}


def holdings(function: Any, args: tuple, kwargs: dict) -> _rebind.Holdings:
    """``binding.holdings(function, args, kwargs)``, read off the block's kept shape where it still holds."""
    if kwargs or not isinstance(function, Module):
        return _rebind.holdings(function, args, kwargs)
    for arg in args:
        if not isinstance(arg, Tensor):
            return _rebind.holdings(function, args, kwargs)
    found = _kept.get(id(function))
    if found is not None and found[0]() is function:
        shape = found[1]
        if shape is None:  # not a block a shape keeps: walked, as at every call
            return _rebind.holdings(function, args, kwargs)
        held = shape.holdings(args)
        if held is not None:
            return held
    held = _rebind.holdings(function, args, kwargs)
    shape = take(function)
    if shape is not None:
        taken = shape.holdings(args)
        if taken is None or not _same(taken, held):
            shape = None
    if len(_kept) >= 4096:
        _kept.clear()
    key = id(function)
    _kept[key] = (weakref.ref(function, functools.partial(_dropped, key)), shape)
    return held


def _dropped(key: int, ref: Any) -> None:
    """A kept block was collected: its entry goes with it (unless the id was taken again since)."""
    found = _kept.get(key)
    if found is not None and found[0] is ref:
        del _kept[key]


def forget() -> None:
    """Drop every kept shape (tests)."""
    _kept.clear()
