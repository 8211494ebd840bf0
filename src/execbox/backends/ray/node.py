"""The node side of the ray backend: one host actor per node, which drives that node's own execbox.

The actor is a plain class here; the driver wraps it with ``ray.remote`` and pins it to its node. It uses execbox
through the public API, as any user's code on that node would (``execbox.AsyncRunner``, imported at run time): the
node's own backend (``auto`` or the one named), its guard, its slots, its output caps and transfer bounds. Its
first check runs the node backend's start-up sweep, so what a host actor that died here (with its node's raylet,
or SIGKILLed) left behind is removed when its successor starts.

Everything that crosses back is plain data: an error is ``("error", fields)``, rebuilt on the driver as the same
execbox error (an exception pickled through Ray may not unpickle, and a node's bug must not pass for a result).
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Concatenate, ParamSpec

from execbox.plugin import ExecboxError

#: Network modes whose verdict a node reports: every mode execbox has.
NETWORK_MODES = ("none", "egress", "proxy", "host")
#: Streamed output is sent at most this often (seconds): fewer, larger objects through the object store.
FLUSH_EVERY_S = 0.05
ABANDONED_KEPT = 4096  # sandbox ids closed before they opened, remembered (a close for an id never opened stays)

Reply = tuple[str, Any]
P = ParamSpec("P")
#: What some errors' constructors set beside the message (BackendUnavailableError, MissingExtraError, the typed
#: file errors): sent along, set again on the driver's copy.
ERROR_ATTRS = ("reason", "fix", "extra", "present", "errno")


def _error(exc: ExecboxError) -> Reply:
    attrs = {name: getattr(exc, name) for name in ERROR_ATTRS if hasattr(exc, name)}
    return "error", {"type": type(exc).__name__, **exc.to_dict(), "attrs": attrs}


async def _reply(work: Awaitable[Any]) -> Reply:
    try:
        return "ok", await work
    except ExecboxError as exc:
        return _error(exc)


def replies(method: Callable[Concatenate[NodeHost, P], Awaitable[Any]]) -> Callable[Concatenate[NodeHost, P],
                                                                                     Awaitable[Reply]]:
    """``("ok", what the method returned)``, or its execbox error as ``("error", fields)``."""
    @functools.wraps(method)
    async def reply(self: NodeHost, /, *args: P.args, **kw: P.kwargs) -> Reply:
        return await _reply(method(self, *args, **kw))
    return reply


class NodeHost:
    """One node's execbox: a runner (its slots) and the sandboxes the driver's sessions are pinned to."""

    def __init__(self, backend: str, slots: int) -> None:
        self._backend_name = backend
        self._slots = slots
        self._runner: Any = None
        self._sandboxes: dict[str, Any] = {}
        self._backend: Any = None
        self._caps: Any = None
        self._opening: set[str] = set()
        # Closed by the driver before their open finished here, or before it began (Ray does not order an async
        # actor's calls): the open closes it. Insertion-ordered, the oldest dropped past ABANDONED_KEPT.
        self._abandoned: dict[str, None] = {}

    async def _ready(self) -> None:
        if self._runner is not None:
            return
        import execbox  # the node's own execbox, as a user's code there would use it

        runner = execbox.AsyncRunner(execbox.Settings.from_env(max_concurrent=self._slots))
        # the first check of this process sweeps what a dead predecessor left (sweeps_on_first_use)
        self._backend, self._caps = await runner.select(self._backend_name, session=True)
        self._runner = runner

    @replies
    async def survey(self) -> dict[str, Any]:
        """What this node runs: its backend, what it enforces, its verdict for each network mode. A survey is an
        adoption: the driver asking knows none of the sandboxes open here (it forgot this node, or never knew it),
        so nothing would ever close them; they are closed now."""
        import ray

        await self._ready()
        self._abandoned.update(dict.fromkeys(self._opening))
        for sid in list(self._sandboxes):
            await self.close(sid)
        context = ray.get_runtime_context()
        verdicts = {}
        for mode in NETWORK_MODES:
            verdict = self._runner.verdict(self._backend, mode)
            verdicts[mode] = (verdict.sandbox, verdict.reason)
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
                "backend": self._backend.name, "capabilities": self._caps.model_dump(mode="json"),
                "verdicts": verdicts, "slots": self._slots, "pid": os.getpid()}

    @replies
    async def open(self, sid: str, network: str, limits: dict[str, Any], lifetime_s: float) -> str:
        return await self._open(sid, network, limits, lifetime_s)

    async def _open(self, sid: str, network: str, limits: dict[str, Any], lifetime_s: float) -> str:
        import execbox

        if sid in self._abandoned:
            del self._abandoned[sid]
            raise execbox.SandboxError(f"sandbox {sid} was closed by the driver before it opened")
        self._opening.add(sid)
        await self._ready()
        # The driver resolved every limit; those this node cannot enforce were not demanded (the driver's guard
        # refused a demand that not every node enforces), so they stay defaults here, as they do locally.
        enforced = {"memory": "memory_mb", "cpu": "cpus", "pids": "pids", "disk": "disk_mb"}
        kept = {field: limits[field] for name, field in enforced.items()
                if name in self._caps.limits and limits.get(field) is not None}
        sandbox = self._runner.sandbox(self._backend.name, network=network, limits=execbox.Limits(**kept),
                                       lifetime_s=lifetime_s)
        try:
            await sandbox.__aenter__()
            if sid in self._abandoned:  # the driver gave up on this open while it ran: nothing else would close it
                await sandbox.close()
                raise execbox.SandboxError(f"sandbox {sid} was closed by the driver while it opened")
        finally:
            self._opening.discard(sid)
            self._abandoned.pop(sid, None)
        self._sandboxes[sid] = sandbox
        return str(sandbox.workspace)

    def _sandbox(self, sid: str) -> Any:
        sandbox = self._sandboxes.get(sid)
        if sandbox is None:
            import execbox

            raise execbox.SandboxError(f"no sandbox {sid} on this node (closed already, or its host actor restarted)")
        return sandbox

    @replies
    async def run(self, sid: str, opening: tuple[str, dict[str, Any], float] | None, files: list[tuple[str, bytes]],
                  command: dict[str, Any]) -> dict[str, Any]:
        """Open the sandbox first when ``opening`` (a one-shot: one call), place ``files``, run ``command``."""
        return await self._run(sid, opening, files, command, None)

    async def run_streaming(self, sid: str, opening: tuple[str, dict[str, Any], float] | None,
                            files: list[tuple[str, bytes]], command: dict[str, Any]) -> AsyncIterator[Reply]:
        """``run``, yielding ("out", [(stream, text), ...]) as the output arrives (the node's own cap bounds it),
        then the reply."""
        import anyio

        chunks: list[tuple[str, str]] = []
        more = anyio.Event()
        done: list[Reply] = []

        def take(stream: str) -> Any:
            def feed(text: str) -> None:
                chunks.append((stream, text))
                more.set()
            return feed

        async def work() -> None:
            done.append(await _reply(self._run(sid, opening, files, command, (take("stdout"), take("stderr")))))
            more.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(work)
            while not done:
                await more.wait()
                more = anyio.Event()
                await anyio.sleep(FLUSH_EVERY_S)
                if chunks:
                    batch, chunks[:] = list(chunks), []
                    yield "out", batch
        if chunks:
            yield "out", list(chunks)
        yield done[0]

    async def _run(self, sid: str, opening: tuple[str, dict[str, Any], float] | None, files: list[tuple[str, bytes]],
                   command: dict[str, Any], feeds: tuple[Any, Any] | None) -> dict[str, Any]:
        workspace = await self._open(sid, *opening) if opening is not None else None
        sandbox = self._sandbox(sid)
        if workspace is not None and workspace != command["workspace"]:
            import execbox

            # the driver planned the command for the workspace this node's sandboxes had so far
            raise execbox.SandboxError(f"this node's sandbox has its workspace at {workspace}, not at "
                                       f"{command['workspace']} as its earlier ones: the command was planned for that")
        for path, data in files:
            await sandbox.write_file(path, data)
        on_stdout, on_stderr = feeds or (None, None)
        result = await sandbox.exec(command["argv"], env=command["env"], stdin=command["stdin"],
                                    timeout=command["timeout"], max_output_bytes=command["max_output_bytes"],
                                    on_stdout=on_stdout, on_stderr=on_stderr)
        fields: dict[str, Any] = result.model_dump(
            mode="python", include={"exit_code", "stdout", "stderr", "timed_out", "truncated", "oom_killed",
                                    "duration_s", "notes", "egress", "limit"})
        fields["workspace"] = workspace
        return fields

    @replies
    async def write_file(self, sid: str, path: str, data: bytes) -> None:
        await self._sandbox(sid).write_file(path, data)

    @replies
    async def read_file(self, sid: str, path: str, max_bytes: int) -> bytes:
        data: bytes = await self._sandbox(sid).read_file(path, max_bytes=max_bytes)
        return data

    @replies
    async def list_files(self, sid: str, path: str, recursive: bool) -> list[dict[str, Any]]:
        found = await self._sandbox(sid).list_files(path or ".", recursive=recursive)
        return [info.model_dump(mode="json") for info in found]

    @replies
    async def close(self, sid: str) -> None:
        sandbox = self._sandboxes.pop(sid, None)
        if sandbox is None:  # given up on while it opens, or before its open began: that open closes it
            self._abandoned[sid] = None
            while len(self._abandoned) > ABANDONED_KEPT:
                del self._abandoned[next(iter(self._abandoned))]
            return
        await sandbox.close()

    async def live(self) -> int:
        """How many sandboxes are open on this node (tests: nothing left after the sessions closed)."""
        return len(self._sandboxes)
