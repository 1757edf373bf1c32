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
  keywords (a parent module bound there may be used only in part; a tensor
  bound there is read as is) — transformers checkpoints
  ``partial(layer.__call__, **kwargs)`` and, in 5.x, ``partial(forward, self, ...)``;
* what a function holds in its closure cells or default arguments, or names
  as globals (``checkpoint(block_fn, x)`` where ``block_fn`` uses a
  module-level ``model``), and modules or tensors inside a list, tuple or dict
  held there (``checkpoint_sequential`` closes over a list of modules): a
  module found there may be used only in part;
* the functions, partials and methods a function holds that way, walked the
  same way, up to :data:`MAX_DEPTH` hops (a block built by a helper,
  ``lambda t: inner(t)`` where ``inner`` closes over the layer; a
  ``functools.wraps`` decorator's wrapper): deeper than that, the walk says
  it could not see.  Functions of torch and the standard library are not
  walked (they hold no module of the user's).

* an object of the user's own class (a callable object, the owner of a
  method): its attributes (``__dict__``) as a closure's cells, and its
  class's ``__call__``, within the same hop limit.

An object without a ``__dict__`` (``__slots__``) or past the hop limit is not
looked into: the walk says so (``Reads.unseen``), and every rule says how it
treats what it cannot see.  Numbers, strings, torch's own objects and the
like cannot hide a module.

The walk never raises into the user's call: a callable whose attribute lookup
raises (a ``__getattr__`` that raises ``KeyError``, say) is simply not looked
into (``Reads.unseen``).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from types import MethodType
from typing import Any, Iterator, List, Tuple

import torch

Module = torch.nn.Module
Tensor = torch.Tensor

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

    @property
    def modules(self) -> Tuple[Module, ...]:
        return self.whole + self.partial

    def named_module_tensors(self) -> Iterator[Tuple[str, Module, str, str, Tensor]]:
        """``(path, owner, store, name, tensor)`` for every parameter and buffer of the modules.

        ``path`` reads like ``Net.inner.weight``; ``store`` is ``"_parameters"``
        or ``"_buffers"`` of ``owner``.  Each owner is visited once.
        """
        seen = set()
        for root in self.modules:
            for prefix, owner in root.named_modules():
                if id(owner) in seen:
                    continue
                seen.add(id(owner))
                base = ".".join(p for p in (type(root).__name__, prefix) if p)
                for store in ("_parameters", "_buffers"):
                    for name, tensor in getattr(owner, store).items():
                        if isinstance(tensor, Tensor):
                            yield f"{base}.{name}", owner, store, name, tensor


def _attribute(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)``, or ``_BROKEN`` if the lookup raises anything else."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a user's __getattr__ may raise anything
        return _BROKEN


# Values that cannot hide a module or a tensor the function reads.
_PLAIN = (
    str, bytes, int, float, complex, bool, type(None), type, range, slice,
    types.FunctionType, types.BuiltinFunctionType, types.ModuleType, functools.partial,
)
# Objects of these libraries hold no module of the user's (types.SimpleNamespace can: not listed).
_LIBRARY_ROOTS = frozenset({
    "builtins", "torch", "typing", "enum", "math", "logging", "warnings", "functools",
    "itertools", "operator", "collections", "contextlib", "threading", "re", "os", "sys",
    "abc", "dataclasses", "inspect", "weakref", "numbers", "copy",
})
#: How many function hops the walk follows from the checkpointed function
#: (a lambda calling a helper that calls another is two).
MAX_DEPTH = 4


def _walkable(value: Any) -> bool:
    """A function, partial, bound method or object of the user's a held value may hide a module behind."""
    if isinstance(value, types.FunctionType):
        return (getattr(value, "__module__", None) or "").split(".")[0] not in _LIBRARY_ROOTS
    return isinstance(value, functools.partial) or type(value) is MethodType or _opaque(value)


def _opaque(value: Any) -> bool:
    """Whether ``value`` is an object that might hide modules from the walk."""
    if isinstance(value, _PLAIN):
        return False
    return (type(value).__module__ or "").split(".")[0] not in _LIBRARY_ROOTS


def _held(value: Any) -> Tuple[List[Any], bool]:
    """``(modules, tensors and functions to walk, opaque?)`` for a value a closure cell or a global holds."""
    if isinstance(value, (Module, Tensor)) or _walkable(value):
        return [value], False
    if isinstance(value, (list, tuple)):
        items: Any = value
    elif isinstance(value, dict):
        items = list(value.values())
    else:
        return [], _opaque(value)
    return [v for v in items if isinstance(v, (Module, Tensor))], False


def _referenced(function: Any) -> Iterator[Any]:
    """What a Python function holds: closure cells, default arguments, the globals its code names."""
    cells = _attribute(function, "__closure__")
    if cells is _BROKEN:
        raise LookupError("__closure__")
    for cell in cells or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    yield from _attribute(function, "__defaults__") or ()
    yield from (_attribute(function, "__kwdefaults__") or {}).values()
    code, namespace = _attribute(function, "__code__"), _attribute(function, "__globals__")
    if isinstance(code, types.CodeType) and isinstance(namespace, dict):
        for name in code.co_names:
            if name in namespace:
                yield namespace[name]


def reads_of(function: Any) -> Reads:
    """Walk ``function`` (see the module docstring); never raises."""
    whole: List[Module] = []
    partial: List[Module] = []
    tensors: List[Tensor] = []
    unseen = False
    # (object, run whole?, look into its closure?, function hops from ``function``)
    todo: List[Tuple[Any, bool, bool, int]] = [(function, True, True, 0)]
    seen = set()
    while todo:
        obj, run_whole, closure_too, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            if isinstance(obj, Module):
                (whole if run_whole else partial).append(obj)
            elif isinstance(obj, Tensor):
                tensors.append(obj)
            elif isinstance(obj, functools.partial):
                # the function runs as its own; what is bound may be used only in part
                todo.append((obj.func, run_whole, True, depth))
                todo.extend((o, False, False, depth) for o in (*obj.args, *obj.keywords.values()))
            elif type(obj) is MethodType:
                owner = obj.__self__
                if isinstance(owner, Module):
                    name = _attribute(obj.__func__, "__name__")
                    todo.append((owner, run_whole and name in _CALL_METHODS, False, depth))
                else:  # a method of the user's object: what the object holds, and the method
                    if _opaque(owner):
                        todo.append((owner, False, True, depth))
                    todo.append((obj.__func__, False, closure_too, depth))
            elif closure_too and isinstance(obj, types.FunctionType):
                unseen = _walk_held(_referenced(obj), depth, todo) or unseen
            elif closure_too and _opaque(obj):  # an object of the user's: its attributes, and its __call__
                attributes = _attribute(obj, "__dict__")
                if not isinstance(attributes, dict):  # __slots__, or a lookup that raises
                    unseen = True
                    continue
                call = _attribute(type(obj), "__call__")
                held = [*attributes.values(), *([call] if isinstance(call, types.FunctionType) else [])]
                unseen = _walk_held(held, depth, todo) or unseen
        except Exception:  # noqa: BLE001 - never raise into the user's call
            unseen = True
    return Reads(tuple(whole), tuple(partial), tuple(tensors), unseen)


def _walk_held(values: Any, depth: int, todo: list) -> bool:
    """Queue what ``values`` (a function's or an object's) hold; True if some of it cannot be seen."""
    unseen = False
    for value in values:
        found, opaque = _held(value)
        unseen = unseen or opaque
        for v in found:
            if isinstance(v, (Module, Tensor)):
                todo.append((v, False, False, depth))
            elif depth < MAX_DEPTH:  # a function or an object it holds: walked as it is
                todo.append((v, False, True, depth + 1))
            else:
                unseen = True
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
    found = reads_of(function)
    for module in found.modules:
        for owner in module.modules():
            for value in (*owner._parameters.values(), *owner._buffers.values(), *vars(owner).values()):
                if isinstance(value, Tensor):
                    yield value
    yield from found.tensors
