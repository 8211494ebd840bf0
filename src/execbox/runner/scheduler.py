"""The runner-wide concurrency cap: a fixed number of sandbox slots, shared by every thread and event loop.

A one-shot run holds a slot while its sandbox exists; a persistent sandbox holds one for its whole life (its
execs take none, so a session can never wait on itself). Waiting for a slot is bounded by its own setting,
separate from the run's timeout, and the time waited is reported on the result.

Why not ``anyio.Semaphore``: the sync facade runs each call in its own event loop thread, and the cap must hold
across all of them; so the count lives under a thread lock and a waiter is woken in its own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

import anyio

from execbox.errors import BusyError


def default_max_concurrent(memory_mb: int) -> int:
    """Four sandboxes per core, and no more than the host's memory holds at each sandbox's memory limit."""
    cores = os.cpu_count() or 1
    try:
        total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    except (ValueError, OSError):
        total_mb = 4096
    return max(2, min(4 * cores, total_mb // max(memory_mb, 1)))


class Slots:
    """A counting semaphore that async code in any thread's event loop can wait on, first come first served."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a scheduler needs at least one slot")
        self.total = total
        self._free = total
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.total - self._free

    async def acquire(self, timeout: float, what: str = "a sandbox") -> float:
        """Take a slot; returns the seconds waited. BusyError after ``timeout`` seconds without one."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return 0.0
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, future))
        try:
            with anyio.fail_after(timeout):
                await asyncio.shield(future)
        except BaseException as exc:
            with self._lock:
                granted = (loop, future) not in self._waiters
                if not granted:
                    self._waiters.remove((loop, future))
            if granted:  # the slot arrived as we gave up: pass it on
                self._hand_over(future)
            if isinstance(exc, TimeoutError):
                raise BusyError(
                    f"all {self.total} sandbox slots stayed in use for {timeout:g} s while {what} waited. Close "
                    "sandboxes you no longer need, or raise CODE_EXEC_MAX_CONCURRENT or CODE_EXEC_QUEUE_TIMEOUT_SEC",
                    env_var="CODE_EXEC_MAX_CONCURRENT") from None
            raise
        return time.monotonic() - started

    def release(self) -> None:
        with self._lock:
            while self._waiters:
                loop, future = self._waiters.popleft()
                try:
                    loop.call_soon_threadsafe(self._grant, future)
                    return
                except RuntimeError:  # that waiter's loop is closed: it is gone
                    continue
            self._free += 1

    def _grant(self, future: asyncio.Future[None]) -> None:
        if future.done():  # its waiter was cancelled in the meantime
            self.release()
        else:
            future.set_result(None)

    def _hand_over(self, future: asyncio.Future[None]) -> None:
        # Granted (or about to be): once the grant callback has run the slot is ours, so give it back.
        if future.done() and not future.cancelled():
            self.release()
        else:
            future.cancel()  # _grant will see it done and release

    @contextlib.asynccontextmanager
    async def slot(self, timeout: float, what: str = "a sandbox") -> AsyncIterator[float]:
        waited = await self.acquire(timeout, what)
        try:
            yield waited
        finally:
            self.release()
