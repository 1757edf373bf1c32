"""The caller writing into a checkpointed block's input after the call, under torch.func (issue 46, item 8).

``y = ckpt(block, h); h.add_(1)``: without checkpointing, autograd raises "modified by an inplace
operation" where the block's graph saved ``h`` (or a view of it), and the program runs where it saved
nothing of ``h`` (``exp`` saves its output).  The composable recompute reads ``h`` again in the
backward: it keeps a copy on write of what the call saw, and raises autograd's error exactly where
the block saved the input.  Every run is compared with the same program without checkpointing;
raw torch (torch's checkpoint, no guard) refuses every transform here.  The eager ``.backward()`` side
is ``tests/test_hidden_reads.py``'s.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacrev, jvp, vjp, vmap

import ckpt_guard
from ckpt_guard import _composable

DTYPE = torch.float64
W1 = torch.linspace(-1, 1, 16, dtype=DTYPE).reshape(4, 4)
W2 = torch.linspace(0.5, -0.5, 16, dtype=DTYPE).reshape(4, 4)
X = torch.linspace(-0.9, 0.8, 12, dtype=DTYPE).reshape(3, 4)

#: what a block saves of its input: nothing (exp saves its output), the input, a view of it (sin saves
#: what it is given; a matmul by a constant would save nothing of it), or only its tangent (exp's
#: tangent, ``exp(t) * t_dot``, saves ``t_dot`` where something differentiates the tangents)
SAVES = {
    "nothing of its input": lambda t: torch.exp(0.5 * t) @ W2,
    "its input": lambda t: torch.sin(t) @ W2,
    "a view of its input": lambda t: torch.sin(t[1:]) @ W2,
    "its input's tangent": lambda t: torch.exp(t) @ W2,
}

#: the transforms that differentiate a block's tangents (a write into a dual writes its tangent too)
DIFFERENTIATE_TANGENTS = {"jvp, then .backward()", "grad(jvp)"}


def _plain_raises(saves, transform):
    """Where autograd raises "modified by an inplace operation" without checkpointing (measured by each test)."""
    if saves == "its input's tangent":
        return transform in DIFFERENTIATE_TANGENTS
    return saves != "nothing of its input"


def _caller_adds(ck, h):
    h.add_(1.0)


def _a_later_block_relus_in_place(ck, h):
    ck(lambda t: F.relu(t, inplace=True), h)  # torch.nn.ReLU(inplace=True) on a skip tensor


#: who writes into the block's input after its call
WRITERS = {"the caller's add_": _caller_adds, "a later checkpointed block's relu_": _a_later_block_relus_in_place}


def _loss(ck, saves, writer):
    body = SAVES[saves]

    def loss(x):
        h = x @ W1 + 0.1  # made by the program (nothing saves it): the caller's to write
        y = ck(body, h)
        WRITERS[writer](ck, h)
        return (2 * y).sum() + (h * h).sum()
    return loss


def _t_vmap_backward(loss):
    xs = torch.stack([X, 0.5 * X]).requires_grad_()
    vmap(loss)(xs).sum().backward()
    return xs.grad


def _t_jvp_backward(loss):
    x = X.clone().requires_grad_()
    out, tangent = jvp(loss, (x,), (torch.ones_like(X),))
    (out + tangent).backward()
    return x.grad


#: the transforms that run a block's backward from the composable recompute
TRANSFORMS = {
    "grad": lambda loss: grad(loss)(X),
    "vjp": lambda loss: vjp(loss, X)[1](torch.tensor(1.0, dtype=DTYPE))[0],
    "jacrev": lambda loss: jacrev(loss)(X),
    "hessian": lambda loss: hessian(loss)(X[0]),
    "vmap(grad)": lambda loss: vmap(grad(loss))(torch.stack([X, 0.5 * X])),
    "grad(grad)": lambda loss: grad(lambda x: grad(loss)(x).pow(2).sum())(X),
    "vmap, then .backward()": _t_vmap_backward,
    "jvp, then .backward()": _t_jvp_backward,
    "grad(jvp)": lambda loss: grad(lambda x: jvp(loss, (x,), (torch.ones_like(X),))[1])(X),
}


def _hessian_input(transform, loss):
    if transform != "hessian":
        return loss
    return lambda row: loss(torch.cat([row[None], X[1:]]))  # hessian over one row: a small square


def _torch_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


ENTRIES = {
    "ckpt_guard.checkpoint, strict": ("strict", ckpt_guard.checkpoint),
    "ckpt_guard.checkpoint, fallback": ("fallback", ckpt_guard.checkpoint),
    "torch checkpoint (non-reentrant), fallback": ("fallback", _torch_checkpoint),
}


@contextlib.contextmanager
def _installed(policy):
    """The guard installed under ``policy`` (torch's own checkpoint goes through it), then as it was."""
    was = ckpt_guard.is_installed()
    ckpt_guard.install(policy, rules={})
    try:
        yield
    finally:
        ckpt_guard.uninstall()
        if was:
            ckpt_guard.install("strict")


def _run(transform, ck, saves, writer):
    return TRANSFORMS[transform](_hessian_input(transform, _loss(ck, saves, writer)))


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("saves", list(SAVES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_write_after_the_call_is_what_the_plain_program_does(transform, saves, writer, entry):
    policy, ck = ENTRIES[entry]
    plain_error = _against_the_plain_program(
        lambda ck: _run(transform, ck, saves, writer), _plain_raises(saves, transform), policy, ck,
    )
    assert plain_error is None or "modified by an inplace operation" in str(plain_error)


def _against_the_plain_program(run, plain_raises, policy="strict", ck=ckpt_guard.checkpoint):
    """The differential of a write after the call: ``run(plain)`` raises exactly where ``plain_raises`` says
    (measured, never assumed; None: wherever it does); ``run(ck)`` with the guard installed under ``policy``
    then raises autograd's "modified by an inplace operation" there, and elsewhere equals the plain program,
    the recompute run.  Returns the plain program's error, or None."""
    try:
        reference, plain_error = run(lambda f, *a: f(*a)), None
    except RuntimeError as exc:
        reference, plain_error = None, exc
    assert plain_raises is None or (plain_error is not None) == plain_raises, plain_error
    before = _composable.counters.RECOMPUTES
    with _installed(policy), warnings.catch_warnings():
        # ckpt_guard.checkpoint has nothing to say here; fallback says what it ran instead of torch's checkpoint
        said = "error" if ck is ckpt_guard.checkpoint else "ignore"
        warnings.simplefilter(said, ckpt_guard.CheckpointCompositionWarning)
        warnings.filterwarnings("error", message=".*batching rule for aten::_lazy_clone")  # no copy by vmap's fallback
        if plain_error is not None:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                run(ck)
            return plain_error
        got = run(ck)
    torch.testing.assert_close(got, reference)
    assert _composable.counters.RECOMPUTES > before  # checkpointed: the recompute ran
    return None


#: complex weights: the block's input is complex (torch's ``_lazy_clone`` has no complex autograd formula;
#: ckpt_guard copies a complex input through its real view)
CW1 = (W1 + 0.5j * W1.flip(0)).to(torch.complex128)
CW2 = (W2 - 0.3j * W2.flip(1)).to(torch.complex128)
COMPLEX_SAVES = {
    "nothing of its input": lambda t: torch.exp(0.5 * t) @ CW2,
    "its input": lambda t: torch.sin(t) @ CW2,
    "a view of its input": lambda t: torch.sin(t[1:]) @ CW2,
}


def _complex_loss(ck, saves, conjugated=False):
    def loss(x):
        h = x.to(torch.complex128) @ CW1 + 0.1  # complex, made by the program
        y = ck(COMPLEX_SAVES[saves], h.conj() if conjugated else h)  # .conj(): a view with the conjugate bit
        h.add_(1.0)
        return (y.abs() ** 2).sum() + (h.abs() ** 2).sum()
    return loss


@pytest.mark.parametrize("conjugated", [False, True], ids=["complex", "conjugate view"])
@pytest.mark.parametrize("saves", list(COMPLEX_SAVES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_complex_input_written_after_the_call_is_what_the_plain_program_does(transform, saves, conjugated):
    _against_the_plain_program(
        lambda ck: TRANSFORMS[transform](_hessian_input(transform, _complex_loss(ck, saves, conjugated))),
        saves != "nothing of its input",
    )


def test_raw_torch_refuses_these_programs():
    """The third run of the differential: torch's checkpoint, no guard, under ``grad``."""
    ckpt_guard.uninstall()
    with pytest.raises(Exception):  # noqa: B017 - torch's own words vary by release
        _run("grad", _torch_checkpoint, "nothing of its input", "the caller's add_")


@pytest.mark.parametrize("transform", ["grad", "vmap(grad)"])
def test_no_copy_is_made_until_the_caller_writes(transform):
    """The copy on write shares the input's memory: the saved input is the call's until written."""
    seen = []

    def loss(x):
        h = torch.tanh(x @ W1)
        y = ckpt_guard.checkpoint(lambda t: torch.exp(0.5 * t), h)
        seen.append(torch._C._is_cow_tensor(_composable.basics._base(h)))
        return y.sum()

    with _installed("strict"):
        TRANSFORMS[transform](loss)
    assert seen == [True], "the input shares its memory with the Function's copy on write"


def test_a_block_without_a_write_after_the_call_is_bitwise_unchanged():
    """No write: the gradient is bitwise the one the recompute gave before copies on write (torch's own
    copy-free composable path is the reference here: the plain program)."""
    def loss(ck):
        def f(x):
            h = torch.tanh(x @ W1)
            return ck(lambda t: torch.sin(t) @ W2, h).pow(2).sum()
        return f

    reference = grad(loss(lambda f, *a: f(*a)))(X)
    with _installed("strict"):
        got = grad(loss(ckpt_guard.checkpoint))(X)
    torch.testing.assert_close(got, reference)


# --------------------------------------------------------------------------
# the cross: every module kind of the conformance matrix under every transform here, the entries
# taken in turn; the block's own parameters are constants (what a write after the call meets is the
# block's use of its input alone: a layer whose weights are differentiated saves its input, and the
# plain program raises, which the cells above cover)

import itertools  # noqa: E402

import conformance as cf  # noqa: E402


def _kind_loss(kind, ck):
    torch.manual_seed(0)
    block = cf.KINDS[kind].make().to(DTYPE)
    for p in block.parameters():
        p.requires_grad_(False)
    use = cf.KINDS[kind].caller or (lambda out: out)
    scale = torch.linspace(-1, 1, cf.T * cf.D, dtype=DTYPE).reshape(cf.T, cf.D)

    def loss(x):
        torch.manual_seed(1)  # a block that draws (dropout) draws the same in every run
        h = x * 1.5 + 0.1  # the program's own tensor (nothing saves it)
        y = use(ck(block, h))
        h.mul_(0.5)  # the caller writes into the block's input after the call
        return (torch.tanh(y) * scale).sum() + (h * h).sum()
    return loss


_KIND_X = torch.linspace(-0.8, 0.9, cf.T * cf.D, dtype=DTYPE).reshape(cf.T, cf.D)
KIND_TRANSFORMS = {
    "grad": lambda loss: grad(loss)(_KIND_X),
    "vjp": lambda loss: vjp(loss, _KIND_X)[1](torch.tensor(1.0, dtype=DTYPE))[0],
    "jacrev": lambda loss: jacrev(loss)(_KIND_X),
    "hessian": lambda loss: hessian(lambda row: loss(torch.cat([row[None], _KIND_X[1:]])))(_KIND_X[0]),
    "vmap(grad)": lambda loss: vmap(grad(loss), randomness="different")(torch.stack([_KIND_X, 0.5 * _KIND_X])),
    "grad(grad)": lambda loss: grad(lambda x: grad(loss)(x).pow(2).sum())(_KIND_X),
    "vmap, then .backward()": lambda loss: _backward_of(
        lambda x: vmap(loss, randomness="different")(x).sum(), torch.stack([_KIND_X, 0.5 * _KIND_X])),
    "jvp, then .backward()": lambda loss: _backward_of(
        lambda x: sum(jvp(loss, (x,), (torch.ones_like(x),))), _KIND_X),
    "grad(jvp)": lambda loss: grad(lambda x: jvp(loss, (x,), (torch.ones_like(x),))[1])(_KIND_X),
}


def _backward_of(function, x):
    x = x.clone().requires_grad_()
    function(x).backward()
    return x.grad


def _kind_cells():
    entries = itertools.cycle(ENTRIES)
    return [(kind, transform, next(entries)) for kind in cf.KINDS for transform in KIND_TRANSFORMS]


@pytest.mark.parametrize("kind, transform, entry", _kind_cells())
def test_every_kind_written_after_the_call_is_what_the_plain_program_does(kind, transform, entry):
    try:
        reference, plain_error = KIND_TRANSFORMS[transform](_kind_loss(kind, lambda f, *a: f(*a))), None
    except Exception as exc:  # noqa: BLE001 - the plain program raises: the checkpointed one must too
        reference, plain_error = None, exc
    policy, ck = ENTRIES[entry]
    with _installed(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt_guard.CheckpointCompositionWarning)  # what a kind's own rules say
        warnings.filterwarnings("error", message=".*batching rule for aten::_lazy_clone")
        if plain_error is not None:
            with pytest.raises(type(plain_error)):
                KIND_TRANSFORMS[transform](_kind_loss(kind, ck))
            return
        try:
            got = KIND_TRANSFORMS[transform](_kind_loss(kind, ck))
        except ckpt_guard.CheckpointCompositionError as exc:  # strict's documented refusal (docs/limits.md)
            assert policy == "strict" and any(f"(refusal class {c}," in str(exc) for c in _composable.REFUSAL_CLASSES), exc
            return
    torch.testing.assert_close(got, reference)


# --------------------------------------------------------------------------
# found by a review: a module's own parameters, writes no version sees, views of a larger storage

@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_block_whose_module_parameters_require_grad_is_what_the_plain_program_does(transform, entry):
    """The block's ``nn.Linear`` keeps eager parameters that require grad; the transform differentiates the
    input only.  The plain run's graph at the transform's level saved nothing of the input for them (the
    eager graph below, which did, is never run): the program runs.  The recompute once marked them
    requiring grad at its own level, saved the input for them, and raised."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).to(DTYPE)

    def loss_with(ck):
        def loss(x):
            h = x * 1.5
            y = ck(lambda t: torch.exp(lin(t)), h)
            h.mul_(2)
            return y.sum() + h.sum()
        return _hessian_input(transform, loss)

    try:  # measured: under a .backward() the eager graph, which saved the input for the weight, runs too
        reference, plain_error = TRANSFORMS[transform](loss_with(lambda f, *a: f(*a))), None
    except RuntimeError as exc:
        reference, plain_error = None, exc
    assert (plain_error is None) == (".backward()" not in transform), plain_error
    policy, ck = ENTRIES[entry]
    with _installed(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt_guard.CheckpointCompositionWarning)
        if plain_error is not None:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                TRANSFORMS[transform](loss_with(ck))
            return
        got = TRANSFORMS[transform](loss_with(ck))
    torch.testing.assert_close(got, reference)


def test_a_write_through_data_is_refused_not_a_number():
    """``hs.data.add_(1)`` moves no version: autograd cannot see it, and the plain program's backward reads
    the new values where the recompute would read the call's.  ckpt_guard sees the copy the write made
    and stops with ChangedSinceForward (before, the recompute read the new values by chance)."""
    def run(ck):
        xs = torch.stack([X, 0.5 * X]).requires_grad_()

        def f(x):
            h = x @ W1
            return ck(lambda t: torch.sin(t) @ W2, h), h
        ys, hs = vmap(f)(xs)
        hs.data.add_(1)
        ys.sum().backward()
        return xs.grad

    run(lambda f, *a: f(*a))  # the plain program runs (torch's own .data hazard)
    with _installed("strict"), pytest.raises(_composable.ChangedSinceForward, match="moves no version"):
        run(ckpt_guard.checkpoint)


#: a block reading the three parts of one projection (``q, k, v = qkv.split(d, -1)``), saving nothing
#: of them (``exp``) or saving them (``sin``)
SPLIT_SAVES = {
    "nothing of its inputs": lambda q, k, v: torch.exp(0.5 * q) * torch.exp(0.2 * k) + torch.exp(0.1 * v),
    "its inputs": lambda q, k, v: torch.sin(q) * torch.sin(k) + v,
}


def _split_loss(ck, saves):
    w = torch.linspace(-1, 1, 48, dtype=DTYPE).reshape(4, 12)

    def loss(x):
        qkv = x @ w  # one storage, the three inputs spanning all of it
        q, k, v = qkv.split(4, -1)
        y = ck(SPLIT_SAVES[saves], q, k, v)
        qkv.mul_(2.0)  # the caller writes the projection after the call
        return (2 * y).sum() + (qkv * qkv).sum()
    return loss


@pytest.mark.parametrize("saves", list(SPLIT_SAVES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_views_that_together_span_their_storage_are_copied_on_write(transform, saves):
    """Views into one storage that the call's inputs span together (more than half of it) are copied on
    write as a whole tensor is: a later write into the storage is what the plain program does."""
    plain_error = _against_the_plain_program(
        lambda ck: TRANSFORMS[transform](_hessian_input(transform, _split_loss(ck, saves))),
        saves != "nothing of its inputs",
    )
    # (the plain program's words there: "Output 1 of Split is a view and its base ... has been modified
    # inplace"; the recompute's saved copies are no views, so autograd says "modified by an inplace operation")
    assert plain_error is None or "modified inplace" in str(plain_error), plain_error


#: a block reading one row of a larger buffer, saving nothing of it (``exp``) or saving it (``sin``)
ROW_SAVES = {
    "nothing of its input": lambda row: torch.exp(0.5 * row),
    "its input": lambda row: torch.sin(row),
}
#: how the caller writes into the buffer after each call: an RNN's preallocated states, an update of the
#: row the call read, a rescale of all of it
ROW_WRITES = ("the next row", "the row itself", "the whole buffer")


def _row_loss(ck, saves, writer, seen=None):
    def loss(x):
        cache = torch.cat([x @ W1, torch.zeros(3, 4, dtype=DTYPE)])  # 6 rows: each call reads a sixth of it
        total = 0
        for i in range(1, 4):
            row = cache[i - 1]
            total = total + ck(ROW_SAVES[saves], row).sum()
            if writer == "the next row":
                cache[i + 2] = torch.tanh(row)
            elif writer == "the row itself":
                row.mul_(2.0)
            else:
                cache.mul_(1.5)
        if seen is not None:
            seen.append(cache)
        return total + (cache * cache).sum()
    return loss


@pytest.mark.parametrize("writer", ROW_WRITES)
@pytest.mark.parametrize("saves", list(ROW_SAVES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_row_of_a_larger_buffer_is_copied_at_the_call(transform, saves, writer):
    """A view into a small part of a larger storage (a cache's row) is copied at the call, the row only:
    a write into the buffer after the call is what the plain program does (the numbers where the block
    saved nothing of the row, autograd's error where it did).  Before, autograd's error everywhere (the
    row was saved as it is; a copy on write would copy the whole buffer at each write)."""
    # where the block saves its row, the plain program raises (a write anywhere in the buffer moves the
    # row's version); elsewhere it may too, where the transform's tangents are differentiated
    # (jvp, then .backward(): the block's tangent graph saves the row's tangent, a view of the buffer's)
    _against_the_plain_program(
        lambda ck: TRANSFORMS[transform](_hessian_input(transform, _row_loss(ck, saves, writer))),
        True if saves == "its input" else None,
    )


#: views of a (6, 4) buffer a call may read: a row (copied at the call), and views with gaps (kept as they are)
VIEWS = {
    "a row": lambda buf: buf[1],
    "a column": lambda buf: buf[:, 1],
    "every third row": lambda buf: buf[::3],
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("transform", ["grad", "vmap(grad)", "jvp, then .backward()"])
def test_what_a_block_reads_of_its_view_is_the_plain_programs(transform, view):
    """The row's copy is laid out as the row (a review found a copy of a view with gaps made contiguous: a
    block branching on ``is_contiguous()`` or reading its strides took the other branch, silently), and a
    row holding NaN is the same row at the recompute (a value comparison had NaN unequal to itself and
    refused with ChangedSinceForward)."""
    def block(t):
        scale = 2.0 if t.is_contiguous() else 3.0  # a block reading its input's layout
        return torch.exp(0.1 * t) * scale + float(t.stride()[0])

    def loss(x):
        buf = torch.cat([x @ W1, torch.zeros(3, 4, dtype=DTYPE)])
        buf = buf.index_put((torch.tensor([1, 3]), torch.tensor([3, 2])), torch.tensor(float("nan"), dtype=DTYPE))
        total = 0
        for _ in range(2):
            total = total + ck(block, VIEWS[view](buf)).nan_to_num().sum()
        return total

    for ck in (lambda f, *a: f(*a), ckpt_guard.checkpoint):
        with _installed("strict"):
            got = TRANSFORMS[transform](loss)
        if ck is not ckpt_guard.checkpoint:
            reference = got
    torch.testing.assert_close(got, reference)


@pytest.mark.skipif(_composable.basics._is_cow is None, reason="this torch cannot say whether a storage is copy-on-write")
def test_a_loop_over_the_rows_of_a_buffer_never_copies_the_buffer():
    """The row's copy is the row's size: the buffer itself is never made copy-on-write, so a write into it
    copies nothing (a copy on write of a row covers the buffer: one copy of all of it per write)."""
    seen: list = []
    with _installed("strict"):
        grad(_row_loss(ckpt_guard.checkpoint, "nothing of its input", "the next row", seen))(X)
    assert seen and not _composable.basics._is_cow(_composable.basics._base(seen[0]))
