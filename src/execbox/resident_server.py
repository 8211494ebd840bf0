"""A resident execbox, the server's side: ``execbox serve`` (the wire, the client and why: ``resident``).

The server imports execbox once and forks a child for each command line; the child becomes the client's
process (its streams, working directory, umask and environment) and runs the CLI. Lifetimes: a client that
goes away gets its child hung up (SIGHUP, handled by the CLI like Ctrl-C: its sandbox is removed), and killed
``KILL_GRACE_S`` later if still there; a child gets SIGHUP when the server dies (its parent-death signal); the
server, on SIGTERM, SIGINT or SIGHUP, stops listening and hangs up every child before it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import signal
import socket
import stat
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from execbox.resident import FORWARDED, HEADER, decode_request

#: Seconds between hanging up a child whose client went away and killing its process group.
KILL_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1
_MAX_REQUEST = 8 << 20  # argv and environment: far above what execve takes (ARG_MAX)
_REQUEST_TIMEOUT_S = 10.0  # a client sends its request at once; one that does not is dropped


class ServeError(Exception):
    """The server cannot start (the CLI says it as a ConfigError)."""


@dataclass
class _Child:
    conn: socket.socket
    pidfd: int
    kill_at: float | None = None  # set when the client went away: then the process group is killed at this time


@dataclass
class _Server:
    path: str
    run: Callable[[list[str]], object]
    listener: socket.socket
    inode: int
    wake: tuple[int, int]
    prctl: Callable[..., int]  # libc's, loaded once: a child arms its parent-death signal with it
    pid: int = field(default_factory=os.getpid)
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    children: dict[int, _Child] = field(default_factory=dict)
    stopping: bool = False


def serve(path: str, run: Callable[[list[str]], object], ready: Callable[[], object] = lambda: None) -> None:
    """Serve command lines on a new socket at ``path`` until SIGTERM, SIGINT or SIGHUP; then hang up every child,
    wait for them (``KILL_GRACE_S`` at most) and remove the socket. ``run(argv)`` runs one command line in a
    forked child: it returns or raises SystemExit, and the child then exits with that status. ``ready()`` is
    called once the socket listens."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    listener, inode = _listen(path)
    wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    server = _Server(path, run, listener, inode, wake, prctl)

    def stop(signum: int, frame: object) -> None:
        server.stopping = True

    for signum in FORWARDED:
        signal.signal(signum, stop)
    signal.set_wakeup_fd(wake[1])
    server.selector.register(listener, selectors.EVENT_READ, "accept")
    server.selector.register(wake[0], selectors.EVENT_READ, "wake")
    ready()
    try:
        _loop(server)
    finally:
        signal.set_wakeup_fd(-1)
        _close_listener(server)
        for pid in list(server.children):
            _hang_up(server, pid)
        deadline = time.monotonic() + KILL_GRACE_S
        while server.children and time.monotonic() < deadline:
            _step(server, timeout=0.2)
        for pid in list(server.children):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            _reap(server, pid)
        for fd in wake:
            os.close(fd)


def _listen(path: str) -> tuple[socket.socket, int]:
    """A listening socket at ``path``, 0600. A stale socket there (no server answers) is replaced; anything else
    there is left alone and refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ServeError(f"{path} exists and is not a socket; give `execbox serve` another path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # a dead server's socket
        except OSError as exc:
            raise ServeError(f"cannot check the socket {path}: {exc.strerror or exc}") from exc
        else:
            raise ServeError(f"a server already listens at {path}; stop it first, or give another path")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is born 0600: no window in which another user may connect
    try:
        listener.bind(path)
    except OSError as exc:
        listener.close()
        raise ServeError(f"cannot listen at {path}: {exc.strerror or exc}") from exc
    finally:
        os.umask(old)
    listener.listen(64)
    listener.setblocking(False)
    return listener, os.lstat(path).st_ino


def _close_listener(server: _Server) -> None:
    with contextlib.suppress(KeyError, ValueError):
        server.selector.unregister(server.listener)
    server.listener.close()
    with contextlib.suppress(OSError):
        if os.lstat(server.path).st_ino == server.inode:  # still ours, not a newer server's
            os.unlink(server.path)


def _loop(server: _Server) -> None:
    while not server.stopping:
        _step(server, timeout=1.0)


def _step(server: _Server, timeout: float) -> None:
    now = time.monotonic()
    waits = [child.kill_at - now for child in server.children.values() if child.kill_at is not None]
    for key, _ in server.selector.select(max(0.0, min([timeout, *waits]))):
        what = key.data
        if what == "accept":
            _accept(server)
        elif what == "wake":
            with contextlib.suppress(OSError):
                os.read(server.wake[0], 512)
        elif what[0] == "client":
            _from_client(server, what[1])
        elif what[0] == "exit":
            _reap(server, what[1])
    now = time.monotonic()
    for pid, child in list(server.children.items()):
        if child.kill_at is not None and now >= child.kill_at:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            child.kill_at = None


def _accept(server: _Server) -> None:
    try:
        conn, _ = server.listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    fds: list[int] = []
    try:
        conn.setblocking(True)
        conn.settimeout(_REQUEST_TIMEOUT_S)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            _answer(conn, f"error this server serves uid {os.getuid()} only, not uid {uid}; start your own "
                          "with `execbox serve`")
            return
        header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 4)
        request = _request(conn, header, fds)
        if isinstance(request, str):
            _answer(conn, f"error {request}")
            return
    except OSError:
        _close_fds(fds)
        conn.close()
        return
    for stream in (sys.stdout, sys.stderr):  # nothing buffered may be written twice, by the child too
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid == 0:
        _child(server, conn, fds, request)
    _close_fds(fds)
    conn.setblocking(False)
    pidfd = os.pidfd_open(pid)
    server.children[pid] = _Child(conn, pidfd)
    server.selector.register(conn, selectors.EVENT_READ, ("client", pid))
    server.selector.register(pidfd, selectors.EVENT_READ, ("exit", pid))


def _request(conn: socket.socket, header: bytes, fds: list[int]) -> dict[str, Any] | str:
    """The client's request, or what is wrong with it."""
    if len(header) != HEADER.size or len(fds) != 4:
        return "malformed request: expected a length and four descriptors"
    (size,) = HEADER.unpack(header)
    if size > _MAX_REQUEST:
        return f"request of {size} bytes: more than {_MAX_REQUEST}"
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(min(size - len(body), 1 << 16))
        if not chunk:
            return "request cut short"
        body += chunk
    try:
        umask, argv, env = decode_request(bytes(body))
    except ValueError as exc:
        return f"malformed request: {exc}"
    if argv[:1] == ["serve"]:
        return "a server does not start another server"
    return {"umask": umask, "argv": argv, "env": env}


def _answer(conn: socket.socket, reply: str) -> None:
    with contextlib.suppress(OSError):
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(reply.replace("\n", " ").encode() + b"\n")
    conn.close()


def _from_client(server: _Server, pid: int) -> None:
    child = server.children[pid]
    try:
        data = child.conn.recv(64)
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        data = b""
    if not data:  # the client is gone (exited, killed): hang up, as a closed terminal would
        _hang_up(server, pid)
        return
    for signum in data:
        if signum in FORWARDED:
            with contextlib.suppress(OSError):
                os.killpg(pid, signum)


def _hang_up(server: _Server, pid: int) -> None:
    child = server.children[pid]
    with contextlib.suppress(KeyError, ValueError):
        server.selector.unregister(child.conn)
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGHUP)
    if child.kill_at is None:
        child.kill_at = time.monotonic() + KILL_GRACE_S


def _reap(server: _Server, pid: int) -> None:
    child = server.children.pop(pid)
    with contextlib.suppress(KeyError, ValueError):
        server.selector.unregister(child.pidfd)
    with contextlib.suppress(KeyError, ValueError):
        server.selector.unregister(child.conn)
    _, status = os.waitpid(pid, 0)
    os.close(child.pidfd)
    code = os.waitstatus_to_exitcode(status)
    _answer(child.conn, f"exit {code if code >= 0 else 128 - code}")


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _child(server: _Server, conn: socket.socket, fds: list[int], request: dict[str, Any]) -> NoReturn:
    """The forked child: become the client's process (streams, directory, umask, environment) and run its
    command line. Never returns to the server's loop."""
    code: object = 1
    try:
        os.setsid()  # its own process group: what the client's signals and a hang-up reach
        if server.prctl(_PR_SET_PDEATHSIG, signal.SIGHUP, 0, 0, 0) != 0 or os.getppid() != server.pid:
            os._exit(1)  # no parent-death signal, or the server died before it was armed
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        server.selector.close()
        server.listener.close()
        for fd in server.wake:
            os.close(fd)
        for child in server.children.values():
            child.conn.close()
            os.close(child.pidfd)
        conn.close()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        os.fchdir(fds[3])
        _close_fds(fds)
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # from the client's TMPDIR, not the server's
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.reconfigure(line_buffering=stream.isatty() or stream is sys.stderr)  # type: ignore[union-attr]
        code = server.run(list(request["argv"]))
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - say it, as the interpreter would, and end the child
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        with contextlib.suppress(BaseException):
            print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code & 0xFF)

