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
import errno
import fcntl
import functools
import hashlib
import hmac
import json
import os
import re
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from execbox.audit.fields import caller_identity, now_iso, sha256
from execbox.config import paths
from execbox.config.paths import OFF
from execbox.errors import ConfigError

GENESIS = "0" * 64
#: A record larger than this is written as a stub holding the SHA-256 of what it would have said.
MAX_RECORD_BYTES = 1 << 20
_ROTATED = re.compile(r"\.(\d{12})$")


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


def log_files(path: Path) -> list[Path]:
    """Every file of a log, oldest first: the rotated ones, then the current one (if it exists)."""
    return [*rotated_files(path), *([path] if path.exists() else [])]


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
