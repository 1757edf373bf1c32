"""install / uninstall / configuration: entry points, identity, errors, robustness."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc

import ckpt_guard
from ckpt_guard import CheckpointCompositionError
from ckpt_guard._rules import RULE_IDS

PYTHON = sys.executable


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
    return {
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


@pytest.mark.parametrize("entry", list(_entry_points()))
def test_every_entry_point_is_guarded(guard, entry):
    call, rule_id = _entry_points()[entry]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCompositionError) as info:
            torch.func.grad(lambda t: call(t).sum())(torch.randn(2, 3))
    assert info.value.rule.id == rule_id


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
        "generator": tuc._checkpoint_without_reentrant_generator,
        "apply-in-class-dict": tuc.CheckpointFunction.__dict__.get("apply"),
        "warnings": tuc.warnings,
        "reparametrize": stateless._reparametrize_module,
        "reparametrize-cell": stateless._reparametrize_module.__closure__[0].cell_contents,
        "checkpoint": tuc.checkpoint,
    }


def test_uninstall_restores_identity():
    ckpt_guard.uninstall()
    before = _patchable_objects()
    ckpt_guard.install("strict")
    during = _patchable_objects()
    assert during["generator"] is not before["generator"]
    assert during["apply-in-class-dict"] is not None
    assert during["reparametrize-cell"] is not before["reparametrize-cell"]
    assert during["checkpoint"] is before["checkpoint"]  # never touched: dynamo matches it by identity
    assert during["reparametrize"] is before["reparametrize"]
    ckpt_guard.uninstall()
    after = _patchable_objects()
    for name in before:
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
    original = composable._checkpoint_without_reentrant_generator
    ckpt_guard.install("strict")
    try:
        assert composable._checkpoint_without_reentrant_generator is tuc._checkpoint_without_reentrant_generator
        assert composable._checkpoint_without_reentrant_generator is not original
    finally:
        ckpt_guard.uninstall()
    assert composable._checkpoint_without_reentrant_generator is original


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
        assert rule.stage in ("call", "recompute")
        assert rule.raises_match or all(rule.symptom_for(v) != "raises" for v in rule.variants)


# ---------------------------------------------------------------------------
# robustness


def test_missing_choke_point_warns_once_and_the_rest_still_works():
    result = _run(
        """
        import warnings, torch
        import torch.utils.checkpoint as tuc
        original = tuc._checkpoint_without_reentrant_generator

        def other_layout(fn, *args, **kwargs):  # as if another torch reorganised it
            return original(fn, *args, **kwargs)

        tuc._checkpoint_without_reentrant_generator = other_layout
        import ckpt_guard
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            ckpt_guard.install("strict")
        notes = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
        print(len(notes))
        print(notes[0])
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
    assert lines[0] == "1", result.stdout + result.stderr
    assert "cannot patch torch.utils.checkpoint._checkpoint_without_reentrant_generator" in lines[1]
    assert "(not a generator function); calls through it stay unguarded" in lines[1]
    assert lines[2] == "still guarded CKG002"
    assert lines[3] == "unguarded: RuntimeError"  # torch's own error, the guard stepped aside


def test_unsupported_torch_version_is_one_clear_error():
    from ckpt_guard._patch import check_torch_version

    with pytest.raises(RuntimeError, match=r"torch 2\.1\.0 \(torch.__version__\) is not supported; ckpt_guard needs torch >= 2\.4"):
        check_torch_version("2.1.0")
    check_torch_version("2.13.0+cpu")
    check_torch_version("3.0.0a0+git123")


def test_install_uninstall_from_threads_while_training():
    """Concurrent install/uninstall/policy while other threads run checkpointed steps."""
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

    assert tuc._checkpoint_without_reentrant_generator.__name__ == "_checkpoint_without_reentrant_generator"
    assert not hasattr(tuc._checkpoint_without_reentrant_generator, "__ckpt_guard_original__")
    assert not hasattr(stateless._reparametrize_module.__closure__[0].cell_contents, "__ckpt_guard_original__")


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
