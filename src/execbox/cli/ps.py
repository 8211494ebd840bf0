"""`execbox ps`: the live sandboxes of this user on this host, whatever process and backend holds them; `execbox kill
ID`: end one through its backend (audited). Both read the runner's records (execbox.runner.live), checked against
what the backends find by their ownership labels or files (AsyncRunner.sandboxes)."""

from __future__ import annotations

import json
from typing import Any

import click

from execbox.cli.common import fail, load_settings
from execbox.errors import ExecboxError
from execbox.runner import AsyncRunner, run_blocking

#: What `--json` gives of a record (the kill_ref is the backend's business).
FIELDS = ("id", "kind", "backend", "pid", "name", "network", "limits", "created", "deadline", "age_s", "left_s",
          "running", "pooled", "killed")


def _duration(seconds: float | None) -> str:
    if seconds is None:  # an orphan's, or an unrecorded one's: its backend's labels or files do not say
        return "-"
    s = max(int(seconds), 0)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _limits(limits: Any) -> str:
    if not isinstance(limits, dict):
        return "-"
    short = {"memory_mb": "mem={}M", "cpus": "cpus={}", "pids": "pids={}", "disk_mb": "disk={}M"}
    return ",".join(form.format(limits[key]) for key, form in short.items() if limits.get(key) is not None) or "-"


@click.command()
@click.option("--json", "as_json", is_flag=True)
def ps(as_json: bool) -> None:
    """List the live sandboxes of this user on this host, across processes and backends: kind (a sandbox, a
    warm-pool member, a one-shot run's; an orphan, whose owner is gone, or an unrecorded one, found by its
    backend's ownership labels or files), owner pid, backend, network and limits, age, time left (to its
    lifetime's end; a one-shot's: to its timeout), what runs (argv[0] only, or idle)."""
    runner = AsyncRunner(load_settings(as_json))

    async def go() -> tuple[list[dict[str, Any]], dict[str, str]]:
        try:
            return await runner.sandboxes()
        finally:
            await runner.aclose()

    try:
        records, unanswered = run_blocking(go)
    except ExecboxError as exc:
        fail(exc, as_json)
    if as_json:
        click.echo(json.dumps({"sandboxes": [{k: r.get(k) for k in FIELDS} for r in records],
                               "unanswered": unanswered}))
        return
    rows = [("ID", "KIND", "BACKEND", "PID", "NETWORK", "LIMITS", "AGE", "LEFT", "RUNNING")]
    for r in records:
        rows.append((str(r["id"]), str(r["kind"]), str(r.get("backend")), str(r.get("pid") or "-"),
                     str(r.get("network") or "-"), _limits(r.get("limits")), _duration(r.get("age_s")),
                     _duration(r.get("left_s")), "(killed)" if r["killed"] else str(r.get("running") or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    for name, why in sorted(unanswered.items()):
        click.echo(f"execbox: {name} did not say which sandboxes it has ({why}): its records are listed as they "
                   "are", err=True)


@click.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True)
def kill(sandbox_id: str, as_json: bool) -> None:
    """End the live sandbox SANDBOX_ID (from `execbox ps`) through its backend, whichever process holds it; its
    owner's next call on it fails with a SandboxError that says so. Audited (sandbox.kill)."""
    runner = AsyncRunner(load_settings(as_json))

    async def go() -> dict[str, Any]:
        try:
            return await runner.kill(sandbox_id)
        finally:
            await runner.aclose()

    try:
        record = run_blocking(go)
    except ExecboxError as exc:
        fail(exc, as_json)
    if as_json:
        click.echo(json.dumps({"killed": sandbox_id, "backend": record.get("backend"), "pid": record.get("pid")}))
    else:
        click.echo(f"killed {sandbox_id} ({record.get('backend')}, held by pid {record.get('pid')})")
