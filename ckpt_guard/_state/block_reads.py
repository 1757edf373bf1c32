"""What a checkpointed function reads: its modules, and the tensors it holds.

One walk serves every rule that asks "whose parameters does this block use?":
CKG003 / CKG006 (trainable parameters inside), CKG101 (which module tensors a
parameter swap may have replaced), CKG108 (which parameters an optimizer step
may have changed).  It finds, as far as Python lets us see without running
the function:

* an ``nn.Module`` (run whole), or its ``forward`` / ``__call__`` bound method;
* a bound method of a module other than those (``checkpoint(gan.generate, z)``):
  that module may be used only in part;
* ``functools.partial``: its function, as above, and its bound arguments and
  keywords as a closure's cells (a parent module bound there may be used only
  in part; a tensor bound there is read as is) — transformers checkpoints
  ``partial(layer.__call__, **kwargs)`` and, in 5.x, ``partial(forward, self, ...)``;
* what a function holds in its closure cells or default arguments, or names
  as globals (``checkpoint(block_fn, x)`` where ``block_fn`` uses a
  module-level ``model``), and modules or tensors inside a list, tuple or dict
  held there, and in those it holds (``checkpoint_sequential`` closes over a
  list of modules; ``[[block, head]]``): a module found there may be used only
  in part;
* the functions and partials held that way, walked the same way: the helpers
  the block calls (``lambda t: inner(t)`` where ``inner`` uses the layer; a
  ``functools.wraps`` decorator's wrapper; ``self.fn = lambda t: layer(t)``);
* a class or a Python module of the user's used as a namespace
  (``Layers.encoder``, ``models.encoder``): the attributes the code holding it
  names (:func:`namespace_values`);
* behind an object of the user's held that way (a config, a trainer, the owner
  of a method, the block itself as a callable object): the attributes the code
  holding it names, or the code of the helpers it calls (``cfg.layers["k"]``:
  ``layers``; :func:`reach_code`), and those named by each method or property
  of its class so named (``self.generate`` → ``self.G``; its special methods
  where it is used whole), :func:`names_read`; a ``__slots__`` object's slots
  alike; what an ``operator.attrgetter`` or ``methodcaller`` held there names,
  and what the ``forward`` of a module of the user's held there names (the
  object may be handed to it); every attribute where the code reads one by a
  computed name.  A module found there may be used only in part.

That is the *direct* view (``Reads.whole``, ``partial``, ``tensors``): what
the call-time rules CKG003 / CKG006 and CKG108 count, so that a block is not
blamed for a model it merely has a path to.  Functions of torch and the
standard library are not walked (they hold no module of the user's).  The
*complete* view (:meth:`Reads.complete`) goes on from there:

* objects of the user's own classes (a callable object, the owner of a
  method): all their attributes (``__dict__``) as a closure's cells, and their
  class's ``__call__``.

The complete view is what the composable recompute lifts, CKG101 compares
and CKG008 searches: there, missing a tensor is a wrong gradient and finding
one too many costs nothing.  It stops after :data:`BUDGET` values looked at.

In the complete view an object without a ``__dict__`` (``__slots__``), or
whatever is past the budget, is not looked into: the walk says so (``unseen``;
in the direct view an object of the user's class counts as unseen too), and every rule says how
it treats what it cannot see.  Numbers, strings, torch's own objects and the
like cannot hide a module.  A function's globals are the names its code
loads as globals (its nested code objects', comprehensions', included), not
attribute names that happen to match one.

The walk never raises into the user's call: a callable whose attribute lookup
raises (a ``__getattr__`` that raises ``KeyError``, say) is simply not looked
into (``Reads.unseen``).
"""

from __future__ import annotations

import dis
import functools
import operator
import types
from dataclasses import dataclass
from types import MethodType
from typing import Any, Iterator, List, Optional, Tuple

from .basics import Module, Tensor, is_module
from .peel import function_of, member_functions


def _module_or_tensor(value: Any) -> bool:
    """A tensor or a module, by its real type (:func:`~.basics.is_module`)."""
    return issubclass(type(value), Tensor) or is_module(value)


#: Methods that run a module whole.
_CALL_METHODS = frozenset({"forward", "__call__", "_call_impl", "_wrapped_call_impl"})
_BROKEN = object()


@dataclass(frozen=True)
class Reads:
    """What ``function`` reads, as far as it can be seen."""

    whole: Tuple[Module, ...] = ()  # modules run whole
    partial: Tuple[Module, ...] = ()  # modules it may use only in part
    tensors: Tuple[Tensor, ...] = ()  # tensors captured or bound, read as they are
    unseen: bool = False  # something could not be looked into
    # beyond the direct view: behind held functions and objects of the user's classes
    deep: Tuple[Module, ...] = ()
    deep_tensors: Tuple[Tensor, ...] = ()
    deep_unseen: bool = False  # the complete walk could not see everything

    @property
    def modules(self) -> Tuple[Module, ...]:
        return self.whole + self.partial

    def complete(self) -> "Reads":
        """Everything found, direct or not, as one view (``unseen``: the complete walk's)."""
        return Reads(self.whole, self.partial + self.deep, self.tensors + self.deep_tensors, self.deep_unseen)

    def named_module_tensors(self) -> Iterator[Tuple[str, Module, str, str, Tensor]]:
        """``(path, owner, store, name, tensor)`` for every tensor the modules hold.

        Parameters and buffers, and plain tensor attributes (``m.scale = s``,
        which ``functional_call`` also swaps): ``store`` is ``"_parameters"``,
        ``"_buffers"`` or ``"__dict__"`` of ``owner``.  Modules a module holds
        in a plain list, tuple or dict attribute (not registered) are visited
        too.  ``path`` reads like ``Net.inner.weight``.  Each owner once.
        """
        seen = set()
        todo = list(self.modules)
        while todo:
            root = todo.pop(0)
            for prefix, owner in root.named_modules():
                if id(owner) in seen:
                    continue
                seen.add(id(owner))
                base = ".".join(p for p in (type(root).__name__, prefix) if p)
                for store in ("_parameters", "_buffers"):
                    for name, tensor in getattr(owner, store).items():
                        if isinstance(tensor, Tensor):
                            yield f"{base}.{name}", owner, store, name, tensor
                for name, value in list(vars(owner).items()):
                    if isinstance(value, Tensor):
                        yield f"{base}.{name}", owner, "__dict__", name, value
                    elif isinstance(value, (list, tuple, dict)) and len(value) <= 64 and not name.startswith("_"):
                        items = value.values() if isinstance(value, dict) else value
                        todo.extend(m for m in items if is_module(m))


def attribute(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)``, or ``_BROKEN`` if the lookup raises anything else."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a user's __getattr__ may raise anything
        return _BROKEN


# Values that cannot hide a module or a tensor the function reads.
HOLDS_NOTHING = (
    str, bytes, int, float, complex, bool, type(None), type, range, slice,
    types.FunctionType, types.BuiltinFunctionType, types.ModuleType, functools.partial,
)
# Objects of these libraries hold no module of the user's (types.SimpleNamespace can: not listed).
LIBRARY_ROOTS = frozenset({
    "builtins", "torch", "typing", "enum", "math", "logging", "warnings", "functools",
    "itertools", "operator", "collections", "contextlib", "threading", "re", "os", "sys",
    "abc", "dataclasses", "inspect", "weakref", "numbers", "copy", "numpy", "unittest",
})
#: How many values the complete walk looks at before it gives up (and says so):
#: a block that holds a million-element list, or an object with a huge
#: ``__dict__``, costs a bounded walk, not a walk of all of it.
BUDGET = 5000


#: values no walk looks into (a container of only these holds no module, tensor or function)
PLAIN_TYPES = frozenset({int, float, bool, str, bytes, complex, type(None)})


def types_within(kinds: frozenset, values: Any) -> bool:
    """Whether every value's type is one of ``kinds``, checked at C speed (False where a type's metaclass makes
    it unhashable)."""
    try:
        return kinds.issuperset(map(type, values))
    except TypeError:
        return False


def only_plain(values: Any) -> bool:
    """Whether ``values`` are all numbers, strings or None (a config's table): checked at C speed."""
    return types_within(PLAIN_TYPES, values)


def _walkable(value: Any) -> bool:
    """A function, partial, bound method or object of the user's a held value may hide a module behind."""
    if type(value) is types.FunctionType:
        return (getattr(value, "__module__", None) or "").split(".")[0] not in LIBRARY_ROOTS
    return issubclass(type(value), functools.partial) or type(value) is MethodType or is_users_object(value)


def is_users_object(value: Any) -> bool:
    """Whether ``value`` is an object that might hide modules from the walk.  (Here and in every test of what
    a value is, its real type: ``__class__``, which ``isinstance`` also asks, may lie, as a
    ``Mock(spec=nn.Linear)``'s does, or raise.)"""
    if issubclass(type(value), HOLDS_NOTHING):
        return False
    return _module_root(type(value)) not in LIBRARY_ROOTS


def is_namespace(value: Any) -> bool:
    """Whether ``value`` is a class or a Python module of the user's, whose attributes code may read as a
    namespace's (``Layers.encoder``, ``models.encoder``): read by the names that code names."""
    if issubclass(type(value), type):
        return _module_root(value) not in LIBRARY_ROOTS
    if issubclass(type(value), types.ModuleType):
        name = attribute(value, "__name__")
        return isinstance(name, str) and name.split(".")[0] not in LIBRARY_ROOTS
    return False


def namespace_values(namespace: Any, names: frozenset) -> Tuple[ClassReads, list]:
    """``(reads, [(name, value)])``: what code naming ``names`` reads of a class or a Python module used as a
    namespace: the attributes so named (a class's through its own classes, no metaclass code runs), and, of
    a class, the names its static and class methods and properties so named name in turn (:func:`names_read`;
    every attribute where one of those reads by a computed name).  A computed read in the code holding it
    (``getattr(torch, name)``, ``getattr(x, "scale", 1)``) is not taken for one of the namespace's: that
    made a module of hundreds of names read whole on every call, and blamed its every model (a
    ``getattr(models, name)`` is unseen: docs/limits.md)."""
    names = names - _COMPUTED_READS
    if issubclass(type(namespace), types.ModuleType):
        attributes = attribute(namespace, "__dict__")
        if not isinstance(attributes, dict):
            return _READS_NOTHING, []
        return ClassReads(names, (), (), (), False), [(name, attributes[name]) for name in names if name in attributes]
    reads = names_read(namespace, names)
    members: dict = {}
    for klass in reversed(namespace.__mro__):
        if _module_root(klass) not in LIBRARY_ROOTS:
            members.update(vars(klass))
    if reads.every_attribute:
        return reads, list(members.items())
    return reads, [(name, members[name]) for name in reads.names if name in members]


#: how deep containers held in containers are looked into (``[[block, head]]``, ``{"stages": [...]}``)
CONTAINER_DEPTH = 3


def _held(value: Any, limit: int = BUDGET) -> Tuple[List[Any], bool, int]:
    """``(modules, tensors and functions to walk, opaque?, values looked at)`` for a value a closure cell,
    a global or a partial holds.

    Inside a list, tuple or dict (and those it holds, :data:`CONTAINER_DEPTH` deep): the modules and
    tensors, and the functions, partials, methods and objects of the user's to walk further.  One
    longer than ``limit``, or deeper, is not looked into (opaque).
    """
    if _module_or_tensor(value) or _walkable(value) or is_namespace(value):
        return [value], False, 1
    if isinstance(value, (list, tuple, dict)):
        found: List[Any] = []
        todo, looked = [(value, CONTAINER_DEPTH)], 0
        while todo:
            container, depth = todo.pop()
            looked += len(container)
            if looked > limit or depth == 0:
                return found, True, looked
            for item in (container.values() if isinstance(container, dict) else container):
                if _module_or_tensor(item) or _walkable(item) or is_namespace(item):
                    found.append(item)
                elif isinstance(item, (list, tuple, dict)):
                    todo.append((item, depth - 1))
        return found, False, looked
    return [], is_users_object(value), 1


def _referenced(function: Any) -> Iterator[Any]:
    """What a Python function holds: closure cells, default arguments, its globals."""
    cells = attribute(function, "__closure__")
    if cells is _BROKEN:
        raise LookupError("__closure__")
    for cell in cells or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    yield from attribute(function, "__defaults__") or ()
    yield from (attribute(function, "__kwdefaults__") or {}).values()
    code, namespace = attribute(function, "__code__"), attribute(function, "__globals__")
    if isinstance(code, types.CodeType) and isinstance(namespace, dict):
        for name in global_names(code):
            if name in namespace:
                yield namespace[name]


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
#: code object -> the names it loads as globals; bounded (generated code makes new ones forever)
_global_names_of: dict = {}


def global_names(code: types.CodeType) -> frozenset:
    """The names ``code`` loads as globals, its nested code objects' (comprehensions) included."""
    names = _global_names_of.get(code)
    if names is None:
        found = set()
        todo = [code]
        while todo:
            current = todo.pop()
            found.update(i.argval for i in dis.get_instructions(current) if i.opname in _GLOBAL_LOADS)
            todo.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
        if len(_global_names_of) >= 1024:
            _global_names_of.clear()
        names = _global_names_of[code] = frozenset(found)
    return names


@functools.lru_cache(maxsize=1024)
def code_names(code: types.CodeType) -> frozenset:
    """The names ``code`` and its nested code name (attributes, globals, methods): ``co_names``, deeply."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= code_names(constant)
    return frozenset(names)


#: what may follow the load of ``self`` where only its attributes are read or written
_ATTRIBUTE_USES = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR", "COPY", "DUP_TOP", "LOAD_SUPER_ATTR"})


@functools.lru_cache(maxsize=1024)
def uses_itself(code: types.CodeType) -> bool:
    """Whether a method's code uses its ``self`` other than through an attribute (``self(h)``, ``helper(self)``):
    then what ``__call__`` reads is the block's too."""
    if not code.co_argcount:
        return False
    itself = code.co_varnames[0]
    instructions = list(dis.get_instructions(code))
    for at, instruction in enumerate(instructions):
        name = instruction.opname
        if "LOAD_FAST" not in name:
            continue
        loaded = instruction.argval
        if isinstance(loaded, tuple):  # 3.13: LOAD_FAST_LOAD_FAST loads both, STORE_FAST_LOAD_FAST the second
            if name.startswith("LOAD_FAST") and loaded[0] == itself:
                return True  # below the other on the stack: an operand of what follows
            loaded = loaded[-1]
        if loaded == itself:
            following = instructions[at + 1].opname if at + 1 < len(instructions) else ""
            if following not in _ATTRIBUTE_USES:
                return True
    return False


#: how many functions of the user's :func:`reach_code` reads the code of
REACH_NAMES_LIMIT = 16


def reach_code(function: types.FunctionType) -> Tuple[frozenset, tuple]:
    """``(names, facts)``: what ``function``'s code names (:func:`method_names`), and per code object what it
    names and the constant keys it subscripts with (:func:`code_facts`), with the same of each function of the
    user's it holds (closure cells, defaults, globals; a partial's or a bound method's function), in turn: an
    object it hands on to a helper (``lambda t: run(cfg, t)``, ``run`` reading ``cfg.layer``) is read by the
    helper's code.  Up to :data:`REACH_NAMES_LIMIT` functions."""
    names: set = set()
    facts: list = []
    todo, done = [function], set()
    while todo and len(done) < REACH_NAMES_LIMIT:
        current = todo.pop()
        if current.__code__ in done:
            continue
        done.add(current.__code__)
        names |= method_names(current)
        facts.append(code_facts(current.__code__))
        try:
            held = list(_referenced(current))
        except Exception:  # noqa: BLE001 - a function whose attributes cannot be read: its own names only
            continue
        for value in held:
            if is_module(value):  # an object handed to a module's forward is read by that code
                helper = attribute(type(value), "forward")
            elif type(value) in (operator.attrgetter, operator.methodcaller):  # get(cfg): reads cfg.<its names>
                names |= _getter_names(value)
                continue
            else:
                helper = function_of(value) if isinstance(value, (types.FunctionType, functools.partial, MethodType)) else None
            if type(helper) is types.FunctionType and (
                    getattr(helper, "__module__", None) or "").split(".")[0] not in LIBRARY_ROOTS:
                todo.append(helper)
    return frozenset(names), tuple(facts)


def _getter_names(getter: Any) -> frozenset:
    """The attribute names an ``operator.attrgetter`` reads (``"a.b"``: both), or the method an
    ``operator.methodcaller`` calls."""
    try:
        made, arguments = getter.__reduce__()[:2]
        if isinstance(made, functools.partial):  # methodcaller("run", k=2): partial(methodcaller, "run", k=2)
            arguments = made.args
        return frozenset(part for name in arguments if isinstance(name, str) for part in name.split("."))
    except Exception:  # noqa: BLE001 - a getter of another shape: every attribute
        return frozenset({"getattr"})


#: instructions after which which items of a container are read cannot be told from the code
_READS_ANY_ITEM = frozenset({
    "GET_ITER", "FOR_ITER", "BUILD_SLICE", "BINARY_SLICE", "CALL_FUNCTION_EX", "DICT_MERGE", "DICT_UPDATE",
    "LIST_EXTEND", "UNPACK_SEQUENCE", "UNPACK_EX",
})
#: container methods that read items by a key the code computes, or all of them
_ITEM_METHODS = frozenset({"get", "values", "items", "keys", "pop", "popitem", "setdefault", "__getitem__", "copy"})


@functools.lru_cache(maxsize=1024)
def subscript_keys(code: types.CodeType) -> Optional[frozenset]:
    """The constant keys ``code`` (and its nested code) subscripts with (``self.nets["G"]``, ``layers[0]``;
    none: it subscripts nothing), or None where it may read any item: a computed key, a slice, a loop, an
    unpacking, a container method (``.values()``, ``.get(k)``)."""
    keys: set = set()
    todo = [code]
    while todo:
        current = todo.pop()
        if not _ITEM_METHODS.isdisjoint(current.co_names):
            return None
        before = None
        for instruction in dis.get_instructions(current):
            name = instruction.opname
            if name in _READS_ANY_ITEM:
                return None
            if name in ("BINARY_SUBSCR", "STORE_SUBSCR", "DELETE_SUBSCR"):
                if before is None or before.opname != "LOAD_CONST":
                    return None
                keys.add(before.argval)
            before = instruction
        todo.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return frozenset(keys)


def code_facts(code: types.CodeType) -> Tuple[frozenset, Optional[frozenset]]:
    """``(names, keys)`` of one code object: :func:`code_names` and :func:`subscript_keys`."""
    return code_names(code), subscript_keys(code)


def keys_read(facts: Any, name: Optional[str]) -> Optional[frozenset]:
    """The keys the code in ``facts`` reads of the container held by the attribute ``name`` (None: of the
    object itself, a dict or list subclass): the constant keys of each code naming it; None (any item)
    where one of them reads items another way, or subscripts nothing (``sum(cfg.layers)`` iterates in C),
    or none names it."""
    found: frozenset = frozenset()
    relevant = False
    for names, keys in facts:
        if name is None or name in names:
            relevant = True
            if not keys:
                return None
            found = found | keys
    return found if relevant else None


def method_names(function: types.FunctionType) -> frozenset:
    """What a method's code names, ``__call__`` too where it uses its ``self`` whole (``self(h)``)."""
    code = function.__code__
    return code_names(code) | {"__call__"} if uses_itself(code) else code_names(code)


#: names whose code reads attributes by a computed name: then every attribute is the code's read
_COMPUTED_READS = frozenset({"getattr", "vars", "__dict__", "__getattribute__", "attrgetter", "methodcaller"})
#: the names to read an object by where no code says which (every attribute, and its ``__call__``)
EVERY_NAME = frozenset({"__dict__", "__call__"})
#: what code holding an object of the user's may run of it without naming anything (``obj(h)``, ``for m
#: in obj``, ``obj[k]``): :func:`names_read` reads ``__call__`` as the object used whole, its special methods
CALLED = frozenset({"__call__"})


#: special methods that make, show, copy or compare an object, not what using it computes
_NOT_RUN_BY_USE = frozenset({
    "__init__", "__new__", "__init_subclass__", "__del__", "__repr__", "__str__", "__format__", "__reduce__",
    "__reduce_ex__", "__getstate__", "__setstate__", "__copy__", "__deepcopy__", "__setattr__", "__delattr__",
    "__set_name__", "__class_getitem__", "__post_init__", "__hash__", "__eq__", "__ne__", "__sizeof__", "__dir__",
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__slots__", "__annotations__",
    "__getattribute__", "__getattr__",  # (a Python one of the class's makes every attribute read: names_read)
})


def _runs_implicitly(name: str) -> bool:
    """Whether the special method ``name`` may run where code uses an object whole (``obj(h)``,
    ``for m in obj``, ``obj[k]``, ``obj + h``, ``with obj:``): a dunder that is not construction,
    display, copying or comparison."""
    return name.startswith("__") and name.endswith("__") and name not in _NOT_RUN_BY_USE


@dataclass(frozen=True)
class ClassReads:
    """What code naming some names may read of an object of a class (:func:`names_read`)."""

    names: frozenset  # the instance attributes it may read
    methods: Tuple[types.FunctionType, ...]  # the class's methods and properties it may run
    facts: tuple  # per code object of those methods: what it names, the constant keys it subscripts with
    slots: tuple  # the member descriptors of those names (a ``__slots__`` class)
    every_attribute: bool  # it reads by a computed name (``getattr``, ``vars``, a ``__getattr__``): all of them


def names_read(cls: type, names: frozenset) -> ClassReads:
    """:func:`read_names`, cached per class and names (a class whose metaclass makes it unhashable: read anew)."""
    try:
        hash(cls)
    except TypeError:
        return read_names(cls, names)
    return _names_read_cached(cls, names)


def read_names(cls: type, names: frozenset) -> ClassReads:
    """What code that names ``names`` may read of an object of ``cls``.

    ``names``, and the names each method or property of the class they name names in turn
    (``self.helper(h)``), with those methods' functions: a superset of the ``obj.<name>`` the code
    reads, and no more of the class (a GAN trainer's ``self.D``, read in another method, is not the
    generator's block's read).  Code that reads by a computed name reads every attribute.  Read once
    per class and names.
    """
    members: dict = {}
    for klass in reversed(cls.__mro__):
        if (getattr(klass, "__module__", None) or "").split(".")[0] not in LIBRARY_ROOTS:
            members.update(vars(klass))
    if "__call__" in names:  # used whole (called, iterated, indexed, added to): its special methods may run
        names = names | {name for name in members if _runs_implicitly(name)}
    found, methods, done = set(names), [], set()
    facts: tuple = ()
    todo = [members[name] for name in names if name in members]
    opaque = False  # a member whose code cannot be read (a descriptor of the user's, property(attrgetter(...)))
    while todo:
        member = todo.pop()
        functions = member_functions(member, reading=True)
        if not functions:
            getter = getattr(type(member), "__get__", None)
            if isinstance(getter, types.FunctionType):  # a descriptor written in Python: what its __get__ reads
                todo.append(getter)
            else:  # property(attrgetter(...)): code that cannot be read
                opaque = opaque or (isinstance(member, property) and member.fget is not None)
            continue
        value = functions[0]
        code = value.__code__
        if code in done:
            continue
        done.add(code)
        methods.append(value)
        more, more_facts = reach_code(value)  # (and the helpers it hands ``self`` to: ``_apply(self, t)``)
        facts += more_facts
        found |= more
        todo += [members[name] for name in more if name in members]
    every = opaque or not found.isdisjoint(_COMPUTED_READS) or any(
        type(members.get(hook)) is types.FunctionType for hook in ("__getattr__", "__getattribute__"))
    wanted = members if every else {name: members[name] for name in found if name in members}
    slots = tuple(v for v in wanted.values() if type(v) is types.MemberDescriptorType)
    return ClassReads(frozenset(found), tuple(methods), facts, slots, every)


_names_read_cached = functools.lru_cache(maxsize=1024)(read_names)
_READS_NOTHING = ClassReads(frozenset(), (), (), (), False)


def named_values(owner: Any, reads: ClassReads) -> list:
    """``(name, value)`` for ``owner``'s attributes ``reads`` names: its own (read past any ``__getattr__`` of
    its class), its slots' (by their member descriptors), its class's, and, for a dict, list or tuple of the
    user's class (an AttrDict, a NamedTuple), its items as a plain container (name None) or its named fields;
    no user code runs."""
    try:
        attributes = object.__getattribute__(owner, "__dict__")
    except Exception:  # noqa: BLE001 - __slots__ only, or a __dict__ of the class's that raises
        attributes = None
    if type(attributes) is not dict:
        attributes = {}
    found = list(attributes.items()) if reads.every_attribute else [
        (name, attributes[name]) for name in reads.names if name in attributes]
    for slot in reads.slots:
        try:
            found.append((slot.__name__, slot.__get__(owner)))
        except Exception:  # noqa: BLE001 - an empty slot
            continue
    # a module or a tensor the class holds under a name read (looked up now: a class attribute may be
    # re-bound after names_read cached its answer), from each class's own __dict__ (no metaclass code runs)
    classes = [vars(klass) for klass in type(owner).__mro__ if _module_root(klass) not in LIBRARY_ROOTS]
    for name in reads.names:
        if name not in attributes:
            held = next((members[name] for members in classes if name in members), None)
            if issubclass(type(held), (Tensor, list, tuple, dict)) or is_module(held):
                found.append((name, held))
    if issubclass(type(owner), (dict, list, tuple)):  # a user's subclass (an AttrDict, a NamedTuple): its items too
        fields = getattr(type(owner), "_fields", None)
        if issubclass(type(owner), tuple) and isinstance(fields, tuple) and not reads.every_attribute:
            found += [(field, tuple.__getitem__(owner, i)) for i, field in enumerate(fields[:len(owner)])
                      if field in reads.names]
        elif len(owner) <= BUDGET:  # as a plain container (read by its keys, or whole: _items_read)
            found.append((None, dict(dict.items(owner)) if issubclass(type(owner), dict) else (
                list.copy(owner) if issubclass(type(owner), list) else tuple(tuple.__iter__(owner)))))
    return found


def attribute_values(owner: Any, reads: ClassReads) -> list:
    """The values of :func:`named_values`."""
    return [value for _, value in named_values(owner, reads)]


def _module_root(klass: type) -> str:
    module = getattr(klass, "__module__", None)
    return module.split(".")[0] if isinstance(module, str) else ""


def clear_caches() -> None:
    _global_names_of.clear()
    code_names.cache_clear()
    uses_itself.cache_clear()
    _names_read_cached.cache_clear()


class _Named:
    """An object of the user's the direct view reached, the names the code that holds it names, and what
    each code object of it names and subscripts with (:func:`code_facts`)."""

    __slots__ = ("owner", "names", "facts")

    def __init__(self, owner: Any, names: frozenset, facts: tuple):
        self.owner, self.names, self.facts = owner, names, facts


def reads_of(function: Any) -> Reads:
    """Walk ``function`` (see the module docstring); never raises."""
    found: dict = {"whole": [], "partial": [], "tensors": [], "deep": [], "deep_tensors": []}
    direct_unseen = deep_unseen = False
    seen: set = set()
    named: set = set()  # (id of an object of the user's, the names) the direct view followed
    budget = [BUDGET]
    # Two tiers: everything the direct view covers first, so that what it finds is
    # counted as direct even if a deeper path reaches it too.
    direct: List[Tuple[Any, bool, bool]] = [(function, True, True)]  # (object, run whole?, look into it?)
    deeper: List[Tuple[Any, bool, bool]] = []
    for is_deep, todo in ((False, direct), (True, deeper)):
        while todo and budget[0] > 0:
            obj, run_whole, look_into = todo.pop()
            budget[0] -= 1
            if type(obj) is _Named:  # (before ``seen``: an object is followed again for names new to it)
                if (id(obj.owner), obj.names) in named:
                    continue
                named.add((id(obj.owner), obj.names))
                try:
                    unseen = _follow_named(obj, todo, deeper, budget)
                except Exception:  # noqa: BLE001 - never raise into the user's call
                    unseen = True
                direct_unseen = direct_unseen or unseen
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            # the code holding what is queued here: the direct view follows the attributes it names of an
            # object of the user's it holds (none in the complete view)
            holder = function_of(obj) if not is_deep and look_into else None
            try:
                if is_module(obj):
                    found["deep" if is_deep else ("whole" if run_whole else "partial")].append(obj)
                elif isinstance(obj, Tensor):
                    found["deep_tensors" if is_deep else "tensors"].append(obj)
                elif isinstance(obj, functools.partial):
                    # the function runs as its own; what is bound may be used only in part (a module,
                    # or one in a list or dict bound there), an object of the user's is walked as a held one
                    todo.append((obj.func, run_whole, True))
                    unseen = _queue_held((*obj.args, *obj.keywords.values()), todo, deeper, budget, holder)
                    deep_unseen = deep_unseen or unseen
                    direct_unseen = direct_unseen or (unseen and not is_deep)
                elif type(obj) is MethodType:
                    owner = obj.__self__
                    if is_module(owner):
                        name = attribute(obj.__func__, "__name__")
                        todo.append((owner, run_whole and name in _CALL_METHODS, False))
                        if not (run_whole and name in _CALL_METHODS) and holder is not None:  # gan.generate: self.G
                            todo += [(m, False, False) for m in named_submodules(owner, code_names(holder.__code__))]
                    else:  # a method of the user's object: what the object holds, and the method
                        if is_users_object(owner):
                            if is_deep:
                                deeper.append((owner, False, True))
                            else:  # the attributes its code names (a trainer's G, not its D), then all
                                function_ = function_of(obj)
                                if function_ is not None:
                                    todo.append((_Named(owner, *reach_code(function_)), False, False))
                                direct_unseen = True
                                deeper.append((owner, False, True))
                        todo.append((obj.__func__, False, look_into))
                elif look_into and isinstance(obj, types.FunctionType):
                    held = _referenced(obj)
                    unseen = _queue_held(held, todo, deeper, budget, holder)
                    deep_unseen = deep_unseen or unseen
                    direct_unseen = direct_unseen or (unseen and not is_deep)
                elif look_into and is_users_object(obj):  # an object of the user's: its attributes, and its __call__
                    if not is_deep:  # the block itself is one: what its __call__ names, then all
                        todo.append((_Named(obj, CALLED, ()), False, False))
                    direct_unseen = direct_unseen or not is_deep
                    attributes = attribute(obj, "__dict__")
                    if not isinstance(attributes, dict):  # __slots__, or a lookup that raises
                        deep_unseen = True
                        continue
                    call = attribute(type(obj), "__call__")
                    held = [*attributes.values(), *([call] if isinstance(call, types.FunctionType) else [])]
                    deep_unseen = _queue_held(held, deeper, deeper, budget) or deep_unseen
            except Exception:  # noqa: BLE001 - never raise into the user's call
                deep_unseen = True
                direct_unseen = direct_unseen or not is_deep
    if budget[0] <= 0 and (direct or deeper):
        deep_unseen = True  # out of budget with things left to look at
    return Reads(
        tuple(found["whole"]), tuple(found["partial"]), tuple(found["tensors"]), direct_unseen or deep_unseen,
        tuple(found["deep"]), tuple(found["deep_tensors"]), deep_unseen,
    )


def _follow_named(reached: _Named, todo: list, deeper: list, budget: list) -> bool:
    """The direct view into an object of the user's: the attributes the code that reached it names
    (``config.layers["k"]``, ``self.G``), and those its class's methods so named name in turn
    (:func:`names_read`); the methods themselves are walked as a method's function is.  Only what
    the code names: a trainer's discriminator is not its generator block's read.  True if unseen."""
    owner = reached.owner
    if is_namespace(owner):  # a class or a Python module used as a namespace
        reads, named = namespace_values(owner, reached.names)
    else:
        reads = names_read(type(owner), reached.names)
        named = named_values(owner, reads)
    todo.extend((method, False, True) for method in reads.methods)
    facts = reached.facts + reads.facts
    values = [_items_read(value, keys_read(reached.facts if name is None else facts, name)) for name, value in named]
    return _queue_held(values, todo, deeper, budget, code=(reads.names, facts))


#: how many submodules deep :func:`named_submodules` follows names (``self.gan.G.body``)
_SUBMODULE_DEPTH = 4


def named_submodules(module: Module, names: frozenset) -> List[Module]:
    """The submodules of ``module`` that code naming ``names`` reaches by name (``gan.G``: a LightningModule's
    ``self.generator``, and their named submodules in turn): a module used in part is counted as a whole only
    where all of it changed (CKG108), so the part the code names is counted too."""
    found: List[Module] = []
    todo = [(module, _SUBMODULE_DEPTH)]
    while todo:
        parent, depth = todo.pop()
        children = vars(parent).get("_modules") if depth else None
        if not isinstance(children, dict):  # (an OrderedDict before torch 2.5)
            continue
        for name in names.intersection(children):
            child = children[name]
            if is_module(child) and all(child is not m for m in found):
                found.append(child)
                todo.append((child, depth - 1))
    return found


def _items_read(value: Any, keys: Optional[frozenset]) -> Any:
    """Of a dict, list or tuple an object's attribute holds, the items the code's constant keys read
    (``self.nets["G"]``, not ``self.nets["D"]``); all of it where the keys are not known."""
    if keys is None or type(value) not in (dict, list, tuple) or len(value) > BUDGET:
        return value
    if type(value) is dict:
        return [item for key, item in value.items() if key in keys]
    size = len(value)
    at = {key % size for key in keys if type(key) is int and -size <= key < size}
    return [item for index, item in enumerate(value) if index in at]


def _queue_held(values: Any, todo: list, deeper: list, budget: list, holder: Any = None, code: Any = None) -> bool:
    """Queue what a function or an object holds; True if some of it cannot be seen.

    Modules and tensors go on ``todo`` (the tier of the holder); functions and
    objects of the user's on ``deeper`` (the complete view only).  In the direct
    view, an object of the user's goes on ``todo`` too, for the attributes of it
    and the items of its containers that ``code`` (names, facts) reads, or the code
    of the function ``holder`` reaches (:func:`reach_code`, read once an object is
    found): :func:`_follow_named`.
    """
    unseen = False
    for value in values:
        budget[0] -= 1
        if budget[0] < 0:
            return True
        found, opaque, looked = _held(value, budget[0])
        budget[0] -= looked
        unseen = unseen or opaque
        for v in found:
            if _module_or_tensor(v):
                todo.append((v, False, False))
                if (code is not None or holder is not None) and is_module(v):  # ``gan.G(z)``: gan.G, by name
                    names = code[0] if code is not None else code_names(holder.__code__)
                    todo += [(m, False, False) for m in named_submodules(v, names)]
            elif is_namespace(v):  # the attributes the code holding it names (``Layers.encoder``)
                if code is not None or holder is not None:
                    names, facts = code if code is not None else (code_names(holder.__code__), (code_facts(holder.__code__),))
                    todo.append((_Named(v, names, facts), False, False))
            else:
                deeper.append((v, False, True))
                if code is None and holder is None:  # the complete view only
                    continue
                if isinstance(v, (types.FunctionType, functools.partial)):  # a helper the code calls: its reads too
                    todo.append((v, False, True))
                elif type(v) is MethodType and isinstance(v.__self__, Module):  # ``f = layer.forward``: its module
                    todo.append((v.__self__, False, False))
                elif type(v) is MethodType and is_users_object(v.__self__):  # ``f = holder.run``: what it reads
                    function = function_of(v)
                    if function is not None:
                        todo.append((_Named(v.__self__, *reach_code(function)), False, False))
                elif is_users_object(v):
                    if code is None:
                        code = reach_code(holder)
                    names, facts = code
                    todo.append((_Named(v, names | CALLED, facts), False, False))  # (``obj(h)``: its __call__)
    return unseen


def trainable_tensors(function: Any) -> Iterator[Tensor]:
    """Tensors ``function`` may train: of its modules in training mode, and those it holds.

    A module in eval mode is being used for inference, so its parameters do
    not make a call-time rule (CKG003, CKG006) fire.
    """
    found = reads_of(function)
    for module in found.modules:
        if module.training:
            yield from module.parameters()
    yield from found.tensors


def held_tensors(function: Any) -> Iterator[Tensor]:
    """Every tensor ``function`` may read besides its arguments.

    Its modules' parameters, buffers and plain tensor attributes, in training
    or eval mode, and the tensors it holds.  Forward-mode AD (CKG008) asks
    this: torch's recipe for forward AD with modules puts a dual tensor on a
    module with ``setattr`` (a plain attribute, not a parameter), and a module
    in eval mode is differentiated forward as often as one in training.
    """
    found = reads_of(function).complete()
    for module in found.modules:
        for owner in module.modules():
            for value in (*owner._parameters.values(), *owner._buffers.values(), *vars(owner).values()):
                if isinstance(value, Tensor):
                    yield value
    yield from found.tensors
