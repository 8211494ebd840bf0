"""Issue 30's snapshot figures, side by side in one run, on docker and bubblewrap.

    .venv/bin/python bench/bench_snapshots.py [--rounds 5] [--forks 8] [--workspace-mb 100] [--readme]

The prepared state: a session with a WORKSPACE_MB file of random bytes in its workspace and a package installed
with `pip install --user` (a wheel built here: no index, no build step). Each round, per backend:
- `sb.snapshot()` of that session;
- `sb.fork(N)`: the time to N open sandboxes started from it, and the first exec in one of them;
- `sb.rollback(snap)` after the session changed, and one sandbox opened (and closed) `from_snapshot=` it alone;
- against what the user saves: N fresh sandboxes opened at once, each redoing the set-up (the same file written,
  the same package installed).
Medians and p99 over the rounds (p99 of so few rounds is their worst); the ratio is fresh-and-set-up over fork.
The set-up here is the cheapest there is (bytes from /dev/urandom, a local wheel): a fork's cost is copying the
snapshot's bytes into each child, whatever the set-up cost; a real one (a clone, a download, a build) saves more.
--readme rewrites the README rows between the bench:snapshots markers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from _common import write_readme  # bench/_common.py (run from the repo: python bench/NAME.py)
from bench_pool import med, p99

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' wheel builder
from execbox import AsyncRunner, AsyncSandbox, Settings  # noqa: E402
from tests.support import wheels  # noqa: E402

PIP = "pip install --user --break-system-packages --no-index --no-deps"


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await call()
    return (time.perf_counter() - started) * 1000


async def set_up(sb: AsyncSandbox, wheel: Path, workspace_mb: int) -> None:
    """The work a snapshot saves: a large workspace and an installed package."""
    made = await sb.exec(f"head -c {workspace_mb}M /dev/urandom > data.bin", timeout=120)
    assert made.exit_code == 0, made
    await sb.upload(str(wheel), wheel.name)
    installed = await sb.exec(f"python3 -m {PIP} {wheel.name} && rm {wheel.name}", timeout=120)
    assert installed.exit_code == 0, installed.stderr


async def one_round(backend: str, wheel: Path, forks: int, workspace_mb: int) -> dict[str, float]:
    probe = f"python3 -c 'import {wheels.MODULE}'"
    settings = Settings.from_env(backend=backend, max_concurrent=2 * forks + 4)
    async with AsyncRunner(settings) as runner, runner.sandbox() as sb:
        await set_up(sb, wheel, workspace_mb)
        figures: dict[str, float] = {}
        started = time.perf_counter()
        snap = await sb.snapshot()
        figures["snapshot"] = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        children = await sb.fork(forks)
        figures["fork"] = (time.perf_counter() - started) * 1000
        try:
            first = await children[0].exec(probe)
            figures["first exec"] = (time.perf_counter() - started) * 1000 - figures["fork"]
            assert first.exit_code == 0, first
        finally:
            for child in children:
                await child.close()

        async def one_from_it() -> None:
            async with runner.sandbox(from_snapshot=snap):
                pass

        figures["from_snapshot"] = await timed(one_from_it)
        await sb.exec("rm -rf data.bin ~/.local")
        figures["rollback"] = await timed(lambda: sb.rollback(snap))
        assert (await sb.exec(probe)).exit_code == 0
        await runner.delete_snapshot(snap)

        async def fresh() -> None:
            async with runner.sandbox() as again:
                await set_up(again, wheel, workspace_mb)
                assert (await again.exec(probe)).exit_code == 0

        async def fresh_all() -> None:
            await asyncio.gather(*(fresh() for _ in range(forks)))

        figures["fresh"] = await timed(fresh_all)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forks", type=int, default=8)
    parser.add_argument("--workspace-mb", type=int, default=100)
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's rows for these figures")
    args = parser.parse_args()
    backends = ("docker", "bubblewrap")
    with tempfile.TemporaryDirectory() as tmp:
        wheel = wheels.build_wheel(Path(tmp))
        for backend in backends:  # warm-up: images, page cache, first-call costs
            asyncio.run(one_round(backend, wheel, 2, 1))
        got: dict[str, dict[str, list[float]]] = {b: {} for b in backends}
        for round_no in range(args.rounds):
            for backend in backends[round_no % 2:] + backends[:round_no % 2]:  # who goes first alternates
                figures = asyncio.run(one_round(backend, wheel, args.forks, args.workspace_mb))
                for name, ms in figures.items():
                    got[backend].setdefault(name, []).append(ms)
                print(f"  round {round_no + 1}/{args.rounds} {backend}: "
                      + ", ".join(f"{k} {v:.0f} ms" for k, v in figures.items()), flush=True)
    rows = []
    n, mb = args.forks, args.workspace_mb
    for backend in backends:
        f = got[backend]

        def fig(name: str, f: dict[str, list[float]] = f) -> str:
            return f"{med(f[name]):.0f} ms (p99 {p99(f[name]):.0f})"

        rows += [
            (f"{backend}: snapshot of a session with {mb} MB in its workspace and a pip --user package",
             fig("snapshot")),
            (f"{backend}: `fork({n})`, to {n} open sandboxes / then the first exec in one", f"{fig('fork')} / "
             f"{fig('first exec')}"),
            (f"{backend}: `rollback` to it / one sandbox opened `from_snapshot=` it (and closed)",
             f"{fig('rollback')} / {fig('from_snapshot')}"),
            (f"{backend}: {n} fresh sandboxes at once, each redoing that set-up (what a fork saves)",
             f"{fig('fresh')}; fork: x{med(f['fresh']) / med(f['fork']):.1f} faster"),
        ]
    for what, figure in rows:
        print(f"{what}: {figure}")
    if args.readme:
        write_readme("snapshots", rows, f"`.venv/bin/python bench/bench_snapshots.py --rounds {args.rounds} "
                                        f"--forks {n} --workspace-mb {mb} --readme`")


if __name__ == "__main__":
    main()
