"""``python -m ckpt_guard``: the live matrix, ``rules``, ``explain`` and ``run``.

Commands run in a subprocess (``sys.executable -m ckpt_guard``) from a
temporary directory, with no ``CKPT_GUARD_*`` variables in the environment.
The full matrix runs in a subprocess twice (text and ``--json``); the stale
detection is tested on the pure functions of ``ckpt_guard._matrix``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ckpt_guard
from ckpt_guard import _config, _matrix
from ckpt_guard._compositions import SAFE_COMPOSITIONS
from ckpt_guard._rules import NON_REENTRANT, REENTRANT, RULE_IDS, RULES, rule_by_id
from ckpt_guard._versions import installed

HERE = installed()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_GUARD_")}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def cli(*args: str, cwd, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckpt_guard", *args],
        cwd=str(cwd),
        env=_env() if env is None else env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
    )


def assert_one_line_usage_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ckpt_guard: error: "), lines[0]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# --------------------------------------------------------------------------
# the matrix (two subprocess runs in all)

def expected_rows(device: str = "cpu") -> list:
    """(rule id, name, variant) per matrix row on this torch and device, from the table.

    A rule whose claim does not hold here has no row, nor one that needs a GPU
    on the CPU; a safe composition this torch refuses is a row of the rule that
    covers it (``otherwise``).
    """
    rows = [
        (r.id, r.title, v) for r in RULES if r.holds_on(HERE) and (device != "cpu" or not r.needs_gpu)
        for v in r.variants
    ]
    for c in SAFE_COMPOSITIONS:
        if c.holds_on(HERE):
            rows += [("-", c.name, v) for v in c.variants]
        elif c.otherwise and rule_by_id(c.otherwise).holds_on(HERE):
            rows += [(c.otherwise, f"{c.name}: {rule_by_id(c.otherwise).title}", v) for v in c.variants]
    return rows


ROWS = len(expected_rows()) + (len(expected_rows("cuda")) if torch.cuda.is_available() else 0)


def test_matrix_text_agrees_on_this_torch(tmp_path):
    result = cli(cwd=tmp_path, env=_env(PYTHONIOENCODING="utf-8", COLUMNS="250"))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    head = out.splitlines()[:5]
    assert head[0].startswith("interception working: non-reentrant via _checkpoint_without_reentrant_generator"), head[0]
    assert head[1] == f"ckpt_guard {ckpt_guard.__version__}"
    assert torch.__version__ in head[2]
    assert head[3].startswith("Python ")
    assert head[4].startswith("CUDA used ")
    for rule_id in RULE_IDS:
        assert rule_id in out
    for composition in SAFE_COMPOSITIONS:
        assert composition.name in out
    assert "raises (by design)" in out  # CKG108: parameters really changed, nothing to replay
    assert "STALE" not in out and "✗" not in out
    assert "agree with the table" in " ".join(out.split("\n\n")[-1].split())  # the verdict, wrapped
    # progress goes to stderr, one line per row
    n = ROWS
    assert f"[1/{n}] " in result.stderr and f"[{n}/{n}] " in result.stderr
    # fitted to an 80-column terminal: every line fits, the cut cells end in "…"
    lines = [line for line in format_matrix_lines(out, width=80) if line]
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert any(line.endswith("…") for line in lines)
    assert any(line.startswith("var R / NR: use_reentrant=True / False") for line in lines)


def format_matrix_lines(wide_text: str, width: int) -> list:
    """Re-render the rows of a full matrix run at ``width`` (the same rows, no second run)."""
    rows = [
        _matrix.Row(kind="rule" if r != "-" else "safe", rule_id=r, name=n, variant=v, device=device,
                    expected="", raw=raw, strict=st, strict_equal_raw=None, fallback=fb,
                    fallback_ran=ran, fallback_saving=saving)
        for r, n, v, device, raw, st, fb, ran, saving in _parse_matrix_table(wide_text)
    ]
    cuda = any(row.device == "cuda" for row in rows)
    head = {"interception": "working: " + "x" * 120, "ckpt_guard": ckpt_guard.__version__,
            "torch": torch.__version__, "python": "3", "cuda_used": cuda, "cuda_device": "GPU" if cuda else None}
    from ckpt_guard._cli import format_matrix

    return format_matrix(head, rows, width=width).splitlines()


def _parse_matrix_table(text: str) -> list:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rule "))
    header = lines[start]
    names = ["rule", "variant", "device", "torch without guard", "strict", "fallback ", "fallback ran", "agrees",
             "composition"]
    if " device " not in header:  # the device column is there when CUDA rows are
        names.remove("device")
    columns = [header.index(name) for name in names]
    parsed = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        cells = dict(zip(names, (line[a:b].strip() for a, b in zip(columns, columns[1:] + [len(line)]))))
        fallback = {"✓": "ok"}.get(cells["fallback "], "raises (by design)" if "design" in cells["fallback "]
                                   else cells["fallback "])
        ran, _, saving = cells["fallback ran"].partition(", saving ")
        parsed.append((cells["rule"], cells["composition"], cells["variant"], cells.get("device", "cpu"),
                       cells["torch without guard"], cells["strict"], fallback, ran, saving))
    return parsed


def test_matrix_json(tmp_path):
    result = cli("--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # progress stays on stderr
    assert data["agrees"] is True and data["problems"] == []
    assert data["header"]["torch"] == torch.__version__
    assert data["header"]["ckpt_guard"] == ckpt_guard.__version__
    assert data["header"]["cuda_used"] == torch.cuda.is_available()
    cpu_rows = [row for row in data["rows"] if row["device"] == "cpu"]
    got = sorted((row["rule_id"], row["name"], row["variant"]) for row in cpu_rows)
    assert got == sorted(expected_rows())
    assert data["header"]["interception"].startswith("working: ")
    left_out = [line.split(":")[0] for line in data["header"]["not_on_this_torch"]]
    needs_gpu = [] if torch.cuda.is_available() else [r.id for r in RULES if r.needs_gpu]
    assert left_out == [r.id for r in RULES if not r.holds_on(HERE)] + needs_gpu + [
        c.name for c in SAFE_COMPOSITIONS if not c.holds_on(HERE)
    ]
    for row in data["rows"]:
        assert row["agrees"] is True, row
        if row["kind"] == "rule":
            rule = rule_by_id(row["rule_id"])
            assert row["strict"] == ("repaired" if rule.repaired_quietly else "raised")
            assert row["expected"] == rule.symptom_for(row["variant"])
        else:
            assert row["raw"] == "ok" and row["strict"] == "passed" and row["strict_equal_raw"] is True
            assert row["strict_warnings"] == []


# --------------------------------------------------------------------------
# the matrix's pure functions, in process


def _training_step(ckpt, use_reentrant):
    """A composition torch gets right."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    ckpt(lin, x, use_reentrant=use_reentrant).sum().backward()
    return [x.grad, lin.weight.grad]


def test_stale_rule_is_detected():
    # A rule whose probe torch gets right, while the table says torch raises.
    fixed = dataclasses.replace(
        rule_by_id("CKG001"), probe=_training_step, variants=(NON_REENTRANT,),
        symptom_kind="raises", symptom_by_variant=(),
    )
    rows = _matrix.run_matrix(rules=[fixed], compositions=[], on=["cpu"])
    assert len(rows) == 1
    row = rows[0]
    assert row.raw == "ok" and row.expected == "raises"
    assert not row.agrees
    assert _matrix.exit_code(rows) == 1
    lines = _matrix.problems(rows)
    assert lines[0].startswith("STALE: CKG001 (non-reentrant): table says raises, torch ")
    assert "returned ok" in lines[0] and "fixed upstream" in lines[0]
    # and the guard did not catch what does not happen
    assert row.strict == "passed"


def test_silently_wrong_claim_against_a_raise_is_stale():
    # The table says "silently wrong", torch raises: also a disagreement.
    rule = dataclasses.replace(rule_by_id("CKG001"), symptom_kind="silently wrong", raises_match="")
    row = _matrix.measure_rule(rule, NON_REENTRANT)
    assert row.raw.startswith("raises: RuntimeError: ")
    assert any(p.startswith("STALE: CKG001 (non-reentrant): table says silently wrong") for p in row.problems)


def test_raises_match_is_checked():
    rule = dataclasses.replace(rule_by_id("CKG001"), raises_match=r"some other error entirely")
    row = _matrix.measure_rule(rule, NON_REENTRANT)
    assert not row.agrees
    assert "/some other error entirely/" in row.problems[0]


def test_real_rule_row_agrees_and_fallback_by_design():
    row = _matrix.measure_rule(rule_by_id("CKG108"), REENTRANT)
    assert row.agrees, row.problems
    assert (row.raw, row.strict, row.fallback) == ("silently wrong", "raised", "raises (by design)")


def test_a_replayed_drift_row_agrees_and_fallback_is_right():
    row = _matrix.measure_rule(rule_by_id("CKG105"), REENTRANT)
    assert row.agrees, row.problems
    assert (row.raw, row.strict, row.fallback) == ("silently wrong", "raised", "ok")


def test_run_matrix_restores_install_state_and_ignores_scopes():
    ckpt_guard.install("warn", rules={"CKG003": "off"})
    try:
        before = _config.current()
        with ckpt_guard.policy("off"):  # a caller's scope must not leak into the measured policies
            rows = _matrix.run_matrix(
                rules=[rule_by_id("CKG002")], compositions=SAFE_COMPOSITIONS[:1], on=["cpu"]
            )
        assert [r.agrees for r in rows] == [True] * len(rows), _matrix.problems(rows)
        assert ckpt_guard.is_installed()
        assert _config.current() == before
    finally:
        ckpt_guard.uninstall()
    rows = _matrix.run_matrix(rules=[rule_by_id("CKG002")], compositions=[], on=["cpu"])
    assert rows[0].agrees
    assert not ckpt_guard.is_installed()


def test_short_error():
    assert _matrix.short_error(RuntimeError("x" * 200)).startswith("RuntimeError: xxx")
    assert len(_matrix.short_error(RuntimeError("x" * 200))) <= len("RuntimeError: ") + _matrix.MESSAGE_CHARS
    assert _matrix.short_error(ValueError("first\nsecond")) == "ValueError: first"
    assert _matrix.short_error(KeyError()) == "KeyError"


# --------------------------------------------------------------------------
# rules and explain


def test_rules_lists_every_id_with_policy(tmp_path):
    result = cli("rules", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for rule in RULES:
        line = next(l for l in result.stdout.splitlines() if l.startswith(rule.id))
        assert "strict" in line and rule.title in line


def test_rules_reads_environment(tmp_path):
    env = _env(CKPT_GUARD_POLICY="fallback", CKPT_GUARD_RULES="ckg003=warn")
    result = cli("rules", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert next(l for l in lines if l.startswith("CKG003")).split()[1] == "warn"
    assert next(l for l in lines if l.startswith("CKG001")).split()[1] == "fallback"


@pytest.mark.parametrize(
    "var, value, needle",
    [("CKPT_GUARD_POLICY", "bogus", "'bogus'"), ("CKPT_GUARD_RULES", "CKG3=warn", "'CKG3'")],
)
def test_rules_bad_environment_exits_2(tmp_path, var, value, needle):
    result = cli("rules", cwd=tmp_path, env=_env(**{var: value}))
    assert_one_line_usage_error(result, needle, var)


def test_run_flags_override_a_bad_environment(tmp_path):
    """'run --policy/--rules' win over the environment, so a bad value there is not read."""
    script = tmp_path / "prog.py"
    script.write_text("import ckpt_guard; print(ckpt_guard.current_config())\n")
    env = _env(CKPT_GUARD_POLICY="fallbak", CKPT_GUARD_RULES="CKG999=warn")
    result = cli("run", "--policy", "strict", "--rules", "CKG001=warn", str(script), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "strict" in result.stdout and "CKG001=warn" in result.stdout


def test_matrix_bad_environment_exits_2_before_running(tmp_path):
    """The matrix sets its own policies, but a mistyped CKPT_GUARD_POLICY is still reported."""
    result = cli(cwd=tmp_path, env=_env(CKPT_GUARD_POLICY="strcit"))
    assert_one_line_usage_error(result, "'strcit'", "CKPT_GUARD_POLICY")
    assert "CKG001" not in result.stdout  # no row ran


def test_explain_prints_rule_and_probe_source(tmp_path):
    result = cli("explain", "ckg001", cwd=tmp_path)  # ids are case-insensitive
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())  # undo the wrapping
    rule = rule_by_id("CKG001")
    assert result.stdout.startswith(f"CKG001  {rule.title}")
    for text in (rule.trigger, rule.symptom, rule.remedy, rule.fallback, rule.torch_versions, *rule.refs):
        assert " ".join(text.split()) in out
    assert "def _probe_grad_transform(ckpt, use_reentrant):" in result.stdout
    assert "return [grad(loss)(x)]" in result.stdout


@pytest.mark.parametrize("rule_id", ["CKG001", "CKG002", "CKG105"])
def test_explain_leads_with_what_keeps_checkpointing_where_the_composable_recompute_helps(rule_id, tmp_path):
    """A rule ckpt_guard.checkpoint handles says so before the remedy that moves or drops the checkpoint."""
    result = cli("explain", rule_id, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    labels = [line.split(":")[0].strip() for line in result.stdout.splitlines() if line[:1].isalpha()]
    rule = rule_by_id(rule_id)
    if rule.composable_helps:
        assert labels.index("works") < labels.index("otherwise")  # the remedy, after what works
        works = next(line for line in result.stdout.splitlines() if line.startswith("works:"))
        assert "ckpt_guard.checkpoint(block, *inputs)" in works
    else:  # CKG105 (default dtype) is not a transform rule: no such line
        assert "works" not in labels and "ckpt_guard.checkpoint(block" not in result.stdout


def test_rules_says_where_the_policy_comes_from_and_who_uses_it(tmp_path):
    """With nothing set the policy is the default, and it is what install() would use: not 'in force'."""
    unset = cli("rules", cwd=tmp_path, env=_env())
    assert unset.returncode == 0, unset.stderr
    head = unset.stdout.splitlines()[:2]
    assert head[0].startswith("policy from the environment: strict") and "unset, the default" in head[0]
    assert "install() with no argument" in head[1] and "only once install() has run" in head[1]
    assert "ckpt_guard.checkpoint under torch.func even without install()" in head[1]
    set_ = cli("rules", cwd=tmp_path, env=_env(CKPT_GUARD_POLICY="warn"))
    assert set_.stdout.startswith("policy from the environment: warn  (CKPT_GUARD_POLICY: warn;")


@pytest.mark.parametrize("rule_id", ["CKG001", "CKG006", "CKG113"])
def test_explains_reproduction_runs_as_a_script(rule_id, tmp_path):
    """The reproduction ``explain`` prints is a script: saved and run, it says for each variant what
    torch does against the uncheckpointed run; with its ckpt_guard line uncommented, the guard raises."""
    result = cli("explain", rule_id, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = result.stdout[result.stdout.index('"""'):]
    rule = rule_by_id(rule_id)
    for guarded in (False, True):
        path = tmp_path / f"{rule_id}_{guarded}.py"
        path.write_text(script.replace("# import ckpt_guard;", "import ckpt_guard;") if guarded else script)
        run = subprocess.run([sys.executable, "-W", "ignore", str(path)], cwd=str(tmp_path), env=_env(),
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert [line.split(":")[0] for line in lines] == [
            f"use_reentrant={variant == REENTRANT}" for variant in rule.variants
        ], run.stdout
        for line in lines:
            if guarded:
                assert f"raises CheckpointCompositionError: [{rule_id}]" in line, line
            elif rule.always_raises:
                assert "raises" in line and "CheckpointComposition" not in line, line
            else:
                assert line.endswith("matches the uncheckpointed run: False"), line


def test_explain_unknown_id_exits_2(tmp_path):
    result = cli("explain", "NOPE", cwd=tmp_path)
    assert_one_line_usage_error(result, "'NOPE'", *RULE_IDS)
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args, needle",
    [
        (("bogus",), "'bogus'"),
        (("explain",), "ID"),
        (("run",), "script"),
        (("run", "-m"), "-m"),
        (("run", "--policy", "nope", "x.py"), "'nope'"),
        (("run", "--rules", "CKG001", "x.py"), "malformed"),
        (("run", "--rules", "CKG999=warn", "x.py"), "'CKG999'"),
        (("run", "missing_script.py"), "missing_script.py"),
        (("run", "-m", "no_such_module_for_ckpt_guard"), "no_such_module_for_ckpt_guard"),
    ],
)
def test_command_line_errors_are_one_line(tmp_path, args, needle):
    assert_one_line_usage_error(cli(*args, cwd=tmp_path), needle)


# --------------------------------------------------------------------------
# run

SCRIPT = textwrap.dedent(
    """
    import sys
    print("argv", sys.argv)
    print("name", __name__)
    print("path0", sys.path[0])
    print("file", __file__)
    import helper_next_to_script
    if sys.argv[1:2] == ["exit"]:
        sys.exit(int(sys.argv[2]))
    if sys.argv[1:2] == ["boom"]:
        def explode():
            raise ValueError("boom from the script")
        explode()
    """
)


@pytest.fixture
def script(tmp_path):
    folder = tmp_path / "prog"
    folder.mkdir()
    (folder / "helper_next_to_script.py").write_text("")
    path = folder / "prog_script.py"
    path.write_text(SCRIPT)
    return path


def test_run_script_sees_argv_and_main(tmp_path, script):
    result = cli("run", str(script), "a", "--policy", "b", "-h", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"argv {[str(script), 'a', '--policy', 'b', '-h', '--json']!r}" in result.stdout
    assert "name __main__" in result.stdout
    assert f"path0 {script.parent}" in result.stdout  # the script's folder, as python does


def test_run_relative_script_gets_an_absolute_file_as_python_gives_it(tmp_path, script):
    relative = os.path.relpath(script, tmp_path)
    plain = subprocess.run([sys.executable, relative, "x"], cwd=tmp_path, capture_output=True, text=True)
    guarded = cli("run", relative, "x", cwd=tmp_path)
    assert guarded.returncode == 0, guarded.stderr
    assert f"file {script}" in plain.stdout and f"file {script}" in guarded.stdout


def test_run_propagates_exit_status(tmp_path, script):
    assert cli("run", str(script), "exit", "3", cwd=tmp_path).returncode == 3
    assert cli("run", "--policy", "warn", str(script), "exit", "0", cwd=tmp_path).returncode == 0


def test_run_traceback_points_at_the_script(tmp_path, script):
    result = cli("run", str(script), "boom", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert f'File "{script}", line' in result.stderr
    assert "in explode" in result.stderr
    assert result.stderr.strip().endswith("ValueError: boom from the script")
    assert "runpy" not in result.stderr and "_cli.py" not in result.stderr


BAD_COMPOSITION = textwrap.dedent(
    """
    import torch
    from torch.func import grad
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(3)
    def loss(x):
        return checkpoint(lambda t: (t * w).sin().sum(), x, use_reentrant=False)
    print("grad", grad(loss)(torch.randn(3)))
    """
)


def test_run_strict_catches_bad_composition(tmp_path):
    path = tmp_path / "bad_composition.py"
    path.write_text(BAD_COMPOSITION)
    result = cli("run", "--policy", "strict", str(path), cwd=tmp_path)
    assert result.returncode == 1
    assert "CheckpointCompositionError" in result.stderr and "[CKG001]" in result.stderr
    assert str(path) in result.stderr


def test_run_policy_and_rules_reach_the_program(tmp_path):
    path = tmp_path / "bad_composition.py"
    path.write_text(BAD_COMPOSITION)
    fallback = cli("run", "--policy", "fallback", str(path), cwd=tmp_path)
    assert fallback.returncode == 0, fallback.stderr
    assert "grad tensor(" in fallback.stdout and "CheckpointCompositionWarning" in fallback.stderr
    # the environment's policy, with one rule switched off on the command line: torch's own error
    off = cli("run", "--rules", "CKG001=off", str(path), cwd=tmp_path, env=_env(CKPT_GUARD_POLICY="warn"))
    assert off.returncode == 1
    assert "don't yet support saved tensor hooks" in off.stderr
    assert "CheckpointCompositionError" not in off.stderr and "[CKG001]" not in off.stderr


def test_run_module(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tool.py").write_text(SCRIPT.replace("import helper_next_to_script\n", ""))
    env = _env(PYTHONPATH=str(tmp_path))
    result = cli("run", "-m", "mypkg.tool", "x", "--policy", "y", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert f"argv {[str(package / 'tool.py'), 'x', '--policy', 'y']!r}" in result.stdout
    assert "name __main__" in result.stdout
    exited = cli("run", "--policy", "warn", "-m", "mypkg.tool", "exit", "4", cwd=tmp_path, env=env)
    assert exited.returncode == 4
    boom = cli("run", "-m", "mypkg.tool", "boom", cwd=tmp_path, env=env)
    assert boom.returncode == 1 and str(package / "tool.py") in boom.stderr


SPAWNING = textwrap.dedent(
    """
    import multiprocessing as mp
    import sys

    import torch
    import torch.multiprocessing


    def refused_here():
        from torch.utils.checkpoint import checkpoint

        import ckpt_guard

        try:
            torch.func.grad(lambda t: checkpoint(torch.sin, t, use_reentrant=False).sum())(torch.randn(3))
        except ckpt_guard.CheckpointCompositionError as exc:
            return f"guarded {exc.rule.id}"
        except RuntimeError:
            return "unguarded"
        return "no error"


    def worker(queue):
        queue.put(refused_here())


    def ddp_style_worker(rank, path):  # what torch.multiprocessing.spawn runs, as DDP launchers do
        with open(path, "w") as out:
            out.write(refused_here())


    if __name__ == "__main__":
        for method in ("spawn", "forkserver"):
            context = mp.get_context(method)
            queue = context.Queue()
            process = context.Process(target=worker, args=(queue,))
            process.start()
            print(method, queue.get(timeout=120))
            process.join()
        torch.multiprocessing.spawn(ddp_style_worker, args=(sys.argv[1],), nprocs=1)
        print("torch.multiprocessing.spawn", open(sys.argv[1]).read())
    """
)


def test_run_guards_spawned_and_forkserver_children(tmp_path):
    """Children started with a fresh interpreter (spawn, forkserver, torch.multiprocessing.spawn)
    are guarded with the launcher's configuration, like the program itself."""
    path = tmp_path / "spawning.py"
    path.write_text(SPAWNING)
    result = cli("run", "--policy", "strict", str(path), str(tmp_path / "ddp.txt"), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "spawn guarded CKG001" in result.stdout
    assert "forkserver guarded CKG001" in result.stdout
    assert "torch.multiprocessing.spawn guarded CKG001" in result.stdout
    # the launcher's rules reach them too
    off = cli("run", "--policy", "strict", "--rules", "CKG001=off", str(path), str(tmp_path / "ddp.txt"),
              cwd=tmp_path, timeout=300)
    assert "spawn unguarded" in off.stdout and "torch.multiprocessing.spawn unguarded" in off.stdout, off.stderr[-3000:]


def test_run_without_the_launcher_children_are_not_touched(tmp_path):
    """The autoinstall is the launcher's: a plain python program's children stay unguarded."""
    path = tmp_path / "spawning.py"
    path.write_text(SPAWNING)
    result = subprocess.run(
        [sys.executable, str(path), str(tmp_path / "ddp.txt")], cwd=str(tmp_path), env=_env(),
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "spawn unguarded" in result.stdout


@pytest.mark.parametrize("error", ["KeyboardInterrupt", "GeneratorExit", "ValueError"])
def test_run_traceback_of_any_uncaught_exception_starts_at_the_program(tmp_path, error):
    path = tmp_path / "interrupted.py"
    path.write_text(f"def main():\n    raise {error}('stopped')\n\nmain()\n")
    result = cli("run", str(path), cwd=tmp_path)
    assert result.stderr.startswith("Traceback (most recent call last):"), result.stderr
    assert f'File "{path}", line' in result.stderr
    assert "runpy" not in result.stderr and "_cli.py" not in result.stderr
    assert result.stderr.strip().endswith(f"{error}: stopped")
    plain = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == plain.returncode  # KeyboardInterrupt: killed by SIGINT, as python is
