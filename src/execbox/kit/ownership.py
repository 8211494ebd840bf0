"""Who created a sandbox, and whether that process still lives: the basis of every backend's gc.

An owner is ``host:pid:starttime``; the start time (from /proc) tells a live owner from a new process that
happens to reuse its pid.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from execbox.contract.backend import OwnedSandbox
from execbox.errors import SandboxError
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


def _session_dirs(prefix: str, parent: str | None) -> Iterator[tuple[str, int, str]]:
    """(path, pid, start time) of each directory PREFIX + owner tag + "-" + RANDOM in PARENT (the temp dir by
    default): only real directories (never a symlink) of this process's user, as anyone can plant such a name in
    a shared /tmp and gc may run as root."""
    where = tempfile.gettempdir() if parent is None else parent
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        owner = name_owner(name, prefix)
        path = os.path.join(where, name)
        if owner is None:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            yield path, *owner


def orphaned_dirs(prefix: str, parent: str | None = None, owner_file: bool = True) -> list[str]:
    """The session directories (``_session_dirs``) whose execbox process is gone. Judged by ``orphaned``
    (OWNER_FILE, else the name); with ``owner_file=False`` by the pid and start time in the name alone: for a
    directory that holds no file of ours (a cgroup) or whose files the sandbox writes (docker's workspace: an owner
    file there is the code's). The caller removes them (``workspace.remove_tree``)."""
    return [path for path, pid, started in _session_dirs(prefix, parent)
            if (orphaned(path, pid, started) if owner_file else not pid_alive(pid, started))]


def owned_session_dirs(prefix: str, parent: str | None = None) -> list[OwnedSandbox]:
    """The session directories (``_session_dirs``) of a backend whose ``kill_ref`` is its directory, for its
    ``owned``: each with its owner (its OWNER_FILE; else, made here, the pid and start time in its name) and when
    it was made (its OWNER_FILE's time: written once, where the directory's own changes with what it holds)."""
    here = socket.gethostname()
    found = []
    for path, pid, started in _session_dirs(prefix, parent):
        try:
            created: float | None = os.lstat(os.path.join(path, OWNER_FILE)).st_mtime
        except OSError:
            created = None
        found.append(OwnedSandbox(path, read_owner(path) or f"{here}:{pid}:{started}", created))
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


@dataclass(frozen=True)
class OwnerLabels:
    """The one vocabulary of gc for a sandbox that carries labels (or tags): which execbox process made it
    (``owner_id``: host, pid and start time), when, and until when; spelled as each engine or provider takes
    label names (docker's ``io.execbox.*``, the remote providers' ``execbox-*``)."""

    #: "1" on everything execbox made: gc never touches what lacks it.
    mark: str
    owner: str
    created: str
    expires: str
    #: "true" on a sandbox kept on purpose (a named, resumable one): gc leaves it; None where nothing is kept.
    persist: str | None = None

    def make(self, lifetime_s: float, *, persist: bool = False) -> dict[str, str]:
        """The labels of a sandbox this process makes now, to live ``lifetime_s`` (or, ``persist``, until removed)."""
        now = int(time.time())
        out = {self.mark: "1", self.owner: owner_id(), self.created: str(now)}
        if persist and self.persist is not None:
            out[self.persist] = "true"
        else:
            out[self.expires] = str(int(now + lifetime_s))
        return out

    def kept(self, tags: Mapping[str, str]) -> bool:
        """Made by execbox and kept on purpose."""
        return tags.get(self.mark) == "1" and self.persist is not None and tags.get(self.persist) == "true"

    def made_here(self, tags: Mapping[str, str]) -> bool:
        """Made by execbox, by a process on this host (alive or not): what `execbox kill` may end from here."""
        return tags.get(self.mark) == "1" and owner_alive(tags.get(self.owner, "")) is not None

    def orphan_reason(self, tags: Mapping[str, str], now: float | None = None) -> str | None:
        """Why gc may remove a sandbox with these labels ("expired", "orphaned": its owner is gone), or None to
        keep it (not execbox's, kept on purpose, or alive and in time)."""
        if tags.get(self.mark) != "1" or self.kept(tags):
            return None
        try:
            if float(tags.get(self.expires, "inf")) < (now or time.time()):
                return "expired"
        except ValueError:
            pass
        if owner_alive(tags.get(self.owner, "")) is False:
            return "orphaned"
        return None


def kill_session_processes(ref: str, prefix: str, parent: str | None = None, owner_file: bool = True) -> int:
    """`execbox kill` of a session directory's sandbox: SIGKILL every process of this user whose command line names
    the directory ``ref`` (the launcher's arguments carry it: bwrap's binds, runsc's --root); how many. Only a
    directory execbox made: PREFIX + owner tag directly in ``parent`` (the temp dir), a real directory of this user
    carrying an owner file (``owner_file=False``: a workspace, whose files are the code's, goes by its name alone),
    else SandboxError. The directory stays: its owner removes it (gc, once it is gone)."""
    where = os.path.realpath(parent or tempfile.gettempdir())
    path = os.path.join(where, os.path.basename(ref))
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        st = None
    if (os.path.normpath(ref) != path or name_owner(os.path.basename(path), prefix) is None or st is None
            or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or owner_file and read_owner(path) is None):
        raise SandboxError(f"no sandbox session {ref!r} of execbox on this host")
    needle = os.fsencode(path)
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.geteuid():
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                words = fh.read(1 << 16).split(b"\0")
        except OSError:
            continue
        # a word that is the directory or below it, alone or as an option's value (--root=DIR/runsc)
        if any(w == needle or w.startswith(needle + b"/") for word in words for w in (word, word.partition(b"=")[2])):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
    return killed
