"""The conformance matrix is the gate: every cell equals the plain code, or is a documented refusal.

``tests/conformance.py`` builds the cells (module kinds × transforms × ways in ×
entries) and runs each against the same program without checkpointing.  A cell
fails on a number that differs or an error where the plain code runs; a cell
that ran without checkpointing (or was refused under strict) must name a refusal
class that ``docs/limits.md`` lists, or a rule of the guard's table.  The table
``docs/conformance.md`` shows the matrix; its section for the installed torch must
be what this run measures.
"""

from __future__ import annotations

import os
import re

import pytest

import conformance as matrix
from ckpt_guard import _composable
from ckpt_guard._rules import RULES

HERE = os.path.dirname(os.path.abspath(__file__))
LIMITS = os.path.join(HERE, os.pardir, "docs", "limits.md")
TABLE = os.path.join(HERE, os.pardir, "docs", "conformance.md")

CELLS = matrix.cells()
#: what each cell did, filled as the cells run (the table's test reads it)
OUTCOMES: dict = {}


def _documented() -> list:
    with open(LIMITS) as limits:
        return matrix.documented_refusal_classes(limits.read())


ACCEPTED = {*_documented(), "forward-only", *(f"rule {rule.id}" for rule in RULES)}


@pytest.mark.parametrize("cell", CELLS, ids=[cell.label() for cell in CELLS])
def test_cell_equals_the_plain_code_or_is_a_documented_refusal(cell):
    outcome = OUTCOMES[cell] = matrix.run_cell(cell)
    assert not outcome.failed, f"{outcome.verdict}: {outcome.detail}"
    if outcome.verdict in ("plain", "refused"):
        assert outcome.refusal in ACCEPTED, (
            f"{outcome.verdict} for a refusal class docs/limits.md does not list: {outcome.refusal!r} ({outcome.detail})"
        )


def test_every_refusal_class_is_documented_and_nothing_else():
    assert sorted(_documented()) == sorted(_composable.REFUSAL_CLASSES)


def test_the_matrix_crosses_every_kind_with_every_transform_for_the_main_entries():
    for entry in matrix.MAIN_ENTRIES:
        main = {(c.kind, c.transform) for c in CELLS if c.entry == entry and c.access == "functional_call"}
        assert main == {(k, t) for k in matrix.KINDS for t in matrix.TRANSFORMS}
    # a block under no_grad: every kind under every transform (grad mode is each level's, read at the call)
    under = {(c.kind, c.transform) for c in CELLS if c.access == matrix.UNDER_NO_GRAD and c.entry == matrix.MAIN_ENTRIES[0]}
    assert under == {(k, t) for k in matrix.KINDS for t in matrix.TRANSFORMS}
    for axis, values in (("access", matrix.ACCESS), ("entry", matrix.ENTRIES)):
        assert {getattr(c, axis) for c in CELLS} == set(values)


def test_the_table_in_docs_is_this_torchs():
    import torch

    with open(TABLE) as table:
        text = table.read()
    title = f"## torch {torch.__version__.split('+')[0]}"
    if title not in text:
        pytest.skip(f"docs/conformance.md has no section for torch {torch.__version__} (CI's releases have one)")
    outcomes = {cell: OUTCOMES.get(cell) or matrix.run_cell(cell) for cell in CELLS}
    written = re.split(r"^(?=## torch )", text, flags=re.M)
    section = next(part for part in written if part.startswith(title + "\n"))
    measured = matrix.version_section(outcomes)
    if section.rstrip() != measured.rstrip():
        import difflib

        changed = list(difflib.unified_diff(section.rstrip().splitlines(), measured.rstrip().splitlines(),
                                            "docs/conformance.md", "this run", n=0, lineterm=""))
        pytest.fail("docs/conformance.md is stale for this torch (run python tests/conformance.py --write "
                    "docs/conformance.md); first differences:\n" + "\n".join(changed[:40]))
