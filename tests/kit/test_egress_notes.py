"""What the code's caller is told about egress (issue 25, C): pip behind a TLS-inspecting network failed with only
"from versions: none" while its attempts read allowed. A TLS handshake the sandbox's client refuses inside a tunnel,
or one the proxy's own connection fails, is said on the attempt and in the result's notes, naming
CODE_EXEC_CA_BUNDLE; the MCP tool result carries the run's egress. Upstreams are this test's TLS listeners on
127.0.0.1."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from execbox import ExecResult
from execbox.contract.models import EgressAttempt
from execbox.kit.proxy import secrets as es
from execbox.kit.proxy import server as px
from execbox.kit.proxy.server import EgressProxy, ProxyRun, with_egress
from execbox.mcp.tools import exec_result
from execbox.policy.egress import EgressPolicy
from execbox.secrets import egress as egress_given
from tests.backends.test_secrets_egress import SECRET_HOST, upstream_ca


@pytest.fixture
def tls_upstream(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A TLS listener whose certificate only the returned CA file vouches for; it answers one line, then closes."""
    ca, tls = upstream_ca(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                conn.settimeout(30)
                with tls.wrap_socket(conn, server_side=True) as s:
                    s.recv(100)
                    s.sendall(b"pong")
            except (OSError, ssl.SSLError):
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1], ca
    listener.close()


def tunnel(run: ProxyRun, port: int, ctx: ssl.SSLContext) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(30)
        raw.connect(run.host_socket)
        raw.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
        got = b""
        while not got.endswith(b"\r\n\r\n"):
            got += raw.recv(1)
        with ctx.wrap_socket(raw, server_hostname=SECRET_HOST) as s:
            s.sendall(b"ping")
            return s.recv(100)


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2])
def test_a_handshake_the_sandbox_s_client_refuses_is_said_naming_the_ca_bundle(
        tls_upstream: tuple[int, Path], version: ssl.TLSVersion) -> None:
    port, ca = tls_upstream
    proxy = EgressProxy(EgressPolicy.build([f"127.0.0.1/32:{port}"], defaults=False))
    try:
        run = proxy.start_run()
        untrusting = ssl.create_default_context()  # as a sandbox whose bundle lacks the inspecting network's CA
        untrusting.maximum_version = version
        with pytest.raises(ssl.SSLCertVerificationError):
            tunnel(run, port, untrusting)
        trusting = ssl.create_default_context(cafile=str(ca))
        trusting.maximum_version = version
        assert tunnel(run, port, trusting) == b"pong"
        attempts, dropped = proxy.finish_run(run)
    finally:
        proxy.close()
    refused, fine = attempts
    assert refused.allowed and px.TLS_FAILED in refused.reason and "CODE_EXEC_CA_BUNDLE" in refused.reason
    assert fine.allowed and px.TLS_FAILED not in fine.reason
    notes = with_egress(ExecResult(exit_code=1), attempts, dropped).notes
    assert len(notes) == 1 and notes[0].startswith(f"egress: 127.0.0.1:{port}: ") and "CODE_EXEC_CA_BUNDLE" in notes[0]


def test_a_host_certificate_the_proxy_cannot_verify_names_the_ca_bundle(
        tls_upstream: tuple[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = tls_upstream

    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    monkeypatch.setattr(px, "resolve", resolve)
    proxy = EgressProxy(EgressPolicy.build([f"127.0.0.1/32:{port}"], defaults=False))  # no CODE_EXEC_CA_BUNDLE
    try:
        given = egress_given.check({"K": (f"{SECRET_HOST}:{port}", "sk-live-0123456789abcdef")})
        run = proxy.start_run(egress_given.RunSecrets(given))
        ctx = ssl.create_default_context(cafile=str(Path(proxy.directory) / es.BUNDLE_FILE))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(30)
            raw.connect(run.host_socket)
            raw.sendall(f"CONNECT {SECRET_HOST}:{port} HTTP/1.1\r\n\r\n".encode())
            raw.recv(100)
            with ctx.wrap_socket(raw, server_hostname=SECRET_HOST) as s:
                assert s.recv(100) == b""  # the proxy hangs up: nothing was sent
        [attempt], dropped = proxy.finish_run(run)
    finally:
        proxy.close()
    assert not attempt.allowed and px.TLS_FAILED in attempt.reason and "CODE_EXEC_CA_BUNDLE" in attempt.reason
    assert "CODE_EXEC_CA_BUNDLE" in with_egress(ExecResult(exit_code=1), [attempt], dropped).notes[0]


def test_the_mcp_tool_result_carries_the_run_s_egress() -> None:
    attempts = [EgressAttempt(host="pypi.org", port=443, allowed=True, reason="allowed by pypi.org",
                              bytes_sent=10, bytes_received=20),
                EgressAttempt(host="evil.example", port=443, allowed=False, reason="not in the allowlist")]
    result = exec_result(ExecResult(exit_code=0, egress=attempts, backend="docker"))
    data = result.structured_content or {}
    assert [(a["host"], a["allowed"], a["bytes_received"]) for a in data["egress"]] == [
        ("pypi.org", True, 20), ("evil.example", False, 0)]
    text = result.content[0].text  # type: ignore[union-attr]
    assert "egress allowed: pypi.org:443" in text and "egress denied: evil.example:443" in text


@pytest.mark.parametrize("stderr", ["urllib.error.URLError: <urlopen error [Errno 99] Cannot assign requested address>",
                                    "curl: (7) Failed to connect to localhost port 8000: Couldn't connect to server",
                                    "OSError: [Errno 101] Network is unreachable"])
def test_a_connection_that_never_reached_the_proxy_is_explained(stderr: str) -> None:
    """NO_PROXY=localhost,... sends those to the sandbox's own loopback, and code ignoring the proxy variables
    has no route: neither leaves an attempt, so the note says why egress does not list it."""
    notes = with_egress(ExecResult(exit_code=1, stderr=stderr), [], 0).notes
    assert notes == [px.UNPROXIED_NOTE] and "NO_PROXY" in notes[0] and "loopback" in notes[0]
    assert with_egress(ExecResult(exit_code=0, stderr=stderr), [], 0).notes == []
    assert with_egress(ExecResult(exit_code=1, stderr="Traceback: KeyError"), [], 0).notes == []
