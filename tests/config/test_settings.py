"""Settings: every knob from the environment, its default, and errors that name the variable and what it allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from execbox import ConfigError, ExecRequest, Limits, Settings
from execbox.runner import AsyncRunner

DEFAULTS = {
    "backend": "auto",
    "shell_backend": None,
    "local": False,
    "enabled": False,
    "network": "none",
    "max_output_bytes": 100_000,
    "max_timeout_sec": 30.0,
    "secret_files": [],
    "memory_mb": 1024,
    "cpus": 1.0,
    "pids_limit": 256,
    "disk_mb": 2048,
    "max_stdin_bytes": 64 << 20,
    "max_read_bytes": 64 << 20,
    "load_plugins": None,
    "auto_plugins": [],
    "disable_plugins": [],
}


def test_defaults_with_a_clean_environment() -> None:
    settings = Settings.from_env()
    assert {key: getattr(settings, key) for key in DEFAULTS} == DEFAULTS
    assert settings.session_backend == "auto"


def test_env_vars_lists_every_knob_with_its_default() -> None:
    rows = {var: default for var, default, _ in Settings.env_vars()}
    assert rows == {
        "CODE_EXEC_BACKEND": "auto", "SHELL_BACKEND": None, "CODE_EXEC_LOCAL": False, "CODE_EXEC_ENABLED": False,
        "CODE_EXEC_NETWORK": "none", "CODE_EXEC_MAX_OUTPUT_BYTES": 100_000, "CODE_EXEC_MAX_TIMEOUT_SEC": 30.0,
        "CODE_EXEC_BACKEND_GRACE_SEC": 30.0, "CODE_EXEC_OPEN_TIMEOUT_SEC": 300.0,
        "CODE_EXEC_EGRESS_ALLOW": [], "CODE_EXEC_EGRESS_DEFAULTS": True, "CODE_EXEC_CA_BUNDLE": None,
        "CODE_EXEC_EGRESS_SECRETS": [],
        "CODE_EXEC_SECRET_FILES": [], "CODE_EXEC_MEMORY_MB": 1024, "CODE_EXEC_CPUS": 1.0,
        "CODE_EXEC_PIDS_LIMIT": 256, "CODE_EXEC_DISK_MB": 2048, "CODE_EXEC_MAX_STDIN_BYTES": 64 << 20,
        "CODE_EXEC_MAX_READ_BYTES": 64 << 20, "CODE_EXEC_MAX_TRANSFER_BYTES": 512 << 20,
        "CODE_EXEC_MAX_TRANSFER_FILES": 100_000, "CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB": 20480,
        "CODE_EXEC_SNAPSHOT_MAX_AGE_SEC": 604800.0, "CODE_EXEC_PACKAGE_CACHE": None,
        "EXECBOX_LOAD_PLUGINS": None, "EXECBOX_AUTO_PLUGINS": [], "EXECBOX_DISABLE_PLUGINS": [],
        "CODE_EXEC_AUDIT_LOG": None, "CODE_EXEC_AUDIT_KEY": None, "CODE_EXEC_AUDIT_KEY_FILE": None,
        "CODE_EXEC_AUDIT_MAX_BYTES": 64 << 20, "CODE_EXEC_AUDIT_OUTPUT": 0, "CODE_EXEC_OTEL_COMMAND_ARGS": False,
        "AGENT_COMPUTE_POSTURE": 0, "CODE_EXEC_REVIEW_RULES": None, "CODE_EXEC_REVIEW_OFF": [],
        "CODE_EXEC_MAX_CONCURRENT": None, "CODE_EXEC_QUEUE_TIMEOUT_SEC": 60.0, "CODE_EXEC_POOL_SIZE": 0,
        "CODE_EXEC_POOL_TTL_SEC": 300.0, "CODE_EXEC_MAX_DISPLAY_BYTES": 16 << 20, "CODE_EXEC_SERVER": None,
        "CODE_EXEC_PROBE_CACHE_SEC": 60.0,
    }
    assert all(description for _, _, description in Settings.env_vars())


@pytest.mark.parametrize(
    ("var", "value", "field", "expected"),
    [
        ("CODE_EXEC_BACKEND", "docker", "backend", "docker"),
        ("SHELL_BACKEND", "ssh", "shell_backend", "ssh"),
        ("CODE_EXEC_LOCAL", "true", "local", True),
        ("CODE_EXEC_LOCAL", "1", "local", True),
        ("CODE_EXEC_LOCAL", "false", "local", False),
        ("CODE_EXEC_ENABLED", "true", "enabled", True),
        ("CODE_EXEC_NETWORK", "egress", "network", "egress"),
        ("CODE_EXEC_NETWORK", "host", "network", "host"),
        ("CODE_EXEC_MAX_OUTPUT_BYTES", "4096", "max_output_bytes", 4096),
        ("CODE_EXEC_MAX_TIMEOUT_SEC", "2.5", "max_timeout_sec", 2.5),
        ("CODE_EXEC_SECRET_FILES", "/a/keys.txt, /b/.seed ,,", "secret_files", [Path("/a/keys.txt"), Path("/b/.seed")]),
        ("CODE_EXEC_MEMORY_MB", "512", "memory_mb", 512),
        ("CODE_EXEC_CPUS", "0.5", "cpus", 0.5),
        ("CODE_EXEC_PIDS_LIMIT", "64", "pids_limit", 64),
        ("EXECBOX_LOAD_PLUGINS", "one, two", "load_plugins", ["one", "two"]),
        ("EXECBOX_LOAD_PLUGINS", "", "load_plugins", []),
        ("EXECBOX_DISABLE_PLUGINS", "one,two", "disable_plugins", ["one", "two"]),
        ("CODE_EXEC_PROBE_CACHE_SEC", "0", "probe_cache_sec", 0.0),
    ],
)
def test_each_variable_is_read(monkeypatch: pytest.MonkeyPatch, var: str, value: str, field: str,
                               expected: object) -> None:
    monkeypatch.setenv(var, value)
    assert getattr(Settings.from_env(), field) == expected


def test_shell_backend_defaults_to_code_exec_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_BACKEND", "docker")
    assert Settings.from_env().session_backend == "docker"
    monkeypatch.setenv("SHELL_BACKEND", "ssh")
    settings = Settings.from_env()
    assert (settings.backend, settings.session_backend) == ("docker", "ssh")


def test_field_names_are_not_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the documented variables count: a stray LOCAL=true must not turn local mode on.
    for name, value in {"LOCAL": "true", "NETWORK": "host", "BACKEND": "x", "MAX_TIMEOUT_SEC": "999"}.items():
        monkeypatch.setenv(name, value)
    settings = Settings.from_env()
    assert (settings.local, settings.network, settings.backend, settings.max_timeout_sec) == (
        False, "none", "auto", 30.0)


def test_overrides_take_precedence_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_NETWORK", "none")
    monkeypatch.setenv("CODE_EXEC_LOCAL", "false")
    settings = Settings.from_env(network="host", local=True)
    assert (settings.network, settings.local) == ("host", True)


def test_an_unknown_override_names_the_known_settings() -> None:
    with pytest.raises(ConfigError, match="no setting 'netwrok'.*network"):
        Settings.from_env(netwrok="host")


@pytest.mark.parametrize(
    ("var", "value", "allowed"),
    [
        ("CODE_EXEC_NETWORK", "foo", ["none", "egress", "proxy", "host"]),
        ("CODE_EXEC_MAX_OUTPUT_BYTES", "-1", ["greater than 0"]),
        ("CODE_EXEC_MAX_OUTPUT_BYTES", "lots", ["integer"]),
        ("CODE_EXEC_MAX_TIMEOUT_SEC", "0", ["greater than 0"]),
        ("CODE_EXEC_MEMORY_MB", "0", ["greater than 0"]),
        ("CODE_EXEC_CPUS", "-2", ["greater than 0"]),
        ("CODE_EXEC_PIDS_LIMIT", "0", ["greater than 0"]),
        ("CODE_EXEC_PROBE_CACHE_SEC", "-1", ["greater than or equal to 0"]),
        ("CODE_EXEC_PROBE_CACHE_SEC", "inf", ["finite"]),
        pytest.param(
            "CODE_EXEC_LOCAL", "maybe", ["true", "false"],
        ),
        pytest.param(
            "CODE_EXEC_ENABLED", "maybe", ["true", "false"],
        ),
    ],
)
def test_an_invalid_value_is_a_config_error_naming_the_variable_and_the_allowed_values(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, allowed: list[str]
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        Settings.from_env()
    message = info.value.message
    assert var in message
    assert repr(value) in message
    for word in allowed:
        assert word in message.lower()


def test_an_invalid_value_carries_the_variable_as_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_NETWORK", "foo")
    with pytest.raises(ConfigError) as info:
        Settings.from_env()
    assert info.value.env_var == "CODE_EXEC_NETWORK"


class TestClamps:
    """Request values are clamped to the maxima from the settings; unset values take the defaults."""

    def prepare(self, **request: object) -> ExecRequest:
        runner = AsyncRunner(Settings.from_env(max_timeout_sec=5, max_output_bytes=1000, memory_mb=256, cpus=1,
                                               pids_limit=32))
        resolved, _, _ = runner.prepare(ExecRequest(argv=["true"], **request))
        return resolved

    def test_timeout_and_output_above_the_maxima_are_clamped(self) -> None:
        resolved = self.prepare(timeout=3600, max_output_bytes=10**9)
        assert (resolved.timeout, resolved.max_output_bytes) == (5, 1000)

    def test_values_below_the_maxima_are_kept(self) -> None:
        resolved = self.prepare(timeout=0.5, max_output_bytes=10)
        assert (resolved.timeout, resolved.max_output_bytes) == (0.5, 10)

    def test_unset_values_take_the_maxima_and_the_default_network(self) -> None:
        resolved = self.prepare()
        assert (resolved.timeout, resolved.max_output_bytes, resolved.network) == (5, 1000, "none")

    def test_limits_are_clamped_and_defaulted(self) -> None:
        resolved = self.prepare(limits=Limits(memory_mb=10**6, pids=8))
        assert resolved.limits == Limits(memory_mb=256, cpus=1, pids=8, disk_mb=2048)

    def test_only_explicitly_requested_limits_are_demands(self) -> None:
        runner = AsyncRunner(Settings.from_env())
        _, _, asked = runner.prepare(ExecRequest(argv=["true"], limits=Limits(pids=8)))
        assert asked == {"pids"}
        _, _, asked = runner.prepare(ExecRequest(argv=["true"]))
        assert asked == set()
