#!/usr/bin/env python3
"""The README's variable tables come from the settings models (execbox.config.settings.settings_table).

    scripts/readme_settings.py          rewrite every <!-- settings:NAME --> ... <!-- /settings --> block
    scripts/readme_settings.py --check  exit 1 (naming the blocks) when the README is out of date

NAME is ``core`` for execbox's own settings, or a built-in backend's name for its settings_model.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from execbox.config.settings import EnvSettings, Settings, settings_table
from execbox.registry import get_registry

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- settings:(\w+) -->\n)(.*?)(<!-- /settings -->)", re.S)


def models() -> dict[str, type[EnvSettings]]:
    from execbox.mcp.settings import McpSettings  # the MCP server's own knobs (no SDK needed to read them)

    found: dict[str, type[EnvSettings]] = {"core": Settings, "mcp": McpSettings}
    for name, entry in get_registry(load=[]).backends.items():
        if entry.cls.settings_model is not None:
            found[name] = entry.cls.settings_model
    return found


def render(text: str) -> str:
    known = models()

    def block(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in known:
            raise SystemExit(f"README block settings:{name} names no settings model; known: {', '.join(known)}")
        return match.group(1) + settings_table(known[name]) + match.group(4)

    return BLOCK.sub(block, text)


def main() -> int:
    text = README.read_text()
    new = render(text)
    if "--check" in sys.argv[1:]:
        missing = sorted(set(models()) - {m.group(2) for m in BLOCK.finditer(text)})
        if missing:
            print(f"README.md has no settings table for: {', '.join(missing)} (add <!-- settings:NAME --> blocks)")
            return 1
        if new != text:
            stale = [m.group(2) for m in BLOCK.finditer(text) if m.group(0) not in new]
            print(f"README.md settings tables are out of date ({', '.join(stale)}): run scripts/readme_settings.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
