"""The event-loop thread behind the sync facades, and run_blocking: sync code reaching async code."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal

from execbox.telemetry import carry


class Facade(Protocol):
    """A sync facade (Runner, Sandbox) whose event-loop thread this module keeps track of."""

    def close(self) -> None: ...

    def _forget(self) -> None: ...

T = TypeVar("T")
#: How long a stopped event-loop thread may take to end once its portal has stopped (its own work is done by then).
LOOP_EXIT_S = 10.0


# Sync facades whose event-loop thread is open (listed weakly: a dropped one closes through its finalizer). One
# left open by its owner (an exception outside its `with`, a forgotten close) is closed when the interpreter
# exits, by atexit, while that thread still runs: later, daemon threads are frozen, and the portal's own clean-up
# would wait on its frozen thread for ever — the program would hang at exit, its sandbox running.
_OPEN_FACADES: weakref.WeakSet[Facade] = weakref.WeakSet()


@atexit.register
def _close_forgotten() -> None:
    for facade in list(_OPEN_FACADES):
        with contextlib.suppress(Exception):
            facade.close()


def _forget_in_child() -> None:
    # A forked child (multiprocessing's workers, say) does not own its parent's sandboxes: closing them would end
    # the parent's; and it has no event-loop thread to reach them through (waiting on one hung it at exit).
    for facade in list(_OPEN_FACADES):
        facade._forget()
    _OPEN_FACADES.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class _LoopThread:
    """An event loop in a daemon thread, reached through its BlockingPortal: anyio's start_blocking_portal as an
    object, not a generator, so that a forked child can simply drop it (a generator's clean-up would wait for
    ever on a thread the child does not have)."""

    def __init__(self) -> None:
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve)
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for the portal
                if not ready.done():
                    ready.set_exception(exc)

        self._thread = threading.Thread(target=run, daemon=True, name="execbox-portal")
        self._thread.start()
        self.portal = ready.result()

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` in the loop and wait for it. Anything raised here while it runs (Ctrl-C, the CLI's SIGTERM)
        cancels that call alone, waits for its clean-up (its sandbox removed), and is raised again."""
        finished = threading.Event()
        resume_trace = carry()  # the caller's span is the parent of the spans this call makes in the loop

        async def tracked() -> T:
            resume_trace()
            try:
                return await fn()
            finally:
                finished.set()

        future = self.portal.start_task_soon(tracked)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                future.cancel()  # the portal cancels the call's scope in the loop
                while not finished.wait(0.1) and self._thread.is_alive():
                    pass
            raise

    def stop(self, cancel: bool = False) -> None:
        """Stop the loop (cancelling what still runs in it when ``cancel``) and wait for its thread."""
        with contextlib.suppress(RuntimeError):  # stopped already
            self.portal.call(self.portal.stop, cancel)
        # What the loop still runs now are backend calls the runner abandoned (contract.backend.bounded), which the
        # loop's end would wait for: a call deaf to cancellation would hang this for ever. The thread is a daemon.
        self._thread.join(LOOP_EXIT_S)

    def shut(self, *closers: Callable[[], Awaitable[object]], cancel: bool = False, stop: bool = True) -> None:
        """Run ``closers`` in the loop, then stop it unless ``stop`` is false (a sandbox closing in the loop of
        the runner it came from): a facade's clean-up."""
        try:
            for closer in closers:
                self.portal.call(closer)
        finally:
            if stop:
                self.stop(cancel)


class _Closing:
    """A facade's clean-up (``closers`` in its loop, then the loop stopped), run once: ``now`` waits for it (close,
    exit); the facade's garbage collection starts it in a thread of its own, since a collection may run in any
    thread, holding any lock, and must not wait there. That thread is not a daemon: exit waits for it."""

    def __init__(self, facade: Facade, loop: _LoopThread, *closers: Callable[[], Awaitable[object]],
                 owns_loop: bool = True) -> None:
        self._finalizer = weakref.finalize(facade, _shut_soon, loop, closers, owns_loop)
        self._finalizer.atexit = False  # _close_forgotten closes it then, waiting
        _OPEN_FACADES.add(facade)

    def now(self, *, cancel: bool = False) -> None:
        detached = self._finalizer.detach()
        if detached is not None:
            _, _, (loop, closers, owns_loop), _ = detached
            loop.shut(*closers, cancel=cancel, stop=owns_loop)

    def forget(self) -> None:
        self._finalizer.detach()


def _shut_soon(loop: _LoopThread, closers: tuple[Callable[[], Awaitable[object]], ...], owns_loop: bool) -> None:
    threading.Thread(target=loop.shut, args=closers, kwargs={"stop": owns_loop}, name="execbox-close").start()



def run_blocking(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine function to completion from sync code, in a private event loop thread (so it also
    works inside a program that already runs a loop). Ctrl-C cancels it, and its clean-up still runs.

    A _LoopThread, not anyio's start_blocking_portal: with that, a Ctrl-C (or the CLI's SIGTERM) landing
    while the portal started left the main thread joining a loop thread that nobody would stop, for ever."""
    loop = _LoopThread()
    try:
        result: T = loop.portal.call(fn)
    except BaseException:
        loop.stop(cancel=True)
        raise
    loop.stop()
    return result

