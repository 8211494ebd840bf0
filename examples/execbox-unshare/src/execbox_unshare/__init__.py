"""An example execbox backend plugin: ``unshare_net``.

It runs each command in fresh network and PID namespaces (util-linux ``unshare``), so network mode
``none`` is really enforced and the whole process tree dies with the run. It does NOT hide the host's
files or users, so it honestly says it is not a sandbox: the guard admits it only with CODE_EXEC_LOCAL=true.

Everything else (workspace, env, output cap, timeout) comes from execbox's own building blocks.
"""

from __future__ import annotations

import shutil
import tempfile

import anyio

import execbox
from execbox.core.envpolicy import sandbox_env
from execbox.core.procs import reaped, run_process
from execbox.core.workspace import safe_read, safe_write


class UnshareSession(execbox.Session):
    def __init__(self) -> None:
        self.workspace = tempfile.mkdtemp(prefix="execbox-unshare-")

    async def exec(self, request: execbox.ExecRequest) -> execbox.ExecResult:
        # --map-root-user lets an unprivileged user create the namespaces; --kill-child ends the tree.
        # A tiny shell is PID 1 of the namespace, so the command is an ordinary process that signals can kill.
        argv = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--",
                "/bin/sh", "-c", '"$@"; exit $?', "sh", *request.argv]
        outcome = await run_process(
            reaped(argv),
            env=sandbox_env(request.env, home=self.workspace),
            cwd=request.workdir or self.workspace,
            stdin=request.stdin,
            timeout=request.timeout or 30,
            max_output_bytes=request.max_output_bytes or 100_000,
        )
        return outcome.to_result()

    async def write_file(self, path: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(safe_write, self.workspace, path, data)

    async def read_file(self, path: str) -> bytes:
        return await anyio.to_thread.run_sync(safe_read, self.workspace, path)

    async def close(self) -> None:
        shutil.rmtree(self.workspace, ignore_errors=True)


class UnshareBackend(execbox.ExecutionBackend):
    name = "unshare_net"
    summary = "fresh network + PID namespaces via util-linux unshare; host files visible, so not a sandbox"
    capabilities = execbox.Capabilities(
        sandbox=False,
        isolation="process",  # the filesystem and the users are the host's
        network_modes=frozenset({"none"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"wall_time"}),
    )

    async def check(self) -> execbox.Capabilities:
        if shutil.which("unshare") is None:
            raise execbox.BackendUnavailableError(
                "the `unshare` command is missing", backend=self.name, fix="apt-get install util-linux")
        probe = await anyio.run_process(["unshare", "--user", "--map-root-user", "--net", "true"], check=False)
        if probe.returncode != 0:
            raise execbox.BackendUnavailableError(
                f"this host does not allow new user namespaces: {probe.stderr.decode().strip()}",
                backend=self.name, fix="sysctl -w kernel.unprivileged_userns_clone=1 (or run as root)")
        return self.capabilities

    async def open_session(self, spec: execbox.SessionSpec) -> UnshareSession:
        return UnshareSession()


@execbox.hookimpl
def execbox_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(UnshareBackend)
