"""An example execbox backend plugin: ``unshare_net``.

It runs each command in fresh network and PID namespaces (util-linux ``unshare``), so network mode
``none`` is really enforced and the whole process tree dies with the run. It does NOT hide the host's
files or users, so it honestly says it is not a sandbox: the guard admits it only with CODE_EXEC_LOCAL=true.

Everything else (workspace, env, rlimits, output cap, timeout, process-tree kill) comes from execbox's
host-workspace session (``execbox.HostWorkspaceSession``), which this backend extends with one
method. It imports nothing but the public plugin kit, ``execbox.plugin``.

``unshare`` runs as the caller (as root, if execbox does), so it must not see the request's variables: a
request's LD_PRELOAD would load a library the code wrote, as root, into ``unshare``. The session takes care
of that: ``unshare`` and its shell start with a minimal host environment, and the ``argv`` the launcher is
given starts with the step that applies the request's variables to the command alone, inside the
namespaces. A launcher runs that ``argv`` as given and keeps inherited file descriptors open.
"""

from __future__ import annotations

import shutil

import anyio

from execbox.plugin import (
    BackendUnavailableError,
    Capabilities,
    ExecutionBackend,
    HostWorkspaceSession,
    Register,
    SessionSpec,
    hookimpl,
    sweep_orphaned_workspaces,
)

PREFIX = "execbox-unshare-"


class UnshareSession(HostWorkspaceSession):
    """execbox's local session (temporary workspace, rlimits, output cap, process-tree kill) with the
    command put behind `unshare`."""

    def launcher(self, argv: list[str]) -> list[str]:
        # --map-root-user lets an unprivileged user create the namespaces; --kill-child ends the tree.
        # A tiny shell is PID 1 of the namespace, so the command is an ordinary process that signals can kill.
        return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--",
                "/bin/sh", "-c", '"$@"; exit $?', "sh", *argv]


class UnshareBackend(ExecutionBackend):
    name = "unshare_net"
    summary = "fresh network + PID namespaces via util-linux unshare; host files visible, so not a sandbox"
    capabilities = Capabilities(
        sandbox=False,
        isolation="process",  # the filesystem and the users are the host's
        network_modes=frozenset({"none"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"wall_time"}),
    )
    # What a SIGKILLed caller left (its workspace directory names it) goes on the next process's first check.
    sweeps_on_first_use = True

    async def probe(self) -> Capabilities:
        if shutil.which("unshare") is None:
            raise BackendUnavailableError(
                "the `unshare` command is missing", backend=self.name, fix="apt-get install util-linux")
        probe = await anyio.run_process(["unshare", "--user", "--map-root-user", "--net", "true"], check=False)
        if probe.returncode != 0:
            raise BackendUnavailableError(
                f"this host does not allow new user namespaces: {probe.stderr.decode().strip()}",
                backend=self.name, fix="sysctl -w kernel.unprivileged_userns_clone=1 (or run as root)")
        return self.capabilities

    async def open_session(self, spec: SessionSpec) -> UnshareSession:
        return UnshareSession(prefix=PREFIX)

    async def gc(self) -> list[str]:
        return await sweep_orphaned_workspaces(PREFIX)


@hookimpl
def execbox_register_backends(register: Register) -> None:
    register(UnshareBackend)
