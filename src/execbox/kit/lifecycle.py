"""Creating a sandbox in a worker thread without leaking it when the caller goes away.

SDK calls that create a sandbox (a container, a remote VM, a session directory) block, so backends run
them in a worker thread. If the caller is cancelled meanwhile, two things can happen: an anyio cancel
scope waits for the thread, then raises; asyncio's own ``task.cancel`` (``asyncio.timeout``, ``wait_for``)
raises at once while the thread goes on. Either way, whatever was created must be removed — by the
caller when the thread is already done, else by the thread itself when it finishes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def create_cleanly(create: Callable[[list[T]], None], discard: Callable[[T], None]) -> T:
    """Run ``create`` (which appends what it made to the list it is given, as soon as it exists) in a worker
    thread. On any failure or cancellation, ``discard`` what was made. Returns the first thing made."""
    made: list[T] = []
    lock = threading.Lock()
    state = {"finished": False, "abandoned": False}

    def work() -> None:
        try:
            create(made)
        finally:
            with lock:
                state["finished"] = True
                orphaned = list(made) if state["abandoned"] else []
            for thing in orphaned:  # the caller is gone: this thread cleans up after itself
                discard(thing)

    try:
        await anyio.to_thread.run_sync(work)
        if not made:
            raise RuntimeError("create() returned without making anything")
    except BaseException:
        with lock:
            state["abandoned"] = True
            leftovers = list(made) if state["finished"] else []
        for thing in leftovers:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(discard, thing)
        raise
    return made[0]
