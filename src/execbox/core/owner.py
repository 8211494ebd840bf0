"""Who created a sandbox, and whether that process still lives: the basis of every backend's gc.

An owner is ``host:pid:starttime``; the start time (from /proc) tells a live owner from a new process that
happens to reuse its pid.
"""

from __future__ import annotations

import os
import socket


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def pid_alive(pid: int, started: str = "") -> bool:
    """Is ``pid`` a live process (and, when ``started`` is given, the same one that had that start time)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not started or _start_time(pid) in ("", started)


def owner_id(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


#: The file a sandbox's host directory carries with its owner_id(), for gc.
OWNER_FILE = "owner"


def read_owner(directory: str) -> str | None:
    """The owner written into ``directory`` (bounded, never through a link); None when there is none."""
    try:
        fd = os.open(os.path.join(directory, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 512).decode("utf-8", "replace").strip() or None
    finally:
        os.close(fd)


def orphaned(directory: str, pid: int, started: str) -> bool:
    """Is the execbox process that made ``directory`` gone? By the owner file (a directory another host made, in
    a /tmp shared between containers, is never judged from here), else by the pid and start time in its name."""
    owner = read_owner(directory)
    if owner:
        return owner_alive(owner) is False
    return not pid_alive(pid, started)


def owner_alive(owner: str) -> bool | None:
    """True/False for an owner on this host; None when it lives elsewhere (then only expiry applies)."""
    host, _, rest = owner.partition(":")
    pid_s, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid_s.isdigit():
        return None
    return pid_alive(int(pid_s), started)
