"""A session whose workspace is a directory on this host and whose commands are local processes.

``HostWorkspaceSession`` is the base of every backend whose sandbox is a launcher in front of a local
command (local_subprocess; the example plugin's ``unshare``): a private temporary workspace, the
symlink-safe, size-capped file access of ``files.workspace``, rlimits, the timeout and output rules of
``kit.processes`` (the whole process tree dies at the deadline), close-once and removal that survives any
tree the code built. A subclass overrides ``launcher`` only.

The request's environment reaches the command and nothing before it: the reaper and the launcher (which
may run as root, like ``unshare``) start with ``host_env()``, and the command's variables are applied by
the last step the launcher starts (``CommandEnv.exec_step``), after every namespace and privilege change
the launcher makes. A launcher only has to keep inherited descriptors open and run the argv it is given.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import IO

import anyio

from execbox.contract.backend import Session
from execbox.contract.models import ExecResult, ExecSpec
from execbox.errors import SandboxError
from execbox.files.transfer import FileInfo, Transfer, TransferLimits
from execbox.files.workspace import remove_tree, safe_read, safe_write
from execbox.kit.ownership import OWNER_FILE, owner_id, owner_tag, remove_orphaned_dirs
from execbox.kit.processes import CommandEnv, reaped, run_process
from execbox.policy.env import sandbox_env

FILE_SIZE_LIMIT = 1 << 30  # no single file over 1 GiB: a runaway writer cannot fill the disk


class HostWorkspaceSession(Session):
    """A temporary host directory as the workspace, and each command a reaped child process.

    The workspace is ``workspace/`` in a directory named ``PREFIX + owner_tag() + "-" + random`` that holds an
    OWNER_FILE: when the owner dies without closing (a SIGKILL), ``sweep_orphaned_workspaces(PREFIX)`` in the
    backend's ``gc`` removes it (set ``sweeps_on_first_use`` and the next process does it by itself)."""

    def __init__(self, prefix: str = "execbox-local-", workspace: str | None = None) -> None:
        # ``workspace``: a directory the subclass made (close removes it as is); else a new one, named for gc.
        self.root: str | None = None
        if workspace is None:
            self.root = tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-")
            try:
                os.chmod(self.root, 0o711)  # a launcher that drops to another uid reaches the workspace, lists nothing
                safe_write(self.root, OWNER_FILE, (owner_id() + "\n").encode(), mode=0o600)
                workspace = os.path.join(self.root, "workspace")
                os.mkdir(workspace, 0o700)
            except BaseException:
                remove_tree(self.root)
                raise
        self.workspace = workspace
        self.host_workspace = self.workspace  # the sandbox sees the host directory itself
        self._closed = False

    def launcher(self, argv: list[str]) -> list[str]:
        """The command line that runs ``argv``; here, ``argv`` itself.

        ``argv`` is the command behind the step that gives it its environment: run it as given, and keep
        inherited file descriptors open (a launcher that closes them makes every run fail, exit 126)."""
        return argv

    def _live(self) -> None:
        if self._closed:
            raise SandboxError("this session is closed; open a new sandbox")

    async def exec(self, request: ExecSpec) -> ExecResult:
        self._live()
        rlimits = {
            # CPU seconds: a busy loop dies even if the wall-clock kill were to fail.
            "RLIMIT_CPU": math.ceil(request.timeout) + 1,
            "RLIMIT_FSIZE": FILE_SIZE_LIMIT,
            "RLIMIT_CORE": 0,
        }
        if request.limits.memory_mb:
            rlimits["RLIMIT_AS"] = request.limits.memory_mb * 1024 * 1024
        with CommandEnv(sandbox_env(request.env, home=self.workspace)) as command_env:
            inner = command_env.exec_step(request.argv)
            launched = self.launcher(inner)
            # No launcher: the reaper's own exec is the command's, and it applies the environment there.
            argv = reaped(request.argv, rlimits=rlimits, command_env=command_env) if launched == inner else \
                reaped(launched, rlimits=rlimits)
            outcome = await run_process(
                argv,
                cwd=request.workdir,
                stdin=request.stdin,
                timeout=request.timeout,
                max_output_bytes=request.max_output_bytes,
                command_env=command_env,
                on_output=request.on_output,
                redactor=request.redactor,
            )
        return outcome.to_result()

    async def write_file(self, path: str, data: bytes) -> None:
        self._live()
        await anyio.to_thread.run_sync(safe_write, self.workspace, path, data)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        self._live()
        return await anyio.to_thread.run_sync(lambda: safe_read(self.workspace, path, max_bytes=max_bytes))

    async def list_files(self, path: str, *, recursive: bool, limits: TransferLimits) -> list[FileInfo]:
        self._live()
        return await super().list_files(path, recursive=recursive, limits=limits)

    async def download(self, path: str, out: IO[bytes], *, limits: TransferLimits) -> Transfer:
        self._live()
        return await super().download(path, out, limits=limits)

    async def upload(self, path: str, archive: IO[bytes], *, limits: TransferLimits) -> Transfer:
        self._live()
        return await super().upload(path, archive, limits=limits)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await anyio.to_thread.run_sync(remove_tree, self.root or self.workspace)


async def sweep_orphaned_workspaces(prefix: str) -> list[str]:
    """For a backend's ``gc``: remove the HostWorkspaceSession directories of ``prefix`` whose owner is gone
    (only real directories of this uid with an owner file; never a link); what was removed."""

    return await anyio.to_thread.run_sync(remove_orphaned_dirs, prefix)
