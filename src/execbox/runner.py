"""The one path of a request: settings -> registry -> policy -> guard -> backend -> result.

``AsyncRunner`` is the core; ``Runner`` is its sync facade (the event loop runs in a helper thread, so it
also works inside programs that already run an event loop). Sessions: ``AsyncSandbox`` / ``Sandbox``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import os
import posixpath
import threading
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal
from pydantic import ValidationError

from execbox.audit import log as audit_log
from execbox.config.settings import Settings
from execbox.contract.backend import ExecutionBackend, Session, SessionSpec, bounded, broken, close_bounded
from execbox.contract.models import (
    ISOLATION_STRENGTH,
    Capabilities,
    CellResult,
    ExecRequest,
    ExecResult,
    ExecSpec,
    Language,
    Limits,
    Mount,
    NetworkMode,
)
from execbox.contract.output import LiveOutput, OnText, OutputEvent, deliver, stream_events
from execbox.contract.results import clamp_note, explain
from execbox.core.pool import WarmPool
from execbox.core.scheduler import Slots, default_max_concurrent
from execbox.errors import (
    BackendUnavailableError,
    ConfigError,
    ExecboxError,
    SandboxError,
    UnsupportedPolicyError,
    WorkspacePathError,
)
from execbox.files import transfer
from execbox.files.transfer import FileInfo, Transfer
from execbox.files.workspace import is_directory_error, normalize
from execbox.guard.guard import Guard
from execbox.guard.mounts import admit_upload
from execbox.kit import packages, transfers
from execbox.kit.proxy import secrets as egress_secrets
from execbox.policy.env import filter_env
from execbox.registry import BUILTIN_DISTRIBUTION, Registry, get_registry
from execbox.secrets import egress as egress_given
from execbox.secrets import values as secrets_inject

if TYPE_CHECKING:
    from execbox.kernel.client import Kernel

T = TypeVar("T")
LOCAL_FALLBACK = "local_subprocess"
#: How long a stopped event-loop thread may take to end once its portal has stopped (its own work is done by then).
LOOP_EXIT_S = 10.0


def _request(**kw: Any) -> ExecRequest:
    try:
        return ExecRequest(**kw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid request: {problems}") from None


def _command_request(command: str | Sequence[str], **kw: Any) -> ExecRequest:
    if isinstance(command, str) and not command.strip():
        raise ConfigError("invalid request: the command is empty; give a shell command or an argv list")
    if not isinstance(command, (str, Sequence)) or isinstance(command, bytes):
        raise ConfigError(f"invalid request: the command is a {type(command).__name__}; give a shell command (str) "
                          "or an argv list of str")
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    return _request(argv=argv, **kw)


@contextlib.contextmanager
def backend_errors(backend: str) -> Iterator[None]:
    """The last line of the one error tree: an exception a backend (a third-party plugin, say) lets out that is
    not an ExecboxError becomes a SandboxError naming the backend, with the original chained for its author."""
    try:
        yield
    except ExecboxError:
        raise
    except Exception as exc:
        raise SandboxError(f"backend {backend!r} failed unexpectedly: {type(exc).__name__}: {exc}. This is a bug "
                           "in the backend; report it to its maintainers", backend=backend) from exc


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"invalid {what}: {type(value).__name__}; give a str")
    return value


def _bytes(value: object, what: str) -> bytes:
    """bytes as given; str as UTF-8 (a lone surrogate is refused: it has no bytes to send)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError as exc:
            raise ConfigError(f"invalid {what}: it is not valid text ({exc.reason} at {exc.start}); give bytes or "
                              "a str without lone surrogates") from None
    raise ConfigError(f"invalid {what}: {type(value).__name__}; give bytes or str")


class AsyncRunner:
    """Runs requests through the one path. ``options`` gives backends their settings in code, by backend name
    (``{"docker": {"image": "my-image"}}``), on top of the environment.

    Use it as ``async with AsyncRunner() as runner:`` to close what its backends opened (engine clients,
    connections) when done; a runner that is just dropped leaves that to the garbage collector. ``check()``
    answers are trusted for CHECK_TTL_S seconds per backend instance (see ExecutionBackend.check).
    """

    def __init__(self, settings: Settings | None = None, *,
                 options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.guard = Guard(self.settings)
        self.options = {name: dict(values) for name, values in (options or {}).items()}
        self._backends: dict[tuple[str, str], ExecutionBackend] = {}
        #: The audit log (CODE_EXEC_AUDIT_LOG): every exec, refusal and sandbox open/close is recorded; other parts
        #: (the MCP server's approvals, say) record through ``runner.audit.record(event, **fields)``.
        self.audit = audit_log.AuditLog.from_settings(self.settings)
        #: The concurrency cap, shared by every thread and loop that uses this runner.
        self.slots = Slots(self.settings.max_concurrent or default_max_concurrent(self.settings.memory_mb))
        #: Warm sandboxes; active only while the runner is entered (its background task group refills them).
        self.pool = WarmPool(self.settings.pool_size, self.settings.pool_ttl_sec,
                             record=lambda event, fields: self.audit.arecord(event, **fields),
                             longest_run_s=self.settings.max_timeout_sec + 60)
        self._background: Any = None
        self._pool_stop: anyio.Event | None = None

    async def __aenter__(self) -> AsyncRunner:
        if self.settings.pool_size and self._background is None:
            self._background = anyio.create_task_group()
            self.pool.attach(await self._background.__aenter__())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def serve_pool(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Host the warm pool's background work until ``aclose``: for a caller that cannot enter the runner and
        leave it in one task (the sync facade runs this in its loop thread)."""
        async with anyio.create_task_group() as tasks:
            self.pool.attach(tasks)
            self._pool_stop = anyio.Event()
            task_status.started()
            await self._pool_stop.wait()
            tasks.cancel_scope.cancel()

    async def aclose(self) -> None:
        """Close the warm pool and every backend instance this runner made (engine clients, connections)."""
        background, self._background = self._background, None
        with anyio.CancelScope(shield=True):
            await self.pool.aclose()
        if self._pool_stop is not None:
            self._pool_stop.set()
        if background is not None:
            background.cancel_scope.cancel()
            await background.__aexit__(None, None, None)
        backends, self._backends = list(self._backends.values()), {}
        with anyio.CancelScope(shield=True):
            for backend in backends:
                await bounded(backend.aclose(), backend.shared.backend_grace_sec, backend=backend, doing="aclose")

    @property
    def registry(self) -> Registry:
        return get_registry(self.settings.load_plugins, self.settings.disable_plugins)

    def backend(self, name: str, options: Mapping[str, Any] | None = None) -> ExecutionBackend:
        """The instance of a registered backend with the runner's options for it, ``options`` on top; one per
        runner and set of options."""
        merged = {**self.options.get(name, {}), **(options or {})}
        key = (name, repr(sorted(merged.items())))
        if key not in self._backends:
            self._backends[key] = self.registry.get(name).cls(self.settings, merged)
        return self._backends[key]

    async def select(self, name: str | None = None, *, session: bool = False) -> tuple[ExecutionBackend, Capabilities]:
        """The backend to use and what it enforces here; ``auto`` picks the strongest sandbox that runs here."""
        name = name or (self.settings.session_backend if session else self.settings.backend)
        if name != "auto":
            backend = self.backend(name)
            return backend, await _check(backend)
        tried: list[str] = []
        probe = ExecRequest(argv=["true"], network=self.settings.network)
        for candidate in self.auto_candidates():
            try:
                backend = self.backend(candidate)
                verdict = backend.verdict(probe)
                if not (verdict.sandbox or candidate == LOCAL_FALLBACK):
                    tried.append(f"- {candidate}: configured here, it is not a sandbox ({verdict.reason})")
                    continue
                return backend, await _check(backend)
            except BackendUnavailableError as exc:
                if exc.env_var and exc.env_var in os.environ:
                    # The operator configured this backend (CODE_EXEC_DOCKER_RUNTIME, ...): falling back to a
                    # weaker sandbox is not what they asked for. Likewise a ConfigError is never skipped.
                    raise
                tried.append(f"- {candidate}: {exc.message}")
        local_hint = "" if self.settings.local else (
            "\n- or, only on your own machine for yourself: CODE_EXEC_LOCAL=true (runs local_subprocess, no sandbox)"
        )
        candidates = set(self.auto_candidates())
        for entry in sorted(self.registry.backends.values(), key=lambda e: e.name):
            if entry.cls.capabilities.sandbox and not entry.cls.capabilities.remote and entry.name not in candidates:
                tried.append(f"- {entry.name} (third-party, from {entry.distribution!r}): auto does not pick a plugin "
                             "on its own claim; name it in EXECBOX_AUTO_PLUGINS, or set CODE_EXEC_BACKEND to it")
        raise BackendUnavailableError(
            "no sandbox backend can run here (CODE_EXEC_BACKEND=auto). Install or start one of:\n"
            + "\n".join(tried or ["- (no sandbox backend is registered)"]) + local_hint,
            env_var="CODE_EXEC_BACKEND",
        )

    def auto_candidates(self) -> list[str]:
        """Local sandbox backends, strongest isolation first; local_subprocess last and only in local mode.

        A third-party backend's capabilities are its own claim: ``auto`` considers one only when the operator
        opted in by naming it in EXECBOX_AUTO_PLUGINS (name it as CODE_EXEC_BACKEND to use it directly)."""
        trusted = set(self.settings.auto_plugins)
        entries = [e for e in self.registry.backends.values()
                   if e.cls.capabilities.sandbox and not e.cls.capabilities.remote
                   and (e.distribution == BUILTIN_DISTRIBUTION or {e.name, e.distribution} & trusted)]
        entries.sort(key=lambda e: (-ISOLATION_STRENGTH[e.cls.capabilities.isolation],
                                    e.distribution != BUILTIN_DISTRIBUTION, e.name))
        names = [e.name for e in entries]
        if self.settings.local and LOCAL_FALLBACK in self.registry.backends:
            names.append(LOCAL_FALLBACK)
        return names

    def prepare(self, request: ExecRequest) -> tuple[ExecRequest, list[str], set[str]]:
        """The request with the settings applied (defaults, clamps, env policy); the dropped env names; the
        limits demanded: those the request names, and those the operator set explicitly (CODE_EXEC_MEMORY_MB,
        CODE_EXEC_CPUS, CODE_EXEC_PIDS_LIMIT). A backend that cannot enforce a demanded limit refuses; the
        built-in defaults apply wherever a backend can enforce them."""
        s = self.settings
        env, dropped = filter_env(request.env)
        asked = request.limits or Limits()
        limits = Limits(
            memory_mb=min(asked.memory_mb or s.memory_mb, s.memory_mb),
            cpus=min(asked.cpus or s.cpus, s.cpus),
            pids=min(asked.pids or s.pids_limit, s.pids_limit),
            disk_mb=min(asked.disk_mb or s.disk_mb, s.disk_mb),
        )
        resolved = request.model_copy(update={
            "env": env,
            "timeout": min(request.timeout or s.max_timeout_sec, s.max_timeout_sec),
            "max_output_bytes": min(request.max_output_bytes or s.max_output_bytes, s.max_output_bytes),
            "network": request.network or s.network,
            "limits": limits,
        })
        if s.egress_secrets and resolved.network == "proxy":  # CODE_EXEC_EGRESS_SECRETS: the operator's
            resolved = resolved.model_copy(update={"secrets_at_egress": {
                **egress_given.from_setting(s.egress_secrets), **resolved.secrets_at_egress}})
        return resolved, dropped, asked.names() | self._operator_limits()

    def _operator_limits(self) -> set[str]:
        by_field = {"memory_mb": "memory", "cpus": "cpu", "pids_limit": "pids", "disk_mb": "disk"}
        return {limit for field, limit in by_field.items() if field in self.settings.model_fields_set}

    async def execute(self, request: ExecRequest, *, backend: str | None = None,
                      output: LiveOutput | None = None, options: Mapping[str, Any] | None = None,
                      upload: Uploads | None = None, download: Uploads | None = None) -> ExecResult:
        """Run one request in a fresh sandbox that is gone afterwards, also on error or cancellation. ``output``
        receives the output as it arrives (see ``stream``). ``options``: the backend's own options for this run
        (``{"image": ...}`` for docker). ``upload``: local paths copied in first, ``{local: remote}``;
        ``download``: workspace paths copied out after the run, ``{remote: local}`` ("." = the whole workspace)."""
        resolved, dropped, asked = self.prepare(request)
        uploads, downloads = _pairs(upload, "upload"), _pairs(download, "download")
        for local, _remote in uploads:
            admit_upload(local, state=self.state_places())
        impl, caps = await self._admitted(backend, resolved, asked, session=False, dropped=dropped, options=options)
        mounts = self.guard.check_mounts(impl, caps, resolved.mounts, state=self.state_places())
        spec = SessionSpec(resolved.network or "none", resolved.limits or Limits(), True, (resolved.timeout or 1) + 60,
                           mounts=mounts)
        _enough_threads(self.slots.total)
        records: list[asyncio.Task[str | None]] = []  # the run's audit record, written beside its clean-up
        try:
            async with self.slots.slot(self.settings.queue_timeout_sec, "this run") as waited:
                # A warm member was opened without this run's mounts (the pool keys on network and limits only).
                session = None if mounts else self.pool.take(impl, spec)
                pooled = session is not None
                if session is None:
                    session = await _open(impl, spec)
                session.session_spec = spec
                try:
                    for local, remote in uploads:
                        await self.upload_to(impl, session, local, remote)
                    result = await _exec_audited(self.audit, impl, session, resolved, dropped,
                                                 asked_timeout=request.timeout, output=output, records=records)
                    result = await self.collected(impl, session, resolved, result)
                    for remote, local in downloads:
                        moved = await self.download_from(impl, session, remote, local,
                                                         secrets_inject.redactor_for(resolved.secrets))
                        result.notes.extend(f"download: {s}" for s in moved.skipped)
                finally:
                    if pooled:
                        await self.pool.discard(session)  # used once; removed in the background
                    else:
                        with backend_errors(impl.name):
                            await close_bounded(session, impl)
            notes = result.notes
            if self.pool.active and not pooled and impl.name in self.pool.errors:
                notes = [*notes, f"warm pool: starting a {impl.name} sandbox ahead failed "
                                 f"({self.pool.errors[impl.name]}); this run started its own"]
            # asyncio.shield: a cancellation landing here must not cancel the record task it would reach
            written = [note for note in [await asyncio.shield(record) for record in records] if note]
            return result.model_copy(update={"queued_s": waited, "pooled": pooled, "notes": [*notes, *written]})
        finally:
            if records:
                with anyio.CancelScope(shield=True):  # on disk before the run returns or raises, whatever happened
                    await asyncio.wait(records)  # neither raises nor cancels them, if interrupted

    @property
    def transfer_limits(self) -> transfer.TransferLimits:
        """The bounds of uploads, downloads and listings (CODE_EXEC_MAX_TRANSFER_BYTES / _FILES)."""
        return transfer.TransferLimits(self.settings.max_transfer_bytes, self.settings.max_transfer_files)

    def state_places(self) -> list[str]:
        """What of execbox's own a mount or an upload must never hand to the code, beyond the default places:
        the package cache, the audit log's directory and key file, the MCP server's grant-signing key."""
        places = [str(self.package_cache)]
        if self.audit.path is not None:
            places.append(str(self.audit.path.parent))
        if self.settings.audit_key_file is not None:
            places.append(str(self.settings.audit_key_file))
        if os.environ.get("EXECBOX_MCP_KEY_FILE"):
            places.append(os.environ["EXECBOX_MCP_KEY_FILE"])
        return places

    @property
    def package_cache(self) -> Path:
        """The per-user wheel cache (CODE_EXEC_PACKAGE_CACHE; see core.packages)."""
        return packages.default_cache_dir(self.settings.package_cache)

    async def upload_to(self, backend: ExecutionBackend, session: Session, local: str, remote: str) -> Transfer:
        rel = normalize(_text(remote, "remote path"), session.workspace, allow_root=True)
        _not_mounted(session, rel, "upload to")
        with backend_errors(backend.name):
            return await bounded(transfers.upload_path(session, _text(os.fspath(local), "local path"), rel,
                                                      limits=self.transfer_limits),
                                 _files_s(backend), backend=backend, doing="an upload", session=session)

    async def download_from(self, backend: ExecutionBackend, session: Session, remote: str, local: str,
                            redactor: secrets_inject.Redactor | None = None) -> Transfer:
        """The download; what it says of the sandbox's files (skipped entries, errors) never shows a secret the
        sandbox was given (the code may have named a file or a link after one)."""
        rel = normalize(_text(remote, "remote path"), session.workspace, allow_root=True)
        _not_mounted(session, rel, "download")
        with secrets_inject.redacting(redactor), backend_errors(backend.name):
            moved = await bounded(transfers.download_path(session, rel, _text(os.fspath(local), "local path"),
                                                         limits=self.transfer_limits),
                                  _files_s(backend), backend=backend, doing="a download", session=session)
        if redactor is not None:
            moved = moved.model_copy(update={"skipped": [redactor.redact_text(s) for s in moved.skipped]})
        return moved

    async def collected(self, backend: ExecutionBackend, session: Session, request: ExecRequest,
                        result: ExecResult) -> ExecResult:
        """The result with the files the request's ``collect`` globs matched (bounded by CODE_EXEC_MAX_READ_BYTES
        in all; what is left out is said in the notes)."""
        if not request.collect:
            return result
        with backend_errors(backend.name):
            files, notes = await bounded(
                transfers.collect(session, list(request.collect), limits=self.transfer_limits,
                                 max_bytes=self.settings.max_read_bytes),
                _files_s(backend), backend=backend, doing="collecting files", session=session)
        result = result.model_copy(update={"files": files, "notes": [*result.notes, *notes]})
        return secrets_inject.redact_result(result, secrets_inject.redactor_for(request.secrets), result.secrets)

    async def warm(self, backend: str | None = None, *, network: NetworkMode | None = None,
                   limits: Limits | None = None, timeout: float | None = None) -> int:
        """Start filling the warm pool for one configuration now (rather than on its first run); returns how
        many members are ready at this moment. Needs CODE_EXEC_POOL_SIZE > 0 and an entered runner."""
        if not self.pool.active:
            raise ConfigError("the warm pool is off: set CODE_EXEC_POOL_SIZE (or Settings(pool_size=...)) and use "
                              "the runner as `async with AsyncRunner() as runner:`", env_var="CODE_EXEC_POOL_SIZE")
        resolved, _, asked = self.prepare(ExecRequest(argv=["true"], network=network, limits=limits, timeout=timeout))
        impl, _ = await self._admitted(backend, resolved, asked, session=False)
        spec = SessionSpec(resolved.network or "none", resolved.limits or Limits(), True, (resolved.timeout or 1) + 60)
        self.pool.refill(impl, spec)
        return self.pool.ready(impl, spec)

    async def _admitted(self, backend: str | None, resolved: ExecRequest, asked: set[str], *, session: bool,
                        options: Mapping[str, Any] | None = None,
                        session_id: str | None = None,
                        dropped: list[str] | None = None) -> tuple[ExecutionBackend, Capabilities]:
        """``_admit``, with every refusal recorded in the audit log (its reason: the error raised)."""
        try:
            return await self._admit(backend, resolved, asked, session=session, options=options)
        except ExecboxError as exc:
            named = backend or (self.settings.session_backend if session else self.settings.backend)
            await self.audit.arecord("refused", **audit_log.refusal_fields(
                exc, resolved, backend=exc.backend or named, session=session_id, oneshot=not session,
                opening=session, dropped=dropped))
            raise

    async def _admit(self, backend: str | None, resolved: ExecRequest, asked: set[str], *, session: bool,
                     options: Mapping[str, Any] | None = None) -> tuple[ExecutionBackend, Capabilities]:
        """The backend (auto resolved) and what it enforces here, once the guard has admitted the request: the one
        place the guard runs, for one-shots and sessions alike, each rule once."""
        name = backend or (self.settings.session_backend if session else self.settings.backend)
        if name == "auto" and options:
            raise ConfigError("backend options were given without a backend: name the backend they are for, e.g. "
                              "execbox.sandbox('docker', image=...)", env_var="CODE_EXEC_BACKEND")
        impl = (await self.select("auto"))[0] if name == "auto" else self.backend(name, options)
        self.guard.check_verdict(impl, resolved)  # cheap refusals first, before the backend is probed
        self.guard.check_secrets(impl)
        with backend_errors(impl.name):
            caps = await _check(impl)  # for auto, select() just checked it: this is the cached answer
        self.guard.check_policy(impl, caps, resolved, asked)
        if session and not caps.persistent_sessions:
            raise UnsupportedPolicyError(
                f"refused: backend {impl.name!r} has no persistent sessions; use execbox.run for one-shot runs "
                "or a backend that keeps sessions", backend=impl.name)
        return impl, caps

    async def run(self, command: str | Sequence[str], *, backend: str | None = None, network: NetworkMode | None = None,
                  timeout: float | None = None, env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                  files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
                  max_output_bytes: int | None = None, limits: Limits | None = None,
                  on_stdout: OnText | None = None, on_stderr: OnText | None = None,
                  mounts: Sequence[Mount] | None = None, collect: Sequence[str] | None = None,
                  upload: Uploads | None = None, download: Uploads | None = None,
                  options: Mapping[str, Any] | None = None,
                  secrets: Mapping[str, secrets_inject.Secret | str] | None = None,
                  secrets_at_egress: egress_given.Given | None = None) -> ExecResult:
        """Run a command (argv list, or a string for /bin/sh -c) in a fresh sandbox. ``on_stdout(text)`` /
        ``on_stderr(text)`` get the output as it arrives (the result is the same as without them). Files: see
        ``execute``; ``mounts`` bind host paths (read-only unless ``Mount(..., writable=True)``); ``collect``
        globs return matching workspace files on ``result.files``."""
        request = _command_request(command, **_request_kw(network, timeout, env, stdin, files, workdir,
                                                          max_output_bytes, limits, mounts, collect, secrets,
                                                          secrets_at_egress))
        return await deliver(lambda out: self.execute(request, backend=backend, output=out, options=options,
                                                      upload=upload, download=download), on_stdout, on_stderr)

    async def run_code(self, code: str, language: Language = "python", **kw: Any) -> ExecResult:
        backend, on_stdout, on_stderr = kw.pop("backend", None), kw.pop("on_stdout", None), kw.pop("on_stderr", None)
        extra = {k: kw.pop(k, None) for k in ("options", "upload", "download")}
        request = _request(code=code, language=language, **_request_kw(**kw))
        return await deliver(lambda out: self.execute(request, backend=backend, output=out, **extra), on_stdout,
                             on_stderr)

    def stream(self, command: str | Sequence[str], *, backend: str | None = None,
               **kw: Any) -> AsyncGenerator[OutputEvent | ExecResult, None]:
        """``async for event in runner.stream(cmd):`` OutputEvents as the output arrives, then the ExecResult."""
        request = _command_request(command, **_request_kw(**kw))
        return stream_events(lambda out: self.execute(request, backend=backend, output=out))

    def stream_code(self, code: str, language: Language = "python", *, backend: str | None = None,
                    **kw: Any) -> AsyncGenerator[OutputEvent | ExecResult, None]:
        request = _request(code=code, language=language, **_request_kw(**kw))
        return stream_events(lambda out: self.execute(request, backend=backend, output=out))

    def sandbox(self, backend: str | None = None, *, network: NetworkMode | None = None, limits: Limits | None = None,
                name: str | None = None, lifetime_s: float = 3600.0, mounts: Sequence[Mount] | None = None,
                package_cache: bool = False, pip: Sequence[str] | None = None,
                secrets: Mapping[str, secrets_inject.Secret | str] | None = None,
                secrets_at_egress: egress_given.Given | None = None,
                **options: Any) -> AsyncSandbox:
        """A persistent sandbox. Keywords beyond these are the backend's own options (its settings_model's fields,
        e.g. ``image=`` for docker), on top of the runner's and the environment's. ``mounts``: host paths bound
        in for the sandbox's life. ``package_cache``: the per-user wheel cache, read-only, where pip looks;
        ``pip``: requirements installed from it when the sandbox opens (implies ``package_cache``). ``secrets``:
        given to every exec (on top of an exec's own), redacted from what every exec returns; ``secrets_at_egress``
        likewise (network mode proxy)."""
        sandbox = AsyncSandbox(self, backend, network=network, limits=limits, name=name, lifetime_s=lifetime_s,
                               options=options, mounts=mounts, package_cache=package_cache or bool(pip), pip=pip)
        sandbox.secrets = _sandbox_secrets(secrets)
        sandbox.secrets_at_egress = _sandbox_secrets(secrets_at_egress, egress=True)
        return sandbox


def _sandbox_secrets(secrets: Mapping[str, Any] | None, *, egress: bool = False) -> dict[str, Any]:
    try:
        return egress_given.check(secrets or {}) if egress else secrets_inject.check_secrets(secrets or {})
    except ValueError as exc:
        raise ConfigError(f"invalid {'secrets_at_egress' if egress else 'secrets'}: {exc}") from None


async def _open(backend: ExecutionBackend, spec: SessionSpec) -> Session:
    """A new sandbox, within CODE_EXEC_OPEN_TIMEOUT_SEC; one that opens after that is closed when it does."""
    with backend_errors(backend.name):
        return await bounded(backend.open_session(spec), backend.shared.open_timeout_sec, backend=backend,
                             doing="open_session", late=lambda late: close_bounded(late, backend))


async def _check(backend: ExecutionBackend) -> Capabilities:
    """What the backend enforces here (its check: cached, or a probe), within CODE_EXEC_OPEN_TIMEOUT_SEC."""
    return await bounded(backend.check(), backend.shared.open_timeout_sec, backend=backend,
                         doing="its availability check")


def _files_s(backend: ExecutionBackend) -> float:
    """The bound of one file call or transfer: the longest run, and the grace."""
    return backend.shared.max_timeout_sec + backend.shared.backend_grace_sec


def _enough_threads(slots: int) -> None:
    """Backends block in worker threads; anyio's default of 40 per loop must not become a second, hidden cap."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    if limiter.total_tokens < 2 * slots + 8:
        limiter.total_tokens = 2 * slots + 8


Uploads = Mapping[str, str] | Sequence[tuple[str, str]]


def _not_mounted(session: Session, rel: str, doing: str) -> None:
    """A path at or below a mount's target is the host's own directory, not the workspace: the workspace side
    of it is an empty mount point, so moving files there would silently do nothing the code can see."""
    spec = session.session_spec
    where = posixpath.join(session.workspace, rel) if rel else session.workspace
    for mount in spec.mounts if spec else ():
        if where == mount.target or where.startswith(mount.target + "/"):
            raise WorkspacePathError(f"cannot {doing} {rel!r}: it is in the mount of the host path {mount.source} at "
                                     f"{mount.target}; use that path on the host directly")


def _pairs(value: Uploads | None, what: str) -> list[tuple[str, str]]:
    """``{a: b}`` or ``[(a, b), ...]`` as a list of pairs of str (paths as str or os.PathLike)."""
    if value is None:
        return []
    items = list(value.items()) if isinstance(value, Mapping) else list(value)
    try:
        return [(os.fspath(a), os.fspath(b)) for a, b in items]
    except (TypeError, ValueError):
        raise ConfigError(f"invalid {what}: give a mapping or a list of (source, destination) paths") from None


def _request_kw(network: NetworkMode | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
                stdin: bytes | str | None = None, files: Mapping[str, bytes | str] | None = None,
                workdir: str | None = None, max_output_bytes: int | None = None,
                limits: Limits | None = None, mounts: Sequence[Mount] | None = None,
                collect: Sequence[str] | str | None = None,
                secrets: Mapping[str, secrets_inject.Secret | str] | None = None,
                secrets_at_egress: egress_given.Given | None = None) -> dict[str, Any]:
    if env is not None and not isinstance(env, Mapping):
        raise ConfigError(f"invalid env: {type(env).__name__}; give a mapping of names to values")
    if secrets is not None and not isinstance(secrets, Mapping):
        raise ConfigError(f"invalid secrets: {type(secrets).__name__}; give a mapping of names to values")
    if files is not None and not isinstance(files, Mapping):
        raise ConfigError(f"invalid files: {type(files).__name__}; give a mapping of workspace paths to contents")
    kw = {
        "network": network, "timeout": timeout, "env": dict(env) if env else None,
        "stdin": None if stdin is None else _bytes(stdin, "stdin"),
        "files": {k: _bytes(v, f"files[{k!r}]") for k, v in files.items()} if files else None,
        "workdir": workdir, "max_output_bytes": max_output_bytes, "limits": limits,
        "mounts": list(mounts) if mounts else None,
        "collect": [collect] if isinstance(collect, str) else list(collect) if collect else None,
        "secrets": dict(secrets) if secrets else None,
        "secrets_at_egress": secrets_at_egress or None,
    }
    return {k: v for k, v in kw.items() if v is not None}


async def _exec_in(backend: ExecutionBackend, session: Session, request: ExecRequest, dropped: list[str], *,
                   asked_timeout: float | None = None, output: LiveOutput | None = None) -> ExecResult:
    """Place the files, resolve the workdir, run, and stamp the result with what the runner knows (the limit that
    cut it short, in words: core.results.explain; ``asked_timeout`` is the timeout as requested, before clamping)."""
    argv, files = request.materialize(session.workspace)
    for path, data in files.items():
        with backend_errors(backend.name):
            await bounded(session.write_file(normalize(path, session.workspace), data), _files_s(backend),
                          backend=backend, doing="write_file", session=session)
    if request.workdir:
        workdir = posixpath.join(session.workspace, normalize(request.workdir, session.workspace))
        # The backend starts in the workspace; a workdir below it is created (if missing) and entered inside
        # the sandbox, the same way on every backend.
        argv = ["/bin/sh", "-c", 'mkdir -p -- "$1" && cd -- "$1" && shift && exec "$@"', "execbox-workdir", workdir,
                *argv]
    assert request.timeout and request.max_output_bytes and request.network and request.limits  # prepare() set them
    if output is not None:
        output.set_cap(request.max_output_bytes)
    # Declared secrets reach the command through its stdin and a wrapper, never the env a backend sees, and the
    # output is redacted as it is captured (core.secrets_inject); secrets at egress give it placeholders that the
    # egress proxy swaps for the values in HTTPS requests to their hosts only (core.egress_secrets).
    secrets = egress_secrets.plan(request, argv, backend=backend)
    spec = ExecSpec(argv=secrets.argv, env=secrets.env, stdin=secrets.stdin, workdir=session.workspace,
                    timeout=request.timeout, max_output_bytes=request.max_output_bytes, network=request.network,
                    limits=request.limits, on_output=output.feed if output else None)
    with secrets.active():
        result = await _session_exec(backend, session, spec)
    result = result.model_copy(update={
        "backend": backend.name, "filtered_env": dropped, "notes": [*result.notes, *backend.notes()],
    })
    result = explain(result, timeout=request.timeout, asked_timeout=asked_timeout,
                     max_timeout=backend.shared.max_timeout_sec, memory_mb=request.limits.memory_mb,
                     network=request.network)
    return secrets.finish(result)


async def _exec_audited(audit: audit_log.AuditLog, backend: ExecutionBackend, session: Session,
                        request: ExecRequest, dropped: list[str], *, session_id: str | None = None,
                        records: list[asyncio.Task[str | None]] | None = None, **kw: Any) -> ExecResult:
    """``_exec_in``, recorded in the audit log: what ran (hashes and names, never values), where, and what came
    back; a run that raised is recorded as exec.error. A record that cannot be written is a note on the result,
    never an error instead of it. With ``records``, the record of a run that returned is started there, for the
    caller to await (and take its note from) after what it does next."""
    if not audit.enabled:
        return await _exec_in(backend, session, request, dropped, **kw)
    fields = audit_log.exec_fields(backend, request, dropped, session=session_id or audit_log.new_session_id(),
                                   oneshot=session_id is None)
    try:
        result = await _exec_in(backend, session, request, dropped, **kw)
    except BaseException as exc:
        await audit.arecord("exec.error", **fields, **audit_log.error_fields(exc))
        raise
    record = audit.arecord("exec", **fields, **audit_log.result_fields(result, audit.keep_output))
    if records is not None:
        records.append(asyncio.ensure_future(record))
        return result
    note = await record
    return result if note is None else result.model_copy(update={"notes": [*result.notes, note]})


async def _session_exec(backend: ExecutionBackend, session: Session, spec: ExecSpec) -> ExecResult:
    """One exec, with the backend's errors translated, bounded by its timeout and CODE_EXEC_BACKEND_GRACE_SEC."""
    with backend_errors(backend.name):
        return await bounded(session.exec(spec), spec.timeout + backend.shared.backend_grace_sec, backend=backend,
                             doing="exec", session=session)


def _cell_fields(result: CellResult, audit: audit_log.AuditLog) -> dict[str, Any]:
    """What the audit log keeps of a cell: its outcome, output hashes (text only when configured), MIME types."""
    return {"timed_out": result.timed_out, "oom_killed": result.oom_killed, "state_lost": result.state_lost,
            "error": result.error.name if result.error else None, "duration_s": result.duration_s,
            "execution_count": result.execution_count,
            "stdout": audit_log.stream_fields(result.stdout, audit.keep_output),
            "stderr": audit_log.stream_fields(result.stderr, audit.keep_output),
            "outputs": [sorted(output.data) for output in result.outputs]}


class AsyncSandbox:
    """A persistent sandbox: files and installed packages survive between execs until it closes."""

    def __init__(self, runner: AsyncRunner, backend: str | None, *, network: NetworkMode | None, limits: Limits | None,
                 name: str | None, lifetime_s: float, options: Mapping[str, Any] | None = None,
                 mounts: Sequence[Mount] | None = None, package_cache: bool = False,
                 pip: Sequence[str] | None = None) -> None:
        self.runner = runner
        self._mounts = list(mounts or [])
        self._package_cache = package_cache
        self._pip = packages.check_requirements(pip) if pip else []
        # Variables every exec of this sandbox gets from execbox itself (the package cache's pip settings).
        self._extra_env: dict[str, str] = {}
        #: True when the sandbox was made by a module-level helper: it then closes its runner too.
        self.owns_runner = False
        self._backend_name = backend
        self._options = dict(options or {})
        self._network = network or runner.settings.network
        self._limits = limits
        self._name = name
        self._lifetime_s = lifetime_s
        self._session: Session | None = None
        self._kernel: Kernel | None = None  # run_cell's interpreter, started by the first cell
        #: Seconds this sandbox waited for a slot (CODE_EXEC_MAX_CONCURRENT) before it opened.
        self.queued_s = 0.0
        self.backend: ExecutionBackend | None = None
        self.capabilities: Capabilities | None = None
        #: This sandbox's id in the audit log (its open, execs and close carry it).
        self.id = audit_log.new_session_id()
        #: Secrets every exec gets (``sandbox(secrets=...)``); ``_given``: every secret any exec got, for redaction
        #: of what the code may have left in the workspace (listings).
        self.secrets: dict[str, secrets_inject.Secret] = {}
        self.secrets_at_egress: dict[str, tuple[str, int, secrets_inject.Secret]] = {}
        self._given: dict[str, secrets_inject.Secret] = {}

    async def __aenter__(self) -> AsyncSandbox:
        probe = ExecRequest(argv=["true"], network=self._network, limits=self._limits)
        resolved, _, asked = self.runner.prepare(probe)
        self.backend, self.capabilities = await self.runner._admitted(self._backend_name, resolved, asked, session=True,
                                                                      options=self._options, session_id=self.id)
        cache = self.runner.package_cache
        mounts = self.runner.guard.check_mounts(self.backend, self.capabilities, self._mounts,
                                                state=self.runner.state_places())
        if self._package_cache:
            mounts = (*mounts, *self._cache_mount(self.backend, self.capabilities, cache))
        spec = SessionSpec(self._network, resolved.limits or Limits(), False, self._lifetime_s, self._name,
                           mounts=mounts)
        _enough_threads(self.runner.slots.total)
        self.queued_s = await self.runner.slots.acquire(self.runner.settings.queue_timeout_sec, "this sandbox")
        try:
            self._session = await _open(self.backend, spec)
        except BaseException:
            self.runner.slots.release()
            raise
        self._session.session_spec = spec
        await self.runner.audit.arecord("sandbox.open", **audit_log.sandbox_fields(self.id, self.backend, spec))
        if self._pip:
            try:
                installed = await self.pip_install(*self._pip)
                if not installed.ok:
                    raise SandboxError(f"pip could not install {', '.join(self._pip)} in the sandbox from the "
                                       f"package cache: {installed.stderr[-800:]}", backend=self.backend.name)
            except BaseException:
                await self.close()
                raise
        return self

    def _cache_mount(self, backend: ExecutionBackend, caps: Capabilities, cache: Path) -> tuple[Mount, ...]:
        """The package cache, read-only at packages.SANDBOX_DIR, and pip pointed at it (offline when the network is
        none). Trusted: execbox's own directory, filled only on the host (core.packages)."""
        if not caps.mounts:
            raise UnsupportedPolicyError(
                f"refused: backend {backend.name!r} cannot bind the package cache (it takes no mounts); install "
                "packages in the sandbox itself, or bake them into the image", backend=backend.name)
        packages.ensure_cache(cache)
        self._extra_env = {"PIP_FIND_LINKS": packages.SANDBOX_DIR, "PIP_BREAK_SYSTEM_PACKAGES": "1",
                           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        if self._network == "none":
            self._extra_env["PIP_NO_INDEX"] = "1"  # nothing to reach: do not make pip retry an index for minutes
        # model_construct: /opt/execbox is reserved for execbox's own mounts, which the caller's may not cover.
        return (Mount.model_construct(source=str(cache), target=packages.SANDBOX_DIR, writable=False),)

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
        if self.owns_runner:
            await self.runner.aclose()

    async def close(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            with anyio.CancelScope(shield=True):
                await kernel.close()
        if self._session is not None:
            session, self._session = self._session, None
            try:
                assert self.backend is not None
                with backend_errors(self.backend.name):
                    await close_bounded(session, self.backend)
            finally:
                self.runner.slots.release()
                await self.runner.audit.arecord("sandbox.close", session=self.id,
                                                backend=self.backend.name if self.backend else None)

    @property
    def broken(self) -> str | None:
        """Why this sandbox is broken (a backend call on it overran its bound, and it was closed), or None."""
        return None if self._session is None else broken(self._session)

    def _live(self) -> tuple[ExecutionBackend, Session]:
        if self._session is None or self.backend is None:
            raise SandboxError("this sandbox is not open (closed already, or never entered): use it as "
                               "`async with runner.sandbox() as sb:` and call it inside that block")
        why = broken(self._session)
        if why is not None:
            raise SandboxError(f"this sandbox is broken and was closed: {why}. Open another sandbox",
                               backend=self.backend.name)
        return self.backend, self._session

    async def execute(self, request: ExecRequest, *, output: LiveOutput | None = None) -> ExecResult:
        backend, session = self._live()
        if self.secrets or self.secrets_at_egress:
            request = request.model_copy(update={"secrets": {**self.secrets, **request.secrets}, "secrets_at_egress": {
                **self.secrets_at_egress, **request.secrets_at_egress}})
        self._given.update(request.secrets)
        try:
            resolved, dropped = self._admit(backend, request)
        except ExecboxError as exc:
            await self.runner.audit.arecord("refused", **audit_log.refusal_fields(
                exc, request, backend=backend.name, session=self.id, oneshot=False))
            raise
        result = await _exec_audited(self.runner.audit, backend, session, resolved, dropped, session_id=self.id,
                                     asked_timeout=request.timeout, output=output)
        return await self.runner.collected(backend, session, resolved, result)

    def _admit(self, backend: ExecutionBackend, request: ExecRequest) -> tuple[ExecRequest, list[str]]:
        """The request resolved for this sandbox, or the refusal: the session's rules."""
        if request.network is not None and request.network != self._network:
            raise UnsupportedPolicyError(
                f"refused: this sandbox was opened with network {self._network!r}; a session cannot change it. "
                "Open another sandbox with the network mode you need", backend=backend.name)
        if request.limits is not None and request.limits != self._limits:
            raise UnsupportedPolicyError(
                f"refused: this sandbox was opened with limits {self._limits}; a session cannot change them per exec. "
                "Open another sandbox with the limits you need", backend=backend.name)
        if request.mounts:
            raise UnsupportedPolicyError(
                "refused: a sandbox's mounts are fixed when it opens; give them to sandbox(mounts=[...])",
                backend=backend.name)
        # Admitted when it opened: the network and limits cannot change, and the backend is the same one. Only
        # the seed scan runs again: it guards every unsandboxed run, and a seed may have appeared since.
        resolved, dropped, _ = self.runner.prepare(request.model_copy(update={"network": self._network,
                                                                               "limits": self._limits}))
        self.runner.guard.check_secrets(backend)
        if self._extra_env:
            resolved = resolved.model_copy(update={"env": {**self._extra_env, **resolved.env}})
        return resolved, dropped

    async def exec(self, command: str | Sequence[str], *, on_stdout: OnText | None = None,
                   on_stderr: OnText | None = None, **kw: Any) -> ExecResult:
        """Run a command in this sandbox; ``on_stdout`` / ``on_stderr`` get the output as it arrives."""
        request = _command_request(command, **_request_kw(**kw))
        return await deliver(lambda out: self.execute(request, output=out), on_stdout, on_stderr)

    async def run_code(self, code: str, language: Language = "python", *, on_stdout: OnText | None = None,
                       on_stderr: OnText | None = None, **kw: Any) -> ExecResult:
        request = _request(code=code, language=language, **_request_kw(**kw))
        return await deliver(lambda out: self.execute(request, output=out), on_stdout, on_stderr)

    def stream(self, command: str | Sequence[str], **kw: Any) -> AsyncGenerator[OutputEvent | ExecResult, None]:
        """``async for event in sb.stream(cmd):`` OutputEvents as the output arrives, then the ExecResult."""
        request = _command_request(command, **_request_kw(**kw))
        return stream_events(lambda out: self.execute(request, output=out))

    def stream_code(self, code: str, language: Language = "python",
                    **kw: Any) -> AsyncGenerator[OutputEvent | ExecResult, None]:
        request = _request(code=code, language=language, **_request_kw(**kw))
        return stream_events(lambda out: self.execute(request, output=out))

    async def run_cell(self, code: str, *, timeout: float | None = None, on_stdout: OnText | None = None,
                       on_stderr: OnText | None = None) -> CellResult:
        """Run Python in this sandbox's persistent interpreter (kernel/client.py): variables, imports and open files
        persist from cell to cell; the last expression's value and display()ed objects come back as MIME bundles,
        matplotlib figures as PNG. A cell past its timeout is interrupted (KeyboardInterrupt, state kept) or, if
        it does not stop, its interpreter is killed: the result then says ``state_lost``, never silently."""
        backend, session = self._live()
        request = _request(code=_text(code, "code"), language="python", timeout=timeout)
        try:
            resolved, _ = self._admit(backend, request)
        except ExecboxError as exc:
            await self.runner.audit.arecord("refused", **audit_log.refusal_fields(
                exc, request, backend=backend.name, session=self.id, oneshot=False))
            raise
        if self._kernel is None:
            from execbox.kernel.client import Kernel  # only sandboxes that run cells need the kernel's client

            assert resolved.limits and resolved.max_output_bytes and self.capabilities
            self._kernel = Kernel(functools.partial(_session_exec, backend, session), workspace=session.workspace,
                                  network=self._network, limits=resolved.limits, lifetime_s=self._lifetime_s,
                                  max_output_bytes=resolved.max_output_bytes, streaming=self.capabilities.streaming,
                                  max_display_bytes=self.runner.settings.max_display_bytes, backend=backend.name)
        kernel, timeout_s = self._kernel, resolved.timeout or self.runner.settings.max_timeout_sec
        # The interpreter gets no secrets, but an exec of this sandbox may have left one where a cell reads it.
        redactor = self._redactor()
        if redactor is not None:
            (on_stdout, on_stderr), finish = secrets_inject.redacted_callbacks(redactor, on_stdout, on_stderr)
        fields = audit_log.exec_fields(backend, resolved, [], session=self.id, oneshot=False)
        try:
            with secrets_inject.redacting(redactor):  # the interpreter's errors quote what the code left, too
                result = await deliver(lambda out: kernel.run_cell(code, timeout=timeout_s, live=out), on_stdout,
                                       on_stderr)
        except BaseException as exc:  # recorded as an exec that raised is (a stuck backend, a broken sandbox)
            await self.runner.audit.arecord("cell.error", **fields, **audit_log.error_fields(exc))
            raise
        if redactor is not None:
            await finish()
            result = secrets_inject.redact_model(result, redactor)
        note = await self.runner.audit.arecord("cell", **fields, **_cell_fields(result, self.runner.audit))
        # Said as exec says it (core.results): a cell's timeout cut to the maximum.
        notes = [clamp_note(timeout, backend.shared.max_timeout_sec), note]
        return result.model_copy(update={"notes": [*result.notes, *(n for n in notes if n)]})

    @property
    def workspace(self) -> str:
        """Where the workspace is inside the sandbox, as its commands see it (relative paths start there)."""
        return self._live()[1].workspace

    async def write_file(self, path: str, data: bytes | str) -> None:
        backend, session = self._live()
        rel, content = normalize(_text(path, "path"), session.workspace), _bytes(data, "data")
        with backend_errors(backend.name):
            await bounded(session.write_file(rel, content), _files_s(backend), backend=backend, doing="write_file",
                          session=session)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The file's bytes; one over ``max_bytes`` (at most CODE_EXEC_MAX_READ_BYTES) is refused unread
        (FileTooLargeError)."""
        backend, session = self._live()
        if normalize(_text(path, "path"), session.workspace, allow_root=True) == "":
            raise is_directory_error("")
        rel = normalize(path, session.workspace)
        cap = min(max_bytes or self.runner.settings.max_read_bytes, self.runner.settings.max_read_bytes)
        with backend_errors(backend.name):
            return await bounded(session.read_file(rel, cap), _files_s(backend), backend=backend, doing="read_file",
                                 session=session)

    async def list_files(self, path: str = ".", *, recursive: bool = False) -> list[FileInfo]:
        """What is in the directory ``path`` of the workspace (everything below it with ``recursive``): names,
        sizes and types, links shown as links (never followed); bounded by CODE_EXEC_MAX_TRANSFER_FILES."""
        backend, session = self._live()
        rel = normalize(_text(path, "path"), session.workspace, allow_root=True)
        with secrets_inject.redacting(self._redactor()), backend_errors(backend.name):
            found = await bounded(session.list_files(rel, recursive=bool(recursive),
                                                     limits=self.runner.transfer_limits),
                                  _files_s(backend), backend=backend, doing="list_files", session=session)
        return secrets_inject.redact_listing(found, self._redactor())

    def _redactor(self) -> secrets_inject.Redactor | None:
        """Every secret this sandbox was given: the code may have left one in a file name."""
        given = {**self._given, **self.secrets}
        return secrets_inject.Redactor(given) if given else None

    async def upload(self, local_path: str | os.PathLike[str], remote: str | None = None) -> Transfer:
        """Copy a local file or directory into the workspace at ``remote`` (default: its name at the top of the
        workspace; "." = into the workspace itself), streamed as tar and bounded by CODE_EXEC_MAX_TRANSFER_BYTES.
        Links in the local tree are copied as links, never followed; the guard refuses the same places as for a
        mount (your home itself, ~/.ssh, ...) and scans the tree for wallet seeds."""
        backend, session = self._live()
        local = _text(os.fspath(local_path), "local path")
        admit_upload(local, backend=backend.name, state=self.runner.state_places())
        return await self.runner.upload_to(backend, session, local,
                                           remote if remote is not None else os.path.basename(os.path.abspath(local)))

    async def download(self, remote: str, local_path: str | os.PathLike[str]) -> Transfer:
        """Copy a workspace file or directory ("." = the whole workspace) to ``local_path`` (the file, or inside
        it when it is an existing directory; a directory is made or merged into). Bounded by
        CODE_EXEC_MAX_TRANSFER_BYTES / _FILES before a byte is read; nothing is followed and no symlink, hard link
        or device the code left is created here (``skipped``)."""
        backend, session = self._live()
        return await self.runner.download_from(backend, session, remote, os.fspath(local_path), self._redactor())

    async def pip_install(self, *requirements: str) -> ExecResult:
        """Install Python packages into this sandbox from the per-user package cache (``package_cache=True``):
        the wheels are fetched on the host by a trusted step (core.packages: the host's pip configuration,
        wheels only) when the cache lacks them, then pip installs them inside the sandbox with no index. The
        result is the install's; a note says how many wheels came from the cache and how many were fetched."""
        backend, session = self._live()
        reqs = packages.check_requirements(requirements)
        if not self._extra_env:
            raise ConfigError("this sandbox was opened without the package cache: open it with "
                              "sandbox(..., package_cache=True) (or pip=[...])")
        probe = await self.exec(["python3", "-c", packages.PROBE], timeout=60)
        if not probe.ok:
            raise SandboxError(f"the sandbox has no working python3 to install into: {probe.stderr[-400:]}",
                               backend=backend.name)
        target = packages.PythonTarget.parse(probe.stdout)
        fill = await anyio.to_thread.run_sync(packages.fill_cache, self.runner.package_cache, reqs, target)
        # PIP_FIND_LINKS (set for this sandbox) points pip at the cache; --no-index: nothing else is looked at.
        result = await self.exec(["python3", "-m", "pip", "install", "--no-index", "--progress-bar", "off", *reqs])
        note = (f"package cache: {len(fill.downloaded)} wheel(s) fetched on the host ({', '.join(fill.downloaded)}), "
                f"{len(fill.cached)} from the cache") if fill.downloaded else (
                f"package cache: every wheel came from the cache ({len(fill.cached)}), nothing was downloaded")
        return result.model_copy(update={"notes": [*result.notes, note]})


# Sync facades whose event-loop thread is open (listed weakly: a dropped one closes through its finalizer). One
# left open by its owner (an exception outside its `with`, a forgotten close) is closed when the interpreter
# exits, by atexit, while that thread still runs: later, daemon threads are frozen, and the portal's own clean-up
# would wait on its frozen thread for ever — the program would hang at exit, its sandbox running.
_OPEN_FACADES: weakref.WeakSet[Runner | Sandbox] = weakref.WeakSet()


@atexit.register
def _close_forgotten() -> None:
    for facade in list(_OPEN_FACADES):
        with contextlib.suppress(Exception):
            facade.close()


def _forget_in_child() -> None:
    # A forked child (multiprocessing's workers, say) does not own its parent's sandboxes: closing them would end
    # the parent's; and it has no event-loop thread to reach them through (waiting on one hung it at exit).
    for facade in list(_OPEN_FACADES):
        facade._forget()
    _OPEN_FACADES.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class _LoopThread:
    """An event loop in a daemon thread, reached through its BlockingPortal: anyio's start_blocking_portal as an
    object, not a generator, so that a forked child can simply drop it (a generator's clean-up would wait for
    ever on a thread the child does not have)."""

    def __init__(self) -> None:
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve)
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for the portal
                if not ready.done():
                    ready.set_exception(exc)

        self._thread = threading.Thread(target=run, daemon=True, name="execbox-portal")
        self._thread.start()
        self.portal = ready.result()

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` in the loop and wait for it. Anything raised here while it runs (Ctrl-C, the CLI's SIGTERM)
        cancels that call alone, waits for its clean-up (its sandbox removed), and is raised again."""
        finished = threading.Event()

        async def tracked() -> T:
            try:
                return await fn()
            finally:
                finished.set()

        future = self.portal.start_task_soon(tracked)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                future.cancel()  # the portal cancels the call's scope in the loop
                while not finished.wait(0.1) and self._thread.is_alive():
                    pass
            raise

    def stop(self, cancel: bool = False) -> None:
        """Stop the loop (cancelling what still runs in it when ``cancel``) and wait for its thread."""
        with contextlib.suppress(RuntimeError):  # stopped already
            self.portal.call(self.portal.stop, cancel)
        # What the loop still runs now are backend calls the runner abandoned (core.backend.bounded), which the
        # loop's end would wait for: a call deaf to cancellation would hang this for ever. The thread is a daemon.
        self._thread.join(LOOP_EXIT_S)

    def shut(self, *closers: Callable[[], Awaitable[object]], cancel: bool = False) -> None:
        """Run ``closers`` in the loop, then stop it: a facade's clean-up."""
        try:
            for closer in closers:
                self.portal.call(closer)
        finally:
            self.stop(cancel)


class _Closing:
    """A facade's clean-up (``closers`` in its loop, then the loop stopped), run once: ``now`` waits for it (close,
    exit); the facade's garbage collection starts it in a thread of its own, since a collection may run in any
    thread, holding any lock, and must not wait there. That thread is not a daemon: exit waits for it."""

    def __init__(self, facade: Runner | Sandbox, loop: _LoopThread, *closers: Callable[[], Awaitable[object]]) -> None:
        self._finalizer = weakref.finalize(facade, _shut_soon, loop, closers)
        self._finalizer.atexit = False  # _close_forgotten closes it then, waiting
        _OPEN_FACADES.add(facade)

    def now(self, *, cancel: bool = False) -> None:
        detached = self._finalizer.detach()
        if detached is not None:
            _, _, (loop, closers), _ = detached
            loop.shut(*closers, cancel=cancel)

    def forget(self) -> None:
        self._finalizer.detach()


def _shut_soon(loop: _LoopThread, closers: tuple[Callable[[], Awaitable[object]], ...]) -> None:
    threading.Thread(target=loop.shut, args=closers, name="execbox-close").start()


class Runner:
    """The sync facade of AsyncRunner: same methods, blocking; ``with Runner() as runner:`` closes its backends.

    Its first call starts an event-loop thread that its later calls reuse (a thread per call cost ~1-2 ms);
    ``close``, or the runner's garbage collection, or the interpreter's exit ends it."""

    def __init__(self, settings: Settings | None = None, *,
                 options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.aio = AsyncRunner(settings, options=options)
        self._loop: _LoopThread | None = None
        self._closing: _Closing | None = None
        self._pool_task: concurrent.futures.Future[None] | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> Runner:
        # With a warm pool, the pool refills in the background in the runner's event loop for its life.
        loop = self._loop_thread()
        with self._lock:
            if self.aio.settings.pool_size and self._pool_task is None:
                self._pool_task, _ = loop.portal.start_task(self.aio.serve_pool)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop_thread(self) -> _LoopThread:
        with self._lock:
            if self._loop is None:
                self._loop = _LoopThread()
                self._closing = _Closing(self, self._loop, self.aio.aclose)
            return self._loop

    def _forget(self) -> None:
        if self._closing is not None:
            self._closing.forget()
        self._loop = self._closing = self._pool_task = None
        self._lock = threading.Lock()  # held by the parent's thread at the fork, maybe

    def close(self) -> None:
        with self._lock:
            closing, pool_task = self._closing, self._pool_task
            self._loop = self._closing = self._pool_task = None
        _OPEN_FACADES.discard(self)
        if closing is None:
            run_blocking(self.aio.aclose)
            return
        closing.now()
        if pool_task is not None:
            pool_task.result()  # what went wrong in the pool's background work, if anything

    def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return self._loop_thread().call(fn)

    def warm(self, backend: str | None = None, **kw: Any) -> int:
        return self._call(functools.partial(self.aio.warm, backend, **kw))

    @property
    def settings(self) -> Settings:
        return self.aio.settings

    @property
    def audit(self) -> audit_log.AuditLog:
        return self.aio.audit

    def run(self, command: str | Sequence[str], **kw: Any) -> ExecResult:
        return self._call(functools.partial(self.aio.run, command, **kw))

    def run_code(self, code: str, language: Language = "python", **kw: Any) -> ExecResult:
        return self._call(functools.partial(self.aio.run_code, code, language, **kw))

    def execute(self, request: ExecRequest, *, backend: str | None = None, **kw: Any) -> ExecResult:
        return self._call(functools.partial(self.aio.execute, request, backend=backend, **kw))

    def sandbox(self, backend: str | None = None, **kw: Any) -> Sandbox:
        return Sandbox(self.aio.sandbox(backend, **kw), runner=self)


def run_blocking(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine function to completion from sync code, in a private event loop thread (so it also
    works inside a program that already runs a loop). Ctrl-C cancels it, and its clean-up still runs.

    A _LoopThread, not anyio's start_blocking_portal: with that, a Ctrl-C (or the CLI's SIGTERM) landing
    while the portal started left the main thread joining a loop thread that nobody would stop, for ever."""
    loop = _LoopThread()
    try:
        result: T = loop.portal.call(fn)
    except BaseException:
        loop.stop(cancel=True)
        raise
    loop.stop()
    return result


class Sandbox:
    """The sync facade of AsyncSandbox; use it as a context manager."""

    def __init__(self, inner: AsyncSandbox, *, runner: Runner | None = None) -> None:
        self.aio = inner
        # The facade of the runner it came from, kept alive: collected, it would close the backends this uses.
        self._runner = runner
        self._loop: _LoopThread | None = None
        self._closing: _Closing | None = None

    def __enter__(self) -> Sandbox:
        loop = _LoopThread()
        try:
            loop.portal.call(self.aio.__aenter__)
        except BaseException:
            loop.stop(cancel=True)
            raise
        self._loop = loop
        closers = [self.aio.close, *([self.aio.runner.aclose] if self.aio.owns_runner else [])]
        self._closing = _Closing(self, loop, *closers)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(*exc)

    def _forget(self) -> None:
        if self._closing is not None:
            self._closing.forget()
        self._loop = self._closing = None

    def close(self, *exc: Any) -> None:
        """Close the sandbox (what ``with`` does on leaving the block); a second call does nothing."""
        closing, self._loop, self._closing = self._closing, None, None
        _OPEN_FACADES.discard(self)
        if closing is not None:
            closing.now(cancel=bool(exc) and exc[0] is not None)

    @property
    def backend(self) -> ExecutionBackend | None:
        return self.aio.backend

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kw: Any) -> T:
        if self._loop is None:
            raise SandboxError("this sandbox is not open (closed already, never entered, or opened by the process "
                               "this one was forked from): use it as `with execbox.sandbox() as sb:` and call it "
                               "inside that block")
        return self._loop.call(functools.partial(fn, *args, **kw))

    def exec(self, command: str | Sequence[str], **kw: Any) -> ExecResult:
        return self._call(self.aio.exec, command, **kw)

    def run_code(self, code: str, language: Language = "python", **kw: Any) -> ExecResult:
        return self._call(self.aio.run_code, code, language, **kw)

    def run_cell(self, code: str, **kw: Any) -> CellResult:
        """Python in this sandbox's persistent interpreter; see AsyncSandbox.run_cell."""
        return self._call(self.aio.run_cell, code, **kw)

    def execute(self, request: ExecRequest) -> ExecResult:
        return self._call(self.aio.execute, request)

    def write_file(self, path: str, data: bytes | str) -> None:
        self._call(self.aio.write_file, path, data)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return self._call(self.aio.read_file, path, max_bytes=max_bytes)

    def list_files(self, path: str = ".", *, recursive: bool = False) -> list[FileInfo]:
        return self._call(self.aio.list_files, path, recursive=recursive)

    def upload(self, local_path: str | os.PathLike[str], remote: str | None = None) -> Transfer:
        return self._call(self.aio.upload, local_path, remote)

    def download(self, remote: str, local_path: str | os.PathLike[str]) -> Transfer:
        return self._call(self.aio.download, remote, local_path)

    def pip_install(self, *requirements: str) -> ExecResult:
        return self._call(self.aio.pip_install, *requirements)
