"""The runner owns every deadline: a backend call that never returns (exec, open, a file call, close; a real setsid
grandchild holding the output pipe) ends in BackendTimeoutError naming the backend and the call, within its bound,
and the sandbox it broke is closed and refuses later calls at once. One-shot, sandbox, warm pool, run_cell, sync."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from execbox import AsyncRunner, BackendTimeoutError, Runner, SandboxError, Settings, plugin
from execbox.audit import reader as audit_reader
from execbox.testing.checks import alive_with
from tests.support import stuck_backends
from tests.support.fixtures import FakeDistributions, anyio_backend  # noqa: F401

pytestmark = pytest.mark.anyio
#: A liveness bound, far above the bounds these tests set (timeout 1 s, grace 1 s, open 2 s).
LIVENESS_S = 60


@pytest.fixture(autouse=True)
def installed(only_local_builtin: None, fake_dists: FakeDistributions) -> Iterator[None]:
    fake_dists.add(stuck_backends.DISTRIBUTION, ep_name="stuck", value="tests.support.stuck_backends")
    stuck_backends.RELEASE.clear()
    yield
    stuck_backends.RELEASE.set()  # the threads the stuck calls block in end, so the test's loop can close


def _settings(backend: str, **kw: object) -> Settings:
    bounds: dict[str, object] = {"backend_grace_sec": 1.0, "open_timeout_sec": 2.0, **kw}
    return Settings(backend=backend, shell_backend=backend, network="none", **bounds)


@pytest.fixture(params=["stuck_exec", "pipe_holder"])
def hung(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A backend whose exec never returns, and a command for it: on pipe_holder, one that leaves a real setsid
    grandchild holding the output pipe (killed afterwards by the unique argument of its sleep)."""
    marker = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"
    yield request.param, f"setsid sleep {marker} & echo started"
    for pid in alive_with(marker, settle_s=0):
        os.kill(pid, signal.SIGKILL)


def _names(exc: pytest.ExceptionInfo[BackendTimeoutError], backend: str, call: str) -> None:
    assert exc.value.backend == backend
    assert f"backend {backend!r} did not return from {call}" in exc.value.message


async def test_a_one_shot_whose_exec_never_returns_raises_and_is_closed() -> None:
    async with AsyncRunner(_settings("stuck_exec")) as runner:
        with anyio.fail_after(LIVENESS_S), pytest.raises(BackendTimeoutError) as exc:
            await runner.run("true", timeout=1)
    _names(exc, "stuck_exec", "exec")
    assert "sandbox closed" in exc.value.message and exc.value.retryable


async def test_a_sandbox_whose_exec_never_returns_is_broken_afterwards(hung: tuple[str, str]) -> None:
    backend, command = hung
    async with AsyncRunner(_settings(backend)) as runner:
        with anyio.fail_after(LIVENESS_S):
            async with runner.sandbox() as sb:
                with pytest.raises(BackendTimeoutError) as exc:
                    await sb.exec(command, timeout=1)
                _names(exc, backend, "exec")
                with anyio.fail_after(1), pytest.raises(SandboxError, match="broken") as later:
                    await sb.write_file("a", b"x")  # refused at once, not after another bound
                assert later.value.backend == backend


@pytest.mark.parametrize("call", ["write_file", "read_file", "list_files"])
async def test_a_file_call_that_never_returns_raises(call: str) -> None:
    async with AsyncRunner(_settings("stuck_files", max_timeout_sec=1.0)) as runner:
        with anyio.fail_after(LIVENESS_S):
            async with runner.sandbox() as sb:
                with pytest.raises(BackendTimeoutError) as exc:
                    await {"write_file": lambda: sb.write_file("a", b"x"), "read_file": lambda: sb.read_file("a"),
                           "list_files": lambda: sb.list_files(".")}[call]()
                _names(exc, "stuck_files", call)


async def test_an_open_that_never_returns_raises_for_a_one_shot_and_a_sandbox() -> None:
    async with AsyncRunner(_settings("stuck_open")) as runner:
        with anyio.fail_after(LIVENESS_S):
            with pytest.raises(BackendTimeoutError) as exc:
                await runner.run("true", timeout=1)
            _names(exc, "stuck_open", "open_session")
            with pytest.raises(BackendTimeoutError) as exc:
                async with runner.sandbox():
                    pass
            _names(exc, "stuck_open", "open_session")
            assert runner.slots.in_use == 0  # the sandbox's slot was given back


async def test_a_sandbox_that_opens_after_its_bound_is_closed_when_it_does() -> None:
    stuck_backends.OPENED.clear()
    async with AsyncRunner(_settings("slow_open")) as runner:
        with anyio.fail_after(LIVENESS_S):
            with pytest.raises(BackendTimeoutError) as exc:
                await runner.run("true", timeout=1)
            _names(exc, "slow_open", "open_session")
            while not stuck_backends.OPENED or stuck_backends.OPENED[0].root is None \
                    or os.path.exists(stuck_backends.OPENED[0].root):
                await anyio.sleep(0.05)  # opened 3 s in, then removed: nobody will use it


async def test_a_close_that_never_returns_raises() -> None:
    async with AsyncRunner(_settings("stuck_close")) as runner:
        with anyio.fail_after(LIVENESS_S), pytest.raises(BackendTimeoutError) as exc:
            await runner.run("true", timeout=1)
    _names(exc, "stuck_close", "close")


async def test_a_warm_member_whose_exec_never_returns_raises(hung: tuple[str, str]) -> None:
    backend, command = hung
    async with AsyncRunner(_settings(backend, pool_size=1)) as runner:
        with anyio.fail_after(LIVENESS_S):
            while await runner.warm() < 1:
                await anyio.sleep(0.02)
            with pytest.raises(BackendTimeoutError) as exc:
                await runner.run(command, timeout=1)
    _names(exc, backend, "exec")


async def test_a_warm_member_that_never_opens_is_a_refill_error_and_the_run_opens_its_own() -> None:
    async with AsyncRunner(_settings("stuck_open", pool_size=1)) as runner:
        with anyio.fail_after(LIVENESS_S):
            await runner.warm()
            while "stuck_open" not in runner.pool.errors:
                await anyio.sleep(0.05)
            assert "did not return from open_session" in runner.pool.errors["stuck_open"]
            with pytest.raises(BackendTimeoutError) as exc:
                await runner.run("true", timeout=1)
    _names(exc, "stuck_open", "open_session")


async def test_a_used_member_whose_close_never_returns_does_not_stop_the_runner() -> None:
    async with AsyncRunner(_settings("stuck_close", pool_size=1)) as runner:
        with anyio.fail_after(LIVENESS_S):
            while await runner.warm() < 1:
                await anyio.sleep(0.02)
            first = await runner.run("echo one", timeout=1)
            assert first.pooled and first.stdout == "one\n"
            while "stuck_close" not in runner.pool.errors:  # removed in the background, given up on after the grace
                await anyio.sleep(0.05)
            assert "did not return from close" in runner.pool.errors["stuck_close"]
            second = await runner.run("echo two", timeout=1)  # the runner's background work still runs
            assert second.stdout == "two\n"


async def test_run_cell_on_a_backend_whose_exec_never_returns_ends() -> None:
    # The interpreter's supervisor is one exec that lasts the sandbox's life: bounded by that life and the grace.
    async with AsyncRunner(_settings("stuck_exec")) as runner:
        with anyio.fail_after(LIVENESS_S):
            async with runner.sandbox(lifetime_s=2) as sb:
                with pytest.raises(SandboxError) as exc:
                    await sb.run_cell("1 + 1", timeout=1)
                assert exc.value.backend == "stuck_exec" and "did not return from exec" in exc.value.message


async def test_a_one_shot_held_open_by_a_setsid_grandchild_raises(hung: tuple[str, str]) -> None:
    backend, command = hung
    async with AsyncRunner(_settings(backend)) as runner:
        with anyio.fail_after(LIVENESS_S), pytest.raises(BackendTimeoutError) as exc:
            await runner.run(command, timeout=1)
    _names(exc, backend, "exec")


def test_the_sync_facade_raises_and_closes() -> None:
    runner = Runner(_settings("stuck_exec"))
    with pytest.raises(BackendTimeoutError) as exc:
        runner.run("true", timeout=1)
    _names(exc, "stuck_exec", "exec")
    runner.close()  # the abandoned call still blocks its thread: the loop's thread is not waited for past its bound


def test_the_kit_exports_the_error() -> None:
    assert plugin.BackendTimeoutError is BackendTimeoutError and issubclass(BackendTimeoutError, SandboxError)


async def test_a_sandbox_that_opens_after_its_caller_was_cancelled_is_closed() -> None:
    # The caller is cancelled while the open runs; the open, deaf to cancellation, comes back 3 s in, within the
    # grace the caller's clean-up waits for it: what it opened is nobody's and must be closed, not dropped.
    stuck_backends.OPENED.clear()
    async with AsyncRunner(_settings("slow_open", backend_grace_sec=10.0, open_timeout_sec=20.0)) as runner:
        with anyio.fail_after(LIVENESS_S):
            with anyio.move_on_after(0.5):
                await runner.run("true", timeout=1)
            assert stuck_backends.OPENED, "the cancelled caller waited for the open within the grace"
            while stuck_backends.OPENED[0].root is None or os.path.exists(stuck_backends.OPENED[0].root):
                await anyio.sleep(0.05)


async def test_a_check_that_never_returns_raises_for_a_one_shot_and_a_sandbox() -> None:
    # The runner checks the backend before every sandbox it opens: that call is a backend call like any other.
    async with AsyncRunner(_settings("stuck_probe")) as runner:
        with anyio.fail_after(LIVENESS_S):
            with pytest.raises(BackendTimeoutError) as exc:
                await runner.run("true", timeout=1)
            _names(exc, "stuck_probe", "its availability check")
            with pytest.raises(BackendTimeoutError) as exc:
                async with runner.sandbox():
                    pass
            _names(exc, "stuck_probe", "its availability check")


async def test_a_stuck_exec_is_recorded_as_an_exec_error_naming_the_timeout() -> None:
    settings = _settings("stuck_exec")
    async with AsyncRunner(settings) as runner:
        with anyio.fail_after(LIVENESS_S):
            with pytest.raises(BackendTimeoutError):
                await runner.run("true", timeout=1)
            async with runner.sandbox() as sb:
                with pytest.raises(BackendTimeoutError):
                    await sb.exec("true", timeout=1)
    errors = [r for r in audit_reader.records(Path(settings.audit_log or "")) if r["event"] == "exec.error"]
    assert [(r["oneshot"], r["error"]["type"], r["error"]["backend"]) for r in errors] == [
        (True, "BackendTimeoutError", "stuck_exec"), (False, "BackendTimeoutError", "stuck_exec")]
    assert all("did not return from exec" in r["error"]["message"] for r in errors)


async def test_a_cell_on_a_stuck_backend_is_recorded_as_a_cell_error() -> None:
    settings = _settings("stuck_exec")
    async with AsyncRunner(settings) as runner:
        with anyio.fail_after(LIVENESS_S):
            async with runner.sandbox(lifetime_s=2) as sb:
                with pytest.raises(SandboxError) as exc:
                    await sb.run_cell("1 + 1", timeout=1)
    (rec,) = [r for r in audit_reader.records(Path(settings.audit_log or "")) if r["event"].startswith("cell")]
    assert rec["event"] == "cell.error" and rec["oneshot"] is False and rec["backend"] == "stuck_exec"
    assert rec["error"]["type"] == type(exc.value).__name__ and rec["error"]["message"] == exc.value.message


async def test_a_runner_whose_backend_never_releases_closes_with_the_typed_error() -> None:
    with anyio.fail_after(LIVENESS_S), pytest.raises(BackendTimeoutError) as exc:
        async with AsyncRunner(_settings("stuck_aclose")) as runner:
            assert (await runner.run("echo ok", timeout=1)).stdout == "ok\n"
    _names(exc, "stuck_aclose", "aclose")


async def test_a_session_that_cannot_be_hashed_is_served() -> None:
    # A plugin's session may be a dataclass (eq without hash): the runner's broken mark must not need its hash.
    async with AsyncRunner(_settings("dataclass_ok")) as runner:
        with anyio.fail_after(LIVENESS_S):
            assert (await runner.run("echo one", timeout=5)).stdout == "one\n"
            async with runner.sandbox() as sb:
                await sb.write_file("a", b"two")
                assert (await sb.exec("cat a", timeout=5)).stdout == "two"



async def test_a_sandbox_whose_exec_outlives_its_callers_cancellation_is_broken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The caller gave up (its own deadline); the backend ignored the cancellation for the whole grace: the sandbox
    # is in no known state, with that call still running in it. It is closed, and later calls refused at once.
    async def deaf(self: stuck_backends.ExecSession, request: plugin.ExecSpec) -> plugin.ExecResult:
        waiting = asyncio.get_running_loop().run_in_executor(None, stuck_backends.RELEASE.wait, 5.0)  # past the grace
        while not waiting.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(waiting)
        raise plugin.SandboxError("released")

    monkeypatch.setattr(stuck_backends.ExecSession, "exec", deaf)
    async with AsyncRunner(_settings("stuck_exec")) as runner:
        with anyio.fail_after(LIVENESS_S):
            async with runner.sandbox() as sb:
                with anyio.move_on_after(0.5):
                    await sb.exec("true", timeout=30)
                with anyio.fail_after(1), pytest.raises(SandboxError, match="broken") as later:
                    await sb.write_file("a", b"x")
                assert "cancellation" in later.value.message and later.value.backend == "stuck_exec"
