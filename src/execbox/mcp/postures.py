"""Compute postures (AGENT_COMPUTE_POSTURE): how much compute the agent surface offers.

    0  one-shot sandboxes only (run_code, run_command); nothing persists between calls. The default.
    1  also one persistent sandbox per MCP session (shell, python, write_file, read_file, list_files; snapshot and
       rollback, its undo history, where the backend keeps snapshots): opened on first use, closed and removed (its
       snapshots with it) when the session ends — the client closes it, disconnects, dies (stdio: its
       pipe closes; HTTP: the session is deleted or idle for EXECBOX_MCP_IDLE_SEC). Its network is ``proxy``
       when the backend enforces that mode (allowlisted egress, e.g. package installs), else ``none``, unless
       the operator set CODE_EXEC_NETWORK.
    3  the persistent "sandbox" is a shell on this host (local_subprocess): for the machine's owner, on the
       owner's own machine. Only with CODE_EXEC_LOCAL=true and the stdio transport; an HTTP server refuses to
       start with it. The wallet-seed guard still refuses to run when a seed is readable, as everywhere.

CODE_EXEC_ENABLED=false (the default) offers no code-execution tools at all: they are absent from the list.
"""

from __future__ import annotations

from typing import Literal

from execbox.config.settings import Settings
from execbox.contract.models import Capabilities, NetworkMode
from execbox.errors import ConfigError

Transport = Literal["stdio", "http"]
HOST_BACKEND = "local_subprocess"


def offered_tools(settings: Settings) -> list[str]:
    """The tools this server lists, in order."""
    if not settings.enabled:
        return []
    tools = ["run_code", "run_command"]
    if settings.posture >= 1:
        tools += ["shell", "python", "write_file", "read_file", "list_files"]
    if settings.posture == 1:  # posture 3's host shell keeps no snapshots
        tools += ["snapshot", "rollback"]
    return [*tools, "delegate"]


def check_startup(settings: Settings, transport: Transport) -> None:
    """Refuse to serve a posture this transport or these settings cannot hold, naming why."""
    if settings.posture != 3:
        return
    if transport != "stdio":
        raise ConfigError(
            "refused: AGENT_COMPUTE_POSTURE=3 is a shell on this host for its owner, and an HTTP server would hand "
            "that shell to whoever holds its token, over the network. Serve it over stdio (`execbox mcp`), or use "
            "posture 1 (a persistent sandbox) over HTTP", env_var="AGENT_COMPUTE_POSTURE")
    if not settings.local:
        raise ConfigError(
            "refused: AGENT_COMPUTE_POSTURE=3 runs commands on this host, unsandboxed; it needs CODE_EXEC_LOCAL=true "
            "(only on your own machine, for yourself), or use posture 1", env_var="CODE_EXEC_LOCAL")


def persistent_backend(settings: Settings) -> str:
    """The backend of the persistent sandbox: the host at posture 3, else SHELL_BACKEND / CODE_EXEC_BACKEND."""
    return HOST_BACKEND if settings.posture == 3 else settings.session_backend


def session_network(settings: Settings, caps: Capabilities) -> NetworkMode:
    """The persistent sandbox's network: the operator's CODE_EXEC_NETWORK when set, else proxy where the backend
    enforces it, else none."""
    if "network" in settings.model_fields_set:
        return settings.network
    return "proxy" if "proxy" in caps.network_modes else "none"
