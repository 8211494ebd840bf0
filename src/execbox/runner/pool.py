"""A warm pool: sandboxes started ahead of time, never used, each handed out once and destroyed after its run.

One queue per configuration (backend instance — so its image and options —, network mode and limits). A member
is an ordinary session opened with the same SessionSpec contract as any other sandbox, so it carries the same
hardening, labels and lifetime backstop; gc and the orphan sweep know it like any session, and a member whose
owner dies is removed by its backend's lifetime backstop. A member older than the pool's TTL is closed, never
handed out. Refills and the removal of used members run in the runner's background task group, so a run pays
neither the start nor the removal of its sandbox.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from execbox.contract.backend import ExecutionBackend, Session, SessionSpec, bounded, close_bounded
from execbox.runner import live
from execbox.telemetry import sandbox_opened, watch_pool

PoolKey = tuple[int, str, Hashable]
#: Records a pool event in the audit log: ("sandbox.open" | "sandbox.close", fields).
Recorder = Callable[[str, dict[str, Any]], Awaitable[object]]


class WarmPool:
    def __init__(self, size: int, ttl_s: float, record: Recorder | None = None, *,
                 longest_run_s: float = 3600.0) -> None:
        self.size = size
        self.ttl_s = ttl_s
        #: The longest run a member may serve (the maximum timeout, and a margin for removal).
        self.longest_run_s = longest_run_s
        self._record = record
        self._ids: dict[int, str] = {}  # id(session) -> the member's id in the audit log
        self._backends: dict[int, ExecutionBackend] = {}  # id(session) -> the backend that opened it
        self._members: dict[PoolKey, deque[tuple[float, Session]]] = {}
        self._filling: dict[PoolKey, int] = {}
        self._tasks: TaskGroup | None = None
        #: The last failure of a background refill per backend name (cleared by a success): a run that found no
        #: member says it on its result.
        self.errors: dict[str, str] = {}
        watch_pool(self)  # its depth is a gauge (execbox.pool.depth) while it lives

    @staticmethod
    def key(backend: ExecutionBackend, spec: SessionSpec) -> PoolKey:
        return (id(backend), spec.network, spec.limits)

    def member_spec(self, spec: SessionSpec) -> SessionSpec:
        # A member is opened as a session, whose exec costs least on docker and bubblewrap (measured: docker's
        # one-shot waits for its container's exit, a session's armed first exec only for its process). It waits up to
        # the TTL, then serves any one run: the longest allowed, whoever asked for the refill (members of one
        # configuration serve runs of any timeout).
        return SessionSpec(spec.network, spec.limits, False, self.ttl_s + max(self.longest_run_s, spec.lifetime_s))

    def attach(self, tasks: TaskGroup) -> None:
        self._tasks = tasks

    @property
    def active(self) -> bool:
        return self.size > 0 and self._tasks is not None

    def take(self, backend: ExecutionBackend, spec: SessionSpec) -> Session | None:
        """A started, never-used member for this configuration, or None; either way a refill is scheduled."""
        if not self.active or self._tasks is None:
            return None
        key = self.key(backend, spec)
        queue = self._members.setdefault(key, deque())
        now = time.monotonic()
        taken: Session | None = None
        while queue:
            started, session = queue.popleft()
            if now - started < self.ttl_s and not live.killed(self._ids[id(session)]):
                taken = session
                live.closed(self._ids[id(session)])  # a one-shot's sandbox from now on: listed as that
                break
            self._tasks.start_soon(self._close, session)  # expired, or killed (`execbox kill`): never handed out
        self.refill(backend, spec)
        return taken

    def refill(self, backend: ExecutionBackend, spec: SessionSpec) -> None:
        if not self.active:
            return
        assert self._tasks is not None
        key = self.key(backend, spec)
        missing = self.size - len(self._members.get(key, ())) - self._filling.get(key, 0)
        for _ in range(max(missing, 0)):
            self._filling[key] = self._filling.get(key, 0) + 1
            self._tasks.start_soon(self._open_one, backend, spec, key)

    async def _open_one(self, backend: ExecutionBackend, spec: SessionSpec, key: PoolKey) -> None:
        member = self.member_spec(spec)
        opening = backend.shared.open_timeout_sec  # the runner's bounds: a backend that never returns is given up on
        try:
            session = await bounded(backend.open_session(member), opening, backend=backend, doing="open_session",
                                    late=lambda late: close_bounded(late, backend))
            try:
                await bounded(session.arm(), opening, backend=backend, doing="arm", session=session)
            except BaseException:
                await close_bounded(session, backend)
                raise
        except Exception as exc:  # a background refill must not kill the runner; the next run opens its own
            self.errors[backend.name] = f"{type(exc).__name__}: {exc}"
            return
        finally:
            self._filling[key] -= 1
        self.errors.pop(backend.name, None)
        self._ids[id(session)] = f"pool-{uuid.uuid4().hex[:16]}"
        self._backends[id(session)] = backend
        sandbox_opened(backend.name)
        live.opened(self._ids[id(session)], backend.name, session, member, pooled=True)
        if self._record is not None:
            await self._record("sandbox.open", {"session": self._ids[id(session)], "backend": backend.name,
                                                "pooled": True, "network": member.network,
                                                "limits": member.limits.model_dump(exclude_none=True),
                                                "lifetime_s": member.lifetime_s})
        if self._tasks is None:  # the runner closed while this member started
            await self._close(session)
            return
        self._members.setdefault(key, deque()).append((time.monotonic(), session))

    async def discard(self, session: Session) -> None:
        """Destroy a used member: in the background, or now if the pool closed while it ran."""
        if self._tasks is None:
            await self._close(session)
        else:
            self._tasks.start_soon(self._close, session)

    async def _close(self, session: Session) -> None:
        backend = self._backends.pop(id(session))
        with anyio.CancelScope(shield=True):
            try:
                await close_bounded(session, backend)
            except Exception as exc:  # a removal in the background must not end the runner's task group
                self.errors[backend.name] = f"removing a member: {type(exc).__name__}: {exc}"
            sandbox_opened(backend.name, -1)
            member = self._ids.pop(id(session), None)
            if member is not None:
                live.closed(member)
            if self._record is not None and member is not None:
                await self._record("sandbox.close", {"session": member, "pooled": True})

    def ready(self, backend: ExecutionBackend, spec: SessionSpec) -> int:
        return len(self._members.get(self.key(backend, spec), ()))

    def depths(self) -> list[tuple[str, int]]:
        """The members ready, per configuration, by the name of its backend."""
        return [(self._backends[id(queue[0][1])].name, len(queue)) for queue in self._members.values() if queue]

    def count(self) -> int:
        return sum(len(q) for q in self._members.values())

    async def aclose(self) -> None:
        """Close every idle member; refills still starting close themselves when they finish."""
        self._tasks = None
        members = [session for queue in self._members.values() for _, session in queue]
        self._members.clear()
        for session in members:
            await self._close(session)
