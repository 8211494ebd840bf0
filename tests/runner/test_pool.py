"""The warm pool's bookkeeping on the in-process path (async runner): members are used once, refilled, closed
with the runner; the pool is off outside an entered runner, and says so."""

from __future__ import annotations

import anyio
import pytest

from execbox import AsyncRunner, Limits, Settings
from execbox.contract.backend import Session, SessionSpec
from execbox.errors import ConfigError
from tests.support.fixtures import anyio_backend  # noqa: F401

pytestmark = pytest.mark.anyio


def _local(**kw: object) -> Settings:
    return Settings(backend="local_subprocess", local=True, network="host", **kw)


async def _ready(runner: AsyncRunner, want: int) -> None:
    with anyio.fail_after(30):
        while await runner.warm() < want:
            await anyio.sleep(0.02)


async def test_members_serve_one_run_each_and_close_with_the_runner() -> None:
    async with AsyncRunner(_local(pool_size=2)) as runner:
        await _ready(runner, 2)
        first = await runner.run("pwd; ls -A; touch mark")
        second = await runner.run("pwd; ls -A")
        assert first.pooled and second.pooled
        assert first.stdout.split()[0] != second.stdout.split()[0]  # two workspaces
        assert second.stdout.split()[1:] == []  # the mark is not there
        await _ready(runner, 2)  # refilled
        pool = runner.pool
    assert pool.count() == 0 and not pool.active


async def test_the_pool_is_off_unless_the_runner_is_entered() -> None:
    runner = AsyncRunner(_local(pool_size=2))
    with pytest.raises(ConfigError, match="CODE_EXEC_POOL_SIZE"):
        await runner.warm()
    assert not (await runner.run("true")).pooled
    await runner.aclose()
    async with AsyncRunner(_local()) as off:
        with pytest.raises(ConfigError, match="CODE_EXEC_POOL_SIZE"):
            await off.warm()


async def test_members_are_in_the_audit_log_from_start_to_removal() -> None:
    from execbox.audit.reader import records

    async with AsyncRunner(_local(pool_size=2)) as runner:
        await _ready(runner, 2)
        assert (await runner.run("true")).pooled
        await _ready(runner, 2)
        path = runner.audit.path
    assert path is not None
    events = [r for r in records(path) if r.get("event", "").startswith("sandbox.")]
    opened = {r["session"] for r in events if r["event"] == "sandbox.open" and r.get("pooled")}
    closed = {r["session"] for r in events if r["event"] == "sandbox.close" and r.get("pooled")}
    assert len(opened) == 3 and opened == closed  # two, one used and refilled; every one removed with the runner


async def test_a_failing_refill_is_said_on_the_next_result(monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox.backends.local_subprocess import LocalSubprocessBackend
    from execbox.errors import SandboxError

    plain = LocalSubprocessBackend.open_session

    async def no_warm_ones(self: LocalSubprocessBackend, spec: SessionSpec) -> Session:
        if not spec.oneshot:  # pool members are opened as sessions
            raise SandboxError("no room for a warm one")
        return await plain(self, spec)

    monkeypatch.setattr(LocalSubprocessBackend, "open_session", no_warm_ones)
    async with AsyncRunner(_local(pool_size=1)) as runner:
        await runner.warm()
        with anyio.fail_after(10):
            while "local_subprocess" not in runner.pool.errors:
                await anyio.sleep(0.01)
        result = await runner.run("true")
    assert result.exit_code == 0 and not result.pooled
    assert any("warm pool" in note and "no room for a warm one" in note for note in result.notes), result.notes


async def test_a_member_lives_long_enough_for_the_longest_run_whoever_asked_for_it() -> None:
    # Found attacking the pool: a member filled after a 1 s run lived 1 + 60 s past its TTL, and a later 90 s run
    # it served died with its container.
    from execbox.runner.pool import WarmPool

    pool = WarmPool(2, 10.0, longest_run_s=260.0)
    short = SessionSpec("none", Limits(), True, 61.0)
    assert pool.member_spec(short).lifetime_s == 10.0 + 260.0
    assert pool.member_spec(SessionSpec("none", Limits(), True, 500.0)).lifetime_s == 510.0
    async with AsyncRunner(_local(max_timeout_sec=200)) as runner:
        assert runner.pool.longest_run_s == 260.0
