"""install / uninstall / configuration: entry points, identity, errors, robustness."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import types
import threading
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc

import ckpt_guard
from ckpt_guard import CheckpointCompositionError
from ckpt_guard._layouts import find_non_reentrant
from ckpt_guard._rules import RULE_IDS

PYTHON = sys.executable
#: the non-reentrant choke point's name on this torch's layout
NON_REENTRANT_ATTRIBUTE = find_non_reentrant(tuc)[0].attribute


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_GUARD_")}
    clean.update(env)
    return subprocess.run(
        [PYTHON, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=clean, timeout=120
    )


def _grad_over_checkpoint(ckpt=tuc.checkpoint, **variant):
    return lambda: torch.func.grad(lambda t: ckpt(torch.sin, t, **variant).sum())(torch.randn(3))


# ---------------------------------------------------------------------------
# entry points: every way into checkpointing is caught


def _vmap_over(call):
    return lambda: torch.func.vmap(call)(torch.randn(4, 3))


def _entry_points():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed._composable import checkpoint as composable_checkpoint

    def wrapped(impl):
        module = checkpoint_wrapper(torch.nn.Linear(3, 3), checkpoint_impl=impl)
        return lambda t: module(t)

    def applied():
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, torch.nn.Linear))
        return model

    def composable():
        model = torch.nn.Linear(3, 3)
        composable_checkpoint(model)
        return model

    partial_nr = functools.partial(tuc.checkpoint, use_reentrant=False)
    partial_r = functools.partial(tuc.checkpoint, use_reentrant=True)
    lin = torch.nn.Linear(3, 3)
    curried = {}
    if _HAS_CURRIED_FORM:  # torch 2.14+: checkpoint(use_reentrant=...)(fn), also as a decorator
        curried = {
            "curried-nr": (lambda t: tuc.checkpoint(use_reentrant=False)(lin)(t), "CKG001"),
            "curried-r": (lambda t: tuc.checkpoint(use_reentrant=True)(lin)(t), "CKG002"),
            "decorator-nr": (tuc.checkpoint(use_reentrant=False)(lambda t: lin(t)), "CKG001"),
        }
    return {
        **curried,
        # (how the block is called under grad(...), the rule expected)
        "checkpoint-nr": (lambda t: tuc.checkpoint(lin, t, use_reentrant=False), "CKG001"),
        "checkpoint-r": (lambda t: tuc.checkpoint(lin, t, use_reentrant=True), "CKG002"),
        "checkpoint-default": (lambda t: tuc.checkpoint(lin, t), "CKG002"),
        "sequential-nr": (lambda t: tuc.checkpoint_sequential(torch.nn.Sequential(lin, torch.nn.Tanh()), 2, t, use_reentrant=False), "CKG001"),
        "sequential-r": (lambda t: tuc.checkpoint_sequential(torch.nn.Sequential(lin, torch.nn.Tanh()), 2, t, use_reentrant=True), "CKG002"),
        "partial-nr": (lambda t: partial_nr(lin, t), "CKG001"),
        "partial-r": (lambda t: partial_r(lin, t), "CKG002"),
        "wrapper-no-reentrant": (wrapped(CheckpointImpl.NO_REENTRANT), "CKG001"),
        "wrapper-reentrant": (wrapped(CheckpointImpl.REENTRANT), "CKG002"),
        "apply_activation_checkpointing": (applied(), "CKG001"),
        "composable": (composable(), "CKG001"),
    }


_HAS_CURRIED_FORM = "_checkpoint_impl" in vars(tuc)


@pytest.fixture
def counted_guard_calls(monkeypatch):
    """The guard installed (strict), counting every call that reaches its decision function."""
    from ckpt_guard import _decide

    calls = []
    original = _decide.prepare_call

    def counting(reentrant, *args, **kwargs):
        calls.append("reentrant" if reentrant else "non-reentrant")
        return original(reentrant, *args, **kwargs)

    ckpt_guard.uninstall()
    monkeypatch.setattr(_decide, "prepare_call", counting)  # the patch points bind it at install
    ckpt_guard.install("strict", rules={})
    try:
        yield calls
    finally:
        ckpt_guard.uninstall()


@pytest.mark.parametrize("entry", list(_entry_points()))
def test_every_entry_point_is_guarded(counted_guard_calls, entry):
    """Each way into checkpointing reaches the guard (counted) and is refused under a grad transform."""
    call, rule_id = _entry_points()[entry]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCompositionError) as info:
            torch.func.grad(lambda t: call(t).sum())(torch.randn(2, 3))
    assert info.value.rule.id == rule_id
    expected = "reentrant" if rule_id == "CKG002" else "non-reentrant"
    assert counted_guard_calls == [expected], counted_guard_calls


@pytest.mark.parametrize("entry", list(_entry_points()))
def test_every_entry_point_trains_through_the_guard(counted_guard_calls, entry):
    """Outside transforms each entry point trains as torch does, every call counted by the guard."""
    call, rule_id = _entry_points()[entry]
    x = torch.randn(2, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call(x).pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    expected = "reentrant" if rule_id == "CKG002" else "non-reentrant"
    assert counted_guard_calls and set(counted_guard_calls) == {expected}, counted_guard_calls


def test_curried_form_is_covered_where_torch_has_it():
    """The entry-point list follows torch: the curried form (2.14+) is in it exactly where torch has it."""
    try:
        curried = tuc.checkpoint(use_reentrant=False)  # no function: the curried form, if torch has one
    except TypeError:
        curried = None
    assert ("curried-nr" in _entry_points()) == callable(curried)


def test_name_bound_before_install_is_guarded():
    """A module that did `from torch.utils.checkpoint import checkpoint` before install()."""
    result = _run(
        """
        import torch
        from torch.utils.checkpoint import checkpoint as bound_early
        import ckpt_guard
        ckpt_guard.install("strict")
        try:
            torch.func.grad(lambda t: bound_early(torch.sin, t, use_reentrant=False).sum())(torch.randn(3))
        except ckpt_guard.CheckpointCompositionError as e:
            print("caught", e.rule.id)
        """
    )
    assert result.stdout.strip() == "caught CKG001", result.stderr


def test_install_before_importing_torch():
    result = _run(
        """
        import sys
        import ckpt_guard
        assert "torch" not in sys.modules, "import ckpt_guard imported torch"
        ckpt_guard.install()  # CKPT_GUARD_POLICY=strict from the environment
        assert "torch" not in sys.modules, "install() imported torch"
        import torch
        from torch.utils.checkpoint import checkpoint
        try:
            torch.func.grad(lambda t: checkpoint(torch.sin, t, use_reentrant=False).sum())(torch.randn(3))
        except ckpt_guard.CheckpointCompositionError as e:
            print("caught", e.rule.id)
        """,
        CKPT_GUARD_POLICY="strict",
    )
    assert result.stdout.strip() == "caught CKG001", result.stderr


def test_import_does_not_import_torch():
    result = _run("import sys, ckpt_guard; print('torch' in sys.modules, ckpt_guard.is_installed())")
    assert result.stdout.strip() == "False False", result.stderr


# ---------------------------------------------------------------------------
# uninstall puts everything back


def _patchable_objects():
    import torch.nn.utils.stateless as stateless

    return {
        "generator": getattr(tuc, NON_REENTRANT_ATTRIBUTE),
        "apply-in-class-dict": tuc.CheckpointFunction.__dict__.get("apply"),
        "warnings": tuc.warnings,
        "reparametrize": stateless._reparametrize_module,
        "reparametrize-swap": _swap_hook_point(stateless),
        "checkpoint": tuc.checkpoint,
    }


def _swap_hook_point(stateless):
    """What the guard replaces to see functional_call's swaps, as a comparable tuple.

    torch 2.5–2.6: the ``_ReparametrizeModule`` class's own ``__enter__`` /
    ``__exit__``; other releases: the generator in ``_reparametrize_module``'s
    closure cell.
    """
    swap_class = getattr(stateless, "_ReparametrizeModule", None)
    if isinstance(swap_class, type):
        return tuple(vars(swap_class).get(name) for name in ("__enter__", "__exit__"))
    return (stateless._reparametrize_module.__closure__[0].cell_contents,)


def _swap_hook_point_now():
    import torch.nn.utils.stateless as stateless

    return _swap_hook_point(stateless)



def test_uninstall_restores_identity():
    ckpt_guard.uninstall()
    before = _patchable_objects()
    ckpt_guard.install("strict")
    during = _patchable_objects()
    assert during["generator"] is not before["generator"]
    assert during["apply-in-class-dict"] is not None
    assert during["reparametrize-swap"] != before["reparametrize-swap"]
    assert during["checkpoint"] is before["checkpoint"]  # never touched: dynamo matches it by identity
    assert during["reparametrize"] is before["reparametrize"]
    ckpt_guard.uninstall()
    after = _patchable_objects()
    for name in before:
        if name == "reparametrize-swap":  # a tuple of the objects
            assert all(a is b for a, b in zip(after[name], before[name])), name
        else:
            assert after[name] is before[name], name
    assert "apply" not in tuc.CheckpointFunction.__dict__
    assert not ckpt_guard.is_installed()
    ckpt_guard.uninstall()  # twice is safe
    assert _patchable_objects() == before


def test_install_twice_replaces_configuration(guard):
    ckpt_guard.install("warn", rules={"CKG001": "off"})
    assert ckpt_guard.current_config() == "warn (rules: CKG001=off)"
    ckpt_guard.install("strict")
    assert ckpt_guard.current_config() == "strict"
    with pytest.raises(CheckpointCompositionError):
        _grad_over_checkpoint(use_reentrant=False)()


def test_uninstalled_is_raw_torch():
    ckpt_guard.uninstall()
    with pytest.raises(RuntimeError, match="saved tensor hooks") as info:
        _grad_over_checkpoint(use_reentrant=False)()
    assert not isinstance(info.value, CheckpointCompositionError)


def test_composable_module_imported_before_install_is_patched_and_restored():
    import torch.distributed._composable.checkpoint_activation as composable

    ckpt_guard.uninstall()
    original = getattr(composable, NON_REENTRANT_ATTRIBUTE)
    ckpt_guard.install("strict")
    try:
        assert getattr(composable, NON_REENTRANT_ATTRIBUTE) is getattr(tuc, NON_REENTRANT_ATTRIBUTE)
        assert getattr(composable, NON_REENTRANT_ATTRIBUTE) is not original
    finally:
        ckpt_guard.uninstall()
    assert getattr(composable, NON_REENTRANT_ATTRIBUTE) is original


# ---------------------------------------------------------------------------
# configuration


def test_default_policy_is_strict(guard):
    ckpt_guard.install()
    assert ckpt_guard.current_config() == "strict"


def test_environment_configures_install(guard, monkeypatch):
    monkeypatch.setenv("CKPT_GUARD_POLICY", " Warn ")
    monkeypatch.setenv("CKPT_GUARD_RULES", "ckg001=strict, CKG003=off,")
    ckpt_guard.install()
    assert ckpt_guard.current_config() == "warn (rules: CKG001=strict,CKG003=off)"


def test_argument_beats_environment(guard, monkeypatch):
    monkeypatch.setenv("CKPT_GUARD_POLICY", "warn")
    ckpt_guard.install("fallback", rules={})
    assert ckpt_guard.current_config() == "fallback"


@pytest.mark.parametrize(
    "kwargs, env, expected",
    [
        ({"policy": "loud"}, {}, r"unknown policy 'loud' from argument 'policy'; valid choices: off, warn, fallback, strict"),
        ({}, {"CKPT_GUARD_POLICY": "bogus"}, r"unknown policy 'bogus' from environment variable CKPT_GUARD_POLICY; valid choices: off, warn, fallback, strict"),
        ({"rules": {"CKG999": "warn"}}, {}, r"unknown rule id 'CKG999' from argument 'rules'; valid rule ids: CKG001, "),
        ({"rules": {"CKG001": "maybe"}}, {}, r"unknown policy 'maybe' from argument 'rules'\['CKG001'\]; valid choices"),
        ({}, {"CKPT_GUARD_RULES": "CKG001"}, r"malformed rule override 'CKG001' in environment variable CKPT_GUARD_RULES='CKG001'; expected ID=POLICY"),
        ({}, {"CKPT_GUARD_RULES": "CKG001=warn,=strict"}, r"malformed rule override '=strict' in environment variable CKPT_GUARD_RULES"),
        ({}, {"CKPT_GUARD_RULES": "NOPE=warn"}, r"unknown rule id 'NOPE' from environment variable CKPT_GUARD_RULES; valid rule ids"),
        ({}, {"CKPT_GUARD_RULES": "CKG002=loud"}, r"unknown policy 'loud' from environment variable CKPT_GUARD_RULES \(rule CKG002\)"),
        ({"rules": ["CKG001"]}, {}, r"argument 'rules' must be a mapping of rule id to policy"),
        ({}, {"CKPT_GUARD_RULES": "CKG001=warn,ckg001=off"}, r"rule CKG001 is given two policies in environment variable CKPT_GUARD_RULES='CKG001=warn,ckg001=off': warn and off; give it one"),
        ({"rules": {"CKG001": "warn", "ckg001": "off"}}, {}, r"rule CKG001 is given two policies in argument 'rules' \(keys that differ only in case\): warn and off"),
    ],
)
def test_configuration_errors(monkeypatch, kwargs, env, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ckpt_guard.uninstall()
    with pytest.raises(ValueError, match=expected):
        ckpt_guard.install(**kwargs)
    assert not ckpt_guard.is_installed()


def test_policy_scope_errors_and_restores():
    with pytest.raises(ValueError, match="unknown policy 'nope' from argument 'policy'"):
        with ckpt_guard.policy("nope"):
            pass
    ckpt_guard.install("warn")
    try:
        with ckpt_guard.policy("strict", rules={"CKG002": "off"}):
            assert ckpt_guard.current_config() == "strict (rules: CKG002=off)"
        assert ckpt_guard.current_config() == "warn"
    finally:
        ckpt_guard.uninstall()


def test_policy_scopes_are_private_to_threads(guard):
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name, policy):
        with ckpt_guard.policy(policy):
            barrier.wait()
            seen[name] = ckpt_guard.current_config()
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(n, p)) for n, p in (("a", "warn"), ("b", "off"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "warn", "b": "off"}
    assert ckpt_guard.current_config() == "strict"


def test_rule_table_is_complete():
    assert list(RULE_IDS) == [r.id for r in ckpt_guard.rules()]
    assert len(set(RULE_IDS)) == len(RULE_IDS)
    for rule in ckpt_guard.rules():
        for attribute in ("id", "title", "trigger", "symptom", "remedy", "torch_versions", "fallback"):
            assert getattr(rule, attribute), (rule.id, attribute)
        assert rule.symptom_kind in ("raises", "silently wrong")
        assert rule.stage in ("call", "recompute", "transform")
        assert rule.raises_match or all(rule.symptom_for(v) != "raises" for v in rule.variants)


# ---------------------------------------------------------------------------
# robustness


# A torch whose layout the guard does not know, simulated: the non-reentrant
# choke point (under either layout's name) becomes a plain function, and
# optionally CheckpointFunction.apply a staticmethod.
_OTHER_LAYOUT = """
import warnings, torch
import torch.utils.checkpoint as tuc
for name in ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator"):
    if hasattr(tuc, name):
        original = getattr(tuc, name)
        setattr(tuc, name, (lambda original: lambda *a, **k: original(*a, **k))(original))
if NO_REENTRANT_EITHER:
    raw_apply = tuc.CheckpointFunction.apply
    tuc.CheckpointFunction.apply = staticmethod(lambda *a: raw_apply(*a))
import ckpt_guard
"""


def test_missing_choke_point_warns_once_naming_what_stays_unguarded():
    result = _run(
        _OTHER_LAYOUT.replace("NO_REENTRANT_EITHER", "False")
        + """
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    ckpt_guard.install("strict")
notes = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
print(len(notes))
print(notes[0])
from ckpt_guard import _patch
print(_patch.interception())
try:
    torch.func.vmap(lambda t: tuc.checkpoint(torch.sin, t, use_reentrant=True))(torch.randn(2, 3))
except ckpt_guard.CheckpointCompositionError as e:
    print("still guarded", e.rule.id)
try:
    torch.func.grad(lambda t: tuc.checkpoint(torch.sin, t, use_reentrant=False).sum())(torch.randn(3))
except RuntimeError as e:
    print("unguarded:", type(e).__name__)
"""
    )
    lines = result.stdout.splitlines()
    assert lines and lines[0] == "1", result.stdout + result.stderr
    assert "cannot patch part of torch.utils.checkpoint" in lines[1]
    assert "these stay unguarded: checkpoint(use_reentrant=False)" in lines[1]
    assert "the composable checkpoint(module)" in lines[1]
    assert "is not a generator function" in lines[1]
    assert lines[2].startswith("PARTIAL: reentrant via CheckpointFunction.apply; NOT guarded: non-reentrant"), lines[2]
    assert lines[3] == "still guarded CKG002"
    assert lines[4] == "unguarded: RuntimeError"  # torch's own error, the guard stepped aside


def test_no_choke_point_strict_raises_one_clear_error():
    result = _run(
        _OTHER_LAYOUT.replace("NO_REENTRANT_EITHER", "True")
        + """
from ckpt_guard._patch import UnsupportedTorchError
try:
    ckpt_guard.install("strict")
except UnsupportedTorchError as e:
    print("raised", isinstance(e, RuntimeError), ckpt_guard.is_installed())
    print(e)
"""
    )
    lines = result.stdout.splitlines()
    assert lines and lines[0] == "raised True False", result.stdout + result.stderr
    message = lines[1]
    assert f"torch {torch.__version__} has no checkpoint choke point ckpt_guard knows" in message
    assert "non-reentrant checkpoint:" in message and "reentrant checkpoint: CheckpointFunction.apply is a staticmethod" in message
    assert "install a tested torch" in message and "(Raised because the policy is strict.)" in message


@pytest.mark.parametrize("policy", ["warn", "fallback"])
def test_no_choke_point_warns_once_under_other_policies(policy):
    result = _run(
        _OTHER_LAYOUT.replace("NO_REENTRANT_EITHER", "True")
        + f"""
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    ckpt_guard.install({policy!r})
    ckpt_guard.install({policy!r})  # reconfiguring does not warn again
notes = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
print(len(notes))
print(notes[0])
from ckpt_guard import _patch
print(_patch.interception())
"""
    )
    lines = result.stdout.splitlines()
    assert lines and lines[0] == "1", result.stdout + result.stderr
    assert "no checkpoint call would be guarded" in lines[1]
    assert "Everything else is guarded" not in lines[1]
    assert lines[2].startswith("NOT WORKING, nothing is guarded: ")


def test_unsupported_torch_version_is_one_clear_error():
    from ckpt_guard._patch import check_torch_version

    with pytest.raises(RuntimeError, match=r"torch 2\.1\.0 \(torch.__version__\) is not supported; ckpt_guard needs torch >= 2\.4"):
        check_torch_version("2.1.0")
    check_torch_version("2.13.0+cpu")
    check_torch_version("3.0.0a0+git123")


def test_install_uninstall_from_threads_while_training():
    """Concurrent install/uninstall/policy while other threads run checkpointed steps."""
    ckpt_guard.uninstall()
    swap_hook_point_before = _swap_hook_point_now()
    torch.manual_seed(0)
    block = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(block(x).sum(), [x, *block.parameters()])
    errors: list = []
    stop = threading.Event()

    def train(use_reentrant):
        try:
            while not stop.is_set():
                with ckpt_guard.policy("strict"):
                    out = tuc.checkpoint(block, x, use_reentrant=use_reentrant)
                grads = torch.autograd.grad(out.sum(), [x, *block.parameters()]) if not use_reentrant else None
                if grads is not None:
                    for g, e in zip(grads, expected):
                        torch.testing.assert_close(g, e)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def toggle():
        try:
            for i in range(200):
                ckpt_guard.install("strict" if i % 2 else "warn")
                with ckpt_guard.policy("off"):
                    pass
                ckpt_guard.uninstall()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=train, args=(r,)) for r in (False, True)]
    togglers = [threading.Thread(target=toggle) for _ in range(2)]
    for t in workers + togglers:
        t.start()
    for t in togglers:
        t.join()
    stop.set()
    for t in workers:
        t.join()
    assert errors == []
    ckpt_guard.uninstall()
    assert "apply" not in tuc.CheckpointFunction.__dict__
    import torch.nn.utils.stateless as stateless

    assert getattr(tuc, NON_REENTRANT_ATTRIBUTE).__name__ == NON_REENTRANT_ATTRIBUTE
    assert not hasattr(getattr(tuc, NON_REENTRANT_ATTRIBUTE), "__ckpt_guard_original__")
    assert _swap_hook_point(stateless) == swap_hook_point_before


def test_errors_and_warnings_are_public_and_picklable():
    """Tracebacks name ckpt_guard.CheckpointCompositionError; both survive pickling
    (multiprocessing and distributed launchers send exceptions between processes)."""
    import pickle

    from ckpt_guard._rules import rule_by_id

    for cls, rule_id in ((ckpt_guard.CheckpointCompositionError, "CKG108"),
                         (ckpt_guard.CheckpointCompositionWarning, "CKG001")):  # CKG001 holds a lambda
        assert f"{cls.__module__}.{cls.__qualname__}" == f"ckpt_guard.{cls.__name__}"
        copy = pickle.loads(pickle.dumps(cls("the message", rule_by_id(rule_id))))
        assert type(copy) is cls and str(copy) == "the message" and copy.rule is rule_by_id(rule_id)


# --------------------------------------------------------------------------
# layouts recognised by what can be verified (signature), not by version


def _generator_module(signature: str):
    namespace: dict = {}
    exec(f"def _checkpoint_without_reentrant_generator{signature}:\n    yield\n", namespace)
    return types.SimpleNamespace(_checkpoint_without_reentrant_generator=namespace["_checkpoint_without_reentrant_generator"])


@pytest.mark.parametrize("signature, layout", [
    ("(fn, preserve_rng_state=True, context_fn=None, determinism_check='default', debug=False, *args, **kwargs)",
     "generator"),
    ("(fn, preserve_rng_state=True, context_fn=None, determinism_check='default', debug=False, early_stop=True, "
     "*args, **kwargs)", "generator"),
    # torch main after 2.15 (read in upstream's source): the old name with the new signature
    ("(fn, args, kwargs, *, preserve_rng_state=True, context_fn=None, determinism_check='default', debug=False, "
     "early_stop=True)", "generator_args_kwargs"),
])
def test_non_reentrant_layout_is_recognised_by_its_signature(signature, layout):
    found, _ = find_non_reentrant(_generator_module(signature))
    assert found.name == layout


def test_an_unknown_signature_is_reported_not_half_guarded():
    from ckpt_guard._layouts import Unsupported

    with pytest.raises(Unsupported, match="_checkpoint_without_reentrant_generator"):
        find_non_reentrant(_generator_module("(fn, inputs, *, preserve_rng_state=True)"))


def _install_warnings(*calls) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for policy in calls:
            ckpt_guard.install(policy)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "ckpt_guard.install" in str(w.message)]


def test_a_second_install_with_another_policy_says_it_replaces_the_first():
    ckpt_guard.uninstall()
    try:
        said = _install_warnings("strict", "strict", "fallback")
        assert len(said) == 1, said  # the same policy again is no change
        assert "replacing the configuration installed earlier (strict, set by install()) with fallback" in said[0]
        assert "ckpt_guard.uninstall() first" in said[0]
        assert ckpt_guard.current_config() == "fallback"  # it still replaces it
        ckpt_guard.uninstall()
        assert _install_warnings("warn") == []  # after uninstall(): nothing is replaced
    finally:
        ckpt_guard.uninstall()


def test_an_explicit_policy_says_a_malformed_environment_policy_goes_unread(monkeypatch):
    ckpt_guard.uninstall()
    monkeypatch.setenv("CKPT_GUARD_POLICY", "fallbak")
    try:
        said = _install_warnings("fallback")
        assert len(said) == 1, said
        assert "CKPT_GUARD_POLICY='fallbak' is not a policy" in said[0]
        assert "off, warn, fallback, strict" in said[0]
        assert ckpt_guard.current_config() == "fallback"
        ckpt_guard.uninstall()
        with pytest.raises(ValueError, match="fallbak"):  # without the argument it is read, and refused
            ckpt_guard.install()
        monkeypatch.setenv("CKPT_GUARD_POLICY", "strict")  # a valid one the argument overrides: no word
        assert _install_warnings("fallback") == []
    finally:
        ckpt_guard.uninstall()
