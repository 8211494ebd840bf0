"""local_subprocess: the command runs as a plain child process of the host user. Not a sandbox.

It gets a fresh temporary workspace, a minimal environment, rlimits (CPU time, address space, file size,
no core dumps) and the timeout and output rules; its whole process tree dies at the deadline. It can read
whatever the host user can read and it shares the host's network, so the guard refuses it unless
CODE_EXEC_LOCAL=true, and it can only honour network mode 'host'.
"""

from __future__ import annotations

import math
import tempfile

import anyio

from execbox.core.backend import ExecutionBackend, Session, SessionSpec
from execbox.core.envpolicy import sandbox_env
from execbox.core.models import Capabilities, ExecRequest, ExecResult
from execbox.core.procs import reaped, run_process
from execbox.core.workspace import remove_tree, safe_read, safe_write

FILE_SIZE_LIMIT = 1 << 30  # no single file over 1 GiB: a runaway writer cannot fill the disk


class LocalSession(Session):
    """A temporary host directory as the workspace, and each command a reaped child process. Backends that
    only put a launcher in front of the command (see examples/execbox-unshare) subclass it and override
    ``launcher``."""

    def __init__(self, prefix: str = "execbox-local-") -> None:
        self.workspace = tempfile.mkdtemp(prefix=prefix)

    def launcher(self, argv: list[str]) -> list[str]:
        """The command line that runs ``argv``; here, ``argv`` itself."""
        return argv

    async def exec(self, request: ExecRequest) -> ExecResult:
        assert request.argv and request.timeout and request.max_output_bytes and request.limits
        rlimits = {
            # CPU seconds: a busy loop dies even if the wall-clock kill were to fail.
            "RLIMIT_CPU": math.ceil(request.timeout) + 1,
            "RLIMIT_FSIZE": FILE_SIZE_LIMIT,
            "RLIMIT_CORE": 0,
        }
        if request.limits.memory_mb:
            rlimits["RLIMIT_AS"] = request.limits.memory_mb * 1024 * 1024
        outcome = await run_process(
            reaped(self.launcher(request.argv), rlimits=rlimits),
            env=sandbox_env(request.env, home=self.workspace),
            cwd=request.workdir or self.workspace,
            stdin=request.stdin,
            timeout=request.timeout,
            max_output_bytes=request.max_output_bytes,
        )
        return outcome.to_result()

    async def write_file(self, path: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(safe_write, self.workspace, path, data)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        return await anyio.to_thread.run_sync(lambda: safe_read(self.workspace, path, max_bytes=max_bytes))

    async def close(self) -> None:
        await anyio.to_thread.run_sync(remove_tree, self.workspace)


class LocalSubprocessBackend(ExecutionBackend):
    name = "local_subprocess"
    summary = "a child process of the host user, with rlimits; not a sandbox (local mode only)"
    capabilities = Capabilities(
        sandbox=False,
        isolation="process",
        network_modes=frozenset({"host"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "wall_time"}),
    )

    async def open_session(self, spec: SessionSpec) -> LocalSession:
        return LocalSession()
