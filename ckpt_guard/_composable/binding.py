"""Binding a block's lifted tensors where it reads them, for one thread only.

The composable recompute (``_composable``) runs a block on tensors of its own
choosing: the same values the block would read, at the torch.func level the
recompute runs at.  This module finds those tensors and puts the chosen ones
in their place, without anything another thread could see:

* **What a block holds** (:func:`holdings`): the modules it reaches (through
  its closures, defaults, globals, ``functools.partial``, bound methods, the
  call's arguments, containers, dataclasses, the attributes of objects of the
  user's classes, a module's plain attributes and forward hooks), and the
  tensors held in places that can be rebuilt (closure cells, defaults,
  partials, containers, dataclass fields, objects' attributes).  Globals,
  class attributes and namespaces cannot be rebuilt: what they hold, at any
  depth, is unbindable (a call reading such a tensor is refused), and a read
  no walk found is caught by the run-time proof (``proof``).

* **Functions and containers are rebuilt, never mutated** (:func:`rebuild`):
  a closure gets a copy with new cells, a ``partial``, a bound method, a
  list, dict, tuple, dataclass or object of the user's class a copy holding
  the chosen tensors.  A copy made at plan time also *freezes* the closure
  cells (``m = MASKS[i]`` in a loop cannot change what the recompute reads).

* **Modules are bound, never copied** (:func:`bound`): a module's identity
  matters (hooks and forwards store state on it), so its ``_parameters`` and
  ``_buffers`` dicts are replaced, while some thread binds them, by a
  :class:`_Slots` dict that answers each thread from that thread's own view
  and every other thread from the real entries.  A plain attribute of the
  module (``m.scale = s``, a monkeypatched ``forward``, its forward-hook
  dict) is bound through the module's class: for that time the module's
  ``__class__`` is a stand-in subclass (same name) whose
  :class:`_ThreadAttribute` data descriptors answer each binding thread from
  its view and every other thread from the module's ``__dict__``.  Other
  threads see the same values, but ``type(module)`` is the stand-in while a
  binding lasts (``isinstance`` still holds).  When the last thread leaves,
  the module's own dicts hold exactly what they held (the same objects), plus
  whatever was assigned to them meanwhile, and its own class is back.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .._state import block_reads as _reads

Tensor = torch.Tensor
Module = torch.nn.Module
_get_ident = threading.get_ident

# --------------------------------------------------------------------------
# modules: per-thread views of their tensor slots


class _Slots(dict):
    """A module's ``_parameters`` / ``_buffers`` while some thread binds entries of it.

    ``views``: thread id -> {name: value}; that thread reads these instead.
    """

    def __init__(self, raw: dict) -> None:
        dict.__init__(self, raw)
        self.views: Dict[int, dict] = {}

    def __getitem__(self, key: str) -> Any:
        view = self.views.get(_get_ident())
        if view is not None and key in view:
            return view[key]
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if dict.__contains__(self, key) else default

    def __setitem__(self, key: str, value: Any) -> None:
        view = self.views.get(_get_ident())
        if view is not None and key in view:
            # this thread rebinds its own binding (a block's own swap): see :func:`rebinding`
            new = rebinding(value, dict.get(self, key, _ABSENT))
            if new is not _ABSENT:
                view[key] = new
        else:
            dict.__setitem__(self, key, value)

    def values(self) -> Any:  # type: ignore[override]
        return [self[k] for k in self]

    def items(self) -> Any:  # type: ignore[override]
        return [(k, self[k]) for k in self]

    def copy(self) -> dict:
        return dict(self.items())


class _ThreadAttribute:
    """A data descriptor on a module's stand-in class: ``module.<name>`` per thread.

    A thread that bound ``name`` reads its own value; every other thread reads
    the module's own attribute (its ``__dict__`` entry, else the class's).
    Being a data descriptor it wins over the instance ``__dict__``, which is
    left untouched.
    """

    __slots__ = ("name", "base")

    def __init__(self, name: str, base: type) -> None:
        self.name = name
        self.base = base  # the module's own class

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return getattr(self.base, self.name)
        views = _attribute_views.get(id(obj))
        if views:
            view = views.get(_get_ident())
            if view is not None and self.name in view:
                return view[self.name]
        found = obj.__dict__.get(self.name, _ABSENT)
        if found is not _ABSENT:
            return found
        # The module's own class's (a method, bound), else AttributeError: then Module.__getattr__
        # runs.  Looked up on that class, not through type(obj): another thread may put the
        # module's own class back while this lookup runs.
        for cls in self.base.__mro__:
            if self.name in cls.__dict__:
                found = cls.__dict__[self.name]
                get = getattr(type(found), "__get__", None)
                return get(found, obj, self.base) if get is not None else found
        raise AttributeError(self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        views = _attribute_views.get(id(obj))
        view = views.get(_get_ident()) if views else None
        if view is not None and self.name in view:
            new = rebinding(value, obj.__dict__.get(self.name, _ABSENT))
            if new is not _ABSENT:
                view[self.name] = new
        else:
            obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        views = _attribute_views.get(id(obj))
        view = views.get(_get_ident()) if views else None
        if view is not None and self.name in view:
            del view[self.name]
        elif obj.__dict__.pop(self.name, _ABSENT) is _ABSENT:
            raise AttributeError(self.name)


#: thread id -> the recomputes binding on it, innermost last: (the call's tensors as weak
#: references by id, the recompute's tensors), for :func:`as_recomputed`
_recomputed_as: Dict[int, List[Tuple[Dict[int, Any], Sequence[Any]]]] = {}


def rebinding(value: Any, own: Any) -> Any:
    """What a bound slot holds after the block, in this thread's recompute, writes ``value`` there
    (``own``: what the module itself holds there); :data:`_ABSENT`: the binding stays as it is.

    A tensor of the call is the recompute's tensor for it (:func:`as_recomputed`); the
    module's own tensor, written back, is no swap: the binding already stands for it as
    the forward read it (higher refills its fast weights from the newest ones, which a
    meta-optimizer may have re-bound since); anything else (a number, a tensor the block
    made) is the block's own write.
    """
    new = as_recomputed(value)
    if new is value and isinstance(value, Tensor) and value is own:
        return _ABSENT
    return new


def as_recomputed(value: Any) -> Any:
    """What a block writing ``value`` into a slot it is bound on means by it, in this thread's recompute.

    A block may bind its own tensors as it runs (higher's patched modules put
    the fast weights from a list of their own into ``_parameters`` at each
    call).  In the first forward those are the call's tensors, which the plan
    lifted; in a recompute the write would put them back over the recompute's
    own, whose gradient would then be lost (higher's fast weights got None).
    So a tensor of the call written there is the recompute's tensor for it; and
    the module's own tensor written there (what its ``_parameters`` holds now,
    which a meta-optimizer may have re-bound since: higher refills its fast
    weights from the newest ones) leaves the binding as it is, since the
    binding *is* the module's own tensor as the forward read it.
    """
    stack = _recomputed_as.get(_get_ident())
    if not stack:
        return value
    originals, tensors = stack[-1]
    if isinstance(value, Tensor):
        found = originals.get(id(value))
        return tensors[found[1]] if found is not None and found[0]() is value else value
    if type(value) in (list, tuple):  # an RNN's _flat_weights, set from the same box
        items = [as_recomputed(item) if isinstance(item, Tensor) else item for item in value]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
    return value


class _SlotsInstalled:
    """A module's ``_parameters`` or ``_buffers`` replaced by a :class:`_Slots` while bindings use it."""

    __slots__ = ("module", "own", "slots", "users")

    def __init__(self, module: Module, own: dict, slots: _Slots) -> None:
        self.module, self.own, self.slots = module, own, slots  # own: the module's own dict, put back after
        self.users = 0  # bindings using it


class _StandIn:
    """A module whose class is a stand-in while bindings use some of its plain attributes."""

    __slots__ = ("module", "own_class", "users")

    def __init__(self, module: Module) -> None:
        self.module, self.own_class = module, type(module)
        self.users: Dict[str, int] = {}  # attribute name -> bindings using it


_install_lock = threading.Lock()
_installed: Dict[Tuple[int, str], _SlotsInstalled] = {}  # (id(module), store) -> ...
_stand_ins: Dict[int, _StandIn] = {}  # id(module) -> ...
#: id(module) -> thread id -> {attribute name: value}
_attribute_views: Dict[int, Dict[int, dict]] = {}
#: (class, names) -> the stand-in class (bounded: a program binds few shapes of attributes)
_stand_in_classes: Dict[Tuple[type, frozenset], type] = {}
_ABSENT = object()


def _enter(module: Module, store: str) -> _Slots:
    """The stand-in for ``module.<store>`` (installed by the first binding; caller holds the lock)."""
    key = (id(module), store)
    entry = _installed.get(key)
    if entry is None:
        own = module.__dict__[store]
        entry = _installed[key] = _SlotsInstalled(module, own, _Slots(own))
        module.__dict__[store] = entry.slots
    entry.users += 1
    return entry.slots


def _leave(module: Module, store: str) -> None:
    key = (id(module), store)
    entry = _installed[key]
    entry.users -= 1
    if entry.users:
        return
    del _installed[key]
    own, current = entry.own, dict(dict.items(entry.slots))
    for name in [name for name in own if name not in current]:  # never empty meanwhile
        del own[name]
    own.update(current)  # the module's own dict again: same object, current entries
    module.__dict__[store] = own


def _stand_in_class(cls: type, names: frozenset) -> type:
    found = _stand_in_classes.get((cls, names))
    if found is None:
        if len(_stand_in_classes) >= 256:
            _stand_in_classes.clear()
        namespace: Dict[str, Any] = {name: _ThreadAttribute(name, cls) for name in names}
        namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__)
        found = _stand_in_classes[(cls, names)] = type(cls.__name__, (cls,), namespace)
    return found


def _bind_attributes(module: Module, names: List[str], delta: int) -> None:
    """Count ``names`` as bound (``delta`` 1) or not (-1) on ``module``; its class follows (caller holds the lock)."""
    entry = _stand_ins.get(id(module))
    if entry is None:
        entry = _stand_ins[id(module)] = _StandIn(module)
    users = entry.users
    for name in names:
        users[name] = users.get(name, 0) + delta
        if not users[name]:
            del users[name]
    if users:
        object.__setattr__(module, "__class__", _stand_in_class(entry.own_class, frozenset(users)))
    else:
        object.__setattr__(module, "__class__", entry.own_class)
        del _stand_ins[id(module)]


Binding = Tuple[Module, str, str, Any]  # (module, "_parameters" | "_buffers" | "__dict__", name, value)


#: thread id -> the bindings entered on it, innermost last (:func:`bindings_here`)
_entered: Dict[int, List[List[Binding]]] = {}
_entered_count = [0]  # over every thread: on the usual call none is entered, and one read says so


def bindings_here() -> Optional[List[Binding]]:
    """The bindings this thread is inside (a recompute replaying the forward's world), outermost
    first; None where there are none (the usual call).

    A checkpoint called inside such a recompute (a nested one) reads what the bindings
    show; its own recompute comes later, when they are gone, so it is run inside them again.
    """
    if not _entered_count[0]:
        return None
    entered = _entered.get(_get_ident())
    if not entered:
        return None
    return [binding for bindings in entered for binding in bindings]


def bound(bindings: List[Binding], recomputed_as: Optional[Tuple[Dict[int, Any], Sequence[Any]]] = None) -> "_Bound":
    """This thread reads each binding's value at ``module.<name>``; others read the module's own.

    ``recomputed_as``: (the call's tensors, ``{id: (weak reference, index)}``; the
    recompute's tensors by index): a bound slot the block writes one of the
    call's tensors into gets the recompute's instead (:func:`as_recomputed`).
    """
    return _Bound(bindings, recomputed_as)


class _Bound:
    """:func:`bound`'s context (a class, not a generator: entered once per recompute)."""

    __slots__ = ("bindings", "stores", "attributes", "previous", "recomputed_as")

    def __init__(self, bindings: List[Binding], recomputed_as: Optional[tuple] = None) -> None:
        self.bindings = bindings
        self.recomputed_as = recomputed_as

    def __enter__(self) -> None:
        bindings = self.bindings
        if not bindings:
            return
        thread = _get_ident()
        if self.recomputed_as is not None:
            _recomputed_as.setdefault(thread, []).append(self.recomputed_as)
        _entered.setdefault(thread, []).append(bindings)
        _entered_count[0] += 1
        stores: List[Tuple[Module, str]] = []
        attributes: Dict[int, Tuple[Module, List[str]]] = {}
        seen = set()
        for module, store, name, _ in bindings:
            if store == "__dict__":
                attributes.setdefault(id(module), (module, []))[1].append(name)
            elif (id(module), store) not in seen:
                seen.add((id(module), store))
                stores.append((module, store))
        with _install_lock:
            for module, store in stores:
                _enter(module, store)
            for module, names in attributes.values():
                _bind_attributes(module, names, 1)
        self.stores, self.attributes = stores, attributes
        previous: list = []
        self.previous = previous
        try:
            for module, store, name, value in bindings:
                if store == "__dict__":
                    views = _attribute_views.setdefault(id(module), {})
                else:
                    views = module.__dict__[store].views
                view = views.get(thread)
                if view is None:
                    view = views[thread] = {}
                previous.append((views, view, name, view.get(name, _ABSENT)))
                view[name] = value
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        if not self.bindings:
            return
        thread = _get_ident()
        entered = _entered[thread]
        entered.pop()
        if not entered:
            del _entered[thread]
        _entered_count[0] -= 1
        if self.recomputed_as is not None:
            stack = _recomputed_as[thread]
            stack.pop()
            if not stack:
                del _recomputed_as[thread]
        for views, view, name, was in reversed(self.previous):
            if was is _ABSENT:
                view.pop(name, None)
            else:
                view[name] = was
            if not view:
                views.pop(thread, None)
        with _install_lock:
            for module, names in self.attributes.values():
                _bind_attributes(module, names, -1)
                if id(module) not in _stand_ins:
                    _attribute_views.pop(id(module), None)
            for module, store in self.stores:
                _leave(module, store)


# --------------------------------------------------------------------------
# what a block holds, and the same graph rebuilt with other tensors

#: the attributes every ``nn.Module`` has (torch's bookkeeping): not user attributes
_MODULE_INTERNALS = frozenset(vars(Module()))
#: ... of which these hold the user's forward hooks, which run as part of the block, and how each
#: is called (a hook registered ``with_kwargs=True`` or ``always_call=True``): a recompute binds
#: the forward's copy of each, so a hook removed after the forward still runs, as it ran there
_HOOK_FLAGS = ("_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks", *_HOOK_FLAGS)
#: what the walk of a module's own attributes passes over: its internals except the forward hooks
_SKIPPED_INTERNALS = _MODULE_INTERNALS - frozenset(_FORWARD_HOOKS)


def _user_function(value: Any) -> bool:
    return isinstance(value, types.FunctionType) and (
        (getattr(value, "__module__", None) or "").split(".")[0] not in _reads.LIBRARY_ROOTS
    )


def _user_namespace(value: Any) -> bool:
    """A class, or an object with a ``__dict__``, of the user's code (not torch's, not a module of Python's)."""
    if isinstance(value, (types.ModuleType, Tensor, Module)) or callable(value) and not isinstance(value, type):
        return False
    owner = value if isinstance(value, type) else type(value)
    if (getattr(owner, "__module__", None) or "").split(".")[0] in _reads.LIBRARY_ROOTS:
        return type(value) is types.SimpleNamespace
    try:
        return isinstance(vars(value), (dict, types.MappingProxyType))
    except TypeError:  # no __dict__
        return False


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later)
        return False
    return True


class Hole:
    """Where a lifted tensor goes (``index`` into the recompute's inputs), or its bound ``method``.

    A plan keeps its block as a graph with holes in it, not with the call's tensors: those belong
    to the transforms of the call (and hold their graphs), the plan lives as long as the backward.
    """

    __slots__ = ("index", "method")

    def __init__(self, index: int, method: Optional[str] = None) -> None:
        self.index, self.method = index, method


class _Rebuild:
    """One pass over a block's graph: rebuilding it with ``swap``'s tensors (and ``fill``'s for holes),
    optionally recording what it meets."""

    def __init__(self, swap: Dict[int, Any], visit: Optional[Callable[[Any, bool], None]] = None,
                 fill: Optional[Any] = None) -> None:
        self.swap, self.fill, self.visit = swap, fill, visit  # visit(tensor_or_module, bindable)
        self.memo: Dict[int, Tuple[Any, bool]] = {}
        #: placed: the ids of the tensors swapped in, in what the walk returns (a lifted tensor placed nowhere
        #: is read unbound by the recompute: the plan refuses)
        self.budget, self.exhausted, self.placed = _reads.BUDGET, False, []
        #: the globals walked as unbindable (ids), those queued, whether a walk drains them (:meth:`_walk_unbound`)
        self.walked_unbound, self.unbound_queue, self.draining = set(), [], [False]

    def __call__(self, obj: Any) -> Tuple[Any, bool]:
        """``(obj rebuilt, whether a swapped tensor is inside)``."""
        if type(obj) is Hole:
            value = self.fill[obj.index]
            return (getattr(value, obj.method) if obj.method else value), True
        key = id(obj)
        done = self.memo.get(key)
        if done is not None:
            return done
        if issubclass(type(obj), Tensor):  # (by its real type, as every test here: a __class__ may raise)
            if self.visit is not None:
                self.visit(obj, True)
            new = self.swap.get(key, _ABSENT)
            result = (obj, False) if new is _ABSENT else (new, True)
            if new is not _ABSENT:
                self.placed.append(key)
            self.memo[key] = result
            return result
        if _reads.is_module(obj):
            if self.visit is not None:
                self.visit(obj, True)
            self.memo[key] = (obj, False)
            return obj, False
        if type(obj) is types.BuiltinMethodType and isinstance(getattr(obj, "__self__", None), Tensor):
            owner, changed = self(obj.__self__)  # checkpoint(w.add, x): the method of the lifted tensor
            if not changed:
                result = (obj, False)
            elif type(owner) is Hole:
                result = (Hole(owner.index, obj.__name__), True)
            else:
                result = (getattr(owner, obj.__name__), True)
            self.memo[key] = result
            return result
        if issubclass(type(obj), _reads.HOLDS_NOTHING) and not issubclass(type(obj), (types.FunctionType, functools.partial)):
            return obj, False
        self.budget -= 1
        if self.budget < 0:
            self.exhausted = True
            return obj, False
        self.memo[key] = (obj, False)  # a cycle leads back to the original
        placed = len(self.placed)
        try:
            result = self._rebuild(obj)
        except Exception:  # noqa: BLE001 - an object that cannot be copied stays as it is: nothing in it is bound
            result = (obj, False)
            del self.placed[placed:]  # (the plan refuses where a lifted tensor is then placed nowhere)
        self.memo[key] = result
        return result

    def _rebuild(self, obj: Any) -> Tuple[Any, bool]:
        if isinstance(obj, types.FunctionType):
            return self._function(obj)
        if isinstance(obj, functools.partial):
            func, f_changed = self(obj.func)
            args, a_changed = self._sequence(obj.args)
            keywords = {}
            k_changed = False
            for name, value in obj.keywords.items():
                keywords[name], changed = self(value)
                k_changed = k_changed or changed
            if func is obj.func and not (a_changed or k_changed):
                return obj, False
            return functools.partial(func, *args, **keywords), f_changed or a_changed or k_changed
        if type(obj) is types.MethodType:
            func, f_changed = self(obj.__func__)
            owner, o_changed = self(obj.__self__)
            if func is obj.__func__ and owner is obj.__self__:
                return obj, False
            return types.MethodType(func, owner), f_changed or o_changed
        if isinstance(obj, tuple):
            items, changed = self._sequence(obj)
            if not changed:
                return obj, False
            return (type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)), True
        if isinstance(obj, list):
            items, changed = self._sequence(obj)
            if not changed:
                return obj, False
            new = copy.copy(obj)
            new[:] = items
            return new, True
        if isinstance(obj, dict):
            if len(obj) > self.budget or _reads.only_plain(obj.values()):
                self.exhausted = self.exhausted or len(obj) > self.budget
                return obj, False
            changes = {}
            for k, v in obj.items():
                new_v, changed = self(v)
                if changed:
                    changes[k] = new_v
            if not changes:
                return obj, False
            new = copy.copy(obj)
            new.update(changes)
            return new, True
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {}
            for field in dataclasses.fields(obj):
                new_v, changed = self(getattr(obj, field.name))
                if changed:
                    changes[field.name] = new_v
            return self._with_attributes(obj, changes)
        if _reads.is_users_object(obj) and not isinstance(obj, (type, types.ModuleType)):
            attributes = getattr(obj, "__dict__", None)
            if not isinstance(attributes, dict) or _reads.only_plain(attributes.values()):
                return obj, False
            changes = {}
            for k, v in list(attributes.items()):
                new_v, changed = self(v)
                if changed:
                    changes[k] = new_v
            return self._with_attributes(obj, changes)
        return obj, False

    def _sequence(self, items: Any) -> Tuple[list, bool]:
        if _reads.only_plain(items):  # nothing to rebuild or visit, at C speed
            return list(items), False
        if len(items) > self.budget:
            self.exhausted = True
            return list(items), False
        out, any_changed = [], False
        for item in items:
            new, changed = self(item)
            out.append(new)
            any_changed = any_changed or changed
        return out, any_changed

    def _function(self, function: types.FunctionType) -> Tuple[Any, bool]:
        """A copy with new closure cells (frozen: later rebinding is not seen) and defaults.

        The copy exists before its cells are filled, so a function reaching itself
        through its closure (a recursive helper, ``nest`` calling ``nest``) reaches
        the copy, whose cells hold the chosen tensors at every depth, not the
        original, which would read the call's tensors from the second call down.
        """
        any_changed = False
        cells = function.__closure__
        copied = None
        if cells:
            new_cells = tuple(types.CellType() if _filled(cell) else cell for cell in cells)
            copied = types.FunctionType(
                function.__code__, function.__globals__, function.__name__, function.__defaults__, new_cells,
            )
            self.memo[id(function)] = (copied, False)  # a cycle leads to the copy
            for cell, new_cell in zip(cells, new_cells):
                if new_cell is cell:  # an empty cell (a name assigned later): shared
                    continue
                new, changed = self(cell.cell_contents)
                any_changed = any_changed or changed
                new_cell.cell_contents = new
        defaults, d_changed = self._sequence(function.__defaults__ or ())
        kwdefaults = dict(function.__kwdefaults__ or {})
        k_changed = False
        for name, value in list(kwdefaults.items()):
            kwdefaults[name], changed = self(value)
            k_changed = k_changed or changed
        if self.visit is not None and _user_function(function):  # its globals: found, not bindable
            namespace = function.__globals__
            for name in _reads.global_names(function.__code__):
                if name in namespace:
                    self._visit_unbindable(namespace[name])
        if not cells and not (d_changed or k_changed):
            return function, False
        if copied is None:
            copied = types.FunctionType(function.__code__, function.__globals__, function.__name__)
        copied.__defaults__ = tuple(defaults) if function.__defaults__ is not None else None
        copied.__kwdefaults__ = kwdefaults or function.__kwdefaults__
        copied.__dict__.update(function.__dict__)
        copied.__qualname__ = function.__qualname__
        copied.__module__ = function.__module__
        copied.__doc__ = function.__doc__
        return copied, any_changed or d_changed or k_changed

    def _visit_unbindable(self, value: Any) -> None:
        """A global: its modules are still bound (through the module itself), nothing it holds is (a helper,
        ``HELPER = make(w)``, a partial, a bound method, a callable object, a dict or list of them, a namespace)."""
        if _reads.is_module(value):
            self(value)
        elif self.visit is None:
            return
        elif isinstance(value, Tensor):
            self.visit(value, False)
        elif isinstance(value, type):  # a class of the user's: its attributes, a staticmethod's function, not its methods
            for item in list(vars(value).values())[: self.budget] if _user_namespace(value) else ():
                item = item.__func__ if isinstance(item, (staticmethod, classmethod)) else item
                if not (isinstance(item, types.FunctionType) and item.__qualname__.startswith(value.__qualname__ + ".")):
                    self._visit_unbindable(item)
        elif isinstance(value, (list, tuple, dict, functools.partial, types.MethodType)) or _user_function(value) \
                or _reads.is_users_object(value) or _user_namespace(value):
            self._walk_unbound(value)
        elif callable(value) and callable(_reads.attribute(value, "__wrapped__")):  # lru_cache, wraps: what it wraps
            self._walk_unbound(value.__wrapped__)

    def _walk_unbound(self, value: Any) -> None:
        """Walk ``value`` as unbindable (its modules still bound: nothing rebuilds a global, even where the same
        tensor is bound another way), in a walk of its own (this one's memo skips what it saw), out of one queue
        the outermost walk drains (a chain of global helpers does not deepen the stack), within the budget."""
        if id(value) not in self.walked_unbound:  # (not a global helper reaching itself, nor one seen already)
            self.walked_unbound.add(id(value))
            self.unbound_queue.append(value)
        if self.draining[0]:
            return
        visit, self.draining[0] = self.visit, True
        try:
            while self.unbound_queue:
                unbound = _Rebuild({}, lambda obj, bindable: visit(obj, bindable and _reads.is_module(obj)))  # type: ignore[misc]
                unbound.budget, unbound.walked_unbound, unbound.unbound_queue, unbound.draining = (
                    self.budget, self.walked_unbound, self.unbound_queue, self.draining)
                unbound(self.unbound_queue.pop())
                self.budget, self.exhausted = unbound.budget, self.exhausted or unbound.exhausted
        finally:
            self.draining[0] = False

    @staticmethod
    def _with_attributes(obj: Any, changes: dict) -> Tuple[Any, bool]:
        if not changes:
            return obj, False
        new = copy.copy(obj)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        return new, True


def rebuild(obj: Any, swap: Dict[int, Any], memo: Optional[_Rebuild] = None) -> Any:
    """``obj`` with every tensor in ``swap`` (by id) replaced where it is held (a copy where needed)."""
    return (memo or _Rebuild(swap))(obj)[0]


#: the plain values of a module's attributes a recompute puts back as the call found them
_SCALARS = frozenset({int, float, bool, str, complex, type(None)})


def _numpy_scalar(value: Any) -> bool:
    """A NumPy scalar (a timestep as ``np.float64``), never an object scalar."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic) and not isinstance(value, numpy.object_)


def module_attributes(module: Module) -> Iterator[Tuple[str, Any]]:
    """A module's own attributes that a block may read besides parameters, buffers and submodules."""
    for name, value in module.__dict__.items():
        if name in _MODULE_INTERNALS and name not in _FORWARD_HOOKS:
            continue
        yield name, value


@dataclasses.dataclass
class Holdings:
    """What a block holds (see the module docstring).  ``frozen``: the block with its cells frozen."""

    frozen: Any
    modules: List[Module]
    tensors: List[Tensor]  # held by the function in bindable places (cells, containers, ...)
    arguments: List[Tensor]  # in the call's arguments (any depth)
    unbindable: List[Tensor]  # held only where no copy can reach (globals, class attributes)
    #: (module, name, value): plain module attributes that are tensors or may reach one
    attributes: List[Tuple[Module, str, Any]]
    exhausted: bool  # the walk ran out of budget: what lies past it is left to the proof
    #: (module, name, value): the modules' plain numbers, flags and strings (NumPy scalars too)
    scalars: List[Tuple[Module, str, Any]] = dataclasses.field(default_factory=list)
    #: whether the ``attributes`` that are not tensors are known to hold no tensor, module or hook
    #: (a kept shape checked them): a recompute then has nothing of theirs to rebuild or bind
    plain_attributes: bool = False


def holdings(function: Any, args: tuple, kwargs: dict) -> Holdings:
    """Walk ``function`` and the call's arguments (see the module docstring)."""
    modules: Dict[int, Module] = {}
    unbindable: Dict[int, Tensor] = {}

    def visitor(tensors: Dict[int, Tensor]) -> Callable[[Any, bool], None]:
        def visit(obj: Any, bindable: bool) -> None:
            if _reads.is_module(obj):
                modules.setdefault(id(obj), obj)
            else:
                (tensors if bindable else unbindable).setdefault(id(obj), obj)
        return visit

    held: Dict[int, Tensor] = {}
    given: Dict[int, Tensor] = {}
    walk = _Rebuild({}, visitor(held))
    frozen, _ = walk(function)
    arguments = _Rebuild({}, visitor(given))
    arguments((args, kwargs))
    attributes: List[Tuple[Module, str, Any]] = []
    scalars: List[Tuple[Module, str, Any]] = []
    done: set = set()
    todo = list(modules.values())
    while todo:
        root = todo.pop()
        for owner in root.modules():
            if id(owner) in done:
                continue
            done.add(id(owner))
            modules.setdefault(id(owner), owner)
            for name, value in owner.__dict__.items():  # module_attributes(owner), inlined: the hot path
                if name in _SKIPPED_INTERNALS:
                    continue
                if isinstance(value, Tensor):
                    attributes.append((owner, name, value))
                    continue
                if type(value) in _SCALARS or _numpy_scalar(value):  # np.int64, np.bool_ too
                    scalars.append((owner, name, value))
                    continue
                if isinstance(value, _reads.HOLDS_NOTHING) and not isinstance(value, (types.FunctionType, functools.partial)):
                    continue
                if name in _FORWARD_HOOKS and not value:
                    continue
                known = len(modules)
                walk(value)
                attributes.append((owner, name, value))
                todo.extend(list(modules.values())[known:])
    return Holdings(
        frozen, list(modules.values()), list(held.values()), list(given.values()),
        # every tensor found where no binding reaches, lifted elsewhere or not: the block may read it
        # there, and a recompute would then read the call's own tensor (its gradient lost)
        list(unbindable.values()), attributes,
        walk.exhausted or arguments.exhausted, scalars,
    )

