"""Judges the effective configuration of a request, not a label.

1. A backend that is not a sandbox for this request is refused unless CODE_EXEC_LOCAL=true. So is network mode
   proxy with an allowlist entry that reaches this host itself (loopback, its own addresses, the cloud metadata
   service): an explicit CIDR entry lets the proxy connect there, which makes the host's services the sandbox's.
2. Before any run whose isolation is none or process, the env files the user can read are scanned for
   wallet seeds and private keys; a find is refused even in local mode.
3. A backend that cannot start raises one non-retryable BackendUnavailableError (from ``backend.check``).
4. A network mode or limit the backend cannot enforce here is refused (fail closed).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from execbox.config.settings import Settings
from execbox.contract.backend import ExecutionBackend, Verdict
from execbox.contract.models import Capabilities, ExecRequest, Mount
from execbox.errors import ConfigError, NotASandboxError, SecretFileError, UnsupportedPolicyError
from execbox.guard.mounts import admit_mounts, admit_tmpfs
from execbox.guard.secrets import find_secrets
from execbox.kit.proxy.server import local_addresses
from execbox.policy.egress import HOST_NETWORKS, parse_entry

UNSANDBOXED_ISOLATION = frozenset({"none", "process"})
LIMIT_VARIABLES = {"memory": "CODE_EXEC_MEMORY_MB", "cpu": "CODE_EXEC_CPUS", "pids": "CODE_EXEC_PIDS_LIMIT",
                   "disk": "CODE_EXEC_DISK_MB"}


class Guard:
    def __init__(self, settings: Settings, *, workspace: Path | None = None, home: Path | None = None) -> None:
        self.settings = settings
        self._workspace = workspace
        self._home = home

    def check_verdict(self, backend: ExecutionBackend, request: ExecRequest) -> Verdict:
        verdict = backend.verdict(request)
        reaching = self.host_reaching_entries(backend, request)
        if verdict.sandbox and reaching:
            verdict = Verdict(False, f"CODE_EXEC_EGRESS_ALLOW has {', '.join(map(repr, reaching))}, which lets the "
                                     "proxy connect to this host itself (loopback, its own addresses or the cloud "
                                     "metadata service), so the host's services are the sandbox's")
        if not verdict.sandbox and not self.settings.local:
            if not backend.capabilities.sandbox:
                fix = "Use a sandbox backend (docker, bubblewrap; `execbox doctor` lists what runs here)"
            elif request.network == "host":
                fix = "Ask for another network mode (--network none, or egress where the backend has it)"
            else:  # a sandbox backend that its own settings made something else: the reason names the setting
                fix = "Change the setting the reason names (or unset it)"
            raise NotASandboxError(
                f"refused: backend {backend.name!r} is not a sandbox for this request ({verdict.reason}). "
                f"{fix}, or, only on your own machine for yourself, set CODE_EXEC_LOCAL=true",
                backend=backend.name,
                env_var="CODE_EXEC_LOCAL",
            )
        return verdict

    def host_reaching_entries(self, backend: ExecutionBackend, request: ExecRequest) -> list[str]:
        """The proxy allowlist's network entries that hold an address of this host (none for a remote backend:
        there the provider's own loopback is meant)."""
        if (request.network or self.settings.network) != "proxy" or backend.capabilities.remote:
            return []
        host = [*HOST_NETWORKS, *(ipaddress.ip_network(a) for a in local_addresses())]
        # An IPv4 place is also reachable as its IPv4-mapped IPv6 address (::ffff:127.0.0.1).
        host += [ipaddress.ip_network(f"::ffff:{n.network_address}/{96 + n.prefixlen}") for n in host if n.version == 4]
        found = []
        for raw in self.settings.egress_allow:
            network = parse_entry(raw).network
            if network is not None and any(network.version == n.version and network.overlaps(n) for n in host):
                found.append(raw)
        return found

    def check_secrets(self, backend: ExecutionBackend) -> None:
        if backend.capabilities.isolation not in UNSANDBOXED_ISOLATION:
            return
        workspace = self._workspace or Path.cwd()
        home = self._home or Path(os.path.expanduser("~"))
        missing = [str(p) for p in self.settings.secret_files if not p.is_file()]
        if missing:  # a typo must not quietly switch off the scan the operator asked for
            raise ConfigError(
                f"CODE_EXEC_SECRET_FILES names files that do not exist: {', '.join(missing)}. Fix the paths or "
                "remove them from the variable", backend=backend.name, env_var="CODE_EXEC_SECRET_FILES")
        findings = find_secrets(workspace, home, list(self.settings.secret_files))
        if findings:
            where = "; ".join(f"{f.path} ({f.kind})" for f in findings)
            raise SecretFileError(
                f"refused: backend {backend.name!r} runs code unsandboxed (isolation "
                f"{backend.capabilities.isolation}) and could read a wallet secret in {where}. Move the seed or key "
                "to your signer (a hardware wallet or a signing service), or run in a sandbox backend such as docker",
                backend=backend.name,
            )

    def check_mounts(self, backend: ExecutionBackend, caps: Capabilities, mounts: Sequence[Mount],
                     state: Sequence[str] = ()) -> tuple[Mount, ...]:
        """The mounts, resolved and admitted (guard.mounts), for a backend that can bind host paths."""
        if not mounts:
            return ()
        if not caps.mounts:
            where = "the files live in the provider's sandbox" if caps.remote else "it cannot bind host paths"
            raise UnsupportedPolicyError(
                f"refused: backend {backend.name!r} takes no mounts ({where}). Copy what the code needs in instead: "
                "upload(local, remote) on a sandbox, upload= on run, or --file / --dir on the CLI; or use docker or "
                "bubblewrap", backend=backend.name)
        return admit_mounts(mounts, backend=backend.name, state=state)

    def check_tmpfs(self, backend: ExecutionBackend, caps: Capabilities, paths: Sequence[str]) -> tuple[str, ...]:
        """The extra tmpfs paths, for a backend that can make them, none over a place the sandbox provides itself."""
        if not paths:
            return ()
        if not caps.tmpfs:
            raise UnsupportedPolicyError(
                f"refused: backend {backend.name!r} cannot make the extra tmpfs paths asked for (tmpfs="
                f"{', '.join(paths)}); write under /tmp or the workspace instead, or use docker or bubblewrap",
                backend=backend.name)
        return admit_tmpfs(paths, backend=backend.name)

    def check_policy(self, backend: ExecutionBackend, caps: Capabilities, request: ExecRequest,
                     requested_limits: set[str]) -> None:
        network = request.network or self.settings.network
        if network not in caps.network_modes:
            modes = ", ".join(sorted(caps.network_modes)) or "none at all"
            why = backend.unenforced(network)
            raise UnsupportedPolicyError(
                f"refused: backend {backend.name!r} cannot enforce network mode {network!r} here"
                + (f": {why}" if why else "") + f" (it enforces: {modes}). Ask for one of those (--network / "
                "CODE_EXEC_NETWORK) or use another backend",
                backend=backend.name,
                env_var="CODE_EXEC_NETWORK",
            )
        missing = sorted(requested_limits - set(caps.limits))
        if missing:
            variables = [LIMIT_VARIABLES[m] for m in missing if m in LIMIT_VARIABLES]
            why = "; ".join(f"{m}: {reason}" for m in missing if (reason := backend.unenforced(m)))
            raise UnsupportedPolicyError(
                f"refused: backend {backend.name!r} cannot enforce the {', '.join(missing)} limit here"
                + (f" ({why})" if why else "") + f" (it enforces: {', '.join(sorted(caps.limits)) or 'none'}). "
                "Drop that limit from the request"
                + (f" or unset {' / '.join(variables)}" if variables else "") + ", or use another backend",
                backend=backend.name,
                env_var=variables[0] if variables else None,
            )
