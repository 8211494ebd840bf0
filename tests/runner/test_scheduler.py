"""The runner-wide concurrency cap (CODE_EXEC_MAX_CONCURRENT): it holds across tasks and threads, waiting is
reported and bounded by its own setting, sessions hold a slot for life without deadlocking their own execs."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import anyio
import pytest

from execbox import AsyncRunner, Runner, Settings
from execbox.errors import BusyError, ExecboxError
from execbox.runner.scheduler import Slots, default_max_concurrent
from tests.support.fixtures import anyio_backend  # noqa: F401

pytestmark = pytest.mark.anyio


def _local(**kw: object) -> Settings:
    return Settings(backend="local_subprocess", local=True, network="host", **kw)


def _max_overlap(log: Path) -> int:
    running = peak = 0
    for line in log.read_text().split():
        running += 1 if line == "start" else -1
        peak = max(peak, running)
    return peak


def _marked(log: Path, seconds: float = 0.2) -> str:
    return f"echo start >> {log}; sleep {seconds}; echo end >> {log}"


async def test_the_cap_holds_across_tasks_and_waiting_is_reported(tmp_path: Path) -> None:
    log = tmp_path / "log"
    async with AsyncRunner(_local(max_concurrent=2)) as runner:
        results = [None] * 8

        async def one(i: int) -> None:
            results[i] = await runner.run(_marked(log))  # type: ignore[call-overload]

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
    assert all(r is not None and r.exit_code == 0 for r in results)
    assert _max_overlap(log) == 2
    assert sum(1 for r in results if r.queued_s > 0) >= 6  # type: ignore[union-attr]
    assert runner.slots.in_use == 0


def test_the_cap_holds_across_threads_of_the_sync_facade(tmp_path: Path) -> None:
    log = tmp_path / "log"
    runner = Runner(_local(max_concurrent=3))
    threads = [threading.Thread(target=runner.run, args=(_marked(log),)) for _ in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log.read_text().split().count("end") == 9
    assert _max_overlap(log) == 3
    assert runner.aio.slots.in_use == 0


async def test_waiting_is_bounded_by_its_own_setting_and_says_what_to_change() -> None:
    async with AsyncRunner(_local(max_concurrent=1, queue_timeout_sec=0.3, max_timeout_sec=30)) as runner:
        async with runner.sandbox():  # holds the only slot
            with pytest.raises(BusyError) as caught:
                await runner.run("true")
        assert isinstance(caught.value, ExecboxError) and caught.value.retryable
        assert "CODE_EXEC_MAX_CONCURRENT" in str(caught.value) and "CODE_EXEC_QUEUE_TIMEOUT_SEC" in str(caught.value)
        assert runner.slots.in_use == 0
        assert (await runner.run("true")).exit_code == 0  # the slot came back when the sandbox closed


async def test_a_session_holds_one_slot_and_its_execs_take_none() -> None:
    async with AsyncRunner(_local(max_concurrent=1)) as runner, runner.sandbox() as sb:
        assert runner.slots.in_use == 1
        for _ in range(3):  # would deadlock if an exec needed a second slot
            assert (await sb.exec("true")).exit_code == 0
    assert runner.slots.in_use == 0


async def test_a_cancelled_waiter_leaks_no_slot() -> None:
    slots = Slots(1)
    await slots.acquire(1)
    with anyio.move_on_after(0.05):
        await slots.acquire(10)
    slots.release()
    assert slots.in_use == 0
    assert await slots.acquire(0.1) == 0.0  # free again, at once


async def test_a_slot_granted_as_the_waiter_is_cancelled_is_passed_on() -> None:
    slots = Slots(1)
    await slots.acquire(1)
    waiter = asyncio.ensure_future(slots.acquire(10))
    await asyncio.sleep(0.01)
    slots.release()  # grants the waiter (scheduled) ...
    waiter.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0.01)
    assert slots.in_use == 0


async def test_waiters_are_served_first_come_first_served() -> None:
    slots = Slots(1)
    await slots.acquire(1)
    order: list[int] = []

    async def wait(i: int) -> None:
        await slots.acquire(5)
        order.append(i)
        slots.release()

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(wait, i)
            await asyncio.sleep(0.01)
        slots.release()
    assert order == [0, 1, 2, 3, 4]


def test_the_default_follows_the_host() -> None:
    assert 2 <= default_max_concurrent(1024) <= 4 * 64
    assert default_max_concurrent(1 << 30) == 2  # memory bounds it, never below two
    with pytest.raises(ExecboxError, match="CODE_EXEC_MAX_CONCURRENT"):
        Settings(max_concurrent=0)
