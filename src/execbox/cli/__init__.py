"""The execbox command line: one module per command group (run; backends and doctor; gc; snapshot; audit; serve;
mcp; ps and kill), what they share in ``common`` (exit codes, errors as text or JSON), and the commands backend
plugins add through the hook ``execbox_register_commands`` (``execbox image build`` is the docker backend's).

Exit status of `execbox run`: the command's own; 124 if it timed out; 125 if the guard or the policy
refused; 126 if the backend is unavailable; 2 for a usage or configuration error.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import click

from execbox.cli.common import fail
from execbox.config.settings import Settings
from execbox.errors import ConfigError, ExecboxError
from execbox.registry import get_registry

__all__ = ["BUILTIN_COMMANDS", "load_builtin_commands", "main"]

#: execbox's own commands, each in the module of its group (``module:attribute`` under execbox.cli).
BUILTIN_COMMANDS = {"run": "run:run", "backends": "doctor:backends", "doctor": "doctor:doctor", "gc": "gc:gc",
                    "audit": "audit:audit_group", "serve": "serve:serve", "mcp": "mcp:mcp_command",
                    "batch": "batch:batch", "snapshot": "snapshot:snapshot_group", "ps": "ps:ps", "kill": "ps:kill"}


class ExecboxGroup(click.Group):
    """execbox's own commands, each imported when a command line names it (`execbox run` imports no other group's
    module); the plugins' commands, loaded only when a command line names a command execbox does not have or the
    commands are listed (--help)."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in BUILTIN_COMMANDS:
            return self._builtin(cmd_name)
        commands, problem = _plugin_commands(set(BUILTIN_COMMANDS))
        if cmd_name not in commands and problem is not None:
            fail(problem, False)  # which plugins to load is unknown: say why rather than "no such command"
        return commands.get(cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*BUILTIN_COMMANDS, *_plugin_commands(set(BUILTIN_COMMANDS))[0]})

    def _builtin(self, name: str) -> click.Command:
        if name not in self.commands:
            module, attribute = BUILTIN_COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(f"execbox.cli.{module}"), attribute), name)
        return self.commands[name]


def load_builtin_commands() -> None:
    """Import every command of execbox's own (`execbox serve` does, before it forks a child per command line)."""
    for name in BUILTIN_COMMANDS:
        main._builtin(name)


def _plugin_commands(taken: set[str]) -> tuple[dict[str, click.Command], ConfigError | None]:
    """The plugins' commands for this environment's plugin selection, each reporting an ExecboxError as execbox's
    own commands do. With settings that do not validate, only the built-in backends' commands, and the error."""
    try:
        settings = Settings.from_env()
        registry, problem = get_registry(settings.load_plugins, settings.disable_plugins), None
    except ConfigError as exc:
        registry, problem = get_registry([]), exc  # no third-party plugin: the built-in ones only
    commands = registry.commands(taken)
    for command in commands.values():
        _report_errors(command)
    return commands, problem


def _report_errors(command: click.Command) -> None:
    """Have ``command`` (and, for a group, each of its commands) end with ``fail`` on an ExecboxError: JSON when its
    ``--json`` flag is set."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _report_errors(sub)
    callback = command.callback
    if callback is None or getattr(callback, "execbox_reports_errors", False):
        return

    @functools.wraps(callback)
    def reported(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except ExecboxError as exc:
            ctx = click.get_current_context()
            as_json = any("--json" in param.opts and ctx.params.get(param.name)
                          for param in ctx.command.params if param.name)
            fail(exc, as_json)

    setattr(reported, "execbox_reports_errors", True)  # noqa: B010 (a marker on a function object)
    command.callback = reported


@click.group(cls=ExecboxGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="execbox")
def main() -> None:
    """Run untrusted code behind a real sandbox boundary."""

