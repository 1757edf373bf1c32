"""Configuration: which policy applies to which rule, and where it came from.

Three layers, last wins:

1. ``install(policy, rules=...)`` sets the process-wide configuration
   (``None`` reads ``CKPT_GUARD_POLICY`` / ``CKPT_GUARD_RULES``).
2. ``with policy(...)`` overrides it in a scope.  The scope lives in a
   ``contextvars.ContextVar`` so threads and asyncio tasks never see each
   other's scopes.
3. A per-rule override (``rules={"CKG003": "warn"}``) beats the base policy of
   its layer.

The configuration in force is read when ``checkpoint`` is *called* and carried
with the call: the recompute may run on an autograd worker thread, which
inherits neither ``threading.local`` nor ``contextvars``.

No torch here: ``import ckpt_guard`` must stay torch-free.
"""

from __future__ import annotations

import contextvars
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

POLICIES: tuple[str, ...] = ("off", "warn", "fallback", "strict")
DEFAULT_POLICY = "strict"
ENV_POLICY = "CKPT_GUARD_POLICY"
ENV_RULES = "CKPT_GUARD_RULES"

# How severe an action each policy takes; when several rules fire, the most
# severe one decides what happens.
SEVERITY = {"off": 0, "warn": 1, "fallback": 2, "strict": 3}


#: Where a configuration came from; messages name the channel in their fix lines.
SOURCES = ("default", "env", "install", "scope", "cli", "pytest-option", "pytest-ini", "marker")


@dataclass(frozen=True)
class Config:
    """An immutable, validated configuration."""

    policy: str = DEFAULT_POLICY
    overrides: Mapping[str, str] = field(default_factory=dict)
    #: one of SOURCES: how the user set it (so a hint can say how to change it)
    source: str = field(default="install", compare=False)
    #: the guard's own scope inside a composable recompute (``_composable``):
    #: checkpoint calls there run as plain calls, deciding nothing
    plain: bool = field(default=False, compare=False)

    #: False when every rule is off: the patch points then step aside at once.
    active: bool = field(init=False)
    #: Whether any rule may be under "fallback" (only then can a drift risk
    #: visible at call time change what runs).
    may_fall_back: bool = field(init=False)

    def __post_init__(self) -> None:
        policies = {self.policy, *self.overrides.values()}
        object.__setattr__(self, "active", policies != {"off"} and not self.plain)
        object.__setattr__(self, "may_fall_back", "fallback" in policies)

    def policy_for(self, rule_id: str) -> str:
        return self.overrides.get(rule_id, self.policy)

    def describe(self) -> str:
        if not self.overrides:
            return self.policy
        rules = ",".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        return f"{self.policy} (rules: {rules})"


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit - 1]}… ({len(text)} characters)"


def _known_rule_ids() -> tuple[str, ...]:
    from ._rules import RULE_IDS

    return RULE_IDS


def check_policy(value: object, source: str) -> str:
    """Return ``value`` as a policy name, or raise one clear ``ValueError``."""
    if isinstance(value, str) and value.strip().lower() in POLICIES:
        return value.strip().lower()
    raise ValueError(
        f"ckpt_guard: unknown policy {shown(value)} from {source}; "
        f"valid choices: {', '.join(POLICIES)}"
    )


def _check_rule_id(rule_id: object, source: str) -> str:
    known = _known_rule_ids()
    if isinstance(rule_id, str) and rule_id.strip().upper() in known:
        return rule_id.strip().upper()
    raise ValueError(
        f"ckpt_guard: unknown rule id {shown(rule_id)} from {source}; "
        f"valid rule ids: {', '.join(known)}"
    )


def parse_rules_spec(spec: str, source: str) -> dict[str, str]:
    """Parse ``"CKG001=warn,CKG003=off"`` (spaces and a trailing comma allowed)."""
    overrides: dict[str, str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        rule_id, sep, policy_name = item.partition("=")
        if not sep or not rule_id.strip() or not policy_name.strip():
            raise ValueError(
                f"ckpt_guard: malformed rule override {shown(item)} in {source}={shown(spec)}; "
                f"expected ID=POLICY[,ID=POLICY...], e.g. CKG001=warn, "
                f"with POLICY one of {', '.join(POLICIES)}"
            )
        known_id = _check_rule_id(rule_id, source)
        policy = check_policy(policy_name, f"{source} (rule {known_id})")
        _set_once(overrides, known_id, policy, f"{source}={shown(spec)}")
    return overrides


def _set_once(overrides: dict, rule_id: str, policy: str, where: str) -> None:
    """``overrides[rule_id] = policy``, unless ``where`` already gave that rule another policy."""
    if overrides.get(rule_id, policy) != policy:
        raise ValueError(
            f"ckpt_guard: rule {rule_id} is given two policies in {where}: "
            f"{overrides[rule_id]} and {policy}; give it one"
        )
    overrides[rule_id] = policy


def check_rules(rules: object, source: str) -> dict[str, str]:
    """Validate a rules argument: a mapping ``{id: policy}`` or an ``ID=P,...`` string."""
    if rules is None:
        return {}
    if isinstance(rules, str):
        return parse_rules_spec(rules, source)
    if not isinstance(rules, Mapping):
        raise ValueError(
            f"ckpt_guard: {source} must be a mapping of rule id to policy "
            f"(e.g. {{'CKG001': 'warn'}}), got {shown(rules)}"
        )
    checked = {}
    for rule_id, p in rules.items():
        known_id = _check_rule_id(rule_id, source)
        policy = check_policy(p, f"{source}[{known_id!r}]")
        _set_once(checked, known_id, policy, f"{source} (keys that differ only in case)")
    return checked


def build_config(
    policy: str | None, rules: Mapping[str, str] | str | None, *, read_env: bool, source: str = "install"
) -> Config:
    """Validate arguments, falling back to the environment when ``read_env``.

    ``source``: how the arguments were given (see :data:`SOURCES`); a policy
    read from the environment (or defaulted) records that instead.
    """
    if policy is None and read_env:
        env_value = os.environ.get(ENV_POLICY, "")
        base = (
            check_policy(env_value, f"environment variable {ENV_POLICY}")
            if env_value.strip()
            else DEFAULT_POLICY
        )
        source = "env" if env_value.strip() or os.environ.get(ENV_RULES, "").strip() else "default"
    elif policy is None:
        base = DEFAULT_POLICY
    else:
        base = check_policy(policy, "argument 'policy'")
    if rules is None and read_env:
        overrides = parse_rules_spec(
            os.environ.get(ENV_RULES, ""), f"environment variable {ENV_RULES}"
        )
    else:
        overrides = check_rules(rules, "argument 'rules'")
    return Config(base, overrides, source)


def from_environment() -> Config:
    """``build_config(None, None, read_env=True)``, built once per value of the two variables.

    ``ckpt_guard.checkpoint`` under a transform reads the policy at every
    call when nothing is installed: parsing the rules each time costs more
    than the variables' lookup.  A bad value raises at every call, as before.
    """
    if _ENVIRON_KEYS is not None:  # os.environ's own dict: .get() raises and catches a KeyError per unset name
        data = os.environ._data  # type: ignore[attr-defined]
        return _config_for_environment(data.get(_ENVIRON_KEYS[0]), data.get(_ENVIRON_KEYS[1]))
    return _config_for_environment(os.environ.get(ENV_POLICY, ""), os.environ.get(ENV_RULES, ""))


def _environ_keys() -> "tuple | None":
    """The two variables' keys in ``os.environ``'s own dict, where it has one (CPython's ``_Environ``)."""
    try:
        data, encode = os.environ._data, os.environ.encodekey  # type: ignore[attr-defined]
        return (encode(ENV_POLICY), encode(ENV_RULES)) if isinstance(data, dict) else None
    except Exception:  # noqa: BLE001 - another Python's os.environ: read through .get()
        return None


_ENVIRON_KEYS = _environ_keys()


@functools.lru_cache(maxsize=8)  # a bad value is never cached: it raises at every call
def _config_for_environment(policy: Any, rules: Any) -> Config:
    del policy, rules  # the cache's key (the two variables, raw or decoded): build_config reads them itself
    return build_config(None, None, read_env=True)


#: Checkpoints nested in a block the guard recomputes itself run plainly.
PLAIN = Config("off", source="default", plain=True)

# The installed configuration (process-wide) and the scoped one (per context).
_installed: Config = Config("off", source="default")
_scoped: contextvars.ContextVar[Config | None] = contextvars.ContextVar(
    "ckpt_guard_scoped_config", default=None
)


#: ``scoped_config()``: the scoped configuration, or None (the hot path's half of ``current()``).
scoped_config = _scoped.get


_SOURCE_WORDS = {
    "env": "the environment", "install": "install()", "cli": "python -m ckpt_guard run",
    "pytest-option": "pytest's --ckpt-guard option", "pytest-ini": "pytest's ini file", "marker": "a pytest marker",
}


def install_warnings(config: Config, policy: str | None, installed: bool) -> list[str]:
    """What ``install()`` says before it installs ``config``: a configuration it replaces, and a
    malformed ``CKPT_GUARD_POLICY`` an explicit ``policy`` leaves unread (either would go unnoticed)."""
    said = []
    if installed and _installed != config and _installed.source != "default":
        said.append(
            f"ckpt_guard.install(): replacing the configuration installed earlier ({_installed.describe()}, "
            f"set by {_SOURCE_WORDS.get(_installed.source, _installed.source)}) with {config.describe()}; "
            "call ckpt_guard.uninstall() first to make that explicit, or use ckpt_guard.policy(...) "
            "for a change that ends with a block"
        )
    env_value = os.environ.get(ENV_POLICY, "")
    if policy is not None and env_value.strip() and env_value.strip().lower() not in POLICIES:
        said.append(
            f"ckpt_guard.install({policy!r}): environment variable {ENV_POLICY}={shown(env_value)} is not a "
            f"policy (valid choices: {', '.join(POLICIES)}) and is not read here, because install() was given "
            "a policy; fix or unset it, or the same program run without that argument will fail"
        )
    return said


#: bumped by every ``install()``, ``uninstall()`` and ``policy()`` scope: fallback's once-per-call-site
#: warnings start afresh
installs = [0]


def set_installed(config: Config) -> None:
    global _installed
    _installed = config
    installs[0] += 1


def installed() -> Config:
    """The process-wide configuration ``install()`` set (``off`` before any): read here, since
    ``install()`` re-binds it."""
    return _installed


def current() -> Config:
    """The configuration in force for a checkpoint call made now, in this context."""
    scoped = _scoped.get()
    return _installed if scoped is None else scoped


def for_ckpt_guard_checkpoint(scoped: "Config | None" = None) -> Config:
    """The configuration ``ckpt_guard.checkpoint`` applies: a scope's (``scoped``, read by the caller on
    its hot path), else the installed one where there is one (``install("off")`` is a policy in
    force, not the absence of one), else the environment's (strict by default, without install())."""
    if scoped is not None:
        return scoped
    installed = _installed
    if installed.active or installed.source != "default":
        return installed
    return from_environment()


def push_scope(config: Config) -> contextvars.Token:
    return _scoped.set(config)


def pop_scope(token: contextvars.Token) -> None:
    _scoped.reset(token)


def how_to_set(source: str, policy: str, rule_ids: "str | Sequence[str]" = "") -> str:
    """How to set ``policy`` (for these rules, or for all) through the channel ``source``."""
    ids = [i for i in ([rule_ids] if isinstance(rule_ids, str) else rule_ids) if i]
    spec = ",".join(f"{i}={policy}" for i in ids)
    rules = "rules={" + ", ".join(f"{i!r}: {policy!r}" for i in ids) + "}"
    if source == "scope":
        return f"ckpt_guard.policy(..., {rules})" if ids else f"ckpt_guard.policy({policy!r})"
    if source == "install":
        return f"ckpt_guard.install(..., {rules})" if ids else f"ckpt_guard.install({policy!r})"
    if source == "marker":
        return f"@pytest.mark.ckpt_guard(..., {rules})" if ids else f"@pytest.mark.ckpt_guard({policy!r})"
    if source == "pytest-option":
        return f"--ckpt-guard-rules={spec}" if ids else f"--ckpt-guard={policy}"
    if source == "pytest-ini":
        return f"ini ckpt_guard_rules = {spec}" if ids else f"ini ckpt_guard = {policy}"
    if source == "cli":
        return f"--rules {spec}" if ids else f"--policy {policy}"
    return f"{ENV_RULES}={spec}" if ids else f"{ENV_POLICY}={policy}"
