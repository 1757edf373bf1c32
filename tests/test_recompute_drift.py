"""Recompute drift beyond the per-rule probes: threads, a realistic model, timing of the check, and the
ways a block reaches its modules (a partial's object, a list in a list, an object's dict) for every rule
that counts them (CKG106, CKG108, and the call-time CKG006)."""

from __future__ import annotations

import contextlib
import functools
import operator
import re
import threading
import types
import typing
import warnings

import pytest
import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint
from conftest import all_close, assert_all_close, no_checkpoint, run_guarded, run_raw

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning
from ckpt_guard._rules import rule_by_id
from ckpt_guard._versions import installed

pytestmark = pytest.mark.usefixtures("guard")


class Block(torch.nn.Module):
    """A small transformer block: self-attention + MLP, pre-norm."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(torch.nn.Module):
    def __init__(self, use_reentrant: bool, checkpointing: bool = True, depth: int = 3, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)
        self.use_reentrant, self.checkpointing = use_reentrant, checkpointing

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            if self.checkpointing:
                x = checkpoint(block, x, use_reentrant=self.use_reentrant)
            else:
                x = block(x)
        return self.head(x).mean()


def _functional_step(model, new_params, x):
    """What stateless ensembles and meta-learning do: functional_call, then backward."""
    loss = functional_call(model, new_params, (x,))
    loss.backward()
    return {name: p.grad for name, p in new_params.items()}


def _fresh_params(model):
    torch.manual_seed(1)
    return {k: (v.detach() + 0.05 * torch.randn_like(v)).requires_grad_() for k, v in model.named_parameters()}


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_transformer_through_functional_call(use_reentrant):
    torch.manual_seed(0)
    model = TinyTransformer(use_reentrant)
    x = torch.randn(2, 5, 8)
    reference_model = TinyTransformer(use_reentrant, checkpointing=False)
    reference_model.load_state_dict(model.state_dict())
    reference = _functional_step(reference_model, _fresh_params(model), x)

    # Without the guard torch silently gets many parameter gradients wrong.
    ckpt_guard.uninstall()
    raw = _functional_step(model, _fresh_params(model), x)
    wrong = [
        name for name in reference
        if raw[name] is None or not torch.allclose(raw[name], reference[name], atol=1e-6)
    ]
    block_params = [name for name in reference if name.startswith("blocks.")]
    assert set(wrong) >= set(block_params[:1]) and len(wrong) >= len(block_params) // 2, wrong
    print(f"torch {torch.__version__}, use_reentrant={use_reentrant}: "
          f"{len(wrong)} of {len(reference)} parameter gradients wrong without the guard")

    ckpt_guard.install("strict")
    model.zero_grad()
    with pytest.raises(CheckpointCompositionError) as info:
        _functional_step(model, _fresh_params(model), x)
    assert info.value.rule.id == "CKG101"
    # which tensors, from where, to where: the names functional_call's dict uses
    assert re.search(r"blocks\.\d\.norm1\.weight", str(info.value)), str(info.value)
    assert "functional_call #" in str(info.value) and "at the forward → the module's own tensor now" in str(info.value)

    with ckpt_guard.policy("fallback"), pytest.warns(CheckpointCompositionWarning):
        guarded = _functional_step(model, _fresh_params(model), x)
    for name in reference:
        torch.testing.assert_close(guarded[name], reference[name])


def test_strict_raises_before_the_recompute_runs():
    calls = []
    w = torch.randn(3, requires_grad=True)

    def block(t):
        calls.append(torch.get_default_dtype())
        return t * w

    x = torch.randn(3, requires_grad=True)
    for use_reentrant in (True, False):
        calls.clear()
        y = checkpoint(block, x, use_reentrant=use_reentrant)
        torch.set_default_dtype(torch.float64)
        try:
            with pytest.raises(CheckpointCompositionError, match="torch.float32 → torch.float64"):
                y.sum().backward()
        finally:
            torch.set_default_dtype(torch.float32)
        assert calls == [torch.float32]  # the forward only


def test_recompute_check_uses_the_forwards_policy_on_another_thread():
    """Backward (and so the recompute) runs where contextvars and threading.local don't reach."""
    ckpt_guard.install("off")
    torch.manual_seed(0)
    model = TinyTransformer(use_reentrant=False, depth=1)
    x = torch.randn(2, 5, 8)
    with ckpt_guard.policy("strict"):  # only the forward sees this scope
        loss = functional_call(model, _fresh_params(model), (x,))
    outcome = {}

    def backward():
        assert ckpt_guard.current_config() == "off"  # this thread sees the installed config
        try:
            loss.backward()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    assert isinstance(outcome.get("error"), CheckpointCompositionError)
    assert outcome["error"].rule.id == "CKG101"


def test_warn_on_another_thread_then_torch_behaviour():
    ckpt_guard.install("off")
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Noop(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with ckpt_guard.policy("warn"), Noop():
        y = checkpoint(lambda t: t.sin() * w, x, use_reentrant=False)
    caught = []

    def backward():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            y.sum().backward()
        caught.extend(record)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    ours = [w for w in caught if issubclass(w.category, CheckpointCompositionWarning)]  # torch 2.4 adds a FutureWarning
    assert [w.message.rule.id for w in ours] == ["CKG102"]
    assert "[Noop] → []" in str(ours[0].message)
    torch.testing.assert_close(w.grad, x.detach().sin())  # a no-op mode: torch's result is right


def test_nested_checkpoints_under_functional_call_fallback():
    class Nested(torch.nn.Module):
        def __init__(self, checkpointing=True):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
            self.ckpt = checkpoint if checkpointing else (lambda f, t, use_reentrant: f(t))

        def forward(self, x):
            inner = lambda t: torch.tanh(self.b(t))  # noqa: E731
            outer = lambda t: self.ckpt(inner, self.a(t), use_reentrant=False)  # noqa: E731
            return self.ckpt(outer, x, use_reentrant=False).sum()

    torch.manual_seed(0)
    model, plain = Nested(), Nested(checkpointing=False)
    plain.load_state_dict(model.state_dict())
    params = {k: (v.detach() * 1.1).requires_grad_() for k, v in model.named_parameters()}
    x = torch.randn(2, 3)
    reference = torch.autograd.grad(functional_call(plain, params, (x,)), list(params.values()))
    with ckpt_guard.policy("fallback"), pytest.warns(CheckpointCompositionWarning):
        loss = functional_call(model, params, (x,))
    grads = torch.autograd.grad(loss, list(params.values()))
    for g, r in zip(grads, reference):
        torch.testing.assert_close(g, r)


def test_backward_inside_functional_call_is_quiet():
    """functional_call still active at recompute: no drift, bitwise-equal gradients."""
    from torch.nn.utils.stateless import _reparametrize_module

    torch.manual_seed(0)
    model = TinyTransformer(use_reentrant=False, depth=1)
    x = torch.randn(2, 5, 8)
    results = []
    for with_guard in (False, True):
        if not with_guard:
            ckpt_guard.uninstall()
        else:
            ckpt_guard.install("strict")
        params = _fresh_params(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)
            with _reparametrize_module(model, params):
                model(x).backward()
        results.append([params[k].grad for k in sorted(params)])
    for raw, guarded in zip(*results):
        assert torch.equal(raw, guarded)


def test_recompute_message_names_each_calls_own_site():
    """The forward's call site is remembered per call, whatever way into checkpointing came before.

    The guard remembers where the user's frame sat on the last call (a cache
    for speed); alternating entry points, whose torch call chains differ in
    length, must still each name their own line.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)
    wrapped = checkpoint_wrapper(torch.nn.Linear(3, 3))
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    x = torch.randn(2, 3, requires_grad=True)
    lines = {}

    def direct():
        lines["direct"] = _line() + 1
        return checkpoint(linear, x, use_reentrant=False)

    def sequential():
        lines["sequential"] = _line() + 1
        return torch.utils.checkpoint.checkpoint_sequential(model, 2, x, use_reentrant=False)

    def through_wrapper():
        lines["through_wrapper"] = _line() + 1
        return wrapped(x)

    def helper_then_direct():
        return direct()  # one user frame more: the site is still direct's line

    def helper():
        lines["helper"] = _line() + 1
        return checkpoint(linear, x, use_reentrant=False)

    def mixed(kind):
        # one function that reaches checkpoint through checkpoint_sequential (one torch
        # frame more) and through a helper (one user frame more): same depth, same code
        if kind == "sequential":
            lines["mixed"] = _line() + 1
            return torch.utils.checkpoint.checkpoint_sequential(model, 2, x, use_reentrant=False)
        return helper()

    def mixed_sequential():
        return mixed("sequential")

    def mixed_helper():
        return mixed("helper")

    expected_site = {helper_then_direct: "direct", mixed_sequential: "mixed", mixed_helper: "helper"}
    ckpt_guard.install("warn")  # the forward's policy decides at the recompute
    order = (direct, sequential, through_wrapper, direct, helper_then_direct, sequential, direct,
             mixed_sequential, mixed_helper, mixed_sequential, mixed_helper)
    for forward in order:
        y = forward()
        torch.set_default_dtype(torch.float64)  # CKG105 at the recompute
        try:
            with pytest.warns(CheckpointCompositionWarning) as record:
                y.sum().backward()
        finally:
            torch.set_default_dtype(torch.float32)
        name = expected_site.get(forward, forward.__name__)
        expected = f"checkpoint called at: {__file__}:{lines[name]} in {name}"
        messages = [str(w.message) for w in record if issubclass(w.category, CheckpointCompositionWarning)]
        assert messages and all(expected in m for m in messages), (forward.__name__, expected, messages)


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_optimizer_step_on_a_captured_tensor_and_on_a_retained_graph():
    """CKG108 beyond the probe: a closure's captured parameter; a second backward after a step."""
    w = torch.randn(3, 3, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(2, 3, requires_grad=True)
    loss = checkpoint(lambda t: torch.tanh(t @ w), x, use_reentrant=False).sum()
    w.grad = torch.ones_like(w)
    optimizer.step()
    with pytest.raises(CheckpointCompositionError, match=r"changed since the forward: .*optimizer step.* → after optimizer step \d+") as info:
        loss.backward()
    assert info.value.rule.id == "CKG108"

    block = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    loss = checkpoint(block, x, use_reentrant=False).pow(2).sum()
    loss.backward(retain_graph=True)  # fine: nothing changed yet
    optimizer.step()
    with pytest.raises(CheckpointCompositionError) as info:
        loss.backward()  # recomputes with the stepped parameters
    assert info.value.rule.id == "CKG108"


def test_optimizer_step_on_a_partly_used_parent_fires_only_when_all_of_it_moved():
    """A closure over a parent module may use any part of it: CKG108 fires only when the step
    updated all of the parent's trainable parameters (one optimizer over the whole model)."""
    torch.manual_seed(0)
    parent = torch.nn.ModuleDict({"block": torch.nn.Linear(3, 3), "head": torch.nn.Linear(3, 1)})
    x = torch.randn(2, 3, requires_grad=True)

    def run(parameters):
        optimizer = torch.optim.SGD(parameters, lr=0.1)
        loss = checkpoint(lambda t: parent["block"](t), x, use_reentrant=False).pow(2).sum()
        for p in parent.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        loss.backward()

    with pytest.raises(CheckpointCompositionError) as info:
        run(parent.parameters())  # every parameter moved, whichever part the closure uses
    assert info.value.rule.id == "CKG108"
    run(parent["head"].parameters())  # only the head moved: unsure, so quiet


class _Config:
    """An object of the user's holding modules in a dict (a config, a registry), and a spare module
    the block never names (a trainer's discriminator, say)."""

    def __init__(self, layers, spare=None):
        self.layers, self.spare = layers, spare


class _Holder:
    """A trainer-like object: its block runs ``self.layer`` through a helper method (or a property);
    ``self.spare`` is never run by it."""

    def __init__(self, layer, spare):
        self.layer, self.spare = layer, spare

    def run(self, t):
        return torch.tanh(self._apply(t))

    def _apply(self, t):
        return self.layer(t)

    def __call__(self, t):
        return self.run(t)

    @property
    def main(self):
        return self.layer


class _Stages:
    """An object of the user's its block iterates (``for stage in stages``): ``__iter__`` yields the layer
    only; the spare is the object's too."""

    def __init__(self, layer, spare):
        self.layer, self.spare = layer, spare

    def __iter__(self):
        return iter([self.layer])


class _Pair(typing.NamedTuple):
    layer: torch.nn.Module
    spare: torch.nn.Module


class _AttrDict(dict):
    """A dict whose items read as attributes (``cfg.layer``), as config libraries make them."""

    def __getattr__(self, name):
        return self[name]


class _Lazy:
    """A descriptor of the user's: ``holder.main`` reads ``holder._layer``."""

    def __get__(self, holder, owner=None):
        return holder._layer


class _WithDescriptor:
    main = _Lazy()

    def __init__(self, layer, spare):
        self._layer, self.spare = layer, spare


def _apply_layer(holder, t):
    return holder.layer(t)


class _HandsItselfOn:
    """Its method hands ``self`` to a module-level helper, which reads ``self.layer``."""

    def __init__(self, layer, spare):
        self.layer, self.spare = layer, spare

    def run(self, t):
        return torch.tanh(_apply_layer(self, t))


class _Slots:
    __slots__ = ("layer", "spare")

    def __init__(self, layer, spare):
        self.layer, self.spare = layer, spare


def _run_config(config, t):
    return torch.tanh(config.layers["k"](t))


def _run_module(module, t):
    return module(t)


class _Gan(torch.nn.Module):
    """A module holding the generator ``G`` its block runs and a discriminator ``D`` it never does (a
    LightningModule's ``self.generator``)."""

    def __init__(self, G, D):
        super().__init__()
        self.G, self.D = G, D

    def generate(self, t):
        return torch.tanh(self.G(t))


class _ApplyTo(torch.nn.Module):
    """A module of the user's whose ``forward`` is handed an object and reads ``config.layer`` of it."""

    def forward(self, config, t):
        return config.layer(t)


def _reach(path: str, layer: torch.nn.Module, spare: torch.nn.Module):
    """A block reaching ``layer`` by ``path`` (what the walk must see for CKG108); where an object of the
    user's holds it, the object holds ``spare`` too, which the block never runs."""
    if path == "the module itself":
        return torch.nn.Sequential(layer, torch.nn.Tanh())  # (a Linear alone: its weight's gradient reads no weight)
    if path == "a partial of an object of the user's":
        return functools.partial(lambda config, t: torch.tanh(config.layers["k"](t)), _Config({"k": layer}, spare))
    if path == "a list in a list in a closure":
        nested = [[layer]]
        return lambda t: torch.tanh(nested[0][0](t))
    if path == "an object's dict in a closure":
        config = _Config({"k": layer}, spare)
        return lambda t: torch.tanh(config.layers["k"](t))
    if path == "an object's method":
        return _Holder(layer, spare).run
    if path == "a callable object":
        return _Holder(layer, spare)
    if path == "a callable object in a closure":
        holder = _Holder(layer, spare)
        return lambda t: holder(t)
    if path == "an object's property in a closure":
        holder = _Holder(layer, spare)
        return lambda t: torch.tanh(holder.main(t))
    if path == "an object in a namespace in a closure":
        outer = types.SimpleNamespace(inner=_Config({"k": layer}), spare=spare)
        return lambda t: torch.tanh(outer.inner.layers["k"](t))
    if path == "an object handed to a helper in a closure":
        config = _Config({"k": layer}, spare)
        return lambda t: _run_config(config, t)
    if path == "an object iterated in a closure":
        stages = _Stages(layer, spare)
        return lambda t: torch.tanh(sum(stage(t) for stage in stages))
    if path == "a NamedTuple in a closure":
        pair = _Pair(layer, spare)
        return lambda t: torch.tanh(pair.layer(t))
    if path == "an AttrDict in a closure":
        config = _AttrDict(layer=layer, spare=spare)
        return lambda t: torch.tanh(config.layer(t))
    if path == "a descriptor of the user's in a closure":
        holder = _WithDescriptor(layer, spare)
        return lambda t: torch.tanh(holder.main(t))
    if path == "a method handing its object to a helper, in a closure":
        holder = _HandsItselfOn(layer, spare)
        return lambda t: holder.run(t)
    if path == "the module's bound forward in a closure":
        forward = layer.forward
        return lambda t: torch.tanh(forward(t))
    if path == "a slot in a closure":
        slots = _Slots(layer, spare)
        return lambda t: torch.tanh(slots.layer(t))
    if path == "a helper function in a closure":
        def helper(t):
            return torch.tanh(layer(t))
        return lambda t: helper(t)
    if path == "a function an object holds, in a closure":
        holder = types.SimpleNamespace(fn=lambda t: layer(t), spare=spare)
        return lambda t: torch.tanh(holder.fn(t))
    if path == "a partial an object holds, in a closure":
        holder = types.SimpleNamespace(fn=functools.partial(_run_module, layer), spare=spare)
        return lambda t: torch.tanh(holder.fn(t))
    if path == "a class used as a namespace, in a closure":
        namespace = type("Layers", (), {"layer": layer, "spare": spare})
        return lambda t: torch.tanh(namespace.layer(t))
    if path == "a Python module's attribute, in a closure":
        models = types.ModuleType("user_models")
        models.layer, models.spare = layer, spare
        return lambda t: torch.tanh(models.layer(t))
    if path == "an attrgetter in a closure":
        get, config = operator.attrgetter("layer"), types.SimpleNamespace(layer=layer, spare=spare)
        return lambda t: torch.tanh(get(config)(t))
    if path == "an object handed to a module's forward, in a closure":
        apply, config = _ApplyTo(), types.SimpleNamespace(layer=layer, spare=spare)
        return lambda t: torch.tanh(apply(config, t))
    if path == "a submodule of a module in a closure":
        gan = _Gan(layer, spare)
        return lambda t: torch.tanh(gan.G(t))
    if path == "a module's own method":
        return _Gan(layer, spare).generate
    raise AssertionError(path)


REACH_PATHS = (
    "the module itself", "a partial of an object of the user's", "a list in a list in a closure",
    "an object's dict in a closure", "an object's method", "a callable object", "a callable object in a closure",
    "an object's property in a closure",
    "an object in a namespace in a closure", "an object handed to a helper in a closure", "an object iterated in a closure",
    "a slot in a closure", "a NamedTuple in a closure", "an AttrDict in a closure", "a descriptor of the user's in a closure",
    "a method handing its object to a helper, in a closure", "the module's bound forward in a closure",
    "a helper function in a closure", "a function an object holds, in a closure",
    "a partial an object holds, in a closure", "a class used as a namespace, in a closure",
    "a Python module's attribute, in a closure", "an attrgetter in a closure",
    "an object handed to a module's forward, in a closure", "a submodule of a module in a closure",
    "a module's own method",
)
#: where the direct view counts the spare too (conservative, documented in docs/limits.md): a dict whose
#: class reads items as attributes (``__getattr__``) makes every attribute, so every item, count
_COUNT_EVERY_ITEM = frozenset({"an AttrDict in a closure"})
#: where a module holding the spare is the block's too, used in part: CKG006 and CKG003 count every trainable
#: parameter of it (conservative, documented), so the block's layer frozen does not make them quiet
_COUNT_THE_PARENT = frozenset({"a submodule of a module in a closure", "a module's own method"})
#: the paths where an object of the user's holds the spare module too (a class or a Python module used as a
#: namespace holds it too, but is read by the names its code names there as well)
_HOLD_THE_SPARE = frozenset(REACH_PATHS) - {
    "the module itself", "a list in a list in a closure", "the module's bound forward in a closure",
    "a helper function in a closure", "a class used as a namespace, in a closure",
    "a Python module's attribute, in a closure"}


def _step_between_forward_and_backward(checkpoint, use_reentrant, path, stepped="the block's"):
    torch.manual_seed(0)
    layer, other = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double()
    # the reentrant checkpoint's output requires grad only through an input that does; then the plain
    # program's Linear saves its weight (for that input's gradient), and the step is autograd's error there
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=bool(use_reentrant))
    block = _reach(path, layer, other)  # (an object of the user's holds ``other`` too)
    optimizer = torch.optim.SGD((layer if stepped == "the block's" else other).parameters(), lr=0.5)
    loss = checkpoint(block, x, use_reentrant=use_reentrant).pow(2).sum()
    for p in (*layer.parameters(), *other.parameters()):
        p.grad = torch.ones_like(p)
    optimizer.step()  # between the forward and the backward: the recompute reads the stepped weights
    for p in layer.parameters():
        p.grad = None
    loss.backward()
    return [layer.weight.grad, layer.bias.grad]


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("path", REACH_PATHS)
def test_optimizer_step_is_seen_whichever_way_the_block_reaches_its_module(path, use_reentrant):
    """CKG108 reads the block's modules through its direct reach: a module in a list in a list was
    "unseen" (now seen), so the step went unblamed and torch's recompute returned gradients of the
    stepped weights (silently wrong).  Behind an object of the user's (``config.layers["k"]``) it was not
    seen either, until the direct view followed the attributes the block's code names."""
    probe = functools.partial(_step_between_forward_and_backward, path=path)
    raw = run_raw(probe, use_reentrant)  # raw torch: a number, from the stepped weights
    if use_reentrant:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            probe(no_checkpoint, use_reentrant)  # the plain program raises; raw torch's number is wrong
    else:
        assert not all_close(raw, probe(no_checkpoint, use_reentrant))
    for policy in ("strict", "fallback"):  # fallback cannot undo a step either: it raises
        with pytest.raises(CheckpointCompositionError) as info:
            run_guarded(probe, use_reentrant, policy)
        assert info.value.rule.id == "CKG108"
    # another module stepped: nothing the block reads changed, no rule fires, the numbers are the plain ones
    # (each run steps and differentiates fresh modules, seeded alike)
    quiet = functools.partial(probe, stepped="another module's")
    if path in _COUNT_EVERY_ITEM:  # conservative (documented): the spare counts, so its step is blamed
        with pytest.raises(CheckpointCompositionError) as info:
            run_guarded(quiet, use_reentrant, "strict")
        assert info.value.rule.id == "CKG108"
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        assert_all_close(run_guarded(quiet, use_reentrant, "strict"), quiet(no_checkpoint, use_reentrant))


def _eval_between_forward_and_backward(checkpoint, use_reentrant, path, switched="the block's"):
    torch.manual_seed(0)
    layer, other = (torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5)).double() for _ in range(2))
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    block = _reach(path, layer, other)
    loss = checkpoint(block, x, use_reentrant=use_reentrant).pow(2).sum()
    # between the forward and the backward: torch's recompute would draw no dropout mask
    (layer if switched == "the block's" else other).eval()
    loss.backward()
    return [layer[0].weight.grad, x.grad]


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("path", REACH_PATHS)
def test_a_train_eval_switch_is_replayed_by_fallback_whichever_way_the_block_reaches_its_module(path, use_reentrant):
    """CKG106: strict raises; fallback recomputes each module in the mode the forward had.  Through a partial
    binding an object of the user's, fallback found no module to put back (its roots were read from the
    partial's function, the snapshot from the partial) and raised where it can replay."""
    probe = functools.partial(_eval_between_forward_and_backward, path=path)
    reference = probe(no_checkpoint, use_reentrant)
    try:  # raw torch: the eval-mode recompute's numbers, or (non-reentrant) its count of saved tensors differs
        raw = run_raw(probe, use_reentrant)
    except torch.utils.checkpoint.CheckpointError:
        raw = None
    assert raw is None or not all_close(raw, reference)
    with pytest.raises(CheckpointCompositionError) as info:
        run_guarded(probe, use_reentrant, "strict")
    assert info.value.rule.id == "CKG106"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)  # fallback says what it replays
        assert_all_close(run_guarded(probe, use_reentrant, "fallback"), reference)
    # a module the block never runs switched: quiet where the block cannot reach it; where an object of the
    # user's holds it, CKG106 counts it (conservative: the object may be handed to code that runs it), and
    # fallback's replay of the forward's modes gives the plain numbers
    other = functools.partial(probe, switched="another module's")
    if path in _HOLD_THE_SPARE:
        with pytest.raises(CheckpointCompositionError) as info:
            run_guarded(other, use_reentrant, "strict")
        assert info.value.rule.id == "CKG106"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointCompositionWarning)
            assert_all_close(run_guarded(other, use_reentrant, "fallback"), other(no_checkpoint, use_reentrant))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)
            assert_all_close(run_guarded(other, use_reentrant, "strict"), other(no_checkpoint, use_reentrant))


def _reentrant_without_an_input_requiring_grad(checkpoint, use_reentrant, path, trainable=True):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3).double().requires_grad_(trainable)
    spare = torch.nn.Linear(3, 3).double()  # trainable, held by an object of the user's, never run by the block
    x = torch.randn(2, 3, dtype=torch.float64)  # no input requires grad: the reentrant variant tracks nothing
    out = checkpoint(_reach(path, layer, spare), x, use_reentrant=use_reentrant)
    if not out.requires_grad:
        return None  # no gradient reaches the layer
    out.pow(2).sum().backward()
    return [layer.weight.grad, layer.bias.grad]


@pytest.mark.parametrize("path", REACH_PATHS)
def test_a_reentrant_checkpoint_whose_block_trains_is_seen_whichever_way_it_reaches_its_module(path):
    """CKG006 (a call-time rule): a reentrant checkpoint with no input requiring grad gives the block's
    parameters no gradient (torch only warns).  A list in a list, and a module behind an object of the
    user's (the attributes the block's code names), are seen now."""
    probe = functools.partial(_reentrant_without_an_input_requiring_grad, path=path)
    reference = probe(no_checkpoint, True)
    assert reference is not None and run_raw(probe, True) is None  # raw torch: no gradient at all
    with pytest.raises(CheckpointCompositionError) as info:
        run_guarded(probe, True, "strict")
    assert info.value.rule.id == "CKG006"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        assert_all_close(run_guarded(probe, True, "fallback"), reference)
    # nothing trains (a frozen layer): no rule fires, and the result is the plain one (no gradient)
    _frozen_block_is_quiet(probe, path, True, "CKG006")


def _frozen_block_is_quiet(probe, path, use_reentrant, rule):
    """With the block's layer frozen (its object's spare still trains), strict is quiet and the result is the
    plain one (no gradient); where the direct view counts every item, ``rule`` fires (conservative, documented)."""
    frozen = functools.partial(probe, trainable=False)
    if path in _COUNT_EVERY_ITEM | _COUNT_THE_PARENT:
        with pytest.raises(CheckpointCompositionError, match=rule):
            run_guarded(frozen, use_reentrant, "strict")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        assert run_guarded(frozen, use_reentrant, "strict") is None and frozen(no_checkpoint, use_reentrant) is None


def _vmapped_then_backward(checkpoint, use_reentrant, path, trainable=True):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3).double().requires_grad_(trainable)
    spare = torch.nn.Linear(3, 3).double()  # trainable, held by an object of the user's, never run by the block
    x = torch.randn(4, 2, 3, dtype=torch.float64)  # no input requires grad: only the parameters carry history
    block = _reach(path, layer, spare)
    out = torch.func.vmap(lambda t: checkpoint(block, t, use_reentrant=use_reentrant))(x)
    if not out.requires_grad:
        return None
    out.pow(2).sum().backward()  # outside the vmap: torch's recompute would run the vmapped block outside it
    return [layer.weight.grad, layer.bias.grad]


@pytest.mark.parametrize("path", REACH_PATHS)
def test_a_vmapped_checkpoint_whose_block_trains_is_seen_whichever_way_it_reaches_its_module(path):
    """CKG003 (a call-time rule, from 2.12; CKG007 before, whatever the block holds): vmap over a
    non-reentrant checkpoint whose block trains, then .backward() outside it, is torch's error; the
    guard must count the block's parameters however it reaches its module, and only those."""
    probe = functools.partial(_vmapped_then_backward, path=path)
    reference = probe(no_checkpoint, False)
    assert reference is not None
    rule = "CKG003" if rule_by_id("CKG003").holds_on(installed()) else "CKG007"
    with pytest.raises(RuntimeError):  # raw torch: escaped from the vmap (or, before 2.12, refused at the call)
        run_raw(probe, False)
    with pytest.raises(CheckpointCompositionError) as info:
        run_guarded(probe, False, "strict")
    assert info.value.rule.id == rule
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        assert_all_close(run_guarded(probe, False, "fallback"), reference)
    if rule == "CKG003":  # nothing the block runs trains (its object's spare module does): quiet, no history
        _frozen_block_is_quiet(probe, path, False, "CKG003")


class _GanTrainer:
    def __init__(self):
        self.G, self.D = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 1).double()

    def generate(self, z):
        return torch.tanh(self.G(z))


class _GanTrainerWithNets:
    """A trainer keeping its networks in a dict (``self.nets["G"]``) or a list (``self.nets[0]``)."""

    def __init__(self, nets):
        self.nets = nets

    def generate_from_dict(self, z):
        return torch.tanh(self.nets["G"](z))

    def generate_from_list(self, z):
        return torch.tanh(self.nets[0](z))


def test_the_items_a_block_reads_of_an_objects_container():
    """Behind an object of the user's, a dict or list its block subscripts with constants counts only the items
    read; any other way of reading items (a computed key, a loop, ``.values()``, a slice, ``sum`` over it)
    counts every item."""
    from ckpt_guard._state.block_reads import reads_of

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    config, key = _Config({"a": a, "b": b}), "a"
    blocks = {
        'config.layers["a"]': (lambda t: config.layers["a"](t), {a}),
        "config.layers[key]": (lambda t: config.layers[key](t), {a, b}),
        "a loop": (lambda t: [m(t) for m in config.layers.values()][0], {a, b}),
        "sum over it": (lambda t: sum(map(lambda m: m(t), config.layers.values())), {a, b}),
    }
    listed = _Config([a, b])
    blocks["listed.layers[-1]"] = (lambda t: listed.layers[-1](t), {b})
    blocks["listed.layers[:1]"] = (lambda t: listed.layers[:1][0](t), {a, b})
    blocks["sum(listed.layers)"] = (lambda t: sum(listed.layers, t), {a, b})  # (no subscript: any item)
    for name, (block, expected) in blocks.items():
        assert set(reads_of(block).modules) == expected, name


class _Runs:
    """An object whose ``run`` reads ``self.layer`` (and holds ``self.spare``)."""

    def __init__(self, layer, spare):
        self.layer, self.spare = layer, spare

    def run(self, t):
        return self.layer(t)


def test_what_a_block_reads_through_operator_getters():
    """An ``operator.attrgetter`` or ``methodcaller`` held by the block reads the attributes or the method it
    names (dotted names too); one the block makes itself names them only as strings: every attribute counts."""
    from ckpt_guard._state.block_reads import reads_of

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    holder = _Runs(a, b)
    outer = types.SimpleNamespace(inner=holder, spare=b)
    get, get_dotted = operator.attrgetter("layer"), operator.attrgetter("inner.layer")
    call, call_with = operator.methodcaller("run", torch.ones(2)), operator.methodcaller("run", t=torch.ones(2))
    blocks = {
        "a held attrgetter": (lambda t: get(holder)(t), {a}),
        "a held dotted attrgetter": (lambda t: get_dotted(outer)(t), {a}),
        "a held methodcaller": (lambda t: call(holder) + t, {a}),
        "a held methodcaller with keywords": (lambda t: call_with(holder) + t, {a}),
        "an attrgetter made inline": (lambda t: operator.attrgetter("layer")(holder)(t), {a, b}),
        "a methodcaller made inline": (lambda t: operator.methodcaller("run", t)(holder), {a, b}),
    }
    for name, (block, expected) in blocks.items():
        assert set(reads_of(block).modules) == expected, name


def test_a_namespace_is_read_by_the_names_its_code_names():
    """A class or a Python module of the user's used as a namespace counts by the attributes the code holding it
    names; a computed read elsewhere in that code (``getattr(torch, name)``) is not one of the namespace's (a
    review found it made a module of thousands of names read whole on every call, and blamed all it holds)."""
    from ckpt_guard._state.block_reads import reads_of
    from ckpt_guard._state.closures import reached_modules

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    models = types.ModuleType("user_models")
    models.layer, models.spare = a, b
    layers = type("Layers", (), {"layer": a, "spare": b})
    blocks = {
        "a Python module's attribute": lambda t: models.layer(t),
        "a class's attribute": lambda t: layers.layer(t),
        "getattr elsewhere in the block": lambda t: getattr(torch, "tanh")(models.layer(t)),
        "getattr elsewhere, with a class": lambda t: getattr(t, "scale", 1.0) * layers.layer(t),
    }
    for name, block in blocks.items():
        assert set(reads_of(block).modules) == {a}, name
        assert set(reached_modules(block)) == {a}, name


@pytest.mark.parametrize("how", ["the trainer's method", "a closure calling it"])
@pytest.mark.parametrize("nets", ["a dict", "a list"])
@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_a_discriminator_step_is_not_the_generator_blocks_drift_whatever_holds_the_nets(nets, policy, how):
    """The GAN step again, the trainer holding G and D in a dict or a list that its block subscripts with a
    constant: only the item read counts (a review found CKG108 raising here once the direct view looked
    behind objects).  Stepping G is still caught."""

    def step(checkpoint, use_reentrant, stepped="D"):
        torch.manual_seed(0)
        G, D = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 1).double()
        trainer = _GanTrainerWithNets({"G": G, "D": D} if nets == "a dict" else [G, D])
        method = trainer.generate_from_dict if nets == "a dict" else trainer.generate_from_list
        run = method if how == "the trainer's method" else (lambda z: method(z))  # (the closure subscripts nothing)
        optimizer = torch.optim.SGD((D if stepped == "D" else G).parameters(), lr=0.1)
        fake = checkpoint(run, torch.randn(4, 3, dtype=torch.float64), use_reentrant=use_reentrant)
        for p in (*G.parameters(), *D.parameters()):
            p.grad = torch.ones_like(p)
        optimizer.step()
        G.zero_grad()
        (-D(fake).mean()).backward()
        return [G.weight.grad, G.bias.grad]

    reference = step(no_checkpoint, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        assert_all_close(run_guarded(step, False, policy), reference)
    with pytest.raises(CheckpointCompositionError) as info:  # G stepped: the block's own module moved
        run_guarded(functools.partial(step, stepped="G"), False, policy)
    assert info.value.rule.id == "CKG108"


@pytest.mark.parametrize("block", ["a closure over the trainer", "the trainer's method", "a partial of the trainer"])
@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_a_discriminator_step_is_not_the_generator_blocks_drift(block, policy):
    """A GAN step: the generator's checkpointed block, reached through a trainer object that holds the
    discriminator too; the discriminator steps between the generator's forward and backward.  Nothing
    the block reads moved: no rule fires, the gradients are the plain program's (a review found CKG108
    raising here, under fallback too, once it counted what lies behind objects)."""

    def step(checkpoint, use_reentrant):
        torch.manual_seed(0)
        trainer = _GanTrainer()
        run = {
            "a closure over the trainer": lambda z: trainer.generate(z), "the trainer's method": trainer.generate,
            "a partial of the trainer": functools.partial(_GanTrainer.generate, trainer),
        }[block]
        d_optimizer = torch.optim.SGD(trainer.D.parameters(), lr=0.1)
        fake = checkpoint(run, torch.randn(4, 3, dtype=torch.float64), use_reentrant=use_reentrant)
        trainer.D(fake.detach()).mean().backward()
        d_optimizer.step()  # the discriminator moves, all of it
        trainer.D.zero_grad()
        (-trainer.D(fake).mean()).backward()
        return [trainer.G.weight.grad, trainer.G.bias.grad]

    reference = step(no_checkpoint, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        assert_all_close(run_guarded(step, False, policy), reference)


def test_optimizer_hook_never_breaks_a_step():
    """An optimizer whose param_groups the hook cannot read still steps; fused steps count."""

    class Odd(torch.optim.Optimizer):
        def __init__(self):
            super().__init__([torch.zeros(1, requires_grad=True)], {})
            self.param_groups.append({"lr": 0.1})  # no "params"
            self.param_groups[0]["params"].append(0.5)  # not a tensor

        def step(self, closure=None):
            return None

    Odd().step()  # no KeyError / AttributeError from the guard's hook

    block = torch.nn.Linear(3, 3)
    optimizer = torch.optim.Adam(block.parameters(), lr=0.1, fused=True)
    loss = checkpoint(block, torch.randn(2, 3, requires_grad=True), use_reentrant=False).sum()
    for p in block.parameters():
        p.grad = torch.ones_like(p)
    before = [p._version for p in block.parameters()]
    optimizer.step()
    assert [p._version for p in block.parameters()] == before  # the premise: fused steps leave versions
    with pytest.raises(CheckpointCompositionError) as info:
        loss.backward()
    assert info.value.rule.id == "CKG108"


# functionalize(jvp(functionalize(f))) around a non-reentrant checkpoint, backward
# outside: torch 2.13 crashes the interpreter (SIGSEGV) in the recompute.  Found by a
# fuzz campaign (which now leaves this shape out, see fuzz_compositions.raw_crashes).
_SEGFAULT_PROGRAM = """
import json, sys
import torch
from torch.func import functionalize, jvp
from torch.utils.checkpoint import checkpoint
import ckpt_guard
mode = sys.argv[1]
if mode != "raw":
    ckpt_guard.install(mode)
torch.manual_seed(0)
block = torch.nn.Linear(3, 3)
x = torch.randn(3, requires_grad=True)
def middle(t):
    out, tangent = jvp(functionalize(lambda u: checkpoint(block, u, use_reentrant=False)),
                       (t,), (torch.ones_like(t),))
    return out + tangent
try:
    functionalize(middle)(x).sum().backward()
    print("gradient", json.dumps(x.grad.tolist()))
except ckpt_guard.CheckpointCompositionError as exc:
    print("raised", exc.rule.id)
"""


# The same composition where torch itself raises in the recompute (a context_fn
# whose recompute context refuses): how the interpreter exits after an error there.
_RECOMPUTE_ERROR_PROGRAM = """
import contextlib
import torch
from torch.func import functionalize, jvp
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
block = torch.nn.Linear(3, 3)
x = torch.randn(3, requires_grad=True)
@contextlib.contextmanager
def refuse():
    raise KeyError("recompute refused")
    yield
def middle(t):
    run = lambda u: checkpoint(block, u, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), refuse()))
    out, tangent = jvp(functionalize(run), (t,), (torch.ones_like(t),))
    return out + tangent
try:
    functionalize(middle)(x).sum().backward()
except KeyError:
    print("raised KeyError", flush=True)
"""


def _run_segfault_program(mode: str, program: str = _SEGFAULT_PROGRAM):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", program, mode], capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(
    not rule_by_id("CKG104").holds_on(installed()),
    reason=f"torch {torch.__version__} refuses functionalize over non-reentrant checkpoint at the call "
    "(CKG007, in test_rules.py): no recompute, no crash",
)
def test_torch_segfault_under_functionalize_jvp_becomes_ckg104():
    import json
    import signal

    # The crash is a SIGSEGV; on Python 3.13 it can surface as an abort while the
    # interpreter tears down ("Fatal Python error: gilstate_tss_set").
    crashed = (-signal.SIGSEGV, -signal.SIGABRT)
    raw = _run_segfault_program("raw")
    assert raw.returncode in crashed, (
        f"torch {torch.__version__} no longer crashes here (rc {raw.returncode}): "
        f"update the CHANGELOG entry\n{raw.stdout}{raw.stderr[-1500:]}"
    )
    strict = _run_segfault_program("strict")
    assert strict.stdout.strip() == "raised CKG104", strict.stderr[-1500:]
    if strict.returncode != 0:
        # Any error raised in this recompute, torch's own included, can leave torch
        # state that aborts the interpreter at exit (seen with Python 3.13 and torch
        # 2.15): accepted only where torch's own error does exactly the same.
        torchs_own = _run_segfault_program("raw", _RECOMPUTE_ERROR_PROGRAM)
        assert torchs_own.stdout.strip() == "raised KeyError", torchs_own.stderr[-1500:]
        assert strict.returncode == torchs_own.returncode == -signal.SIGABRT, (strict.stderr[-1500:], torchs_own.stderr[-1500:])
        assert "finalizing" in strict.stderr and "finalizing" in torchs_own.stderr
    warn = _run_segfault_program("warn")  # warns, then does exactly what torch does
    assert warn.returncode in crashed and "[CKG104]" in warn.stderr, warn.stderr[-1500:]
    fallback = _run_segfault_program("fallback")  # anticipated at call time: no checkpoint
    assert fallback.returncode == 0 and fallback.stdout.startswith("gradient"), fallback.stderr[-1500:]

    torch.manual_seed(0)  # the reference: the same program without checkpointing
    block = torch.nn.Linear(3, 3)
    x = torch.randn(3, requires_grad=True)

    def middle(t):
        out, tangent = torch.func.jvp(torch.func.functionalize(block), (t,), (torch.ones_like(t),))
        return out + tangent

    torch.func.functionalize(middle)(x).sum().backward()
    got = torch.tensor(json.loads(fallback.stdout.split(" ", 1)[1]))
    torch.testing.assert_close(got, x.grad)


def test_optimizer_step_blamed_only_for_what_it_changed():
    """CKG108 blames a step only for what that step changed, not for an EMA swap made
    meanwhile. (A partial binding a GAN parent: composition gan-parent-method.)"""
    torch.manual_seed(0)
    generator, discriminator = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    z = torch.randn(2, 3, requires_grad=True)

    # An EMA-style swap of the generator's weights and back, plus an unrelated step in between.
    fake = checkpoint(generator, z, use_reentrant=False)
    backup = [p.detach().clone() for p in generator.parameters()]
    with torch.no_grad():
        for p in generator.parameters():
            p.mul_(0.5)  # "load the EMA weights" (bumps the versions)
    discriminator(torch.randn(2, 3)).sum().backward()
    d_optimizer.step()
    with torch.no_grad():
        for p, b in zip(generator.parameters(), backup):
            p.copy_(b)  # restore: values as in the forward
    fake.sum().backward()  # quiet: the step did not touch the generator (strict would raise)


# --------------------------------------------------------------------------
# MAML (a new user's report): the common step is quiet; second-order says what changed


class _Learner(torch.nn.Module):
    def __init__(self, checkpointing=True):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 1)
        self.checkpointing = checkpointing

    def forward(self, x):
        h = checkpoint(self.body, x, use_reentrant=False) if self.checkpointing else self.body(x)
        return self.head(torch.tanh(h)).pow(2).mean()


def test_maml_step_with_the_modules_own_parameters_is_quiet():
    """functional_call(net, dict(net.named_parameters()), x), gradient after the call returned:
    the recompute reads the very tensors the forward read, so nothing fires and fallback keeps
    checkpointing (both did fire before: CKG101 on the mere existence of the swap)."""
    torch.manual_seed(0)
    net = _Learner()
    x = torch.randn(5, 4)

    def step():
        loss = functional_call(net, dict(net.named_parameters()), (x,))
        return torch.autograd.grad(loss, list(net.parameters()))

    raw = run_raw(lambda ckpt, ur: step(), False)
    for policy in ("strict", "fallback"):
        with ckpt_guard.policy(policy), ckpt_guard.record() as events:
            guarded = step()
        assert events == [], policy
        for g, r in zip(guarded, raw):
            assert torch.equal(g, r)


def _second_order_maml(model, x, inner_lr=0.1):
    """Adapt on x (create_graph), then the outer loss of the adapted weights; meta-gradients.

    Taken the way CKG101's remedy says (the meta-gradient computed while a
    functional_call of the model is still active): not enough here, as the
    outer step's blocks ran under another one (the adapted weights).
    """
    params = {k: v * 1 for k, v in model.named_parameters()}  # the meta-parameters, as tensors of their own
    with torch.nn.utils.stateless._reparametrize_module(model, params):  # what functional_call does
        inner = model(x)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        adapted = {k: v - inner_lr * g for (k, v), g in zip(params.items(), grads)}
        outer = functional_call(model, adapted, (x * 0.5,))
        return torch.autograd.grad(outer, list(model.parameters()))


def test_second_order_maml_says_which_tensors_changed_and_what_fits():
    torch.manual_seed(0)
    net, plain = _Learner(), _Learner(checkpointing=False)
    plain.load_state_dict(net.state_dict())
    x = torch.randn(5, 4)
    reference = _second_order_maml(plain, x)
    raw = run_raw(lambda ckpt, ur: _second_order_maml(net, x), False)
    assert not all(torch.allclose(r, e, atol=1e-5) for r, e in zip(raw, reference))  # silently off without the guard
    with pytest.raises(CheckpointCompositionError) as info:
        _second_order_maml(net, x)
    message = str(info.value)
    assert info.value.rule.id == "CKG101"
    change = next(line for line in message.splitlines() if "changed since the forward:" in line)
    assert "body.0.weight" in change and "functional_call #" in change, change
    assert "functional_call active → functional_call active" not in message
    assert "runs under another functional_call than the forward" in message
    assert "call .backward() (or torch.autograd.grad) while the functional_call is still active" not in message
    with ckpt_guard.policy("fallback"), pytest.warns(CheckpointCompositionWarning):
        guarded = _second_order_maml(net, x)
    for g, e in zip(guarded, reference):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_rebound_rnn_weight_is_replayed_through_its_flat_weights(kind):
    """CKG110 under fallback for an RNN, whose forward reads its own ``_flat_weights`` list, not the attribute."""

    def probe(ckpt, use_reentrant):
        torch.manual_seed(0)
        rnn = getattr(torch.nn, kind)(4, 4)
        x = torch.randn(3, 2, 4, requires_grad=True)
        old = rnn.weight_hh_l0
        out = ckpt(rnn, x, use_reentrant=use_reentrant)[0].pow(2).sum()
        del rnn.weight_hh_l0
        rnn.weight_hh_l0 = (old * 3).detach()  # re-bound (a plain tensor now), not updated in place
        return torch.autograd.grad(out, [old, x])

    reference = probe(no_checkpoint, False)
    try:  # torch alone recomputes with the new weight: wrong numbers, or a count of saved tensors off
        assert not all_close(run_raw(probe, False), reference)
    except torch.utils.checkpoint.CheckpointError:
        pass
    with pytest.warns(CheckpointCompositionWarning, match="CKG110"):
        assert_all_close(run_guarded(probe, False, "fallback"), reference)


def test_a_rebound_weight_of_a_module_with_its_own_setattr_is_not_replayed():
    """A class whose ``__setattr__`` may keep its own view of the tensor: binding the forward's tensor
    for the recompute would not reach that view, so fallback raises at the recompute, as strict. (Only
    higher's patched modules, known to bind in their forward, make fallback skip checkpointing at the
    call: a class like this one, Opacus' DPLSTM, torchopt's MetaGradientModule stays checkpointed.)"""

    class Cached(torch.nn.Linear):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "weight":
                super().__setattr__("_cached", value)

        def forward(self, x):
            return torch.nn.functional.linear(x, self._cached, self.bias)

    def probe(ckpt, use_reentrant):
        torch.manual_seed(0)
        lin = Cached(3, 3)
        x = torch.randn(2, 3, requires_grad=True)
        old = lin.weight
        out = ckpt(lin, x, use_reentrant=use_reentrant).pow(2).sum()
        lin.weight = torch.nn.Parameter(old.detach() * 3)
        return torch.autograd.grad(out, [old, x])

    reference = probe(no_checkpoint, False)
    try:  # torch alone recomputes with the new weight (or trips its saved-tensor check)
        assert not all_close(run_raw(probe, False), reference)
    except torch.utils.checkpoint.CheckpointError:
        pass
    for policy in ("strict", "fallback"):
        with pytest.raises(CheckpointCompositionError, match="CKG110"):
            run_guarded(probe, False, policy)


def test_a_module_with_its_own_setattr_and_no_re_bind_stays_checkpointed_under_fallback():
    """Review of e2fd73d: fallback ran every class with a ``__setattr__`` of its own without
    checkpointing (Opacus' DPLSTM among them). Nothing re-bound: silent, checkpointed, bitwise torch's."""

    class Renaming(torch.nn.Linear):  # the shape of Opacus' RenameParamsMixin
        def __setattr__(self, name, value):
            super().__setattr__(name, value)

    def probe(ckpt, use_reentrant):
        torch.manual_seed(0)
        lin = Renaming(3, 3)
        x = torch.randn(2, 3, requires_grad=True)
        out = ckpt(lin, x, use_reentrant=use_reentrant).pow(2).sum()
        return torch.autograd.grad(out, [lin.weight, x])

    raw = run_raw(probe, False)
    with ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        guarded = run_guarded(probe, False, "fallback")
    assert list(events) == []
    for g, r in zip(guarded, raw):
        assert torch.equal(g, r)


# --------------------------------------------------------------------------
# CKG102 / CKG103 under fallback: no replay of a user mode can be right in general


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("backward", ["outside the mode", "inside the mode", "under another Noise"])
def test_fallback_runs_blocks_under_a_user_mode_plainly(backward, use_reentrant):
    """A mode carries state a recompute cannot replay (its own generator, a counter, another
    instance of its class around the backward): fallback runs the block without checkpointing, so
    the gradients *and the mode's state* equal those without checkpointing. Pushing the forward's
    mode back for the recompute (tried, reverted) drew the mode's next noise: silently wrong."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Noise(TorchDispatchMode):
        def __init__(self, seed):
            super().__init__()
            self.generator, self.calls = torch.Generator().manual_seed(seed), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.sin.default:
                self.calls += 1
                out = out + torch.rand(out.shape, generator=self.generator, dtype=out.dtype)
            return out

    def program(ckpt):
        x = torch.linspace(0.1, 1.0, 4, dtype=torch.float64, requires_grad=True)
        w = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        mode = Noise(0)
        with mode:
            y = ckpt(lambda t: torch.sin(t) * w, x)
            if backward == "inside the mode":
                y.sum().backward()
        if backward != "inside the mode":
            with Noise(1) if backward == "under another Noise" else contextlib.nullcontext():
                y.sum().backward()
        return w.grad, x.grad, torch.tensor(float(mode.calls)), torch.rand(1, generator=mode.generator)

    reference = program(lambda f, t: f(t))
    ckpt_guard.install("fallback")
    with pytest.warns(CheckpointCompositionWarning, match="CKG102"):
        got = program(lambda f, t: checkpoint(f, t, use_reentrant=use_reentrant))
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("recompute", ["nothing", "the mode again"])
def test_a_user_context_fn_does_not_hide_a_mode_missing_at_recompute(recompute):
    """A context_fn may add modes for the recompute (no alarm then); one that does not re-enter the
    forward's mode leaves it missing: CKG102 under strict (before: torch's wrong gradient, silently)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class DoubleSin(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 2 if func is torch.ops.aten.sin.default else out

    def context_fn():
        return contextlib.nullcontext(), (DoubleSin() if recompute == "the mode again" else contextlib.nullcontext())

    def program(ckpt):
        x = torch.linspace(0.1, 1.0, 4, dtype=torch.float64, requires_grad=True)
        w = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        with DoubleSin():
            y = ckpt(lambda t: torch.sin(t) * w, x)
        y.sum().backward()
        return w.grad, x.grad

    reference = program(lambda f, t: f(t))
    guarded = lambda: program(lambda f, t: checkpoint(f, t, use_reentrant=False, context_fn=context_fn))  # noqa: E731
    if recompute == "nothing":
        with pytest.raises(CheckpointCompositionError, match=r"CKG102[\s\S]*\[DoubleSin\] → \[\]"):
            guarded()
    else:
        for g, r in zip(guarded(), reference):
            torch.testing.assert_close(g, r)


# --------------------------------------------------------------------------
# CKG114: a reentrant checkpoint under .backward(create_graph=True)


def _penalty_step(use_reentrant, nested: bool = False, create_graph: bool = True, retain_graph: bool = False):
    """A gradient penalty through a residual pair of blocks (the inner one nested in the outer, or not)."""
    torch.manual_seed(0)
    a = torch.randn(4, requires_grad=True)
    w, v = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)

    def inner(h):
        return torch.tanh(h @ v)

    def outer(h):
        h = torch.tanh(h @ w)
        return checkpoint(inner, h, use_reentrant=use_reentrant) if nested and use_reentrant is not None else inner(h)

    ckpt = no_checkpoint if use_reentrant is None else checkpoint
    kwargs = {} if use_reentrant is None else {"use_reentrant": use_reentrant}
    y = ckpt(outer, x * a, **kwargs).pow(2).sum()
    torch.autograd.backward(y, create_graph=create_graph, retain_graph=retain_graph or None)
    first = [t.grad.detach().clone() for t in (x, a, w, v)]
    if not create_graph:
        return first
    penalty = x.grad.pow(2).sum()
    for t in (x, a, w, v):
        t.grad = None
    penalty.backward()
    return [*first, *(torch.zeros_like(t) if t.grad is None else t.grad for t in (x, a, w, v))]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_through_a_reentrant_checkpoint_is_caught_once_even_when_nested():
    """Strict raises (CKG114); warn warns once, for the outer block only (the inner one is recomputed
    by torch's own graph-free backward, as without the guard), then matches raw torch bitwise."""
    reference = _penalty_step(None)
    with pytest.raises(CheckpointCompositionError, match=r"create_graph=True") as info:
        _penalty_step(True, nested=True)
    assert info.value.rule.id == "CKG114"
    ckpt_guard.uninstall()
    raw = _penalty_step(True, nested=True)
    assert not all_close(raw, reference)  # the symptom: torch drops the second-order terms
    ckpt_guard.install("warn")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warned = _penalty_step(True, nested=True)
    ids = [w.message.rule.id for w in record if issubclass(w.category, CheckpointCompositionWarning)]
    assert ids == ["CKG114"]
    assert all(torch.equal(a, b) for a, b in zip(warned, raw))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("case", ["non-reentrant", "retain_graph only", "first order"])
def test_create_graph_rule_stays_quiet_where_torch_is_right(case):
    """Non-reentrant under create_graph=True, and reentrant without it (retain_graph=True alone
    keeps a graph but builds none): no rule fires, and the results are raw torch's, bitwise."""
    use_reentrant = case != "non-reentrant"
    create_graph = case == "non-reentrant"
    retain_graph = case == "retain_graph only"
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        guarded = _penalty_step(use_reentrant, nested=True, create_graph=create_graph, retain_graph=retain_graph)
    ckpt_guard.uninstall()
    raw = _penalty_step(use_reentrant, nested=True, create_graph=create_graph, retain_graph=retain_graph)
    assert all(torch.equal(a, b) for a, b in zip(guarded, raw))
    assert_all_close(guarded, _penalty_step(None, create_graph=create_graph, retain_graph=retain_graph))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_rule_is_about_the_reentrant_block_only():
    """A reentrant block inside a non-reentrant one: the outer recompute starts inside the inner
    block's reentrant backward; CKG114 is about the reentrant block alone (a review saw it blame
    the non-reentrant one too, and raise for it when the inner one was exempted)."""
    def outer_step():
        torch.manual_seed(0)
        w, v = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        x = torch.randn(3, 4, requires_grad=True)

        def outer(h):
            h = torch.tanh(h @ w)
            with ckpt_guard.policy("strict", rules={"CKG114": "off"}) if exempt else contextlib.nullcontext():
                return checkpoint(lambda u: torch.tanh(u @ v), h, use_reentrant=True)

        y = checkpoint(outer, x * 2, use_reentrant=False).pow(2).sum()
        torch.autograd.backward(y, create_graph=True)
        return [t.grad.detach().clone() for t in (x, w, v)]

    ckpt_guard.install("warn")
    exempt = False
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        outer_step()
    blamed = [
        line.strip() for w in record if issubclass(w.category, CheckpointCompositionWarning)
        for line in str(w.message).splitlines() if line.strip().startswith("variant:")
    ]
    assert len(blamed) == 1 and blamed[0].startswith("variant: reentrant"), blamed
    ckpt_guard.install("strict")
    exempt = True
    outer_step()  # the reentrant block exempted: nothing else to raise for


def test_autograd_grad_through_a_reentrant_checkpoint_keeps_torchs_own_error():
    """torch refuses torch.autograd.grad through a reentrant checkpoint before any recompute: that
    error passes through untouched (CKG114 is about .backward(create_graph=True), which it allows)."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = checkpoint(lambda h: torch.tanh(h @ w), x, use_reentrant=True).sum()
    with pytest.raises(RuntimeError, match=r"\.grad\(\)") as info:
        torch.autograd.grad(y, x, create_graph=True)
    assert not isinstance(info.value, CheckpointCompositionError)


def test_uninstall_puts_back_torchs_reentrant_backward():
    from torch.utils.checkpoint import CheckpointFunction

    assert getattr(CheckpointFunction.backward, "__ckpt_guard_original__", None) is not None
    ckpt_guard.uninstall()
    assert not hasattr(CheckpointFunction.backward, "__ckpt_guard_original__")
