"""The audit log: one tamper-evident JSON Lines record per event (exec, refusal, sandbox open/close, gc, approval).

Format. Each line is one JSON object with ``seq`` (1, 2, ... across every file), ``ts`` (UTC, ISO 8601), ``event``,
the event's fields, ``prev`` (the previous record's ``hash``; 64 zeros for the first) and ``hash``: SHA-256 of the
record's canonical JSON without ``hash`` (``alg: sha256``), or, with a key (CODE_EXEC_AUDIT_KEY or
CODE_EXEC_AUDIT_KEY_FILE), HMAC-SHA256 under that key (``alg: hmac-sha256``). Editing, removing or reordering a
record breaks the chain at that record. A plain SHA-256 chain can be rebuilt by anyone who can write the file; an
HMAC chain only by someone who holds the key.

Writers. ``record()`` takes an exclusive ``flock`` on ``<log>.lock`` (threads and processes alike), reads the last
record of the log under that lock, appends one complete line with one ``write`` and ``fdatasync``s it, then
updates ``<log>.head`` (the last seq and hash, MAC'd under the key). Every record is on disk before the call
returns: the log answers "what ran" after a crash or power loss too; the cost is measured in bench/bench_audit.py.
A log larger than CODE_EXEC_AUDIT_MAX_BYTES is renamed ``<log>.<last seq, 12 digits>`` and a new file starts,
its first record chaining to the last of the old one.

Truncation. A hash chain alone cannot tell a log cut after record N from a log that ended at N. The head file
can: ``verify`` fails when the log ends before the head says it does (or the head is missing while records
exist); and a writer that finds the log shorter than its head (or the head gone) first appends an ``audit.gap``
record, so the cut stays visible after more records are written (a torn last line with the head in step is a
crash, cut and recorded as ``audit.torn``; one the head says was followed by more is a cut). Honest limits:
someone who can write both files and rewrite the head consistently (anyone, without a key; with a key, only by
putting back an older head they copied) can still cut the tail unseen, and someone who deletes every file leaves
nothing to verify. Ship the records off the host if that matters.

Failures. A record that cannot be written never raises into the run it describes: ``record()`` returns a note
(the caller puts it on the result), warns, and appends the failure to ``audit-failures.jsonl`` in the per-user
state directory when it can, where ``execbox doctor`` reports it.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import functools
import getpass
import hashlib
import hmac
import json
import os
import re
import threading
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import anyio
import anyio.to_thread

from execbox.config import paths
from execbox.config.paths import OFF
from execbox.errors import ConfigError

GENESIS = "0" * 64
#: A record larger than this is written as a stub holding the SHA-256 of what it would have said.
MAX_RECORD_BYTES = 1 << 20
_ROTATED = re.compile(r"\.(\d{12})$")
#: The caller (and its delegation chain) of the execs in this context; the MCP server sets it per request.
CALLER: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("execbox_audit_caller", default=None)


def load_key(key: str | None, key_file: str | os.PathLike[str] | None) -> bytes | None:
    """The HMAC key: CODE_EXEC_AUDIT_KEY's text, or the key file's bytes (one trailing newline dropped)."""
    if key:
        return key.encode()
    if key_file:
        try:
            data = Path(key_file).read_bytes()
        except OSError as exc:
            raise ConfigError(f"CODE_EXEC_AUDIT_KEY_FILE={str(key_file)!r} cannot be read: {exc.strerror}. Fix the "
                              "path or its permissions", env_var="CODE_EXEC_AUDIT_KEY_FILE") from None
        data = data[:-1] if data.endswith(b"\n") else data
        if not data:
            raise ConfigError(f"CODE_EXEC_AUDIT_KEY_FILE={str(key_file)!r} is empty; put the key in it",
                              env_var="CODE_EXEC_AUDIT_KEY_FILE")
        return data
    return None


def canonical(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def digest(record: Mapping[str, Any], key: bytes | None) -> str:
    """The ``hash`` of a record (every field but ``hash``): SHA-256, or HMAC-SHA256 under ``key``."""
    body = canonical({k: v for k, v in record.items() if k != "hash"})
    if key is None:
        return hashlib.sha256(body).hexdigest()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def head_mac(seq: int, last: str, key: bytes | None) -> str:
    body = f"execbox-audit-head:{seq}:{last}".encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest() if key else hashlib.sha256(body).hexdigest()


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


# --- writing --------------------------------------------------------------------------------------


class AuditLog:
    """Appends hash-chained records to ``path`` (``None``: the log is off and ``record`` does nothing)."""

    def __init__(self, path: str | os.PathLike[str] | None, *, key: bytes | None = None,
                 max_bytes: int = 64 << 20, keep_output: int = 0) -> None:
        self.path = Path(path) if path is not None else None
        self.key = key
        self.max_bytes = max_bytes
        self.keep_output = keep_output
        #: The notes of the writes that failed in this process, oldest first (bounded).
        self.failures: list[str] = []
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Any) -> AuditLog:
        """The log the core settings describe (audit_log already resolved by the settings' validator)."""
        path = settings.audit_log
        key_value = settings.audit_key.get_secret_value() if settings.audit_key is not None else None
        key = load_key(key_value, settings.audit_key_file)
        return cls(None if path == OFF else path, key=key, max_bytes=settings.audit_max_bytes,
                   keep_output=settings.audit_output)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @property
    def lock_path(self) -> Path:
        assert self.path is not None
        return self.path.with_name(self.path.name + ".lock")

    @property
    def head_path(self) -> Path:
        assert self.path is not None
        return self.path.with_name(self.path.name + ".head")

    def record(self, event: str, **fields: Any) -> str | None:
        """Append one record; ``None`` when it was written (or the log is off), else a note saying why not.

        Never raises for an I/O failure: the note is for the caller to surface (on a result, in a reply), and the
        failure is also warned and kept for `execbox doctor`."""
        if self.path is None:
            return None
        if "caller" not in fields:
            fields["caller"] = caller_identity()
        try:
            with self._lock:
                self._append(event, fields)
            return None
        except (OSError, ValueError, TypeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            note = (f"audit log: this {event} was NOT recorded in {self.path}: {why}. Fix the path or its "
                    "permissions (CODE_EXEC_AUDIT_LOG); `execbox doctor` reports it")
            self._failed(note)
            return note

    async def arecord(self, event: str, **fields: Any) -> str | None:
        """``record`` from async code: the lock wait and the disk sync happen in a worker thread, never on the
        event loop, and a cancelled caller still gets its record written."""
        if self.path is None:
            return None
        fields.setdefault("caller", caller_identity())  # read here: the context (CALLER) is this task's
        note: str | None = None
        with anyio.CancelScope(shield=True):
            note = await anyio.to_thread.run_sync(functools.partial(self.record, event, **fields))
        return note

    def _failed(self, note: str) -> None:
        self.failures = [*self.failures[-99:], note]
        warnings.warn(note, RuntimeWarning, stacklevel=3)
        with contextlib.suppress(OSError):
            where = paths.state_dir()
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
            line = json.dumps({"ts": now_iso(), "log": str(self.path), "pid": os.getpid(), "note": note}) + "\n"
            fd = os.open(where / FAILURES_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def _append(self, event: str, fields: Mapping[str, Any]) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                seq, prev, size = self._tail(fd)
                pending: list[tuple[str, Mapping[str, Any]]] = [(event, fields)]
                gap = self._gap(seq, prev)
                if gap is not None:
                    pending.insert(0, ("audit.gap", gap))
                for name, values in pending:
                    line = self._line(seq + 1, prev, name, values)
                    if size and size + len(line) > self.max_bytes:
                        os.fdatasync(fd)
                        os.close(fd)
                        fd = -1
                        os.rename(self.path, self.path.with_name(f"{self.path.name}.{seq:012d}"))
                        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                     | os.O_CLOEXEC, 0o600)
                        size = 0
                    written = os.write(fd, line)
                    if written != len(line):  # a full disk: cut the partial line off rather than leave half a record
                        os.ftruncate(fd, os.fstat(fd).st_size - written)
                        raise OSError(errno.ENOSPC, "the disk is full (a partial write)")
                    size += written
                    record = json.loads(line)
                    seq, prev = record["seq"], record["hash"]
                os.fdatasync(fd)
                self._write_head(seq, prev)
            finally:
                if fd >= 0:
                    os.close(fd)
        finally:
            os.close(lock)  # releases the flock

    def _gap(self, seq: int, last: str) -> dict[str, Any] | None:
        """When the log ends before the head file says (records cut off the end, or every file removed), what the
        next record must say first: a writer that just chained on would make the cut invisible."""
        head = read_head(self.head_path)
        if head is None and seq == 0:
            self._write_head(0, GENESIS)  # a new log: its head exists before its first record
            return None
        if head is None:  # removed (a crash cannot: the head is written before the first record)
            return {"head_seq": None, "head_hash": None, "log_seq": seq, "log_hash": last}
        if head[0] < seq or (head[0] == seq and head[1] == last):
            return None  # the head behind (a writer stopped between its record and the head update), or in step
        return {"head_seq": head[0], "head_hash": head[1], "log_seq": seq, "log_hash": last}

    def _line(self, seq: int, prev: str, event: str, fields: Mapping[str, Any]) -> bytes:
        record: dict[str, Any] = {"seq": seq, "ts": now_iso(), "event": event, **fields,
                                  "alg": "hmac-sha256" if self.key else "sha256", "prev": prev}
        for reserved in ("seq", "ts", "event", "alg", "prev", "hash"):
            if reserved in fields:
                raise ValueError(f"audit record field {reserved!r} is reserved; name it otherwise")
        # Through JSON and back: the record hashed is exactly the one `verify` will read (tuples, paths, int keys).
        record = json.loads(json.dumps(record, ensure_ascii=False, default=str))
        body = canonical(record)
        if len(body) > MAX_RECORD_BYTES:
            record = {"seq": seq, "ts": record["ts"], "event": event, "oversize": len(body),
                      "fields_sha256": hashlib.sha256(body).hexdigest(), "alg": record["alg"], "prev": prev}
        record["hash"] = digest(record, self.key)
        # Written in the order above (readable); hashed in canonical (sorted) form.
        return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"

    def _tail(self, fd: int) -> tuple[int, str, int]:
        """(seq, hash) of the last record (in this file, else in the newest rotated one, else the genesis) and the
        file's size. A torn last line (a crash mid-write) is cut off and its loss recorded."""
        size = os.fstat(fd).st_size
        if size == 0:
            return (*self._rotated_tail(), 0)
        last, start = _last_line(fd, size)
        if not last.endswith(b"\n"):
            os.ftruncate(fd, start)
            seq, prev, _ = self._tail(fd)
            line = self._line(seq + 1, prev, "audit.torn", {"bytes": len(last), "sha256": sha256(last)})
            os.write(fd, line)
            return seq + 1, json.loads(line)["hash"], start + len(line)
        try:
            rec = json.loads(last)
            return int(rec["seq"]), str(rec["hash"]), size
        except (ValueError, KeyError, TypeError):
            # Not a record (edited by hand?): chain to its bytes; `verify` names the line.
            head = read_head(self.head_path)
            return (head[0] if head else 0), hashlib.sha256(last).hexdigest(), size

    def _rotated_tail(self) -> tuple[int, str]:
        assert self.path is not None
        files = rotated_files(self.path)
        if not files:
            return 0, GENESIS
        with open(files[-1], "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                return 0, GENESIS
            last, _ = _last_line(fh.fileno(), size)
        try:
            rec = json.loads(last)
            return int(rec["seq"]), str(rec["hash"])
        except (ValueError, KeyError, TypeError):
            return 0, hashlib.sha256(last).hexdigest()

    def _write_head(self, seq: int, last: str) -> None:
        """Overwrite the head in place: one pwrite of a fixed 512 bytes (one sector: a crash leaves the old head or
        the new one, and a rename per record would cost more than the record itself)."""
        alg = "hmac-sha256" if self.key else "sha256"
        head = json.dumps({"seq": seq, "hash": last, "alg": alg, "mac": head_mac(seq, last, self.key)}).encode()
        fd = os.open(self.head_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, head.ljust(HEAD_BYTES - 1) + b"\n", 0)
        finally:
            os.close(fd)


HEAD_BYTES = 512

FAILURES_FILE = "audit-failures.jsonl"


def _last_line(fd: int, size: int) -> tuple[bytes, int]:
    """The last line of a file (with its newline, if it has one) and where it starts."""
    end = size
    chunk = 64 << 10
    buf = b""
    pos = end
    while pos > 0:
        step = min(chunk, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        body = buf[:-1] if buf.endswith(b"\n") and pos + len(buf) == end else buf
        nl = body.rfind(b"\n")
        if nl >= 0:
            return buf[nl + 1:], pos + nl + 1
        if len(buf) > 2 * MAX_RECORD_BYTES:
            break
    return buf, pos


def rotated_files(path: Path) -> list[Path]:
    """The rotated files of a log, oldest first."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    found = []
    for name in names:
        if name.startswith(path.name + "."):
            m = _ROTATED.search(name)
            if m and name == f"{path.name}.{m.group(1)}":
                found.append((int(m.group(1)), path.parent / name))
    return [p for _, p in sorted(found)]


def read_head(path: Path) -> tuple[int, str, str, str] | None:
    """(seq, hash, alg, mac) of a head file, or None when it is missing or unreadable."""
    try:
        head = json.loads(path.read_bytes())
        return int(head["seq"]), str(head["hash"]), str(head.get("alg", "")), str(head.get("mac", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- what a run records ---------------------------------------------------------------------------


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
    secrets = getattr(request, "secrets", None)  # declared secrets (core.secrets_inject): names only, never values
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
    if not opening:
        out.update(request_fields(request, dropped))
    return {**out, **error_fields(exc)}


def sandbox_fields(session: str, backend: Any, spec: Any) -> dict[str, Any]:
    """A persistent sandbox that opened: its id, backend and configuration (SessionSpec)."""
    config = config_fields(backend, spec.network, spec.limits, lifetime_s=spec.lifetime_s)
    if spec.name:
        config["name"] = spec.name
    return {"session": session, "backend": backend.name, "config": config}


# --- reading and verifying ------------------------------------------------------------------------


def log_files(path: Path) -> list[Path]:
    """Every file of a log, oldest first: the rotated ones, then the current one (if it exists)."""
    return [*rotated_files(path), *([path] if path.exists() else [])]


@dataclass(frozen=True)
class Line:
    file: Path
    number: int
    raw: bytes
    record: dict[str, Any] | None

    @property
    def where(self) -> str:
        return f"{self.file.name}:{self.number}"

    @property
    def seq(self) -> int | None:
        value = self.record.get("seq") if self.record else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def iter_lines(path: Path, files: Sequence[tuple[Path, BinaryIO, int]] | None = None) -> Iterator[Line]:
    """Every line of every file of a log, parsed when it is a JSON object (``record`` None otherwise); of the
    ``files`` of a ``snapshot`` (each read up to its size then) when given."""
    if files is None:
        for file in log_files(path):
            with open(file, "rb") as opened:
                yield from _parsed(file, opened, None)
    else:
        for file, fh, size in files:
            yield from _parsed(file, fh, size)


def _parsed(file: Path, fh: BinaryIO, size: int | None) -> Iterator[Line]:
    left = size
    for number, raw in enumerate(fh, 1):
        if left is not None:
            if left <= 0:
                return
            raw = raw[:left]
            left -= len(raw)
        try:
            rec = json.loads(raw)
        except ValueError:
            rec = None
        yield Line(file, number, raw, rec if isinstance(rec, dict) else None)


@contextlib.contextmanager
def snapshot(path: Path) -> Iterator[tuple[list[tuple[Path, BinaryIO, int]], tuple[int, str, str, str] | None]]:
    """The log's files (open, with their sizes) and its head as of one moment: taken under a shared lock, so no
    writer is mid-record or between its record and the head; read afterwards (a rotation does not move an open
    file, and what is appended later is past the size taken)."""
    handles: list[tuple[Path, BinaryIO, int]] = []
    try:
        try:
            lock: int | None = os.open(path.with_name(path.name + ".lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            lock = None  # no writer ever ran here (or it cannot be read): nothing to wait for
        try:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_SH)
            head = read_head(path.with_name(path.name + ".head"))
            for file in log_files(path):
                opened = open(file, "rb")  # noqa: SIM115 - closed below, after the caller has read it
                handles.append((file, opened, os.fstat(opened.fileno()).st_size))
        finally:
            if lock is not None:
                os.close(lock)
        yield handles, head
    finally:
        for entry in handles:
            entry[1].close()


@dataclass
class Verification:
    """The outcome of ``verify``: ``problem`` names the first record that is not as written (None: intact)."""

    path: Path
    records: int = 0
    files: int = 0
    problem: str | None = None
    warnings: list[str] = field(default_factory=list)
    #: True when records are HMAC'd but no key was given: their links were checked, their MACs were not.
    unauthenticated: bool = False
    last_seq: int = 0

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.unauthenticated

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "log": str(self.path), "records": self.records, "files": self.files,
                "last_seq": self.last_seq, "problem": self.problem, "warnings": self.warnings,
                "unauthenticated": self.unauthenticated}


def verify(path: str | os.PathLike[str], key: bytes | None = None) -> Verification:
    """Check the whole chain of a log (every rotated file, then the current one) against its head file.

    Names the first record that was edited, removed or reordered, a torn or foreign line, and a log that ends
    before its head says (truncation). With ``key``, every record from the first MAC'd one on must carry a valid
    HMAC: a chain rebuilt without the key fails at the first record it changed."""
    path = Path(path)
    with snapshot(path) as (files, head):
        return _verify(path, key, files, head)


def _verify(path: Path, key: bytes | None, files: list[tuple[Path, BinaryIO, int]],
            head: tuple[int, str, str, str] | None) -> Verification:
    report = Verification(path, files=len(files))
    if report.files == 0:
        report.problem = f"no audit log at {path} (nothing was recorded there, or every file was removed)"
        return report
    expected, prev, seen_mac = 1, GENESIS, False
    last: Line | None = None
    lines = iter_lines(path, files)
    for line in lines:
        rec, seq = line.record, line.seq
        if rec is None or seq is None or not isinstance(rec.get("hash"), str) or "prev" not in rec:
            torn = not line.raw.endswith(b"\n")
            report.problem = (f"{line.where}: the last line is incomplete (a torn write, or the file was cut)"
                              if torn else f"{line.where}: not an audit record (edited, or written by something else)")
            return report
        alg = rec.get("alg")
        if alg == "hmac-sha256":
            seen_mac = True
            if key is None:
                report.unauthenticated = True
        elif alg != "sha256":
            report.problem = f"record seq {seq} ({line.where}) names an unknown hash {alg!r}: it was edited"
            return report
        elif key is not None and seen_mac:
            report.problem = (f"record seq {seq} ({line.where}) is not MAC'd although earlier records are: it was "
                              "written without the key, or the chain was rebuilt from here")
            return report
        checkable = alg == "sha256" or key is not None
        if checkable and not hmac.compare_digest(digest(rec, key if alg == "hmac-sha256" else None), rec["hash"]):
            hint = " (or the key is not the one it was written with)" if alg == "hmac-sha256" else ""
            report.problem = f"record seq {seq} ({line.where}) was edited: its content does not match its hash{hint}"
            return report
        if rec["prev"] != prev:
            report.problem = _break(line, seq, expected, last, lines)
            return report
        if rec.get("event") == "audit.gap":
            log_seq, head_seq = rec.get("log_seq"), rec.get("head_seq")
            found = (f"the head file missing at seq {log_seq}" if head_seq is None else
                     f"the log cut short (it ended at seq {log_seq}, the head named seq {head_seq})")
            report.problem = f"record seq {seq} ({line.where}): a writer found {found}: records may have been removed"
            return report
        if rec.get("event") == "audit.torn":
            report.warnings.append(f"record seq {seq} ({line.where}): a torn line (a crash mid-write) was dropped")
        expected, prev, last = seq + 1, rec["hash"], line
        report.records += 1
    report.last_seq = expected - 1
    if key is not None and report.records and not seen_mac:
        report.problem = ("no record carries a MAC although a key was given: the log was written without the key, "
                          "or rebuilt without it")
        return report
    report.problem = _check_head(path, report, prev, key, head)
    return report


def _break(line: Line, seq: int, expected: int, last: Line | None, rest: Iterator[Line]) -> str:
    """Name what broke the chain at ``line`` (whose ``prev`` is not the hash of the record before it)."""
    if seq == expected and last is not None:
        return (f"record seq {expected - 1} ({last.where}) was edited (its hash recomputed): seq {seq} "
                f"({line.where}) does not chain to it")
    if seq == expected:
        return f"record seq {seq} ({line.where}) was edited: it does not chain to the genesis"
    if seq < expected:
        return f"record seq {seq} ({line.where}) is out of order (or a copy): seq {expected} was expected here"
    if any(later.seq == expected for later in rest):
        return f"record seq {seq} ({line.where}) is out of order: seq {expected} comes after it (records reordered)"
    missing = f"seq {expected}" if seq == expected + 1 else f"seq {expected} to {seq - 1}"
    return f"records {missing} were removed (before seq {seq}, {line.where})"


def _check_head(path: Path, report: Verification, last_hash: str, key: bytes | None,
                head: tuple[int, str, str, str] | None) -> str | None:
    head_path = path.with_name(path.name + ".head")
    if head is None:
        if report.records == 0:
            return None
        return (f"the head file {head_path.name} is missing or unreadable: whether records were cut off the end "
                "cannot be checked")
    seq, hash_, alg, mac = head
    if alg == "hmac-sha256" and key is None:
        report.unauthenticated = True
    elif not hmac.compare_digest(head_mac(seq, hash_, key if alg == "hmac-sha256" else None), mac) or (
            key is not None and alg != "hmac-sha256"):
        return f"the head file {head_path.name} was edited (its MAC does not match)"
    last = report.last_seq
    if seq > last:
        cut = f"seq {seq}" if seq == last + 1 else f"seq {last + 1} to {seq}"
        return f"the log was truncated: it ends at seq {last} but the head says seq {seq}; records {cut} are missing"
    if seq == last and hash_ != last_hash:
        return f"record seq {seq} (the last) is not the one the head file names: it was rewritten"
    if seq < last:
        report.warnings.append(f"the head file names seq {seq}, the log goes on to seq {last}: a writer stopped "
                               "between its record and the head update, or something else appended records")
    return None


def parse_since(value: str) -> datetime:
    """``--since``: an ISO date or time (UTC unless it says otherwise), or an age: 30s, 15m, 2h, 7d, 2w."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", value)
    if m:
        seconds = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]
        return datetime.now(UTC) - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"--since {value!r} is not a time: give an ISO date or time (2026-01-31, "
                          "2026-01-31T12:00) or an age (30m, 2h, 7d)") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def records(path: str | os.PathLike[str], *, session: str | None = None,
            since: datetime | None = None) -> Iterator[dict[str, Any]]:
    """The records of a log, oldest first (lines that are not records are skipped: `verify` names them)."""
    for line in iter_lines(Path(path)):
        rec = line.record
        if rec is None:
            continue
        if session is not None and rec.get("session") != session:
            continue
        if since is not None:
            try:
                ts = datetime.fromisoformat(str(rec.get("ts", "")).replace("Z", "+00:00"))
            except ValueError:
                continue
            if ts < since:
                continue
        yield rec


def summary(rec: Mapping[str, Any]) -> str:
    """One line for `execbox audit show`."""
    event = str(rec.get("event"))
    parts = [f"{rec.get('seq', '?'):>6}", str(rec.get("ts", "?")), f"{event:<14}"]
    if rec.get("session"):
        parts.append(f"session={rec['session']}")
    if rec.get("backend"):
        parts.append(f"backend={rec['backend']}")
    if event == "exec":
        parts.append(f"exit={rec.get('exit_code')}")
        parts.append(f"{rec.get('duration_s', 0)}s")
        for flag in ("timed_out", "oom_killed"):
            if rec.get(flag):
                parts.append(flag)
        if rec.get("egress"):
            denied = sum(1 for a in rec["egress"] if not a.get("allowed"))
            parts.append(f"egress={len(rec['egress'])} ({denied} denied)")
    elif isinstance(rec.get("error"), dict):
        parts.append(f"{rec['error'].get('type')}: {str(rec['error'].get('message'))[:160]}")
    elif event == "gc":
        parts.append(f"removed={len(rec.get('removed') or [])}")
    chain = (rec.get("caller") or {}).get("chain") if isinstance(rec.get("caller"), dict) else None
    if chain:
        parts.append("caller=" + " > ".join(map(str, chain)))
    return "  ".join(parts)


# --- doctor -------------------------------------------------------------------------------------------


#: Variables whose values `execbox doctor` never prints.
SECRET_VARIABLES = frozenset({"CODE_EXEC_AUDIT_KEY"})


def health(log: AuditLog) -> dict[str, Any]:
    """What `execbox doctor` says of the audit log: on or off, where, writable now, past write failures."""
    out: dict[str, Any] = {"enabled": log.enabled, "path": str(log.path) if log.path else None,
                           "chain": "hmac-sha256" if log.key else "sha256", "problems": [], "failures": 0,
                           "last_failure": None}
    if log.path is None:
        out["problems"].append("the audit log is off (CODE_EXEC_AUDIT_LOG=off): runs are not recorded")
    else:
        try:
            log.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            for target in (log.lock_path, log.path):
                os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o600))
        except OSError as exc:
            out["problems"].append(f"the audit log {log.path} cannot be written: {exc.strerror or exc}; runs "
                                   "would carry a note saying they were not recorded. Fix the path or its "
                                   "permissions (CODE_EXEC_AUDIT_LOG)")
    failures = paths.state_dir() / FAILURES_FILE
    with contextlib.suppress(OSError):
        lines = failures.read_bytes().splitlines()
        if lines:
            out["failures"] = len(lines)
            with contextlib.suppress(ValueError):
                out["last_failure"] = json.loads(lines[-1])
            out["problems"].append(f"{len(lines)} audit write(s) failed (the last: "
                                   f"{(out['last_failure'] or {}).get('ts', '?')}); see {failures}, and remove it "
                                   "once the cause is fixed")
    return out
