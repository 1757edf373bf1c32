"""Reader: the containers, objects and user generators a block is given, and their replay (CKG112, CKG113).

Owns: the snapshot of lists, dicts, tuples, dataclasses and plain objects reachable from
the block's arguments and closures (bounded in depth and size), telling a real change
from a count or a log (the rule's relevance), what fallback can put back
(:func:`replaying_contents`), and when code is stateless enough to trust.  A user
``torch.Generator`` is found the same way, or held by the block's modules (``modules``
notes those).  May not touch: module tensors (``modules``).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import threading
import types
from typing import Iterator, Optional, Sequence

import torch

from . import block_reads as _reads
from .basics import Module, Tensor, _GONE, _Generator, _cell_contents, _version_of, is_module, requires_grad_anywhere
from .closures import closure_cells, object_slots
from .modules import block_module, _structure, module_containers_seen, module_generators_seen, snapshot_roots


# --------------------------------------------------------------------------
# a list, dict or object the block is given, changed before its recompute (CKG112)
#
# A KV cache passed to a checkpointed attention block (pytorch#155171) grows
# in the block's own forward: the recompute then reads the grown cache and
# appends to it again.  The capture keeps the shallow contents of each such
# container the block is given (its arguments, what a partial of it binds,
# its closure cells), to a small depth: the items of a list, the entries of
# a dict, an object's attributes; the versions of the tensors in them.
# Compared by identity, as the block snapshot is.

#: values that cannot be, or hold, a container the block could change
_ATOMS = frozenset({
    Tensor, torch.nn.Parameter, type(None), bool, int, float, complex, str, bytes,
    torch.dtype, torch.device, torch.Size,
})
_SCALARS = _ATOMS - {Tensor, torch.nn.Parameter}


def _in(kinds: frozenset, value: object) -> bool:
    """Whether ``value``'s type is one of ``kinds`` (False for a type whose metaclass makes it unhashable)."""
    try:
        return type(value) in kinds
    except TypeError:
        return False


#: how many containers deep, and how many containers and tensors per root, the capture looks
_CONTENTS_DEPTH, _CONTENTS_BUDGET = 4, 256
#: a container longer than this is recorded by its length and last values (a per-call
#: copy of a long list of token ids would cost more than the block); fallback cannot
#: put such a record back, so it raises for it as strict
_LONG, _LONG_TAIL = 256, 8
LONG_MARK = "<long container>"


def _is_long(record: object) -> bool:
    """A container record that keeps only its length and last values (see :func:`_shallow`)."""
    return type(record) is tuple and bool(record) and record[0] is LONG_MARK
#: one replay of the user's shared objects at a time (containers, closure cells, generators)
REPLAY_LOCK = threading.RLock()


def _object_state(value: object) -> Optional[dict]:
    """An object's own ``__dict__``, or None (none, or one its class hides behind ``__getattr__``)."""
    try:
        state = object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 - __slots__, a __getattr__ of its own: not watched
        return None
    return state if type(state) is dict else None


def _container_kind(value: object) -> Optional[str]:
    """"list", "dict" or "object" for a value whose contents the block could change in place; else None."""
    kind = type(value)
    if issubclass(kind, list):
        return "list"
    if issubclass(kind, dict):
        return "dict"
    if issubclass(kind, (Tensor, tuple, type, types.FunctionType, types.MethodType, functools.partial)) or is_module(value):
        return None
    root = (getattr(type(value), "__module__", None) or "").split(".")[0]
    if root in _reads.LIBRARY_ROOTS or root == "ckpt_guard" or _object_state(value) is None:
        return None  # the guard's own objects (the record ckpt_guard.checkpoint binds) are not the user's state
    return "object"


def argument_roots(
    function: object, inputs: tuple, keywords: Optional[dict], modules: Optional[list] = None,
) -> Optional[list]:
    """``[(label, value)]`` for the containers and generators the block is given; None when there is none.

    ``modules``: where to list the modules it is given (arguments, closure
    cells, what a partial binds), for their generators.
    """
    roots: list = []
    # (label format, its argument, value): a label is written only for what is kept (this runs per call)
    values = [("its argument {}", i + 1, value) for i, value in enumerate(inputs)]
    values += [("its keyword argument {!r}", name, value) for name, value in (keywords or {}).items()]
    while type(function) is functools.partial:
        values += [("argument {} bound by a functools.partial", i + 1, v) for i, v in enumerate(function.args)]
        values += [("keyword argument {!r} bound by a functools.partial", k, v) for k, v in function.keywords.items()]
        function = function.func
    if type(function) is types.FunctionType:
        for cell, what in closure_cells(function, with_globals=False):  # and those of the functions they hold
            try:
                values.append(("{}", what, cell.cell_contents))
            except ValueError:  # an empty cell
                continue
    elif not is_module(function):  # a plain object's method, a callable object: its attributes
        values += [("{}", what, slot.cell_contents) for slot, what in object_slots(function, with_globals=False)]
    for label, which, value in values:
        if _in(_ATOMS, value):
            continue
        if modules is not None and is_module(value):
            modules.append(value)
        elif holds_container(value):
            roots.append((label.format(which), value))
    return roots or None


def holds_container(value: object) -> bool:
    if type(value) is tuple:  # a tuple of tensors (rotary embeddings) is the usual non-tensor argument
        for item in value:
            if not _in(_ATOMS, item) and holds_container(item):
                return True
        return False
    return type(value) is _Generator or _container_kind(value) is not None


def _full(value: object, kind: str) -> tuple:
    """A container's items, read through the base class (a subclass's own ``__iter__`` or ``items`` may do anything)."""
    if kind == "list":
        return tuple(list.__getitem__(value, slice(None)))  # type: ignore[arg-type]
    if kind == "dict":
        return tuple(dict.items(value))  # type: ignore[arg-type]
    return tuple((_object_state(value) or {}).items())


def _shallow(value: object, kind: str) -> tuple:
    """What the capture keeps of a container: its items (a list's) or ``(key, value)`` pairs."""
    items = _full(value, kind)
    if len(items) > _LONG:  # its length and last values only
        tail = items[-_LONG_TAIL:] if kind == "list" else tuple(v for _, v in items[-_LONG_TAIL:])
        return (LONG_MARK, len(items), *tail)
    return items


def _step(path: str, key: object, kind: str) -> str:
    return f"{path}.{key}" if kind == "object" else f"{path}[{key!r}]"


def contents_snapshot(roots: list, generators: Optional[list] = None, unrecorded: Optional[list] = None) -> tuple:
    """``((path, container, kind, shallow contents) | (path, tensor, "tensor", version), ...)``.

    Depth-first from each root, each container once, at most
    ``_CONTENTS_DEPTH`` containers deep and ``_CONTENTS_BUDGET`` containers
    and tensors per root.  ``path``: the root's label, then the way in
    (``its argument 2.layers[0]``).  A user ``torch.Generator`` met on the way
    is appended to ``generators`` as ``(path, generator)``, if given.
    ``unrecorded``, if given, gets the path of each value whose state the
    walk did not record (too deep, past the budget, or of a kind it does not
    record, other than functions, classes and torch's operators).
    """
    entries: list = []
    seen: set = set()
    for label, root in roots:
        stack = [(root, 0, label)]
        budget = _CONTENTS_BUDGET
        while stack:
            if budget <= 0:
                if unrecorded is not None:
                    unrecorded.append(stack[-1][2])
                break
            value, depth, path = stack.pop()
            if _in(_SCALARS, value) or id(value) in seen:
                continue
            if issubclass(type(value), Tensor):  # (its real type: an object's __class__ may raise)
                seen.add(id(value))
                budget -= 1
                if depth:  # an argument tensor itself: torch checks its version
                    try:
                        entries.append((path, value, "tensor", value._version))
                    except Exception:  # noqa: BLE001 - a torch.func wrapper has no version counter
                        pass
                continue
            if type(value) is tuple:
                stack.extend((item, depth, f"{path}[{i}]") for i, item in reversed(list(enumerate(value))))
                continue
            if type(value) is _Generator:
                seen.add(id(value))
                if generators is not None and is_user_generator(value):
                    generators.append((path, value))
                continue
            kind = _container_kind(value)
            if kind is None or depth >= _CONTENTS_DEPTH:
                if unrecorded is not None and (kind is not None or not _stateless(value)):
                    unrecorded.append(path)
                continue
            seen.add(id(value))
            budget -= 1
            contents = _shallow(value, kind)
            entries.append((path, value, kind, contents))
            if _is_long(contents):
                stack.extend((item, depth + 1, f"{path}[…]") for item in reversed(contents[2:]))
            else:
                pairs = enumerate(contents) if kind == "list" else contents
                stack.extend((item, depth + 1, _step(path, key, kind)) for key, item in reversed(list(pairs)))
    return tuple(entries)


#: values a mode may hold whose own state cannot change what it computes (identity is recorded):
#: functions (looked into by _stateless), classes, torch's operators and their namespaces
_STATELESS = (
    types.FunctionType, types.BuiltinFunctionType, type,
    torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops._OpNamespace,
    # a C class's methods (typing.Generic's on Python 3.13)
    types.MethodDescriptorType, types.ClassMethodDescriptorType, types.WrapperDescriptorType,
    types.GetSetDescriptorType,
)
#: where code the replay trusts lives: torch's package and Python's standard library (not the
#: site-packages below it)
_TRUSTED_CODE_ROOTS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (torch.__file__, functools.__file__)
)


def _wrapper_held(value: object, depth: int, seen: set) -> bool:
    """What a wrapper of torch's or Python's holds may stay: its own bookkeeping (an object of a
    torch or standard-library class: dynamo's context, dataclasses' recursion guard, typing's
    cache), unless it holds a function of the user's, which is looked into; an object of the
    user's own class is state the record cannot see."""
    if type(value) is types.FunctionType:
        return _stateless(value, depth, seen)
    if _immutable(value) or issubclass(type(value), _STATELESS):
        return True
    if type(value) in (dict, list, tuple, set, frozenset):
        items = value.values() if type(value) is dict else value  # type: ignore[attr-defined]
        return len(items) <= _CONTENTS_BUDGET and all(  # type: ignore[arg-type]
            _wrapper_held(item, depth - 1, seen) for item in items  # type: ignore[union-attr]
        )
    root = (getattr(type(value), "__module__", "") or "").split(".")[0]
    return root == "torch" or root in _reads.LIBRARY_ROOTS


def _trusted_code(function: types.FunctionType) -> bool:
    """A function of torch's or of Python's own library (a decorator's wrapper: torch's dynamo
    disable on ``__torch_dispatch__``, ``torch.no_grad()``, dataclasses' repr guard)."""
    filename = function.__code__.co_filename
    if filename.startswith(_TRUSTED_CODE_ROOTS[0]):
        return True
    return filename.startswith(_TRUSTED_CODE_ROOTS[1]) and "-packages" not in filename[len(_TRUSTED_CODE_ROOTS[1]):]


def _stateless(value: object, depth: int = 4, seen: Optional[set] = None) -> bool:
    """A function whose defaults hold nothing mutable, whose attributes and closure cells hold only
    such functions, classes or operators (``super()``'s ``__class__`` cell is fine; a number in a
    cell is not: ``nonlocal n; n += 1`` rebinds it), a static or class method or property made of
    such functions, a class, an operator, a module; a function of torch's or Python's own library.
    What a function reads through its globals is not seen."""
    if type(value) is types.FunctionType:
        seen = set() if seen is None else seen
        if id(value) in seen:
            return True  # already being looked at (a wrapper and the function it wraps refer to each other)
        seen.add(id(value))
        if depth <= 0:
            return False
        if _trusted_code(value):  # a wrapper of torch's or Python's: what it wraps is looked into
            held = [*value.__dict__.values(), *(_cell_contents(cell) for cell in value.__closure__ or ())]
            return all(_wrapper_held(h, depth - 1, seen) for h in held)
        if not all(_stateless(v, depth - 1, seen) for v in value.__dict__.values()):
            return False  # an attribute of its own: a counter (f.calls += 1); functools.wraps' __wrapped__ is looked into
        defaults = (*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values())
        if not all(_immutable(d) for d in defaults):
            return False
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell: it may be filled later
                return False
            if not (name == "__class__" or _stateless(content, depth - 1, seen)):
                return False
        return True
    if issubclass(type(value), (staticmethod, classmethod)):
        return _stateless(value.__func__, depth, seen)
    if issubclass(type(value), property):
        return all(f is None or _stateless(f, depth, seen) for f in (value.fget, value.fset, value.fdel))
    if issubclass(type(value), functools.cached_property):  # it stores into the instance __dict__, which is recorded
        return _stateless(value.func, depth, seen)
    if issubclass(type(value), types.ModuleType):  # a namespace anyone may write to: torch's are taken as constant
        return (value.__name__ or "").split(".")[0] == "torch"
    if issubclass(type(value), types.BuiltinFunctionType):  # len, math.sqrt; not log.append or rng.random
        owner = getattr(value, "__self__", None)
        return owner is None or issubclass(type(owner), types.ModuleType)
    return issubclass(type(value), _STATELESS)


def _immutable(value: object) -> bool:
    """A number, string, dtype, shape, enum member, or a tuple / frozenset of such values or of
    operators and classes."""
    if type(value) in (tuple, frozenset):
        return all(_immutable(item) or issubclass(type(item), _STATELESS[2:]) for item in value)  # type: ignore[attr-defined]
    return _in(_SCALARS, value) or issubclass(type(value), enum.Enum)


_NO_ARGUMENT_STATE = ((), ())


def argument_state(function: object, inputs: tuple = (), keywords: Optional[dict] = None) -> tuple:
    """``(contents, generators)``: CKG112's and CKG113's reads of what the block is given, in one walk.

    On every checkpoint call: a module or bound method given tensors only returns
    after one look at each input (and one flag: has any block held a generator?).
    """
    kind = type(function)
    if not keywords and (  # a module, its bound method, a function without cells: only what it is given
        isinstance(function, Module) or (kind is types.FunctionType and not function.__closure__)
        or (kind is types.MethodType and isinstance(function.__self__, Module))
    ):
        if _reads.types_within(_ATOMS, inputs):
            if not module_generators_seen[0] and not module_containers_seen[0]:
                return _NO_ARGUMENT_STATE
            found = _module_generators(function)
            roots = _module_containers(function)
            return contents_snapshot(roots, found) if roots else (), _generator_states(found) if found else ()
    modules: list = []
    roots = (argument_roots(function, inputs, keywords, modules) or []) + _module_containers(function)
    found: list = _module_generators(function, modules)
    contents = contents_snapshot(roots, found) if roots else ()
    return contents, _generator_states(found) if found else ()


def _module_containers(function: object) -> list:
    """``[(label, list or dict)]`` the block's module (itself, its bound method, a partial of either; or
    each module its closure's cells hold) holds as attributes its classes' code names: a log it appends
    to, a memo, a cache (CKG112)."""
    if not module_containers_seen[0]:
        return []
    found = []
    for module in snapshot_roots(function):
        for path, name in _structure(module).containers:
            try:
                value = vars(module.get_submodule(path) if path else module).get(name)
            except AttributeError:
                continue
            if type(value) in (list, dict):
                found.append((f"the attribute {type(module).__name__}{'.' + path if path else ''}.{name}", value))
    return found


argument_state.takes_inputs = True  # type: ignore[attr-defined]


def argument_contents(function: object, inputs: tuple = (), keywords: Optional[dict] = None) -> tuple:
    """CKG112's part of :func:`argument_state`: the contents of the containers the block is given."""
    return argument_state(function, inputs, keywords)[0]


argument_contents.part_of = (argument_state, 0)  # type: ignore[attr-defined]


def _now(entry: tuple) -> object:
    _, value, kind, _ = entry
    return _version_of(value) if kind == "tensor" else _shallow(value, kind)


def _same(now: object, was: object) -> bool:
    """Two records of one container (or one tensor's versions) hold the same values, by identity."""
    if type(now) is not tuple or type(was) is not tuple:
        return now == was
    return len(now) == len(was) and all(
        _same_value(a, b)
        or (type(a) is tuple and type(b) is tuple and len(a) == 2 == len(b) and a[0] == b[0] and a[1] is b[1])
        for a, b in zip(now, was)
    )


def changed_at_all(was: tuple) -> list:
    """The entries of ``was`` not as they were then: any value came, went or was replaced."""
    return [entry for entry in was if not _same(_now(entry), entry[3])]


def changed_contents(was: tuple) -> list:
    """The entries of ``was`` changed in a way a gradient can depend on.

    A tensor updated in place; in a container, a value replaced (a counter,
    a position: the block may compute with it), or a tensor (or a container,
    which may hold one) that came or went.  A log the block appends devices
    or Python numbers to is not counted (fallback's replay puts such values
    back all the same).
    """
    return [
        entry for entry in changed_at_all(was)
        if entry[2] == "tensor" or _counts(_shallow(entry[1], entry[2]), entry[3], entry[2])
    ]


def values_only(was: tuple) -> bool:
    """Whether everything that changed in ``was`` is Python values, which a replay makes exact.

    A counter (``calls[0] += 1``), a step number, a position, a log of
    strings, a memo of numbers, a flag: no tensor came, went or was updated
    in place, every value that came, went or was replaced is a number,
    string, shape or tuple of such (a KV cache, where tensors come, is never
    one).  The recompute differs from the forward only where the block
    computes with such a value, and recomputing with the values the forward
    read, the new ones put back after, is exactly the uncheckpointed program
    either way (the log gets its line once): strict and fallback repair it
    without a word.
    """
    changed = changed_at_all(was)
    return bool(changed) and replayable(changed) and all(
        _immutable(value)
        for _, container, kind, recorded in changed
        for value in _moved(_shallow(container, kind), recorded, kind)
    )


def _same_value(a: object, b: object) -> bool:
    """The same object, or equal immutable values (a number, a shape, a tuple of them made anew)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if _in(_SCALARS, a):
        return a == b
    return type(a) in (tuple, frozenset) and _immutable(a) and _immutable(b) and a == b


def _counts(now: tuple, was: tuple, kind: str) -> bool:
    """Whether a change between two shallow contents is one a gradient can depend on (see :func:`changed_contents`)."""
    if _is_long(was) or _is_long(now):
        return any(_may_hold_tensors(item) for item in _moved(now, was, kind))
    if kind == "list":
        common = min(len(now), len(was))
        if not all(_same_value(a, b) for a, b in zip(now[:common], was[:common])):
            return True  # a value replaced in place (a counter in a box: counter[0] += 1)
        return any(_may_hold_tensors(item) for item in (*now[common:], *was[common:]))
    before, after = dict(was), dict(now)
    for key, value in after.items():
        if key in before:
            if not _same_value(value, before[key]):
                return True  # an entry or attribute replaced: a counter, a position, a flag
        elif _may_hold_tensors(value):
            return True
    return any(_may_hold_tensors(value) for key, value in before.items() if key not in after)


def carries_gradient(value: object) -> bool:
    """A tensor that requires grad (through torch.func's wrappers), or a container holding one."""
    if isinstance(value, Tensor):
        return requires_grad_anywhere(value)
    return any(kind == "tensor" and requires_grad_anywhere(t) for _, t, kind, _ in contents_snapshot([("", value)]))


def _moved(now: tuple, was: tuple, kind: str) -> list:
    """The values that came, went or were replaced between two shallow contents."""
    if kind == "list" or _is_long(was) or _is_long(now):
        moved = [a for a, b in zip(now, was) if a is not b]
        moved += [b for a, b in zip(now, was) if a is not b]
        return moved + list(now[len(was):]) + list(was[len(now):])
    before, after = dict(was), dict(now)
    moved = [value for key, value in after.items() if before.get(key, _GONE) is not value]
    return moved + [value for key, value in before.items() if after.get(key, _GONE) is not value]


def _may_hold_tensors(value: object) -> bool:
    return isinstance(value, Tensor) or (
        type(value) is tuple and any(_may_hold_tensors(item) for item in value)
    ) or _container_kind(value) is not None


def describe_contents(value: object) -> str:
    return "what the block was given" if value else "nothing watched"


def describe_contents_change(was: tuple, now: tuple = ()) -> str:
    """CKG112's change line: ``its argument 2.keys (a list): 1 item → 2 items``."""
    parts = []
    for path, value, kind, recorded in changed_contents(was):
        if kind == "tensor":
            parts.append(f"the tensor {path} was updated in place")
            continue
        what = f"a {type(value).__name__}" if kind == "object" else f"a {kind}"
        current = _shallow(value, kind)
        values = _values_replaced(recorded, current, kind)
        if values:
            parts.append(f"{path} ({what}): {values}")
            continue
        if kind == "object" and not _is_long(recorded):
            before, after = dict(recorded), dict(current)
            names = [k for k in {**before, **after} if after.get(k, _GONE) is not before.get(k, _GONE)]
            parts.append(f"{path} ({what}): {', '.join(map(str, names)) or 'attributes'} changed")
            continue
        was_len = recorded[1] if _is_long(recorded) else len(recorded)
        now_len = current[1] if _is_long(current) else len(current)
        parts.append(f"{path} ({what}): {_count(was_len)} → {_count(now_len)}" + (
            "" if now_len != was_len else ", other values"
        ))
    return "; ".join(parts) or "what the block was given changed"


def _values_replaced(was: tuple, now: tuple, kind: str, shown: int = 3) -> str:
    """``[0]: 0 → 1`` for Python values replaced in a container of unchanged keys; "" otherwise."""
    if _is_long(was) or _is_long(now):
        return ""
    before = dict(enumerate(was)) if kind == "list" else dict(was)
    after = dict(enumerate(now)) if kind == "list" else dict(now)
    if before.keys() != after.keys():
        return ""
    replaced = [key for key in after if not _same_value(after[key], before[key])]
    if not replaced or not all(_immutable(before[k]) and _immutable(after[k]) for k in replaced):
        return ""
    def name(key: object) -> str:
        return f".{key}" if kind == "object" else f"[{key!r}]"
    def short(value: object) -> str:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    text = ", ".join(f"{name(k)}: {short(before[k])} → {short(after[k])}" for k in replaced[:shown])
    return text + (f" and {len(replaced) - shown} more" if len(replaced) > shown else "")


def _count(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"




def restore_contents(entries: list) -> None:
    """Put each container of ``entries`` back to its recorded contents (not tensors, nor long records)."""
    for _, value, kind, recorded in entries:
        if kind == "tensor" or _is_long(recorded):
            continue
        if kind == "list":
            list.__setitem__(value, slice(None), recorded)  # type: ignore[arg-type]
        elif kind == "dict":
            dict.clear(value)  # type: ignore[arg-type]
            dict.update(value, recorded)  # type: ignore[arg-type]
        else:
            state = _object_state(value)
            if state is not None:
                state.clear()
                state.update(recorded)


def replayable(entries: list) -> bool:
    """Whether :func:`replaying_contents` can put these back: no tensor updated in place, no long record."""
    return not any(kind == "tensor" or _is_long(recorded) for _, _, kind, recorded in entries)


@contextlib.contextmanager
def replaying_contents(entries: list, lock: bool = True) -> Iterator[None]:
    """The recorded contents in these containers while the block runs; what they hold now, after.

    The containers are the user's objects, seen by every thread: with
    ``lock``, one replay at a time (a rare repair: CKG112 under fallback).
    The composable recompute replays without it, for every log or counter a
    block keeps: a block that waits for another thread's block (a barrier)
    must not wait for this lock too.  What they hold now is copied whole.
    """
    with REPLAY_LOCK if lock else contextlib.nullcontext():
        now = [(path, value, kind, _full(value, kind)) for path, value, kind, _ in entries if kind != "tensor"]
        restore_contents(entries)
        try:
            yield
        finally:
            restore_contents(now)


@contextlib.contextmanager
def replaying_generators(generators: Sequence[tuple], lock: bool = True) -> Iterator[None]:
    """Each ``(generator, state)`` at that state while the block runs; where it is now, after.

    As torch does for the default generators: the recompute draws what the
    forward drew, and the program's next draw is the one it would have made.
    ``lock``: as for :func:`replaying_contents`.
    """
    with REPLAY_LOCK if lock else contextlib.nullcontext():
        now = [(generator, generator.get_state()) for generator, _ in generators]
        for generator, state in generators:
            generator.set_state(state)
        try:
            yield
        finally:
            for generator, state in now:
                generator.set_state(state)


def _device_default_generators() -> tuple:
    """The default generators of the initialised accelerators (CUDA, XPU): torch's RNG replay's, not the user's."""
    found: tuple = ()
    for name in ("cuda", "xpu"):
        device = getattr(torch, name, None)
        if device is not None and getattr(device, "is_initialized", lambda: False)():
            found += tuple(getattr(device, "default_generators", ()))
    return found


def is_user_generator(generator: object) -> bool:
    return generator is not torch.default_generator and not any(
        generator is default for default in _device_default_generators()
    )


def _module_generators(function: object, given: Sequence[Module] = ()) -> list:
    """``[(label, generator)]`` held by the block's module (itself, its bound method, a partial of
    either) or by a module it is given (an argument, a closure cell, what a partial binds)."""
    block = block_module(function)
    modules = [block] if isinstance(block, Module) and module_generators_seen[0] else []
    modules += [m for m in given if m is not block]
    found = []
    for module in modules:
        for path, name in _structure(module).generators:
            try:
                value = vars(module.get_submodule(path) if path else module).get(name)
            except AttributeError:
                continue
            if type(value) is _Generator and is_user_generator(value):
                found.append((f"{type(module).__name__}{'.' + path if path else ''}.{name}", value))
    return found


def _generator_states(found: list) -> tuple:
    return tuple((label, generator, generator.get_state()) for label, generator in found)


def generator_states(function: object, inputs: tuple = (), keywords: Optional[dict] = None) -> tuple:
    """CKG113's part of :func:`argument_state`: ``((label, generator, state), ...)``."""
    return argument_state(function, inputs, keywords)[1]


generator_states.part_of = (argument_state, 1)  # type: ignore[attr-defined]


def moved_generators(was: tuple) -> list:
    """The entries of ``was`` whose generator is not in the state it was then (the block drew from it)."""
    return [entry for entry in was if not torch.equal(entry[1].get_state(), entry[2])]


def describe_generators(value: object) -> str:
    return "the user generators the block can draw from" if value else "no user generator"


def describe_generator_change(was: tuple, now: tuple) -> str:
    """CKG113's change line: ``the torch.Generator its argument 2 moved on since the forward``."""
    labels = [label for label, _, _ in moved_generators(was)]
    return "; ".join(
        f"the torch.Generator {label} moved on since the forward (the block drew from it, or code between "
        "the forward and the backward did)" for label in labels
    ) or (
        "a user generator moved on"
    )


