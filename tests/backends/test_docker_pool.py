"""The warm pool on the real engine: a pooled sandbox is as hardened and as fresh as a new one, serves one run,
is refilled, expires unused, and nothing of it outlives its runner — or its killed owner (gc)."""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from typing import Any

import pytest

from execbox import Runner, Settings
from tests.backends import test_docker as base
from tests.backends import test_docker_boundary as boundary
from tests.support.pool import wait_ready

pytestmark = pytest.mark.engine

engine = base.engine
no_leaks = base.no_leaks

PROBE = 'id -u; grep CapEff /proc/self/status; echo "tmp:$(ls -A /tmp)"; echo "ws:$(ls -A)"; touch mark /tmp/mark'

# What the contract sets, as the code sees it: the same in a pooled sandbox as in a fresh one.
LIMITS = ("touch /etc/x; grep processes /proc/self/limits; cat /proc/self/uid_map; grep -c . /proc/net/dev; "
          "grep Seccomp: /proc/self/status; grep NoNewPrivs /proc/self/status; df -P /workspace | tail -1 | "
          "awk '{print $2}'")


def pooled_runner(**kw: Any) -> Runner:
    return Runner(Settings.from_env(backend="docker", pool_size=2, **kw))


def test_a_pooled_run_is_hardened_fresh_and_used_once(engine: Any) -> None:
    plain = Runner(Settings.from_env(backend="docker"))
    fresh, fresh_limits = plain.run(PROBE), plain.run(LIMITS)
    with pooled_runner() as runner:
        wait_ready(runner)
        first, second = runner.run(PROBE), runner.run(PROBE)
        wait_ready(runner)
        pooled_limits = runner.run(LIMITS)
    assert first.pooled and second.pooled and not fresh.pooled
    uid, caps, tmp1, listing1 = first.stdout.split("\n")[:4]
    assert (uid, caps) == tuple(fresh.stdout.split("\n")[:2]) == ("65534", "CapEff:\t0000000000000000")
    # No mark of the run before: a fresh workspace and a fresh /tmp, so two sandboxes, one run each.
    assert (tmp1, listing1) == ("tmp:", "ws:") and second.stdout.split("\n")[2:4] == ["tmp:", "ws:"]
    assert pooled_limits.pooled and (pooled_limits.stdout, pooled_limits.stderr) == (fresh_limits.stdout,
                                                                                      fresh_limits.stderr)
    assert "Read-only file system" in pooled_limits.stderr and "Max processes" in pooled_limits.stdout


def test_the_pool_refills_and_is_gone_with_its_runner(engine: Any) -> None:
    with pooled_runner() as runner:
        wait_ready(runner)
        results = [runner.run("true") for _ in range(4)]
        assert all(r.exit_code == 0 for r in results)
        wait_ready(runner)  # refilled in the background
        assert len(base.ours(engine)) >= 2
    deadline = time.monotonic() + 30
    while base.ours(engine):  # members and used sandboxes are removed (the used ones in the background)
        assert time.monotonic() < deadline, [c.name for c in base.ours(engine)]
        time.sleep(0.2)


def test_an_expired_member_is_never_handed_out(engine: Any) -> None:
    with pooled_runner(pool_ttl_sec=0.5) as runner:
        wait_ready(runner)
        stale = {c.id for c in base.ours(engine)}
        time.sleep(0.8)
        assert not runner.run("true").pooled
        deadline = time.monotonic() + 30
        while stale & {c.id for c in base.ours(engine)}:  # and the expired members are removed
            assert time.monotonic() < deadline, "an expired member was not removed"
            time.sleep(0.2)


POOL_OWNER = textwrap.dedent("""
    import time
    from execbox import Runner, Settings
    with Runner(Settings.from_env(backend="docker", pool_size=2)) as runner:
        while runner.warm() < 2:
            time.sleep(0.1)
        print("ready", flush=True)
        time.sleep(600)
""")


def test_a_killed_owner_leaves_nothing_gc_cannot_remove(engine: Any) -> None:
    caller, owner = boundary.start_caller([sys.executable, "-c", POOL_OWNER])
    deadline = time.monotonic() + 90
    while len(boundary.running(engine, owner)) < 2:
        assert time.monotonic() < deadline, "the pool never filled"
        time.sleep(0.2)
    boundary.stop_watchdog(caller)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    boundary.gc_removes_everything(engine, caller.pid, owner)
