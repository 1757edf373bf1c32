"""CKG112 and the composable recompute: a block that is given a container it changes (a KV cache).

pytorch#155171: a checkpointed attention block appends to the cache it is
given; torch's recompute reads the grown cache and appends again.  Each way
of handing a block a container is run three ways (uncheckpointed, raw torch,
guarded), and the cache itself is compared too: fallback makes the change
once, as without checkpointing.  ``ckpt_guard.checkpoint`` under torch.func
ran the block on a copy of the list before (the user's cache did not grow)
or on the list itself (an empty one: silently wrong gradients); it now
refuses such a block, so fallback runs it plainly and strict explains.
"""

from __future__ import annotations

import copy
import functools
import types
import warnings

import pytest
import torch
from conftest import assert_all_close, assert_all_equal
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning, _composable

pytestmark = pytest.mark.usefixtures("guard")


class Layer:
    """A cache layer as transformers' DynamicLayer keeps one: ``keys``, re-bound by each update."""

    def __init__(self):
        self.keys = None

    def update(self, k):
        self.keys = k if self.keys is None else torch.cat([self.keys, k])
        return self.keys


class Cache:
    def __init__(self, layers=1):
        self.layers = [Layer() for _ in range(layers)]


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, cache):
        k = self.k(x)
        if isinstance(cache, list):
            cache.append(k)
            keys = torch.cat(cache)
        elif isinstance(cache, dict):
            cache["keys"] = k if "keys" not in cache else torch.cat([cache["keys"], k])
            keys = cache["keys"]
        else:
            keys = cache.layers[0].update(k)
        return (self.q(x) @ keys.T).softmax(-1) @ keys


def _cache(kind, filled=True):
    torch.manual_seed(1)
    start = torch.randn(3, 4)
    if kind == "list":
        return [start] if filled else []
    if kind == "dict":
        return {"keys": start} if filled else {}
    cache = Cache()
    if filled:
        cache.layers[0].update(start)
    return cache


def _keys(cache):
    if isinstance(cache, list):
        return torch.cat(cache) if cache else torch.zeros(0)
    if isinstance(cache, dict):
        return cache.get("keys", torch.zeros(0))
    return cache.layers[0].keys


def _call(ckpt, block, x, cache, way, use_reentrant):
    """Hand the block its cache ``way``: as an argument, a keyword, bound by a partial, closed over."""
    variant = {} if ckpt is None else {"use_reentrant": use_reentrant}
    run = ckpt or (lambda f, *a, **k: f(*a, **k))
    if way == "argument":
        return run(block, x, cache, **variant)
    if way == "keyword":
        return run(block, x, cache=cache, **variant)
    if way == "partial":  # transformers' GradientCheckpointingLayer binds its keywords so
        return run(functools.partial(block, cache=cache), x, **variant)
    if way == "closure":
        return run(lambda h: block(h, cache), x, **variant)
    inner = lambda h: block(h, cache)  # noqa: E731 - a closure of a closure: unseen before 2026-12-06
    return run(lambda h: inner(h), x, **variant)


def _step(ckpt, kind, way, use_reentrant, filled=True):
    torch.manual_seed(0)
    block = Attention()
    x = torch.randn(3, 4, requires_grad=True)
    cache = _cache(kind, filled)
    y = _call(ckpt, block, x, cache, way, use_reentrant)
    y.sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in block.parameters()), _keys(cache)]


CASES = [
    pytest.param(kind, way, ur, id=f"{kind}-{way}-{'reentrant' if ur else 'non-reentrant'}")
    for kind in ("list", "dict", "object")
    for way in ("argument", "keyword", "partial", "closure", "closure of a closure")
    for ur in (True, False)
    if not (way == "keyword" and ur)  # the reentrant variant takes no keyword arguments
]


@pytest.mark.parametrize("kind, way, use_reentrant", CASES)
def test_a_changed_container_is_caught_and_fallback_changes_it_once(kind, way, use_reentrant):
    reference = _step(None, kind, way, use_reentrant)
    ckpt_guard.uninstall()
    try:  # raw torch: wrong gradients and a cache grown twice, or a CheckpointError
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = _step(checkpoint, kind, way, use_reentrant)
        assert raw[-1].shape != reference[-1].shape  # the cache grew twice
        assert not all(torch.equal(a, b) for a, b in zip(raw[:-1], reference[:-1]))
    except torch.utils.checkpoint.CheckpointError as error:
        assert "different metadata" in str(error)
    finally:
        ckpt_guard.install("strict")
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError) as info:
        _step(checkpoint, kind, way, use_reentrant)
    assert info.value.rule.id == "CKG112"
    message = str(info.value)
    assert "[CKG112]" in message
    label = {
        "argument": "its argument 2", "keyword": "its keyword argument 'cache'",
        "partial": "keyword argument 'cache' bound by a functools.partial", "closure": "the closure variable 'cache'",
        "closure of a closure": "the closure variable 'cache' (of ",
    }[way]
    assert label in message, message
    with ckpt_guard.policy("fallback"), pytest.warns(CheckpointCompositionWarning, match=r"\[CKG112\]"):
        repaired = _step(checkpoint, kind, way, use_reentrant)
    assert_all_close(repaired, reference)  # the gradients, and the cache as the uncheckpointed run left it


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_tensor_updated_in_place_in_a_container_cannot_be_replayed(use_reentrant):
    """A static cache written in place: what the forward read is gone, so fallback raises as strict."""

    def block(x, cache):
        return x * cache[0]

    for policy in ("strict", "fallback"):
        x = torch.randn(3, requires_grad=True)
        cache = [torch.randn(3)]
        with ckpt_guard.policy(policy):
            y = checkpoint(block, x, cache, use_reentrant=use_reentrant)
            cache[0].mul_(2)
            with pytest.raises(CheckpointCompositionError, match=r"the tensor its argument 2\[0\] was updated in place") as info:
                y.sum().backward()
        assert info.value.rule.id == "CKG112"


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_containers_the_block_does_not_change_are_quiet_and_bitwise(use_reentrant):
    """A list of weights, rotary embeddings as a tuple, a config object: torch's values, no report."""

    class Config:
        scale = 0.5

        def __init__(self):
            self.shift = 1.0

    def block(x, weights, rotary, config, table):
        cos, sin = rotary
        return torch.tanh(x @ weights[0] * cos + sin) * config.scale + config.shift + table["bias"]

    def step(ckpt):
        torch.manual_seed(0)
        w = torch.randn(4, 4, requires_grad=True)
        x = torch.randn(3, 4, requires_grad=True)
        rotary, table = (torch.randn(4), torch.randn(4)), {"bias": torch.randn(4)}
        y = ckpt(block, x, [w], rotary, Config(), table, use_reentrant=use_reentrant)
        y.sum().backward()
        return [y.detach(), x.grad, w.grad]

    ckpt_guard.uninstall()
    try:
        raw = step(checkpoint)
    finally:
        ckpt_guard.install("strict")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        for policy in ("strict", "warn", "fallback"):
            with ckpt_guard.policy(policy):
                assert_all_equal(step(checkpoint), raw)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_log_of_devices_and_numbers_is_not_a_change_the_recompute_reads(use_reentrant):
    """Instrumentation that appends devices or numbers to a list moves no tensor: quiet; strict puts the
    log back for the recompute, so it gets its lines once, as without checkpointing (torch: twice)."""
    seen = []

    def block(x):
        seen.append(x.device)
        seen.append(len(seen))
        return torch.tanh(x)

    x = torch.randn(3, requires_grad=True)
    with ckpt_guard.policy("strict"), warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        checkpoint(block, x, use_reentrant=use_reentrant).sum().backward()
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)
    assert len(seen) == 2  # the recompute ran on the forward's log, put back after


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("where", ["object", "dict", "box"])
def test_a_counter_the_block_bumps_and_reads_is_repaired_under_strict_and_fallback(where, use_reentrant):
    """Found by review: a step counter alone (no tensor next to it) that scales the output. Reentrant:
    silently wrong gradients, the counter bumped twice; non-reentrant: right (torch's recompute stops
    once the tanh is recomputed, before the bump). Python values replaced are what
    the replay makes exact, read or not: strict and fallback recompute with the forward's value,
    silently (issue 27: a counter that only counts is no reason to stop a program); warn reports it
    and behaves as torch."""
    state = {"object": types.SimpleNamespace(step=0), "dict": {"step": 0}, "box": [0]}

    def bump(st):
        if where == "object":
            st.step += 1
            return st.step
        if where == "dict":
            st["step"] += 1
            return st["step"]
        st[0] += 1
        return st[0]

    def step(ckpt, policy="off"):
        torch.manual_seed(0)
        w = torch.randn(4, 4, requires_grad=True)
        x = torch.randn(3, 4, requires_grad=True)
        st = copy.deepcopy(state[where])
        block = lambda h, s: torch.tanh(h @ w) * bump(s)  # noqa: E731
        with ckpt_guard.policy(policy):
            y = ckpt(block, x, st, use_reentrant=use_reentrant) if ckpt else block(x, st)
            y.sum().backward()
        return [x.grad, w.grad, torch.tensor(bump(st))]

    reference = step(None)
    raw = step(checkpoint, "off")
    if use_reentrant:  # torch bumps the counter a second time, and scales the gradients by it
        assert not torch.equal(raw[-1], reference[-1]) and not torch.equal(raw[1], reference[1])
    with pytest.warns(CheckpointCompositionWarning, match=r"\[CKG112\][\s\S]*(\.step|\['step'\]|\[0\]): 0 → 1"):
        assert_all_equal(step(checkpoint, "warn"), raw)
    for policy in ("strict", "fallback"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)
            assert_all_close(step(checkpoint, policy), reference)


def test_a_list_the_block_only_collects_into_is_reported_and_fallback_appends_once():
    """The documented exception: a list of tensors the block collects into (aux losses) is not read, but
    the recompute appends to it again; the guard cannot tell it from a cache."""

    def block(x, collected):
        y = torch.tanh(x)
        collected.append(y.detach().sum())
        return y

    def step(policy):
        x = torch.randn(3, requires_grad=True)
        collected = []
        with ckpt_guard.policy(policy), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checkpoint(block, x, collected, use_reentrant=True).sum().backward()
        return len(collected)

    with pytest.raises(CheckpointCompositionError, match=r"\[CKG112\]"):
        step("strict")
    assert step("off") == 2  # torch: the recompute appended a second time
    assert step("fallback") == 1  # as without checkpointing


# ---------------------------------------------------------------------------
# the composable recompute (ckpt_guard.checkpoint under torch.func, and fallback there)


class Wrapper(torch.nn.Module):
    def __init__(self, attention, composable):
        super().__init__()
        self.attention, self.composable = attention, composable

    def forward(self, x, cache):
        if self.composable:
            return ckpt_guard.checkpoint(self.attention, x, cache)
        return self.attention(x, cache)


class AttributeCache(Attention):
    """The cache as a plain attribute of the module."""

    def __init__(self):
        super().__init__()
        self.cache = []

    def forward(self, x, cache=None):
        return super().forward(x, self.cache)


def _grad_step(composable, kind, filled, attribute=False):
    torch.manual_seed(0)
    attention = AttributeCache() if attribute else Attention()
    x = torch.randn(3, 4)
    cache = _cache(kind, filled)
    if attribute:
        attention.cache = cache
    model = Wrapper(attention, composable)
    params = dict(model.named_parameters())
    grads = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x, cache)).sum())(params)
    return [*grads.values(), _keys(cache).detach()]


@pytest.mark.parametrize("filled", [False, True], ids=["empty", "filled"])
@pytest.mark.parametrize("kind", ["list", "dict", "object", "module attribute"])
def test_the_composable_recompute_keeps_a_block_that_grows_its_cache(kind, filled):
    """A KV cache the block appends a key to, under torch.func.grad: the first forward is the plain run,
    so the key in the cache is the plain run's (its gradient reaches the code that reads it, as without
    checkpointing); the recompute starts from what the forward found and puts it back after. Right and
    recomputed under strict (it was refused, losing the memory saving), the cache grown once."""
    attribute = kind == "module attribute"
    kind = "list" if attribute else kind
    reference = _grad_step(False, kind, filled, attribute)
    for policy in ("strict", "fallback"):
        before = _composable.counters.RECOMPUTES
        with ckpt_guard.policy(policy), warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)  # nothing to say
            got = _grad_step(True, kind, filled, attribute)
        assert_all_close(got, reference)  # the gradients, and the cache grown once
        assert _composable.counters.RECOMPUTES == before + 1


def test_the_composable_recompute_keeps_a_block_that_only_reads_its_container():
    def block(x, weights):
        return torch.tanh(x @ weights[0])

    torch.manual_seed(0)
    w, x = torch.randn(4, 4), torch.randn(3, 4)

    def loss(w, ckpt):
        return ckpt(block, x, [w]).sum()

    reference = torch.func.grad(loss)(w, lambda f, *a: f(*a))
    before = _composable.counters.RECOMPUTES
    got = torch.func.grad(loss)(w, ckpt_guard.checkpoint)
    assert _composable.counters.RECOMPUTES == before + 1  # recomputed: the memory saving is kept
    torch.testing.assert_close(got, reference)


# ---------------------------------------------------------------------------
# found by a fresh-eyes review of CKG112, each failed before its fix


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_fallback_puts_every_value_back_a_position_counter_too(use_reentrant):
    """A cache object with a position counter and a list of keys: the recompute sees both as the forward did."""

    class PositionCache:
        def __init__(self):
            self.pos, self.keys = 0, [torch.randn(3, 4)]

    def block(linear, x, cache):
        k = linear(x) * (cache.pos + 1)
        cache.keys.append(k)
        cache.pos += 1
        return torch.cat(cache.keys).sum(0) * k

    def step(ckpt):
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 4)
        x = torch.randn(3, 4, requires_grad=True)
        cache = PositionCache()
        y = ckpt(block, linear, x, cache, use_reentrant=use_reentrant) if ckpt else block(linear, x, cache)
        y.sum().backward()
        return [y.detach(), x.grad, linear.weight.grad, torch.tensor([len(cache.keys), cache.pos])]

    reference = step(None)
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match=r"its argument 3\.keys \(a list\)"):
        step(checkpoint)
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        assert_all_close(step(checkpoint), reference)


def test_reentrant_fallback_keeps_the_gradient_of_what_the_block_puts_in_the_cache():
    """A later layer reads the cached key: the reentrant forward (under no_grad) loses its gradient, so
    fallback undoes that forward and runs the call with use_reentrant=False instead."""
    linear = torch.nn.Linear(4, 4)

    def block(x, cache):
        cache.append(linear(x))
        k = torch.cat(cache)
        return (x @ k.T).softmax(-1) @ k

    def step(ckpt):
        torch.manual_seed(0)
        linear.zero_grad(set_to_none=True)
        x = torch.randn(3, 4, requires_grad=True)
        cache = [torch.ones(3, 4)]
        y = ckpt(block, x, cache, use_reentrant=True) if ckpt else block(x, cache)
        (y.sum() + cache[-1].pow(2).sum()).backward()
        return [x.grad, linear.weight.grad, torch.tensor(len(cache))]

    reference = step(None)
    with ckpt_guard.policy("fallback"), pytest.warns(CheckpointCompositionWarning, match=r"\[CKG112\]"):
        assert_all_close(step(checkpoint), reference)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_list_that_grows_past_the_long_mark_is_put_back_whole(use_reentrant):
    linear = torch.nn.Linear(4, 4)

    def block(x, outs):
        for i in range(10):
            outs.append(linear(x).detach() * i)
        return linear(x).tanh()

    outs = [torch.zeros(3, 4) for _ in range(250)]
    x = torch.randn(3, 4, requires_grad=True)
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        checkpoint(block, x, outs, use_reentrant=use_reentrant).sum().backward()
    assert len(outs) == 260 and all(isinstance(t, torch.Tensor) for t in outs)


class _AttrConfig:
    """An attribute dict with __slots__ and a __getattr__ that raises KeyError: not the guard's to read."""

    __slots__ = ("_d",)

    def __init__(self, **values):
        object.__setattr__(self, "_d", values)

    def __getattr__(self, name):
        return self._d[name]


class _ExplodingDict(dict):
    def items(self):
        raise RuntimeError("items is not for the guard")


class _ExplodingList(list):
    def __iter__(self):
        raise RuntimeError("iteration is not for the guard")


@pytest.mark.parametrize("given", [_AttrConfig(scale=2.0), _ExplodingDict(a=1), _ExplodingList([1])], ids=type)
@pytest.mark.parametrize("policy", ["strict", "warn", "fallback"])
def test_odd_objects_given_to_a_block_never_break_the_guard(given, policy):
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with ckpt_guard.policy(policy), warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        for use_reentrant in (True, False):
            checkpoint(lambda h, _: linear(h) * 2, x, given, use_reentrant=use_reentrant).sum().backward()


def test_a_cache_four_containers_deep_is_watched():
    linear = torch.nn.Linear(4, 4)

    class LayerCache:
        def __init__(self):
            self.keys = [torch.ones(3, 4)]

    def block(x, context):
        keys = context["layers"][0].keys
        keys.append(linear(x))
        k = torch.cat(keys)
        return (x @ k.T).softmax(-1) @ k

    x = torch.randn(3, 4, requires_grad=True)
    with ckpt_guard.policy("strict"), pytest.raises(
        CheckpointCompositionError, match=r"its argument 2\['layers'\]\[0\]\.keys \(a list\): 1 item → 2 items"
    ):
        checkpoint(block, x, {"layers": [LayerCache()]}, use_reentrant=True).sum().backward()


def test_a_big_config_given_first_does_not_use_up_the_watch_of_the_cache():
    config = types.SimpleNamespace(**{f"field{i}": i for i in range(120)}, id2label={i: str(i) for i in range(150)})
    linear = torch.nn.Linear(4, 4)

    def block(x, config, cache):
        cache.append(linear(x))
        return torch.cat(cache).sum(0) * x

    x = torch.randn(3, 4, requires_grad=True)
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match=r"\[CKG112\]"):
        checkpoint(block, x, config, [torch.ones(3, 4)], use_reentrant=True).sum().backward()


class Logging(torch.nn.Module):
    """Keeps detached attention maps for visualisation, and counts its calls in an object it is given."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(4, 4)
        self.maps = []

    def forward(self, x, counter):
        counter.calls += 1
        a = (self.q(x) @ x.T).softmax(-1) * counter.calls
        self.maps.append(a.detach())
        return a @ x


def test_the_composable_recompute_replays_a_log_and_a_counter_and_keeps_the_saving():
    """Detached tensors and Python numbers carry no gradient: each recompute starts from what the
    forward found and leaves what is there after (one map, one count), with the memory saving."""
    torch.manual_seed(0)
    module = Logging()
    x = torch.randn(3, 4)
    params = {k: v.detach() for k, v in module.named_parameters()}

    def loss(p, counter, checkpointed):
        run = lambda h: torch.func.functional_call(module, p, (h, counter))  # noqa: E731
        return (ckpt_guard.checkpoint(run, x) if checkpointed else run(x)).pow(2).sum()

    reference_counter = types.SimpleNamespace(calls=0)
    reference = torch.func.grad(loss)(params, reference_counter, False)
    module.maps.clear()
    counter = types.SimpleNamespace(calls=0)
    before = _composable.counters.RECOMPUTES
    with ckpt_guard.policy("strict"):
        got = torch.func.grad(loss)(params, counter, True)
    assert _composable.counters.RECOMPUTES == before + 1
    torch.testing.assert_close(got, reference)
    assert counter.calls == reference_counter.calls == 1 and len(module.maps) == 1


def test_install_off_is_the_policy_for_ckpt_guard_checkpoint_too():
    """Found by review: a refused block under install("off") raised strict's explanation (the
    environment's default) instead of doing what torch does."""
    hidden = torch.randn(4, requires_grad=True)  # read through a global: the composable recompute refuses

    def block(x):
        return torch.tanh(x * _HIDDEN[0])

    _HIDDEN[:] = [hidden]
    ckpt_guard.install("off")
    try:
        with pytest.raises(RuntimeError) as info:
            torch.func.grad(lambda x: ckpt_guard.checkpoint(block, x).sum())(torch.randn(4))
        assert not isinstance(info.value, CheckpointCompositionError)
    finally:
        ckpt_guard.install("strict")


_HIDDEN: list = []


def test_reentrant_fallback_cannot_run_again_a_forward_that_updated_a_buffer():
    """The reentrant forward put a key in the cache and updated BatchNorm's running statistics: running it
    again non-reentrant would update them twice, so fallback raises (strict's explanation) instead."""
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))

    def run(x, cache):
        cache.append(block(x))
        return torch.cat(cache).sum(0) * x

    x = torch.randn(3, 4, requires_grad=True)
    with ckpt_guard.policy("fallback"), pytest.raises(CheckpointCompositionError, match=r"updated a tensor in place, a buffer, an input"):
        checkpoint(functools.partial(run), x, [torch.ones(3, 4)], use_reentrant=True)


def test_the_guards_own_record_bound_by_a_partial_is_not_the_users_state():
    """Issue 27: CKG112 named the guard's own ``_RecordedReads`` ("argument 1 bound by a functools.partial
    (a _RecordedReads): forward changed"), which ckpt_guard.checkpoint binds under an untracked swap and
    fills in the forward. The snapshot leaves the guard's objects out; a user's object of the same shape
    is still watched."""
    from ckpt_guard import _entry as entry
    from ckpt_guard._state import argument_contents

    def block(t):
        return t.tanh()

    recorder = entry._RecordedReads([], entry._SWAP_RULE, "strict", "here", {}, "")
    bound = functools.partial(types.MethodType(entry._run_recorded, block), recorder)
    x = torch.randn(3, requires_grad=True)
    assert argument_contents(bound, (x,)) == ()

    class UsersRecord:
        def __init__(self):
            self.forward = None

    users = functools.partial(lambda record, t: t.tanh(), UsersRecord())
    assert [entry[2] for entry in argument_contents(users, (x,))] == ["object"]


# a value the block reads from a container it is given (its closure, an argument), changed by the program
# after the call and before the pullback (``cfg.scale = 2.0``, ``scales[0] = 2.0``): the composable
# recompute runs with it as the call found it (before 2026-12-06's second session it read the new one, and
# the gradient was silently wrong), and the program's value is there after


class _Config:
    pass


def _changed_after_the_call(kind: str, way: str, transform: str, ckpt) -> list:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    config = _Config()
    config.scale = 1.5
    holder = {"object": config, "list": [1.5], "dict": {"scale": 1.5}}[kind]
    read = {"object": lambda c: c.scale, "list": lambda c: c[0], "dict": lambda c: c["scale"]}[kind]

    def change():
        if kind == "object":
            holder.scale = 2.0
        else:
            holder[0 if kind == "list" else "scale"] = 2.0

    if way == "its closure":
        call = lambda h: ckpt(lambda u: torch.sin(lin(u) * read(holder)), h)  # noqa: E731
    else:
        call = lambda h: ckpt(lambda u, c: torch.sin(lin(u) * read(c)), h, holder)  # noqa: E731

    def loss(h):
        y = call(h)
        change()
        return y.pow(2).sum()

    if transform == "vjp, pullback after the change":
        out, pull = torch.func.vjp(lambda h: call(h).pow(2).sum(), x)
        change()
        got = pull(torch.ones_like(out))[0]
    elif transform == "grad":
        got = torch.func.grad(loss)(x)
    else:  # vmap(grad)
        got = torch.func.vmap(torch.func.grad(loss))(x.unsqueeze(1).expand(4, 2, 3).clone())
    return [got, torch.tensor(read(holder))]


@pytest.mark.parametrize("transform", ["vjp, pullback after the change", "grad", "vmap(grad)"])
@pytest.mark.parametrize("way", ["its closure", "an argument"])
@pytest.mark.parametrize("kind", ["object", "list", "dict"])
def test_the_composable_recompute_reads_a_container_as_the_call_found_it(kind, way, transform):
    reference = _changed_after_the_call(kind, way, transform, lambda f, *a: f(*a))
    assert reference[1].item() == 2.0
    assert_all_close(_changed_after_the_call(kind, way, transform, ckpt_guard.checkpoint), reference)
