"""A stand-in for the ``daytona`` SDK (0.2xx), at the SDK's own boundary.

Use it in tests::

    with execbox.fakes.daytona.installed() as service:
        os.environ.update(service.credentials)       # DAYTONA_API_KEY
        from daytona import Daytona                  # -> this fake
        ...
        service.calls_to("Daytona.create")           # the exact params the code under test sent

Same names, signatures and exceptions as the real SDK for what execbox's daytona backend uses (checked
against the installed SDK by tests/fakes/test_fake_surfaces.py): ``Daytona`` (``create``/``get``/``list``),
``DaytonaConfig``, ``CreateSandboxFromImageParams``/``CreateSandboxFromSnapshotParams``, ``Resources``,
``ListSandboxesQuery``, ``FileUpload``, ``FileDownloadRequest``, ``SandboxState``, the sandbox's
``process.exec``, ``fs.upload_file(s)``/``download_file(s)``, ``start``/``stop``/``delete``/``get_work_dir``,
``create_snapshot``, the client's ``snapshot`` service (``get``/``delete``), and the ``Daytona*Error`` classes.
Each sandbox is a local box (``_box.py``): commands really run (in bash, as the SDK documents),
``network_block_all=True`` really has no network (and neither has an allowlist,
``domain_allow_list``/``network_allow_list``: nothing one could name is reachable from these machines),
``Resources.memory`` (GiB) is really a limit, ``stop`` kills every process and keeps the files, ``start`` brings
it back.

Behaviour copied from daytona 0.226 and its daemon: ``exec`` returns stdout and stderr combined in
``result`` (no stderr field); a command killed by a signal reports exit code -1 (Go's ExitCode());
an exec past its ``timeout`` is killed and raises ``DaytonaTimeoutError`` (HTTP 408); relative paths and
``cwd`` resolve against the work dir ``/home/daytona``; ``upload_file`` with a ``str`` source reads that
LOCAL file; ``download_file`` of a missing file raises ``DaytonaFileNotFoundError``, ``download_files``
reports it in ``error``; ephemeral sandboxes are deleted when stopped; ``ttl_minutes`` is a real deadline;
the SDK adds the ``code-toolbox-language`` label; ``sandbox.create_snapshot(name)`` keeps the sandbox's own files
(all of them; the host's userland is no part of a fake snapshot) and its resources as a snapshot of that name
(another of the same name is a conflict), ``CreateSandboxFromSnapshotParams(snapshot=name or id)`` starts a
sandbox with those files and resources (an unknown one is ``DaytonaNotFoundError``), and
``daytona.snapshot.delete(snapshot or its id or name)`` removes one.

Deliberately stricter than the real SDK: unknown parameter names raise TypeError (the real pydantic
models drop them silently, so a typo would go unnoticed). Credentials come from ``DAYTONA_API_KEY`` (or
``DAYTONA_JWT_TOKEN`` + ``DAYTONA_ORGANIZATION_ID``) or ``DaytonaConfig``, not from ``.env`` files.
Not modelled: image builds and snapshots built from images (every image runs on the host's userland), volumes,
sessions,
PTYs, git, previews, auto-stop/archive timers (recorded only), the async client.
"""

from __future__ import annotations

import contextlib
import enum
import os
import posixpath
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from execbox.fakes import _box
from execbox.fakes._common import Service, module, modules_installed
from execbox.files.workspace import remove_tree

WORK_DIR = "/home/daytona"
_service: FakeDaytona | None = None


def _svc() -> FakeDaytona:
    if _service is None:
        raise RuntimeError("the daytona fake is not installed: use `with execbox.fakes.daytona.installed():`")
    return _service


# --- errors (daytona.common.errors) -------------------------------------------------------------------


class DaytonaError(Exception):
    def __init__(self, message: str, status_code: int | None = None, headers: Any = None, code: str | None = None,
                 source: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.headers = headers or {}
        self.code = code
        self.source = source


class DaytonaNotFoundError(DaytonaError):
    pass


class DaytonaAuthenticationError(DaytonaError):
    pass


class DaytonaConflictError(DaytonaError):
    pass


class DaytonaBadRequestError(DaytonaError):
    pass


class DaytonaTimeoutError(DaytonaError):
    pass


class DaytonaFileNotFoundError(DaytonaNotFoundError):
    pass


DaytonaValidationError = DaytonaBadRequestError

ERRORS = {
    "DaytonaError": DaytonaError, "DaytonaNotFoundError": DaytonaNotFoundError,
    "DaytonaAuthenticationError": DaytonaAuthenticationError, "DaytonaConflictError": DaytonaConflictError,
    "DaytonaBadRequestError": DaytonaBadRequestError, "DaytonaTimeoutError": DaytonaTimeoutError,
    "DaytonaFileNotFoundError": DaytonaFileNotFoundError, "DaytonaValidationError": DaytonaValidationError,
}


# --- parameter types ----------------------------------------------------------------------------------


class SandboxState(str, enum.Enum):
    CREATING = "creating"
    STARTED = "started"
    STOPPED = "stopped"
    STARTING = "starting"
    STOPPING = "stopping"
    DESTROYED = "destroyed"
    ERROR = "error"
    SNAPSHOTTING = "snapshotting"


@dataclass(kw_only=True)
class DaytonaConfig:
    api_key: str | None = None
    api_url: str | None = None
    server_url: str | None = None
    target: str | None = None
    jwt_token: str | None = None
    organization_id: str | None = None
    connection_pool_maxsize: int | None = 250
    otel_enabled: bool | None = None
    use_deprecated_polling: bool | None = None


@dataclass
class Resources:
    cpu: int | None = None
    memory: int | None = None  # GiB
    disk: int | None = None  # GiB
    gpu: int | None = None
    gpu_type: Any = None


@dataclass
class ListSandboxesQuery:
    limit: int | None = None
    id: str | None = None
    name: str | None = None
    labels: dict[str, str] | None = None
    states: list[SandboxState] | None = None


@dataclass
class FileUpload:
    source: bytes | str
    destination: str


@dataclass
class FileDownloadRequest:
    source: str
    destination: str | None = None


@dataclass
class FileDownloadResponse:
    source: str
    result: str | bytes | None = None
    error: str | None = None
    error_details: Any = None


@dataclass
class Snapshot:
    """A snapshot (the SDK's is a pydantic model of the API's SnapshotDto; these are the fields the fake keeps)."""

    id: str
    name: str
    state: str
    cpu: int
    mem: int  # GiB
    disk: int  # GiB
    image_name: str | None = None


@dataclass
class ExecutionArtifacts:
    stdout: str = ""
    charts: list[Any] | None = None


@dataclass
class ExecuteResponse:
    exit_code: int
    result: str
    artifacts: ExecutionArtifacts | None = None
    additional_properties: dict[str, Any] = field(default_factory=dict)


_BASE_FIELDS = (
    "name", "language", "os_user", "env_vars", "labels", "public", "auto_stop_interval", "auto_pause_interval",
    "auto_archive_interval", "auto_delete_interval", "ttl_minutes", "queue_timeout", "volumes", "secrets",
    "network_block_all", "kvm", "network_allow_list", "domain_allow_list", "outbound_proxy_url",
    "otel_endpoint_override", "ephemeral", "spot", "linked_sandbox", "target",
)


class _Params:
    _extra: tuple[str, ...] = ()
    # Every name in _BASE_FIELDS (and the subclass's _extra) is set by __init__, None when not given; the types
    # are the SDK's (CreateSandboxBaseParams).
    name: str | None
    language: str | None
    os_user: str | None
    env_vars: dict[str, str] | None
    labels: dict[str, str] | None
    public: bool | None
    auto_stop_interval: int | None
    auto_pause_interval: int | None
    auto_archive_interval: int | None
    auto_delete_interval: int | None
    ttl_minutes: int | None
    queue_timeout: int | None
    volumes: list[Any] | None
    secrets: dict[str, str] | None
    network_block_all: bool | None
    kvm: bool | None
    network_allow_list: str | None
    domain_allow_list: str | None
    outbound_proxy_url: str | None
    otel_endpoint_override: str | None
    ephemeral: bool | None
    spot: bool | None
    linked_sandbox: str | None
    target: str | None

    def __init__(self, **kwargs: Any) -> None:
        known = set(_BASE_FIELDS) | set(self._extra)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown parameters {unknown} (the real SDK would silently "
                            "drop them: fix the name)")
        for name in known:
            setattr(self, name, kwargs.get(name))
        if self.network_allow_list is not None and not isinstance(self.network_allow_list, str):
            raise TypeError("network_allow_list is a comma-separated string of CIDRs, not a list")
        if kwargs.get("ephemeral"):
            self.auto_delete_interval = 0
        for name in ("auto_stop_interval", "auto_pause_interval", "auto_archive_interval", "ttl_minutes"):
            if (getattr(self, name) or 0) < 0:
                raise DaytonaBadRequestError(f"{name} must be a non-negative integer")
        if self.queue_timeout is not None and self.queue_timeout < 1:
            raise DaytonaBadRequestError("queue_timeout must be at least 1 minute")
        self._given = dict(kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"


class CreateSandboxFromSnapshotParams(_Params):
    _extra = ("snapshot",)
    snapshot: str | None


class CreateSandboxFromImageParams(_Params):
    _extra = ("image", "resources")
    image: Any  # a name or a daytona Image
    resources: Resources | None

    def __init__(self, **kwargs: Any) -> None:
        if "image" not in kwargs:
            raise TypeError("CreateSandboxFromImageParams requires `image`")
        super().__init__(**kwargs)


# --- the provider -------------------------------------------------------------------------------------


class FakeDaytona(Service):
    """The fake Daytona service: the accepted API key, the sandboxes, and the call record."""

    def __init__(self) -> None:
        super().__init__()
        self.credentials = {"DAYTONA_API_KEY": "dtn_fake_" + uuid.uuid4().hex}
        self.sandboxes: dict[str, Sandbox] = {}
        # How long a minute of ttl_minutes lasts here; a test that wants to see a TTL expire shortens it.
        self.seconds_per_minute = 60.0
        # Snapshots by id, and where their files are.
        self.snapshots: dict[str, Snapshot] = {}
        self.snapshot_files: dict[str, Path] = {}
        self._snapshot_dir: Path | None = None

    def find_snapshot(self, id_or_name: str) -> Snapshot:
        with self.lock:
            for snap in self.snapshots.values():
                if id_or_name in (snap.id, snap.name):
                    return snap
        raise DaytonaNotFoundError(f"Snapshot {id_or_name} not found", status_code=404, source="api")

    def keep_snapshot(self, name: str, sandbox: Sandbox, box: _box.Box) -> Snapshot:
        with self.lock:
            if any(snap.name == name for snap in self.snapshots.values()):
                raise DaytonaConflictError(f"Snapshot with name {name} already exists", status_code=409, source="api")
            if self._snapshot_dir is None:
                self._snapshot_dir = Path(tempfile.mkdtemp(prefix="execbox-fakedaytona-snapshots-"))
            snap = Snapshot(id=str(uuid.uuid4()), name=name, state="pending", cpu=sandbox.cpu, mem=sandbox.memory,
                            disk=sandbox.disk)
            self.snapshots[snap.id] = snap  # the name is taken from here on
        files = self._snapshot_dir / snap.id
        try:
            box.save(files)
        except BaseException:
            with self.lock:
                del self.snapshots[snap.id]
            remove_tree(str(files))
            raise
        with self.lock:
            self.snapshot_files[snap.id] = files
            snap.state = "active"
        return snap

    def drop_snapshot(self, snap: Snapshot) -> None:
        with self.lock:
            self.snapshots.pop(snap.id, None)
            files = self.snapshot_files.pop(snap.id, None)
        if files is not None:
            remove_tree(str(files))

    def close(self) -> None:
        for sb in list(self.sandboxes.values()):
            sb._remove()
        if self._snapshot_dir is not None:
            remove_tree(str(self._snapshot_dir))


class SnapshotService:
    """``Daytona().snapshot``: the organisation's snapshots."""

    def __init__(self, client: Daytona) -> None:
        self._client = client

    def get(self, name: str) -> Snapshot:
        _svc().record("SnapshotService.get", name)
        return self._client._auth().find_snapshot(name)

    def delete(self, snapshot: Snapshot | str) -> None:
        _svc().record("SnapshotService.delete", snapshot if isinstance(snapshot, str) else snapshot.id)
        svc = self._client._auth()
        svc.drop_snapshot(svc.find_snapshot(snapshot if isinstance(snapshot, str) else snapshot.id))


class Daytona:
    """The client. Credentials are read here, in the calling process; they never reach a sandbox."""

    def __init__(self, config: DaytonaConfig | None = None) -> None:
        svc = _svc()
        svc.record("Daytona", config=config)
        config = config or DaytonaConfig()
        self._api_key = config.api_key or os.environ.get("DAYTONA_API_KEY")
        self._jwt_token = config.jwt_token or os.environ.get("DAYTONA_JWT_TOKEN")
        organization = config.organization_id or os.environ.get("DAYTONA_ORGANIZATION_ID")
        if not self._api_key and not self._jwt_token:
            raise DaytonaAuthenticationError(
                "Authentication credentials not found. Set DAYTONA_API_KEY, or both DAYTONA_JWT_TOKEN and "
                "DAYTONA_ORGANIZATION_ID. These can also be provided via DaytonaConfig.")
        if self._jwt_token and not self._api_key and not organization:
            raise DaytonaAuthenticationError("Organization ID is required when using JWT token")
        self.snapshot = SnapshotService(self)

    def _auth(self) -> FakeDaytona:
        svc = _svc()
        if self._api_key != svc.credentials["DAYTONA_API_KEY"]:
            raise DaytonaAuthenticationError("Unauthorized: invalid API key", status_code=401, source="api")
        return svc

    def create(self, params: CreateSandboxFromSnapshotParams | CreateSandboxFromImageParams | None = None, *,
               timeout: float = 60, on_snapshot_create_logs: Any = None) -> Sandbox:
        svc = _svc()
        svc.record("Daytona.create", params, timeout=timeout)
        if timeout < 0:
            raise DaytonaBadRequestError("Timeout must be a non-negative number")
        svc = self._auth()
        params = params or CreateSandboxFromSnapshotParams(language="python")
        for what in ("volumes", "secrets", "linked_sandbox", "outbound_proxy_url", "kvm", "spot"):
            if getattr(params, what):
                raise NotImplementedError(f"the daytona fake does not model {what}; extend execbox/fakes/daytona.py")
        with svc.lock:
            if params.name and any(s.name == params.name for s in svc.sandboxes.values()):
                raise DaytonaConflictError(f"Sandbox with name {params.name} already exists", status_code=409)
        resources = getattr(params, "resources", None) or Resources()
        seed = None
        if isinstance(params, CreateSandboxFromSnapshotParams) and params.snapshot:
            snap = svc.find_snapshot(params.snapshot)
            resources, seed = Resources(cpu=snap.cpu, memory=snap.mem, disk=snap.disk), svc.snapshot_files[snap.id]
        labels = {"code-toolbox-language": params.language or "python", **(params.labels or {})}
        sb = Sandbox(self, params, labels, resources, seed=seed)
        with svc.lock:
            svc.sandboxes[sb.id] = sb
        return sb

    def get(self, sandbox_id_or_name: str, request_timeout: float | None = None) -> Sandbox:
        svc = _svc()
        svc.record("Daytona.get", sandbox_id_or_name)
        if not sandbox_id_or_name:
            raise DaytonaBadRequestError("sandbox_id_or_name is required")
        svc = self._auth()
        for sb in svc.sandboxes.values():
            if sandbox_id_or_name in (sb.id, sb.name):
                return sb
        raise DaytonaNotFoundError(f"Sandbox with ID or name {sandbox_id_or_name} not found", status_code=404,
                                   source="api")

    def list(self, query: ListSandboxesQuery | None = None, request_timeout: float | None = None) -> Iterator[Sandbox]:
        svc = _svc()
        svc.record("Daytona.list", query)
        svc = self._auth()
        query = query or ListSandboxesQuery()
        for sb in list(svc.sandboxes.values()):
            if query.labels and any(sb.labels.get(k) != v for k, v in query.labels.items()):
                continue
            if query.states and sb.state not in query.states:
                continue
            if query.name and not (sb.name or "").startswith(query.name):
                continue
            yield sb

    def start(self, sandbox: Sandbox, timeout: float = 60) -> None:
        sandbox.start(timeout)

    def stop(self, sandbox: Sandbox, timeout: float = 60) -> None:
        sandbox.stop(timeout)

    def delete(self, sandbox: Sandbox, timeout: float = 60, wait: bool = False) -> None:
        sandbox.delete(timeout, wait)


class Process:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: int | None = None) -> ExecuteResponse:
        _svc().record_on(self._sb.id, "Process.exec", command, cwd=cwd, env=env, timeout=timeout)
        box = self._sb._live_box()
        full_env = {"PATH": _box.PATH, "HOME": WORK_DIR, **(self._sb.env or {}), **(env or {})}
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        done = box.run([shell, "-c", command], cwd=self._sb._resolve(cwd or "."), env=full_env,
                       timeout=timeout if timeout else None, merge_stderr=True)
        if done.timed_out:
            raise DaytonaTimeoutError(
                f"Command execution timed out after {timeout} seconds. The timeout can be increased by adjusting "
                "the timeout parameter in the request.", status_code=408, source="daemon")
        result = done.stdout.decode("utf-8", errors="replace")  # Go string -> JSON: invalid bytes become U+FFFD
        code = -1 if done.returncode < 0 else done.returncode  # Go: ExitCode() is -1 after a signal
        return ExecuteResponse(exit_code=code, result=result, artifacts=ExecutionArtifacts(stdout=result, charts=[]))


class FileSystem:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def upload_file(self, src: str | bytes, dst: str, timeout: int = 1800) -> None:
        shown = src if isinstance(src, str) else f"<{len(src)} bytes>"
        _svc().record_on(self._sb.id, "FileSystem.upload_file", shown, dst)
        self._upload(src, dst)

    def upload_files(self, files: list[FileUpload], timeout: int = 1800) -> None:
        _svc().record_on(self._sb.id, "FileSystem.upload_files", [
            (f.source if isinstance(f.source, str) else f"<{len(f.source)} bytes>", f.destination) for f in files
        ])
        for f in files:
            self._upload(f.source, f.destination)

    def _upload(self, src: str | bytes, dst: str) -> None:
        data = src if isinstance(src, bytes) else open(src, "rb").read()  # noqa: SIM115 - a str is a LOCAL path
        rc = _box.write_file(self._sb._live_box(), self._sb._resolve(dst), data)
        if rc:
            raise DaytonaError(f"Failed to upload {dst}: status {rc}", status_code=400, source="daemon")

    def _read(self, remote_path: str) -> tuple[int, bytes]:
        return _box.read_file(self._sb._live_box(), self._sb._resolve(remote_path))

    def download_file(self, *args: str) -> bytes | None:
        _svc().record_on(self._sb.id, "FileSystem.download_file", *args)
        remote_path = args[0]
        local_path = args[1] if len(args) > 1 and isinstance(args[1], str) else None
        rc, data = self._read(remote_path)
        if rc == 2:
            raise DaytonaFileNotFoundError(f"Failed to download file: file not found: {remote_path}",
                                           status_code=404, code="FILE_NOT_FOUND", source="daemon")
        if rc:
            raise DaytonaError(f"Failed to download file {remote_path}: status {rc}", status_code=400,
                               source="daemon")
        if local_path is None:
            return data
        with open(local_path, "wb") as fh:
            fh.write(data)
        return None

    def download_files(self, files: list[FileDownloadRequest], timeout: int = 1800) -> list[FileDownloadResponse]:
        _svc().record_on(self._sb.id, "FileSystem.download_files", [(f.source, f.destination) for f in files])
        out = []
        for f in files:
            rc, data = self._read(f.source)
            if rc:
                out.append(FileDownloadResponse(f.source, error="file not found" if rc == 2 else f"status {rc}"))
            elif f.destination:
                with open(f.destination, "wb") as fh:
                    fh.write(data)
                out.append(FileDownloadResponse(f.source, result=f.destination))
            else:
                out.append(FileDownloadResponse(f.source, result=data))
        return out


class Sandbox:
    """A Daytona sandbox (a local box in the fake)."""

    def __init__(self, client: Daytona, params: _Params, labels: dict[str, str], resources: Resources, *,
                 seed: Path | None = None) -> None:
        self._service = _svc()
        self.id = str(uuid.uuid4())
        self.name = params.name or self.id
        self.labels = labels
        self.env = dict(params.env_vars or {})
        self.network_block_all = bool(params.network_block_all)
        self.network_allow_list = params.network_allow_list
        self.domain_allow_list = params.domain_allow_list
        allowlist = self.network_allow_list is not None or self.domain_allow_list is not None
        self.cpu = resources.cpu or 1
        self.memory = resources.memory or 1
        self.disk = resources.disk or 3
        self.auto_stop_interval = 15 if params.auto_stop_interval is None else params.auto_stop_interval
        self.auto_delete_interval = params.auto_delete_interval if params.auto_delete_interval is not None else -1
        self.ttl_minutes = params.ttl_minutes or 0
        self.state = SandboxState.STARTED
        self.process = Process(self)
        self.fs = FileSystem(self)
        self._client = client
        self._box: _box.Box | None = _box.Box(
            network="none" if self.network_block_all or allowlist else "allow", dirs=(WORK_DIR,),
            memory_mb=resources.memory * 1024 if resources.memory else None, seed=seed)
        self._timer: threading.Timer | None = None
        if self.ttl_minutes:
            self._timer = threading.Timer(self.ttl_minutes * self._service.seconds_per_minute, self._remove)
            self._timer.daemon = True
            self._timer.start()

    def _resolve(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.normpath(posixpath.join(WORK_DIR, path))

    def _live_box(self) -> _box.Box:
        if self.state != SandboxState.STARTED or self._box is None:
            raise DaytonaError(f"Sandbox {self.id} is not started (state: {self.state.value})", status_code=409,
                               source="api")
        return self._box

    def get_work_dir(self) -> str:
        return WORK_DIR

    def get_user_home_dir(self) -> str:
        return WORK_DIR

    def refresh_data(self, request_timeout: float | None = None) -> None:
        if self.id not in _svc().sandboxes:
            raise DaytonaNotFoundError(f"Sandbox {self.id} not found", status_code=404, source="api")

    def start(self, timeout: float | None = 60) -> None:
        _svc().record_on(self.id, "Sandbox.start", timeout=timeout)
        self._client._auth()
        self.refresh_data()
        if self.state == SandboxState.STARTED:
            return
        assert self._box is not None
        self._box.start()
        self.state = SandboxState.STARTED

    def stop(self, timeout: float | None = 60, force: bool = False) -> None:
        _svc().record_on(self.id, "Sandbox.stop", timeout=timeout, force=force)
        self._client._auth()
        self.refresh_data()
        if self._box is not None:
            self._box.stop()
        self.state = SandboxState.STOPPED
        if self.auto_delete_interval == 0:  # ephemeral: deleted as soon as it stops
            self._remove()

    def create_snapshot(self, name: str, timeout: float | None = 60) -> None:
        svc = _svc()
        svc.record_on(self.id, "Sandbox.create_snapshot", name, timeout=timeout)
        self._client._auth()
        self.refresh_data()
        box = self._live_box()
        before, self.state = self.state, SandboxState.SNAPSHOTTING
        try:
            svc.keep_snapshot(name, self, box)
        finally:
            self.state = before  # the SDK waits until the sandbox leaves SNAPSHOTTING

    def delete(self, timeout: float | None = 60, wait: bool = False) -> None:
        _svc().record_on(self.id, "Sandbox.delete", timeout=timeout, wait=wait)
        self._client._auth()
        self.refresh_data()
        self._remove()

    def _remove(self) -> None:
        svc = self._service
        with svc.lock:
            svc.sandboxes.pop(self.id, None)
        if self._timer is not None:
            self._timer.cancel()
        box, self._box = self._box, None
        if box is not None:
            box.destroy()
        self.state = SandboxState.DESTROYED


@contextlib.contextmanager
def installed() -> Iterator[FakeDaytona]:
    """Make ``import daytona`` return this fake."""
    global _service
    if _service is not None:
        raise RuntimeError("the daytona fake is already installed")
    service = FakeDaytona()
    members = {
        "Daytona": Daytona, "DaytonaConfig": DaytonaConfig, "Sandbox": Sandbox, "SandboxState": SandboxState,
        "CreateSandboxFromImageParams": CreateSandboxFromImageParams,
        "CreateSandboxFromSnapshotParams": CreateSandboxFromSnapshotParams, "Resources": Resources,
        "ListSandboxesQuery": ListSandboxesQuery, "FileUpload": FileUpload, "FileDownloadRequest": FileDownloadRequest,
        "FileDownloadResponse": FileDownloadResponse, "ExecuteResponse": ExecuteResponse, "Snapshot": Snapshot,
        **ERRORS,
    }
    _service = service
    try:
        with modules_installed({"daytona": module("daytona", __doc__, members)}):
            yield service
    finally:
        _service = None
        service.close()


__all__ = ["FakeDaytona", "installed"]
