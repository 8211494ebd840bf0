"""Secrets at egress: the sandbox holds a placeholder; the egress proxy puts the real value in, on the way out,
only into HTTPS requests to the one host it is for.

``secrets_at_egress={"OPENAI_API_KEY": ("api.openai.com", value)}`` (or ``CODE_EXEC_EGRESS_SECRETS=
OPENAI_API_KEY=api.openai.com``, the value read from execbox's own environment) needs network mode ``proxy``
on a backend that runs execbox's proxy (docker, bubblewrap). The command's ``OPENAI_API_KEY`` holds a
placeholder of the value's byte length (``EXECBOX-PLACEHOLDER-...``, random per run); code that exfiltrates
the variable leaks a useless token.

Interception, for those hosts alone. A ``CONNECT`` to a secret's host (port 443, or the port named) is
terminated by the proxy with a certificate minted for that host by a CA of this sandbox's own: one CA per
host, made when a run first needs it, its key only in this process's memory, its certificate restricted by
X.509 name constraints to that host, and gone with the sandbox's proxy (``EgressProxy.close``). The sandbox
trusts it through the proxy's CA variables (``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``, ... point at a
bundle of this host's roots, CODE_EXEC_CA_BUNDLE and these CAs). The proxy opens its own TLS connection to
the host, verified against this host's roots (and CODE_EXEC_CA_BUNDLE), and relays one request and one response
(HTTP/1.1 only, offered by ALPN; heads parsed strictly by ``protocol.parse_head``, bodies read by their framing,
nothing after them; then the connection closes), replacing the placeholder by the value in the request's head
(request line and header fields, where API keys go) and the value by the placeholder in everything that comes
back (a server echoing the key; a chunked body is de-chunked first, and a start of the value held back is never
let out as itself, even across a pause; a start of ``PARTIAL`` bytes or more that stops short of the whole value,
mid-body or at its end, becomes the placeholder's start). The two have the same
length, so no length field changes. A secret's host:port counts as allowlisted for its run. Every connection that
carried a substitution lists the secret's name on its ``EgressAttempt`` (``secrets``), and so in the audit log.

Request bodies carry the placeholder unchanged unless the secret's destination ends with ``+body``
(``"api.example.com+body"``, ``CODE_EXEC_EGRESS_SECRETS=NAME=api.example.com+body``). The risk that opt-in takes:
a host that stores a body and hands it back later, to this request or another, in a form the swap back does not
see (base64, escaped, split, compressed by the host's own logic) gives the code the real value.

Exfiltration. A request that carries a placeholder anywhere else is refused before the placeholder is
forwarded and recorded as ``allowed=False`` with the reason ``exfiltration attempt``: a ``CONNECT`` target or
a plain-HTTP request line or header holding it (also one to the secret's own host over plain HTTP: secrets
at egress go over HTTPS only), and a plain-HTTP body or unencrypted tunnel in which it appears (the
connection is cut before the chunk that completes it is sent). HTTPS to other hosts is tunnelled without
interception, so a placeholder inside it is not seen (it is worthless there).

Why ``cryptography`` and the ``ssl`` module rather than mitmproxy: the proxy is already ours (it resolves
and checks every address itself); interception is a few hosts' worth of certificates and two ``start_tls``
calls in it, where mitmproxy would be a second proxy with its own policy and a large dependency tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import re
import secrets as random
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

from execbox.errors import BackendUnavailableError
from execbox.secrets.egress import EgressSecret, RunSecrets, address_of

#: The combined bundle the sandbox trusts when a run has secrets at egress (in the proxy's directory).
BUNDLE_FILE = "execbox-ca-bundle.pem"
HANDSHAKE_TIMEOUT_S = 15.0
#: The shortest start of a value the swap back replaces by the placeholder's start where the rest of the value does
#: not follow (a host echoing the key cut short): fewer bytes tell the code little beyond a key's published prefix.
PARTIAL = 8
_CHUNK = 1 << 16
_HOST_ROOTS = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")


# --- the proxy's hooks (kit.proxy.server calls these) ---------------------------------------------------


def for_run(proxy: Any, run: RunSecrets | None) -> RunSecrets | None:
    """A run's secrets at egress (its spec's ``egress``), for the proxy run being started (and the proxy's
    interceptor, made on first use)."""
    if run is None:
        return None
    interceptor = getattr(proxy, "mitm", None)
    if interceptor is None:
        interceptor = proxy.mitm = Interceptor(proxy.directory, upstream_cafile=_user_bundle(proxy))
    interceptor.ensure({s.host for s in run.secrets})
    run.attached = True
    return run


def ca_env(proxy: Any, run: RunSecrets | None) -> dict[str, str]:
    """The CA variables for a run (empty unless it has secrets at egress)."""
    interceptor = getattr(proxy, "mitm", None)
    if run is None or interceptor is None:
        return {}
    from execbox.kit.proxy.protocol import CA_VARIABLES, MOUNT_POINT

    return {name: f"{MOUNT_POINT}/{BUNDLE_FILE}" for name in CA_VARIABLES}


def _user_bundle(proxy: Any) -> str | None:
    from execbox.kit.proxy.protocol import CA_FILE

    path = os.path.join(proxy.directory, CA_FILE)
    return path if getattr(proxy, "ca_file", None) and os.path.isfile(path) else None


def exfiltration(secret: EgressSecret, where: str) -> str:
    return (f"exfiltration attempt: {where} carries the placeholder of {secret.name} (a secret for "
            f"{secret.host}:{secret.port}, over HTTPS only); refused")


class GuardedReader:
    """A StreamReader whose bytes are checked for placeholders before anyone forwards them: on one, the attempt
    is marked refused and the connection cut (ConnectionAbortedError) before the chunk completing it is
    returned."""

    def __init__(self, reader: asyncio.StreamReader, secrets: RunSecrets, attempt: Any) -> None:
        self._reader = reader
        self._secrets = secrets
        self._attempt = attempt
        self._tail = b""

    def _check(self, data: bytes, framing: bool = False) -> bytes:
        # A chunked body's framing (its lines, read by readuntil and readexactly) is judged on its own, outside the
        # window of data: a placeholder split over two chunks is whole again upstream.
        window = data if framing else self._tail + data
        hit = self._secrets.carried(window)
        if hit is not None:
            self._attempt.allowed = False
            self._attempt.reason = exfiltration(hit, "the request body")
            self._attempt.secrets = [*getattr(self._attempt, "secrets", []), hit.name]
            raise ConnectionAbortedError(self._attempt.reason)
        if not framing:
            self._tail = window[-(self._secrets.longest - 1):] if self._secrets.longest > 1 else b""
        return data

    async def read(self, n: int = -1) -> bytes:
        return self._check(await self._reader.read(n))

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        return self._check(await self._reader.readuntil(separator), framing=True)

    async def readexactly(self, n: int) -> bytes:
        return self._check(await self._reader.readexactly(n), framing=True)

    def at_eof(self) -> bool:
        return self._reader.at_eof()


def guard(run: Any, attempt: Any, reader: asyncio.StreamReader) -> Any:
    """``reader`` checked for the run's placeholders (itself when the run has none)."""
    secrets: RunSecrets | None = getattr(run, "secrets", None)
    return reader if secrets is None else GuardedReader(reader, secrets, attempt)


def refuse_head(run: Any, head: bytes, host: str, port: int) -> str | None:
    """The refusal for a request head (CONNECT target, request line, headers) carrying a placeholder."""
    secrets: RunSecrets | None = getattr(run, "secrets", None)
    hit = secrets.carried(head) if secrets is not None else None
    if hit is None:
        return None
    return exfiltration(hit, f"a request to {host}:{port}" if host else "a request")


def intercepts(run: Any, host: str, port: int) -> bool:
    secrets: RunSecrets | None = getattr(run, "secrets", None)
    return bool(secrets and secrets.for_destination(host, port))


# --- certificates and the interception itself ------------------------------------------------------------


def _crypto() -> Any:
    try:
        from cryptography import x509
    except ImportError:
        raise BackendUnavailableError("secrets at egress need the cryptography package to mint the sandbox's CA",
                                      fix="pip install 'execbox[egress-secrets]'") from None
    return x509


@dataclass
class _Authority:
    key: Any
    cert: Any
    pem: bytes
    contexts: dict[str, ssl.SSLContext] = field(default_factory=dict)


class Interceptor:
    """One sandbox's interception: a CA per secret host (minted here, key in memory), the bundle the sandbox
    trusts, and the TLS relay with substitution."""

    def __init__(self, directory: str, *, upstream_cafile: str | None = None) -> None:
        self.directory = directory
        self.upstream_cafile = upstream_cafile
        self._lock = threading.Lock()
        self._authorities: dict[str, _Authority] = {}
        self._client: ssl.SSLContext | None = None

    def ensure(self, hosts: set[str]) -> None:
        """A CA for each host (made now if new), and the sandbox's bundle rewritten when one was added."""
        with self._lock:
            new = [h for h in sorted(hosts) if h not in self._authorities]
            for host in new:
                self._authorities[host] = _mint_authority(host)
            if new or not os.path.exists(os.path.join(self.directory, BUNDLE_FILE)):
                self._write_bundle()

    def _write_bundle(self) -> None:
        parts = [_host_roots()]
        if self.upstream_cafile:
            with open(self.upstream_cafile, "rb") as fh:
                parts.append(fh.read())
        parts += [a.pem for a in self._authorities.values()]
        data = b"\n".join(p.strip() + b"\n" for p in parts if p.strip())
        target = os.path.join(self.directory, BUNDLE_FILE)
        temp = f"{target}.{random.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(temp, 0o644)
        os.replace(temp, target)

    def server_context(self, host: str) -> ssl.SSLContext:
        with self._lock:
            authority = self._authorities[host]
            ctx = authority.contexts.get(host)
            if ctx is None:
                ctx = authority.contexts[host] = _leaf_context(host, authority)
            return ctx

    def client_context(self) -> ssl.SSLContext:
        if self._client is None:
            ctx = ssl.create_default_context()
            if self.upstream_cafile:
                ctx.load_verify_locations(cafile=self.upstream_cafile)
            ctx.set_alpn_protocols(["http/1.1"])
            self._client = ctx
        return self._client

    async def intercept(self, run: Any, attempt: Any, host: str, port: int, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, up_reader: asyncio.StreamReader,
                        up_writer: asyncio.StreamWriter) -> None:
        """TLS to the code with our certificate, TLS to the host verified, and the plaintext relayed with the
        placeholders of this host's secrets swapped for their values (and back in what returns)."""
        from execbox.kit.proxy.protocol import TLS_FAILED, TLS_HINT, HeadError, answer, parse_head

        secrets: list[EgressSecret] = run.secrets.for_destination(host, port)
        try:
            await writer.start_tls(self.server_context(host.lower().rstrip(".")),
                                   ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            attempt.reason += (f"; {TLS_FAILED} in the sandbox ({exc}): its client must trust the bundle "
                               f"SSL_CERT_FILE names, which holds this sandbox's CA for {host}")
            up_writer.transport.abort()
            return
        try:
            await up_writer.start_tls(self.client_context(), server_hostname=host,
                                      ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            attempt.allowed = False
            attempt.reason = (f"{TLS_FAILED} with {host}:{port}: its certificate did not verify ({exc}); "
                              f"nothing was sent. {TLS_HINT}")
            up_writer.transport.abort()
            return
        # One request per connection, to this host, asking for a plain response, its body framed exactly
        # (Content-Length or chunked, read here) and nothing read from the code after it: the value is swapped back
        # only where it returns as bytes, so a compressed or partial reflection, or a second request smuggled
        # behind the first (to another tenant of the same front-end), would hand it to the code.
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANDSHAKE_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError, ssl.SSLError):
            raw = b""
        request = plain_request(raw, host, port) if raw else "no request head"
        if isinstance(request, str):
            attempt.allowed = False
            attempt.reason = f"refused before sending: the request {request}"
            up_writer.transport.abort()
            if raw:
                await answer(writer, 400, attempt.reason)
            writer.transport.abort()
            return
        head = parse_head(request)
        in_head = _Swap([(s.placeholder, s.value, s.name) for s in secrets])
        in_body = _Swap([(s.placeholder, s.value, s.name) for s in secrets if s.body])
        incoming = _Swap([(s.value, s.placeholder, "") for s in secrets], partial=PARTIAL)
        try:
            _put(up_writer, in_head.whole(request), attempt, "sent")
            if any("100-continue" in v.lower() for v in parse_head(raw).values("expect")):
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # asked of us: the host is not asked to wait
            try:
                await relay_body(reader, up_writer, head.length, in_body, attempt, "sent")
            except HeadError as exc:
                attempt.allowed, attempt.reason = False, f"refused: the request's body: {exc}"
                await answer(writer, 400, attempt.reason)
                return
            await relay_response(up_reader, writer, incoming, attempt, head.start[0])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ssl.SSLError, TimeoutError):
            pass
        finally:
            used = sorted(in_head.used | in_body.used)
            if used:
                attempt.secrets = sorted({*getattr(attempt, "secrets", []), *used})
            up_writer.transport.abort()
            writer.transport.abort()


_DROPPED_REQUEST_FIELDS = frozenset({"accept-encoding", "connection", "keep-alive", "proxy-connection", "te",
                                     "range", "if-range", "expect"})


def plain_request(head: bytes, host: str, port: int) -> bytes | str:
    """The first request head of an intercepted connection (parsed strictly: ``kit.proxy.protocol.parse_head``),
    rewritten to ask for one plain response (``Accept-Encoding: identity``, ``Connection: close``, no ``Range``,
    no ``Expect``); or why it is refused: malformed, not in origin form, a Host other than the secret's (or
    none, or two), an upgrade."""
    from execbox.kit.proxy.protocol import HeadError, parse_head

    try:
        parsed = parse_head(head)
    except HeadError as exc:
        return f"has a malformed head: {exc}"
    method, target, version = parsed.start
    if not target.startswith("/"):
        return "is not an HTTP/1.1 request for a path on this host"
    if parsed.values("upgrade"):
        return "asks for an upgrade (the proxy relays HTTP/1.1 only)"
    hosts = [value.lower().rstrip(".") for value in parsed.values("host")]
    wanted = host.lower().rstrip(".")
    if len(hosts) != 1 or hosts[0] not in (wanted, f"{wanted}:{port}"):
        return f"names the Host {', '.join(hosts) or '(none)'}, not {wanted}: refused as a possible exfiltration"
    kept = [f"{method} {target} {version}"]
    kept += [f"{name}: {value}" for name, value in parsed.fields if name.lower() not in _DROPPED_REQUEST_FIELDS]
    return ("\r\n".join([*kept, "Accept-Encoding: identity", "Connection: close"]) + "\r\n\r\n").encode("latin-1")


def encoded_response(head: bytes) -> str | None:
    """Why a response head cannot be relayed with the value swapped back: malformed (``kit.proxy.protocol.parse_head``),
    an encoded or partial body, an upgrade."""
    from execbox.kit.proxy.protocol import HeadError, parse_head

    try:
        parsed = parse_head(head, response=True)
    except HeadError as exc:
        return f"a malformed response head: {exc}"
    status = parsed.start[1]
    if status == "206":
        return "a partial (206) response"
    if status == "101":
        return "a protocol switch (101), which was not asked for"
    for value in parsed.values("content-encoding"):
        if value.lower() not in ("", "identity"):
            return f"its body is encoded ({value[:40]}), where a secret would pass unswapped"
    if parsed.values("content-range"):
        return "a partial response (Content-Range)"
    return None


async def relay_response(src: asyncio.StreamReader, dst: asyncio.StreamWriter, swap: _Swap, attempt: Any,
                         method: str) -> None:
    """The host's response (after any 1xx), the value swapped back in head and body, the body read by its framing
    (a chunked one de-chunked first, so chunk framing never splits the value from the swap); withheld when the
    value could pass unswapped (``encoded_response``). The code gets one response, then the connection closes."""
    from execbox.kit.proxy.protocol import HeadError, closing_head, parse_head

    while True:
        try:
            raw = await src.readuntil(b"\r\n\r\n")  # no time limit: a model's answer can take minutes
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ssl.SSLError):
            raw = b""
        problem = encoded_response(raw) if raw else "the host sent no response head"
        if problem:
            attempt.reason += f"; the response was withheld: {problem}"
            return
        head = parse_head(raw, response=True)
        informational = head.start[1].startswith("1")
        _put(dst, swap.whole(raw if informational else closing_head(head)), attempt, "received")
        if not informational:
            break
    try:
        await relay_body(src, dst, head.body_after(method), swap, attempt, "received")
    except HeadError as exc:
        attempt.reason += f"; the response was cut: {exc}"


async def relay_body(src: Any, dst: asyncio.StreamWriter, length: int | None, swap: _Swap, attempt: Any,
                     way: str) -> None:
    """A body of ``length`` bytes (-1: chunked, None: until the connection closes) through ``swap``: a chunked
    one is de-chunked, swapped, and sent as chunks of what the swap let out (trailers dropped). A partial match
    held back is never let out as it is, even when the source pauses; one of ``PARTIAL`` bytes or more that turns
    out no whole match, or is cut by the body's end, as the same start of the placeholder (``_Swap``)."""
    from execbox.kit.proxy.protocol import read_chunk_end, read_chunk_size

    chunked = length == -1

    async def put(data: bytes, last: bool) -> None:
        out = swap.feed(data) + (swap.end() if last else b"")
        if out:
            _put(dst, b"%x\r\n%b\r\n" % (len(out), out) if chunked else out, attempt, way)
        if last and chunked:
            _put(dst, b"0\r\n\r\n", attempt, way)
        await dst.drain()

    async def exactly(size: int) -> None:
        while size:
            data = await src.read(min(size, _CHUNK))
            if not data:
                raise asyncio.IncompleteReadError(b"", size)
            size -= len(data)
            await put(data, False)

    if length is None:
        while data := await src.read(_CHUNK):
            await put(data, False)
    elif chunked:
        while size := await read_chunk_size(src):
            await exactly(size)
            await read_chunk_end(src, size)
        await read_chunk_end(src, 0)
    else:
        await exactly(length)
    await put(b"", True)


def _put(dst: asyncio.StreamWriter, data: bytes, attempt: Any, way: str) -> None:
    dst.write(data)
    setattr(attempt, way, getattr(attempt, way) + len(data))


class _Swap:
    """Same-length replacement in a byte stream that arrives in pieces: holds back only an end that could be the
    start of a pattern, until more bytes show whether it is one (``end`` at the stream's end). With ``partial``, a
    start of a pattern at least that long (or the whole, if shorter) that stops short of it is replaced too, by the
    same start of its replacement: a host echoing a key cut short ("invalid key sk-live-0123...") gives the code
    no more of the value than its first ``partial - 1`` bytes."""

    def __init__(self, table: list[tuple[bytes, bytes, str]], partial: int = 0) -> None:
        self.table = table
        self.partial = partial
        self.used: set[str] = set()
        self._buf = b""
        self._longest = max((len(old) for old, _, _ in table), default=0)
        starts = sorted({old[:self._least(old)] for old, _, _ in table}, key=len, reverse=True)
        self._starts = re.compile(b"|".join(map(re.escape, starts))) if partial and table else None
        self._cut = [(old[:self._least(old)], self._least(old), old, new) for old, new, _ in table]

    def _least(self, old: bytes) -> int:
        return min(len(old), self.partial) if self.partial else len(old)

    def feed(self, data: bytes) -> bytes:
        if not self.table:
            return data
        buf = self._buf + data
        for old, new, name in self.table:  # whole patterns first, in C
            if old in buf:
                buf = buf.replace(old, new)
                if name:
                    self.used.add(name)
        out: list[bytes] = []
        at = 0
        while self._starts is not None and (found := self._starts.search(buf, at)) is not None:
            pos = found.start()  # a start cut short (or by this piece's end): the longest there
            size, whole, new = max((_common(buf, pos, old, least), len(old), new)
                                   for start, least, old, new in self._cut if buf.startswith(start, pos))
            if pos + size == len(buf) and size < whole:
                break  # it may yet complete: held back below
            out += (buf[at:pos], new[:size])
            at = pos + size
        rest = buf[at:]
        cut = len(rest)
        for pos in range(max(0, len(rest) - self._longest + 1), len(rest)):
            tail = rest[pos:]
            if any(old.startswith(tail) for old, _, _ in self.table):
                cut = pos
                break
        self._buf = rest[cut:]
        return b"".join(out) + rest[:cut]

    def end(self) -> bytes:
        """What is held back, at the stream's end: a start of a pattern that never completed, given as the same
        start of its replacement when it is one ``partial`` replaces (a value's first bytes come back as the
        placeholder's, never as themselves), otherwise as it is."""
        tail, self._buf = self._buf, b""
        new = next((new for old, new, _ in self.table
                    if self.partial and old.startswith(tail) and len(tail) >= self._least(old)), tail)
        return new[:len(tail)]

    def whole(self, data: bytes) -> bytes:
        """``data`` complete in itself (a head)."""
        return self.feed(data) + self.end()


def _common(buf: bytes, pos: int, old: bytes, low: int) -> int:
    """How many bytes of ``old`` ``buf`` holds from ``pos`` on, knowing it holds ``low`` (slices compared in C,
    halving; most often the next byte differs)."""
    high = min(len(old), len(buf) - pos)
    if low < high and buf[pos + low] != old[low]:
        return low
    while low < high:
        mid = (low + high + 1) // 2
        if buf[pos:pos + mid] == old[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _host_roots() -> bytes:
    """This host's trusted roots, so that HTTPS elsewhere still verifies inside the sandbox."""
    paths = [ssl.get_default_verify_paths().cafile, *_HOST_ROOTS]
    for path in paths:
        if path and os.path.isfile(path):
            with open(path, "rb") as fh:
                return fh.read(16 << 20)
    with contextlib.suppress(ImportError):
        import certifi

        with open(certifi.where(), "rb") as fh:
            return fh.read(16 << 20)
    return b""


def _mint_authority(host: str) -> _Authority:
    x509 = _crypto()
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"execbox sandbox CA for {host}"[:64]),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "execbox (per-sandbox, in memory)")])
    now = datetime.datetime.now(datetime.UTC)
    address = address_of(host)
    permitted = [x509.IPAddress(ipaddress.ip_network(address))] if address else [x509.DNSName(host)]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return _Authority(key, cert, cert.public_bytes(serialization.Encoding.PEM))


def _leaf_context(host: str, authority: _Authority) -> ssl.SSLContext:
    x509 = _crypto()
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    address = address_of(host)
    san = x509.IPAddress(address) if address else x509.DNSName(host)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(authority.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()),
                           critical=False)
            .sign(authority.key, hashes.SHA256()))
    pem = (cert.public_bytes(serialization.Encoding.PEM)
           + key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    # ssl loads a key only from a path: an anonymous in-memory file, never on disk.
    fd = os.memfd_create("execbox-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return ctx


# --- one run's secrets, both kinds, as the runner applies them -------------------------------------------






