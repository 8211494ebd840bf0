"""`execbox serve`: execbox kept loaded, running the command lines the `execbox` program hands it on a socket."""

from __future__ import annotations

import contextlib
import os

import click

from execbox.cli.common import fail, load_settings, usage
from execbox.config.settings import Settings
from execbox.errors import ConfigError
from execbox.registry import get_registry


@click.command()
@click.option("--socket", "socket_path", metavar="PATH", help="Where to listen (default: CODE_EXEC_SERVER).")
def serve(socket_path: str | None) -> None:
    """Keep execbox loaded and run the `execbox` command lines handed to it on a local socket (opt-in).

    With CODE_EXEC_SERVER naming the socket, the `execbox` program forks each command line from this process
    instead of starting Python and importing execbox anew: same output, exit status, streams, working directory
    and environment, ~0.3 s sooner. Only this user's command lines are served. Ends on SIGTERM, SIGINT or SIGHUP.

    \b
    export CODE_EXEC_SERVER=$XDG_RUNTIME_DIR/execbox.sock
    execbox serve &
    execbox run -- echo hi
    """
    from execbox import resident, resident_server

    settings = load_settings(False)
    path = socket_path or (str(settings.server) if settings.server else None)
    if not path:
        usage(f"give --socket PATH, or set {resident.SERVER_VAR}", False)
    _preload(settings)
    try:
        resident_server.serve(path, _run_command_line, ready=lambda: click.echo(
            f"execbox serve: listening on {path} (pid {os.getpid()}); command lines run here when "
            f"{resident.SERVER_VAR}={path}", err=True))
    except resident_server.ServeError as exc:
        fail(ConfigError(str(exc), env_var=resident.SERVER_VAR), False)


def _preload(settings: Settings) -> None:
    """Import what a command line's first run imports: every backend's module and installed SDK, and anyio's
    event loop. Nothing is started or connected: the children forked afterwards share no thread or socket."""
    import importlib

    importlib.import_module("anyio._backends._asyncio")
    from execbox.cli import load_builtin_commands

    load_builtin_commands()
    for entry in get_registry(settings.load_plugins, settings.disable_plugins).backends.values():
        sdk = entry.cls.sdk
        with contextlib.suppress(Exception):  # a missing or broken SDK is the backend's own error, at first use
            if sdk:
                importlib.import_module(sdk)


def _run_command_line(argv: list[str]) -> object:
    """One command line in a child of `execbox serve`: as `execbox ARGV...` would run it."""
    from execbox.cli import main  # the whole command line, this command among the others

    return main.main(args=argv, prog_name="execbox")

