"""Blocks of many shapes the guard may fail to read: it degrades to torch's own behaviour, never a crash.

A ``torch.jit.script``ed module crashed the guard's block snapshot (``dict.copy``
of TorchScript's ``OrderedDictWrapper``) where raw torch ran it (issue 27).  Each
block below is checkpointed raw (guard uninstalled), under strict and under
fallback, with both variants, outside any transform (no rule applies): the
guarded outcome is torch's, value for value (the gradient of the input and of
every parameter), or the same exception type.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ckpt_guard


def _sequential():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))


class _Forwarding:
    """A proxy: every attribute is the wrapped module's (``__getattr__`` for all of it), callable."""

    def __init__(self, module):
        object.__setattr__(self, "_wrapped", module)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_wrapped"), name)

    def __call__(self, *args):
        return object.__getattribute__(self, "_wrapped")(*args)


class _Loud(torch.nn.Module):
    """A module whose __getattr__ answers every name (a wrapper library's style) and a property that raises."""

    def __init__(self):
        super().__init__()
        self.inner = _sequential()

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    @property
    def broken(self):
        raise RuntimeError("a property that raises when read")

    def forward(self, x):
        return self.inner(x)


def _blocks():
    scripted = torch.jit.script(_sequential())
    traced = torch.jit.trace(_sequential(), torch.randn(2, 3))
    return {
        "torch.jit.script module": lambda: torch.jit.script(_sequential()),
        "torch.jit.trace module": lambda: torch.jit.trace(_sequential(), torch.randn(2, 3)),
        "a scripted module's bound forward": lambda: scripted.forward,
        "partial of a traced module": lambda: functools.partial(traced),
        "a __getattr__ proxy of a module": lambda: _Forwarding(_sequential()),
        "a module with a __getattr__ for every name and a raising property": _Loud,
        "a C function (torch.tanh)": lambda: torch.tanh,
        "a scripted function": lambda: torch.jit.script(_tanh_twice),
        "a torch.compile'd module": lambda: torch.compile(_sequential(), backend="eager"),
        "an fx GraphModule": lambda: torch.fx.symbolic_trace(_sequential()),
        "an autograd.Function's apply (a C method)": lambda: _Square.apply,
        "a module behind a C-level partial and a bound __call__": lambda: functools.partial(_sequential().__call__),
    }


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def _tanh_twice(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


BLOCKS = _blocks()


def _outcome(block, use_reentrant):
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
    params = [p for p in getattr(block, "parameters", lambda: [])()] if hasattr(block, "parameters") else []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checkpoint(block, x, use_reentrant=use_reentrant).pow(2).sum().backward()
    except Exception as error:  # noqa: BLE001 - compared with torch's own
        return type(error)
    return [x.grad, *[p.grad for p in params]]


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("policy", ["strict", "fallback"])
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_the_guard_degrades_to_torchs_behaviour_on_blocks_it_cannot_read(kind, policy, use_reentrant):
    ckpt_guard.uninstall()
    raw = _outcome(BLOCKS[kind](), use_reentrant)
    ckpt_guard.install(policy)
    try:
        guarded = _outcome(BLOCKS[kind](), use_reentrant)
    finally:
        ckpt_guard.uninstall()
    if isinstance(raw, type):
        assert guarded is raw, f"torch raised {raw.__name__}, the guard {guarded}"
        return
    assert not isinstance(guarded, type), f"torch ran it; the guard raised {guarded.__name__}"
    assert len(guarded) == len(raw)
    for g, r in zip(guarded, raw):
        assert (g is None) == (r is None)
        if r is not None:
            assert torch.equal(g, r)  # no rule fires: bitwise torch's


def test_a_scripted_module_under_a_transform_is_refused_by_class_never_a_crash():
    """ckpt_guard.checkpoint of a TorchScript module under grad crashed in the per-thread binding (its
    parameter dict is TorchScript's); a recompute could not bind its parameters anyway (TorchScript
    reads its own). Refused: strict explains (class scripted), fallback returns the plain run."""
    from torch.func import grad

    from ckpt_guard import CheckpointCompositionError

    scripted = torch.jit.script(_sequential())
    x = torch.randn(4, 3)
    expected = grad(lambda t: scripted(t).pow(2).sum())(x)
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match="refusal class scripted"):
        grad(lambda t: ckpt_guard.checkpoint(scripted, t).pow(2).sum())(x)
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = grad(lambda t: ckpt_guard.checkpoint(scripted, t).pow(2).sum())(x)
    torch.testing.assert_close(got, expected)


def _public_outcome(block):
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
    params = [p for p in getattr(block, "parameters", lambda: [])()] if hasattr(block, "parameters") else []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_guard.checkpoint(block, x).pow(2).sum().backward()
    except Exception as error:  # noqa: BLE001 - compared with torch's own
        return type(error)
    return [x.grad, *[p.grad for p in params]]


@pytest.mark.parametrize("installed", [False, True], ids=["not-installed", "installed-strict"])
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_ckpt_guard_checkpoint_degrades_to_torchs_behaviour_on_the_same_blocks(kind, installed, monkeypatch):
    """ckpt_guard.checkpoint outside transforms is torch's non-reentrant checkpoint, checked at each
    recompute without install() under the environment's policy (strict here): the same outcome."""
    monkeypatch.setenv("CKPT_GUARD_POLICY", "strict")
    ckpt_guard.uninstall()
    raw = _outcome(BLOCKS[kind](), False)
    if installed:
        ckpt_guard.install("strict")
    try:
        guarded = _public_outcome(BLOCKS[kind]())
    finally:
        ckpt_guard.uninstall()
    if isinstance(raw, type):
        assert guarded is raw, f"torch raised {raw.__name__}, the guard {guarded}"
        return
    assert not isinstance(guarded, type), f"torch ran it; the guard raised {guarded.__name__}"
    assert len(guarded) == len(raw)
    for g, r in zip(guarded, raw):
        assert (g is None) == (r is None)
        if r is not None:
            assert torch.equal(g, r)
