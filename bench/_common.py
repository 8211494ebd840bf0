"""What every benchmark here shares: the median of repeated timings, after one warm-up call; the README's rows."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from execbox.runner.batch import percentile

README = Path(__file__).resolve().parents[1] / "README.md"


def median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up: first-call costs (imports, image layers, page cache) are not what we compare
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def p99(samples: list[float]) -> float:
    return percentile(samples, 0.99)  # the batch summary's rule, so every p99 in the README is the same one


def write_readme(section: str, rows: list[tuple[str, str]], command: str, figure: str = "median") -> None:
    """Replace the table between README.md's bench:SECTION markers: one row per (what, figure), the command that
    produced them in the first row."""
    text = README.read_text()
    begin, end = f"<!-- bench:{section} -->\n", f"<!-- /bench:{section} -->\n"
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    body = f"| what | {figure} | command |\n|---|---|---|\n" + "".join(
        f"| {what} | {value} | {command if i == 0 else 'same'} |\n" for i, (what, value) in enumerate(rows))
    README.write_text(head + begin + body + end + tail)
    print(f"README.md: {len(rows)} rows rewritten")
