"""docker: every run in a hardened container on a real Docker engine (docker-py, extra ``docker``).

The boundary, on every container, with no knob that turns a part of it off:

    network        none by default; egress = a bridge network of our own; host only on request, and
                   then the guard is told this is not a sandbox
    capabilities   all dropped; no-new-privileges; never --privileged, host PID/IPC, added caps
    filesystem     read-only root; /tmp a size-limited tmpfs; exactly one writable host path, the
                   session workspace, at /workspace; never the Docker socket, $HOME or execbox itself
    limits         pids 256, memory 1024 MiB with no swap headroom, 1.0 CPU (CODE_EXEC_* settings)
    user           the caller's uid:gid, or 65534:65534 when execbox runs as root; another uid
                   (CODE_EXEC_DOCKER_USER) only as root, so the workspace is never open to other local users
    init           docker-init as PID 1: signals are delivered and zombies reaped

``_hardened`` checks the final create arguments against that table and refuses anything else, so a
future edit cannot weaken one container by accident.

Runs. The code arrives as a file in the workspace and stdin over the attach socket: nothing but argv
is on a command line. Output is demultiplexed as it streams into the bounded capture (the engine logs
nothing: log driver "none"). The deadline is kept on the host: at the deadline the container (one-shot)
or every process of the sandbox user (session) is SIGKILLed; ``timed_out`` is what execbox saw, never
guessed from an exit code; an OOM kill is read from the engine (one-shot) or the memory cgroup
(session).

Lifecycle. One-shot: create, attach, start, stream, wait, remove; a cancelled caller still gets the
container removed (``close`` marks the session closed, a create that races with it removes itself).
Sessions: one long-lived container whose PID 1 and keep-alive run as a second unprivileged uid, so the
timeout sweep (``kill -9 -1`` as the sandbox user) can never take the session down. Every container
carries labels (owner host:pid:start-time, session, created, expires, workspace) and ``gc`` removes
expired containers and those whose owner process is gone; each process sweeps once at start-up.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import socket
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from pydantic import field_validator

from execbox.backends.docker_image import DEFAULT_TAG
from execbox.core.owner import owner_alive, owner_id
from execbox.core.backend import ExecutionBackend, Session, SessionSpec, Verdict
from execbox.core.envpolicy import sandbox_env
from execbox.core.errors import BackendUnavailableError, ConfigError, SandboxError
from execbox.core.models import Capabilities, ExecRequest, ExecResult, Limits
from execbox.core.output import BoundedCapture
from execbox.core.results import build_result, failed_to_start
from execbox.core.settings import EnvSettings, Settings, setting
from execbox.core.workspace import remove_tree, safe_read, safe_write

LABEL = "io.execbox"
L_OWNER = "io.execbox.owner"
L_SESSION = "io.execbox.session"
L_CREATED = "io.execbox.created"
L_EXPIRES = "io.execbox.expires"
L_WORKSPACE = "io.execbox.workspace"

WORKSPACE = "/workspace"
HOME = "/tmp"
DEFAULT_SOCKET = "unix:///var/run/docker.sock"
NOBODY = "65534:65534"
WORKSPACE_PREFIX = "execbox-docker-"
_CHUNK = 1 << 18
_GRACE_S = 3.0  # after a kill: how long the stream may take to close
_CHECK_TTL_S = 30.0
# Runtimes whose isolation is stronger than a shared-kernel container.
_RUNTIME_ISOLATION = (("runsc", "gvisor"), ("gvisor", "gvisor"), ("kata", "microvm"))


class DockerSettings(EnvSettings):
    """Knobs of the docker backend (the limits are the core's CODE_EXEC_MEMORY_MB/CPUS/PIDS_LIMIT)."""

    image: str = setting("CODE_EXEC_DOCKER_IMAGE", DEFAULT_TAG,
                      "Sandbox image; build the default with `execbox image build`; pin registry images by digest")
    user: str | None = setting("CODE_EXEC_DOCKER_USER", None,
                            "uid[:gid] inside the container; default: yours, or 65534:65534 when execbox runs as "
                            "root; a uid other than yours needs execbox to run as root")
    runtime: str | None = setting("CODE_EXEC_DOCKER_RUNTIME", None,
                               "OCI runtime registered in the engine, e.g. runsc (gVisor); default: the engine's")
    tmpfs_mb: int = setting("CODE_EXEC_DOCKER_TMPFS_MB", 512, "Size of the /tmp tmpfs (counts against memory), MiB", gt=0)
    egress_network: str = setting("CODE_EXEC_DOCKER_EGRESS_NETWORK", "execbox-egress",
                               "Bridge network for network mode egress; created (labelled execbox) when missing")

    @field_validator("user")
    @classmethod
    def _numeric_user(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"\d+(:\d+)?", value):
            raise ValueError("give a numeric uid or uid:gid such as 1000:1000 (names cannot be checked for root)")
        if value is not None and ":" not in value:
            value = f"{value}:{value}"  # docker would otherwise run a bare uid with gid 0
        return value


# --- the engine: which one, and errors that say which ------------------------------------------------


def _resolve_endpoint(environ: dict[str, str] | None = None) -> tuple[str, dict[str, Any], str]:
    """(endpoint URL, DockerClient kwargs, where it came from), following DOCKER_HOST, then the docker
    context (DOCKER_CONTEXT or ~/.docker/config.json), then the default socket; like the docker CLI."""
    import docker
    from docker.context import ContextAPI

    env = dict(os.environ if environ is None else environ)
    params = docker.utils.kwargs_from_env(environment=env)
    if "base_url" in params:
        return params["base_url"], params, "DOCKER_HOST"
    name = env.get("DOCKER_CONTEXT")
    try:
        ctx = ContextAPI.get_context(name)
    except docker.errors.DockerException as exc:
        raise BackendUnavailableError(f"docker context {name!r} cannot be loaded: {exc}", backend="docker",
                                      fix="docker context ls; set DOCKER_CONTEXT to one of them or unset it") from None
    if ctx is None and name:
        raise BackendUnavailableError(f"docker context {name!r} does not exist", backend="docker",
                                      fix="docker context ls; set DOCKER_CONTEXT to one of them or unset it")
    if ctx is not None and ctx.Host and ctx.name != "default":
        # docker-py stores hosts it wrote itself as http+unix://; the CLI writes unix://
        host = re.sub(r"^http\+(unix|npipe)://", r"\1://", ctx.Host)
        params = {"base_url": host}
        if ctx.TLSConfig is not None:
            params["tls"] = ctx.TLSConfig
        return host, params, f"docker context {ctx.name!r}"
    return DEFAULT_SOCKET, {"base_url": DEFAULT_SOCKET}, "the default socket"


def _is_local(endpoint: str) -> bool:
    if endpoint.startswith(("unix://", "npipe://")) or endpoint.startswith("/"):
        return True
    host = re.sub(r"^[a-z+]+://", "", endpoint).split("/")[0].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "127.0.0.1", "::1")


def _unreachable(endpoint: str, origin: str, exc: BaseException) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"cannot reach the Docker engine at {endpoint} (from {origin}): {exc}", backend="docker",
        fix="start the engine (as root: scripts/bootstrap.sh starts dockerd) or point DOCKER_HOST / "
            "DOCKER_CONTEXT at a running one; retrying will not help until then", env_var="DOCKER_HOST")


def connect(environ: dict[str, str] | None = None) -> tuple[Any, str, str]:
    """(docker.DockerClient, endpoint, origin) for the engine the environment selects; raises one
    BackendUnavailableError naming the endpoint when docker-py is missing or the engine does not answer."""
    try:
        import docker
        import requests
    except ImportError:
        raise BackendUnavailableError("docker-py is not installed", backend="docker",
                                      fix="pip install 'execbox[docker]'") from None
    endpoint, params, origin = _resolve_endpoint(environ)
    try:
        client = docker.DockerClient(timeout=60, **params)  # version=None: negotiated, contacts the engine
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
        raise _unreachable(endpoint, origin, exc) from None
    return client, endpoint, origin


# --- the hardening table, checked on the final arguments ---------------------------------------------


def parse_user(user: str) -> tuple[int, int]:
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def default_user() -> str:
    return NOBODY if os.geteuid() == 0 else f"{os.geteuid()}:{os.getegid()}"  # who owns what mkdtemp makes


def _install_dir() -> Path:
    return Path(__file__).resolve().parents[1]


def _contains(outer: Path, inner: Path) -> bool:
    return inner == outer or outer in inner.parents


def _hardened(kw: dict[str, Any], *, socket_path: str | None) -> dict[str, Any]:
    """Refuse create arguments that break the hardening table. Returns ``kw`` unchanged."""
    problems = []
    if kw.get("privileged"):
        problems.append("privileged mode")
    if kw.get("cap_add"):
        problems.append(f"added capabilities {kw['cap_add']}")
    if kw.get("cap_drop") != ["ALL"]:
        problems.append("capabilities not all dropped")
    if "no-new-privileges" not in (kw.get("security_opt") or []):
        problems.append("no-new-privileges missing")
    if not kw.get("read_only"):
        problems.append("a writable root filesystem")
    for ns in ("pid_mode", "ipc_mode", "userns_mode", "uts_mode", "cgroupns"):
        if str(kw.get(ns) or "").startswith(("host", "container:")):
            problems.append(f"{ns}={kw[ns]}")
    if kw.get("devices") or kw.get("device_requests") or kw.get("volumes_from") or kw.get("volumes"):
        problems.append("devices or extra volumes")
    if not kw.get("init"):
        problems.append("no init process")
    uid, gid = parse_user(str(kw.get("user") or "0"))
    if uid == 0 or gid == 0:
        problems.append(f"user {kw.get('user')} (root)")
    for key in ("pids_limit", "mem_limit", "nano_cpus"):
        if not kw.get(key):
            problems.append(f"{key} unset")
    if kw.get("memswap_limit") != kw.get("mem_limit"):
        problems.append("swap headroom (memswap_limit != mem_limit)")
    mounts = kw.get("mounts") or []
    writable = [m for m in mounts if not m.get("ReadOnly")]
    if len(writable) != 1 or writable[0].get("Target") != WORKSPACE or writable[0].get("Type") != "bind":
        problems.append("the one writable mount must be the workspace bind at /workspace")
    for m in writable:
        with contextlib.suppress(OSError):  # a missing source is the engine's error to report
            if os.stat(m.get("Source") or "/").st_mode & 0o022:
                problems.append(f"workspace {m.get('Source')} is writable by other local users")
    forbidden = [Path(os.path.expanduser("~")).resolve(), _install_dir()]
    if socket_path:
        forbidden.append(Path(socket_path).resolve())
    forbidden.append(Path("/var/run/docker.sock").resolve())
    for m in mounts:
        source = Path(m.get("Source") or "/").resolve()
        for bad in forbidden:
            if _contains(source, bad):
                problems.append(f"mount of {source} exposes {bad}")
    if problems:
        raise ConfigError("refused: this container would not be a sandbox: " + "; ".join(problems)
                          + ". The docker backend only starts containers that match its hardening table")
    return kw


# --- streaming: attach/exec sockets, demultiplexed into bounded captures ---------------------------


class _Demux:
    """Docker's multiplexed stream (8-byte header: stream id, 3 pad, big-endian length) into captures."""

    def __init__(self, out: BoundedCapture, err: BoundedCapture) -> None:
        self.sinks = {1: out, 2: err}
        self.header = bytearray()
        self.remaining = 0
        self.sink: BoundedCapture | None = None

    def feed(self, data: memoryview) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.remaining == 0:
                take = min(8 - len(self.header), n - i)
                self.header += data[i:i + take]
                i += take
                if len(self.header) < 8:
                    return
                stream, self.remaining = struct.unpack(">BxxxL", self.header)
                self.header.clear()
                self.sink = self.sinks.get(stream)
                continue
            take = min(self.remaining, n - i)
            if self.sink is not None:
                self.sink.write(bytes(data[i:i + take]))
            i += take
            self.remaining -= take


def _hijacked(sock_io: Any) -> tuple[socket.socket, bytes]:
    """The real socket under docker-py's attach/exec socket, plus any bytes the HTTP layer read ahead."""
    raw = getattr(sock_io, "_sock", sock_io)
    leftover = b""
    response = getattr(sock_io, "_response", None)
    fp = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    raw.setblocking(False)
    if fp is not None:
        with contextlib.suppress(BlockingIOError, OSError, ValueError):
            leftover = fp.read1(_CHUNK) or b""
    return raw, leftover


def _close(sock_io: Any, sock: socket.socket) -> None:
    """Close the hijacked connection at every layer docker-py stacked on it (response, file, socket)."""
    response = getattr(sock_io, "_response", None)
    for closable in (response, sock_io, sock):
        with contextlib.suppress(Exception):
            if closable is not None:
                closable.close()


def _pump(sock: socket.socket, leftover: bytes, stdin: bytes | None, deadline: float,
          out: BoundedCapture, err: BoundedCapture) -> bool:
    """Feed stdin and read output until EOF; True if the deadline came first. Memory stays flat: one
    read buffer and the two bounded captures, however much the program writes."""
    demux = _Demux(out, err)
    if leftover:
        demux.feed(memoryview(leftover))
    data = memoryview(stdin or b"")
    sent = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    sel = selectors.DefaultSelector()
    try:
        if data:
            sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        else:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            sel.register(sock, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            for _, mask in sel.select(remaining):
                if mask & selectors.EVENT_WRITE:
                    try:
                        sent += sock.send(data[sent:sent + _CHUNK])
                    except BlockingIOError:
                        pass
                    except OSError:  # the program closed stdin or exited: the rest is not wanted
                        sent = len(data)
                    if sent >= len(data):
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_WR)
                        sel.modify(sock, selectors.EVENT_READ)
                if mask & selectors.EVENT_READ:
                    try:
                        n = sock.recv_into(buf)
                    except BlockingIOError:
                        continue
                    except OSError:
                        return False
                    if n == 0:
                        return False
                    demux.feed(view[:n])
    finally:
        sel.close()


def _drain(sock: socket.socket, out: BoundedCapture, err: BoundedCapture, seconds: float) -> None:
    """After a kill: read what is left for a moment so the stream closes cleanly; never block."""
    with contextlib.suppress(OSError):
        _pump(sock, b"", None, time.monotonic() + seconds, out, err)


# --- sessions ------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """What every container of a session is made of."""

    image: str
    user: str
    keeper: str  # PID 1 of a persistent session: a second uid the sandbox user cannot signal
    limits: Limits
    network: str
    runtime: str | None
    tmpfs_mb: int
    egress_network: str


class DockerSession(Session):
    workspace = WORKSPACE

    def __init__(self, backend: DockerBackend, spec: SessionSpec, plan: _Plan) -> None:
        self.backend = backend
        self.spec = spec
        self.plan = plan
        self.id = uuid.uuid4().hex[:12]
        self.host_workspace = tempfile.mkdtemp(prefix=WORKSPACE_PREFIX)
        self._owner = parse_user(plan.user)
        # As root: hand the workspace to the sandbox user. Otherwise the sandbox user is the caller
        # (DockerBackend.workspace_access refuses any other), and mkdtemp's 0700 is already right.
        if os.geteuid() == 0:
            os.chown(self.host_workspace, *self._owner)
        self._lock = threading.Lock()
        self._closed = False
        self._containers: set[str] = set()
        self._keeper_id: str | None = None
        self._oom_seen = 0

    # -- container arguments --

    def _labels(self, expires_in: float) -> dict[str, str]:
        now = int(time.time())
        return {LABEL: "1", L_OWNER: owner_id(), L_SESSION: self.id, L_CREATED: str(now),
                L_EXPIRES: str(int(now + expires_in)), L_WORKSPACE: self.host_workspace}

    def _create_kwargs(self, command: list[str], *, user: str, env: dict[str, str], workdir: str,
                       expires_in: float, stdin: bool) -> dict[str, Any]:
        from docker.types import LogConfig, Mount, Ulimit

        p = self.plan
        # The runner passes the effective limits; one missing is left unset, and _hardened refuses it.
        memory = f"{p.limits.memory_mb}m" if p.limits.memory_mb else None
        kw: dict[str, Any] = dict(
            image=p.image, command=command, user=user, environment=env, working_dir=workdir,
            hostname="sandbox", labels=self._labels(expires_in), name=f"execbox-{self.id}-{uuid.uuid4().hex[:6]}",
            cap_drop=["ALL"], security_opt=["no-new-privileges"], read_only=True, init=True, ipc_mode="private",
            tmpfs={"/tmp": f"rw,exec,nosuid,nodev,size={p.tmpfs_mb}m,mode=1777"},
            mounts=[Mount(WORKSPACE, self.host_workspace, type="bind", read_only=False)],
            pids_limit=p.limits.pids, mem_limit=memory, memswap_limit=memory,
            nano_cpus=int(p.limits.cpus * 1e9) if p.limits.cpus else None,
            ulimits=[Ulimit(name="core", soft=0, hard=0)],
            log_config=LogConfig(type=LogConfig.types.NONE), stdin_open=stdin,
        )
        if p.network == "egress":
            kw["network"] = p.egress_network
        else:
            kw["network_mode"] = p.network  # "none" or "host" (the guard has judged host already)
        if p.runtime:
            kw["runtime"] = p.runtime
        return _hardened(kw, socket_path=self.backend.socket_path)

    def _create(self, kw: dict[str, Any]) -> Any:
        container = self.backend.call(lambda c: c.containers.create(**kw))
        with self._lock:
            self._containers.add(container.id)
            closed = self._closed
        if closed:  # the caller gave up while we were creating: leave nothing behind
            self._remove(container.id)
            raise SandboxError("the session was closed while its container was being created", backend="docker")
        return container

    def _remove(self, container_id: str) -> None:
        import docker

        with contextlib.suppress(docker.errors.APIError):  # gone already, or its removal is in progress
            self.backend.call(lambda c: c.api.remove_container(container_id, force=True))
        with self._lock:
            self._containers.discard(container_id)

    # -- persistent session --

    def start(self) -> None:
        kw = self._create_kwargs(["sleep", "infinity"], user=self.plan.keeper, env=sandbox_env({}, home=HOME),
                                 workdir=WORKSPACE, expires_in=self.spec.lifetime_s, stdin=False)
        container = self._create(kw)
        self.backend.call(lambda c: container.start())
        self._keeper_id = container.id

    # -- running --

    async def exec(self, request: ExecRequest) -> ExecResult:
        run = self._exec_oneshot if self.spec.oneshot else self._exec_in_session
        # Abandon the worker thread on cancellation: close() (shielded, in the runner) kills the container,
        # which ends the thread's stream.
        return await anyio.to_thread.run_sync(self._guarded, run, request, abandon_on_cancel=True)

    def _guarded(self, run: Any, request: ExecRequest) -> ExecResult:
        import docker

        try:
            return run(request)
        except docker.errors.NotFound as exc:
            raise SandboxError(f"the sandbox container is gone (removed or killed from outside?): "
                               f"{exc.explanation or exc}", backend="docker") from None
        except docker.errors.APIError as exc:
            raise SandboxError(f"the Docker engine refused: {exc.explanation or exc}", backend="docker") from None

    def _exec_oneshot(self, request: ExecRequest) -> ExecResult:
        assert request.argv and request.timeout and request.max_output_bytes
        env = sandbox_env(request.env, home=HOME)
        kw = self._create_kwargs(request.argv, user=self.plan.user, env=env, workdir=request.workdir or WORKSPACE,
                                 expires_in=request.timeout + 60, stdin=True)
        out, err = BoundedCapture(request.max_output_bytes), BoundedCapture(request.max_output_bytes)
        container = self._create(kw)
        try:
            # Attach before start: not one byte of output can be missed, and stdin is ours from the start.
            sock_io = self.backend.call(lambda c: c.api.attach_socket(
                container.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}))
            sock, leftover = _hijacked(sock_io)
            try:
                started = time.monotonic()
                failed = self._start(container)
                if failed is not None:
                    return failed
                timed_out = _pump(sock, leftover, request.stdin, started + request.timeout, out, err)
                if timed_out:
                    with contextlib.suppress(Exception):
                        self.backend.call(lambda c: container.kill())
                    _drain(sock, out, err, _GRACE_S)
            finally:
                _close(sock_io, sock)
            state = self._final_state(container)
            duration = time.monotonic() - started
        finally:
            self._remove(container.id)
        return build_result(exit_code=state.get("ExitCode"), stdout=out, stderr=err, timed_out=timed_out,
                            oom_killed=bool(state.get("OOMKilled")), duration_s=duration)

    def _start(self, container: Any) -> ExecResult | None:
        """Start the container; a command that cannot be executed is a result (127/126), like a shell's."""
        import docker

        try:
            self.backend.call(lambda c: container.start())
        except docker.errors.APIError as exc:
            message = str(exc.explanation or exc)
            if "executable file not found" in message or "no such file or directory" in message:
                return failed_to_start(127, f"execbox: command not found in the image: {message}")
            if "permission denied" in message:
                return failed_to_start(126, f"execbox: command not executable: {message}")
            raise SandboxError(f"the engine could not start the container: {message}", backend="docker") from None
        return None

    def _final_state(self, container: Any) -> dict[str, Any]:
        import requests

        try:
            self.backend.call(lambda c: c.api.wait(container.id, timeout=10))
        except requests.exceptions.RequestException:
            with contextlib.suppress(Exception):
                self.backend.call(lambda c: container.kill())
        container.reload()
        return container.attrs.get("State", {})

    def _exec_in_session(self, request: ExecRequest) -> ExecResult:
        assert request.argv and request.timeout and request.max_output_bytes and self._keeper_id
        cid = self._keeper_id
        env = sandbox_env(request.env, home=HOME)
        out, err = BoundedCapture(request.max_output_bytes), BoundedCapture(request.max_output_bytes)
        exec_id = self.backend.call(lambda c: c.api.exec_create(
            cid, request.argv, stdin=True, stdout=True, stderr=True, user=self.plan.user, environment=env,
            workdir=request.workdir or WORKSPACE))["Id"]
        sock_io = self.backend.call(lambda c: c.api.exec_start(exec_id, socket=True))
        started = time.monotonic()
        sock, leftover = _hijacked(sock_io)
        try:
            timed_out = _pump(sock, leftover, request.stdin, started + request.timeout, out, err)
            if timed_out:
                self._kill_sandbox_user()
                _drain(sock, out, err, _GRACE_S)
        finally:
            _close(sock_io, sock)
        exit_code = self._exec_exit_code(exec_id)
        duration = time.monotonic() - started
        oom = exit_code == 137 and not timed_out and self._new_oom_kills()
        return build_result(exit_code=exit_code, stdout=out, stderr=err, timed_out=timed_out, oom_killed=oom,
                            duration_s=duration)

    def _quick_exec(self, argv: list[str], user: str) -> bytes:
        cid = self._keeper_id
        result = self.backend.call(lambda c: c.containers.get(cid).exec_run(argv, user=user, demux=False))
        return result.output or b""

    def _kill_sandbox_user(self) -> None:
        # Every process of the sandbox uid, setsid'd grandchildren and fork bombs included (kill(-1) is atomic
        # against fork). PID 1 and the keep-alive run as another uid, so the session survives.
        self._quick_exec(["/bin/sh", "-c", "kill -9 -1"], self.plan.user)

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
        text = self._quick_exec(["/bin/sh", "-c", "cat /sys/fs/cgroup/memory/memory.oom_control "
                                 "/sys/fs/cgroup/memory.events 2>/dev/null"], self.plan.keeper).decode()
        match = re.search(r"^oom_kill (\d+)", text, re.M)
        if not match:
            return False
        count = int(match.group(1))
        new, self._oom_seen = count > self._oom_seen, count
        return new

    # -- files: the workspace is a host directory; never follow a link the sandbox planted --

    async def write_file(self, path: str, data: bytes) -> None:
        owner = self._owner if os.geteuid() == 0 else None
        await anyio.to_thread.run_sync(lambda: safe_write(self.host_workspace, path, data, owner=owner))

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        return await anyio.to_thread.run_sync(lambda: safe_read(self.host_workspace, path, max_bytes=max_bytes))

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self._close_blocking)

    def _close_blocking(self) -> None:
        with self._lock:
            self._closed = True
            containers = list(self._containers)
        for cid in containers:
            with contextlib.suppress(Exception):
                self._remove(cid)
        remove_tree(self.host_workspace)


# --- the backend ---------------------------------------------------------------------------------------


_swept: set[str] = set()
_swept_lock = threading.Lock()


class DockerBackend(ExecutionBackend):
    name = "docker"
    extra = "docker"
    summary = "hardened containers on a Docker engine (DOCKER_HOST / context); gVisor via CODE_EXEC_DOCKER_RUNTIME"
    capabilities = Capabilities(
        sandbox=True,
        isolation="container",
        network_modes=frozenset({"none", "egress", "host"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "cpu", "pids", "wall_time"}),
    )

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.docker = DockerSettings.from_env()
        self.user = self.docker.user or default_user()
        self._client: Any = None
        self.endpoint = ""
        self.origin = ""
        self.socket_path: str | None = None
        self._checked: tuple[float, Capabilities] | None = None
        self._lock = threading.Lock()

    # -- engine access --

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                client, self.endpoint, self.origin = connect()
                if not _is_local(self.endpoint):
                    client.close()
                    raise BackendUnavailableError(
                        f"the Docker engine at {self.endpoint} (from {self.origin}) is not on this machine, and the "
                        "docker backend bind-mounts a local workspace directory", backend="docker",
                        fix="use a local engine (unix socket), or a remote backend", env_var="DOCKER_HOST")
                if self.endpoint.startswith("unix://"):
                    self.socket_path = self.endpoint[len("unix://"):]
                self._client = client
            return self._client

    def call(self, fn: Any) -> Any:
        """Run ``fn(client)``; a dropped engine becomes one non-retryable error naming the endpoint."""
        import docker
        import requests

        client = self.client()
        try:
            return fn(client)
        except docker.errors.ImageNotFound as exc:
            raise self._missing_image(exc) from None
        except (requests.exceptions.ConnectionError, ConnectionRefusedError, FileNotFoundError) as exc:
            raise _unreachable(self.endpoint, self.origin, exc) from None

    def _missing_image(self, exc: BaseException) -> BackendUnavailableError:
        built = self.docker.image == DEFAULT_TAG
        fix = ("build it from Debian's packages, no registry needed (as root): execbox image build"
               if built else f"docker pull/load {self.docker.image}, or unset CODE_EXEC_DOCKER_IMAGE and run "
                             "`execbox image build` for the default image")
        return BackendUnavailableError(f"the sandbox image {self.docker.image} is not on the engine at "
                                       f"{self.endpoint}", backend="docker", fix=fix,
                                       env_var="CODE_EXEC_DOCKER_IMAGE")

    # -- contract --

    async def check(self) -> Capabilities:
        cached = self._checked
        if cached and time.monotonic() - cached[0] < _CHECK_TTL_S:
            return cached[1]
        caps = await anyio.to_thread.run_sync(self._check_blocking)
        self._checked = (time.monotonic(), caps)
        return caps

    def _check_blocking(self) -> Capabilities:
        self.workspace_access()
        info = self.call(lambda c: c.info())
        isolation = self.capabilities.isolation
        runtime = self.docker.runtime
        if runtime:
            known = sorted(info.get("Runtimes") or {})
            if runtime not in known:
                raise BackendUnavailableError(
                    f"CODE_EXEC_DOCKER_RUNTIME={runtime} is not a runtime of the engine at {self.endpoint} "
                    f"(it has: {', '.join(known)})", backend="docker", env_var="CODE_EXEC_DOCKER_RUNTIME",
                    fix=f"register {runtime} in /etc/docker/daemon.json \"runtimes\" and restart dockerd "
                        "(gVisor: runsc install), or unset CODE_EXEC_DOCKER_RUNTIME")
            path = str((info["Runtimes"][runtime] or {}).get("path", runtime))
            for needle, strength in _RUNTIME_ISOLATION:
                if needle in runtime or needle in path:
                    isolation = strength
                    break
        self.call(lambda c: c.images.get(self.docker.image))
        limits = set(self.capabilities.limits)
        for limit, flag in (("memory", "MemoryLimit"), ("pids", "PidsLimit"), ("cpu", "CpuCfsQuota")):
            if info.get(flag) is False:
                limits.discard(limit)
        self._sweep_once()
        return self.capabilities.model_copy(update={"isolation": isolation, "limits": frozenset(limits)})

    def _sweep_once(self) -> None:
        with _swept_lock:
            if self.endpoint in _swept:
                return
            _swept.add(self.endpoint)
        with contextlib.suppress(Exception):  # a start-up sweep must never stop a run
            self._gc_blocking()

    def workspace_access(self) -> None:
        """Refuse a sandbox user this process cannot give a private workspace to. A non-root caller can only
        let another uid write a directory in /tmp by opening it to every local user, and any of them could
        then swap the code file between our write and the run."""
        me = os.geteuid()
        uid, _ = parse_user(self.user)
        if me != 0 and uid != me:
            raise ConfigError(
                f"CODE_EXEC_DOCKER_USER={self.user} is not you (uid {me}): without root, execbox cannot hand "
                "another uid a workspace that other local users cannot also write. Unset CODE_EXEC_DOCKER_USER "
                f"(the code then runs as {me}:{os.getegid()}), set it to your own uid, or run execbox as root "
                "(the workspace is then given to that uid)", backend="docker", env_var="CODE_EXEC_DOCKER_USER")

    def verdict(self, request: ExecRequest) -> Verdict:
        if request.network == "host":
            return Verdict(False, "network mode 'host' shares the host's network with the container")
        uid, gid = parse_user(self.user)
        if uid == 0 or gid == 0:
            return Verdict(False, f"CODE_EXEC_DOCKER_USER={self.user} runs the code as root (uid or gid 0) in the "
                                  "container; unset it or give a non-root uid:gid")
        runtime = f", runtime {self.docker.runtime}" if self.docker.runtime else ""
        return Verdict(True, f"hardened container as {self.user}{runtime}")

    def plan(self, spec: SessionSpec) -> _Plan:
        uid, gid = parse_user(self.user)
        keeper = "65533:65533" if uid != 65533 else "65532:65532"
        return _Plan(image=self.docker.image, user=self.user, keeper=keeper, limits=spec.limits, network=spec.network,
                     runtime=self.docker.runtime, tmpfs_mb=self.docker.tmpfs_mb,
                     egress_network=self.docker.egress_network)

    async def open_session(self, spec: SessionSpec) -> DockerSession:
        if spec.network not in self.capabilities.network_modes:
            raise ConfigError(f"the docker backend cannot enforce network mode {spec.network!r}",
                              backend="docker", env_var="CODE_EXEC_NETWORK")
        self.workspace_access()
        session = DockerSession(self, spec, self.plan(spec))
        try:
            if spec.network == "egress":
                await anyio.to_thread.run_sync(self._ensure_egress_network)
            if not spec.oneshot:
                await anyio.to_thread.run_sync(session.start)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await session.close()
            raise
        return session

    def _ensure_egress_network(self) -> None:
        import docker

        name = self.docker.egress_network
        try:
            self.call(lambda c: c.networks.get(name))
        except docker.errors.NotFound:
            with contextlib.suppress(docker.errors.APIError):  # another process created it meanwhile
                self.call(lambda c: c.networks.create(
                    name, driver="bridge", labels={LABEL: "1"},
                    # no traffic between sandboxes on the same bridge
                    options={"com.docker.network.bridge.enable_icc": "false"}))

    async def gc(self) -> list[str]:
        return await anyio.to_thread.run_sync(self._gc_blocking)

    def _gc_blocking(self) -> list[str]:
        """Remove execbox containers that expired or whose owner process is gone. Only ours: the label filter
        selects them, and a container without our label is never touched."""
        import docker

        removed = []
        now = time.time()
        for item in self.call(lambda c: c.api.containers(all=True, filters={"label": LABEL})):
            labels = item.get("Labels") or {}
            if labels.get(LABEL) != "1":
                continue
            reason = None
            with contextlib.suppress(ValueError):
                if float(labels.get(L_EXPIRES, "inf")) < now:
                    reason = "expired"
            if reason is None and owner_alive(labels.get(L_OWNER, "")) is False:
                reason = "orphaned"
            if reason is None:
                continue
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                self.call(lambda c: c.api.remove_container(item["Id"], force=True))
            if owner_alive(labels.get(L_OWNER, "")) is not None:
                _remove_workspace(labels.get(L_WORKSPACE, ""))
            name = (item.get("Names") or [item["Id"][:12]])[0].lstrip("/")
            removed.append(f"docker container {name} ({reason})")
        return removed


def _remove_workspace(path: str) -> None:
    # Only a directory we would have made: directly in the temp dir, with our prefix.
    if not path:
        return
    p = Path(path)
    if p.parent.resolve() == Path(tempfile.gettempdir()).resolve() and p.name.startswith(WORKSPACE_PREFIX) \
            and not p.is_symlink():
        remove_tree(str(p))
