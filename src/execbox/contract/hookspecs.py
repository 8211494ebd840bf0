"""The plugin hooks: a plugin registers its backend classes; a plugin reviews an agent's commands."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from execbox.contract.review import ReviewDecision, ReviewRequest

PROJECT = "execbox"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PluginWarning(UserWarning):
    """A plugin could not be loaded; the others still work."""


@hookspec
def execbox_register_backends(register: Callable[..., None]) -> None:
    """Call ``register(BackendClass)`` once for each backend the plugin provides; or
    ``register("package.module:BackendClass", name="its_name")`` to have the module imported only when that
    backend is used or every backend is listed."""


@hookspec
def execbox_review_command(request: ReviewRequest) -> ReviewDecision | list[ReviewDecision] | None:
    """Review a command an agent asked to run, before it runs (the MCP tools run_command, run_code, shell).

    Return ``ReviewDecision(action="allow" | "ask" | "deny", reason=..., rule=...)``, a list of them, or None
    for no opinion. Every plugin's answer counts and the strictest wins (deny > ask > allow), with execbox's own
    rules among them: a plugin adds policy, it cannot loosen another's. ``ask`` has a person approve it (MCP
    elicitation); a plugin that raises counts as deny. Every decision goes to the audit log."""
