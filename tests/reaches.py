"""How a checkpointed block reaches the tensors it is differentiated with respect to.

Each *reach* builds ``model(w, x) -> tensor`` (``w``: a (3, 3) weight, ``x``: a
(2, 3) input, both float64) through a checkpoint function ``ckpt``, reaching
``w`` (and, for the residual, ``x``) one particular way.  With ``ckpt`` the
plain call, it is the uncheckpointed reference.  Each *transform* differentiates
``model`` with respect to both ``w`` and ``x`` one way torch.func users do.

``test_reaches.py`` crosses them: every combination must equal the reference,
or be refused with ``CheckpointCompositionError`` (never a wrong number).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Callable, Dict, List, NamedTuple

import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Ckpt = Callable[..., torch.Tensor]


def plain(function, *args, **kwargs):
    return function(*args, **kwargs)


# --------------------------------------------------------------------------
# reaches


class Linear3(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))

    def forward(self, t):
        return torch.tanh(t @ self.weight)


class Holder(torch.nn.Module):
    """``functional_call`` swaps ``lin.weight``; the block reaches ``lin`` one way or another."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = Linear3()
        self.how = how
        self.ckpt: Ckpt = plain

    def forward(self, t):
        if self.how == "module-argument":
            return self.ckpt(_run_layer, self.lin, t)
        return self.ckpt(self.lin, t)


def _run_layer(layer, t):
    return layer(t) * 2


class Scaled(torch.nn.Module):
    """Reads a plain tensor attribute (set by functional_call: not a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.zeros(3, 3, dtype=torch.float64)

    def forward(self, t):
        return torch.tanh(t @ self.scale)


class ScaledHolder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Scaled()
        self.ckpt: Ckpt = plain

    def forward(self, t):
        return self.ckpt(self.inner, t)


class ListHolder(torch.nn.Module):
    """A registered submodule that the checkpointed block reaches through a plain list attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Linear3()
        self.block = _Outer(self.inner)
        self.ckpt: Ckpt = plain

    def forward(self, t):
        return self.ckpt(self.block, t)


class _Outer(torch.nn.Module):
    def __init__(self, inner) -> None:
        super().__init__()
        self.helpers = [inner]  # a plain list: not a registered submodule of this block

    def forward(self, t):
        return self.helpers[0](t) + 1


@dataclasses.dataclass
class Pack:
    t: torch.Tensor
    w: torch.Tensor


@dataclasses.dataclass
class Out:
    y: torch.Tensor


class Pair(NamedTuple):
    t: torch.Tensor
    w: torch.Tensor


class ClassHeld:
    w = None

    @classmethod
    def apply(cls, t):
        return torch.tanh(t @ cls.w)


NAMESPACE = types.ModuleType("ckpt_guard_test_namespace")
_GLOBAL_W = None


def _global_block(t):
    return torch.tanh(t @ _GLOBAL_W)


def _with_global(w, x, ckpt):
    global _GLOBAL_W
    _GLOBAL_W = w
    try:
        return ckpt(_global_block, x)
    finally:
        _GLOBAL_W = None


def _with_class(w, x, ckpt):
    ClassHeld.w = w
    try:
        return ckpt(ClassHeld.apply, x)
    finally:
        ClassHeld.w = None


def _with_namespace(w, x, ckpt):
    NAMESPACE.w = w
    try:
        return ckpt(lambda t: torch.tanh(t @ NAMESPACE.w), x)
    finally:
        NAMESPACE.w = None


def _hooked(w, x, ckpt):
    lin = Linear3()
    lin.register_forward_hook(lambda module, inputs, out: out * (1 + w.sum()))
    return ckpt(lin, x)  # the hook stays registered (the module is this call's own)


def _monkeypatched(w, x, ckpt):
    lin = Linear3()
    lin.forward = lambda t: torch.tanh(t @ w)  # an instance attribute shadowing the class's forward
    return ckpt(lin, x)


def _loop_rebinding(w, x, ckpt):
    masks = [torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), torch.tensor([0.5, 3.0, 1.0], dtype=torch.float64)]
    h = x
    for i in range(2):
        m = masks[i]
        h = ckpt(lambda t: torch.tanh((t @ w) * m), h)
    return h


_HOLDERS: Dict[str, torch.nn.Module] = {}


def _holder(how: str) -> torch.nn.Module:
    return _HOLDERS.setdefault(how, Holder(how))


def _functional(how: str) -> Callable[[torch.Tensor, torch.Tensor, Ckpt], torch.Tensor]:
    def model(w, x, ckpt):
        holder = _holder(how)
        holder.ckpt = ckpt
        return functional_call(holder, {"lin.weight": w}, (x,))

    return model


def _scaled(w, x, ckpt):
    holder = _HOLDERS.setdefault("scaled", ScaledHolder())
    holder.ckpt = ckpt
    return functional_call(holder, {"inner.scale": w}, (x,))


def _list_held(w, x, ckpt):
    holder = _HOLDERS.setdefault("list", ListHolder())
    holder.ckpt = ckpt
    return functional_call(holder, {"inner.weight": w}, (x,))


#: reach name -> model(w, x, ckpt)
REACHES: Dict[str, Callable[[torch.Tensor, torch.Tensor, Ckpt], torch.Tensor]] = {
    "argument": lambda w, x, ckpt: ckpt(lambda t, v: torch.tanh(t @ v), x, w),
    "closure": lambda w, x, ckpt: ckpt(lambda t: torch.tanh(t @ w), x),
    "nested-dict": lambda w, x, ckpt: (lambda p: ckpt(lambda t: torch.tanh(t @ p["l1"]["w"]), x))({"l1": {"w": w}}),
    "nested-list": lambda w, x, ckpt: (lambda p: ckpt(lambda t: torch.tanh(t @ p[0][0]), x))([[w]]),
    "dict-of-tuple": lambda w, x, ckpt: (lambda p: ckpt(lambda t: torch.tanh(t @ p["a"][0]), x))({"a": (w,)}),
    "partial": lambda w, x, ckpt: ckpt(functools.partial(lambda t, v: torch.tanh(t @ v), v=w), x),
    "module-argument": _functional("module-argument"),
    "module-whole": _functional("module"),
    "tensor-attribute": _scaled,
    "list-held-submodule": _list_held,
    "forward-hook": _hooked,
    "monkeypatched-forward": _monkeypatched,
    "class-attribute": _with_class,
    "module-global": _with_global,
    "namespace-attribute": _with_namespace,
    "residual": lambda w, x, ckpt: ckpt(lambda t: torch.tanh(t @ w) + x, x),
    "bound-tensor-method": lambda w, x, ckpt: torch.tanh(ckpt(w.add, x[:1].expand(3, 3))),
    "dataclass-argument": lambda w, x, ckpt: ckpt(lambda p: torch.tanh(p.t @ p.w), Pack(x, w)),
    "dataclass-output": lambda w, x, ckpt: ckpt(lambda t, v: Out(torch.tanh(t @ v)), x, w).y,
    "namedtuple-argument": lambda w, x, ckpt: ckpt(lambda p: torch.tanh(p.t @ p.w), Pair(x, w)),
    "loop-rebinding": _loop_rebinding,
}

#: reaches that reset what the block reads once the call returns (a global, a class attribute):
#: an eager .backward() recomputes after that, which torch's checkpoint cannot survive
RESET_AFTER_THE_CALL = frozenset({"class-attribute", "module-global", "namespace-attribute"})

#: reaches the static walk lifts: the composable recompute runs (memory saving kept)
LIFTED = frozenset(REACHES) - {"class-attribute", "module-global", "namespace-attribute"}


# --------------------------------------------------------------------------
# transforms: each returns a flat list of tensors


def _flat(value) -> List[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _loss(model: Model):
    return lambda w, x: model(w, x).pow(2).sum()


def _pullback_grad(model: Model, w, x):
    _, pullback = vjp(model, w, x)
    return grad(lambda c: sum(g.pow(2).sum() for g in pullback(c)))(torch.ones_like(model(w, x)))


def _eager_after(model: Model, w, x):
    w, x = w.detach().requires_grad_(), x.detach().requires_grad_()
    g = grad(lambda v: model(w, v).pow(2).sum())(x)
    g.pow(2).sum().backward()
    return [w.grad, x.grad]


def _eager(model: Model, w, x):
    w, x = w.detach().requires_grad_(), x.detach().requires_grad_()
    model(w, x).pow(2).sum().backward()
    return [w.grad, x.grad]


TRANSFORMS: Dict[str, Callable[[Model, torch.Tensor, torch.Tensor], List[torch.Tensor]]] = {
    "eager .backward()": lambda m, w, x: _flat(_eager(m, w, x)),
    "grad": lambda m, w, x: _flat(grad(_loss(m), argnums=(0, 1))(w, x)),
    "vmap(grad)": lambda m, w, x: _flat(vmap(grad(_loss(m), argnums=(0, 1)), in_dims=(None, 0))(w, x[:, None])),
    "jacrev": lambda m, w, x: _flat(jacrev(m, argnums=(0, 1))(w, x)),
    "jacfwd": lambda m, w, x: _flat(jacfwd(m, argnums=(0, 1))(w, x)),
    "hessian": lambda m, w, x: _flat(hessian(_loss(m), argnums=(0, 1))(w, x)),
    "jvp": lambda m, w, x: _flat(jvp(m, (w, x), (torch.ones_like(w), torch.ones_like(x)))),
    "grad-through-pullback": lambda m, w, x: _flat(_pullback_grad(m, w, x)),
    "then-backward": lambda m, w, x: _flat(_eager_after(m, w, x)),
}


def inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64, generator=g) * 0.5
    x = torch.randn(2, 3, dtype=torch.float64, generator=g)
    return w, x


def run(reach: str, transform: str, ckpt: Ckpt) -> List[torch.Tensor]:
    w, x = inputs()
    body = REACHES[reach]
    return TRANSFORMS[transform](lambda w_, x_: body(w_, x_, ckpt), w, x)
