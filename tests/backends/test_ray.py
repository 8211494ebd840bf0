"""The ray backend on a real Ray cluster of three nodes on this machine (ray_fixtures), each node running its code in
bubblewrap: one-shots, a pinned session and its files, the guard across the hop, 500 one-shots spread over the
nodes, the conformance kit; then the failures: a node removed under a session and under a batch, the driver
SIGKILLed, an unreachable cluster. The cluster starts once for the module's tests (about 20 s)."""

from __future__ import annotations

import collections
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest

from execbox import (
    BackendUnavailableError,
    Limits,
    MissingExtraError,
    NotASandboxError,
    Runner,
    SandboxLostError,
    SandboxPermissionError,
    Settings,
)
from execbox.backends.ray.backend import Node, RayBackend, _rebuild
from execbox.backends.ray.node import _error
from execbox.plugin import SessionSpec
from execbox.testing.conformance import BackendConformance
from tests.backends.ray_fixtures import RayCluster, ray_cluster  # noqa: F401  (the fixture)
from tests.support.containers import containers_of
from tests.support.waiting import wait_until

pytestmark = pytest.mark.engine
NODE = {"ray": {"node_backend": "bubblewrap"}}
SRC = str(Path(__file__).resolve().parents[2] / "src")


def ray_runner(**settings: object) -> Runner:
    return Runner(Settings.from_env(backend="ray", **settings), options=NODE)


@pytest.fixture(scope="module")
def runner(ray_cluster: RayCluster) -> Iterator[Runner]:  # noqa: F811
    with ray_runner(max_concurrent=12) as made:
        yield made


def node_of(result: object) -> str:
    notes = [n for n in getattr(result, "notes", []) if n.startswith("ray: ran on node ")]
    assert len(notes) == 1, notes
    return notes[0].split(" in its ")[0].removeprefix("ray: ran on node ")


def processes_with(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc.pid)
    return found


def test_oneshot_runs_on_a_node_in_its_sandbox(runner: Runner) -> None:
    from execbox.audit.reader import records

    result = runner.run_code("import os; print(os.getcwd(), os.getuid())", timeout=30)
    assert result.ok, result
    assert runner.audit.path is not None
    logged = [r for r in records(runner.audit.path) if r.get("event") == "exec" and r["backend"] == "ray"][-1]
    assert f"ray: ran on node {node_of(result)}" in " ".join(logged["notes"])  # the audit record names the node
    assert result.backend == "ray"
    assert result.stdout.startswith("/workspace ")
    assert node_of(result).startswith(("127.", "192.", "10.", "172."))
    assert any(n.endswith("in its bubblewrap sandbox") for n in result.notes)


def test_capabilities_are_what_every_node_enforces(runner: Runner) -> None:
    backend = runner.aio.backend("ray")
    caps = runner._call(backend.check)
    local = runner._call(runner.aio.backend("bubblewrap").check)
    assert caps.sandbox and caps.remote and caps.persistent_sessions and caps.file_transfer and caps.streaming
    assert caps.isolation == local.isolation
    assert caps.network_modes == local.network_modes
    assert caps.limits == local.limits
    assert not caps.mounts  # the driver's paths are not on the nodes
    assert len(backend.details()["nodes"]) == 3


def test_the_guard_refuses_a_cluster_whose_nodes_are_no_sandbox(ray_cluster: RayCluster) -> None:  # noqa: F811
    with Runner(Settings.from_env(backend="ray"), options={"ray": {"node_backend": "local_subprocess"}}) as plain:
        with pytest.raises(NotASandboxError, match="not every node of the Ray cluster is a sandbox"):
            plain.run_code("print(1)")


def live_on_nodes(runner: Runner) -> int:
    import ray

    nodes = runner.aio.backend("ray")._nodes.values()
    return sum(ray.get([node.actor.live.remote() for node in nodes], timeout=30))


def test_the_verdict_never_surveys_the_first_run_checks_first(ray_cluster: RayCluster) -> None:  # noqa: F811
    # another configuration: nodes this process has not surveyed yet
    with Runner(Settings.from_env(backend="ray"), options={"ray": {"node_backend": "bubblewrap",
                                                                   "slots_per_node": 3}}) as fresh:
        backend = fresh.aio.backend("ray")
        started = time.monotonic()
        verdict = fresh.aio.verdict(backend)
        assert time.monotonic() - started < 0.5 and not backend._nodes  # asked nothing of the cluster
        assert not verdict.sandbox and "no node of the Ray cluster is known yet" in verdict.reason
        assert fresh.run("echo ok").stdout == "ok\n"  # the run checks (surveys), then the guard judges the nodes
        assert fresh.aio.verdict(backend).sandbox and len(backend._nodes) == 3


def test_a_readopted_host_actor_closes_the_sandboxes_its_driver_forgot(runner: Runner) -> None:
    backend = runner.aio.backend("ray")
    with runner.sandbox("ray") as sb:
        sb.exec("true")
        assert live_on_nodes(runner) == 1
        node = next(n for n in backend._nodes.values() if runner._call(n.actor.live.remote) == 1)
        backend.lost(node, RuntimeError("as if its actor had died"))  # forgotten: close() will skip it
        assert node.node_id not in backend._nodes
        # the next placement surveys in the background: the same live actor is adopted again, and closes it
        assert runner.run("echo placed").stdout == "placed\n"
        assert wait_until(lambda: node.node_id in backend._nodes, 30), "a forgotten live node never came back"
        assert live_on_nodes(runner) == 0


def test_an_open_given_up_on_leaves_nothing_on_its_node(ray_cluster: RayCluster) -> None:  # noqa: F811
    # host actors of their own (another slot count): what other tests opened or forgot is not counted here
    with Runner(Settings.from_env(backend="ray"), options={"ray": {**NODE["ray"], "slots_per_node": 2}}) as runner:
        backend = runner.aio.backend("ray")
        runner._call(backend.check)  # the nodes known: each open is sent to one

        async def give_up() -> None:
            with anyio.move_on_after(0.02):  # cancelled while the node opens it
                session = await backend.open_session(SessionSpec("none", Limits(), oneshot=False, lifetime_s=300))
                await session.close()  # opened before the deadline: closed as a caller would

        for _ in range(3):
            runner._call(give_up)
        assert wait_until(lambda: live_on_nodes(runner) == 0, 20), "an abandoned open outlived its caller"


def test_node_errors_keep_their_constructor_fields() -> None:
    node = Node("n" * 20, "10.0.0.1", None, "bubblewrap", RayBackend.capabilities, {}, 1, 1)
    unavailable = _rebuild(_error(MissingExtraError("no docker sdk", extra="docker", present="a socket",
                                                    fix="pip install 'execbox[docker]'"))[1], node)
    assert isinstance(unavailable, MissingExtraError) and isinstance(unavailable, BackendUnavailableError)
    assert unavailable.reason.startswith("no docker sdk") and "10.0.0.1" in unavailable.reason
    assert (unavailable.fix, unavailable.extra, unavailable.present) == ("pip install 'execbox[docker]'", "docker",
                                                                         "a socket")
    denied = _rebuild(_error(SandboxPermissionError("read-only: a.txt"))[1], node)
    assert isinstance(denied, PermissionError) and denied.errno == errno.EACCES
    assert "10.0.0.1" in str(denied)


def test_secrets_output_cap_and_collect_hold_across_the_hop(runner: Runner) -> None:
    code = "import os, sys; open('out.txt', 'w').write('kept'); print(os.environ['TOKEN']); print('x' * 100000)"
    result = runner.run_code(code, secrets={"TOKEN": "s3cret-value-42"}, max_output_bytes=2000, collect=["out.txt"])
    assert result.exit_code == 0, result
    assert "s3cret-value-42" not in result.stdout and "[secret TOKEN]" in result.stdout
    assert result.truncated and len(result.stdout) < 4000
    assert result.files == {"out.txt": b"kept"}


def test_network_proxy_attempts_come_back_from_the_node(runner: Runner) -> None:
    code = ("import urllib.request\ntry:\n    urllib.request.urlopen('http://example.com/', timeout=10)\n"
            "except Exception as exc:\n    print(type(exc).__name__)")
    result = runner.run_code(code, network="proxy", timeout=30)
    assert result.exit_code == 0, result
    assert [(a.host, a.allowed) for a in result.egress] == [("example.com", False)], result.egress


def test_a_session_is_pinned_to_its_node_with_its_files(runner: Runner, tmp_path: Path) -> None:
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "a.txt").write_text("uploaded")
    with runner.sandbox("ray") as sb:
        sb.write_file("data.txt", b"42")
        first = sb.exec("cat data.txt")
        sb.upload(tmp_path / "up", "up")
        second = sb.exec("cat up/a.txt && echo more > up/b.txt")
        assert (first.stdout, second.stdout) == ("42", "uploaded")
        assert node_of(first) == node_of(second)
        assert sb.read_file("up/b.txt") == b"more\n"
        assert sorted(f.name for f in sb.list_files("up")) == ["a.txt", "b.txt"]
        sb.download("up", tmp_path / "down")
        assert (tmp_path / "down" / "b.txt").read_text() == "more\n"
        cell = sb.run_cell("x = 6 * 7\nx")
        assert cell.ok and cell.outputs[0].text == "42"
        seen: list[tuple[float, str]] = []
        streamed = sb.exec("echo one; sleep 1; echo two", on_stdout=lambda text: seen.append((time.monotonic(), text)))
        assert streamed.stdout == "one\ntwo\n"
        assert "".join(text for _, text in seen) == "one\ntwo\n"
        assert seen[-1][0] - seen[0][0] > 0.5  # the first line reached the caller while the command ran


def test_500_oneshots_spread_over_the_nodes(runner: Runner) -> None:
    started = time.monotonic()
    with runner.map(["print(1)"] * 500, progress=False) as batch:
        items = list(batch)
    took = time.monotonic() - started
    assert all(item.ok for item in items), [item.error or item.result for item in items if not item.ok][:3]
    share = collections.Counter(node_of(item.result) for item in items)
    assert len(share) == 3 and min(share.values()) > 50, share  # every node took its part
    print(f"500 one-shots in {took:.1f} s over 3 nodes: {dict(share)}")


class TestRayConformance(BackendConformance):
    backend_name = "ray"

    @pytest.fixture
    def runner(self, ray_cluster: RayCluster) -> Iterator[Runner]:  # noqa: F811
        with ray_runner() as made:
            yield made


# --- failures -------------------------------------------------------------------------------------------------


@pytest.fixture
def spare_node(ray_cluster: RayCluster) -> Iterator[None]:  # noqa: F811
    """Put a node back after a test removed one, so that the cluster has three again."""
    before = len(ray_cluster.workers())
    yield
    while len(ray_cluster.workers()) < before:
        ray_cluster.add_node()


def remove_node_of(ray_cluster: RayCluster, label: str) -> None:  # noqa: F811
    node_id = label.split("(")[1].rstrip(")")
    for worker in ray_cluster.workers():
        if worker.node_id.startswith(node_id):
            ray_cluster.remove_node(worker)
            return
    pytest.fail(f"no worker node {label} (the head is never removed)")


def test_a_node_removed_under_a_session_loses_it_at_once(ray_cluster: RayCluster, spare_node: None) -> None:  # noqa: F811
    marker = f"execbox-ray-{uuid.uuid4().hex[:8]}"
    with ray_runner() as runner:
        # sessions until one lands on a worker node (the head node cannot be removed)
        heads = [node.node_id for node in ray_cluster.workers()]
        with runner.sandbox("ray") as sb, runner.sandbox("ray") as sb2:
            where = {s: node_of(s.exec("true")) for s in (sb, sb2)}
            target = next((s for s, label in where.items() if any(h.startswith(label.split("(")[1][:-1])
                                                                   for h in heads)), None)
            assert target is not None, where
            target.write_file("state.txt", b"gone soon")
            outcome: list[BaseException] = []

            def run() -> None:
                try:
                    target.exec(["sh", "-c", f"sleep 60; echo {marker}"], timeout=90)
                except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
                    outcome.append(exc)

            thread = threading.Thread(target=run)
            thread.start()
            assert wait_until(lambda: processes_with(marker), 15)
            removed = time.monotonic()
            remove_node_of(ray_cluster, where[target])
            thread.join(30)
            assert outcome and isinstance(outcome[0], SandboxLostError), outcome
            assert time.monotonic() - removed < 15  # at once: not at the command's end, nor its timeout
            assert not outcome[0].retryable and "not run again" in str(outcome[0])
            with pytest.raises(SandboxLostError):
                target.read_file("state.txt")
            # the other session, if elsewhere, still works
            other = sb2 if target is sb else sb
            if where[other] != where[target]:
                assert other.exec("echo alive").stdout == "alive\n"
    assert wait_until(lambda: not processes_with(marker), 20), "a sandbox process outlived its node"


def test_a_docker_node_removed_under_a_session(ray_cluster: RayCluster, spare_node: None) -> None:  # noqa: F811
    """Docker's containers do not die with their owner: the host actor that starts on the node next sweeps them."""
    docker = pytest.importorskip("docker")
    engine = docker.from_env()
    on_docker = {"ray": {"node_backend": "docker"}}
    with Runner(Settings.from_env(backend="ray"), options=on_docker) as runner:
        backend = runner.aio.backend("ray")
        runner._call(backend.check)
        workers = {w.node_id[:12]: w for w in ray_cluster.workers()}
        with runner.sandbox("ray") as sb, runner.sandbox("ray") as sb2:
            where = {s: node_of(s.exec("true")) for s in (sb, sb2)}
            target = next(s for s, label in where.items() if label.split("(")[1][:-1] in workers)
            pid = backend.details()["nodes"][where[target]]["pid"]
            assert containers_of(engine, pid)
            ray_cluster.remove_node(workers[where[target].split("(")[1][:-1]])
            with pytest.raises(SandboxLostError):
                target.exec("sleep 30", timeout=60)
        ray_cluster.add_node()
        runner._call(backend.probe)  # the new node's host actor starts, and its first check sweeps
        assert wait_until(lambda: not containers_of(engine, pid), 30), containers_of(engine, pid)


def test_a_node_removed_under_a_batch(ray_cluster: RayCluster, spare_node: None) -> None:  # noqa: F811
    marker = f"execbox-ray-{uuid.uuid4().hex[:8]}"
    items = [["sh", "-c", f"sleep 4; echo {marker}"]] * 12
    with ray_runner(max_concurrent=12) as runner:
        backend = runner.aio.backend("ray")
        runner._call(backend.check)
        victim = ray_cluster.workers()[0]

        def remove_when_running() -> None:
            if wait_until(lambda: len(processes_with(marker)) >= 6, 30):
                ray_cluster.remove_node(victim)

        remover = threading.Thread(target=remove_when_running)
        remover.start()
        with runner.map(items, progress=False) as batch:  # runs as it is iterated
            done = list(batch)
        remover.join()
    lost = [item for item in done if item.error is not None]
    ran = [item for item in done if item.result is not None]
    assert lost and all(isinstance(item.error, SandboxLostError) for item in lost), [i.error for i in lost]
    assert len(lost) <= 4  # that node's share (its slots), never the rest
    assert all(item.ok and item.result.stdout.strip() == marker for item in ran)
    assert len(lost) + len(ran) == 12
    assert all(not node_of(item.result).endswith(f"({victim.node_id[:12]})") for item in ran)
    assert wait_until(lambda: not processes_with(marker), 20), "a sandbox process outlived its node"


def test_a_oneshot_is_run_again_elsewhere_only_when_asked(ray_cluster: RayCluster, spare_node: None) -> None:  # noqa: F811
    marker = f"execbox-ray-{uuid.uuid4().hex[:8]}"
    retrying = {"ray": {**NODE["ray"], "retry_oneshots": True}}
    with Runner(Settings.from_env(backend="ray"), options=retrying) as runner:
        runner._call(runner.aio.backend("ray").check)
        victim = ray_cluster.workers()[0]

        def remove_when_running() -> None:
            if wait_until(lambda: len(processes_with(marker)) >= 3, 30):
                ray_cluster.remove_node(victim)

        remover = threading.Thread(target=remove_when_running)
        remover.start()
        # one per node: the placement spreads them
        with runner.map([["sh", "-c", f"sleep 3; echo {marker}"]] * 3, progress=False) as batch:
            done = list(batch)
        remover.join()
    assert all(item.ok for item in done), [item.error for item in done]
    again = [item.result for item in done if item.result and any("run again" in n for n in item.result.notes)]
    assert len(again) == 1, [item.result.notes for item in done if item.result]
    assert not node_of(again[0]).endswith(f"({victim.node_id[:12]})")


DRIVER = textwrap.dedent("""
    import os, sys
    import ray
    from execbox import Runner, Settings
    ray.init(address=sys.argv[1], log_to_driver=False)
    runner = Runner(Settings.from_env(backend="ray"), options={"ray": {"node_backend": "bubblewrap"}})
    runner.run(["sh", "-c", "sleep 300; echo " + os.environ["MARKER"]], timeout=8)
""")


def test_the_driver_killed_its_sandboxes_end_by_their_deadlines(ray_cluster: RayCluster) -> None:  # noqa: F811
    marker = f"execbox-ray-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "MARKER": marker, "PYTHONPATH": SRC}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, ray_cluster.address], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: processes_with(marker), 60), driver.stderr
        killed = time.monotonic()
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        assert wait_until(lambda: not processes_with(marker), 30), "the sandbox outlived its driver's deadline"
        assert time.monotonic() - killed < 30
    finally:
        if driver.poll() is None:
            driver.kill()


def test_without_ray_installed_the_backend_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what find_spec sees of a package that is not installed
    with Runner(Settings.from_env(backend="ray")) as runner, pytest.raises(MissingExtraError) as raised:
        runner.run("true")
    assert raised.value.fix == "pip install 'execbox[ray]'"


@pytest.mark.parametrize(("address", "code", "says"), [
    ("ray://127.0.0.1:1", 126, "do not retry until"), ("127.0.0.1:1", 126, "do not retry until"),
    ("no-port-here", 2, "is not `auto`, `host:port` or `ray://host:port`")])
def test_an_unreachable_cluster_is_refused_at_once(address: str, code: int, says: str) -> None:
    started = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "execbox"), "run", "--backend", "ray", "--", "true"],
                          env={**os.environ, "CODE_EXEC_RAY_ADDRESS": address, "PYTHONPATH": SRC},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 30
