"""Bounded output capture, and streaming it to the caller as it arrives.

``BoundedCapture`` keeps the head and the tail of a stream, never more than the cap in memory. Given an
``on_output`` callback (a run's ``ExecSpec.on_output``), it also hands every byte it is written to that
callback, at once: this is how every backend streams, with no code of its own beyond building its captures
with ``ExecSpec.captures()`` (or passing ``on_output`` to ``run_process``).

``LiveOutput`` is the caller's side: it takes those bytes from any thread and turns them into ``OutputEvent``
objects on the event loop, bounded the same way as the result. Only a stream's head (the bytes the result
keeps from its start) is delivered live; past the cap the stream says it is dropping, and the rest of the
result's text (the omission marker and the tail) follows when the run ends, so that a stream's events,
concatenated, are exactly the result's ``stdout`` or ``stderr``. A backend that does not stream still works:
its whole output is delivered at the end.
"""

from __future__ import annotations

import asyncio
import codecs
import inspect
import re
import threading
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Literal, Protocol, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict

from execbox.secrets.values import Redactor

StreamName = Literal["stdout", "stderr"]
#: A run's streaming callback: ``on_output(stream, data)``, called as output arrives, from any thread.
OnOutput = Callable[[StreamName, bytes], None]

#: A caller's callback for one stream: ``on_stdout(text)``; it may also be a coroutine function.
OnText = Callable[[str], object]

_MARKER = re.compile(r"\n\[\.\.\. execbox: \d+ bytes omitted; output is capped at \d+ bytes \.\.\.\]\n")


class BoundedCapture:
    """Keeps the first and last bytes of a stream, ``cap`` bytes at most, and counts the rest.

    With ``on_output``, every byte written is also passed on, as ``on_output(stream, data)``, before it is
    kept or dropped: the callback (not the capture) decides how much of it a caller sees."""

    def __init__(self, cap: int, on_output: OnOutput | None = None, stream: StreamName = "stdout", *,
                 redactor: Redactor | None = None) -> None:
        self.cap = cap
        self.head_cap = cap - cap // 2
        self.tail_cap = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.on_output = on_output
        self.stream: StreamName = stream
        # A run with declared secrets (its spec's redactor, secrets.values): every byte is redacted before it
        # is streamed or kept, so the cap never keeps half a secret and the omission marker counts the redacted stream.
        self.redactor = redactor.stream() if redactor is not None else None

    def write(self, data: bytes) -> None:
        if self.redactor is not None:
            data = self.redactor.feed(bytes(data))
        self._write(data)

    def _release(self) -> None:
        """Pass on what the redactor still holds back (the run is over, or a gap in the stream follows)."""
        if self.redactor is not None:
            self._write(self.redactor.flush())

    def _write(self, data: bytes) -> None:
        if self.on_output is not None and data:
            self.on_output(self.stream, bytes(data))
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data or not self.tail_cap:
            return
        if len(data) >= self.tail_cap:
            self.tail[:] = data[-self.tail_cap:]
        else:
            self.tail += data
            excess = len(self.tail) - self.tail_cap
            if excess > 0:
                del self.tail[:excess]

    def skip(self, count: int) -> None:
        """``count`` bytes of the stream were dropped before they got here (a sandbox-side capture kept only the
        head and the tail): they count as omitted. Call it between the head and the tail."""
        self._release()
        self.total += max(0, count)

    @property
    def truncated(self) -> bool:
        self._release()
        return self.total > self.cap

    def getvalue(self) -> bytes:
        self._release()
        if not self.truncated:
            return bytes(self.head + self.tail)
        omitted = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... execbox: {omitted} bytes omitted; output is capped at {self.cap} bytes ...]\n".encode()
        return bytes(self.head) + marker + bytes(self.tail)

    def text(self) -> str:
        return self.getvalue().decode("utf-8", errors="replace")


class OutputEvent(BaseModel):
    """A piece of a running command's output, as it arrives (``stream()``, callbacks, ``execbox run --jsonl``).

    ``kind`` "output" carries ``text``; "dropped" says the stream went over the output cap: from here on its
    output is cut from the result's middle, and the result's tail comes when the run ends. A stream's
    "output" texts, concatenated, are exactly the result's ``stdout`` (or ``stderr``)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["output", "dropped"] = "output"
    stream: StreamName
    text: str = ""


class _Stream:
    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.live = 0  # bytes decoded live (at most the head)
        self.chars = 0  # characters delivered
        self.total = 0  # bytes seen
        self.dropped = False


class LiveOutput:
    """Output bytes in, from any thread (``feed``, a run's ``on_output``); ``OutputEvent`` batches out, on the
    event loop that made it (``wait`` then ``take``).

    Bounded like the result: per stream, at most the head (``cap - cap // 2`` bytes) is decoded and queued
    while the run goes on; past ``cap`` a "dropped" event is queued once. ``finish(stdout, stderr)`` queues
    what the result holds beyond what was delivered (for a backend that does not stream: all of it).
    """

    def __init__(self, cap: int | None = None) -> None:
        self._lock = threading.Lock()
        self._events: deque[OutputEvent] = deque()
        self._streams: dict[StreamName, _Stream] = {"stdout": _Stream(), "stderr": _Stream()}
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._closed = False
        self.cap = cap or 0

    def set_cap(self, cap: int) -> None:
        """The run's output cap, once it is resolved (before the run starts)."""
        self.cap = cap

    @property
    def head_cap(self) -> int:
        return self.cap - self.cap // 2

    def feed(self, stream: StreamName, data: bytes) -> None:
        """Take output bytes: thread-safe, never blocks, keeps at most the head per stream."""
        with self._lock:
            if self._closed:
                return
            st = self._streams[stream]
            st.total += len(data)
            room = self.head_cap - st.live
            if room > 0:
                piece = data[:room]
                st.live += len(piece)
                text = st.decoder.decode(piece)
                if text:
                    st.chars += len(text)
                    self._events.append(OutputEvent(stream=stream, text=text))
            if st.total > self.cap and not st.dropped:
                st.dropped = True
                self._events.append(OutputEvent(kind="dropped", stream=stream))
            wake = bool(self._events)
        if wake:
            self._wake()

    def finish(self, stdout: str, stderr: str) -> None:
        """Queue the rest of the result's text after what was delivered live; no ``feed`` counts after this."""
        with self._lock:
            self._closed = True
            pairs: tuple[tuple[StreamName, str], ...] = (("stdout", stdout), ("stderr", stderr))
            for name, text in pairs:
                st = self._streams[name]
                rest = text[st.chars:]
                if not st.dropped and st.live == 0 and _MARKER.search(text):
                    # A backend that did not stream: the result says where the cap cut it.
                    self._events.append(OutputEvent(kind="dropped", stream=name))
                    st.dropped = True
                if rest:
                    st.chars += len(rest)
                    self._events.append(OutputEvent(stream=name, text=rest))
        self._wake()

    def close(self) -> None:
        """Stop taking output (the run is over or abandoned)."""
        with self._lock:
            self._closed = True

    def take(self) -> list[OutputEvent]:
        """The events queued so far, oldest first (call on the event loop)."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
            self._ready.clear()
        return events

    async def wait(self) -> None:
        """Until an event is queued (call on the event loop)."""
        await self._ready.wait()

    def _wake(self) -> None:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._ready.set()
            return
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class _HasOutput(Protocol):
    @property
    def stdout(self) -> str: ...

    @property
    def stderr(self) -> str: ...


R = TypeVar("R", bound=_HasOutput)


async def stream_events(run: Callable[[LiveOutput], Awaitable[R]]) -> AsyncGenerator[OutputEvent | R, None]:
    """Run ``run(live)`` (a run whose spec streams into ``live``) and yield its output events as they come, then
    its result. Leaving the loop early (or cancelling) stops the run: its sandbox is cleaned up as on any
    cancellation."""
    live = LiveOutput()
    task = asyncio.ensure_future(run(live))
    try:
        while True:
            for event in live.take():
                yield event
            if task.done():
                break
            waiter = asyncio.ensure_future(live.wait())
            try:
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        result = task.result()
        live.finish(result.stdout, result.stderr)
        for event in live.take():
            yield event
        yield result
    finally:
        live.close()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: raised above if it mattered


async def deliver(run: Callable[[LiveOutput | None], Awaitable[R]], on_stdout: OnText | None,
                  on_stderr: OnText | None) -> R:
    """``run(None)`` when nobody listens; else stream it, calling ``on_stdout(text)`` / ``on_stderr(text)`` in
    order on the event loop (a coroutine callback is awaited). A callback that raises stops the run, and the
    exception propagates."""
    if on_stdout is None and on_stderr is None:
        return await run(None)
    events = stream_events(run)
    try:
        async for event in events:
            if not isinstance(event, OutputEvent):
                return event
            callback = on_stdout if event.stream == "stdout" else on_stderr
            if event.kind == "output" and callback is not None:
                returned = callback(event.text)
                if inspect.isawaitable(returned):
                    await returned
    finally:
        await events.aclose()
    raise AssertionError("a stream ends with its result")  # pragma: no cover
