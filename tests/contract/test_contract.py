"""The settings contract, backend options given in code, the check() rule, runner lifecycle and auto's trust rule."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import execbox
from execbox import ConfigError, Runner, Settings
from execbox.contract import backend as backend_module
from execbox.plugin import BackendSettings, Capabilities, ExecutionBackend, HostWorkspaceSession, SessionSpec, setting
from execbox.runner import AsyncRunner


class TestSettingsGivenInCode:
    def test_field_names_are_honoured(self) -> None:
        settings = Settings(backend="docker", local=True)
        assert (settings.backend, settings.local) == ("docker", True)
        assert Settings(backend="docker").model_dump() == Settings.from_env(backend="docker").model_dump()

    def test_code_takes_precedence_over_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_MEMORY_MB", "300")
        assert Settings().memory_mb == 300
        assert Settings(memory_mb=200).memory_mb == 200

    def test_an_unknown_keyword_is_an_error_not_ignored(self) -> None:
        with pytest.raises(ConfigError, match="no setting 'bakend'.*backend"):
            Settings(bakend="docker")

    def test_an_invalid_value_in_code_names_the_field_and_its_variable(self) -> None:
        with pytest.raises(ConfigError, match=r"memory_mb \(given in code; variable CODE_EXEC_MEMORY_MB\)=-1") as info:
            Settings(memory_mb=-1)
        assert info.value.env_var == "CODE_EXEC_MEMORY_MB"

    def test_field_names_are_never_read_from_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("BACKEND", "docker")
        monkeypatch.setenv("LOCAL", "true")
        settings = Settings()
        assert (settings.backend, settings.local) == ("auto", False)


class Knobs(BackendSettings):
    image: str = setting("CODE_EXEC_KNOBBED_IMAGE", "default-image", "an image, for this test")
    size: int = setting("CODE_EXEC_KNOBBED_SIZE", 1, "a size, for this test", gt=0)


class Knobbed(ExecutionBackend):
    name = "knobbed"
    capabilities = Capabilities(sandbox=True, isolation="namespace", network_modes=frozenset({"none"}))
    settings_model = Knobs
    probes = 0
    closed = 0

    async def probe(self) -> Capabilities:
        type(self).probes += 1
        return self.capabilities

    async def open_session(self, spec: SessionSpec) -> HostWorkspaceSession:
        return HostWorkspaceSession()

    async def aclose(self) -> None:
        type(self).closed += 1


@pytest.fixture
def knobbed(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Knobbed]]:
    from execbox import registry

    real_get = registry.Registry.get

    def get(self: registry.Registry, name: str) -> registry.BackendEntry:
        return registry.BackendEntry("knobbed", Knobbed, "test") if name == "knobbed" else real_get(self, name)

    monkeypatch.setattr(registry.Registry, "get", get)
    Knobbed.probes = Knobbed.closed = 0
    yield Knobbed


class TestBackendOptions:
    def test_options_in_code_sit_on_top_of_the_environment(self, knobbed: type[Knobbed],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_KNOBBED_SIZE", "7")
        one = AsyncRunner(Settings(), options={"knobbed": {"image": "one"}})
        two = AsyncRunner(Settings(), options={"knobbed": {"image": "two"}})
        first, second = one.backend("knobbed").settings, two.backend("knobbed").settings
        assert (first.image, second.image) == ("one", "two")  # type: ignore[attr-defined]
        assert first.size == second.size == 7  # type: ignore[attr-defined]
        assert one.backend("knobbed", {"image": "three"}).settings.image == "three"  # type: ignore[attr-defined]
        assert one.backend("knobbed") is one.backend("knobbed")  # one instance per set of options

    def test_an_unknown_option_names_the_ones_it_takes(self, knobbed: type[Knobbed]) -> None:
        with pytest.raises(ConfigError, match="no option 'imag'; it takes: image, size"):
            AsyncRunner(Settings(), options={"knobbed": {"imag": "x"}}).backend("knobbed")

    def test_an_invalid_option_is_raised_on_use_naming_backend_and_variable(self, knobbed: type[Knobbed]) -> None:
        backend = AsyncRunner(Settings(), options={"knobbed": {"size": 0}}).backend("knobbed")  # constructing is fine
        with pytest.raises(ConfigError, match="CODE_EXEC_KNOBBED_SIZE") as info:
            backend.settings  # noqa: B018
        assert info.value.backend == "knobbed"

    def test_options_without_a_backend_name_are_refused(self) -> None:
        with pytest.raises(ConfigError, match="name the backend"):
            with execbox.sandbox(image="x"):
                pass


class TestCheckRule:
    def test_a_success_is_trusted_for_the_ttl_then_probed_again(self, knobbed: type[Knobbed],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        now = [1000.0]
        monkeypatch.setattr(backend_module.time, "monotonic", lambda: now[0])
        backend = AsyncRunner(Settings()).backend("knobbed")
        anyio.run(backend.check)
        anyio.run(backend.check)
        assert knobbed.probes == 1
        now[0] += backend_module.CHECK_TTL_S + 1
        anyio.run(backend.check)
        assert knobbed.probes == 2

    def test_a_failure_is_never_cached(self, knobbed: type[Knobbed], monkeypatch: pytest.MonkeyPatch) -> None:
        answers: list[Any] = [execbox.BackendUnavailableError("down"), Knobbed.capabilities]

        async def probe(self: Knobbed) -> Capabilities:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer  # type: ignore[no-any-return]

        monkeypatch.setattr(Knobbed, "probe", probe)
        backend = AsyncRunner(Settings()).backend("knobbed")
        with pytest.raises(execbox.BackendUnavailableError):
            anyio.run(backend.check)
        assert anyio.run(backend.check) == Knobbed.capabilities


class TestLifecycle:
    def test_a_runner_closes_the_backends_it_made(self, knobbed: type[Knobbed]) -> None:
        with Runner(Settings()) as runner:
            runner.aio.backend("knobbed")
            runner.aio.backend("knobbed", {"image": "other"})
        assert knobbed.closed == 2

    def test_an_async_runner_too(self, knobbed: type[Knobbed]) -> None:
        async def go() -> None:
            async with AsyncRunner(Settings()) as runner:
                runner.backend("knobbed")

        anyio.run(go)
        assert knobbed.closed == 1


class TestAutoTrust:
    def test_auto_does_not_pick_a_plugin_on_its_own_claim(self, fake_backends: object, home: object,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("EXECBOX_AUTO_PLUGINS")
        with pytest.raises(execbox.BackendUnavailableError) as info:
            Runner(Settings()).run(["true"])
        assert "fake_sandbox (third-party, from 'execbox-test-fakes')" in info.value.message
        assert "EXECBOX_AUTO_PLUGINS" in info.value.message

    def test_named_by_the_operator_it_is_considered(self, fake_backends: object, home: object,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("EXECBOX_AUTO_PLUGINS", "fake_namespace")
        assert Runner(Settings()).run(["true"]).backend == "fake_namespace"


class TestOneErrorTree:
    def test_an_unexpected_exception_from_a_backend_is_a_sandbox_error_naming_it(
            self, knobbed: type[Knobbed], monkeypatch: pytest.MonkeyPatch, home: object) -> None:
        async def broken(self: Knobbed, spec: SessionSpec) -> HostWorkspaceSession:
            raise KeyError("a bug in the plugin")

        monkeypatch.setattr(Knobbed, "open_session", broken)
        with pytest.raises(execbox.SandboxError, match="backend 'knobbed' failed unexpectedly: KeyError") as info:
            Runner(Settings(local=True)).run(["true"], backend="knobbed")
        assert info.value.backend == "knobbed" and isinstance(info.value.__cause__, KeyError)
