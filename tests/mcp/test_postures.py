"""Postures: which tools each offers, what a transport refuses at start, the persistent sandbox's network."""

from __future__ import annotations

import pytest

from execbox.config.settings import Settings
from execbox.contract.models import Capabilities
from execbox.errors import ConfigError
from execbox.mcp.postures import check_startup, offered_tools, persistent_backend, session_network

WITH_PROXY = Capabilities(sandbox=True, isolation="container", network_modes=frozenset({"none", "proxy"}))
WITHOUT = Capabilities(sandbox=True, isolation="container", network_modes=frozenset({"none", "egress"}))


def test_tools_by_switch_and_posture() -> None:
    assert offered_tools(Settings()) == []
    assert offered_tools(Settings(posture=3)) == []
    assert offered_tools(Settings(enabled=True)) == ["run_code", "run_command", "delegate"]
    assert offered_tools(Settings(enabled=True, posture=1)) == [
        "run_code", "run_command", "shell", "python", "write_file", "read_file", "list_files", "snapshot", "rollback",
        "delegate"]


def test_posture_3_needs_stdio_and_local_mode() -> None:
    with pytest.raises(ConfigError, match="HTTP server would hand that shell"):
        check_startup(Settings(posture=3, local=True), "http")
    with pytest.raises(ConfigError, match="CODE_EXEC_LOCAL=true") as info:
        check_startup(Settings(posture=3), "stdio")
    assert info.value.env_var == "CODE_EXEC_LOCAL"
    check_startup(Settings(posture=3, local=True), "stdio")
    check_startup(Settings(posture=1), "http")
    assert persistent_backend(Settings(posture=3, local=True)) == "local_subprocess"
    assert persistent_backend(Settings(posture=1)) == "auto"
    assert persistent_backend(Settings(posture=1, shell_backend="docker")) == "docker"


def test_the_persistent_sandbox_gets_proxy_where_enforced_unless_the_operator_chose() -> None:
    assert session_network(Settings(), WITH_PROXY) == "proxy"
    assert session_network(Settings(), WITHOUT) == "none"
    assert session_network(Settings(network="none"), WITH_PROXY) == "none"
    assert session_network(Settings(network="egress"), WITHOUT) == "egress"


def test_posture_2_does_not_exist() -> None:
    with pytest.raises(ConfigError, match="AGENT_COMPUTE_POSTURE.*0, 1 or 3"):
        Settings(posture=2)
