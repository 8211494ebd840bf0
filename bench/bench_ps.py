"""What `execbox ps` costs a one-shot run, measured side by side in one run (the machine is shared and noisy:
runs alternate between the two, and the medians are compared).

    .venv/bin/python bench/bench_ps.py [--backend bubblewrap] [--runs 150] [--readme]

- one-shot `true` with its `execbox ps` record (created, its kill marker looked at, removed) against the same
  run with the record's calls replaced by no-ops;
- the record alone: create, kill check, remove, in a loop (what it adds, without the run's noise).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, cast

from _common import p99, write_readme  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox import Runner, Settings
from execbox.contract.backend import Session, SessionSpec
from execbox.contract.models import Limits
from execbox.runner import live


class _Session:
    kill_ref = "/tmp/execbox-bwrap-1-2-bench"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="bubblewrap")
    parser.add_argument("--runs", type=int, default=150)
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's bench:ps rows")
    args = parser.parse_args()

    local = {"local": True, "network": "host"} if args.backend == "local_subprocess" else {}
    runner = Runner(Settings.from_env(backend=args.backend, **local))
    real = (live.oneshot, live.closed)

    def nothing(*_: Any, **__: Any) -> None:
        return None

    for _ in range(5):
        runner.run(["true"])
    samples: dict[str, list[float]] = {"with its record": [], "without": []}
    for i in range(args.runs):
        for mode in ("with its record", "without") if i % 2 else ("without", "with its record"):
            live.oneshot, live.closed = real if mode == "with its record" else (nothing, nothing)
            started = time.perf_counter()
            runner.run(["true"])
            samples[mode].append((time.perf_counter() - started) * 1000)
    live.oneshot, live.closed = real
    runner.close()
    rows = [(f"one-shot `true` on {args.backend}, {mode}", f"{statistics.median(ms):.1f} ms / {p99(ms):.1f} ms")
            for mode, ms in samples.items()]
    rows.append(("added by the record, median of the per-pair difference",
                 f"{statistics.median(a - b for a, b in zip(*samples.values(), strict=True)):+.2f} ms"))

    spec = SessionSpec("none", Limits(memory_mb=1024, cpus=1.0, pids=256, disk_mb=2048), True, 60)
    n = 3000
    started = time.perf_counter()
    for i in range(n):
        live.oneshot(f"bench{i}", args.backend, cast(Session, _Session()), spec, "python3", timeout_s=30,
                     pooled=False)
        with live.told_if_killed(f"bench{i}", args.backend, ""):
            pass
        live.closed(f"bench{i}", marks=live.killed(f"bench{i}"))
    rows.append(("the record alone (create, kill check, remove; no sandbox)",
                 f"{(time.perf_counter() - started) / n * 1e6:.0f} µs"))
    for what, value in rows:
        print(f"{what}: {value}")
    if args.readme:
        write_readme("ps", rows, f"`.venv/bin/python bench/bench_ps.py --runs {args.runs} --readme`",
                     figure="median / p99")


if __name__ == "__main__":
    main()
