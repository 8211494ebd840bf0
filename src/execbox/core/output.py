"""Bounded output capture: the head and the tail of a stream, never more than the cap in memory."""

from __future__ import annotations


class BoundedCapture:
    """Keeps the first and last bytes of a stream, ``cap`` bytes at most, and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.head_cap = cap - cap // 2
        self.tail_cap = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def write(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data or not self.tail_cap:
            return
        if len(data) >= self.tail_cap:
            self.tail[:] = data[-self.tail_cap:]
        else:
            self.tail += data
            excess = len(self.tail) - self.tail_cap
            if excess > 0:
                del self.tail[:excess]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def getvalue(self) -> bytes:
        if not self.truncated:
            return bytes(self.head + self.tail)
        omitted = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... execbox: {omitted} bytes omitted; output is capped at {self.cap} bytes ...]\n".encode()
        return bytes(self.head) + marker + bytes(self.tail)

    def text(self) -> str:
        return self.getvalue().decode("utf-8", errors="replace")
