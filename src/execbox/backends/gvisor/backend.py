"""The gvisor backend: its capabilities, the probe (runsc, the root filesystem, a real sandbox), sessions and gc."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from typing import Any

import anyio

from execbox.backends.gvisor.rootfs import ensure_rootfs, sweep_partial_exports
from execbox.backends.gvisor.session import (
    SESSION_PREFIX,
    WORKSPACE,
    GvisorSession,
    Host,
    cgroup_parents,
    release,
    sessions_dir,
)
from execbox.backends.gvisor.settings import GvisorSettings
from execbox.plugin import (
    BackendUnavailableError,
    Capabilities,
    ExecSpec,
    ExecutionBackend,
    OwnedSandbox,
    SandboxError,
    SeccompUnavailable,
    SessionSpec,
    SharedSettings,
    compiled_filter,
    create_cleanly,
    host_env,
    kill_session_processes,
    orphaned_dirs,
    owned_session_dirs,
    restore_sandbox_paths,
    sized_workspace_unavailable,
    untrusted_binary,
)

_HOSTS: dict[str, tuple[Host, float]] = {}


def _unavailable(reason: str, fix: str, env_var: str | None = None) -> BackendUnavailableError:
    return BackendUnavailableError(f"gvisor: {reason}", backend="gvisor", fix=fix, env_var=env_var)


class GvisorBackend(ExecutionBackend[GvisorSettings]):
    name = "gvisor"
    extra = None  # no Python SDK: needs the runsc binary (Debian's runsc) and a root filesystem
    summary = "gVisor's user-space kernel run directly by runsc: no daemon; the code never reaches the host kernel"
    capabilities = Capabilities(
        sandbox=True,
        isolation="gvisor",
        network_modes=frozenset({"none", "proxy"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "disk", "wall_time"}),
        streaming=True,
        snapshot=True,  # the workspace and /tmp (the root is read-only)
    )
    settings_model = GvisorSettings
    sweeps_on_first_use = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host: Host | None = None
        self.export_s = 0.0

    async def probe(self) -> Capabilities:
        self.host, self.export_s = await _host(self.settings, self.shared)
        limits = {"wall_time"} | ({"memory"} if self.host.cgroups else set()) | (
            {"disk"} if self.host.sized_workspace else set())
        return self.capabilities.model_copy(update={"limits": frozenset(limits)})

    def details(self) -> dict[str, Any]:
        """What ``check`` found, for `execbox doctor`."""
        host = self.host
        if host is None:
            return {}
        return {"runsc": host.runsc, "version": host.version, "platform": host.platform, "rootfs": host.rootfs,
                "user": "%d:%d" % host.user,
                "rootless": os.geteuid() != 0, "memory_cgroup": host.cgroups, "sized_workspace": host.sized_workspace}

    async def open_session(self, spec: SessionSpec) -> GvisorSession:
        if self.host is None:
            await self.check()
        assert self.host is not None
        return await _open(self.host, spec, self.shared)

    async def owned(self) -> list[OwnedSandbox]:
        return await anyio.to_thread.run_sync(owned_session_dirs, SESSION_PREFIX, sessions_dir())

    async def kill(self, ref: str) -> None:
        runsc = self.settings.runsc

        def end() -> None:
            # runsc run, its sandbox and gofer all carry --root SESSION/runsc; the owner's close deletes what remains
            kill_session_processes(ref, SESSION_PREFIX, sessions_dir())
            if ref in orphaned_dirs(SESSION_PREFIX, sessions_dir()):  # an orphan's: nobody else removes it (gc would)
                release(ref, [runsc, "--root", os.path.join(ref, "runsc")])

        await anyio.to_thread.run_sync(end)

    async def gc(self) -> list[str]:
        """Session directories of execbox processes that are gone (their sandbox, runsc state, sized workspace),
        their empty cgroups and half-made root filesystem exports; needs no ``check`` first."""
        runsc = self.settings.runsc

        def sweep() -> list[str]:
            removed = sweep_partial_exports()
            with contextlib.suppress(OSError):
                for path in orphaned_dirs(SESSION_PREFIX, sessions_dir()):
                    release(path, [runsc, "--root", os.path.join(path, "runsc")])
                    removed.append(path)
            for parent in cgroup_parents():
                for path in orphaned_dirs(SESSION_PREFIX, parent, owner_file=False):
                    with contextlib.suppress(OSError):  # a cgroup with a process left in it stays
                        os.rmdir(path)
                        removed.append(path)
            return removed

        return await anyio.to_thread.run_sync(sweep)


async def _open(host: Host, spec: SessionSpec, shared: SharedSettings) -> GvisorSession:
    def create(made: list[GvisorSession]) -> None:
        made.append(GvisorSession(host, spec, shared))

    session = await create_cleanly(create, GvisorSession.destroy)
    try:
        await session.start()
        await restore_sandbox_paths(session, spec, shared)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await session.close()
        raise
    return session


async def _host(settings: GvisorSettings, shared: SharedSettings) -> tuple[Host, float]:
    """Decide once per configuration what runs here; raises BackendUnavailableError with the fix."""
    key = f"{settings.model_dump_json()}:{os.geteuid()}"
    if key in _HOSTS:
        return _HOSTS[key]
    if not sys.platform.startswith("linux"):
        raise _unavailable(f"runsc runs on Linux only; this is {sys.platform}", "use a remote backend")
    runsc = shutil.which(settings.runsc)
    if not runsc:
        raise _unavailable(f"{settings.runsc!r} not found", "apt-get install runsc (or gVisor's release binary) or "
                           "set CODE_EXEC_GVISOR_RUNSC", "CODE_EXEC_GVISOR_RUNSC")
    runsc = os.path.realpath(runsc)  # exec the file itself: a link on the way may change after this check
    untrusted = untrusted_binary(runsc)
    if untrusted:
        raise _unavailable(f"{runsc} cannot be trusted to be the sandbox: {untrusted}", "point CODE_EXEC_GVISOR_RUNSC "
                           "at the distribution's runsc (e.g. /usr/bin/runsc)", "CODE_EXEC_GVISOR_RUNSC")
    done = await anyio.run_process([runsc, "--version"], check=False, env=host_env())
    version = done.stdout.decode(errors="replace").splitlines()[0] if done.stdout else ""
    if done.returncode != 0 or not version.startswith("runsc version"):
        raise _unavailable(f"{runsc} --version says {version[:100]!r}", "point CODE_EXEC_GVISOR_RUNSC at runsc",
                           "CODE_EXEC_GVISOR_RUNSC")
    try:
        compiled_filter()
    except SeccompUnavailable as exc:
        raise _unavailable(str(exc), "apt-get install libseccomp2 (Fedora: dnf install libseccomp)") from None
    if settings.platform == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
        raise _unavailable("platform kvm needs /dev/kvm, which is not usable here", "use CODE_EXEC_GVISOR_PLATFORM="
                           "ptrace", "CODE_EXEC_GVISOR_PLATFORM")
    if settings.rootfs:
        if not os.path.isfile(os.path.join(settings.rootfs, "bin/sh")):
            raise _unavailable(f"{settings.rootfs} holds no bin/sh: not a root filesystem",
                               "point CODE_EXEC_GVISOR_ROOTFS at a root filesystem directory",
                               "CODE_EXEC_GVISOR_ROOTFS")
        rootfs, export_s = settings.rootfs, 0.0
    else:
        rootfs, export_s = await anyio.to_thread.run_sync(ensure_rootfs, settings.image)
    root = os.geteuid() == 0
    uid, _, gid = settings.user.partition(":")
    host = Host(runsc=runsc, version=version.strip(), platform=settings.platform, rootfs=rootfs,
                user=(int(uid), int(gid)) if root else (0, 0), cgroups=root,
                sized_workspace=root and not sized_workspace_unavailable(), tmpfs_mb=settings.tmpfs_mb,
                start_timeout_s=settings.start_timeout_s)
    # Prove it end to end: a real sandbox with the default limits must start and run `id -u`.
    try:
        with anyio.fail_after(settings.start_timeout_s + 20):
            limits = shared.default_limits
            probe = await _open(host, SessionSpec("none", limits, True, 60.0), shared)
            try:
                result = await probe.exec(ExecSpec(argv=["/bin/sh", "-c", "id -u"], timeout=20, max_output_bytes=4096,
                                                   network="none", limits=limits, workdir=WORKSPACE))
            finally:
                with anyio.CancelScope(shield=True):
                    await probe.close()
    except (SandboxError, TimeoutError) as exc:
        raise _unavailable(f"a test sandbox did not run: {exc or 'it hung'}",
                           "see the error; as a user without root, runsc --rootless needs user namespaces; try "
                           "CODE_EXEC_GVISOR_PLATFORM=ptrace") from None
    if result.exit_code != 0 or result.stdout.strip() != str(host.user[0]):
        said = (result.stderr or result.stdout)[-300:]
        raise _unavailable(f"a test sandbox failed (exit {result.exit_code}): {said}", "see the error above")
    _HOSTS[key] = (host, export_s)
    return host, export_s
