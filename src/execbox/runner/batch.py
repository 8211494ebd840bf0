"""Many one-shots as one batch: ``runner.map(items)`` runs each item in its own fresh sandbox, at most
``concurrency`` at a time (through the runner's slots and warm pool, like any one-shot), and hands back one
``BatchItem`` per item, in input order or as they complete. One item's failure, timeout, refusal or runaway output
is that item's outcome; it never stops the batch. Closing the batch (or Ctrl-C) cancels what still runs, and each
cancelled run removes its sandbox as a cancelled one-shot always does."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import anyio

from execbox.contract.models import ExecRequest, ExecResult
from execbox.errors import BackendTimeoutError, ConfigError, ExecboxError, RefusedError, SandboxError
from execbox.runner.pipeline import request_from
from execbox.runner.scheduler import Slots

T = TypeVar("T")
#: An item of a batch: Python code (a str), a command (a sequence of str: argv), a full request, or a mapping of
#: ExecRequest's fields (a line of `execbox batch`'s input); an ExecboxError is an item that could not even be read
#: (a line that is not JSON), reported as that item's error.
Item = str | Sequence[str] | ExecRequest | Mapping[str, Any] | ExecboxError
Outcome = Literal["passed", "failed", "timed_out", "refused", "error"]
OUTCOMES: tuple[Outcome, ...] = ("passed", "failed", "timed_out", "refused", "error")
#: In input order, finished items wait for the earliest unfinished one; at most this many concurrencies' worth of
#: them are held (no new item starts past that), so a slow first item does not grow the batch's memory without end.
ORDERED_WINDOW = 4


@dataclass(frozen=True)
class BatchItem:
    """One item's outcome: its ``result``, or the ``error`` that kept it from one (a refusal, a bad request, a
    backend that never answered)."""

    index: int
    result: ExecResult | None = None
    error: ExecboxError | None = None
    #: Seconds from the item's start (a slot free for it) to its outcome: sandbox start, run and clean-up.
    elapsed_s: float = 0.0

    @property
    def outcome(self) -> Outcome:
        if self.error is not None:
            if isinstance(self.error, RefusedError):
                return "refused"
            return "timed_out" if isinstance(self.error, BackendTimeoutError) else "error"
        assert self.result is not None
        if self.result.timed_out:
            return "timed_out"
        return "passed" if self.result.ok else "failed"

    @property
    def ok(self) -> bool:
        return self.outcome == "passed"

    def to_dict(self) -> dict[str, Any]:
        """The JSON line `execbox batch` prints: the result as `execbox run --json` prints it, or {"error": ...}."""
        body = self.result.model_dump(mode="json") if self.result is not None else {
            "error": self.error.to_dict() if self.error is not None else None}
        return {"index": self.index, **body}


@dataclass
class BatchSummary:
    """How a batch went so far: items per outcome, wall time, and each item's time from its start to its outcome
    (p50 / p99; BatchItem.elapsed_s)."""

    counts: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    durations: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def add(self, item: BatchItem) -> None:
        self.counts[item.outcome] += 1
        self.durations.append(item.elapsed_s)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def wall_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def percentile(self, q: float) -> float | None:
        """The item time (seconds) below which ``q`` of the items fall; None before any."""
        return percentile(self.durations, q) if self.durations else None

    def __str__(self) -> str:
        rate = self.total / self.wall_s if self.wall_s > 0 else 0.0
        words = {"timed_out": "timed out", "error": "with an error"}
        parts = ", ".join(f"{n} {words.get(outcome, outcome)}" for outcome, n in self.counts.items())
        p50, p99 = self.percentile(0.5), self.percentile(0.99)
        timing = f"; per item p50 {p50:.3f} s, p99 {p99:.3f} s" if p50 is not None and p99 is not None else ""
        return f"{self.total} items in {self.wall_s:.1f} s ({rate:.1f}/s): {parts}{timing}"


def percentile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank percentile: the smallest sample with at least ``q`` of them at or below it (the bench's
    p99 too). ``samples`` must not be empty."""
    ranked = sorted(samples)
    return ranked[max(0, math.ceil(q * len(ranked)) - 1)]


def as_request(item: Item) -> ExecRequest:
    """An item as the request it stands for; anything else is a ConfigError (that item's error, not the batch's)."""
    if isinstance(item, ExecRequest):
        return item
    if isinstance(item, ExecboxError):
        raise item
    if isinstance(item, str):
        return request_from({"code": item})
    if isinstance(item, Mapping):
        return request_from(item)
    if isinstance(item, Sequence) and not isinstance(item, bytes) and all(isinstance(w, str) for w in item):
        return request_from({"argv": list(item)})
    raise ConfigError(f"invalid batch item: a {type(item).__name__}; give code (str), a command (list of str), an "
                      "ExecRequest or a mapping of its fields")


class Progress:
    """A progress bar on the caller's terminal (tqdm, on stderr), with the summary when the batch ends."""

    def __init__(self, total: int | None) -> None:
        from tqdm import tqdm  # only a batch that shows progress pays for the import

        self._bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)

    def update(self, summary: BatchSummary) -> None:
        self._bar.set_postfix_str(f"{summary.counts['passed']} passed, {summary.total - summary.counts['passed']} "
                                  "not", refresh=False)
        self._bar.update(1)

    def close(self, summary: BatchSummary) -> None:
        self._bar.close()
        print(f"execbox batch: {summary}", file=sys.stderr)


class BatchHost(Protocol):
    """What a batch needs of its runner (AsyncRunner): the slots that cap its concurrency, and one-shots."""

    slots: Slots

    async def execute(self, request: ExecRequest, *, backend: str | None = None) -> ExecResult: ...


class AsyncBatch:
    """The async iterator ``AsyncRunner.map`` returns: ``async with runner.map(items) as batch: async for item in
    batch``. The items run in a task of the batch's own; leaving the ``async with`` (or ``aclose``) cancels what
    still runs and waits for their sandboxes to be gone. ``summary`` is kept up to date as items finish."""

    def __init__(self, runner: BatchHost, items: Iterable[Item] | AsyncIterable[Item], *,
                 concurrency: int | None = None, ordered: bool = True, progress: bool | None = None,
                 backend: str | None = None) -> None:
        slots = runner.slots.total
        if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                        or not 0 < concurrency <= slots):
            raise ConfigError(f"concurrency={concurrency!r}: give a whole number from 1 to {slots}, the runner's "
                              "sandbox slots (raise CODE_EXEC_MAX_CONCURRENT for more)",
                              env_var="CODE_EXEC_MAX_CONCURRENT")
        self._runner = runner
        self._items = items
        self._concurrency = concurrency or slots
        self._ordered = ordered
        self._backend = backend
        total = len(items) if isinstance(items, Sequence) else None
        self._progress = Progress(total) if (sys.stderr.isatty() if progress is None else progress) else None
        self.summary = BatchSummary()
        self._send, self._receive = anyio.create_memory_object_stream[BatchItem](self._concurrency)
        self._driver: asyncio.Task[None] | None = None
        self._closed = False
        self._failure: Exception | None = None

    async def __aenter__(self) -> AsyncBatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncBatch:
        return self

    async def __anext__(self) -> BatchItem:
        if self._driver is None and not self._closed:
            self.summary = BatchSummary()
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            if self._failure is not None:  # the items' own iterator raised: the caller's error, as it was
                raise self._failure from None
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Stop: what has not started never starts, what runs is cancelled, and this returns once it is gone."""
        self._closed = True
        self._receive.close()
        driver = self._driver
        if driver is not None and not driver.done():
            driver.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([driver])

    async def _drive(self) -> None:
        running = anyio.Semaphore(self._concurrency)
        # Started but not yet handed over; in input order finished items may wait for an earlier one.
        window = anyio.Semaphore(self._concurrency * (ORDERED_WINDOW if self._ordered else 1))
        finished: dict[int, BatchItem] = {}
        handing = anyio.Lock()
        next_out = 0

        async def one(index: int, item: Item) -> None:
            nonlocal next_out
            async with running:
                started = time.monotonic()
                try:
                    result = await self._runner.execute(as_request(item), backend=self._backend)
                    done = BatchItem(index, result=result, elapsed_s=time.monotonic() - started)
                except ExecboxError as exc:
                    done = BatchItem(index, error=exc, elapsed_s=time.monotonic() - started)
                except Exception as exc:  # noqa: BLE001 - a bug under one item is that item's error, not the batch's
                    failed = SandboxError(f"the item failed with {type(exc).__name__}: {str(exc)[:2000]}")
                    done = BatchItem(index, error=failed, elapsed_s=time.monotonic() - started)
            self.summary.add(done)
            if self._progress is not None:
                self._progress.update(self.summary)
            async with handing:  # in input order: hand over every finished item the earliest one was holding up
                finished[index] = done
                while (ready := finished.pop(next_out if self._ordered else index, None)) is not None:
                    await self._send.send(ready)
                    window.release()
                    next_out += 1

        try:
            async with self._send, anyio.create_task_group() as tasks:
                try:
                    async for index, item in _numbered(self._items):
                        await window.acquire()
                        tasks.start_soon(one, index, item)
                except Exception as exc:  # noqa: BLE001 - the caller's iterator: raised to them after what started
                    self._failure = exc
        finally:
            self.summary.ended = time.monotonic()
            if self._progress is not None:
                self._progress.close(self.summary)


async def _numbered(items: Iterable[Item] | AsyncIterable[Item]) -> AsyncIterator[tuple[int, Item]]:
    """The items with their index; a lazy iterator (a file, a generator) is read in a worker thread, so a slow
    producer never stalls the runs in flight."""
    if isinstance(items, AsyncIterable):
        index = 0
        async for item in items:
            yield index, item
            index += 1
    elif isinstance(items, Sequence):
        for index, item in enumerate(items):
            yield index, item
    else:
        iterator = iter(items)

        index = 0
        while next_one := await anyio.to_thread.run_sync(list, itertools.islice(iterator, 1)):  # [] at the end
            yield index, next_one[0]
            index += 1


class Batch:
    """The sync iterator ``Runner.map`` returns (see AsyncBatch): ``for item in runner.map(items)``; ``with``, or
    ``close()``, or Ctrl-C while it runs, stops it and leaves nothing behind."""

    def __init__(self, inner: AsyncBatch, call: Callable[[Callable[[], Awaitable[Any]]], Any]) -> None:
        self._inner = inner
        self._call = call

    @property
    def summary(self) -> BatchSummary:
        return self._inner.summary

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[BatchItem]:
        return self

    def __next__(self) -> BatchItem:
        try:
            item: BatchItem = self._call(self._inner.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None
        except BaseException:  # Ctrl-C (KeyboardInterrupt) included: nothing of the batch runs on
            self.close()
            raise
        return item

    def close(self) -> None:
        self._call(self._inner.aclose)
