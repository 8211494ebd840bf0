"""A docker session: one container per run (one-shot), or one long-lived container that every exec enters.

A one-shot container is started "armed", before its command is known: its process waits for one script on
stdin (the command, its environment and directory, shell-quoted) and execs it. So the sized workspace is made
while the engine creates the container (~18 ms less per one-shot, measured side by side), and the command's
environment travels on the attach stream, not in the container's config (``docker inspect`` does not show it).
A session arms its first exec the same way (an exec started at open, waiting for the script): a warm-pool member,
a session whose one exec is the run, costs no `docker exec` when it is used; its result comes when the process
ends, where an armed one-shot's waits for its container to exit.

The deadline is kept twice. On the host: at the deadline the container (one-shot) or every process of the
sandbox user (session) is SIGKILLed, and ``timed_out`` is what execbox saw, never guessed from an exit code.
In the container, so that it holds when the caller is gone (SIGKILL, a crash, a lost machine): every command
runs under coreutils ``timeout -s KILL`` set a few seconds past the deadline (a one-shot container's init
exits with it, and every process with the init), and a session's keep-alive sleeps only for the session's
lifetime. A killed caller's container therefore stops by itself.

What a caller leaves when it ends without closing its sandboxes (SIGKILL, or SIGTERM and SIGHUP with their
default action, when no clean-up of Python's runs) is removed within seconds by its watchdog (``watch_owner``):
one process per caller, started with its first sandbox, that waits for the caller's exit. Should the watchdog
be gone too, the next sweep or ``execbox gc`` removes it.

The workspace is a host directory, named after its owner process (``execbox-docker-<pid>-<start>-*``) so that
gc can tell an orphan from a live session even when no container points at it; where the ``disk`` limit is
available (root), a size-limited filesystem is mounted on it before the container starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from execbox.backends.docker.hardening import (
    TMPFS,
    WORKSPACE,
    Contract,
    built_problems,
    hardened,
    parse_user,
    security_opt,
)
from execbox.backends.docker.stream import close, hijacked, pump
from execbox.plugin import (
    ARMED,
    PROXY_MOUNT_POINT,
    SIZED_IMAGE_SUFFIX,
    BackendUnavailableError,
    BoundedCapture,
    EgressProxy,
    ExecResult,
    ExecSpec,
    Limits,
    Mount,
    NotASandboxError,
    OwnerLabels,
    ProxyRun,
    SandboxError,
    Session,
    SessionSpec,
    SharedSettings,
    SnapshotParts,
    SnapshotPlace,
    armed_script,
    build_result,
    mount_sized_soon,
    name_owner,
    owner_id,
    owner_tag,
    pack_sandbox_paths,
    pid_alive,
    release_sized,
    remove_tree,
    safe_read,
    safe_write,
    sandbox_env,
    snapshot_limits,
    tmpfs_path_mb,
    with_egress,
)

LABEL = "io.execbox"
L_OWNER = "io.execbox.owner"
L_SESSION = "io.execbox.session"
L_CREATED = "io.execbox.created"
L_EXPIRES = "io.execbox.expires"
L_WORKSPACE = "io.execbox.workspace"
#: gc's vocabulary spelled as docker labels: no container is kept on purpose (persist).
DOCKER_LABELS = OwnerLabels(mark=LABEL, owner=L_OWNER, created=L_CREATED, expires=L_EXPIRES)

HOME = "/tmp"
WORKSPACE_PREFIX = "execbox-docker-"
_GRACE_S = 3.0  # after a command's end: how long its exec may take to report its exit code
# A helper exec (the kill at a deadline, the OOM count): how long it may take before the session is judged broken.
_QUICK_S = 10.0
# How long past its deadline the in-container backstop kills a command. Long enough that the host's own
# deadline always comes first while the caller lives (results keep their timed_out), short enough that a
# dead caller's run ends soon after its deadline.
BACKSTOP_GRACE_S = 5


def backstop(argv: list[str], seconds: float) -> list[str]:
    """``argv`` under a deadline the container enforces without the caller: coreutils timeout, SIGKILL."""
    return ["timeout", "-s", "KILL", str(math.ceil(seconds)), *argv]


def remove_workspace(path: str) -> bool:
    """Unmount (a sized workspace) and remove a workspace directory, and its disk image. Only a directory we
    would have made: directly in the temp dir, with our prefix, not a link. True if there was one."""
    if not path:
        return False
    p = os.path.abspath(path)
    if os.path.realpath(os.path.dirname(p)) != os.path.realpath(tempfile.gettempdir()) \
            or name_owner(os.path.basename(p), WORKSPACE_PREFIX) is None or os.path.islink(p):
        return False
    existed = os.path.exists(p) or os.path.exists(p + SIZED_IMAGE_SUFFIX)
    release_sized(p)
    remove_tree(p)
    return existed


def orphaned_workspaces(sandbox_uid: int | None = None) -> list[str]:
    """Workspaces (and bare disk images) in the temp dir whose owner process is gone. Judged by the name alone:
    the workspace is the sandbox's to write, an owner file in it too. Only what execbox could have made, never
    a link: directories and images of this user; as root, also directories of ``sandbox_uid`` (root hands each
    workspace to the sandbox user, and a sized one's mounted root too) and mount points with root's disk image
    beside them (a sized workspace of another sandbox uid)."""
    tmp = os.path.realpath(tempfile.gettempdir())
    me = os.geteuid()
    uids = {me, sandbox_uid} if me == 0 and sandbox_uid is not None else {me}
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            base = os.path.join(tmp, name.removesuffix(SIZED_IMAGE_SUFFIX))
            owner = name_owner(os.path.basename(base), WORKSPACE_PREFIX)
            if owner is None or pid_alive(*owner):
                continue
            path = os.path.join(tmp, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if path != base:  # an image whose directory is gone (its directory takes it along otherwise)
                if stat.S_ISREG(st.st_mode) and st.st_uid == me and not os.path.lexists(base):
                    found.append(base)
            elif stat.S_ISDIR(st.st_mode) and (st.st_uid in uids or me == 0 and os.path.ismount(path)
                                               and _owned_file(path + SIZED_IMAGE_SUFFIX, me)):
                found.append(path)
    return found


def _owned_file(path: str, uid: int) -> bool:
    """Is ``path`` a regular file of ``uid`` (never through a link)? A sized workspace's image: its mount point is
    execbox's only with it, as a user may mount (FUSE) on a directory of their own named like a workspace."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == uid


# The watchdog's first stage: standard library only, no site, nothing of execbox until the owner has exited; then
# the second stage (reap_owner) only if a workspace of the owner is left, so an owner that closed everything costs
# one idle process. pidfd: woken by the exit itself (polling where the kernel has none).
_WATCHDOG = """
import os, select, sys, time
pid, started = int(sys.argv[1]), sys.argv[2]
def start_time():
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""
try:
    fd = os.pidfd_open(pid)
except OSError:
    fd = None
if fd is None:
    while start_time() == started:
        time.sleep(1)
elif start_time() == started:
    select.select([fd], [], [])
if any(name.startswith(sys.argv[4]) for name in os.listdir(sys.argv[3])):
    os.execv(sys.executable, [sys.executable, "-I", "-c", "import sys; sys.path[:] = sys.argv[5:]; from execbox."
                              "backends.docker.session import reap_owner; reap_owner(*sys.argv[1:5])", *sys.argv[3:]])
"""
_watchdogs: dict[int, subprocess.Popen[bytes]] = {}  # owner pid -> its watchdog (a forked child needs its own)
_watch_lock = threading.Lock()


def _new_watch_lock() -> None:
    # A child forked while another thread held the lock (starting the watchdog) would wait on it forever.
    global _watch_lock
    _watch_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_watch_lock)


def watch_owner(sandbox_uid: int) -> None:
    """Start, once per process, the watchdog that removes this process's containers and workspaces when it ends
    however it ends: SIGKILL, SIGTERM or SIGHUP with their default action, a crash. The keep-alive in the
    container cannot see the caller; a host process can. It runs in a session of its own (a signal to the
    caller's process group does not reach it), without the caller's stdio (whoever reads the caller's output to
    its end is not held up) and in /. Where it cannot start, the next sweep or gc removes what is left.

    Its second stage imports execbox isolated (-I: no PYTHON* variable, no user site, not /) from this process's
    own import path, its absolute entries (a relative one was this process's working directory): an execbox
    found only through a path the caller added at run time is found too. It takes the workspaces the orphan scan
    would, with ``sandbox_uid`` the first sandbox's user (a later one with another user is left to gc)."""
    pid = os.getpid()
    with _watch_lock:
        if pid in _watchdogs or not sys.executable:
            return
        tag = owner_tag()
        tmp = os.path.realpath(tempfile.gettempdir())
        with contextlib.suppress(OSError):
            _watchdogs[pid] = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(pid), tag.split("-", 1)[1], tmp,
                 f"{WORKSPACE_PREFIX}{tag}-", owner_id(), str(sandbox_uid),
                 *(path for path in sys.path if os.path.isabs(path))],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, cwd="/")


def reap_owner(tmp: str, prefix: str, owner: str, sandbox_uid: str) -> None:
    """The watchdog's second stage, once ``owner`` has exited: remove its containers (by their owner label) and
    then its workspaces in ``tmp`` (named with ``prefix``, and only what the orphan scan takes: never a link,
    another user's directory or mount), twice: a container the engine was still creating as the owner died is
    there a moment later."""
    import docker

    from execbox.backends.docker.engine import connect

    tempfile.tempdir = tmp  # the owner's, which remove_workspace checks every path against
    try:
        client, _, _ = connect()
    except BackendUnavailableError:
        client = None
    for again in (False, True):
        if again:
            time.sleep(2)
        if client is not None:
            with contextlib.suppress(docker.errors.APIError):
                for item in client.api.containers(all=True, filters={"label": f"{L_OWNER}={owner}"}):
                    with contextlib.suppress(docker.errors.APIError):
                        client.api.remove_container(item["Id"], force=True)
        for path in orphaned_workspaces(int(sandbox_uid)):
            if os.path.basename(path).startswith(prefix):
                remove_workspace(path)


class SessionBackend(Protocol):
    """What a session uses of its backend (``DockerBackend``, which imports this module, not the other way): the
    engine behind ``call``, where that engine is, and the shared settings its egress proxy is made from."""

    @property
    def shared(self) -> SharedSettings: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def socket_path(self) -> str | None: ...

    def call(self, fn: Any) -> Any: ...


@dataclass
class Plan:
    """What every container of a session is made of."""

    image: str
    user: str
    keeper: str  # PID 1 of a persistent session: a second uid the sandbox user cannot signal
    limits: Limits
    network: str
    runtime: str | None
    tmpfs_mb: int
    egress_network: str
    disk: bool  # mount a size-limited workspace (limits.disk_mb)
    mounts: tuple[Mount, ...] = ()  # the caller's host paths (admitted by the guard; sources resolved)
    tmpfs: tuple[str, ...] = ()  # extra empty tmpfs paths (admitted by the guard), the sandbox user's
    gvisor: bool = False  # the runtime was judged gVisor (its seccomp profile: hardening.seccomp_profile)


class DockerSession(Session):
    workspace = WORKSPACE
    host_workspace: str  # the host directory bound at /workspace: file transfer works on it directly

    def __init__(self, backend: SessionBackend, spec: SessionSpec, plan: Plan) -> None:
        self.backend = backend
        self.spec = spec
        self.plan = plan
        self.id = uuid.uuid4().hex[:12]
        self.kill_ref = self.id  # its containers' io.execbox.session label
        self.host_workspace = tempfile.mkdtemp(prefix=f"{WORKSPACE_PREFIX}{owner_tag()}-")
        self._owner = parse_user(plan.user)
        # As root: hand the workspace to the sandbox user. Otherwise the sandbox user is the caller
        # (DockerBackend.workspace_access refuses any other), and mkdtemp's 0700 is already right.
        if os.geteuid() == 0:
            os.chown(self.host_workspace, *self._owner)
        self.host_owner = self._owner if os.geteuid() == 0 else None
        self._lock = threading.Lock()
        self._closed = False
        self._sized = False
        self._containers: set[str] = set()
        self._keeper_id: str | None = None  # the session's keep-alive, or the one-shot's armed container
        self._disk: concurrent.futures.Future[None] | None = None  # the sized workspace being made (prepare)
        self._armed: Any = None  # a one-shot's attach socket, its container waiting for the command
        self._armed_exec: tuple[str, Any] | None = None  # a session's first exec, waiting for its command
        self._oom_seen = 0
        self._streams: set[socket.socket] = set()  # the attach/exec sockets being read now (close() cuts them)
        self._broken: str | None = None  # why the container can no longer be trusted to run another exec
        # Network mode proxy: the session's egress proxy; its directory is bound read-only at /run/execbox.
        self.egress: EgressProxy | None = None

    def prepare(self) -> None:
        """Before any container: the egress proxy in network mode proxy, and the size-limited workspace where
        the disk limit is enforced here — made in a thread while ``start`` has the engine create the container
        (a bind mount is resolved when the container starts, not when it is created)."""
        if self.plan.network == "proxy":
            shared = self.backend.shared
            self.egress = EgressProxy(shared.egress_policy(), owner=self._owner if os.geteuid() == 0 else None,
                                      ca_bundle=shared.ca_bundle)
        if self.plan.disk and self.plan.limits.disk_mb:
            self._sized = True  # set first: close() releases whatever part of the mount was made
            self._disk = mount_sized_soon(self.host_workspace, self.plan.limits.disk_mb, self._owner)

    # -- container arguments --

    def _labels(self, expires_in: float) -> dict[str, str]:
        return {**DOCKER_LABELS.make(expires_in), L_SESSION: self.id, L_WORKSPACE: self.host_workspace}

    def _create_kwargs(self, command: list[str], *, user: str, env: dict[str, str], workdir: str,
                       expires_in: float, stdin: bool) -> dict[str, Any]:
        from docker.types import LogConfig, Mount, Ulimit

        p = self.plan
        # The runner passes the effective limits; one missing is left unset, and hardened() refuses it.
        memory = f"{p.limits.memory_mb}m" if p.limits.memory_mb else None
        kw: dict[str, Any] = {
            "image": p.image, "command": command, "user": user, "environment": env, "working_dir": workdir,
            "hostname": "sandbox", "labels": self._labels(expires_in),
            "name": f"execbox-{self.id}-{uuid.uuid4().hex[:6]}",
            "cap_drop": ["ALL"], "security_opt": security_opt(p.gvisor), "read_only": True, "init": True,
            "ipc_mode": "private", "cgroupns": "private",
            "tmpfs": {TMPFS: f"rw,exec,nosuid,nodev,size={p.tmpfs_mb}m,mode=1777", **self._extra_tmpfs()},
            "mounts": [Mount(WORKSPACE, self.host_workspace, type="bind", read_only=False)],
            "pids_limit": p.limits.pids, "mem_limit": memory, "memswap_limit": memory,
            "nano_cpus": int(p.limits.cpus * 1e9) if p.limits.cpus else None,
            "ulimits": [Ulimit(name="core", soft=0, hard=0)],
            "log_config": LogConfig(type=LogConfig.types.NONE), "stdin_open": stdin,
        }
        if p.network == "egress":
            kw["network"] = p.egress_network
        elif p.network == "proxy":  # no network at all: the proxy's Unix socket is the only way out
            kw["network_mode"] = "none"
            kw["mounts"].append(Mount(PROXY_MOUNT_POINT, self._egress_dir(), type="bind", read_only=True))
        else:
            kw["network_mode"] = p.network  # "none" or "host" (the guard has judged host already)
        for m in p.mounts:  # the caller's host paths: read-only unless asked otherwise
            kw["mounts"].append(Mount(m.target, m.source, type="bind", read_only=not m.writable))
        if p.runtime:
            kw["runtime"] = p.runtime
        return hardened(kw, socket_path=self.backend.socket_path, user_mounts=self._user_mounts(), gvisor=p.gvisor)

    def _extra_tmpfs(self) -> dict[str, str]:
        """The request's tmpfs paths: each sized as /tmp is, within the disk limit, and owned by the sandbox user."""
        p = self.plan
        size = tmpfs_path_mb(p.tmpfs_mb, p.limits.disk_mb)
        uid, gid = self._owner
        return {path: f"rw,exec,nosuid,nodev,size={size}m,mode=0700,uid={uid},gid={gid}" for path in p.tmpfs}

    def _user_mounts(self) -> tuple[tuple[str, str, bool], ...]:
        return tuple((m.source, m.target, m.writable) for m in self.plan.mounts)

    def _egress_dir(self) -> str:
        if self.egress is None:
            raise SandboxError("network mode proxy without its proxy (prepare() was not called)", backend="docker")
        return self.egress.directory

    def contract(self, user: str) -> Contract:
        p = self.plan
        network = {"egress": p.egress_network, "proxy": "none"}.get(p.network, p.network)
        return Contract(user=user, network=network, proxy_dir=self._egress_dir() if p.network == "proxy" else None,
                        workspace=self.host_workspace, memory_bytes=(p.limits.memory_mb or 0) << 20,
                        nano_cpus=int((p.limits.cpus or 0) * 1e9), pids=p.limits.pids or 0, runtime=p.runtime,
                        mounts=self._user_mounts(), tmpfs=self.plan.tmpfs, gvisor=p.gvisor)

    def _create(self, kw: dict[str, Any]) -> Any:
        container = self.backend.call(lambda c: c.containers.create(**kw))
        with self._lock:
            self._containers.add(container.id)
            closed = self._closed
        if closed:  # the caller gave up while we were creating: leave nothing behind
            self._remove(container.id)
            raise SandboxError("the session was closed while its container was being created", backend="docker")
        # docker-py's create inspects the new container: its attrs are what the engine built, before it runs.
        problems = built_problems(container.attrs, self.contract(kw["user"]))
        if problems:
            self._remove(container.id)
            raise NotASandboxError(
                "refused: the Docker engine built a container that differs from execbox's hardening table: "
                + "; ".join(problems) + f". Check the engine at {self.backend.endpoint} (daemon.json defaults, "
                "authorization plugins, the runtime); the container was removed before it ran", backend="docker")
        return container

    def _remove(self, container_id: str) -> None:
        import docker

        with contextlib.suppress(docker.errors.APIError):  # gone already, or its removal is in progress
            self.backend.call(lambda c: c.api.remove_container(container_id, force=True))
        with self._lock:
            self._containers.discard(container_id)

    def _stream(self, sock_io: Any, stdin: bytes, deadline: float, out: BoundedCapture, err: BoundedCapture,
                kill: Callable[[], object], alive: Callable[[], bool] | None = None) -> bool:
        """Feed stdin and capture the output of a hijacked attach/exec socket until EOF or the deadline; True if
        the deadline came first, and then the socket is closed before ``kill`` runs.

        Closed first because the engine (20.10 at least) ends an exec only once all its output has reached the
        client, and handles one container's events one at a time: with the unread stream of a program that
        keeps printing, the kill's own exec, a removal, any later exec of that container waits forever. What
        the program prints after its deadline is not wanted."""
        sock, leftover = hijacked(sock_io)
        with self._lock:
            self._streams.add(sock)
        try:
            timed_out = pump(sock, leftover, stdin, deadline, out, err, alive)
        finally:
            with self._lock:
                self._streams.discard(sock)
            close(sock_io, sock)
        if timed_out:
            kill()
        return timed_out

    # -- starting: a session's keep-alive, or a one-shot's armed container --

    def start(self) -> None:
        if self.spec.oneshot:  # the command comes with the run: until then the container waits for it on stdin
            command = backstop(["/bin/sh", "-c", ARMED], self.spec.lifetime_s)
            user = self.plan.user
        else:  # the keep-alive ends with the session's lifetime: a session whose caller died stops by itself
            command, user = ["sleep", str(math.ceil(self.spec.lifetime_s))], self.plan.keeper
        kw = self._create_kwargs(command, user=user, env=sandbox_env({}, home=HOME), workdir=WORKSPACE,
                                 expires_in=self.spec.lifetime_s, stdin=self.spec.oneshot)
        try:
            container = self._create(kw)
        finally:
            if self._disk is not None:
                self._disk.result()  # the workspace is ready (or its error raised) before anything runs
        if self.spec.oneshot:
            # Attach before start: not one byte of output can be missed, and stdin is ours from the start.
            self._armed = self.backend.call(lambda c: c.api.attach_socket(
                container.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}))
        self._start(container)
        self._keeper_id = container.id
        if not self.spec.oneshot:
            # The first exec armed ahead (a warm-pool member's only one): its process is started now, so the run
            # costs no `docker exec` (~30 ms); later execs start their own.
            self._armed_exec = self._start_exec(["/bin/sh", "-c", ARMED], sandbox_env({}, home=HOME), WORKSPACE,
                                                self.plan.user)

    # -- running --

    async def exec(self, request: ExecSpec) -> ExecResult:
        run = self._exec_oneshot if self.spec.oneshot else self._exec_in_session
        # Abandon the worker thread on cancellation: close() (shielded, in the runner) kills the container,
        # which ends the thread's stream.
        return await anyio.to_thread.run_sync(self._guarded, run, request, abandon_on_cancel=True)

    def _guarded(self, run: Callable[[ExecSpec, ProxyRun | None], ExecResult], request: ExecSpec
                 ) -> ExecResult:
        import docker

        door = self.egress.start_run(request.egress) if self.egress is not None else None
        try:
            result = run(request, door)
            if door is None:
                return result
            if result.exit_code == 127 and re.search(r"failed to run command .python3.: No such file", result.stderr):
                raise BackendUnavailableError(
                    f"the image {self.plan.image} has no python3, which network mode proxy runs in the sandbox "
                    "to reach its proxy", backend="docker", env_var="CODE_EXEC_DOCKER_IMAGE",
                    fix="add python3 to the image, or unset CODE_EXEC_DOCKER_IMAGE for the default image")
            attempts, dropped = self.egress.finish_run(door) if self.egress else ([], 0)
            door = None
            return with_egress(result, attempts, dropped)
        except docker.errors.NotFound as exc:
            raise SandboxError(f"the sandbox container is gone (removed or killed from outside?): "
                               f"{exc.explanation or exc}", backend="docker") from None
        except docker.errors.APIError as exc:
            if "is not running" in str(exc.explanation or exc):
                raise self._stopped_error() from None
            raise SandboxError(f"the Docker engine refused: {exc.explanation or exc}", backend="docker") from None
        finally:
            if door is not None and self.egress is not None:
                self.egress.finish_run(door, settle_s=0)

    def _stopped_error(self) -> SandboxError:
        """Why the session's container is no longer running, as the caller should read it."""
        if self._state().get("OOMKilled"):  # killed by the kernel at its memory limit
            return SandboxError(
                f"the session's container was killed at its memory limit ({self.plan.limits.memory_mb} MiB): "
                "the whole sandbox, not one process, as under gVisor, whose kernel the container's cgroup "
                "holds too. Open a new sandbox, with a higher limit (limits.memory_mb) or doing less per run",
                backend="docker")
        return SandboxError(f"the session's container has stopped: its lifetime of {self.spec.lifetime_s:g} s is "
                            "over, or it was stopped from outside. Open a new sandbox (lifetime_s sets how long "
                            "one lives)", backend="docker")

    def _state(self) -> dict[str, Any]:
        """The session container's State as docker inspect reports it; {} when it is gone or unreachable."""
        if self._keeper_id is None:
            return {}
        try:
            return self.backend.call(lambda c: c.api.inspect_container(self._keeper_id)).get("State") or {}
        except Exception:  # noqa: BLE001 - gone or unreachable: the caller reports the stopped container as it is
            return {}

    def _command(self, request: ExecSpec, door: ProxyRun | None) -> tuple[list[str], dict[str, str]]:
        """The container's command (under the backstop; behind the proxy's forwarder in mode proxy) and env."""
        # HOSTNAME as docker sets it for a container's own process and an exec: an armed command's env -i drops it.
        env = {"HOSTNAME": "sandbox", **sandbox_env(request.env, home=HOME)}
        argv = request.argv
        if door is not None and self.egress is not None:
            env.update(self.egress.env(request.egress))
            argv = EgressProxy.command(door, argv)
        return backstop(argv, request.timeout + BACKSTOP_GRACE_S), env

    def _exec_oneshot(self, request: ExecSpec, door: ProxyRun | None = None) -> ExecResult:
        command, env = self._command(request, door)
        script = armed_script(command, env, request.workdir, backend="docker")
        with self._lock:
            container_id, sock_io, self._armed = self._keeper_id, self._armed, None
        if container_id is None or sock_io is None:
            raise SandboxError("this one-shot sandbox has run its command already, or was closed", backend="docker")
        out, err = request.captures()
        started = time.monotonic()

        def kill() -> None:
            with contextlib.suppress(Exception):
                self.backend.call(lambda c: c.api.kill(container_id))
        timed_out = self._stream(sock_io, script + (request.stdin or b""), started + request.timeout, out, err, kill)
        exit_code, oom = self._exit_state(container_id)
        duration = time.monotonic() - started
        # The container is removed with the session (close): for a pool member, after the result is returned.
        return build_result(exit_code=exit_code, stdout=out, stderr=err, timed_out=timed_out, oom_killed=oom,
                            duration_s=duration)

    def _start(self, container: Any) -> None:
        import docker

        try:
            self.backend.call(lambda c: container.start())
        except docker.errors.APIError as exc:
            message = str(exc.explanation or exc)
            if "not found" in message or "no such file" in message:
                raise BackendUnavailableError(
                    f"the image {self.plan.image} lacks what execbox runs in every container (coreutils `timeout`, "
                    f"`sleep` and `head`, and /bin/sh): {message}", backend="docker",
                    fix="add coreutils and a POSIX shell to the image, or unset CODE_EXEC_DOCKER_IMAGE for the "
                        "default image", env_var="CODE_EXEC_DOCKER_IMAGE") from None
            raise SandboxError(f"the engine could not start the container: {message}", backend="docker") from None

    def _exit_state(self, container_id: str) -> tuple[int | None, bool]:
        """(exit code, OOM-killed) of a one-shot's container, once it has exited. Like an exec in a session, the
        OOM flag is looked up only for a SIGKILLed command (137)."""
        import requests

        try:
            code = self.backend.call(lambda c: c.api.wait(container_id, timeout=10)).get("StatusCode")
        except requests.exceptions.RequestException:
            with contextlib.suppress(Exception):
                self.backend.call(lambda c: c.api.kill(container_id))
            code = None
        if code is None or code == 137:
            state = self.backend.call(lambda c: c.api.inspect_container(container_id)).get("State", {})
            return state.get("ExitCode"), bool(state.get("OOMKilled"))
        return int(code), False

    def _exec_in_session(self, request: ExecSpec, door: ProxyRun | None = None) -> ExecResult:
        if self._broken:
            raise SandboxError(f"this session is broken: {self._broken}. Open a new sandbox", backend="docker")
        command, env = self._command(request, door)
        out, err = request.captures()
        script = armed_script(command, env, request.workdir, backend="docker")
        with self._lock:
            armed, self._armed_exec = self._armed_exec, None
        if armed is not None:  # the first exec: its process is already running, waiting for the script
            exec_id, sock_io = armed
            stdin = script + (request.stdin or b"")
        else:
            exec_id, sock_io = self._start_exec(command, env, request.workdir, self.plan.user)
            stdin = request.stdin or b""
        started = time.monotonic()
        stopped = False

        def alive() -> bool:  # asked in silences: a container dead under its exec leaves the exec's stream open
            nonlocal stopped
            stopped = self._state().get("Running") is False
            return not stopped

        timed_out = self._stream(sock_io, stdin, started + request.timeout, out, err, self._kill_sandbox_user, alive)
        if stopped:
            raise self._stopped_error()
        exit_code = None if timed_out else self._exec_exit_code(exec_id)  # a timed-out result has its own code
        if exit_code is not None and not 0 <= exit_code < 128 and self._state().get("Running") is False:
            # The stream may also end because the container died under the exec (gVisor's Sentry at its memory
            # limit): its code is then the engine's, not the command's
            raise self._stopped_error()
        duration = time.monotonic() - started
        oom = exit_code == 137 and not timed_out and self._new_oom_kills()
        return build_result(exit_code=exit_code, stdout=out, stderr=err, timed_out=timed_out, oom_killed=oom,
                            duration_s=duration)

    def _start_exec(self, command: list[str], env: dict[str, str], workdir: str, user: str) -> tuple[str, Any]:
        """``command`` started in the session's container as ``user``: (exec id, its hijacked socket)."""
        cid = self._keeper_id
        exec_id: str = self.backend.call(lambda c: c.api.exec_create(
            cid, command, stdin=True, stdout=True, stderr=True, user=user, environment=env,
            workdir=workdir))["Id"]
        return exec_id, self.backend.call(lambda c: c.api.exec_start(exec_id, socket=True))

    def _quick_exec(self, argv: list[str], user: str) -> bytes | None:
        """``argv``'s output, or None when it did not end within _QUICK_S. Read like any exec, with a deadline:
        docker-py's exec_run reads its output with no timeout at all."""
        _, sock_io = self._start_exec(argv, {}, "/", user)
        out, err = BoundedCapture(1 << 16), BoundedCapture(1 << 16)
        if self._stream(sock_io, b"", time.monotonic() + _QUICK_S, out, err, lambda: None):
            return None
        return out.getvalue()

    def _kill_sandbox_user(self) -> None:
        # Every process of the sandbox uid, setsid'd grandchildren and fork bombs included (kill(-1) is atomic
        # against fork). PID 1 and the keep-alive run as another uid, so the session survives.
        if self._quick_exec(["/bin/sh", "-c", "kill -9 -1"], self.plan.user) is None:
            # The kill did not come back: whatever it left running, the container goes with it.
            self._broken = f"the kill at a deadline did not finish within {_QUICK_S:g} s"
            with contextlib.suppress(Exception):
                self.backend.call(lambda c: c.api.kill(self._keeper_id))

    def _exec_exit_code(self, exec_id: str) -> int:
        deadline = time.monotonic() + _GRACE_S
        while True:
            info = self.backend.call(lambda c: c.api.exec_inspect(exec_id))
            if not info.get("Running") or time.monotonic() > deadline:
                code = info.get("ExitCode")
                return 137 if code is None else int(code)
            time.sleep(0.05)

    def _new_oom_kills(self) -> bool:
        """Did the memory cgroup kill something since we last looked? (cgroup v1 oom_control, v2 memory.events)"""
        script = "cat /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events 2>/dev/null"
        text = (self._quick_exec(["/bin/sh", "-c", script], self.plan.keeper) or b"").decode()
        match = re.search(r"^oom_kill (\d+)", text, re.MULTILINE)
        if not match:
            return False
        count = int(match.group(1))
        new, self._oom_seen = count > self._oom_seen, count
        return new

    # -- files: the workspace is a host directory; never follow a link the sandbox planted --

    async def write_file(self, path: str, data: bytes) -> None:
        owner = self.host_owner
        await anyio.to_thread.run_sync(lambda: safe_write(self.host_workspace, path, data, owner=owner))

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        owner = self.host_owner  # as the sandbox user: a file the code made unreadable stays unread
        return await anyio.to_thread.run_sync(lambda: safe_read(self.host_workspace, path, max_bytes=max_bytes,
                                                                owner=owner))

    async def snapshot(self, place: SnapshotPlace, *, memory: bool) -> SnapshotParts:
        # The root filesystem is read-only: besides the workspace (the runner's part) only the tmpfs paths change,
        # /tmp holding HOME and what pip installs with --user.
        await pack_sandbox_paths(self, place, [TMPFS, *self.spec.tmpfs], limits=snapshot_limits(self.backend.shared))
        return SnapshotParts(memory=False, source=self.plan.image)

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self._close_blocking)

    def _close_blocking(self) -> None:
        with self._lock:
            self._closed = True
            containers = list(self._containers)
            unused = (self._armed, self._armed_exec[1] if self._armed_exec else None)  # armed, never used
            self._armed = self._armed_exec = None
            streaming = list(self._streams)
        # A stream still being read (an abandoned exec's) is cut first: unread, it would hold the removal
        # (see _stream). Shut down, not closed: the thread reading it closes it.
        for sock in streaming:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for sock_io in unused:
            if sock_io is not None:
                with contextlib.suppress(Exception):
                    close(sock_io, getattr(sock_io, "_sock", sock_io))
        for cid in containers:
            with contextlib.suppress(Exception):
                self._remove(cid)
        if self.egress is not None:
            self.egress.close()
        if self._disk is not None:
            concurrent.futures.wait([self._disk])
        if self._sized:  # the containers are gone: nothing holds the mount any more
            release_sized(self.host_workspace)
        remove_tree(self.host_workspace)
