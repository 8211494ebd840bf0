"""local_subprocess: the command runs as a plain child process of the host user. Not a sandbox.

It gets a fresh temporary workspace, a minimal environment, rlimits (CPU time, address space, file size,
no core dumps) and the timeout and output rules; its whole process tree dies at the deadline. It can read
whatever the host user can read and it shares the host's network, so the guard refuses it unless
CODE_EXEC_LOCAL=true, and it can only honour network mode 'host'.

A session is a directory ``execbox-local-PID-STARTTIME-*`` in the temp dir holding an ``owner`` file and the
``workspace``; ``close`` removes it. What a SIGKILLed execbox process left, ``gc`` removes (``execbox gc``, and
the first use of this backend in every process), never a live owner's and never through a link.
"""

from __future__ import annotations

import os
import tempfile

import anyio

from execbox.plugin import (
    OWNER_FILE,
    Capabilities,
    ExecutionBackend,
    HostWorkspaceSession,
    SessionSpec,
    orphaned_dirs,
    owner_id,
    owner_tag,
    remove_tree,
    safe_write,
)

SESSION_PREFIX = "execbox-local-"


class LocalSession(HostWorkspaceSession):
    """The host-workspace session, its workspace inside a directory that names its owner (for gc)."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{owner_tag()}-")
        try:
            safe_write(self.root, OWNER_FILE, (owner_id() + "\n").encode(), mode=0o600)
            workspace = os.path.join(self.root, "workspace")
            os.mkdir(workspace, 0o700)
        except BaseException:
            remove_tree(self.root)
            raise
        super().__init__(workspace=workspace)

    async def close(self) -> None:
        if self._closed:
            return
        await super().close()
        await anyio.to_thread.run_sync(remove_tree, self.root)


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
        streaming=True,
    )
    sweeps_on_first_use = True

    async def open_session(self, spec: SessionSpec) -> LocalSession:
        return LocalSession()

    async def gc(self) -> list[str]:
        """Session directories of execbox processes that are gone (a crash, a SIGKILL)."""

        def sweep() -> list[str]:
            found = orphaned_dirs(SESSION_PREFIX)
            for path in found:
                remove_tree(path)
            return [path for path in found if not os.path.lexists(path)]  # what could not go is not reported

        return await anyio.to_thread.run_sync(sweep)


__all__ = ["LocalSession", "LocalSubprocessBackend"]
