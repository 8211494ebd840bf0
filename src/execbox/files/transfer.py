"""Whole files and directories in and out of a sandbox, as tar streams, bounded, never following a link.

The interchange is one tar stream whose members are named under one prefix: the basename of the path moved
(``out`` -> ``out``, ``out/a.png``...), or ``.`` for the workspace itself. Two ways to make and take it:

- Host side (``host_list``, ``host_pack``, ``host_unpack``): for sessions whose workspace is a directory on this
  host (docker, bubblewrap, singularity, local launchers). Every directory is opened with O_NOFOLLOW relative to
  its parent and checked to be the one listed; a symlink is stored as a symlink (never followed), a FIFO, socket
  or device is skipped and reported. Bounded before anything is read: total bytes of regular files (a sparse
  5 GiB file is refused from its size, not by reading it), number of entries, and depth (a tree thousands of
  levels deep is refused at ``MAX_DEPTH``); directories are walked iteratively.
- Inside the sandbox (``sandbox_list``, ``sandbox_pack``, ``sandbox_unpack``): for every other session (ssh,
  remote providers, third-party backends), with GNU find and tar run by the session's own ``exec``, and the
  archive moved with its ``read_file``/``write_file``. What the sandbox's tar does stays inside the sandbox; what
  it hands back is extracted here by ``host_unpack`` like any untrusted archive.

Downloads to this host (``host_unpack(..., keep_symlinks=False)``) never create a symlink, a device or a hard
link: those are listed in ``Transfer.skipped``. Names that would leave the destination (``..``, absolute) are
skipped too.
"""

from __future__ import annotations

import base64
import errno
import os
import posixpath
import re
import stat
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from execbox.errors import (
    FileTooLargeError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxPermissionError,
    TransferTooLargeError,
    WorkspacePathError,
)
from execbox.files.workspace import _open_dir, _refuse, is_directory_error, write_error

#: Deepest tree a transfer or listing walks (levels below the path given); deeper is refused.
MAX_DEPTH = 256
CHUNK = 1 << 20
#: How long a helper command inside the sandbox (find, tar) may take.
HELPER_TIMEOUT_S = 120.0
BYTES_VAR = "CODE_EXEC_MAX_TRANSFER_BYTES"
FILES_VAR = "CODE_EXEC_MAX_TRANSFER_FILES"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FileInfo(BaseModel):
    """One entry of ``list_files``: its path relative to the workspace, its name, type and size in bytes."""

    model_config = ConfigDict(frozen=True)

    path: str
    name: str
    type: Literal["file", "directory", "symlink", "other"]
    size: int = 0


class Transfer(BaseModel):
    """What an upload or download moved, and what it left out (each ``skipped`` entry says why)."""

    files: int = 0
    directories: int = 0
    bytes: int = 0
    skipped: list[str] = Field(default_factory=list)


class SandboxShell(Protocol):
    """What the in-sandbox walkers need of a session: its workspace, its file calls, and a small sh script run
    through its own exec (every contract Session is one)."""

    workspace: str

    async def read_file(self, path: str, max_bytes: int) -> bytes: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def run_script(self, script: str, *args: str, max_output: int = 1 << 16,
                         stdin: bytes | None = None) -> tuple[int, str, bool]:
        """(exit code, stdout, whether stdout was cut); a script that overruns HELPER_TIMEOUT_S is a SandboxError."""
        ...


@dataclass(frozen=True)
class TransferLimits:
    """The bounds of one transfer or listing: bytes of regular files, entries, depth."""

    max_bytes: int
    max_entries: int
    max_depth: int = MAX_DEPTH


class _Budget:
    def __init__(self, limits: TransferLimits, what: str) -> None:
        self.limits = limits
        self.what = what
        self.entries = 0
        self.bytes = 0

    def entry(self, path: str, depth: int) -> None:
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise TransferTooLargeError(
                f"refused: {self.what} holds more than {self.limits.max_entries} entries. Raise {FILES_VAR}, or "
                "pick a smaller directory (or collect by glob)", env_var=FILES_VAR)
        if depth > self.limits.max_depth:
            raise TransferTooLargeError(
                f"refused: {self.what} goes deeper than {self.limits.max_depth} levels (at {path[:200]!r}...). "
                "Pick a shallower directory")

    def data(self, path: str, size: int) -> None:
        self.bytes += size
        if self.bytes > self.limits.max_bytes:
            raise TransferTooLargeError(
                f"refused: {self.what} holds more than {self.limits.max_bytes} bytes (reached at {path[:200]!r}, "
                f"{size} bytes; sparse files count at their full size). Raise {BYTES_VAR} if you expect that much, "
                "or pick less", env_var=BYTES_VAR)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


@dataclass
class _Entry:
    path: str  # relative to the path walked ("" for that path itself)
    st: os.stat_result
    dir_fd: int  # the directory holding it (valid while the walk is at this entry)
    name: str  # its name in dir_fd; "" for the walked root when it is the workspace itself


def _walk(root: str | int, rel: str, budget: _Budget, *, recursive: bool = True,
          skipped: list[str] | None = None) -> Iterator[_Entry]:
    """``rel`` itself, then (a directory) everything below it, depth first, in name order. No link is followed:
    each directory is opened O_NOFOLLOW relative to its parent and must be the one that was listed."""
    parts = rel.split("/") if rel else []
    try:
        parent = _open_dir(root, parts[:-1], create=False, owner=None)
    except OSError as exc:
        raise _refuse(rel, exc) from None
    try:
        if parts:
            name = parts[-1]
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except OSError as exc:
                raise _refuse(rel, exc) from None
            yield _Entry("", st, parent, name)
            if not stat.S_ISDIR(st.st_mode):
                return
            top = _open_child(parent, name, st)
            if top is None:
                raise WorkspacePathError(f"cannot open {rel!r}: it changed while it was being opened, or is unreadable")
        else:
            top = os.dup(parent)
            yield _Entry("", os.fstat(top), parent, "")
    finally:
        os.close(parent)
    # One frame per open directory: its fd, its path, its depth, the entries still to visit.
    stack: list[tuple[int, str, int, list[tuple[str, os.stat_result]]]] = []
    try:
        stack.append((top, "", 1, _listing(top, "", 1, budget, skipped)))
        while stack:
            fd, prefix, depth, pending = stack[-1]
            if not pending:
                os.close(fd)
                stack.pop()
                continue
            name, st = pending.pop()
            path = _join(prefix, name)
            yield _Entry(path, st, fd, name)
            if recursive and stat.S_ISDIR(st.st_mode):
                child = _open_child(fd, name, st)
                if child is None:
                    if skipped is not None:
                        skipped.append(f"{path}: unreadable directory, or it changed while being read (left out)")
                    continue
                stack.append((child, path, depth + 1, []))  # on the stack first: closed even if listing fails
                stack[-1] = (child, path, depth + 1, _listing(child, path, depth + 1, budget, skipped))
    finally:
        for fd, *_ in stack:
            os.close(fd)


def _listing(fd: int, prefix: str, depth: int, budget: _Budget,
             skipped: list[str] | None) -> list[tuple[str, os.stat_result]]:
    """The entries of the directory ``fd`` (lstat), counted against the budget as they are read; reversed name
    order so that popping visits them in order."""
    found: list[tuple[str, os.stat_result]] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                path = _join(prefix, entry.name)
                budget.entry(path, depth)
                try:
                    found.append((entry.name, entry.stat(follow_symlinks=False)))
                except OSError:
                    if skipped is not None:
                        skipped.append(f"{path}: vanished while being listed")
    except OSError as exc:
        if skipped is None:
            raise SandboxError(f"cannot list {prefix or 'the workspace'!r}: {exc.strerror}") from None
        skipped.append(f"{prefix or '.'}: cannot be listed ({exc.strerror})")
    found.sort(key=lambda item: item[0], reverse=True)
    return found


def _open_child(parent: int, name: str, st: os.stat_result) -> int | None:
    """The directory ``name`` in ``parent``, only if it is still the one ``st`` describes (not swapped)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError:
        return None
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        return None
    return fd


# --- host side --------------------------------------------------------------------------------------------


def host_list(root: str | int, rel: str, *, recursive: bool, limits: TransferLimits) -> list[FileInfo]:
    """The entries of the directory ``root/rel`` (everything below it with ``recursive``), or the one entry of a
    file; paths relative to ``root``. Never follows a link."""
    budget = _Budget(limits, f"listing {rel or 'the workspace'!r}")
    out: list[FileInfo] = []
    for entry in _walk(root, rel, budget, recursive=recursive):
        if entry.path == "" and stat.S_ISDIR(entry.st.st_mode):
            continue
        path = _join(rel, entry.path) if entry.path else rel
        kind = _kind(entry.st.st_mode)
        out.append(FileInfo(path=path, name=posixpath.basename(path), type=kind,  # type: ignore[arg-type]
                            size=entry.st.st_size if kind == "file" else 0))
    return out


class _Exactly:
    """Reads exactly ``size`` bytes of ``fh`` (zeros if it shrank, the rest cut if it grew): a tar header has
    already promised that many."""

    def __init__(self, fh: IO[bytes], size: int) -> None:
        self.fh = fh
        self.left = size
        self.changed = False

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        data = self.fh.read(want) if want else b""
        if len(data) < want:
            self.changed = True
            data += b"\0" * (want - len(data))
        self.left -= len(data)
        return data


def host_pack(root: str | int, rel: str, out: IO[bytes], *, limits: TransferLimits, prefix: str | None = None,
              what: str | None = None) -> Transfer:
    """Write a tar of ``root/rel`` (``rel`` "" = ``root`` itself) to ``out``, members named under ``prefix``
    (default: the basename of ``rel``, or "." for the root). Symlinks are stored as links; FIFOs, sockets and
    devices are skipped and reported; setuid/setgid bits are dropped; owners are not stored."""
    prefix = prefix if prefix is not None else (posixpath.basename(rel) if rel else ".")
    budget = _Budget(limits, what or f"{rel or 'the workspace'!r}")
    stats = Transfer()
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK) as tar:
        tar.copybufsize = CHUNK  # type: ignore[attr-defined]  # 16 KiB by default (not in typeshed)
        for entry in _walk(root, rel, budget, skipped=stats.skipped):
            name = _join(prefix, entry.path) if entry.path else prefix
            shown = _join(rel, entry.path) if entry.path else (rel or ".")
            st = entry.st
            info = tarfile.TarInfo(name)
            info.mode = stat.S_IMODE(st.st_mode) & 0o777
            info.mtime = int(st.st_mtime)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                stats.directories += 1
            elif stat.S_ISLNK(st.st_mode):
                try:
                    info.linkname = os.readlink(entry.name, dir_fd=entry.dir_fd)
                except OSError:
                    stats.skipped.append(f"{shown}: symlink vanished while being read")
                    continue
                info.type = tarfile.SYMTYPE
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                budget.data(shown, st.st_size)
                try:
                    fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                 dir_fd=entry.dir_fd)
                except OSError as exc:
                    if not entry.path:  # the file asked for, as read_file would refuse it
                        raise _refuse(shown, exc) from None
                    stats.skipped.append(f"{shown}: cannot be opened ({exc.strerror})")
                    continue
                with os.fdopen(fd, "rb") as fh:
                    now = os.fstat(fd)
                    if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                        stats.skipped.append(f"{shown}: replaced while being read (left out)")
                        continue
                    info.size = st.st_size
                    reader = _Exactly(fh, st.st_size)
                    tar.addfile(info, reader)
                if reader.changed:
                    stats.skipped.append(f"{shown}: shrank while being read (the rest is zeros)")
                stats.files += 1
                stats.bytes += st.st_size
            else:
                stats.skipped.append(f"{shown}: a {_special(st.st_mode)}, not copied")
    return stats


def _special(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def _member_rel(name: str, prefix: str) -> str | None:
    """Where a member named ``name`` goes, relative to the destination; None if it is not under ``prefix`` or
    would leave the destination."""
    if not name or "\0" in name or name.startswith("/"):
        return None
    clean = posixpath.normpath(name)
    if clean == ".." or clean.startswith("../"):
        return None
    if prefix == ".":
        return "" if clean == "." else clean
    if clean == prefix:
        return ""
    if clean.startswith(prefix + "/"):
        return clean[len(prefix) + 1:]
    return None


class _Dirs:
    """The last parent directory opened (O_NOFOLLOW all the way down from the root), kept open for its
    siblings."""

    def __init__(self, root: str | int, owner: tuple[int, int] | None) -> None:
        self.root = root
        self.owner = owner
        self.key: str | None = None
        self.fd = -1

    def get(self, rel_dir: str) -> int:
        if rel_dir != self.key:
            self.close()
            self.fd = _open_dir(self.root, rel_dir.split("/") if rel_dir else [], create=True, owner=self.owner)
            self.key = rel_dir
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.key = -1, None


def host_unpack(root: str | int, dest: str, archive: IO[bytes], *, limits: TransferLimits, prefix: str,
                owner: tuple[int, int] | None = None, keep_symlinks: bool = False, workspace: bool = True,
                shown_as: str | None = None) -> Transfer:
    """Extract a tar whose members are named under ``prefix`` so that ``prefix`` becomes ``root/dest`` (``dest``
    "" = ``root`` itself). Every directory on the way is opened O_NOFOLLOW (a symlink planted in the destination
    is refused, never followed); files are created O_NOFOLLOW. ``keep_symlinks``: recreate symlink members as
    symlinks (into a sandbox's workspace); otherwise they are skipped and reported, like hard links, devices and
    FIFOs. ``owner``: chown what is created (a workspace handed to the sandbox user). ``workspace``: the root is
    a sandbox's workspace (a full disk names CODE_EXEC_DISK_MB). ``shown_as``: how ``dest`` is named in
    ``skipped`` (its path in the sandbox, for a download)."""
    budget = _Budget(limits, f"the archive for {dest or 'the workspace'!r}")
    stats = Transfer()
    before = 0
    dirs = _Dirs(root, owner)
    try:
        with tarfile.open(fileobj=archive, mode="r|", bufsize=CHUNK) as tar:
            for member in tar:
                sub = _member_rel(member.name, prefix)
                if sub is None:
                    stats.skipped.append(f"{member.name[:200]}: outside {prefix!r} (left out)")
                    continue
                rel = _join(dest, sub) if sub else dest
                budget.entry(rel, sub.count("/") + 1 if sub else 0)
                try:
                    _extract_one(tar, member, rel, dirs, budget, stats, owner, keep_symlinks)
                except OSError as exc:
                    raise _write_error(rel, exc, workspace) from None
                if shown_as is not None and len(stats.skipped) > before:
                    shown = _join(shown_as, sub) if sub else (shown_as or ".")
                    stats.skipped[-1] = shown + stats.skipped[-1][len(rel):]
                before = len(stats.skipped)
    except tarfile.TarError as exc:
        raise SandboxError(f"the archive for {dest or 'the workspace'!r} is malformed: {exc}") from None
    finally:
        dirs.close()
    return stats


def _write_error(rel: str, exc: OSError, workspace: bool) -> SandboxError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return write_error(rel, exc) if workspace else SandboxError(f"cannot write {rel!r}: {exc.strerror}")
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.EEXIST):
        return WorkspacePathError(f"refused {rel!r}: it is (or passes through) a symlink, or something other than "
                                  f"what the archive holds is in its place ({exc.strerror})")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return SandboxPermissionError(f"permission denied: cannot write {rel!r} ({exc.strerror}; the modes are the "
                                      "ones the code set)")
    return SandboxError(f"cannot write {rel!r}: {exc.strerror}")


def _extract_one(tar: tarfile.TarFile, member: tarfile.TarInfo, rel: str, dirs: _Dirs, budget: _Budget,
                 stats: Transfer, owner: tuple[int, int] | None, keep_symlinks: bool) -> None:
    parent, name = posixpath.split(rel)
    if member.isdir():
        if rel:
            dirs.get(rel)  # made (and owned) on the way, O_NOFOLLOW like every directory
        stats.directories += 1
        return
    if not rel:
        raise WorkspacePathError("refused: the archive puts a file where the workspace itself is")
    if member.issym() and keep_symlinks:
        fd = dirs.get(parent)
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stats.skipped.append(f"{rel}: a directory is in the place of this symlink (left out)")
                return
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        os.symlink(member.linkname, name, dir_fd=fd)
        if owner:
            os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
        return
    if not member.isreg():
        what = ("a symlink to " + repr(member.linkname[:200]) if member.issym() else
                "a hard link" if member.islnk() else "a special file")
        stats.skipped.append(f"{rel}: {what}, not created")
        return
    budget.data(rel, member.size)
    fd = dirs.get(parent)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    out = os.open(name, flags, 0o600, dir_fd=fd)
    with os.fdopen(out, "wb") as fh:
        if not stat.S_ISREG(os.fstat(out).st_mode):
            raise OSError(errno.ENXIO, "not a regular file")
        os.set_blocking(out, True)
        os.ftruncate(out, 0)
        if owner:
            os.fchown(out, *owner)
        os.fchmod(out, (member.mode & 0o755) | 0o600)
        source = tar.extractfile(member)
        left = member.size
        while source is not None and left > 0:
            chunk = source.read(min(CHUNK, left))
            if not chunk:
                break
            fh.write(chunk)
            left -= len(chunk)
    stats.files += 1
    stats.bytes += member.size


# --- inside the sandbox (sessions without a host workspace) ------------------------------------------------

# sh -c LIST execbox WORKSPACE REL RECURSIVE: REL's directory must resolve inside the workspace (exit 4 outside
# it; REL itself is never followed: a link is listed as a link), then one record per entry:
# "<type letter> <size> <path>\0" (GNU find; paths relative to REL).
_LIST = r"""
w=$(realpath -- "$1") || exit 3
cd "$w" || exit 3
if [ -n "$2" ]; then
  t=$(realpath -m -- "$(dirname -- "$2")") || exit 3
  case "$t/" in "${w%/}"/*) ;; *) exit 4 ;; esac
  [ -e "$2" ] || [ -L "$2" ] || exit 5
fi
p=${2:-.}
if [ -d "$p" ] && [ ! -L "$p" ]; then
  depth=-maxdepth; [ "$3" = 1 ] && depth=-mindepth
  find "$p" -mindepth 1 "$depth" 1 -printf '%y %s %P\0'
else
  printf 'F '; find "$p" -maxdepth 0 -printf '%y %s \0'
fi
"""

# sh -c PACK execbox WORKSPACE REL OUT NAME: a tar of REL (members under its basename; "." for the workspace) at the
# absolute path OUT (NAME: OUT relative to WORKSPACE, left out of a tar of the workspace itself).
_PACK = r"""
w=$(realpath -- "$1") || exit 3
cd "$w" || exit 3
if [ -z "$2" ]; then exec tar -cf "$3" --exclude="./$4" .; fi
t=$(realpath -m -- "$(dirname -- "$2")") || exit 3
case "$t/" in "${w%/}"/*) ;; *) exit 4 ;; esac
cd -- "$(dirname -- "$2")" && exec tar -cf "$3" -- "$(basename -- "$2")"
"""

# sh -c PACK_CONTENTS execbox DIR ARCHIVE: what DIR holds, without DIR itself (whose mode and times belong to its
# owner: /tmp is root's, and extracting a "." entry into it would try to change them).
_PACK_CONTENTS = r"""
cd -- "$1" || exit 3
find . -mindepth 1 -maxdepth 1 -print0 | tar -cf "$2" --null -T -
"""

# sh -c UNPACK execbox WORKSPACE DEST ARCHIVE: extract ARCHIVE (an absolute path, written by execbox) into DEST's
# parent.
_UNPACK = r"""
w=$(realpath -- "$1") || exit 3
cd "$w" || exit 3
d=.
if [ -n "$2" ]; then
  d=$(dirname -- "$2")
  t=$(realpath -m -- "$d") || exit 3
  case "$t/" in "${w%/}"/*) ;; *) exit 4 ;; esac
fi
if ! mkdir -p -- "$d" 2>/dev/null || [ ! -w "$d" ]; then rm -f -- "$3"; exit 16; fi
tar -xf "$3" -C "$d" --no-same-owner; rc=$?
rm -f -- "$3"
exit $rc
"""

# The file calls on an absolute path outside the workspace, run inside the sandbox as its user (its kernel judges
# every access: the modes the code set, read-only places); the exit code says what went wrong, stdout why.
_NOT_FOUND, _IS_DIR, _NOT_REGULAR, _DENIED, _TOO_LARGE, _FULL = 12, 14, 15, 16, 17, 18
# sh -c READ execbox PATH MAX: PATH's bytes (at most MAX + 1 of them) as base64.
_READ = r"""
p=$1
if [ ! -e "$p" ]; then
  e=$(LC_ALL=C stat -L -- "$p" 2>&1); echo "$e"
  case $e in *"ermission denied"*) exit 16 ;; esac; exit 12
fi
[ -d "$p" ] && exit 14
[ -f "$p" ] || exit 15
[ -r "$p" ] || { echo "Permission denied"; exit 16; }
n=$(wc -c < "$p") || exit 16
[ "$n" -gt "$2" ] && { echo "$n"; exit 17; }
head -c "$(($2 + 1))" < "$p" | base64
"""
# sh -c WRITE execbox PATH < DATA: PATH made (its directories too) or replaced with DATA.
_WRITE = r"""
p=$1
[ -d "$p" ] && exit 14
d=$(dirname -- "$p")
if [ ! -d "$d" ]; then e=$(LC_ALL=C mkdir -p -- "$d" 2>&1) || { echo "$e"; exit 16; }; fi
e=$( (LC_ALL=C; cat > "$p") 2>&1 ) && exit 0
echo "$e"
case $e in *"o space"*|*"uota"*) exit 18 ;; *"ermission denied"*|*"ead-only"*) exit 16 ;; esac
exit 1
"""


def _path_error(path: str, code: int, why: str, doing: str) -> SandboxError:
    why = why.strip().splitlines()[-1][-300:] if why.strip() else ""
    if code == _NOT_FOUND:
        return SandboxFileNotFoundError(f"no such file in the sandbox: {path!r}")
    if code == _IS_DIR:
        return is_directory_error(path)
    if code == _NOT_REGULAR:
        return WorkspacePathError(f"refused {path!r}: not a regular file (a device, a FIFO or a socket)")
    if code == _DENIED:
        return SandboxPermissionError(f"permission denied: the sandbox user may not {doing} {path!r}"
                                      + (f" ({why})" if why else ""))
    if code == _FULL:
        return SandboxError(f"cannot write {path!r}: no space left there ({why})")
    return SandboxError(f"the file helper failed in the sandbox for {path!r} (exit {code}); it needs /bin/sh and "
                        "the coreutils (head, base64, wc) in the image" + (f": {why}" if why else ""))


async def sandbox_read(session: SandboxShell, path: str, max_bytes: int) -> bytes:
    """Read the file at the absolute sandbox ``path`` as the sandbox user (links followed inside the sandbox, which
    is its own view); over ``max_bytes`` is refused (FileTooLargeError), from its size before a byte is sent."""
    cap = (max_bytes + 1 + 2) // 3 * 4 + (max_bytes // 57) + 4096  # base64 with its newlines
    code, out, cut = await session.run_script(_READ, path, str(max_bytes), max_output=cap)
    if code == _TOO_LARGE:
        size = out.strip()
        raise FileTooLargeError(path, int(size) if size.isdigit() else None, max_bytes)
    if code != 0:
        raise _path_error(path, code, out, "read")
    if cut:  # a cut base64 text may still decode: to other bytes than the file's
        raise SandboxError(f"the file helper's output for {path!r} was cut short: the file was not read whole")
    try:
        data = base64.b64decode(out.replace("\n", ""), validate=True)
    except ValueError:
        raise SandboxError(f"the file helper sent back something that is not base64 for {path!r}") from None
    if len(data) > max_bytes:  # it grew after its size was read
        raise FileTooLargeError(path, None, max_bytes)
    return data


async def sandbox_write(session: SandboxShell, path: str, data: bytes) -> None:
    """Write ``data`` to the absolute sandbox ``path`` as the sandbox user, making its directories."""
    code, out, _ = await session.run_script(_WRITE, path, stdin=data)
    if code != 0:
        raise _path_error(path, code, out, "write")


def _helper_failed(rel: str, code: int, stderr_hint: str = "") -> SandboxError:
    if code == 4:
        return WorkspacePathError(f"refused {rel!r}: it is (or passes through) a symlink that leads out of the "
                                  "workspace")
    if code == 5:
        return SandboxFileNotFoundError(f"no such file or directory in the sandbox: {rel!r}")
    if code == _DENIED:
        return SandboxPermissionError(f"permission denied: the sandbox user may not write in the directory of {rel!r}")
    return SandboxError(f"the file-transfer helper failed in the sandbox for {rel or '.'!r} (exit {code}); it needs "
                        "/bin/sh, realpath and GNU find and tar in the image" + stderr_hint)


_RECORD = re.compile(r"([a-zA-Z]) ([0-9]+) (.*)", re.DOTALL)
_TYPES = {"f": "file", "d": "directory", "l": "symlink"}


def _rooted(session: SandboxShell, rel: str) -> tuple[str, str, str]:
    """(the directory the walkers stay in, ``rel`` relative to it, what listed paths are prefixed with): the
    workspace for a relative path, ``/`` for an absolute one (elsewhere in the sandbox, which is its own view)."""
    if rel.startswith("/"):
        return "/", rel.lstrip("/"), "/"
    return session.workspace, rel, ""


async def sandbox_list(session: SandboxShell, rel: str, *, recursive: bool, limits: TransferLimits) -> list[FileInfo]:
    """``rel`` relative to the workspace, or absolute (elsewhere in the sandbox: listed paths are absolute too)."""
    root, inner, shown = _rooted(session, rel)
    found = await _sandbox_list(session, root, inner, recursive=recursive, limits=limits)
    if not shown:
        return found
    return [entry.model_copy(update={"path": shown + entry.path}) for entry in found]


async def _sandbox_list(session: SandboxShell, root: str, rel: str, *, recursive: bool,
                        limits: TransferLimits) -> list[FileInfo]:
    # ~ a record per 4 KiB at most: the output cap bounds what comes back.
    cap = min(64 << 20, max(1 << 16, limits.max_entries * 512))
    code, out, cut = await session.run_script(_LIST, root, rel, "1" if recursive else "0", max_output=cap)
    if code != 0:
        raise _helper_failed(rel, code)
    if cut:
        raise TransferTooLargeError(f"refused: listing {rel or 'the workspace'!r} is longer than execbox reads "
                                    f"({cap} bytes); raise {FILES_VAR} or list a smaller directory", env_var=FILES_VAR)
    budget = _Budget(limits, f"listing {rel or 'the workspace'!r}")
    entries: list[FileInfo] = []
    if out.startswith("F "):  # a single entry: the path itself
        match = _RECORD.fullmatch(out[2:].rstrip("\0"))
        if not match:
            raise _helper_failed(rel, 0, f"; it printed {out[:100]!r}")
        kind = _TYPES.get(match.group(1), "other")
        return [FileInfo(path=rel, name=posixpath.basename(rel), type=kind,  # type: ignore[arg-type]
                         size=int(match.group(2)) if kind == "file" else 0)]
    for record in out.split("\0"):
        if not record:
            continue
        match = _RECORD.fullmatch(record)
        if not match:
            continue
        path = _join(rel, match.group(3))
        budget.entry(path, match.group(3).count("/") + 1)
        kind = _TYPES.get(match.group(1), "other")
        entries.append(FileInfo(path=path, name=posixpath.basename(path), type=kind,  # type: ignore[arg-type]
                                size=int(match.group(2)) if kind == "file" else 0))
    entries.sort(key=lambda e: e.path)
    return entries


async def sandbox_pack(session: SandboxShell, rel: str, out: IO[bytes], *, limits: TransferLimits,
                       contents: bool = False) -> None:
    """``rel`` as tar into ``out``; with ``contents``, what the absolute directory ``rel`` holds, as ``./...``
    (a snapshot's kept directory, unpacked into the same place by ``sandbox_unpack(contents=True)``)."""
    listing = await sandbox_list(session, rel, recursive=True, limits=limits)
    budget = _Budget(limits, f"{rel or 'the workspace'!r}")
    for entry in listing:
        if entry.type == "file":
            budget.data(entry.path, entry.size)  # refused from the sizes, before a byte is packed
    name = f".execbox/xfer-{uuid.uuid4().hex[:12]}.tar"
    await session.write_file(name, b"")  # makes .execbox (as the caller sees the workspace)
    if contents:
        code, _, _ = await session.run_script(_PACK_CONTENTS, rel, posixpath.join(session.workspace, name))
    else:
        root, inner, _ = _rooted(session, rel)
        code, _, _ = await session.run_script(_PACK, root, inner, posixpath.join(session.workspace, name), name)
    try:
        if code != 0:
            raise _helper_failed(rel, code)
        # Headers and padding: at most ~1.5 KiB per entry with pax names, plus the end blocks.
        data = await session.read_file(name, limits.max_bytes + 2048 * (len(listing) + 8))
    finally:
        await session.run_script('rm -f -- "$1/$2"', session.workspace, name)
    out.write(data)


async def sandbox_unpack(session: SandboxShell, dest: str, archive: IO[bytes], *, limits: TransferLimits,
                         contents: bool = False) -> None:
    name = f".execbox/xfer-{uuid.uuid4().hex[:12]}.tar"
    bound = limits.max_bytes + 2048 * (limits.max_entries + 8)
    data = archive.read(bound + 1)
    if len(data) > bound:
        raise TransferTooLargeError(f"refused: the archive for {dest!r} is over {bound} bytes. Raise {BYTES_VAR}, or "
                                    "upload less", env_var=BYTES_VAR)
    await session.write_file(name, data)
    root, inner = (dest, "") if contents else _rooted(session, dest)[:2]
    code, _, _ = await session.run_script(_UNPACK, root, inner, posixpath.join(session.workspace, name))
    if code != 0:
        raise _helper_failed(dest, code)


# --- globs --------------------------------------------------------------------------------------------------


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob over workspace paths: ``*``, ``?`` and ``[...]`` within one path segment, ``**`` any number of
    segments (``**/*.png`` also matches ``a.png``)."""
    parts = posixpath.normpath(pattern).split("/")
    out = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out += ".*" if last else "(?:[^/]+/)*"
            continue
        seg = ""
        j = 0
        while j < len(part):
            c = part[j]
            if c == "*":
                seg += "[^/]*"
            elif c == "?":
                seg += "[^/]"
            elif c == "[":
                end = part.find("]", j + 2 if part[j + 1:j + 2] in ("!", "]") else j + 1)
                if end < 0:
                    seg += re.escape(c)
                else:
                    body = part[j + 1:end]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    seg += "[" + body.replace("\\", "\\\\").replace("/", "") + "]"
                    j = end
            else:
                seg += re.escape(c)
            j += 1
        out += seg + ("" if last else "/")
    return re.compile(out, re.DOTALL)


def glob_base(pattern: str) -> str:
    """The longest leading directory of ``pattern`` without wildcards ("" for the workspace)."""
    parts = posixpath.normpath(pattern).split("/")[:-1]
    fixed: list[str] = []
    for part in parts:
        if any(c in part for c in "*?["):
            break
        fixed.append(part)
    return "/".join(fixed)
