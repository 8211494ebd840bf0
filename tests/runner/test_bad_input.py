"""Bad input gets a clear ExecboxError that says what to change, and a misconfiguration never buys a weaker run."""

from __future__ import annotations

from pathlib import Path

import pytest

from execbox import Capabilities, ConfigError, Runner, Settings, WorkspacePathError


@pytest.mark.parametrize("variable,value", [("CODE_EXEC_CPUS", "inf"), ("CODE_EXEC_MAX_TIMEOUT_SEC", "inf"),
                                            ("CODE_EXEC_MAX_TIMEOUT_SEC", "1e12"), ("CODE_EXEC_CPUS", "nan")])
def test_infinite_or_absurd_settings_are_refused(variable: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        Settings.from_env()
    assert info.value.env_var == variable


def test_an_empty_command_is_refused(local_mode: None) -> None:
    with pytest.raises(ConfigError, match="empty"):
        Runner().run("  ")


def test_reading_a_directory_is_a_workspace_error(local_mode: None) -> None:
    with Runner().sandbox() as sb:
        sb.exec("mkdir d")
        with pytest.raises(WorkspacePathError, match="is a directory, not a file: use list_files"):
            sb.read_file("d")


def test_a_misconfigured_backend_stops_auto_instead_of_falling_back(fake_backends: object,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.fakes_plugin import FakeSandbox

    async def misconfigured(self: FakeSandbox) -> Capabilities:
        if self.name != "fake_sandbox":
            return FakeSandbox.capabilities
        raise ConfigError("CODE_EXEC_FAKE_RUNTIME='runsc' is not installed", env_var="CODE_EXEC_FAKE_RUNTIME")

    monkeypatch.setattr(FakeSandbox, "probe", misconfigured)
    with pytest.raises(ConfigError) as info:
        Runner(Settings.from_env()).run(["true"])  # fake_namespace could run, but is weaker than what was configured
    assert info.value.env_var == "CODE_EXEC_FAKE_RUNTIME"


def test_load_plugins_naming_nothing_installed_warns(fake_dists: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox import PluginWarning
    from execbox.registry import get_registry

    with pytest.warns(PluginWarning, match="nosuch"):
        registry = get_registry(["nosuch"], [])
    assert "local_subprocess" in registry.names()


def test_a_workdir_error_names_the_command_not_the_workdir(local_mode: None, tmp_path: Path) -> None:
    result = Runner().run(["./missing.sh"], workdir="sub")
    assert result.exit_code == 127 and "/sub:" not in result.stderr


def test_auto_does_not_fall_back_past_a_backend_the_operator_configured(fake_backends: object,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox import BackendUnavailableError
    from tests.support.fakes_plugin import FakeSandbox

    original = FakeSandbox.probe

    async def runtime_missing(self: FakeSandbox) -> Capabilities:
        if self.name != "fake_sandbox":
            return await original(self)
        raise BackendUnavailableError("runtime runsc is not installed", env_var="CODE_EXEC_FAKE_RUNTIME")

    monkeypatch.setattr(FakeSandbox, "probe", runtime_missing)
    # Not configured by the operator: auto moves on to the next sandbox.
    assert Runner(Settings.from_env()).run(["true"]).backend == "fake_namespace"
    # Configured: the operator asked for that backend's boundary; no silent fallback.
    monkeypatch.setenv("CODE_EXEC_FAKE_RUNTIME", "runsc")
    with pytest.raises(BackendUnavailableError, match="runsc"):
        Runner(Settings.from_env()).run(["true"])
