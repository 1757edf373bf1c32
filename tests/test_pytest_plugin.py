"""The pytest plugin (ckpt_guard._pytest_plugin), driven through pytester.

Every inner session runs in a subprocess: installing the guard is
process-global, and "the plugin does not import torch" can only be observed in
a fresh interpreter.  Most inner sessions never import torch (the guard can be
installed before torch is imported), so they are cheap; one imports torch to
check real decisions end to end.
"""

from __future__ import annotations

import importlib.metadata

import pytest

import ckpt_guard._pytest_plugin as plugin_module

pytest_plugins = ["pytester"]

ENTRY_POINT_NAME = "ckpt_guard"


def _entry_point():
    eps = importlib.metadata.entry_points()
    group = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", [])
    return next((ep for ep in group if ep.name == ENTRY_POINT_NAME), None)


# Once the entry point is registered, "-p ckpt_guard._pytest_plugin" would load
# the module a second time under another name (pluggy refuses: "Plugin already
# registered under a different name"), so name the entry point instead.
PLUGIN_ARGS = (
    ("-p", ENTRY_POINT_NAME) if _entry_point() is not None else ("-p", "ckpt_guard._pytest_plugin")
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("CKPT_GUARD_POLICY", raising=False)
    monkeypatch.delenv("CKPT_GUARD_RULES", raising=False)
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)


# Third-party plugins of this environment that cost time and have nothing to do
# with the guard (hypothesis's plugin imports hypothesis: ~0.5 s per session).
QUIET_ARGS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")


def run(pytester, *args):
    return pytester.runpytest_subprocess(*PLUGIN_ARGS, *QUIET_ARGS, *args)


def write_config_probe(pytester, expected_config, installed=True):
    """A test module that checks the guard's state inside the inner session."""
    pytester.makepyfile(
        test_probe=f"""
        import ckpt_guard

        def test_session_config():
            assert ckpt_guard.is_installed() is {installed!r}
            assert ckpt_guard.current_config() == {expected_config!r}
        """
    )


# --------------------------------------------------------------------------
# enabling, precedence, header, session end


def test_option_enables_and_session_end_uninstalls(pytester):
    write_config_probe(pytester, "warn (rules: CKG003=off)")
    # Runs after the plugin's pytest_unconfigure (conftest hooks run first unless trylast).
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(trylast=True)
        def pytest_unconfigure(config):
            import ckpt_guard
            with open("after_session.txt", "w") as f:
                f.write(f"{ckpt_guard.is_installed()} {ckpt_guard.current_config()}")
        """
    )
    result = run(pytester, "--ckpt-guard=warn", "--ckpt-guard-rules=CKG003=off")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["ckpt_guard: warn (rules: CKG003=off) (from --ckpt-guard, --ckpt-guard-rules)"]
    )
    assert (pytester.path / "after_session.txt").read_text() == "False off"


def test_session_end_restores_a_guard_installed_before_the_session(pytester):
    write_config_probe(pytester, "strict")
    pytester.makeconftest(
        """
        import pytest
        import ckpt_guard

        ckpt_guard.install("warn", rules={"CKG001": "off"})  # before pytest_configure

        @pytest.hookimpl(trylast=True)
        def pytest_unconfigure(config):
            with open("after_session.txt", "w") as f:
                f.write(f"{ckpt_guard.is_installed()} {ckpt_guard.current_config()}")
        """
    )
    result = run(pytester, "--ckpt-guard=strict")
    result.assert_outcomes(passed=1)
    assert (pytester.path / "after_session.txt").read_text() == "True warn (rules: CKG001=off)"


def test_ini_enables(pytester):
    pytester.makeini(
        """
        [pytest]
        ckpt_guard = fallback
        ckpt_guard_rules = CKG001=warn, CKG002=off
        """
    )
    write_config_probe(pytester, "fallback (rules: CKG001=warn,CKG002=off)")
    result = run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "ckpt_guard: fallback (rules: CKG001=warn,CKG002=off) "
            "(from ini option ckpt_guard, ini option ckpt_guard_rules)"
        ]
    )


def test_env_enables(pytester, monkeypatch):
    monkeypatch.setenv("CKPT_GUARD_POLICY", "Strict")
    monkeypatch.setenv("CKPT_GUARD_RULES", "ckg101=warn")
    write_config_probe(pytester, "strict (rules: CKG101=warn)")
    result = run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "ckpt_guard: strict (rules: CKG101=warn) (from environment variable "
            "CKPT_GUARD_POLICY, environment variable CKPT_GUARD_RULES)"
        ]
    )


@pytest.mark.parametrize(
    "ini, env, cli, expected",
    [
        pytest.param(
            ("warn", "CKG001=off"),
            ("fallback", "CKG002=off"),
            ("strict", "CKG003=off"),
            "strict (rules: CKG003=off)",
            id="option-beats-env-and-ini",
        ),
        pytest.param(
            ("warn", "CKG001=off"),
            ("fallback", "CKG002=off"),
            (None, None),
            "fallback (rules: CKG002=off)",
            id="env-beats-ini",
        ),
        pytest.param(
            ("warn", "CKG001=off"),
            (None, None),
            ("strict", None),
            "strict (rules: CKG001=off)",
            id="policy-and-rules-resolved-separately",
        ),
    ],
)
def test_precedence(pytester, monkeypatch, ini, env, cli, expected):
    pytester.makeini(f"[pytest]\nckpt_guard = {ini[0]}\nckpt_guard_rules = {ini[1]}\n")
    for name, value in zip(("CKPT_GUARD_POLICY", "CKPT_GUARD_RULES"), env):
        if value is not None:
            monkeypatch.setenv(name, value)
    args = []
    if cli[0] is not None:
        args.append(f"--ckpt-guard={cli[0]}")
    if cli[1] is not None:
        args.append(f"--ckpt-guard-rules={cli[1]}")
    pytester.makepyfile(
        test_precedence=f"""
        import pytest
        import ckpt_guard

        def test_session():
            assert ckpt_guard.is_installed()
            assert ckpt_guard.current_config() == {expected!r}

        # the marker beats everything, and session overrides do not leak into it
        @pytest.mark.ckpt_guard("off", rules={{"CKG005": "warn"}})
        def test_marker_beats_all():
            assert ckpt_guard.current_config() == "off (rules: CKG005=warn)"
        """
    )
    result = run(pytester, "--strict-markers", *args)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"ckpt_guard: {expected} (from *)"])


#: what the header adds where the fixture would enable the guard itself
NOTE = "; tests that use ckpt_guard_events run under warn"


@pytest.mark.parametrize(
    "args, env, header",
    [
        pytest.param([], {}, "ckpt_guard: not enabled" + NOTE, id="nothing"),
        pytest.param(
            [],
            {"CKPT_GUARD_RULES": "CKG001=warn"},
            "ckpt_guard: not enabled (overrides from environment variable CKPT_GUARD_RULES "
            "ignored: no policy from --ckpt-guard, CKPT_GUARD_POLICY or ini option ckpt_guard)" + NOTE,
            id="rules-alone",
        ),
        pytest.param(
            ["--ckpt-guard=off"],
            {"CKPT_GUARD_POLICY": "strict"},
            "ckpt_guard: off (from --ckpt-guard); guard not installed" + NOTE,
            id="off",
        ),
    ],
)
def test_not_enabled_imports_no_torch_and_installs_nothing(pytester, monkeypatch, args, env, header):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile(
        test_cost="""
        import sys

        def test_nothing_loaded():
            assert "torch" not in sys.modules
            assert "wrapt" not in sys.modules  # needed only to install before torch
            assert "ckpt_guard._patch" not in sys.modules  # nor the patching machinery
            guard = sys.modules.get("ckpt_guard")
            assert guard is None or not guard.is_installed()
        """
    )
    result = run(pytester, *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([header])


# --------------------------------------------------------------------------
# the marker


def test_marker_installs_for_one_test_and_works_with_strict_markers(pytester):
    pytester.makepyfile(
        test_marker="""
        import pytest
        import ckpt_guard

        @pytest.mark.ckpt_guard("warn", rules={"CKG003": "off"})
        def test_marked():
            assert ckpt_guard.is_installed()
            assert ckpt_guard.current_config() == "warn (rules: CKG003=off)"

        def test_after_marked():
            assert not ckpt_guard.is_installed()
            assert ckpt_guard.current_config() == "off"

        @pytest.mark.ckpt_guard(rules="CKG001=warn")
        def test_policy_defaults_to_strict():
            assert ckpt_guard.current_config() == "strict (rules: CKG001=warn)"

        @pytest.mark.ckpt_guard("fallback")
        class TestClass:
            def test_class_marker(self):
                assert ckpt_guard.current_config() == "fallback"

            @pytest.mark.ckpt_guard(policy="warn")
            def test_closest_marker_wins(self):
                assert ckpt_guard.current_config() == "warn"

        @pytest.mark.ckpt_guard("loud")
        def test_bad_marker():
            pass
        """
    )
    result = run(pytester, "--strict-markers")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(
        [
            "ckpt_guard: not enabled" + NOTE,
            "*unknown policy 'loud' from @pytest.mark.ckpt_guard on "
            "test_marker.py::test_bad_marker; valid choices: off, warn, fallback, strict*",
        ]
    )


# --------------------------------------------------------------------------
# real decisions (imports torch: one inner session for all of them)


def test_real_decisions_strict_option_and_events_fixture(pytester):
    pytester.makepyfile(
        test_compose="""
        import pytest
        import torch
        from torch.utils.checkpoint import checkpoint

        import ckpt_guard

        def bad_composition():
            return torch.func.grad(
                lambda t: checkpoint(lambda u: u.sin(), t, use_reentrant=False).sum()
            )(torch.randn(3))

        def test_strict_session_fails():
            bad_composition()

        def test_strict_session_records(ckpt_guard_events):
            with pytest.raises(ckpt_guard.CheckpointCompositionError):
                bad_composition()
            assert [(e.rule_id, e.policy, e.action) for e in ckpt_guard_events] == [
                ("CKG001", "strict", "raised")
            ]

        @pytest.mark.ckpt_guard("warn")
        def test_warn_marker_records(ckpt_guard_events):
            with pytest.warns(ckpt_guard.CheckpointCompositionWarning, match="CKG001"):
                with pytest.raises(RuntimeError) as info:
                    bad_composition()  # warned, then torch's own error
            assert not isinstance(info.value, ckpt_guard.CheckpointCompositionError)
            assert [e.rule_id for e in ckpt_guard_events] == ["CKG001"]
            (event,) = ckpt_guard_events
            assert event.policy == "warn"
            assert event.action == "warned"
            assert event.stage == "call"
            assert "test_compose.py" in event.call_site
        """
    )
    result = run(pytester, "--ckpt-guard=strict", "--strict-markers")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "ckpt_guard: strict (from --ckpt-guard)",
            "E * ckpt_guard.CheckpointCompositionError: [[]CKG001[]] *",
            "FAILED test_compose.py::test_strict_session_fails - *",
        ]
    )


# --------------------------------------------------------------------------
# bad values


@pytest.mark.parametrize(
    "args, env, ini, message",
    [
        pytest.param(
            ["--ckpt-guard=bogus"],
            {},
            None,
            "ckpt_guard: unknown policy 'bogus' from --ckpt-guard; "
            "valid choices: off, warn, fallback, strict",
            id="option",
        ),
        pytest.param(
            [],
            {"CKPT_GUARD_POLICY": "bogus"},
            None,
            "ckpt_guard: unknown policy 'bogus' from environment variable CKPT_GUARD_POLICY;*",
            id="env",
        ),
        pytest.param(
            [],
            {},
            "ckpt_guard = bogus",
            "ckpt_guard: unknown policy 'bogus' from ini option ckpt_guard;*",
            id="ini",
        ),
        pytest.param(
            ["--ckpt-guard=warn", "--ckpt-guard-rules=CKG001"],
            {},
            None,
            "ckpt_guard: malformed rule override 'CKG001' in --ckpt-guard-rules='CKG001';*",
            id="malformed-rules-option",
        ),
        pytest.param(
            ["--ckpt-guard=warn"],
            {"CKPT_GUARD_RULES": "CKG001=loud"},
            None,
            "ckpt_guard: unknown policy 'loud' from environment variable CKPT_GUARD_RULES "
            "(rule CKG001);*",
            id="bad-rule-policy-env",
        ),
        pytest.param(
            [],
            {},
            "ckpt_guard = warn\nckpt_guard_rules = CKG999=warn",
            "ckpt_guard: unknown rule id 'CKG999' from ini option ckpt_guard_rules;*",
            id="unknown-rule-ini",
        ),
        pytest.param(
            ["--ckpt-guard-rules=CKG999=warn"],
            {},
            None,
            "ckpt_guard: unknown rule id 'CKG999' from --ckpt-guard-rules;*",
            id="unknown-rule-without-policy",
        ),
    ],
)
def test_bad_value_is_a_usage_error(pytester, monkeypatch, args, env, ini, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if ini is not None:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_never_runs="def test_x(): pass")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])
    assert "Traceback" not in result.stderr.str()
    assert result.stderr.str().count("ERROR:") == 1
    result.stdout.no_fnmatch_line("*test_x*")


# --------------------------------------------------------------------------
# registration


@pytest.mark.skipif(
    _entry_point() is None,
    reason="pytest11 entry point 'ckpt_guard' not registered yet: add "
    '[project.entry-points.pytest11] ckpt_guard = "ckpt_guard._pytest_plugin" '
    "to pyproject.toml and reinstall (pip install -e .)",
)
def test_entry_point_registered_and_autoloaded(pytester):
    entry_point = _entry_point()
    assert entry_point.value == "ckpt_guard._pytest_plugin"
    assert entry_point.load() is plugin_module
    pytester.makepyfile(test_empty="def test_x(): pass")
    result = pytester.runpytest_subprocess(*QUIET_ARGS)  # no "-p ckpt_guard": autoloaded
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["ckpt_guard: not enabled" + NOTE])


def test_malformed_leftover_overrides_do_not_stop_an_unguarded_session(pytester, monkeypatch):
    """A bad CKPT_GUARD_RULES without any policy: the session runs, the header says why."""
    monkeypatch.setenv("CKPT_GUARD_RULES", "CKG999=warn")
    pytester.makepyfile(test_runs="def test_x(): pass")
    result = run(pytester)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "ckpt_guard: not enabled (overrides from environment variable CKPT_GUARD_RULES ignored: *"
        "; and malformed: ckpt_guard: unknown rule id 'CKG999'*",
    ])


# --------------------------------------------------------------------------
# the fixture always checks something

VACUOUS = """
import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import ckpt_guard


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False).sum()


def test_no_unsafe_composition(ckpt_guard_events):
    net = Net()
    params = {k: v.detach() * 2 for k, v in net.named_parameters()}
    functional_call(net, params, (torch.randn(2, 3, requires_grad=True),)).backward()  # CKG101
    assert ckpt_guard_events == []


def test_the_guard_is_gone_afterwards():
    assert ckpt_guard.is_installed() is INSTALLED_AFTER
"""


@pytest.mark.parametrize("args", [[], ["--ckpt-guard=off"]], ids=["nothing-enabled", "session-off"])
def test_events_fixture_checks_even_when_nothing_enabled_the_guard(pytester, args):
    """Before, this test passed whatever the composition did, unless a flag enabled the guard."""
    pytester.makepyfile(test_vacuous=VACUOUS.replace("INSTALLED_AFTER", "False"))
    result = run(pytester, "-p", "no:randomly", *args)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*Event(rule_id='CKG101', policy='warn', action='warned'*"])


def test_events_fixture_keeps_the_sessions_own_policy(pytester):
    pytester.makepyfile(test_vacuous=VACUOUS.replace("INSTALLED_AFTER", "True"))
    result = run(pytester, "-p", "no:randomly", "--ckpt-guard=strict")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*CheckpointCompositionError: [[]CKG101[]]*"])


# --------------------------------------------------------------------------
# fix lines name the channel that set the policy (option, ini, variable, marker)

_CKG001_TEST = '''
import torch
from torch.utils.checkpoint import checkpoint
import ckpt_guard

def loss(t):
    return checkpoint(torch.sin, t, use_reentrant=False).sum()

def test_it(request):
    try:
        torch.func.grad(loss)(torch.randn(3))
    except ckpt_guard.CheckpointCompositionError as exc:
        (request.config.rootpath / "message.txt").write_text(str(exc))
'''


@pytest.mark.parametrize("how, expected, not_expected", [
    (("--ckpt-guard=strict",), "--ckpt-guard-rules=CKG001=fallback", "ckpt_guard.install("),
    (("ini",), "ini ckpt_guard_rules = CKG001=fallback", "ckpt_guard.install("),
    (("env",), "CKPT_GUARD_RULES=CKG001=fallback", "ckpt_guard.install("),
    (("marker",), "@pytest.mark.ckpt_guard(..., rules={'CKG001': 'fallback'", "ckpt_guard.policy("),
])
def test_fix_lines_name_the_pytest_channel(pytester, monkeypatch, how, expected, not_expected):
    source = _CKG001_TEST
    args = []
    if how == ("ini",):
        pytester.makeini("[pytest]\nckpt_guard = strict\n")
    elif how == ("env",):
        monkeypatch.setenv("CKPT_GUARD_POLICY", "strict")
    elif how == ("marker",):
        source = source.replace("def test_it(", "import pytest\n\n@pytest.mark.ckpt_guard('strict')\ndef test_it(")
    else:
        args = list(how)
    pytester.makepyfile(source)
    result = run(pytester, *args)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    message = (pytester.path / "message.txt").read_text()
    assert expected in message, message
    assert not_expected not in message, message
