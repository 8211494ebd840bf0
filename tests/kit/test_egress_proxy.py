"""The egress proxy (kit/proxy/server.py) on its own: a client speaks to a run's Unix socket as the in-sandbox forwarder
would; upstreams are listeners on loopback addresses this test starts (allowed only through CIDR entries)."""

from __future__ import annotations

import http.server
import os
import socket
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from execbox import ConfigError, ExecResult
from execbox.kit.ownership import owner_id
from execbox.kit.proxy import server as px
from execbox.kit.proxy.server import EgressProxy, ProxyRun, sweep_orphans, with_egress
from execbox.policy.egress import EgressPolicy
from execbox.testing.checks import Listener


class Upstream(http.server.BaseHTTPRequestHandler):
    """Answers GET with what it received (path and Host), POST with the body; /redirect sends elsewhere."""

    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.example/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = f"path={self.path} host={self.headers.get('Host')} conn={self.headers.get('Connection')}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Keep-Alive", "timeout=5")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def make(*allow: str, **kw: object) -> EgressProxy:
    return EgressProxy(EgressPolicy.build(allow, defaults=False), **kw)  # type: ignore[arg-type]


def ask(run: ProxyRun, data: bytes) -> bytes:
    """Send ``data`` through the run's socket as the forwarder would; all the proxy answered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(run.host_socket)
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def through_forwarder(proxy: EgressProxy, run: ProxyRun, command: str) -> subprocess.CompletedProcess[str]:
    """``command`` behind the real forwarder, on this host (the socket path as the host sees it)."""
    argv = [part.replace(run.sandbox_socket, run.host_socket)
            for part in EgressProxy.command(run, ["sh", "-c", command])]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def test_connect_tunnels_to_an_allowed_address_and_records_bytes(upstream: int) -> None:
    proxy = make(f"127.0.0.1/32:{upstream}")
    try:
        run = proxy.start_run()
        answer = ask(run, f"CONNECT 127.0.0.1:{upstream} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
                     + b"GET /t HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.0 200")
        assert answer.endswith(b"path=/t host=a conn=close")
        [attempt], dropped = proxy.finish_run(run)
        assert (attempt.host, attempt.port, attempt.allowed, attempt.address) == ("127.0.0.1", upstream, True,
                                                                                  "127.0.0.1")
        assert attempt.bytes_sent > 40 and attempt.bytes_received > 100 and dropped == 0
    finally:
        proxy.close()


def test_a_denied_name_is_recorded_and_never_resolved_or_connected(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(px, "resolve", resolve)
    listener = Listener()
    proxy = make(f"127.0.0.1/32:{listener.port}")  # even the address it would resolve to is allowed
    try:
        run = proxy.start_run()
        answer = ask(run, f"CONNECT evil.example:{listener.port} HTTP/1.1\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 403 Forbidden")
        assert b"denied evil.example" in answer and b"not in the allowlist" in answer
        [attempt], _ = proxy.finish_run(run)
        assert (attempt.allowed, attempt.reason, attempt.address) == (False, "not in the allowlist", "")
        assert asked == [] and listener.wait_for(1, 0.3) == 0
    finally:
        proxy.close()
        listener.close()


def test_an_allowlisted_name_resolving_to_loopback_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    listener = Listener()

    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1", "::ffff:127.0.0.1"]

    monkeypatch.setattr(px, "resolve", resolve)
    proxy = make(f"rebind.example:{listener.port}")
    try:
        run = proxy.start_run()
        answer = ask(run, f"CONNECT rebind.example:{listener.port} HTTP/1.1\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 403")
        [attempt], _ = proxy.finish_run(run)
        assert not attempt.allowed and attempt.reason == "resolves to a loopback address (127.0.0.1)"
        assert attempt.address == "127.0.0.1"
        assert listener.wait_for(1, 0.3) == 0
    finally:
        proxy.close()
        listener.close()


def test_only_the_checked_addresses_of_a_name_are_connected_to(monkeypatch: pytest.MonkeyPatch) -> None:
    refused, allowed = Listener("127.0.0.1"), Listener("127.0.0.2")

    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1", "127.0.0.2"]

    monkeypatch.setattr(px, "resolve", resolve)
    proxy = make(f"mixed.example:{allowed.port}", f"127.0.0.2/32:{allowed.port}")
    try:
        run = proxy.start_run()
        ask(run, f"CONNECT mixed.example:{allowed.port} HTTP/1.1\r\n\r\n".encode())
        [attempt], _ = proxy.finish_run(run)
        assert attempt.allowed and attempt.address == "127.0.0.2"
        assert allowed.wait_for(1) == 1 and refused.accepted == 0
    finally:
        proxy.close()
        refused.close()
        allowed.close()


def test_ports_and_literals_are_checked_before_anything_else() -> None:
    proxy = make("ok.example")
    try:
        run = proxy.start_run()
        cases = [("ok.example:22", "port 22 is not allowed for ok.example"), ("127.0.0.1:443", "an IP address"),
                 ("[::1]:443", "an IP address"), ("2130706433:443", "an IP address")]
        for target, _ in cases:
            assert ask(run, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode()).startswith(b"HTTP/1.1 403"), target
        attempts, _ = proxy.finish_run(run)
        assert [a.allowed for a in attempts] == [False] * 4
        for attempt, (_, reason) in zip(attempts, cases, strict=True):
            assert reason in attempt.reason
    finally:
        proxy.close()


def test_plain_http_is_decided_per_request_and_a_redirect_is_a_new_decision(upstream: int) -> None:
    proxy = make(f"127.0.0.1/32:{upstream}")
    try:
        run = proxy.start_run()
        result = through_forwarder(proxy, run, f"curl -sS -H 'Proxy-Authorization: x' http://127.0.0.1:{upstream}/a?b=1"
                                              f"; echo; curl -sS -d payload http://127.0.0.1:{upstream}/p; echo; "
                                              f"curl -sSL http://127.0.0.1:{upstream}/redirect")
        lines = result.stdout.splitlines()
        assert lines[0] == f"path=/a?b=1 host=127.0.0.1:{upstream} conn=close", result
        assert lines[1] == "payload"
        assert "denied elsewhere.example:80 (not in the allowlist)" in lines[2]
        attempts, _ = proxy.finish_run(run)
        assert [(a.host, a.allowed) for a in attempts] == [("127.0.0.1", True)] * 3 + [("elsewhere.example", False)]
    finally:
        proxy.close()


def test_the_forwarder_sets_the_variables_and_a_shells_wait_does_not_wait_for_it(upstream: int) -> None:
    proxy = make(f"127.0.0.1/32:{upstream}")
    try:
        run = proxy.start_run()
        result = through_forwarder(proxy, run, "sleep 0.1 & wait; echo $HTTP_PROXY $https_proxy")
        http_proxy, https_proxy = result.stdout.split()
        assert http_proxy == https_proxy and http_proxy.startswith("http://127.0.0.1:")
        proxy.finish_run(run)
    finally:
        proxy.close()


def test_malformed_and_oversized_requests_are_recorded_and_refused() -> None:
    proxy = make("ok.example")
    try:
        run = proxy.start_run()
        assert ask(run, b"\x16\x03\x01 not http\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert ask(run, b"CONNECT nohostport HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert ask(run, b"GET ftp://ok.example/ HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400")
        huge = b"GET / HTTP/1.1\r\nX: " + b"a" * (px.HEAD_LIMIT + 10) + b"\r\n\r\n"
        assert ask(run, huge).startswith(b"HTTP/1.1 431")
        attempts, _ = proxy.finish_run(run)
        assert len(attempts) == 4 and not any(a.allowed for a in attempts)
    finally:
        proxy.close()


def test_records_are_per_run_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(px, "MAX_RECORDS", 3)
    proxy = make("ok.example")
    try:
        first, second = proxy.start_run(), proxy.start_run()
        for _ in range(5):
            ask(first, b"CONNECT evil.example:443 HTTP/1.1\r\n\r\n")
        ask(second, b"CONNECT other.example:443 HTTP/1.1\r\n\r\n")
        attempts, dropped = proxy.finish_run(first)
        assert (len(attempts), dropped) == (3, 2)
        assert [a.host for a in proxy.finish_run(second)[0]] == ["other.example"]
        result = with_egress(ExecResult(exit_code=0), attempts, dropped)
        assert result.egress == attempts and "2 more connection attempts" in result.notes[0]
    finally:
        proxy.close()


def test_finishing_a_run_closes_its_socket_and_connections_and_close_leaves_nothing(upstream: int) -> None:
    proxy = make(f"127.0.0.1/32:{upstream}")
    run = proxy.start_run()
    assert stat.S_IMODE(os.stat(run.host_socket).st_mode) == 0o600
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held.connect(run.host_socket)
    held.sendall(f"CONNECT 127.0.0.1:{upstream} HTTP/1.1\r\n\r\n".encode())
    assert held.recv(100).startswith(b"HTTP/1.1 200")
    attempts, _ = proxy.finish_run(run, settle_s=0.2)  # the tunnel is still open: it is cut
    assert attempts[0].allowed
    held.settimeout(5)
    assert held.recv(100) == b""
    held.close()
    assert not os.path.exists(run.host_socket)
    proxy.close()
    proxy.close()
    assert not os.path.exists(proxy.directory)
    assert not [t for t in threading.enumerate() if t.name == "execbox-egress-proxy"]


def test_a_ca_bundle_is_copied_in_and_named_by_the_variables(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    proxy = make("ok.example", ca_bundle=bundle)
    try:
        assert Path(proxy.directory, px.CA_FILE).read_bytes() == bundle.read_bytes()
        env = proxy.env()
        assert env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == env["PIP_CERT"] == "/run/execbox/ca-bundle.pem"
        assert env["NO_PROXY"] == "localhost,127.0.0.1,::1"
    finally:
        proxy.close()
    bundle.write_text("not a certificate")
    with pytest.raises(ConfigError, match="CODE_EXEC_CA_BUNDLE"):
        make("ok.example", ca_bundle=bundle)
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(px.DIR_PREFIX + str(os.getpid()))]


@pytest.fixture
def short_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private temp dir with a path short enough for Unix sockets (pytest's tmp_path is too long)."""
    path = Path(tempfile.mkdtemp(prefix="xbt-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    monkeypatch.undo()
    from execbox.files.workspace import remove_tree

    remove_tree(str(path))


def test_gc_sweeps_the_directory_of_a_dead_owner_only(short_tmp: Path) -> None:
    tmp_path = short_tmp
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"{px.DIR_PREFIX}{dead.pid}-1-abcd"
    orphan.mkdir()
    (orphan / "run-x.sock").write_text("")
    live = make("ok.example")  # named after this process
    planted = tmp_path / f"{px.DIR_PREFIX}{dead.pid}-1-link"
    planted.symlink_to(tmp_path)
    try:
        assert sweep_orphans() == [str(orphan)]
        assert not orphan.exists() and os.path.isdir(live.directory) and planted.is_symlink()
    finally:
        live.close()


def test_gc_never_judges_a_directory_another_host_made(short_tmp: Path) -> None:
    # A /tmp shared between containers: the pid in the name means nothing here; the owner file says whose it is.
    dead = subprocess.Popen(["true"])
    dead.wait()
    foreign = short_tmp / f"{px.DIR_PREFIX}{dead.pid}-1-host"
    foreign.mkdir()
    (foreign / "owner").write_text(f"another-host:{dead.pid}:1\n")
    mine_dead = short_tmp / f"{px.DIR_PREFIX}{dead.pid}-1-mine"
    mine_dead.mkdir()
    (mine_dead / "owner").write_text(f"{socket.gethostname()}:{dead.pid}:1\n")
    live = make("ok.example")
    try:
        assert open(os.path.join(live.directory, "owner")).read().strip() == owner_id()
        assert sweep_orphans() == [str(mine_dead)]
        assert foreign.is_dir() and os.path.isdir(live.directory)
    finally:
        live.close()
