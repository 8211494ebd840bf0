"""Workspace paths and host-side file access that never follows a symlink.

Sandboxed code can plant ``out.txt -> /etc/shadow`` in its workspace; a host that reads the workspace
back must refuse that, so every component is opened with O_NOFOLLOW relative to the one before it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from collections.abc import Iterator

from execbox.errors import (
    FileTooLargeError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxPermissionError,
    WorkspacePathError,
)


def is_directory_error(rel: str) -> SandboxIsADirectoryError:
    """What reading a directory (or the workspace itself) as a file says: where to go instead."""
    shown = "the workspace itself" if rel in ("", ".") else repr(rel)
    return SandboxIsADirectoryError(f"{shown} is a directory, not a file: use list_files({rel or '.'!r}) to see what "
                                    f"is in it, or download({rel or '.'!r}, local_path) to copy it out")


def normalize(path: str, workspace: str | None = None, *, allow_root: bool = False, anywhere: bool = False) -> str:
    """A clean relative POSIX path inside the workspace, or WorkspacePathError.

    An absolute path under ``workspace`` (the sandbox's own view of it) is made relative to it. With ``anywhere``,
    an absolute path elsewhere in the sandbox is returned clean and absolute (a ``..`` above ``/`` is refused);
    without it, it is refused. ``allow_root``: the workspace itself ("", "." or ``workspace``) is returned as "".
    """
    if allow_root and path is not None and (path in ("", ".", "./") or (
            workspace and path.rstrip("/") == workspace.rstrip("/"))):
        return ""
    if not path or "\0" in path:
        raise WorkspacePathError(f"invalid sandbox path {path!r}: give a path relative to the workspace or an "
                                 "absolute one")
    if path.startswith("/"):
        if anywhere:
            path = _absolute(path)
        root = (workspace or "").rstrip("/")
        if not root or not (path == root or path.startswith(root + "/")):
            if anywhere:
                return path
            raise WorkspacePathError(
                f"path {path!r} is outside the workspace; give a path relative to the workspace"
                + (f" or under {workspace}" if workspace else "")
            )
        if path == root and allow_root:
            return ""
        path = path[len(root):].lstrip("/")
    clean = posixpath.normpath(path)
    if clean in ("", ".") or clean == ".." or clean.startswith("../"):
        hint = " (or an absolute path to reach the rest of the sandbox)" if anywhere else ""
        raise WorkspacePathError(f"path {path!r} escapes the workspace; give a path inside it{hint}")
    return clean


def _absolute(path: str) -> str:
    """``path`` (absolute) without ``.``, ``..`` or repeated slashes; a ``..`` above ``/`` is refused, not dropped."""
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise WorkspacePathError(f"path {path!r} climbs above / with '..'; give the place itself")
            parts.pop()
        else:
            parts.append(part)
    return "/" + "/".join(parts)


def _open_dir(root: str | int, parts: list[str], *, create: bool, owner: tuple[int, int] | None) -> int:
    """``root/parts...``, each part opened without following a link (made, with ``create``, and given to ``owner``).
    ``root``: a path, or a directory descriptor its caller opened (and keeps)."""
    top = os.dup(root) if isinstance(root, int) else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return _open_parts(top, parts, create=create, owner=owner)


def _open_parts(fd: int, parts: list[str], *, create: bool, owner: tuple[int, int] | None) -> int:
    """Walk ``parts`` down from ``fd`` (consumed: closed, or returned when ``parts`` is empty)."""
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refuse(rel: str, exc: OSError) -> WorkspacePathError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return WorkspacePathError(f"refused {rel!r}: it is (or passes through) a symlink or not a regular file")
    if exc.errno == errno.ENOENT:
        return SandboxFileNotFoundError(f"no such file in the workspace: {rel!r}")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return SandboxPermissionError(f"permission denied: the sandbox user may not access {rel!r} in the workspace "
                                      f"({exc.strerror}; the modes are the ones the code set)")
    if exc.errno == errno.EISDIR:
        return is_directory_error(rel)
    return WorkspacePathError(f"cannot access {rel!r} in the workspace: {exc.strerror}")


class _Fs:
    """The calls that make this thread's file access the sandbox user's: Linux keeps the filesystem uid, gid and the
    supplementary groups per thread (the raw system calls; glibc's setgroups would change every thread). On an
    architecture not listed, root's supplementary groups stay (its primary group 0 is replaced all the same)."""

    _SETGROUPS = {"x86_64": 116, "aarch64": 159}

    def __init__(self) -> None:
        import ctypes
        import platform

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.setgroups_nr = self._SETGROUPS.get(platform.machine())
        self.ctypes = ctypes

    def set(self, uid: int, gid: int, groups: list[int] | None) -> None:
        self.libc.setfsgid(gid)
        self.libc.setfsuid(uid)
        if self.libc.setfsuid(-1) != uid:  # -1 is never valid: it only reads the current one back
            raise OSError(errno.EPERM, "cannot take the sandbox user's filesystem identity")
        if self.setgroups_nr is not None and groups is not None and (groups or os.getgroups()):
            array = (self.ctypes.c_uint * max(1, len(groups)))(*groups)
            if self.libc.syscall(self.setgroups_nr, len(groups), array) != 0:
                raise OSError(self.ctypes.get_errno(), "cannot set the supplementary groups")


_fs: _Fs | None = None


@contextlib.contextmanager
def as_owner(owner: tuple[int, int] | None) -> Iterator[None]:
    """Run the block with this thread's file access as ``owner`` (uid, gid, no supplementary groups) when execbox is
    root: root passes every mode check, so without this the host would read a file the code made unreadable or
    overwrite one it made read-only. The kernel then judges each access as it would the sandbox user's (modes, ACLs,
    read-only mounts); created files and directories are the owner's. Not root (or no owner): as is, the host user
    is then the sandbox's owner itself. Costs a few system calls."""
    global _fs
    if owner is None or os.geteuid() != 0:
        yield
        return
    if _fs is None:
        _fs = _Fs()
    groups = os.getgroups()
    try:  # set inside the try: a failure half way is undone too
        _fs.set(owner[0], owner[1], [])
        yield
    finally:
        _fs.set(0, os.getegid(), groups)


def safe_read(root: str, rel: str, *, max_bytes: int, owner: tuple[int, int] | None = None) -> bytes:
    """Read ``root/rel`` without following any symlink; only a regular file is read, and only up to
    ``max_bytes`` (a larger one, sparse or not, is refused before a byte is loaded). ``owner``: the sandbox user
    whose access this is (``as_owner``)."""
    parts = rel.split("/")
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # execbox's to reach; the rest the user's
        with as_owner(owner):
            dfd = _open_parts(top, parts[:-1], create=False, owner=None)
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        raise _refuse(rel, exc) from None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise is_directory_error(rel)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise WorkspacePathError(f"refused {rel!r}: not a regular file")
    if st.st_size > max_bytes:
        os.close(fd)
        raise FileTooLargeError(rel, st.st_size, max_bytes)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(max_bytes + 1)  # the file may grow after fstat: never read past the cap
    if len(data) > max_bytes:
        raise FileTooLargeError(rel, None, max_bytes)
    return data


def safe_write(root: str, rel: str, data: bytes, *, owner: tuple[int, int] | None = None, mode: int = 0o644) -> None:
    """Write ``root/rel``, creating directories, never following a symlink the sandbox planted. ``owner``: the
    sandbox user, who gets what is created and whose access this is (``as_owner``: a file or directory the code made
    read-only is not written)."""
    parts = rel.split("/")
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # execbox's to reach; the rest the user's
        with as_owner(owner):
            dfd = _open_parts(top, parts[:-1], create=True, owner=owner)
            try:
                # O_NONBLOCK: a FIFO the sandbox planted must not hang the host (ENXIO without a reader).
                flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                fd = os.open(parts[-1], flags, mode, dir_fd=dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise WorkspacePathError(f"refused {rel!r}: not a regular file") from None
        raise _refuse(rel, exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WorkspacePathError(f"refused {rel!r}: not a regular file")
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    try:
        with os.fdopen(fd, "wb") as fh:
            if owner:
                os.fchown(fh.fileno(), *owner)
            fh.write(data)
    except OSError as exc:
        raise write_error(rel, exc) from None


def write_error(rel: str, exc: OSError) -> SandboxError:
    """A write into the workspace that failed: a full workspace (the sandbox filled it) names CODE_EXEC_DISK_MB."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return SandboxError(f"cannot write {rel!r}: the workspace is full ({exc.strerror}); it holds at most "
                            "CODE_EXEC_DISK_MB: free space in it or raise the limit", env_var="CODE_EXEC_DISK_MB")
    return SandboxError(f"cannot write {rel!r} in the workspace: {exc.strerror}")


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything in it, whatever the sandboxed code built there.

    Iterative (a tree thousands of levels deep is fine; ``shutil.rmtree`` recurses), holding at most two
    directory descriptors (depth never exhausts the fd limit), never following a symlink (each level is
    opened with O_NOFOLLOW relative to the one above, and the way back up is checked to be the same
    directory), and giving back access the code took away from its own directories (mode 0000 or 0500:
    the owner may chmod them). Sockets, FIFOs and devices are just unlinked. What still cannot be removed
    (not ours, a mount point) is left, never retried forever.
    """
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(top.st_mode):
        with _suppress_oserror():
            os.unlink(path)  # a file or a symlink in place of the tree: the entry goes, never its target
        return
    parent_path, name = os.path.split(os.path.abspath(path))
    try:
        parent = os.open(parent_path or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        _remove_below(parent, name)
    finally:
        os.close(parent)


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)


def _open_subdir(parent: int, name: str) -> int | None:
    """A descriptor of the real directory ``name`` in ``parent`` (access given back if it was taken)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=parent)
    except PermissionError:
        pass
    except OSError:
        return None
    try:  # mode 0000/0100: O_PATH needs no permission on the directory itself, and its /proc link is exact
        fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return None
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
        # Not O_NOFOLLOW here: the /proc link is itself a symlink, to exactly the directory the O_PATH
        # descriptor pins (opened with O_NOFOLLOW above).
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(fd)


def _unlink(fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except PermissionError:  # the directory itself was made read-only (0500): give write back, once
        with _suppress_oserror():
            os.fchmod(fd, 0o700)
            os.unlink(name, dir_fd=fd)
    except OSError:
        pass


def _rmdir(fd: int, name: str) -> None:
    try:
        os.rmdir(name, dir_fd=fd)
    except PermissionError:  # a read-only parent (0500): give write back, once
        with _suppress_oserror():
            os.fchmod(fd, 0o700)
            os.rmdir(name, dir_fd=fd)
    except OSError:
        pass  # not empty (something could not go) or not ours: leave it


def _clear_files(fd: int) -> list[str]:
    """Unlink every non-directory in the directory ``fd``; return the names of its subdirectories."""
    subdirs: list[str] = []
    with _suppress_oserror(), os.scandir(fd) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                subdirs.append(entry.name)
            else:
                _unlink(fd, entry.name)
    return subdirs


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _remove_below(parent: int, top_name: str) -> None:
    fd = _open_subdir(parent, top_name)
    if fd is None:
        return
    # One frame per directory entered: its name, its identity, the subdirectories still to visit.
    stack: list[tuple[str, tuple[int, int], list[str]]] = [(top_name, _identity(fd), _clear_files(fd))]
    try:
        while stack:
            name, _, pending = stack[-1]
            if pending:
                child_name = pending.pop()
                child = _open_subdir(fd, child_name)
                if child is not None:
                    os.close(fd)
                    fd = child
                    stack.append((child_name, _identity(fd), _clear_files(fd)))
                continue
            stack.pop()  # as empty as it will get: go up and remove it
            if not stack:
                os.close(fd)
                fd = -1
                _rmdir(parent, name)
                return
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = up
            if _identity(fd) != stack[-1][1]:
                return  # the tree was moved while we were in it: stop rather than touch another directory
            _rmdir(fd, name)
    finally:
        if fd >= 0:
            os.close(fd)
