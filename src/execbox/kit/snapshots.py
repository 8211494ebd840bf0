"""A backend's part of a snapshot, for the common case: absolute sandbox paths that outlive each exec besides the
workspace (a container's /tmp tmpfs, where HOME and pip's --user packages live), packed and unpacked inside the
sandbox as its user, through the bounded file helpers every exec-capable session has (files.transfer)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from execbox.contract.backend import Session, SessionSpec, SharedSettings
from execbox.contract.snapshots import SnapshotPlace, SnapshotRestore
from execbox.errors import SandboxFileNotFoundError, SnapshotError
from execbox.files import transfer
from execbox.files.transfer import TransferLimits

KEPT = "paths.json"  # the sandbox paths packed, in order: path-N.tar is the N-th


def snapshot_limits(shared: SharedSettings) -> TransferLimits:
    """The bounds of one snapshot's packing: the snapshot store's size, the transfer bounds' entries."""
    return TransferLimits(shared.snapshot_max_bytes, shared.max_transfer_files)


async def restore_sandbox_paths(session: Session, spec: SessionSpec, shared: SharedSettings) -> None:
    """At the end of ``open_session``: the kept paths of the snapshot ``spec`` starts from, if it does."""
    if spec.restore is not None:
        await unpack_sandbox_paths(session, spec.restore, limits=snapshot_limits(shared))


async def pack_sandbox_paths(session: Session, place: SnapshotPlace, paths: Sequence[str], *,
                             limits: TransferLimits) -> None:
    """Each absolute sandbox path in ``paths`` (that exists) as tar into ``place.directory``; links kept as
    links, nothing followed out of the sandbox (it is its own view)."""
    kept: list[str] = []
    for path in paths:
        try:
            listed = await transfer.sandbox_list(session, path, recursive=False, limits=limits)
        except SandboxFileNotFoundError:
            continue
        if not listed:
            continue
        with open(place.directory / f"path-{len(kept)}.tar", "xb") as out:
            await transfer.sandbox_pack(session, path, out, limits=limits, contents=True)
        kept.append(path)
    (place.directory / KEPT).write_text(json.dumps(kept))


async def unpack_sandbox_paths(session: Session, restore: SnapshotRestore, *, limits: TransferLimits) -> None:
    """What ``pack_sandbox_paths`` kept, unpacked at the same paths of a new sandbox (its runner checked the
    snapshot's hash just before)."""
    try:
        kept = json.loads((restore.place.directory / KEPT).read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"snapshot {restore.place.id}: its list of kept paths is unreadable ({exc})") from None
    if not isinstance(kept, list) or not all(isinstance(p, str) and p.startswith("/") for p in kept):
        raise SnapshotError(f"snapshot {restore.place.id}: its list of kept paths is not one execbox wrote")
    for index, path in enumerate(kept):
        with open(restore.place.directory / f"path-{index}.tar", "rb") as archive:
            await transfer.sandbox_unpack(session, path, archive, limits=limits, contents=True)
