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


def _runs_eagerly() -> bool:
    """What dynamo decides for a compiled function entered on this thread now: no frame callback
    (None, what force_eager answers) means it runs eagerly."""
    import torch._dynamo.eval_frame as eval_frame

    marker = object()
    return eval_frame._callback_from_stance(marker) is None


@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_force_eager_holds_on_the_blocks_thread_only(policy):
    ckpt_guard.install(policy)
    seen = []
    lin = torch.nn.Linear(3, 3).double()
    compiled = torch.compile(lambda t: torch.tanh(lin(t)), backend="eager")

    def block(t):
        elsewhere = []
        other = threading.Thread(target=lambda: elsewhere.append(_runs_eagerly()))
        other.start()
        other.join()
        seen.append((_runs_eagerly(), elsewhere[0]))
        return compiled(t) * 2

    x = torch.randn(4, 3, dtype=torch.float64)
    try:
        got = grad(lambda v: ckpt_guard.checkpoint(block, v).pow(2).sum())(x)
    finally:
        ckpt_guard.uninstall()
    want = grad(lambda v: (torch.tanh(lin(v)) * 2).pow(2).sum())(x)
    torch.testing.assert_close(got, want)
    assert seen and all(here and not there for here, there in seen), seen
    assert not _runs_eagerly() and _stance() == "default"  # dynamo's own once the last block is out


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


def test_another_threads_stance_put_back_during_a_block_leaves_the_block_eager():
    """Another thread (an evaluation loop) leaving ``set_stance(...)`` while a block runs puts back the
    stance it found; the block's thread still runs its compiled code eagerly (fresh-eyes review: it
    compiled under the proof's mode and failed 'False != True' when the stance itself was swapped)."""
    ckpt_guard.install("strict")
    lin = torch.nn.Linear(3, 3).double()
    compiled = torch.compile(lambda t: torch.tanh(lin(t)), backend="eager")
    opened, block_in, closed = threading.Event(), threading.Event(), threading.Event()

    def other():
        with torch.compiler.set_stance("eager_on_recompile"):
            opened.set()
            block_in.wait(30)
        closed.set()

    def block(t):
        block_in.set()
        closed.wait(30)
        return compiled(t) * 2

    thread = threading.Thread(target=other)
    thread.start()
    opened.wait(30)
    x = torch.randn(4, 3, dtype=torch.float64)
    try:
        got = grad(lambda v: ckpt_guard.checkpoint(block, v).pow(2).sum())(x)
    finally:
        thread.join()
        ckpt_guard.uninstall()
    torch.testing.assert_close(got, grad(lambda v: (torch.tanh(lin(v)) * 2).pow(2).sum())(x))
    assert _stance() == "default" and not _runs_eagerly()
