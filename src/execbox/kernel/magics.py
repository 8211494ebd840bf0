"""IPython's ``%pip install`` / ``!pip install`` lines in ``run_cell``, as agent frameworks and notebooks send them.

A cell that parses as Python is Python, whatever its lines start with (``%`` continuing an expression, ``!`` in
a string). One that does not is split at its magic lines (a line starting with ``!`` or ``%``): the pip installs
among them go to ``pip_install`` (the package cache: wheels fetched on the host by the trusted step, installed in
the sandbox with no index), the Python between them runs in the interpreter, in order. Any other magic or shell
escape is refused before anything runs: ``run_cell`` runs Python, and commands have ``exec``. This module only
reads the cell; the requirements are checked where the install happens (kit.packages.check_requirements).
"""

from __future__ import annotations

import ast
import shlex
from dataclasses import dataclass

#: pip install's options that change nothing of what is installed, or only how much pip says (quiet).
_HARMLESS = {"-U", "--upgrade", "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--no-color"}
_QUIET = {"-q", "-qq", "-qqq", "--quiet"}
#: The ways a notebook line runs pip: %pip, !pip, !pip3, !python -m pip, !python3 -m pip.
_PIP = {("%pip",), ("!pip",), ("!pip3",), ("!python", "-m", "pip"), ("!python3", "-m", "pip")}
_FLAGS = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
#: The most parts one cell splits into: each Python part is padded to the cell's line numbers, so their size
#: together is this many times the cell's at worst.
MAX_PARTS = 64


class MagicError(ValueError):
    """A magic line run_cell does not run (the message says why and what to do instead)."""


@dataclass(frozen=True)
class PipInstall:
    """One ``pip install`` line: its requirements as written (unchecked) and whether it asked to be quiet."""

    requirements: tuple[str, ...]
    quiet: bool
    line: str


#: A cell's parts in order: Python source (padded with blank lines, so a traceback's line numbers are the
#: cell's), or a pip install.
Part = str | PipInstall


def _parses(code: str) -> bool:
    try:
        compile(code, "<cell>", "exec", ast.PyCF_ONLY_AST | _FLAGS, dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def _is_magic(line: str) -> bool:
    return line.lstrip().startswith(("!", "%"))


def split_cell(code: str) -> list[Part]:
    """The cell's parts: ``[code]`` for a cell of Python; raises MagicError for a magic that is not a pip
    install, one inside a block, a ``%%`` cell magic, or a pip line it cannot read."""
    lines = code.split("\n")
    if not any(_is_magic(line) for line in lines) or _parses(code):
        return [code]
    parts: list[Part] = []
    chunk: list[str] = []
    start = 0

    def flush() -> None:
        if any(line.strip() for line in chunk):
            parts.append("\n" * start + "\n".join(chunk))
        chunk.clear()

    number = 0
    while number < len(lines):
        line = lines[number]
        if line.startswith(("!", "%")):
            flush()
            if len(parts) >= MAX_PARTS:
                raise MagicError(f"more than {MAX_PARTS // 2} `%pip install` lines in one cell: put the "
                                 "requirements on fewer lines")
            pieces = [line]
            while pieces[-1].endswith("\\") and number + 1 < len(lines):  # a magic continued on the next line
                pieces[-1] = pieces[-1][:-1]
                number += 1
                pieces.append(lines[number].strip())
            parts.append(_pip_line(" ".join(pieces)))
            start = number + 1
        else:
            chunk.append(line)
        number += 1
    flush()
    for part in parts:
        if isinstance(part, str) and not _parses(part) and any(_is_magic(line) for line in part.split("\n")):
            raise MagicError("a magic or shell escape inside a block (an indented `!` or `%` line) is not run: put "
                             "`%pip install ...` on a line of its own at the top level of the cell")
    return parts


def _pip_line(line: str) -> PipInstall:
    if line.startswith("%%"):
        raise MagicError(f"{line.split()[0]}: cell magics are not run by run_cell, which runs Python; run commands "
                         "with the sandbox's exec()")
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise MagicError(f"cannot read the line {line[:200]!r}: {exc}") from None
    for prefix in _PIP:
        if tuple(words[:len(prefix)]) == prefix:
            rest = words[len(prefix):]
            break
    else:
        what = words[0] if words else line[:1]
        raise MagicError(f"{what[:100]}: run_cell runs Python; of the notebook magics it runs only `%pip install` "
                         "(and `!pip install`), from the package cache. Run commands with the sandbox's exec()")
    if not rest or rest[0] != "install":
        raise MagicError(f"{line[:200]!r}: run_cell runs `pip install` only (from the package cache); run other pip "
                         "commands with the sandbox's exec()")
    quiet = any(word in _QUIET for word in rest[1:])
    requirements = tuple(word for word in rest[1:] if word not in _QUIET | _HARMLESS)
    return PipInstall(requirements, quiet, line)
