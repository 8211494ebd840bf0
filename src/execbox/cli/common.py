"""What every command shares: exit codes, and errors reported as text or JSON.

Exit status of `execbox run`: the command's own; 124 if it timed out; 125 if the guard or the policy
refused; 126 if the backend is unavailable; 2 for a usage or configuration error. Every other command
exits with the same codes for the same errors.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import NoReturn

import click

from execbox.config.settings import Settings
from execbox.errors import (
    BackendUnavailableError,
    ConfigError,
    ExecboxError,
    RefusedError,
    WorkspacePathError,
)
from execbox.telemetry import OTLP_PACKAGES, export_from_cli

EXIT_TIMEOUT, EXIT_REFUSED, EXIT_UNAVAILABLE, EXIT_USAGE = 124, 125, 126, 2


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def stop_signals_interrupt() -> None:
    """SIGTERM (timeout(1), systemd, kubernetes) and SIGHUP (a closed terminal or ssh session) clean up like Ctrl-C:
    a KeyboardInterrupt, on whose way out every sandbox of the command is removed."""
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, _interrupt)


def exit_code(exc: ExecboxError) -> int:
    """The exit status an error ends a command with."""
    if isinstance(exc, RefusedError):
        return EXIT_REFUSED
    if isinstance(exc, BackendUnavailableError):
        return EXIT_UNAVAILABLE
    if isinstance(exc, (ConfigError, WorkspacePathError)):
        return EXIT_USAGE
    return 1


def fail(exc: ExecboxError, as_json: bool) -> NoReturn:
    """End the command with ``exc``: ``{"error": ...}`` on stdout with --json, else one line on stderr."""
    if as_json:
        click.echo(json.dumps({"error": exc.to_dict()}))
    else:
        click.echo(f"execbox: {type(exc).__name__}: {exc.message}", err=True)
    sys.exit(exit_code(exc))


def usage(message: str, as_json: bool) -> NoReturn:
    """End the command with a usage error (status 2): click's own message, or with --json one JSON object."""
    if as_json:
        click.echo(json.dumps({"error": {"type": "UsageError", "message": message, "retryable": False,
                                         "backend": None, "env_var": None}}))
        sys.exit(EXIT_USAGE)
    raise click.UsageError(message)


def load_settings(as_json: bool) -> Settings:
    """The settings from the environment; one that is invalid ends the command."""
    try:
        return Settings.from_env()
    except ConfigError as exc:
        fail(exc, as_json)


def otlp_missing(exc: ModuleNotFoundError) -> BackendUnavailableError:
    """OTEL_EXPORTER_OTLP_* is set and what exports over OTLP is not installed: what to install."""
    return BackendUnavailableError(f"OTEL_EXPORTER_OTLP_* is set, and exporting over OTLP needs {exc.name}, which is "
                                   "not installed", fix=f"pip install {OTLP_PACKAGES}")


def export_telemetry() -> None:
    """A command that runs code: its spans and metrics over OTLP when OTEL_EXPORTER_OTLP_* is set, under the caller's
    trace when TRACEPARENT names one (telemetry.export_from_cli); nothing imported when neither is set. Without the
    exporter installed, a note and the command goes on: a variable set for other programs must not stop every run
    (a server, which starts once, refuses instead)."""
    try:
        export_from_cli(os.environ)
    except ModuleNotFoundError as exc:
        missing = otlp_missing(exc)
        click.echo(f"execbox: note: {missing.reason}; this command is not exported. Fix: {missing.fix}", err=True)
