"""The run-time proof behind the composable recompute: the block read only what it was given.

The composable recompute (``_composable``) runs a block below the torch.func
levels that called it, on the tensors it lifted out of the block (its
arguments, its modules' parameters and buffers, the tensors its closures and
containers hold).  A walk over what a function holds can never be complete:
classes, module namespaces, descriptors, C-level bound methods, objects of
any shape can hide a tensor.  A tensor that needs a gradient and that the
block reaches past the walk would be read *as a constant*: its gradient would
silently come back zero or wrong.

So while the block's forward runs, :class:`ReadCheck` (a ``TorchFunctionMode``)
looks at every tensor handed to a torch operation before the operation runs,
and at every tensor the block returns.  A tensor that carries a gradient (it
requires grad, or a torch.func level wraps it) must be one the block was
given or one it computed; anything else raises :class:`Unlifted`, before the
operation has run.  The caller then refuses this call (strict) or runs the
block another way (fallback).  Tensors that carry no gradient (a mask, a
constant) are read as they are: they are constants for every transform.

"Computed" is tracked by identity: the outputs of every operation are
recorded.  A tensor alive before the forward began can never share an id
with one made during it, so a captured tensor is never taken for a computed
one.  The other way round, a tensor made without a torch operation (by a C
extension that bypasses ``__torch_function__``, say) and needing a gradient
is refused: a lost memory saving, never a wrong gradient.

Only the forward is checked: the recompute runs the same code on the same
tensors, with the forward's RNG, dtype and device replayed.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional, Sequence

import torch
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor


class Unlifted(Exception):
    """The block read a tensor that needs a gradient and was not given to it (not a user error)."""

    def __init__(self, tensor: Tensor, operation: str, site: str) -> None:
        super().__init__(operation)
        self.tensor = tensor
        self.operation = operation  # "torch.matmul", or "returned" for an output
        self.site = site  # the block's line that read it


def _carries_gradient(tensor: Tensor) -> bool:
    return tensor.requires_grad or is_functorch_wrapped_tensor(tensor)



class ReadCheck(TorchFunctionMode):
    """Refuses an operation on a tensor that needs a gradient and is neither given nor computed.

    It also keeps, before an operation that may update one of the given
    tensors in place (``add_``, ``batch_norm``'s running statistics, ...), a
    copy of that tensor's *source* (``sources``: the tensors the given ones
    stand for, index for index): ``before`` maps the index to the copy, so the
    recompute can start from what the forward started from.
    """

    def __init__(self, sources: Sequence[Any] = ()) -> None:
        super().__init__()
        self.known: set = set()
        self.sources = sources
        self.index: dict = {}
        self.before: dict = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        known = self.known
        if self.index and _may_update(func, kwargs):
            self._keep_before(args, kwargs)
        for arg in args:
            if isinstance(arg, Tensor):
                if id(arg) not in known and _carries_gradient(arg):
                    raise Unlifted(arg, _name(func), _block_site())
            elif type(arg) in (list, tuple):
                for item in arg:
                    if isinstance(item, Tensor) and id(item) not in known and _carries_gradient(item):
                        raise Unlifted(item, _name(func), _block_site())
        if kwargs:
            for value in kwargs.values():
                if isinstance(value, Tensor) and id(value) not in known and _carries_gradient(value):
                    raise Unlifted(value, _name(func), _block_site())
        else:
            kwargs = {}
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            known.add(id(out))
        elif type(out) in (tuple, list):
            for item in out:
                if isinstance(item, Tensor):
                    known.add(id(item))
        return out

    def given(self, tensors: Sequence[Any]) -> None:
        """Tensors the block is given (a recompute's inputs, at whatever level they arrive)."""
        self.known.update(id(t) for t in tensors if isinstance(t, Tensor))
        if self.sources:
            self.index = {id(t): i for i, t in enumerate(tensors) if isinstance(t, Tensor)}

    def _keep_before(self, args: tuple, kwargs: Optional[dict]) -> None:
        for arg in (*args, *(kwargs or {}).values()):
            for item in (arg if type(arg) in (list, tuple) else (arg,)):
                if isinstance(item, Tensor):
                    i = self.index.get(id(item))
                    if i is not None and i not in self.before:
                        source = self.sources[i]
                        if not is_functorch_wrapped_tensor(source):
                            self.before[i] = source.detach().clone()

    def check_outputs(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if isinstance(t, Tensor) and id(t) not in self.known and _carries_gradient(t):
                raise Unlifted(t, "returned", _block_site())


_UPDATING = frozenset({
    "batch_norm", "instance_norm", "native_batch_norm", "_native_batch_norm_legit", "__setitem__",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})


def _may_update(func: Any, kwargs: Optional[dict]) -> bool:
    """Whether ``func`` may write into one of its arguments (an ``_`` method, ``out=``, BatchNorm's statistics)."""
    name = getattr(func, "__name__", "") or ""
    return (name.endswith("_") and not name.endswith("__")) or name in _UPDATING or bool(kwargs and "out" in kwargs)


def _name(func: Any) -> str:
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if module.startswith("torch") and "." not in name:
        return f"torch.{name}" if module in ("torch", "torch._C._VariableFunctions") else f"{module}.{name}"
    return name if not module else f"{module}.{name}"


_PACKAGE = __name__.rsplit(".", 1)[0]


def _block_site() -> str:
    """The innermost frame that is neither torch's nor the guard's: the block's line that read it."""
    frame = sys._getframe(2)
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    while frame is not None:
        filename = frame.f_code.co_filename
        module = frame.f_globals.get("__name__", "")
        if not filename.startswith(torch_dir) and not module.startswith(_PACKAGE) and module not in (
            "contextlib", "functools",
        ):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"
