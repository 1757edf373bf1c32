"""Random checkpoint compositions for the differential fuzz test (``test_fuzz.py``).

A :class:`Comp` is a plain, printable record of choices; :func:`run` builds the
program it describes and runs it one of five ways:

* ``"reference"``: no checkpointing at all (the same model, plain calls);
* ``"raw"``: torch's checkpoint with the guard uninstalled;
* ``"strict"`` / ``"warn"`` / ``"fallback"``: the guard installed, the policy scoped.

Each run gives an :class:`Outcome`: a list of tensors (outputs, tangents and
gradients; a missing gradient reads as zeros) or the exception raised, plus the
ids of the ``CheckpointCompositionWarning``s emitted.

A failing example prints its ``Comp``; ``run(comp, "raw")`` etc. reproduce it.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.autograd.forward_ad as fwAD
import torch.utils.checkpoint as tuc
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Bound before ckpt_guard.install() runs (test_fuzz installs in a fixture).
from torch.utils.checkpoint import checkpoint as bound_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning

TRANSFORMS = ("grad", "vjp", "jacrev", "vmap", "jvp", "jacfwd", "functionalize")
GRAD_TRANSFORMS = ("grad", "vjp", "jacrev")
ENTRIES = ("direct", "bound", "partial", "sequential", "wrapper")
RUNS = ("reference", "raw", "strict", "warn", "fallback")


@dataclass(frozen=True)
class Comp:
    """One composition.  ``transforms`` is outermost first: ("vmap", "grad") is vmap(grad(f))."""

    transforms: Tuple[str, ...] = ()
    use_reentrant: Optional[bool] = False  # None: not passed
    entry: str = "direct"
    # "module" | "lambda" (captures the parent Net) | "dict" (the block in a dict the closure holds:
    # seen) | "namespace" (the block in an attribute of an object: seen) | "object" (the block in
    # a __slots__ object's attribute: out of the guard's sight)
    fn_kind: str = "module"
    fcall: str = "none"  # functional_call: "none" | "all" (swap every parameter) | "head" (swap the head only)
    dual: bool = False  # forward-mode AD: the input is a dual tensor
    mode: str = "none"  # "none" | "dispatch" | "function": a user mode doubling sin, around the forward
    backward_in_mode: bool = False  # .backward() inside the mode as well
    hooks_disabled: bool = False  # disable_saved_tensors_hooks around the whole step
    no_grad: bool = False  # torch.no_grad() around the forward
    x_requires_grad: bool = True
    block_trainable: bool = True
    dtype_switch: bool = False  # the block creates a constant; default dtype float64 during backward
    do_backward: bool = True  # .backward() after everything returned
    #: set only by explicit regression examples: the known bug they document (the
    #: test then fails on it instead of counting it; the strategy never sets it)
    expect_bug: str = ""


# --------------------------------------------------------------------------
# user modes (module level: the guard compares mode classes)


class _Slots:
    """An object without a ``__dict__``: the guard reads the slots the block's code names."""

    __slots__ = ("block",)

    def __init__(self, block) -> None:
        self.block = block


class DoubleSinDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.ops.aten.sin.default else out


class DoubleSinFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.sin else out


def _mode(comp: Comp):
    if comp.mode == "dispatch":
        return DoubleSinDispatch()
    if comp.mode == "function":
        return DoubleSinFunction()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------
# the model


class Sin(torch.nn.Module):
    """``sin(t) * t``: saves the sin output for backward, so a mode that changes sin shows in gradients."""

    def forward(self, t):
        return torch.sin(t) * t


class DtypeTrick(torch.nn.Module):
    """Creates a constant: the extra term is 0 in float32 and ``2t`` in float64."""

    def forward(self, t):
        big = torch.tensor(2.0**24)
        return t + 2 * t * ((big + 1) - big)  # x1 vs x3: never cancels the modes' x2


def _variant_kwargs(use_reentrant: Optional[bool]) -> dict:
    return {} if use_reentrant is None else {"use_reentrant": use_reentrant}


class Net(torch.nn.Module):
    """head(block(x)); the block is checkpointed through the entry point ``comp.entry``."""

    def __init__(self, comp: Comp, checkpointed: bool):
        super().__init__()
        layers = [torch.nn.Linear(3, 3), Sin()] + ([DtypeTrick()] if comp.dtype_switch else [])
        block = torch.nn.Sequential(*layers)
        if not comp.block_trainable:
            block.requires_grad_(False)
        self.comp, self.checkpointed = comp, checkpointed
        if checkpointed and comp.entry == "wrapper":
            impl = {} if comp.use_reentrant is None else {
                "checkpoint_impl": CheckpointImpl.REENTRANT if comp.use_reentrant else CheckpointImpl.NO_REENTRANT
            }
            block = checkpoint_wrapper(block, **impl)
        self.block = block
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x):
        comp = self.comp
        kw = _variant_kwargs(comp.use_reentrant)
        if not self.checkpointed or comp.entry == "wrapper":
            h = self.block(x)
        elif comp.entry == "sequential":
            h = tuc.checkpoint_sequential(self.block, 2, x, **kw)
        else:
            if comp.fn_kind == "lambda":
                fn = lambda t: self.block(t)  # noqa: E731 - captures the whole Net
            elif comp.fn_kind == "dict":
                holder = {"block": self.block}
                fn = lambda t: holder["block"](t)  # noqa: E731 - a dict the closure holds: seen
            elif comp.fn_kind == "namespace":
                holder = types.SimpleNamespace(block=self.block)
                fn = lambda t: holder.block(t)  # noqa: E731 - an object's attribute: seen
            elif comp.fn_kind == "object":
                hidden = _Slots(self.block)
                fn = lambda t: hidden.block(t)  # noqa: E731 - a slot the closure's code names: seen
            else:
                fn = self.block
            if comp.entry == "direct":
                h = tuc.checkpoint(fn, x, **kw)
            elif comp.entry == "bound":
                h = bound_checkpoint(fn, x, **kw)
            else:
                h = functools.partial(tuc.checkpoint, **kw)(fn, x)
        return self.head(h)


# --------------------------------------------------------------------------
# torch.func adapters: each maps a (3,) -> (3,) function to another one


def _adapt(name: str, g):
    func = torch.func
    if name == "grad":
        return lambda x: func.grad(lambda t: g(t).sum())(x)
    if name == "vjp":
        def h(x):
            out, pullback = func.vjp(g, x)
            return pullback(torch.ones_like(out))[0]
        return h
    if name in ("jacrev", "jacfwd"):
        jac = getattr(func, name)
        return lambda x: jac(g)(x).sum(-1)
    if name == "vmap":
        return lambda x: func.vmap(g)(torch.stack([x, x * 0.5])).sum(0)
    if name == "jvp":
        def h(x):
            out, tangent = func.jvp(g, (x,), (torch.ones_like(x),))
            return out + tangent
        return h
    if name == "functionalize":
        return func.functionalize(g)
    raise ValueError(name)


def _zeros_if_none(t, like):
    return torch.zeros_like(like) if t is None else t


def program(comp: Comp, checkpointed: bool) -> List[torch.Tensor]:
    """Run the composition once; return outputs, tangents and gradients."""
    torch.manual_seed(0)
    net = Net(comp, checkpointed)
    x = torch.randn(3).requires_grad_(comp.x_requires_grad)
    new = {}
    if comp.fcall != "none":
        new = {
            k: (v.detach() * 1.5 + 0.1).requires_grad_(v.requires_grad)
            for k, v in net.named_parameters()
            if comp.fcall == "all" or k.startswith("head.")
        }

    def g(t):
        if comp.fcall != "none":
            return torch.func.functional_call(net, new, (t,))
        return net(t)

    for name in reversed(comp.transforms):  # wrap inner to outer
        g = _adapt(name, g)

    previous_dtype = torch.get_default_dtype()
    with contextlib.ExitStack() as step:
        if comp.hooks_disabled:
            step.enter_context(torch.autograd.graph.disable_saved_tensors_hooks("fuzz: saved tensor hooks disabled"))
        if comp.dual:
            step.enter_context(fwAD.dual_level())
            inp = fwAD.make_dual(x, torch.ones_like(x))
        else:
            inp = x
        with contextlib.ExitStack() as moded:
            moded.enter_context(_mode(comp))
            with torch.no_grad() if comp.no_grad else contextlib.nullcontext():
                y = g(inp)
            if comp.dual:
                y, tangent = fwAD.unpack_dual(y)
                tangents = [_zeros_if_none(tangent, y).detach()]
            else:
                tangents = []
            if not comp.backward_in_mode:
                moded.close()
            if comp.do_backward and y.requires_grad:
                try:
                    if comp.dtype_switch:
                        torch.set_default_dtype(torch.float64)
                    y.sum().backward()
                finally:
                    torch.set_default_dtype(previous_dtype)
    grads = [_zeros_if_none(t.grad, t) for t in (x, *new.values(), *net.parameters())]
    return [y.detach(), *tangents, *grads]


def raw_crashes(comp: Comp) -> bool:
    """Compositions on which raw torch 2.13 crashes the interpreter (SIGSEGV).

    A non-reentrant checkpoint under functionalize(jvp-or-jacfwd(functionalize(f)))
    with backward outside.  The guard raises CKG104 there; the crash itself is
    measured in a subprocess by
    ``test_recompute_drift.test_torch_segfault_under_functionalize_jvp_becomes_ckg104``.
    Running it in-process would end the fuzz run, so the test leaves it out.
    """
    t = comp.transforms
    # not passed: checkpoint defaults to reentrant, checkpoint_wrapper to non-reentrant
    non_reentrant = comp.use_reentrant is False or (comp.use_reentrant is None and comp.entry == "wrapper")
    return (
        non_reentrant
        and len(t) >= 3
        and t[0] == "functionalize"
        and t[-1] == "functionalize"
        and any(name in ("jvp", "jacfwd") for name in t[1:-1])
    )


# --------------------------------------------------------------------------
# running it five ways


@dataclass
class Outcome:
    values: Optional[List[torch.Tensor]]
    error: Optional[BaseException]
    warned: Tuple[str, ...]  # rule ids of CheckpointCompositionWarnings

    @property
    def fired(self) -> bool:
        return isinstance(self.error, CheckpointCompositionError)

    def describe(self) -> str:
        if self.error is not None:
            first = str(self.error).splitlines()[0] if str(self.error) else ""
            return f"raises {type(self.error).__name__}: {first[:150]}"
        return "ok"


def run(comp: Comp, how: str) -> Outcome:
    """Run ``comp`` as ``how`` (one of RUNS).  Expects the guard installed with strict."""
    values, error = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if how == "reference":
                values = program(comp, checkpointed=False)
            elif how == "raw":
                ckpt_guard.uninstall()
                try:
                    values = program(comp, checkpointed=True)
                finally:
                    ckpt_guard.install("strict", rules={})
            else:
                with ckpt_guard.policy(how):
                    values = program(comp, checkpointed=True)
        except Exception as e:  # noqa: BLE001 - the outcome is the exception
            error = e
    warned = tuple(
        w.message.rule.id for w in caught if issubclass(w.category, CheckpointCompositionWarning)
    )
    return Outcome(values, error, warned)


def all_close(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return False
    try:
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
    except AssertionError:
        return False
    return True


def all_equal(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b)
    )


# --------------------------------------------------------------------------
# the strategy


def _pick(true_weight: int, false_weight: int):
    return st.sampled_from([True] * true_weight + [False] * false_weight)


@st.composite
def compositions(draw) -> Comp:
    transforms = tuple(draw(st.lists(st.sampled_from(TRANSFORMS), max_size=3)))
    entry = draw(st.sampled_from(ENTRIES))
    fn_kind = draw(st.sampled_from(("module", "module", "lambda", "dict", "namespace", "object"))) if entry in ("direct", "bound", "partial") else "module"
    mode = draw(st.sampled_from(("none", "none", "none", "dispatch", "function")))
    do_backward = draw(_pick(3, 1))
    return Comp(
        transforms=transforms,
        use_reentrant=draw(st.sampled_from((True, False, None))),
        entry=entry,
        fn_kind=fn_kind,
        fcall=draw(st.sampled_from(("none", "none", "none", "all", "head"))),
        dual=draw(_pick(1, 5)),
        mode=mode,
        backward_in_mode=mode != "none" and do_backward and draw(st.booleans()),
        hooks_disabled=draw(_pick(1, 6)),
        no_grad=draw(_pick(1, 6)),
        x_requires_grad=draw(_pick(3, 1)),
        block_trainable=draw(_pick(4, 1)),
        dtype_switch=do_backward and draw(_pick(1, 6)),
        do_backward=do_backward,
    )
