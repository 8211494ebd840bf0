"""The README's examples, for the tests that run them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(heading: str) -> str:
    """The first python block after the heading ``heading`` (any level) in the README."""
    found = re.search(rf"^#+ {re.escape(heading)}\n.*?```python\n(.*?)```", README.read_text(), re.S | re.M)
    assert found, f"no python block under the heading {heading!r} in the README"
    return found.group(1)
