"""The built-in backends. They register through the same hook as third-party plugins."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

from execbox.plugin import PluginWarning, hookimpl

# One line per backend, "name = module:Class" as in an entry point: registered by name, the module is imported
# only when that backend is used or every backend is listed, so `--backend docker` imports no other backend. A
# bare "module:Class" is imported at once to learn its name.
BUILTIN_BACKENDS = [
    "local_subprocess = execbox.backends.local_subprocess:LocalSubprocessBackend",
    "modal = execbox.backends.modal:ModalBackend",
    "daytona = execbox.backends.daytona:DaytonaBackend",
    "vercel_sandbox = execbox.backends.vercel_sandbox:VercelSandboxBackend",
    "docker = execbox.backends.docker:DockerBackend",
    "ssh = execbox.backends.ssh:SshBackend",
    "singularity = execbox.backends.singularity:SingularityBackend",
    "bubblewrap = execbox.backends.bubblewrap:BubblewrapBackend",
]


@hookimpl
def execbox_register_backends(register: Callable[..., None]) -> None:
    for spec in BUILTIN_BACKENDS:
        name, sep, ref = (part.strip() for part in spec.rpartition("="))
        if sep:
            register(ref, name=name)
            continue
        module, _, cls = ref.partition(":")
        try:
            backend: Any = getattr(importlib.import_module(module), cls)
        except Exception as exc:  # one broken module must not hide the other backends
            warnings.warn(f"execbox built-in backend {spec} failed to import: {exc!r}", PluginWarning, stacklevel=2)
            continue
        register(backend)
