"""Activation offload with checkpointing under torch.func (issue 48, item 1), measured on the installed torch.

``torch.autograd.graph.save_on_cpu`` around a torch.func transform is refused by torch at the
transform's entry ("don't yet support saved tensor hooks"), with or without checkpointing and
before any checkpoint call.  The guard decides that refusal as rule CKG012: strict's error names
what works under the transform, offload by a save policy
(``context_fn=checkpoint_policies.context_fn(checkpoint_policies.offload_dots)``); fallback sets the
offload aside for the transform (torch >= 2.8).
"""

from __future__ import annotations

import gc
import re
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch.func import functional_call, grad, vmap

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning
from ckpt_guard import checkpoint_policies as cp
from ckpt_guard._rules import OFFLOAD_RULE
from ckpt_guard._state import top_saved_tensor_hooks as _top_hooks
from ckpt_guard._state import vmap_switches_saved_tensor_hooks_off
from ckpt_guard._transform_entry import fallback_can_set_aside

torch.manual_seed(0)
NET = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
PARAMS = {k: v.detach() for k, v in NET.named_parameters()}
XS = torch.randn(3, 4, dtype=torch.float64)


def per_sample(checkpoint=None, **options):
    """Per-sample gradients of NET by ``vmap(grad)``, its one block checkpointed by ``checkpoint``
    (``tests/test_patched_torch.py`` runs the same program on a patched torch)."""
    def loss(p, x):
        block = lambda h: functional_call(NET, p, (h,))  # noqa: E731
        out = block(x[None]) if checkpoint is None else checkpoint(block, x[None], **options)
        return out.pow(2).sum()

    return vmap(grad(loss), in_dims=(None, 0))(PARAMS, XS)


@pytest.fixture(autouse=True)
def _uninstalled():
    ckpt_guard.uninstall()
    yield
    ckpt_guard.uninstall()


def _refusal_of(program):
    """Torch's own error for ``program`` under ``save_on_cpu`` (the guard uninstalled), or None."""
    ckpt_guard.uninstall()
    try:
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            program()
    except RuntimeError as exc:
        return exc
    return None


ENTRIES = {"no checkpoint": None, "ckpt_guard.checkpoint": ckpt_guard.checkpoint, "torch checkpoint": tuc.checkpoint}


@pytest.mark.parametrize("policy", [None, "off", "strict", "warn", "fallback"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_save_on_cpu_around_a_transform_is_decided_by_ckg012(entry, policy):
    """``save_on_cpu`` around ``vmap(grad)``: torch refuses it at the transform's entry, with or without
    checkpointing, before any checkpoint call (measured here, on the installed torch); the guard makes
    that refusal CKG012's, by policy, never reaching a checkpoint call it could not see."""
    checkpoint = ENTRIES[entry]
    options = {"use_reentrant": False} if checkpoint is tuc.checkpoint else {}
    calls = []
    counted = None if checkpoint is None else (lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    refusal = _refusal_of(lambda: per_sample(counted, **options))
    assert refusal is not None and re.search(OFFLOAD_RULE.raises_match, str(refusal)), refusal  # the table's claim
    assert calls == []  # refused at the transform's entry: no checkpoint call was reached
    reference = per_sample()  # offload changes no value: the program without it
    if policy is not None:
        ckpt_guard.install(policy)
    with warnings.catch_warnings(record=True) as caught, ckpt_guard.record() as events:
        warnings.simplefilter("always")
        offload, error = torch.autograd.graph.save_on_cpu(pin_memory=False), None
        try:
            with offload:
                result = per_sample(counted, **options)
                if _top_hooks is not None:  # the offload is back once the transform is left
                    assert _top_hooks() == (offload.pack_hook, offload.unpack_hook)
        except RuntimeError as exc:
            result, error = None, exc
    ids = [w.message.rule.id for w in caught if issubclass(w.category, CheckpointCompositionWarning)]
    if policy in (None, "off"):
        assert type(error) is RuntimeError and str(error) == str(refusal) and ids == [] and events == []
    elif policy == "warn":
        assert type(error) is RuntimeError and str(error) == str(refusal) and ids == ["CKG012"]
    elif policy == "strict" or not fallback_can_set_aside():
        assert isinstance(error, CheckpointCompositionError) and error.rule.id == "CKG012"
        assert error.__cause__ is not None and str(error.__cause__) == str(refusal)
        message = str(error)
        assert f"torch.func transform entered at: {__file__}:" in message  # the user's line: per_sample's
        assert "entering " in message and "offload_dots" in message
        if policy == "fallback":
            assert f"torch {torch.__version__} cannot read its saved-tensor hooks stack" in message
        assert [(e.rule_id, e.action, e.stage) for e in events] == [("CKG012", "raised", "transform")]
    else:  # fallback, where torch's hooks stack can be read (torch >= 2.8): right, the offload set aside
        assert result is not None, error
        for name in reference:
            torch.testing.assert_close(result[name], reference[name], rtol=0, atol=0, msg=name)  # bitwise
        assert ids[0] == "CKG012"
        assert ("CKG012", "fallback: repaired", "transform") in [(e.rule_id, e.action, e.stage) for e in events]
    assert bool(calls) == (result is not None and checkpoint is not None)  # checkpointed only where it ran


@pytest.mark.skipif(not fallback_can_set_aside(), reason="fallback sets the offload aside where torch can read its "
                    "hooks stack back (torch >= 2.8); here it raises strict's error (the test above checks it)")
def test_fallback_puts_the_offload_back_after_the_transform_even_when_the_block_raises():
    """The user's hooks are set aside only for the transform: what is saved after it, inside the same
    ``save_on_cpu``, is offloaded again; an exception of the user's passes through untouched."""
    ckpt_guard.install("fallback")
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            grad(lambda v: ckpt_guard.checkpoint(torch.sin, v).sum())(w.detach())
            assert packed == []  # nothing inside the transform went through the user's hooks
            (w * w).sum().backward()  # after it: the user's hooks again
            assert packed, "the user's hooks were not put back after the transform"

            class Mine(Exception):
                pass

            def failing(v):
                raise Mine("the user's own")

            with pytest.raises(Mine, match="the user's own"):
                grad(failing)(w.detach())
            assert _top_hooks is None or _top_hooks()[0] is pack
    assert _top_hooks is None or _top_hooks() is None


@pytest.mark.skipif(not hasattr(tuc, "create_selective_checkpoint_contexts"),
                    reason="save policies need torch's selective checkpointing (torch 2.5+)")
@pytest.mark.skipif(not hasattr(getattr(tuc, "CheckpointPolicy", None), "MUST_CPU_OFFLOAD"),
                    reason="this torch's CheckpointPolicy has no MUST_CPU_OFFLOAD")
def test_offload_by_a_save_policy_under_the_transform_gives_the_uncheckpointed_gradients():
    reference = per_sample()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        got = per_sample(ckpt_guard.checkpoint, context_fn=cp.context_fn(cp.offload_dots))
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], msg=name)


# --------------------------------------------------------------------------
# the user's save_on_cpu where torch allows it: around a vmap or jvp, then an eager .backward()

import itertools  # noqa: E402

import conformance as cf  # noqa: E402 - the matrix's kinds and its judge

OFFLOADED_TRANSFORMS = ("vmap, then .backward()", "jvp, then .backward()", "eager .backward()")


def _offloaded_cells():
    """Every kind under every transform here, pinned (the copy that once read as a write); the entry
    taken in turn, and every third cell unpinned (an alias, whose version is still checked)."""
    entries = itertools.cycle(("ckpt_guard.checkpoint, strict", "ckpt_guard.checkpoint, fallback"))
    pinning = itertools.cycle((True, True, False))
    return [(kind, transform, next(entries), next(pinning)) for kind in cf.KINDS for transform in OFFLOADED_TRANSFORMS]


@pytest.mark.parametrize("kind, transform, entry, pin_memory", _offloaded_cells(),
                         ids=lambda v: v if isinstance(v, str) else ("pinned" if v else "not pinned"))
def test_save_on_cpu_around_the_program_keeps_it_right(kind, transform, entry, pin_memory):
    """Every kind, the whole program (the uncheckpointed reference too) inside ``save_on_cpu``.

    A pinned copy (``pin_memory=True``, whose copy moves the copy's version) once read to the
    composable recompute as an input written in place after the call: ChangedSinceForward where the
    plain program is right.  What the user's hooks give back as a copy is what the call saw.
    """
    cell = cf.Cell(kind, transform, "module", entry)
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
        outcome = cf._run_cell(cell)
    assert not outcome.failed, f"{cell.label()}: {outcome.verdict}: {outcome.detail}"


def test_a_write_after_the_call_is_still_caught_under_hooks_that_give_the_input_back():
    """``save_on_cpu`` on the CPU gives the input back as itself: a write into it after the call is
    still the recompute's ChangedSinceForward (torch's autograd checks no version of what hooks packed:
    without checkpointing this program is torch's silent wrong gradient; the guard stops it)."""
    lin = torch.nn.Linear(3, 3).double()
    xs = torch.randn(2, 3, dtype=torch.float64)
    if vmap_switches_saved_tensor_hooks_off():
        pytest.skip("this torch's vmap refuses saved-tensor hooks (torch 2.4, measured): the program cannot run")
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        h = vmap(lin)(xs)
        out = vmap(lambda t: ckpt_guard.checkpoint(lambda u: torch.exp(0.5 * u), t))(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="updated in place after the block's forward"):
        out.sum().backward()


# --------------------------------------------------------------------------
# CKG012's cross: every kind under every grad transform torch refuses to enter under offload hooks

#: the transforms torch refuses under ``save_on_cpu`` on every supported release (measured per cell)
REFUSED_TRANSFORMS = ("grad", "vmap(grad), randomness same", "jacrev", "hessian", "jvp(grad)", "vjp(grad)", "grad(grad)")
_CROSS_ENTRIES = ("ckpt_guard.checkpoint, fallback", "ckpt_guard.checkpoint, strict",
                  "torch checkpoint (non-reentrant), fallback", "torch checkpoint (reentrant), fallback")


def _refused_cells():
    """Every kind × every refused transform, the entry taken in turn (pairwise: kind × transform is
    full, each pair with one entry; every entry meets every transform)."""
    entries = itertools.cycle(_CROSS_ENTRIES)
    return [(kind, transform, next(entries)) for kind in cf.KINDS for transform in REFUSED_TRANSFORMS]


@pytest.mark.parametrize("kind, transform, entry", _refused_cells())
def test_offload_around_a_refused_transform_for_every_kind(kind, transform, entry):
    """Strict: CKG012, never torch's bare refusal; fallback: the program's numbers (offload set aside
    for the transform) where this torch can read its hooks back, else CKG012 saying why."""
    cell = cf.Cell(kind, transform, "module", entry)
    policy, ckpt = cf.ENTRIES[entry]
    refusal = _refusal_of(lambda: cf._execute(cell, cf._plain))  # torch, unguarded, no checkpoint at all
    assert refusal is not None and re.search(OFFLOAD_RULE.raises_match, str(refusal)), refusal
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference, error = cf._execute(cell, cf._plain)[0], None  # offload changes no value
    except Exception as exc:  # noqa: BLE001 - the plain program raises here: no number may come back
        reference, error = None, exc
    ckpt_guard.install(policy, rules={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if policy == "strict" or not fallback_can_set_aside():
            with pytest.raises(CheckpointCompositionError) as info:
                with torch.autograd.graph.save_on_cpu(pin_memory=False):
                    cf._execute(cell, ckpt)
            assert info.value.rule.id == "CKG012"
            return
        if reference is None:
            with pytest.raises(type(error)):
                with torch.autograd.graph.save_on_cpu(pin_memory=False):
                    cf._execute(cell, ckpt)
            return
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            got = cf._execute(cell, ckpt)[0]
    wrong = cf._compare(got, reference)
    assert not wrong, f"{cell.label()}: {wrong}"


def test_the_transform_entry_watch_keeps_torchs_function_and_is_undone_by_uninstall():
    """The function functorch's decorator calls (and dynamo recognises by identity) stays torch's:
    only the generator in its ``@contextmanager`` cell is the guard's, and only while installed."""
    disable = torch.autograd.graph.disable_saved_tensors_hooks
    torchs = disable.__closure__[0].cell_contents
    ckpt_guard.install("strict")
    assert torch.autograd.graph.disable_saved_tensors_hooks is disable
    assert disable.__closure__[0].cell_contents is not torchs
    assert disable.__closure__[0].cell_contents.__ckpt_guard_original__ is torchs
    ckpt_guard.uninstall()
    assert disable.__closure__[0].cell_contents is torchs


@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_another_librarys_refused_disable_stays_torchs(policy):
    """Only functorch's message is CKG012's: a library's own ``disable_saved_tensors_hooks`` under the
    user's offload raises torch's error, untouched, under every policy."""
    ckpt_guard.install(policy)
    with torch.autograd.graph.save_on_cpu(pin_memory=False), warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        with pytest.raises(RuntimeError, match="^my library refuses hooks$") as info:
            with torch.autograd.graph.disable_saved_tensors_hooks("my library refuses hooks"):
                pass
    assert type(info.value) is RuntimeError


# --------------------------------------------------------------------------
# the same refusal where the hooks are torch's own checkpoint's: a transform inside a checkpointed block

INNER_TRANSFORMS = {
    "grad": lambda f, p: grad(f)(p),
    "vjp": lambda f, p: torch.func.vjp(f, p)[1](torch.ones((), dtype=p.dtype))[0],
    "jacrev": lambda f, p: torch.func.jacrev(f)(p),
    "vmap(grad)": lambda f, p: vmap(grad(f))(p),
}
INNER_ENTRIES = {
    "ckpt_guard.checkpoint": ckpt_guard.checkpoint,  # outside torch.func: torch's non-reentrant checkpoint
    "torch checkpoint (non-reentrant)": lambda f, t: tuc.checkpoint(f, t, use_reentrant=False),
}


def _inner_program(transform, checkpoint):
    """Forces from an energy inside a checkpointed block (a transform in the block), then .backward()."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    inner = INNER_TRANSFORMS[transform]

    def block(pos):
        return lin(pos) - inner(lambda p: torch.tanh(p @ lin.weight).pow(2).sum(), pos)

    out = block(x) if checkpoint is None else checkpoint(block, x)
    out.pow(2).sum().backward()
    return [x.grad, lin.weight.grad, lin.bias.grad]


@pytest.mark.parametrize("policy", ["strict", "warn", "fallback", "off"])
@pytest.mark.parametrize("entry", list(INNER_ENTRIES))
@pytest.mark.parametrize("transform", list(INNER_TRANSFORMS))
def test_a_transform_inside_a_checkpointed_block_is_ckg012_in_a_checkpoints_words(transform, entry, policy):
    """The hooks torch refuses are its own non-reentrant checkpoint's (pytorch#122729): strict says so and
    gives the fix that works (use_reentrant=True, measured here), never an offload the program has not;
    fallback sets them aside for the transform and gives the uncheckpointed gradients.

    Torch 2.4's non-reentrant checkpoint leaves its hooks pushed after an exception in the block
    until its generator is collected (its frame is in the exception's traceback cycle): collected
    here before and after, as torch's own leak, not the guard's (the same with the guard off)."""
    gc.collect()
    reference = _inner_program(transform, None)
    reentrant = _inner_program(transform, lambda f, t: tuc.checkpoint(f, t, use_reentrant=True))
    for got, want in zip(reentrant, reference):  # the remedy the message names works
        torch.testing.assert_close(got, want)
    ckpt_guard.install(policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = _inner_program(transform, INNER_ENTRIES[entry]), None
        except RuntimeError as exc:
            result, error = None, exc
    try:
        _judge_inner(policy, result, error, reference, caught)
    finally:
        error = None  # the traceback's cycle through this frame would keep torch 2.4's checkpoint (its hooks)
        gc.collect()


def _judge_inner(policy, result, error, reference, caught):
    ids = [w.message.rule.id for w in caught if issubclass(w.category, CheckpointCompositionWarning)]
    if policy == "off":
        assert type(error) is RuntimeError and re.search(OFFLOAD_RULE.raises_match, str(error)) and not ids
    elif policy == "warn":
        assert type(error) is RuntimeError and re.search(OFFLOAD_RULE.raises_match, str(error)) and ids == ["CKG012"]
    elif policy == "strict" or not fallback_can_set_aside():
        assert isinstance(error, CheckpointCompositionError) and error.rule.id == "CKG012", error
        if fallback_can_set_aside():  # torch >= 2.8 reads whose hooks they are
            assert "that checkpoint's own, not an offload" in str(error)
            assert "use_reentrant=True" in str(error) and "save_on_cpu off" not in str(error)
    else:
        assert error is None, error
        for got, want in zip(result, reference):
            torch.testing.assert_close(got, want)
        assert "CKG012" in ids
