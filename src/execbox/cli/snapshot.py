"""`execbox snapshot ls | rm | gc`: the snapshots kept for this user (sb.snapshot(), fork), listed and removed."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from execbox.cli.common import fail, load_settings
from execbox.errors import ExecboxError, SnapshotError
from execbox.runner import AsyncRunner, run_blocking
from execbox.runner import snapshots as store
from execbox.runner.snapshots import Snapshot


@click.group("snapshot")
def snapshot_group() -> None:
    """The snapshots of sandboxes kept for this user (sb.snapshot(), fork): list them, remove them."""


def row(snap: Snapshot, max_age_s: float, now: float) -> dict[str, Any]:
    """One snapshot as `ls --json` prints it."""
    age = max(0.0, now - snap.created.timestamp())
    return {"id": snap.id, "name": snap.name, "backend": snap.backend, "network": snap.network,
            "created": snap.created.isoformat(timespec="seconds"), "age_s": round(age, 1), "size": snap.size,
            "memory": snap.memory, "source": snap.source, "expired": age > max_age_s}


def human_size(size: int) -> str:
    value, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"


def human_age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def kept_summary(snaps: list[Snapshot]) -> str:
    """What is kept, and how to remove it: said after every collection (none removes an unexpired snapshot)."""
    if not snaps:
        return "snapshots: none kept"
    return (f"snapshots: {len(snaps)} kept ({human_size(sum(s.size for s in snaps))}): `execbox snapshot ls` "
            "lists them, `execbox snapshot rm ID` removes one, `execbox snapshot gc` the expired ones")


@snapshot_group.command("ls")
@click.option("--json", "as_json", is_flag=True)
def snapshot_ls(as_json: bool) -> None:
    """List the snapshots kept for this user, oldest first (an expired one is refused, and `gc` removes it)."""
    runner = AsyncRunner(load_settings(as_json))
    try:
        snaps = run_blocking(runner.snapshots)
    except ExecboxError as exc:
        fail(exc, as_json)
    now, max_age = time.time(), runner.settings.snapshot_max_age_sec
    rows = [row(s, max_age, now) for s in snaps]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no snapshots kept for this user")
        return
    table = [("ID", "NAME", "BACKEND", "NETWORK", "CREATED (UTC)", "AGE", "SIZE", "MEMORY", "SOURCE")]
    table += [(r["id"], r["name"] or "-", r["backend"], r["network"], r["created"][:19].replace("T", " "),
               human_age(r["age_s"]) + (" (expired)" if r["expired"] else ""), human_size(r["size"]),
               "yes" if r["memory"] else "no", r["source"] or "-") for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    for line in table:  # the last column (the source) unpadded: it is the long one
        cells = [cell.ljust(width) for cell, width in zip(line[:-1], widths, strict=True)]
        click.echo("  ".join([*cells, line[-1]]))


@snapshot_group.command("rm")
@click.argument("ids", nargs=-1, required=True, metavar="ID...")
@click.option("--json", "as_json", is_flag=True)
def snapshot_rm(ids: tuple[str, ...], as_json: bool) -> None:
    """Remove snapshots by id: their files and what their backend keeps of them. Every id is checked first: an
    unknown one, or one still being written, removes nothing."""
    runner = AsyncRunner(load_settings(as_json))
    try:
        for snapshot_id in ids:
            if store.backend_of(snapshot_id) is None:  # also refuses what is not an id (`../x`, "")
                raise SnapshotError(f"no snapshot {snapshot_id} here (removed, or expired and collected): nothing "
                                    "was removed; `execbox snapshot ls` lists them")
            store.refuse_if_being_written(snapshot_id)
        removed: list[str] = []

        async def go() -> None:
            for snapshot_id in dict.fromkeys(ids):
                await runner.delete_snapshot(snapshot_id)
                removed.append(snapshot_id)

        run_blocking(go)
    except ExecboxError as exc:
        fail(exc, as_json)
    if as_json:
        click.echo(json.dumps({"removed": removed}))
        return
    for snapshot_id in removed:
        click.echo(f"removed {snapshot_id}")


@snapshot_group.command("gc")
@click.option("--json", "as_json", is_flag=True)
def snapshot_gc(as_json: bool) -> None:
    """Remove the snapshots past CODE_EXEC_SNAPSHOT_MAX_AGE_SEC and those whose writer died before finishing them."""
    runner = AsyncRunner(load_settings(as_json))
    try:
        removed = run_blocking(runner.gc_snapshots)
        kept = run_blocking(runner.snapshots)
    except ExecboxError as exc:
        fail(exc, as_json)
    if as_json:
        click.echo(json.dumps({"removed": removed, "kept": len(kept)}))
        return
    click.echo(f"snapshots: removed {len(removed)}" + (f": {', '.join(removed)}" if removed else ""))
    click.echo(kept_summary(kept))
