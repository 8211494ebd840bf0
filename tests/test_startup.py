"""Start-up (issue 16): a fresh process imports only what the chosen path needs.

Each check runs a fresh interpreter and reads its ``sys.modules``: no timing here (the speed itself is measured
outside the suite); what is asserted is which modules a path loads, each with a control that shows the same
probe does see the module once the path needs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import execbox.backends
import execbox.cli
from execbox import BackendUnavailableError, PluginError, Runner, Settings
from execbox.registry import PluginWarning, get_registry
from execbox.testing import engine_missing
from tests.support.fixtures import FakeDistributions, fake_dists, fresh_registry, home, local_mode  # noqa: F401 (fixtures)

EXECBOX_SCRIPT = Path(sys.executable).with_name("execbox")
BUILTINS = ["bubblewrap", "daytona", "docker", "gvisor", "local_subprocess", "modal", "ray", "singularity", "ssh",
            "vercel_sandbox"]
# Never needed to run a command on a local backend, or to start the CLI.
HEAVY = ["docker", "paramiko", "cryptography", "invoke", "execbox.backends.ssh", "execbox.backends.bubblewrap",
         "execbox.backends.modal", "execbox.backends.daytona", "execbox.backends.vercel_sandbox",
         "execbox.backends.singularity", "execbox.backends.gvisor", "execbox.kernel.client", "execbox.mcp", "ray",
         "execbox.backends.ray"]


def _fresh(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> list[str]:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last. Returns that line, parsed."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=cwd)
    assert done.returncode == 0, done.stderr
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


def _heavy_loaded(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> list[str]:
    probe = f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    return _fresh(textwrap.dedent(code) + probe, env, cwd)


def test_importing_execbox_imports_none_of_its_parts() -> None:
    loaded = _fresh("""
        import json, sys
        import execbox
        from execbox import hookimpl  # what a plugin module imports
        print(json.dumps([m for m in ("execbox.runner", "execbox.contract.models", "pydantic") if m in sys.modules]))
    """)
    assert loaded == []


def test_a_public_name_loads_its_module_on_first_use() -> None:
    """The control of the test above: the probe sees the runner once a name that lives there is used."""
    loaded = _fresh("""
        import json, sys
        import execbox
        execbox.Runner
        print(json.dumps([m for m in ("execbox.runner", "execbox.contract.models") if m in sys.modules]))
    """)
    assert loaded == ["execbox.runner", "execbox.contract.models"]


def test_a_lazy_name_whose_module_fails_says_why(tmp_path: Path) -> None:
    # Found reviewing: a module shadowing the stdlib's inspect made `from execbox import Runner` say only "cannot
    # import name 'Runner'" (a from-import turns the AttributeError inside into that), hiding the cause.
    (tmp_path / "inspect.py").write_text("")
    done = subprocess.run([sys.executable, "-c", "from execbox import Runner"], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=60)
    assert done.returncode != 0
    assert "importing execbox.runner failed" in done.stderr and "getsource" in done.stderr, done.stderr[-800:]


def test_importing_the_cli_imports_no_backend_and_no_sdk() -> None:
    assert _heavy_loaded("import execbox.cli") == []


def test_a_local_run_imports_no_other_backend_and_no_sdk(tmp_path: Path) -> None:
    code = """
        from execbox import Runner, Settings
        result = Runner(Settings.from_env(local=True, network="host")).run(["true"], backend="local_subprocess")
        assert result.exit_code == 0, result
    """
    assert _heavy_loaded(code, {"HOME": str(tmp_path)}, cwd=tmp_path) == []


def test_the_registry_imports_only_the_backend_asked_for() -> None:
    code = """
        import json, sys
        from execbox.registry import get_registry
        registry = get_registry([])
        before = sorted(m for m in sys.modules if m.startswith("execbox.backends."))
        registry.get("docker")
        after = sorted({m.split(".")[2] for m in sys.modules if m.startswith("execbox.backends.")})
        listed = registry.names()  # listing every backend imports every backend
        everything = sorted({m.split(".")[2] for m in sys.modules if m.startswith("execbox.backends.")})
        print(json.dumps([before, after, listed, everything]))
    """
    before, after, listed, everything = _fresh(code)  # type: ignore[misc]
    assert before == []
    assert after == ["docker"]
    assert listed == BUILTINS
    assert set(BUILTINS) <= set(everything)


class TestLazyRegistration:
    """``register("module:Class", name=...)``: known by name at once, imported and checked on first use."""

    @pytest.fixture(autouse=True)
    def only_lazy_builtins(self, fake_dists: FakeDistributions,  # noqa: F811
                           monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(execbox.backends, "BUILTIN_BACKENDS", [
            "local_subprocess = execbox.backends.local_subprocess:LocalSubprocessBackend",
            "fake_sandbox = tests.support.fakes_plugin:FakeSandbox",
        ])

    def test_entries_are_registered_without_importing_them(self) -> None:
        registry = get_registry()
        assert sorted(registry.entries) == ["fake_sandbox", "local_subprocess"]
        assert not any(entry.loaded for entry in registry.entries.values())
        assert registry.get("fake_sandbox").cls.name == "fake_sandbox"
        assert registry.entries["fake_sandbox"].loaded and not registry.entries["local_subprocess"].loaded

    def test_a_lazy_backend_runs(self, local_mode: None) -> None:  # noqa: F811
        result = Runner(Settings.from_env()).run(["echo", "hi"], backend="local_subprocess")
        assert (result.backend, result.stdout) == ("local_subprocess", "hi\n")

    def test_a_name_that_is_not_the_class_name_is_an_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(execbox.backends, "BUILTIN_BACKENDS",
                            ["impostor = execbox.backends.local_subprocess:LocalSubprocessBackend"])
        registry = get_registry()
        with pytest.warns(PluginWarning, match="'impostor'"):
            with pytest.raises(PluginError, match="'impostor'.*named 'local_subprocess'"):
                registry.get("impostor")
        with pytest.raises(PluginError, match="'impostor'.*named 'local_subprocess'"):  # the same reason again
            registry.get("impostor")

    def test_a_listing_leaves_a_misnamed_entry_out_with_a_warning(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # Found reviewing: a plugin's misnamed lazy entry crashed `execbox backends` and `execbox doctor`.
        monkeypatch.setattr(execbox.backends, "BUILTIN_BACKENDS", [
            *execbox.backends.BUILTIN_BACKENDS, "impostor = execbox.backends.local_subprocess:LocalSubprocessBackend"])
        with pytest.warns(PluginWarning, match="'impostor'"):
            assert get_registry().names() == ["fake_sandbox", "local_subprocess"]
        with pytest.raises(PluginError, match="'impostor'"):
            get_registry().get("impostor")

    def test_a_module_that_fails_to_import_is_a_warning_and_named_when_asked_for(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(execbox.backends, "BUILTIN_BACKENDS", [
            *execbox.backends.BUILTIN_BACKENDS, "broken = execbox_no_such_module_anywhere:Backend"])
        registry = get_registry()
        assert "broken" in registry.entries
        with pytest.warns(PluginWarning, match="'broken'.*execbox_no_such_module_anywhere"):
            with pytest.raises(BackendUnavailableError, match="'broken' cannot be loaded"):
                registry.get("broken")
        assert registry.names() == ["fake_sandbox", "local_subprocess"]
        assert len(registry.problems) == 1
        with pytest.raises(BackendUnavailableError, match="'broken' cannot be loaded.*execbox_no_such_module"):
            registry.get("broken")  # asked again: the same reason, not "unknown backend"

    def test_the_listing_leaves_a_broken_module_out_with_a_warning(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(execbox.backends, "BUILTIN_BACKENDS", [
            *execbox.backends.BUILTIN_BACKENDS, "broken = execbox_no_such_module_anywhere:Backend"])
        with pytest.warns(PluginWarning, match="'broken'"):
            assert get_registry().names() == ["fake_sandbox", "local_subprocess"]

    @pytest.mark.parametrize("source", [
        "register('tests.support.fakes_plugin:FakeSandbox')",  # no name: it cannot be known before the import
        "register('not a reference', name='acme')",
        "register('tests.support.fakes_plugin:FakeSandbox', name='Bad-Name')",
    ])
    def test_a_malformed_lazy_registration_is_an_error(self, fake_dists: FakeDistributions,  # noqa: F811
                                                       source: str) -> None:
        fake_dists.add("sloppy", source=f"from execbox import hookimpl\n@hookimpl\n"
                                        f"def execbox_register_backends(register):\n    {source}\n")
        with pytest.raises(PluginError, match="'sloppy'"):
            get_registry()

    def test_a_third_party_plugin_may_register_by_name(self, fake_dists: FakeDistributions) -> None:  # noqa: F811
        fake_dists.add("acme", source="from execbox import hookimpl\n@hookimpl\n"
                                      "def execbox_register_backends(register):\n"
                                      "    register('tests.support.fakes_plugin:FakeNamespace',"
                                      " name='fake_namespace')\n")
        entry = get_registry().get("fake_namespace")
        assert (entry.distribution, entry.cls.name) == ("acme", "fake_namespace")


@pytest.fixture
def docker_py() -> None:
    if importlib.util.find_spec("docker") is None:
        pytest.skip("docker-py is not installed")


@pytest.fixture
def no_docker_config(tmp_path: Path) -> Iterator[dict[str, str]]:
    yield {"HOME": str(tmp_path), "DOCKER_CONFIG": str(tmp_path / "docker-config"), "DOCKER_HOST": ""}


IMPORT_DOCKER = """
    import json, sys
    from execbox.backends.docker.backend import _import_docker
    docker = _import_docker()
    print(json.dumps([hasattr(docker.transport, "SSHHTTPAdapter"), "paramiko" in sys.modules,
                      "docker.transport.sshconn" in sys.modules]))
"""


def test_docker_py_is_imported_without_its_ssh_transport(docker_py: None, no_docker_config: dict[str, str]) -> None:
    assert _fresh(IMPORT_DOCKER, no_docker_config) == [False, False, False]


@pytest.mark.parametrize("how", ["DOCKER_HOST", "DOCKER_CONTEXT", "currentContext"])
def test_docker_py_keeps_its_ssh_transport_when_the_engine_may_be_ssh(docker_py: None, how: str,
                                                                     no_docker_config: dict[str, str]) -> None:
    env = dict(no_docker_config)
    if how == "DOCKER_HOST":
        env["DOCKER_HOST"] = "ssh://nobody@engine.invalid"
    elif how == "DOCKER_CONTEXT":
        env["DOCKER_CONTEXT"] = "remote"
    else:
        config = Path(env["DOCKER_CONFIG"])
        config.mkdir()
        (config / "config.json").write_text(json.dumps({"currentContext": "remote"}))
    assert _fresh(IMPORT_DOCKER, env) == [True, True, True]


def test_docker_py_imported_earlier_is_left_as_it_is(docker_py: None, no_docker_config: dict[str, str]) -> None:
    """A program that imported docker itself keeps its ssh transport: only the first import is ours."""
    assert _fresh("import docker\n" + textwrap.dedent(IMPORT_DOCKER), no_docker_config) == [True, True, True]


def _run_cli(tmp_path: Path, *args: str, argv0: str) -> subprocess.CompletedProcess[str]:
    """``execbox run`` in a fresh process whose argv[0] is ``argv0``; an atexit handler and a finalizer of its own
    say whether they ran (on fd 1, which outlives sys.stdout)."""
    code = textwrap.dedent(f"""
        import atexit, os, sys
        atexit.register(lambda: os.write(1, b"[atexit ran]"))
        class Finalized:
            def __del__(self):
                os.write(1, b"[teardown ran]")
        kept = Finalized()
        sys.argv = [{argv0!r}, "run", *{list(args)!r}]
        from execbox.cli import main
        main()
    """)
    env = {**os.environ, "HOME": str(tmp_path), "CODE_EXEC_LOCAL": "true", "CODE_EXEC_NETWORK": "host"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)


@pytest.mark.parametrize("command, code", [(["sh", "-c", "echo out; echo err >&2; exit 3"], 3),
                                           (["true"], 0)])
@pytest.mark.parametrize("argv0", [str(EXECBOX_SCRIPT), str(Path(execbox.cli.__file__).with_name("__main__.py"))],
                         ids=["execbox", "python -m execbox.cli"])
def test_execbox_run_ends_without_the_interpreter_teardown(tmp_path: Path, command: list[str], code: int,
                                                           argv0: str) -> None:
    done = _run_cli(tmp_path, "--backend", "local_subprocess", "--", *command, argv0=argv0)
    assert done.returncode == code, done.stderr
    assert "[atexit ran]" in done.stdout and "[teardown ran]" not in done.stdout
    if code:
        assert done.stdout.startswith("out\n") and done.stderr == "err\n"


def test_execbox_run_called_by_another_program_exits_as_usual(tmp_path: Path) -> None:
    """The control: when the process is not the execbox program, main() raises SystemExit and the interpreter
    tears down as always (the finalizer runs)."""
    done = _run_cli(tmp_path, "--backend", "local_subprocess", "--", "sh", "-c", "exit 3", argv0="other-program")
    assert done.returncode == 3, done.stderr
    assert "[atexit ran]" in done.stdout and "[teardown ran]" in done.stdout


def test_the_execbox_script_prints_and_exits_like_the_command(tmp_path: Path) -> None:
    if not EXECBOX_SCRIPT.exists():
        pytest.skip(f"no execbox script next to {sys.executable}")
    env = {**os.environ, "HOME": str(tmp_path), "CODE_EXEC_LOCAL": "true", "CODE_EXEC_NETWORK": "host"}
    done = subprocess.run([str(EXECBOX_SCRIPT), "run", "--backend", "local_subprocess", "--json", "--",
                           "sh", "-c", "echo hi; exit 5"], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert done.returncode == 5, done.stderr
    assert json.loads(done.stdout)["stdout"] == "hi\n"


def test_a_docker_run_imports_no_other_backend_and_not_paramiko(docker_py: None, tmp_path: Path) -> None:
    from execbox.backends.docker.engine import connect

    try:
        connect()[0].close()
    except BackendUnavailableError as exc:
        engine_missing(f"no Docker engine: {exc}")
    code = """
        import json, sys
        from execbox import Runner, Settings
        result = Runner(Settings.from_env()).run(["true"], backend="docker")
        assert result.exit_code == 0, result
        probe = ["docker", "paramiko", "invoke", "execbox.backends.ssh", "execbox.backends.bubblewrap",
                 "execbox.backends.modal"]
        print(json.dumps(sorted(m for m in probe if m in sys.modules)))
    """
    try:
        loaded = _fresh(code, {"HOME": str(tmp_path)}, cwd=tmp_path)
    except AssertionError as exc:
        if "is not on the engine" in str(exc):  # the sandbox image: tests/backends/test_docker.py builds it
            engine_missing(f"the sandbox image is missing: {exc}")
        raise
    assert loaded == ["docker"]


@pytest.mark.parametrize("extra, loaded", [({}, False), ({"TRACEPARENT": "00-4bf92f3577b34da6a3ce929d0e0e4736-"
                                                                         "00f067aa0ba902b7-01"}, False),
                                           ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, True)],
                         ids=["plain", "a traceparent alone", "control: an OTLP endpoint"])
def test_a_run_imports_opentelemetry_only_to_export(tmp_path: Path, extra: dict[str, str], loaded: bool) -> None:
    """`execbox run` loads opentelemetry only when OTEL_EXPORTER_OTLP_* is set: a TRACEPARENT alone, with nothing
    that records, changes nothing. (Probed at exit: the command ends the process.)"""
    code = """
        import atexit, json, os, sys
        atexit.register(lambda: os.write(1, ("\\n" + json.dumps(sorted(
            m for m in sys.modules if m.startswith("opentelemetry")))).encode()))
        sys.argv = ["execbox", "run", "--backend", "local_subprocess", "--", "true"]
        from execbox.cli import main
        main()
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACE"))}
    env.update(HOME=str(tmp_path), CODE_EXEC_LOCAL="true", CODE_EXEC_NETWORK="host", CODE_EXEC_AUDIT_LOG="off",
               **extra)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout.splitlines()[-1])
    assert bool(modules) == loaded and ("opentelemetry.sdk.trace" in modules) == loaded, modules
