"""Reading the audit log back: the chain verified (execbox audit verify), records filtered and summarised
(execbox audit show)."""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from execbox.audit.log import GENESIS, digest, head_mac, log_files, read_head
from execbox.errors import ConfigError


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
