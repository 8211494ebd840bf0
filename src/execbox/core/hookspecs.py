"""The plugin hooks. There is one: a plugin registers its backend classes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from execbox.core.backend import ExecutionBackend

PROJECT = "execbox"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PluginWarning(UserWarning):
    """A plugin could not be loaded; the others still work."""


@hookspec
def execbox_register_backends(register: Callable[[type[ExecutionBackend]], None]) -> None:
    """Call ``register(BackendClass)`` once for each backend the plugin provides."""
