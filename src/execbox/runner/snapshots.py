"""The snapshot store: each snapshot a private directory under execbox's own state, with a manifest that names its
backend, configuration and content hash. What the code wrote is in it, secrets it was given included: the store is
0700, one of the places a mount or an upload never reaches (AsyncRunner.state_places), and bounded in total size
(CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB) and age (CODE_EXEC_SNAPSHOT_MAX_AGE_SEC).

Every read of a snapshot re-hashes what is on disk: a corrupted or truncated snapshot is refused whole. Walking the
directory never follows a link and refuses anything but plain files and directories, bounded in entries and depth.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from execbox.config import paths
from execbox.config.settings import Settings
from execbox.contract.models import Limits, NetworkMode
from execbox.contract.snapshots import SnapshotParts, SnapshotPlace
from execbox.errors import SnapshotError, TransferTooLargeError
from execbox.files.transfer import TransferLimits
from execbox.files.workspace import remove_tree

MANIFEST = "manifest.json"
DATA = "data"  # the backend's part (SnapshotPlace.directory)
WORKSPACE = "workspace.tar"  # the runner's part: the workspace, packed by the session's own bounded download
WRITER = "writer"  # pid and start time of the process writing it, until the manifest is in place
BACKEND = "backend"  # its backend's name, from the start: a half-written one's refs are removed through it
# Why no backend here keeps processes, measured on this project's machine (README "Snapshots").
NO_MEMORY = ("No backend here keeps processes: gVisor's runsc 20221219 restores a checkpoint only while no process "
             "holds a connection to the host, which a run_cell interpreter does, and Docker's checkpoint needs "
             "CRIU and an experimental engine (README, Snapshots)")
_MAX_ENTRIES = 1_000_000
_MAX_DEPTH = 256
_ID_CHARS = set("0123456789abcdef")


class Snapshot(BaseModel):
    """A sandbox's state, kept by execbox: start sandboxes from it (``runner.sandbox(from_snapshot=snap)``), roll
    back to it (``sb.rollback(snap)``), list them (``runner.snapshots()``), remove one (``runner.delete_snapshot``).
    What the snapshot holds is on disk under execbox's private state; this object only names it."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str | None = None
    backend: str
    network: NetworkMode
    #: The limits the sandbox was asked to have (None: the settings' defaults, as they are when it is restored).
    limits: Limits | None = None
    created: datetime
    #: Bytes it keeps: its files and what the backend keeps outside them (an engine image's layer).
    size: int
    #: Processes and their memory are in it, not only files.
    memory: bool
    #: The image or recipe the sandbox came from.
    source: str
    #: SHA-256 over its files and the backend's refs: checked before every restore.
    content_hash: str
    #: The sandbox it was taken of (its audit id); rollback takes only a snapshot of the same sandbox's line.
    origin: str
    refs: dict[str, str] = {}
    #: Bytes of its files (the rest of ``size`` is kept by the backend, outside them).
    files_size: int = 0

    @property
    def parts(self) -> SnapshotParts:
        return SnapshotParts(memory=self.memory, source=self.source, refs=dict(self.refs),
                             outside_bytes=self.size - self.files_size)


def root() -> Path:
    """$XDG_STATE_HOME/execbox/snapshots (execbox's private state, never a sandbox's)."""
    return paths.state_dir() / "snapshots"


def place_of(snapshot_id: str) -> SnapshotPlace:
    return SnapshotPlace(snapshot_id, _directory(snapshot_id) / DATA)


def _directory(snapshot_id: str) -> Path:
    if not (8 <= len(snapshot_id) <= 64 and set(snapshot_id) <= _ID_CHARS):
        raise SnapshotError(f"{snapshot_id[:80]!r} is not a snapshot id (hex digits, as `execbox snapshot ls` shows)")
    return root() / snapshot_id


def new_place(backend: str) -> SnapshotPlace:
    """A new snapshot's empty private directory (0700), marked as being written by this process."""
    base = root()
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(base, 0o700)
    snapshot_id = secrets.token_hex(8)
    directory = base / snapshot_id
    directory.mkdir(mode=0o700)
    (directory / WRITER).write_text(_me())
    (directory / BACKEND).write_text(backend)
    (directory / DATA).mkdir(mode=0o700)
    return SnapshotPlace(snapshot_id, directory / DATA)


def workspace_of(snapshot_id: str) -> Path:
    """Where the runner keeps a snapshot's packed workspace."""
    return _directory(snapshot_id) / WORKSPACE


def limits(transfer_limits: TransferLimits, max_bytes: int) -> TransferLimits:
    """The bounds of packing or unpacking a snapshot's workspace: the transfer bounds' entries and depth, but
    ``max_bytes`` (a workspace larger than a download may be is what snapshots are for)."""
    return TransferLimits(max(max_bytes, 1), transfer_limits.max_entries, transfer_limits.max_depth)


def room_left(settings: Settings) -> int:
    """Bytes the store's bound leaves for a new snapshot."""
    return (settings.snapshot_max_total_mb << 20) - sum(s.size for s in listing())


@contextlib.contextmanager
def over_the_bound(settings: Settings) -> Iterator[None]:
    """A snapshot's packing past its bytes is the store's bound, not a download's: say that one (past its entries
    or its depth, the transfer's own words hold)."""
    try:
        yield
    except TransferTooLargeError as exc:
        if exc.env_var != "CODE_EXEC_MAX_TRANSFER_BYTES":
            raise SnapshotError(f"the sandbox cannot be kept: {exc.message}", env_var=exc.env_var) from exc
        raise SnapshotError(
            f"the sandbox holds more than a snapshot may keep: CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB "
            f"({settings.snapshot_max_total_mb} MiB) bounds all snapshots together, what is kept already included. "
            "Remove some (`execbox snapshot rm`), keep less in the sandbox, or raise it",
            env_var="CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB") from exc


def backend_of(snapshot_id: str) -> str | None:
    """The backend a snapshot (finished or not) was taken on, as it was written down when it began."""
    try:
        return (_directory(snapshot_id) / BACKEND).read_text().strip() or None
    except OSError:
        return None


def _me() -> str:
    return f"{os.getpid()} {_started(os.getpid())}"


def _started(pid: int) -> str:
    """The process's start time (field 22 of /proc/PID/stat): a pid reused by another process does not match."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "gone"


def _writer_alive(directory: Path) -> bool:
    try:
        pid, started = (directory / WRITER).read_text().split()
        return _started(int(pid)) == started
    except (OSError, ValueError):
        return False


def content_hash(directory: Path, refs: dict[str, str]) -> tuple[str, int]:
    """(SHA-256 over every file below ``directory`` and ``refs``, bytes of files): each file's relative path, size
    and content in path order. A link, a device or a FIFO is refused, never followed; so is a tree past the
    store's entry and depth bounds."""
    digest = hashlib.sha256(json.dumps(sorted(refs.items())).encode())
    total = 0
    for rel, fd in _files(directory):
        with os.fdopen(fd, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            digest.update(f"\0{rel}\0{size}\0".encode())
            total += size
            while chunk := file.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest(), total


def _files(directory: Path) -> Iterator[tuple[str, int]]:
    """(relative path, open descriptor) of each plain file below ``directory``, sorted; nothing is followed."""
    seen = 0

    def walk(fd: int, prefix: str, depth: int) -> Iterator[tuple[str, int]]:
        nonlocal seen
        if depth > _MAX_DEPTH:
            raise SnapshotError(f"the snapshot's tree is deeper than {_MAX_DEPTH} levels: not a snapshot execbox wrote")
        for name in sorted(os.listdir(fd)):
            seen += 1
            if seen > _MAX_ENTRIES:
                raise SnapshotError(f"the snapshot holds more than {_MAX_ENTRIES} entries")
            rel = f"{prefix}{name}"
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                try:
                    yield from walk(child, rel + "/", depth + 1)
                finally:
                    os.close(child)
            elif stat.S_ISREG(st.st_mode):
                yield rel, os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
            else:
                raise SnapshotError(f"the snapshot holds {rel!r}, which is not a plain file: refused")

    top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        yield from walk(top, "", 0)
    finally:
        os.close(top)


def seal(place: SnapshotPlace, *, name: str | None, backend: str, network: NetworkMode, limits: Limits | None,
         parts: SnapshotParts, origin: str, max_total_bytes: int) -> Snapshot:
    """Hash what was written, check the store's size bound (a snapshot past it is removed: SnapshotError) and
    write the manifest: from then on the snapshot exists."""
    directory = place.directory.parent
    refs = dict(parts.refs)
    digest, files_size = content_hash(directory / DATA, refs)
    workspace = directory / WORKSPACE
    digest, files_size = _with_workspace(digest, files_size, workspace)
    snapshot = Snapshot(id=place.id, name=name, backend=backend, network=network, limits=limits,
                        created=datetime.now(timezone.utc), size=files_size + parts.outside_bytes,
                        files_size=files_size, memory=parts.memory, source=parts.source, content_hash=digest,
                        origin=origin, refs=refs)
    others = sum(s.size for s in listing() if s.id != place.id)
    if others + snapshot.size > max_total_bytes:
        raise SnapshotError(
            f"this snapshot ({snapshot.size >> 20} MiB) would take the snapshots of this user past their bound of "
            f"{max_total_bytes >> 20} MiB ({others >> 20} MiB kept already): it was not kept. Remove some "
            "(`execbox snapshot rm ID`, `execbox snapshot gc`) or raise CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB",
            env_var="CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB")
    manifest = directory / (MANIFEST + ".new")
    manifest.write_text(snapshot.model_dump_json())
    os.replace(manifest, directory / MANIFEST)
    with contextlib.suppress(FileNotFoundError):
        (directory / WRITER).unlink()
    return snapshot


def _with_workspace(digest: str, files_size: int, workspace: Path) -> tuple[str, int]:
    """The content hash with the packed workspace folded in (it sits beside the backend's part)."""
    whole = hashlib.sha256(digest.encode())
    fd = os.open(workspace, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise SnapshotError("the snapshot's workspace is not a plain file: refused")
        while chunk := file.read(1 << 20):
            whole.update(chunk)
            files_size += len(chunk)
    return whole.hexdigest(), files_size


def load(snapshot_id: str, *, max_age_s: float, check: bool = True) -> Snapshot:
    """The snapshot ``snapshot_id`` as its manifest says, its content checked against the manifest's hash (with
    ``check``): SnapshotError when it is unknown, expired, half-written, or no longer what was written."""
    directory = _directory(snapshot_id)
    try:
        snapshot = Snapshot.model_validate_json((directory / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot {snapshot_id} here (removed, expired and collected, or never "
                            "finished): `execbox snapshot ls` lists them") from None
    except (OSError, ValidationError, ValueError) as exc:
        raise SnapshotError(f"snapshot {snapshot_id}: its manifest is unreadable ({type(exc).__name__}): "
                            "refused; remove it with `execbox snapshot rm`") from None
    if snapshot.id != snapshot_id:
        raise SnapshotError(f"snapshot {snapshot_id}: its manifest names another snapshot: refused")
    age = time.time() - snapshot.created.timestamp()
    if age > max_age_s:
        raise SnapshotError(f"snapshot {snapshot_id} is {age / 86400:.1f} days old, past "
                            f"CODE_EXEC_SNAPSHOT_MAX_AGE_SEC ({max_age_s:g} s): refused; `execbox snapshot gc` "
                            "removes it", env_var="CODE_EXEC_SNAPSHOT_MAX_AGE_SEC")
    if check:
        try:
            digest, size = content_hash(directory / DATA, dict(snapshot.refs))
            digest, size = _with_workspace(digest, size, directory / WORKSPACE)
        except OSError as exc:
            raise SnapshotError(f"snapshot {snapshot_id} is incomplete ({exc.strerror or exc}): refused whole, "
                                "nothing restored") from None
        if (digest, size) != (snapshot.content_hash, snapshot.files_size):
            raise SnapshotError(f"snapshot {snapshot_id} is not what was written (corrupted or truncated: its "
                                "content hash differs): refused whole, nothing restored; remove it with "
                                "`execbox snapshot rm`")
    return snapshot


def listing() -> list[Snapshot]:
    """Every finished snapshot of this user, oldest first (unchecked: `load` checks one before it is used)."""
    found = []
    for directory in _directories():
        with contextlib.suppress(SnapshotError):
            found.append(load(directory.name, max_age_s=float("inf"), check=False))
    return sorted(found, key=lambda s: s.created)


def _directories() -> list[Path]:
    try:
        return [d for d in root().iterdir() if d.is_dir() and not d.is_symlink() and set(d.name) <= _ID_CHARS]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SnapshotError(f"cannot read the snapshot store {root()}: {exc.strerror or exc}") from None


def refuse_if_being_written(snapshot_id: str) -> None:
    """SnapshotError when a live process is still writing this snapshot (no manifest yet, its writer alive): its
    writer would go on writing into a directory being removed, and then seal what is left."""
    directory = _directory(snapshot_id)
    if not (directory / MANIFEST).exists() and _writer_alive(directory):
        raise SnapshotError(f"snapshot {snapshot_id} is still being written by a live process: nothing removed; "
                            "remove it once it is finished (if its writer dies first, `execbox snapshot gc` "
                            "removes it)")


def leftovers() -> list[str]:
    """Ids of snapshots nobody is writing and nobody will finish: their writer died before the manifest."""
    return [d.name for d in _directories()
            if not (d / MANIFEST).exists() and not _writer_alive(d)]


def expired(max_age_s: float) -> list[Snapshot]:
    return [s for s in listing() if time.time() - s.created.timestamp() > max_age_s]


def read_refs(snapshot_id: str) -> SnapshotParts | None:
    """What the backend reported for a snapshot, when its manifest is readable (to remove what it keeps outside)."""
    with contextlib.suppress(SnapshotError):
        return load(snapshot_id, max_age_s=float("inf"), check=False).parts
    return None


def remove(snapshot_id: str) -> None:
    """The snapshot's directory, gone (links in it removed, never followed)."""
    remove_tree(str(_directory(snapshot_id)))
