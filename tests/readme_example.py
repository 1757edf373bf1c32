"""Run the README's "Using torch.func? Do this" example exactly as written.

    python tests/readme_example.py README.md

Used by the test suite and by CI (in a project where ckpt_guard is installed from
its wheel). Exit status 0 when the example runs.
"""

from __future__ import annotations

import sys

HEADING = "## Using torch.func? Do this"


def example(readme: str) -> str:
    """The first ```python block after the heading."""
    text = open(readme, encoding="utf-8").read()
    section = text[text.index(HEADING):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```", start)]


if __name__ == "__main__":
    code = example(sys.argv[1])
    exec(compile(code, "README.md (Using torch.func? Do this)", "exec"), {"__name__": "__main__"})  # noqa: S102
