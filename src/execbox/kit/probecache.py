"""What an engine probe found, kept across processes for a short while: a fresh `execbox run` need not ask the
Docker engine for its API version and its runtimes again (~12 ms of the engine's time, every process).

Safe because of what the key and the facts are. The key names the engine instance itself (a unix socket's
device, inode and change time: a restarted or replaced daemon makes a new socket), what a reload re-reads
(docker: a digest of the engine's daemon.json and command line, so a reload's new runtimes are seen at once),
this user, and the SDK's version; a record older than CODE_EXEC_PROBE_CACHE_SEC, or one for another key, is not
used. The facts are the engine's, never a verdict: execbox still judges them against the current settings on
every run, and still checks each container the engine built against its contract, so a stale fact can make a run
refused, never weaker. The records live in execbox's own cache directory (which no mount may hand to a sandbox),
in files of this user that nobody else can write; anything else there is ignored, never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from execbox.config import paths

_MAX_RECORD = 64 << 10


def cache_dir() -> str:
    """/var/cache/execbox/probes as root, else $XDG_CACHE_HOME/execbox/probes (the package cache's neighbour)."""
    return str(paths.cache_dir() / "probes")


def _path(name: str, key: Sequence[object]) -> str:
    digest = hashlib.sha256(json.dumps([name, *key]).encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), f"{name}-{digest}.json")


def _private(st: os.stat_result, kind: int, owner: int | None = None) -> bool:
    """Of ``kind``, owned by ``owner`` (default: this user) and writable by nobody else."""
    return (stat.S_IFMT(st.st_mode) == kind and st.st_uid == (os.geteuid() if owner is None else owner)
            and not st.st_mode & 0o022)


def read_owned_json(path: str | os.PathLike[str], owner: int | None = None) -> Any:
    """The JSON in ``path`` when it is a regular file (not a link) of ``owner`` (default: this user) that nobody
    else can write, at most 64 KiB; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _private(st, stat.S_IFREG, owner) or st.st_size > _MAX_RECORD:
            return None
        return json.loads(os.read(fd, _MAX_RECORD))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def load_probe_facts(name: str, key: Sequence[object], max_age_s: float) -> dict[str, Any] | None:
    """The facts stored under ``key`` at most ``max_age_s`` ago, or None (none, too old, another key, or a file
    that is not this user's private record)."""
    if max_age_s <= 0:
        return None
    try:
        if not _private(os.lstat(cache_dir()), stat.S_IFDIR):
            return None
    except OSError:
        return None
    record = read_owned_json(_path(name, key))
    if not isinstance(record, dict) or record.get("key") != [name, *key]:
        return None
    at, facts = record.get("at"), record.get("facts")
    if not isinstance(at, (int, float)) or not 0 <= time.time() - at <= max_age_s or not isinstance(facts, dict):
        return None
    return facts


def store_probe_facts(name: str, key: Sequence[object], facts: dict[str, Any]) -> None:
    """Keep ``facts`` under ``key``; a cache that cannot be written (a read-only home, a foreign directory) is
    silently not kept: it only saves time."""
    directory = cache_dir()
    with contextlib.suppress(OSError, TypeError, ValueError):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _private(os.lstat(directory), stat.S_IFDIR):
            return
        data = json.dumps({"key": [name, *key], "at": time.time(), "facts": facts}).encode()
        if len(data) > _MAX_RECORD:
            return
        fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{name}-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(temp, _path(name, key))  # whole or not at all, for a reader in another process
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
