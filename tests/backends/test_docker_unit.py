"""The docker backend's pieces that need no engine: the hardening gate, stream framing, settings,
endpoint resolution, owners, and the image builder's recipe and mirror lookup."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from execbox import Limits, Settings
from execbox.backends.docker import backend as db
from execbox.backends.docker import engine, stream
from execbox.backends.docker import hardening as h
from execbox.backends.docker import image as di
from execbox.backends.docker import session as ds
from execbox.contract.backend import SessionSpec
from execbox.contract.output import BoundedCapture
from execbox.errors import BackendUnavailableError, ConfigError
from execbox.kit.ownership import owner_id
from execbox.testing import engine_missing


def docker_py() -> Any:
    try:
        import docker
    except ImportError:
        engine_missing("docker-py is not installed: pip install 'execbox[docker]'")
    return docker


def good_kwargs(tmp_path: Path) -> dict[str, Any]:
    return {
        "image": "img", "command": ["true"], "user": "1000:1000", "cap_drop": ["ALL"], "security_opt": h.security_opt(),
        "read_only": True, "init": True, "ipc_mode": "private", "pids_limit": 256, "mem_limit": "1024m",
        "memswap_limit": "1024m", "nano_cpus": 10**9,
        "mounts": [{"Target": "/workspace", "Source": str(tmp_path), "Type": "bind", "ReadOnly": False}],
    }


def test_hardened_accepts_the_table(tmp_path: Path) -> None:
    kw = good_kwargs(tmp_path)
    assert h.hardened(kw, socket_path="/var/run/docker.sock") is kw


@pytest.mark.parametrize("change, words", [
    ({"privileged": True}, "privileged"),
    ({"cap_add": ["SYS_ADMIN"]}, "added capabilities"),
    ({"cap_drop": ["NET_RAW"]}, "not all dropped"),
    ({"security_opt": []}, "no-new-privileges"),
    ({"security_opt": ["no-new-privileges"]}, "seccomp profile"),
    ({"security_opt": [*h.security_opt(), "apparmor=unconfined"]}, "seccomp profile"),
    ({"read_only": False}, "writable root"),
    ({"pid_mode": "host"}, "pid_mode=host"),
    ({"ipc_mode": "host"}, "ipc_mode=host"),
    ({"user": "0:0"}, "root"),
    ({"user": "1000:0"}, "root"),
    ({"init": False}, "init"),
    ({"memswap_limit": "2048m"}, "swap"),
    ({"pids_limit": None}, "pids_limit"),
    ({"devices": ["/dev/kvm:/dev/kvm"]}, "devices"),
])
def test_hardened_refuses_each_weakening(tmp_path: Path, change: dict, words: str) -> None:
    kw = {**good_kwargs(tmp_path), **change}
    with pytest.raises(ConfigError, match="not be a sandbox") as info:
        h.hardened(kw, socket_path=None)
    assert words in str(info.value)


@pytest.mark.parametrize("source", ["/var/run", "/", "HOME", "INSTALL"])
def test_hardened_refuses_mounts_of_socket_home_or_install_dir(tmp_path: Path, source: str) -> None:
    source = {"HOME": os.path.expanduser("~"), "INSTALL": str(h.install_dir())}.get(source, source)
    kw = good_kwargs(tmp_path)
    kw["mounts"] = [{"Target": "/workspace", "Source": source, "Type": "bind", "ReadOnly": False}]
    with pytest.raises(ConfigError, match="exposes"):
        h.hardened(kw, socket_path="/var/run/docker.sock")


def test_hardened_refuses_a_second_writable_mount(tmp_path: Path) -> None:
    kw = good_kwargs(tmp_path)
    kw["mounts"].append({"Target": "/data", "Source": str(tmp_path), "Type": "bind", "ReadOnly": False})
    with pytest.raises(ConfigError, match="one writable mount"):
        h.hardened(kw, socket_path=None)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o703], ids=oct)
def test_hardened_refuses_a_workspace_other_users_can_write(tmp_path: Path, mode: int) -> None:
    tmp_path.chmod(mode)
    with pytest.raises(ConfigError, match="writable by other local users"):
        h.hardened(good_kwargs(tmp_path), socket_path=None)


def workspaces() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(ds.WORKSPACE_PREFIX)}


def test_another_sandbox_uid_without_root_is_refused_before_any_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """S8: a non-root caller used to open the workspace 0777 in /tmp for a different sandbox uid."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "2000:2000")
    # No engine is contacted: the refusal comes first, and names what to change.
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/execbox-test.sock")
    backend = db.DockerBackend(Settings.from_env())
    before = workspaces()
    with pytest.raises(ConfigError, match="CODE_EXEC_DOCKER_USER=2000:2000 is not you") as info:
        anyio.run(backend.open_session, SessionSpec("none", Limits(memory_mb=64, cpus=1, pids=64), True, 60))
    assert info.value.env_var == "CODE_EXEC_DOCKER_USER" and "run execbox as root" in str(info.value)
    with pytest.raises(ConfigError, match="is not you"):
        anyio.run(backend.check)
    assert workspaces() == before


@pytest.mark.parametrize("euid, user", [(1000, "1000"), (1000, "1000:2000"), (0, "2000:2000")])
def test_sandbox_uid_accepted_when_the_workspace_can_stay_private(monkeypatch: pytest.MonkeyPatch, euid: int,
                                                                  user: str) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", user)
    db.DockerBackend(Settings.from_env()).workspace_access()


def test_a_session_without_every_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """D6: no silent refill from settings: the runner passes effective limits, and one missing is refused."""
    docker_py()
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "1000:1000")
    backend = db.DockerBackend(Settings.from_env())
    for limits, missing in ((Limits(cpus=1, pids=64), "mem_limit unset"), (Limits(memory_mb=64, pids=64),
                            "nano_cpus unset"), (Limits(memory_mb=64, cpus=1), "pids_limit unset")):
        spec = SessionSpec("none", limits, True, 60)
        session = ds.DockerSession(backend, spec, backend.plan(spec))
        try:
            with pytest.raises(ConfigError, match=missing):
                session._create_kwargs(["true"], user="1000:1000", env={}, workdir="/workspace", expires_in=60,
                                       stdin=False)
        finally:
            shutil.rmtree(session.host_workspace)
    spec = SessionSpec("none", Limits(memory_mb=64, cpus=0.5, pids=64), True, 60)
    session = ds.DockerSession(backend, spec, backend.plan(spec))
    try:
        kw = session._create_kwargs(["true"], user="1000:1000", env={}, workdir="/workspace", expires_in=60,
                                    stdin=False)
    finally:
        shutil.rmtree(session.host_workspace)
    assert (kw["mem_limit"], kw["memswap_limit"], kw["nano_cpus"], kw["pids_limit"]) == ("64m", "64m", 5 * 10**8, 64)


def frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


def test_demux_splits_streams_across_any_chunking() -> None:
    wire = frame(1, b"hello ") + frame(2, b"oops") + frame(1, b"world") + frame(0, b"ignored")
    for size in (1, 3, 7, 8, 9, len(wire)):
        out, err = BoundedCapture(100), BoundedCapture(100)
        demux = stream.Demux(out, err)
        for i in range(0, len(wire), size):
            demux.feed(memoryview(wire[i:i + size]))
        assert (out.getvalue(), err.getvalue()) == (b"hello world", b"oops"), size


def test_pump_feeds_stdin_and_stops_at_the_deadline() -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(frame(1, b"out"))
    out, err = BoundedCapture(100), BoundedCapture(100)
    import time

    started = time.monotonic()
    timed_out = stream.pump(ours, b"", b"x" * 1000, time.monotonic() + 0.5, out, err)
    assert timed_out and 0.4 < time.monotonic() - started < 3
    assert out.getvalue() == b"out"
    assert theirs.recv(2000) == b"x" * 1000  # all of stdin, then EOF
    theirs.close()
    ours.close()


def test_pump_asks_whether_the_container_lives_only_in_silence_and_ends_when_it_does_not() -> None:
    """The engine keeps an exec's stream open when its container dies under it: a silent stream is not EOF."""
    import time

    ours, theirs = socket.socketpair()
    asked: list[float] = []

    def alive() -> bool:
        asked.append(time.monotonic())
        return len(asked) < 3

    theirs.sendall(frame(1, b"out"))
    out, err = BoundedCapture(100), BoundedCapture(100)
    started = time.monotonic()
    timed_out = stream.pump(ours, b"", None, started + 60, out, err, alive)
    assert not timed_out and out.getvalue() == b"out"
    assert len(asked) == 3 and asked[0] - started >= stream.ALIVE_EVERY_S * 0.9, "asked in silence only"
    assert time.monotonic() - started < 30, "ended when the container did, not at the deadline"
    theirs.close()
    ours.close()


def test_settings_user_must_be_numeric(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "nobody")
    with pytest.raises(ConfigError, match="CODE_EXEC_DOCKER_USER"):
        db.DockerSettings.from_env()
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "1000:1000")
    assert db.DockerSettings.from_env().user == "1000:1000"
    # A bare uid would run with gid 0 under docker: it is spelled out as uid:uid.
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "1000")
    assert db.DockerSettings.from_env().user == "1000:1000"


def test_default_user_is_never_root() -> None:
    uid, gid = h.parse_user(h.default_user())
    assert uid != 0 and gid != 0
    if os.geteuid() == 0:
        assert h.default_user() == "65534:65534"


@pytest.mark.parametrize("endpoint, local", [
    ("unix:///var/run/docker.sock", True), ("unix:///run/user/1000/docker.sock", True),
    ("tcp://127.0.0.1:2375", True), ("tcp://localhost:2376", True), ("tcp://[::1]:2375", True),
    ("tcp://10.0.0.5:2375", False), ("ssh://user@build-host", False), ("tcp://docker:2376", False),
])
def test_local_engines_only(endpoint: str, local: bool) -> None:
    assert engine.is_local(endpoint) is local


def test_endpoint_follows_docker_host() -> None:
    docker_py()
    endpoint, _, origin = engine.resolve_endpoint({"DOCKER_HOST": "unix:///tmp/x.sock"})
    assert (endpoint, origin) == ("unix:///tmp/x.sock", "DOCKER_HOST")


def test_endpoint_follows_a_docker_context(tmp_path: Path) -> None:
    docker_py()
    from docker.context import ContextAPI

    env = {"DOCKER_CONFIG": str(tmp_path)}
    old = os.environ.get("DOCKER_CONFIG")
    os.environ["DOCKER_CONFIG"] = str(tmp_path)  # docker-py finds its config dir through os.environ
    try:
        # config.json first: without it docker-py puts contexts under the current directory.
        (tmp_path / "config.json").write_text('{"currentContext": "execbox-test"}')
        ContextAPI.create_context("execbox-test", host="unix:///tmp/execbox-ctx.sock")
        assert (tmp_path / "contexts" / "meta").is_dir()
        endpoint, _, origin = engine.resolve_endpoint(env)
        assert endpoint == "unix:///tmp/execbox-ctx.sock" and "execbox-test" in origin
        endpoint, _, origin = engine.resolve_endpoint({**env, "DOCKER_CONTEXT": "default"})
        assert endpoint == engine.DEFAULT_SOCKET
    finally:
        if old is None:
            os.environ.pop("DOCKER_CONFIG")
        else:
            os.environ["DOCKER_CONFIG"] = old


def test_recipe_hash_tracks_content_not_mirror() -> None:
    a = di.recipe_hash("bookworm", ("python3", "coreutils"), "65534:65534")
    assert a == di.recipe_hash("bookworm", ("coreutils", "python3"), "65534:65534")
    assert a != di.recipe_hash("bookworm", ("python3", "coreutils", "git"), "65534:65534")
    assert a != di.recipe_hash("trixie", ("python3", "coreutils"), "65534:65534")


def test_mirror_from_deb822_and_one_line_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb deb-src\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n")
    assert di.find_debian_mirror("bookworm", str(tmp_path)) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").unlink()
    (tmp_path / "sources.list").write_text("# c\ndeb [arch=amd64] http://other.example/debian bookworm main\n")
    assert di.find_debian_mirror("bookworm", str(tmp_path)) == "http://other.example/debian"
    (tmp_path / "sources.list").unlink()
    assert di.find_debian_mirror("bookworm", str(tmp_path)) == di.DEFAULT_MIRROR


def test_the_probe_key_follows_the_config_a_reload_reads(tmp_path: Path) -> None:
    """engine_config digests the config named by the listening process's --config-file (found through the
    socket's peer): a changed daemon.json is a new key at once; a listener that is gone is no key at all."""
    sock, config = tmp_path / "engine.sock", tmp_path / "daemon.json"
    config.write_text('{"runtimes": {}}')
    listener = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
         "s.listen(); print(flush=True); time.sleep(60)", str(sock), f"--config-file={config}"],
        stdout=subprocess.PIPE)
    try:
        assert listener.stdout is not None and listener.stdout.readline()
        first = engine.engine_config(f"unix://{sock}")
        assert first is not None and engine.engine_config(f"unix://{sock}") == first
        declared = {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}}
        config.write_text(json.dumps({"runtimes": declared}))
        second = engine.engine_config(f"unix://{sock}")
        assert second is not None and second[0] != first[0] and second[1] == declared
        # facts read before the reload took effect (the old entry, or none) are not kept; after it, they are
        assert not engine.reload_done(declared, {"runc": {"path": "runc"}})
        assert not engine.reload_done(declared, {"runsc": {"path": "/usr/bin/runsc"}})
        assert engine.reload_done(declared, {"runc": {"path": "runc"}, **declared})
        config.unlink()  # dockerd runs without one: still a key, another one
        third = engine.engine_config(f"unix://{sock}")
        assert third is not None and third[0] not in (first[0], second[0])
    finally:
        listener.kill()
        listener.wait()
    assert engine.engine_config(f"unix://{sock}") is None
    assert engine.engine_config("tcp://127.0.0.1:2375") is None


def test_a_fifo_planted_as_the_engine_config_is_no_key_and_holds_nothing(tmp_path: Path) -> None:
    sock, config = tmp_path / "engine.sock", tmp_path / "daemon.json"
    os.mkfifo(config)  # opened without O_NONBLOCK, it would block until a writer came
    listener = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
         "s.listen(); print(flush=True); time.sleep(60)", str(sock), f"--config-file={config}"],
        stdout=subprocess.PIPE)
    try:
        assert listener.stdout is not None and listener.stdout.readline()
        assert engine.engine_config(f"unix://{sock}") is None
    finally:
        listener.kill()
        listener.wait()


# --- the container as built, against the contract ------------------------------------------------------


def contract(workspace: str) -> h.Contract:
    return h.Contract(user="1000:1000", network="none", workspace=workspace, memory_bytes=1024 << 20,
                      nano_cpus=10**9, pids=256, runtime="runc")


def good_inspect(workspace: str) -> dict[str, Any]:
    """What `docker inspect` reports for a container built as execbox asked (the fields the check reads)."""
    return {
        "Config": {"User": "1000:1000"},
        "HostConfig": {
            "NetworkMode": "none", "Privileged": False, "CapAdd": None, "CapDrop": ["ALL"], "PidMode": "",
            "IpcMode": "private", "UTSMode": "", "UsernsMode": "", "CgroupnsMode": "private", "ReadonlyRootfs": True,
            "Init": True, "Devices": [], "DeviceRequests": None, "DeviceCgroupRules": None, "Binds": None,
            "VolumesFrom": None, "Links": None, "PortBindings": {}, "GroupAdd": None, "PublishAllPorts": False,
            "OomKillDisable": False, "Memory": 1024 << 20, "MemorySwap": 1024 << 20, "NanoCpus": 10**9,
            "PidsLimit": 256, "Tmpfs": {"/tmp": "rw,size=512m"}, "SecurityOpt": h.security_opt(),
            "MaskedPaths": ["/proc/asound", "/proc/kcore", "/sys/firmware"],
            "ReadonlyPaths": ["/proc/bus", "/proc/sys", "/proc/sysrq-trigger"], "Runtime": "runc",
        },
        "Mounts": [{"Type": "bind", "Source": workspace, "Destination": "/workspace", "Mode": "", "RW": True,
                    "Propagation": "rprivate"}],
    }


def test_the_contract_accepts_what_was_asked_for() -> None:
    assert h.built_problems(good_inspect("/tmp/ws"), contract("/tmp/ws")) == []


@pytest.mark.parametrize("section, key, value, words", [
    ("HostConfig", "NetworkMode", "host", "HostConfig.NetworkMode='host'"),
    ("HostConfig", "NetworkMode", "bridge", "HostConfig.NetworkMode='bridge'"),
    ("HostConfig", "Privileged", True, "HostConfig.Privileged=True"),
    ("HostConfig", "CapAdd", ["SYS_ADMIN"], "HostConfig.CapAdd=['SYS_ADMIN']"),
    ("HostConfig", "CapDrop", None, "HostConfig.CapDrop=None"),
    ("Config", "User", "0:0", "Config.User='0:0'"),
    ("Config", "User", "", "Config.User=''"),
    ("HostConfig", "PidMode", "host", "HostConfig.PidMode='host'"),
    ("HostConfig", "IpcMode", "host", "HostConfig.IpcMode='host'"),
    ("HostConfig", "IpcMode", "shareable", "HostConfig.IpcMode='shareable'"),
    ("HostConfig", "UTSMode", "host", "HostConfig.UTSMode='host'"),
    ("HostConfig", "UsernsMode", "host", "HostConfig.UsernsMode='host'"),
    ("HostConfig", "CgroupnsMode", "host", "HostConfig.CgroupnsMode='host'"),
    ("HostConfig", "ReadonlyRootfs", False, "HostConfig.ReadonlyRootfs=False"),
    ("HostConfig", "Init", False, "HostConfig.Init=False"),
    ("HostConfig", "Devices", [{"PathOnHost": "/dev/kvm", "PathInContainer": "/dev/kvm"}], "HostConfig.Devices"),
    ("HostConfig", "DeviceRequests", [{"Driver": "nvidia", "Count": -1}], "HostConfig.DeviceRequests"),
    ("HostConfig", "DeviceCgroupRules", ["c 10:200 rwm"], "HostConfig.DeviceCgroupRules"),
    ("HostConfig", "Binds", ["/:/host"], "HostConfig.Binds=['/:/host']"),
    ("HostConfig", "VolumesFrom", ["other"], "HostConfig.VolumesFrom"),
    ("HostConfig", "Sysctls", {"net.ipv4.ip_unprivileged_port_start": "0"}, "HostConfig.Sysctls"),
    ("HostConfig", "PortBindings", {"80/tcp": [{"HostPort": "8080"}]}, "HostConfig.PortBindings"),
    ("HostConfig", "OomKillDisable", True, "HostConfig.OomKillDisable=True"),
    ("HostConfig", "Memory", 0, "HostConfig.Memory=0"),
    ("HostConfig", "MemorySwap", -1, "HostConfig.MemorySwap=-1"),
    ("HostConfig", "NanoCpus", 0, "HostConfig.NanoCpus=0"),
    ("HostConfig", "PidsLimit", None, "HostConfig.PidsLimit=None"),
    ("HostConfig", "PidsLimit", -1, "HostConfig.PidsLimit=-1"),
    ("HostConfig", "Tmpfs", {"/tmp": "", "/run": ""}, "HostConfig.Tmpfs"),
    ("HostConfig", "SecurityOpt", ["no-new-privileges"], "HostConfig.SecurityOpt=['no-new-privileges']"),
    ("HostConfig", "SecurityOpt", ["no-new-privileges", "seccomp=unconfined"], "seccomp=unconfined"),
    ("HostConfig", "SecurityOpt", ["no-new-privileges", 'seccomp={"defaultAction": "SCMP_ACT_ALLOW"}'],
     "seccomp=<another profile>"),
    ("HostConfig", "SecurityOpt", [*h.security_opt(), "apparmor=unconfined"], "apparmor=unconfined"),
    ("HostConfig", "SecurityOpt", [*h.security_opt(), "label=disable"], "label=disable"),
    ("HostConfig", "MaskedPaths", [], "MaskedPaths"),
    ("HostConfig", "ReadonlyPaths", [], "ReadonlyPaths"),
    ("HostConfig", "Runtime", "nvidia", "HostConfig.Runtime='nvidia'"),
    (None, "Mounts", [], "Mounts=[]"),
])
def test_each_deviation_from_the_contract_is_refused_by_name(section: str | None, key: str, value: Any,
                                                             words: str) -> None:
    attrs = good_inspect("/tmp/ws")
    (attrs[section] if section else attrs)[key] = value
    problems = h.built_problems(attrs, contract("/tmp/ws"))
    assert len(problems) == 1 and words in problems[0], problems


@pytest.mark.parametrize("mount", [
    {"Type": "volume", "Name": "x", "Source": "/var/lib/docker/volumes/x/_data", "Destination": "/data", "RW": True},
    {"Type": "bind", "Source": "/var/run/docker.sock", "Destination": "/run/docker.sock", "RW": False},
], ids=["anonymous-volume", "read-only-bind"])
def test_any_mount_but_the_workspace_is_refused(mount: dict[str, Any]) -> None:
    attrs = good_inspect("/tmp/ws")
    attrs["Mounts"].append(mount)
    (problem,) = h.built_problems(attrs, contract("/tmp/ws"))
    assert problem.startswith("Mounts=") and mount["Destination"] in problem


@pytest.mark.parametrize("change, words", [
    ({"Source": "/tmp/other"}, "/tmp/other"), ({"RW": False}, "False"), ({"Destination": "/work"}, "/work"),
])
def test_the_workspace_mount_must_be_the_one_asked_for(change: dict[str, Any], words: str) -> None:
    attrs = good_inspect("/tmp/ws")
    attrs["Mounts"][0].update(change)
    (problem,) = h.built_problems(attrs, contract("/tmp/ws"))
    assert problem.startswith("Mounts=") and words in problem


def test_a_runtime_in_the_contract_must_be_the_one_built() -> None:
    attrs = good_inspect("/tmp/ws")
    pinned = h.Contract(**{**contract("/tmp/ws").__dict__, "runtime": "runsc"})
    assert h.built_problems(attrs, pinned) == ["HostConfig.Runtime='runc' (the contract says 'runsc')"]
    unjudged = h.Contract(**{**contract("/tmp/ws").__dict__, "runtime": None})  # nothing judged: nothing admitted
    assert h.built_problems(attrs, unjudged) == ["HostConfig.Runtime='runc' (the contract says None)"]


# --- seccomp profile, runtimes, egress network, backstop -----------------------------------------------------


@pytest.mark.parametrize("machine, arches", [
    ("x86_64", {"SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"}),
    ("aarch64", {"SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"}),
])
def test_the_seccomp_profile_is_the_shared_deny_list(machine: str, arches: set[str]) -> None:
    import json

    from execbox.policy import seccomp as policy

    profile = json.loads(h.seccomp_profile(machine))
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW" and set(profile["architectures"]) == arches
    by_name: dict[str, list[dict[str, Any]]] = {}
    for rule in profile["syscalls"]:
        assert rule["action"] == "SCMP_ACT_ERRNO"
        for name in rule["names"]:
            by_name.setdefault(name, []).append(rule)
    for name in policy.DENIED_SYSCALLS:
        assert [(r["errnoRet"], r.get("args")) for r in by_name[name]] == [(1, None)], name  # EPERM, always
    for name in ("clone", "unshare"):
        (rule,) = by_name[name]
        assert rule["errnoRet"] == 1 and rule["args"] == [
            {"index": 0, "value": 0x10000000, "valueTwo": 0x10000000, "op": "SCMP_CMP_MASKED_EQ"}]
    (rule,) = by_name["socket"]
    assert rule["args"] == [{"index": 0, "value": 40, "op": "SCMP_CMP_EQ"}]  # AF_VSOCK only
    assert [r["errnoRet"] for r in by_name["clone3"]] == [38]  # ENOSYS: libc falls back to clone
    assert set(by_name) == {*policy.DENIED_SYSCALLS, "clone", "unshare", "socket", "clone3"}


RUNSC = "/usr/bin/runsc"


@pytest.mark.parametrize("name, entry, refused", [
    ("runc", {"path": "runc"}, None),
    ("io.containerd.runc.v2", {"path": "runc"}, None),
    ("io.containerd.runc.v2", {"runtimeType": "io.containerd.runc.v2"}, None),
    ("my-crun", {"path": "crun", "runtimeArgs": ["--cgroup-manager=systemd"]}, None),
    ("runc", {"path": "runc", "runtimeArgs": ["--debug"]}, "runs runc with --debug: an argument execbox does not know"),
    ("runsc", {"path": "/usr/bin/runc"}, None),  # a name means nothing: this is runc, judged as runc
    ("runsc", {"path": RUNSC}, "runs runsc without --oci-seccomp"),
    ("runc", {"path": "/opt/nvidia-container-runtime"}, "runs nvidia-container-runtime, not a runtime execbox knows"),
    ("nvidia", {"path": "nvidia-container-runtime"}, "not a runtime execbox knows"),
    ("sysbox-runc", {"path": "sysbox-runc"}, "not a runtime execbox knows"),
    ("kata", {"path": "kata-runtime", "runtimeArgs": ["--debug"]}, "runs kata-runtime with --debug"),
    ("io.containerd.runsc.v1", {"runtimeType": "io.containerd.runsc.v1", "options": {"ConfigPath": "/x.toml"}},
     "passes options to io.containerd.runsc.v1 (ConfigPath) that execbox cannot read"),
])
def test_runtimes_are_judged_by_binary_and_arguments(name: str, entry: dict[str, Any], refused: str | None) -> None:
    problem = h.judge_runtime(name, entry).problem
    assert problem is None if refused is None else refused in (problem or ""), problem


@pytest.mark.parametrize("args, platform, network", [
    (["--oci-seccomp"], None, "sandbox"),
    (["--network=none", "--oci-seccomp=true"], None, "none"),
    (["--platform=ptrace", "--network", "none", "-oci-seccomp"], "ptrace", "none"),
    (["-platform=kvm", "--oci-seccomp", "--host-uds=open", "--overlay2=root:memory"], "kvm", "sandbox"),
])
def test_a_gvisor_registration_with_safe_arguments_is_gvisor_whatever_its_name(
        args: list[str], platform: str | None, network: str) -> None:
    judged = h.judge_runtime("anything-at-all", {"path": RUNSC, "runtimeArgs": args})
    assert (judged.problem, judged.isolation, judged.platform, judged.network) == (None, "gvisor", platform, network)


@pytest.mark.parametrize("arg, words", [
    ("--network=host", "--network=host: gives the sandbox the host kernel's network stack"),
    ("--platform=native", "--platform=native: is not a platform execbox knows"),
    ("--host-uds=all", "--host-uds=all: lets the sandbox create or bind sockets"),
    ("--fsgofer-host-uds", "--fsgofer-host-uds: lets the sandbox create or bind sockets"),
    ("--ignore-cgroups", "--ignore-cgroups: the engine's memory, cpu and pids limits would not apply"),
    ("--rootless", "--rootless: runs the sandbox without"),
    ("--net-raw", "--net-raw: gives the sandbox raw sockets"),
    ("--overlay2=all:memory", "--overlay2=all:memory: keeps /workspace writes in the sandbox's memory"),
    ("--debug", "--debug: logs what the sandboxed code does"),
    ("--strace", "--strace: logs what the sandboxed code does"),
    ("--debug-log=/tmp/x/", "--debug-log=/tmp/x/: logs what the sandboxed code does"),
    ("--TESTONLY-unsafe-nonroot", "--TESTONLY-unsafe-nonroot: is test-only"),
    ("--allow-flag-override", "--allow-flag-override: lets annotations"),
    ("--cpu-num-from-quota", "--cpu-num-from-quota: an argument execbox does not know to be safe (admitted: "),
    ("no-dash", "no-dash: an argument execbox does not know to be safe"),
    ("--network", "--network: an argument execbox does not know to be safe"),  # a flag without its value
])
def test_a_gvisor_argument_that_weakens_it_or_is_unknown_is_refused_by_name(arg: str, words: str) -> None:
    judged = h.judge_runtime("runsc", {"path": RUNSC, "runtimeArgs": ["--network=none", "--oci-seccomp", arg]})
    assert judged.isolation is None and f"runtime runsc runs runsc with {words}" in (judged.problem or "")


@pytest.mark.parametrize("path, args", [
    (RUNSC, ["--log=/tmp/x --network=host"]),  # dockerd's wrapper script splits it: --network=host would apply
    (RUNSC, ["--root=/r", "--log", "/tmp/x --debug --strace"]),
    (RUNSC, ["--num-network-channels=1;touch /tmp/pwn;#"]),
    (RUNSC, ["--log=$(id)"]),
    (RUNSC, ["--log=/tmp/x\n--rootless"]),
    ("/bin/sh -c /tmp/evil /usr/bin/runsc", []),
])
def test_a_registration_the_wrapper_shell_would_read_otherwise_is_refused(path: str, args: list[str]) -> None:
    judged = h.judge_runtime("runsc", {"path": path, "runtimeArgs": ["--network=none", "--oci-seccomp", *args]})
    assert judged.isolation is None and "is not one plain word" in (judged.problem or ""), judged


@pytest.mark.parametrize("args", [[], ["--network=none"], ["--oci-seccomp=false"]])
def test_a_gvisor_registration_that_ignores_the_seccomp_profile_is_refused(args: list[str]) -> None:
    problem = h.judge_runtime("runsc", {"path": RUNSC, "runtimeArgs": args}).problem or ""
    assert "without --oci-seccomp" in problem or "--oci-seccomp=false" in problem, problem


def request(network: str) -> Any:
    from execbox.contract.models import ExecRequest

    return ExecRequest(argv=["true"], network=network)


@pytest.mark.parametrize("name", ["host", "bridge", "none", "default", "container:abc"])
def test_egress_on_a_network_of_the_engine_is_not_a_sandbox(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("CODE_EXEC_DOCKER_EGRESS_NETWORK", name)
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "1000:1000")
    backend = db.DockerBackend(Settings.from_env())
    verdict = backend.verdict(request("egress"))
    assert not verdict.sandbox and f"CODE_EXEC_DOCKER_EGRESS_NETWORK={name}" in verdict.reason
    assert backend.verdict(request("none")).sandbox  # a request without egress never uses it


@pytest.mark.parametrize("attrs, words", [
    ({"Driver": "bridge", "Labels": {"io.execbox": "1"}, "Options": {"com.docker.network.bridge.enable_icc": "false"}},
     None),
    ({"Driver": "bridge", "Labels": {}, "Options": {"com.docker.network.bridge.enable_icc": "false"}},
     "no io.execbox label"),
    ({"Driver": "bridge", "Labels": {"io.execbox": "1"}, "Options": {}}, "traffic between its containers"),
    ({"Driver": "macvlan", "Labels": {"io.execbox": "1"}, "Options": {"com.docker.network.bridge.enable_icc": "false"}},
     "driver macvlan"),
])
def test_an_existing_egress_network_must_be_one_execbox_made(attrs: dict[str, Any], words: str | None) -> None:
    problem = db.egress_network_problem("execbox-egress", attrs)
    assert problem is None if words is None else (words in (problem or "") and "CODE_EXEC_DOCKER_EGRESS_NETWORK"
                                                   in (problem or "")), problem


def test_every_command_runs_under_a_backstop_past_its_deadline() -> None:
    assert ds.backstop(["sleep", "600"], 3 + ds.BACKSTOP_GRACE_S) == ["timeout", "-s", "KILL", "8", "sleep", "600"]
    assert ds.backstop(["-x"], 1.2)[3:] == ["2", "-x"]  # whole seconds, rounded up; timeout stops parsing at argv


# --- workspaces: named after their owner, so gc finds orphans without a container ----------------------------


def uuid_hex() -> str:
    import uuid

    return uuid.uuid4().hex[:8]


def dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_orphaned_workspaces_are_found_and_removed_but_never_a_live_ones() -> None:
    tmp = tempfile.gettempdir()
    dead = os.path.join(tmp, f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-{uuid_hex()}")
    started = owner_id().rsplit(":", 1)[1]
    alive = tempfile.mkdtemp(prefix=f"{ds.WORKSPACE_PREFIX}{os.getpid()}-{started}-")
    stray_image = os.path.join(tmp, f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-{uuid_hex()}.disk")
    lookalike = os.path.join(tmp, f"{ds.WORKSPACE_PREFIX}{uuid_hex()}")  # not named after an owner: not ours to judge
    try:
        os.makedirs(os.path.join(dead, "deep", "er"))
        Path(dead, "deep", "er", "f").write_text("x")
        Path(stray_image).write_bytes(b"")
        os.mkdir(lookalike)
        found = ds.orphaned_workspaces()
        assert dead in found and stray_image.removesuffix(".disk") in found
        assert lookalike not in found and alive not in found
        for path in found:
            if path in (dead, stray_image.removesuffix(".disk")):
                assert ds.remove_workspace(path)
        assert not os.path.exists(dead) and not os.path.exists(stray_image)
        assert os.path.isdir(lookalike) and os.path.isdir(alive)
    finally:
        for path in (alive, lookalike):
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")
def test_orphaned_workspaces_take_a_mount_point_only_with_roots_image(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A user may mount (FUSE) on a directory of their own named like a workspace; gc as root must neither unmount
    # it nor remove what is in it. A sized workspace's mount has root's image beside it. (A tmpfs of uid 4242 here.)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    theirs = str(tmp_path / f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-{uuid_hex()}")
    sized = str(tmp_path / f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-{uuid_hex()}")
    mounted = []
    try:
        for path in (theirs, sized):
            os.mkdir(path)
            os.chown(path, 4242, 4242)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,uid=4242", "none", path], check=True)
            mounted.append(path)
        Path(theirs + ".disk").write_bytes(b"")
        os.chown(theirs + ".disk", 4242, 4242)  # an image of theirs proves nothing
        Path(sized + ".disk").write_bytes(b"")
        found = ds.orphaned_workspaces(sandbox_uid=65534)
        assert sized in found and theirs not in found
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", path], check=False)


@pytest.mark.parametrize("path", ["/etc", "/tmp", "/tmp/../etc/execbox-docker-1-1-x", "/var/tmp/execbox-docker-1-1-x"])
def test_remove_workspace_touches_only_our_directories(path: str) -> None:
    assert ds.remove_workspace(path) is False


@pytest.mark.parametrize("user", ["4294967296", "4294967295:1", "1:4294967295", "١٠٠٠"])
def test_an_out_of_range_or_non_ascii_uid_is_a_config_error(user: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", user)
    with pytest.raises(ConfigError) as info:
        db.DockerBackend(Settings.from_env()).user  # noqa: B018
    assert info.value.env_var == "CODE_EXEC_DOCKER_USER"


@pytest.mark.parametrize("host", ["tcp://[::1", "tcp://[::1]:notaport"])
def test_a_malformed_docker_host_is_an_error_naming_it(host: str) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        engine.connect({"DOCKER_HOST": host})
    assert info.value.env_var == "DOCKER_HOST"


def test_orphaned_workspaces_take_neither_another_users_nor_trust_an_owner_file_the_code_wrote() -> None:
    # The workspace is the sandbox's to write: an owner file planted there (another host, a live process) must not
    # keep a dead owner's workspace from gc. And gc running as root takes only its own user's directories and the
    # sandbox user's (root hands every workspace to it), never another user's.
    tmp = tempfile.gettempdir()
    planted = os.path.join(tmp, f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-{uuid_hex()}")
    foreign = os.path.join(tmp, f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-{uuid_hex()}")
    handed = os.path.join(tmp, f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-{uuid_hex()}")
    link = os.path.join(tmp, f"{ds.WORKSPACE_PREFIX}{dead_pid()}-1-{uuid_hex()}")
    try:
        os.mkdir(planted)
        Path(planted, "owner").write_text("another-host:1:1\n")
        os.mkdir(foreign)
        os.mkdir(handed)
        os.symlink(handed, link)
        if os.geteuid() == 0:
            os.chown(foreign, 4242, 4242)
            os.chown(handed, 65534, 65534)
        found = ds.orphaned_workspaces(sandbox_uid=65534)
        assert planted in found and handed in found and link not in found
        assert (foreign in found) == (os.geteuid() != 0)
        assert (handed in ds.orphaned_workspaces()) == (os.geteuid() != 0)  # without a sandbox uid: only ours
    finally:
        for path in (planted, foreign, handed):
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)


def test_doctor_warns_when_an_engine_is_here_but_its_extra_is_not(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install execbox` alone on a machine with Docker: auto quietly picks bubblewrap; doctor says why."""
    from click.testing import CliRunner

    from execbox.cli import main

    def doctor(*args: str) -> str:
        return CliRunner().invoke(main, ["doctor", *args]).stdout

    monkeypatch.setattr(db.DockerBackend, "sdk", "execbox_test_no_such_sdk")  # docker-py as if not installed
    listening = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX) as fake_engine:
        fake_engine.bind(str(listening))
        fake_engine.listen()
        monkeypatch.setenv("DOCKER_HOST", f"unix://{listening}")
        row = {r["name"]: r for r in json.loads(doctor("--json"))["backends"]}["docker"]
        assert row["available"] is False and row["fix"] == "pip install 'execbox[docker]'"
        assert row["warning"] == (f"a Docker engine (unix://{listening}) is here, but the docker backend needs "
                                  "its extra: pip install 'execbox[docker]' (until then auto passes it over)")
        assert "though a Docker engine" in row["reason"]
        assert f"warning: {row['warning']}" in doctor()
    # Nothing answers there now: the missing extra is a fix, not a warning.
    row = {r["name"]: r for r in json.loads(doctor("--json"))["backends"]}["docker"]
    assert row["available"] is False and row["warning"] is None
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:2375")  # configured by the operator: that says enough
    assert engine.engine_here() == "a Docker engine (DOCKER_HOST=tcp://127.0.0.1:2375)"
