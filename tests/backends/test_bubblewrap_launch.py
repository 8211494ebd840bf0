"""The bubblewrap launcher (bubblewrap/launcher.py: a shell watcher and setpriv in front of bwrap): what it
guarantees on its own paths. The killed-caller tests (test_bubblewrap_orphans.py) and the conformance kit
(test_bubblewrap.py) run every exec through it too; these pin the parts they cannot see."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from execbox import Limits, Runner, Settings
from execbox.backends.bubblewrap import cgroups, probe
from execbox.backends.bubblewrap import launcher as launch
from execbox.backends.bubblewrap.cgroups import CGROUP_PREFIX, RunCgroup
from execbox.backends.bubblewrap.report import HostReport
from execbox.backends.bubblewrap.session import FILE_SIZE_LIMIT
from execbox.errors import BackendUnavailableError
from execbox.runner import run_blocking
from execbox.testing import engine_missing

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def report() -> HostReport:
    runner = Runner(Settings.from_env(backend="bubblewrap"))
    try:
        run_blocking(runner.aio.backend("bubblewrap").check)
    except BackendUnavailableError as exc:
        engine_missing(f"bubblewrap cannot run here: {exc}")
    found = runner.aio.backend("bubblewrap").report
    assert found is not None
    return found


def sh_functions(report: HostReport, call: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run one of the watcher's shell functions with the shell the launcher uses."""
    return subprocess.run([report.tools["sh"], "-c", launch.FUNCTIONS + call, "sh", *args], capture_output=True,
                          text=True, timeout=30)


def test_a_watcher_whose_caller_is_gone_starts_nothing(report: HostReport, tmp_path: Path) -> None:
    """A caller that died before the watcher asked for its parent-death signal: nothing may start, since
    nothing would ever kill it."""
    for name in ("args", "bpf"):
        (tmp_path / name).write_bytes(b"")
    witness = tmp_path / "ran"
    argv = launch.launch_argv(tools=report.tools, caller=1, bwrap="/bin/sh", args_file=str(tmp_path / "args"),
                              seccomp_file=str(tmp_path / "bpf"), status_file=str(tmp_path / "status"),
                              rlimits={"c": 0}, cgroup_procs=[], user=None,
                              command=["-c", f"touch {witness}"])
    done = subprocess.run(argv, capture_output=True, start_new_session=True, timeout=30)
    assert done.returncode == launch.EXIT_LAUNCH_FAILED
    assert not witness.exists() and not (tmp_path / "status").exists()


def test_a_watcher_outside_its_own_process_group_refuses(report: HostReport, tmp_path: Path) -> None:
    """The watcher SIGTERMs its process group on the way out: started inside its caller's group it would hit the
    caller, so it refuses to start at all."""
    argv = launch.launch_argv(tools=report.tools, caller=os.getpid(), bwrap="/bin/true", args_file="/dev/null",
                              seccomp_file="/dev/null", status_file=str(tmp_path / "status"), rlimits={},
                              cgroup_procs=[], user=None, command=["true"])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)  # same group as this process
    assert done.returncode == launch.EXIT_LAUNCH_FAILED
    assert "must lead its own process group" in done.stderr


def test_the_last_step_starts_bwrap_only_under_its_watcher_and_through_the_gate(report: HostReport) -> None:
    check = [report.tools["sh"], "-c", launch.CHECK, "check", "/bin/sh", "-c", "echo started; cat"]
    watched = {"EXECBOX_BWRAP_WATCHER": str(os.getpid())}

    def run(env: dict[str, str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(check, capture_output=True, env=env, input=stdin, timeout=30)

    alive = run(watched, launch.GATE + b"the command's own stdin\nline two")
    assert alive.returncode == 0 and alive.stdout == b"started\nthe command's own stdin\nline two"
    for env in ({"EXECBOX_BWRAP_WATCHER": "1"}, {}):  # orphaned, or not under a watcher at all
        refused = run(env, launch.GATE)
        assert refused.returncode == launch.EXIT_LAUNCH_FAILED and not refused.stdout
    for gate in (b"", b"go", b"no\n", b"go now\n"):  # closed before opening (a caller gone or failed), or garbled
        shut = run(watched, gate)
        assert shut.returncode == launch.EXIT_LAUNCH_FAILED and not shut.stdout, gate


def test_the_watcher_reads_a_process_whose_name_mimics_stat_fields(report: HostReport, tmp_path: Path) -> None:
    """A process name is the code's choice (up to 15 bytes, spaces and parentheses included): the watcher must
    still read the real parent, or it would kill the wrong process or miss the right one."""
    sleeper = tmp_path / "x) S 1 1 1 ("
    shutil.copy("/bin/sleep", sleeper)
    child = subprocess.Popen([str(sleeper), "30"])
    try:
        with open(f"/proc/{child.pid}/stat") as fh:
            assert ") S 1 1 1 (" in fh.read()  # the name really is in the file
        done = sh_functions(report, 'stat_of "$1" && echo "$spid $sppid"', f"/proc/{child.pid}/stat")
        assert done.stdout.split() == [str(child.pid), str(os.getpid())], done
    finally:
        child.kill()
        child.wait()


def test_both_ways_of_listing_children_agree(report: HostReport) -> None:
    """Without CONFIG_PROC_CHILDREN the watcher scans every process's parent: it must find what the kernel's
    list holds, zombies included."""
    # sh becomes a sleep that never reaps: the `true` stays its zombie child
    parent = subprocess.Popen(["/bin/sh", "-c", "sleep 30 & sleep 30 & true & exec sleep 30"])
    try:
        assert _wait(lambda: len(_children(parent.pid)) == 3 and _zombies(parent.pid) == 1)
        listed = sh_functions(report, 'children "$1"', str(parent.pid)).stdout.split()
        scanned = sh_functions(report, 'scan_children "$1"', str(parent.pid)).stdout.split()
        assert sorted(listed) == sorted(scanned) == sorted(map(str, _children(parent.pid))), (listed, scanned)
    finally:
        for pid in _children(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_the_sandbox_runs_in_its_cgroup_with_the_pids_limit_and_the_watcher_does_not(report: HostReport) -> None:
    """The launcher moves bwrap (and so the whole sandbox) into the run's cgroup before bwrap starts; the watcher
    stays outside it (it must survive whatever the code does to its cgroup)."""
    if report.cgroup is None or "pids" not in report.cgroup.parents:
        engine_missing(f"no pids cgroup for execbox here: {report.cgroup_reason}")
    marker = f"cg-{uuid.uuid4().hex[:8]}"
    runner = Runner(Settings.from_env(backend="bubblewrap"))
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(runner.run(
        # the marker is a whole argument of the inner sh only (the launcher's holds it inside a script)
        f"sh -c 'sleep 20; :' {marker}", limits=Limits(pids=37), timeout=30)))
    thread.start()
    try:
        assert _wait(lambda: bool(_with_arg(marker)) or bool(done), timeout=30), "the sandbox never started"
        (sandboxed,) = _with_arg(marker)
        path = _cgroup_dir(sandboxed, "pids")
        assert os.path.basename(path).startswith(CGROUP_PREFIX), path
        assert Path(path, "pids.max").read_text().strip() == "37"
        for controller in report.cgroup.parents:  # v1: each hierarchy joined on its own (through tasks)
            assert os.path.basename(_cgroup_dir(sandboxed, controller)) == os.path.basename(path), controller
        watcher = _ancestor_with_arg(sandboxed, "execbox-bwrap")
        assert watcher is not None, "no watcher above the sandbox"
        assert _cgroup_dir(watcher, "pids") != path
        os.kill(watcher, signal.SIGTERM)  # what the deadline does: the sandbox goes with it
        assert _wait(lambda: not _with_arg(marker), timeout=10), "the sandbox outlived its watcher's SIGTERM"
    finally:
        for pid in _with_arg(marker):
            os.kill(pid, signal.SIGKILL)
        thread.join(60)


def _wait(condition: object, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]


def _zombies(pid: int) -> int:
    count = 0
    for child in _children(pid):
        with open(f"/proc/{child}/stat") as fh:
            count += fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    return count


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _with_arg(arg: str) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and arg in _argv(int(e))]


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def _ancestor_with_arg(pid: int, arg: str) -> int | None:
    while pid > 1:
        pid = _ppid(pid)
        if arg in _argv(pid):
            return pid
    return None


def _cgroup_dir(pid: int, controller: str) -> str:
    with open(f"/proc/{pid}/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(",") or not controllers:
                for mount, root, fstype, opts in cgroups._mounts():
                    if (fstype == "cgroup" and controller in opts) or (fstype == "cgroup2" and not controllers):
                        found = cgroups._under(mount, root, path)
                        if found:
                            return found
    raise AssertionError(f"no {controller} cgroup for {pid}")


def test_the_watcher_kills_what_is_left_in_the_runs_cgroup(report: HostReport, tmp_path: Path) -> None:
    """Found reviewing (1 caller kill in ~150 during start-up): a monitor stopped inside clone() made bwrap's pid 1
    after its children were listed, and it outlived everything. The watcher now waits for the stop, and kills
    whatever is still in the run's cgroups: here a process that left both the monitor's children and the watcher's
    process group (setsid, reparented), as such a pid 1 does."""
    if report.cgroup is None:
        engine_missing(f"no cgroup for execbox here: {report.cgroup_reason}")
    marker = f"left-{uuid.uuid4().hex[:8]}"
    fake_bwrap = tmp_path / "bwrap"  # skips bwrap's own options, runs the command
    fake_bwrap.write_text('#!/bin/sh\nwhile [ "$1" != -- ]; do shift; done; shift; exec "$@"\n')
    fake_bwrap.chmod(0o755)
    for name in ("args", "bpf"):
        (tmp_path / name).write_bytes(b"")
    cgroup = RunCgroup.create(report.cgroup, Limits(pids=64))
    argv = launch.launch_argv(tools=report.tools, caller=os.getpid(), bwrap=str(fake_bwrap),
                              args_file=str(tmp_path / "args"), seccomp_file=str(tmp_path / "bpf"),
                              status_file=str(tmp_path / "status"), rlimits={"c": 0},
                              cgroup_procs=cgroup.procs_files(), user=None,
                              command=["sh", "-c", f"(setsid sh -c 'sleep 1000; :' {marker} &); sleep 1000"])
    watcher = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.PIPE)
    assert watcher.stdin is not None
    watcher.stdin.write(launch.GATE)
    watcher.stdin.close()
    try:
        def escaped() -> bool:  # the shell alone (setsid may fork on its way), once out of the watcher's tree
            found = _with_arg(marker)
            return (len(found) == 1 and _argv(found[0])[:1] == ["sh"]
                    and _ancestor_with_arg(found[0], "execbox-bwrap") is None)
        assert _wait(escaped, timeout=30), f"no process left the watcher's tree: {_with_arg(marker)}"
        watcher.send_signal(signal.SIGTERM)  # the deadline
        watcher.wait(30)
        assert _wait(lambda: not _with_arg(marker), timeout=10), "a process of the run's cgroup outlived its watcher"
    finally:
        for pid in _with_arg(marker):
            os.kill(pid, signal.SIGKILL)
        if watcher.poll() is None:
            watcher.kill()
        cgroup.remove()


def test_the_run_gets_its_rlimits_soft_and_hard_in_bytes(report: HostReport) -> None:
    """The launcher sets them with its shell's ulimit, in the shell's units: the kernel must see the bytes meant."""
    with Runner(Settings.from_env(backend="bubblewrap")) as runner:
        result = runner.run(["cat", "/proc/self/limits"], timeout=10)
    rows = {line[:26].strip(): line[26:].split()[:2] for line in result.stdout.splitlines()}
    assert rows["Max file size"] == [str(FILE_SIZE_LIMIT)] * 2, result.stdout
    assert rows["Max core file size"] == ["0", "0"] and rows["Max cpu time"] == ["11", "11"], result.stdout


def test_a_shell_whose_ulimit_counts_other_units_is_refused(report: HostReport) -> None:
    assert run_blocking(lambda: probe._ulimit_units_wrong(report.tools["sh"])) == ""
    bash = shutil.which("bash")
    assert bash is not None, "bash is part of every Debian system"
    # bash outside POSIX mode (not started as sh) counts -c and -f in KiB, not 512-byte blocks
    assert "ulimit -c 3 gave ['3072', '3072']" in run_blocking(lambda: probe._ulimit_units_wrong(bash))
