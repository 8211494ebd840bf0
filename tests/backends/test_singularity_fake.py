"""The fake apptainer/singularity executable: what it answers, what it records, how it runs a command."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from execbox.fakes import apptainer as fake
from execbox.testing import engine_missing


@pytest.fixture
def fake_bin(tmp_path: Path):
    """A fake `apptainer` and `singularity` in a bin dir, each with its own log, sharing one state dir."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    paths = {"bin": bin_dir, "state": state, "image": tmp_path / "img.sif", "ws": tmp_path / "ws"}
    for name in ("apptainer", "singularity"):
        paths[name] = fake.install(bin_dir, name, log_file=tmp_path / f"{name}.log", state=state)
        paths[f"{name}_log"] = tmp_path / f"{name}.log"
    paths["image"].write_bytes(b"fake image")
    paths["ws"].mkdir()
    yield paths
    fake.stop_all(state)  # instances are real processes


def run(binary: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def logged(log: Path) -> list[list[str]]:
    return [json.loads(line)["argv"] for line in log.read_text().splitlines()]


def needs_bwrap() -> None:
    if not fake.bwrap_usable():
        engine_missing("bubblewrap cannot create namespaces here; the fake runs commands through it")


def test_version_per_name(fake_bin) -> None:
    assert run(fake_bin["apptainer"], "--version").stdout.startswith("apptainer version ")
    assert run(fake_bin["singularity"], "--version").stdout.startswith("singularity-ce version ")
    assert logged(fake_bin["apptainer_log"]) == [["apptainer", "--version"]]


def test_exec_binds_workspace_cleans_env_and_denies_network(fake_bin) -> None:
    needs_bwrap()
    result = run(
        fake_bin["apptainer"], "exec", "--containall", "--cleanenv", "--no-home",
        "--bind", f"{fake_bin['ws']}:/workspace", "--pwd", "/workspace", "--net", "--network", "none",
        str(fake_bin["image"]), "sh", "-c", "pwd; echo made > f; echo FOO=$FOO HOSTVAR=$HOSTVAR; "
        "cat /proc/net/dev | tail -n +3 | cut -d: -f1; exit 7",
        env={"APPTAINERENV_FOO": "bar", "HOSTVAR": "leak"},
    )
    assert result.returncode == 7, result.stderr
    lines = result.stdout.split("\n")
    assert lines[:2] == ["/workspace", "FOO=bar HOSTVAR="]
    assert [i.strip() for i in lines[2:] if i.strip()] == ["lo"]
    assert (fake_bin["ws"] / "f").read_text() == "made\n"
    assert logged(fake_bin["apptainer_log"])[0][:12] == [
        "apptainer", "exec", "--containall", "--cleanenv", "--no-home", "--bind", f"{fake_bin['ws']}:/workspace",
        "--pwd", "/workspace", "--net", "--network", "none"]


def test_unknown_flag_and_missing_image_fail(fake_bin) -> None:
    bad = run(fake_bin["apptainer"], "exec", "--bogus", str(fake_bin["image"]), "true")
    assert bad.returncode == 255 and "unknown flag: --bogus" in bad.stderr
    missing = run(fake_bin["apptainer"], "exec", str(fake_bin["image"]) + ".nope", "true")
    assert missing.returncode == 255 and "no such file" in missing.stderr
    nobind = run(fake_bin["apptainer"], "exec", "--bind", "/does/not/exist:/x", str(fake_bin["image"]), "true")
    assert nobind.returncode == 255 and "doesn't exist" in nobind.stderr


def test_instances_start_list_exec_stop(fake_bin) -> None:
    needs_bwrap()
    app = fake_bin["apptainer"]
    start = run(app, "instance", "start", "--containall", "--bind", f"{fake_bin['ws']}:/workspace",
                str(fake_bin["image"]), "box1")
    assert start.returncode == 0, start.stderr
    assert run(app, "instance", "start", str(fake_bin["image"]), "box1").returncode == 255
    listed = json.loads(run(app, "instance", "list", "--json", "box1").stdout)["instances"]
    assert [(i["instance"], i["img"]) for i in listed] == [("box1", str(fake_bin["image"]))]
    assert set(listed[0]) == {"instance", "pid", "img", "ip", "logErrPath", "logOutPath"}
    assert run(app, "exec", "--pwd", "/workspace", "instance://box1", "sh", "-c", "echo hi > g").returncode == 0
    assert (fake_bin["ws"] / "g").read_text() == "hi\n"
    assert run(app, "instance", "stop", "-t", "5", "box1").returncode == 0
    assert json.loads(run(app, "instance", "list", "--json").stdout) == {"instances": []}
    assert run(app, "exec", "instance://box1", "true").returncode == 255


def test_an_instance_is_a_living_pid_namespace(fake_bin) -> None:
    """What one exec leaves behind is there for the next; orphans belong to the instance's init; stop ends all."""
    needs_bwrap()
    app = fake_bin["apptainer"]
    assert run(app, "instance", "start", "--containall", "--bind", f"{fake_bin['ws']}:/workspace",
               str(fake_bin["image"]), "box2").returncode == 0
    (listed,) = json.loads(run(app, "instance", "list", "--json").stdout)["instances"]
    left = run(app, "exec", "--pwd", "/workspace", "instance://box2", "sh", "-c",
               "(setsid sh -c 'exec sleep 300' >/dev/null 2>&1 &); echo started")
    assert left.stdout == "started\n", left.stderr
    ps = run(app, "exec", "instance://box2", "ps", "-eo", "pid=,ppid=,args=").stdout.split("\n")
    rows = [line.split(None, 2) for line in ps if line.strip()]
    assert ["1", "0"] == rows[0][:2] and "python3" in rows[0][2]  # the init, as PID 1
    assert any(r[1:] == ["1", "sleep 300"] for r in rows), rows  # the orphan, re-parented to the init
    host_sleepers = [pid for pid in os.listdir("/proc") if pid.isdigit() and _ppid(pid) == listed["pid"]]
    assert host_sleepers, "the instance's init has no children on the host"
    assert run(app, "instance", "stop", "box2").returncode == 0
    assert fake.start_time(listed["pid"]) is None
    assert all(fake.start_time(int(pid)) is None for pid in host_sleepers)
    assert run(app, "exec", "instance://box2", "true").returncode == 255


def _ppid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rpartition(b")")[2].split()[1])
    except OSError:
        return None


def test_spython_drives_the_fake(fake_bin, monkeypatch) -> None:
    """The fake answers spython's own calls (spython runs `singularity` from PATH)."""
    needs_bwrap()
    try:
        import spython  # noqa: F401
    except ImportError:
        engine_missing("spython is not installed (pip install 'execbox[singularity]')")
    monkeypatch.setenv("PATH", f"{fake_bin['bin']}{os.pathsep}{os.environ['PATH']}")
    from spython.main import Client

    assert Client.version().startswith("singularity-ce version")
    out = Client.execute(str(fake_bin["image"]), ["sh", "-c", "echo out; echo err >&2; exit 3"],
                         bind=[f"{fake_bin['ws']}:/workspace"], options=["--containall"], return_result=True)
    assert out == {"message": ["out\n", "err\n"], "return_code": 3}
    inst = Client.instance(str(fake_bin["image"]), name="sp1", options=["--containall"])
    assert inst.pid and str(inst) == "instance://sp1"
    assert [str(i) for i in Client.instances(quiet=True)] == ["instance://sp1"]
    assert Client.execute(inst, ["echo", "inside"]).strip() == "inside"
    assert inst.stop(timeout=5) == 0
    assert ["singularity", "--quiet", "instance", "stop", "-t", "5", "sp1"] in logged(fake_bin["singularity_log"])


def test_started_by_root_it_is_not_a_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """Apptainer runs the code as the calling user: as root that is host root with its capabilities."""
    from execbox import ExecRequest, Settings
    from execbox.backends.singularity import SingularityBackend

    backend = SingularityBackend(Settings())
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    verdict = backend.verdict(ExecRequest(argv=["true"], network="none"))
    assert not verdict.sandbox and "unprivileged user" in verdict.reason
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert backend.verdict(ExecRequest(argv=["true"], network="none")).sandbox
