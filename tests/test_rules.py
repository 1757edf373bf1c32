"""Every rule, run live on the installed torch: reference vs raw torch vs guarded.

For each rule and variant the rule's own probe is run four ways:

* without the guard, proving the rule's claim about torch (it raises the
  quoted error, or returns values that differ from the uncheckpointed
  reference);
* under ``strict``: ``CheckpointCompositionError`` for this very rule;
* under ``warn``: the warning, then exactly torch's own behaviour;
* under ``fallback``: the uncheckpointed reference's values (or, for a drift
  that cannot be foreseen at call time, the strict error).

If torch fixes a composition, the "without the guard" test fails and names
the rule: the table is then stale for this torch version.

Expectations come from the table for the installed torch: a rule whose claim
does not hold on it is skipped (saying on which releases it holds), and a safe
composition that this torch refuses runs as one more case of the rule that
covers it there (``Composition.otherwise``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings

import pytest
import torch
from conftest import all_close, assert_all_close, assert_all_equal, no_checkpoint, run_guarded, run_raw

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning
from ckpt_guard._compositions import KNOWN_FALSE_ALARMS, SAFE_COMPOSITIONS
from ckpt_guard._rules import NON_REENTRANT, OFFLOAD_RULE, RULES, rule_by_id
from ckpt_guard._transform_entry import fallback_can_set_aside
from ckpt_guard._versions import installed

HERE = installed()


def _on_gpu(probe):
    """A GPU rule's probe as the matrix runs it: inside ``with torch.device("cuda")``."""

    @functools.wraps(probe)
    def on_gpu(ckpt, use_reentrant):
        with torch.device("cuda"):
            return probe(ckpt, use_reentrant)

    return on_gpu


def _skip_reason(rule):
    if not rule.holds_on(HERE):
        return f"{rule.id}'s claim holds on torch {rule.torch_range}, not on the installed {torch.__version__}"
    if rule.needs_gpu and not torch.cuda.is_available():
        return (
            f"{rule.id} needs a GPU (its symptom needs a default device other than the CPU); "
            "on a GPU machine these tests and python -m ckpt_guard measure it"
        )
    return ""


def _cases():
    """(rule, variant, probe) for every rule case on the installed torch; others skipped, saying why."""
    cases = [
        pytest.param(
            rule, variant, _on_gpu(rule.probe) if rule.needs_gpu else rule.probe, id=f"{rule.id}-{variant}",
            marks=pytest.mark.skip(reason=_skip_reason(rule)) if _skip_reason(rule) else (),
        )
        for rule in RULES
        for variant in rule.variants
    ]
    cases += [
        pytest.param(rule_by_id(c.otherwise), variant, c.probe, id=f"{c.otherwise}-{c.name}-{variant}")
        for c in SAFE_COMPOSITIONS + KNOWN_FALSE_ALARMS
        if not c.holds_on(HERE) and c.otherwise and rule_by_id(c.otherwise).holds_on(HERE)
        for variant in c.variants
    ]
    return cases


CASES = _cases()
# Drift that no call-time state reveals: fallback must raise rather than let it through.
UNFORESEEABLE = {rule.id for rule in RULES if not rule.fallback_helps}
# A transform's entry under offload hooks (CKG012): fallback sets them aside where this torch can read
# them back (>= 2.8); elsewhere it raises strict's error, saying why.
FALLBACK_RAISES_HERE = set() if fallback_can_set_aside() else {OFFLOAD_RULE.id}


def _use_reentrant(variant: str) -> bool:
    return variant != NON_REENTRANT


pytestmark = pytest.mark.usefixtures("guard")


@pytest.mark.parametrize("rule, variant, probe", CASES)
def test_torch_without_guard_shows_the_symptom(rule, variant, probe):
    reference = probe(no_checkpoint, _use_reentrant(variant))
    if rule.symptom_for(variant) == "raises":
        with pytest.raises(Exception) as info:
            run_raw(probe, _use_reentrant(variant))
        assert not isinstance(info.value, CheckpointCompositionError)
        assert re.search(rule.raises_match, str(info.value)), (
            f"{rule.id}: torch raised something else than the table says: {info.value!r}"
        )
    else:
        raw = run_raw(probe, _use_reentrant(variant))
        assert not all_close(raw, reference), (
            f"{rule.id} ({variant}): torch {torch.__version__} now matches the reference; "
            "the rule is stale for this torch version"
        )


@pytest.mark.parametrize("rule, variant, probe", CASES)
def test_strict_raises_this_rule(rule, variant, probe):
    if rule.repaired_quietly:  # the table says strict repairs it without a word: the uncheckpointed result
        reference = probe(no_checkpoint, _use_reentrant(variant))
        with ckpt_guard.record() as events, warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)
            assert_all_close(run_guarded(probe, _use_reentrant(variant), "strict"), reference)
        assert [e.rule_id for e in events] == []
        return
    with ckpt_guard.record() as events:
        with pytest.raises(CheckpointCompositionError) as info:
            run_guarded(probe, _use_reentrant(variant), "strict")
    assert info.value.rule.id == rule.id
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert f"[{rule.id}]" in message and rule.title in message
    probe_file = os.path.basename(getattr(probe, "__wrapped__", probe).__code__.co_filename)
    site = "torch.func transform entered at: " if rule.stage == "transform" else "checkpoint called at: "
    assert site in message and f"{probe_file}:" in message  # the probe's line
    assert "without the guard torch" in message
    # hints are written for the channel that set the policy: here a ckpt_guard.policy() scope; a
    # per-rule hint only where one leads somewhere better (never "off" for a silently wrong rule)
    if rule.fallback_helps or rule.always_raises:
        assert f"ckpt_guard.policy(..., rules={{'{rule.id}': " in message
    else:
        assert "'off'" not in message
    assert "CKPT_GUARD_RULES" not in message
    # fallback is suggested only where it helps
    assert ("ckpt_guard.policy('fallback')" in message) == (rule.fallback_helps and rule.id not in FALLBACK_RAISES_HERE)
    assert [(e.rule_id, e.policy, e.action, e.stage) for e in events] == [
        (rule.id, "strict", "raised", rule.stage)
    ]


@pytest.mark.parametrize("rule, variant, probe", CASES)
def test_warn_warns_then_behaves_like_torch(rule, variant, probe):
    ur = _use_reentrant(variant)
    with pytest.warns(CheckpointCompositionWarning) as record:
        if rule.symptom_for(variant) == "raises":
            with pytest.raises(Exception) as info:
                run_guarded(probe, ur, "warn")
            assert not isinstance(info.value, CheckpointCompositionError)
            assert re.search(rule.raises_match, str(info.value))
        else:
            warned = run_guarded(probe, ur, "warn")
    ids = [w.message.rule.id for w in record if issubclass(w.category, CheckpointCompositionWarning)]
    assert rule.id in ids
    if rule.symptom_for(variant) != "raises":
        _assert_as_torch(rule, warned, run_raw(probe, ur), probe, ur)


def test_unforeseeable_rules_are_the_expected_ones():
    """The table's own claim, pinned: these drifts show only at recompute."""
    assert UNFORESEEABLE == {"CKG108", "CKG114", "CKG116"}


@pytest.mark.parametrize("rule, variant, probe", CASES)
def test_fallback_matches_the_reference(rule, variant, probe):
    ur = _use_reentrant(variant)
    reference = probe(no_checkpoint, ur)
    if rule.id in UNFORESEEABLE:
        with pytest.raises(CheckpointCompositionError) as info:
            run_guarded(probe, ur, "fallback")
        assert info.value.rule.id == rule.id
        assert "could not be foreseen" in str(info.value)
        return
    if rule.id in FALLBACK_RAISES_HERE:
        with pytest.raises(CheckpointCompositionError) as info:
            run_guarded(probe, ur, "fallback")
        assert info.value.rule.id == rule.id
        assert f"torch {torch.__version__} cannot read its saved-tensor hooks stack" in str(info.value)
        assert "ckpt_guard.policy('fallback')" not in str(info.value)
        return
    if rule.repaired_quietly:  # repaired without a word, as strict does
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointCompositionWarning)
            assert_all_close(run_guarded(probe, ur, "fallback"), reference)
        return
    with pytest.warns(CheckpointCompositionWarning) as record:
        result = run_guarded(probe, ur, "fallback")
    assert_all_close(result, reference)
    assert rule.id in [w.message.rule.id for w in record if issubclass(w.category, CheckpointCompositionWarning)]


@pytest.mark.parametrize("rule, variant, probe", CASES)
def test_off_is_raw_torch(rule, variant, probe):
    """Policy off (and a per-rule off) do exactly what torch does."""
    ur = _use_reentrant(variant)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        if rule.symptom_for(variant) == "raises":
            with pytest.raises(Exception) as info:
                run_guarded(probe, ur, "off")
            assert re.search(rule.raises_match, str(info.value))
        else:
            _assert_as_torch(rule, run_guarded(probe, ur, "off"), run_raw(probe, ur), probe, ur)
            _assert_as_torch(rule, run_guarded(probe, ur, "strict", rules={rule.id: "off"}), run_raw(probe, ur), probe, ur)


def _assert_as_torch(rule, got, raw, probe, ur):
    """``got`` is what raw torch gives: bitwise, or (a symptom that varies run to run) as wrong."""
    if rule.symptom_varies:
        reference = probe(no_checkpoint, ur)
        assert not all_close(got, reference) and not all_close(raw, reference)
    else:
        assert_all_equal(got, raw)


# ---------------------------------------------------------------------------
# Specific behaviours the table-driven tests do not pin down


def _per_sample_loss(counter, **variant):
    w = torch.randn(3, 3)

    def block(t):
        counter.append(1)
        return torch.tanh(t @ w)

    def loss(t):
        return torch.utils.checkpoint.checkpoint(block, t, **variant).sum()

    return loss


def test_strict_raises_before_any_compute():
    calls: list = []
    loss = _per_sample_loss(calls, use_reentrant=False)
    with pytest.raises(CheckpointCompositionError):
        torch.func.vmap(torch.func.grad(loss))(torch.randn(4, 3))
    assert calls == []


def test_message_names_stack_site_and_defaulted_variant():
    loss = _per_sample_loss([])  # use_reentrant not passed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCompositionError) as info:
            torch.func.vmap(torch.func.grad(loss))(torch.randn(4, 3))
    message = str(info.value)
    assert info.value.rule.id == "CKG002"
    assert "torch.func transforms: vmap(level 1) > grad(level 2)" in message
    assert "use_reentrant was not passed: torch defaulted to use_reentrant=True" in message
    assert re.search(r"checkpoint called at: .*test_rules\.py:\d+ in loss", message)
    # under grad use_reentrant=False is refused too (CKG001): the fix is the composable recompute
    assert "checkpoint these blocks with ckpt_guard.checkpoint" in message
    assert "pass use_reentrant=False" not in message


def test_fallback_names_a_defaulted_variant_as_strict_does():
    """The same call, the same words: fallback's warning says use_reentrant was not passed, as strict does."""
    loss = _per_sample_loss([])  # use_reentrant not passed
    ckpt_guard.install("fallback", rules={})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.func.vmap(torch.func.grad(loss))(torch.randn(4, 3))
    finally:
        ckpt_guard.uninstall()
    ours = [str(w.message) for w in caught if issubclass(w.category, ckpt_guard.CheckpointCompositionWarning)]
    assert ours and all("use_reentrant was not passed: torch defaulted to use_reentrant=True" in m for m in ours), ours


def test_explicit_reentrant_is_not_called_defaulted():
    loss = _per_sample_loss([], use_reentrant=True)
    with pytest.raises(CheckpointCompositionError) as info:
        torch.func.vmap(loss)(torch.randn(4, 3))
    assert "variant: reentrant (use_reentrant=True)" in str(info.value)


def test_defaulted_through_checkpoint_sequential():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCompositionError) as info:
            torch.func.vmap(lambda t: torch.utils.checkpoint.checkpoint_sequential(model, 2, t))(
                torch.randn(4, 3)
            )
    assert "torch defaulted to use_reentrant=True" in str(info.value)
    with pytest.raises(CheckpointCompositionError) as info:
        torch.func.vmap(
            lambda t: torch.utils.checkpoint.checkpoint_sequential(model, 2, t, use_reentrant=True)
        )(torch.randn(4, 3))
    assert "variant: reentrant (use_reentrant=True)" in str(info.value)


def test_warning_points_at_the_users_line():
    loss = _per_sample_loss([], use_reentrant=False)
    with ckpt_guard.policy("warn"), pytest.warns(CheckpointCompositionWarning) as record:
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            torch.func.grad(loss)(torch.randn(3))
    ours = [w for w in record if issubclass(w.category, CheckpointCompositionWarning)]
    assert ours[0].filename == __file__


def test_user_exceptions_pass_through_untouched():
    class Boom(Exception):
        pass

    def block(t):
        raise Boom("from the user's function")

    x = torch.randn(3, requires_grad=True)
    for variant in (True, False):
        with pytest.raises(Boom, match="from the user's function"):
            torch.utils.checkpoint.checkpoint(block, x, use_reentrant=variant)
        with ckpt_guard.policy("fallback"), pytest.raises(Boom):
            torch.func.grad(lambda t: torch.utils.checkpoint.checkpoint(block, t, use_reentrant=variant).sum())(x)


@pytest.mark.parametrize("holder", ["module", "bound-method", "partial", "partial-of-method", "closure"])
def test_ckg006_sees_parameters_through_wrappers(holder):
    import functools

    block = torch.nn.Linear(3, 3)
    function = {
        "module": block,
        "bound-method": block.forward,
        "partial": functools.partial(block),
        "partial-of-method": functools.partial(block.forward),
        "closure": lambda t: block(t),
    }[holder]
    with pytest.raises(CheckpointCompositionError) as info:
        torch.utils.checkpoint.checkpoint(function, torch.randn(2, 3), use_reentrant=True)
    assert info.value.rule.id == "CKG006"


def test_ckg006_quiet_when_block_has_no_trainable_parameters():
    block = torch.nn.Linear(3, 3).requires_grad_(False)
    x = torch.randn(2, 3)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
    assert torch.equal(out, block(x))


@pytest.mark.skipif(
    rule_by_id("CKG007").holds_on(HERE),
    reason=f"torch {torch.__version__} refuses vmap over non-reentrant checkpoint even under no_grad (CKG007)",
)
def test_ckg003_forward_only_vmap_is_quiet_under_no_grad():
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    f = lambda t: torch.utils.checkpoint.checkpoint(lambda u: torch.tanh(u @ w), t, use_reentrant=False)  # noqa: E731
    with torch.no_grad():
        out = torch.func.vmap(f)(x)
    with torch.no_grad():
        assert torch.equal(out, torch.func.vmap(lambda u: torch.tanh(u @ w))(x))


def test_fallback_keeps_checkpointing_with_non_reentrant_when_safe():
    """CKG006 under fallback runs use_reentrant=False (memory saving kept), not a plain call."""
    block, x = torch.nn.Linear(3, 3), torch.randn(2, 3)
    with ckpt_guard.record() as events, ckpt_guard.policy("fallback"):
        with pytest.warns(CheckpointCompositionWarning, match="use_reentrant=False instead"):
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
    assert out.requires_grad and out.grad_fn is not None
    assert [(e.rule_id, e.action) for e in events] == [("CKG006", "fallback: use_reentrant=False")]
    out.sum().backward()
    assert block.weight.grad is not None


def test_per_rule_override_beats_base_policy():
    loss = _per_sample_loss([], use_reentrant=False)
    with ckpt_guard.policy("off", rules={"CKG001": "strict"}):
        with pytest.raises(CheckpointCompositionError):
            torch.func.grad(loss)(torch.randn(3))
    with ckpt_guard.policy("strict", rules={"CKG001": "off"}):
        with pytest.raises(RuntimeError, match="saved tensor hooks") as info:
            torch.func.grad(loss)(torch.randn(3))
        assert not isinstance(info.value, CheckpointCompositionError)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_unpreserved_rng_without_randomness_is_quiet_and_bitwise(use_reentrant):
    """CKG107 watches the forward; a deterministic block stays silent and unchanged."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(4, 8, requires_grad=True)

    def step():
        x.grad = None
        block.zero_grad()
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant, preserve_rng_state=False)
        y.sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in block.parameters())]

    raw = run_raw(lambda ckpt, ur: step(), use_reentrant)
    with warnings.catch_warnings(), ckpt_guard.record() as events:
        warnings.simplefilter("error", CheckpointCompositionWarning)
        guarded = step()
    assert events == []
    assert_all_equal(guarded, raw)


@pytest.mark.parametrize("impl", ["NO_REENTRANT", "REENTRANT"])
def test_a_trainer_wrapping_every_block_with_unpreserved_rng_is_caught(impl):
    """OLMo-core#828, as a trainer did it: every block wrapped by checkpoint_wrapper(preserve_rng_state=False)
    with a dropout in it (the loss moved 2.49 vs 2.19 with checkpointing on and off). Raw torch: a fresh mask
    in each recompute; strict raises CKG107, fallback matches the uncheckpointed gradients."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.1)

        def forward(self, x):
            return x + self.drop(torch.tanh(self.linear(x)))

    def step(wrap):
        torch.manual_seed(0)
        blocks = torch.nn.Sequential(*[wrap(Block()) for _ in range(2)])
        x = torch.randn(4, 8, requires_grad=True)
        torch.manual_seed(1)
        blocks(x).pow(2).sum().backward()
        return [x.grad, *(p.grad for p in blocks.parameters())]

    wrapped = functools.partial(
        checkpoint_wrapper, checkpoint_impl=getattr(CheckpointImpl, impl), preserve_rng_state=False
    )
    reference = step(lambda block: block)
    ckpt_guard.uninstall()
    assert not all_close(step(wrapped), reference)
    for policy in ("strict", "fallback"):
        ckpt_guard.install(policy)
        try:
            if policy == "strict":
                with pytest.raises(CheckpointCompositionError, match=r"\[CKG107\]"):
                    step(wrapped)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", CheckpointCompositionWarning)
                    assert_all_close(step(wrapped), reference)
        finally:
            ckpt_guard.uninstall()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_user_exception_passes_through_the_rng_watch(use_reentrant):
    class Boom(Exception):
        pass

    def block(t):
        raise Boom("from the user's function")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(Boom, match="from the user's function"):
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant, preserve_rng_state=False)


def test_fix_hints_never_suggest_the_policy_in_force():
    loss = _per_sample_loss([], use_reentrant=False)
    for policy in ("warn", "fallback"):
        with ckpt_guard.policy(policy), pytest.warns(CheckpointCompositionWarning) as record, warnings.catch_warnings():
            try:
                torch.func.grad(loss)(torch.randn(3))
            except RuntimeError:
                pass  # warn: torch's own error follows
        message = str(next(w.message for w in record if issubclass(w.category, CheckpointCompositionWarning)))
        assert f"'CKG001': '{policy}'" not in message
        assert ("ckpt_guard.policy('fallback')" in message) == (policy != "fallback")
        # a call-time rule has no drift to wait for: no "raise only if the drift happens"
        assert "drift really happens" not in message


@pytest.mark.parametrize("channel", ["env", "install", "scope"])
def test_fix_hints_name_the_channel_that_set_the_policy(monkeypatch, channel):
    """A hint that names an environment variable inside a policy() scope changes nothing there."""
    loss = _per_sample_loss([], use_reentrant=False)
    ckpt_guard.uninstall()
    scope = contextlib.nullcontext()
    if channel == "env":
        monkeypatch.setenv("CKPT_GUARD_POLICY", "warn")
        ckpt_guard.install()
    elif channel == "install":
        ckpt_guard.install("warn")
    else:
        ckpt_guard.install("strict")
        scope = ckpt_guard.policy("warn")
    try:
        with scope, pytest.warns(CheckpointCompositionWarning) as record:
            with pytest.raises(RuntimeError, match="saved tensor hooks"):
                torch.func.grad(loss)(torch.randn(3))
    finally:
        ckpt_guard.uninstall()
    message = str(next(w.message for w in record if issubclass(w.category, CheckpointCompositionWarning)))
    expected = {
        "env": ("CKPT_GUARD_RULES=CKG001=fallback", "CKPT_GUARD_POLICY=fallback", "CKPT_GUARD_RULES=CKG001=off"),
        "install": ("ckpt_guard.install(..., rules={'CKG001': 'fallback', ", "ckpt_guard.install('fallback')",
                    "ckpt_guard.install(..., rules={'CKG001': 'off'})"),
        "scope": ("ckpt_guard.policy(..., rules={'CKG001': 'fallback', ", "ckpt_guard.policy('fallback')",
                  "ckpt_guard.policy(..., rules={'CKG001': 'off'})"),
    }[channel]
    for hint in expected:
        assert hint in message, (hint, message)
    others = {"env": "CKPT_GUARD", "install": "ckpt_guard.install", "scope": "ckpt_guard.policy"}
    for other, prefix in others.items():
        if other != channel:
            assert prefix + ("_" if other == "env" else "(") not in message, (other, message)

def test_fallback_acting_on_a_risk_says_so():
    """A swap is active at the call: fallback acts on the risk (the composable recompute, which
    reads the swapped-in tensors whenever it runs), and the warning says it is a risk."""
    model = _Wrapper(torch.nn.Linear(3, 3))
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    x = torch.randn(2, 3)
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, \
            pytest.warns(CheckpointCompositionWarning) as record:
        out = torch.func.functional_call(model, params, (x,))
    message = str(record[0].message)
    assert message.startswith("[CKG101] risk: ") and "nothing has gone wrong" in message
    assert [(e.rule_id, e.action) for e in events] == [("CKG101", "fallback: composable recompute")]
    out.sum().backward()  # after the swap ended: still the swapped-in tensors' gradients
    expected = torch.autograd.grad(torch.func.functional_call(model.inner, params_of(params), (x,)).sum(),
                                   list(params.values()))
    for (name, p), e in zip(params.items(), expected):
        torch.testing.assert_close(p.grad, e)


def params_of(params):
    return {k.removeprefix("inner.") if hasattr(k, "removeprefix") else k[len("inner."):]: v
            for k, v in params.items()}


class _Wrapper(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.usefixtures("guard")
def test_fallback_repairs_two_call_rules_at_once_rrelu_and_unpreserved_rng():
    """CKG009 and CKG107 on one call: fallback switches early stop off *and* preserves the RNG."""
    if not rule_by_id("CKG009").holds_on(installed()):
        pytest.skip(f"CKG009 does not hold on torch {installed()}")

    def probe(ckpt, use_reentrant):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RReLU())
        x = torch.randn(4, 8, requires_grad=True)
        junk = torch.full((4, 8), float("nan"))  # its memory, freed: what RReLU's unfilled noise reads
        del junk
        torch.manual_seed(1)
        ckpt(net, x, use_reentrant=use_reentrant, preserve_rng_state=False).sum().backward()
        return [x.grad]

    reference = probe(no_checkpoint, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_all_close(run_guarded(probe, False, "fallback"), reference)
    ours = [w.message for w in caught if issubclass(w.category, CheckpointCompositionWarning)]  # torch 2.4 adds a FutureWarning
    assert {re.match(r"\[(CKG\d+)\]", str(message)).group(1) for message in ours} >= {"CKG009", "CKG107"}


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_linearize_over_a_checkpoint_gets_the_forward_ad_rule(use_reentrant):
    """Issue 27, section 4: torch.func.linearize (a jvp traced at a dual level) over a checkpoint gets the
    forward-AD rule the table gives the variant on this torch (CKG004 reentrant; CKG007 non-reentrant on
    torch < 2.12, none after), as the same call under fwAD.dual_level does."""
    torch.manual_seed(0)
    w = torch.randn(3, 3)
    x, tangent = torch.randn(3), torch.randn(3)

    def block(u):
        return torch.tanh(u @ w)

    def linearized(ckpt):
        return torch.func.linearize(lambda u: ckpt(block, u), x)[1](tangent)

    reference = linearized(lambda f, u: f(u))
    expected = "CKG004" if use_reentrant else ("CKG007" if rule_by_id("CKG007").holds_on(installed()) else None)
    torch_checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=use_reentrant)
    ckpt_guard.uninstall()
    if expected:
        with pytest.raises(Exception) as raw:
            linearized(torch_checkpoint)
        assert re.search(rule_by_id(expected).raises_match or ".", str(raw.value))
        assert not isinstance(raw.value, CheckpointCompositionError)
    else:
        raw_value = linearized(torch_checkpoint)
        torch.testing.assert_close(raw_value, reference)
    for policy in ("strict", "fallback"):
        ckpt_guard.install(policy)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if expected and policy == "strict":
                    with pytest.raises(CheckpointCompositionError, match=rf"\[{expected}\]"):
                        linearized(torch_checkpoint)
                    continue
                got = linearized(torch_checkpoint)
            rules = {w.message.rule.id for w in caught if issubclass(w.category, CheckpointCompositionWarning)}
            assert rules == ({expected} if expected else set())
            if expected:
                torch.testing.assert_close(got, reference)
            else:
                assert torch.equal(got, raw_value)
        finally:
            ckpt_guard.uninstall()
