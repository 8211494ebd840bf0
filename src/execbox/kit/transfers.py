"""Whole files and directories between this host and a session, and the files a run collects: the operations of
the API (``Sandbox.upload``/``download``, ``collect=``) built on a session's own file calls and the walkers of
execbox.files.transfer."""

from __future__ import annotations

import os
import posixpath
import tarfile
import tempfile
from typing import IO

import anyio

from execbox.contract.backend import Session
from execbox.errors import FileTooLargeError, TransferTooLargeError, WorkspacePathError
from execbox.files import transfer
from execbox.files.transfer import FileInfo, Transfer, TransferLimits, glob_base, glob_regex, host_pack, host_unpack

# A path the runner hands on is relative to the workspace (the session's own file calls, with their fast host side),
# or absolute elsewhere in the sandbox: then the calls run inside it, as its user (files.transfer's helpers), on every
# backend whose exec can run sh.

async def read_path(session: Session, path: str, max_bytes: int) -> bytes:
    if path.startswith("/"):
        return await transfer.sandbox_read(session, path, max_bytes)
    return await session.read_file(path, max_bytes)


async def write_path(session: Session, path: str, data: bytes) -> None:
    if path.startswith("/"):
        await transfer.sandbox_write(session, path, data)
    else:
        await session.write_file(path, data)


async def list_path(session: Session, path: str, *, recursive: bool, limits: TransferLimits) -> list[FileInfo]:
    if path.startswith("/"):
        return await transfer.sandbox_list(session, path, recursive=recursive, limits=limits)
    return await session.list_files(path, recursive=recursive, limits=limits)


async def _unpack(session: Session, path: str, archive: IO[bytes], *, limits: TransferLimits) -> Transfer:
    if path.startswith("/"):
        await transfer.sandbox_unpack(session, path, archive, limits=limits)
        return Transfer()
    return await session.upload(path, archive, limits=limits)


async def _pack(session: Session, path: str, out: IO[bytes], *, limits: TransferLimits) -> Transfer:
    if path.startswith("/"):
        await transfer.sandbox_pack(session, path, out, limits=limits)
        return Transfer()
    return await session.download(path, out, limits=limits)


async def upload_path(session: Session, local: str, remote: str, *, limits: TransferLimits) -> Transfer:
    """Copy the local file or directory ``local`` to ``remote`` in the workspace ("" = the workspace itself; an
    absolute path: anywhere in the sandbox),
    through a temporary tar on this host. Links in the local tree are copied as links, never followed."""
    source = os.path.realpath(local)  # the caller named it: a link given as the path itself is followed
    if not os.path.lexists(source):
        raise WorkspacePathError(f"no such local file or directory: {local!r}")
    parent, base = os.path.split(source)
    prefix = posixpath.basename(remote) if remote else "."
    with tempfile.TemporaryFile(prefix="execbox-upload-") as tmp:
        packed = await anyio.to_thread.run_sync(lambda: host_pack(
            parent or "/", base, tmp, limits=limits, prefix=prefix, what=f"the upload of {local!r}"))
        tmp.seek(0)
        placed = await _unpack(session, remote, tmp, limits=limits)
    packed.skipped.extend(s for s in placed.skipped if s not in packed.skipped)
    return packed


async def pack_workspace(session: Session, out: IO[bytes], *, limits: TransferLimits) -> Transfer:
    """The whole workspace as tar into ``out`` (a snapshot's), through the session's own bounded download: links
    kept as links, never followed."""
    return await session.download("", out, limits=limits)


async def unpack_workspace(session: Session, archive: IO[bytes], *, limits: TransferLimits) -> Transfer:
    """A tar ``pack_workspace`` wrote, into the session's workspace, through its own bounded upload."""
    return await session.upload("", archive, limits=limits)


async def download_path(session: Session, remote: str, local: str, *, limits: TransferLimits) -> Transfer:
    """Copy ``remote`` ("" = the whole workspace) to the local path ``local``: a directory is made or merged into;
    a file is written there, or inside ``local`` when that is an existing directory. Symlinks, hard links,
    devices and FIFOs the code left are not created here: see ``skipped``."""
    target = os.path.abspath(local)
    parent, base = os.path.split(target)
    if not base:
        raise WorkspacePathError(f"download needs a local path to create or fill, not {local!r}")
    os.makedirs(parent, exist_ok=True)
    prefix = posixpath.basename(remote) if remote else "."
    with tempfile.TemporaryFile(prefix="execbox-download-") as tmp:
        packed = await _pack(session, remote, tmp, limits=limits)
        tmp.seek(0)
        if os.path.isdir(target) and not os.path.islink(target) and _first_is_file(tmp):
            parent, base = target, posixpath.basename(remote)  # a file into an existing directory: inside it
        tmp.seek(0)
        placed = await anyio.to_thread.run_sync(lambda: host_unpack(
            parent, base, tmp, limits=limits, prefix=prefix, keep_symlinks=False, workspace=False, shown_as=remote))
    placed.skipped[:0] = packed.skipped  # what the sandbox side left out (FIFOs, unreadable directories)
    return placed


def _first_is_file(archive: IO[bytes]) -> bool:
    try:
        with tarfile.open(fileobj=archive, mode="r|") as tar:
            first = tar.next()
            return first is not None and not first.isdir()
    except tarfile.TarError:
        return False


async def collect(session: Session, patterns: list[str], *, limits: TransferLimits,
                  max_bytes: int) -> tuple[dict[str, bytes], list[str]]:
    """The regular files matching ``patterns`` (``glob_regex``), read with the session's own bounded read: at most
    ``max_bytes`` in all. What is left out (over the cap, a symlink, a missing directory) is said in the notes."""
    files: dict[str, bytes] = {}
    notes: list[str] = []
    regexes = [glob_regex(p) for p in patterns]
    bases = sorted({glob_base(p) for p in patterns})
    roots = [b for b in bases if not any(o != b and (o == "" or b.startswith(o + "/")) for o in bases)]
    seen: list[FileInfo] = []
    for base in roots:
        try:
            seen += await session.list_files(base, recursive=True, limits=limits)
        except (WorkspacePathError, TransferTooLargeError) as exc:
            notes.append(f"collect: {base or '.'}: {exc.message}")
    total = 0
    for entry in sorted(seen, key=lambda e: e.path):
        if not any(r.fullmatch(entry.path) for r in regexes):
            continue
        if entry.type == "symlink":
            notes.append(f"collect: {entry.path} is a symlink: not collected")
            continue
        if entry.type != "file":
            continue
        if total + entry.size > max_bytes:
            notes.append(f"collect: {entry.path} ({entry.size} bytes) left out: the collected files may hold at most "
                         f"{max_bytes} bytes in all (CODE_EXEC_MAX_READ_BYTES)")
            continue
        try:
            data = await session.read_file(entry.path, max_bytes - total)
        except (WorkspacePathError, FileTooLargeError) as exc:
            notes.append(f"collect: {entry.path} left out: {exc.message}")
            continue
        files[entry.path] = data
        total += len(data)
    if not files and not notes:
        notes.append(f"collect: nothing matched {', '.join(patterns)}")
    return files, notes
