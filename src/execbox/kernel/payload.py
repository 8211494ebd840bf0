"""The Python interpreter behind ``run_cell``. It runs INSIDE the sandbox: standard library only, Python 3.8+,
never imported by execbox itself (kernel/client.py sends this file's text).

    python3 -I -S -c SOURCE serve SOCKET     the supervisor; its stdin is SOURCE again (to start interpreters)
    python3 -u -c SOURCE child FD            one interpreter, started by the supervisor

The supervisor owns a Unix socket in the workspace (a file, so it works with network none and across the
separate namespaces of each exec) and never runs cell code. One interpreter child at a time runs the cells:
its fd 1 and 2 are pipes the supervisor reads, its fd FD a socketpair for control frames (4-byte big-endian
length + JSON). A client connects, sends one request line (JSON), and gets JSON lines back until the
supervisor closes the connection after the final ``done`` line:

    {"t": "stream", "s": "stdout"|"stderr", "d": TEXT}       the cell's output (head live, tail at the end)
    {"t": "drop", "s": ..., "n": BYTES}                      bytes cut from the middle (the output cap)
    {"t": "display", "kind": "display"|"result", "data": {MIME: ...}, "metadata": {...}}
    {"t": "done", "count": N, "error": {...}|null, "timed_out": B, "state_lost": B, "lost": REASON|null,
     "oom": B, "duration": S, "dropped_displays": N}

Deadline: at the cell's timeout the child gets SIGINT (KeyboardInterrupt in the cell; state kept); if it has
not finished ``grace`` seconds later, its process group is SIGKILLed and the next cell starts a fresh
interpreter (state_lost). The child raises its own oom_score_adj, so a memory limit kills it, not the
supervisor. Everything here is bounded for the supervisor's sake; the host bounds it again, as it trusts
nothing the sandbox says.
"""

from __future__ import annotations

import ast
import base64
import builtins
import codecs
import errno
import io
import json
import linecache
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from typing import Any

MAX_CTL_FRAME = 64 << 20  # one control frame from the interpreter (a large figure)
MAX_REQUEST = 64 << 20  # one request line from a client (the cell's code)
OUT_HIGH_WATER = 4 << 20  # bytes queued for a slow client before the interpreter's pipes stop being read
CHUNK = 65536
MAX_DISPLAYS = 1000  # rich outputs per cell (the host holds the same bound)
INLINE_BACKEND = "execbox_inline"


def encode(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode() + b"\n"


def send_ctl(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts = []
    while n:
        chunk = sock.recv(min(n, CHUNK))
        if not chunk:
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


# --- the supervisor -------------------------------------------------------------------------------------------


def memory_oom_kills() -> int:
    """The sandbox cgroup's OOM kill count, where it is readable (cgroup v2 or v1); -1 when it is not."""
    for path, key in (("/sys/fs/cgroup/memory.events", "oom_kill"),
                      ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill")):
        try:
            with open(path) as fh:
                for line in fh:
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value)
        except (OSError, ValueError):
            continue
    return -1


class StreamCap:
    """One stream of one cell: the first ``head`` bytes go out as they come, the last ``tail`` are held for the
    end, what lies between is counted."""

    def __init__(self, name: str, cap: int) -> None:
        self.name = name
        self.head = cap - cap // 2
        self.tail_cap = cap // 2
        self.sent = 0
        self.tail = bytearray()
        self.omitted = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> list[bytes]:
        out = []
        if self.sent < self.head:
            piece = data[:self.head - self.sent]
            self.sent += len(piece)
            data = data[len(piece):]
            text = self.decoder.decode(piece)
            if text:
                out.append(encode({"t": "stream", "s": self.name, "d": text}))
        if data:
            self.tail += data
            excess = len(self.tail) - self.tail_cap
            if excess > 0:
                self.omitted += excess
                del self.tail[:excess]
        return out

    def finish(self) -> list[bytes]:
        out = []
        if self.omitted:
            text = self.decoder.decode(b"", True)
            if text:
                out.append(encode({"t": "stream", "s": self.name, "d": text}))
            out.append(encode({"t": "drop", "s": self.name, "n": self.omitted}))
            text = self.tail.decode("utf-8", errors="replace")
        else:
            text = self.decoder.decode(bytes(self.tail), True)
        if text:
            out.append(encode({"t": "stream", "s": self.name, "d": text}))
        return out


class Cell:
    def __init__(self, conn: socket.socket | None, request: dict[str, Any]) -> None:
        self.conn = conn
        self.timeout = float(request.get("timeout") or 30)
        self.grace = float(request.get("grace") or 2)
        cap = max(1, int(request.get("max_output") or 100000))
        self.max_display = max(0, int(request.get("max_display") or (16 << 20)))
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout
        self.interrupted_at: float | None = None
        self.timed_out = False
        self.caps = {"stdout": StreamCap("stdout", cap), "stderr": StreamCap("stderr", cap)}
        self.display_bytes = 0
        self.displays = 0
        self.dropped_displays = 0
        self.lost: str | None = None  # reported with this cell: the state was lost before it ran
        self.oom_before = memory_oom_kills()


class Supervisor:
    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.source = source
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        try:
            os.unlink(path)
        except OSError:
            pass
        old = os.umask(0o077)
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        self.listener.listen(8)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.child: subprocess.Popen[bytes] | None = None
        self.ctl: socket.socket | None = None
        self.pipes: dict[str, int] = {}
        self.ctl_buf = bytearray()
        self.count = 0
        self.lost: str | None = None  # the interpreter died between cells: said with the next one
        self.cell: Cell | None = None
        # A cell asked for while an abandoned one is being interrupted: it starts when that one has ended.
        self.waiting: tuple[socket.socket, dict[str, Any]] | None = None
        self.outbuf = bytearray()
        self.out_conn: socket.socket | None = None
        self.reading_child = False

    # -- the interpreter process --

    def spawn(self) -> None:
        ctl, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        env = dict(os.environ)
        env.setdefault("MPLBACKEND", "module://" + INLINE_BACKEND)
        env["PYTHONUNBUFFERED"] = "1"
        try:
            self.child = subprocess.Popen(
                [sys.executable, "-u", "-c", self.source, "child", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, pass_fds=(theirs.fileno(),),
                start_new_session=True, env=env, close_fds=True)
        finally:
            theirs.close()
            os.close(out_w)
            os.close(err_w)
        self.ctl = ctl
        self.ctl_buf = bytearray()
        ctl.setblocking(False)
        self.pipes = {"stdout": out_r, "stderr": err_r}
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        self.count = 0
        self.reading_child = False
        self.watch_child(True)

    def watch_child(self, on: bool) -> None:
        if on == self.reading_child or self.ctl is None:
            return
        self.reading_child = on
        items: list[tuple[Any, str]] = [(self.ctl, "ctl"), *((fd, name) for name, fd in self.pipes.items())]
        for obj, tag in items:
            try:
                if on:
                    self.sel.register(obj, selectors.EVENT_READ, tag)
                else:
                    self.sel.unregister(obj)
            except (KeyError, ValueError, OSError):
                pass  # a pipe the cell closed, already out of the selector

    def reap(self, why: str) -> str:
        """The interpreter is gone or must go: kill its group, collect it, close its channels; the reason."""
        child = self.child
        self.watch_child(False)
        if child is not None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
            code = child.wait()
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = str(-code)
                hint = " (a memory limit, or a kill from inside the sandbox)" if -code == signal.SIGKILL else ""
                why = why or "the interpreter was killed by %s%s" % (name, hint)
            elif not why:
                why = "the interpreter exited with status %d" % code
        if self.ctl is not None:
            self.ctl.close()
        for fd in self.pipes.values():
            os.close(fd)
        self.child, self.ctl, self.pipes = None, None, {}
        return why

    # -- clients --

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        # A running cell's deadline must not wait long on a client that does not send (ours sends at once).
        conn.settimeout(1.0 if self.cell is not None else 10.0)
        try:
            line = self.read_line(conn)
        except OSError:
            line = None
        if line is None:
            conn.close()
            return
        try:
            request = json.loads(line)
        except ValueError:
            request = {}
        op = request.get("op") if isinstance(request, dict) else None
        if op == "shutdown":
            if self.child is not None:
                self.reap("shut down")
            self.send_now(conn, {"t": "bye"})
            conn.close()
            raise SystemExit(0)
        if op == "execute" and self.cell is not None and self.waiting is None and (
                request.get("takeover") or self.cell.conn is None):
            # The caller gave up on the running cell (its relay may live on, e.g. a cancelled docker exec):
            # interrupt it, and run this one when it has ended.
            if self.cell.conn is not None:
                self.client_gone()
            self.waiting = (conn, request)
            return
        if op != "execute" or self.cell is not None or self.out_conn is not None:
            self.send_now(conn, {"t": "error", "message": "busy" if op == "execute" else "bad request"})
            conn.close()
            return
        self.start_cell(conn, request)

    def read_line(self, conn: socket.socket) -> bytes | None:
        buf = bytearray()
        while b"\n" not in buf:
            chunk = conn.recv(CHUNK)
            if not chunk:
                return None
            buf += chunk
            if len(buf) > MAX_REQUEST:
                return None
        return bytes(buf.split(b"\n", 1)[0])

    def send_now(self, conn: socket.socket, obj: Any) -> None:
        try:
            conn.sendall(encode(obj))
        except OSError:
            pass

    def start_cell(self, conn: socket.socket, request: dict[str, Any]) -> None:
        cell = Cell(conn, request)
        if self.child is not None and self.child.poll() is not None:
            self.lost = self.reap("")
        cell.lost, self.lost = self.lost, None
        if self.child is None:
            self.spawn()
        assert self.ctl is not None
        self.count += 1
        self.cell = cell
        conn.setblocking(False)
        self.out_conn = conn
        self.sel.register(conn, selectors.EVENT_READ, "client")
        try:
            self.ctl.setblocking(True)
            send_ctl(self.ctl, {"op": "execute", "code": request.get("code") or "", "count": self.count})
        except OSError:
            self.finish_cell(self.reap("") or "the interpreter could not take the cell")
        finally:
            if self.ctl is not None:
                self.ctl.setblocking(False)

    def queue(self, data: bytes) -> None:
        if self.out_conn is None:
            return
        if not self.outbuf:
            self.sel.modify(self.out_conn, selectors.EVENT_READ | selectors.EVENT_WRITE, "client")
        self.outbuf += data
        if len(self.outbuf) > OUT_HIGH_WATER:
            self.watch_child(False)  # back-pressure: the interpreter blocks on its pipes, timers still run

    def flush_out(self) -> None:
        conn = self.out_conn
        if conn is None:
            return
        try:
            sent = conn.send(self.outbuf[:1 << 20])
        except BlockingIOError:
            return
        except OSError:
            self.client_gone()
            return
        del self.outbuf[:sent]
        if not self.outbuf:
            self.sel.modify(conn, selectors.EVENT_READ, "client")
            if self.cell is None:
                self.close_client()
        if len(self.outbuf) <= OUT_HIGH_WATER and self.child is not None:
            self.watch_child(True)

    def close_client(self) -> None:
        conn, self.out_conn = self.out_conn, None
        self.outbuf = bytearray()
        if conn is not None:
            try:
                self.sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()
        if self.child is not None:
            self.watch_child(True)

    def client_gone(self) -> None:
        """The client left mid-cell (the caller gave up): interrupt the cell now; nobody reads its output."""
        cell = self.cell
        self.close_client()
        if cell is not None:
            cell.conn = None
            if cell.interrupted_at is None:
                self.interrupt(cell)

    # -- the cell --

    def interrupt(self, cell: Cell) -> None:
        cell.interrupted_at = time.monotonic()
        if self.child is not None:
            try:
                os.kill(self.child.pid, signal.SIGINT)
            except OSError:
                pass

    def timers(self) -> float | None:
        cell = self.cell
        if cell is None:
            return None
        now = time.monotonic()
        if cell.interrupted_at is None:
            if now >= cell.deadline:
                cell.timed_out = True
                self.interrupt(cell)
                return cell.grace
            return cell.deadline - now
        if now >= cell.interrupted_at + cell.grace:
            if cell.timed_out:
                why = ("the cell did not stop within %gs of its timeout (SIGINT) and the interpreter was killed"
                       % cell.grace)
            else:
                why = "the caller gave up on the cell and it did not stop on SIGINT; the interpreter was killed"
            self.finish_cell(self.reap(why))
            return None
        return cell.interrupted_at + cell.grace - now

    def read_pipe(self, name: str) -> bool:
        fd = self.pipes.get(name)
        if fd is None:
            return False
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            try:
                self.sel.unregister(fd)
            except (KeyError, ValueError):
                pass
            return False
        if self.cell is not None:
            for frame in self.cell.caps[name].feed(data):
                self.queue(frame)
        return True

    def drain_pipes(self) -> None:
        for name in list(self.pipes):
            for _ in range(256):  # what the interpreter wrote before its frame; bounded
                if not self.read_pipe(name):
                    break

    def read_ctl(self) -> None:
        assert self.ctl is not None
        try:
            data = self.ctl.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.child_died()
            return
        self.ctl_buf += data
        while len(self.ctl_buf) >= 4:
            (size,) = struct.unpack(">I", self.ctl_buf[:4])
            if size > MAX_CTL_FRAME:
                self.finish_cell(self.reap("the interpreter sent a control frame over %d bytes" % MAX_CTL_FRAME))
                return
            if len(self.ctl_buf) < 4 + size:
                return
            raw = bytes(self.ctl_buf[4:4 + size])
            del self.ctl_buf[:4 + size]
            try:
                frame = json.loads(raw)
            except ValueError:
                continue
            if isinstance(frame, dict):
                self.on_frame(frame, len(raw))
            if self.ctl is None:
                return

    def on_frame(self, frame: dict[str, Any], size: int) -> None:
        cell = self.cell
        if cell is None:
            return
        self.drain_pipes()  # what it printed before this frame comes first
        if frame.get("op") == "display":
            if cell.display_bytes + size > cell.max_display or cell.displays >= MAX_DISPLAYS:
                cell.dropped_displays += 1
                return
            cell.displays += 1
            cell.display_bytes += size
            self.queue(encode({"t": "display", "kind": frame.get("kind") or "display",
                               "data": frame.get("data") or {}, "metadata": frame.get("metadata") or {}}))
        elif frame.get("op") == "done":
            self.finish_cell(None, frame)

    def child_died(self) -> None:
        if self.cell is not None:
            self.drain_pipes()
            self.finish_cell(self.reap(""))
        else:
            self.lost = self.reap("")

    def finish_cell(self, lost: str | None, done: dict[str, Any] | None = None) -> None:
        cell = self.cell
        if cell is None:
            return
        self.cell = None
        for cap in cell.caps.values():
            for frame in cap.finish():
                self.queue(frame)
        oom = False
        if lost is not None and cell.oom_before >= 0 and memory_oom_kills() > cell.oom_before:
            oom = True
            lost = "the interpreter was killed: out of memory (the sandbox's memory limit)"
        if cell.conn is None:  # nobody is listening: the next cell says so
            if lost is not None:
                self.lost = lost
            self.start_waiting()
            return
        reasons = [r for r in (cell.lost, lost) if r]
        self.queue(encode({
            "t": "done", "count": self.count if lost is None else 0,
            "error": (done or {}).get("error"), "timed_out": cell.timed_out,
            "state_lost": bool(reasons), "lost": "; ".join(reasons) or None, "oom": oom,
            "duration": round(time.monotonic() - cell.started, 4), "dropped_displays": cell.dropped_displays,
        }))
        if self.out_conn is not None and not self.outbuf:
            self.close_client()

    def start_waiting(self) -> None:
        if self.waiting is not None and self.cell is None and self.out_conn is None:
            (conn, request), self.waiting = self.waiting, None
            self.start_cell(conn, request)

    # -- the loop --

    def serve(self) -> None:
        while True:
            timeout = self.timers()
            for key, mask in self.sel.select(timeout):
                tag = key.data
                if tag == "accept":
                    self.accept()
                elif tag == "ctl":
                    if self.ctl is not None:
                        self.read_ctl()
                elif tag in ("stdout", "stderr"):
                    self.read_pipe(tag)
                elif tag == "client":
                    if mask & selectors.EVENT_WRITE:
                        self.flush_out()
                    if mask & selectors.EVENT_READ and self.out_conn is not None:
                        try:
                            data = self.out_conn.recv(CHUNK)
                        except BlockingIOError:
                            continue
                        except OSError:
                            data = b""
                        if not data:
                            self.client_gone()


def serve(path: str) -> None:
    source = sys.stdin.read(4 << 20)
    sys.stdin.close()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    supervisor = Supervisor(path, source)
    try:
        supervisor.serve()
    finally:
        if supervisor.child is not None:
            supervisor.reap("shut down")
        try:
            os.unlink(path)
        except OSError:
            pass


# --- the interpreter --------------------------------------------------------------------------------------------

MIME_METHODS = (
    ("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"), ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"), ("image/jpeg", "_repr_jpeg_"), ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
)
BINARY = ("image/png", "image/jpeg")


class Interpreter:
    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.in_cell = False
        self.pending_interrupt = False
        self.shown: set[int] = set()  # figures already published in this cell
        self.loop: Any = None

    # SIGINT raises only while cell code runs; during our own frames it waits for the next cell code.
    def on_sigint(self, signum: int, frame: Any) -> None:
        if self.in_cell:
            raise KeyboardInterrupt
        self.pending_interrupt = True

    def send(self, obj: Any) -> None:
        was, self.in_cell = self.in_cell, False
        try:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a replaced stream's problem, not ours
                    pass
            send_ctl(self.ctl, obj)
        finally:
            self.in_cell = was
        if was and self.pending_interrupt:
            self.pending_interrupt = False
            raise KeyboardInterrupt

    # -- rich output --

    def bundle(self, obj: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        data: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        if not isinstance(obj, type):
            method = getattr(obj, "_repr_mimebundle_", None)
            if callable(method):
                try:
                    got = method(include=None, exclude=None)
                    if isinstance(got, tuple) and len(got) == 2:
                        got, more = got
                        if isinstance(more, dict):
                            meta.update(more)
                    if isinstance(got, dict):
                        data.update(got)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
            for mime, name in MIME_METHODS:
                method = getattr(obj, name, None)
                if mime in data or not callable(method):
                    continue
                try:
                    value = method()
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                    continue
                if isinstance(value, tuple) and len(value) == 2:
                    value, more = value
                    if isinstance(more, dict):
                        meta[mime] = more
                if value is not None:
                    data[mime] = value
            if "image/png" not in data and self.is_figure(obj):
                png = self.figure_png(obj)
                if png is not None:
                    data["image/png"] = png
                    self.shown.add(id(obj))
        for mime in BINARY:
            if isinstance(data.get(mime), (bytes, bytearray)):
                data[mime] = base64.b64encode(bytes(data[mime])).decode("ascii")
        for mime, value in list(data.items()):
            if isinstance(value, (bytes, bytearray)):
                data[mime] = bytes(value).decode("utf-8", errors="replace")
        if "text/plain" not in data:
            try:
                data["text/plain"] = repr(obj)
            except Exception as exc:  # noqa: BLE001
                data["text/plain"] = "<repr failed: %s>" % type(exc).__name__
        return data, meta

    def publish(self, obj: Any, kind: str = "display") -> None:
        data, meta = self.bundle(obj)
        try:
            json.dumps(data)
        except (TypeError, ValueError):
            data = {k: v for k, v in data.items() if _jsonable(v)}
        self.send({"op": "display", "kind": kind, "data": data, "metadata": meta if _jsonable(meta) else {}})

    def display(self, *objs: Any, **_: Any) -> None:
        for obj in objs:
            self.publish(obj)

    @staticmethod
    def is_figure(obj: Any) -> bool:
        return type(obj).__module__.startswith("matplotlib.") and type(obj).__name__ == "Figure"

    def figure_png(self, fig: Any) -> str | None:
        buf = io.BytesIO()
        try:
            fig.savefig(buf, format="png", bbox_inches="tight")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            return None
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def flush_figures(self) -> None:
        """Every open pyplot figure as a PNG (as Jupyter's inline backend does), then closed."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        try:
            numbers = list(plt.get_fignums())
        except Exception:  # noqa: BLE001
            return
        for number in numbers:
            fig = plt.figure(number)
            if id(fig) not in self.shown:
                png = self.figure_png(fig)
                if png is not None:
                    self.shown.add(id(fig))
                    self.send({"op": "display", "kind": "display", "metadata": {},
                               "data": {"image/png": png, "text/plain": repr(fig)}})
        plt.close("all")

    # -- running a cell --

    def user_site(self) -> None:
        """pip installs as the sandbox user into the user site-packages, which site leaves off sys.path when it
        did not exist as this interpreter started: added once it does, so a cell imports what the last one
        installed (``%pip install``)."""
        try:
            import site

            path = site.getusersitepackages() if site.ENABLE_USER_SITE else None
            if path and path not in sys.path and os.path.isdir(path):
                site.addsitedir(path)
                import importlib

                importlib.invalidate_caches()
        except Exception:  # noqa: BLE001 - a broken site module leaves sys.path as it was
            pass

    def run(self, code: str, count: int) -> dict[str, Any] | None:
        self.user_site()
        filename = "<cell-%d>" % count
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
        self.shown = set()
        self.pending_interrupt = False
        self.in_cell = True
        try:
            try:
                tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST | flags)
                last = None
                if tree.body and isinstance(tree.body[-1], ast.Expr):
                    last = ast.Expression(tree.body.pop().value)
                self.wait(eval(compile(tree, filename, "exec", flags), self.ns))
                if last is not None:
                    value = self.wait(eval(compile(last, filename, "eval", flags), self.ns))
                    if value is not None:
                        self.ns["_"] = value
                        self.publish(value, "result")
            finally:
                self.flush_figures()
        except BaseException as exc:  # noqa: BLE001 - everything the cell raised is its result
            self.in_cell = False
            if isinstance(exc, SystemExit):
                pass
            return self.error(exc)
        finally:
            self.in_cell = False
        return None

    def wait(self, value: Any) -> Any:
        """The value of a cell that used top-level await: run its coroutine to the end."""
        if not (hasattr(value, "__await__") and hasattr(value, "send")):
            return value
        if self.loop is None:
            import asyncio

            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(value)

    def error(self, exc: BaseException) -> dict[str, Any]:
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        seen: set[int] = set()
        todo = [report]
        while todo:  # this file's frames (the runner, the SIGINT handler) are not the cell's
            item = todo.pop()
            if id(item) in seen:
                continue
            seen.add(id(item))
            item.stack = traceback.StackSummary.from_list([f for f in item.stack if f.filename != "<string>"])
            todo += [t for t in (item.__cause__, item.__context__) if t is not None]
        text = "".join(report.format())
        try:
            sys.stderr.write(text)
        except Exception:  # noqa: BLE001
            pass
        return {"name": type(exc).__name__, "value": _short(str(exc)), "traceback": _short(text, 1 << 20)}

    def main(self) -> None:
        signal.signal(signal.SIGINT, self.on_sigint)
        builtins.display = self.display  # type: ignore[attr-defined]
        sys.meta_path.insert(0, InlineBackendFinder(self))
        while True:
            try:
                header = recv_exact(self.ctl, 4)
                if header is None:
                    return
                (size,) = struct.unpack(">I", header)
                raw = recv_exact(self.ctl, size)
                if raw is None:
                    return
                request = json.loads(raw)
                error = self.run(str(request.get("code") or ""), int(request.get("count") or 0))
                self.send({"op": "done", "error": error})
            except KeyboardInterrupt:
                continue  # a late interrupt for a cell that had already finished
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF):
                    return
                raise


def _short(text: str, limit: int = 65536) -> str:
    return text if len(text) <= limit else text[:limit // 2] + "\n[...]\n" + text[-limit // 2:]


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class InlineBackendFinder:
    """``MPLBACKEND=module://execbox_inline``: matplotlib's Agg canvas, and ``plt.show()`` publishes the open
    figures as PNG instead of opening a window."""

    def __init__(self, interpreter: Interpreter) -> None:
        self.interpreter = interpreter

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != INLINE_BACKEND:
            return None
        import importlib.util

        loader: Any = self
        return importlib.util.spec_from_loader(name, loader)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        import importlib

        bases = importlib.import_module("matplotlib.backend_bases")
        agg = importlib.import_module("matplotlib.backends.backend_agg")
        interpreter = self.interpreter

        def show(*args: Any, **kwargs: Any) -> None:
            interpreter.flush_figures()

        module.FigureCanvas = agg.FigureCanvasAgg
        module.FigureManager = bases.FigureManagerBase
        module.show = show


def child(fd: int) -> None:
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")  # under a memory limit, the interpreter goes first, never the supervisor
    except OSError:
        pass
    Interpreter(socket.socket(fileno=fd)).main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["child"]:
        child(int(sys.argv[2]))
    else:
        sys.stderr.write("usage: serve SOCKET | child FD\n")
        sys.exit(2)
