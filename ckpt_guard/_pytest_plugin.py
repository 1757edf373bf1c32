"""pytest plugin: run a test session (or one test) under the checkpoint guard.

Registered as the ``pytest11`` entry point ``ckpt_guard``, so pytest loads it
in every session of an environment where ckpt_guard is installed.  It does
nothing, and costs nothing, unless something enables it.

Enabling the guard for the session
----------------------------------

A base policy (``off``, ``warn``, ``fallback`` or ``strict``) from any of

* the command-line option ``--ckpt-guard=POLICY``,
* the environment variable ``CKPT_GUARD_POLICY``,
* the ini key ``ckpt_guard`` (``pytest.ini``, ``tox.ini``, ``setup.cfg`` or
  ``[tool.pytest.ini_options]`` in ``pyproject.toml``)

installs the guard when the session starts (``pytest_configure``) and
uninstalls it when the session ends (``pytest_unconfigure``).  Per-rule
overrides, ``ID=POLICY[,ID=POLICY...]`` (e.g. ``CKG001=warn,CKG003=off``),
come from ``--ckpt-guard-rules``, ``CKPT_GUARD_RULES`` or the ini key
``ckpt_guard_rules``.  Overrides alone do not enable the guard: without a base
policy from one of the three sources above the session stays unguarded (the
header says the overrides were ignored).  If the resulting configuration does
nothing (``off`` with no override turning a rule on), the guard is not
installed at all.

Precedence
----------

**marker > command line > environment > ini.**  The base policy and the
overrides are resolved separately: each comes from the highest-precedence
source that sets it, so ``--ckpt-guard=strict`` keeps the overrides of the
ini file.  A blank environment variable or ini value counts as unset; a blank
command-line value is an error.

The marker ``@pytest.mark.ckpt_guard(policy="strict", rules=None)`` pins the
*whole* configuration for one test, exactly as ``with ckpt_guard.policy(policy,
rules=rules)`` does: the session's overrides do not leak into it, and an
omitted ``policy`` means ``"strict"``, so a marked test behaves the same
whatever the command line, environment or ini say.  ``rules`` is a mapping
``{"CKG003": "warn"}`` or a string ``"CKG003=warn"``.  The scope covers the
test function call (``pytest_runtest_call``), not fixture setup or teardown.
If the session did not install the guard, the marker installs it for that
test call and uninstalls it afterwards.  The closest marker wins (function
over class over module).  The marker is registered, so it works with
``--strict-markers``.

Other pieces
------------

* The fixture ``ckpt_guard_events`` is the list from ``ckpt_guard.record()``
  held open for the test (setup, call and teardown): one
  :class:`ckpt_guard.Event` (``rule_id``, ``policy``, ``action``,
  ``call_site``, ``stage``) per decision the guard made.  Where nothing
  enabled the guard (or the session is ``off``), the fixture installs it under
  ``warn`` for that test, so ``assert ckpt_guard_events == []`` never passes
  without checking: ``warn`` records every decision and changes nothing torch
  does.  A marker still decides the policy of the test call.
* The header reports the configuration in force, e.g.
  ``ckpt_guard: strict (from --ckpt-guard)`` or ``ckpt_guard: not enabled``.
* A bad value (unknown policy, malformed or unknown override) fails the
  session with one usage error (exit code 4) naming its source.  A bad marker
  fails the test that carries it.

Cost when not enabled
---------------------

At top level this module imports only the standard library and pytest
(already imported: it runs inside pytest).  It imports neither torch nor
anything else until a source enables the guard (or a test uses the marker or
the fixture).  Importing it does execute the torch-free
``ckpt_guard/__init__.py``, as every submodule import of a package does.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Generator, List, Optional, Tuple

import pytest

_POLICY_OPTION = "--ckpt-guard"
_RULES_OPTION = "--ckpt-guard-rules"
_POLICY_INI = "ckpt_guard"
_RULES_INI = "ckpt_guard_rules"
# Same as ckpt_guard._config.ENV_POLICY / ENV_RULES, written out so that the
# top level imports nothing from ckpt_guard.
_POLICY_ENV = "CKPT_GUARD_POLICY"
_RULES_ENV = "CKPT_GUARD_RULES"
_MARKER = "ckpt_guard"


class _SessionState:
    """What ``pytest_configure`` resolved and did, for the header and unconfigure."""

    def __init__(self) -> None:
        self.policy_source: Optional[str] = None
        self.rules_source: Optional[str] = None
        self.description: Optional[str] = None  # Config.describe() once validated
        self.active = False
        self.installed_by_plugin = False
        self.previous_config: Any = None  # a Config to restore, if one was installed before
        self.ignored_error: Optional[str] = None  # why ignored overrides were malformed


_STATE_KEY = pytest.StashKey[_SessionState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ckpt_guard", "activation checkpointing guard (ckpt_guard)")
    group.addoption(
        _POLICY_OPTION,
        action="store",
        dest="ckpt_guard",
        default=None,
        metavar="POLICY",
        help="install the checkpoint guard for the session with this policy: "
        "off, warn, fallback or strict (overrides $CKPT_GUARD_POLICY and the "
        "ini key ckpt_guard).",
    )
    group.addoption(
        _RULES_OPTION,
        action="store",
        dest="ckpt_guard_rules",
        default=None,
        metavar="ID=POLICY[,ID=POLICY...]",
        help="per-rule policy overrides, e.g. CKG001=warn,CKG003=off "
        "(overrides $CKPT_GUARD_RULES and the ini key ckpt_guard_rules).",
    )
    parser.addini(
        _POLICY_INI,
        "install the checkpoint guard for the session with this policy "
        "(off, warn, fallback, strict); --ckpt-guard and $CKPT_GUARD_POLICY win.",
        default="",
    )
    parser.addini(
        _RULES_INI,
        "per-rule checkpoint guard overrides, ID=POLICY[,ID=POLICY...]; "
        "--ckpt-guard-rules and $CKPT_GUARD_RULES win.",
        default="",
    )


def _resolve(
    config: pytest.Config, dest: str, option: str, env: str, ini: str
) -> Tuple[Optional[str], Optional[str]]:
    """(value, source) from the highest-precedence source that sets it, else (None, None)."""
    value = config.getoption(dest)
    if value is not None:
        return value, option
    value = os.environ.get(env, "")
    if value.strip():
        return value, f"environment variable {env}"
    value = config.getini(ini)
    if isinstance(value, str) and value.strip():
        return value, f"ini option {ini}"
    return None, None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(policy='strict', *, rules=None): run this test under the checkpoint "
        "guard with this policy and per-rule overrides (a mapping or 'ID=POLICY,...'), "
        "like `with ckpt_guard.policy(policy, rules=rules)`; installs the guard for the "
        "test if the session did not.",
    )
    state = _SessionState()
    config.stash[_STATE_KEY] = state

    policy_value, state.policy_source = _resolve(
        config, "ckpt_guard", _POLICY_OPTION, _POLICY_ENV, _POLICY_INI
    )
    rules_value, state.rules_source = _resolve(
        config, "ckpt_guard_rules", _RULES_OPTION, _RULES_ENV, _RULES_INI
    )
    if policy_value is None:
        if rules_value is not None:  # not enabled: the overrides are ignored, but checked
            from . import _config  # torch-free

            try:
                _config.parse_rules_spec(rules_value, state.rules_source)
            except ValueError as exc:
                if state.rules_source == _RULES_OPTION:
                    raise pytest.UsageError(str(exc)) from None  # given for this very run
                # a leftover environment or ini value must not stop an unguarded session
                state.ignored_error = str(exc)
        return  # not enabled: install nothing

    from . import _config  # torch-free; only now that the guard is enabled

    try:
        base = _config.check_policy(policy_value, state.policy_source)
        overrides = (
            _config.parse_rules_spec(rules_value, state.rules_source)
            if rules_value is not None
            else {}
        )
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    session_config = _config.Config(base, overrides)
    state.description = session_config.describe()
    state.active = session_config.active
    if not state.active:
        return  # "off" with nothing turned on: nothing to install

    import ckpt_guard

    if ckpt_guard.is_installed():
        state.previous_config = _config.current()  # no scope is open here
    from . import _patch

    # explicit values (the environment is not re-read), and the channel that set them, so that a
    # message's fix lines name the pytest option, ini key or variable, not install()
    _patch.install(_config.Config(base, overrides, _source_key(state.rules_source or state.policy_source)))
    state.installed_by_plugin = state.previous_config is None


def _source_key(description: Optional[str]) -> str:
    """The message channel (``_config.how_to_set``) of a ``_resolve`` source description."""
    if description in (_POLICY_OPTION, _RULES_OPTION):
        return "pytest-option"
    if description is not None and description.startswith("ini option"):
        return "pytest-ini"
    return "env"


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is None or not state.active:
        return
    import ckpt_guard

    if state.installed_by_plugin:
        ckpt_guard.uninstall()
    elif state.previous_config is not None and ckpt_guard.is_installed():
        # Someone installed the guard before the session: put their configuration back.
        from . import _patch

        _patch.install(state.previous_config)


def pytest_report_header(config: pytest.Config) -> str:
    state = config.stash.get(_STATE_KEY, None)
    if state is None or state.description is None:
        line = "ckpt_guard: not enabled"
        if state is not None and state.rules_source is not None:
            line += (
                f" (overrides from {state.rules_source} ignored: no policy from "
                f"{_POLICY_OPTION}, {_POLICY_ENV} or ini option {_POLICY_INI})"
            )
            if state.ignored_error:
                line += f"; and malformed: {state.ignored_error}"
        return line + _FIXTURE_NOTE
    sources: List[str] = [s for s in (state.policy_source, state.rules_source) if s]
    line = f"ckpt_guard: {state.description} (from {', '.join(dict.fromkeys(sources))})"
    if not state.active:
        line += "; guard not installed" + _FIXTURE_NOTE
    return line


_FIXTURE_NOTE = "; tests that use ckpt_guard_events run under warn"


def _marker_config(item: pytest.Item, mark: Any) -> Tuple[str, Dict[str, str]]:
    """Validate the marker's arguments; fail the test with a clear message if bad."""
    from . import _config

    source = f"@pytest.mark.{_MARKER} on {item.nodeid}"
    kwargs = dict(mark.kwargs)
    args = list(mark.args)
    unknown = set(kwargs) - {"policy", "rules"}
    if len(args) > 1 or unknown or (args and "policy" in kwargs):
        pytest.fail(
            f"ckpt_guard: {source} takes (policy='strict', *, rules=None); "
            f"got args={_config.shown(tuple(args))} kwargs={_config.shown(mark.kwargs)}",
            pytrace=False,
        )
    policy_value = args[0] if args else kwargs.get("policy", _config.DEFAULT_POLICY)
    try:
        policy = _config.check_policy(policy_value, source)
        overrides = _config.check_rules(kwargs.get("rules"), f"{source} (rules=)")
    except ValueError as exc:
        pytest.fail(str(exc), pytrace=False)
    return policy, overrides


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, None]:
    mark = item.get_closest_marker(_MARKER)
    if mark is None:
        yield
        return
    policy, overrides = _marker_config(item, mark)

    import ckpt_guard
    from . import _config

    installed_here = False
    if not ckpt_guard.is_installed() and _config.Config(policy, overrides).active:
        ckpt_guard.install(policy, rules=overrides)
        installed_here = True
    # the marker's scope, as ckpt_guard.policy() opens one, but named after the marker in messages
    _config.installs[0] += 1  # and, as there, fallback's once-per-call-site warnings start afresh
    scope = _config.Config(policy, overrides, "marker")
    if scope.may_fall_back:
        from . import _patch

        _patch.enable_composable_fallback()
    token = _config.push_scope(scope)
    try:
        yield
    finally:
        _config.pop_scope(token)
        if installed_here:
            ckpt_guard.uninstall()


@pytest.fixture
def ckpt_guard_events() -> Generator[List[Any], None, None]:
    """Every decision the checkpoint guard makes during the test, as ``ckpt_guard.Event``\\ s.

    A test that asks for it checks something even when nothing enabled the
    guard (no option, environment, ini or marker, or a session set to
    ``off``): the guard is then installed under ``warn`` for the test, which
    records every decision and changes nothing torch does.
    """
    import ckpt_guard

    from . import _config, _patch

    installed_here = not ckpt_guard.is_installed() or not _config.installed().active
    if installed_here:
        previous = _config.installed() if ckpt_guard.is_installed() else None
        _patch.install(_config.Config("warn", {}, source="marker"))
    try:
        with ckpt_guard.record() as events:
            yield events
    finally:
        if installed_here:
            if previous is None:
                ckpt_guard.uninstall()
            else:
                _patch.install(previous)
