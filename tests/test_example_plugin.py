"""The example third-party package in examples/ is a real plugin: installed with pip, listed by
`execbox backends`, run through the guard, and passing the conformance kit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox import registry as plugins
from execbox.testing.conformance import BackendConformance

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "execbox-unshare"
EXECBOX = str(Path(sys.executable).with_name("execbox"))


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


@pytest.fixture(scope="module", autouse=True)
def installed_example() -> Iterator[None]:
    # --no-build-isolation: hatchling comes from the dev extra, so nothing is downloaded here.
    _pip("install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    plugins._cache.clear()
    yield
    _pip("uninstall", "-y", "execbox-unshare")
    plugins._cache.clear()


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_"))}
    return subprocess.run([EXECBOX, *args], capture_output=True, text=True, env={**clean, **env}, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_backends_lists_the_plugin_with_its_distribution() -> None:
    rows = {row["name"]: row for row in json.loads(_cli("backends", "--json").stdout)}
    assert rows["unshare_net"]["distribution"] == "execbox-unshare"
    assert rows["local_subprocess"]["distribution"] == "execbox"


def test_run_goes_through_the_guard() -> None:
    refused = _cli("run", "--backend", "unshare_net", "--json", "--", "echo", "hi")
    assert refused.returncode == 125
    error = json.loads(refused.stdout)["error"]
    assert error["type"] == "NotASandboxError" and "CODE_EXEC_LOCAL" in error["message"]

    ran = _cli("run", "--backend", "unshare_net", "--json", "--", "echo", "hi", CODE_EXEC_LOCAL="true")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["stdout"] == "hi\n"


def test_disabling_the_plugin_removes_it() -> None:
    rows = json.loads(_cli("backends", "--json", EXECBOX_DISABLE_PLUGINS="execbox-unshare").stdout)
    assert "unshare_net" not in {row["name"] for row in rows}
    rows = json.loads(_cli("backends", "--json", EXECBOX_LOAD_PLUGINS="").stdout)
    assert "unshare_net" not in {row["name"] for row in rows}


class TestExamplePluginConformance(BackendConformance):
    backend_name = "unshare_net"

    @pytest.fixture
    def runner(self) -> Runner:
        return Runner(Settings.from_env(local=True, network="none"))


HOLDER = """
import sys, time
from execbox import Runner, Settings
runner = Runner(Settings.from_env(backend="unshare_net", local=True, network="none"))
with runner.sandbox() as sb:
    print(sb.exec(["sh", "-c", "echo kept > kept.txt && pwd"]).stdout.strip(), flush=True)
    time.sleep(3600)
"""


def test_a_sigkilled_callers_workspace_goes_on_the_next_first_use(tmp_path: Path) -> None:
    """The kit's HostWorkspaceSession names its directory for gc; the plugin sweeps on first use."""
    import signal

    from execbox.plugin import OWNER_FILE, name_owner

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_"))}
    env.update(TMPDIR=str(tmp_path), CODE_EXEC_LOCAL="true")  # a private temp dir: no other process sweeps it
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        workspace = Path(holder.stdout.readline().strip())
        assert (workspace / "kept.txt").read_text() == "kept\n"
        root = workspace.parent
        assert root.parent == tmp_path and name_owner(root.name, "execbox-unshare-") is not None
        assert (root / OWNER_FILE).is_file()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert root.exists()  # nothing cleaned it: only the sweep can
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    ran = subprocess.run([EXECBOX, "run", "--backend", "unshare_net", "--", "true"], env=env, capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, ran.stderr
    assert not root.exists()
