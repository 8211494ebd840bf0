"""A resident execbox, the server's side: ``execbox serve`` (the wire, the client and why: ``resident``).

The server imports execbox once and forks a child for each command line; the child becomes the client's
process (its streams, working directory, umask and environment) and runs the CLI. Lifetimes: a client that
goes away gets its child hung up (SIGHUP, handled by the CLI like Ctrl-C: its sandbox is removed), and killed
``KILL_GRACE_S`` later if still there; what the child left in its process group is killed when it ends; a child
gets SIGHUP when the server dies (its parent-death signal); the server, on SIGTERM, SIGINT or SIGHUP, stops
listening and hangs up every child before it ends.

One thread, one selector, nothing that blocks: a client that connects and sends nothing (or a byte at a time)
costs the others nothing, and is dropped ``REQUEST_TIMEOUT_S`` after it connected.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import selectors
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from execbox.resident import FORWARDED, HEADER_SIZE, decode_request, open_standard_fds, peer_uid, starts_a_server

#: Seconds between hanging up a child whose client went away and killing its process group.
KILL_GRACE_S = 30.0
#: Seconds a client has, from connecting, to send its whole request.
REQUEST_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1
_MAX_REQUEST = 8 << 20  # argv and environment: far above what execve takes (ARG_MAX)


class ServeError(Exception):
    """The server cannot start (the CLI says it as a ConfigError)."""


@dataclass
class _Request:
    """A connection whose request is still arriving."""

    conn: socket.socket
    deadline: float
    fds: list[int] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)


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
    requests: dict[int, _Request] = field(default_factory=dict)  # by the connection's descriptor
    children: dict[int, _Child] = field(default_factory=dict)  # by pid
    stopping: bool = False


def serve(path: str, run: Callable[[list[str]], object], ready: Callable[[], object] = lambda: None) -> None:
    """Serve command lines on a new socket at ``path`` until SIGTERM, SIGINT or SIGHUP; then hang up every child,
    wait for them (``KILL_GRACE_S`` at most) and remove the socket. ``run(argv)`` runs one command line in a
    forked child: it returns or raises SystemExit, and the child then exits with that status. ``ready()`` is
    called once the socket listens."""
    import ctypes

    open_standard_fds()  # started with one closed: the listener must not take its place (children inherit 0-2)
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
        while not server.stopping:
            _step(server, timeout=1.0)
    finally:
        signal.set_wakeup_fd(-1)
        _close_listener(server)
        for fd in list(server.requests):
            _drop(server, fd)
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
    there is left alone and refused. Under a lock beside it (``PATH.lock``): two servers starting at once would
    otherwise both find the stale socket, and the second would unlink the first one's new socket, leaving that
    server listening where nobody can reach it. The lock must be ours and private: a lock file another user made
    (or may open: flock needs only read access) would let them hold our start forever."""
    try:
        lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ServeError(f"cannot lock {path}.lock: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(lock)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ServeError(f"{path}.lock is not a private file of yours (uid {st.st_uid}, mode "
                             f"{stat.S_IMODE(st.st_mode):04o}): whoever may open it can hold this server's start; "
                             "remove it, or give `execbox serve` another path")
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _listen_locked(path)
    finally:
        os.close(lock)


def _listen_locked(path: str) -> tuple[socket.socket, int]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ServeError(f"cannot check {path}: {exc.strerror or exc}") from exc
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ServeError(f"{path} exists and is not a socket; give `execbox serve` another path")
        if st.st_uid != os.getuid():  # not probed: its listener could hold the connect below forever
            raise ServeError(f"{path} is uid {st.st_uid}'s socket, not yours; give `execbox serve` another path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Not blocking: a listener whose queue is full (one that never accepts) holds a blocking connect forever;
            # a Unix socket's connect then fails at once (EAGAIN) instead.
            probe.setblocking(False)
            probe.connect(path)
        except ConnectionRefusedError:
            try:
                os.unlink(path)  # a dead server's socket
            except FileNotFoundError:
                pass  # another server starting at the same path took it away first
            except OSError as exc:
                raise ServeError(f"cannot replace the dead server's socket {path}: {exc.strerror}") from exc
        except BlockingIOError as exc:
            raise ServeError(f"a server listens at {path} but accepts nothing (its queue is full); stop it first, "
                             "or give another path") from exc
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
        if exc.errno == errno.EADDRINUSE:
            raise ServeError(f"another server started at {path} at the same time; stop it first, or give "
                             "another path") from exc
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


def _step(server: _Server, timeout: float) -> None:
    now = time.monotonic()
    waits = [request.deadline - now for request in server.requests.values()]
    waits += [child.kill_at - now for child in server.children.values() if child.kill_at is not None]
    for key, _ in server.selector.select(max(0.0, min([timeout, *waits]))):
        what = key.data
        if what == "accept":
            _accept(server)
        elif what == "wake":
            with contextlib.suppress(OSError):
                os.read(server.wake[0], 512)
        elif what[0] == "request":
            if what[1] in server.requests:
                _read_request(server, what[1])
        elif what[1] in server.children:  # an event of this batch may concern a child reaped earlier in it
            if what[0] == "client":
                _from_client(server, what[1])
            else:
                _reap(server, what[1])
    now = time.monotonic()
    for fd, request in list(server.requests.items()):
        if now >= request.deadline:
            _drop(server, fd, "request not sent in time")
    for pid, child in list(server.children.items()):
        if child.kill_at is not None and now >= child.kill_at:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            child.kill_at = None


def _accept(server: _Server) -> None:
    try:
        conn, _ = server.listener.accept()
    except OSError:  # none waiting, or out of descriptors: the client sees its connection closed
        return
    uid = peer_uid(conn)
    if uid != os.getuid():
        _answer(conn, f"error this server serves uid {os.getuid()} only, not uid {uid}; start your own with "
                      "`execbox serve`")
        return
    conn.setblocking(False)
    server.requests[conn.fileno()] = _Request(conn, time.monotonic() + REQUEST_TIMEOUT_S)
    server.selector.register(conn, selectors.EVENT_READ, ("request", conn.fileno()))


def _read_request(server: _Server, fd: int) -> None:
    request = server.requests[fd]
    try:
        # The descriptors come with the header; close-on-exec until the child puts them in place.
        data, fds, _, _ = socket.recv_fds(request.conn, 1 << 16, 4, socket.MSG_CMSG_CLOEXEC)
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        data, fds = b"", []
    request.fds += fds
    if len(request.fds) > 4:
        _drop(server, fd, "malformed request: more than four descriptors")
        return
    if not data:  # the client went away (or stopped writing) before its request was whole
        _drop(server, fd, "request cut short" if request.data else None)
        return
    request.data += data
    if len(request.data) < HEADER_SIZE:
        return
    size = int.from_bytes(request.data[:HEADER_SIZE], "big")
    if len(request.fds) != 4:
        _drop(server, fd, "malformed request: expected a length with four descriptors")
    elif size > _MAX_REQUEST:
        _drop(server, fd, f"request of {size} bytes: more than {_MAX_REQUEST}")
    elif len(request.data) >= HEADER_SIZE + size:
        _start(server, fd, bytes(request.data[HEADER_SIZE:HEADER_SIZE + size]))


def _drop(server: _Server, fd: int, error: str | None = None) -> None:
    """Forget a connection whose request is incomplete or refused: its descriptors closed, ``error`` answered."""
    request = server.requests.pop(fd)
    with contextlib.suppress(KeyError, ValueError):
        server.selector.unregister(request.conn)
    _close_fds(request.fds)
    if error is None:
        request.conn.close()
    else:
        _answer(request.conn, f"error {error}")


def _start(server: _Server, fd: int, body: bytes) -> None:
    try:
        umask, argv, env = decode_request(body)
    except ValueError as exc:
        _drop(server, fd, f"malformed request: {exc}")
        return
    if starts_a_server(argv):
        _drop(server, fd, "a server does not start another server")
        return
    request = server.requests.pop(fd)
    server.selector.unregister(request.conn)
    _flush_standard_streams()  # nothing buffered may be written twice, by the child too
    pid = os.fork()
    if pid == 0:
        _child(server, request.conn, request.fds, umask, argv, env)
    _close_fds(request.fds)
    pidfd = os.pidfd_open(pid)
    server.children[pid] = _Child(request.conn, pidfd)
    server.selector.register(request.conn, selectors.EVENT_READ, ("client", pid))
    server.selector.register(pidfd, selectors.EVENT_READ, ("exit", pid))


def _answer(conn: socket.socket, reply: str) -> None:
    with contextlib.suppress(OSError):
        conn.setblocking(False)  # one short line into an empty socket buffer; never wait on a client
        conn.send(reply.replace("\n", " ").encode() + b"\n")
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
    for what in (child.pidfd, child.conn):
        with contextlib.suppress(KeyError, ValueError):
            server.selector.unregister(what)
    _, status = os.waitpid(pid, 0)
    os.close(child.pidfd)
    # What the child left in its process group (its session: nothing else is in it) goes with it. Its pid stays
    # that group's id while a member lives, so it cannot name another process yet.
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    code = os.waitstatus_to_exitcode(status)
    _answer(child.conn, f"exit {code if code >= 0 else 128 - code}")


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _child(server: _Server, conn: socket.socket, fds: list[int], umask: int, argv: list[str],
           env: dict[str, str]) -> NoReturn:
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
        for request in server.requests.values():
            request.conn.close()
            _close_fds(request.fds)
        for child in server.children.values():
            child.conn.close()
            os.close(child.pidfd)
        conn.close()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)  # the copy at 0-2 is inheritable; the received ones are close-on-exec
        os.fchdir(fds[3])
        _close_fds(fds)
        os.umask(umask)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # from the client's TMPDIR, not the server's
        _standard_streams()
        code = server.run(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - say it, as the interpreter would, and end the child
        with contextlib.suppress(BaseException):
            traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        _flush_standard_streams()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        with contextlib.suppress(BaseException):
            print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code & 0xFF)


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()


def _standard_streams() -> None:
    """sys.stdin/stdout/stderr over the client's descriptors: buffered as an interpreter started on them would
    (line by line on a terminal, and stderr always), and made anew if the server started without them."""
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        stream = getattr(sys, name)
        if stream is None:
            stream = open(fd, mode, closefd=False, encoding="utf-8",  # noqa: SIM115 - the process's own stream
                          errors="backslashreplace" if name == "stderr" else "strict")
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        if mode == "w":
            with contextlib.suppress(Exception):
                stream.reconfigure(line_buffering=name == "stderr" or os.isatty(fd))
