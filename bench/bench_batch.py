"""Issue 29's batch figures, side by side in one run: N `print(1)` snippets, each in a fresh sandbox.

    .venv/bin/python bench/bench_batch.py [--items 1000] [--rounds 5] [--peer] [--readme]

- execbox `runner.map` on docker and bubblewrap, without and with the warm pool (CODE_EXEC_POOL_SIZE = the
  concurrency);
- what users write today: a plain asyncio fan-out over `arun_code` (a semaphore at the same concurrency);
- with --peer, llm-sandbox's documented pooled runner (`create_pool_manager` + `PooledSandboxSession`, one thread
  per slot) on docker, installed in .bench-peer/ (never in the project's venv). Its pool REUSES a container for
  many runs; every execbox figure here is a fresh sandbox per item.
The execbox configurations are interleaved round by round (N / rounds items each, in turn, each round starting one
configuration later), so the machine's noise falls on all of them alike. Throughput is items / the configuration's
summed wall time; p50 / p99 are per item, from its start (a slot free) to its result. --readme rewrites the README
rows between the bench:batch markers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from _common import p99, write_readme  # bench/_common.py (run from the repo: python bench/NAME.py)
from bench_pool import PEER_IMAGE, med, peer_image

from execbox import AsyncRunner, Settings

SNIPPET = "print(1)"
Rows = list[tuple[str, str]]
Figures = dict[str, tuple[float, list[float]]]  # name -> (summed wall seconds, per-item ms)


async def execbox_map(backend: str, pool: bool, concurrency: int, items: int) -> tuple[float, list[float]]:
    settings = Settings.from_env(backend=backend, max_concurrent=concurrency, pool_size=concurrency if pool else 0)
    async with AsyncRunner(settings) as runner:
        if pool:
            await runner.warm(backend)
            await asyncio.sleep(0)
        started = time.perf_counter()
        async with runner.map([SNIPPET] * items, progress=False) as batch:
            got = [item async for item in batch]
        wall = time.perf_counter() - started
    assert all(item.ok for item in got), [item for item in got if not item.ok][:3]
    return wall, [item.elapsed_s * 1000 for item in got]


async def asyncio_fan_out(backend: str, concurrency: int, items: int) -> tuple[float, list[float]]:
    """What a user writes today: gather over arun_code, a semaphore at the same concurrency."""
    settings = Settings.from_env(backend=backend, max_concurrent=concurrency)
    limit = asyncio.Semaphore(concurrency)
    times: list[float] = []

    async def one() -> None:
        async with limit:
            started = time.perf_counter()
            result = await runner.run_code(SNIPPET)
            times.append((time.perf_counter() - started) * 1000)
            assert result.ok, result

    async with AsyncRunner(settings) as runner:
        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(items)))
        return time.perf_counter() - started, times


def interleaved(configs: dict[str, Callable[[int], Awaitable[tuple[float, list[float]]]]], items: int,
                rounds: int) -> Figures:
    figures: Figures = {name: (0.0, []) for name in configs}
    for run in configs.values():  # warm-up: images, page cache, first-call costs
        asyncio.run(run(2))
    share = items // rounds
    names = list(configs)
    for round_no in range(rounds):
        # Each round starts one configuration later: what one leaves behind (an engine still removing containers)
        # falls on each of the others in turn, not always on the same one.
        for name in names[round_no % len(names):] + names[:round_no % len(names)]:
            run = configs[name]
            wall, times = asyncio.run(run(share))
            figures[name] = (figures[name][0] + wall, figures[name][1] + times)
            print(f"  round {round_no + 1}/{rounds} {name:<34} {share / wall:6.1f} runs/s", flush=True)
    return figures


def peer(items: int, concurrency: int) -> tuple[float, list[float]]:
    python = peer_image()
    script = Path(__file__).parent / "peer_llm_sandbox_pool.py"
    try:
        out = subprocess.run([str(python), str(script), PEER_IMAGE, str(items), str(concurrency)],
                             capture_output=True, text=True, check=True).stdout
    finally:  # its pool's close leaves its containers running: they are not ours to leave behind
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"ancestor={PEER_IMAGE}"], capture_output=True,
                              text=True, check=False).stdout.split()
        if left:
            subprocess.run(["docker", "rm", "-f", *left], capture_output=True, check=False)
    got = json.loads(out.strip().splitlines()[-1])
    return got["wall_s"], got["times_ms"]


def row(items: int, wall: float, times: list[float]) -> str:
    return f"{items / wall:.1f} runs/s; per item p50 {med(times):.0f} ms, p99 {p99(times):.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--peer", action="store_true", help="measure llm-sandbox's pooled runner too")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's rows for these figures")
    args = parser.parse_args()
    n, c = args.items, args.concurrency
    configs: dict[str, Callable[[int], Awaitable[tuple[float, list[float]]]]] = {}
    for backend in ("docker", "bubblewrap"):
        configs[f"{backend} map"] = lambda k, b=backend: execbox_map(b, False, c, k)
        configs[f"{backend} map, warm pool"] = lambda k, b=backend: execbox_map(b, True, c, k)
        configs[f"{backend} asyncio fan-out (arun_code)"] = lambda k, b=backend: asyncio_fan_out(b, c, k)
    print(f"{n} x `{SNIPPET}`, concurrency {c}, {args.rounds} interleaved rounds")
    figures = interleaved(configs, n, args.rounds)
    done = n // args.rounds * args.rounds
    rows: Rows = []
    for backend in ("docker", "bubblewrap"):
        mine, pooled, fan = (figures[f"{backend} {k}"] for k in ("map", "map, warm pool",
                                                                  "asyncio fan-out (arun_code)"))
        rows.append((f"{backend}: {done} one-shots with `runner.map` / with the warm pool",
                     f"{row(done, *mine)} / {row(done, *pooled)}"))
        rows.append((f"{backend}: the same as a plain asyncio fan-out over `arun_code` (what users write today)",
                     f"{row(done, *fan)} (map: x{(done / mine[0]) / (done / fan[0]):.2f} the throughput)"))
    if args.peer:
        wall, times = peer(done, c)
        rows.append(("llm-sandbox's pooled runner (peer; docker; its containers are reused across runs)",
                     row(done, wall, times)))
    for what, figure in rows:
        print(f"{what}: {figure}")
    if args.readme:
        command = (f"`.venv/bin/python bench/bench_batch.py --items {n} --rounds {args.rounds} --concurrency {c}"
                   f"{' --peer' if args.peer else ''} --readme`")
        write_readme("batch", rows, command, figure="figure")


if __name__ == "__main__":
    main()
