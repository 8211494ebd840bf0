"""Network mode proxy on the real docker engine and real bubblewrap: pip installs from the registry through the
proxy; whatever the code tries, listeners this test starts on loopback, on the docker bridge's gateway and on this
host's own address get no connection; every attempt is recorded per run; nothing of the proxy outlives its sandbox."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import subprocess
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from execbox import BackendUnavailableError, Runner, Settings
from execbox.cli import main as cli_main
from execbox.kit.proxy import server as px
from execbox.runner import run_blocking
from execbox.testing import engine_missing
from execbox.testing.checks import Listener

pytestmark = pytest.mark.engine

BACKENDS = ["docker", "bubblewrap"]
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def usable(backend: str) -> Runner:
    runner = Runner(Settings.from_env(backend=backend, network="proxy"))
    try:
        caps = run_blocking(runner.aio.backend(backend).check)
    except BackendUnavailableError as exc:
        engine_missing(f"{backend} cannot run here: {exc}")
    assert "proxy" in caps.network_modes
    return runner


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "execbox-egress-proxy"]


def proxy_dirs() -> list[str]:
    mine = f"{px.DIR_PREFIX}{os.getpid()}-"
    return [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(mine)]


@pytest.fixture(autouse=True)
def nothing_of_the_proxy_outlives_its_sandbox() -> Iterator[None]:
    yield
    assert proxy_dirs() == [] and proxy_threads() == []


# --- the registry through the proxy ---------------------------------------------------------------------------

PIP = ("PIP_CONFIG_FILE=/dev/null python3 -m pip install --no-cache-dir --disable-pip-version-check --quiet "
       "--target /workspace/lib --index-url https://pypi.org/simple six && "
       "PYTHONPATH=/workspace/lib python3 -c 'import six; print(\"six\", six.__version__)'")


@pytest.mark.parametrize("backend", BACKENDS)
def test_pip_installs_a_small_package_from_the_registry(backend: str) -> None:
    usable(backend)
    # This machine reaches the registries through a TLS-inspecting front whose CA only the host's bundle has.
    runner = Runner(Settings.from_env(backend=backend, network="proxy", ca_bundle=CA_BUNDLE))
    result = runner.run(PIP, timeout=120)
    assert result.exit_code == 0, result
    assert result.stdout.strip().startswith("six 1."), result
    hosts = {(a.host, a.port, a.allowed) for a in result.egress}
    assert ("pypi.org", 443, True) in hosts and ("files.pythonhosted.org", 443, True) in hosts, result.egress
    assert all(a.bytes_received > 0 and a.address for a in result.egress if a.allowed)


# --- no route anywhere, whatever the code tries -----------------------------------------------------------------

PROBE = textwrap.dedent("""
    import json, os, socket, sys, urllib.request
    t = json.loads(sys.argv[1])
    port, report = t["port"], {}
    for name in ("NO_PROXY", "no_proxy"):  # loopback literals go to the proxy too
        os.environ.pop(name, None)

    def attempt(key, fn):
        try:
            report[key] = "OK " + str(fn())[:200]
        except Exception as exc:
            report[key] = "FAILED " + type(exc).__name__ + " " + str(exc)[:200]

    def tcp(host):
        with socket.create_connection((host, port), timeout=3):
            return "connected"

    def udp(host, udp_port):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            query = bytes.fromhex("abcd01000001000000000000047079706903") + b"org\\0\\0\\1\\0\\1"  # pypi.org A
            return s.sendto(query, (host, udp_port))

    def fetch(url, proxied=True):
        handlers = [] if proxied else [urllib.request.ProxyHandler({})]  # ProxyHandler({}) is curl --noproxy '*'
        with urllib.request.build_opener(*handlers).open(url, timeout=5) as response:
            return response.read()

    def bracket(host):
        return "[%s]" % host if ":" in host else host

    for host in t["tcp"]:
        attempt("direct " + host, lambda: tcp(host))
        attempt("noproxy " + host, lambda: fetch("http://%s:%d/" % (bracket(host), port), proxied=False))
        attempt("literal http " + host, lambda: fetch("http://%s:%d/" % (bracket(host), port)))
        attempt("literal https " + host, lambda: fetch("https://%s:%d/" % (bracket(host), port)))
    for host in t["udp"]:
        attempt("udp " + host, lambda: udp(host, t["udp_port"]))
    attempt("dns " + t["resolver"], lambda: udp(t["resolver"], 53))
    attempt("getaddrinfo", lambda: socket.getaddrinfo("pypi.org", 443))
    for name in t["names"]:
        attempt("name http " + name, lambda: fetch("http://%s:%d/" % (name, port)))
        attempt("name https " + name, lambda: fetch("https://%s:%d/" % (name, port)))
        attempt("name noproxy " + name, lambda: fetch("http://%s:%d/" % (name, port), proxied=False))
    attempt("denied name", lambda: fetch("https://evil.example/"))
    report["ifaces"] = sorted(name for _, name in socket.if_nameindex())
    print(json.dumps(report))
""")


def own_address() -> str:
    """This host's own address on its default route (connecting a UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.53", 53))
        return str(s.getsockname()[0])


def bridge_gateway() -> str:
    from execbox.backends.docker.engine import connect

    try:
        client, _, _ = connect()
    except BackendUnavailableError as exc:
        engine_missing(f"no Docker engine: {exc}")
    try:
        attrs = client.networks.get("bridge").attrs
    finally:
        client.close()
    gateway = (attrs["IPAM"]["Config"] or [{}])[0].get("Gateway")
    if gateway:
        return str(gateway)
    # Not reported by every engine version: the bridge interface's own address is the gateway.
    device = (attrs.get("Options") or {}).get("com.docker.network.bridge.name", "docker0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", device.encode()[:15]))  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])


class UdpCounter:
    def __init__(self, host: str, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self.sock.recv(2048)
                self.received += 1
            except (TimeoutError, OSError):
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def udp_counters_on_one_port(hosts: list[str]) -> list[UdpCounter]:
    for _ in range(50):
        made = [UdpCounter(hosts[0])]
        try:
            made += [UdpCounter(host, made[0].port) for host in hosts[1:]]
            return made
        except OSError:
            for counter in made:
                counter.close()
    raise RuntimeError("no UDP port free on every address")


def listeners_on_one_port(hosts: list[str]) -> tuple[int, list[Listener]]:
    """TCP listeners on every host address, all on the same port (so one allowlist entry names them all)."""
    for _ in range(50):
        first = Listener(hosts[0])
        made = [first]
        try:
            for host in hosts[1:]:
                made.append(_listener_at(host, first.port))
            return first.port, made
        except OSError:
            for listener in made:
                listener.close()
    raise RuntimeError("no port free on every address")


def _listener_at(host: str, port: int) -> Listener:
    listener = Listener.__new__(Listener)
    listener.host = host
    listener.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.sock.bind((host, port))
    listener.sock.listen(16)
    listener.sock.settimeout(0.2)
    listener.port = port
    listener.accepted = 0
    listener._stop = threading.Event()
    listener._thread = threading.Thread(target=listener._serve, daemon=True)
    listener._thread.start()
    return listener


@pytest.mark.parametrize("backend", BACKENDS)
def test_listeners_on_loopback_the_bridge_gateway_and_this_host_get_no_connection(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    usable(backend)
    hosts = ["127.0.0.1", bridge_gateway(), own_address(), "::1"]
    port, tcp = listeners_on_one_port(hosts)
    udp = udp_counters_on_one_port(hosts)
    resolved: list[str] = []
    real_resolve = px.resolve

    async def resolve(host: str, port_: int) -> list[str]:
        resolved.append(host)
        if host == "internal.test":  # an allowlisted name that resolves to every listener (DNS rebinding)
            return hosts
        if host == "internal6.test":
            return [f"::ffff:{hosts[0]}", f"::ffff:{hosts[2]}", f"64:ff9b::{hosts[1]}"]
        return await real_resolve(host, port_)

    monkeypatch.setattr(px, "resolve", resolve)
    try:
        for listener in tcp:  # the control: each listener accepts a connection from the host
            socket.create_connection((listener.host, port), timeout=3).close()
            assert listener.wait_for(1) == 1, listener.host
        for counter in udp:
            with socket.socket(counter.sock.family, socket.SOCK_DGRAM) as s:
                s.sendto(b"control", counter.sock.getsockname()[:2])
        runner = Runner(Settings.from_env(backend=backend, network="proxy",
                                          egress_allow=[f"internal.test:{port}", f"internal6.test:{port}"]))
        targets = {"port": port, "tcp": hosts, "udp": hosts, "udp_port": udp[0].port, "resolver": "10.255.255.53",
                   "names": ["internal.test", "internal6.test"]}
        result = runner.run(["python3", "-c", PROBE, json.dumps(targets)], timeout=120)
        assert result.exit_code == 0, result
        report = json.loads(result.stdout.splitlines()[-1])
        assert report.pop("ifaces") == ["lo"]
        succeeded = {key: value for key, value in report.items() if value.startswith("OK") and not key.startswith(
            "udp ")}
        assert succeeded == {}, report
        # A datagram may be refused by the socket or leave it (loopback inside); none may arrive (counted below).
        assert "Network is unreachable" in report["dns 10.255.255.53"], report
        for listener in tcp:
            assert listener.wait_for(2, 0.5) == 1, f"{listener.host}: {listener.accepted - 1} connection(s) from inside"
        assert [c.received for c in udp] == [1] * len(udp), "datagrams from inside"
        # The record: names the proxy resolved and refused, literals refused unresolved, the denied name unresolved.
        by_host: dict[str, list[Any]] = {}
        for a in result.egress:
            by_host.setdefault(a.host, []).append(a)
        assert not any(a.allowed for a in result.egress), result.egress
        assert {a.reason for a in by_host["internal.test"]} == {"resolves to a loopback address (127.0.0.1)"}
        assert all(a.reason.startswith("resolves to an IPv6 form of 127.0.0.1") for a in by_host["internal6.test"])
        for host in ("127.0.0.1", hosts[1], hosts[2], "::1"):
            assert by_host[host] and all("an IP address" in a.reason for a in by_host[host]), by_host.get(host)
        assert [a.reason for a in by_host["evil.example"]] == ["not in the allowlist"]
        assert "evil.example" not in resolved and set(resolved) == {"internal.test", "internal6.test"}
    finally:
        for listener in tcp:
            listener.close()
        for counter in udp:
            counter.close()


# --- a session keeps one proxy; each exec has its own record ----------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_session_keeps_one_proxy_and_each_exec_gets_its_own_attempts(backend: str) -> None:
    runner = usable(backend)
    fetch = "python3 -c \"import urllib.request as u; u.urlopen('https://denied-%s.example/')\" 2>/dev/null; true"
    with runner.sandbox(backend, network="proxy") as sb:
        first = sb.exec(fetch % "one")
        assert len(proxy_dirs()) == 1 and len(proxy_threads()) == 1
        second = sb.exec(fetch % "two")
        quiet = sb.exec("echo nothing")
        assert len(proxy_dirs()) == 1 and len(proxy_threads()) == 1
    assert [a.host for a in first.egress] == ["denied-one.example"]
    assert [a.host for a in second.egress] == ["denied-two.example"]
    assert quiet.egress == [] and quiet.stdout == "nothing\n"


def test_other_network_modes_have_no_proxy() -> None:
    runner = usable("bubblewrap")
    result = runner.run("echo ${HTTP_PROXY:-none}; test -e /run/execbox && echo bound || echo absent",
                        network="none")
    assert result.stdout.split() == ["none", "absent"] and result.egress == []


# --- the image must have python3 ----------------------------------------------------------------------------------


def test_an_image_without_python3_is_refused_with_the_reason() -> None:
    usable("docker")
    from execbox.backends.docker.image import DEFAULT_TAG

    tag = f"execbox-test-nopython:{os.getpid()}"
    name = f"execbox-test-nopython-{os.getpid()}"
    subprocess.run(["docker", "run", "--name", name, "--user", "0", "--network", "none", DEFAULT_TAG, "sh", "-c",
                    "rm -f /usr/bin/python3*"], check=True, capture_output=True)
    try:
        subprocess.run(["docker", "commit", name, tag], check=True, capture_output=True)
        runner = Runner(Settings.from_env(backend="docker", network="proxy"), options={"docker": {"image": tag}})
        with pytest.raises(BackendUnavailableError, match="has no python3, which network mode proxy runs") as exc:
            runner.run("echo hi")
        assert exc.value.env_var == "CODE_EXEC_DOCKER_IMAGE"
        runner.close()
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, check=False)


def test_execbox_backends_lists_proxy_for_docker_and_bubblewrap() -> None:
    usable("bubblewrap")
    result = CliRunner().invoke(cli_main, ["backends", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    for backend in BACKENDS:
        assert "proxy" in rows[backend]["capabilities"]["network_modes"], rows[backend]


def test_the_cli_says_what_was_denied() -> None:
    usable("bubblewrap")
    code = "import urllib.request as u; u.urlopen('https://evil.example/')"
    result = CliRunner().invoke(cli_main, ["run", "--backend", "bubblewrap", "--network", "proxy", "--", "python3",
                                           "-c", code])
    assert result.exit_code == 1
    assert "execbox: egress denied: evil.example:443 (not in the allowlist)" in result.output


@pytest.mark.parametrize("backend", BACKENDS)
def test_gc_removes_the_proxy_directory_a_killed_caller_left(backend: str) -> None:
    runner = usable(backend)
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tempfile.mkdtemp(prefix=f"{px.DIR_PREFIX}{dead.pid}-1-")
    open(os.path.join(left, "run-0.sock"), "w").close()
    removed = run_blocking(runner.aio.backend(backend).gc)
    assert not os.path.exists(left)
    assert any(left in line for line in removed), removed
