"""Reader: what a checkpointed block's modules hold (CKG106, CKG110, CKG111).

Owns: the generated block snapshot (one compiled function per module shape: its
parameters and buffers, its forward hooks, its train/eval flags), the re-bound values
(CKG110: a parameter or attribute replaced between the forward and the recompute),
hook changes (CKG111) and train/eval changes (CKG106).  A module the snapshot cannot
read (TorchScript, a C++ module) gives nothing to compare, never an error.  May not
touch: the containers the block is given (``contents``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import types
import weakref
from typing import Callable, Optional

import torch

from .. import _files
from .basics import Module, _GONE, _Generator, _cell_contents, is_module
from .block_reads import code_names
from .closures import block_slots, closure_cells, object_slots, reached_modules
from .peel import innermost_partial, member_functions, peel


# --------------------------------------------------------------------------
# what the block reads by reference, re-bound between forward and recompute (CKG110)
#
# A meta-optimizer (torchopt's MetaSGD, higher's differentiable optimizers)
# writes new, non-leaf tensors into a module's ``_parameters`` after the inner
# forward; a one-shot forward hook (nnsight) is removed after it; a loop
# rebinds a variable a checkpointed lambda closes over.  The recompute then
# reads other tensors, or runs other hooks, than the forward did.  The
# capture keeps what the block reads by reference: the entries of its
# modules' parameter, buffer and forward-hook dicts (for a module, its bound
# method, or a partial of either), or the contents of a function's closure
# cells.  Compared by identity.


_TENSOR_STORES = ("_parameters", "_buffers")
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
#: set once a checkpointed block holding an nn.RReLU is seen: until then CKG009 costs one read
rrelu_seen = [False]
#: set once a checkpointed module whose code names a list or dict it holds is walked: until then
#: CKG112 looks at no module's attributes
module_containers_seen = [False]


class _Structure:
    """A checkpointed module's shape, walked once per module (a block keeps its shape).

    It holds no module (a weak reference to check the id, the submodules'
    paths): the guard must never keep a model alive.  ``snapshot(module)`` is
    generated for the shape and shared by every module of that shape (no loop,
    no per-module call: it runs on every checkpoint call).  It walks from the
    module to each submodule by name, as the forward will, and returns
    ``(copies of each module's parameter and buffer dicts, copies of its
    forward (pre-)hook dicts or None when there are none, each module's
    training flag)``, or None when the module no longer has this shape (a
    submodule added, removed or replaced by one of another shape): the
    structure is then walked again.
    """

    __slots__ = ("ref", "paths", "shape", "rrelus", "generators", "attributes", "containers", "snapshot")

    def __init__(self, module: Module) -> None:
        self.ref = weakref.ref(module)
        named = _every_path(module)
        self.paths = tuple(path for path, _ in named)
        self.rrelus = [weakref.ref(m) for _, m in named if isinstance(m, torch.nn.RReLU)]  # CKG009's
        if self.rrelus:
            rrelu_seen[0] = True
        self.generators = _generator_attributes(module)  # CKG113's
        # per module: (path, number of children, has parameters, has buffers)
        shape = self.shape = tuple(
            (path, len(m._modules), bool(m._parameters), bool(m._buffers)) for path, m in named
        )
        # a class that binds its own tensors in its forward (higher's patched modules keep their fast
        # weights so): what the forward read is what it bound, re-read when the forward ends
        binds = any(_binds_in_forward(type(m)) for _, m in named)
        # CKG115's: (module index, attribute name) of each plain value its class's code names
        self.attributes = tuple(
            (i, name) for i, (_, m) in enumerate(named) for name in _read_names(type(m))
            if _watched(m.__dict__.get(name, _GONE))
        )
        # CKG112's: (path, name) of each list or dict its class's code names (a log, a memo, a cache)
        self.containers = tuple(
            (path, name) for path, m in named for name in _read_names(type(m))
            if type(m.__dict__.get(name)) in (list, dict)
        )
        if self.containers:
            module_containers_seen[0] = True
        self.snapshot = _snapshots.get((binds, shape, self.attributes)) or _compile_snapshot(
            shape, binds, self.attributes
        )

    def modules(self, module: Module) -> list:
        """The modules in snapshot order (for messages and replays, not the hot path); [] if the shape changed."""
        try:
            return [module.get_submodule(path) for path in self.paths]
        except AttributeError:
            return []

    def owners(self, module: Module, hooks: bool) -> list:
        """``[(module, dict name)]`` in the order of the snapshot's tensor part (or its hook part)."""
        modules = self.modules(module)
        if hooks:
            return [(m, store) for m in modules for store in _HOOK_DICTS]
        return [
            (m, store) for m, (_, _, has_parameters, has_buffers) in zip(modules, self.shape)
            for store, has in (("_parameters", has_parameters), ("_buffers", has_buffers)) if has
        ]


def _every_path(module: Module) -> list:
    """``named_modules()`` with every path to a shared submodule (each can be re-bound on its own).

    A module graph with a cycle has endless paths: then each module once.
    """
    unique = list(module.named_modules())
    try:
        every = list(itertools.islice(module.named_modules(remove_duplicate=False), 4 * len(unique) + 64))
    except RecursionError:
        return unique
    return unique if len(every) > 4 * len(unique) + 63 else every


# the module's shape -> its generated snapshot
_snapshots: dict = {}


class InForward(tuple):
    """The tensor part of a snapshot of a module that binds its own tensors in its forward.

    higher's patched modules (:func:`_binds_in_forward`) set their fast weights
    from a box of their own at each call: at the call the
    module still holds what its last call bound, so the patch point re-reads
    these dict copies, in place, when the forward ends (:func:`refresh_after_forward`).
    A module of the record that the block does not call is compared too: which
    modules a forward called is not recorded (higher's ``update_params`` binds
    every module before the call, so "unchanged in the forward" does not mean
    "not read"), so a later call binding it differently is a CKG110 under strict
    (docs/limits.md).
    """


def _binds_in_forward(cls: type) -> bool:
    """A module class known to bind its own tensors in its forward: higher's patched modules.

    Only those: other classes with a ``__setattr__`` of their own (Opacus' DPLSTM,
    torchopt's MetaGradientModule) bind nothing in their forward, and fallback keeps
    checkpointing them (a re-bind found at the recompute raises there, as strict).
    """
    return any(
        base.__name__ == "_MonkeyPatchBase" and (base.__module__ or "").startswith("higher")
        for base in cls.__mro__
    )


def needs_refresh(bindings: object) -> bool:
    """Whether a captured CKG110 record is re-read when the forward ends (see :class:`InForward`)."""
    kind = type(bindings)
    return kind is InForward or (kind is ClosureRead and any(type(t) is InForward for t in bindings[2]))


def refresh_after_forward(function: object, recorded: object) -> None:
    """Re-read, in place, what a block's modules that bind their own tensors bound in the forward just run.

    Whatever it fails to read leaves the call's record as it was (compared as before).
    """
    try:
        _refresh_all(function, recorded)
    except Exception:  # noqa: BLE001 - a module the guard cannot read: the call's record stands
        pass


def _refresh_all(function: object, recorded: object) -> None:
    if type(recorded) is ClosureRead:
        for module, tensors in zip(recorded[1], recorded[2]):
            if type(tensors) is InForward:
                _refresh(module, tensors)
    elif type(recorded) is InForward:
        block = block_module(function)
        if isinstance(block, Module):
            _refresh(block, recorded)


def _refresh(module: Module, recorded: "InForward") -> None:
    owners = _structure(module).owners(module, False)
    if len(owners) != len(recorded):
        return  # its shape changed in the forward: the recompute compares with the call's record
    for (owner, store), kept in zip(owners, recorded):
        kept.clear()
        kept.update(getattr(owner, store))


def _compile_snapshot(shape: tuple, binds: bool = False, attributes: tuple = ()) -> Callable[[Module], Optional[tuple]]:
    # Each module's __dict__ is read once and subscripted: an attribute read on a
    # module goes through nn.Module's __getattr__ hook, several times slower.  A
    # parameter or buffer dict empty when the shape was taken is checked to be
    # empty still (part of the shape), not copied.
    index = {path: i for i, (path, *_) in enumerate(shape)}
    walk, same, tensors, hooks, any_hook, flags, forwards = [], [], [], [], [], [], []
    for i, (path, children, has_parameters, has_buffers) in enumerate(shape):
        if i:
            parent, _, name = path.rpartition(".")
            walk.append(f"        d{i} = d{index[parent]}['_modules'][{name!r}].__dict__\n")
        same.append(f"len(d{i}['_modules']) == {children}" if children else f"not d{i}['_modules']")
        for store, has in (("_parameters", has_parameters), ("_buffers", has_buffers)):
            if has:
                tensors.append(f"copy(d{i}[{store!r}]), ")
            else:
                same.append(f"not d{i}[{store!r}]")
        hooks.append(f"copy(d{i}['_forward_pre_hooks']), copy(d{i}['_forward_hooks']), ")
        any_hook.append(f"d{i}['_forward_pre_hooks'] or d{i}['_forward_hooks']")
        flags.append(f"d{i}['training'], ")
        forwards.append(f"get{i}('forward'), ")
    values = "".join(f"d{i}.get({name!r}, GONE), " for i, name in attributes)
    gets = "".join(f"        get{i} = d{i}.get\n" for i in range(len(shape)))
    source = (
        "def snapshot(m0):\n"
        "    try:\n"
        "        d0 = m0.__dict__\n"
        f"{''.join(walk)}"
        f"        if not ({' and '.join(same) or 'True'}):\n"
        "            return None\n"
        f"{gets}"
        f"        return {'InForward(' if binds else ''}({''.join(tensors)}){')' if binds else ''}, "
        f"(({''.join(hooks)}) if {' or '.join(any_hook)} else None), "
        f"({''.join(flags)}), ({values}), ({''.join(forwards)})\n"
        "    except (KeyError, AttributeError, TypeError):  # a submodule gone or None, or a module unlike\n"
        "        # nn.Module's (torch.jit.script's dicts are wrappers dict.copy does not take)\n"
        "        return None\n"
    )
    # a plain dict of each (OrderedDict's copy is slower); filed under this file: dynamo skips it
    # (torch 2.4's dynamo, tracing a generated file, fails on dict.copy)
    made = _files.compile_generated(
        source, __file__, "snapshot", {"copy": dict.copy, "InForward": InForward, "GONE": _GONE},
    )
    if len(_snapshots) >= 1024:
        _snapshots.clear()
    snapshot = _snapshots[binds, shape, attributes] = made
    return snapshot


def _read_snapshot(module: Module) -> tuple:
    """What a generated snapshot returns, read plainly (a module its code cannot read, say a property ``training``)."""
    modules = list(module.modules())
    hooks = [getattr(m, store) for m in modules for store in _HOOK_DICTS]
    return (
        tuple(dict(getattr(m, store)) for m in modules for store in _TENSOR_STORES if getattr(m, store)),
        tuple(dict(h) for h in hooks) if any(hooks) else None,
        tuple(bool(m.training) for m in modules),
        (),  # its attributes and instance forwards are not watched (a module unlike nn.Module's)
        (),
    )


# id(module) -> its _Structure (whose weak reference tells a new module at the same id)
_block_structure: dict = {}


def _structure(module: Module) -> _Structure:
    entry = _block_structure.get(id(module))
    if entry is None or entry.ref() is not module:
        if len(_block_structure) >= 4096:
            _block_structure.clear()
        entry = _block_structure[id(module)] = _Structure(module)
    return entry


def block_module(function: object) -> object:
    """The module a call runs (itself, behind a bound method or a partial of either, ``partial(forward,
    module)``), else what it runs past its wrappers (:func:`~.peel.peel`)."""
    kind = type(function)
    if kind is not functools.partial and kind is not _MethodType:  # (itself: the usual case, on every call)
        return function
    runs = peel(function)
    if type(runs) is _MethodType and isinstance(runs.__self__, Module):
        return runs.__self__
    last = innermost_partial(function)
    if last is not None and runs is last.func:  # partial(forward, module): the module
        return _partial_target(last)
    return runs


_CALLS = frozenset({"__call__", "_call_impl", "_wrapped_call_impl"})


def root_hooks_run_inside(function: object) -> bool:
    """Whether the block's own module's forward hooks run inside the checkpoint: they do for the module
    itself and its ``__call__``, not for its ``forward`` or another method of it, nor for
    ``partial(forward, module)`` (a helper given the module may call it: inside, to be safe)."""
    while True:
        kind = type(function)
        if kind is functools.partial:
            target = _partial_target(function)
            if target is not function.func:  # partial(f, module): f is its method, or a helper
                return getattr(function.func, "__name__", "") != "forward" and not _is_method_of(
                    function.func, target
                )
            function = target
        elif kind is _MethodType and isinstance(function.__self__, Module):
            return function.__func__.__name__ in _CALLS
        elif kind is _MethodType and isinstance(function.__self__, (types.FunctionType, _MethodType, functools.partial)):
            function = function.__self__
        else:
            return True


def _is_method_of(func: object, module: object) -> bool:
    owner = getattr(func, "__qualname__", "").rpartition(".")[0]
    return any(owner == klass.__qualname__ for klass in type(module).__mro__)


def _partial_target(function: functools.partial) -> object:
    """What a partial runs: its function, or the module it is the method of.

    ``partial(forward, layer, **kwargs)`` is a bound method spelled as a partial:
    transformers 5's ``GradientCheckpointingLayer`` checkpoints its layers so
    (the layer's own hooks stay outside the checkpoint; its submodules' run inside).
    """
    args, func = function.args, function.func
    if args and type(func) is types.FunctionType and is_module(args[0]):
        # a method of the module's class (by its qualified name: transformers hands on the class's
        # forward from before it wrapped it), or a helper that closes over nothing (what it reads
        # is the module); a helper with a closure is a function, its cells watched (CKG110)
        if not func.__closure__ or _is_method_of(func, args[0]):
            return args[0]
    return func


_NOTHING = ((), (), None, (), ())


def block_snapshot(function: object) -> tuple:
    """What the block reads by reference, its hooks and its modules' train/eval flags, in one read.

    ``(tensors, hooks, training)``: for a module (itself, its bound method, a
    partial of either, ``partial(forward, module)``) a shallow copy of each of its modules' parameter and
    buffer dicts, of their forward (pre-)hook dicts (C-level copies: names and
    values, the cheapest way to keep them), and each module's ``training``;
    for a function its closure cells' contents, ``()`` and None (a closure
    holding modules: see :func:`_closure_snapshot`).  Read on
    every checkpoint call.  Compared as plain tuples: an entry that is the
    same object compares equal without looking at it; one that is another
    tensor cannot be compared (:func:`differs` says so).
    """
    given = function
    function = block_module(function)  # (past the guard's recorder too)
    kind = type(function)
    if isinstance(function, Module):
        entry = _block_structure.get(id(function))
        if entry is None or entry.ref() is not function:
            entry = _structure(function)
        snapshot = entry.snapshot(function)
        if snapshot is None:  # its shape changed since it was walked
            _block_structure.pop(id(function), None)
            snapshot = _structure(function).snapshot(function)
            if snapshot is None:
                try:
                    return _read_snapshot(function)
                except Exception:  # noqa: BLE001 - a module the guard cannot read (a C++ one): nothing to compare
                    return _NOTHING
        return snapshot
    cells: tuple = ()
    if kind is types.FunctionType:  # its closure's cells and the globals it loads (CKG110)
        try:
            cells = tuple([cell.cell_contents for cell, _ in closure_cells(function)])
        except ValueError:  # an empty cell: a name assigned after the function was made
            return _NOTHING
    elif kind is not types.BuiltinFunctionType:  # a plain object's method, a callable object: its code's reads
        try:
            cells = tuple([slot.cell_contents for slot, _ in object_slots(given)])
        except ValueError:
            return _NOTHING
    modules = reached_modules(given)  # `lambda h: torch.tanh(lin(h))`: what lin holds, too; `holder.run`
    if modules:
        return _closure_snapshot(cells, modules)
    return (cells, (), None, (), ()) if cells else _NOTHING


class ClosureRead(tuple):
    """``(closure cells' contents, the modules they reach, per module: its tensors' snapshot or None)``.

    A tuple, compared as one; its own type so :func:`rebound` tells it from a closure of three cells.
    """

    __slots__ = ()


#: the record types :func:`needs_refresh` may say yes for: the decision calls it only for these
MAY_NEED_REFRESH = frozenset({InForward, ClosureRead})


#: a module held in a closure with more submodules than this is not snapshotted on every call (a
#: closure holding a whole model, ``lambda h: self.layer(h)``, would cost a copy of every module's
#: dicts per call): checkpoint the submodule itself, or pass it, for CKG110 to see it
CLOSURE_MODULE_LIMIT = 64


def _closure_module_snapshot(module: Module) -> Optional[tuple]:
    """``module``'s snapshot, or None past :data:`CLOSURE_MODULE_LIMIT` or unreadable."""
    if len(_structure(module).paths) > CLOSURE_MODULE_LIMIT:
        return None
    snapshot = block_snapshot(module)
    return snapshot if snapshot is not _NOTHING else None


def _closure_snapshot(cells: tuple, modules: list) -> tuple:
    """A closure's snapshot: its cells, and the parts of the snapshot of each module they reach
    (:func:`reached_modules`: held in a cell, or through a helper, a list, an object, a bound method).

    The tensors each module holds (CKG110), and, joined in the cells' order, its modules' train/eval
    flags (CKG106, CKG117) and the plain attributes their code names (CKG115): a block given as
    ``lambda h: norm(counter(h))`` advances the counter and the running statistics in its forward,
    and torch's recompute would advance them again, as for the module given itself.  Hooks and
    instance forwards (CKG111, CKG116) are the module's own business: not for a closure.
    """
    snapshots = [_closure_module_snapshot(m) for m in modules]
    kept = [s for s in snapshots if s is not None]
    training = tuple(flag for s in kept for flag in s[2])
    attributes = tuple(value for s in kept for value in s[3])
    return ClosureRead((cells, tuple(modules), tuple(None if s is None else s[0] for s in snapshots))), (), training, \
        attributes, ()


def modules_in_snapshot(bindings: object) -> Optional[list]:
    """The modules a function block's snapshot (its :class:`ClosureRead`) took, in the order its
    training flags join them; None for any other snapshot (a module block's, a plain closure's)."""
    if type(bindings) is not ClosureRead:
        return None
    return [module for module, snapshot in zip(bindings[1], bindings[2]) if snapshot is not None]


def snapshot_roots(function: object) -> list:
    """The modules whose snapshots the block's is made of: its module (itself, its bound method, a
    partial of either), or each module its closure's cells hold (see :func:`_closure_snapshot`)."""
    block = block_module(function)
    # closure_held peels the partial itself: given the peeled function, it would not see what a partial
    # binds (``partial(run, cfg)`` with ``cfg.layers["k"]``), which the snapshot reached from the call's
    return [block] if isinstance(block, Module) else closure_held(function)


def snapshot_modules(function: object) -> list:
    """The modules in the order of the snapshot's training part: each root's modules (its submodules
    included, see :func:`snapshot_roots`), in turn; [] if a shape changed."""
    modules: list = []
    for root in snapshot_roots(function):
        found = _structure(root).modules(root)
        if not found:
            return []
        modules += found
    return modules


def closure_held(function: object) -> list:
    """The modules a function block (or a plain object's method) reaches whose snapshot it takes, as
    :func:`block_snapshot` finds them (see :func:`_closure_snapshot`)."""
    given = function
    function = block_module(function)
    kind = type(function)
    if isinstance(function, Module):
        return []
    if kind is types.FunctionType and function.__closure__:
        try:
            [cell.cell_contents for cell in function.__closure__]
        except ValueError:  # an empty cell: no snapshot (see block_snapshot)
            return []
    return [m for m in reached_modules(given) if len(_structure(m).paths) <= CLOSURE_MODULE_LIMIT]


def differs(was: object, now: object) -> bool:
    """``was != now`` for captured state, as Python compares containers: identical entries are equal
    without a look.  A tensor that is another object is compared by ``==`` (a kernel, on drift
    only): one of several elements cannot be (so it differs), a one-element one equal in value
    counts as the same (its recompute computes the same numbers)."""
    try:
        return bool(was != now)
    except Exception:  # noqa: BLE001 - a tensor compared with another: ambiguous, so not the same
        return True


def bindings_values_only(was: object, now: object) -> bool:
    """Only Python values changed among what a function block reads by name, none of its modules'
    tensors (CKG110's quiet case, as :func:`attributes_values_only` is CKG115's): a counter its
    forward advances, a step or a scale re-bound.  A replay of the forward's values is then the
    uncheckpointed program, so strict need not stop it.  A module block's record: never.
    """
    if type(was) is ClosureRead:
        if type(now) is not ClosureRead or differs(was[1], now[1]) or differs(was[2], now[2]):
            return False  # the modules it reaches, or a tensor one of them holds, changed
        was, now = was[0], now[0]
    if type(was) is not tuple or type(now) is not tuple or len(was) != len(now):
        return False
    changed = [(old, new) for old, new in zip(was, now) if old is not new]
    return bool(changed) and all(
        type(old) in _PLAIN_VALUES and type(new) in _PLAIN_VALUES for old, new in changed
    )


def block_bindings(function: object) -> object:
    """CKG110's part of :func:`block_snapshot`: the tensors (or closure values) the block reads."""
    return block_snapshot(function)[0]


def block_hooks(function: object) -> object:
    """CKG111's part of :func:`block_snapshot`: its modules' forward hooks and pre-hooks."""
    return block_snapshot(function)[1]


block_bindings.part_of = (block_snapshot, 0)  # type: ignore[attr-defined]
block_hooks.part_of = (block_snapshot, 1)  # type: ignore[attr-defined]
block_bindings.takes_function = block_hooks.takes_function = True  # type: ignore[attr-defined]


def rebound(was: object, function: object, hooks: bool = False) -> list:
    """``[(owner, store, name, forward value)]`` for what differs now from the forward's ``was``.

    ``store``: "cell" (owner a cell), "_parameters" / "_buffers" (a tensor
    re-bound, deleted, or moved to a plain attribute: the forward value is
    what to read again), a hook dict's name (name is that too, value the
    forward's dict), or "new" (an entry the forward did not have: nothing
    to replay).
    """
    block = block_module(function)
    if not isinstance(block, Module):
        reached = block_slots(block)
        held: list = []
        if type(was) is ClosureRead:  # modules the cells reach: what they hold, too
            was, modules, tensors = was
            if not hooks:
                held = [
                    change for module, forward in zip(modules, tensors) if forward is not None
                    for change in _module_changes(module, forward, False)
                ]
        if len(reached) != len(was):
            return held
        return [
            (cell, "cell", name, old)
            for (cell, name), old in zip(reached, was)
            if cell.cell_contents is not old
        ] + held
    return _module_changes(block, was, hooks)


def _module_changes(block: Module, was: object, hooks: bool) -> list:
    """:func:`rebound` for a module: what its dicts hold now that the forward's ``was`` did not."""
    owners = _structure(block).owners(block, hooks)
    dicts = [getattr(m, store) for m, store in owners]
    changes: list = []
    if was is None:  # the forward ran without any hook
        was = tuple({} for _ in dicts)
    if len(dicts) != len(was):
        return changes
    for (module, store), forward, current in zip(owners, was, dicts):
        same = len(forward) == len(current) and all(current.get(k, _GONE) is v for k, v in forward.items())
        if same:
            continue
        if hooks:
            changes.append((module, store, store, forward))
            continue
        changes += [(module, store, name, value) for name, value in forward.items() if current.get(name, _GONE) is not value]
        changes += [(module, "new", name, _GONE) for name in current if name not in forward]
    return changes


def describe_bindings(value: object) -> str:
    return "what the block reads by reference" if value else "nothing watched"


def _module_paths(function: object) -> dict:
    """``{id(module): where the block reaches it}``, for messages: ``fc1`` in the checkpointed module
    (or its bound method), ``self.fc1`` through a closure's ``self``, ``""`` for the block itself."""
    block = block_module(function)
    if isinstance(block, Module):
        roots = [("", block)]
    else:
        code = getattr(block, "__code__", None)
        cells = getattr(block, "__closure__", None) or ()
        names = code.co_freevars if code is not None else ()
        roots = [(name, value) for name, value in zip(names, map(_cell_contents, cells)) if is_module(value)]
    paths: dict = {}
    for prefix, root in roots:
        structure = _structure(root)
        for path, module in zip(structure.paths, structure.modules(root)):
            paths.setdefault(id(module), ".".join(part for part in (prefix, path) if part))
    return paths


def _where(owner: object, paths: dict) -> str:
    """A module as a message names it: ``fc1 (Linear)``, or its class alone for the block itself."""
    path = paths.get(id(owner), "")
    return f"{path} ({type(owner).__name__})" if path else type(owner).__name__


def describe_rebinding(was: object, now: object, function: object = None) -> str:
    """CKG110's change line: ``fc1.weight, fc1.bias (Linear) re-bound (other tensors, not updated in place)``
    (``weight, bias (Linear)`` for the block itself).

    Tensors are named by their path from the checkpointed block (higher's patched
    classes all read ``InnerFunctionalLinear``), grouped per module.
    """
    paths = _module_paths(function)
    cells, added, groups = [], [], {}  # groups: id(owner) -> (owner, [names]), in first-seen order
    for owner, store, name, _ in rebound(was, function):
        if store == "cell":
            cells.append(f"{name} re-bound")
        elif store == "new":
            added.append((owner, name))
        else:
            groups.setdefault(id(owner), (owner, []))[1].append(name)

    def named(owner: object, names: list) -> str:
        path = paths.get(id(owner), "")
        return f"{', '.join(f'{path}.{name}' if path else name for name in names)} ({type(owner).__name__})"

    parts = cells + [
        f"{named(owner, names)} re-bound ({'another tensor' if len(names) == 1 else 'other tensors'}, "
        "not updated in place)"
        for owner, names in groups.values()
    ] + [f"{named(owner, [name])} added" for owner, name in added]
    return "; ".join(parts) or "what the block reads changed"


def describe_hook_change(was: object, now: object, function: object = None) -> str:
    """CKG111's change line: ``forward hooks of fc1 (Linear) added or removed``."""
    paths = _module_paths(function)
    parts = [
        f"{'forward pre-hooks' if store == '_forward_pre_hooks' else 'forward hooks'} of {_where(owner, paths)} "
        "added or removed"
        for owner, store, _, _ in rebound(was, function, hooks=True)
    ]
    return "; ".join(parts) or "the block's hooks changed"




# --------------------------------------------------------------------------
# a user torch.Generator the block draws from (CKG113)
#
# torch's checkpoint preserves the default generators (CPU and the device's)
# for the recompute, never one of the user's: a block that draws from its own
# generator (``torch.randn(..., generator=g)``, a dropout of its own) draws
# the next numbers in the recompute.  The capture keeps the state of each
# user generator the block can reach: given to it (found as CKG112 finds
# containers, and inside them) or held as an attribute of one of its modules.

#: set once a checkpointed module holding a torch.Generator attribute is walked: until then
#: CKG113 costs nothing for modules.  The capture reads the block snapshot (which walks a
#: new module) before this, so a module's first call is seen too.
module_generators_seen = [False]


def _generator_attributes(module: Module) -> list:
    """``[(path, name)]``: the plain attributes of ``module`` and its submodules that hold a torch.Generator."""
    found = [
        (path, name) for path, m in module.named_modules()
        for name, value in vars(m).items() if type(value) is _Generator
    ]
    if found:
        module_generators_seen[0] = True
    return found


# --------------------------------------------------------------------------
# train / eval mode of the checkpointed module

_MethodType = type(Module().train)


def module_training(function: object) -> Optional[tuple]:
    """CKG106's part of :func:`block_snapshot`: each of the checkpointed module's modules' ``training``.

    Every submodule's, so that fallback can recompute each in the mode it had
    (a frozen BatchNorm in eval inside a training model); for a closure, those of
    each module its cells hold (see :func:`_closure_snapshot`).  ``None`` for other functions.
    """
    return block_snapshot(function)[2]


module_training.part_of = (block_snapshot, 2)  # type: ignore[attr-defined]
module_training.takes_function = True  # type: ignore[attr-defined]

# module class -> does its code depend on train/eval mode?  Weak, as above.
_mode_dependent_classes: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _class_depends_on_mode(cls: type) -> bool:
    """Whether a module class behaves differently in train and eval mode.

    Read from its code: a ``forward`` that mentions ``training`` (dropout,
    batch norm, RNNs with dropout, attention with dropout, and the user's own
    layers alike), or a ``train()`` of its own.  A class whose source cannot
    be read counts as dependent.
    """
    known = _mode_dependent_classes.get(cls)
    if known is None:
        if getattr(cls, "train", Module.train) is not Module.train:
            known = True
        else:
            try:
                known = "training" in inspect.getsource(cls.forward)
            except (OSError, TypeError, AttributeError):
                known = True
        _mode_dependent_classes[cls] = known
    return known


def training_relevant(function: object, was: object, now: object) -> bool:
    """A train/eval switch matters only to a module some part of which behaves differently."""
    module = function if isinstance(function, Module) else getattr(function, "__self__", None)
    if not isinstance(module, Module):
        return True
    return any(_class_depends_on_mode(type(m)) for m in module.modules())




def describe_training(training: Optional[tuple]) -> str:
    if training is None:
        return "not a module"
    if all(training):
        return "train mode"
    if not any(training):
        return "eval mode"
    return f"mixed ({sum(training)} of {len(training)} modules in train mode)"


def retrained(was: tuple, function: object) -> list:
    """``[(module, forward flag)]`` for each module whose train/eval mode differs now from ``was``."""
    modules = snapshot_modules(function)
    if len(modules) != len(was):
        return []
    return [(m, flag) for m, flag in zip(modules, was) if m.training != flag]


# --------------------------------------------------------------------------
# a module's own plain attributes its forward reads, changed before the recompute (CKG115),
# and a forward put on a module instance (CKG116)
#
# A shared module whose timestep, scale or flag is set before each call
# (``m.t = t``), a counter its own forward increments (``self.calls += 1``), a
# tensor it keeps (``self.last = h``): torch's recompute reads the value there is
# then.  Which attributes a class's code names is read once per class (the
# names its functions load or store as attributes: an over-approximation that
# costs a few reads, never a miss of ``self.<name>``); the snapshot then reads,
# on each call, those of them each module holds as a plain value.

#: what every nn.Module holds (torch's bookkeeping, ``training``: CKG106's): never watched here
_MODULE_INTERNALS = frozenset(vars(Module())) | {"forward"}
_read_names_of: "weakref.WeakKeyDictionary[type, tuple]" = weakref.WeakKeyDictionary()
_LIBRARY_ROOTS = frozenset({"torch", "builtins"})


def _read_names(cls: type) -> tuple:
    """The attribute names a module class's own code names (its methods', nested code's too), sorted.

    torch's own classes are left out: their settings (``eps``, ``p``) are fixed at
    construction, and reading them on every call would cost every block.
    """
    known = _read_names_of.get(cls)
    if known is None:
        names: set = set()
        for klass in cls.__mro__:
            if (getattr(klass, "__module__", None) or "").split(".")[0] in _LIBRARY_ROOTS:
                continue
            for value in list(vars(klass).values()):
                for function in member_functions(value, reading=True):
                    names.update(code_names(function.__code__))
        known = _read_names_of[cls] = tuple(sorted(names - _MODULE_INTERNALS))
    return known


def _watched(value: object) -> bool:
    """A value CKG115 compares: a number, flag, string, None, a NumPy scalar, a dtype, a tensor (not a
    container: CKG112's domain, nor a module or a function)."""
    if value is _GONE:
        return False
    if type(value) in _PLAIN_VALUES or isinstance(value, torch.Tensor):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic) and not isinstance(value, numpy.object_)


_PLAIN_VALUES = frozenset({int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device})


def module_attributes(function: object) -> tuple:
    """CKG115's part of :func:`block_snapshot`: the plain attributes its modules' code names, as they are."""
    return block_snapshot(function)[3]


def instance_forwards(function: object) -> tuple:
    """CKG116's part of :func:`block_snapshot`: each module's instance ``forward`` (None: its class's)."""
    return block_snapshot(function)[4]


module_attributes.part_of = (block_snapshot, 3)  # type: ignore[attr-defined]
instance_forwards.part_of = (block_snapshot, 4)  # type: ignore[attr-defined]
module_attributes.takes_function = instance_forwards.takes_function = True  # type: ignore[attr-defined]


def _attribute_owners(function: object) -> list:
    """``[(module, name)]`` in the order of the snapshot's attribute part ([] if not a module's)."""
    owners: list = []
    for module in snapshot_roots(function):
        structure = _structure(module)
        modules = structure.modules(module)
        if not modules:
            return []
        owners += [(modules[i], name) for i, name in structure.attributes]
    return owners


def reattributed(was: tuple, function: object) -> list:
    """``[(module, name, forward value)]`` for each watched attribute that differs now from ``was``."""
    owners = _attribute_owners(function)
    if len(owners) != len(was):
        return []
    return [
        (module, name, value) for (module, name), value in zip(owners, was)
        if differs(module.__dict__.get(name, _GONE), value)
    ]


def attributes_values_only(was: tuple, now: tuple) -> bool:
    """Only Python values changed (a number, a flag, a string, not a tensor), each present both times:
    recomputing with the forward's is the uncheckpointed program (CKG115's quiet case)."""
    return all(
        not isinstance(old, torch.Tensor) and not isinstance(new, torch.Tensor) and old is not _GONE and new is not _GONE
        for old, new in zip(was, now) if differs(old, new)
    )


def _show(value: object) -> str:
    if value is _GONE:
        return "absent"
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} tensor"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_attribute_change(was: tuple, now: tuple, function: object = None) -> str:
    """CKG115's change line: ``t (Timestep): 1.0 → 3.0; scale (Block): a () tensor → another tensor``."""
    paths = _module_paths(function)
    owners = _attribute_owners(function)
    parts = []
    for (module, name), old, new in zip(owners, was, now):
        if not differs(old, new):
            continue
        path = paths.get(id(module), "")
        where = f"{path}.{name}" if path else name
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            change = f"{_show(old)} → another tensor"
        else:
            change = f"{_show(old)} → {_show(new)}"
        parts.append(f"{where} ({type(module).__name__}): {change}")
    return "; ".join(parts) or "a plain attribute its forward reads changed"


def describe_attributes(value: object) -> str:
    return f"{len(value)} plain attribute(s)" if value else "nothing watched"


def describe_forward_change(was: tuple, now: tuple, function: object = None) -> str:
    """CKG116's change line: ``fc1 (Linear): forward replaced on the instance → its class's forward``."""
    block = block_module(function)
    modules = _structure(block).modules(block) if isinstance(block, Module) else []
    paths = _module_paths(function)
    parts = []
    for module, old, new in zip(modules, was, now):
        if old is new:
            continue
        where = _where(module, paths)

        def named(value: object) -> str:
            return "its class's forward" if value is None else f"{getattr(value, '__qualname__', type(value).__name__)} on the instance"

        parts.append(f"{where}: {named(old)} → {named(new)}")
    return "; ".join(parts) or "a module's forward changed"


def describe_forwards(value: object) -> str:
    return "its modules' forwards"



