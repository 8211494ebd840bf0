"""The README's examples, as the suite runs them: a fenced block found by the heading it sits under."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(heading: str, language: str) -> list[str]:
    """The ``language`` code blocks of the section whose heading line is ``heading`` (e.g. "### smolagents"), up to
    the next heading of the same or a higher level; an AssertionError when the section or its blocks are gone."""
    text = README.read_text()
    level = len(heading) - len(heading.lstrip("#"))
    start = text.find(f"\n{heading}\n")
    assert start >= 0, f"README: no section {heading!r}"
    end = re.compile(rf"\n#{{1,{level}}} ").search(text, start + 1)
    section = text[start:end.start() if end else len(text)]
    found = re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)
    assert found, f"README: no {language} block under {heading!r}"
    return found
