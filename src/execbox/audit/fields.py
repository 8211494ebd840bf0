"""What an audit record says: the caller, the request, where and how it ran, its result or refusal."""

from __future__ import annotations

import contextlib
import contextvars
import getpass
import hashlib
import os
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

#: The caller (and its delegation chain) of the execs in this context; the MCP server sets it per request.
CALLER: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("execbox_audit_caller", default=None)


def sha256(data: bytes | str | None) -> str | None:
    if data is None:
        return None
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def argv_sha256(argv: Sequence[str]) -> str:
    """SHA-256 of an argv as the kernel receives it: each word NUL-terminated."""
    return hashlib.sha256(b"".join(w.encode() + b"\0" for w in argv)).hexdigest()


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def caller_identity() -> dict[str, Any]:
    """Who is running execbox: uid, user, pid, and the delegation chain the context carries (if any)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = None
    identity: dict[str, Any] = {"uid": os.getuid(), "user": user, "pid": os.getpid()}
    chain = CALLER.get()
    if chain:
        identity["chain"] = list(chain)
    return identity


@contextlib.contextmanager
def caller(*chain: str) -> Iterator[None]:
    """Attribute the records written inside this block to ``chain`` (outermost first, e.g. the MCP client, the
    agent, the sub-agent it delegated to)."""
    token = CALLER.set([*(CALLER.get() or []), *chain])
    try:
        yield
    finally:
        CALLER.reset(token)


def new_session_id() -> str:
    return uuid.uuid4().hex[:16]


def stream_fields(text: str, keep: int) -> dict[str, Any]:
    data = text.encode(errors="surrogatepass")
    out: dict[str, Any] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if keep:
        out["text"] = data[:keep].decode(errors="replace")
        if len(data) > keep:
            out["text_truncated"] = True
    return out


def request_fields(request: Any, dropped: Sequence[str] | None) -> dict[str, Any]:
    """What an ExecRequest said, as hashes and names only: code or argv, stdin, files, env names (passed and
    dropped by the env policy; or, for a request refused before the policy ran, just the names asked for)."""
    out: dict[str, Any] = {}
    if request.code is not None:
        out["code_sha256"], out["language"] = sha256(request.code), request.language
    else:
        out["argv_sha256"] = argv_sha256(request.argv)
    if request.stdin is not None:
        out["stdin_sha256"], out["stdin_bytes"] = sha256(request.stdin), len(request.stdin)
    if request.files:
        out["files"] = {path: {"sha256": sha256(data), "bytes": len(data)}
                        for path, data in sorted(request.files.items())}
    if dropped is None:
        out["env"] = {"names": sorted(request.env)}
    else:
        out["env"] = {"passed": sorted(request.env), "dropped": sorted(dropped)}
    secrets = getattr(request, "secrets", None)  # declared secrets (secrets.values): names only, never values
    if secrets:
        out["secrets"] = sorted(secrets)
    if request.workdir:
        out["workdir"] = request.workdir
    return out


def where_fields(backend: Any) -> dict[str, Any]:
    """What a backend's options say of where and how it runs (image, host, runtime; never credentials)."""
    options: dict[str, Any] = {}
    if getattr(backend, "settings_model", None) is not None:
        with contextlib.suppress(Exception):  # a third-party options model must not break the run it describes
            options = backend.settings.model_dump()
    out: dict[str, Any] = {}
    for name in WHERE_FIELDS:
        value = options.get(name)
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, (int, float)) or (isinstance(value, str) and value):
            out[name] = value[:200] if isinstance(value, str) else value
    return out


def config_fields(backend: Any, network: Any, limits: Any, **more: Any) -> dict[str, Any]:
    """The effective configuration of a run or sandbox: network, limits, isolation, where it runs, and ``more``."""
    return {"network": network, "limits": limits.model_dump(exclude_none=True) if limits is not None else {},
            "isolation": backend.capabilities.isolation, **more, **where_fields(backend)}


#: Backend option names whose values say where and how a run happened (and are never secrets).
WHERE_FIELDS = ("image", "runtime", "host", "port", "user", "binary", "app", "sandboxed", "egress_network")


def result_fields(result: Any, keep_output: int) -> dict[str, Any]:
    return {
        "exit_code": result.exit_code, "timed_out": result.timed_out, "oom_killed": result.oom_killed,
        "truncated": result.truncated, "duration_s": result.duration_s,
        "stdout": stream_fields(result.stdout, keep_output), "stderr": stream_fields(result.stderr, keep_output),
        "egress": [a.model_dump() for a in result.egress],
        "notes": list(result.notes),  # where it ran (a ray node), what was retried: execbox's words, not output
    }


def error_fields(exc: BaseException) -> dict[str, Any]:
    to_dict = getattr(exc, "to_dict", None)
    if callable(to_dict):
        return {"error": to_dict()}
    return {"error": {"type": type(exc).__name__, "message": str(exc)[:2000]}}


def exec_fields(backend: Any, request: Any, dropped: Sequence[str], *, session: str, oneshot: bool) -> dict[str, Any]:
    """What an exec record says before the run: where, how configured, and what was asked (hashes, names)."""
    config = config_fields(backend, request.network, request.limits, timeout=request.timeout,
                           max_output_bytes=request.max_output_bytes)
    if request.tmpfs:
        config["tmpfs"] = list(request.tmpfs)
    return {"session": session, "oneshot": oneshot, "backend": backend.name, "started": now_iso(), "config": config,
            **request_fields(request, dropped)}


def refusal_fields(exc: BaseException, request: Any, *, backend: str | None, session: str | None, oneshot: bool,
                   opening: bool = False, dropped: Sequence[str] | None = None) -> dict[str, Any]:
    """A refused request: the error (its reason), the backend, and what was asked (not for a sandbox being opened:
    its request is the runner's probe, not the caller's). ``dropped``: the env names the policy dropped, when it
    ran before the refusal."""
    limits = request.limits.model_dump(exclude_none=True) if request.limits is not None else {}
    out: dict[str, Any] = {"session": session, "oneshot": oneshot, "backend": backend,
                           "config": {"network": request.network, "limits": limits}}
    if request.tmpfs:
        out["config"]["tmpfs"] = list(request.tmpfs)
    if not opening:
        out.update(request_fields(request, dropped))
    return {**out, **error_fields(exc)}


def sandbox_fields(session: str, backend: Any, spec: Any) -> dict[str, Any]:
    """A persistent sandbox that opened: its id, backend and configuration (SessionSpec)."""
    config = config_fields(backend, spec.network, spec.limits, lifetime_s=spec.lifetime_s)
    if spec.name:
        config["name"] = spec.name
    if spec.tmpfs:
        config["tmpfs"] = list(spec.tmpfs)
    return {"session": session, "backend": backend.name, "config": config}
