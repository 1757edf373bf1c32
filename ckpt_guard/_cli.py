"""``python -m ckpt_guard``: the live matrix, the rule table, and a guarded launcher.

::

    python -m ckpt_guard                   # measure every rule on this torch; exit 1 if the table is stale
    python -m ckpt_guard --json            # the same, machine-readable on stdout
    python -m ckpt_guard rules             # the rule table and the policy the environment sets
    python -m ckpt_guard explain CKG001    # one rule in full, with its minimal reproduction
    python -m ckpt_guard run [--policy P] [--rules ID=P,...] script.py [args...]
    python -m ckpt_guard run [--policy P] [--rules ID=P,...] -m package.module [args...]

Command-line errors print one line (``ckpt_guard: error: ...``) and exit 2.
Only the matrix imports torch; ``run`` installs the guard before the program
imports torch, as ``ckpt_guard.install()`` at the top of it would.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import runpy
import shutil
import sys
import textwrap
from types import TracebackType
from typing import IO, Any, List, NoReturn, Optional, Sequence

from . import _config

PROG = "python -m ckpt_guard"
EXIT_USAGE = 2


class UsageError(Exception):
    """A command-line error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line on stderr and exit 2 (subparsers inherit this)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UsageError(message)


def _one_line(message: str) -> str:
    text = " ".join(str(message).split())
    return text[len("ckpt_guard: "):] if text.startswith("ckpt_guard: ") else text


def _fail(message: str) -> int:
    sys.stderr.write(f"ckpt_guard: error: {_one_line(message)}\n")
    sys.stderr.flush()
    return EXIT_USAGE


def _build_parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Without a command: run every rule's live probe (and every safe composition's) on the "
            "installed torch, with and without the guard, and print the compatibility matrix. "
            "Exit status 1 when torch no longer behaves as the rule table says."
        ),
    )
    parser.add_argument("--json", action="store_true", help="write the matrix as JSON to stdout")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("rules", help="list the rules and the policy the environment sets for each")

    explain = sub.add_parser("explain", help="print one rule in full, with its minimal reproduction")
    explain.add_argument("rule_id", metavar="ID", help="a rule id, e.g. CKG001 (any case)")

    run = sub.add_parser(
        "run",
        help="run a Python program with the guard installed",
        usage=f"{PROG} run [--policy P] [--rules ID=P,...] (script.py | -m module) [args...]",
        description=(
            "Install the guard, then run the program as 'python script.py args...' or "
            "'python -m module args...' would. Everything after the script or module name is "
            "passed to the program untouched."
        ),
    )
    run.add_argument(
        "--policy",
        help=f"one of {', '.join(_config.POLICIES)}; default: ${_config.ENV_POLICY} or {_config.DEFAULT_POLICY}",
    )
    run.add_argument(
        "--rules", metavar="ID=P,...", help=f"per-rule overrides; default: ${_config.ENV_RULES}"
    )
    run.add_argument(
        "-m", dest="module", nargs=argparse.REMAINDER, metavar="module [args...]",
        help="run a library module as a script (like python -m)",
    )
    run.add_argument("script", nargs=argparse.REMAINDER, metavar="script.py [args...]")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (SystemExit from ``run`` passes through)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        return _fail(f"{exc} (see '{PROG} --help')")
    try:
        if args.command != "run":
            # A bad CKPT_GUARD_POLICY / CKPT_GUARD_RULES is reported even where the
            # command does not use it ('run' reads it only where no flag overrides it).
            _config.build_config(None, None, read_env=True)
        if args.command is None:
            return _cmd_matrix(as_json=args.json, quiet=args.quiet)
        if args.json:
            raise UsageError(f"--json goes with the matrix ('{PROG} --json'), not with '{args.command}'")
        if args.command == "rules":
            return _cmd_rules()
        if args.command == "explain":
            return _cmd_explain(args.rule_id)
        return _cmd_run(args)
    except (UsageError, ValueError) as exc:
        return _fail(str(exc))
    except BrokenPipeError:
        # Our own output went to a closed pipe ('... | head'); the program that
        # 'run' runs reports its own errors (see _cmd_run), so this is ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


# --------------------------------------------------------------------------
# the matrix


def _can_encode(stream: IO[str], text: str) -> bool:
    try:
        text.encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    """Left-aligned columns; the last column is not padded."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).ljust(w) for c, w in zip(cells[:-1], widths[:-1])]
        return "  ".join([*padded, str(cells[-1])]).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _cut(text: str, width: int, ellipsis: str) -> str:
    return text if len(text) <= width else text[: max(width - len(ellipsis), 0)].rstrip() + ellipsis


def _fit_columns(headers: Sequence[str], rows: List[List[str]], flexible: Sequence[int], width: int, ellipsis: str) -> None:
    """Cut the ``flexible`` columns (in place) so that the table is at most ``width`` wide.

    The other columns keep their text; the flexible ones share what is left
    equally (one that needs less gives the rest to the others), each at least
    as wide as its header and 8 characters (a terminal narrower than that wraps).
    """
    natural = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    fixed = sum(w for i, w in enumerate(natural) if i not in flexible) + 2 * (len(headers) - 1)
    least = {i: max(8, len(headers[i])) for i in flexible}
    room = max(width - fixed, sum(least.values()))
    if sum(natural[i] for i in flexible) <= room:
        return
    shares: dict = {}
    for n, i in enumerate(sorted(flexible, key=lambda i: natural[i])):  # the modest ones first
        left = room - sum(shares.values()) - sum(least[j] for j in flexible if j not in shares and j != i)
        shares[i] = max(least[i], min(natural[i], left if n == len(flexible) - 1 else
                                      (room - sum(shares.values())) // (len(flexible) - n)))
    for row in rows:
        for i in flexible:
            row[i] = _cut(str(row[i]), shares[i], ellipsis)


def format_matrix(head: dict, rows: Sequence[Any], *, unicode: bool = True, width: Optional[int] = None) -> str:
    """The matrix as text: header lines, the table, and a verdict (one line per disagreement).

    ``width``: the table's cells are cut (with "…") to fit it, the other lines
    wrapped; ``None`` leaves everything whole.  ``--json`` always has the full text.
    """
    import textwrap

    from . import _matrix

    yes, no, dash = ("✓", "✗", "—") if unicode else ("yes", "NO", "-")
    cuda = head["cuda_used"]
    lines = [
        f"interception {head['interception']}",
        f"ckpt_guard {head['ckpt_guard']}",
        f"torch      {head['torch']}",
        f"Python     {head['python']}",
        f"CUDA used  {'yes (' + str(head['cuda_device']) + ')' if cuda else 'no'}",
        "",
    ]
    narrow = width is not None and width < 160  # short headers and words, explained below the table
    headers = ["rule", "var" if narrow else "variant", *(["device"] if cuda else []),
               "torch alone" if narrow else "torch without guard", "strict", "fallback",
               "ran" if narrow else "fallback ran", "ok" if narrow else "agrees", "composition"]
    variant_words = {"reentrant": "R", "non-reentrant": "NR"} if narrow else {}
    by_design = "by design" if narrow else "raises (by design)"
    ran_words = {"composable": "compos.", "no checkpoint": "plain", "use_reentrant=False": "NR", "no early stop": "no e.s.",
                 "checkpoint": "ckpt"} if narrow else {}
    cells = []
    for row in rows:
        fallback = {"ok": yes, "raises (by design)": by_design}.get(row.fallback, no)
        ran = ran_words.get(row.fallback_ran, row.fallback_ran)
        if row.fallback_saving not in ("", "-", "no"):  # "no": plain says it
            ran = f"{ran} {row.fallback_saving}" if narrow else f"{ran}, saving {row.fallback_saving}"
        raw = row.raw if unicode else row.raw.replace("…", "...")
        if narrow and raw.startswith("raises: "):
            raw = raw[len("raises: "):]  # "RuntimeError: ..." says it raised
        cells.append([
            row.rule_id, variant_words.get(row.variant, row.variant), *([row.device] if cuda else []), raw,
            row.strict, fallback, ran or "-", yes if row.agrees else no, row.name,
        ])
    ellipsis = "…" if unicode else "..."
    if width is not None:
        raw_column = headers.index("torch alone" if narrow else "torch without guard")
        ran_column = headers.index("ran" if narrow else "fallback ran")
        _fit_columns(headers, cells, (raw_column, ran_column, len(headers) - 1), width, ellipsis)
    lines += _table(headers, cells)
    if narrow:
        lines.append(
            "var R / NR: use_reentrant=True / False; torch alone: what torch does without the "
            "guard; by design: fallback raises the drift it could not foresee; ran: what fallback "
            "ran, ckpt (torch's checkpoint), NR (use_reentrant=False), no e.s. (without early stop), compos. (the composable "
            "recompute) or plain (without checkpointing), and whether the memory saving was kept "
            "(the block recomputed in the backward), measured; ok: agrees with the table; --json "
            "has every cell in full"
        )
    lines.append("")
    if head.get("not_on_this_torch"):
        lines.append(f"not measured on torch {head['torch']} here:")
        lines += [f"  {line}" for line in head["not_on_this_torch"]]
        lines.append("")
    found = _matrix.problems(rows)
    if found:
        lines += [line if unicode else line.replace("—", dash).replace("…", "...") for line in found]
        disagreeing = sorted({f"{r.rule_id if r.kind == 'rule' else r.name} ({r.variant})" for r in rows if not r.agrees})
        lines.append(f"{len(disagreeing)} of {len(rows)} rows disagree with the table: {', '.join(disagreeing)}")
    else:
        safe = [r for r in rows if r.kind == "safe"]
        plain = sum(r.fallback_ran == "no checkpoint" for r in safe)
        composable = sum(r.fallback_ran == "composable" for r in safe)
        acted = [
            *([f"{composable} as the composable recompute"] if composable else []),
            *([f"{plain} without checkpointing"] if plain else []),
        ]
        lines.append(
            f"all {len(rows)} rows agree with the table on torch {head['torch']}: every rule's symptom "
            "reproduced and caught, every safe composition left untouched by strict"
            + (
                f" (fallback ran {' and '.join(acted)}, correctly: a risk it cannot rule out when "
                "checkpoint is called)" if acted else ""
            )
        )
    if width is not None:  # the table is cut to fit; the prose is wrapped
        table = range(6, 6 + 2 + len(cells))
        lines = [
            wrapped
            for i, line in enumerate(lines)
            for wrapped in ([line] if i in table else textwrap.wrap(line, width, subsequent_indent="    ") or [""])
        ]
    return "\n".join(lines)


def _cmd_matrix(*, as_json: bool, quiet: bool) -> int:
    try:
        import torch

        from . import _matrix, _patch

        _patch.check_torch_version(torch.__version__)
    except (ImportError, RuntimeError) as exc:  # no torch, or one too old for the guard
        raise UsageError(f"cannot run the matrix: {exc}") from None

    def progress(i: int, n: int, label: str) -> None:
        if not quiet:
            sys.stderr.write(f"[{i}/{n}] {label} ...\n")
            sys.stderr.flush()

    on = _matrix.devices()
    head = _matrix.header(on)
    rows = _matrix.run_matrix(on=on, progress=progress)
    code = _matrix.exit_code(rows)
    if as_json:
        json.dump(
            {
                "header": head,
                "rows": [row.as_dict() for row in rows],
                "agrees": code == 0,
                "problems": _matrix.problems(rows),
            },
            sys.stdout,
            indent=2,
            ensure_ascii=False,
        )
        sys.stdout.write("\n")
    else:
        unicode = _can_encode(sys.stdout, "✓✗—…")
        width = shutil.get_terminal_size((100, 24)).columns  # $COLUMNS, the terminal, else 100
        sys.stdout.write(format_matrix(head, rows, unicode=unicode, width=width) + "\n")
    sys.stdout.flush()
    return code


# --------------------------------------------------------------------------
# rules and explain


def _cmd_rules() -> int:
    from ._rules import RULES

    config = _config.build_config(None, None, read_env=True)  # as install() would: bad env -> ValueError
    env = {
        name: os.environ.get(name, "").strip() or "unset"
        for name in (_config.ENV_POLICY, _config.ENV_RULES)
    }
    default = "" if os.environ.get(_config.ENV_POLICY, "").strip() else ", the default"
    print(
        f"policy from the environment: {config.describe()}  "
        f"({_config.ENV_POLICY}: {env[_config.ENV_POLICY]}{default}; {_config.ENV_RULES}: {env[_config.ENV_RULES]})"
    )
    print(
        "  used by ckpt_guard.install() with no argument, and by ckpt_guard.checkpoint under torch.func "
        "even without install(); every other checkpoint call (ckpt_guard.checkpoint outside torch.func "
        "included: it is torch's then) is guarded only once install() has run"
    )
    print()
    rows = [
        [rule.id, config.policy_for(rule.id), rule.stage, ", ".join(rule.variants), rule.title]
        for rule in RULES
    ]
    for line in _table(["id", "policy", "stage", "variants", "title"], rows):
        print(line)
    print()
    print(f"details: {PROG} explain ID")
    return 0


def _wrapped(label: str, text: str, width: int = 100) -> List[str]:
    return textwrap.wrap(
        text, width=width, initial_indent=f"{label:<16}", subsequent_indent=" " * 16,
        break_long_words=False, break_on_hyphens=False,
    ) or [label]


#: the first fix ``explain`` gives for a rule the composable recompute handles
COMPOSABLE_WORKS = (
    "checkpoint the block with ckpt_guard.checkpoint(block, *inputs) instead of torch.utils.checkpoint: "
    "under torch.func it runs the composable recompute (the uncheckpointed code's result, the memory "
    "saving kept), elsewhere torch's own checkpoint; for torch's own calls, install the guard with "
    "policy fallback, which does the same"
)


def _cmd_explain(rule_id: str) -> int:
    from ._rules import RULE_IDS, RULES

    wanted = rule_id.strip().upper()
    rule = next((r for r in RULES if r.id == wanted), None)
    if rule is None:
        raise UsageError(f"unknown rule id {_config.shown(rule_id)}; valid rule ids: {', '.join(RULE_IDS)}")
    stage = {
        "call": "call (decided when checkpoint is called)",
        "transform": "transform (decided when a torch.func transform is entered, before any checkpoint call)",
        "recompute": "recompute (checked when the backward recomputes the block)",
    }.get(rule.stage, rule.stage)
    symptoms = ", ".join(f"{v}: {rule.symptom_for(v)}" for v in rule.variants)
    out = [f"{rule.id}  {rule.title}", ""]
    out += _wrapped("stage:", stage)
    out += _wrapped("variants:", ", ".join(rule.variants))
    out += _wrapped("trigger:", rule.trigger)
    out += _wrapped("symptom:", f"{rule.symptom} [{symptoms}]")
    if rule.raises_match:
        out += _wrapped("torch's error:", f"matches /{rule.raises_match}/")
    if rule.composable_helps:  # what keeps checkpointing and its memory saving comes first
        out += _wrapped("works:", COMPOSABLE_WORKS)
    out += _wrapped("otherwise:" if rule.composable_helps else "remedy:", rule.remedy)
    out += _wrapped("fallback:", rule.fallback or "-")
    out.append("references:" if rule.refs else "references:     -")
    out += [f"  {ref}" for ref in rule.refs]
    out += _wrapped("torch versions:", rule.torch_versions)
    out.append("")
    out.append(
        "minimal reproduction (the rule's live probe, as a script: save it and run it with python; "
        "it compares the uncheckpointed run with torch's checkpoint for each variant; uncomment "
        f"its ckpt_guard line to see the guard catch it; '{PROG}' runs every probe with and "
        "without the guard):"
    )
    out.append("")
    try:
        source = _reproduction(rule)
    except (OSError, TypeError) as exc:
        source = f"<source not available: {exc}>"
    out.append(source)
    print("\n".join(out))
    return 0


_REPRODUCTION_HEADER = '''"""{title} ({id}): the uncheckpointed run against torch's checkpoint."""
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils.checkpoint

# import ckpt_guard; ckpt_guard.install("strict")  # uncomment: the guard catches it
'''

_REPRODUCTION_DRIVER = '''

def no_checkpoint(function, *args, use_reentrant=None, **kwargs):
    """The reference: the same call as checkpoint's, run plainly."""
    kwargs.pop("preserve_rng_state", None)
    kwargs.pop("context_fn", None)
    return function(*args, **kwargs)


def matches(actual, expected) -> bool:
    try:
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, equal_nan=True)
    except AssertionError:
        return False
    return len(actual) == len(expected)


if __name__ == "__main__":
    reference = {probe}(no_checkpoint, None)
    for use_reentrant in {variants}:
        try:
            result = {probe}(torch.utils.checkpoint.checkpoint, use_reentrant)
        except Exception as exc:  # torch's own error, or the guard's if it is installed
            print(f"use_reentrant={{use_reentrant}}: raises {{type(exc).__name__}}: {{str(exc).splitlines()[0][:200]}}")
            continue
        print(f"use_reentrant={{use_reentrant}}: matches the uncheckpointed run: {{matches(result, reference)}}")
'''


def _reproduction(rule: Any) -> str:
    """The rule's probe as a script that runs: imports, the probe and its helpers, a driver."""
    from ._rules import REENTRANT

    variants = tuple(v == REENTRANT for v in rule.variants)
    return (
        _REPRODUCTION_HEADER.format(title=rule.title, id=rule.id)
        + "\n\n"
        + _source_with_helpers(rule.probe)
        + "\n"
        + _REPRODUCTION_DRIVER.format(probe=rule.probe.__name__, variants=variants)
    )


def _source_with_helpers(function: Any) -> str:
    """``function``'s source, after that of the module-level helpers it calls (transitively)."""
    import re

    module = vars(sys.modules[function.__module__])
    wanted, sources, todo = {function.__name__}, [], [function]
    while todo:
        source = textwrap.dedent(inspect.getsource(todo.pop())).rstrip()
        sources.append(source)
        for name in re.findall(r"\b(_\w+)\(", source):
            helper = module.get(name)
            if name not in wanted and inspect.isfunction(helper) and helper.__module__ == function.__module__:
                wanted.add(name)
                todo.append(helper)
    return "\n\n\n".join(reversed(sources))


# --------------------------------------------------------------------------
# run


def _user_traceback(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """Drop the leading frames of this launcher and runpy: start at the program's own code."""
    here = os.path.dirname(os.path.abspath(__file__))
    own_files = {os.path.join(here, "_cli.py"), os.path.join(here, "__main__.py")}

    def launcher(frame: Any) -> bool:
        return (
            frame.f_globals.get("__name__") == "runpy"
            or os.path.abspath(frame.f_code.co_filename) in own_files
        )

    while tb is not None and tb.tb_next is not None and launcher(tb.tb_frame):
        tb = tb.tb_next
    return tb


def _innermost_module(tb: Optional[TracebackType]) -> Optional[str]:
    name = None
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__")
        tb = tb.tb_next
    return name


def _cmd_run(args: argparse.Namespace) -> int:
    if args.module is not None:
        if not args.module:
            raise UsageError("argument -m: expected a module name")
        target, program_args, as_module = args.module[0], [*args.module[1:], *args.script], True
    else:
        script = list(args.script)
        if script and script[0] == "--":
            script = script[1:]
        if not script:
            raise UsageError(f"run needs a script or -m module: {PROG} run [--policy P] script.py [args...]")
        target, program_args, as_module = script[0], script[1:], False

    policy = _config.check_policy(args.policy, "--policy") if args.policy is not None else None
    rules = _config.parse_rules_spec(args.rules, "--rules") if args.rules is not None else None

    if not as_module:
        if not os.path.exists(target):
            raise UsageError(f"can't open file {os.path.abspath(target)!r}: no such file or directory")
        # As python does for 'python script.py': the script's directory (symlinks
        # resolved) replaces the current directory that 'python -m' put first.
        if os.path.isfile(target):
            first = os.path.dirname(os.path.realpath(target))
        else:  # a directory or zip file with __main__.py
            first = os.path.abspath(target)
        if sys.path and sys.path[0] in ("", os.getcwd()):
            sys.path[0] = first
        else:
            sys.path.insert(0, first)

    from . import _patch

    source = "cli" if policy is not None or rules is not None else "env"
    config = _config.build_config(policy, rules, read_env=True, source=source)
    _guard_child_processes(config)
    _patch.install(config)
    sys.argv = [target, *program_args]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(target), run_name="__main__")  # as python does, an absolute __file__
    except SystemExit:
        raise  # the program's own exit status, exactly as python would use it
    except BaseException as exc:  # noqa: BLE001 - report it as python would, from the program's code
        if as_module and isinstance(exc, ImportError) and _innermost_module(exc.__traceback__) == "runpy":
            raise UsageError(str(exc)) from None  # runpy could not find or run the module
        tb = _user_traceback(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):
            _exit_by_sigint()
        return 1
    return 0


def _guard_child_processes(config: _config.Config) -> None:
    """Child interpreters of the program install the guard too, with this configuration.

    Through the environment they inherit: ``CKPT_GUARD_RUN=1``, the policy and
    rules, and ``ckpt_guard/_autoinstall`` first on ``PYTHONPATH`` (its
    ``sitecustomize`` installs the guard at start-up).  A forked child needs
    none of it: it inherits the installed guard itself.
    """
    os.environ["CKPT_GUARD_RUN"] = "1"
    os.environ[_config.ENV_POLICY] = config.policy
    os.environ[_config.ENV_RULES] = ",".join(f"{k}={v}" for k, v in sorted(config.overrides.items()))
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autoinstall")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != folder]
    os.environ["PYTHONPATH"] = os.pathsep.join([folder, *rest])


def _exit_by_sigint() -> None:
    """End as python does after an uncaught KeyboardInterrupt: killed by SIGINT (status 130)."""
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    if hasattr(signal, "SIGINT") and hasattr(os, "kill"):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(130)
