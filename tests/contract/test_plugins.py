"""The plugin registry: built-ins through the same hook as third parties, broken plugins are warnings,
duplicate names are errors naming both distributions, EXECBOX_LOAD_PLUGINS / EXECBOX_DISABLE_PLUGINS select."""

from __future__ import annotations

import sys

import pytest

import execbox.backends
from execbox import NotASandboxError, PluginError, Runner, Settings
from execbox import registry as plugins
from execbox.registry import PluginWarning, get_registry
from tests.support.fixtures import LOCAL_BUILTIN, FakeDistributions


def backend_plugin(*names: str, sandbox: bool = True, hook: str = "execbox_register_backends") -> str:
    """The source of a plugin module that registers one backend per name."""
    isolation = "container" if sandbox else "process"
    lines = [
        "from execbox import Capabilities, hookimpl",
        "from execbox.backends.local_subprocess import LocalSubprocessBackend",
        "CLASSES = []",
    ]
    for name in names:
        lines += [
            "class Backend(LocalSubprocessBackend):",
            f"    name = {name!r}",
            f"    capabilities = Capabilities(sandbox={sandbox}, isolation={isolation!r},",
            "        network_modes=frozenset({'none', 'host'}), persistent_sessions=True)",
            "CLASSES.append(Backend)",
        ]
    lines += ["@hookimpl", f"def {hook}(register):", "    for cls in CLASSES:", "        register(cls)"]
    return "\n".join(lines) + "\n"


BROKEN_IMPORT = "import execbox_no_such_module_anywhere\n"


def settings(**kw: object) -> Settings:
    return Settings.from_env(**kw)


def registry_for(s: Settings) -> plugins.Registry:
    return get_registry(s.load_plugins, s.disable_plugins)


@pytest.fixture(autouse=True)
def no_installed_plugins(fake_dists: FakeDistributions, only_local_builtin: None) -> None:
    """Every test here sees only the distributions it adds, and only local_subprocess as a built-in."""


def test_builtins_register_through_the_hook_as_distribution_execbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execbox.backends, "BUILTIN_BACKENDS",
                        [LOCAL_BUILTIN, "fake_sandbox = tests.support.fakes_plugin:FakeSandbox"])
    registry = get_registry()
    assert registry.names() == ["fake_sandbox", "local_subprocess"]
    assert {e.distribution for e in registry.backends.values()} == {"execbox"}
    assert registry.problems == []


def test_a_third_party_backend_is_registered_under_its_distribution(fake_dists: FakeDistributions) -> None:
    fake_dists.add("acme-execbox", source=backend_plugin("acme"))
    entry = get_registry().get("acme")
    assert (entry.name, entry.distribution) == ("acme", "acme-execbox")
    assert get_registry().get("local_subprocess").distribution == "execbox"


def test_plugins_load_lazily_and_once(fake_dists: FakeDistributions, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dists.add("acme-execbox", source=backend_plugin("acme"))
    calls: list[str] = []
    real = plugins.entry_points

    def counting(*, group: str) -> list:
        calls.append(group)
        return real(group=group)

    monkeypatch.setattr(plugins, "entry_points", counting)
    runner = Runner(settings())
    assert calls == []  # building a runner loads nothing
    assert "acme" in runner.aio.registry.backends
    assert "acme" in get_registry().backends
    assert calls == ["execbox"]


def test_a_plugin_that_fails_to_import_is_a_warning_naming_its_distribution(fake_dists: FakeDistributions) -> None:
    fake_dists.add("broken-execbox-plugin", source=BROKEN_IMPORT)
    fake_dists.add("acme-execbox", source=backend_plugin("acme"))
    with pytest.warns(PluginWarning, match="'broken-execbox-plugin' failed to import.*execbox_no_such_module"):
        registry = get_registry()
    assert registry.names() == ["acme", "local_subprocess"]
    assert len(registry.problems) == 1 and "broken-execbox-plugin" in registry.problems[0]


def test_a_plugin_whose_hook_raises_is_a_warning(fake_dists: FakeDistributions) -> None:
    source = ("from execbox import hookimpl\n@hookimpl\ndef execbox_register_backends(register):\n"
              "    raise RuntimeError('boom')\n")
    fake_dists.add("raising-plugin", source=source)
    with pytest.warns(PluginWarning, match="'raising-plugin'.*boom"):
        registry = get_registry()
    assert registry.names() == ["local_subprocess"]


def test_a_misspelled_hookimpl_is_reported_and_registers_nothing(fake_dists: FakeDistributions) -> None:
    fake_dists.add("typo-plugin", source=backend_plugin("typo", hook="execbox_register_backend"))
    with pytest.warns(PluginWarning, match="'typo-plugin' is invalid.*execbox_register_backend"):
        registry = get_registry()
    assert "typo" not in registry.backends


def test_two_backends_with_one_name_is_an_error_naming_both_distributions(fake_dists: FakeDistributions) -> None:
    fake_dists.add("first-dist", source=backend_plugin("twin"))
    fake_dists.add("second-dist", source=backend_plugin("twin"))
    with pytest.raises(PluginError) as info:
        get_registry()
    message = str(info.value)
    assert "'twin'" in message and "'first-dist'" in message and "'second-dist'" in message
    assert "EXECBOX_DISABLE_PLUGINS" in message


def test_a_plugin_reusing_a_builtin_name_is_an_error_naming_execbox(fake_dists: FakeDistributions) -> None:
    fake_dists.add("impostor", source=backend_plugin("local_subprocess", sandbox=True))
    with pytest.raises(PluginError, match="'local_subprocess'.*") as info:
        get_registry()
    assert "'execbox'" in str(info.value) and "'impostor'" in str(info.value)


def test_registering_something_that_is_not_a_backend_is_an_error(fake_dists: FakeDistributions) -> None:
    source = "from execbox import hookimpl\n@hookimpl\ndef execbox_register_backends(register):\n    register(dict)\n"
    fake_dists.add("confused-plugin", source=source)
    with pytest.raises(PluginError, match="'confused-plugin'.*not an ExecutionBackend"):
        get_registry()


def test_a_backend_with_a_bad_name_is_an_error(fake_dists: FakeDistributions) -> None:
    fake_dists.add("shouty", source=backend_plugin("Bad-Name"))
    with pytest.raises(PluginError, match="'shouty'.*class-level name"):
        get_registry()


def test_empty_load_plugins_loads_no_third_party_plugin(fake_dists: FakeDistributions,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dists.add("acme-execbox", source=backend_plugin("acme"))
    broken = fake_dists.add("broken-execbox-plugin", source=BROKEN_IMPORT)
    monkeypatch.setenv("EXECBOX_LOAD_PLUGINS", "")
    registry = registry_for(settings())
    assert registry.names() == ["local_subprocess"]
    assert registry.problems == [] and broken not in sys.modules  # not even imported


@pytest.mark.parametrize("selector", ["acme-execbox", "acme_ep"], ids=["by distribution", "by entry point"])
def test_load_plugins_selects_by_distribution_or_entry_point(fake_dists: FakeDistributions,
                                                             monkeypatch: pytest.MonkeyPatch, selector: str) -> None:
    fake_dists.add("acme-execbox", ep_name="acme_ep", source=backend_plugin("acme"))
    fake_dists.add("other-execbox", source=backend_plugin("other"))
    monkeypatch.setenv("EXECBOX_LOAD_PLUGINS", selector)
    assert registry_for(settings()).names() == ["acme", "local_subprocess"]


@pytest.mark.parametrize("selector", ["broken-execbox-plugin", "broken_ep"], ids=["by distribution", "by entry point"])
def test_disable_plugins_skips_one(fake_dists: FakeDistributions, monkeypatch: pytest.MonkeyPatch,
                                   selector: str, recwarn: pytest.WarningsRecorder) -> None:
    fake_dists.add("broken-execbox-plugin", ep_name="broken_ep", source=BROKEN_IMPORT)
    fake_dists.add("acme-execbox", source=backend_plugin("acme"))
    monkeypatch.setenv("EXECBOX_DISABLE_PLUGINS", selector)
    registry = registry_for(settings())
    assert registry.names() == ["acme", "local_subprocess"]
    assert registry.problems == [] and not [w for w in recwarn if issubclass(w.category, PluginWarning)]


def test_disable_plugins_resolves_a_duplicate(fake_dists: FakeDistributions, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dists.add("first-dist", source=backend_plugin("twin"))
    fake_dists.add("second-dist", source=backend_plugin("twin"))
    monkeypatch.setenv("EXECBOX_DISABLE_PLUGINS", "second-dist")
    assert registry_for(settings()).get("twin").distribution == "first-dist"


def test_builtins_cannot_be_disabled_by_the_plugin_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXECBOX_LOAD_PLUGINS", "")
    monkeypatch.setenv("EXECBOX_DISABLE_PLUGINS", "execbox")
    assert "local_subprocess" in registry_for(settings()).backends


def test_a_third_party_backend_runs_only_through_the_guard(fake_dists: FakeDistributions, home: object) -> None:
    fake_dists.add("acme-execbox", source=backend_plugin("acme_local", sandbox=False))
    with pytest.raises(NotASandboxError, match="acme_local"):
        Runner(settings(network="host")).run(["true"], backend="acme_local")
    result = Runner(settings(network="host", local=True)).run(["echo", "hi"], backend="acme_local")
    assert (result.backend, result.stdout) == ("acme_local", "hi\n")
