"""The one path of a request: settings -> registry -> guard -> session -> result (issue 26's pipeline)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from pydantic import ValidationError

from execbox.core import audit as audit_log
from execbox.core import egress_secrets, secrets_inject
from execbox.core.backend import ExecutionBackend, Session, SessionSpec, bounded, close_bounded
from execbox.core.errors import (
    ConfigError,
    ExecboxError,
    SandboxError,
    WorkspacePathError,
)
from execbox.core.models import (
    Capabilities,
    CellResult,
    ExecRequest,
    ExecResult,
    ExecSpec,
    Limits,
    Mount,
    NetworkMode,
)
from execbox.core.output import LiveOutput
from execbox.core.results import explain
from execbox.core.workspace import normalize

if TYPE_CHECKING:
    pass


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



def _sandbox_secrets(secrets: Mapping[str, Any] | None, *, egress: bool = False) -> dict[str, Any]:
    try:
        return egress_secrets.check(secrets or {}) if egress else secrets_inject.check_secrets(secrets or {})
    except ValueError as exc:
        raise ConfigError(f"invalid {'secrets_at_egress' if egress else 'secrets'}: {exc}") from None


async def _open(backend: ExecutionBackend, spec: SessionSpec) -> Session:
    """A new sandbox, within CODE_EXEC_OPEN_TIMEOUT_SEC; one that opens after that is closed when it does."""
    with backend_errors(backend.name):
        return await bounded(backend.open_session(spec), backend.settings.open_timeout_sec, backend=backend,
                             doing="open_session", late=lambda late: close_bounded(late, backend))


async def _check(backend: ExecutionBackend) -> Capabilities:
    """What the backend enforces here (its check: cached, or a probe), within CODE_EXEC_OPEN_TIMEOUT_SEC."""
    return await bounded(backend.check(), backend.settings.open_timeout_sec, backend=backend,
                         doing="its availability check")


def _files_s(backend: ExecutionBackend) -> float:
    """The bound of one file call or transfer: the longest run, and the grace."""
    return backend.settings.max_timeout_sec + backend.settings.backend_grace_sec


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
                secrets_at_egress: egress_secrets.Given | None = None) -> dict[str, Any]:
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
                     max_timeout=backend.settings.max_timeout_sec, memory_mb=request.limits.memory_mb,
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
        return await bounded(session.exec(spec), spec.timeout + backend.settings.backend_grace_sec, backend=backend,
                             doing="exec", session=session)


def _cell_fields(result: CellResult, audit: audit_log.AuditLog) -> dict[str, Any]:
    """What the audit log keeps of a cell: its outcome, output hashes (text only when configured), MIME types."""
    return {"timed_out": result.timed_out, "oom_killed": result.oom_killed, "state_lost": result.state_lost,
            "error": result.error.name if result.error else None, "duration_s": result.duration_s,
            "execution_count": result.execution_count,
            "stdout": audit_log.stream_fields(result.stdout, audit.keep_output),
            "stderr": audit_log.stream_fields(result.stderr, audit.keep_output),
            "outputs": [sorted(output.data) for output in result.outputs]}

