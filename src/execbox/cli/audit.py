"""`execbox audit verify` and `execbox audit show`: the audit log's chain checked, its records shown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from execbox.audit import log as audit_log
from execbox.audit import reader as audit_reader
from execbox.cli.common import EXIT_USAGE, fail, load_settings, usage
from execbox.config import paths
from execbox.errors import ConfigError


@click.group("audit")
def audit_group() -> None:
    """The audit log of every run, refusal and sandbox (CODE_EXEC_AUDIT_LOG): verify its chain, show its records."""


def _audit_source(log: str | None, as_json: bool) -> tuple[Path, bytes | None]:
    settings = load_settings(as_json)
    try:
        key = audit_log.AuditLog.from_settings(settings).key
    except ConfigError as exc:
        fail(exc, as_json)
    path = log or settings.audit_log
    if not path or path == paths.OFF:
        usage("the audit log is off (CODE_EXEC_AUDIT_LOG=off): give --log PATH to read one", as_json)
    return Path(path), key


@audit_group.command("verify")
@click.option("--log", help="The log file (default: CODE_EXEC_AUDIT_LOG); its rotated files are read with it.")
@click.option("--json", "as_json", is_flag=True)
def audit_verify(log: str | None, as_json: bool) -> None:
    """Check the whole chain (every rotated file) and the head file; name the first record that was edited,
    removed or reordered, and a log cut short.

    Exits 0 when intact; 1 when tampered or damaged (or there is nothing to verify); 2 when records are HMAC'd
    and no key (CODE_EXEC_AUDIT_KEY or CODE_EXEC_AUDIT_KEY_FILE) was given to check them.
    """
    path, key = _audit_source(log, as_json)
    report = audit_reader.verify(path, key)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        for warning in report.warnings:
            click.echo(f"warning: {warning}", err=True)
        if report.problem:
            click.echo(f"audit log {path}: NOT intact: {report.problem}", err=True)
        elif report.unauthenticated:
            click.echo(f"audit log {path}: {report.records} records chained, but their MACs were NOT checked: set "
                       "CODE_EXEC_AUDIT_KEY or CODE_EXEC_AUDIT_KEY_FILE to the key", err=True)
        else:
            click.echo(f"audit log {path}: intact: {report.records} records in {report.files} file(s), up to seq "
                       f"{report.last_seq}" + (" (HMAC checked)" if key else ""))
    sys.exit(0 if report.ok else 1 if report.problem else EXIT_USAGE)


@audit_group.command("show")
@click.option("--log", help="The log file (default: CODE_EXEC_AUDIT_LOG); its rotated files are read with it.")
@click.option("--session", help="Only the records of this session (one-shot runs have their own).")
@click.option("--since", help="Only records since: an ISO date or time (UTC), or an age (30m, 2h, 7d).")
@click.option("--json", "as_json", is_flag=True, help="The records as JSON Lines, as written.")
def audit_show(log: str | None, session: str | None, since: str | None, as_json: bool) -> None:
    """Print the audit log's records, oldest first (`execbox audit verify` checks they are as written)."""
    path, _ = _audit_source(log, as_json)
    try:
        after = audit_reader.parse_since(since) if since else None
    except ConfigError as exc:
        fail(exc, as_json)
    for rec in audit_reader.records(path, session=session, since=after):
        click.echo(json.dumps(rec, ensure_ascii=False) if as_json else audit_reader.summary(rec))

