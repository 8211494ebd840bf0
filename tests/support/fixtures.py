"""Fixtures shared by the tests of the runner and its layers, tests/test_api.py and tests/test_cli.py (import them
from here)."""

from __future__ import annotations

import sys
import tempfile
import uuid
from collections.abc import Iterator
from importlib.metadata import distributions
from pathlib import Path

import pytest

import execbox.backends
from execbox import registry as plugins

LOCAL_BUILTIN = "local_subprocess = execbox.backends.local_subprocess:LocalSubprocessBackend"


class FakeDistributions:
    """Installed distributions for the plugin loader, made of real dist-info directories under a tmp dir.

    ``execbox.registry.entry_points`` is replaced by a function that reads only these, so the entry
    points carry a real ``dist`` (with its name) and no plugin installed in the venv interferes.
    """

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dists = root / "site"
        self.dists.mkdir()
        self.modules: list[str] = []
        monkeypatch.syspath_prepend(str(self.dists))
        monkeypatch.setattr(plugins, "entry_points", self._entry_points)

    def _entry_points(self, *, group: str) -> list:
        return [ep for dist in distributions(path=[str(self.dists)]) for ep in dist.entry_points if ep.group == group]

    def add(self, dist: str, *, ep_name: str | None = None, value: str | None = None, source: str | None = None) -> str:
        """Install distribution ``dist`` with one entry point in the execbox group.

        Give ``value`` (an importable "module[:attr]") or ``source`` (the text of a new plugin module, written
        under a fresh name). Returns the entry point's value.
        """
        if source is not None:
            module = f"execbox_testplugin_{uuid.uuid4().hex[:10]}"
            (self.dists / f"{module}.py").write_text(source)
            self.modules.append(module)
            value = module
        assert value, "give value or source"
        info = self.dists / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[execbox]\n{ep_name or dist.replace('-', '_')} = {value}\n")
        return value

    def cleanup(self) -> None:
        for module in self.modules:
            sys.modules.pop(module, None)


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """Every test builds the plugin registry itself: the cache holds the previous test's fakes."""
    plugins._cache.clear()
    yield
    plugins._cache.clear()


@pytest.fixture
def fake_dists(tmp_path_factory: pytest.TempPathFactory,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDistributions]:
    fakes = FakeDistributions(tmp_path_factory.mktemp("dists"), monkeypatch)
    yield fakes
    fakes.cleanup()


@pytest.fixture
def only_local_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-ins reduced to local_subprocess: other backends are being written concurrently."""
    monkeypatch.setattr(execbox.backends, "BUILTIN_BACKENDS", [LOCAL_BUILTIN])


@pytest.fixture
def fake_backends(only_local_builtin: None, fake_dists: FakeDistributions,
                  monkeypatch: pytest.MonkeyPatch) -> FakeDistributions:
    """Registered: local_subprocess (built-in) and fake_sandbox, fake_namespace, fake_down (an entry point), which
    the operator lets `auto` pick (EXECBOX_AUTO_PLUGINS)."""
    from tests.support.fakes_plugin import DISTRIBUTION

    fake_dists.add(DISTRIBUTION, ep_name="fakes", value="tests.support.fakes_plugin")
    monkeypatch.setenv("EXECBOX_AUTO_PLUGINS", DISTRIBUTION)
    return fake_dists


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME with the current directory in a project under it: the seed scan sees only what a test writes."""
    home = tmp_path / "home"
    project = home / "project"
    project.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(project)
    return home


@pytest.fixture
def local_mode(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """The environment under which local_subprocess is admitted: local mode, network host."""
    monkeypatch.setenv("CODE_EXEC_LOCAL", "true")
    monkeypatch.setenv("CODE_EXEC_NETWORK", "host")
    monkeypatch.setenv("CODE_EXEC_BACKEND", "local_subprocess")


@pytest.fixture
def workspaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where local_subprocess makes its temporary workspaces, so a test can see them go."""
    root = tmp_path / "workspaces"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
