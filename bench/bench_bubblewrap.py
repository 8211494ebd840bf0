"""bubblewrap startup latency, measured side by side in one run (the machine is shared and noisy: compare ratios).

    .venv/bin/python bench/bench_bubblewrap.py [--runs 20]

- bare `bwrap ... true` with the backend's own arguments, no launcher (what bwrap itself costs);
- one-shot `true` and `python3 -c pass` through execbox (launcher, cgroup per exec, seccomp, capture);
- `true` in an open session (no workspace set-up per exec);
- where the disk limit holds (root): what the size-limited workspace adds to each one-shot run (mkfs, mount,
  unmount of a CODE_EXEC_DISK_MB image);
- the same commands on the host without any sandbox, for reference;
- host responsiveness during a fork bomb held by the pids cgroup: how long a host `true` takes while the
  bomb runs (the test only checks that the host stays responsive at all; the number lives here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import threading
import time

from _common import median_ms  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox import Limits, Runner, Settings
from execbox.backends.bubblewrap.filesystem import WORKSPACE
from execbox.backends.bubblewrap.report import HostReport
from execbox.backends.bubblewrap.session import BubblewrapSession
from execbox.backends.bubblewrap.settings import BubblewrapSettings
from execbox.contract.backend import SessionSpec
from execbox.contract.models import ExecSpec
from execbox.files import disk
from execbox.runner import run_blocking


def bare_bwrap_argv(report: HostReport, workspace: str) -> list[str]:
    """The backend's bwrap arguments for `true`, run directly (as the caller: no uid drop, no cgroup)."""
    session = BubblewrapSession.__new__(BubblewrapSession)
    session.report, session.settings, session.root, session.host_workspace = (
        report, BubblewrapSettings.from_env(), workspace, workspace)
    session.spec = SessionSpec("none", Limits(), True, 60.0)
    for name in ("passwd", "group", "hosts"):
        open(os.path.join(workspace, name), "w").close()
    request = ExecSpec(argv=["true"], timeout=10, max_output_bytes=1000, network="none", workdir=WORKSPACE)
    return [report.bwrap, *session._bwrap_args(request), "--", "true"]


def bare_command(report: HostReport, workspace: str) -> list[str]:
    """bare_bwrap_argv as the backend would run it: as root, dropped to the sandbox user first (never bwrap as
    host root), like the launcher does. Also used by bench_pool.py."""
    argv = bare_bwrap_argv(report, workspace)
    if os.geteuid() == 0:
        uid, gid = report.host_identity or (65534, 65534)
        os.chown(workspace, uid, gid)
        argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]
    return argv


def fork_bomb_latency(runner: Runner) -> tuple[float, float, float, int]:
    """(median idle, median and worst during the bomb) of a host `true` in ms, and how many were sampled."""
    def latency() -> float:
        started = time.perf_counter()
        subprocess.run(["true"], check=True)
        return (time.perf_counter() - started) * 1000

    idle = statistics.median(latency() for _ in range(20))
    during: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            during.append(latency())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = runner.run("b() { b | b & }; b; sleep 3", limits=Limits(pids=64), timeout=6)
    finally:
        stop.set()
        watcher.join()
    assert "Cannot fork" in result.stderr, f"the bomb was not held: {result}"
    return idle, statistics.median(during), max(during), len(during)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    runs = args.runs

    runner = Runner(Settings.from_env(backend="bubblewrap"))
    backend = runner.aio.backend("bubblewrap")
    caps = run_blocking(backend.check)
    report = backend.report
    assert report is not None
    print(f"host: {report.version}; runs as {report.facts()['runs_as']}; cgroup {report.facts()['cgroup']}; "
          f"limits {sorted(caps.limits)}")

    with tempfile.TemporaryDirectory() as ws:
        argv = bare_bwrap_argv(report, ws)
        if os.geteuid() == 0:  # never bwrap as root (the sandbox user would be host root): drop like the launcher
            uid, gid = report.host_identity or (65534, 65534)
            os.chown(ws, uid, gid)
            argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]
        bare = median_ms(lambda: subprocess.run(argv, check=True), runs)
    host_true = median_ms(lambda: subprocess.run(["true"], check=True), runs)
    host_py = median_ms(lambda: subprocess.run(["/usr/bin/python3", "-c", "pass"], check=True), runs)
    one_true = median_ms(lambda: runner.run(["true"]), runs)
    one_py = median_ms(lambda: runner.run(["python3", "-c", "pass"]), runs)
    sized = None
    if "disk" in caps.limits:
        with tempfile.TemporaryDirectory() as root:
            workspace = os.path.join(root, "workspace")
            os.mkdir(workspace)

            def mount_and_release() -> None:
                disk.mount_sized(workspace, runner.settings.disk_mb, report.host_identity or (65534, 65534))
                disk.release_sized(workspace)

            sized = median_ms(mount_and_release, runs)
    with runner.sandbox("bubblewrap") as sb:
        sess_true = median_ms(lambda: sb.exec(["true"]), runs)
        sess_py = median_ms(lambda: sb.exec(["python3", "-c", "pass"]), runs)

    print(f"median of {runs} runs, ms")
    print(f"  host `true`                          {host_true:7.1f}")
    print(f"  host `python3 -c pass`               {host_py:7.1f}")
    print(f"  bare bwrap `true` (backend's args)   {bare:7.1f}")
    print(f"  execbox one-shot `true`              {one_true:7.1f}")
    print(f"  execbox one-shot `python3 -c pass`   {one_py:7.1f}")
    if sized is not None:
        print(f"    of which the sized workspace      {sized:7.1f}  ({runner.settings.disk_mb} MiB image)")
    print(f"  execbox session exec `true`          {sess_true:7.1f}")
    print(f"  execbox session `python3 -c pass`    {sess_py:7.1f}")
    if "pids" in caps.limits:
        idle, median, worst, samples = fork_bomb_latency(runner)
        print(f"host `true` during a fork bomb (pids=64, {samples} samples), ms: idle median {idle:.1f}, "
              f"bomb median {median:.1f}, worst {worst:.1f}")
    else:
        print("fork bomb: skipped, no pids cgroup here")


if __name__ == "__main__":
    main()
