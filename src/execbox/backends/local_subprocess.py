"""local_subprocess: the command runs as a plain child process of the host user. Not a sandbox.

It gets a fresh temporary workspace, a minimal environment, rlimits (CPU time, address space, file size,
no core dumps) and the timeout and output rules; its whole process tree dies at the deadline. It can read
whatever the host user can read and it shares the host's network, so the guard refuses it unless
CODE_EXEC_LOCAL=true, and it can only honour network mode 'host'.
"""

from __future__ import annotations

from execbox.plugin import (
    Capabilities,
    ExecutionBackend,
    HostWorkspaceSession,
    SessionSpec,
)


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

    async def open_session(self, spec: SessionSpec) -> HostWorkspaceSession:
        return HostWorkspaceSession()
