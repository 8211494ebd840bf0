"""The built-in backends. They register through the same hook as third-party plugins."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

from execbox.plugin import PluginWarning, hookimpl

# One line per backend: "module:Class". Each module imports its SDK lazily, so this list is cheap.
BUILTIN_BACKENDS = [
    "execbox.backends.local_subprocess:LocalSubprocessBackend",
    "execbox.backends.modal:ModalBackend",
    "execbox.backends.daytona:DaytonaBackend",
    "execbox.backends.vercel_sandbox:VercelSandboxBackend",
    "execbox.backends.docker:DockerBackend",
    "execbox.backends.ssh:SshBackend",
    "execbox.backends.singularity:SingularityBackend",
    "execbox.backends.bubblewrap:BubblewrapBackend",
]


@hookimpl
def execbox_register_backends(register: Callable[[type], None]) -> None:
    for spec in BUILTIN_BACKENDS:
        module, _, cls = spec.partition(":")
        try:
            backend = getattr(importlib.import_module(module), cls)
        except Exception as exc:  # one broken module must not hide the other backends
            warnings.warn(f"execbox built-in backend {spec} failed to import: {exc!r}", PluginWarning, stacklevel=2)
            continue
        register(backend)
