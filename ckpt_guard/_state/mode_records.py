"""Marked modes (``@ckpt_guard.replayable_mode``): their records, replay and write-back.

A marked mode promises that what it computes depends only on its own instance
attributes.  Owns: the record of such a mode at the forward (its numbers, containers,
held tensors, class values), telling whether it moved by the recompute, running the
recompute under the forward's state and putting the current one back, and hiding the
recompute from torch's global saved-tensor hooks.  May not touch: which modes are the
user's (``modes``).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import torch
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.overrides import _get_current_function_mode_stack
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from . import block_reads as _reads
from .basics import Tensor, _GONE, _version_of, requires_grad_anywhere, top_saved_tensor_hooks
from .peel import member_functions
from .contents import (
    _ATOMS, _CONTENTS_BUDGET, _cell_contents, _count, _full, _generator_states, _immutable, _is_long,
    _object_state, _same_value, _shallow, _stateless, changed_at_all, contents_snapshot, moved_generators,
    replaying_contents, replaying_generators, restore_contents,
)


def describe_modes(modes: tuple[type, ...]) -> str:
    return "[" + ", ".join(m.__name__ for m in modes) + "]"


# --------------------------------------------------------------------------
# a user mode fallback re-enters for the recompute (CKG102/103)
#
# A mode the forward ran under and the recompute runs without makes the
# recompute save other tensors.  Re-entering the forward's mode object is
# right only if the mode computes the same thing the second time: it must
# depend on nothing but its own attributes (a scale, a counter, a generator),
# which fallback puts back to what the call found for the recompute and to
# what they hold now after it.  The guard cannot see that a mode reads a
# global or another object, so the user says it: ``ckpt_guard.replayable_mode``.

#: the class attribute ``replayable_mode`` sets, holding the class itself (a subclass is not marked)
REPLAYABLE_MODE_MARK = "__ckpt_guard_replayable_mode__"


def mark_replayable_mode(cls: type) -> type:
    """``ckpt_guard.replayable_mode``: mark a user mode class fallback may re-enter in the recompute."""
    if not isinstance(cls, type) or not issubclass(cls, (TorchDispatchMode, TorchFunctionMode)):
        raise TypeError(
            f"ckpt_guard.replayable_mode({cls!r}): expected a TorchDispatchMode or TorchFunctionMode "
            "subclass (the class, not an instance)"
        )
    setattr(cls, REPLAYABLE_MODE_MARK, cls)
    return cls


def is_replayable_mode(mode: object) -> bool:
    cls = type(mode)
    return cls.__dict__.get(REPLAYABLE_MODE_MARK) is cls


#: the tensors a replayable mode holds that need no gradient are copied at each call (their value
#: is what the recompute must see: a dispatch mode's in-place update moves no version counter);
#: more bytes than this make the mode unrecordable (fallback then runs the block plainly)
_MODE_COPY_LIMIT = 1 << 20


#: what the base classes' __init__ and __enter__ keep on a mode: pushed and popped in pairs
_MODE_BASE_ATTRIBUTES = frozenset({
    "old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
    "old_without_ignore_compile_internals_dispatch_mode_flags", "old_dispatch_mode_flag",
    "_dispatch_key", "_mode_key",
})


class ModeRecord(NamedTuple):
    """What fallback needs to recompute under a replayable mode as the forward did."""

    contents: tuple  # as CKG112 records a container: the mode object, what its attributes hold
    copies: tuple  # ((tensor, its value at the call), ...) for the tensors that need no gradient
    generators: tuple  # ((label, generator, state), ...)
    class_values: tuple = ()  # ((class, name, value), ...): numbers its classes hold (type(self).n += 1)


@contextlib.contextmanager
def _user_modes_off() -> Iterator[None]:
    """The guard's own tensor work (copies, comparisons) unseen by the user's modes."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        yield


def mode_record(mode: object) -> Optional[ModeRecord]:
    """:func:`_mode_record`, unseen by the user's modes (a function mode sees a tensor's ``_version`` read)."""
    with _user_modes_off():
        return _mode_record(mode)


def _mode_record(mode: object) -> Optional[ModeRecord]:
    """A replayable mode's state as the call finds it, or None if it cannot be put back.

    Its instance attributes and what they hold, four containers deep; a copy
    of each tensor among them that needs no gradient (a scale, a history);
    the state of each user generator among them.  None where some of its
    state could not be put back, or might live elsewhere: fallback then runs
    the block plainly.  See :func:`_unrecordable_class` and :func:`_stateless`
    for what counts.
    """
    cls = type(mode)
    if _object_state(mode) is None or _unrecordable_class(cls):
        return None
    label = cls.__name__
    own = _shallow(mode, "object")
    if _is_long(own):
        return None
    entries: list = [(label, mode, "object", own)]
    roots, found = [], []
    attributes = [(f"{label}.{name}", value) for name, value in own if name not in _MODE_BASE_ATTRIBUTES]
    budget = _CONTENTS_BUDGET
    while attributes:  # tensors among its attributes, in tuples too (the walk below records deeper ones)
        budget -= 1
        if budget < 0:
            return None  # more than the walk keeps: not all of its state could be put back
        path, value = attributes.pop()
        if isinstance(value, Tensor):
            entries.append((path, value, "tensor", _version_of(value)))
        elif type(value) is tuple:
            attributes += [(f"{path}[{i}]", item) for i, item in enumerate(value)]
        elif type(value) not in _ATOMS:
            roots.append((path, value))
    unrecorded: list = []
    entries += contents_snapshot(roots, found, unrecorded) if roots else ()
    if unrecorded or any(kind != "tensor" and _is_long(recorded) for _, _, kind, recorded in entries):
        return None  # state the replay could not put back: a deque, a module, another library's object
    tensors = [value for _, value, kind, _ in entries if kind == "tensor"]
    copies = _copies(tensors, dispatch=isinstance(mode, TorchDispatchMode))
    if copies is None:
        return None
    return ModeRecord(tuple(entries), copies, _generator_states(found), _class_values(cls))


#: what Python and typing keep in a class's own namespace: no state of the mode's
_CLASS_BOOKKEEPING = frozenset({
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
    "__orig_bases__", "__parameters__", "__firstlineno__", "__static_attributes__", "__type_params__",
    "__abstractmethods__", "_abc_impl", "__slots__", "__dataclass_fields__", "__dataclass_params__",
    "__match_args__", REPLAYABLE_MODE_MARK,
})


#: mode class -> _unrecordable_class's answer, worked out on its first record (weak: a user's class
#: must not outlive its last use)
_unrecordable_classes: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _unrecordable_class(cls: type) -> bool:
    known = _unrecordable_classes.get(cls)
    if known is None:
        known = _unrecordable_classes[cls] = _keeps_state_outside(cls)
    return known


def _user_classes(cls: type) -> list:
    return [
        klass for klass in cls.__mro__
        if klass is not object and (getattr(klass, "__module__", "") or "").split(".")[0] != "torch"
    ]


def _class_values(cls: type) -> tuple:
    """``((owner, name, value), ...)``: the plain values (numbers, strings, tuples of them) the mode's
    own classes hold now, and those its methods (and the functions they wrap) hold as attributes.

    A method that rebinds one (``type(self).calls += 1``, also creating it on
    a subclass; ``wrapper.calls = getattr(wrapper, "calls", 0) + 1`` in a
    decorator) changes the mode's state as an attribute of its own does.
    """
    functions, classes = _reachable_from(cls)
    owners = [*classes, *functions]
    return tuple(
        (owner, name, value) for owner in owners for name, value in vars(owner).items()
        if name not in _CLASS_BOOKKEEPING and not (name.startswith("__") and type(owner) is types.FunctionType)
        and _immutable(value)
    )


def _class_values_moved(values: tuple, cls: Optional[type] = None) -> bool:
    if cls is not None and len(_class_values(cls)) != len(values):
        return True  # a plain value came (a subclass's own counter, a decorator's first count) or went
    return any(not _same_value(vars(owner).get(name, _GONE), value) for owner, name, value in values)


#: mode class -> (its methods and the functions they wrap or close over, the user classes it and
#: they refer to: a nested ``class State: calls = 0``, a class in a closure)
_reachable: "weakref.WeakKeyDictionary[type, tuple]" = weakref.WeakKeyDictionary()


def _user_class(value: object) -> bool:
    if not isinstance(value, type):
        return False
    root = (getattr(value, "__module__", "") or "").split(".")[0]
    return root != "torch" and root not in _reads.LIBRARY_ROOTS


def _reachable_from(cls: type) -> tuple:
    """``(functions, classes)`` the mode class reaches through its classes' namespaces, its
    functions' attributes and closure cells, and the classes found there (bounded)."""
    known = _reachable.get(cls)
    if known is not None:
        return known
    functions: list = []
    classes: list = list(_user_classes(cls))
    seen: set = {id(c) for c in classes}
    stack = [value for klass in classes for value in vars(klass).values()]
    while stack and len(seen) <= _CONTENTS_BUDGET:
        value = stack.pop()
        if type(value) is not types.FunctionType and member_functions(value):  # a static method, a property
            stack += member_functions(value)
            continue
        if id(value) in seen:
            continue
        if type(value) is types.FunctionType:
            seen.add(id(value))
            functions.append(value)
            stack += [*value.__dict__.values(), *map(_cell_contents, value.__closure__ or ())]
        elif _user_class(value):
            for klass in value.__mro__:
                if _user_class(klass) and id(klass) not in seen:
                    seen.add(id(klass))
                    classes.append(klass)
                    stack += list(vars(klass).values())
    known = _reachable[cls] = (tuple(functions), tuple(classes))
    return known


def _set_class_values(values: Sequence[tuple]) -> None:
    for klass, name, value in values:
        if value is _GONE:
            if name in vars(klass):
                delattr(klass, name)
        else:
            setattr(klass, name, value)


def _keeps_state_outside(cls: type) -> bool:
    """Whether a mode class may keep state outside its instance ``__dict__``: slots, a mutable value
    held by a class of its own (a list shared by its instances, a mixin's), a method with a mutable
    default or a closure over one; so may a class it refers to (a nested one, one in a closure).
    torch's classes are not looked at.  Looked at once per class (a class given a mutable
    attribute after its first use is not seen)."""
    for klass in _reachable_from(cls)[1]:
        if set(vars(klass).get("__slots__", ())) - {"__dict__", "__weakref__"}:
            return True
        for name, value in vars(klass).items():
            if name in _CLASS_BOOKKEEPING or _immutable(value) or _stateless(value):
                continue
            return True
    return False


def _copies(tensors: list, dispatch: bool) -> Optional[tuple]:
    """``((tensor, copy), ...)`` for the tensors that need no gradient; None if they cannot be kept.

    A tensor that needs a gradient is not copied (the recompute must use that
    very tensor), and a dispatch mode may not hold one: an update inside
    ``__torch_dispatch__`` moves no version counter, so it could not be seen.
    Only plain dense tensors are copied (the replay writes the copy back into
    the tensor itself, so the block sees it too, if it reads it), none
    sharing memory with another held one or overlapping itself, within
    ``_MODE_COPY_LIMIT``.
    """
    copies, storages, size = [], set(), 0
    with _user_modes_off():
        for tensor in tensors:
            if requires_grad_anywhere(tensor):
                if dispatch:
                    return None
                continue
            if (
                type(tensor) not in (Tensor, torch.nn.Parameter) or is_functorch_wrapped_tensor(tensor)
                or tensor.layout is not torch.strided or tensor.is_meta
                or any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape))
            ):
                return None
            storage = tensor.untyped_storage().data_ptr()
            size += tensor.numel() * tensor.element_size()
            if storage in storages or size > _MODE_COPY_LIMIT:
                return None
            storages.add(storage)
            copies.append((tensor, tensor.detach().clone()))
    return tuple(copies)


def _same_bits(tensor: Tensor, copy: Tensor) -> bool:
    """Bitwise equal (NaN where NaN), unseen by the user's modes."""
    with _user_modes_off():
        if tensor.shape != copy.shape or tensor.dtype != copy.dtype:
            return False
        if tensor.numel() == 0:
            return True
        return torch.equal(tensor.detach().reshape(-1).view(torch.uint8), copy.reshape(-1).view(torch.uint8))


def _mode_moved(record: ModeRecord) -> bool:
    """Whether a replayable mode's state changed since ``record`` in a way its results can depend on."""
    with _user_modes_off():  # the comparisons (tensor versions, generator states) unseen by the user's modes
        return _mode_state_moved(record)


def _mode_state_moved(record: ModeRecord) -> bool:
    return (
        bool(changed_at_all(record.contents))  # a log it appends to too: the mode may read its length
        or bool(moved_generators(record.generators))
        or any(not _same_bits(tensor, copy) for tensor, copy in record.copies)
        or _class_values_moved(record.class_values, type(record.contents[0][1]))
    )


def modes_to_replay(was: object, now: object, dispatch: bool) -> Optional[tuple]:
    """``(popped, pushed, restated)``: how fallback gives the recompute the forward's user modes; None if it cannot.

    The recompute runs under the forward's modes alone, as the forward did:
    ``popped``, the user modes on top of the stack that are not the
    forward's (one around the backward only, another object of its class),
    taken off for the recompute; ``pushed``, the forward's replayable modes
    then missing, each ``(mode, record)``; ``restated``, its replayable modes
    still on the stack (the same objects), whose state is put back.  None
    when a mode to take off is not on top of the stack (torch's own mode
    above it) or a mode to push was not recorded.
    """
    instances, records = getattr(was, "instances", ()), getattr(was, "records", ())
    others = tuple(getattr(now, "instances", ()))
    if not instances:
        return None
    common = 0
    while common < min(len(instances), len(others)) and others[common] is instances[common]:
        common += 1
    popped = others[common:]
    pushed = list(zip(instances[common:], records[common:]))
    if any(record is None for _, record in pushed):
        return None
    if popped:
        stack = _get_current_dispatch_mode_stack() if dispatch else _get_current_function_mode_stack()
        top = stack[len(stack) - len(popped):]
        if len(top) != len(popped) or any(a is not b for a, b in zip(top, popped)):
            return None  # torch's own mode sits above one to take off: it cannot be popped alone
    restated = [(mode, record) for mode, record in zip(instances[:common], records[:common]) if record is not None]
    if not (popped or pushed or restated):
        return None
    return popped, pushed, restated


def mode_state_kept(replay: tuple) -> bool:
    """Whether the state recorded for a replay's modes can be put back (:func:`_records_kept`)."""
    _, pushed, restated = replay
    return _records_kept([record for _, record in (*pushed, *restated)])


def modes_updated_in_place(modes: Sequence[object]) -> bool:
    """Whether a marked mode of these stacks updated a tensor it holds where autograd sees it, or
    resized one, since the call: no forward can run again from the call's state then."""
    records = [record for stack in modes for record in getattr(stack, "records", ()) if record is not None]
    return not _records_kept(records)


def _records_kept(records: Sequence[ModeRecord]) -> bool:
    """Whether these records can be put back: no held tensor updated in place where autograd sees
    it since the call (:func:`_held_tensors_updated`), none resized or re-typed in place."""
    return not _held_tensors_updated(records) and all(
        tensor.shape == copy.shape and tensor.dtype == copy.dtype and tensor.stride() == copy.stride()
        for record in records for tensor, copy in record.copies
    )  # a held tensor resized or re-typed in place: its old value cannot be written back into it


def _held_tensors_updated(records: Sequence[ModeRecord]) -> bool:
    """Any tensor a mode holds updated in place where autograd sees it (its version moved) since the call.

    One that needs a gradient: the recompute must use that very tensor.  One
    that needs none: without checkpointing, a backward through an operation
    that saved it would raise ("modified by an inplace operation"); the
    replay's quiet write-back would hide that and use the new value.  (An
    update inside ``__torch_dispatch__`` moves no version, and is replayed.)
    """
    return any(
        kind == "tensor" and _version_of(value) != version
        for record in records for _, value, kind, version in record.contents
    )


def describe_mode_change(was: object, now: object) -> str:
    """CKG102/103's change line: the modes missing or added, or the replayable mode whose state moved."""
    parts = [f"{describe_modes(was)} → {describe_modes(now)}"] if tuple.__ne__(was, now) else []  # type: ignore[arg-type]
    others = getattr(now, "instances", ())
    for i, (mode, record) in enumerate(zip(getattr(was, "instances", ()), getattr(was, "records", ()))):
        if record is None:
            continue
        name = type(mode).__name__
        if i < len(others) and others[i] is not mode:
            parts.append(f"another {name} object than the forward's is active at the recompute")
        elif _mode_moved(record):
            what = [_describe_state_change(record.contents)] if changed_at_all(record.contents) else []
            what += ["a tensor it holds changed"] if any(not _same_bits(t, c) for t, c in record.copies) else []
            what += ["its generator moved on"] if moved_generators(record.generators) else []
            what += [
                f"{owner.__qualname__}.{name} changed" for owner, name, value in record.class_values
                if not _same_value(vars(owner).get(name, _GONE), value)
            ] or (["a value its class or a method holds came or went"] if _class_values_moved(
                record.class_values, type(mode)) else [])
            parts.append(f"the {name} mode's state moved on since the forward: " + "; ".join(what))
    return "; ".join(parts) or "the user modes changed"


def _describe_state_change(contents: tuple) -> str:
    """``Scaler.calls changed; Scaler.log: 2 items → 3 items``: what moved in a mode's recorded state."""
    parts = []
    for path, value, kind, recorded in changed_at_all(contents):
        if kind == "tensor":
            parts.append(f"{path} updated in place")
        elif kind == "object":
            before, after = dict(recorded), dict(_full(value, kind))
            names = [k for k in {**before, **after} if not _same_value(after.get(k, _GONE), before.get(k, _GONE))]
            parts.append(", ".join(f"{path}.{name}" for name in names) + " changed")
        else:
            parts.append(f"{path}: {_count(len(recorded))} → {_count(len(_full(value, kind)))}")
    return "; ".join(parts)


def only_state_moved(was: object, now: object) -> bool:
    """The recompute runs under the forward's very mode objects; only a replayable one's state moved."""
    others = getattr(now, "instances", ())
    instances = getattr(was, "instances", ())
    return len(others) == len(instances) and all(a is b for a, b in zip(others, instances))


def _write_quietly(pairs: Sequence[tuple]) -> None:
    """Each ``(tensor, value)``: the tensor's values set to ``value``'s as a dispatch mode's own update
    sets them: no version counter moves (a saved tensor stays valid), unseen by the user's modes."""
    if not pairs:
        return
    with _user_modes_off(), torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        for tensor, value in pairs:
            tensor.copy_(value)


@contextlib.contextmanager
def _tensor_values(copies: Sequence[tuple]) -> Iterator[None]:
    """Each ``(tensor, value)``: the tensor holds that value while the block runs, its own value after."""
    with _user_modes_off():
        now = [(tensor, tensor.detach().clone()) for tensor, _ in copies]
    try:
        _write_quietly(copies)
        yield
    finally:
        _write_quietly(now)


@contextlib.contextmanager
def _class_values_replayed(records: list) -> Iterator[None]:
    """The plain values the modes' classes held at the call while the block runs; today's after."""
    now = {cls: _class_values(cls) for cls in {type(mode) for mode, _ in records}}
    try:
        for mode, record in records:
            _put_class_values(type(mode), record.class_values)
        yield
    finally:
        for cls, values in now.items():
            _put_class_values(cls, values)


def _put_class_values(cls: type, values: Sequence[tuple]) -> None:
    """The mode's classes' plain values as ``values`` has them: set, and those that came since removed."""
    kept = {(klass, name) for klass, name, _ in values}
    for klass, name, _ in _class_values(cls):
        if (klass, name) not in kept:
            delattr(klass, name)
    _set_class_values(values)


def put_back_modes(modes: Sequence[object]) -> None:
    """Each replayable mode of these stacks back to its state at the call (a forward that must run again)."""
    for stack in modes:
        for record in getattr(stack, "records", ()):
            if record is None:
                continue
            restore_contents(changed_at_all(record.contents))
            for _, generator, state in record.generators:
                generator.set_state(state)
            _write_quietly(record.copies)
        for mode, record in zip(getattr(stack, "instances", ()), getattr(stack, "records", ())):
            if record is not None:
                _put_class_values(type(mode), record.class_values)


_top_hooks = top_saved_tensor_hooks

#: whether fallback can re-enter a replayable mode for a non-reentrant recompute: that recompute
#: runs torch's pack hook (``x.detach()``) for each saved tensor, which the mode must not see (the
#: forward's pack hook runs no operation); hiding it needs the hook, read off the hook stack
QUIET_RECOMPUTE_HOOKS = _top_hooks is not None


@contextlib.contextmanager
def _recompute_hooks_unseen(dispatch: bool) -> Iterator[None]:
    """Run torch's recompute pack and unpack hooks with the user's modes off (see QUIET_RECOMPUTE_HOOKS)."""
    top = _top_hooks() if _top_hooks is not None else None
    if top is None:
        yield
        return
    pack, unpack = top
    if dispatch:
        from torch.utils._python_dispatch import _disable_current_modes as modes_off
    else:
        modes_off = torch._C.DisableTorchFunction

    def quiet_pack(x: Tensor) -> Any:
        with modes_off():
            return pack(x)

    def quiet_unpack(x: Any) -> Any:
        with modes_off():
            return unpack(x)

    with torch.autograd.graph.saved_tensors_hooks(quiet_pack, quiet_unpack):
        yield


@contextlib.contextmanager
def replaying_modes(replay: tuple, dispatch: bool, inside_hooks: bool = False) -> Iterator[None]:
    """The forward's modes for the recompute: the others taken off the top of the stack, the missing
    ones pushed back (innermost last), each one's state as the call found it; all as before, after.

    A tensor the mode holds that needs no gradient holds its value at the
    call again (written in place, as the mode's own update writes it: the
    block sees it too where it reads that tensor), and its current value
    after.  Pushed by the base class's ``__enter__``:
    the mode's own ``__enter__`` and ``__exit__`` (a report printed at exit,
    a counter reset) run once, as without checkpointing.  ``inside_hooks``: a
    non-reentrant recompute, whose saved-tensor hooks the modes must not see.
    """
    popped, pushed, restated = replay
    records = [record for _, record in (*pushed, *restated)]
    contents = [entry for record in records for entry in record.contents if entry[2] != "tensor"]
    generators = [(g, state) for record in records for _, g, state in record.generators]
    copies = [pair for record in records for pair in record.copies]
    base = TorchDispatchMode if dispatch else TorchFunctionMode
    if dispatch:
        from torch.utils._python_dispatch import _pop_mode_temporarily
    else:
        from torch.overrides import _pop_mode_temporarily  # type: ignore[no-redef]
    with contextlib.ExitStack() as stack:
        for _ in popped:
            stack.enter_context(_pop_mode_temporarily())
        stack.enter_context(replaying_contents(contents))
        stack.enter_context(replaying_generators(generators))
        stack.enter_context(_tensor_values(copies))
        stack.enter_context(_class_values_replayed([*pushed, *restated]))
        for mode, _ in pushed:
            base.__enter__(mode)
            stack.callback(base.__exit__, mode, None, None, None)
        if inside_hooks:
            stack.enter_context(_recompute_hooks_unseen(dispatch))
        yield
