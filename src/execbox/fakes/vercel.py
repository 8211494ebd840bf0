"""A stand-in for the Vercel Sandbox SDK (``vercel`` 0.12 / ``vercel-sandbox`` 0.10, the function-style API),
at the SDK's own boundary.

Use it in tests::

    with execbox.fakes.vercel.installed() as service:
        os.environ.update(service.credentials)       # VERCEL_TOKEN, VERCEL_PROJECT_ID, VERCEL_TEAM_ID
        from vercel.sandbox import sync             # -> this fake
        ...
        service.calls_to("create_sandbox")           # the exact arguments the code under test sent

Same names, signatures and exceptions as the real SDK for what execbox's vercel_sandbox backend uses
(checked against the installed SDK by tests/fakes/test_fake_surfaces.py): ``vercel.sandbox.sync``'s
``create_sandbox``/``get_sandbox``/``query_sandboxes``, ``NetworkPolicy``, ``SandboxResources``,
``TagFilter``, ``SandboxQueryByCreatedAt``, ``CompletedProcess``, the sandbox handle's ``run_process``,
``fs.read_bytes``/``fs.write_bytes``, ``stop``/``destroy`` and properties, and the ``Sandbox*Error``
classes. Each sandbox is a local box (``_box.py``): commands really run, ``NetworkPolicy.custom(...)`` (an
allowlist: nothing one could name is reachable from these machines, so no network here), ``NetworkPolicy.deny_all()``
really has no network, ``kill_after`` really kills, the ``execution_time_limit`` really stops the session.

Behaviour copied from the SDK: sandboxes are addressed by name; credentials are resolved on the first
API call (``VERCEL_OIDC_TOKEN``, or ``VERCEL_TOKEN`` + ``VERCEL_PROJECT_ID`` + ``VERCEL_TEAM_ID``), and
missing ones raise ``SandboxCredentialsError``; extra keyword arguments that do not start with ``__``
raise TypeError; ``run_process`` follows ``subprocess.run``: with ``stdout=None`` the output goes to the
local ``sys.stdout`` (not captured), ``capture_output``/``PIPE`` capture whole strings, a text stream
receives each chunk as it arrives; a stopped sandbox is resumed lazily by the next process or file call
(a non-persistent one comes back empty); relative paths resolve against ``/vercel/sandbox``; a missing
file raises ``SandboxPathNotFoundError``; a 404 is a ``SandboxApiError`` with ``status_code == 404``.

Assumed, because the SDK cannot say: a process killed by a signal (``kill_after``) reports
``128 + signal``. Not modelled: sources, snapshots, drives/mounts, ports/routes, custom network policies,
``sudo`` users, interactive sessions, the async API. Output is decoded as UTF-8 with replacement.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import enum
import os
import posixpath
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Literal, TextIO

from execbox.fakes import _box
from execbox.fakes._common import Service, module, modules_installed

CWD = "/vercel/sandbox"
_service: FakeVercel | None = None


def _svc() -> FakeVercel:
    if _service is None:
        raise RuntimeError("the vercel fake is not installed: use `with execbox.fakes.vercel.installed():`")
    return _service


# --- errors -------------------------------------------------------------------------------------------


class VercelError(Exception):
    pass


class SandboxError(VercelError):
    pass


class _Response:
    """The little of an httpx Response that SandboxApiError exposes."""

    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class SandboxApiError(SandboxError):
    def __init__(self, response: Any, message: str, *, data: object | None = None) -> None:
        super().__init__(message)
        self.response = response
        self.status_code = response.status_code
        self.data = data
        self.code = data.get("code") if isinstance(data, dict) else None


class SandboxCredentialsError(SandboxError):
    pass


class SandboxTimeoutError(SandboxError):
    pass


class SandboxTerminalStateError(SandboxError):
    def __init__(self, message: str, *, status: Any, sandbox: object | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.sandbox = sandbox


class SandboxFilesystemError(SandboxError):
    pass


class SandboxFilesystemWriteError(SandboxFilesystemError):
    def __init__(self, message: str, *, paths: Sequence[str], cwd: str | None, cause: BaseException | None) -> None:
        super().__init__(message)
        self.paths = tuple(paths)
        self.cwd = cwd
        self.cause = cause


class SandboxPathNotFoundError(SandboxFilesystemError):
    def __init__(self, path: str, *, operation: str, cwd: str | None, cause: Any) -> None:
        super().__init__(f"{operation}: no such file or directory: {path}")
        self.path = path
        self.operation = operation
        self.cwd = cwd
        self.cause = cause


ERRORS = {c.__name__: c for c in (
    SandboxError, SandboxApiError, SandboxCredentialsError, SandboxTimeoutError, SandboxTerminalStateError,
    SandboxFilesystemError, SandboxFilesystemWriteError, SandboxPathNotFoundError,
)}


def _api_error(status: int, message: str) -> SandboxApiError:
    return SandboxApiError(_Response(status), message, data={"error": {"code": str(status), "message": message}})


# --- models -------------------------------------------------------------------------------------------


class SandboxStatus(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    ABORTED = "aborted"
    SNAPSHOTTING = "snapshotting"


@dataclasses.dataclass(frozen=True)
class NetworkPolicy:
    mode: Literal["allow-all", "deny-all", "custom"]
    allow: Mapping[str, tuple[Any, ...]]
    subnets: Any = None

    @classmethod
    def allow_all(cls) -> NetworkPolicy:
        return cls(mode="allow-all", allow=MappingProxyType({}))

    @classmethod
    def deny_all(cls) -> NetworkPolicy:
        return cls(mode="deny-all", allow=MappingProxyType({}))

    @classmethod
    def custom(cls, allow: Any = (), subnets: Any = None) -> NetworkPolicy:
        return cls(mode="custom", allow=MappingProxyType({d: tuple(r) for d, r in dict(allow).items()}),
                   subnets=subnets)


@dataclasses.dataclass(frozen=True)
class NetworkPolicySubnets:
    allow: tuple[str, ...] | None = None
    deny: tuple[str, ...] | None = None

    def __init__(self, *, allow: Any = None, deny: Any = None) -> None:
        object.__setattr__(self, "allow", None if allow is None else tuple(allow))
        object.__setattr__(self, "deny", None if deny is None else tuple(deny))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxResources:
    vcpus: int | None = None
    memory: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TagFilter:
    key: str
    value: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxQueryByCreatedAt:
    sort_order: Literal["asc", "desc"] = "desc"
    tag: TagFilter | None = None


@dataclasses.dataclass(slots=True)
class CompletedProcess:
    id: str
    name: str
    args: tuple[str, ...]
    cwd: str
    session_id: str
    started_at: int
    returncode: int
    stdout: str | None
    stderr: str | None

    def check_returncode(self) -> None:
        if self.returncode:
            raise subprocess.CalledProcessError(self.returncode, self.args, self.stdout, self.stderr)


# --- the provider -------------------------------------------------------------------------------------


class FakeVercel(Service):
    """The fake Vercel Sandbox service: the accepted token, the sandboxes (by name), and the call record."""

    def __init__(self) -> None:
        super().__init__()
        self.credentials = {"VERCEL_TOKEN": "vcp_fake_" + uuid.uuid4().hex,
                            "VERCEL_PROJECT_ID": "prj_fake", "VERCEL_TEAM_ID": "team_fake"}
        self.sandboxes: dict[str, SyncSandbox] = {}

    def authenticate(self) -> None:
        """The SDK's credential resolution (vercel.oidc.credentials.get_credentials), then the server's check."""
        token = os.environ.get("VERCEL_OIDC_TOKEN")
        project, team = os.environ.get("VERCEL_PROJECT_ID"), os.environ.get("VERCEL_TEAM_ID")
        if not token:
            token = os.environ.get("VERCEL_TOKEN")
            if not (token and project and team):
                raise SandboxCredentialsError(
                    "Missing credentials. For local development, run 'vercel link && vercel env pull'. "
                    "Otherwise, set VERCEL_TOKEN, VERCEL_PROJECT_ID, and VERCEL_TEAM_ID.")
        elif not (project and team):
            raise SandboxCredentialsError(
                "OIDC token present but could not determine VERCEL_PROJECT_ID and VERCEL_TEAM_ID")
        if (token, project, team) != (self.credentials["VERCEL_TOKEN"], self.credentials["VERCEL_PROJECT_ID"],
                                      self.credentials["VERCEL_TEAM_ID"]):
            raise _api_error(403, "Not authorized: invalid token, project or team")

    def close(self) -> None:
        for sb in list(self.sandboxes.values()):
            sb._destroyed()


def _private(fn: str, params: Mapping[str, Any]) -> None:
    bad = sorted(k for k in params if not k.startswith("__"))
    if bad:
        raise TypeError(f"{fn}() got unexpected keyword arguments: {', '.join(bad)}")


def _seconds(value: int | float | timedelta | None) -> float | None:
    return value.total_seconds() if isinstance(value, timedelta) else value


def create_sandbox(
    *,
    name: str | None = None,
    image: str | None = None,
    source: Any = None,
    ports: list[int] | None = None,
    execution_time_limit: int | float | timedelta | None = None,
    resources: SandboxResources | None = None,
    persistent: bool | None = None,
    network_policy: NetworkPolicy | None = None,
    network_id: str | None = None,
    env: Mapping[str, str] | None = None,
    tags: Mapping[str, str] | None = None,
    mounts: Mapping[Any, Any] | None = None,
    snapshot_expiration: Any = None,
    snapshot_retention: Any = None,
    region: str | None = None,
    failover_regions: Iterable[str] | None = None,
    destroy: bool = True,
    **private_parameters: Any,
) -> _ManagedSyncSandbox:
    svc = _svc()
    svc.record("create_sandbox", name=name, image=image, source=source, ports=ports,
               execution_time_limit=execution_time_limit, resources=resources, persistent=persistent,
               network_policy=network_policy, network_id=network_id, env=env, tags=tags, mounts=mounts,
               region=region, failover_regions=failover_regions, destroy=destroy, **private_parameters)
    _private("create_sandbox", private_parameters)
    for what, value in (("sources", source), ("ports", ports), ("network_id", network_id), ("mounts", mounts),
                        ("snapshots", snapshot_expiration or snapshot_retention)):
        if value:
            raise NotImplementedError(f"the vercel fake does not model {what}; extend execbox/fakes/vercel.py")
    if network_policy is not None and network_policy.mode == "custom" and any(network_policy.allow.values()):
        raise NotImplementedError("the vercel fake does not model network policy rules (transforms, forwards)")
    svc.authenticate()
    with svc.lock:
        name = name or f"sbx-{uuid.uuid4().hex[:16]}"
        if name in svc.sandboxes:
            raise _api_error(409, f"a sandbox named {name!r} already exists")
        sb = _ManagedSyncSandbox(name=name, image=image, resources=resources or SandboxResources(),
                                 persistent=bool(persistent),
                                 network_policy=network_policy or NetworkPolicy.allow_all(),
                                 env=dict(env or {}), tags=dict(tags or {}),
                                 execution_time_limit=_seconds(execution_time_limit) or 300.0, destroy=destroy)
        svc.sandboxes[name] = sb
        try:
            sb._resume()  # create_sandbox returns once the sandbox is ready
        except BaseException:
            svc.sandboxes.pop(name, None)
            raise
    return sb


def get_sandbox(*, name: str, include_system_routes: bool | None = None, **private_parameters: Any) -> SyncSandbox:
    svc = _svc()
    svc.record("get_sandbox", name=name, include_system_routes=include_system_routes)
    _private("get_sandbox", private_parameters)
    svc.authenticate()
    if name not in svc.sandboxes:
        raise _api_error(404, f"Sandbox not found: {name}")
    return svc.sandboxes[name]


def query_sandboxes(*, query: SandboxQueryByCreatedAt | None = None, page_size: int | None = None,
                    cursor: str | None = None) -> Iterator[SyncSandbox]:
    svc = _svc()
    svc.record("query_sandboxes", query=query, page_size=page_size, cursor=cursor)
    svc.authenticate()
    if query is not None and not isinstance(query, SandboxQueryByCreatedAt):
        raise NotImplementedError("the vercel fake models only SandboxQueryByCreatedAt")
    found = sorted(svc.sandboxes.values(), key=lambda s: s.created_at,
                   reverse=query is None or query.sort_order == "desc")
    tag = query.tag if query else None
    return iter([s for s in found if tag is None or s.tags.get(tag.key) == tag.value])


class SyncSandboxFilesystem:
    """``sb.fs``: paths absolute or relative to ``cwd`` (default the sandbox cwd, /vercel/sandbox)."""

    def __init__(self, sandbox: SyncSandbox) -> None:
        self._sb = sandbox

    def _path(self, path: Any, cwd: Any) -> str:
        path = str(path)
        return path if path.startswith("/") else posixpath.normpath(posixpath.join(str(cwd or self._sb.cwd), path))

    def read_bytes(self, path: Any, *, cwd: Any = None) -> bytes:
        _svc().record_on(self._sb.name, "fs.read_bytes", str(path), cwd=cwd)
        rc, data = _box.read_file(self._sb._resume(), self._path(path, cwd))
        if rc == 2:
            raise SandboxPathNotFoundError(str(path), operation="read_bytes", cwd=cwd,
                                           cause=_api_error(404, "not found"))
        if rc:
            raise SandboxFilesystemError(f"read_bytes({path}) failed with status {rc}")
        return data

    def write_bytes(self, path: Any, data: bytes, *, cwd: Any = None, mode: int | None = None) -> None:
        _svc().record_on(self._sb.name, "fs.write_bytes", str(path), f"<{len(data)} bytes>", cwd=cwd, mode=mode)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("data must be bytes-like")
        target = self._path(path, cwd)
        rc = _box.write_file(self._sb._resume(), target, bytes(data))
        if rc:
            raise SandboxFilesystemWriteError(f"write failed with status {rc}", paths=[str(path)], cwd=cwd, cause=None)
        if mode is not None:
            self._sb._resume().run(["chmod", f"{mode:o}", target], cwd="/")


class SyncSandbox:
    """A Vercel sandbox handle (a local box in the fake)."""

    def __init__(self, *, name: str, image: str | None, resources: SandboxResources, persistent: bool,
                 network_policy: NetworkPolicy, env: dict[str, str], tags: dict[str, str],
                 execution_time_limit: float) -> None:
        self._service = _svc()
        self._name = name
        self.image = image
        self.vcpus = resources.vcpus or 2
        self.memory = resources.memory or self.vcpus * 2048
        self.persistent = persistent
        self.network_policy = network_policy
        self.env = env
        self._tags = tags
        self.execution_time_limit = execution_time_limit
        self.created_at = time.time()
        self._status = SandboxStatus.PENDING
        self._box: _box.Box | None = None
        self._timer: threading.Timer | None = None
        self._session = 0
        self.fs = SyncSandboxFilesystem(self)

    # properties of the real handle
    @property
    def name(self) -> str:
        return self._name

    @property
    def status(self) -> SandboxStatus:
        return self._status

    @property
    def tags(self) -> dict[str, str]:
        return dict(self._tags)

    @property
    def cwd(self) -> str:
        return CWD

    @property
    def current_session_id(self) -> str:
        return f"{self._name}-s{self._session}"

    def _resume(self) -> _box.Box:
        """Session-bound calls resume a stopped sandbox lazily, as the SDK does."""
        with self._service.lock:
            if self._name not in self._service.sandboxes:
                raise _api_error(404, f"Sandbox not found: {self._name}")
            if self._box is not None and self._status == SandboxStatus.RUNNING:
                return self._box
            network = "allow" if self.network_policy.mode == "allow-all" else "none"
            memory_mb = self.memory
            if self._box is None:
                self._box = _box.Box(network=network, dirs=(CWD,), memory_mb=memory_mb)
            else:
                self._box.start()
            self._session += 1
            self._status = SandboxStatus.RUNNING
            self._timer = threading.Timer(self.execution_time_limit, self._session_ended)
            self._timer.daemon = True
            self._timer.start()
            return self._box

    def _session_ended(self) -> None:
        with self._service.lock:
            if self._timer is not None:
                self._timer.cancel()
            box = self._box
            if box is not None:
                if self.persistent:
                    box.stop()
                else:
                    box.destroy()  # a non-persistent sandbox keeps nothing across sessions
                    self._box = None
            self._status = SandboxStatus.STOPPED

    def _destroyed(self) -> None:
        self._session_ended()
        with self._service.lock:
            self._service.sandboxes.pop(self._name, None)
            if self._box is not None:
                self._box.destroy()
                self._box = None

    def run_process(self, command: str, args: Sequence[str] | None = None, *, cwd: str | None = None,
                    env: Mapping[str, str] | None = None, sudo: bool = False,
                    kill_after: float | timedelta | None = None, check: bool = False,
                    stdout: TextIO | int | None = None, stderr: TextIO | int | None = None,
                    capture_output: bool = False, input: str | bytes | bytearray | memoryview | None = None,
                    on_start: Any = None) -> CompletedProcess:
        svc = _svc()
        svc.record_on(self._name, "run_process", command, list(args or []), cwd=cwd, env=env, sudo=sudo,
                   kill_after=kill_after, check=check, stdout=stdout, stderr=stderr,
                   capture_output=capture_output, input=None if input is None else f"<{len(input)} bytes>")
        if capture_output and (stdout is not None or stderr is not None):
            raise ValueError("stdout and stderr arguments may not be used with capture_output.")
        if stdout == subprocess.STDOUT:
            raise ValueError("STDOUT is only supported for stderr")
        if on_start is not None:
            raise NotImplementedError("the vercel fake does not model on_start")
        if capture_output:
            stdout = stderr = subprocess.PIPE
        svc.authenticate()
        box = self._resume()
        full_env = {"PATH": _box.PATH, "HOME": "/home/vercel-sandbox", **self.env, **dict(env or {})}
        work = cwd or CWD
        proc = box.popen([command, *(args or [])], cwd=work, env=full_env,
                         stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
        data = input.encode() if isinstance(input, str) else (bytes(input) if input is not None else None)
        out_target = _Target(stdout, sys.stdout)
        err_target = out_target if stderr == subprocess.STDOUT else _Target(stderr, sys.stderr)
        timeout = _seconds(kill_after)
        timed_out = _stream(proc, data, out_target, err_target, timeout)
        raw = proc.wait()
        code = 128 + 9 if timed_out else (128 - raw if raw < 0 else raw)
        result = CompletedProcess(id="cmd_" + uuid.uuid4().hex[:16], name=command, args=(command, *(args or [])),
                                  cwd=work, session_id=self.current_session_id, started_at=int(time.time() * 1000),
                                  returncode=code, stdout=out_target.captured(),
                                  stderr=None if err_target is out_target else err_target.captured())
        if check:
            result.check_returncode()
        return result

    def stop(self) -> SyncSandbox:
        _svc().record_on(self._name, "stop")
        _svc().authenticate()
        self._session_ended()
        return self

    def destroy(self, *, delete_orphan_snapshots: bool = False) -> SyncSandbox:
        _svc().record_on(self._name, "destroy", delete_orphan_snapshots=delete_orphan_snapshots)
        _svc().authenticate()
        if self._name not in self._service.sandboxes:
            raise _api_error(404, f"Sandbox not found: {self._name}")
        self._destroyed()
        return self


class _ManagedSyncSandbox(SyncSandbox):
    """What ``create_sandbox`` returns: also a context manager that stops (and by default destroys) it."""

    def __init__(self, *, destroy: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._destroy_on_exit = destroy

    def __enter__(self) -> _ManagedSyncSandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        if self._destroy_on_exit:
            self.destroy(delete_orphan_snapshots=True)


class _Target:
    """Where one stream goes, with run_process's conventions."""

    def __init__(self, dest: TextIO | int | None, inherited: TextIO) -> None:
        self.chunks: list[str] | None = [] if dest == subprocess.PIPE else None
        dropped = dest in (subprocess.PIPE, subprocess.DEVNULL)
        self.stream = None if dropped else (dest if dest is not None else inherited)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        if not text:
            return
        if self.chunks is not None:
            self.chunks.append(text)
        elif self.stream is not None:
            self.stream.write(text)  # type: ignore[union-attr]
            self.stream.flush()  # type: ignore[union-attr]

    def captured(self) -> str | None:
        return None if self.chunks is None else "".join(self.chunks)


def _stream(proc: subprocess.Popen[bytes], data: bytes | None, out: _Target, err: _Target,
            timeout: float | None) -> bool:
    """Deliver the output chunk by chunk, from one thread, as the SDK's log stream does. True if killed."""
    import selectors

    sel = selectors.DefaultSelector()
    targets: dict[int, _Target] = {}  # by fd
    for pipe, target in ((proc.stdout, out), (proc.stderr, err)):
        assert pipe is not None
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
        targets[pipe.fileno()] = target
    if proc.stdin is not None:
        threading.Thread(target=_feed, args=(proc.stdin, data or b""), daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    killed = False
    linger_until = None
    while sel.get_map():
        now = time.monotonic()
        if deadline is not None and now >= deadline and not killed:
            killed = True
            _box.Box.kill(proc)
        if linger_until is None and (killed or proc.poll() is not None):
            linger_until = now + 1.0  # an escaped process may hold the pipes open; do not wait for it
        if linger_until is not None and now >= linger_until:
            break
        for key, _ in sel.select(0.1):
            chunk = os.read(key.fd, 65536)
            if chunk:
                targets[key.fd].feed(chunk)
            else:
                sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
    for key in list(sel.get_map().values()):
        sel.unregister(key.fileobj)
        key.fileobj.close()  # type: ignore[union-attr]
    sel.close()
    out.feed(b"", final=True)
    if err is not out:
        err.feed(b"", final=True)
    if deadline is not None and not killed:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed = True
            _box.Box.kill(proc)
    return killed


def _feed(pipe: Any, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        pipe.write(data)
    with contextlib.suppress(OSError, ValueError):
        pipe.close()


@contextlib.contextmanager
def installed() -> Iterator[FakeVercel]:
    """Make ``import vercel.sandbox`` / ``from vercel.sandbox import sync`` return this fake."""
    global _service
    if _service is not None:
        raise RuntimeError("the vercel fake is already installed")
    service = FakeVercel()
    members = {
        "create_sandbox": create_sandbox, "get_sandbox": get_sandbox, "query_sandboxes": query_sandboxes,
        "NetworkPolicy": NetworkPolicy, "NetworkPolicySubnets": NetworkPolicySubnets,
        "SandboxResources": SandboxResources, "TagFilter": TagFilter,
        "SandboxQueryByCreatedAt": SandboxQueryByCreatedAt, "CompletedProcess": CompletedProcess,
        "SandboxStatus": SandboxStatus, "SyncSandbox": SyncSandbox, "SyncSandboxFilesystem": SyncSandboxFilesystem,
        **ERRORS,
    }
    sync = module("vercel.sandbox.sync", "Fake vercel.sandbox.sync", members)
    sandbox = module("vercel.sandbox", "Fake vercel.sandbox", {
        "sync": sync, "NetworkPolicy": NetworkPolicy, "NetworkPolicySubnets": NetworkPolicySubnets,
        "SandboxResources": SandboxResources, **ERRORS})
    root = module("vercel", __doc__, {"sandbox": sandbox})
    _service = service
    try:
        with modules_installed({"vercel": root, "vercel.sandbox": sandbox, "vercel.sandbox.sync": sync}):
            yield service
    finally:
        _service = None
        service.close()


__all__ = ["FakeVercel", "installed"]
