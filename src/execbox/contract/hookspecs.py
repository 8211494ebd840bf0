"""The plugin hooks: a plugin registers its backend classes; adds its commands to the execbox command line;
reviews an agent's commands."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, overload

import pluggy

if TYPE_CHECKING:
    import click

    from execbox.contract.backend import ExecutionBackend
    from execbox.contract.review import ReviewDecision, ReviewRequest

PROJECT = "execbox"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PluginWarning(UserWarning):
    """A plugin could not be loaded; the others still work."""


class Register(Protocol):
    """What ``execbox_register_backends`` is given: ``register(BackendClass)``, or
    ``register("package.module:BackendClass", name="its_name")`` to import the module only when that backend is
    used or every backend is listed. A bad registration is a PluginError naming the plugin's distribution."""

    @overload
    def __call__(self, backend: type[ExecutionBackend[Any]], /) -> None: ...

    @overload
    def __call__(self, backend: str, /, *, name: str) -> None: ...


@hookspec
def execbox_register_backends(register: Register) -> None:
    """Call ``register(BackendClass)`` once for each backend the plugin provides; or
    ``register("package.module:BackendClass", name="its_name")`` to have the module imported only when that
    backend is used or every backend is listed."""


@hookspec
def execbox_register_commands(cli: click.Group) -> None:
    """Add the plugin's commands to the ``execbox`` command line: ``cli.add_command(command)`` for each (a click
    command or group), e.g. ``execbox image build`` is the docker backend's.

    Called only when a command line names a command execbox does not have, or the commands are listed
    (``execbox --help``): never for ``execbox run``, so what this imports costs a run nothing. A name the command
    line already has (execbox's own, or an earlier plugin's) is refused with a warning: a plugin adds commands, it
    cannot replace one. An ``ExecboxError`` a command raises is reported as execbox's own commands report theirs
    (one line on stderr, or ``{"error": ...}`` when its ``--json`` flag is set) with the same exit status."""


@hookspec
def execbox_review_command(request: ReviewRequest) -> ReviewDecision | list[ReviewDecision] | None:
    """Review a command an agent asked to run, before it runs (the MCP tools run_command, run_code, shell).

    Return ``ReviewDecision(action="allow" | "ask" | "deny", reason=..., rule=...)``, a list of them, or None
    for no opinion. Every plugin's answer counts and the strictest wins (deny > ask > allow), with execbox's own
    rules among them: a plugin adds policy, it cannot loosen another's. ``ask`` has a person approve it (MCP
    elicitation); a plugin that raises counts as deny. Every decision goes to the audit log."""
