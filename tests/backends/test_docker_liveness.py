"""A docker run ends at its deadline whatever the code does, and what a dead owner leaves is removed.

Endless output past a 2 s deadline, in a session (which stays usable), a one-shot and a warm-pool member: the
engine finishes an exec only once its output has reached the client, so an unread stream once held the kill at
the deadline (and every later call on that container) forever. Each run is made in a thread and the test fails
if it is still running after a generous bound, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from execbox import ExecResult, Runner, SandboxError, Settings
from execbox.backends.docker import session as ds
from execbox.backends.docker.stream import hijacked
from execbox.files import disk
from execbox.kit.ownership import owner_id
from execbox.runner import run_blocking
from tests.backends import test_docker as base
from tests.backends import test_docker_boundary as boundary
from tests.backends.test_docker_unit import dead_pid
from tests.support.pool import wait_ready

pytestmark = pytest.mark.engine

engine = base.engine
no_leaks = base.no_leaks

T = TypeVar("T")
BOUND_S = 60  # liveness only: the deadline is 2 s, a fixed run takes a few seconds

PRINTERS = {
    "stdout": "while True:\n    print('x' * 1000)",
    "stderr": "import sys\nwhile True:\n    sys.stderr.write('x' * 1000 + '\\n')",
    "no newline": "import sys\nwhile True:\n    sys.stdout.write('x')",
}


def within(fn: Callable[[], T], seconds: float = BOUND_S) -> T:
    """``fn()``, run in a thread; the test fails if it has not returned within ``seconds``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running {seconds} s later: the deadline did not end the run")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def timed_out(result: ExecResult, printed: str = "x" * 100) -> None:
    assert result.timed_out and result.exit_code == 124, result
    assert printed in result.stdout + result.stderr, "the output before the deadline is kept"


@pytest.fixture
def runner(engine: Any) -> Runner:
    return Runner(Settings.from_env(backend="docker"))


@pytest.mark.parametrize("source", PRINTERS.values(), ids=PRINTERS.keys())
def test_endless_output_in_a_session_times_out_and_the_session_stays_usable(runner: Runner, source: str) -> None:
    with runner.sandbox("docker") as sb:
        timed_out(within(lambda: sb.run_code(source, timeout=2)))
        after = within(lambda: sb.exec("echo still here"))
        assert (after.exit_code, after.stdout) == (0, "still here\n"), after


def test_endless_output_of_a_later_exec_in_a_session_times_out(runner: Runner) -> None:
    """The session's first exec is armed ahead; a later one starts its own exec: both paths end."""
    with runner.sandbox("docker") as sb:
        assert sb.exec("true").exit_code == 0
        timed_out(within(lambda: sb.exec("yes hello", timeout=2)), "hello\nhello\n")
        assert within(lambda: sb.exec("echo ok")).stdout == "ok\n"


def test_a_kill_that_does_not_come_back_breaks_the_session_with_a_typed_error(
        runner: Runner, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the kill at a deadline not finish (here: it is said not to), the container is killed and every
    later exec is a SandboxError saying so; the sandbox still closes and its container goes."""
    with runner.sandbox("docker") as sb:
        session = sb.aio._session  # type: ignore[union-attr]
        monkeypatch.setattr(session, "_quick_exec", lambda argv, user: None)
        timed_out(within(lambda: sb.exec("yes hello", timeout=2)), "hello\nhello\n")
        with pytest.raises(SandboxError, match="broken: the kill at a deadline did not finish"):
            within(lambda: sb.exec("echo no"))
        assert engine.api.inspect_container(session._keeper_id)["State"]["Running"] is False
    assert not base.ours(engine)


def test_endless_output_in_a_one_shot_times_out(runner: Runner) -> None:
    timed_out(within(lambda: runner.run_code(PRINTERS["stdout"], backend="docker", timeout=2)))


def test_endless_output_in_a_warm_pool_member_times_out(engine: Any) -> None:
    with Runner(Settings.from_env(backend="docker", pool_size=1)) as runner:
        wait_ready(runner, 1)
        result = within(lambda: runner.run_code(PRINTERS["stdout"], timeout=2))
        assert result.pooled
        timed_out(result)


# --- what a dead owner leaves -------------------------------------------------------------------------------

# A plain program: no signal handler of execbox's or its own. "unwatched": its watchdog is stopped first.
OWNER = textwrap.dedent("""
    import os, sys, time
    from execbox import Limits, Runner, Settings
    from execbox.backends.docker import session as ds
    limits = Limits(disk_mb=64) if "disk" in sys.argv else None
    with Runner(Settings.from_env(backend="docker")).sandbox("docker", limits=limits) as sb:
        if "unwatched" in sys.argv:
            ds._watchdogs[os.getpid()].kill()
            ds._watchdogs[os.getpid()].wait()
        session = sb.aio._session
        print(session._keeper_id, session.host_workspace, flush=True)
        time.sleep(600)
""")


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A temp dir of this test's own, for its owners and itself: no other execbox process's sweep (each one
    sweeps at start-up) takes what a dead owner left there before the test looks."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return str(tmp_path)


def start_owner(*args: str, python: list[str] | None = None) -> tuple[subprocess.Popen[str], str, str]:
    """A Python program with a docker sandbox open: (its process, the container id, the workspace). Under a
    hostname of its own, as in test_docker_boundary: no other execbox process's sweep takes its container."""
    argv = boundary.under_own_hostname(f"execbox-owner-{uuid.uuid4().hex[:8]}",
                                       [*(python or [sys.executable, "-c"]), OWNER, *args])
    owner = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    line = within(owner.stdout.readline)
    assert line, "the owner did not open its sandbox"
    container_id, workspace = line.split()
    return owner, container_id, workspace


def mounted(path: str) -> bool:
    return f" {path} " in Path("/proc/self/mounts").read_text()


def test_gc_removes_a_dead_owners_mounted_workspace(engine: Any, runner: Runner, private_tmp: str) -> None:
    """The mounted root of a sized workspace belongs to the sandbox user, not to gc's (root): when its container
    was gone before gc came (removed by hand, by another sweep), the orphan scan once passed it by for good."""
    boundary.require_disk()
    owner, container_id, workspace = start_owner("disk", "unwatched")
    owner.kill()
    owner.wait()
    engine.api.remove_container(container_id, force=True)
    assert mounted(workspace) and os.stat(workspace).st_uid != os.geteuid()
    run_blocking(runner.aio.backend("docker").gc)  # (or this process's own first sweep, with the same code)
    assert not os.path.lexists(workspace) and not os.path.lexists(workspace + ".disk") and not mounted(workspace)


def test_gc_never_removes_a_live_owners_workspace(engine: Any, runner: Runner, private_tmp: str) -> None:
    """A container of a live owner past its expiry is removed; the workspace it names is its owner's to remove."""
    with runner.sandbox("docker") as live:
        live_ws = live.aio._session.host_workspace  # type: ignore[union-attr]
        expired = engine.containers.create(base.docker_image.DEFAULT_TAG, ["true"], labels={
            ds.LABEL: "1", ds.L_OWNER: owner_id(), ds.L_EXPIRES: str(int(time.time()) - 5),
            ds.L_WORKSPACE: live_ws})
        run_blocking(runner.aio.backend("docker").gc)
        assert expired.id not in {c.id for c in engine.containers.list(ignore_removed=True, all=True)}
        assert os.path.isdir(live_ws) and live.exec("touch kept && echo ok").stdout == "ok\n"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_an_owner_ended_by_a_signal_leaves_no_container_and_no_workspace(engine: Any, private_tmp: str,
                                                                          signum: signal.Signals) -> None:
    """No clean-up of the program runs (default action, or SIGKILL): its watchdog removes what it left, without
    a gc. (Before, the container lived to the end of its lifetime, an hour by default, until the next gc.)"""
    owner, container_id, workspace = start_owner(*(["disk"] if disk.unavailable_reason() is None else []))
    owner.send_signal(signum)
    assert owner.wait() == -signum
    deadline = time.monotonic() + BOUND_S
    while (engine.containers.list(ignore_removed=True, all=True, filters={"id": container_id})
           or os.path.lexists(workspace)):
        assert time.monotonic() < deadline, f"left {BOUND_S} s after the owner died: {container_id}, {workspace}"
        time.sleep(0.2)
    assert not os.path.lexists(workspace + ".disk") and not mounted(workspace)


def test_the_watchdog_imports_execbox_from_where_its_owner_did(engine: Any, private_tmp: str) -> None:
    """An owner whose execbox is found only through a path it added at run time (here: the base interpreter, the
    venv's paths added by the program): the watchdog's second stage once ran with the interpreter's own path and
    could not import execbox, and nothing was removed."""
    base_python = getattr(sys, "_base_executable", sys.executable)
    if subprocess.run([base_python, "-c", "import execbox"], capture_output=True).returncode == 0:
        pytest.skip("the base interpreter imports execbox by itself")
    added = [path for path in sys.path if os.path.isabs(path)]
    owner, container_id, workspace = start_owner(python=[
        base_python, "-c", f"import sys; sys.path[:0] = {added!r}; exec(sys.argv.pop(1))"])
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + BOUND_S
    while (engine.containers.list(ignore_removed=True, all=True, filters={"id": container_id})
           or os.path.lexists(workspace)):
        assert time.monotonic() < deadline, f"left {BOUND_S} s after the owner died: {container_id}, {workspace}"
        time.sleep(0.2)


def test_the_watchdog_takes_only_what_the_orphan_scan_would(private_tmp: str) -> None:
    """Named with a dead owner's prefix but not execbox's (another user's directory, a link): left alone."""
    prefix = f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-"
    ours, theirs, link = (os.path.join(private_tmp, prefix + name) for name in ("ours", "theirs", "link"))
    for path in (ours, theirs):
        os.mkdir(path)
        Path(path, "f").write_text("x")
    os.symlink(theirs, link)
    if os.geteuid() == 0:
        os.chown(theirs, 4242, 4242)
    within(lambda: ds.reap_owner(private_tmp, prefix, "no-such-host:1:1", "65534"))
    assert not os.path.lexists(ours) and os.path.islink(link)
    assert os.path.exists(os.path.join(theirs, "f")) == (os.geteuid() == 0)


def test_a_child_forked_while_the_watchdog_starts_starts_its_own() -> None:
    """Another thread holds the watchdog's lock (starting the parent's) as this one forks: the child, whose first
    sandbox starts its own watchdog, once waited on that lock forever."""
    with ds._watch_lock:
        child = os.fork()
        if child == 0:  # pragma: no cover (the child)
            ds.watch_owner(os.geteuid())
            os._exit(0 if os.getpid() in ds._watchdogs else 1)
    deadline = time.monotonic() + BOUND_S
    while (status := os.waitpid(child, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail(f"the child still waited on the lock {BOUND_S} s later")
        time.sleep(0.1)
    assert os.waitstatus_to_exitcode(status[1]) == 0


def test_close_cuts_a_stream_nobody_reads_any_more(runner: Runner, engine: Any) -> None:
    """An exec abandoned while its reader is stuck (an output callback that never returns): close() shuts its
    stream first. (Without that, this engine held the removal ~20 s, a delay the liveness bound does not catch: the
    test checks that the stream was cut.)"""
    sb = runner.sandbox("docker").__enter__()
    session = sb.aio._session  # type: ignore[union-attr]
    _, sock_io = session._start_exec(["yes"], {}, "/", session.plan.user)
    sock, _ = hijacked(sock_io)
    with session._lock:
        session._streams.add(sock)  # where the stuck reader left it
    time.sleep(1)  # the pipe and the socket fill up
    within(lambda: sb.__exit__(None, None, None))
    assert not base.ours(engine)
    with pytest.raises(BrokenPipeError):  # shut down by close(), not left for the engine's own time-out
        sock.send(b"x")
    sock.close()
