"""What the egress proxy and its TLS interceptor share - the strict HTTP/1.1 head parser and chunk framing, the
answers the proxy gives itself, and where its files sit in the sandbox (MOUNT_POINT, CA_FILE, CA_VARIABLES)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from typing import Any

#: Where the proxy's directory is inside every sandbox (read-only).
MOUNT_POINT = "/run/execbox"
CA_FILE = "ca-bundle.pem"
#: Variables that make the usual tools trust CODE_EXEC_CA_BUNDLE (set to the bundle's path in the sandbox).
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
                "NPM_CONFIG_CAFILE", "GIT_SSL_CAINFO", "CARGO_HTTP_CAINFO")
#: In every attempt's reason where a TLS handshake failed (``with_egress`` makes a note of each).
TLS_FAILED = "the TLS handshake failed"
TLS_HINT = ("If this network inspects TLS (a corporate proxy), set CODE_EXEC_CA_BUNDLE to a PEM bundle of its CA: "
            "the sandbox and the proxy then trust it")


class HeadError(ValueError):
    """Why an HTTP head is refused (the message is the reason recorded on the attempt)."""


# RFC 9110's token (a method, a field name) and a field value's bytes: visible ASCII, obs-text, SP and HT.
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")
_TARGET = re.compile(rb"[\x21-\x7e]+\Z")
_VERSION = re.compile(rb"HTTP/1\.[01]\Z")
_STATUS = re.compile(rb"[1-9][0-9][0-9]\Z")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,15})(;[\t\x20-\x7e]*)?\r\n\Z")


@dataclass(frozen=True)
class Head:
    """One HTTP/1.x head, parsed strictly (``parse_head``): its start line's three parts and its fields in order
    (values without the surrounding blanks)."""

    start: tuple[str, str, str]
    fields: tuple[tuple[str, str], ...]
    #: The body that follows: ``-1`` chunked, otherwise its length (a request's; a response's is ``body_after``).
    length: int

    def values(self, name: str) -> list[str]:
        return [value for key, value in self.fields if key.lower() == name]

    @property
    def chunked(self) -> bool:
        return self.length == -1

    def body_after(self, method: str) -> int | None:
        """A response's body: its length, -1 chunked, None when it runs until the connection closes."""
        status = int(self.start[1])
        if method.upper() == "HEAD" or status < 200 or status in (204, 304):
            return 0
        if self.chunked or self.values("content-length"):
            return self.length
        return None


def parse_head(data: bytes, *, response: bool = False) -> Head:
    """The head ``data`` (up to and with its empty line), parsed as strictly as RFC 9112 allows, or HeadError:
    a CR or LF outside a CRLF, a NUL or other control byte, a folded line, a start line that is not exactly
    ``METHOD SP TARGET SP HTTP/1.x`` (``HTTP/1.x SP STATUS SP REASON``), a malformed field, a Content-Length
    with a Transfer-Encoding, two different Content-Lengths, a transfer coding other than ``chunked`` or in an
    HTTP/1.0 message, a field named like either with ``_`` for ``-``. One
    recipient reading lines otherwise (a bare LF as a line end, say) would see other requests than the proxy
    checked. (Which Host a request may name is its caller's to judge: ``kit.proxy.secrets.plain_request``.)"""
    if not data.endswith(b"\r\n\r\n"):
        raise HeadError("the head does not end with an empty line")
    lines = data[:-4].split(b"\r\n")
    if any(b"\r" in line or b"\n" in line for line in lines):
        raise HeadError("a CR or LF that is not part of a CRLF in the head")
    if b"\0" in data:
        raise HeadError("a NUL byte in the head")
    if response:
        parts = lines[0].split(b" ", 2)
        if len(parts) == 2:
            parts.append(b"")
        if (len(parts) != 3 or not _VERSION.match(parts[0]) or not _STATUS.match(parts[1])
                or not _FIELD_VALUE.match(parts[2])):
            raise HeadError("a malformed status line")
    else:
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not _TOKEN.match(parts[0]) or not _TARGET.match(parts[1]) or not _VERSION.match(parts[2]):
            raise HeadError("a request line that is not METHOD SP TARGET SP HTTP/1.1 (or 1.0)")
    fields: list[tuple[str, str]] = []
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            raise HeadError("a folded header line (obsolete line folding)")
        name, sep, value = line.partition(b":")
        value = value.strip(b" \t")
        if not sep or not _TOKEN.match(name) or not _FIELD_VALUE.match(value):
            raise HeadError(f"a malformed header line ({name[:40].decode('latin-1')!r})")
        if b"_" in name and name.replace(b"_", b"-").lower() in (b"content-length", b"transfer-encoding"):
            # a server mapping _ to - (as CGI names do) would frame the body by it
            raise HeadError(f"a header named like a framing one ({name.decode('latin-1')!r})")
        fields.append((name.decode("latin-1"), value.decode("latin-1")))
    first, second, third = (p.decode("latin-1") for p in parts)
    head = Head((first, second, third), tuple(fields), 0)
    lengths = {n.strip(" \t") for v in head.values("content-length") for n in v.split(",")}
    codings = head.values("transfer-encoding")
    if lengths and codings:
        raise HeadError("both Content-Length and Transfer-Encoding")
    if codings:
        if (first if response else third) == "HTTP/1.0":  # RFC 9112 6.1: its framing is faulty
            raise HeadError("a Transfer-Encoding in an HTTP/1.0 message (its recipient may read the body as the next "
                            "message)")
        if [c.lower() for c in codings] != ["chunked"]:
            raise HeadError(f"a transfer coding other than chunked ({', '.join(codings)[:60]})")
        return Head(head.start, head.fields, -1)
    if len(lengths) > 1 or not all(n.isascii() and n.isdigit() and len(n) <= 18 for n in lengths):
        raise HeadError("a malformed Content-Length")
    return Head(head.start, head.fields, int(lengths.pop()) if lengths else 0)


async def read_chunk_size(reader: Any) -> int:
    """The size on a chunk's line (its extensions ignored); HeadError when the line is malformed."""
    line = await reader.readuntil(b"\r\n")
    found = _CHUNK_LINE.match(line)
    if found is None:
        raise HeadError("a malformed chunk size line")
    return int(found.group(1), 16)


async def read_chunk_end(reader: Any, size: int) -> None:
    """After a chunk's data its CRLF; after the last chunk, the trailers (dropped) up to the empty line."""
    if size:
        if await reader.readexactly(2) != b"\r\n":
            raise HeadError("a chunk not followed by CRLF")
        return
    for _ in range(100):
        line = await reader.readuntil(b"\r\n")
        if line == b"\r\n":
            return
        if b"\r" in line[:-2] or b"\n" in line[:-2]:
            raise HeadError("a CR or LF that is not part of a CRLF in the trailers")
    raise HeadError("more than 100 trailer lines")


def closing_head(head: Head) -> bytes:
    """A response head whose connection closes after it (we send one request per upstream connection)."""
    hop = ("connection", "keep-alive", "proxy-connection")
    kept = [" ".join(head.start).rstrip(" ")] + [f"{n}: {v}" for n, v in head.fields if n.lower() not in hop]
    return ("\r\n".join([*kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")


_DENIED = "X-Execbox-Egress: denied\r\n"


async def answer(writer: asyncio.StreamWriter, status: int, text: str) -> None:
    """A short plain-text answer from the proxy itself; the connection closes after it."""
    phrase = {400: "Bad Request", 403: "Forbidden", 431: "Request Header Fields Too Large", 502: "Bad Gateway",
              503: "Service Unavailable"}[status]
    body = f"execbox proxy: {text}\n".encode()
    writer.write(f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: "
                 f"{len(body)}\r\nConnection: close\r\n{_DENIED if status == 403 else ''}\r\n".encode() + body)
    with contextlib.suppress(OSError, RuntimeError):
        await asyncio.wait_for(writer.drain(), 5)
