"""The live sandboxes of this user on this host, across processes and backends (`execbox ps`, `execbox kill`).

Each open sandbox (a persistent one, a warm-pool member, or a one-shot run's) has a small record under execbox's
private state: what the backend's ownership labels or files do not carry (its configuration, deadline, what it runs
now, its kind), and the ``kill_ref`` its backend ends it by. Written 0600 at open (a sandbox's atomically; a
one-shot's in one create, ~70 us: see ``oneshot``), what runs said beside it (``running``), removed at close.
A record whose owner (``owner_id``: host, pid, start time) is gone is stale: not listed, and removed by `execbox gc`.
`execbox kill` leaves a ``.killed`` marker beside it, which the owner's next call reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from execbox.config.paths import state_dir
from execbox.contract.backend import OwnedSandbox, Session, SessionSpec
from execbox.errors import ConfigError, ExecboxError, SandboxError
from execbox.kit.ownership import owner_alive, owner_id, pid_alive

IDLE = "idle"
#: A sandbox id as the runner makes them (audit_fields.new_session_id, the pool's "pool-..."): also a file name.
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KILLED = ".killed"
# What runs now, beside the record: rewritten at every exec's start and end, so one small write in place (a few
# microseconds) rather than the record's atomic rewrite (a file and a rename: ~0.3 ms each time, on the event loop).
_RUNNING = ".running"
_RUNNING_BYTES = 64
# A record being written is unreadable for a moment (a one-shot's is created in place, not renamed into place):
# gc removes an unreadable one only once it is older than this.
_WRITING_S = 60.0
# A sandbox is there before its record (written once it opened): one no record names, of a live owner, is listed
# as unrecorded only once it is older than this (a docker open with an image to unpack takes seconds).
_OPENING_S = 30.0


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


_owner: tuple[int, str] = (0, "")


def _me() -> str:
    """owner_id() of this process, read once per pid (a /proc read: ~20 us, on every one-shot otherwise)."""
    global _owner
    if _owner[0] != os.getpid():
        _owner = (os.getpid(), owner_id())
    return _owner[1]


def _record(sandbox_id: str, backend: str, session: Session, spec: SessionSpec, *, lifetime_s: float,
            running: str = IDLE, pooled: bool = False, oneshot: bool = False,
            name: str | None = None) -> dict[str, Any]:
    now = time.time()
    return {"id": sandbox_id, "owner": _me(), "pid": os.getpid(), "backend": backend, "ref": session.kill_ref,
            "name": name, "network": spec.network, "limits": spec.limits.model_dump(exclude_none=True),
            "created": round(now, 3), "deadline": round(now + lifetime_s, 3), "running": _name(running),
            "pooled": pooled, "oneshot": oneshot}


def opened(sandbox_id: str, backend: str, session: Session, spec: SessionSpec, *, pooled: bool = False,
           name: str | None = None) -> dict[str, Any]:
    """The record of a sandbox that just opened (returned: ``running`` rewrites it)."""
    record = _record(sandbox_id, backend, session, spec, lifetime_s=spec.lifetime_s, pooled=pooled, name=name)
    _write(sandbox_id, record)
    return record


def rewrite(record: dict[str, Any]) -> None:
    """A sandbox's record after its session changed (a restore in place: a new ``ref``), atomically."""
    _write(record["id"], record)


def oneshot(sandbox_id: str, backend: str, session: Session, spec: SessionSpec, what: str, *, timeout_s: float,
            pooled: bool) -> None:
    """The record of a one-shot run's sandbox, which runs ``what`` (argv[0]'s name) until ``timeout_s`` from now
    and is never rewritten: created in place in one write (no temporary file and rename, which would double its
    cost on every run). Removed by ``closed(sandbox_id, marks=False)``."""
    record = _record(sandbox_id, backend, session, spec, lifetime_s=timeout_s, running=what, pooled=pooled,
                     oneshot=True)
    with contextlib.suppress(OSError):
        try:
            fd = os.open(_path(sandbox_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # the first record of this user
            live_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(_path(sandbox_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(record).encode())
        finally:
            os.close(fd)


def _name(what: str) -> str:
    """What a record says runs: a command's argv[0] base name (never an argument, env or path), or IDLE."""
    return os.path.basename(what)[:_RUNNING_BYTES] or IDLE


def running(record: dict[str, Any], what: str) -> None:
    """What the sandbox runs now: a command's argv[0] (its base name: never an argument, env or path), or IDLE.
    Written in place, space-padded to one fixed size: a reader sees the old name or the new one, never a mix."""
    name = _name(what).encode(errors="replace")[:_RUNNING_BYTES]
    with contextlib.suppress(OSError):
        fd = os.open(_path(record["id"], _RUNNING), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, name.ljust(_RUNNING_BYTES), 0)
        finally:
            os.close(fd)


def _running_now(sandbox_id: str, said_at_open: str) -> str:
    try:
        fd = os.open(_path(sandbox_id, _RUNNING), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            said = os.pread(fd, _RUNNING_BYTES, 0)
        finally:
            os.close(fd)
    except OSError:
        return said_at_open  # never said since it opened (a one-shot's record says what it runs)
    return said.decode(errors="replace").strip() or IDLE


def closed(sandbox_id: str, *, marks: bool = True) -> None:
    """Its record removed, and (``marks``) what was said beside it. A one-shot has nothing said beside it, and
    a kill marker only if it was killed: one unlink is its cost (gc removes a marker a late kill left)."""
    for suffix in (".json", _KILLED, _RUNNING) if marks else (".json",):
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


def killed_error(sandbox_id: str, backend: str | None, advice: str) -> SandboxError:
    return SandboxError(f"sandbox {sandbox_id} was killed from outside (`execbox kill`): what ran in it and its "
                        f"files are gone. {advice}", backend=backend)


@contextlib.contextmanager
def told_if_killed(sandbox_id: str, backend: str | None, advice: str) -> Iterator[None]:
    """A call on the sandbox whose outcome (an error, or a result: a signal's exit status) was the doing of
    `execbox kill`, not of the code or the backend, says so: ``killed_error``."""
    try:
        yield
    except ExecboxError as exc:
        if killed(sandbox_id):
            raise killed_error(sandbox_id, backend, advice) from exc
        raise
    if killed(sandbox_id):
        raise killed_error(sandbox_id, backend, advice)


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


def _stale(path: Path, record: dict[str, Any] | None) -> bool:
    """Its owner is gone (a process on this host that ended, or one whose pid was reused), or it is unreadable
    (and not being written: ``_WRITING_S``). A record another host wrote (a home shared between machines) is that
    host's: never stale here, never listed."""
    if record is None:
        try:
            return time.time() - path.lstat().st_mtime > _WRITING_S
        except OSError:
            return False  # gone already
    return owner_alive(str(record.get("owner", ""))) is False


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
        record["running"] = _running_now(record["id"], str(record.get("running", IDLE)))
        record["kind"] = kind(record)
        out.append(record)
    return sorted(out, key=lambda r: float(r.get("created", 0)))


def merged(records: list[dict[str, Any]], found: Mapping[str, list[OwnedSandbox] | None]) -> list[dict[str, Any]]:
    """The records (``listing``) checked against the sandboxes each backend found (``found[backend]``; None or
    absent: it cannot say): a record whose sandbox its backend no longer finds is left out (it closed between the
    two looks, or its owner's close failed), unless it was killed (listed as that until its owner closes it); a
    sandbox that no record names is added (``unrecorded``), after them. Read the
    records first: a sandbox opened between the two looks is then in neither, never wrongly left out."""
    named = {(str(r.get("backend")), r.get("ref")) for r in records}
    out = [r for r in records if r.get("ref") is None or r.get("killed") or found.get(str(r.get("backend"))) is None
           or r.get("ref") in {s.ref for s in found[str(r.get("backend"))] or ()}]
    for backend, sandboxes in sorted(found.items()):
        for sandbox in sandboxes or ():
            row = None if (backend, sandbox.ref) in named else unrecorded(backend, sandbox)
            if row is not None:
                out.append(row)
    return out


def unrecorded(backend: str, sandbox: OwnedSandbox) -> dict[str, Any] | None:
    """The `execbox ps` row of a sandbox no record names: an ``orphan`` (its owner is gone: SIGKILLed before it
    closed it, and gc has not run since) or ``unrecorded`` (its owner lives, or its labels do not say who it is,
    and wrote no record: it could not, or it is of an execbox before records). None for one another host made."""
    alive = owner_alive(sandbox.owner) if sandbox.owner else True
    now = time.time()
    if alive is None or alive and (sandbox.created is None or now - sandbox.created < _OPENING_S):
        return None  # another host's; or opening, its record not written yet
    name = os.path.basename(sandbox.ref.rstrip("/"))
    sandbox_id = f"{backend}-{name}"
    if not _ID.fullmatch(sandbox_id):
        sandbox_id = f"{backend[:40]}-{hashlib.sha256(sandbox.ref.encode(errors='replace')).hexdigest()[:16]}"
    pid = sandbox.owner.split(":")[1] if sandbox.owner.count(":") == 2 else ""
    return {"id": sandbox_id, "kind": "unrecorded" if alive else "orphan", "backend": backend, "ref": sandbox.ref,
            "pid": int(pid) if pid.isdigit() else None, "name": None, "network": None, "limits": None,
            "created": sandbox.created, "deadline": None,
            "age_s": None if sandbox.created is None else round(now - sandbox.created, 1), "left_s": None,
            "running": None, "pooled": False, "killed": False}


def kind(record: Mapping[str, Any]) -> str:
    """``one-shot`` (a run's sandbox), ``pooled`` (a warm-pool member, waiting for a run) or ``sandbox``."""
    return "one-shot" if record.get("oneshot") else "pooled" if record.get("pooled") else "sandbox"


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
        if _stale(path, record):
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
