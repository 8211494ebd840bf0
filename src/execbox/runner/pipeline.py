"""The one path of a request, in four stages, each only calling down:

    admit(runner, request, ...) -> Admission   settings resolved, env filtered, backend chosen, the guard run once
                                               (mounts, uploads, secrets at egress included); a refusal is one
                                               `refused` audit record, before any sandbox opens
    plan(admission, session) -> Plan          the ExecSpec, complete and frozen: the redactor and the secrets at
                                               egress travel in it
    session.exec(spec)                        bounded by the timeout and the grace (_session_exec)
    finish(raw, admission, plan) -> ExecResult  stamped, explained, collected files added, redacted

One-shots (AsyncRunner.execute), a sandbox's execs (AsyncSandbox.execute) and its opening, the warm pool's
configurations and the guard questions of doctor (``configuration``, AsyncRunner.judge) all go through here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
from pydantic import ValidationError

from execbox.audit import fields as audit_fields
from execbox.audit import log as audit_log
from execbox.contract.backend import ExecutionBackend, Session, SessionSpec, bounded, close_bounded
from execbox.contract.models import (
    Capabilities,
    CellResult,
    ExecRequest,
    ExecResult,
    ExecSpec,
    Limits,
    Mount,
    NetworkMode,
)
from execbox.contract.output import LiveOutput
from execbox.contract.results import clamp_note, explain
from execbox.errors import (
    ConfigError,
    ExecboxError,
    SandboxError,
    UnsupportedPolicyError,
    WorkspacePathError,
)
from execbox.files import transfer
from execbox.files.transfer import Transfer
from execbox.files.workspace import normalize
from execbox.guard.mounts import admit_upload
from execbox.kit import transfers
from execbox.policy.env import filter_env
from execbox.secrets import egress as egress_given
from execbox.secrets import run as secret_run
from execbox.secrets import values as secrets_inject
from execbox.telemetry import annotate, current_span, outcome, record_refusal, record_run, sandbox_opened, span

if TYPE_CHECKING:
    from pathlib import Path

    from execbox.audit.log import AuditLog
    from execbox.config.settings import Settings
    from execbox.guard.guard import Guard
    from execbox.runner.scheduler import Slots
    from execbox.runner.snapshots import Snapshot


class Host(Protocol):
    """What the pipeline needs of the runner it serves (AsyncRunner is the one): a protocol, so that the
    pipeline sits below the runner that calls it."""

    settings: Settings
    guard: Guard
    audit: AuditLog

    def backend(self, name: str, options: Mapping[str, Any] | None = None) -> ExecutionBackend: ...

    async def select(self, name: str | None = None, *, session: bool = False,
                     network: NetworkMode | None = None) -> tuple[ExecutionBackend, Capabilities]:
        ...

    def state_places(self) -> list[str]: ...


class SandboxHost(Host, Protocol):
    """What a sandbox needs of the runner that opened it, beyond the pipeline's needs."""

    slots: Slots

    @property
    def transfer_limits(self) -> transfer.TransferLimits: ...

    @property
    def package_cache(self) -> Path: ...

    async def aclose(self) -> None: ...

    async def upload_to(self, backend: ExecutionBackend, session: Session, local: str, remote: str) -> Transfer: ...

    async def download_from(self, backend: ExecutionBackend, session: Session, remote: str, local: str,
                            redactor: secrets_inject.Redactor | None = None) -> Transfer: ...

    async def take_snapshot(self, backend: ExecutionBackend, session: Session, *, name: str | None, memory: bool,
                            network: NetworkMode, limits: Limits | None, origin: str) -> Snapshot: ...

    async def load_snapshot(self, snapshot_id: str) -> Snapshot: ...

    async def delete_snapshot(self, snapshot: Snapshot | str) -> None: ...


def _request(**kw: Any) -> ExecRequest:
    return request_from(kw)


def request_from(fields: Mapping[str, Any]) -> ExecRequest:
    """An ExecRequest from its fields, or a ConfigError naming each field's problem (never the value: a secret)."""
    try:
        return ExecRequest.model_validate(fields)
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
        return egress_given.check(secrets or {}) if egress else secrets_inject.check_secrets(secrets or {})
    except ValueError as exc:
        raise ConfigError(f"invalid {'secrets_at_egress' if egress else 'secrets'}: {exc}") from None


# --- stage 1: admission ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Admission:
    """A request judged and resolved before any sandbox opens: what the later stages run, and nothing else.

    ``request`` has the settings applied (defaults, clamps, the env policy; ``dropped`` names what the policy
    took out); ``asked`` is the request as the caller gave it. ``mounts`` are resolved and admitted (the uploads
    were judged like them, before it was made). ``session`` is the audit id of the sandbox it runs in (None for a
    one-shot). ``settings`` are the runner's, which judged it (the collected files' bounds come from there)."""

    settings: Settings
    backend: ExecutionBackend
    capabilities: Capabilities
    request: ExecRequest
    asked: ExecRequest
    dropped: list[str]
    mounts: tuple[Mount, ...] = ()
    session: str | None = None


def configuration(network: NetworkMode | None, limits: Limits | None = None, *, mounts: Sequence[Mount] = (),
                  secrets: Mapping[str, secrets_inject.Secret] | None = None,
                  secrets_at_egress: Mapping[str, tuple[str, int, secrets_inject.Secret]] | None = None,
                  timeout: float | None = None, tmpfs: Sequence[str] = ()) -> ExecRequest:
    """A sandbox's configuration (or a backend's default one) as the request the guard judges: what a sandbox
    opens with, what the warm pool fills for, what ``doctor`` and ``auto`` ask about. It names no command of the
    caller's: the audit record of its refusal has no command fields (``admit(opening=...)``)."""
    request = _request(argv=["true"], network=network, limits=limits, mounts=list(mounts), timeout=timeout,
                       tmpfs=list(tmpfs))
    return request.model_copy(update={"secrets": dict(secrets or {}),
                                      "secrets_at_egress": dict(secrets_at_egress or {})})


def resolve(settings: Settings, request: ExecRequest) -> tuple[ExecRequest, list[str], set[str]]:
    """The request with the settings applied (defaults, clamps, env policy); the dropped env names; the
    limits demanded: those the request names, and those the operator set explicitly (CODE_EXEC_MEMORY_MB,
    CODE_EXEC_CPUS, CODE_EXEC_PIDS_LIMIT). A backend that cannot enforce a demanded limit refuses; the
    built-in defaults apply wherever a backend can enforce them."""
    s = settings
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
    by_field = {"memory_mb": "memory", "cpus": "cpu", "pids_limit": "pids", "disk_mb": "disk"}
    operator = {limit for field, limit in by_field.items() if field in s.model_fields_set}
    return resolved, dropped, asked.names() | operator


async def admit(runner: Host, request: ExecRequest, *, backend: str | None = None,
                options: Mapping[str, Any] | None = None, uploads: Sequence[tuple[str, str]] = (),
                opening: str | None = None, within: Admission | None = None,
                extra_env: Mapping[str, str] | None = None, package_cache: bool = False) -> Admission:
    """The one place a request is judged, before any sandbox opens: settings resolved, env filtered, the backend
    chosen (``auto`` resolved) and the guard run once (verdict, seed scan, network and limits, mounts, uploads,
    secrets at egress). Any refusal is raised after exactly one `refused` audit record.

    ``opening``: the audit id of a sandbox this request opens (the sandbox's own configuration, not a command);
    ``package_cache``: the sandbox opened, or the one this request runs in, must bind the package cache.
    ``within``: the admission of the open sandbox this request runs in (its backend, network and limits are
    fixed; ``extra_env`` is what that sandbox adds to every exec)."""
    with span("execbox.admit", {"execbox.opening": opening is not None}) as current:
        admission = await _admit(runner, request, backend=backend, options=options, uploads=uploads, opening=opening,
                                 within=within, extra_env=extra_env, package_cache=package_cache)
        annotate(current, {"execbox.verdict": "admitted", "execbox.backend": admission.backend.name,
                           "execbox.network": admission.request.network or ""})
        return admission


async def _admit(runner: Host, request: ExecRequest, *, backend: str | None, options: Mapping[str, Any] | None,
                 uploads: Sequence[tuple[str, str]], opening: str | None, within: Admission | None,
                 extra_env: Mapping[str, str] | None, package_cache: bool) -> Admission:
    session = within.session if within is not None else opening
    resolved, dropped = request, None
    named = within.backend.name if within is not None else backend or (
        runner.settings.session_backend if opening else runner.settings.backend)
    try:
        if within is not None:
            impl, caps = within.backend, within.capabilities
            _session_rules(within, request)
            resolved, dropped, _ = resolve(runner.settings, request.model_copy(update={
                "network": within.asked.network, "limits": within.asked.limits}))
            # Admitted when it opened: the network and limits cannot change, and the backend is the same one. Only
            # the seed scan runs again: it guards every unsandboxed run, and a seed may have appeared since.
            runner.guard.check_secrets(impl)
            if extra_env:
                resolved = resolved.model_copy(update={"env": {**extra_env, **resolved.env}})
            mounts: tuple[Mount, ...] = ()
        else:
            resolved, dropped, demanded = resolve(runner.settings, request)
            for local, _remote in uploads:
                admit_upload(local, state=runner.state_places())
            impl, caps = await _choose(runner, backend, resolved, demanded, session=opening is not None,
                                       options=options)
            mounts = runner.guard.check_mounts(impl, caps, resolved.mounts, state=runner.state_places())
            runner.guard.check_tmpfs(impl, caps, resolved.tmpfs)
        if package_cache and not caps.mounts:
            raise UnsupportedPolicyError(
                f"refused: backend {impl.name!r} cannot bind the package cache (it takes no mounts); install "
                "packages in the sandbox itself, or bake them into the image", backend=impl.name)
        secret_run.refuse_uncarried(resolved, backend=impl)
    except ExecboxError as exc:
        record = request if within is not None else resolved  # a session's refusal says what the caller asked
        await _refused(runner, exc, record, backend=exc.backend or named, session=session,
                       opening=opening is not None, dropped=None if within is not None else dropped)
        raise
    return Admission(runner.settings, impl, caps, resolved, request, dropped, mounts, session)


async def admit_upload_into(runner: Host, within: Admission, local: str) -> None:
    """An upload into an open sandbox, judged as a one-shot's uploads are (the places a mount may not show, the
    seed scan); a refusal is one `refused` audit record."""
    with span("execbox.admit", {"execbox.upload": True, "execbox.backend": within.backend.name}) as current:
        try:
            admit_upload(local, backend=within.backend.name, state=runner.state_places())
        except ExecboxError as exc:
            await _refused(runner, exc, within.asked, backend=within.backend.name, session=within.session,
                           opening=True)
            raise
        annotate(current, {"execbox.verdict": "admitted"})


async def _refused(runner: Host, exc: ExecboxError, request: ExecRequest, *, backend: str | None,
                   session: str | None, opening: bool, dropped: list[str] | None = None) -> None:
    """The one audit record of a refusal (its reason: the error raised); ``opening``: the request is a sandbox's
    configuration, not a command, so no command fields. The current span (admission's) and the refusal counter
    get its reason: the error's kind, never its message."""
    reason = type(exc).__name__
    record_refusal(reason, backend=backend)
    annotate(current_span(), {"execbox.verdict": "refused", "execbox.refusal.reason": reason,
                               "execbox.backend": backend or ""})
    await runner.audit.arecord("refused", **audit_fields.refusal_fields(
        exc, request, backend=backend, session=session, oneshot=session is None, opening=opening, dropped=dropped))


def _session_rules(within: Admission, request: ExecRequest) -> None:
    """What an exec in an open sandbox may not ask for: its network, limits and mounts were fixed at the open."""
    backend, network, limits = within.backend.name, within.asked.network, within.asked.limits
    if request.network is not None and request.network != network:
        raise UnsupportedPolicyError(
            f"refused: this sandbox was opened with network {network!r}; a session cannot change it. "
            "Open another sandbox with the network mode you need", backend=backend)
    if request.limits is not None and request.limits != limits:
        raise UnsupportedPolicyError(
            f"refused: this sandbox was opened with limits {limits}; a session cannot change them per exec. "
            "Open another sandbox with the limits you need", backend=backend)
    if request.mounts:
        raise UnsupportedPolicyError(
            "refused: a sandbox's mounts are fixed when it opens; give them to sandbox(mounts=[...])", backend=backend)
    if request.tmpfs:
        raise UnsupportedPolicyError(
            "refused: a sandbox's tmpfs paths are fixed when it opens; give them to sandbox(tmpfs=[...])",
            backend=backend)


async def _choose(runner: Host, backend: str | None, resolved: ExecRequest, demanded: set[str], *,
                  session: bool, options: Mapping[str, Any] | None) -> tuple[ExecutionBackend, Capabilities]:
    """The backend (auto resolved) and what it enforces here, once the guard has admitted the request for it."""
    name = backend or (runner.settings.session_backend if session else runner.settings.backend)
    if name == "auto" and options:
        raise ConfigError("backend options were given without a backend: name the backend they are for, e.g. "
                          "execbox.sandbox('docker', image=...)", env_var="CODE_EXEC_BACKEND")
    impl = (await runner.select("auto", network=resolved.network))[0] if name == "auto" \
        else runner.backend(name, options)
    if impl.verdict_needs_check:  # its verdict is on what the check found
        with backend_errors(impl.name):
            await _check(impl)
    runner.guard.check_verdict(impl, resolved)  # cheap refusals first, before the backend is probed
    runner.guard.check_secrets(impl)
    with backend_errors(impl.name):
        caps = await _check(impl)  # for auto, select() just checked it: this is the cached answer
    runner.guard.check_policy(impl, caps, resolved, demanded)
    if session and not caps.persistent_sessions:
        raise UnsupportedPolicyError(
            f"refused: backend {impl.name!r} has no persistent sessions; use execbox.run for one-shot runs "
            "or a backend that keeps sessions", backend=impl.name)
    return impl, caps


async def _open(backend: ExecutionBackend, spec: SessionSpec) -> Session:
    """A new sandbox, within CODE_EXEC_OPEN_TIMEOUT_SEC; one that opens after that is closed when it does."""
    with span("execbox.sandbox.open", _sandbox_attrs(backend, spec, pooled=False)), backend_errors(backend.name):
        session = await bounded(backend.open_session(spec), backend.shared.open_timeout_sec, backend=backend,
                                doing="open_session", late=lambda late: close_bounded(late, backend))
    sandbox_opened(backend.name)
    return session


def _sandbox_attrs(backend: ExecutionBackend, spec: SessionSpec, *, pooled: bool) -> dict[str, str | bool]:
    return {"execbox.backend": backend.name, "execbox.network": spec.network, "execbox.pooled": pooled}


async def _close(session: Session, backend: ExecutionBackend) -> None:
    """A sandbox ``_open`` opened, closed (bounded: close_bounded) and no longer counted as live."""
    try:
        with span("execbox.sandbox.close", {"execbox.backend": backend.name}), backend_errors(backend.name):
            await close_bounded(session, backend)
    finally:
        sandbox_opened(backend.name, -1)


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
                secrets_at_egress: egress_given.Given | None = None, *,
                tmpfs: Sequence[str] | None = None) -> dict[str, Any]:
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
        "tmpfs": [tmpfs] if isinstance(tmpfs, str) else list(tmpfs) if tmpfs else None,
    }
    return {k: v for k, v in kw.items() if v is not None}


# --- stage 2: the plan; stage 3: the session's exec; stage 4: the result finished ---------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """An admitted request as one session runs it: the spec (complete and frozen: the redactor and the secrets at
    egress travel in it), the files to place in the workspace first, and its secrets (for ``finish``)."""

    spec: ExecSpec
    files: dict[str, bytes]
    secrets: secret_run.RunPlan


def plan(admission: Admission, session: Session, *, output: LiveOutput | None = None) -> Plan:
    """The spec of an admitted request in ``session``: code as a file, the workdir created and entered, declared
    secrets delivered through stdin and a wrapper and redacted as the output is captured (secrets.values),
    secrets at egress as placeholders the session's egress proxy swaps for their values (kit.proxy.secrets)."""
    request = admission.request
    argv, files = request.materialize(session.workspace)
    inside = normalize(request.workdir, session.workspace, anywhere=True, allow_root=True) if request.workdir else ""
    if inside:  # the workspace itself ("", ".", its absolute path) is where the backend starts anyway
        workdir = posixpath.join(session.workspace, inside)
        # The backend starts in the workspace; the workdir (below it, or absolute anywhere) is created (if missing)
        # and entered inside the sandbox as its user, the same way on every backend.
        argv = ["/bin/sh", "-c", 'mkdir -p -- "$1" && cd -- "$1" && shift && exec "$@"', "execbox-workdir", workdir,
                *argv]
    assert request.timeout and request.max_output_bytes and request.network and request.limits  # resolve() set them
    if output is not None:
        output.set_cap(request.max_output_bytes)
    secrets = secret_run.plan(request, argv)
    spec = ExecSpec(argv=secrets.argv, env=secrets.env, stdin=secrets.stdin, workdir=session.workspace,
                    timeout=request.timeout, max_output_bytes=request.max_output_bytes, network=request.network,
                    limits=request.limits, on_output=output.feed if output else None, redactor=secrets.redactor,
                    egress=secrets.egress)
    return Plan(spec, files, secrets)


def finish(raw: ExecResult, admission: Admission, planned: Plan,
           collected: tuple[dict[str, bytes], list[str]] | None = None) -> ExecResult:
    """The one place a run's result is finished: stamped with what the runner knows (the backend and the isolation it
    enforced here, the env names the policy dropped, the backend's notes), the limit that cut it short said in words
    (contract.results.explain; the timeout as asked, before clamping), the files ``collect`` matched (and what was
    left out, in the notes), secrets at egress that no proxy took noted, and every secret redacted (the collected
    files' paths and contents too)."""
    backend, request = admission.backend, admission.request
    assert request.timeout and request.network and request.limits  # resolve() set them
    result = raw.model_copy(update={
        "backend": backend.name, "isolation": admission.capabilities.isolation, "filtered_env": admission.dropped,
        "notes": [*raw.notes, *backend.notes()],
    })
    result = explain(result, timeout=request.timeout, asked_timeout=admission.asked.timeout,
                     max_timeout=backend.shared.max_timeout_sec, memory_mb=request.limits.memory_mb,
                     network=request.network)
    if collected is not None:
        files, notes = collected
        result = result.model_copy(update={"files": files, "notes": [*result.notes, *notes]})
    return planned.secrets.finish(result)


def finish_cell(result: CellResult, admission: Admission, redactor: secrets_inject.Redactor | None) -> CellResult:
    """``finish`` for a cell of a sandbox's interpreter: every secret the sandbox was given redacted (the code may
    have left one where the cell reads it), and a timeout cut to the maximum said as an exec's is."""
    result = secrets_inject.redact_model(result, redactor)
    clamped = clamp_note(admission.asked.timeout, admission.backend.shared.max_timeout_sec)
    return result if clamped is None else result.model_copy(update={"notes": [*result.notes, clamped]})


def transfer_bounds(settings: Settings) -> transfer.TransferLimits:
    """The bounds of uploads, downloads, listings and collected files (CODE_EXEC_MAX_TRANSFER_BYTES / _FILES)."""
    return transfer.TransferLimits(settings.max_transfer_bytes, settings.max_transfer_files)


async def _collect(admission: Admission, session: Session) -> tuple[dict[str, bytes], list[str]] | None:
    """The files the request's ``collect`` globs matched (bounded by CODE_EXEC_MAX_READ_BYTES in all), and notes
    on what was left out; None when it has none."""
    backend, request = admission.backend, admission.request
    if not request.collect:
        return None
    settings = admission.settings
    with backend_errors(backend.name):
        return await bounded(
            transfers.collect(session, list(request.collect), limits=transfer_bounds(settings),
                             max_bytes=settings.max_read_bytes),
            _files_s(backend), backend=backend, doing="collecting files", session=session)


async def _exec_in(admission: Admission, session: Session, *, output: LiveOutput | None = None) -> ExecResult:
    """Plan, place the files, run, collect the files asked for, finish."""
    backend = admission.backend
    planned = plan(admission, session, output=output)
    for path, data in planned.files.items():
        with backend_errors(backend.name):
            await bounded(session.write_file(normalize(path, session.workspace), data), _files_s(backend),
                          backend=backend, doing="write_file", session=session)
    with secrets_inject.redacting(planned.spec.redactor):  # a backend's error may quote what the code printed
        raw = await _session_exec(backend, session, planned.spec)
    return finish(raw, admission, planned, await _collect(admission, session))


async def _exec_audited(audit: audit_log.AuditLog, admission: Admission, session: Session, *,
                        records: list[asyncio.Task[str | None]] | None = None,
                        output: LiveOutput | None = None, oneshot_id: str | None = None) -> ExecResult:
    """``_exec_logged`` in its span (``execbox.exec``), its outcome counted in the metrics. ``oneshot_id``: a
    one-shot's id in the audit log (its `execbox ps` id), or a new one."""
    request, backend = admission.request, admission.backend.name
    attrs: dict[str, str | bool | Sequence[str]] = {
        "execbox.backend": backend, "execbox.network": request.network or "",
        "execbox.oneshot": admission.session is None, "execbox.session": admission.session or ""}
    if admission.settings.otel_command_args and request.argv:  # the operator's opt-in: it may hold a secret
        attrs["process.command_args"] = list(request.argv)
    with span("execbox.exec", attrs) as current:
        result = await _exec_logged(audit, admission, session, records=records, output=output, oneshot_id=oneshot_id)
        denied = sum(1 for attempt in result.egress if not attempt.allowed)
        annotate(current, {"process.exit.code": result.exit_code, "execbox.outcome": outcome(result),
                           "execbox.timed_out": result.timed_out, "execbox.oom_killed": result.oom_killed,
                           "execbox.truncated": result.truncated, "execbox.duration_s": result.duration_s,
                           "execbox.limit": result.limit or "", "execbox.egress.allowed": len(result.egress) - denied,
                           "execbox.egress.denied": denied})
    record_run(result, backend=backend)
    return result


async def _exec_logged(audit: audit_log.AuditLog, admission: Admission, session: Session, *,
                       records: list[asyncio.Task[str | None]] | None = None,
                       output: LiveOutput | None = None, oneshot_id: str | None = None) -> ExecResult:
    """``_exec_in``, recorded in the audit log: what ran (hashes and names, never values), where, and what came
    back; a run that raised is recorded as exec.error. A record that cannot be written is a note on the result,
    never an error instead of it. With ``records``, the record of a run that returned is started there, for the
    caller to await (and take its note from) after what it does next."""
    if not audit.enabled:
        return await _exec_in(admission, session, output=output)
    fields = audit_fields.exec_fields(admission.backend, admission.request, admission.dropped,
                                   session=admission.session or oneshot_id or audit_fields.new_session_id(),
                                   oneshot=admission.session is None)
    try:
        result = await _exec_in(admission, session, output=output)
    except BaseException as exc:
        await audit.arecord("exec.error", **fields, **audit_fields.error_fields(exc))
        raise
    record = audit.arecord("exec", **fields, **audit_fields.result_fields(result, audit.keep_output))
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
            "stdout": audit_fields.stream_fields(result.stdout, audit.keep_output),
            "stderr": audit_fields.stream_fields(result.stderr, audit.keep_output),
            "outputs": [sorted(output.data) for output in result.outputs]}

