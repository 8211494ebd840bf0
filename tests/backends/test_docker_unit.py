"""The docker backend's pieces that need no engine: the hardening gate, stream framing, settings,
endpoint resolution, owners, and the image builder's recipe and mirror lookup."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from execbox import Limits, Settings
from execbox.backends import docker as d
from execbox.backends import docker_image as di
from execbox.core.backend import SessionSpec
from execbox.core.errors import ConfigError
from execbox.core.output import BoundedCapture
from execbox.testing import engine_missing


def docker_py() -> Any:
    try:
        import docker
    except ImportError:
        engine_missing("docker-py is not installed: pip install 'execbox[docker]'")
    return docker


def good_kwargs(tmp_path: Path) -> dict:
    return dict(
        image="img", command=["true"], user="1000:1000", cap_drop=["ALL"], security_opt=["no-new-privileges"],
        read_only=True, init=True, ipc_mode="private", pids_limit=256, mem_limit="1024m", memswap_limit="1024m",
        nano_cpus=10**9, mounts=[{"Target": "/workspace", "Source": str(tmp_path), "Type": "bind", "ReadOnly": False}],
    )


def test_hardened_accepts_the_table(tmp_path: Path) -> None:
    kw = good_kwargs(tmp_path)
    assert d._hardened(kw, socket_path="/var/run/docker.sock") is kw


@pytest.mark.parametrize("change, words", [
    ({"privileged": True}, "privileged"),
    ({"cap_add": ["SYS_ADMIN"]}, "added capabilities"),
    ({"cap_drop": ["NET_RAW"]}, "not all dropped"),
    ({"security_opt": []}, "no-new-privileges"),
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
        d._hardened(kw, socket_path=None)
    assert words in str(info.value)


@pytest.mark.parametrize("source", ["/var/run", "/", "HOME", "INSTALL"])
def test_hardened_refuses_mounts_of_socket_home_or_install_dir(tmp_path: Path, source: str) -> None:
    source = {"HOME": os.path.expanduser("~"), "INSTALL": str(d._install_dir())}.get(source, source)
    kw = good_kwargs(tmp_path)
    kw["mounts"] = [{"Target": "/workspace", "Source": source, "Type": "bind", "ReadOnly": False}]
    with pytest.raises(ConfigError, match="exposes"):
        d._hardened(kw, socket_path="/var/run/docker.sock")


def test_hardened_refuses_a_second_writable_mount(tmp_path: Path) -> None:
    kw = good_kwargs(tmp_path)
    kw["mounts"].append({"Target": "/data", "Source": str(tmp_path), "Type": "bind", "ReadOnly": False})
    with pytest.raises(ConfigError, match="one writable mount"):
        d._hardened(kw, socket_path=None)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o703], ids=oct)
def test_hardened_refuses_a_workspace_other_users_can_write(tmp_path: Path, mode: int) -> None:
    tmp_path.chmod(mode)
    with pytest.raises(ConfigError, match="writable by other local users"):
        d._hardened(good_kwargs(tmp_path), socket_path=None)


def workspaces() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(d.WORKSPACE_PREFIX)}


def test_another_sandbox_uid_without_root_is_refused_before_any_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """S8: a non-root caller used to open the workspace 0777 in /tmp for a different sandbox uid."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "2000:2000")
    # No engine is contacted: the refusal comes first, and names what to change.
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/execbox-test.sock")
    backend = d.DockerBackend(Settings.from_env())
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
    d.DockerBackend(Settings.from_env()).workspace_access()


def test_a_session_without_every_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """D6: no silent refill from settings: the runner passes effective limits, and one missing is refused."""
    docker_py()
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "1000:1000")
    backend = d.DockerBackend(Settings.from_env())
    for limits, missing in ((Limits(cpus=1, pids=64), "mem_limit unset"), (Limits(memory_mb=64, pids=64),
                            "nano_cpus unset"), (Limits(memory_mb=64, cpus=1), "pids_limit unset")):
        spec = SessionSpec("none", limits, True, 60)
        session = d.DockerSession(backend, spec, backend.plan(spec))
        try:
            with pytest.raises(ConfigError, match=missing):
                session._create_kwargs(["true"], user="1000:1000", env={}, workdir="/workspace", expires_in=60,
                                       stdin=False)
        finally:
            shutil.rmtree(session.host_workspace)
    spec = SessionSpec("none", Limits(memory_mb=64, cpus=0.5, pids=64), True, 60)
    session = d.DockerSession(backend, spec, backend.plan(spec))
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
        demux = d._Demux(out, err)
        for i in range(0, len(wire), size):
            demux.feed(memoryview(wire[i:i + size]))
        assert (out.getvalue(), err.getvalue()) == (b"hello world", b"oops"), size


def test_pump_feeds_stdin_and_stops_at_the_deadline() -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(frame(1, b"out"))
    out, err = BoundedCapture(100), BoundedCapture(100)
    import time

    started = time.monotonic()
    timed_out = d._pump(ours, b"", b"x" * 1000, time.monotonic() + 0.5, out, err)
    assert timed_out and 0.4 < time.monotonic() - started < 3
    assert out.getvalue() == b"out"
    assert theirs.recv(2000) == b"x" * 1000  # all of stdin, then EOF
    theirs.close()
    ours.close()


def test_settings_user_must_be_numeric(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "nobody")
    with pytest.raises(ConfigError, match="CODE_EXEC_DOCKER_USER"):
        d.DockerSettings.from_env()
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "1000:1000")
    assert d.DockerSettings.from_env().user == "1000:1000"
    # A bare uid would run with gid 0 under docker: it is spelled out as uid:uid.
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", "1000")
    assert d.DockerSettings.from_env().user == "1000:1000"


def test_default_user_is_never_root() -> None:
    uid, gid = d.parse_user(d.default_user())
    assert uid != 0 and gid != 0
    if os.geteuid() == 0:
        assert d.default_user() == "65534:65534"


@pytest.mark.parametrize("endpoint, local", [
    ("unix:///var/run/docker.sock", True), ("unix:///run/user/1000/docker.sock", True),
    ("tcp://127.0.0.1:2375", True), ("tcp://localhost:2376", True), ("tcp://[::1]:2375", True),
    ("tcp://10.0.0.5:2375", False), ("ssh://user@build-host", False), ("tcp://docker:2376", False),
])
def test_local_engines_only(endpoint: str, local: bool) -> None:
    assert d._is_local(endpoint) is local


def test_endpoint_follows_docker_host() -> None:
    docker_py()
    endpoint, params, origin = d._resolve_endpoint({"DOCKER_HOST": "unix:///tmp/x.sock"})
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
        endpoint, _, origin = d._resolve_endpoint(env)
        assert endpoint == "unix:///tmp/execbox-ctx.sock" and "execbox-test" in origin
        endpoint, _, origin = d._resolve_endpoint({**env, "DOCKER_CONTEXT": "default"})
        assert endpoint == d.DEFAULT_SOCKET
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
