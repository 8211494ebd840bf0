"""Workspace paths and host-side file access that never follows a symlink.

Sandboxed code can plant ``out.txt -> /etc/shadow`` in its workspace; a host that reads the workspace
back must refuse that, so every component is opened with O_NOFOLLOW relative to the one before it.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat

from execbox.core.errors import WorkspacePathError


def normalize(path: str, workspace: str | None = None) -> str:
    """A clean relative POSIX path inside the workspace, or WorkspacePathError.

    An absolute path is accepted only when it lies under ``workspace`` (the sandbox's own view of it).
    """
    if not path or "\0" in path:
        raise WorkspacePathError(f"invalid workspace path {path!r}")
    if path.startswith("/"):
        root = (workspace or "").rstrip("/")
        if not root or not (path == root or path.startswith(root + "/")):
            raise WorkspacePathError(
                f"path {path!r} is outside the workspace; give a path relative to the workspace"
                + (f" or under {workspace}" if workspace else "")
            )
        path = path[len(root):].lstrip("/")
    clean = posixpath.normpath(path)
    if clean in ("", ".") or clean == ".." or clean.startswith("../"):
        raise WorkspacePathError(f"path {path!r} escapes the workspace; give a path inside it")
    return clean


def _open_dir(root: str, parts: list[str], *, create: bool, owner: tuple[int, int] | None) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
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
        return WorkspacePathError(f"no such file in the workspace: {rel!r}")
    return WorkspacePathError(f"cannot access {rel!r} in the workspace: {exc.strerror}")


def safe_read(root: str, rel: str, *, max_bytes: int | None = None) -> bytes:
    """Read ``root/rel`` without following any symlink; only a regular file is read."""
    parts = rel.split("/")
    try:
        dfd = _open_dir(root, parts[:-1], create=False, owner=None)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise _refuse(rel, exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WorkspacePathError(f"refused {rel!r}: not a regular file")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise WorkspacePathError(f"{rel!r} is larger than {max_bytes} bytes")
    return data


def safe_write(root: str, rel: str, data: bytes, *, owner: tuple[int, int] | None = None, mode: int = 0o644) -> None:
    """Write ``root/rel``, creating directories, never following a symlink the sandbox planted."""
    parts = rel.split("/")
    try:
        dfd = _open_dir(root, parts[:-1], create=True, owner=owner)
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
    with os.fdopen(fd, "wb") as fh:
        if owner:
            os.fchown(fh.fileno(), *owner)
        fh.write(data)
