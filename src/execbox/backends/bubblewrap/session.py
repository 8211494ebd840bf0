"""A bubblewrap session: a private directory holding the workspace (size-limited as root), and each exec a new
sandbox over it, started by the launcher in the run's cgroup; ``arm`` starts the first one ahead."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import stat
import tempfile
import uuid
from dataclasses import dataclass
from typing import IO

import anyio

from execbox.backends.bubblewrap.cgroups import RunCgroup
from execbox.backends.bubblewrap.filesystem import WORKSPACE, masks, system_binds, unsafe_bind
from execbox.backends.bubblewrap.launcher import GATE, TOOLS_PATH, launch_argv
from execbox.backends.bubblewrap.report import HostReport
from execbox.backends.bubblewrap.settings import BubblewrapSettings
from execbox.plugin import (
    ARMED,
    OWNER_FILE,
    PROXY_MOUNT_POINT,
    ConfigError,
    EgressProxy,
    ExecResult,
    ExecSpec,
    FileInfo,
    ProxyRun,
    SandboxError,
    Session,
    SessionSpec,
    Settings,
    SharedSettings,
    SnapshotParts,
    SnapshotPlace,
    Transfer,
    TransferLimits,
    armed_script,
    compiled_filter,
    finish_process,
    mount_sized_soon,
    mount_tmpfs,
    owner_id,
    owner_tag,
    pack_sandbox_paths,
    release_sized,
    remove_tree,
    safe_read,
    safe_write,
    sandbox_env,
    snapshot_limits,
    start_process,
    stop_process,
    through_egress,
    tmpfs_path_mb,
)

SANDBOX_UID = SANDBOX_GID = 1000
FILE_SIZE_LIMIT = 1 << 30
SHM_MB = 64
SESSION_PREFIX = "execbox-bwrap-"


@dataclass
class _Launched:
    """One exec's sandbox as started: the files bwrap reads, its cgroup and its process (all gone on discard)."""

    args_file: str
    status_file: str
    cgroup: RunCgroup | None = None
    proc: asyncio.subprocess.Process | None = None
    loop: asyncio.AbstractEventLoop | None = None

    async def discard(self) -> None:
        """Stop the process if it still runs (an armed sandbox never used), then remove its files and cgroup."""
        if self.proc is not None and self.proc.returncode is None:
            await stop_process(self.proc)
        for path in (self.args_file, self.status_file):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self.cgroup:
            await anyio.to_thread.run_sync(self.cgroup.remove)


#: A persistent session's kept tmpfs paths: directories <root>/tmpfs-N (see _make_tmpfs_dirs).
TMPFS_PREFIX = "tmpfs-"


class BubblewrapSession(Session):
    workspace = WORKSPACE
    #: Network mode proxy: the session's egress proxy (its directory is bound in, one socket per exec).
    egress: EgressProxy | None = None
    host_workspace: str  # the host directory bound at /workspace: file transfer works on it directly

    def __init__(self, report: HostReport, settings: BubblewrapSettings, spec: SessionSpec,
                 shared: SharedSettings | None = None) -> None:
        self.report = report
        self.settings = settings
        self.spec = spec
        self.shared = shared
        self.owner = report.host_identity
        self.host_owner = self.owner
        self.root = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{owner_tag()}-")
        self.host_workspace = os.path.join(self.root, "workspace")
        self.kill_ref = self.root  # named on its bwrap command lines (kill_session_processes)
        self._closed = False
        self._armed: _Launched | None = None
        self._sized: concurrent.futures.Future[None] | None = None  # the size-limited workspace being made
        self._tmpfs_dirs: dict[str, str] = {}  # sandbox path -> the session's directory bound there
        try:
            if spec.network == "proxy":
                shared = shared or SharedSettings.of(Settings.from_env())
                self.egress = EgressProxy(shared.egress_policy(), owner=self.owner, ca_bundle=shared.ca_bundle)
            # root: 0711 so the dropped uid can reach its workspace but list nothing else here
            os.chmod(self.root, 0o711)
            self._write_private(OWNER_FILE, owner_id() + "\n", 0o644)
            os.mkdir(self.host_workspace, 0o700)
            if self.owner:
                os.chown(self.host_workspace, *self.owner)
            if report.sized_workspace and spec.limits.disk_mb:
                self._sized = mount_sized_soon(self.host_workspace, spec.limits.disk_mb,
                                                    self.owner or (os.getuid(), os.getgid()))
                if not spec.oneshot:
                    # A sandbox's workspace (the kit's host_workspace, usable by anyone holding the session) is
                    # ready when it opens. A one-shot's is made while its launcher starts: the runner reaches it
                    # only through the methods, which wait, and bwrap waits at its gate (see _ready).
                    self._sized_done(self._sized.exception())
            self._tmpfs_dirs = self._make_tmpfs_dirs()
            self._write_private("passwd", f"root:x:0:0::/:/usr/sbin/nologin\nsandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:"
                                          f"sandbox:{WORKSPACE}:/bin/sh\nnobody:x:65534:65534::/:/usr/sbin/nologin\n",
                                0o644)
            self._write_private("group", f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n", 0o644)
            self._write_private("hosts", "127.0.0.1 localhost\n::1 localhost\n", 0o644)
            self._write_private("filter.bpf", compiled_filter(), 0o600)
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Unmount the size-limited workspace (if any) and remove the whole session directory."""
        if self.egress is not None:
            self.egress.close()
        if self._sized is not None:
            concurrent.futures.wait([self._sized])  # done either way: no part of the mount appears later
        release_mounts(self.root)
        remove_tree(self.root)

    def _tmpfs_size_mb(self) -> int:
        return tmpfs_path_mb(self.settings.tmpfs_mb, self.spec.limits.disk_mb)

    def _make_tmpfs_dirs(self) -> dict[str, str]:
        """As root, a persistent session's tmpfs paths outlive each exec (every exec is a new bwrap), as a
        container's do: sandbox path -> a directory of the session's, the sandbox user's, with a tmpfs of its size
        mounted there and bound in; /tmp is one too (the code may mkdir in one exec and use it in the next). Not
        root there is no mounting on the host: /tmp and every tmpfs= path are each exec's own sized tmpfs (bwrap's
        --tmpfs), never a plain host directory, so they count against memory and do not persist across execs; a
        one-shot's are bwrap's own --tmpfs too."""
        if self.spec.oneshot or not self.owner:
            return {}
        kept = [("/tmp", self.settings.tmpfs_mb)] + [(path, self._tmpfs_size_mb()) for path in self.spec.tmpfs]
        made: dict[str, str] = {}
        for n, (path, size_mb) in enumerate(kept):
            directory = os.path.join(self.root, f"{TMPFS_PREFIX}{n}")
            os.mkdir(directory, 0o700)
            made[path] = directory
            os.chown(directory, *self.owner)
            mount_tmpfs(directory, size_mb, self.owner)
        return made

    def _write_private(self, name: str, data: str | bytes, mode: int) -> str:
        path = os.path.join(self.root, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.chmod(path, mode)
        return path

    def _bwrap_args(self, request: ExecSpec) -> list[str]:
        features = self.report.features
        args = ["--unshare-all", "--unshare-user"]
        if request.network == "host":
            args.append("--share-net")
        if "--disable-userns" in features:
            args.append("--disable-userns")
        args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL",
                 "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID), "--hostname", "execbox", "--clearenv"]
        env = sandbox_env(request.env, home=WORKSPACE)
        if self.egress is not None:
            env.update(self.egress.env(request.egress))
        for name, value in env.items():
            args += ["--setenv", name, value]
        args += system_binds()
        for name in ("passwd", "group", "hosts"):
            args += ["--ro-bind", os.path.join(self.root, name), f"/etc/{name}"]
        if request.network == "host":
            args += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        sized = "--size" in features
        args += (["--size", str(SHM_MB << 20)] if sized else []) + ["--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        if "/tmp" in self._tmpfs_dirs:
            args += ["--bind", self._tmpfs_dirs["/tmp"], "/tmp"]
        else:
            args += (["--size", str(self.settings.tmpfs_mb << 20)] if sized else []) + ["--tmpfs", "/tmp"]
        args += ["--bind", self.host_workspace, WORKSPACE]
        # The request's tmpfs paths: sized as /tmp is (within the disk limit), the sandbox user's (bwrap makes a
        # tmpfs as the user it maps), mode 0700; as root a persistent session's are kept across its execs
        # (_make_tmpfs_dirs).
        for path in self.spec.tmpfs:
            if path in self._tmpfs_dirs:
                args += ["--bind", self._tmpfs_dirs[path], path]
                continue
            args += (["--size", str(self._tmpfs_size_mb() << 20)] if sized else [])
            args += (["--perms", "0700"] if "--perms" in features else []) + ["--tmpfs", path]
        if self.egress is not None:  # the proxy's sockets: the only way out of the network namespace
            args += ["--ro-bind", self.egress.directory, PROXY_MOUNT_POINT]
        for mount in self.spec.mounts:  # the caller's host paths (admitted by the guard), outer targets first
            self._check_mount_target(mount.target)
            args += ["--bind" if mount.writable else "--ro-bind", mount.source, mount.target]
        for extra in self.settings.ro_binds:
            unsafe = unsafe_bind(extra)
            if unsafe:
                raise ConfigError(f"CODE_EXEC_BWRAP_RO_BINDS: {unsafe}. Remove it from the variable",
                                  backend="bubblewrap", env_var="CODE_EXEC_BWRAP_RO_BINDS")
            args += ["--ro-bind", extra, extra]
        args += masks(["/usr", *self.settings.ro_binds])
        args += ["--remount-ro", "/"]
        args += ["--chdir", request.workdir]
        return args

    def _check_mount_target(self, target: str) -> None:
        """A mount below /workspace lands on a directory the code could have replaced (each exec is a new sandbox
        over the same workspace): refuse a link or a file there rather than mount wherever it leads."""
        if not target.startswith(WORKSPACE + "/"):
            return
        path = self.host_workspace
        for part in target[len(WORKSPACE) + 1:].split("/"):
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return  # bwrap makes it
            if not stat.S_ISDIR(st.st_mode):
                raise SandboxError(f"the mount point {target} was replaced by the code (it is no longer a "
                                   "directory); open a new sandbox", backend="bubblewrap")

    def _rlimits(self, request: ExecSpec, cgroup: RunCgroup | None) -> dict[str, int]:
        """ulimit's letters (core dumps, file size, CPU seconds, address space) -> bytes or seconds (soft = hard)."""
        rlimits = {"c": 0, "f": FILE_SIZE_LIMIT, "t": math.ceil(request.timeout) + 1}
        limits = request.limits
        if limits.memory_mb and not (cgroup and "memory" in cgroup.dirs):
            # No memory cgroup here: a per-process address-space cap is the best there is (not claimed).
            rlimits["v"] = limits.memory_mb * 1024 * 1024
        return rlimits

    async def exec(self, request: ExecSpec) -> ExecResult:
        return await through_egress(self.egress, request.egress, lambda run: self._exec(request, run))

    async def arm(self) -> None:
        """Start the first exec's sandbox now, waiting in ARMED for its command (as docker arms a session's first
        exec): a warm-pool member's run then costs no bwrap start. Not with network mode proxy, whose command is
        wrapped per run. The armed sandbox has the session's limits; its CPU-time limit, set for the session's
        lifetime, is lowered to the run's by the script."""
        if self.egress is not None or self._armed is not None:
            return
        spec = ExecSpec(argv=["/bin/sh", "-c", ARMED], env={}, workdir=WORKSPACE, timeout=self.spec.lifetime_s,
                        max_output_bytes=1, network=self.spec.network, limits=self.spec.limits)
        self._armed = await self._launch(spec, None)

    async def _exec(self, request: ExecSpec, run: ProxyRun | None) -> ExecResult:
        if self._closed:
            raise SandboxError("this bubblewrap session is closed", backend="bubblewrap")
        armed, self._armed = self._armed, None
        if armed is not None and (request.limits != self.spec.limits or armed.loop is not asyncio.get_running_loop()
                                  or armed.proc is None or armed.proc.returncode is not None):
            await armed.discard()  # for another shape of run, in another event loop, or ended while it waited
            armed = None
        if armed is not None:
            script = armed_script(request.argv, sandbox_env(request.env, home=WORKSPACE), request.workdir,
                                  backend="bubblewrap", cpu_s=self._rlimits(request, armed.cgroup)["t"])
            return await self._finish(armed, request, script + (request.stdin or b""))
        return await self._finish(await self._launch(request, run), request, request.stdin)

    async def _launch(self, request: ExecSpec, run: ProxyRun | None) -> _Launched:
        """``request``'s sandbox started (its cgroup, argument and status files, the watched bwrap); not fed yet."""
        tag = uuid.uuid4().hex[:12]
        launched = _Launched(self._write_private(f"args-{tag}", "\0".join(self._bwrap_args(request)) + "\0", 0o600),
                             os.path.join(self.root, f"status-{tag}"))
        try:
            if self.report.cgroup:
                try:
                    launched.cgroup = await anyio.to_thread.run_sync(RunCgroup.create, self.report.cgroup,
                                                                     request.limits)
                except OSError as exc:
                    raise SandboxError(f"cannot create the run's cgroup: {exc}",
                                       backend="bubblewrap") from exc
            cgroup = launched.cgroup
            argv = launch_argv(
                tools=self.report.tools, caller=os.getpid(), bwrap=self.report.bwrap, args_file=launched.args_file,
                seccomp_file=os.path.join(self.root, "filter.bpf"), status_file=launched.status_file,
                rlimits=self._rlimits(request, cgroup), cgroup_procs=cgroup.procs_files() if cgroup else [],
                user=self.owner, command=EgressProxy.command(run, request.argv) if run else request.argv)
            launched.proc = await start_process(argv, env={"PATH": TOOLS_PATH}, cwd=self.root)
            launched.loop = asyncio.get_running_loop()
            await self._ready()  # made while the launcher started; only now may bwrap bind the workspace
            assert launched.proc.stdin is not None
            launched.proc.stdin.write(GATE)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await launched.discard()
            raise
        return launched

    async def _finish(self, launched: _Launched, request: ExecSpec, stdin: bytes | None) -> ExecResult:
        try:
            assert launched.proc is not None
            outcome = await finish_process(launched.proc, stdin=stdin, timeout=request.timeout,
                                           max_output_bytes=request.max_output_bytes, on_output=request.on_output,
                                           redactor=request.redactor)
            oom = launched.cgroup.oom_killed() if launched.cgroup else False
            started = await anyio.to_thread.run_sync(_sandbox_started, launched.status_file)
            if not started and not outcome.timed_out:
                raise SandboxError(
                    f"bubblewrap did not start the sandbox (exit {outcome.exit_code}): "
                    f"{outcome.stderr.text().strip()[-500:]}",
                    backend="bubblewrap")
            return outcome.to_result(oom_killed=oom)
        finally:
            with anyio.CancelScope(shield=True):
                await launched.discard()

    async def _ready(self) -> None:
        """Wait for the size-limited workspace (made in the background since the session opened); before anything
        touches the workspace, and before bwrap may start (the gate: the launcher's last step reads a line)."""
        if self._sized is not None:
            with contextlib.suppress(Exception):  # said by _sized_done; shielded: a cancelled waiter leaves it be
                await asyncio.shield(asyncio.wrap_future(self._sized))
            self._sized_done(self._sized.exception())

    @staticmethod
    def _sized_done(error: BaseException | None) -> None:
        if error is not None:
            raise SandboxError(f"cannot make the session's size-limited workspace: {error}",
                               backend="bubblewrap") from error

    async def list_files(self, path: str, *, recursive: bool, limits: TransferLimits) -> list[FileInfo]:
        await self._ready()
        return await super().list_files(path, recursive=recursive, limits=limits)

    async def download(self, path: str, out: IO[bytes], *, limits: TransferLimits) -> Transfer:
        await self._ready()
        return await super().download(path, out, limits=limits)

    async def upload(self, path: str, archive: IO[bytes], *, limits: TransferLimits) -> Transfer:
        await self._ready()
        return await super().upload(path, archive, limits=limits)

    async def write_file(self, path: str, data: bytes) -> None:
        await self._ready()
        await anyio.to_thread.run_sync(lambda: safe_write(self.host_workspace, path, data, owner=self.owner))

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        await self._ready()
        # as the sandbox user: a file the code made unreadable stays unread
        return await anyio.to_thread.run_sync(lambda: safe_read(self.host_workspace, path, max_bytes=max_bytes,
                                                                owner=self.owner))

    async def snapshot(self, place: SnapshotPlace, *, memory: bool) -> SnapshotParts:
        # /usr and the rest of the root are this host's, read-only: besides the workspace (the runner's part) only
        # the tmpfs paths a session keeps (as root: /tmp and tmpfs=) change; otherwise each exec has its own.
        await pack_sandbox_paths(self, place, list(self._tmpfs_dirs), limits=snapshot_limits(
            self.shared or SharedSettings.of(Settings.from_env())))
        return SnapshotParts(memory=False, source="this host's /usr, read-only (bubblewrap)")

    async def close(self) -> None:
        self._closed = True
        armed, self._armed = self._armed, None
        if armed is not None:
            await armed.discard()
        await anyio.to_thread.run_sync(self.destroy)


def release_mounts(root: str) -> None:
    """Unmount what a session directory holds (its size-limited workspace, its kept tmpfs paths) so it can go; a
    plain directory there is left as it is. The session directory is execbox's alone (0711): nothing in it is the
    code's to plant."""
    release_sized(os.path.join(root, "workspace"))  # the mount first: a mount point cannot go
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith(TMPFS_PREFIX) and entry.is_dir(follow_symlinks=False):
                release_sized(entry.path)


def _sandbox_started(status_file: str) -> bool:
    try:
        with open(status_file) as fh:
            return '"child-pid"' in fh.read()
    except OSError:
        return False
