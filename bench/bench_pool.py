"""Issue 16's figures, side by side in one run (the machine is shared and noisy: compare medians and ratios).

    .venv/bin/python bench/bench_pool.py [--runs 30] [--concurrent 200] [--peer] [--readme]

- one-shot `true` on docker, in-process: a raw `docker run` with the same hardening as execbox's (flags, seccomp
  profile, tmpfs, workspace bind, init) against execbox without a pool, interleaved run by run;
- one-shot `true` and `print(1)` in python from a warm pool: median and p99; the same back to back, the pool
  refilling while the runs go;
- N concurrent one-shots in one process: wall time, most running at once, containers left;
- `execbox run` as a fresh process, and handed to an `execbox serve`, against the raw docker CLI for the same
  hardened one-shot, interleaved;
- bubblewrap: a bare bwrap with the backend's own arguments against execbox's one-shot, without and with a warm
  pool, interleaved;
- with --peer, llm-sandbox's one-shot `print(1)` (installed into .bench-peer/, never into the project's venv).
--readme rewrites the README's performance rows for these figures (between the bench:pool markers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
from _common import p99, write_readme  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox import AsyncRunner, Runner, Settings
from execbox.backends.docker import image as docker_image
from execbox.backends.docker.hardening import seccomp_profile
from execbox.kit.ownership import owner_id

REPO = Path(__file__).resolve().parents[1]
PEER_VENV = REPO / ".bench-peer" / "venv"  # .bench-peer/ is git-ignored
PEER_IMAGE = "execbox-bench-peer:latest"  # ours, plus `python` on PATH (llm-sandbox runs `python`)
Rows = list[tuple[str, str]]


@contextlib.contextmanager
def raw_docker(settings: Settings) -> Iterator[Callable[[], object]]:
    """A `docker run` of `true` with execbox's hardening (hardening.py's table) but without execbox: what the
    engine costs. Its seccomp profile and workspace live in a temporary directory for the block."""
    s, mem = settings, f"{settings.memory_mb}m"
    with tempfile.TemporaryDirectory() as tmp:
        profile, workspace = os.path.join(tmp, "seccomp.json"), os.path.join(tmp, "ws")
        Path(profile).write_text(seccomp_profile())
        os.mkdir(workspace)
        argv = ["docker", "run", "--rm", "-i", "--init", "--network", "none", "--cap-drop", "ALL", "--read-only",
                "--user", "65534:65534", "--security-opt", "no-new-privileges", "--security-opt", f"seccomp={profile}",
                "--ipc", "private", "--cgroupns", "private", "--hostname", "sandbox", "--pids-limit",
                str(s.pids_limit), "--memory", mem, "--memory-swap", mem, "--cpus", str(s.cpus), "--ulimit", "core=0",
                "--log-driver", "none", "--tmpfs", "/tmp:rw,exec,nosuid,nodev,size=512m,mode=1777", "--mount",
                f"type=bind,src={workspace},dst=/workspace", "-w", "/workspace", docker_image.DEFAULT_TAG, "true"]
        yield lambda: subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)


def interleaved(fns: dict[str, Callable[[], object]], runs: int,
                before: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Each function once per round, in turn: noise falls on every figure alike. One warm-up round first. Each
    round starts one function later, so what one leaves behind (an engine still removing a container) falls on
    each of the others in turn, not always on the same one. ``before`` runs (untimed) before each function: e.g.
    wait until a pool's background refill is done."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_no in range(runs):
        for name in names[round_no % len(names):] + names[:round_no % len(names)]:
            fn = fns[name]
            if before:
                before()
            started = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - started) * 1000)
    return samples


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


def med(samples: list[float]) -> float:
    return statistics.median(samples)


def show(label: str, samples: list[float], base: list[float] | None = None) -> None:
    ratio = f"  x{med(samples) / med(base):.2f}" if base else ""
    print(f"  {label:<52} median {med(samples):7.1f} ms   p99 {p99(samples):7.1f} ms{ratio}")


def docker_figures(runs: int, rows: Rows) -> None:
    settings = Settings.from_env(backend="docker")
    plain = Runner(settings)
    with raw_docker(settings) as raw:
        got = interleaved({"raw": raw, "execbox": lambda: plain.run("true")}, runs)
    print("docker one-shot `true`, in-process, interleaved")
    show("raw `docker run`, execbox's hardening", got["raw"])
    show("execbox, no pool", got["execbox"], got["raw"])
    raw_ms, ours_ms = med(got["raw"]), med(got["execbox"])
    rows.append(("docker one-shot `true`, in-process: raw `docker run` with execbox's hardening / execbox, no pool",
                 f"{raw_ms:.0f} / {ours_ms:.0f} ms (x{ours_ms / raw_ms:.2f})"))
    with Runner(Settings.from_env(backend="docker", pool_size=4)) as pooled:
        def full() -> None:
            while pooled.warm() < 4:
                time.sleep(0.01)
            time.sleep(0.05)  # let the used member's removal finish: measure the run, not the clean-up beside it
        true = timings(lambda: pooled.run("true"), runs, full)
        code = timings(lambda: pooled.run_code("print(1)"), runs, full)
        full()
        back_to_back = timings(lambda: pooled.run("true"), runs)
        hits = sum(pooled.run("true").pooled for _ in range(10))
    print("docker, warm pool of 4")
    show("one-shot `true`", true)
    show("`print(1)` in python", code)
    show(f"back to back, refilling ({hits}/10 pooled)", back_to_back)
    rows.append(("docker from a warm pool: one-shot `true` / `print(1)` in python",
                 f"{med(true):.0f} ms (p99 {p99(true):.0f}) / {med(code):.0f} ms (p99 {p99(code):.0f})"))
    rows.append(("docker, back to back from a pool of 4 (refilling while the runs go)",
                 f"{med(back_to_back):.0f} ms, p99 {p99(back_to_back):.0f} ms ({hits} of 10 runs pooled)"))


def concurrent(n: int, rows: Rows) -> None:
    seen = {"now": 0, "peak": 0}
    lock = threading.Lock()

    async def go() -> tuple[float, int]:
        async with AsyncRunner(Settings.from_env(backend="docker")) as runner:
            async def one() -> None:
                result = await runner.run("sleep 0.2")
                assert result.exit_code == 0, result
            acquire, release = runner.slots.acquire, runner.slots.release

            async def counting(*a: object, **k: object) -> float:
                waited = await acquire(*a, **k)  # type: ignore[arg-type]
                with lock:
                    seen["now"] += 1
                    seen["peak"] = max(seen["peak"], seen["now"])
                return waited

            def counted_release() -> None:
                with lock:
                    seen["now"] -= 1
                release()
            runner.slots.acquire = counting  # type: ignore[method-assign]
            runner.slots.release = counted_release  # type: ignore[method-assign]
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(one)
            return time.perf_counter() - started, runner.slots.total

    elapsed, cap = anyio.run(go)
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=io.execbox.owner={owner_id()}"],
                          capture_output=True, text=True, check=True).stdout.split()
    print(f"  {n} concurrent `sleep 0.2` one-shots: {elapsed:.1f} s, at most {seen['peak']} at once (cap {cap}), "
          f"{len(left)} containers left")
    rows.append((f"{n} concurrent one-shots (`sleep 0.2`) in one process",
                 f"{elapsed:.0f} s, at most {seen['peak']} at once (the cap here), {len(left)} left"))


def fresh_process(runs: int, rows: Rows) -> None:
    settings = Settings.from_env(backend="docker")
    cli = [str(REPO / ".venv/bin/execbox"), "run", "--backend", "docker", "--", "true"]
    # With bytecode, as an installed package has it (this machine sets PYTHONDONTWRITEBYTECODE, which would
    # recompile execbox in every process: ~80 ms that no user pays).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "CODE_EXEC_SERVER")}
    env["PYTHONPYCACHEPREFIX"] = str(REPO / ".bench-peer" / "pycache")
    with raw_docker(settings) as raw, resident_server(env) as served_env:
        got = interleaved({
            "raw": raw,
            "cli": lambda: subprocess.run(cli, check=True, stdout=subprocess.DEVNULL, env=env),
            "served": lambda: subprocess.run(cli, check=True, stdout=subprocess.DEVNULL, env=served_env),
        }, runs)
    imports = subprocess.run([sys.executable, "-X", "importtime", "-c", "import execbox.cli"], capture_output=True,
                             text=True, check=True, env=env).stderr.strip().splitlines()[-1]
    import_ms = int(imports.split("|")[1]) / 1000
    print("fresh process, interleaved")
    show("raw `docker run` CLI, execbox's hardening", got["raw"])
    show("`execbox run --backend docker -- true`", got["cli"], got["raw"])
    show("the same, handed to `execbox serve` (CODE_EXEC_SERVER)", got["served"], got["raw"])
    print(f"  of which importing execbox.cli: {import_ms:.0f} ms (-X importtime)")
    rows.append(("`execbox run` as a fresh process / the raw docker CLI, same hardening",
                 f"{med(got['cli']):.0f} / {med(got['raw']):.0f} ms (x{med(got['cli']) / med(got['raw']):.2f}; "
                 f"importing execbox.cli: {import_ms:.0f} ms)"))
    rows.append(("`execbox run` handed to `execbox serve` (CODE_EXEC_SERVER) / the raw docker CLI",
                 f"{med(got['served']):.0f} / {med(got['raw']):.0f} ms (x{med(got['served']) / med(got['raw']):.2f})"))


@contextlib.contextmanager
def resident_server(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """An `execbox serve` for the block; yields the environment that hands command lines to it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "execbox.sock")
        server = subprocess.Popen([str(REPO / ".venv/bin/execbox"), "serve", "--socket", path], env=env,
                                  stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not os.path.exists(path):
                if server.poll() is not None:
                    raise RuntimeError(f"execbox serve exited with {server.returncode}")
                time.sleep(0.05)
            yield {**env, "CODE_EXEC_SERVER": path}
        finally:
            server.terminate()
            server.wait(timeout=60)


def bubblewrap_figures(runs: int, rows: Rows) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_bubblewrap import bare_command  # the backend's own bwrap arguments, run without execbox

    from execbox.runner import run_blocking

    runner = Runner(Settings.from_env(backend="bubblewrap"))
    backend = runner.aio.backend("bubblewrap")
    try:
        run_blocking(backend.check)
    except Exception as exc:  # noqa: BLE001 - say why and measure the rest
        print(f"bubblewrap: not measured ({exc})")
        return
    report = getattr(backend, "report", None)  # the bubblewrap backend's host facts, after check()
    assert report is not None
    with tempfile.TemporaryDirectory() as workspace:
        bare = bare_command(report, workspace)
        got = interleaved({"bare": lambda: subprocess.run(bare, check=True),
                           "execbox": lambda: runner.run("true")}, runs)
        # The pool apart, each run once the refill beside the last is done: a refill running beside a bare
        # bwrap would slow that one instead (measured: 8.7 -> 13 ms), flattering both differences.
        with Runner(Settings.from_env(backend="bubblewrap", pool_size=2)) as pooled:
            def full() -> None:
                while pooled.warm() < 2:
                    time.sleep(0.002)
                time.sleep(0.01)  # and the used member's removal

            with_pool = interleaved({"bare": lambda: subprocess.run(bare, check=True),
                                     "pooled": lambda: pooled.run("true")}, runs, full)
        got["pooled"], got["bare_pool"] = with_pool["pooled"], with_pool["bare"]
    print("bubblewrap one-shot `true`, interleaved")
    show("bare bwrap, the backend's arguments", got["bare"])
    show("execbox", got["execbox"], got["bare"])
    show("bare bwrap, beside the pool's runs", got["bare_pool"])
    show("execbox, warm pool", got["pooled"], got["bare_pool"])
    rows.append(("bubblewrap one-shot `true`: bare bwrap with the backend's arguments / execbox",
                 f"{med(got['bare']):.1f} / {med(got['execbox']):.1f} ms "
                 f"({med(got['execbox']) - med(got['bare']):+.1f} ms)"))
    rows.append(("the same from a warm pool (CODE_EXEC_POOL_SIZE=2)",
                 f"{med(got['bare_pool']):.1f} / {med(got['pooled']):.1f} ms "
                 f"({med(got['pooled']) - med(got['bare_pool']):+.1f} ms)"))


def peer_image() -> Path:
    """llm-sandbox in a venv of its own (its python returned); its image is ours plus `python` on PATH, so no
    registry is needed."""
    python = PEER_VENV / "bin/python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "llm-sandbox[docker]"], check=True)
    # The venv llm-sandbox's pooled sessions run in (its environment set-up makes it, then upgrades pip from the
    # network, which the sandbox has not): made here, so that set-up can be skipped.
    dockerfile = (f"FROM {docker_image.DEFAULT_TAG}\nUSER root\nRUN ln -sf /usr/bin/python3 /usr/local/bin/python && "
                  "python3 -m venv /sandbox/.sandbox-venv\n")
    subprocess.run(["docker", "build", "-q", "-t", PEER_IMAGE, "-"], input=dockerfile.encode(), check=True,
                   stdout=subprocess.DEVNULL)
    return python


def peer(runs: int, rows: Rows) -> None:
    python = peer_image()
    out = subprocess.run([str(python), str(Path(__file__).parent / "peer_llm_sandbox.py"), PEER_IMAGE, str(runs)],
                         capture_output=True, text=True, check=True).stdout
    pairs = json.loads(out.strip().splitlines()[-1])
    result, whole = [p[0] for p in pairs], [p[1] for p in pairs]
    print("llm-sandbox (peer), one-shot `print(1)`")
    show("time to the result", result)
    show("with its session closed", whole)
    rows.append(("llm-sandbox one-shot `print(1)` (peer; environment set-up skipped): to the result / closed",
                 f"{med(result):.0f} / {med(whole):.0f} ms"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--concurrent", type=int, default=200)
    parser.add_argument("--peer", action="store_true", help="measure llm-sandbox too (installs it in .bench-peer/)")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's rows for these figures")
    args = parser.parse_args()
    rows: Rows = []
    print(f"median / p99 of {args.runs} runs, in-process unless said")
    docker_figures(args.runs, rows)
    concurrent(args.concurrent, rows)
    fresh_process(max(args.runs // 3, 5), rows)
    bubblewrap_figures(args.runs, rows)
    if args.peer:
        peer(max(args.runs // 10, 3), rows)
    if args.readme:
        write_readme("pool", rows, "`.venv/bin/python bench/bench_pool.py --peer --readme`")


if __name__ == "__main__":
    main()
