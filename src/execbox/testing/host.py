"""What the checks do on this host, outside the sandbox: look for its processes, set its environment,
plant canary files, and serve the listeners a sandbox must (or must not) reach."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from execbox.testing.framework import Unavailable


def pure_wheel(name: str, version: str, files: dict[str, bytes]) -> tuple[str, bytes]:
    """(file name, bytes) of a pure-Python wheel of ``files`` (paths in site-packages), built here: a zip with its
    dist-info (METADATA, WHEEL, a RECORD of sha256 digests). No network and no build step."""
    module = name.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    files = {**files,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: execbox-kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in files.items()]
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,", ""]).encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    return f"{module}-{version}-py3-none-any.whl", out.getvalue()


def host_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of every process this host's /proc shows; processes that vanish mid-scan are skipped."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    raw = fh.read()
            except OSError:
                continue
            if raw:
                yield int(entry), [part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0")]


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def alive_with(marker: str, settle_s: float = 1.0) -> list[int]:
    """Host processes with ``marker`` as an argument, after giving a kill in flight time to land."""
    if not os.path.isdir("/proc"):
        raise Unavailable("this host has no /proc to look for leftover processes in")
    deadline = time.monotonic() + settle_s
    while True:
        alive = [pid for pid, argv in host_processes() if marker in " ".join(argv) and _running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@contextlib.contextmanager
def host_env(name: str, value: str) -> Iterator[None]:
    """A variable in this process's environment for the block (the sandbox must not inherit it)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class Listener:
    """A TCP listener that counts the connections it accepted: on loopback, or on an address of a network
    the test itself created (e.g. a bridge gateway)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            conn.close()

    def wait_for(self, count: int, timeout_s: float = 3.0) -> int:
        deadline = time.monotonic() + timeout_s
        while self.accepted < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.accepted

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


class TokenServer:
    """A plain-HTTP server on this host's loopback: answers every GET with its path, counts connections."""

    def __init__(self) -> None:
        import http.server

        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = f"TOKEN {self.path.strip('/')}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class Counting(http.server.ThreadingHTTPServer):
            def process_request(self, request: Any, client_address: Any) -> None:
                server.connections += 1
                super().process_request(request, client_address)

        self.connections = 0
        self.httpd = Counting(("127.0.0.1", 0), Handler)
        self.port: int = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def fetch(self, token: str) -> str:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(f"GET /{token} HTTP/1.0\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        return data.decode(errors="replace").rpartition("\r\n\r\n")[2]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def status_fields(status: str) -> dict[str, str]:
    """The fields of a /proc/<pid>/status text, by name."""
    return {k: v.strip() for k, _, v in (line.partition(":") for line in status.splitlines()) if v}


class HostView(threading.Thread):
    """Finds the identity probe among this host's processes while it runs (argv ``python -c PROBE marker
    hold``), reads its /proc status as this host sees it (ids translated into the host's user namespace),
    then tells it to finish (SIGWINCH, once it has its handler)."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker = marker
        self.views: dict[int, str] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for pid, argv in host_processes():
                if (pid in self.views or len(argv) < 4 or argv[1] != "-c" or argv[-2] != self.marker
                        or not os.path.basename(argv[0]).startswith("python")):
                    continue
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                caught = int(status_fields(status).get("SigCgt", "0"), 16)
                if caught & (1 << (signal.SIGWINCH - 1)):
                    self.views[pid] = status
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGWINCH)
            time.sleep(0.02)


@contextlib.contextmanager
def canary_files() -> Iterator[dict[str, str]]:
    """World-readable files on this host (path -> content): in a fresh temp dir, and under $HOME when it is
    writable. Readable by any uid that can see them, so only a filesystem boundary hides them."""
    made: list[Path] = []
    try:
        tmp = Path(tempfile.mkdtemp(prefix="execbox-canary-"))
        made.append(tmp)
        homes = [Path.home()] if os.access(Path.home(), os.W_OK) else []
        for base in homes:
            made.append(base / f".execbox-canary-{uuid.uuid4().hex}")
            made[-1].mkdir()
        files = {}
        for folder in made:
            folder.chmod(0o755)
            path = folder / "canary"
            path.write_text(f"execbox-canary-{uuid.uuid4().hex}")
            path.chmod(0o644)
            files[str(path)] = path.read_text()
        yield files
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
