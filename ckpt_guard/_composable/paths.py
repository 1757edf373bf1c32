"""Naming a tensor by the path a user would recognise, for messages only (it may be slow).

``describe_path`` searches breadth-first from the block and its arguments, by the same edges the
walk of :mod:`.binding` follows (closure cells, defaults and keyword-only defaults, globals, a
partial's arguments, a method's object, a module's parameters, buffers, submodules and attributes,
containers, the class attributes of the user's classes), and returns the first path that reaches
the tensor: ``"closure of <lambda> (train.py:41) → P['l1']['w']"``.
"""

from __future__ import annotations

import collections
import functools
import types
from typing import Any, Deque, Iterator, Optional, Tuple

from .._state import block_reads as _reads
from .basics import Tensor
from .binding import _FORWARD_HOOKS, _HOOK_FLAGS, module_attributes


def describe_path(function: Any, args: tuple, kwargs: dict, target: Any) -> Optional[str]:
    """``"closure of <lambda> (train.py:41) → P['l1']['w']"``, or None if no path is found."""
    queue: Deque[Tuple[Any, str]] = collections.deque([(function, _root_name(function))])
    queue.extend((a, f"argument {i}") for i, a in enumerate(args))
    queue.extend((v, f"keyword argument {k}") for k, v in kwargs.items())
    seen: set = set()
    budget = _reads.BUDGET * 4
    while queue and budget > 0:
        obj, path = queue.popleft()
        if obj is target:
            return path
        if id(obj) in seen or issubclass(type(obj), (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        budget -= 1
        try:
            queue.extend(_labelled_children(obj, path))
        except Exception:  # noqa: BLE001 - messages only: an object that resists is skipped
            continue
    return None


def _root_name(function: Any) -> str:
    code = getattr(function, "__code__", None)
    name = getattr(function, "__qualname__", None) or type(function).__name__
    if isinstance(code, types.CodeType):
        return f"{name} ({code.co_filename}:{code.co_firstlineno})"
    return name


def _labelled_children(obj: Any, path: str) -> Iterator[Tuple[Any, str]]:
    if isinstance(obj, Tensor):
        return
    if _reads.is_module(obj):
        for store in ("_parameters", "_buffers", "_modules"):
            for name, value in obj.__dict__[store].items():
                yield value, f"{path}.{name}"
        for name, value in module_attributes(obj):
            if name in _HOOK_FLAGS:
                continue
            if name in _FORWARD_HOOKS:
                for hook in value.values():
                    yield hook, f"{path} forward hook {getattr(hook, '__qualname__', hook)!s}"
            else:
                yield value, f"{path}.{name}"
        yield from _class_attributes(type(obj), path)
        return
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                yield cell.cell_contents, f"{path} → {name}"
            except ValueError:
                continue
        for i, value in enumerate(obj.__defaults__ or ()):
            yield value, f"{path} → default {i}"
        for name, value in (obj.__kwdefaults__ or {}).items():  # lifted as the walk lifts them
            yield value, f"{path} → default {name}="
        for name in _reads.global_names(code):
            if name in obj.__globals__:
                yield obj.__globals__[name], f"global {name} of {obj.__module__}"
        return
    if isinstance(obj, functools.partial):
        yield obj.func, path
        for i, value in enumerate(obj.args):
            yield value, f"{path} (bound argument {i})"
        for name, value in obj.keywords.items():
            yield value, f"{path} (bound {name}=)"
        return
    if isinstance(obj, (types.MethodType, types.BuiltinMethodType)):
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, type):
            yield from _class_attributes(owner, owner.__qualname__)
        elif owner is not None:
            yield owner, f"{path} (its object)"
        if isinstance(obj, types.MethodType):
            yield obj.__func__, f"{path}"
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield v, f"{path}[{k!r}]"
        return
    if isinstance(obj, (list, tuple)):
        fields = getattr(obj, "_fields", None)
        for i, v in enumerate(obj):
            yield v, f"{path}.{fields[i]}" if fields else f"{path}[{i}]"
        return
    if isinstance(obj, type):
        yield from _class_attributes(obj, obj.__qualname__)
        return
    if isinstance(obj, types.ModuleType):
        if (obj.__name__ or "").split(".")[0] not in _reads.LIBRARY_ROOTS:
            for name, value in vars(obj).items():
                yield value, f"{obj.__name__}.{name}"
        return
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict) and _reads.is_users_object(obj):
        for name, value in attributes.items():
            yield value, f"{path}.{name}"
        yield from _class_attributes(type(obj), f"{type(obj).__qualname__}")


def _class_attributes(cls: type, path: str) -> Iterator[Tuple[Any, str]]:
    """The class attributes of the user's classes (not torch's or the standard library's)."""
    for klass in cls.__mro__:
        if (klass.__module__ or "").split(".")[0] in _reads.LIBRARY_ROOTS:
            continue
        for name, value in vars(klass).items():
            if not name.startswith("__"):
                yield (value.__func__ if isinstance(value, (classmethod, staticmethod)) else value), f"{klass.__qualname__}.{name}"
