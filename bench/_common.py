"""What every benchmark here shares: the median of repeated timings, after one warm-up call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up: first-call costs (imports, image layers, page cache) are not what we compare
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)
