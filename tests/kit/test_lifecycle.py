"""create_cleanly: whatever a worker thread created is discarded when the caller fails or goes away."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

from execbox.kit.lifecycle import create_cleanly


def _slow_create(started: threading.Event, release: threading.Event):  # type: ignore[no-untyped-def]
    def create(made: list[str]) -> None:
        made.append("sandbox-1")
        started.set()
        release.wait(10)
    return create


def test_asyncio_cancel_leaves_the_clean_up_to_the_thread() -> None:
    started, release, discarded = threading.Event(), threading.Event(), []

    async def main() -> None:
        task = asyncio.ensure_future(create_cleanly(_slow_create(started, release), discarded.append))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert discarded == []  # the thread still runs: it must clean up itself
        release.set()
        for _ in range(100):
            if discarded:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert discarded == ["sandbox-1"]


def test_anyio_cancel_waits_for_the_thread_and_hands_over_what_was_made() -> None:
    """An anyio cancel scope waits for the thread; the caller then owns the sandbox (the runner closes it)."""
    started, release, discarded, got = threading.Event(), threading.Event(), [], []

    async def main() -> None:
        with anyio.CancelScope() as scope:
            async def cancel_when_started() -> None:
                await anyio.to_thread.run_sync(started.wait, 10)
                scope.cancel()
                release.set()
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_started)
                got.append(await create_cleanly(_slow_create(started, release), discarded.append))
                await anyio.sleep(0)  # the deferred cancellation lands here

    anyio.run(main)
    assert got == ["sandbox-1"] and discarded == []


def test_a_failure_after_creating_discards_what_was_made() -> None:
    discarded: list[str] = []

    def create(made: list[str]) -> None:
        made.append("sandbox-2")
        raise OSError("upload failed")

    with pytest.raises(OSError):
        anyio.run(create_cleanly, create, discarded.append)
    assert discarded == ["sandbox-2"]


def test_success_returns_what_was_made_and_discards_nothing() -> None:
    discarded: list[str] = []
    assert anyio.run(create_cleanly, lambda made: made.append("ok"), discarded.append) == "ok"
    assert discarded == []
