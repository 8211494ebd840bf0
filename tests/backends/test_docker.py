"""The docker backend against the real engine: the conformance kit, then one test per wall of the
hardening table (each would fail if that wall were missing), then lifecycle, gc and engine errors."""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from execbox import (
    AsyncRunner,
    BackendUnavailableError,
    Limits,
    NotASandboxError,
    Runner,
    SandboxError,
    Settings,
    WorkspacePathError,
)
from execbox.backends.docker import backend as db
from execbox.backends.docker import engine as de
from execbox.backends.docker import image as docker_image
from execbox.backends.docker import session as ds
from execbox.kit.ownership import owner_id
from execbox.runner import run_blocking
from execbox.testing import PeakRss, engine_missing
from execbox.testing.conformance import BackendConformance, Listener

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
def engine() -> Any:
    """The real engine, with the sandbox image built when it is missing (as root; that takes a minute)."""
    try:
        client, _, _ = de.connect()
    except BackendUnavailableError as exc:
        engine_missing(f"no Docker engine: {exc}")
    import docker

    try:
        client.images.get(docker_image.DEFAULT_TAG)
    except docker.errors.ImageNotFound:
        if os.geteuid() != 0:
            engine_missing(f"image {docker_image.DEFAULT_TAG} is missing; build it: sudo execbox image build")
        docker_image.build_image()
    return client


@pytest.fixture
def runner(engine: Any) -> Runner:
    return Runner(Settings.from_env(backend="docker"))


def ours(engine: Any) -> list[Any]:
    """Containers this test process owns (by the owner label)."""
    return engine.containers.list(ignore_removed=True, all=True, filters={"label": f"{ds.L_OWNER}={owner_id()}"})


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        left = ours(request.getfixturevalue("engine"))
        assert not left, f"containers left behind: {[c.name for c in left]}"


class TestDockerConformance(BackendConformance):
    backend_name = "docker"

    @pytest.fixture
    def runner(self, engine: Any) -> Runner:
        return Runner(Settings.from_env(backend="docker"))


def run(runner: Runner, command: Any, **kw: Any) -> Any:
    return runner.run(command, backend="docker", **kw)


def code(runner: Runner, source: str, **kw: Any) -> Any:
    return runner.run_code(textwrap.dedent(source), backend="docker", **kw)


# --- walls -------------------------------------------------------------------------------------------


def test_runs_as_non_root(runner: Runner) -> None:
    result = run(runner, "id -u; id -g")
    expected = "65534\n65534\n" if os.geteuid() == 0 else f"{os.getuid()}\n{os.getgid()}\n"
    assert result.stdout == expected


def test_no_effective_capabilities(runner: Runner) -> None:
    status = run(runner, ["cat", "/proc/self/status"]).stdout
    caps = dict(line.split(":\t") for line in status.splitlines() if line.startswith("Cap"))
    assert caps and all(int(v, 16) == 0 for v in caps.values()), caps
    assert "NoNewPrivs:\t1" in status


def test_setuid_binary_gains_nothing(runner: Runner) -> None:
    """A setuid-root copy of id in the workspace: without no-new-privileges it prints euid=0."""
    if os.geteuid() != 0:
        pytest.skip("only root can make the setuid-root binary this test needs")
    with runner.sandbox("docker") as sb:
        host_ws = sb.aio._session.host_workspace  # type: ignore[union-attr]
        target = os.path.join(host_ws, "suid-id")
        shutil.copy("/usr/bin/id", target)
        os.chown(target, 0, 0)
        os.chmod(target, 0o4755)
        result = sb.exec(["./suid-id"])
        assert result.exit_code == 0, result
        assert "euid" not in result.stdout and "uid=65534" in result.stdout
        # The host still sees a setuid-root file: the wall is inside, not a missing bit.
        assert os.stat(target).st_mode & 0o4000


def test_raw_sockets_refused(runner: Runner) -> None:
    result = code(runner, """
        import socket
        for family, kind, proto in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
                                    (socket.AF_PACKET, socket.SOCK_RAW, 0)):
            try:
                socket.socket(family, kind, proto)
                print("OPENED", family)
            except PermissionError:
                print("REFUSED")
    """)
    assert result.stdout == "REFUSED\nREFUSED\n", result


PROBE = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, int(port)))
        print("CONNECTED", host)
    except OSError as exc:
        print("BLOCKED", host, exc.errno)
"""


def egress_gateway(engine: Any) -> str:
    """The host's address on the egress bridge: a network the docker backend created (labelled execbox)."""
    name = db.DockerSettings.from_env().egress_network
    network = engine.networks.get(name)
    assert (network.attrs["Labels"] or {}).get(ds.LABEL) == "1", f"{name} was not created by execbox"
    return network.attrs["IPAM"]["Config"][0]["Gateway"]


def test_network_none_cannot_reach_a_host_listener_but_egress_can(runner: Runner, engine: Any) -> None:
    # Listeners only on loopback and on the gateway of the bridge execbox created, never on every address.
    listeners: list[Listener] = []
    try:
        with runner.sandbox("docker", network="egress") as sb:  # creates the egress bridge when missing
            # Positive control first: on the egress bridge the probe reaches a listener on its gateway.
            gateway = Listener(egress_gateway(engine))
            listeners.append(gateway)
            seen = sb.exec(["python3", "-c", PROBE, f"{gateway.host}:{gateway.port}"])
        assert f"CONNECTED {gateway.host}" in seen.stdout, seen
        assert gateway.accepted == 1
        loopback = Listener("127.0.0.1")
        listeners.append(loopback)
        result = run(runner, ["python3", "-c", PROBE, f"{gateway.host}:{gateway.port}",
                              f"127.0.0.1:{loopback.port}"], network="none")
        assert result.stdout.count("BLOCKED") == 2 and "CONNECTED" not in result.stdout, result
        assert (gateway.accepted, loopback.accepted) == (1, 0)
    finally:
        for listener in listeners:
            listener.close()


def test_no_docker_socket_inside(runner: Runner) -> None:
    result = code(runner, """
        import os
        for path in ("/var/run/docker.sock", "/run/docker.sock", "/run/docker", "/var/run/docker"):
            print(path, os.path.exists(path))
        print("mounted", "docker.sock" in open("/proc/mounts").read())
    """)
    assert "True" not in result.stdout, result.stdout


def test_root_filesystem_is_read_only(runner: Runner) -> None:
    result = run(runner, "touch /usr/x 2>&1; echo rc=$?; grep ' / ' /proc/mounts")
    assert "Read-only file system" in result.stdout and "rc=1" in result.stdout
    assert " ro," in result.stdout.splitlines()[-1]


def test_writes_outside_workspace_and_tmp_fail(runner: Runner) -> None:
    # /dev/shm and /dev/mqueue are the private IPC namespace's own (POSIX shared memory, message queues).
    result = code(runner, """
        import os
        places = ["/", "/etc", "/usr", "/usr/local", "/var", "/var/tmp", "/var/cache", "/root", "/home", "/opt",
                  "/run", "/srv", "/dev", "/sys/fs/cgroup", "/proc/sys/kernel"]
        for place in places:
            try:
                with open(os.path.join(place, "execbox-probe"), "w") as fh:
                    fh.write("x")
                print("WROTE", place)
            except OSError:
                pass
        for place in ("/workspace", "/tmp", "/dev/shm"):
            with open(os.path.join(place, "ok"), "w") as fh:
                fh.write("x")
        rw = [line.split()[1] for line in open("/proc/mounts") if line.split()[3].startswith("rw")
              and not line.split()[1].startswith(("/proc", "/sys", "/dev/pts"))]
        print("RW", sorted(rw))
    """)
    assert "WROTE" not in result.stdout, result.stdout
    rw = ast.literal_eval(result.stdout.split("RW ", 1)[1])
    assert set(rw) <= {"/workspace", "/tmp", "/dev", "/dev/shm", "/dev/mqueue"}, rw


def test_host_marker_outside_the_workspace_is_invisible(runner: Runner) -> None:
    name = f"execbox-marker-{uuid.uuid4().hex}"
    markers = [Path(tempfile.gettempdir()) / name, Path("/var/tmp") / name, Path.home() / name]
    for marker in markers:
        marker.write_text("host secret")
    try:
        result = code(runner, f"""
            import os
            found = []
            for root, dirs, files in os.walk("/"):
                if root.startswith(("/proc", "/sys")):
                    dirs[:] = []
                    continue
                if {name!r} in files:
                    found.append(root)
            print("FOUND", found)
        """, timeout=30)
        assert result.stdout == "FOUND []\n", result
    finally:
        for marker in markers:
            marker.unlink()


def test_host_secret_variable_is_absent(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXECBOX_TEST_HOST_SECRET", "hunter2-host-only")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "AKIA-host-only")
    result = run(runner, ["cat", "/proc/self/environ"], env={"ASKED_FOR": "yes"})
    env = dict(item.split("=", 1) for item in result.stdout.split("\0") if item)
    assert env["ASKED_FOR"] == "yes"
    assert "host-only" not in result.stdout and "EXECBOX_TEST_HOST_SECRET" not in env
    assert set(env) <= {"PATH", "HOME", "LANG", "TMPDIR", "PYTHONUNBUFFERED", "HOSTNAME", "ASKED_FOR"}, env


def pids_in(container: Any) -> int | None:
    """How many tasks the container's pids cgroup holds, from the engine (cgroup v1 and v2 alike)."""
    import docker

    try:
        try:
            stats = container.stats(stream=False, one_shot=True)
        except docker.errors.InvalidVersion:  # an engine older than API 1.41 samples twice, a second
            stats = container.stats(stream=False)
    except (docker.errors.APIError, ValueError):  # gone meanwhile (a removed container's stats are empty)
        return None
    return (stats.get("pids_stats") or {}).get("current")


def test_fork_bomb_is_held_and_the_host_stays_responsive(runner: Runner, engine: Any) -> None:
    stop = threading.Event()
    host_latencies: list[float] = []
    peak_pids: list[int] = []

    def watch() -> None:
        while not stop.is_set():
            started = time.monotonic()
            subprocess.run(["true"], check=True)
            host_latencies.append(time.monotonic() - started)
            for container in ours(engine):
                count = pids_in(container)
                if count is not None:
                    peak_pids.append(count)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run(runner, ["bash", "-c", "bomb() { bomb | bomb & }; bomb; sleep 30"], timeout=6)
    finally:
        stop.set()
        watcher.join()
    assert result.timed_out
    # Generous: the machine may be busy with other work; an unlimited bomb makes fork fail outright.
    assert host_latencies and max(host_latencies) < 5.0, host_latencies
    # The bomb ran into the limit, and the limit held.
    limit = Settings.from_env().pids_limit
    assert peak_pids, "the engine reported no pid count for the container"
    assert limit // 2 < max(peak_pids) <= limit, (max(peak_pids), limit)


def test_memory_bomb_is_reported_as_oom_killed(runner: Runner) -> None:
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))\n"
    result = code(runner, bomb, limits=Limits(memory_mb=128), timeout=30)
    assert result.oom_killed and not result.timed_out and result.exit_code == 137, result
    with runner.sandbox("docker", limits=Limits(memory_mb=128)) as sb:
        result = sb.run_code(bomb, timeout=30)
        assert result.oom_killed and not result.timed_out, result
        after = sb.exec(["echo", "alive"])
        assert after.stdout == "alive\n" and not after.oom_killed


def test_one_gigabyte_of_output_is_capped_with_flat_memory(runner: Runner) -> None:
    with PeakRss() as rss:
        result = run(runner, "head -c 1000000000 /dev/zero; echo END >&2", max_output_bytes=100_000, timeout=120)
    assert result.exit_code == 0 and result.truncated and not result.timed_out, result.stderr[-200:]
    assert "999900000 bytes omitted" in result.stdout  # every byte was read, only the cap was kept
    assert len(result.stdout) < 100_200 and result.stderr == "END\n"
    growth_mb = rss.growth / 2**20
    assert growth_mb < 100, f"the caller's memory grew by {growth_mb:.0f} MB while 1 GB streamed past"


def test_infinite_loop_ends_at_the_deadline_with_no_container_left(runner: Runner, engine: Any) -> None:
    started = time.monotonic()
    result = code(runner, "while True:\n    pass\n", timeout=2)
    assert result.timed_out and not result.oom_killed
    assert time.monotonic() - started < 60  # ends rather than hangs; the latency is bench/bench_docker.py's
    assert ours(engine) == []


def wait_for_running(engine: Any, deadline_s: float = 60) -> list[Any]:
    """Our containers once one of them runs (polled from the engine), or [] at the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        running = [c for c in ours(engine) if c.status == "running"]
        if running:
            return running
        time.sleep(0.1)
    return []


def test_cancelled_caller_leaves_no_container(engine: Any) -> None:
    seen: list[Any] = []

    async def cancel_mid_run() -> None:
        runner = AsyncRunner(Settings.from_env(backend="docker"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: runner.run(["sleep", "100"], backend="docker", timeout=90))
            # Cancel only once the container runs, so the cancel lands mid-stream, not before the create.
            seen.extend(await anyio.to_thread.run_sync(wait_for_running, engine))
            tg.cancel_scope.cancel()

    started = time.monotonic()
    anyio.run(cancel_mid_run)
    assert seen, "the run's container never showed up as running"
    assert time.monotonic() - started < 60  # ends rather than waits out the 90 s timeout
    assert ours(engine) == []


def test_parallel_runs_stay_apart(engine: Any) -> None:
    async def many() -> dict[int, Any]:
        runner = AsyncRunner(Settings.from_env(backend="docker"))
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            results[i] = await runner.run(["sh", "-c", f"echo {i}; cat; ls"], backend="docker",
                                          stdin=f"in-{i}\n".encode(), files={f"only-{i}.txt": b"x"})

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        return results

    for i, result in anyio.run(many).items():
        assert result.stdout.startswith(f"{i}\nin-{i}\n") and f"only-{i}.txt" in result.stdout, result
        assert result.stdout.count("only-") == 1


def test_planted_symlink_to_a_host_secret_is_refused(runner: Runner) -> None:
    with runner.sandbox("docker") as sb:
        assert sb.exec("ln -s /etc/shadow out.txt && mkdir -p d && ln -s /root d/home").exit_code == 0
        for path in ("out.txt", "d/home/.bashrc"):
            with pytest.raises(WorkspacePathError, match="symlink"):
                sb.read_file(path)
        # and a write through a planted link never lands outside
        with pytest.raises(WorkspacePathError):
            sb.write_file("d/home/planted", b"x")
        assert not os.path.exists("/root/planted")


# --- sessions ----------------------------------------------------------------------------------------


def test_session_keeps_files_and_installed_packages_and_goes_away(runner: Runner, engine: Any) -> None:
    with runner.sandbox("docker") as sb:
        # A package "installed" into the user site (what pip install --user does) is importable later.
        install = sb.run_code("import os, site\nd = site.getusersitepackages()\nos.makedirs(d)\n"
                              "open(os.path.join(d, 'execbox_pkg.py'), 'w').write('VALUE = 42')")
        assert install.exit_code == 0, install
        assert sb.run_code("import execbox_pkg\nprint(execbox_pkg.VALUE)").stdout == "42\n"
        sb.write_file("data/in.txt", "hello")
        assert sb.exec("cat data/in.txt > out.txt").exit_code == 0
        assert sb.read_file("out.txt") == b"hello"
        host_ws = sb.aio._session.host_workspace  # type: ignore[union-attr]
        assert len(ours(engine)) == 1
    assert ours(engine) == []
    assert not os.path.exists(host_ws)


def test_session_timeout_kills_the_run_but_not_the_session(runner: Runner) -> None:
    with runner.sandbox("docker") as sb:
        sb.exec("echo kept > state.txt")
        result = sb.exec("sleep 300 & sleep 300", timeout=1)
        assert result.timed_out
        assert sb.exec(["cat", "state.txt"]).stdout == "kept\n"
        # Every process of the sandbox user but the probe and its parent (the backstop's `timeout`).
        left = sb.run_code("import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit() and "
                           "os.stat('/proc/' + p).st_uid == os.getuid() and "
                           "int(p) not in (os.getpid(), os.getppid())))")
        assert left.stdout == "[]\n", left


def test_session_whose_container_was_removed_raises_a_sandbox_error(runner: Runner, engine: Any) -> None:
    with runner.sandbox("docker") as sb:
        (container,) = ours(engine)
        container.remove(force=True)
        with pytest.raises(SandboxError, match="gone"):
            sb.exec(["true"])


# --- images, gc and engine errors --------------------------------------------------------------------


def test_image_build_is_idempotent_and_well_formed(engine: Any) -> None:
    result = docker_image.build_image()
    assert not result.built and result.seconds < 60  # generous; the up-to-date latency is in bench_docker.py
    config = engine.images.get(docker_image.DEFAULT_TAG).attrs["Config"]
    assert config["User"] == "65534:65534" and config["WorkingDir"] == "/workspace"
    assert config["Labels"][docker_image.RECIPE_LABEL] == result.recipe


def test_missing_image_says_how_to_get_one(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_DOCKER_IMAGE", "execbox-test-missing:none")
    with pytest.raises(BackendUnavailableError) as info:
        Runner(Settings.from_env(backend="docker")).run(["true"])
    assert "execbox-test-missing:none" in str(info.value) and "docker pull" in str(info.value)
    assert info.value.retryable is False


def test_unregistered_runtime_is_a_clear_error(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = next(name for name in ("crun", "runsc", "kata-runtime") if name not in engine.info()["Runtimes"])
    monkeypatch.setenv("CODE_EXEC_DOCKER_RUNTIME", runtime)
    with pytest.raises(BackendUnavailableError) as info:
        Runner(Settings.from_env(backend="docker")).run(["true"])
    assert f"CODE_EXEC_DOCKER_RUNTIME={runtime}" in str(info.value) and "runc" in str(info.value)


def test_known_runtime_is_used_and_reported(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    runtimes = engine.info()["Runtimes"]
    runtime = "runsc" if "runsc" in runtimes else "runc"
    monkeypatch.setenv("CODE_EXEC_DOCKER_RUNTIME", runtime)
    runner = Runner(Settings.from_env(backend="docker"))
    caps = run_blocking(runner.aio.backend("docker").check)
    assert caps.isolation == ("gvisor" if runtime == "runsc" else "container")
    assert run(runner, ["echo", "ok"]).stdout == "ok\n"


@pytest.mark.parametrize("user", ["0", "0:0", "1000:0"])
def test_root_user_is_not_a_sandbox(engine: Any, monkeypatch: pytest.MonkeyPatch, user: str) -> None:
    monkeypatch.setenv("CODE_EXEC_DOCKER_USER", user)
    with pytest.raises(NotASandboxError, match="root"):
        Runner(Settings.from_env(backend="docker")).run(["id"])


def test_network_host_is_not_a_sandbox(runner: Runner) -> None:
    with pytest.raises(NotASandboxError, match="host"):
        run(runner, ["true"], network="host")


def test_gc_removes_orphans_and_expired_but_never_foreign_containers(engine: Any) -> None:
    runner = Runner(Settings.from_env(backend="docker"))
    backend = runner.aio.backend("docker")
    dead = subprocess.Popen(["true"])
    dead.wait()
    far = str(int(time.time()) + 3600)
    tag = uuid.uuid4().hex[:8]
    made = {
        "orphan": {ds.LABEL: "1", ds.L_OWNER: f"{socket.gethostname()}:{dead.pid}:1", ds.L_EXPIRES: far},
        "expired": {ds.LABEL: "1", ds.L_OWNER: "elsewhere:1:1", ds.L_EXPIRES: str(int(time.time()) - 5)},
        "live": {ds.LABEL: "1", ds.L_OWNER: owner_id(), ds.L_EXPIRES: far},
        "foreign": {"com.example.app": "1"},
        "lookalike": {ds.LABEL: "yes-but-not-ours", ds.L_OWNER: f"{socket.gethostname()}:{dead.pid}:1"},
    }
    ids = {}
    try:
        for kind, labels in made.items():
            ids[kind] = engine.containers.create(docker_image.DEFAULT_TAG, ["true"], labels=labels,
                                                 name=f"execbox-gc-test-{kind}-{tag}").id
        removed = run_blocking(backend.gc)
        remaining = {c.id for c in engine.containers.list(ignore_removed=True, all=True)}
        assert ids["orphan"] not in remaining and ids["expired"] not in remaining
        assert {ids["live"], ids["foreign"], ids["lookalike"]} <= remaining
        # Another execbox process sweeping at start-up may have taken them first; whatever this gc removed
        # of ours must be the orphan or the expired one, described with its reason.
        mine = [r for r in removed if tag in r]
        assert all(f"orphan-{tag} (orphaned)" in r or f"expired-{tag} (expired)" in r for r in mine), mine
    finally:
        for cid in ids.values():
            with contextlib.suppress(Exception):
                engine.api.remove_container(cid, force=True)


def test_engine_stopped_says_not_to_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """No daemon is stopped: DOCKER_HOST points at a socket that does not exist, as after a dockerd stop."""
    try:
        import docker  # noqa: F401
    except ImportError:
        engine_missing("docker-py is not installed: pip install 'execbox[docker]'")
    endpoint = f"unix:///tmp/execbox-no-engine-{uuid.uuid4().hex[:8]}.sock"
    monkeypatch.setenv("DOCKER_HOST", endpoint)
    with pytest.raises(BackendUnavailableError) as info:
        Runner(Settings.from_env(backend="docker")).run(["true"])
    err = info.value
    assert err.retryable is False and err.backend == "docker"
    assert endpoint in str(err) and "DOCKER_HOST" in str(err) and "retry" in str(err)


def _engine_answers_nothing_but(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make `docker info` and `docker version` fail (and record that they were asked)."""
    import docker.api.daemon

    asked: list[str] = []

    def refuse(name: str) -> Any:
        def call(self: Any, *a: Any, **k: Any) -> Any:
            asked.append(name)
            raise AssertionError(f"the engine was asked for {name}")
        return call

    monkeypatch.setattr(docker.api.daemon.DaemonApiMixin, "info", refuse("info"))
    monkeypatch.setattr(docker.api.daemon.DaemonApiMixin, "version", refuse("version"))
    return asked


def _unregistered_known_runtime(engine: Any) -> str:
    registered = engine.info()["Runtimes"]
    return next(name for name in ("crun", "runsc", "kata-runtime") if name not in registered)


def test_a_new_process_uses_the_engine_facts_another_probed_and_judges_them_anew(
        engine: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A new backend (as in a new process) does not ask the engine for its info or API version while the probe
    cache holds them; the facts are judged again under its own settings; CODE_EXEC_PROBE_CACHE_SEC=0 asks."""
    from execbox.kit import probecache

    missing = _unregistered_known_runtime(engine)
    monkeypatch.setattr(probecache, "cache_dir", lambda: str(tmp_path / "probes"))
    run_blocking(Runner(Settings.from_env(backend="docker")).aio.backend("docker").check)  # probed, and kept
    asked = _engine_answers_nothing_but(monkeypatch)
    assert run(Runner(Settings.from_env(backend="docker")), ["echo", "ok"]).stdout == "ok\n"
    assert asked == []
    monkeypatch.setenv("CODE_EXEC_DOCKER_RUNTIME", missing)  # known to execbox, not registered in the engine
    with pytest.raises(BackendUnavailableError, match=f"CODE_EXEC_DOCKER_RUNTIME={missing} is not a runtime of"):
        Runner(Settings.from_env(backend="docker")).run(["true"])
    monkeypatch.delenv("CODE_EXEC_DOCKER_RUNTIME")
    with pytest.raises(BackendUnavailableError, match="the engine was asked for"):
        Runner(Settings.from_env(backend="docker", probe_cache_sec=0)).run(["true"])
    assert asked


def test_a_default_runtime_changed_since_the_probe_is_never_used_unjudged(
        engine: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Facts kept from before the engine's default runtime changed (a reload keeps the socket) cannot make a run
    use another runtime than the one judged: that one is asked for by name, and the container checked as built.
    Here the kept facts name a default the engine does not have: the run fails, no container is left."""
    import json

    from execbox import ExecboxError
    from execbox.kit import probecache

    missing = _unregistered_known_runtime(engine)
    monkeypatch.setattr(probecache, "cache_dir", lambda: str(tmp_path / "probes"))
    backend = Runner(Settings.from_env(backend="docker")).aio.backend("docker")
    run_blocking(backend.check)
    assert backend.plan(db.SessionSpec("none", Limits(), True, 60)).runtime == engine.info()["DefaultRuntime"]
    (record,) = (tmp_path / "probes").glob("docker-*.json")
    data = json.loads(record.read_text())
    data["facts"]["info"]["DefaultRuntime"] = missing
    data["facts"]["info"]["Runtimes"][missing] = {"path": missing}
    record.write_text(json.dumps(data))
    with pytest.raises(ExecboxError, match=missing):
        Runner(Settings.from_env(backend="docker")).run(["true"])


def test_a_kept_record_of_another_shape_is_probed_anew(engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    import json

    from execbox.kit import probecache

    monkeypatch.setattr(probecache, "cache_dir", lambda: str(tmp_path / "probes"))
    run_blocking(Runner(Settings.from_env(backend="docker")).aio.backend("docker").check)
    (record,) = (tmp_path / "probes").glob("docker-*.json")
    data = json.loads(record.read_text())
    for facts in ({"api_version": "../../x", "info": data["facts"]["info"]}, {"api_version": "1.41"}):
        record.write_text(json.dumps({**data, "facts": facts}))
        assert run(Runner(Settings.from_env(backend="docker")), ["echo", "ok"]).stdout == "ok\n"
        assert json.loads(record.read_text())["facts"] == data["facts"]  # probed again, and kept again
