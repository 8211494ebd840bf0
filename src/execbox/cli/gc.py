"""`execbox gc`: remove the expired and orphaned sandboxes execbox created, each backend's gc under a bound, and
the expired or half-written snapshots (never one still in date: `execbox snapshot rm` removes those)."""

from __future__ import annotations

import json
from typing import Any

import click

from execbox.cli.common import fail, load_settings
from execbox.cli.snapshot import kept_summary
from execbox.contract.backend import bounded
from execbox.errors import BackendUnavailableError, ConfigError, ExecboxError
from execbox.runner import AsyncRunner, live, run_blocking
from execbox.runner.snapshots import Snapshot


@click.command()
@click.option("--backend", "only", help="Only this backend.")
@click.option("--json", "as_json", is_flag=True)
def gc(only: str | None, as_json: bool) -> None:
    """Remove expired and orphaned sandboxes that execbox created (never another program's), and expired or
    half-written snapshots; say how many snapshots are kept."""
    runner = AsyncRunner(load_settings(as_json))
    if only:
        try:
            runner.registry.get(only)
        except ConfigError as exc:
            fail(exc, as_json)
    names = [only] if only else runner.registry.names()
    removed: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    snapshots: dict[str, Any] = {"removed": [], "kept": 0}
    kept: list[Snapshot] = []

    async def go() -> None:
        for name in names:
            try:
                # No check() first: a backend's own start-up sweep would remove the orphans before gc counts them.
                backend = runner.backend(name)
                backend.require_sdk()
                # Bounded as an open is (CODE_EXEC_OPEN_TIMEOUT_SEC): a gc that never returns is skipped, said.
                removed[name] = await bounded(backend.gc(), backend.shared.open_timeout_sec, backend=backend,
                                              doing="gc")
            except BackendUnavailableError as exc:
                skipped[name] = exc.reason
            except ExecboxError as exc:  # e.g. a backend setting is invalid: that backend only
                skipped[name] = exc.message
        if not only:  # the records of `execbox ps` whose owner is gone (the backends' gc removed their sandboxes)
            removed["live records"] = live.sweep_stale()
        try:
            snapshots["removed"] = await runner.gc_snapshots(only)
        except ExecboxError as exc:  # a snapshot whose backend cannot remove its part: kept, said
            snapshots["skipped"] = exc.message
        kept[:] = [s for s in await runner.snapshots() if only in (None, s.backend)]
        snapshots["kept"] = len(kept)

    try:
        run_blocking(go)
    except ExecboxError as exc:
        fail(exc, as_json)
    for name, ids in removed.items():
        if ids:
            note = runner.audit.record("gc", backend=name, removed=ids)
            if note:
                click.echo(f"execbox: note: {note}", err=True)
    if as_json:
        click.echo(json.dumps({"removed": removed, "skipped": skipped, "snapshots": snapshots}))
        return
    for name, ids in removed.items():
        click.echo(f"{name}: removed {len(ids)}" + (f": {', '.join(ids)}" if ids else ""))
    gone = snapshots["removed"]
    if gone:
        click.echo(f"snapshots: removed {len(gone)} expired or half-written: {', '.join(gone)}")
    if "skipped" in snapshots:
        click.echo(f"snapshots: not all removed: {snapshots['skipped']}", err=True)
    click.echo(kept_summary(kept))
    if only and only in skipped:
        click.echo(f"{only}: not available here: {skipped[only]}", err=True)

