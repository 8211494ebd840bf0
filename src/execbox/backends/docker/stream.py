"""Streaming: the attach and exec sockets docker-py hijacks, demultiplexed as they stream into the bounded
captures. Memory stays flat however much the program writes: one read buffer and the two captures."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from execbox.plugin import BoundedCapture

_CHUNK = 1 << 18
ALIVE_EVERY_S = 1.0


class Demux:
    """Docker's multiplexed stream (8-byte header: stream id, 3 pad, big-endian length) into captures."""

    def __init__(self, out: BoundedCapture, err: BoundedCapture) -> None:
        self.sinks = {1: out, 2: err}
        self.header = bytearray()
        self.remaining = 0
        self.sink: BoundedCapture | None = None

    def feed(self, data: memoryview) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.remaining == 0:
                take = min(8 - len(self.header), n - i)
                self.header += data[i:i + take]
                i += take
                if len(self.header) < 8:
                    return
                stream, self.remaining = struct.unpack(">BxxxL", self.header)
                self.header.clear()
                self.sink = self.sinks.get(stream)
                continue
            take = min(self.remaining, n - i)
            if self.sink is not None:
                self.sink.write(bytes(data[i:i + take]))
            i += take
            self.remaining -= take


def hijacked(sock_io: Any) -> tuple[socket.socket, bytes]:
    """The real socket under docker-py's attach/exec socket, plus any bytes the HTTP layer read ahead."""
    raw = getattr(sock_io, "_sock", sock_io)
    leftover = b""
    response = getattr(sock_io, "_response", None)
    fp = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    raw.setblocking(False)
    if fp is not None:
        with contextlib.suppress(BlockingIOError, OSError, ValueError):
            leftover = fp.read1(_CHUNK) or b""
    return raw, leftover


def close(sock_io: Any, sock: socket.socket) -> None:
    """Close the hijacked connection at every layer docker-py stacked on it (response, file, socket)."""
    response = getattr(sock_io, "_response", None)
    for closable in (response, sock_io, sock):
        with contextlib.suppress(Exception):
            if closable is not None:
                closable.close()


def pump(sock: socket.socket, leftover: bytes, stdin: bytes | None, deadline: float,
          out: BoundedCapture, err: BoundedCapture, alive: Callable[[], bool] | None = None) -> bool:
    """Feed stdin and read output until EOF; True if the deadline came first. Memory stays flat: one
    read buffer and the two bounded captures, however much the program writes.

    ``alive`` is asked after each ALIVE_EVERY_S of silence: the engine keeps an exec's stream open when its
    container dies under it (gVisor's Sentry killed at the memory limit), so EOF alone would wait out the
    deadline. False ends the pump as EOF would."""
    demux = Demux(out, err)
    if leftover:
        demux.feed(memoryview(leftover))
    data = memoryview(stdin or b"")
    sent = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    sel = selectors.DefaultSelector()
    try:
        if data:
            sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        else:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            sel.register(sock, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            events = sel.select(remaining if alive is None else min(remaining, ALIVE_EVERY_S))
            if not events and alive is not None and time.monotonic() < deadline and not alive():
                return False
            for _, mask in events:
                if mask & selectors.EVENT_WRITE:
                    try:
                        sent += sock.send(data[sent:sent + _CHUNK])
                    except BlockingIOError:
                        pass
                    except OSError:  # the program closed stdin or exited: the rest is not wanted
                        sent = len(data)
                    if sent >= len(data):
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_WR)
                        sel.modify(sock, selectors.EVENT_READ)
                if mask & selectors.EVENT_READ:
                    try:
                        n = sock.recv_into(buf)
                    except BlockingIOError:
                        continue
                    except OSError:
                        return False
                    if n == 0:
                        return False
                    demux.feed(view[:n])
    finally:
        sel.close()
