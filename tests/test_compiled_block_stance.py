"""A compiled block's code runs eagerly inside ckpt_guard.checkpoint under torch.func, on its own thread only.

Dynamo cannot fake torch.func's wrappers under the run-time proof's mode, so while a block runs
its compiled code is eager (torch >= 2.6's ``force_eager`` stance); under an eager transform torch
itself never runs a compiled function's code anyway (pytorch#128711, ``benchmarks/blocks.py
--compiled`` measures it).  The stance is the block's thread's (issue 47, item 3: no process-wide
``force_eager``): another thread's compiled code keeps compiling meanwhile.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.func import grad

import ckpt_guard

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"),
                                reason="torch < 2.6 has no stance: a compiled block is refused there (class compiled)")


def _stance() -> str:
    import torch._dynamo.eval_frame as eval_frame

    return eval_frame._stance.stance


@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_force_eager_holds_on_the_blocks_thread_only(policy):
    ckpt_guard.install(policy)
    seen = []
    lin = torch.nn.Linear(3, 3).double()
    compiled = torch.compile(lambda t: torch.tanh(lin(t)), backend="eager")

    def block(t):
        elsewhere = []
        other = threading.Thread(target=lambda: elsewhere.append(_stance()))
        other.start()
        other.join()
        seen.append((_stance(), elsewhere[0]))
        return compiled(t) * 2

    x = torch.randn(4, 3, dtype=torch.float64)
    try:
        got = grad(lambda v: ckpt_guard.checkpoint(block, v).pow(2).sum())(x)
    finally:
        ckpt_guard.uninstall()
    want = grad(lambda v: (torch.tanh(lin(v)) * 2).pow(2).sum())(x)
    torch.testing.assert_close(got, want)
    assert seen and all(here == "force_eager" and there == "default" for here, there in seen), seen
    assert _stance() == "default"  # put back once the last block is out


def test_a_stance_the_program_set_meanwhile_is_kept():
    """The program setting a stance while a block runs (another thread's ``set_stance``): kept, not
    overwritten by the guard's putting back."""
    import torch._dynamo.eval_frame as eval_frame

    ckpt_guard.install("strict")
    lin = torch.nn.Linear(3, 3).double()
    compiled = torch.compile(lambda t: torch.tanh(lin(t)), backend="eager")
    set_inside = []

    def block(t):
        if not set_inside:
            set_inside.append(eval_frame._set_stance(eval_frame.DynamoStance("eager_on_recompile")))
        return compiled(t)

    try:
        grad(lambda v: ckpt_guard.checkpoint(block, v).sum())(torch.randn(2, 3, dtype=torch.float64))
        assert _stance() == "eager_on_recompile"
    finally:
        eval_frame._stance = eval_frame.DynamoStance()
        ckpt_guard.uninstall()
