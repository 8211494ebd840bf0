"""The singularity backend against the fake apptainer: the exact command lines, env, sessions, errors, gc."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import anyio
import pytest

from execbox import BackendUnavailableError, Limits, NotASandboxError, Runner, SandboxError, Settings
from execbox.backends.singularity import SingularityBackend
from execbox.contract.backend import SessionSpec
from execbox.fakes import apptainer as fake
from execbox.testing import engine_missing
from tests.support.waiting import wait_until


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
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if os.geteuid() == 0:  # started by root apptainer is not a sandbox (its verdict): these tests use local mode
        monkeypatch.setenv("CODE_EXEC_LOCAL", "true")
    fake_env = Fake(tmp_path, monkeypatch)
    yield fake_env
    fake.stop_all(fake_env.state)  # the fake's instances are real processes; a failed test must not leak them


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
        apptainer.runner(local=False).run(["true"], network="host")
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
    assert set(record["env"]) == {"APPTAINERENV_VISIBLE", "APPTAINERENV_EXECBOX_RUN", "APPTAINERENV_LANG",
                                  "APPTAINERENV_TMPDIR", "APPTAINERENV_PYTHONUNBUFFERED"}


def test_only_the_binarys_dir_settings_reach_it(apptainer: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """S4: an HPC module's APPTAINER_BIND / SINGULARITY_BINDPATH would bind host paths into every container."""
    secret = apptainer.tmp / "home-of-the-user"
    secret.mkdir()
    (secret / "id_rsa").write_text("PRIVATE KEY")
    cache = apptainer.tmp / "cache"
    monkeypatch.setenv("APPTAINER_BIND", f"{secret}:/mnt/home")
    monkeypatch.setenv("SINGULARITY_BINDPATH", f"{secret}:/mnt/home2")
    monkeypatch.setenv("APPTAINER_CONTAINALL", "false")
    monkeypatch.setenv("APPTAINER_CACHEDIR", str(cache))
    monkeypatch.setenv("SINGULARITY_TMPDIR", str(apptainer.tmp))
    monkeypatch.setenv("APPTAINER_CONFIGDIR", str(apptainer.tmp / "conf"))
    runner = apptainer.runner()
    result = runner.run(["sh", "-c", "cat /mnt/home/id_rsa /mnt/home2/id_rsa; ls /mnt"])
    assert "PRIVATE KEY" not in result.stdout and result.exit_code != 0
    with runner.sandbox("singularity", network="none") as sb:
        assert "PRIVATE KEY" not in sb.exec("cat /mnt/home/id_rsa /mnt/home2/id_rsa").stdout
    calls = [r for r in apptainer.records() if r["argv"][1] != "--version"]
    assert {r["argv"][1] for r in calls} >= {"exec", "instance"}
    for record in calls:
        assert record["host_env"] == {"APPTAINER_CACHEDIR": str(cache), "SINGULARITY_TMPDIR": str(apptainer.tmp),
                                      "APPTAINER_CONFIGDIR": str(apptainer.tmp / "conf")}, record["argv"]


def test_the_fake_honours_apptainer_bind(apptainer: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: given APPTAINER_BIND, the fake binds it, as Apptainer does."""
    shared = apptainer.tmp / "shared"
    shared.mkdir()
    (shared / "f").write_text("seen")
    monkeypatch.setenv("APPTAINER_BIND", f"{shared}:/mnt/shared")
    done = subprocess.run([str(apptainer.bin / "apptainer"), "exec", "--containall", str(apptainer.image),
                           "cat", "/mnt/shared/f"], capture_output=True, text=True, timeout=60)
    assert done.stdout == "seen", done.stderr


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


# A run whose grandchild leaves the session, clears its environment (no marker left) and is orphaned: inside
# an instance it is re-parented to the instance's init, out of reach of the tree kill.
ESCAPE_IN_INSTANCE = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("env", ["env", "-i", "sh", "-c", "while :; do echo x >> tick; sleep 0.1; done; : " + sys.argv[1]])
    os._exit(0)
while not os.path.exists("tick"):
    time.sleep(0.05)
print("started", flush=True)
time.sleep(1000)
"""


def alive_with(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line]



@pytest.mark.parametrize("pidns", [True, False], ids=["instance-pid-namespace", "allow-pid-ns-no"])
def test_timeout_in_a_session_kills_an_env_clearing_setsid_grandchild(env: Fake, pidns: bool) -> None:
    """L4: the grandchild carries no marker and is not in the caller's tree; it must still die, and the
    session must still work after."""
    env.monkeypatch.setenv("CODE_EXEC_SINGULARITY_BINARY", str(env.install("apptainer", deny_pidns=not pidns)))
    marker = f"escapee-{uuid.uuid4().hex}"
    with env.runner().sandbox("singularity", network="none") as sb:
        # a background process an earlier exec left: it lives on in the instance's PID namespace (without one,
        # execbox's subreaper took it at the end of that exec), and a timeout kills it with everything else
        background = f"sleep 1000; : {marker}-bg"
        assert sb.exec(f"sh -c '{background}' >/dev/null 2>&1 &").exit_code == 0
        assert bool(alive_with(f"{marker}-bg")) is pidns
        result = sb.exec(["python3", "-c", ESCAPE_IN_INSTANCE, marker], timeout=3)
        assert result.timed_out and result.stdout == "started\n"
        assert result.notes == [] or all("attested" not in n and "failed" not in n for n in result.notes)
        assert wait_until(lambda: not alive_with(marker), 5), alive_with(marker)  # the background one too
        first = len(sb.read_file("tick"))
        time.sleep(0.5)
        assert len(sb.read_file("tick")) == first, "the grandchild is still writing"
        assert sb.exec(["echo", "still here"]).stdout == "still here\n"
        kill = [a for a in env.argvs() if "-c" in a and "kill -9 -1" in a[a.index("-c") + 1]]
        (name,) = {a[3] for a in kill}
        assert kill[0][:6] == ["apptainer", "exec", "--cleanenv", name, "/bin/sh", "-c"] and len(kill[0][-2]) == 16


def instances(env: Fake) -> list[str]:
    listed = subprocess.run([str(env.bin / "apptainer"), "instance", "list", "--json"], capture_output=True, text=True)
    return [i["instance"] for i in json.loads(listed.stdout)["instances"]]


def test_cancelled_open_leaves_no_instance_and_no_workspace(env: Fake) -> None:
    """L2: the caller gives up while `instance start` runs (asyncio's own cancellation returns at once while
    the worker thread goes on); what that start makes is stopped and removed when it ends."""
    env.monkeypatch.setenv("CODE_EXEC_SINGULARITY_BINARY", str(env.install("apptainer", start_delay=2)))
    backend = SingularityBackend(Settings.from_env())
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(backend.open_session(SessionSpec("none", Limits(), False, 600)), 0.5))
    assert wait_until(lambda: [a[1:3] for a in env.argvs()] == [["instance", "start"], ["instance", "stop"]], 20)
    assert instances(env) == [] and list(env.workspaces.iterdir()) == []


def test_timed_out_start_leaves_no_instance_and_no_workspace(env: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """L2: `instance start` hits its timeout after the instance came up (exit 124 from execbox's side)."""
    from execbox.backends import singularity

    monkeypatch.setattr(singularity, "_START_TIMEOUT_S", 1.0)
    env.monkeypatch.setenv("CODE_EXEC_SINGULARITY_BINARY", str(env.install("apptainer", start_delay=30)))
    with pytest.raises(SandboxError, match="could not start the instance .*timed out after 1s"):
        anyio.run(SingularityBackend(Settings.from_env()).open_session, SessionSpec("none", Limits(), False, 600))
    assert instances(env) == [] and list(env.workspaces.iterdir()) == []


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


def test_gc_tells_a_reused_pid_from_the_owner(apptainer: Fake) -> None:
    """Instances and workspaces are named pid-starttime (owner_tag), as every backend's: one named by this process's
    pid but another start time was left by a dead process whose pid is now ours, and goes."""
    from execbox.plugin import owner_tag

    app = str(apptainer.bin / "apptainer")
    mine, reused = owner_tag(), f"{os.getpid()}-1"
    for name in (f"execbox-{reused}-abc123", f"execbox-{mine}-def456"):
        subprocess.run([app, "instance", "start", str(apptainer.image), name], check=True, capture_output=True)
    stale = apptainer.workspaces / f"execbox-sing-{reused}-x1"
    live = apptainer.workspaces / f"execbox-sing-{mine}-x2"
    stale.mkdir()
    live.mkdir()
    try:
        removed = anyio.run(SingularityBackend(Settings.from_env()).gc)
        assert sorted(removed) == sorted([f"instance execbox-{reused}-abc123", str(stale)])
        assert live.exists() and not stale.exists()
    finally:
        fake.stop_all(apptainer.state)


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
    try:
        removed = anyio.run(SingularityBackend(Settings.from_env()).gc)
        assert sorted(removed) == sorted([f"instance execbox-{dead.pid}-abc123", str(stale)])
        left = json.loads(subprocess.run([app, "instance", "list", "--json"], capture_output=True, text=True).stdout)
        assert sorted(i["instance"] for i in left["instances"]) == [f"execbox-{os.getpid()}-def456", "someone-elses"]
        assert live.exists() and not stale.exists()
    finally:
        fake.stop_all(apptainer.state)


# --- execbox kill --------------------------------------------------------------------------------------------

def _kill_from_another_runner(sandbox_id: str) -> None:
    from execbox.runner import AsyncRunner, run_blocking

    async def kill() -> None:
        async with AsyncRunner(Settings.from_env(backend="singularity")) as other:
            await other.kill(sandbox_id)

    run_blocking(kill)


def _instances(apptainer: Fake) -> list[str]:
    listed = subprocess.run([str(apptainer.bin / "apptainer"), "instance", "list", "--json"], capture_output=True,
                            text=True, check=True).stdout
    return [i["instance"] for i in json.loads(listed)["instances"]]


def test_kill_stops_a_session_s_instance(apptainer: Fake) -> None:
    from execbox.runner import live

    with apptainer.runner().sandbox("singularity") as sb:
        sb.exec("true")
        ref = json.loads((live.live_dir() / f"{sb.id}.json").read_text())["ref"]
        assert ref in _instances(apptainer)
        _kill_from_another_runner(sb.id)
        assert ref not in _instances(apptainer)
        with pytest.raises(SandboxError, match=r"killed from outside \(`execbox kill`\)"):
            sb.exec("true")


def test_kill_ends_a_one_shot_run_s_processes(apptainer: Fake) -> None:
    import threading

    from execbox.runner import live

    marker = f"oneshot-{uuid.uuid4().hex}"
    said: list[object] = []

    def run() -> None:
        try:
            said.append(apptainer.runner().run(["sh", "-c", f"sleep 300; : {marker}"], timeout=120))
        except SandboxError as exc:
            said.append(exc)

    holder = threading.Thread(target=run)
    holder.start()
    assert wait_until(lambda: list(live.live_dir().glob("*.json")) if live.live_dir().exists() else [], 30)
    sandbox_id = next(live.live_dir().glob("*.json")).stem
    assert wait_until(lambda: marker in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout,
                      30)
    _kill_from_another_runner(sandbox_id)
    holder.join(30)
    assert not holder.is_alive() and isinstance(said[0], SandboxError), said
    assert "killed from outside" in str(said[0])
    assert marker not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("ref", ["execbox-1-2-abc123", "someone-elses", "/tmp", "/tmp/execbox-sing-nope"])
def test_kill_refuses_what_execbox_did_not_start_here(apptainer: Fake, ref: str) -> None:
    with pytest.raises(SandboxError, match="no singularity instance|no sandbox session"):
        anyio.run(SingularityBackend(Settings.from_env()).kill, ref)
