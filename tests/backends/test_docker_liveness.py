"""A docker run ends at its deadline whatever the code does, and so does a session's owner.

Endless output past a 2 s deadline, in a session (which stays usable), a one-shot and a warm-pool member: the
engine finishes an exec only once its output has reached the client, so an unread stream once held the kill at
the deadline (and every later call on that container) forever. Each run is made in a thread and the test fails
if it is still running after a generous bound, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from execbox import ExecResult, Runner, Settings
from tests.backends import test_docker as base
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


def test_endless_output_in_a_one_shot_times_out(runner: Runner) -> None:
    timed_out(within(lambda: runner.run_code(PRINTERS["stdout"], backend="docker", timeout=2)))


def test_endless_output_in_a_warm_pool_member_times_out(engine: Any) -> None:
    with Runner(Settings.from_env(backend="docker", pool_size=1)) as runner:
        wait_ready(runner, 1)
        result = within(lambda: runner.run_code(PRINTERS["stdout"], timeout=2))
        assert result.pooled
        timed_out(result)
