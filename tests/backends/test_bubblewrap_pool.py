"""The warm pool on bubblewrap: a member's first exec is armed ahead (bwrap already started, waiting for its
command), and a pooled run is indistinguishable from a fresh one; an armed member never used, a timed-out armed
run, a closed runner and a SIGKILLed owner leave no process behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest

from execbox import Runner, Settings
from execbox.backends.bubblewrap.session import SESSION_PREFIX
from execbox.plugin import owner_tag
from tests.backends.test_bubblewrap import caps, runner, sandbox_processes  # noqa: F401 - fixtures
from tests.support.pool import wait_ready

pytestmark = pytest.mark.engine

# What the run sees of itself: streams, exit status, environment, limits, identity, workspace.
PROBE = ("echo out; cat; echo err >&2; pwd; env | sort; ulimit -a | sort; id; "
         "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp):' /proc/self/status; "
         "ls -A /workspace /tmp; touch /workspace/mark /tmp/mark; exit 3")


def pooled(**kw: Any) -> Runner:
    return Runner(Settings.from_env(backend="bubblewrap", pool_size=2, **kw))


def session_processes() -> list[int]:
    """Host processes of any bubblewrap session of this test process (their command lines name its directory)."""
    return sandbox_processes(f"{SESSION_PREFIX}{owner_tag()}")


def test_a_pooled_run_is_armed_and_indistinguishable_from_a_fresh_one(caps: Any) -> None:
    fresh = Runner(Settings.from_env(backend="bubblewrap")).run(PROBE, stdin=b"in\n", env={"FOO": "b a'r $x"},
                                                                  timeout=7)
    with pooled() as runner:
        wait_ready(runner)
        assert len(session_processes()) >= 2  # each member's sandbox is already running, waiting for its command
        first = runner.run(PROBE, stdin=b"in\n", env={"FOO": "b a'r $x"}, timeout=7)
        second = runner.run(PROBE, stdin=b"in\n", env={"FOO": "b a'r $x"}, timeout=7)
    assert first.pooled and second.pooled and not fresh.pooled
    for got in (first, second):
        assert (got.exit_code, got.stdout, got.stderr) == (fresh.exit_code, fresh.stdout, fresh.stderr)
    assert "FOO=b a'r $x" in fresh.stdout and "time(seconds)        8" in fresh.stdout  # the run's timeout + 1
    assert fresh.exit_code == 3 and fresh.stdout.startswith("out\nin\n") and fresh.stderr.startswith("err\n")
    assert not session_processes()


def test_an_armed_run_times_out_and_leaves_nothing(caps: Any) -> None:
    with pooled() as runner:
        wait_ready(runner)
        started = time.monotonic()
        result = runner.run("echo started; sleep 60 & sleep 60", timeout=1)
        assert result.pooled and result.timed_out and result.stdout == "started\n"
        assert time.monotonic() - started < 10
    assert not session_processes()


def test_members_never_used_are_stopped_with_their_runner(caps: Any) -> None:
    with pooled() as runner:
        wait_ready(runner)
        assert session_processes()
    assert not session_processes()


def test_a_run_the_armed_member_does_not_fit_still_runs(caps: Any) -> None:
    """A member armed with other limits is not handed out (the pool keys on them); a session's own first exec
    with other limits than it was opened with starts its own sandbox and stops the armed one."""
    with pooled(memory_mb=512) as runner:
        wait_ready(runner)
        with runner.sandbox("bubblewrap") as sb:
            assert sb.exec("echo plain").stdout == "plain\n"
        result = runner.run("echo pooled")
        assert result.pooled and result.stdout == "pooled\n"
    assert not session_processes()


POOL_OWNER = textwrap.dedent("""
    import time
    from execbox import Runner, Settings
    with Runner(Settings.from_env(backend="bubblewrap", pool_size=2)) as runner:
        while runner.warm() < 2:
            time.sleep(0.05)
        print("ready", flush=True)
        time.sleep(600)
""")


def test_a_sigkilled_owner_leaves_no_armed_sandbox_running(caps: Any) -> None:
    owner = subprocess.Popen([sys.executable, "-c", POOL_OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "ready\n"
        held = psutil.Process(owner.pid).children(recursive=True)  # watchers, bwraps and the waiting shells
        assert len([p for p in held if p.name() == "bwrap"]) >= 2, "no armed sandbox was running"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 15
        while left := [p.pid for p in held if _running(p)]:
            assert time.monotonic() < deadline, f"still running: {left}"
            time.sleep(0.05)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
