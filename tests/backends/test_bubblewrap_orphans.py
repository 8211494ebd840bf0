"""A killed caller leaves nothing running: the CLI or a Python program holding a bubblewrap session is
SIGKILLed mid-exec (also while the sandbox is still being set up), and with no other execbox process
around no sandboxed process outlives it for more than a moment — a setsid and double-forked process and
one that ignores SIGTERM included. What cannot clean itself (the session directory, the run's cgroup) stays
until the next first use of bubblewrap in some process, or `execbox gc`, removes it. SIGTERM and SIGHUP of
the CLI clean up on the way out, with no gc needed.

Every caller runs with a private TMPDIR and a private CODE_EXEC_BWRAP_CGROUP_PARENT, so that no other
test (or execbox process on this host) sweeps its leftovers before the test has looked at them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox.backends.bubblewrap import cgroups
from execbox.backends.bubblewrap.cgroups import plan_cgroups, remove_cgroup
from execbox.backends.bubblewrap.settings import BubblewrapSettings
from execbox.errors import BackendUnavailableError
from execbox.files import disk
from execbox.runner import run_blocking
from execbox.testing import engine_missing

pytestmark = pytest.mark.engine
EXECBOX = str(Path(sys.executable).with_name("execbox"))
# Nothing may be left this long after the caller died (the launcher reacts within milliseconds).
BOUND_S = 5.0
ROLES = ("ignores-term", "double-forked", "main")


def sandbox_script(marker: str) -> str:
    """Three long-lived processes whose argv carries ``marker-ROLE`` as one whole argument (the caller's and
    the launcher's command lines hold the marker only inside the script, never as a whole argument)."""
    loop = "while :; do sleep 1; done"
    return (f"setsid sh -c 'trap \"\" TERM HUP INT; {loop}' {marker}-ignores-term & "
            f"(sh -c '{loop}' {marker}-double-forked &) ; "
            f"sh -c 'trap \"\" TERM; {loop}' {marker}-main")


def argv_of(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def sandboxed(marker: str) -> list[int]:
    wanted = {f"{marker}-{role}".encode() for role in ROLES}
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and wanted & set(argv_of(int(e)))]


def in_child_pid_namespace(marker: str) -> bool:
    """Has a process of this run entered the sandbox's PID namespace (bwrap's pid 1, before it is set up)?"""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and any(marker.encode() in arg for arg in argv_of(int(entry))):
            try:
                with open(f"/proc/{entry}/status") as fh:
                    if any(line.startswith("NSpid:") and len(line.split()) > 2 for line in fh):
                        return True
            except OSError:
                pass
    return False


def wait_for(condition: object, timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


@dataclass
class Place:
    """Where a caller's leftovers go: its TMPDIR and, where cgroups run here, its cgroup parent directories."""

    tmp: Path
    cgroup_parent: str
    cgroup_dirs: list[str]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CODE_EXEC_")}
        env["TMPDIR"] = str(self.tmp)
        if self.cgroup_parent:
            env["CODE_EXEC_BWRAP_CGROUP_PARENT"] = self.cgroup_parent
        return env

    def sessions(self, pid: int) -> list[Path]:
        return sorted(self.tmp.glob(f"execbox-bwrap-{pid}-*"))

    def cgroups(self, pid: int) -> list[str]:
        return sorted(os.path.join(d, n) for d in self.cgroup_dirs if os.path.isdir(d)
                      for n in os.listdir(d) if n.startswith(f"execbox-{pid}-"))


@pytest.fixture
def place(monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    try:
        run_blocking(Runner(Settings(backend="bubblewrap")).aio.backend("bubblewrap").check)
    except BackendUnavailableError as exc:
        engine_missing(f"bubblewrap cannot run here: {exc}")
    tmp = Path(tempfile.mkdtemp(prefix="execbox-orphans-"))
    tmp.chmod(0o1777)
    parent, dirs = "", []
    with contextlib.suppress(OSError):
        own = cgroups._own_cgroups()
        base = own.get("memory", own.get(""))
        if base is not None:
            parent = f"{base.rstrip('/')}/execbox-test-{uuid.uuid4().hex[:8]}"
            plan, _ = plan_cgroups(BubblewrapSettings(cgroup_parent=parent))
            dirs = sorted(set(plan.parents.values())) if plan else []
    if not dirs:
        parent = ""  # no cgroups for execbox here: only the directory is left behind
    # This process (gc, a first-use sweep) looks where the callers put things.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("CODE_EXEC_BWRAP_CGROUP_PARENT", parent)
    yield Place(tmp, parent, dirs)
    for d in dirs:
        for name in os.listdir(d):
            if name.startswith("execbox-"):
                remove_cgroup(os.path.join(d, name))
        remove_cgroup(d)
    for root in tmp.glob("execbox-bwrap-*"):  # what a failed test left: a mounted workspace blocks removal
        disk.release_sized(str(root / "workspace"))
    shutil.rmtree(tmp, ignore_errors=True)


def cli_caller(place: Place, marker: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([EXECBOX, "run", "--backend", "bubblewrap", "--timeout", "60", "--", "sh", "-c",
                             sandbox_script(marker)], env=place.env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def python_caller(place: Place, marker: str) -> subprocess.Popen[bytes]:
    program = ("import sys, execbox\n"
               "with execbox.sandbox('bubblewrap') as sb:\n"
               "    sb.exec(sys.argv[1], timeout=60)\n")
    return subprocess.Popen([sys.executable, "-c", program, sandbox_script(marker)], env=place.env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


CALLERS = {"cli": cli_caller, "python": python_caller}


def started(caller: subprocess.Popen[bytes], marker: str) -> None:
    if not wait_for(lambda: len(sandboxed(marker)) == len(ROLES) or caller.poll() is not None, 60):
        pytest.fail("the sandbox's processes never all started")
    if caller.poll() is not None:
        pytest.fail(f"the caller ended early: {caller.stderr.read().decode() if caller.stderr else ''}")


def assert_nothing_runs(marker: str) -> None:
    if not wait_for(lambda: not sandboxed(marker), BOUND_S):
        left = {pid: b" ".join(argv_of(pid)).decode(errors="replace") for pid in sandboxed(marker)}
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"sandboxed processes outlived their killed caller by {BOUND_S} s: {left}")


@pytest.mark.parametrize("kind", sorted(CALLERS))
def test_sigkilled_caller_leaves_no_process_and_gc_removes_the_rest(place: Place, kind: str) -> None:
    marker = f"orphan-{uuid.uuid4().hex[:8]}"
    caller = CALLERS[kind](place, marker)
    started(caller, marker)
    assert place.sessions(caller.pid)
    if place.cgroup_dirs:
        assert place.cgroups(caller.pid), "the run's cgroup was never made"
    caller.kill()
    caller.wait()
    assert_nothing_runs(marker)
    # Nobody cleaned up: the directory (and the cgroup) are there until a sweep.
    sessions, cgroups = place.sessions(caller.pid), place.cgroups(caller.pid)
    assert sessions and (cgroups or not place.cgroup_dirs)
    removed = run_blocking(Runner(Settings(backend="bubblewrap")).aio.backend("bubblewrap").gc)
    assert set(map(str, sessions)) | set(cgroups) <= set(removed)
    assert not place.sessions(caller.pid) and not place.cgroups(caller.pid)


def test_the_next_first_use_sweeps_what_a_killed_caller_left(place: Place) -> None:
    marker = f"orphan-{uuid.uuid4().hex[:8]}"
    caller = cli_caller(place, marker)
    started(caller, marker)
    caller.kill()
    caller.wait()
    assert_nothing_runs(marker)
    assert place.sessions(caller.pid) and (place.cgroups(caller.pid) or not place.cgroup_dirs)
    subprocess.run([EXECBOX, "run", "--backend", "bubblewrap", "--", "true"], env=place.env(), check=True,
                   stdout=subprocess.DEVNULL, timeout=120)
    assert not place.sessions(caller.pid) and not place.cgroups(caller.pid)


def test_a_caller_killed_while_the_sandbox_starts_leaves_no_process(place: Place) -> None:
    """The window bwrap --die-with-parent leaves: bwrap's pid 1 exists but has not yet asked to die with its
    parent. A caller killed then must not leave a sandbox that nobody will ever kill."""
    for _ in range(3):
        marker = f"orphan-{uuid.uuid4().hex[:8]}"
        caller = cli_caller(place, marker)
        assert wait_for(lambda: in_child_pid_namespace(marker) or caller.poll() is not None, 60, step=0.0005)  # noqa: B023
        caller.kill()
        caller.wait()
        time.sleep(0.5)  # had a process escaped, the rest of the script would have started by now
        assert_nothing_runs(marker)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_cli_stopped_by_a_signal_cleans_up_on_the_way_out(place: Place, signum: int) -> None:
    marker = f"orphan-{uuid.uuid4().hex[:8]}"
    caller = cli_caller(place, marker)
    started(caller, marker)
    caller.send_signal(signum)
    try:
        caller.wait(timeout=30)
    except subprocess.TimeoutExpired:
        caller.kill()
        pytest.fail(f"the CLI did not stop on {signal.Signals(signum).name}")
    assert_nothing_runs(marker)
    assert not place.sessions(caller.pid), "the session directory was left behind"
    assert not place.cgroups(caller.pid), "the run's cgroup was left behind"
