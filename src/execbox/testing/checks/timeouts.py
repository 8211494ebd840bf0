"""Checks of the deadline: a timeout ends the run as exit 124 and kills setsid grandchildren, endless
output is cut and bounded (one-shot, session, warm pool member), and nothing is left running after a run."""

from __future__ import annotations

import textwrap
import time
import uuid
from collections.abc import Callable

from execbox import ExecResult, Runner
from execbox.plugin import TIMEOUT_EXIT_CODE
from execbox.testing.framework import DEADLINE_SLACK_S, Family, Kit, NotClaimed, expect, shown
from execbox.testing.host import alive_with
from execbox.testing.probes import ENDLESS, ESCAPING_GRANDCHILD, ESCAPING_MARKED_GRANDCHILD

family = Family()


@family.check("a timeout ends the run, reported as exit 124 + timed_out")
def check_timeout_ends_the_run(kit: Kit) -> None:
    started = time.monotonic()
    result = kit.run(["sleep", "1000"], timeout=1)
    took = time.monotonic() - started
    # One result builder: every backend reports a timeout with the same exit code.
    expect((result.exit_code, result.timed_out, result.oom_killed) == (TIMEOUT_EXIT_CODE, True, False),
           "a timeout is reported the same on every backend", f"exit {TIMEOUT_EXIT_CODE}, timed_out, not oom_killed",
           shown(result))
    expect(took < 1 + DEADLINE_SLACK_S, "a timeout ends the run", f"back within {1 + DEADLINE_SLACK_S:.0f} s",
           f"{took:.1f} s")


@family.check("a timeout kills a setsid grandchild in a session")
def check_timeout_kills_setsid_grandchild(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a timeout kills a setsid grandchild in a session"
    with kit.sandbox() as sb:
        result = sb.run_code(ESCAPING_GRANDCHILD, timeout=5)
        expect(result.timed_out and "GRANDCHILD RUNNING" in result.stdout, claim,
               "the grandchild started (GRANDCHILD RUNNING) and the run timed out", shown(result))
        time.sleep(1.0)
        first = len(sb.read_file("tick"))
        time.sleep(1.5)
        later = len(sb.read_file("tick"))
        expect(first > 0 and later == first, claim, "the grandchild's file to stop growing after the deadline",
               f"{first} bytes, then {later} bytes 1.5 s later")


@family.check("a timeout kills a setsid grandchild of a one-shot run")
def check_timeout_kills_setsid_grandchild_of_a_one_shot_run(kit: Kit) -> None:
    if kit.caps.remote:
        raise NotClaimed("the sandbox's processes run on another host: not observable from here")
    claim = "a timeout kills a setsid grandchild of a one-shot run"
    marker = f"execbox-escape-{uuid.uuid4().hex}"
    result = kit.run(["python3", "-c", ESCAPING_MARKED_GRANDCHILD, marker], timeout=3)
    expect(result.timed_out and "GRANDCHILD RUNNING" in result.stdout, claim,
           "the grandchild started (GRANDCHILD RUNNING) and the run timed out", shown(result))
    left = alive_with(marker)
    expect(left == [], claim, "no process with the marker after the deadline", f"host pids {left}")


ENDLESS_CAP = 10_000


def _endless_ended(run: Callable[[list[str]], ExecResult], claim: str, *, pooled: bool | None = None) -> None:
    for name, argv in ENDLESS.items():
        started = time.monotonic()
        result = run(argv)
        took = time.monotonic() - started
        expect(result.timed_out and result.exit_code == TIMEOUT_EXIT_CODE, claim,
               f"endless output ({name}) to time out (exit {TIMEOUT_EXIT_CODE}, timed_out)", shown(result))
        size = max(len(result.stdout.encode()), len(result.stderr.encode()))
        expect(result.truncated and size <= ENDLESS_CAP + 200, claim,
               f"the output of {name} truncated to its cap ({ENDLESS_CAP} bytes, +200 for the notice)",
               f"truncated={result.truncated}, {size} bytes")
        expect(took < 2 + DEADLINE_SLACK_S, claim, f"back within {2 + DEADLINE_SLACK_S:.0f} s", f"{took:.1f} s")
        if pooled is not None:
            expect(result.pooled == pooled, claim, "the run to have used a warm pool member", f"pooled={result.pooled}")


@family.check("endless output past the deadline ends a one-shot run, its output bounded")
def check_endless_output_ends_a_one_shot_run(kit: Kit) -> None:
    _endless_ended(lambda argv: kit.run(argv, timeout=2, max_output_bytes=ENDLESS_CAP),
                   "endless output past the deadline ends a one-shot run, its output bounded")


@family.check("endless output past the deadline ends an exec in a session, its output bounded")
def check_endless_output_ends_a_session_exec(kit: Kit) -> None:
    kit.require(sessions=True)
    with kit.sandbox() as sb:
        _endless_ended(lambda argv: sb.exec(argv, timeout=2, max_output_bytes=ENDLESS_CAP),
                       "endless output past the deadline ends an exec in a session, its output bounded")
        after = sb.exec(["echo", "alive"], timeout=10)
        expect(after.stdout.strip() == "alive", "the session still serves after an endless run was killed",
               "stdout 'alive'", shown(after))


@family.check("endless output past the deadline ends a run in a warm pool member, its output bounded")
def check_endless_output_ends_a_pool_member_run(kit: Kit) -> None:
    kit.require(sessions=True)
    claim = "endless output past the deadline ends a run in a warm pool member, its output bounded"
    settings = kit.runner.settings.model_copy(update={"pool_size": 1})
    with Runner(settings, options=kit.runner.aio.options) as runner:

        def run(argv: list[str]) -> ExecResult:
            deadline = time.monotonic() + 120  # a liveness bound for the member's start
            while runner.warm(kit.backend, network=kit.net) < 1:
                expect(time.monotonic() < deadline, claim, "a warm member ready within 120 s",
                       f"errors {runner.aio.pool.errors}")
                time.sleep(0.05)
            return runner.run(argv, backend=kit.backend, network=kit.net, timeout=2, max_output_bytes=ENDLESS_CAP)

        _endless_ended(run, claim, pooled=True)


@family.check("nothing is left running after a run")
def check_nothing_left_running_after_a_run(kit: Kit) -> None:
    if kit.caps.remote:
        raise NotClaimed("the sandbox's processes run on another host: not observable from here")
    claim = "nothing is left running after a run"
    marker = f"execbox-leak-{uuid.uuid4().hex}"
    # "started" only once the detached shell is up and still running, so a shell that died at once is seen.
    code = textwrap.dedent(f"""
        import os, subprocess, time
        p = subprocess.Popen(['sh', '-c', 'touch up; sleep 1000; : {marker}'], start_new_session=True)
        while not os.path.exists('up'):
            time.sleep(0.05)
        print('started' if p.poll() is None else 'died')
    """)
    result = kit.code(code)
    expect(result.stdout == "started\n", claim, "the detached process to be running ('started')", shown(result))
    left = alive_with(marker)
    expect(left == [], claim, "no process with the marker after the run", f"host pids {left}")
