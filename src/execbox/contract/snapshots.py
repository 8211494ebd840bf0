"""What a backend implements to snapshot a sandbox, and what it is handed to start one from a snapshot.

The runner owns everything around it: the snapshot's id, its private directory (0700, under execbox's own state,
which the guard never lets a sandbox reach), the manifest with the content hash, the size and age bounds, the
audit records, re-judging a restore under today's settings, fork and rollback, and the workspace: it packs the
workspace into the snapshot through the session's own bounded file calls and unpacks it into the restored sandbox.
A backend writes what the code changed outside the workspace (``Session.snapshot``: an engine image of the
container's changes, say; nothing, where only the workspace is writable) and opens a sandbox from it
(``SessionSpec.restore``); what it keeps outside the directory (an engine image, a remote provider's snapshot) it
names in ``SnapshotParts.refs`` and removes in ``ExecutionBackend.delete_snapshot``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SnapshotPlace:
    """One snapshot's id and its private directory (made by the runner, empty, 0700). A backend may write
    anything below it; the runner hashes every file there into the snapshot's content hash and refuses a
    restore when the hash no longer matches (a corrupted or truncated snapshot is never restored half-way)."""

    id: str
    directory: Path


@dataclass(frozen=True)
class SnapshotParts:
    """What a backend reports after writing a snapshot."""

    #: Processes and their memory are in it (``memory=True`` was asked and the backend can).
    memory: bool
    #: The image or recipe the sandbox came from (an image name and digest, a root filesystem's id).
    source: str
    #: What the backend keeps outside the directory, by a name of its own (``{"image": "sha256:..."}``): part of
    #: the content hash, handed back to ``open_session`` (in ``SnapshotRestore``) and to ``delete_snapshot``.
    refs: Mapping[str, str] = field(default_factory=dict)
    #: Bytes the refs hold on this host (an engine image's own layer), counted against the snapshot store's bound.
    outside_bytes: int = 0


@dataclass(frozen=True)
class SnapshotRestore:
    """What ``open_session`` is handed, in ``SessionSpec.restore``, to start a sandbox in a snapshot's state: the
    snapshot's place (checked against its hash just before) and what the backend reported when it made it."""

    place: SnapshotPlace
    parts: SnapshotParts
