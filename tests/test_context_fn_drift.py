"""A value a user ``context_fn`` sets, read by the block: never a replay that undoes the context.

The forward's state is read at the call, outside the ``context_fn``'s forward context; the
recompute's inside its recompute context.  A context that sets a global, a module's attribute
or the default dtype for both runs shows as a change of Python values, which torch recomputes
right, and which looks the same as a change the program made after the call.  Before
2026-12-07 strict and fallback replayed the value read at the call (CKG115, and CKG110 once
its Python values were replayed quietly): silently wrong, torch alone right.  Now neither
replays it: strict and fallback raise the rule naming the context, warn warns and behaves
as torch.  Found by a review of the quiet CKG110 replay.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import installed_under
from torch.utils.checkpoint import checkpoint

import ckpt_guard

SCALE = 1.0


@contextlib.contextmanager
def _global_scale(value):
    global SCALE
    old, SCALE = SCALE, value
    try:
        yield
    finally:
        SCALE = old


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = 1.0  # a plain attribute its forward reads (CKG115's)

    def forward(self, h):
        return torch.sin(h * self.t)


_MODULE = _Scaled()


@contextlib.contextmanager
def _module_scale(value):
    old, _MODULE.t = _MODULE.t, value
    try:
        yield
    finally:
        _MODULE.t = old


@contextlib.contextmanager
def _double_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


#: what the block reads, the context its context_fn enters for the forward and for the recompute, the rule
CASES = {
    "a global (CKG110)": (lambda h: torch.sin(h * SCALE), lambda: _global_scale(2.0), "CKG110"),
    "a module's attribute (CKG115)": (_MODULE, lambda: _module_scale(2.0), "CKG115"),
    "the default dtype (CKG105)": (
        lambda h: torch.sin(h * torch.tensor(1.5)).to(h.dtype), _double_default, "CKG105",
    ),
}


def _program(case: str, checkpointed: bool) -> torch.Tensor:
    block, context, _ = CASES[case]
    x = torch.linspace(0.1, 1.0, 5, dtype=torch.float64, requires_grad=True)
    if checkpointed:
        y = checkpoint(block, x, use_reentrant=False, context_fn=lambda: (context(), context()))
    else:
        with context():
            y = block(x)
    y.sum().backward()
    return x.grad


@pytest.mark.parametrize("case", list(CASES))
def test_a_value_a_context_fn_sets_is_never_replayed_away(case):
    rule = CASES[case][2]
    reference = _program(case, checkpointed=False)
    ckpt_guard.uninstall()
    raw = _program(case, checkpointed=True)
    torch.testing.assert_close(raw, reference)  # torch alone is right here: the context sets it both times
    for policy in ("strict", "fallback"):
        with pytest.raises(ckpt_guard.CheckpointCompositionError, match=rf"\[{rule}\]") as info:
            installed_under(policy, _program, case, True)
        assert "context_fn's forward context" in str(info.value)
    warned, said = installed_under("warn", _program, case, True)
    assert [m.rule.id for m in said] == [rule]
    assert torch.equal(warned, raw)  # warn: exactly what torch does
