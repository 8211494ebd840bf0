"""The built-in backends. They register through the same hook as third-party plugins."""

from __future__ import annotations

from execbox.plugin import Register, hookimpl

# One line per backend, "name = module:Class" as in an entry point: registered by name, the module is imported
# only when that backend is used or every backend is listed (a module that fails to import is the registry's
# warning), so `--backend docker` imports no other backend.
BUILTIN_BACKENDS = [
    "local_subprocess = execbox.backends.local_subprocess:LocalSubprocessBackend",
    "modal = execbox.backends.modal:ModalBackend",
    "daytona = execbox.backends.daytona:DaytonaBackend",
    "vercel_sandbox = execbox.backends.vercel_sandbox:VercelSandboxBackend",
    "docker = execbox.backends.docker.backend:DockerBackend",
    "ssh = execbox.backends.ssh:SshBackend",
    "singularity = execbox.backends.singularity:SingularityBackend",
    "bubblewrap = execbox.backends.bubblewrap.backend:BubblewrapBackend",
    "gvisor = execbox.backends.gvisor.backend:GvisorBackend",
    "ray = execbox.backends.ray.backend:RayBackend",
]


@hookimpl
def execbox_register_backends(register: Register) -> None:
    for spec in BUILTIN_BACKENDS:
        name, _, ref = (part.strip() for part in spec.partition("="))
        register(ref, name=name)
