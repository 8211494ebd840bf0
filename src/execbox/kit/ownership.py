"""Who created a sandbox, and whether that process still lives: the basis of every backend's gc.

An owner is ``host:pid:starttime``; the start time (from /proc) tells a live owner from a new process that
happens to reuse its pid.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import tempfile

from execbox.files.workspace import remove_tree

_DIGITS = re.compile(r"[0-9]{1,10}")


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
    except (ProcessLookupError, OverflowError):  # OverflowError: a pid no process can have (a 10-digit name)
        return False
    except PermissionError:
        pass
    return not started or _start_time(pid) in ("", started)


def owner_id(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def owner_tag() -> str:
    """``pid-starttime`` of this process, for the names of what it creates on this host: gc tells a dead owner
    from a new process that reuses its pid (``name_owner`` reads it back)."""
    pid = os.getpid()
    return f"{pid}-{_start_time(pid)}"


def name_owner(name: str, prefix: str) -> tuple[int, str] | None:
    """(pid, start time, "" in names of older versions) from PREFIX + PID[-START]-RANDOM; None if not ours."""
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix):].split("-")
    if len(parts) == 3 and _DIGITS.fullmatch(parts[0]) and (not parts[1] or parts[1].isascii() and parts[1].isdigit()):
        return int(parts[0]), parts[1]
    if len(parts) == 2 and _DIGITS.fullmatch(parts[0]):
        return int(parts[0]), ""
    return None


#: The file a sandbox's host directory carries with its owner_id(), for gc.
OWNER_FILE = "owner"


def read_owner(directory: str) -> str | None:
    """The owner written into ``directory`` (bounded, never through a link); None when there is none."""
    try:
        # O_NONBLOCK: a FIFO planted there must not hang gc (it is refused below, as anything but a file is).
        fd = os.open(os.path.join(directory, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 512).decode("utf-8", "replace").strip() or None
    except OSError:
        return None
    finally:
        os.close(fd)


def orphaned(directory: str, pid: int, started: str) -> bool:
    """Is the execbox process that made ``directory`` gone? By the owner file (a directory another host made, in
    a /tmp shared between containers, is never judged from here), else by the pid and start time in its name."""
    owner = read_owner(directory)
    if owner:
        return owner_alive(owner) is False
    return not pid_alive(pid, started)


def orphaned_dirs(prefix: str, parent: str | None = None, owner_file: bool = True) -> list[str]:
    """The directories PREFIX + owner_tag() + "-" + RANDOM in PARENT (the temp dir by default) whose execbox
    process is gone: only real directories (never a symlink) of this process's user, as anyone can plant such a
    name in a shared /tmp and gc may run as root. Judged by ``orphaned`` (OWNER_FILE, else the name); with
    ``owner_file=False`` by the pid and start time in the name alone: for a directory that holds no file of ours
    (a cgroup) or whose files the sandbox writes (docker's workspace: an owner file there is the code's). The
    caller removes them (``workspace.remove_tree``)."""
    where = tempfile.gettempdir() if parent is None else parent
    found = []
    try:
        names = os.listdir(where)
    except OSError:
        return []
    for name in names:
        owner = name_owner(name, prefix)
        path = os.path.join(where, name)
        if owner is None:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and (
                orphaned(path, *owner) if owner_file else not pid_alive(*owner)):
            found.append(path)
    return found


def owner_alive(owner: str) -> bool | None:
    """True/False for an owner on this host; None when it lives elsewhere (then only expiry applies)."""
    host, _, rest = owner.partition(":")
    pid_s, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid_s.isdigit():
        return None
    return pid_alive(int(pid_s), started)


def remove_orphaned_dirs(prefix: str) -> list[str]:
    """``orphaned_dirs(prefix)`` removed (``remove_tree``); what went (what could not go is not reported)."""
    found = orphaned_dirs(prefix)
    for path in found:
        remove_tree(path)
    return [path for path in found if not os.path.lexists(path)]
