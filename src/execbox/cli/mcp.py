"""`execbox mcp`: execbox served to agents over the Model Context Protocol (stdio, or streamable HTTP)."""

from __future__ import annotations

import functools
import os

import anyio
import click

from execbox.cli.common import fail, otlp_missing, usage
from execbox.config.settings import Settings
from execbox.errors import BackendUnavailableError, ExecboxError
from execbox.telemetry import PROMETHEUS_FIX, export, flush


@click.command("mcp")
@click.option("--http", "http", metavar="HOST:PORT",
              help="Serve streamable HTTP on HOST:PORT (PORT alone: 127.0.0.1) instead of stdio; needs a token.")
@click.option("--token-file", type=click.Path(dir_okay=False), help="File holding the HTTP bearer token "
              "(instead of EXECBOX_MCP_TOKEN).")
def mcp_command(http: str | None, token_file: str | None) -> None:
    """Serve execbox to agents over the Model Context Protocol (stdio by default).

    \b
    CODE_EXEC_ENABLED=true execbox mcp                       # stdio, for an MCP client's config
    EXECBOX_MCP_TOKEN=... execbox mcp --http 127.0.0.1:8765  # streamable HTTP at /mcp
    """
    import importlib.util

    if importlib.util.find_spec("mcp") is None:
        fail(BackendUnavailableError("the MCP server needs the mcp SDK, which is not installed",
                                      fix="pip install 'execbox[mcp]'"), False)
    from execbox.mcp.server import METRICS_PATH, OFF, McpApp, serve_http, serve_stdio, server_token
    from execbox.mcp.settings import McpSettings

    def ready(app: McpApp, *lines: str) -> None:
        """Said once the server has accepted its settings (and bound its port): never before a refusal."""
        if not app.tools:
            click.echo(f"execbox mcp: {OFF}", err=True)
        for line in lines:
            click.echo(f"execbox mcp: {line}", err=True)

    try:
        # OTEL_EXPORTER_OTLP_*: this server's spans and metrics, over OTLP; over HTTP, its metrics at /metrics too
        exporting = export(os.environ, prometheus=http is not None)
    except ModuleNotFoundError as exc:
        fail(otlp_missing(exc), False)
    try:
        settings, mcp_settings = Settings.from_env(), McpSettings.from_env()
        if http is None:
            anyio.run(functools.partial(serve_stdio, settings, mcp_settings, ready=ready))
            return
        host, _, port = http.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            usage(f"--http takes HOST:PORT (or PORT), got {http!r}", False)
        token = server_token(mcp_settings, token_file)
        host = host.strip("[]") or "127.0.0.1"
        lines = []
        if host not in ("127.0.0.1", "localhost", "::1"):
            lines.append(f"listening on {host}, beyond this machine: every request needs the token; put TLS in "
                         "front of it")
        shown = f"[{host}]" if ":" in host else host
        lines.append(f"serving http://{shown}:{port}/mcp")
        if exporting is not None and exporting.registry is not None:
            lines.append(f"serving metrics at http://{shown}:{port}{METRICS_PATH} (Prometheus text format; the "
                         "server token)")
        else:
            missing = exporting.missing if exporting is not None else None
            lines.append(f"no metrics at {METRICS_PATH}: the Prometheus reader is not installed ({missing}); "
                         f"{PROMETHEUS_FIX}")
        anyio.run(functools.partial(serve_http, settings, mcp_settings, host, int(port), token,
                                    ready=lambda app: ready(app, *lines), exporting=exporting))
    except ExecboxError as exc:
        fail(exc, False)
    finally:
        if exporting is not None:
            flush(exporting)  # what is still pending goes out before the process ends (bounded)
