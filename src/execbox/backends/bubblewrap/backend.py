"""The bubblewrap backend: its capabilities, ``probe`` (probe.py), sessions (session.py), the mounts the dropped
uid can reach, and ``gc`` of what killed execbox processes left."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Mapping
from typing import Any

import anyio

from execbox.backends.bubblewrap.cgroups import CGROUP_PREFIX, cgroup_sweep_dirs, remove_cgroup
from execbox.backends.bubblewrap.probe import host_report, unavailable
from execbox.backends.bubblewrap.report import HostReport
from execbox.backends.bubblewrap.session import SESSION_PREFIX, BubblewrapSession, release_mounts
from execbox.backends.bubblewrap.settings import BubblewrapSettings
from execbox.plugin import (
    Capabilities,
    ConfigError,
    ExecutionBackend,
    OwnedSandbox,
    SessionSpec,
    Settings,
    create_cleanly,
    kill_session_processes,
    orphaned_dirs,
    owned_session_dirs,
    remove_tree,
    restore_sandbox_paths,
    sweep_orphaned_proxies,
)


def _unreachable_by(path: str, identity: tuple[int, int] | None, writable: bool) -> str | None:
    """Why the host user ``identity`` (None: this process's user) cannot open ``path`` (x on every directory
    above, r on it, w too when ``writable``), or None. bwrap opens the source as that user."""
    if identity is None:
        return None if os.access(path, os.R_OK | (os.W_OK if writable else 0)) else "it is not readable" + (
            " and writable" if writable else "") + " by you"
    uid, gid = identity

    def allows(st: os.stat_result, bits: int) -> bool:
        shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
        return (st.st_mode >> shift) & bits == bits

    current = "/"
    for part in [p for p in path.split("/") if p]:
        try:
            st = os.stat(current)
        except OSError as exc:
            return f"{current} cannot be read: {exc.strerror}"
        if not allows(st, 1):
            return f"uid {uid} cannot enter {current}"
        current = os.path.join(current, part)
    try:
        st = os.stat(current)
    except OSError as exc:
        return f"{current} cannot be read: {exc.strerror}"
    need = 4 | (2 if writable else 0) | (1 if stat.S_ISDIR(st.st_mode) else 0)
    return None if allows(st, need) else f"uid {uid} cannot {'write' if writable else 'read'} {current}"


class BubblewrapBackend(ExecutionBackend[BubblewrapSettings]):
    name = "bubblewrap"
    extra = None  # no Python SDK: needs the bwrap binary and libseccomp2 from the OS
    summary = "Linux namespaces with bwrap: no daemon, starts in milliseconds; shares the host kernel"
    capabilities = Capabilities(
        sandbox=True,
        isolation="namespace",
        network_modes=frozenset({"none", "proxy", "host"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "pids", "cpu", "wall_time"}),
        streaming=True,
        mounts=True,  # execbox.Mount as --ro-bind / --bind (a source the dropped uid can reach)
        tmpfs=True,  # extra tmpfs paths (SessionSpec.tmpfs) as --tmpfs, the sandbox user's
        snapshot=True,  # the workspace (HOME, pip's --user) and, as root, the tmpfs paths a session keeps
    )

    settings_model = BubblewrapSettings
    sweeps_on_first_use = True

    def __init__(self, execbox_settings: Settings, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(execbox_settings, options)
        self.report: HostReport | None = None

    async def probe(self) -> Capabilities:
        self.report = await host_report(self.settings, self.shared.default_limits, BubblewrapBackend.capabilities)
        return self.report.capabilities

    def details(self) -> dict[str, Any]:
        """What ``check`` found on this host (bwrap, identity, cgroups, seccomp), for `execbox doctor`."""
        return self.report.facts() if self.report else {}

    async def open_session(self, spec: SessionSpec) -> BubblewrapSession:
        if self.report is None:
            await self.check()
        report, settings = self.report, self.settings
        assert report is not None
        if spec.network == "proxy" and not shutil.which("python3", path="/usr/local/bin:/usr/bin"):
            raise unavailable("network mode proxy runs a small forwarder with python3 inside the sandbox, and "
                               "there is no python3 under /usr here", "apt-get install python3 (dnf install python3)")
        identity = settings.host_identity()
        for mount in spec.mounts:
            unreachable = _unreachable_by(mount.source, identity, mount.writable)
            if unreachable:
                raise ConfigError(f"cannot mount {mount.source}: {unreachable}. bubblewrap runs the sandbox as "
                                  f"{settings.user} (CODE_EXEC_BWRAP_USER) when execbox runs as root: make the path "
                                  "reachable by that user, or mount another one", backend=self.name,
                                  env_var="CODE_EXEC_BWRAP_USER")
        session: BubblewrapSession = await create_cleanly(
            lambda made: made.append(BubblewrapSession(report, settings, spec, self.shared)),
            lambda session: session.destroy())
        try:
            await restore_sandbox_paths(session, spec, self.shared)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await session.close()
            raise
        return session

    async def owned(self) -> list[OwnedSandbox]:
        return await anyio.to_thread.run_sync(owned_session_dirs, SESSION_PREFIX)

    async def kill(self, ref: str) -> None:
        def end() -> None:
            kill_session_processes(ref, SESSION_PREFIX)
            if ref in orphaned_dirs(SESSION_PREFIX):  # an orphan's (its owner is gone): removed here, as gc would
                release_mounts(ref)
                remove_tree(ref)

        await anyio.to_thread.run_sync(end)

    async def gc(self) -> list[str]:
        """Session directories, size-limited workspaces and cgroups (v1 and v2) of execbox processes that are
        gone; needs no ``check`` first."""
        settings = self.settings
        plan = self.report.cgroup if self.report else None

        def sweep() -> list[str]:
            dirs = set(cgroup_sweep_dirs(settings)) | set(plan.parents.values() if plan else ())
            return _gc(sorted(dirs)) + sweep_orphaned_proxies()

        return await anyio.to_thread.run_sync(sweep)


def _gc(cgroup_dirs: list[str]) -> list[str]:
    """Session directories (and their size-limited workspaces) and cgroups left by execbox processes that are
    gone (a crash, a SIGKILL); a cgroup's processes are killed first. orphaned_dirs takes only real directories
    of ours: anyone can plant an execbox-bwrap-* name (a symlink, a directory) in a shared /tmp, and gc may run
    as root; a cgroup holds no owner file, so its name alone says whose it is."""
    removed = []
    with contextlib.suppress(OSError):
        for path in orphaned_dirs(SESSION_PREFIX):
            release_mounts(path)  # the mounts first: a mount point cannot go
            remove_tree(path)
            removed.append(path)
    for parent in cgroup_dirs:
        with contextlib.suppress(OSError):
            removed += [path for path in orphaned_dirs(CGROUP_PREFIX, parent, owner_file=False)
                        if remove_cgroup(path)]
    return removed
