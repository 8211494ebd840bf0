"""The singularity backend against the fake apptainer: the exact command lines, env, sessions, errors, gc."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import anyio
import pytest

from execbox import BackendUnavailableError, NotASandboxError, Runner, Settings
from execbox.backends.singularity import SingularityBackend
from execbox.fakes import apptainer as fake
from execbox.testing import engine_missing


class Fake:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        if not fake.bwrap_usable():
            engine_missing("the fake apptainer runs containers through bubblewrap, which cannot make namespaces here")
        self.tmp, self.monkeypatch = tmp_path, monkeypatch
        self.bin = tmp_path / "bin"
        self.state = tmp_path / "state"
        self.image = tmp_path / "python.sif"
        self.image.write_bytes(b"fake image")
        self.workspaces = tmp_path / "workspaces"
        self.workspaces.mkdir()
        monkeypatch.setenv("CODE_EXEC_SINGULARITY_IMAGE", str(self.image))
        monkeypatch.setenv("CODE_EXEC_SINGULARITY_TMPDIR", str(self.workspaces))

    def install(self, name: str = "apptainer", **kw) -> Path:
        return fake.install(self.bin, name, log_file=self.log_path(name), state=self.state, **kw)

    def log_path(self, name: str = "apptainer") -> Path:
        return self.tmp / f"{name}.log"

    def records(self, name: str = "apptainer") -> list[dict]:
        path = self.log_path(name)
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def argvs(self, name: str = "apptainer") -> list[list[str]]:
        return [r["argv"] for r in self.records(name)]

    def runner(self, **settings) -> Runner:
        return Runner(Settings.from_env(backend="singularity", **settings))


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    return Fake(tmp_path, monkeypatch)


@pytest.fixture
def apptainer(env: Fake) -> Fake:
    env.monkeypatch.setenv("CODE_EXEC_SINGULARITY_BINARY", str(env.install("apptainer")))
    return env


def runs(argvs: list[list[str]]) -> list[list[str]]:
    """The exec command lines that ran the caller's command (not the probes of check())."""
    return [a for a in argvs if a[1] == "exec" and a[-1] != "true"]


def test_oneshot_command_line_is_exact(apptainer: Fake) -> None:
    result = apptainer.runner().run(["sh", "-c", "pwd; cat sub/in.txt"], network="none", files={"sub/in.txt": b"x"})
    assert result.exit_code == 0 and result.stdout == "/workspace\nx"
    probes = [a for a in apptainer.argvs() if a[-1] == "true"]
    assert [a[:2] for a in apptainer.argvs()[:1]] == [["apptainer", "--version"]]
    assert len(probes) == 2 and probes[1][7:10] == ["--net", "--network", "none"]
    (run,) = runs(apptainer.argvs())
    host_ws = run[6].split(":")[0]
    assert run == ["apptainer", "exec", "--containall", "--cleanenv", "--no-home", "--bind", f"{host_ws}:/workspace",
                   "--net", "--network", "none", "--pwd", "/workspace", str(apptainer.image),
                   "sh", "-c", "pwd; cat sub/in.txt"]
    assert host_ws.startswith(str(apptainer.workspaces)) and not os.path.exists(host_ws)


def test_network_host_has_no_net_flags_and_is_not_a_sandbox(apptainer: Fake) -> None:
    with pytest.raises(NotASandboxError):
        apptainer.runner().run(["true"], network="host")
    assert apptainer.runner(local=True).run(["true"], network="host").exit_code == 0
    (run,) = [a for a in apptainer.argvs() if a[1] == "exec" and "--pwd" in a]
    assert "--net" not in run and "--network" not in run


def test_env_goes_through_the_prefix_and_nothing_else(apptainer: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPTAINERENV_INJECTED", "from-the-host")
    monkeypatch.setenv("HOST_ONLY", "leak")
    result = apptainer.runner().run(["sh", "-c", "echo $VISIBLE/$INJECTED/$HOST_ONLY/$OPENAI_API_KEY"],
                                    env={"VISIBLE": "yes", "OPENAI_API_KEY": "sk"})
    assert result.stdout == "yes///\n"
    (record,) = [r for r in apptainer.records() if r["argv"][1] == "exec" and r["argv"][-1] != "true"]
    assert set(record["env"]) == {"APPTAINERENV_VISIBLE", "APPTAINERENV_EXECBOX_RUN_ID", "APPTAINERENV_LANG",
                                  "APPTAINERENV_TMPDIR", "APPTAINERENV_PYTHONUNBUFFERED"}


def test_singularity_binary_and_its_prefix(env: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    env.install("singularity")
    monkeypatch.setenv("PATH", f"{env.bin}{os.pathsep}{os.environ['PATH']}")
    result = env.runner().run(["sh", "-c", "echo $VISIBLE"], env={"VISIBLE": "through SINGULARITYENV_"})
    assert result.stdout == "through SINGULARITYENV_\n"
    (record,) = [r for r in env.records("singularity") if r["argv"][1] == "exec" and r["argv"][-1] != "true"]
    assert record["argv"][0] == "singularity" and "SINGULARITYENV_VISIBLE" in record["env"]
    # with both on PATH, apptainer wins
    env.install("apptainer")
    backend = SingularityBackend(Settings.from_env())
    assert Path(backend.binary).name == "apptainer"


def test_session_is_an_instance(apptainer: Fake) -> None:
    with apptainer.runner().sandbox("singularity", network="none") as sb:
        assert sb.exec("echo kept > state.txt").exit_code == 0
        assert sb.exec(["cat", "state.txt"]).stdout == "kept\n"
        (start,) = [a for a in apptainer.argvs() if a[1:3] == ["instance", "start"]]
        name = start[-1]
        host_ws = start[7].split(":")[0]
        assert start == ["apptainer", "instance", "start", "--containall", "--cleanenv", "--no-home",
                         "--bind", f"{host_ws}:/workspace", "--net", "--network", "none", str(apptainer.image), name]
        assert name.startswith(f"execbox-{os.getpid()}-")
        execs = [a for a in apptainer.argvs() if a[1] == "exec" and f"instance://{name}" in a]
        assert execs[-1] == ["apptainer", "exec", "--cleanenv", "--pwd", "/workspace", f"instance://{name}",
                             "cat", "state.txt"]
    assert apptainer.argvs()[-1] == ["apptainer", "instance", "stop", "-t", "5", name]
    assert not os.path.exists(host_ws)
    assert json.loads(subprocess.run([str(apptainer.bin / "apptainer"), "instance", "list", "--json"],
                                     capture_output=True, text=True).stdout) == {"instances": []}


def test_timeout_in_a_session_kills_the_runs_marker_inside_the_instance(apptainer: Fake) -> None:
    with apptainer.runner().sandbox("singularity", network="none") as sb:
        result = sb.exec(["sleep", "100"], timeout=1)
        assert result.timed_out
        kill = apptainer.argvs()[-1]
        assert kill[1:3] == ["exec", kill[2]] and kill[2].startswith("instance://execbox-")
        assert kill[3:5] == ["/bin/sh", "-c"] and "EXECBOX_RUN_ID" in kill[5] and len(kill[-1]) == 16


def test_host_without_network_namespaces_offers_only_host_network(env: Fake) -> None:
    env.monkeypatch.setenv("CODE_EXEC_SINGULARITY_BINARY", str(env.install("apptainer", deny_net=True)))
    runner = env.runner()
    backend = runner.aio.backend("singularity")
    caps = anyio.run(backend.check)
    assert caps.network_modes == frozenset({"host"})
    assert any("--net --network none" in note for note in backend.notes())
    from execbox import UnsupportedPolicyError

    with pytest.raises(UnsupportedPolicyError, match="network mode 'none'"):
        runner.run(["true"], network="none")


def test_missing_binary_and_missing_image(env: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(env.tmp / "empty"))
    with pytest.raises(BackendUnavailableError, match="neither apptainer nor singularity") as info:
        env.runner().run(["true"])
    assert "install Apptainer" in info.value.message
    monkeypatch.setenv("CODE_EXEC_SINGULARITY_BINARY", str(env.install()))
    monkeypatch.setenv("CODE_EXEC_SINGULARITY_IMAGE", str(env.tmp / "missing.sif"))
    with pytest.raises(BackendUnavailableError, match="missing.sif does not exist") as info:
        env.runner().run(["true"])
    assert info.value.env_var == "CODE_EXEC_SINGULARITY_IMAGE"


def test_gc_removes_what_dead_processes_left(apptainer: Fake) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    app = str(apptainer.bin / "apptainer")
    for name in (f"execbox-{dead.pid}-abc123", f"execbox-{os.getpid()}-def456", "someone-elses"):
        subprocess.run([app, "instance", "start", str(apptainer.image), name], check=True, capture_output=True)
    stale = apptainer.workspaces / f"execbox-sing-{dead.pid}-x1"
    live = apptainer.workspaces / f"execbox-sing-{os.getpid()}-x2"
    stale.mkdir()
    live.mkdir()
    removed = anyio.run(SingularityBackend(Settings.from_env()).gc)
    assert sorted(removed) == sorted([f"instance execbox-{dead.pid}-abc123", str(stale)])
    left = json.loads(subprocess.run([app, "instance", "list", "--json"], capture_output=True, text=True).stdout)
    assert sorted(i["instance"] for i in left["instances"]) == [f"execbox-{os.getpid()}-def456", "someone-elses"]
    assert live.exists() and not stale.exists()
