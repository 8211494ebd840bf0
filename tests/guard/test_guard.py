"""The sandbox guard: not-a-sandbox refused unless local mode, fail closed on policy, unavailable never retryable."""

from __future__ import annotations

import pytest

from execbox import (
    BackendUnavailableError,
    ExecRequest,
    Limits,
    NotASandboxError,
    RefusedError,
    Runner,
    Settings,
    UnsupportedPolicyError,
)
from execbox.backends.local_subprocess import LocalSubprocessBackend
from execbox.guard import Guard
from tests.support.fakes_plugin import FakeDown, FakeNamespace, FakeSandbox


def request(**kw: object) -> ExecRequest:
    return ExecRequest(argv=["true"], **kw)


class TestNotASandbox:
    def test_local_subprocess_is_refused_without_local_mode(self) -> None:
        settings = Settings.from_env(network="host")
        with pytest.raises(NotASandboxError) as info:
            Guard(settings).check_verdict(LocalSubprocessBackend(settings), request(network="host"))
        exc = info.value
        assert isinstance(exc, RefusedError)
        assert "'local_subprocess'" in exc.message and "CODE_EXEC_LOCAL=true" in exc.message
        assert (exc.backend, exc.env_var, exc.retryable) == ("local_subprocess", "CODE_EXEC_LOCAL", False)

    def test_local_subprocess_is_admitted_in_local_mode_and_still_called_no_sandbox(self) -> None:
        settings = Settings.from_env(network="host", local=True)
        verdict = Guard(settings).check_verdict(LocalSubprocessBackend(settings), request(network="host"))
        assert verdict.sandbox is False

    def test_network_host_makes_a_sandbox_backend_not_a_sandbox(self) -> None:
        settings = Settings.from_env()
        guard, backend = Guard(settings), FakeSandbox(settings)
        assert guard.check_verdict(backend, request(network="none")).sandbox
        with pytest.raises(NotASandboxError, match="network mode 'host'.*CODE_EXEC_LOCAL"):
            guard.check_verdict(backend, request(network="host"))

    def test_through_the_runner_local_subprocess_is_refused_without_local_mode(self, fake_backends: object) -> None:
        with pytest.raises(NotASandboxError, match="local_subprocess"):
            Runner(Settings.from_env(network="host")).run(["true"], backend="local_subprocess")

    def test_through_the_runner_network_host_on_a_sandbox_is_refused(self, fake_backends: object) -> None:
        with pytest.raises(NotASandboxError):
            Runner(Settings.from_env()).run(["true"], backend="fake_sandbox", network="host")


class TestFailClosed:
    def test_a_network_mode_the_backend_cannot_enforce_is_refused_naming_what_to_change(self) -> None:
        settings = Settings.from_env(local=True)
        backend = LocalSubprocessBackend(settings)
        with pytest.raises(UnsupportedPolicyError) as info:
            Guard(settings).check_policy(backend, backend.capabilities, request(network="none"), set())
        message = info.value.message
        assert "'none'" in message and "host" in message and "CODE_EXEC_NETWORK" in message
        assert info.value.env_var == "CODE_EXEC_NETWORK"

    def test_the_settings_default_network_is_judged_when_the_request_names_none(self) -> None:
        settings = Settings.from_env(network="egress")
        backend = FakeNamespace(settings)
        with pytest.raises(UnsupportedPolicyError, match="'egress'"):
            Guard(settings).check_policy(backend, backend.capabilities, request(), set())

    def test_a_limit_the_backend_cannot_enforce_is_refused_naming_it(self) -> None:
        settings = Settings.from_env()
        backend = FakeNamespace(settings)
        with pytest.raises(UnsupportedPolicyError) as info:
            Guard(settings).check_policy(backend, backend.capabilities, request(network="none"), {"memory", "pids"})
        assert "memory, pids limit" in info.value.message and "Drop that limit" in info.value.message

    def test_capabilities_narrowed_by_check_are_the_ones_judged(self) -> None:
        settings = Settings.from_env()
        backend = FakeSandbox(settings)
        narrowed = backend.capabilities.model_copy(update={"limits": frozenset({"wall_time"})})
        with pytest.raises(UnsupportedPolicyError, match="memory"):
            Guard(settings).check_policy(backend, narrowed, request(network="none"), {"memory"})

    def test_through_the_runner_default_network_none_on_local_subprocess_is_refused(
            self, fake_backends: object) -> None:
        with pytest.raises(UnsupportedPolicyError, match="network mode 'none'"):
            Runner(Settings.from_env(local=True)).run(["true"], backend="local_subprocess")

    def test_through_the_runner_an_explicit_limit_is_a_demand(self, fake_backends: object, home: object) -> None:
        runner = Runner(Settings.from_env(local=True, network="host"))
        with pytest.raises(UnsupportedPolicyError, match="pids"):
            runner.run(["true"], backend="local_subprocess", limits=Limits(pids=10))
        # The settings' own defaults are not demands: the same run without the explicit limit goes through.
        assert runner.run(["true"], backend="local_subprocess").exit_code == 0

    def test_a_session_on_a_backend_without_sessions_is_refused(self, fake_backends: object) -> None:
        with pytest.raises(UnsupportedPolicyError, match="persistent sessions"):
            with Runner(Settings.from_env()).sandbox("fake_namespace"):
                pass

    def test_a_session_cannot_change_its_network(self, fake_backends: object) -> None:
        with Runner(Settings.from_env()).sandbox("fake_sandbox", network="none") as sb:
            with pytest.raises(UnsupportedPolicyError, match="cannot change"):
                sb.exec(["true"], network="egress")


class TestUnavailable:
    def test_the_error_is_never_retryable_and_says_so(self) -> None:
        exc = BackendUnavailableError("docker daemon is not running", backend="docker", fix="systemctl start docker")
        assert exc.retryable is False
        assert exc.message == ("docker daemon is not running. Fix: systemctl start docker. "
                               "Do not retry until this is fixed.")
        assert (exc.reason, exc.fix) == ("docker daemon is not running", "systemctl start docker")

    def test_a_failing_check_stops_the_run_before_anything_starts(self, fake_backends: object,
                                                                   workspaces: object) -> None:
        with pytest.raises(BackendUnavailableError) as info:
            Runner(Settings.from_env()).run(["true"], backend="fake_down")
        exc = info.value
        assert exc.retryable is False and exc.backend == "fake_down"
        assert FakeDown.REASON in exc.message and FakeDown.FIX in exc.message and "not retry" in exc.message
        assert not any(workspaces.iterdir())  # type: ignore[attr-defined]

    def test_a_failing_check_stops_a_session_too(self, fake_backends: object) -> None:
        with pytest.raises(BackendUnavailableError, match="not retry"):
            with Runner(Settings.from_env()).sandbox("fake_down"):
                pass

    def test_an_unknown_backend_is_a_config_error_listing_the_registered_ones(self, fake_backends: object) -> None:
        from execbox import ConfigError

        with pytest.raises(ConfigError, match="unknown backend 'nope'.*fake_sandbox.*local_subprocess"):
            Runner(Settings.from_env()).run(["true"], backend="nope")
