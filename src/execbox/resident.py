"""A resident execbox, the client's side (the server's is ``resident_server``): ``execbox serve`` keeps the CLI
imported and forks a child for each command line it is handed; the ``execbox`` program hands its command line
over when ``CODE_EXEC_SERVER`` names the server's socket.

Why: a fresh ``execbox run`` spends ~300 ms before its sandbox starts (Python, then importing pydantic, click,
anyio and docker-py): twice a raw ``docker run``. A child forked from a process that has all that imported
starts in a few milliseconds. Opt-in, since the server is a process that outlives the runs (like ``execbox
mcp``); every sandbox still belongs to the child that made it, and goes with it.

Why fork, not run the command in the server: the child gets the client's own standard streams (passed over the
socket as file descriptors), its working directory (a descriptor too), its umask and its environment, and runs
the very same CLI code; so a command behaves exactly as it does without the server (relative paths, ``--stdin``,
a terminal, the exit status, the settings in the environment). The server itself starts no thread and opens no
connection to an engine: a child shares nothing with the server or with another child.

Safety: the socket is 0600 and the server serves its own uid only (``SO_PEERCRED``): a root server never runs
another user's command line. The client sends nothing before it knows the socket is its own server's: every
step of the path is this user's or root's (``socket_dir``; no link or directory another user controls), the
socket is this user's and private, it connects through the directory it checked, and the peer is this uid.

Lifetimes: a client that dies (SIGKILL included) closes its connection, and the server then hangs up its child's
process group (SIGHUP, which the CLI handles like Ctrl-C: its sandbox is removed), and kills it ``KILL_GRACE_S``
later if it is still there. A child gets SIGHUP too when the server dies (its parent-death signal). The client
forwards SIGINT, SIGTERM and SIGHUP to its child's process group.

The wire: the client sends a 4-byte length with four descriptors (stdin, stdout, stderr, working directory),
then that many bytes: the request (``encode_request``: umask, argv and environment, NUL-separated, as the
kernel keeps them, so any bytes a file name may hold go through); later, single bytes, each a signal number to
forward. The server answers one line: ``exit N`` when the child has ended, or ``error MESSAGE``.

The client runs before anything else of execbox is imported, and imports the C modules under the stdlib's
``socket``, ``signal`` and ``struct`` rather than those: their enums alone cost ~10 ms of each command line.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stub: the C module under signal
import _socket
import os
import stat  # imported by os already: free
import sys

#: The variable that names the server's socket (declared with the other settings as ``Settings.server``; read here
#: directly, because the client runs before pydantic is imported).
SERVER_VAR = "CODE_EXEC_SERVER"
#: The signals a client forwards to its child's process group.
FORWARDED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
#: The request's header: the length of its body (``encode_request``), 4 bytes, big-endian.
HEADER_SIZE = 4


def header(length: int) -> bytes:
    return length.to_bytes(HEADER_SIZE, "big")


def starts_a_server(argv: list[str]) -> bool:
    """Is ``argv`` (the program's arguments) an ``execbox serve``? Never handed to a server, nor run by one."""
    command = [arg for arg in argv if arg != "--"][:1]
    return command == ["serve"]


def open_standard_fds() -> None:
    """Make 0, 1 and 2 open (/dev/null for a closed one), so that no socket of ours takes a standard stream's
    number, to be handed over or inherited as that stream."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one


def peer_uid(sock: _socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED: pid, uid, gid)."""
    return int.from_bytes(sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)[4:8], sys.byteorder)


class UntrustedSocket(Exception):
    """The socket at the path may not be this user's server's: why."""


#: Symbolic links followed on the way to the socket, at most (the kernel's own limit).
_MAX_LINKS = 40


def socket_dir(path: str) -> tuple[int, str]:
    """A descriptor (O_PATH) of the directory holding the socket ``path`` names, and its name there, when only this
    user or root can have made every step of the way to it: each directory on the way (links followed) is owned by
    one of them and writable by no one else unless sticky (in /tmp another user may add a name, never replace
    ours), each link is owned by one of them, and the socket itself (not a link, nor one of several hard links)
    is this user's, mode 0600 or less. Else UntrustedSocket: root's environment went to any root-owned socket
    another user pointed a link in a shared directory at (that listener's peer uid was root's too)."""
    uid = os.getuid()
    if not path.startswith("/"):
        path = os.getcwd() + "/" + path
    head, _, name = path.rpartition("/")
    if name in ("", ".", ".."):
        raise UntrustedSocket("it names a directory")
    pending = [part for part in reversed(head.split("/")) if part]  # a stack: the next component last
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    links = 0
    try:
        _trusted_dir(fd, "/", uid)
        while pending:
            part = pending.pop()
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if st.st_uid not in (uid, 0) or links > _MAX_LINKS:
                    raise UntrustedSocket(f"the link {part!r} on its way is uid {st.st_uid}'s" if links <= _MAX_LINKS
                                          else "too many links on its way")
                target = os.readlink(part, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = -1
                    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                pending += [step for step in reversed(target.split("/")) if step]
                continue
            # O_NOFOLLOW: a name swapped for a link since the stat fails here instead of being followed.
            step = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = step
            _trusted_dir(fd, part, uid)
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise UntrustedSocket("it is a symbolic link")
        if not stat.S_ISSOCK(st.st_mode):
            raise UntrustedSocket("it is not a socket")
        if st.st_uid != uid:
            raise UntrustedSocket(f"it is uid {st.st_uid}'s, not yours")
        if st.st_mode & 0o077:
            raise UntrustedSocket(f"other users may use it (mode {stat.S_IMODE(st.st_mode):04o})")
        if st.st_nlink != 1:  # a server binds one name: another is a hard link, which another user may have made
            raise UntrustedSocket(f"it has {st.st_nlink} names (hard links)")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd, name


def _trusted_dir(fd: int, name: str, uid: int) -> None:
    st = os.fstat(fd)
    if st.st_uid not in (uid, 0):
        raise UntrustedSocket(f"the directory {name!r} on its way is uid {st.st_uid}'s")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UntrustedSocket(f"other users may write to the directory {name!r} on its way "
                              f"(mode {stat.S_IMODE(st.st_mode):04o})")


def forward(path: str, argv: list[str]) -> int | None:
    """Run the command line ``argv`` on the server at ``path``, with this process's standard streams, working
    directory, umask and environment; its exit status. None when no server of this user answers there: then
    nothing was sent, and the caller runs the command itself."""
    open_standard_fds()
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    where = -1
    try:
        where, name = socket_dir(path)
        # Through the directory checked, not the path again: what is connected to is what was checked.
        sock.connect(f"/proc/self/fd/{where}/{name}")
        uid = peer_uid(sock)
    except (OSError, UntrustedSocket) as exc:
        sock.close()
        _without(path, exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc))
        return None
    finally:
        if where >= 0:
            os.close(where)
    if uid != os.getuid():  # whoever could make that path would get the environment, streams and directory
        sock.close()
        _without(path, f"it is served by uid {uid}, not by you")
        return None
    umask = os.umask(0o022)
    os.umask(umask)
    body = encode_request(umask, argv, dict(os.environ))
    cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # O_PATH: a directory we may enter, not read
    try:
        fds = b"".join(fd.to_bytes(4, sys.byteorder) for fd in (0, 1, 2, cwd))  # SCM_RIGHTS: C ints
        sock.sendmsg([header(len(body))], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        sock.sendall(body)
    except OSError:
        pass  # refused before it read everything: its answer says why
    finally:
        os.close(cwd)

    def relay(signum: int, frame: object) -> None:
        try:
            sock.send(bytes([signum]))
        except OSError:
            pass

    for signum in FORWARDED:
        if _signal.getsignal(signum) != _signal.SIG_IGN:  # ignored here (nohup, a background job): not relayed
            _signal.signal(signum, relay)
    answer = b""
    while not answer.endswith(b"\n"):
        try:
            chunk = sock.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            _say(f"the server at {path} ended before the command did")
            return 1
        answer += chunk
    kind, _, value = answer.decode(errors="replace").strip().partition(" ")
    if kind != "exit" or not value.isdigit():
        _say(f"the server at {path} refused: {value if kind == 'error' else answer!r}")
        return 1
    return int(value)


def _without(path: str, why: str) -> None:
    _say(f"no server of yours at {SERVER_VAR}={path} ({why}); running without it. Start one with `execbox serve`, "
         f"or unset {SERVER_VAR}")


def _say(message: str) -> None:
    # On descriptor 2 itself: sys.stderr is None when the program started with it closed.
    os.write(2, f"execbox: {message}\n".encode(errors="replace"))


def encode_request(umask: int, argv: list[str], env: dict[str, str]) -> bytes:
    """``umask``, the number of arguments, the arguments, then NAME=VALUE of each variable; each ends in NUL."""
    items = [f"{umask:o}", str(len(argv)), *argv, *(f"{name}={value}" for name, value in env.items())]
    return b"".join(os.fsencode(item) + b"\0" for item in items)


def decode_request(body: bytes) -> tuple[int, list[str], dict[str, str]]:
    """``encode_request``'s (umask, argv, env); ValueError when ``body`` is not one."""
    if not body.endswith(b"\0"):
        raise ValueError("request does not end in NUL")
    items = [os.fsdecode(item) for item in body[:-1].split(b"\0")]
    if len(items) < 2 or not items[1].isdigit() or len(items) < 2 + int(items[1]):
        raise ValueError("request has no umask and argument count")
    umask, count = int(items[0], 8), int(items[1])
    if not 0 <= umask <= 0o777:
        raise ValueError(f"umask {items[0]} out of range")
    env = {}
    for item in items[2 + count:]:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"variable without a name or '=': {item[:50]!r}")
        env[name] = value
    return umask, items[2:2 + count], env
