"""The live sandboxes of this user on this host, across processes and backends (`execbox ps`, `execbox kill`).

Each open sandbox (a persistent one, or a warm-pool member) has a small record under execbox's private state:
what the backend's ownership labels or files do not carry (its configuration, deadline, what it runs now, pooled or
not), and the ``kill_ref`` its backend ends it by. Written 0600 and atomically at open, rewritten at an exec's start
and end, removed at close. A record whose owner (``owner_id``: host, pid, start time) is gone is stale: not listed,
and removed by `execbox gc`. `execbox kill` leaves a ``.killed`` marker beside it, which the owner's next call reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from execbox.config.paths import state_dir
from execbox.contract.backend import Session, SessionSpec
from execbox.errors import ConfigError
from execbox.kit.ownership import owner_alive, owner_id, pid_alive

IDLE = "idle"
#: A sandbox id as the runner makes them (audit_fields.new_session_id, the pool's "pool-..."): also a file name.
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KILLED = ".killed"
# What runs now, beside the record: rewritten at every exec's start and end, so one small write in place (a few
# microseconds) rather than the record's atomic rewrite (a file and a rename: ~0.3 ms each time, on the event loop).
_RUNNING = ".running"
_RUNNING_BYTES = 64


def live_dir() -> Path:
    return state_dir() / "live"


def _path(sandbox_id: str, suffix: str = ".json") -> Path:
    return live_dir() / f"{sandbox_id}{suffix}"


def check_id(sandbox_id: object) -> str:
    """``sandbox_id`` if it can name a sandbox here, else ConfigError (never a path to follow)."""
    if not isinstance(sandbox_id, str) or not _ID.fullmatch(sandbox_id):
        raise ConfigError(f"{str(sandbox_id)[:80]!r} is not a sandbox id: `execbox ps` lists them")
    return sandbox_id


def _write(sandbox_id: str, record: Mapping[str, Any]) -> None:
    """Atomically, 0600 in a 0700 directory; a record that cannot be written is left out of `ps`, never an error
    of the sandbox (it is bookkeeping, like a full disk's audit note)."""
    with contextlib.suppress(OSError):
        where = live_dir()
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = where / f".{sandbox_id}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, _path(sandbox_id))


def opened(sandbox_id: str, backend: str, session: Session, spec: SessionSpec, *, pooled: bool = False,
           name: str | None = None) -> dict[str, Any]:
    """The record of a sandbox that just opened (returned: ``running`` rewrites it)."""
    now = time.time()
    record = {"id": sandbox_id, "owner": owner_id(), "pid": os.getpid(), "backend": backend,
              "ref": session.kill_ref, "name": name, "network": spec.network,
              "limits": spec.limits.model_dump(exclude_none=True), "created": round(now, 3),
              "deadline": round(now + spec.lifetime_s, 3), "running": IDLE, "pooled": pooled}
    _write(sandbox_id, record)
    return record


def running(record: dict[str, Any], what: str) -> None:
    """What the sandbox runs now: a command's argv[0] (its base name: never an argument, env or path), or IDLE.
    Written in place, space-padded to one fixed size: a reader sees the old name or the new one, never a mix."""
    name = (os.path.basename(what) or IDLE).encode(errors="replace")[:_RUNNING_BYTES]
    with contextlib.suppress(OSError):
        fd = os.open(_path(record["id"], _RUNNING), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, name.ljust(_RUNNING_BYTES), 0)
        finally:
            os.close(fd)


def _running_now(sandbox_id: str) -> str:
    try:
        fd = os.open(_path(sandbox_id, _RUNNING), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            said = os.pread(fd, _RUNNING_BYTES, 0)
        finally:
            os.close(fd)
    except OSError:
        return IDLE
    return said.decode(errors="replace").strip() or IDLE


def closed(sandbox_id: str) -> None:
    for suffix in (".json", _KILLED, _RUNNING):
        with contextlib.suppress(OSError):
            os.unlink(_path(sandbox_id, suffix))


def killed(sandbox_id: str) -> bool:
    """Was this sandbox ended from outside (`execbox kill`)? One stat: asked on every call of an open sandbox."""
    return os.path.lexists(_path(sandbox_id, _KILLED))


def mark_killed(sandbox_id: str, by: Mapping[str, Any]) -> None:
    with contextlib.suppress(FileExistsError):
        fd = os.open(_path(sandbox_id, _KILLED), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(dict(by), fh)


def unmark_killed(sandbox_id: str) -> None:
    """A kill that failed: the sandbox lives on, and its owner's calls go on working."""
    with contextlib.suppress(OSError):
        os.unlink(_path(sandbox_id, _KILLED))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            record = json.loads(fh.read(1 << 16))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("id"), str) else None


def _records() -> list[tuple[Path, dict[str, Any] | None]]:
    try:
        paths = sorted(live_dir().glob("*.json"))
    except OSError:
        return []
    return [(path, _read(path)) for path in paths if not path.name.startswith(".")]


def _stale(record: dict[str, Any] | None) -> bool:
    """Its owner is gone (a process on this host that ended, or one whose pid was reused), or it is unreadable. A
    record another host wrote (a home shared between machines) is that host's: never stale here, never listed."""
    return record is None or owner_alive(str(record.get("owner", ""))) is False


def _here(record: dict[str, Any]) -> bool:
    return owner_alive(str(record.get("owner", ""))) is True


def listing() -> list[dict[str, Any]]:
    """Every live sandbox of this user on this host, oldest first, each with its age and time left (seconds)."""
    now = time.time()
    out = []
    for _, record in _records():
        if record is None or not _here(record):
            continue
        record["age_s"] = round(now - float(record.get("created", now)), 1)
        record["left_s"] = round(float(record.get("deadline", now)) - now, 1)
        record["killed"] = killed(record["id"])
        record["running"] = _running_now(record["id"])
        out.append(record)
    return sorted(out, key=lambda r: float(r.get("created", 0)))


def find(sandbox_id: str) -> dict[str, Any]:
    """The live record of ``sandbox_id``, or ConfigError (no such sandbox, or its owner is gone)."""
    record = _read(_path(check_id(sandbox_id)))
    if record is None or not _here(record):
        raise ConfigError(f"no live sandbox {sandbox_id!r} of this user on this host: `execbox ps` lists them")
    return record


def sweep_stale() -> list[str]:
    """Remove the records (and kill markers) of sandboxes whose owner is gone: what `execbox gc` removed."""
    removed = []
    for path, record in _records():
        if _stale(record):
            closed(path.stem)
            removed.append(f"live record {path.stem} (owner gone)")
    with contextlib.suppress(OSError):
        for marker in live_dir().glob(f"*{_KILLED}"):
            if not _path(marker.name[:-len(_KILLED)]).exists():
                marker.unlink()
        for said in live_dir().glob(f"*{_RUNNING}"):
            if not _path(said.name[:-len(_RUNNING)]).exists():
                said.unlink()
        for tmp in live_dir().glob(".*.tmp"):  # a writer that died between its write and its rename
            pid = tmp.name.rsplit(".", 2)[-2]
            if pid.isdigit() and not pid_alive(int(pid)):
                tmp.unlink()
    return removed
