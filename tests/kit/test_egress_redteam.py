"""Red team of the egress proxy's fixes for issue 25 (B2-B5): what the code can still do, attacking as the
sandboxed code would, against upstreams this test starts on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from execbox.kit.proxy import secrets as es
from execbox.kit.proxy import server as px
from execbox.kit.proxy.protocol import HeadError, parse_head
from execbox.kit.proxy.server import EgressProxy
from execbox.policy.egress import EgressPolicy
from execbox.secrets import egress as egress_given
from tests.backends.test_secrets_egress import SECRET_HOST
from tests.kit.test_egress_heads import VALUE, header, through, world

__all__ = ["world"]  # the fixture, used here


def _get(placeholder: bytes) -> bytes:
    return b"GET / HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nAuthorization: " + placeholder + b"\r\n\r\n"


def test_a_reflection_cut_short_mid_body_gives_the_placeholder_s_start(world: dict[str, Any]) -> None:
    """A host that echoes the key truncated ("invalid key sk-live-0123...", then more text): the start of the value
    was let out as itself once the next byte showed it was no whole match."""
    def truncated(lines: list[bytes], body: bytes, tls: socket.socket) -> None:
        text = b'{"error": "invalid key ' + header(lines, b"authorization")[:30] + b'..."}'
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(text), text))

    proxy, run, server, placeholder = world["start"](truncated)
    answer = through(proxy, run, server.port, _get(placeholder))
    proxy.finish_run(run)
    assert VALUE[:9].encode() not in answer
    assert answer.endswith(b'{"error": "invalid key ' + placeholder[:30] + b'..."}')


def test_a_body_ending_like_the_value_s_first_bytes_comes_back_as_it_is(world: dict[str, Any]) -> None:
    """A start of the value too short to tell anything (the value begins with s) is not rewritten at the end."""
    def plain(lines: list[bytes], body: bytes, tls: socket.socket) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nthis: sk")

    proxy, run, server, placeholder = world["start"](plain)
    answer = through(proxy, run, server.port, _get(placeholder))
    proxy.finish_run(run)
    assert answer.endswith(b"\r\n\r\nthis: sk")


def _chunk_extension(auth: bytes, tls: socket.socket) -> None:
    tls.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;k=" + auth + b"\r\nok\r\n0\r\n\r\n")


def _informational_first(auth: bytes, tls: socket.socket) -> None:
    tls.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: " + auth + b"\r\n\r\n")
    tls.sendall(b"HTTP/1.1 200 " + auth[:20] + b"\r\nContent-Length: 2\r\n\r\nok")


def _head_split_by_a_pause(auth: bytes, tls: socket.socket) -> None:
    tls.sendall(b"HTTP/1.1 200 OK\r\nX-Echo: " + auth[:15])
    time.sleep(0.5)
    tls.sendall(auth[15:] + b"\r\nContent-Length: 2\r\n\r\nok")


def _both_lengths(auth: bytes, tls: socket.socket) -> None:
    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"%x\r\n%b\r\n0\r\n\r\n" % (len(auth), auth))


def _huge_chunk(auth: bytes, tls: socket.socket) -> None:
    tls.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffff\r\n" + auth[:30])
    tls.close()


@pytest.mark.parametrize("reflect", [_chunk_extension, _informational_first, _head_split_by_a_pause,
                                     _both_lengths, _huge_chunk])
def test_other_reflections_never_carry_the_value_back(world: dict[str, Any], reflect: Any) -> None:
    """Held on today's code: a chunk extension (dropped when re-chunked), a 1xx head and a status line (swapped
    whole), a head paused half-way (read whole), both lengths (withheld), a chunk cut short (its start swapped)."""
    proxy, run, server, placeholder = world["start"](
        lambda lines, body, tls: reflect(header(lines, b"authorization"), tls))
    answer = through(proxy, run, server.port, _get(placeholder))
    proxy.finish_run(run)
    assert VALUE[:9].encode() not in answer and VALUE[-9:].encode() not in answer
    assert header(server.requests[0][0], b"authorization") == VALUE.encode()


def test_transfer_encoding_on_http_1_0_is_refused() -> None:
    """RFC 9112 6.1: an HTTP/1.0 recipient may ignore Transfer-Encoding and read the chunked body as the next
    request (with +body, the value swapped into it, to another virtual host)."""
    with pytest.raises(HeadError, match="HTTP/1.0"):
        parse_head(b"POST / HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(HeadError, match="HTTP/1.0"):
        parse_head(b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", response=True)
    assert parse_head(b"POST / HTTP/1.0\r\nHost: a\r\nContent-Length: 2\r\n\r\n").length == 2


# --- the in-sandbox forwarder: one connection that never reads its responses stops no other -------------------

_BIG = 64 << 20


class _Big(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        size = _BIG if self.path == "/big" else 2
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        with contextlib.suppress(OSError):
            block = b"x" * (1 << 20) if size > 2 else b"ok"
            for _ in range(max(1, size >> 20)):
                self.wfile.write(block)

    def log_message(self, *args: object) -> None:
        pass


SLOW_READER = """
import os, socket, time
host, port = os.environ["HTTP_PROXY"][len("http://"):].rsplit(":", 1)
stuck = []
for _ in range(3):  # responses of 64 MiB each, never read
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"GET http://127.0.0.1:{port}/big HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    stuck.append(s)
time.sleep(2)  # long enough for their buffers to fill
s = socket.create_connection((host, int(port)), timeout=30)
s.sendall(b"GET http://127.0.0.1:{port}/small HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
got = b""
while True:
    data = s.recv(65536)
    if not data:
        break
    got += data
print(got.split(b"\\r\\n\\r\\n", 1)[1].decode())
"""


@pytest.fixture
def big() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Big)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_connections_that_never_read_their_responses_stop_no_other(big: int) -> None:
    proxy = EgressProxy(EgressPolicy.build([f"127.0.0.1/32:{big}"], defaults=False))
    try:
        run = proxy.start_run()
        argv = [part.replace(run.sandbox_socket, run.host_socket) for part in
                EgressProxy.command(run, [sys.executable, "-c", SLOW_READER.replace("{port}", str(big))])]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        proxy.finish_run(run)
    finally:
        proxy.close()
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("name", [b"Content_Length", b"transfer_encoding", b"Transfer_Encoding"])
def test_a_field_named_like_a_framing_one_with_underscores_is_refused(name: bytes) -> None:
    """Servers that read _ as - in field names (CGI-style mapping) would frame the body by it where the proxy framed
    it by the real one: the rest of the body read as a second request (with +body, the value swapped into it)."""
    with pytest.raises(HeadError, match="framing"):
        parse_head(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n" + name + b": chunked\r\n\r\n")
    assert parse_head(b"GET / HTTP/1.1\r\nHost: a\r\nX_Forwarded_For: b\r\n\r\n").values("x_forwarded_for") == ["b"]



# --- exhausting the proxy: every read from the sandbox is bounded ----------------------------------------------


def _was_cut(conn: socket.socket) -> bool:
    """The proxy closed it: end of stream, or a reset (a byte the dribbler sent after the close)."""
    try:
        return conn.recv(100) == b""
    except ConnectionResetError:
        return True


def test_silent_and_dribbling_heads_are_cut_and_connections_beyond_the_cap_refused(
        big: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held on today's code: slowloris heads end at HEAD_TIMEOUT_S (a total, not per byte), a connection past
    MAX_CONNECTIONS gets a 503 at once, and once the held ones are cut a request gets through."""
    monkeypatch.setattr(px, "HEAD_TIMEOUT_S", 2.0)
    monkeypatch.setattr(px, "MAX_CONNECTIONS", 20)
    proxy = EgressProxy(EgressPolicy.build([f"127.0.0.1/32:{big}"], defaults=False))
    held: list[socket.socket] = []
    try:
        run = proxy.start_run()
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(run.host_socket)
            held.append(s)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
            extra.settimeout(30)
            extra.connect(run.host_socket)
            assert extra.recv(100).startswith(b"HTTP/1.1 503")
        start = time.monotonic()
        while time.monotonic() - start < 4:  # one byte a half second: the head never completes in time
            held[0].send(b"G")
            time.sleep(0.5)
            with contextlib.suppress(BlockingIOError):
                held[0].setblocking(False)
                if _was_cut(held[0]):
                    break
                held[0].setblocking(True)
        for s in held:
            s.setblocking(True)
            assert _was_cut(s)  # cut, well within the 30 s timeout
        answer = b""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(run.host_socket)
            s.sendall(f"GET http://127.0.0.1:{big}/small HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            while data := s.recv(65536):
                answer += data
        proxy.finish_run(run)
    finally:
        for s in held:
            s.close()
        proxy.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\nok")


def test_an_intercepted_connection_that_dribbles_its_head_is_cut_with_nothing_sent(
        world: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(es, "HANDSHAKE_TIMEOUT_S", 2.0)
    proxy, run, server, placeholder = world["start"]()

    def dribble(tls: Any) -> None:
        with contextlib.suppress(OSError):  # cut half-way
            for byte in b"\r\nAuthorization: " + placeholder:
                tls.sendall(bytes([byte]))
                time.sleep(0.1)

    answer = through(proxy, run, server.port, b"GET / HTTP/1.1\r\nHost: " + SECRET_HOST.encode(), dribble)
    [attempt], _ = proxy.finish_run(run)
    assert answer == b"" and server.requests == [] and server.raw == b""
    assert not attempt.allowed and "no request head" in attempt.reason


def test_a_placeholder_split_by_chunk_framing_is_still_caught_on_plain_http() -> None:
    """The guard looked at the body as it came, framing included, so a placeholder split over two chunks (which the
    upstream joins) went out unseen and the attempt read allowed."""
    secrets = egress_given.RunSecrets(egress_given.check({"K": ("api.example.com", VALUE)}))
    placeholder = secrets.secrets[0].placeholder
    attempt = px._Attempt("elsewhere.example", 80, allowed=True, reason="allowlisted")
    sent: list[bytes] = []

    class Writer:
        def write(self, data: bytes) -> None:
            sent.append(data)

        async def drain(self) -> None:
            pass

    async def go() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(b"5\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (placeholder[:5], len(placeholder) - 5, placeholder[5:]))
        reader.feed_eof()
        await px._copy_chunked(es.GuardedReader(reader, secrets, attempt), Writer(), attempt)  # type: ignore[arg-type]

    with pytest.raises(ConnectionAbortedError):
        asyncio.run(go())
    assert not attempt.allowed and "exfiltration attempt" in attempt.reason and attempt.secrets == ["K"]
    assert placeholder[5:] not in b"".join(sent)


PROXIES = """
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from execbox.policy.egress import EgressPolicy
from execbox.kit.proxy.server import EgressProxy
proxies = [EgressProxy(EgressPolicy.build(["127.0.0.1/32:{port}"], defaults=False)) for _ in range(2)]
print(" ".join(p.start_run().host_socket for p in proxies), flush=True)
sys.stdin.readline()  # the sandboxes' code holds its connections now
opened = []
try:
    while len(opened) < 64:
        opened.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print("can open", len(opened), "files", flush=True)
for p in proxies:
    p.close()
"""


def test_sandboxes_cannot_take_every_descriptor_of_the_caller() -> None:
    """Each proxy admits 256 connections from its sandbox, each with an upstream: two descriptors apiece, so two
    sandboxes' code could take 1024 of the caller's, the soft limit of many systems, and every other open of the
    caller failed (EMFILE). Here the caller's limit is 256 and two sandboxes try to hold 150 tunnels each: the caller
    must keep room for 64 files of its own, and the connections past its share get a 503."""
    upstream = socket.create_server(("127.0.0.1", 0), backlog=512)
    kept: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                kept.append(upstream.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    port = upstream.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", PROXIES.replace("{port}", str(port))], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        paths = child.stdout.readline().split()
        answers = []
        for path in paths:
            for _ in range(150):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(30)
                s.connect(path)
                with contextlib.suppress(OSError):  # refused at once: the proxy may be gone before it is asked
                    s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
                answers.append(s.recv(12))
                held.append(s)
        child.stdin.write("\n")
        child.stdin.flush()
        said = child.stdout.readline().strip()
    finally:
        for s in held:
            s.close()
        child.kill()
        child.wait(30)
        upstream.close()
        for s in kept:
            s.close()
    assert said == "can open 64 files"
    assert b"HTTP/1.1 200" in answers and b"HTTP/1.1 503" in answers


@pytest.mark.parametrize("value", [VALUE + "\r\nHost: evil.example", VALUE + "\n", "\x1b" + VALUE, VALUE + "\x7f"])
def test_a_value_a_request_head_cannot_carry_is_refused(value: str) -> None:
    """Swapped into the head, a CR or LF in the value would split it where the code put the placeholder: the proxy
    itself would send the bare LF it refuses from the code."""
    with pytest.raises(ValueError, match="control character"):
        egress_given.check({"K": ("api.example.com", value)})
    assert egress_given.check({"K": ("api.example.com", VALUE + "\t+/=é")})["K"][2].reveal().endswith("é")
