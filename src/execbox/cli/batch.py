"""`execbox batch FILE.jsonl`: many one-shots from a file of JSON lines, their results as JSON lines (runner.map)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import IO

import click

from execbox.cli.common import export_telemetry, fail, load_settings, stop_signals_interrupt
from execbox.errors import ConfigError, ExecboxError
from execbox.runner import Runner
from execbox.runner.batch import Item

#: A longer input line is that item's error (its files travel base64 inside it: raise the cap with a file instead).
LINE_LIMIT = 64 << 20


def _items(source: IO[bytes]) -> Iterator[Item]:
    """Each non-blank line as an item: a JSON object (ExecRequest's fields), a string (Python code) or an array
    (argv). A line that is not one is that item's error, and the batch goes on."""
    number = 0
    while line := source.readline(LINE_LIMIT + 1):
        number += 1
        if len(line) > LINE_LIMIT and not line.endswith(b"\n"):
            while (rest := source.readline(LINE_LIMIT)) and not rest.endswith(b"\n"):
                pass
            yield ConfigError(f"line {number}: longer than {LINE_LIMIT} bytes; put large data in files (upload)")
            continue
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as exc:
            yield ConfigError(f"line {number}: not JSON: {str(exc)[:200]}")
            continue
        yield item if isinstance(item, (dict, str, list)) else ConfigError(
            f"line {number}: a JSON {type(item).__name__}; give an object (a request), a string (code) or an array "
            "(a command)")


@click.command()
@click.argument("source", type=click.File("rb"), metavar="FILE.jsonl")
@click.option("--backend", help="Backend name (default: CODE_EXEC_BACKEND, auto = strongest sandbox here).")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="Runs at a time (default and most: CODE_EXEC_MAX_CONCURRENT).")
@click.option("--as-completed", is_flag=True, help="Print each result as it finishes, not in input order.")
@click.option("--progress/--no-progress", default=None,
              help="A progress bar on stderr (default: when stderr is a terminal).")
def batch(source: IO[bytes], backend: str | None, concurrency: int | None, as_completed: bool,
          progress: bool | None) -> None:
    """Run each line of FILE.jsonl ('-': standard input) in its own fresh sandbox and print one JSON line per item,
    in input order: the result as `execbox run --json` prints it, or {"error": ...}, with "index" (the item's place
    among the non-blank lines). A line is a request ({"code": "print(1)", "timeout": 5}, {"argv": ["ls"]}, files
    base64), a string (Python code) or an array (a command). One item's failure, timeout or refusal never stops
    the batch; the summary goes to stderr at the end.

    Exits 0 when every item passed (ran and exited 0), 1 when one did not, 130 when interrupted (Ctrl-C, SIGTERM,
    SIGHUP: what still ran is stopped and removed), 2 for a usage error."""
    settings = load_settings(False)
    export_telemetry()
    stop_signals_interrupt()
    shown = sys.stderr.isatty() if progress is None else progress
    with Runner(settings) as runner:
        try:
            work = runner.map(_items(source), concurrency=concurrency, ordered=not as_completed, progress=shown,
                              backend=backend)
        except ExecboxError as exc:
            fail(exc, False)
        with work:
            try:
                for item in work:
                    click.echo(json.dumps(item.to_dict()))
                    sys.stdout.flush()
            except KeyboardInterrupt:
                click.echo(f"execbox batch: interrupted; {work.summary}", err=True)
                sys.exit(130)
        if not shown:  # the progress bar ends with the summary itself
            click.echo(f"execbox batch: {work.summary}", err=True)
    sys.exit(0 if work.summary.counts["passed"] == work.summary.total else 1)
