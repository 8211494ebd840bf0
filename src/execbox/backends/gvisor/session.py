"""A gvisor session: one runsc sandbox over a private directory (its OCI bundle, runsc's state, the workspace),
started attached behind the kit's reaper and joined by ``runsc exec`` for every command."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import anyio

from execbox.backends.gvisor.rootfs import base_dir
from execbox.plugin import (
    OWNER_FILE,
    PROXY_MOUNT_POINT,
    EgressProxy,
    ExecResult,
    ExecSpec,
    Limits,
    ProxyRun,
    SandboxError,
    Session,
    SessionSpec,
    SharedSettings,
    SnapshotParts,
    SnapshotPlace,
    compiled_filter,
    finish_process,
    host_env,
    mount_sized,
    owner_id,
    owner_tag,
    pack_sandbox_paths,
    reaped,
    release_sized,
    remove_tree,
    safe_read,
    safe_write,
    sandbox_env,
    snapshot_limits,
    through_egress,
)

SESSION_PREFIX = "execbox-gvisor-"
WORKSPACE = "/workspace"
FILE_SIZE_LIMIT = 1 << 30
RUNSC_FAILED = 128  # runsc exec's own failure (the sandbox gone), not the command's status
SECCOMP_DIR = "/run/execbox-seccomp"  # the compiled filter, bound in read-only
# Every command starts behind this: it loads the shared seccomp deny list (runsc 20221219's exec does not apply
# the container's OCI filter to an exec'd process), then a shell execs the command, so that a file that cannot
# run is the shell's 126/127 with its reason (runsc's own failed exec died of SIGPIPE on the output socket the
# sandbox had shut down: 141, no message). ~25 ms a command: python3's start in gVisor.
LOADER = """import ctypes, os, sys
prog = open(sys.argv[1], "rb").read()
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
if ctypes.CDLL(None, use_errno=True).prctl(22, 2, ctypes.byref(Prog(len(prog) // 8, prog)), 0, 0):
    sys.exit("execbox: the seccomp filter did not load: " + os.strerror(ctypes.get_errno()))
os.execv("/bin/sh", ["sh", "-c", 'exec "$@"', "sh", *sys.argv[2:]])
"""
EXEC = ["python3", "-I", "-S", "-c", LOADER, f"{SECCOMP_DIR}/filter.bpf"]
SIGKILLED = 137
# The container's init: says it runs (start waits for that line), then reaps every orphan (a session's background
# processes re-parent to it) and does nothing else.
INIT = """import os, signal
print('ready', flush=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    signal.sigwait({signal.SIGCHLD})
"""
# At a deadline: every process of the sandbox user but init (pid 1, which kill -1 spares) and this one.
KILL_ALL = ["/bin/sh", "-c", "kill -9 -1"]

@dataclass(frozen=True)
class Host:
    """What ``check`` found: the runsc binary, its flags, the root filesystem, and what is enforced here."""

    runsc: str
    version: str
    platform: str
    rootfs: str
    user: tuple[int, int]  # the code's uid:gid inside; rootless, 0:0 (the only id runsc maps: the caller's)
    cgroups: bool  # memory and cpu through runsc's own cgroup (root only)
    sized_workspace: bool
    tmpfs_mb: int
    start_timeout_s: float

    def flags(self, root: str) -> list[str]:
        flags = [self.runsc, "--root", root, "--network=none", f"--platform={self.platform}"]
        return flags if os.geteuid() == 0 else flags + ["--rootless", "--ignore-cgroups"]


def sessions_dir() -> str:
    path = base_dir() / "sessions"
    path.mkdir(parents=True, exist_ok=True, mode=0o711)
    return str(path)


class GvisorSession(Session):
    workspace = WORKSPACE

    #: Network mode proxy: the session's egress proxy (its directory bound in, one socket per exec).
    egress: EgressProxy | None = None

    def __init__(self, host: Host, spec: SessionSpec, shared: SharedSettings) -> None:
        """The session's directory, workspace and bundle (in a worker thread); ``start`` runs the sandbox."""
        self.host, self.spec, self.shared = host, spec, shared
        self._closed = False
        self._lost = ""  # why the sandbox ended under a command, when it did
        self._proc: subprocess.Popen[bytes] | None = None
        self.root = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{owner_tag()}-", dir=sessions_dir())
        self.id = os.path.basename(self.root)
        self.kill_ref = self.root  # named on its runsc command lines (--root SESSION/runsc)
        self.host_workspace = self._workspace = os.path.join(self.root, "workspace")
        self.owner = host.user if os.geteuid() == 0 else None
        self.host_owner = self.owner  # what uploads and restored workspaces are given: the sandbox user's
        try:
            if spec.network == "proxy":
                self.egress = EgressProxy(shared.egress_policy(), owner=self.owner, ca_bundle=shared.ca_bundle)
            os.chmod(self.root, 0o700)
            safe_write(self.root, OWNER_FILE, (owner_id() + "\n").encode(), mode=0o600)
            os.mkdir(self.host_workspace, 0o700)
            if self.owner is not None:
                if spec.limits.disk_mb:
                    mount_sized(self.host_workspace, spec.limits.disk_mb, self.owner)
                os.chown(self.host_workspace, *self.owner)
            os.mkdir(os.path.join(self.root, "runsc"), 0o700)
            os.mkdir(os.path.join(self.root, "bundle"), 0o700)
            os.mkdir(os.path.join(self.root, "seccomp"), 0o755)
            self._write("seccomp/filter.bpf", compiled_filter(), 0o644)
            self._write("bundle/config.json", json.dumps(self._config()))
        except BaseException:
            self.destroy()
            raise

    def _write(self, name: str, data: str | bytes, mode: int = 0o600) -> str:
        path = os.path.join(self.root, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        return path

    def _process(self, argv: list[str], env: dict[str, str], cwd: str, cpu_s: int) -> dict[str, Any]:
        uid, gid = self.host.user
        return {
            "terminal": False, "user": {"uid": uid, "gid": gid}, "args": argv, "cwd": cwd,
            "env": [f"{k}={v}" for k, v in env.items()],
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
            "rlimits": [{"type": "RLIMIT_CPU", "hard": cpu_s, "soft": cpu_s},
                        {"type": "RLIMIT_FSIZE", "hard": FILE_SIZE_LIMIT, "soft": FILE_SIZE_LIMIT},
                        {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                        {"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}],
            "noNewPrivileges": True,
        }

    def _config(self) -> dict[str, Any]:
        """The OCI spec: read-only root, the workspace the only writable host path, a sized /tmp, no
        capabilities, an empty network namespace, and the session's memory and cpu limits."""
        init = self._process(["python3", "-I", "-S", "-c", INIT], {"PATH": "/usr/bin:/bin"}, "/", 1 << 30)
        linux: dict[str, Any] = {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]}
        resources = _resources(self.spec.limits) if self.host.cgroups else {}
        if resources:
            linux["cgroupsPath"] = f"/{self.id}"
            linux["resources"] = resources
        return {
            "ociVersion": "1.0.2", "process": init, "hostname": "execbox",
            "root": {"path": self.host.rootfs, "readonly": True},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                 "options": ["nosuid", "nodev", f"size={self.host.tmpfs_mb}m", "mode=1777"]},
                {"destination": WORKSPACE, "type": "bind", "source": self.host_workspace, "options": ["rbind", "rw"]},
                {"destination": SECCOMP_DIR, "type": "bind", "source": os.path.join(self.root, "seccomp"),
                 "options": ["rbind", "ro"]},
                # network mode proxy: the proxy's sockets, the only way out of the loopback-only network stack
                *([{"destination": PROXY_MOUNT_POINT, "type": "bind", "source": self.egress.directory,
                    "options": ["rbind", "ro"]}] if self.egress else []),
            ],
            "linux": linux,
        }

    def _runsc(self, *args: str) -> list[str]:
        flags = self.host.flags(os.path.join(self.root, "runsc"))
        return [*flags, *(["--host-uds=open"] if self.egress else []), *args]

    async def start(self) -> None:
        """Run the sandbox attached to a reaper (started from the event loop's thread, which outlives it: the
        reaper's parent-death signal follows the thread that forked it), and wait for its init's first line."""
        ours, theirs = os.pipe()
        try:
            os.set_blocking(ours, False)
            with open(os.path.join(self.root, "runsc.log"), "wb") as log:
                self._proc = subprocess.Popen(
                    reaped(self._runsc("run", "--bundle", os.path.join(self.root, "bundle"), self.id)),
                    stdin=subprocess.DEVNULL, stdout=theirs, stderr=log, cwd=self.root, env=host_env(),
                    start_new_session=True)
            os.close(theirs)
            theirs = -1
            await self._until_ready(ours)
        finally:
            os.close(ours)
            if theirs >= 0:
                os.close(theirs)

    async def _until_ready(self, fd: int) -> None:
        """Polled, not a blocking read in a thread: a cancelled start must not leave a reader behind."""
        assert self._proc is not None
        deadline = time.monotonic() + self.host.start_timeout_s
        said = b""
        while not said.endswith(b"\n"):
            with contextlib.suppress(BlockingIOError):
                chunk = os.read(fd, 64)
                said += chunk
                if chunk:
                    continue
            if self._proc.poll() is not None or time.monotonic() > deadline or len(said) > 64:
                with open(os.path.join(self.root, "runsc.log"), "rb") as fh:
                    log = fh.read()[-500:].decode(errors="replace").strip()
                why = "did not start" if self._proc.poll() is not None else \
                    f"did not start within {self.host.start_timeout_s:g}s (CODE_EXEC_GVISOR_START_TIMEOUT_S)"
                raise SandboxError(f"runsc {why}: {log}", backend="gvisor")
            await anyio.sleep(0.01)

    async def exec(self, request: ExecSpec) -> ExecResult:
        if self._closed or self._lost:
            raise SandboxError(f"this gvisor session is {'closed' if self._closed else 'gone: ' + self._lost}; "
                               "open a new sandbox", backend="gvisor")
        return await through_egress(self.egress, request.egress, lambda run: self._exec(request, run))

    async def _exec(self, request: ExecSpec, run: ProxyRun | None) -> ExecResult:
        env = sandbox_env(request.env, home=WORKSPACE)
        if self.egress is not None:
            env.update(self.egress.env(request.egress))
        argv = EgressProxy.command(run, request.argv) if run else request.argv
        process = self._process([*EXEC, *argv], env, request.workdir, math.ceil(request.timeout) + 1)
        path = await anyio.to_thread.run_sync(self._write, f"process-{uuid.uuid4().hex[:12]}.json",
                                              json.dumps(process))
        try:
            # SIGKILL, not a forwarded SIGTERM: runsc exec would pass that to the command alone; the sandbox's
            # own processes are killed below.
            proc, writers = await _start_over_sockets(self._runsc("exec", "--process", path, self.id), self.root)
            try:
                outcome = await finish_process(proc, stdin=request.stdin, timeout=request.timeout,
                                               max_output_bytes=request.max_output_bytes,
                                               terminate_signal=signal.SIGKILL, on_output=request.on_output,
                                               redactor=request.redactor)
            finally:
                for writer in writers:
                    writer.close()
            if outcome.timed_out:
                with anyio.CancelScope(shield=True):
                    await self._kill_all()
        finally:
            os.unlink(path)
        if outcome.exit_code == RUNSC_FAILED and not outcome.timed_out and await self._ended():
            # The sandbox died under the command, most often the memory cgroup's OOM killer taking the whole
            # Sentry (runsc removes the cgroup with the sandbox, its OOM count too): the command was killed, a
            # result; the session is gone.
            limit = self.spec.limits.memory_mb
            self._lost = "the sandbox ended under a command" + (f" (its memory limit is {limit} MiB)" if limit else "")
            return dataclasses.replace(outcome, exit_code=SIGKILLED).to_result()
        return outcome.to_result()

    async def _ended(self) -> bool:
        """Whether the sandbox is gone (runsc run exits just after it): given a moment to say so."""
        assert self._proc is not None
        for _ in range(100):
            if self._proc.poll() is not None:
                return True
            await anyio.sleep(0.02)
        return False

    async def _kill_all(self) -> None:
        path = await anyio.to_thread.run_sync(self._write, f"kill-{uuid.uuid4().hex[:12]}.json",
                                              json.dumps(self._process(KILL_ALL, {}, "/", 10)))
        try:
            with anyio.move_on_after(10):
                await anyio.run_process(self._runsc("exec", "--process", path, self.id), check=False, env=host_env())
        finally:
            os.unlink(path)

    async def write_file(self, path: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(lambda: safe_write(self._workspace, path, data, owner=self.owner))

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        return await anyio.to_thread.run_sync(lambda: safe_read(self._workspace, path, max_bytes=max_bytes,
                                                                owner=self.owner))

    async def snapshot(self, place: SnapshotPlace, *, memory: bool) -> SnapshotParts:
        # The root filesystem is read-only: besides the workspace (the runner's part) only /tmp changes.
        await pack_sandbox_paths(self, place, ["/tmp"], limits=snapshot_limits(self.shared))
        return SnapshotParts(memory=False, source=self.host.rootfs)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await anyio.to_thread.run_sync(self.destroy)

    def destroy(self) -> None:
        """The sandbox killed (the reaper takes runsc and everything it started), the workspace unmounted, the
        directory and the cgroups removed. runsc's record goes with the directory: ``runsc delete`` (one more
        Go start) only when the reaper did not end in time."""
        if self.egress is not None:
            self.egress.close()
        lingering = False
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                lingering = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        release(self.root, self.host.flags(os.path.join(self.root, "runsc")) if lingering else None)


def release(root: str, runsc: list[str] | None) -> None:
    """What a session directory holds, gone: with ``runsc`` (its flags), the sandbox runsc knows of first; the
    sized workspace, the directory, and the cgroups runsc leaves when a sandbox is killed under it."""
    if runsc is not None and os.path.isdir(os.path.join(root, "runsc")):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([*runsc, "delete", "--force", os.path.basename(root)], capture_output=True, timeout=30,
                           env=host_env(), check=False)
    release_sized(os.path.join(root, "workspace"))
    remove_tree(root)
    for parent in cgroup_parents():
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(parent, os.path.basename(root)))


def cgroup_parents() -> list[str]:
    """Where runsc makes a sandbox's cgroup (linux.cgroupsPath /NAME): each v1 controller, or the v2 root."""
    base = "/sys/fs/cgroup"
    if os.path.exists(os.path.join(base, "cgroup.controllers")):
        return [base]
    with contextlib.suppress(OSError), os.scandir(base) as entries:
        return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    return []


async def _start_over_sockets(argv: list[str], cwd: str) -> tuple[asyncio.subprocess.Process,
                                                                  list[asyncio.StreamWriter]]:
    """``argv`` started as ``start_process`` would, but its stdout and stderr Unix sockets, not pipes: runsc hands
    them to the sandbox, whose writes to a full host pipe come back short (after 64 KiB), and a writer that does
    not retry (python -u's stdout) loses the rest; a socket takes the whole write."""
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, stdout=pairs[0][1].fileno(),
                                                    stderr=pairs[1][1].fileno(), env=host_env(), cwd=cwd,
                                                    start_new_session=True)
    except BaseException:
        for ours, _ in pairs:
            ours.close()
        raise
    finally:
        for _, theirs in pairs:
            theirs.close()
    streams = [await asyncio.open_unix_connection(sock=ours, limit=1 << 16) for ours, _ in pairs]
    proc.stdout, proc.stderr = streams[0][0], streams[1][0]
    return proc, [writer for _, writer in streams]


def _resources(limits: Limits) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limits.memory_mb:
        resources["memory"] = {"limit": limits.memory_mb << 20}
    return resources
