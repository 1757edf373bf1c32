"""A read the recompute cannot see must end in a refusal, never in a number (issue 46, items 1-3, 8).

The property: hide a tensor that a transform differentiates every way a block can reach
it (its closure, a dict it closes over, an object's attribute, a class attribute, a
module namespace global, a helper kept as a global: a function closing over it, a partial, a
bound method), read it every way (plainly, inside
``torch._C.DisableTorchFunction()``, added in place into a tensor the block made), and
differentiate under every reverse transform through both doors (``ckpt_guard.checkpoint``
and torch's checkpoint under fallback).  Each program runs without checkpointing (the
reference) and checkpointed: strict returns the reference's numbers or raises
``CheckpointCompositionError`` of a documented refusal class; fallback returns the
reference's numbers.  Never another number.

Then the places issue 46 found a gap in: outputs that share memory written by the caller
(refused, class ``aliasing-outputs``), checkpoints nested deeper than three whose blocks
close over the tensors (right), and an input written after the call on torch's path
(right: the recompute starts from a copy on write).
"""

from __future__ import annotations

import functools
import types
import warnings

import pytest
import torch
from torch.func import grad, hessian, jacrev, vmap

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, _composable

DTYPE = torch.float64
X = torch.randn(3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
W = 0.5 * torch.randn(4, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
HIDDEN = types.SimpleNamespace(w=None)  # a module namespace global, by attribute


class Holder:
    w = None  # a class attribute

    def __init__(self, w=None):
        self.own = w

    def get(self):
        return self.own


class _Uncopyable:
    """An object that refuses to be copied (the recompute cannot rebuild it with its own tensors)."""

    def __init__(self, w):
        self.w = w

    def __copy__(self):
        raise TypeError("an _Uncopyable cannot be copied")

    def __reduce_ex__(self, protocol):
        raise TypeError("an _Uncopyable cannot be copied")


#: helpers kept as module globals, each holding the tensor where a copy of the block cannot reach
GLOBAL_HELPER = GLOBAL_PARTIAL = GLOBAL_METHOD = None

def _global_helper():
    return GLOBAL_HELPER()


def _global_partial():
    return GLOBAL_PARTIAL()


def _global_method():
    return GLOBAL_METHOD()


_THROUGH_A_GLOBAL_HELPER = {
    "a global helper's closure": _global_helper, "a global partial": _global_partial,
    "a global bound method": _global_method,
}

PLACES = (
    "closure", "dict in a closure", "object attribute", "class attribute", "module global",
    "a global helper's closure", "a global partial", "a global bound method",
    "an uncopyable object in a closure", "an uncopyable object as an argument",
)
READS = ("plainly", "with torch functions off", "added in place, torch functions off")
TRANSFORMS = {
    "grad": lambda f: grad(f)(W),
    "vmap(grad)": lambda f: vmap(grad(f), in_dims=0)(torch.stack([W, 2 * W])),
    "jacrev": lambda f: jacrev(f)(W),
    "hessian": lambda f: hessian(f)(W[0]),
}
ENTRIES = ("ckpt_guard.checkpoint", "torch checkpoint, fallback")


def _program(place: str, read: str, ckpt):
    """``loss(w)``: a checkpointed block that reads ``w`` from ``place``, ``read`` the given way."""

    def loss(w):
        global GLOBAL_HELPER, GLOBAL_PARTIAL, GLOBAL_METHOD
        if w.dim() == 1:  # hessian's point: a row of W
            w = torch.cat([w[None], W[1:]])
        box = {"w": w}
        obj = types.SimpleNamespace(w=w)
        Holder.w = w
        HIDDEN.w = w
        GLOBAL_HELPER = (lambda v: lambda: v)(w)  # found through the helper's closure (issue 49's survey)
        GLOBAL_PARTIAL = functools.partial(lambda v: v, w)
        GLOBAL_METHOD = Holder(w).get
        uncopyable = _Uncopyable(w)

        if place in _THROUGH_A_GLOBAL_HELPER:  # the block reaches nothing else that holds w
            get = _THROUGH_A_GLOBAL_HELPER[place]
        elif place == "an uncopyable object in a closure":  # nor here
            get = lambda: uncopyable.w  # noqa: E731
        elif place == "an uncopyable object as an argument":  # (the block reads the one it is given)
            get = None
        else:
            def get():
                return {
                    "closure": lambda: w, "dict in a closure": lambda: box["w"], "object attribute": lambda: obj.w,
                    "class attribute": lambda: Holder.w, "module global": lambda: HIDDEN.w,
                }[place]()

        def block(t, given=None):
            read_w = get if given is None else (lambda: given.w)  # (an object the block is given)
            h = torch.tanh(t @ W)
            if read == "plainly":
                return torch.tanh(h @ read_w())
            if read == "with torch functions off":
                with torch._C.DisableTorchFunction():
                    return torch.tanh(h @ read_w())
            with torch._C.DisableTorchFunction():
                h.add_(read_w()[0])
            return torch.tanh(h)

        if place == "an uncopyable object as an argument":
            return ckpt(block, X, uncopyable).pow(2).sum()
        return ckpt(block, X).pow(2).sum()

    return loss


def _run(place, read, transform, entry, policy):
    if entry == "ckpt_guard.checkpoint":
        ckpt = ckpt_guard.checkpoint
        scope = ckpt_guard.policy(policy)
    else:
        def ckpt(f, *args):
            return torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=False)
        scope = _Installed(policy)
    with scope, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TRANSFORMS[transform](_program(place, read, ckpt))


class _Installed:
    def __init__(self, policy):
        self.policy = policy

    def __enter__(self):
        ckpt_guard.install(self.policy, rules={})

    def __exit__(self, *exc):
        ckpt_guard.uninstall()


def _documented(exc: CheckpointCompositionError) -> bool:
    text = str(exc)
    return any(f"(refusal class {kind}," in text for kind in _composable.REFUSAL_CLASSES)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("place", PLACES)
def test_a_hidden_read_is_right_or_refused(place, read, transform, entry):
    if read.startswith("added in place") and transform == "vmap(grad)":
        pytest.skip("vmap itself refuses a batched value added in place into an unbatched tensor (the plain program raises)")
    reference = TRANSFORMS[transform](_program(place, read, lambda f, *args: f(*args)))
    assert reference.abs().sum() > 0  # the hidden tensor matters to the gradient
    if entry == "ckpt_guard.checkpoint":  # strict: the reference's numbers, or a documented refusal
        try:
            got = _run(place, read, transform, entry, "strict")
        except CheckpointCompositionError as exc:
            assert _documented(exc), str(exc)
        else:
            torch.testing.assert_close(got, reference)
    torch.testing.assert_close(_run(place, read, transform, entry, "fallback"), reference)


class _CallableHolder:
    def __init__(self, w):
        self.w = w

    def __call__(self):
        return self.w


class _StaticHolder:
    get = None  # a staticmethod set per program


#: a global that holds a helper reading ``w``: each is set by the program, then read by the block
GLOBAL_HOLDERS = {
    "a dict of helpers": lambda w: {"w": (lambda v: lambda: v)(w)},
    "a list of partials": lambda w: [functools.partial(lambda v: v, w)],
    "a callable object": lambda w: _CallableHolder(w),
    "a namespace holding a helper": lambda w: types.SimpleNamespace(get=(lambda v: lambda: v)(w)),
    "an lru_cache-wrapped helper": lambda w: functools.lru_cache(None)((lambda v: lambda: v)(w)),
    "a class's staticmethod": lambda w: _static_holder(w),
}
_READ_THROUGH = {
    "a dict of helpers": lambda: GLOBAL_HOLDER["w"](), "a list of partials": lambda: GLOBAL_HOLDER[0](),
    "a callable object": lambda: GLOBAL_HOLDER(), "a namespace holding a helper": lambda: GLOBAL_HOLDER.get(),
    "an lru_cache-wrapped helper": lambda: GLOBAL_HOLDER(), "a class's staticmethod": lambda: GLOBAL_HOLDER.get(),
}
GLOBAL_HOLDER = None


def _static_holder(w):
    _StaticHolder.get = staticmethod((lambda v: lambda: v)(w))
    return _StaticHolder


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap(grad)"])
@pytest.mark.parametrize("holder", list(GLOBAL_HOLDERS))
def test_a_tensor_read_through_its_closure_and_a_global_holder_is_never_a_wrong_number(holder, transform):
    """The block reads ``w`` through its closure (so the walk lifts it) and through a global holding a
    helper that returns it (which nothing rebinds for the recompute): the recompute read the call's
    ``w`` there and the gradient was wrong (a review found these after the fix for a global helper
    itself).  Everything a global holds is now walked as unbindable: refused, or fallback's right number."""
    read = _READ_THROUGH[holder]

    def program(ck):
        def loss(w):
            global GLOBAL_HOLDER
            GLOBAL_HOLDER = GLOBAL_HOLDERS[holder](w)

            def block(t):
                return torch.tanh(t @ w) * read().sum()
            return ck(block, X).pow(2).sum()
        if transform == "grad":
            return grad(loss)(W)
        if transform == "vjp":
            return torch.func.vjp(loss, W)[1](torch.tensor(1.0, dtype=DTYPE))[0]
        return vmap(grad(loss))(torch.stack([W, 2 * W]))

    reference = program(lambda f, x: f(x))
    try:
        with ckpt_guard.policy("strict"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = program(ckpt_guard.checkpoint)
    except CheckpointCompositionError as exc:
        assert _documented(exc), str(exc)
    else:
        torch.testing.assert_close(got, reference)
    with _Installed("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = program(lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False))
    torch.testing.assert_close(got, reference)


def test_a_long_chain_of_global_helpers_is_walked_to_its_end():
    """``h0 -> h1 -> ... -> h200``, each a global calling the next, the last returning ``w`` (also in the
    block's closure): walked one helper per nested walk, the stack ran out past some 120 links, the
    error was swallowed and the gradient was wrong.  One queue now: refused at any length."""
    namespace: dict = {"__name__": "chain", "torch": torch, "X": X}
    n = 200
    exec("\n".join(f"def h{i}(): return h{i + 1}()" for i in range(n)) + f"\ndef h{n}(): return LAST()\n" + (
        "def loss(w, ck):\n"
        "    global LAST\n"
        "    LAST = (lambda v: lambda: v)(w)\n"
        "    def block(t):\n"
        "        return torch.tanh(t @ w) * h0().sum()\n"  # w through the closure, and through the chain
        "    return ck(block, X).pow(2).sum()\n"
    ), namespace)
    loss = namespace["loss"]

    reference = grad(loss)(W, lambda f, x: f(x))
    assert reference.abs().sum() > 0
    with ckpt_guard.policy("strict"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCompositionError, match="global-tensor"):
            grad(loss)(W, ckpt_guard.checkpoint)


def test_a_read_no_walk_and_no_mode_sees_is_refused_from_the_graph():
    """Looked up where no walk follows (by name, through sys.modules) and read with torch functions off:
    neither the walk nor the mode sees it; the graph of what the block returned does (it was silently 0)."""
    import sys

    def loss(w):
        sys.modules[__name__].SECRET = w

        def block(t):
            with torch._C.DisableTorchFunction():
                return torch.tanh(t @ getattr(sys.modules[__name__], "SECRET"))

        return ckpt_guard.checkpoint(block, X).pow(2).sum()

    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError) as info:
        grad(loss)(W)
    text = str(info.value)
    assert "refusal class unlifted-read" in text and "torch functions off" in text
    assert "found in the graph of what it returned" in text


# --------------------------------------------------------------------------
# outputs that share memory, written by the caller (item 1)

ALIASES = {
    "a tensor and a slice of it": lambda h: (h, h[..., :2]),
    "a tensor and a view of it": lambda h: (h, h.view(-1)),
    "two overlapping views": lambda h: (h[:, :3], h[:, 1:]),
    "the same tensor twice": lambda h: (h, h),
}
WRITE_TRANSFORMS = {
    "grad": lambda f, x: grad(f)(x),
    "vmap(grad)": lambda f, x: vmap(grad(f))(torch.stack([x, 2 * x])),
    "jacrev": lambda f, x: jacrev(f)(x),
    "hessian": lambda f, x: hessian(f)(x[0]),
}


def _aliasing(how, ckpt):
    torch.manual_seed(2)  # the same layer for the plain and the checkpointed program
    lin = torch.nn.Linear(4, 4).to(DTYPE)

    def block(t):
        return ALIASES[how](torch.tanh(lin(t)) * 1.0)

    def loss(x):
        if x.dim() == 1:
            x = torch.cat([x[None], X[1:]])
        a, b = ckpt(block, x)
        b.mul_(2.0)  # reaches a too, without checkpointing
        return (a ** 2).sum()

    return loss


@pytest.mark.parametrize("transform", list(WRITE_TRANSFORMS))
@pytest.mark.parametrize("how", list(ALIASES))
def test_outputs_that_share_memory_are_refused_never_a_number(how, transform):
    """Refused (strict raises, fallback's result is the plain run); the same tensor returned twice
    is one output of the recompute in both places, so the write reaches it: packed, and right."""
    reference = WRITE_TRANSFORMS[transform](_aliasing(how, lambda f, x: f(x)), X)
    if how == "the same tensor twice":
        before = _composable.counters.PACKED
        with ckpt_guard.policy("strict"):
            got = WRITE_TRANSFORMS[transform](_aliasing(how, ckpt_guard.checkpoint), X)
        assert _composable.counters.PACKED > before
        torch.testing.assert_close(got, reference)
        return
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match="refusal class aliasing-outputs"):
        WRITE_TRANSFORMS[transform](_aliasing(how, ckpt_guard.checkpoint), X)
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = WRITE_TRANSFORMS[transform](_aliasing(how, ckpt_guard.checkpoint), X)
    torch.testing.assert_close(got, reference)


def test_disjoint_parts_of_one_tensor_are_still_packed():
    """q, k, v = qkv.split(...): parts that share a storage but no element are no aliasing."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(4, 12).to(DTYPE)

    def block(t):
        return lin(t).split(4, dim=-1)

    def loss(x, ckpt):
        q, k, v = ckpt(block, x)
        return (torch.tanh(q) * k + v).sum()

    before = _composable.counters.PACKED
    with ckpt_guard.policy("strict"):
        got = grad(loss)(X, ckpt_guard.checkpoint)
    assert _composable.counters.PACKED > before
    torch.testing.assert_close(got, grad(loss)(X, lambda f, x: f(x)))


# --------------------------------------------------------------------------
# nested deeper than three, the tensor in a closure (item 2)

@pytest.mark.parametrize("depth", [1, 3, 4, 6])
@pytest.mark.parametrize("form", ["closure over the next", "recursive block"])
@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap(grad)"])
def test_deep_nesting_through_a_closure_is_right(depth, form, transform):
    def program(ck):
        def loss(w):
            if form == "closure over the next":
                def nest(t, d):
                    if d == 0:
                        return t
                    return ck(lambda u: nest(torch.tanh(u @ w), d - 1), t)
                return nest(X, depth).pow(2).sum()

            def block(t, n):
                t = torch.tanh(t @ w)
                return t if n == 1 else ck(block, t, n - 1)
            return ck(block, X, depth).pow(2).sum()
        return loss

    run = {"grad": lambda f: grad(f)(W), "jacrev": lambda f: jacrev(f)(W),
           "vmap(grad)": lambda f: vmap(grad(f))(torch.stack([W, 2 * W]))}[transform]
    reference = run(program(lambda f, *a: f(*a)))
    with ckpt_guard.policy("strict"):
        torch.testing.assert_close(run(program(ckpt_guard.checkpoint)), reference)


# --------------------------------------------------------------------------
# an input written in place, on torch's path (items 8 and 10, eager)

#: what a block saves of its input: nothing (exp saves its output), the input, a view of it
SAVES = {
    "nothing of its input": lambda lin: (lambda t: torch.exp(0.5 * t)),
    "its input": lambda lin: (lambda t: lin(t)),
    "a view of its input": lambda lin: (lambda t: lin(t.view(3, 4)[1:])),
}
#: torch can hand the guard its recompute's saved-tensor hooks (not 2.4): a caller's write is then
#: recomputed from what the call found, and raised only where the block saved the input
WATCHES_THE_RECOMPUTE = hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")


@pytest.mark.parametrize("saves", list(SAVES))
@pytest.mark.parametrize("writer", ["the caller after the call", "the block itself"])
@pytest.mark.parametrize("policy", ["strict", "fallback"])
@pytest.mark.parametrize("entry", ["ckpt_guard.checkpoint", "torch checkpoint"])
def test_an_input_written_in_place_on_torchs_path_is_what_the_plain_program_does(saves, writer, policy, entry):
    """Torch alone raises that a saved tensor was modified.  The block's own write (``torch.relu_``
    first): strict and fallback recompute from a copy on write of what the call found, right.  The
    caller's write after the call (issue 46, item 8): recomputed from what the call found where the
    block saved nothing of that input (the plain program runs: the same numbers), raised in
    autograd's words where it saved the input or a view (the plain program raises there too)."""
    def run(ckpt):
        torch.manual_seed(0)
        lin, inner = torch.nn.Linear(4, 4).to(DTYPE), torch.nn.Linear(4, 4).to(DTYPE)
        x = X.clone().requires_grad_()
        h = lin(x)
        body = SAVES[saves](inner)
        if writer == "the block itself":
            y = ckpt(lambda t: body(torch.relu_(t)), h)
        else:
            y = ckpt(body, h)
            h.add_(1.0)
        ((2 * y).sum() + h.pow(2).sum()).backward()
        return [x.grad, lin.weight.grad, inner.weight.grad]

    def torchs(f, t):
        return torch.utils.checkpoint.checkpoint(f, t, use_reentrant=False)

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(torchs)  # torch alone
    scope = ckpt_guard.policy(policy) if entry == "ckpt_guard.checkpoint" else _Installed(policy)
    ckpt = ckpt_guard.checkpoint if entry == "ckpt_guard.checkpoint" else torchs
    plain_raises = writer == "the caller after the call" and saves != "nothing of its input"
    if plain_raises:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run(lambda f, t: f(t))  # measured: the plain program raises here
    reference = None if plain_raises else run(lambda f, t: f(t))
    if plain_raises or (writer == "the caller after the call" and not WATCHES_THE_RECOMPUTE):
        with scope, pytest.raises(RuntimeError, match=r"modified by an inplace operation: an input of a checkpointed"):
            run(ckpt)
        return
    with scope:
        got = run(ckpt)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)
