"""The docker backend's speed and memory, against the real engine (the machine is shared: compare ratios).

    .venv/bin/python bench/bench_docker.py [--runs 20] [--gigabytes 1]

- the disk limit: what a size-limited workspace (as root) adds to each sandbox;
- one-shot `true`: execbox docker (create, attach, start, wait, remove, with the whole hardening table)
  against a bare `docker run --rm` of the same image, and against docker-py's containers.run;
- an exec in a persistent session (`execbox.sandbox(backend="docker")`);
- a timed-out run: how long past its deadline the caller waits (kill, drain, remove);
- a cancelled caller: from the cancel until the container is gone from the engine;
- output streaming: throughput and the caller's RSS growth while N GB pass through the byte cap;
- the image: `build_image()` when it is up to date (the idempotent path the test command takes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

import anyio
from _common import (
    median_ms,  # bench/_common.py (run from the repo: python bench/NAME.py)
)

from execbox import Runner, Settings
from execbox.backends.docker import image as docker_image
from execbox.files import disk
from execbox.testing import PeakRss


def cancel_ms(client) -> float:
    """Cancel a running `sleep` once its container runs; the time until the engine no longer lists it."""
    from execbox import AsyncRunner
    from execbox.backends.docker.session import L_OWNER
    from execbox.kit.ownership import owner_id

    def ours(**filters) -> list:
        return client.containers.list(all=True, filters={"label": f"{L_OWNER}={owner_id()}", **filters})

    async def go() -> float:
        runner = AsyncRunner(Settings.from_env(backend="docker"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: runner.run(["sleep", "100"], backend="docker", timeout=90))
            while not await anyio.to_thread.run_sync(lambda: ours(status="running")):
                await anyio.sleep(0.05)
            started = time.perf_counter()
            tg.cancel_scope.cancel()
        while ours():
            await anyio.sleep(0.01)
        return (time.perf_counter() - started) * 1000

    return anyio.run(go)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    args = parser.parse_args()
    image = docker_image.DEFAULT_TAG
    runner = Runner(Settings.from_env(backend="docker"))
    runner.run(["true"])  # warm: engine connection, start-up sweep, page cache

    ours = median_ms(lambda: runner.run(["true"]), args.runs)
    line = f"one-shot `true`: execbox docker {ours:.0f} ms"
    if shutil.which("docker"):
        cli = median_ms(lambda: subprocess.run(["docker", "run", "--rm", image, "true"], check=True,
                                               capture_output=True), args.runs)
        line += f", bare `docker run --rm` {cli:.0f} ms (x{ours / cli:.2f})"
    import docker

    client = docker.from_env()
    sdk = median_ms(lambda: client.containers.run(image, ["true"], remove=True), args.runs)
    line += f", docker-py containers.run {sdk:.0f} ms — median of {args.runs}"
    print(line)

    if disk.unavailable_reason() is None:
        def sized() -> None:
            path = tempfile.mkdtemp(prefix="execbox-bench-")
            try:
                disk.mount_sized(path, Settings.from_env().disk_mb, (65534, 65534))
            finally:
                disk.release_sized(path)
                os.rmdir(path)
        added = median_ms(sized, args.runs)
        print(f"disk limit: a size-limited workspace (mkfs + loop mount + unmount) adds {added:.0f} ms to every "
              "sandbox, included above")
    else:
        print(f"disk limit: not available here ({disk.unavailable_reason()})")

    with runner.sandbox("docker") as sb:
        sb.exec(["true"])
        exec_ms = median_ms(lambda: sb.exec(["true"]), args.runs)
    print(f"session exec `true`: {exec_ms:.0f} ms median of {args.runs}")
    started = time.perf_counter()
    with runner.sandbox("docker") as sb:
        opened = time.perf_counter()
    print(f"session open + close: {(time.perf_counter() - started) * 1000:.0f} ms "
          f"(open {(opened - started) * 1000:.0f} ms)")

    started = time.perf_counter()
    result = runner.run(["sleep", "60"], timeout=2)
    assert result.timed_out, result
    print(f"timed-out run: returned {(time.perf_counter() - started - 2) * 1000:.0f} ms after its 2 s deadline")
    print(f"cancelled run: container gone {cancel_ms(client):.0f} ms after the cancel")

    size = int(args.gigabytes * 1e9)
    started = time.perf_counter()
    with PeakRss() as rss:
        result = runner.run(["head", "-c", str(size), "/dev/zero"], timeout=600)
    elapsed = time.perf_counter() - started
    assert result.truncated and result.exit_code == 0, result
    print(f"output: {size / 1e9:.1f} GB through the cap in {elapsed:.1f} s ({size / 1e6 / elapsed:.0f} MB/s), "
          f"caller RSS growth {rss.growth / 2**20:.1f} MiB")

    build = docker_image.build_image(log=lambda _: None)
    print(f"image {build.tag}: {build.size_bytes / 1e6:.0f} MB; build_image() when up to date: "
          f"{build.seconds * 1000:.0f} ms")


if __name__ == "__main__":
    main()
