"""The request environment reaches the sandboxed command only, never a host-side process before it.

The proof is a real preload library: its constructor records the name and uid of every process that loads
it. The request sets LD_PRELOAD to it (a file the caller placed in the workspace, as sandboxed code could),
and only the final command may appear in the record: not the python reaper, not `unshare` running as root,
not the shell a launcher starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import distributions
from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox import registry as plugins
from execbox.contract.models import ExecResult, ExecSpec, Limits
from execbox.kit.processes import run_process
from execbox.kit.sessions.host import HostWorkspaceSession
from execbox.policy.env import host_env, sandbox_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "execbox-unshare"

_MARKER_LIB = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

__attribute__((constructor)) static void mark(void) {
    char comm[64] = {0}, line[128];
    int fd = open("/proc/self/comm", O_RDONLY);
    if (fd >= 0) {
        ssize_t n = read(fd, comm, sizeof comm - 1);
        if (n > 0 && comm[n - 1] == '\n') comm[n - 1] = 0;
        close(fd);
    }
    int len = snprintf(line, sizeof line, "%s %d\n", comm, (int)getuid());
    int out = open(MARKER, O_WRONLY | O_CREAT | O_APPEND, 0666);
    if (out >= 0) {
        write(out, line, len);
        close(out);
    }
}
"""


@pytest.fixture
def marker_lib(tmp_path: Path) -> tuple[bytes, Path]:
    """A preload library (its bytes) that appends "<comm> <uid>" of each process loading it to the marker."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the preload library")
    marker = tmp_path / "loaded-by"
    source = tmp_path / "mark.c"
    source.write_text(_MARKER_LIB)
    lib = tmp_path / "mark.so"
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(source)], check=True)
    return lib.read_bytes(), marker


def _loaded_by(marker: Path) -> list[str]:
    return marker.read_text().splitlines() if marker.exists() else []


def _preloaded_run(runner: Runner, backend: str, lib: bytes, marker: Path) -> ExecResult:
    """Place the library in the workspace, then run `true` with LD_PRELOAD pointing at it."""
    with runner.sandbox(backend) as sb:
        sb.write_file("evil.so", lib)
        workspace = sb.exec(["pwd"]).stdout.strip()
        assert _loaded_by(marker) == []
        return sb.exec(["true"], env={"LD_PRELOAD": f"{workspace}/evil.so"})


def test_local_subprocess_preload_reaches_the_command_only(
    marker_lib: tuple[bytes, Path], home: Path, only_local_builtin: None
) -> None:
    lib, marker = marker_lib
    result = _preloaded_run(Runner(Settings.from_env(local=True, network="host")), "local_subprocess", lib, marker)
    assert result.exit_code == 0, result.stderr
    assert _loaded_by(marker) == [f"true {os.getuid()}"]  # loaded by the command, and by nothing else


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plugin pip-installed into a private directory, not the shared venv (other test runs
    install and uninstall it there)."""
    site = tmp_path_factory.mktemp("example-site")
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(EXAMPLE)], check=True)
    return site


@pytest.fixture
def example_plugin(example_site: Path, monkeypatch: pytest.MonkeyPatch, only_local_builtin: None) -> Iterator[None]:
    """The registry sees the built-in local_subprocess and the installed example plugin, nothing else."""
    monkeypatch.syspath_prepend(str(example_site))
    monkeypatch.setattr(plugins, "entry_points", lambda *, group: [
        ep for dist in distributions(path=[str(example_site)]) for ep in dist.entry_points if ep.group == group])
    yield
    sys.modules.pop("execbox_unshare", None)


def test_unshare_plugin_preload_reaches_the_command_only(
    marker_lib: tuple[bytes, Path], home: Path, example_plugin: None
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is not installed")
    lib, marker = marker_lib
    result = _preloaded_run(Runner(Settings.from_env(local=True, network="none")), "unshare_net", lib, marker)
    assert result.exit_code == 0, result.stderr
    # `true` alone, as the namespace's mapped root: not unshare, not its shell, not the reaper
    assert _loaded_by(marker) == ["true 0"]


def test_the_reaper_runs_with_the_host_env_and_the_command_with_exactly_the_request_env(
    home: Path, only_local_builtin: None
) -> None:
    env = {"MULTI": "a\nb=c", "EMPTY": "", "UNI": "h\u00e9llo", "LD_LIBRARY_PATH": "/opt/lib", "BASH_ENV": "/x"}
    probe = "import json, os\nprint(json.dumps([dict(os.environ), open(f'/proc/{os.getppid()}/environ').read()]))"
    with Runner(Settings.from_env(local=True, network="host")).sandbox("local_subprocess") as sb:
        result = sb.exec(["python3", "-c", probe], env=env)
        workspace = sb.exec(["pwd"]).stdout.strip()
    assert result.exit_code == 0, result.stderr
    command, reaper = json.loads(result.stdout)
    assert command == sandbox_env(env, home=workspace)
    assert reaper == "".join(f"{k}={v}\0" for k, v in host_env().items())


class _Launched(HostWorkspaceSession):
    """A session behind a launcher given by a test."""

    def __init__(self, launcher: Callable[[list[str]], list[str]]) -> None:
        super().__init__(prefix="execbox-test-launcher-")
        self._launcher = launcher

    def launcher(self, argv: list[str]) -> list[str]:
        return self._launcher(argv)


def _request(session: HostWorkspaceSession, argv: list[str], env: dict[str, str]) -> ExecSpec:
    return ExecSpec(argv=argv, env=env, timeout=30, max_output_bytes=1 << 16, network="host", limits=Limits(),
                    workdir=session.workspace)


@pytest.mark.anyio
async def test_behind_a_launcher_the_launcher_gets_the_host_env_and_the_command_the_request_env() -> None:
    # The launcher is a shell that records its own environment, then runs what it is given.
    session = _Launched(lambda argv: ["/bin/sh", "-c", 'env > launcher.env; exec "$@"', "sh", *argv])
    try:
        result = await session.exec(_request(session, ["env"], {"FOO": "bar", "LD_PRELOAD": "/nonexistent.so"}))
        launcher_env = (Path(session.workspace) / "launcher.env").read_text()
    finally:
        await session.close()
    assert result.exit_code == 0, result.stderr
    assert "FOO=bar" in result.stdout.splitlines() and "LD_PRELOAD=/nonexistent.so" in result.stdout.splitlines()
    assert "FOO" not in launcher_env and "LD_PRELOAD" not in launcher_env


@pytest.mark.anyio
async def test_a_launcher_that_closes_inherited_descriptors_fails_closed() -> None:
    closer = "import os, sys\nos.closerange(3, 1 << 16)\nos.execvp(sys.argv[1], sys.argv[1:])"
    session = _Launched(lambda argv: ["python3", "-c", closer, *argv])
    try:
        result = await session.exec(_request(session, ["echo", "ran"], {"FOO": "bar"}))
    finally:
        await session.close()
    assert result.exit_code == 126 and result.stdout == ""
    assert "environment did not reach it" in result.stderr


@pytest.mark.anyio
async def test_run_process_never_gives_injection_variables_to_the_host_process(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "KEEP": "1", "LD_PRELOAD": "x.so", "LD_AUDIT": "a.so", "BASH_ENV": "/x",
           "PYTHONPATH": "/p", "NODE_OPTIONS": "--require /x", "GCONV_PATH": "/g"}
    outcome = await run_process(["/usr/bin/env"], env=env, cwd=str(tmp_path), stdin=None, timeout=30,
                                max_output_bytes=1 << 16)
    assert sorted(outcome.stdout.text().splitlines()) == ["KEEP=1", "PATH=/usr/bin:/bin"]


def test_commands_die_of_sigpipe_as_anywhere_else(home: Path, only_local_builtin: None) -> None:
    # Python ignores SIGPIPE; the reaper must not hand that on (`yes` would complain of a broken pipe).
    result = Runner(Settings.from_env(local=True, network="host")).run("yes | head -n 1", backend="local_subprocess")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "y\n", "")
