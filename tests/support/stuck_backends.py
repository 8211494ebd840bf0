"""Backends that never return from one call, built from the public plugin kit only (``execbox.plugin``).

Each is an ordinary local session (``HostWorkspaceSession``) with one call stuck:

    stuck_exec     exec blocks in a worker thread that cancellation cannot reach (no abandon_on_cancel)
    stuck_open     open_session never returns
    stuck_probe    probe (the availability check behind check()) never returns
    stuck_gc       gc never returns
    stuck_aclose   aclose (the release of what the instance holds, when the runner closes) never returns
    stuck_files    write_file, read_file and list_files never return
    stuck_close    close removes the workspace, then never returns
    slow_open      open_session takes 3 s, deaf to cancellation, then returns its session (kept in OPENED)
    dataclass_ok   an honest backend whose session is a dataclass (so, unhashable): nothing stuck
    pipe_holder    exec reads the command's stdout to its end, ignoring the deadline: a real setsid grandchild
                   that keeps the pipe open (``sleep`` behind ``setsid``) keeps it from ever returning
    counting       an honest backend that takes mounts and counts the sandboxes it opens (OPENS): nothing stuck
    counting_remote  the same, claiming to be a provider's sandbox (remote) that offers network mode proxy
    own_thread     an honest backend that runs the command and builds its captures in a thread of its own (not
                   anyio's): nothing of the caller's context reaches them, only the spec
    stuck_snapshot claims snapshot; Session.snapshot never returns, delete_snapshot counts its calls (DELETED)

The threads they block in end when ``RELEASE`` is set (each test's teardown), so a test's event loop can close.
They are NOT sandboxes: never use them outside these tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import anyio

from execbox import plugin

DISTRIBUTION = "execbox-test-stuck"
CLAIMS = plugin.Capabilities(sandbox=True, isolation="namespace", network_modes=frozenset({"none"}),
                             persistent_sessions=True, file_transfer=True, limits=frozenset({"wall_time"}))
#: What every stuck call waits for: set by the tests when they end.
RELEASE = threading.Event()


async def stuck() -> NoReturn:
    """Never returns until RELEASE: blocked in a thread, deaf to cancellation like a backend's blocking SDK call."""
    await anyio.to_thread.run_sync(RELEASE.wait)
    raise plugin.SandboxError("released")


class Session(plugin.HostWorkspaceSession):
    pass


class StuckBackend(plugin.ExecutionBackend):
    capabilities = CLAIMS
    session: type[Session] = Session

    async def open_session(self, spec: plugin.SessionSpec) -> plugin.Session:
        return self.session(prefix="execbox-stuck-")


class ExecSession(Session):
    async def exec(self, request: plugin.ExecSpec) -> plugin.ExecResult:
        await stuck()


class StuckExec(StuckBackend):
    name = "stuck_exec"
    session = ExecSession


class StuckOpen(StuckBackend):
    name = "stuck_open"

    async def open_session(self, spec: plugin.SessionSpec) -> plugin.Session:
        await stuck()


class StuckProbe(StuckBackend):
    name = "stuck_probe"

    async def probe(self) -> plugin.Capabilities:
        await stuck()


class StuckGc(StuckBackend):
    name = "stuck_gc"

    async def gc(self) -> list[str]:
        await stuck()


class StuckAclose(StuckBackend):
    name = "stuck_aclose"

    async def aclose(self) -> None:
        await stuck()


#: The sessions slow_open opened, late.
OPENED: list[Session] = []


class SlowOpen(StuckBackend):
    name = "slow_open"

    async def open_session(self, spec: plugin.SessionSpec) -> plugin.Session:
        started = asyncio.get_running_loop().run_in_executor(None, RELEASE.wait, 3.0)
        while not started.done():  # deaf to cancellation, however often it comes: it opens all the same
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(started)
        OPENED.append(Session(prefix="execbox-stuck-"))
        return OPENED[-1]


class FilesSession(Session):
    async def write_file(self, path: str, data: bytes) -> None:
        await stuck()

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        await stuck()

    async def list_files(self, path: str, *, recursive: bool, limits: plugin.TransferLimits) -> list[plugin.FileInfo]:
        await stuck()


class StuckFiles(StuckBackend):
    name = "stuck_files"
    session = FilesSession


class CloseSession(Session):
    async def close(self) -> None:
        await super().close()
        await stuck()


class StuckClose(StuckBackend):
    name = "stuck_close"
    session = CloseSession


class PipeSession(Session):
    async def exec(self, request: plugin.ExecSpec) -> plugin.ExecResult:
        # Deliberately wrong: waits for the end of the output instead of the deadline.
        with subprocess.Popen(request.argv, cwd=request.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL) as proc:
            out, err = await anyio.to_thread.run_sync(proc.communicate)
        return plugin.ExecResult(exit_code=proc.returncode, stdout=out.decode(), stderr=err.decode())


@dataclasses.dataclass
class DataSession(plugin.Session):
    workspace: str = ""

    def __post_init__(self) -> None:
        self.inner = plugin.HostWorkspaceSession(prefix="execbox-stuck-")
        self.workspace = self.inner.workspace

    async def exec(self, request: plugin.ExecSpec) -> plugin.ExecResult:
        return await self.inner.exec(request)

    async def write_file(self, path: str, data: bytes) -> None:
        await self.inner.write_file(path, data)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        return await self.inner.read_file(path, max_bytes)

    async def close(self) -> None:
        await self.inner.close()


class DataclassOk(StuckBackend):
    name = "dataclass_ok"

    async def open_session(self, spec: plugin.SessionSpec) -> plugin.Session:
        return DataSession()


class PipeHolder(StuckBackend):
    name = "pipe_holder"
    session = PipeSession


#: The names of the counting backends, once per sandbox they opened.
OPENS: list[str] = []


class Counting(StuckBackend):
    name = "counting"
    capabilities = CLAIMS.model_copy(update={"mounts": True, "tmpfs": True})

    async def open_session(self, spec: plugin.SessionSpec) -> plugin.Session:
        OPENS.append(self.name)
        return await super().open_session(spec)


class CountingRemote(Counting):
    name = "counting_remote"
    capabilities = CLAIMS.model_copy(update={"remote": True, "network_modes": frozenset({"none", "proxy"})})


class ThreadSession(Session):
    async def exec(self, request: plugin.ExecSpec) -> plugin.ExecResult:
        done: list[plugin.ExecResult] = []

        def run() -> None:
            out, err = request.captures()
            proc = subprocess.run(request.argv, cwd=request.workdir, input=request.stdin, capture_output=True,
                                  env={"PATH": "/usr/bin:/bin", **request.env}, timeout=request.timeout, check=False)
            out.write(proc.stdout)
            err.write(proc.stderr)
            done.append(plugin.build_result(exit_code=proc.returncode, stdout=out, stderr=err, timed_out=False,
                                            duration_s=0.0))

        thread = threading.Thread(target=run)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        return done[0]


class OwnThread(StuckBackend):
    name = "own_thread"
    session = ThreadSession


#: The snapshot ids stuck_snapshot was asked to remove.
DELETED: list[str] = []


class SnapshotSession(Session):
    async def snapshot(self, place: plugin.SnapshotPlace, *, memory: bool) -> plugin.SnapshotParts:
        await stuck()


class StuckSnapshot(StuckBackend):
    name = "stuck_snapshot"
    capabilities = CLAIMS.model_copy(update={"snapshot": True})
    session = SnapshotSession

    async def delete_snapshot(self, place: plugin.SnapshotPlace, parts: plugin.SnapshotParts) -> None:
        DELETED.append(place.id)


BACKENDS = (StuckExec, StuckOpen, StuckProbe, StuckGc, StuckAclose, SlowOpen, StuckFiles, StuckClose, DataclassOk,
            PipeHolder, Counting, CountingRemote, OwnThread, StuckSnapshot)


@plugin.hookimpl
def execbox_register_backends(register: Callable[[type], None]) -> None:
    for cls in BACKENDS:
        register(cls)


def site(root: Path) -> Path:
    """A directory for another process's PYTHONPATH in which this plugin is an installed distribution."""
    info = root / "site" / f"{DISTRIBUTION.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[execbox]\nstuck = {__name__}\n")
    return info.parent
