"""Regressions from an adversarial pass over the guard: each failed before its fix.

Silently changed results, false alarms and crashes on programs torch runs
correctly, memory the guard kept alive, a race, and messages.  (The launcher's
defects are tested in ``test_cli.py``.)
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import textwrap
import threading
import types
import warnings
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import run_raw
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning

pytestmark = pytest.mark.usefixtures("guard")


def _quietly(run):
    """``run()`` with warnings ignored (torch's use_reentrant / None-of-the-inputs notes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run()


# --------------------------------------------------------------------------
# silently wrong or changed results


@pytest.mark.parametrize("binding", ["positional", "keyword"])
def test_ckg006_sees_a_trainable_tensor_bound_by_partial(binding):
    """A reentrant checkpoint of partial(f, w) with no input requiring grad: w gets no gradient."""
    w = torch.randn(3, requires_grad=True)

    def block(*args, **kwargs):
        weight = args[0] if args and binding == "positional" else kwargs["weight"]
        x = args[-1] if binding == "positional" else args[0]
        return (x * weight).sin()

    function = functools.partial(block, w) if binding == "positional" else functools.partial(block, weight=w)
    x = torch.randn(3)
    raw = run_raw(lambda ckpt, ur: ckpt(function, x, use_reentrant=ur), True)
    assert not raw.requires_grad  # the symptom: w would train on nothing
    with pytest.raises(CheckpointCompositionError) as info:
        _quietly(lambda: checkpoint(function, x, use_reentrant=True))
    assert info.value.rule.id == "CKG006"


class _ClassHeld:
    weight = None


def test_fallback_without_checkpointing_keeps_the_users_forward_context():
    """An autocast context_fn: bfloat16 under raw torch, and still when fallback runs the block plainly."""
    # a class attribute cannot be lifted into the composable recompute: the run-time proof refuses it
    _ClassHeld.weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    seen = []

    def block(u):
        out = u @ _ClassHeld.weight
        seen.append(out.dtype)
        return out

    def context_fn():
        return torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16)

    raw = run_raw(lambda ckpt, ur: ckpt(block, x, use_reentrant=ur, context_fn=context_fn), False)
    assert raw.dtype == torch.bfloat16 and seen == [torch.bfloat16]
    seen.clear()
    # under torch.func.grad, fallback runs the block without checkpointing (CKG001)
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, pytest.warns(CheckpointCompositionWarning):
        torch.func.grad(
            lambda t: checkpoint(block, t, use_reentrant=False, context_fn=context_fn).float().sum()
        )(x)
    assert [(e.rule_id, e.action) for e in events] == [("CKG001", "fallback: no checkpoint")]
    assert seen == [torch.bfloat16]


# --------------------------------------------------------------------------
# false alarms and crashes on programs torch runs correctly


class _KeyErrorOnAttributes:
    """A callable whose __getattr__ raises KeyError (a dict-backed config object, say)."""

    def __init__(self, block):
        self.__dict__["block"] = block

    def __getattr__(self, name):
        raise KeyError(name)

    def __call__(self, t):
        return self.block(t)


@pytest.mark.parametrize("policy", ["strict", "warn", "fallback"])
def test_a_callable_whose_getattr_raises_is_not_the_guards_problem(policy):
    block = torch.nn.Linear(3, 3).requires_grad_(False)  # frozen: no rule fires, the walk runs all the same
    function = _KeyErrorOnAttributes(block)
    from ckpt_guard._state import block_reads as _reads

    complete = _reads.reads_of(function).complete()  # looked into, __getattr__ and all
    assert complete.partial == (block,) and not complete.unseen
    x = torch.randn(2, 3)  # no input requires grad: a non-quiet reentrant call
    with ckpt_guard.policy(policy):
        for use_reentrant in (True, False):
            out = _quietly(lambda: checkpoint(function, x, use_reentrant=use_reentrant))
            torch.testing.assert_close(out, block(x))
    # trainable, reentrant: CKG006 sees the Linear its __call__ runs and speaks (the guard's error, not a KeyError)
    block.requires_grad_(True)
    if policy == "strict":
        with ckpt_guard.policy(policy), pytest.raises(ckpt_guard.CheckpointCompositionError) as info:
            checkpoint(function, x, use_reentrant=True)
        assert info.value.rule.id == "CKG006"


def test_the_words_for_a_callable_whose_getattr_raises_are_the_guards():
    """A rule fires (CKG002: reentrant under grad) on such a callable: building its message read
    ``function.__code__`` and raised the user's KeyError instead of the guard's error."""
    function = _KeyErrorOnAttributes(torch.nn.Linear(3, 3))
    with ckpt_guard.policy("strict"), pytest.raises(ckpt_guard.CheckpointCompositionError) as info:
        torch.func.grad(lambda x: checkpoint(function, x, use_reentrant=True).sum())(torch.randn(2, 3))
    assert info.value.rule.id == "CKG002" and "checkpointed: a _KeyErrorOnAttributes object" in str(info.value)


class _Net(torch.nn.Module):
    def __init__(self, block_fn):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.block_fn = block_fn

    def forward(self, x):
        h = self.lin(x)
        return checkpoint(self.block_fn, h, use_reentrant=False).sum()


@pytest.mark.parametrize("block_fn", [
    F.gelu,
    lambda t: torch.tanh(t) * t,
    lambda t: F.scaled_dot_product_attention(t[None, None], t[None, None], t[None, None])[0, 0],
], ids=["gelu", "lambda-over-inputs", "sdpa"])
def test_parameter_free_block_inside_functional_call_is_quiet(block_fn):
    """MAML-style: backward after the swap, but the checkpointed function reads no parameter."""
    torch.manual_seed(0)
    net = _Net(block_fn)
    params = {k: (v.detach() * 1.5).requires_grad_() for k, v in net.named_parameters()}
    x = torch.randn(3, 4)

    def step():
        loss = functional_call(net, params, (x,))
        return torch.autograd.grad(loss, list(params.values()))

    raw = run_raw(lambda ckpt, ur: step(), False)
    for policy in ("strict", "fallback"):
        with ckpt_guard.policy(policy), ckpt_guard.record() as events, warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)
            guarded = step()
        assert events == [], policy  # fallback keeps checkpointing it, too
        for g, r in zip(guarded, raw):
            assert torch.equal(g, r)


def test_another_threads_functional_call_is_not_this_threads_swap():
    """Swap state is per thread: a plain checkpoint here is not blamed on a swap over there."""
    other = torch.nn.Linear(3, 3)
    inside, leave = threading.Event(), threading.Event()

    def swapping():
        params = {k: v.detach() * 2 for k, v in other.named_parameters()}
        with torch.nn.utils.stateless._reparametrize_module(other, params):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=swapping)
    thread.start()
    try:
        assert inside.wait(10)
        x = torch.randn(2, 3, requires_grad=True)
        y = checkpoint(lambda t: torch.sin(t) * 2, x, use_reentrant=False)  # while the other thread swaps
    finally:
        leave.set()
        thread.join()
    y.sum().backward()  # recompute after that swap ended: nothing this block reads changed
    assert x.grad is not None


def test_train_eval_switch_of_a_block_without_mode_dependent_layers_is_quiet():
    """CKG106 only where train/eval changes what the block computes (a Linear: it does not)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.LayerNorm(4))

    def probe(ckpt, use_reentrant):
        block.train()
        x = torch.randn(2, 4, requires_grad=True)
        y = ckpt(block, x, use_reentrant=use_reentrant)
        block.eval()
        y.sum().backward()
        block.zero_grad(set_to_none=False)
        return [x.grad]

    for use_reentrant in (True, False):
        torch.manual_seed(1)
        raw = run_raw(probe, use_reentrant)
        torch.manual_seed(1)
        with ckpt_guard.record() as events:
            guarded = probe(checkpoint, use_reentrant)
        assert events == []
        assert torch.equal(guarded[0], raw[0])


def test_train_eval_switch_of_a_users_layer_that_reads_training_fires():
    """The precision comes from the layers' code: a user's own layer reading self.training counts."""

    class Noisy(torch.nn.Module):
        def forward(self, t):
            return t + (torch.randn_like(t) if self.training else 0)

    block = torch.nn.Sequential(torch.nn.Linear(4, 4), Noisy())
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False)
    block.eval()
    with pytest.raises(CheckpointCompositionError) as info:
        y.sum().backward()
    assert info.value.rule.id == "CKG106"


def test_fx_symbolic_trace_is_not_training():
    """torch.fx.symbolic_trace of a module with a reentrant checkpoint: Proxies, not a missing gradient."""

    class Traced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return checkpoint(self.lin, x, use_reentrant=True)

    module = Traced()

    def trace():
        try:
            return "traced", torch.fx.symbolic_trace(module)
        except CheckpointCompositionError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever torch itself does with it
            return "raised", type(exc)

    raw = run_raw(lambda ckpt, ur: _quietly(trace), True)
    guarded = _quietly(trace)
    assert guarded[0] == raw[0]
    if raw[0] == "raised":
        assert guarded[1] is raw[1]


# --------------------------------------------------------------------------
# memory kept alive


def _collected(make):
    """Whether the objects ``make()`` returns weak references to are freed once it returns."""
    refs = make()
    gc.collect()
    return all(ref() is None for ref in refs)


def test_an_optimizer_step_that_raises_keeps_nothing_alive():
    def make():
        model = torch.nn.Linear(3, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)

        def failing_step(*args, **kwargs):
            raise RuntimeError("step failed")

        optimizer.register_step_pre_hook(lambda *a: failing_step())
        with pytest.raises(RuntimeError, match="step failed"):
            optimizer.step()
        return [weakref.ref(model.weight), weakref.ref(optimizer)]

    assert _collected(make)
    ckpt_guard.uninstall()
    assert _collected(make)


def test_user_mode_classes_are_not_kept_alive():
    from torch.utils._python_dispatch import TorchDispatchMode

    def make():
        payload = torch.randn(1000)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                _ = payload
                return func(*args, **(kwargs or {}))

        x = torch.randn(3, requires_grad=True)
        with Mode():
            y = checkpoint(torch.sin, x, use_reentrant=False)
            y.sum().backward()
        return [weakref.ref(Mode), weakref.ref(payload)]

    assert _collected(make)
    ckpt_guard.uninstall()


def test_generated_code_is_not_kept_alive():
    """exec'd (or torch.fx-made) functions that checkpoint: the call-site caches stay bounded."""
    from ckpt_guard import _messages

    w = torch.randn(3, requires_grad=True)
    refs = []
    for i in range(1500):
        namespace = {"checkpoint": checkpoint, "w": w}
        exec(compile(f"def step_{i}(x):\n    return checkpoint(lambda t: t * w, x, use_reentrant=False)\n",
                     f"<generated {i}>", "exec"), namespace)
        step = namespace[f"step_{i}"]
        step(torch.randn(3, requires_grad=True)).sum().backward()
        refs.append(weakref.ref(step.__code__))
        del step, namespace
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive <= _messages.CACHE_LIMIT, alive
    ckpt_guard.uninstall()
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0


# --------------------------------------------------------------------------
# thread safety of the first install()


def test_is_installed_and_uninstall_from_another_thread_during_the_first_install():
    code = textwrap.dedent(
        """
        import sys, threading, time, traceback
        import torch
        import ckpt_guard
        errors, stop = [], threading.Event()

        def poke():
            while not stop.is_set():
                try:
                    ckpt_guard.is_installed()
                    ckpt_guard.uninstall()
                except BaseException:
                    errors.append(traceback.format_exc())
                    return
                time.sleep(0.0001)

        threads = [threading.Thread(target=poke) for _ in range(2)]
        for t in threads:
            t.start()
        ckpt_guard.install("strict")  # the first one: imports the patching machinery
        stop.set()
        for t in threads:
            t.join()
        print("errors", len(errors))
        print(errors[0] if errors else "")
        """
    )
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.stdout.startswith("errors 0"), result.stdout + result.stderr[-2000:]


# --------------------------------------------------------------------------
# messages and configuration


def test_one_call_one_decision_one_report():
    """Reentrant under vmap with fallback: CKG002 decides; one warning, the events agree on what ran.

    The block's weight sits in an object the guard does not look into, so CKG003
    cannot tell that use_reentrant=False would not do either; before, the
    switched call then warned again (CKG104 "no checkpoint") after CKG002 had
    reported "use_reentrant=False".
    """
    holder = types.SimpleNamespace(w=torch.randn(3, 3, requires_grad=True))
    block = lambda t: torch.tanh(t @ holder.w)  # noqa: E731
    x = torch.randn(4, 3)
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.func.vmap(lambda t: checkpoint(block, t, use_reentrant=True))(x)
        y.sum().backward()
    ours = [w for w in caught if issubclass(w.category, CheckpointCompositionWarning)]
    assert len(ours) == 1, [str(w.message).splitlines()[0] for w in ours]
    assert len({e.action for e in events}) == 1, events
    action = events[0].action
    assert action in str(ours[0].message) or {
        "fallback: no checkpoint": "without checkpointing", "fallback: use_reentrant=False": "use_reentrant=False",
        "fallback: composable recompute": "composable recompute",
    }[action] in str(ours[0].message)
    torch.testing.assert_close(holder.w.grad, torch.autograd.grad(block(x).sum(), holder.w)[0])


@pytest.mark.parametrize("name", ["my_functools.py", "my_contextlib.py", "my_threading.py"])
def test_a_users_file_named_like_a_stdlib_helper_is_the_users(tmp_path, name):
    path = tmp_path / name
    path.write_text(textwrap.dedent(
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        def step():
            return torch.func.grad(lambda t: checkpoint(torch.sin, t, use_reentrant=False).sum())(torch.randn(3))
        """
    ))
    module = types.ModuleType(name[:-3])
    module.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    with pytest.raises(CheckpointCompositionError) as info:
        module.step()
    assert f"checkpoint called at: {path}:6 in <lambda>" in str(info.value)


@pytest.mark.parametrize("kind", ["policy", "rule id", "rules spec"])
def test_a_huge_bad_configuration_value_is_not_echoed_in_full(kind):
    huge = "x" * 1_000_000
    ckpt_guard.uninstall()
    with pytest.raises(ValueError) as info:
        if kind == "policy":
            ckpt_guard.install(huge)
        elif kind == "rule id":
            ckpt_guard.install("strict", rules={huge: "warn"})
        else:
            ckpt_guard.install("strict", rules=f"CKG001={huge}")
    assert len(str(info.value)) < 600, len(str(info.value))
    assert "(1000002 characters)" in str(info.value) or "characters)" in str(info.value)



def test_a_rule_switched_off_is_torch_not_another_rules_risk():
    """fallback with CKG001 off: before, CKG104's call-time risk stood in for it, with a message
    that described another error and "fixes" that led back to torch's error.  Now: torch as asked."""
    from ckpt_guard._rules import rule_by_id
    from ckpt_guard._versions import installed

    rule = rule_by_id("CKG001")
    if not rule.holds_on(installed()):
        pytest.skip(f"CKG001 does not hold on torch {torch.__version__}")
    with ckpt_guard.policy("fallback", rules={"CKG001": "off"}), ckpt_guard.record() as events:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)
            with pytest.raises(RuntimeError, match=rule.raises_match):
                torch.func.grad(lambda t: checkpoint(torch.sin, t, use_reentrant=False).sum())(torch.randn(3))
    assert events == []


def test_a_rule_set_to_warn_is_torch_after_the_warning():
    """fallback with CKG001 at warn: one warning (CKG001's), then torch's own error; before, CKG104's
    call-time risk also fired and ran the block another way."""
    from ckpt_guard._rules import rule_by_id
    from ckpt_guard._versions import installed

    rule = rule_by_id("CKG001")
    if not rule.holds_on(installed()):
        pytest.skip(f"CKG001 does not hold on torch {torch.__version__}")
    with ckpt_guard.policy("fallback", rules={"CKG001": "warn"}), ckpt_guard.record() as events:
        with pytest.warns(CheckpointCompositionWarning, match=r"\[CKG001\]"):
            with pytest.raises(RuntimeError, match=rule.raises_match):
                torch.func.grad(lambda t: checkpoint(torch.sin, t, use_reentrant=False).sum())(torch.randn(3))
    assert [(e.rule_id, e.action) for e in events] == [("CKG001", "warned")]


class _Trainer:
    """Holds a frozen encoder, a trainable model and its optimizer."""

    def __init__(self):
        self.encoder = torch.nn.Linear(4, 4).requires_grad_(False)
        self.model = torch.nn.Linear(4, 4)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def encode(self, t):
        return torch.tanh(self.encoder(t))


_TRAINER = _Trainer()


def _log_shapes(t):
    if _TRAINER is None:  # mentions the global trainer, uses nothing of it
        print(t.shape)
    return t


@pytest.mark.parametrize("case", ["method of an object holding a trainable model", "helper naming a global trainer"])
def test_a_path_to_a_trainable_model_is_not_using_it(case):
    """CKG006 counts what the block holds directly: a model it merely has a path to (through an
    object or a helper function) is not blamed (the deeper walk serves the recompute only)."""
    x = torch.randn(2, 4)
    function = _TRAINER.encode if case.startswith("method") else (lambda t: torch.tanh(_log_shapes(t)))
    with ckpt_guard.policy("strict"), ckpt_guard.record() as events:
        out = _quietly(lambda: checkpoint(function, x, use_reentrant=True))
    assert events == []
    torch.testing.assert_close(out, function(x))


class _LyingClass:
    """An object whose ``__class__`` claims ``nn.Linear`` (as a ``Mock(spec=...)``'s does), with no module's state."""

    @property
    def __class__(self):
        return torch.nn.Linear


class _ClassLookupError(Exception):
    pass


class _RaisingClass:
    @property
    def __class__(self):
        raise _ClassLookupError("__class__ of the user's raised")


class _EqualityMeta(type):
    def __eq__(cls, other):  # (defining __eq__ leaves the classes unhashable)
        return cls is other

    __hash__ = None


class _UnhashableClass(metaclass=_EqualityMeta):
    pass


class _RaisingMroMeta(type):
    @property
    def __mro__(cls):
        raise _ClassLookupError("__mro__ of the user's raised")


class _RaisingMroClass(metaclass=_RaisingMroMeta):
    pass


_PROXIED = torch.nn.Linear(3, 3)  # (what a weakref.proxy near the block refers to)


ODD_OBJECTS = {
    "Mock(spec=nn.Linear)": lambda: mock.Mock(spec=torch.nn.Linear),
    "MagicMock(spec=nn.Module)": lambda: mock.MagicMock(spec=torch.nn.Module),
    "a lying __class__": _LyingClass,
    "a raising __class__": _RaisingClass,
    "a class with an unhashable metaclass": lambda: _UnhashableClass,
    "an object of that class": _UnhashableClass,
    "a class whose __mro__ raises": lambda: _RaisingMroClass,
    "a weakref.proxy of a module": lambda: weakref.proxy(_PROXIED),
}
_ODD_ENTRIES = {
    "ckpt_guard.checkpoint": ckpt_guard.checkpoint,
    "non-reentrant": functools.partial(checkpoint, use_reentrant=False),
    "reentrant": functools.partial(checkpoint, use_reentrant=True),
}


@pytest.mark.parametrize("place", ["closure", "object attribute", "partial argument", "argument"])
@pytest.mark.parametrize("odd", list(ODD_OBJECTS))
def test_an_odd_object_near_the_block_is_not_the_guards_crash(odd, place):
    """Mocks, a ``__class__`` that lies or raises, a class whose metaclass makes it unhashable, near a block
    that never uses them: the walks took a Mock for a module and raised into the user's call, and an argument
    whose ``__class__`` raised made the composable recompute's template keep the argument tuple as it was
    (zero gradients, silently).  Through each entry, under each policy, eager and under grad: the plain
    program's gradient, strict's refusal, or the very error raw torch raises there (torch's own checkpoint
    flattens its arguments and asks their types)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3).double()
    thing = ODD_OBJECTS[odd]()
    holder = types.SimpleNamespace(layer=layer, odd=thing)
    block, extra = {
        "closure": (lambda t: torch.tanh(layer(t)) if thing is not None else t, ()),
        "object attribute": (lambda t: torch.tanh(holder.layer(t)) if holder.odd is not None else t, ()),
        "partial argument": (functools.partial(lambda o, t: torch.tanh(layer(t)), thing), ()),
        "argument": (lambda t, o: torch.tanh(layer(t)), (thing,)),
    }[place]
    x = torch.randn(2, 3, dtype=torch.float64)

    def run(ckpt, how):
        layer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if how == "eager backward":
                ckpt(block, x.clone().requires_grad_(), *extra).sum().backward()
                return layer.weight.grad
            return torch.func.grad(lambda z: ckpt(block, z, *extra).sum())(x)

    for how in ("eager backward", "grad"):
        reference = run(lambda f, *args: f(*args), how)
        for entry, ckpt in _ODD_ENTRIES.items():
            # raw torch (ckpt_guard.checkpoint runs torch's non-reentrant checkpoint where it can)
            torch_entry = _ODD_ENTRIES["non-reentrant" if entry == "ckpt_guard.checkpoint" else entry]
            ckpt_guard.uninstall()
            try:
                raw = run(torch_entry, how)
            except Exception as exc:  # noqa: BLE001
                raw = exc
            finally:
                ckpt_guard.install("strict", rules={})
            for policy in ("strict", "fallback"):
                with ckpt_guard.policy(policy):
                    try:
                        got = run(ckpt, how)
                    except CheckpointCompositionError:
                        assert policy == "strict", (entry, how)
                        continue
                    except Exception as exc:  # noqa: BLE001
                        assert type(exc) is type(raw), (entry, how, policy, exc)
                        continue
                torch.testing.assert_close(got, reference, msg=f"{entry}, {how}, {policy}")
