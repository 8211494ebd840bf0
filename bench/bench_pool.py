"""Issue 16's figures, side by side in one run (the machine is shared and noisy: compare medians and ratios).

    .venv/bin/python bench/bench_pool.py [--runs 30] [--concurrent 200]

- one-shot time-to-result on docker, in-process: a raw hardened `docker run` (CLI), execbox without a pool,
  execbox from a warm pool (`true` and `print(1)` in python): median and p99;
- the same from the warm pool under sustained load (runs back to back: the pool refills while they run);
- N concurrent one-shots in one process: wall time, most running at once, containers left;
- `execbox run` as a fresh process against the raw docker CLI for the same hardened one-shot.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio

from execbox import AsyncRunner, Runner, Settings
from execbox.backends import docker_image

REPO = Path(__file__).resolve().parents[1]
RAW = ["docker", "run", "--rm", "--network", "none", "--cap-drop", "ALL", "--read-only", "--user", "65534:65534",
       "--security-opt", "no-new-privileges", "--pids-limit", "256", "--memory", "1g",
       docker_image.DEFAULT_TAG, "true"]


def timings(fn: Callable[[], object], runs: int, before: Callable[[], object] | None = None) -> list[float]:
    fn()  # warm-up
    samples = []
    for _ in range(runs):
        if before:
            before()
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def show(label: str, samples: list[float], base: float | None = None) -> float:
    med = statistics.median(samples)
    ratio = f"  x{med / base:.2f} raw" if base else ""
    print(f"  {label:<44} median {med:7.1f} ms   p99 {p(samples, 0.99):7.1f} ms{ratio}")
    return med


def concurrent(n: int) -> None:
    seen = {"now": 0, "peak": 0}
    lock = threading.Lock()

    async def go() -> float:
        async with AsyncRunner(Settings.from_env(backend="docker")) as runner:
            async def one() -> None:
                result = await runner.run("sleep 0.2")
                assert result.exit_code == 0, result
            orig = runner.slots.acquire

            async def counting(*a: object, **k: object) -> float:
                waited = await orig(*a, **k)  # type: ignore[arg-type]
                with lock:
                    seen["now"] += 1
                    seen["peak"] = max(seen["peak"], seen["now"])
                return waited
            orig_release = runner.slots.release

            def release() -> None:
                with lock:
                    seen["now"] -= 1
                orig_release()
            runner.slots.acquire = counting  # type: ignore[method-assign]
            runner.slots.release = release  # type: ignore[method-assign]
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(one)
            return time.perf_counter() - started

    elapsed = anyio.run(go)
    left = subprocess.run(["docker", "ps", "-aq", "--filter", "label=io.execbox.owner"], capture_output=True,
                          text=True, check=True).stdout.split()
    cap = Runner(Settings.from_env()).aio.slots.total
    print(f"  {n} concurrent `sleep 0.2` one-shots: {elapsed:.1f} s, at most {seen['peak']} at once (cap {cap}), "
          f"{len(left)} containers left")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--concurrent", type=int, default=200)
    args = parser.parse_args()
    print(f"median / p99 of {args.runs} runs, docker, in-process unless said")
    raw = show("raw hardened `docker run` (CLI)", timings(lambda: subprocess.run(RAW, check=True), args.runs))
    plain = Runner(Settings.from_env(backend="docker"))
    show("execbox one-shot `true`, no pool", timings(lambda: plain.run("true"), args.runs), raw)
    with Runner(Settings.from_env(backend="docker", pool_size=4)) as pooled:
        def full() -> None:
            while pooled.warm() < 4:
                time.sleep(0.01)
        full()
        show("execbox one-shot `true`, warm pool", timings(lambda: pooled.run("true"), args.runs, full), raw)
        show("execbox `print(1)` python, warm pool", timings(lambda: pooled.run_code("print(1)"), args.runs, full),
             raw)
        full()
        back_to_back = timings(lambda: pooled.run("true"), args.runs)
        hits = sum(pooled.run("true").pooled for _ in range(10))
        show(f"  back to back (pool of 4 refilling; {hits}/10 pooled)", back_to_back, raw)
    concurrent(args.concurrent)
    cli = [str(REPO / ".venv/bin/execbox"), "run", "--backend", "docker", "--", "true"]
    print("fresh process")
    raw_cli = show("raw hardened `docker run` (CLI)", timings(lambda: subprocess.run(RAW, check=True), args.runs // 3))
    show("`execbox run --backend docker -- true`", timings(lambda: subprocess.run(cli, check=True), args.runs // 3),
         raw_cli)
    imports = subprocess.run([sys.executable, "-X", "importtime", "-c", "import execbox.cli"], capture_output=True,
                             text=True, check=True).stderr.strip().splitlines()[-1]
    print(f"  of which importing execbox.cli: {int(imports.split('|')[1]) / 1000:.0f} ms")


if __name__ == "__main__":
    main()
