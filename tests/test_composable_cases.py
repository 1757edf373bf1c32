"""The composable recompute on programs that crashed it, fooled it, or raced it.

Differential, as everywhere: each program's result with ``ckpt_guard.checkpoint``
(strict, the default, and fallback) and with torch's checkpoint under fallback,
against the same program without checkpointing.  Correct, or (strict only) a
``CheckpointCompositionError`` naming the rule; never a wrong number.
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, _composable

pytestmark = pytest.mark.usefixtures("guard")


def plain(function, *args):
    return function(*args)


def torch_checkpoint(function, *args):
    return checkpoint(function, *args, use_reentrant=False)


ENTRIES = {"public strict": ("strict", ckpt_guard.checkpoint), "public fallback": ("fallback", ckpt_guard.checkpoint),
           "torch fallback": ("fallback", torch_checkpoint)}


def _leaves(value):
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def assert_right_or_refused(program, entry, refusable=True):
    """``program(ckpt)`` equals ``program(plain)``; strict may refuse instead (if ``refusable``)."""
    reference = _leaves(program(plain))
    policy, ckpt = ENTRIES[entry]
    try:
        with ckpt_guard.policy(policy), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _leaves(program(ckpt))
    except CheckpointCompositionError:
        assert policy == "strict" and refusable, "refused where it should have run"
        return None
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)
    return got


# --------------------------------------------------------------------------
# programs that crashed the recompute (they run without checkpointing)


def _seeded(module_factory):
    torch.manual_seed(0)
    return module_factory()


DROPOUT = _seeded(lambda: torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5)).train())
GRU = _seeded(lambda: torch.nn.GRU(3, 3, batch_first=True))
EVAL_BN = _seeded(lambda: torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).eval())
LINEAR = _seeded(lambda: torch.nn.Linear(3, 3))
X = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
XS = torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(2))


def _dropout_jacrev(ckpt):
    torch.manual_seed(3)
    return jacrev(lambda t: ckpt(DROPOUT, t))(X)


def _dropout_vmap_over_pullback(ckpt):
    torch.manual_seed(3)
    _, pullback = vjp(lambda t: ckpt(DROPOUT, t), X)
    return vmap(pullback)(torch.eye(6).reshape(6, 2, 3))


def _gru(transform):
    def program(ckpt):
        return transform(lambda t: ckpt(lambda u: GRU(u)[0], t).sum())(XS)
    return program


def _eval_bn(transform):
    def program(ckpt):
        return transform(lambda t: ckpt(EVAL_BN, t).pow(2).sum())(X)
    return program


def _nested_under_hessian(ckpt):
    return hessian(lambda t: ckpt(lambda u: ckpt(LINEAR, u).tanh(), t).pow(2).sum())(X)


CRASHED = {
    "dropout under jacrev": _dropout_jacrev,
    "dropout, vmap over a vjp pullback": _dropout_vmap_over_pullback,
    "GRU under jacfwd": _gru(jacfwd),
    "GRU under hessian": _gru(hessian),
    "eval BatchNorm under jvp": _eval_bn(lambda f: lambda x: jvp(f, (x,), (torch.ones_like(x),))),
    "eval BatchNorm under jacfwd": _eval_bn(jacfwd),
    "eval BatchNorm under hessian": _eval_bn(hessian),
    "a checkpoint nested in another under hessian": _nested_under_hessian,
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("name", list(CRASHED))
def test_programs_that_crashed_the_recompute_are_right(name, entry):
    assert assert_right_or_refused(CRASHED[name], entry, refusable=False) is not None


def test_train_batchnorm_buffers_as_transform_inputs_update_once():
    """Buffers passed to functional_call under grad: the gradients are right and the running
    statistics are updated once, as without checkpointing (the recompute updates a copy)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).train()

    class Outer(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.net, self.ckpt = net, ckpt

        def forward(self, t):
            return self.ckpt(self.net, t)

    params = {"net." + k: v.detach() for k, v in net.named_parameters()}

    def program(ckpt):
        buffers = {"net." + k: v.clone() for k, v in net.named_buffers()}
        grads = grad(lambda p, b: functional_call(Outer(ckpt), (p, b), (X,)).pow(2).sum())(params, buffers)
        return [*grads.values(), *buffers.values()]

    for entry in ENTRIES:
        assert assert_right_or_refused(program, entry, refusable=False) is not None


def test_expanded_weights_fall_back_to_torchs_checkpoint():
    """Per-sample gradients with ExpandedWeights (Opacus' "ew" mode): a tensor subclass with its own
    __torch_function__ is not lifted; torch's checkpoint handles it (before: an error from the
    recompute's own dtype check)."""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    class Net(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.lin, self.ckpt = torch.nn.Linear(3, 2), ckpt

        def forward(self, x):
            return self.ckpt(self.lin, x)

    def program(ckpt):
        torch.manual_seed(0)
        net = Net(ckpt)
        call_for_per_sample_grads(net)(torch.randn(4, 3, generator=torch.Generator().manual_seed(5))).sum().backward()
        return [p.grad_sample for p in net.parameters()]

    for entry in ENTRIES:
        assert assert_right_or_refused(program, entry, refusable=False) is not None


# --------------------------------------------------------------------------
# the block's forward runs as it would without checkpointing


def test_transformer_encoder_takes_the_same_path_as_without_checkpointing():
    """An eval nn.TransformerEncoder with a padding mask takes its fast path only with grad off or
    nothing requiring grad; under vjp / grad the reference takes the slow path, and so must the
    checkpointed forward (before, run under no_grad, it took the fast path: padded rows 0.0)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    params = {k: v.detach() for k, v in encoder.named_parameters()}

    def model(p, t, ckpt):
        return ckpt(lambda u: functional_call(encoder, p, (u,), {"src_key_padding_mask": mask}), t)

    programs = {
        "vjp": lambda ckpt: vjp(lambda t: model(params, t, ckpt), x)[0],
        "grad": lambda ckpt: grad(lambda p: model(p, x, ckpt).pow(2).sum())(params),
    }
    for program in programs.values():
        for entry in ENTRIES:
            assert assert_right_or_refused(program, entry, refusable=False) is not None


def test_parametrization_cache_is_refused_not_filled_below_the_transforms():
    """parametrize.cached(): the block's forward would cache a weight computed below the transform,
    and the code after the block would read it as a constant (a zero gradient).  Refused: strict
    raises, fallback runs the block plainly."""
    import torch.nn.utils.parametrize as parametrize

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)

    class Symmetric(torch.nn.Module):
        def forward(self, w):
            return w + w.T

    parametrize.register_parametrization(lin, "weight", Symmetric())
    params = {k: v.detach() for k, v in lin.named_parameters()}

    def program(ckpt):
        def loss(p):
            with parametrize.cached():
                return (functional_call(lin, p, (X,)) + ckpt(lambda t: functional_call(lin, p, (t,)), X)).pow(2).sum()

        return grad(loss)(params)

    assert assert_right_or_refused(program, "public strict") is None  # refused
    for entry in ("public fallback", "torch fallback"):
        assert assert_right_or_refused(program, entry, refusable=False) is not None


# --------------------------------------------------------------------------
# threads


def test_two_threads_on_one_module_never_see_each_others_tensors():
    """Both threads inside their blocks at once (a barrier in the block forces it, in the forward
    and in the recompute): each gets its own gradients, and the module keeps its own Parameters
    (before: wrong gradients or "does not require grad", and the module left holding plain tensors)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    own = list(lin.parameters())
    barrier = threading.Barrier(2, timeout=30)
    entered: list = []

    def block(t):
        out = lin(t)
        entered.append(threading.get_ident())
        barrier.wait()  # the other thread is inside its own block now, with its own bindings
        if entered[-1] == threading.get_ident():
            time.sleep(0.2)  # the later one leaves later: a swap it made over the other's is undone last
        return torch.tanh(out)

    def per_thread(seed, ckpt):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        return grad(lambda t: ckpt(block, t).pow(2).sum())(x)

    results = {}

    def worker(seed):
        try:
            results[seed] = per_thread(seed, ckpt_guard.checkpoint)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[seed] = exc

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    barrier = threading.Barrier(1)  # the reference runs one thread at a time
    entered.clear()
    for seed in (1, 2):
        assert not isinstance(results[seed], BaseException), results[seed]
        torch.testing.assert_close(results[seed], per_thread(seed, plain))
    assert list(lin.parameters()) == own and all(type(p) is torch.nn.Parameter for p in lin.parameters())
    own_dict = type(torch.nn.Linear(1, 1)._parameters)  # an OrderedDict before torch 2.5, a dict since
    assert type(lin) is torch.nn.Linear and type(lin._parameters) is own_dict


def test_a_module_that_sets_its_fast_weights_when_called():
    """higher.monkeypatch's way: the patched module writes plain (non-leaf) fast weights into
    _parameters when called, then runs its forward, which checkpoints a submodule; first order,
    autograd.grad over the fast weights, no install() (before: their gradients were None)."""
    torch.manual_seed(0)

    class Patched(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.a = torch.nn.Linear(2, 2)
            self.ckpt = ckpt

        def forward(self, x, params):
            for name, value in zip(("weight", "bias"), params):
                self.a._parameters[name] = value  # what higher's patched forward does
            return self.ckpt(self.a, x).pow(2).sum()

    x = torch.randn(3, 2)

    def program(ckpt):
        torch.manual_seed(0)
        net = Patched(ckpt)
        fast = [p * 1.0 for p in net.a.parameters()]
        return torch.autograd.grad(net(x, fast), fast)

    ckpt_guard.uninstall()
    try:
        assert assert_right_or_refused(program, "public strict", refusable=False) is not None
    finally:
        ckpt_guard.install("strict", rules={})


def test_higher_monkeypatch_end_to_end():
    higher = pytest.importorskip("higher", reason="higher is not installed (pip install higher)")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.a, self.ckpt = torch.nn.Linear(2, 2), ckpt

        def forward(self, x):
            return self.ckpt(self.a, x).sum()

    x = torch.randn(3, 2)

    def program(ckpt):
        torch.manual_seed(0)
        net = Net(ckpt)
        fnet = higher.monkeypatch(net, copy_initial_weights=False)
        fast = [p * 1.0 for p in net.parameters()]
        return torch.autograd.grad(fnet(x, params=fast), fast)

    ckpt_guard.uninstall()
    try:
        assert assert_right_or_refused(program, "public strict", refusable=False) is not None
    finally:
        ckpt_guard.install("strict", rules={})


def test_a_hook_removed_after_the_forward_still_runs_in_the_recompute():
    """nnsight's one-shot edit under torch.func: the forward ran the hook; so does the recompute."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    params = {k: v.detach() for k, v in lin.named_parameters()}

    def program(ckpt):
        def loss(p):
            handle = lin.register_forward_hook(lambda module, inputs, out: out * 2)
            try:
                y = ckpt(lambda t: torch.tanh(functional_call(lin, p, (t,))), X)
            finally:
                handle.remove()  # before the backward (torch.func.grad runs it after loss returns)
            return y.pow(2).sum()

        return grad(loss)(params)

    for entry in ENTRIES:
        assert assert_right_or_refused(program, entry, refusable=False) is not None


# --------------------------------------------------------------------------
# what a fresh-eyes review found: blocks the proof misread, updates it missed


def test_named_tuple_results_count_as_computed():
    """torch.return_types (max, sort, topk) are tuple subclasses: their tensors were taken for unlifted reads."""
    def program(ckpt):
        block = lambda t: LINEAR(t).max(-1).values.sum() + LINEAR(t).sort(-1).values[..., 0].sum()  # noqa: E731
        return grad(lambda t: ckpt(block, t))(X), vmap(grad(lambda t: ckpt(block, t)))(XS[0])

    for entry in ENTRIES:
        assert assert_right_or_refused(program, entry, refusable=False) is not None


IN_PLACE_UPDATES = {
    "inplace=True": lambda b: torch.nn.functional.elu(b, inplace=True),
    "inplace positionally": lambda b: torch.nn.functional.leaky_relu(b, 0.1, True),
    "through a view": lambda b: b[:1].mul_(2),
    "through .data": lambda b: b.data.mul_(2),
    "an aten overload": lambda b: torch.ops.aten.add_.Tensor(b, 1.0),
}


@pytest.mark.parametrize("how", list(IN_PLACE_UPDATES))
def test_an_input_updated_in_place_is_recomputed_from_its_forward_value(how):
    """The recompute starts from what the forward started from, whichever way the block wrote into it."""
    update = IN_PLACE_UPDATES[how]

    def block(t, buffer):
        update(buffer)
        return (LINEAR(t) * buffer).pow(2).sum()

    def program(ckpt):
        buffer = torch.randn(2, 3, generator=torch.Generator().manual_seed(4))
        return grad(lambda t, b: ckpt(block, t, b))(X, buffer), buffer

    for entry in ENTRIES:
        assert assert_right_or_refused(program, entry, refusable=False) is not None


def test_an_update_the_proof_cannot_see_keeps_the_plain_run():
    """Written with torch functions off (as a C extension may): no copy of the buffer was kept for a
    recompute, so the call is not packed; the plain run (run once: the buffer doubled once) is the result
    (fallback), or strict explains it. Never a recompute from the new value."""
    def block(t, buffer):
        with torch._C.DisableTorchFunction():
            buffer.mul_(2)
        return (LINEAR(t) * buffer).pow(2).sum()

    def program(ckpt):
        buffer = torch.ones(2, 3)
        g = grad(lambda t, b: ckpt(block, t, b))(X, buffer)
        return g, buffer

    (expected, doubled) = program(plain)
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match=r"argument 1 \(a \(2, 3\) tensor\) in place"):
        program(ckpt_guard.checkpoint)
    with ckpt_guard.policy("fallback"), pytest.warns(ckpt_guard.CheckpointCompositionWarning, match="in place"):
        got, buffer = program(ckpt_guard.checkpoint)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(buffer, doubled)  # doubled once


HIDDEN = torch.randn(3, requires_grad=True, generator=torch.Generator().manual_seed(5))


def test_a_refusal_the_block_catches_still_stops_it():
    """The block's own ``except Exception`` around a read the proof refuses: refused (strict) or right (fallback)."""
    import sys

    def block(t):
        try:  # read through a lookup no walk can follow
            scale = getattr(sys.modules[__name__], "HID" + "DEN")
            return (LINEAR(t) * scale).pow(2).sum()
        except Exception:  # noqa: BLE001 - what the test is about
            return LINEAR(t).pow(2).sum()

    def program(ckpt):
        return grad(lambda t: ckpt(block, t))(X)

    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match="not lifted"):
        program(ckpt_guard.checkpoint)
    for entry in ("public fallback", "torch fallback"):
        assert assert_right_or_refused(program, entry, refusable=False) is not None


def test_eager_swap_the_guard_did_not_track_is_ckg101():
    """No install(), a swap outside transforms, a block the proof refuses: never torch's recompute of other weights."""
    import sys

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    fast = {k: (v * 2).detach().requires_grad_() for k, v in net.named_parameters()}

    def block(t):
        return net(t) * getattr(sys.modules[__name__], "HID" + "DEN").detach().requires_grad_()

    def outer_grads(ckpt):
        with torch.nn.utils.stateless._reparametrize_module(net, fast):
            loss = ckpt(block, X).pow(2).sum()
        return torch.autograd.grad(loss, list(fast.values()), allow_unused=True)  # after the swap ended

    ckpt_guard.uninstall()
    reference = outer_grads(plain)
    raw = outer_grads(torch_checkpoint)
    assert any(r is None or not torch.allclose(r, e) for r, e in zip(raw, reference)), "torch alone is wrong here"
    # the block ran once, plainly, with the swapped-in weights (the proof needed that run): right, and
    # every policy says it could not be checkpointed (strict too: nothing wrong is returned)
    for policy in ("strict", "fallback", "warn"):
        warned = r"\[CKG101\][\s\S]*refusal class leaf-inside"  # the block makes HIDDEN's copy a leaf
        with ckpt_guard.policy(policy), pytest.warns(ckpt_guard.CheckpointCompositionWarning, match=warned):
            got = outer_grads(ckpt_guard.checkpoint)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r)


def test_the_guard_keeps_no_checkpointed_model_alive():
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    model[0].register_forward_hook(lambda module, inputs, out: None)
    checkpoint(model, X.requires_grad_(), use_reentrant=False).sum().backward()
    X.requires_grad_(False)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_a_hook_on_a_submodule_added_after_the_first_call_is_watched():
    """The block's shape changed since the guard first walked it: the new submodule's hooks count too (CKG111)."""
    seq = torch.nn.Sequential(torch.nn.Linear(3, 3))
    x = X.clone().requires_grad_()
    checkpoint(seq, x, use_reentrant=False).sum().backward()  # walked once
    seq.append(torch.nn.Linear(3, 3))
    handle = seq[1].register_forward_hook(lambda module, inputs, out: out * 2)
    out = checkpoint(seq, x, use_reentrant=False).sum()
    handle.remove()
    with pytest.raises(CheckpointCompositionError, match="CKG111"):
        out.backward()


# --------------------------------------------------------------------------
# found by the second review: writes into batched or shared memory, frozen swaps, shared submodules


def test_frozen_weights_swapped_in_by_functional_call_are_ckg101():
    """Frozen weights, differentiable ones swapped in (hypernetwork), no install(): the recompute after the
    swap reads the frozen ones, which need no gradient; the forward's swapped-in tensors are missed (CKG101)."""
    import sys

    class Wrapper(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.norm, self.ckpt = torch.nn.LayerNorm(3), ckpt

        def forward(self, t):  # the block reads HIDDEN through a lookup no walk follows: the proof refuses it
            return self.ckpt(lambda u: torch.tanh(self.norm(u) * getattr(sys.modules[__name__], "HID" + "DEN")), t)

    def program(ckpt):
        net = Wrapper(ckpt).requires_grad_(False)
        hyper = torch.linspace(0.5, 1.5, 3).requires_grad_()
        x = X.clone().requires_grad_()
        functional_call(net, {"norm.weight": hyper * 2, "norm.bias": hyper + 1}, (x,)).pow(2).sum().backward()
        return hyper.grad, x.grad

    ckpt_guard.uninstall()
    reference = program(plain)
    raw = program(torch_checkpoint)
    assert raw[0] is None or not torch.allclose(raw[0], reference[0]), "torch alone is wrong here"
    for policy in ("strict", "fallback"):  # run once, plainly: right, and said
        with ckpt_guard.policy(policy), pytest.warns(ckpt_guard.CheckpointCompositionWarning, match=r"\[CKG101\][\s\S]*not lifted"):
            got = program(ckpt_guard.checkpoint)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r)


def _add_one(t, buffer):
    buffer.add_(1)
    return (t * buffer).sin()


def test_an_input_vmap_batches_written_in_place_is_right():
    """A batched input the block updates in place (no gradient): the plain run keeps a copy of it at the
    caller's levels (batched), which the recompute starts from; the buffers are updated once."""
    def program(ckpt):
        x = torch.linspace(0.1, 1, 12).reshape(3, 4).requires_grad_()
        buffers = torch.ones(3, 4)
        vmap(lambda t, b: ckpt(_add_one, t, b))(x, buffers).sum().backward()
        return x.grad, buffers  # the buffers updated once, as without checkpointing

    for entry in ENTRIES:
        before = _composable.counters.RECOMPUTES
        assert assert_right_or_refused(program, entry, refusable=False) is not None
        assert _composable.counters.RECOMPUTES > before


def test_an_ensemble_of_train_batchnorms_counts_each_batch_once():
    """stack_module_state + vmap over train BatchNorm: running statistics and num_batches_tracked as without checkpointing."""
    import copy

    from torch.func import stack_module_state

    class Member(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.lin, self.bn, self.ckpt = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), ckpt

        def forward(self, t):
            return self.ckpt(lambda u: self.bn(self.lin(u)), t)

    def program(ckpt):
        torch.manual_seed(0)
        members = [Member(ckpt) for _ in range(2)]
        params, buffers = stack_module_state(members)
        base = copy.deepcopy(members[0]).to("meta")
        x = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(6))
        vmap(lambda p, b, t: functional_call(base, (p, b), (t,)))(params, buffers, x).pow(2).sum().backward()
        return params["lin.weight"].grad, buffers["bn.running_mean"], buffers["bn.num_batches_tracked"]

    for entry in ENTRIES:
        assert_right_or_refused(program, entry)


def _write_first(t, a, b):
    a.add_(1)
    return torch.sin(t * a + b)


def _write_second_through_data(t, a, b):
    b.data.add_(1)
    return torch.sin(t * b) + a


def test_inputs_sharing_memory_are_recomputed_from_their_forward_values():
    """Two views of one tensor, or a tensor and its ``.data`` (separate version counters, one storage):
    the write through one is seen for both; no false refusal, no recompute from the new value."""
    def views(ckpt):
        h = torch.zeros(8)
        x = torch.linspace(0.1, 1, 12).reshape(3, 4).requires_grad_()
        vmap(lambda t: ckpt(_write_first, t, h[:4], h[4:]))(x).sum().backward()
        return x.grad, h

    def data_alias(ckpt):
        a = torch.zeros(4)
        x = torch.linspace(0.1, 1, 12).reshape(3, 4).requires_grad_()
        vmap(lambda t: ckpt(_write_second_through_data, t, a, a.data))(x).sum().backward()
        return x.grad, a

    for program in (views, data_alias):
        for entry in ENTRIES:
            assert assert_right_or_refused(program, entry, refusable=False) is not None


def test_a_shared_submodule_rebound_through_its_second_path_is_ckg110():
    """``self.a`` and ``self.b`` are one Linear: re-binding either path before the recompute is CKG110."""
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = self.b = torch.nn.Linear(3, 3)

        def forward(self, t):
            return torch.sin(self.b(torch.sin(self.a(t))))

    for path in ("a", "b"):
        net = Twice()
        out = checkpoint(net, X.clone().requires_grad_(), use_reentrant=False).sum()
        setattr(net, path, torch.nn.Linear(3, 3))
        with pytest.raises(CheckpointCompositionError, match="CKG110"):
            out.backward()


def test_a_module_switched_to_eval_behind_an_untracked_swap_keeps_the_plain_run():
    """Installed, a weight swapped by hand (not functional_call), a block the proof refuses, then eval():
    the plain run the proof needed is the result (it used to be torch's checkpoint behind the guard's read
    recorder, recomputing in eval mode: CKG106), so eval() changes nothing."""
    import sys

    class Mode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, t):
            scale = getattr(sys.modules[__name__], "HID" + "DEN")
            return torch.sin(self.lin(t) * scale * (2.0 if self.training else 3.0))

    torch.manual_seed(0)
    net = Mode()
    net.lin._parameters["weight"] = net.lin.weight * 1.0  # an untracked swap
    x = X.clone().requires_grad_()
    expected = torch.autograd.grad(net(x).sum(), x)[0]
    # refused after its one plain run, which is the result: no recompute left for eval() to change
    with pytest.warns(ckpt_guard.CheckpointCompositionWarning, match=r"CKG101[\s\S]*checkpointed: Mode"):
        out = ckpt_guard.checkpoint(net, x)
    net.eval()
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], expected)


# --------------------------------------------------------------------------
# a user torch.Generator: the recompute draws what the forward drew


def _noisy_program(transform, refused=False):
    """A block drawing noise from its own generator (and, if ``refused``, reading a global the proof refuses)."""
    import sys

    def program(ckpt):
        generator = torch.Generator().manual_seed(0)
        w = torch.linspace(0.5, 1.5, 3, dtype=torch.float64).requires_grad_()
        def block(t):
            noise = torch.randn(t.shape, generator=generator, dtype=t.dtype)
            out = torch.sin(t * w) * noise
            if refused:  # after the draw: fallback's plain run must draw the same numbers again
                return out * getattr(sys.modules[__name__], "HID" + "DEN").to(t.dtype)
            return out

        x = torch.linspace(0.1, 1, 6, dtype=torch.float64).reshape(2, 3)
        result = transform(lambda t: ckpt(block, t).pow(2).sum())(x)
        return result, torch.randn(3, generator=generator)  # the program's next draw: the block drew once

    return program


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("how", ["grad", "jacrev", "grad of grad", "vmap(grad)", "refused, grad"])
def test_a_user_generator_is_replayed_in_the_recompute(how, entry):
    """Before: the recompute drew the generator's next numbers (silently wrong gradients)."""
    transforms = {
        "grad": grad, "jacrev": jacrev, "refused, grad": grad,
        "grad of grad": lambda f: grad(lambda x: grad(f)(x).sin().sum()),  # (hessian: vmap refuses random ops)
        "vmap(grad)": lambda f: lambda x: vmap(grad(f), randomness="same")(x),
    }
    program = _noisy_program(transforms[how], refused=how.startswith("refused"))
    assert assert_right_or_refused(program, entry, refusable=how.startswith("refused")) is not None or (
        entry == "public strict" and how.startswith("refused")
    )


DRAWS = {
    # torch.poisson takes its generator positionally (so do binomial and _standard_gamma)
    "a generator passed positionally": lambda t, g: torch.poisson(torch.full_like(t, 3.0), g),
    # the default generator by name, after an implicit draw: the RNG replay's, not kept as a user one
    "the default generator by name": lambda t, g: torch.randn(t.shape, dtype=t.dtype)
    + torch.randn(t.shape, dtype=t.dtype, generator=torch.default_generator),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("draw", list(DRAWS))
def test_every_way_of_naming_a_generator_is_replayed(draw, entry):
    def program(ckpt):
        torch.manual_seed(7)
        generator = torch.Generator().manual_seed(0)
        w = torch.linspace(0.5, 1.5, 3, dtype=torch.float64).requires_grad_()

        def block(t):
            return torch.sin(t * w) * DRAWS[draw](t, generator)

        x = torch.linspace(0.1, 1, 6, dtype=torch.float64).reshape(2, 3)
        return grad(lambda t: ckpt(block, t).pow(2).sum())(x), torch.rand(2, generator=generator), torch.rand(2)

    assert assert_right_or_refused(program, entry, refusable=False) is not None


# --------------------------------------------------------------------------
# a tensor the block reads, updated in place between its forward and its recompute


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return torch.sin(self.lin(x) * self.scale)


def _pullback_after(update, entry):
    """``vjp`` of a checkpointed block, ``update()`` in place, then the pullback."""
    net, x = _Scaled(), torch.randn(3, 4)
    params = {k: v.detach() for k, v in net.named_parameters()}
    _, pullback = vjp(lambda p: entry(lambda h: functional_call(net, p, (h,)), x).sum(), params)
    update(net, params)
    return pullback(torch.ones(()))[0]["lin.weight"]


UPDATES = {
    "a buffer": (lambda net, params: net.scale.fill_(5.0), r"_Scaled\.scale, which the checkpointed block reads"),
    "a differentiated primal": (lambda net, params: params["lin.weight"].mul_(2.0), r"a tensor the checkpointed block reads \(a \(4, 4\) tensor\)"),
}


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_an_in_place_update_between_the_forward_and_the_recompute_raises_not_a_wrong_gradient(entry, update):
    """The recompute would read the new values (a review found wrong gradients, no word): autograd's
    check on saved tensors compares the torch.func wrapper's version, which never moves. Without
    checkpointing the pullback uses what the forward saved; with checkpointing it must stop."""
    policy, call = ENTRIES[entry]
    change, named = UPDATES[update]
    reference = _pullback_after(change, plain)
    assert reference.abs().sum() > 0
    ckpt_guard.install(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback's one line for the torch call (CKG001)
        with pytest.raises(_composable.ChangedSinceForward, match=named + r"[\s\S]*updated in place after"):
            _pullback_after(change, call)
    ckpt_guard.install(policy)
    with warnings.catch_warnings():  # no update: no alarm, the uncheckpointed gradient
        warnings.simplefilter("ignore")
        torch.testing.assert_close(_pullback_after(lambda *_: None, call), _pullback_after(lambda *_: None, plain))


def test_an_optimizer_step_before_the_pullback_stops_bare_and_is_ckg108_under_fallback():
    """Not installed, ``ckpt_guard.checkpoint`` alone used to return the stepped weights' gradient;
    torch's checkpoint under fallback: the drift rule that explains the change (CKG108) speaks first."""
    def pullback_after_a_step(entry):
        net, x = _Scaled(), torch.randn(3, 4)
        _, pullback = vjp(lambda h: entry(net, h).sum(), x)
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.SGD(net.parameters(), lr=0.5).step()
        return pullback(torch.ones(()))[0]

    ckpt_guard.uninstall()
    with pytest.raises(_composable.ChangedSinceForward, match=r"_Scaled\.lin\.(weight|bias), which[\s\S]*updated in place"):
        pullback_after_a_step(ckpt_guard.checkpoint)
    ckpt_guard.install("fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback's one line for the call (CKG001)
        with pytest.raises(CheckpointCompositionError, match="CKG108"):
            pullback_after_a_step(torch_checkpoint)


def test_an_update_of_a_tensor_the_block_does_not_read_is_no_alarm():
    """A block closing over the whole model lifts every parameter of it; an optimizer step on another
    stage's (decoupled or pipelined training) between this stage's forward and pullback is no change
    the recompute reads (a review found the first version of the check raising here)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"stage1": torch.nn.Linear(4, 4), "stage2": torch.nn.Linear(4, 1)})
    x = torch.randn(3, 4)

    def program(call):
        out, pullback = vjp(lambda t: call(lambda u: torch.tanh(model["stage1"](u)), t), x)
        model["stage2"](out.detach()).sum().backward()
        torch.optim.SGD(model["stage2"].parameters(), lr=0.5).step()
        return pullback(torch.ones_like(out))[0]

    expected = program(plain)
    torch.testing.assert_close(program(ckpt_guard.checkpoint), expected)
    assert expected.abs().sum() > 0


def test_a_module_run_twice_in_train_mode_is_no_alarm():
    """A BatchNorm's running statistics move in each forward (the second call's too, before the first
    call's recompute): the recompute starts from its own copy of them, so that is no change it reads."""
    torch.manual_seed(0)
    norm, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), torch.randn(8, 4)

    def program(call):
        def loss(p, b):  # the buffers an argument (not differentiated), as functorch's examples pass them
            h = call(lambda t: functional_call(norm, (p, b), (t,)), x)
            return call(lambda t: functional_call(norm, (p, b), (t,)), h.tanh()).pow(2).sum()

        params = {k: v.detach() for k, v in norm.named_parameters()}
        buffers = {k: v.clone() for k, v in norm.named_buffers()}
        return grad(loss)(params, buffers), buffers

    (expected, updated), (got, given) = program(plain), program(ckpt_guard.checkpoint)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
    for name in updated:  # each call's update once, as without checkpointing
        torch.testing.assert_close(given[name], updated[name])
    assert updated["1.num_batches_tracked"].item() == 2


def _spectral_norm_with_buffers_in_a_closure(ckpt, calls=2):
    """spectral_norm's power iteration writes its ``_u``/``_v`` buffers in place (``out=``); here they
    reach the block through ``functional_call`` from a closure, so the recompute is not given them."""
    torch.manual_seed(0)
    m = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 4))
    params = {k: v.detach() for k, v in m.named_parameters()}
    buffers = {k: v.clone() for k, v in m.named_buffers()}
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))

    def loss(p):
        h = x
        for _ in range(calls):
            h = ckpt(lambda t: functional_call(m, (p, buffers), (t,)), h).tanh()
        return h.pow(2).sum()

    _, pullback = vjp(loss, params)
    return [*pullback(torch.ones(()))[0].values(), *buffers.values()]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_write_into_a_tensor_the_block_was_not_given_is_refused_not_recomputed_twice(entry):
    """A review found gradients off by 0.11 and the buffers advanced twice, silently: the recompute
    started from the power iteration's updated vectors. The proof refuses the write (fallback runs
    the block plainly; strict explains); the result equals the uncheckpointed one."""
    got = assert_right_or_refused(_spectral_norm_with_buffers_in_a_closure, entry)
    assert (got is None) == (ENTRIES[entry][0] == "strict")
    if got is None:
        with ckpt_guard.policy("strict"), pytest.raises(
            CheckpointCompositionError, match=r"writes in place into .*\['parametrizations\.weight\.0\._u'\], a tensor it was neither given nor made"
        ):
            _spectral_norm_with_buffers_in_a_closure(ckpt_guard.checkpoint)


# --------------------------------------------------------------------------
# a module's plain numbers: the recompute reads what the forward read


class _Timed(torch.nn.Module):
    """A shared block told its step before each call (a timestep, a layer index), counting its calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(4, 4)
        self.t, self.calls = 0.0, 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x) * (1.0 + self.t) + 0.1 * self.calls)


def _shared_block_program(ckpt):
    m = _Timed()
    x = torch.randn(4, generator=torch.Generator().manual_seed(2))

    def f(h):
        for t in range(3):
            m.t = float(t)
            h = ckpt(m, h)
        return h.sum()

    return grad(f)(x), torch.tensor(m.calls), torch.tensor(m.t)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_number_set_on_a_module_between_calls_is_read_by_the_recompute_as_the_forward_read_it(entry):
    """A review found each call recomputed with the last ``m.t`` and the counter moved on by the
    recompute (wrong gradients, no word; torch's own checkpoint does the same eagerly). The module
    ends as without checkpointing: ``t`` as last set, ``calls`` counting the three forwards."""
    got = assert_right_or_refused(_shared_block_program, entry, refusable=False)
    assert got[1].item() == 3 and got[2].item() == 2.0


class _ReadsInsideAFunction(torch.autograd.Function):
    """Reads ``mod.w`` inside its forward, where the proof sees only the Function's call."""

    @staticmethod
    def forward(x, mod):
        s = mod.w.sum()
        return x * s, s

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, g, gs):
        (s,) = ctx.saved_tensors
        return g * s, None


class _FunctionUser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return _ReadsInsideAFunction.apply(x, self)[0]


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_update_read_inside_an_autograd_function_is_still_checked(entry):
    """The proof cannot see what an autograd.Function's forward reads: every input is checked then
    (a review found ``mod.w.mul_(2)`` between vjp and pullback giving [6, 6, 6] for [3, 3, 3])."""
    policy, call = ENTRIES[entry]
    mod, x = _FunctionUser(), torch.arange(3.0)
    ckpt_guard.install(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, pullback = vjp(lambda t: call(mod, t).sum(), x)
    with torch.no_grad():
        mod.w.mul_(2)
    with pytest.raises(_composable.ChangedSinceForward, match=r"_FunctionUser\.w, which"):
        pullback(torch.ones(()))


_OUTSIDE = torch.zeros(4)
WRITES = {
    "torch.ops.aten.add_.Tensor": lambda: torch.ops.aten.add_.Tensor(_OUTSIDE, torch.ones(4)),
    "torch._foreach_add_": lambda: torch._foreach_add_([_OUTSIDE], 1.0),
}


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_writes_an_aten_overload_or_a_foreach_list_names_are_refused_too(entry, write):
    """``_written`` reads an aten overload's schema and flattens lists: both wrote into a closure's
    buffer unrefused (the recompute wrote it again: gradients 4.9 off, the buffer at 2, not 1)."""
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(4, 4), torch.randn(3, 4)

    def program(ckpt):
        _OUTSIDE.zero_()
        lin.zero_grad()

        def block(r):
            WRITES[write]()
            return lin(r) * _OUTSIDE

        vmap(lambda r: ckpt(block, r).pow(2).sum())(x).sum().backward()
        return lin.weight.grad.clone(), _OUTSIDE.clone()

    assert assert_right_or_refused(program, entry) is not None or ENTRIES[entry][0] == "strict"
