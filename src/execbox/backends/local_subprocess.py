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

from execbox.plugin import (
    Capabilities,
    ExecutionBackend,
    HostWorkspaceSession,
    SessionSpec,
    sweep_orphaned_workspaces,
)

SESSION_PREFIX = "execbox-local-"


class LocalSession(HostWorkspaceSession):
    """The host-workspace session (its workspace in a directory that names its owner, for gc)."""

    def __init__(self) -> None:
        super().__init__(prefix=SESSION_PREFIX)


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
        return await sweep_orphaned_workspaces(SESSION_PREFIX)


__all__ = ["LocalSession", "LocalSubprocessBackend"]
