"""Core overhead, measured side by side in one run (the machine is shared and noisy: compare ratios).

    .venv/bin/python bench/bench_core.py [--runs 30]

- one-shot `true` through execbox (local_subprocess: guard, env policy, reaper, capture, workspace)
  against a bare subprocess.run of the same command;
- BoundedCapture throughput and peak memory while 1 GiB streams through it.
"""

from __future__ import annotations

import argparse
import subprocess
import time
import tracemalloc

from _common import median_ms  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox import Runner, Settings
from execbox.contract.output import BoundedCapture


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

    runner = Runner(Settings.from_env(backend="local_subprocess", local=True, network="host"))
    bare = median_ms(lambda: subprocess.run(["true"], check=True), args.runs)
    ours = median_ms(lambda: runner.run(["true"]), args.runs)
    print(f"one-shot `true`: bare subprocess {bare:.1f} ms, execbox local_subprocess {ours:.1f} ms "
          f"(x{ours / bare:.1f}, +{ours - bare:.1f} ms) — median of {args.runs}")

    chunk = b"x" * 65536
    capture = BoundedCapture(100_000)
    tracemalloc.start()
    started = time.perf_counter()
    for _ in range((1 << 30) // len(chunk)):
        capture.write(chunk)
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"BoundedCapture: 1 GiB in {elapsed:.2f} s ({1024 / elapsed:.0f} MiB/s), "
          f"peak traced memory {peak / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
