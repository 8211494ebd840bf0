"""Streaming and run_cell, side by side in one run per backend (the machine is shared and noisy: compare ratios).

    .venv/bin/python bench/bench_kernel.py [--runs 15] [--backends docker,bubblewrap]

- a persistent cell `x = 1` (run_cell) against a fresh interpreter per call (exec `python3 -c 'x = 1'`);
- the first cell of a sandbox (it starts the interpreter) against a later one;
- how soon the first streamed chunk of `echo first; sleep 1` reaches the caller, against the whole run;
- 100 MB of output with a streaming callback against without (the callback's cost; the cap holds both).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import median_ms  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox import Runner, Settings


def first_cell_ms(runner: Runner, backend: str, runs: int) -> float:
    samples = []
    for _ in range(runs):
        with runner.sandbox(backend) as sb:
            started = time.perf_counter()
            sb.run_cell("x = 1")
            samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def first_chunk_ms(runner: Runner, backend: str, runs: int) -> tuple[float, float]:
    """(median ms to the first chunk, median ms of the whole run) of `echo first; sleep 1`."""
    first, whole = [], []
    for _ in range(runs):
        seen: list[float] = []
        started = time.perf_counter()
        runner.run("echo first; sleep 1", backend=backend,
                   on_stdout=lambda _, seen=seen: seen.append(time.perf_counter()))
        whole.append((time.perf_counter() - started) * 1000)
        first.append((seen[0] - started) * 1000)
    return statistics.median(first), statistics.median(whole)


def bench(backend: str, runs: int) -> None:
    big = "head -c 100000000 /dev/zero"
    chunks = {"n": 0}

    def count(_: str) -> None:
        chunks["n"] += 1

    with Runner(Settings.from_env()) as runner:
        with runner.sandbox(backend) as sb:
            cell = median_ms(lambda: sb.run_cell("x = 1"), runs)
            fresh = median_ms(lambda: sb.exec(["python3", "-c", "x = 1"]), runs)
            print(f"{backend}: run_cell 'x = 1' {cell:.0f} ms; exec python3 -c 'x = 1' {fresh:.0f} ms "
                  f"(x{cell / fresh:.2f})")
            quiet = median_ms(lambda: sb.exec(big), max(3, runs // 5))
            loud = median_ms(lambda: sb.exec(big, on_stdout=count), max(3, runs // 5))
            print(f"{backend}: 100 MB of output {quiet:.0f} ms; with a streaming callback {loud:.0f} ms "
                  f"(x{loud / quiet:.2f})")
        first = first_cell_ms(runner, backend, max(3, runs // 3))
        print(f"{backend}: first cell of a sandbox (starts the interpreter) {first:.0f} ms; a later one {cell:.0f} ms")
        chunk, whole = first_chunk_ms(runner, backend, max(3, runs // 3))
        print(f"{backend}: one-shot `echo first; sleep 1`: first chunk after {chunk:.0f} ms, whole run {whole:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--backends", default="docker,bubblewrap")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        bench(backend, args.runs)


if __name__ == "__main__":
    main()
