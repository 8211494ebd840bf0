"""The egress proxy of network mode ``proxy``: one per sandbox, on this host, reachable only through Unix sockets.

The sandbox has no network route at all (docker ``--network none``, bubblewrap's own network namespace);
what it can reach is a Unix socket in a directory bound read-only into it at ``MOUNT_POINT``. In front of
each command, a small forwarder (``FORWARDER``, run by the sandbox's own python3) listens on a port of the
sandbox's loopback, sets ``HTTP_PROXY``/``HTTPS_PROXY`` (and the lower-case forms) to it, and relays each
connection to that socket; it dies with the command. Code that ignores the variables has no route anywhere.

This side is a small asyncio proxy, running in a daemon thread with its own event loop:

- ``CONNECT host:port`` (HTTPS, or anything over TLS) is decided by ``policy.egress``, resolved here, every
  resolved address checked, then tunnelled without interception;
- a plain-HTTP request (``GET http://host/...``) is decided the same way per request: one request per
  connection upstream (``Connection: close``), the ``Host`` header set from the URL, so a redirect is a new
  request the client sends, and a new decision;
- every attempt, allowed or denied, is recorded against the run whose socket it came through: host, port,
  the address connected to (or refused), the reason, bytes each way (``EgressAttempt``).

Why not squid or tinyproxy: neither checks the addresses it resolved against a policy of address ranges
(squid's ``dst`` ACLs come close but resolve separately from the connection and apply to literal and
named destinations alike, so a name that rebinds between the check and the connect slips through), neither
reports attempts per run in a structured form without parsing its access log, and running one per sandbox
means another daemon to start, configure, supervise and kill; this proxy is a thread of the caller's own
process, so it cannot outlive it.

Each run gets its own socket (``start_run``), so records are per exec even when a session runs several at
once, and ``finish_run`` closes that socket and every connection still open through it. ``close`` stops
the thread and removes the directory. The directory is named after its owner process, so gc removes one
a killed caller left (``sweep_orphans``). Everything read from the sandbox is bounded: a request head
(64 KiB, 30 s), open connections (256 per proxy, and a quarter of the process's file limit over all its
proxies), records (1000 per run; the rest counted). Every HTTP head
read, from the sandbox or from upstream, is parsed strictly (``parse_head``): a head one party would read
otherwise than another (a bare LF as a line end, two lengths) is refused, never passed on.

``resolve`` is the one resolver; tests replace it (monkeypatch) to make an allowlisted name resolve to a
listener of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import resource
import socket
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio

from execbox.contract.models import EgressAttempt, ExecResult
from execbox.errors import ConfigError, SandboxError
from execbox.files.workspace import remove_tree
from execbox.kit.ownership import OWNER_FILE, owner_id, owner_tag, remove_orphaned_dirs
from execbox.kit.proxy import secrets as egress_secrets
from execbox.kit.proxy.protocol import (
    CA_FILE,
    CA_VARIABLES,
    MOUNT_POINT,
    TLS_FAILED,
    TLS_HINT,
    Head,
    HeadError,
    answer,
    closing_head,
    parse_head,
    read_chunk_end,
    read_chunk_size,
)
from execbox.policy.egress import (
    Decision,
    EgressPolicy,
    IPAddress,
    literal_address,
)
from execbox.secrets.egress import RunSecrets

T = TypeVar("T")

DIR_PREFIX = "execbox-proxy-"
HEAD_LIMIT = 64 << 10
HEAD_TIMEOUT_S = 30.0
RESOLVE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 256
MAX_RECORDS = 1000
CA_MAX_BYTES = 8 << 20
SETTLE_S = 1.0
_CHUNK = 1 << 16
_UNIX_PATH_MAX = 107
# Never forwarded upstream on a plain-HTTP request: they are about the hop to us, not the request.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate",
                          "te", "trailer", "upgrade", "host", "expect"})
NO_PROXY = "localhost,127.0.0.1,::1"
# What a connection that never reached the proxy fails with (it leaves no attempt): errno texts of Linux and
# the messages of curl and node for them.
_UNPROXIED_ERRORS = ("Cannot assign requested address", "Connection refused", "Network is unreachable",
                     "Couldn't connect to server", "ECONNREFUSED", "ENETUNREACH", "EADDRNOTAVAIL")
UNPROXIED_NOTE = ("egress: a connection failed without reaching the egress proxy, so egress does not list it: "
                  f"{NO_PROXY} (NO_PROXY) are the sandbox's own loopback, where only what the code itself serves "
                  "listens (nothing of this host's; docker's has no ::1), and code that ignores HTTP_PROXY and "
                  "HTTPS_PROXY has no route anywhere")

# Runs inside the sandbox as ``python3 -I -S -c FORWARDER SOCKET -- COMMAND...``: built-in modules only
# (_socket, not socket, whose import would cost every run tens of ms; any python3 since 3.6). Binds a free
# port on the sandbox's loopback, puts it in the proxy variables, and becomes the command; a double-forked
# grandchild (not a child of the command, so a shell's `wait` never waits for it) relays each connection to
# SOCKET until the command's process is gone.
FORWARDER = r"""
import _socket, os, select, sys
path, argv = sys.argv[1], sys.argv[3:]
listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
listener.bind(("127.0.0.1", 0))
listener.listen(128)
url = "http://127.0.0.1:%d" % listener.getsockname()[1]
for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
    os.environ[name] = url
command = os.getpid()
child = os.fork()
if child:
    os.waitpid(child, 0)
    listener.close()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write("execbox: %s: %s\n" % (argv[0], exc.strerror))
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
if os.fork():
    os._exit(0)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)

# One thread relays every connection (poll), so no number of connections can run the sandbox's pids limit
# out, and no error ends the loop: a connection that fails is closed alone. At most LIMIT are open at once
# (the proxy refuses more than MAX_CONNECTIONS anyway); beyond that, new ones wait in the listen queue.
LIMIT, HELD = 240, 1 << 18
IN, OUT, GONE = select.POLLIN, select.POLLOUT, select.POLLHUP | select.POLLERR | select.POLLNVAL
poller = select.poll()
conns = {}  # fd -> [socket, the peer's fd, bytes to send to it, still reading from it, still polled]

def close(fd):
    for f in (fd, conns[fd][1]):
        c = conns.pop(f, None)
        if c is not None:
            if c[4]:
                poller.unregister(f)
            c[0].close()

def update(fd):
    c = conns[fd]
    if c[4]:
        poller.modify(fd, (IN if c[3] and len(conns[c[1]][2]) < HELD else 0) | (OUT if c[2] else 0))

def step(fd, ev):
    c = conns[fd]
    sock, other = c[0], conns[c[1]]
    if ev & OUT and c[2]:
        del c[2][:sock.send(c[2])]
        if not c[2] and not other[3]:
            sock.shutdown(_socket.SHUT_WR)  # its peer sent everything: pass the end on
    if ev & (IN | GONE) and c[3]:
        data = sock.recv(65536)
        if data:
            other[2] += data
        else:
            c[3] = False
            if not other[2]:
                other[0].shutdown(_socket.SHUT_WR)
    elif ev & GONE and c[4]:  # hung up, nothing more to read from it: stop polling it
        poller.unregister(fd)
        c[4] = False
    # done: both ends sent everything and got it, or one hung up and what it sent was delivered
    if (not c[3] and not other[3] and not c[2] and not other[2] or not c[4] and not other[2]
            or not other[4] and not c[2]):
        close(fd)
    else:
        update(fd)
        update(c[1])

def accept():
    fd = listener._accept()[0]
    conn = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM, 0, fd)
    up = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        up.settimeout(10)
        up.connect(path)
    except OSError:
        conn.close()
        up.close()
        return
    for s, peer in ((conn, up), (up, conn)):
        s.setblocking(False)
        conns[s.fileno()] = [s, peer.fileno(), bytearray(), True, True]
        poller.register(s.fileno(), IN)

try:
    watch = os.pidfd_open(command)
    poller.register(watch, IN)
except (AttributeError, OSError):
    watch = None
poller.register(listener.fileno(), IN)
listening = True
while True:
    try:
        if listening != (len(conns) < 2 * LIMIT):
            listening = not listening
            poller.modify(listener.fileno(), IN if listening else 0)
        ready = poller.poll(None if watch is not None else 500)
        if watch is None:
            try:
                os.kill(command, 0)
            except ProcessLookupError:
                os._exit(0)
            except OSError:
                pass
        for fd, ev in ready:
            if fd == watch:
                os._exit(0)
            if fd == listener.fileno():
                if ev & IN and listening:
                    accept()
            elif fd in conns:
                try:
                    step(fd, ev)
                except OSError:
                    close(fd)
    except Exception:
        select.select([], [], [], 0.05)  # out of file descriptors, say: a connection closing will end it
"""














async def resolve(host: str, port: int) -> list[str]:
    """The addresses of ``host``, in the resolver's order (this host's resolver; tests replace this)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[str] = []
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and sockaddr[0] not in found:
            found.append(str(sockaddr[0]))
    return found


_local_cache: tuple[float, frozenset[IPAddress]] = (0.0, frozenset())


def local_addresses() -> frozenset[IPAddress]:
    """This host's own addresses (every interface, v4 and v6), from /proc; re-read at most once a second."""
    global _local_cache
    at, cached = _local_cache
    if time.monotonic() - at < 1.0:
        return cached
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError), open("/proc/net/fib_trie") as fh:
        last = ""
        for line in fh:
            text = line.strip()
            if text.startswith("|--"):
                last = text[3:].strip()
            elif text.endswith("host LOCAL") and last:
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(last))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as fh:
        for line in fh:
            raw = line.split()[0] if line.split() else ""
            with contextlib.suppress(ValueError):
                found.add(ipaddress.IPv6Address(int(raw, 16)))
    result = frozenset(found)
    _local_cache = (time.monotonic(), result)
    return result


@dataclass
class _Attempt:
    host: str
    port: int
    allowed: bool = False
    reason: str = ""
    address: str = ""
    sent: int = 0
    received: int = 0
    secrets: list[str] = field(default_factory=list)  # secrets at egress substituted (or carried, when refused)

    def frozen(self) -> EgressAttempt:
        return EgressAttempt(host=self.host, port=self.port, allowed=self.allowed, reason=self.reason,
                             address=self.address, bytes_sent=self.sent, bytes_received=self.received,
                             secrets=list(self.secrets))


@dataclass
class ProxyRun:
    """One exec's door to the proxy: its own socket, its own record."""

    name: str
    host_socket: str
    attempts: list[_Attempt] = field(default_factory=list)
    dropped: int = 0
    server: asyncio.AbstractServer | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    # The run's secrets at egress (secrets.egress.RunSecrets), if it has any.
    secrets: Any = None

    @property
    def sandbox_socket(self) -> str:
        """The socket's path inside the sandbox."""
        return f"{MOUNT_POINT}/{self.name}"


def sweep_orphans() -> list[str]:
    """Remove the proxy directories of execbox processes that are gone (a crash, a SIGKILL): only real
    directories of this user, with our name; returns what was removed."""
    return remove_orphaned_dirs(DIR_PREFIX)


def _read_bundle(path: Path) -> bytes:
    """The CA bundle's bytes, bounded, without following a link swapped in after the settings were read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"CODE_EXEC_CA_BUNDLE={path} cannot be read: {exc.strerror}. Point it at a PEM file of "
                          "CA certificates, or unset it", env_var="CODE_EXEC_CA_BUNDLE") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise ConfigError(f"CODE_EXEC_CA_BUNDLE={path} is not a regular file", env_var="CODE_EXEC_CA_BUNDLE")
        data = fh.read(CA_MAX_BYTES + 1)
    if len(data) > CA_MAX_BYTES or b"-----BEGIN CERTIFICATE-----" not in data:
        raise ConfigError(f"CODE_EXEC_CA_BUNDLE={path} is not a PEM bundle of CA certificates (at most "
                          f"{CA_MAX_BYTES >> 20} MiB)", env_var="CODE_EXEC_CA_BUNDLE")
    return data


class EgressProxy:
    """The proxy of one sandbox (a session, or a one-shot run): a directory to bind into the sandbox at
    ``MOUNT_POINT``, a thread serving it, one socket per run. Safe to call from any thread; ``close`` twice."""

    #: TLS interception for secrets at egress (kit.proxy.secrets.Interceptor), made when a run first has some.
    mitm: Any = None

    def __init__(self, policy: EgressPolicy, *, owner: tuple[int, int] | None = None,
                 ca_bundle: Path | None = None) -> None:
        self.policy = policy
        #: uid:gid the sandbox's processes run as on this host, when that is not this process's (as root).
        self.owner = owner
        self._closed = False
        self._lock = threading.Lock()
        self._open: set[asyncio.StreamWriter] = set()
        self._clients = 0  # connections from the sandbox now open (MAX_CONNECTIONS; each may have one upstream)
        self._servers: set[asyncio.AbstractServer] = set()
        self.directory = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{owner_tag()}-")
        self.ca_file: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="execbox-egress-proxy", daemon=True)
        try:
            # Searchable, not listable, by the sandbox's uid; each socket is that uid's alone.
            os.chmod(self.directory, 0o711 if owner else 0o700)
            with open(os.path.join(self.directory, OWNER_FILE), "x") as fh:  # for gc: who made it, on which host
                fh.write(owner_id() + "\n")
            if len(os.path.join(self.directory, "run-" + "0" * 12 + ".sock")) > _UNIX_PATH_MAX:
                raise SandboxError(f"the temporary directory {tempfile.gettempdir()} has too long a path for a Unix "
                                   "socket; set TMPDIR to a shorter one (e.g. /tmp)")
            if ca_bundle is not None:
                data = _read_bundle(ca_bundle)
                target = os.path.join(self.directory, CA_FILE)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.chmod(target, 0o644)
                self.ca_file = f"{MOUNT_POINT}/{CA_FILE}"
            self._thread.start()
        except BaseException:
            self._loop.close()
            remove_tree(self.directory)
            raise

    # -- what a backend uses --

    def env(self, secrets: RunSecrets | None = None) -> dict[str, str]:
        """Variables every command of the sandbox gets (the forwarder adds the proxy variables themselves);
        ``secrets``: the run's secrets at egress (its spec's ``egress``)."""
        env = {"NO_PROXY": NO_PROXY, "no_proxy": NO_PROXY}
        if self.ca_file:
            env.update({name: self.ca_file for name in CA_VARIABLES})
        env.update(egress_secrets.ca_env(self, secrets))  # a run with secrets at egress trusts this sandbox's CAs too
        return env

    @staticmethod
    def command(run: ProxyRun, argv: list[str], python: str = "python3") -> list[str]:
        """``argv`` behind the forwarder of ``run``: what the sandbox runs instead of ``argv``."""
        return [python, "-I", "-S", "-c", FORWARDER, run.sandbox_socket, "--", *argv]

    def start_run(self, secrets: RunSecrets | None = None) -> ProxyRun:
        """A new socket for one exec (blocking, milliseconds), carrying ``secrets``, the run's secrets at egress
        (its spec's ``egress``)."""
        run = self._call(self._start_run())
        run.secrets = egress_secrets.for_run(self, secrets)
        return run

    def finish_run(self, run: ProxyRun, settle_s: float = SETTLE_S) -> tuple[list[EgressAttempt], int]:
        """Close the run's socket and, after up to ``settle_s`` for them to end by themselves, every connection
        still open through it; the run's attempts, in order, and how many more were not kept."""
        if self._closed:
            return [a.frozen() for a in run.attempts], run.dropped
        return self._call(self._finish_run(run, settle_s), timeout=settle_s + 10)

    def close(self) -> None:
        """Stop the thread, close every socket and connection, remove the directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.mitm = None  # the sandbox's CAs (keys in memory only) go with it
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        remove_tree(self.directory)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the loop's side --

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        if self._closed:
            coro.close()
            raise SandboxError("the sandbox's egress proxy is closed; open a new sandbox")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start_run(self) -> ProxyRun:
        name = f"run-{uuid.uuid4().hex[:12]}.sock"
        run = ProxyRun(name, os.path.join(self.directory, name))
        run.server = await asyncio.start_unix_server(lambda r, w: self._serve(run, r, w), run.host_socket,
                                                     limit=HEAD_LIMIT)
        self._servers.add(run.server)
        if self.owner:
            os.chown(run.host_socket, *self.owner)
        os.chmod(run.host_socket, 0o600)
        return run

    async def _finish_run(self, run: ProxyRun, settle_s: float) -> tuple[list[EgressAttempt], int]:
        if run.server is not None:
            run.server.close()
            self._servers.discard(run.server)
        deadline = time.monotonic() + settle_s
        while run.writers and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for writer in list(run.writers):
            writer.transport.abort()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(run.host_socket)
        await asyncio.sleep(0)  # let the aborted relays count their last bytes
        return [a.frozen() for a in run.attempts], run.dropped

    async def _shutdown(self) -> None:
        for server in list(self._servers):
            server.close()
        for writer in list(self._open):
            writer.transport.abort()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)

    def _record(self, run: ProxyRun, attempt: _Attempt) -> _Attempt:
        if len(run.attempts) < MAX_RECORDS:
            run.attempts.append(attempt)
        else:
            run.dropped += 1
        return attempt

    async def _serve(self, run: ProxyRun, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        run.writers.add(writer)
        self._open.add(writer)
        self._clients += 1
        admitted = _admit()
        try:
            if self._clients > MAX_CONNECTIONS:
                self._record(run, _Attempt("", 0, reason=f"refused: more than {MAX_CONNECTIONS} connections open"))
                await answer(writer, 503, f"more than {MAX_CONNECTIONS} connections open through this sandbox's "
                                           "proxy")
                return
            if not admitted:
                self._record(run, _Attempt("", 0, reason=f"refused: {_process_cap()} connections from sandboxes "
                                                          "open in this process (a quarter of its file limit)"))
                await answer(writer, 503, "too many connections open through this process's egress proxies")
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except asyncio.LimitOverrunError:
                self._record(run, _Attempt("", 0, reason=f"a request head over {HEAD_LIMIT} bytes"))
                await answer(writer, 431, "request head too large")
                return
            except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
                partial = getattr(exc, "partial", b"")
                if partial:
                    self._record(run, _Attempt("", 0, reason="not an HTTP proxy request (no complete request head)"))
                return
            await self._dispatch(run, head, reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            pass
        except asyncio.CancelledError:  # the proxy is closing: a connection handler ends quietly
            pass
        finally:
            run.writers.discard(writer)
            self._open.discard(writer)
            self._clients -= 1
            if admitted:
                _release()
            writer.transport.abort()

    async def _dispatch(self, run: ProxyRun, raw: bytes, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        method, _, rest = raw.partition(b" ")
        target = rest.partition(b" ")[0].decode("latin-1")
        connect = method.upper() == b"CONNECT"
        where = _authority(target) if connect else _url_destination(target)
        if run.secrets is not None:  # a placeholder of a secret at egress, where it must not go
            refusal = egress_secrets.refuse_head(run, raw, where[0] or "", where[1])
            if refusal is not None:
                hit = run.secrets.carried(raw)
                self._record(run, _Attempt((where[0] or target)[:253], where[1], reason=refusal, secrets=[hit.name]))
                await answer(writer, 403, refusal)
                return
        try:
            head = parse_head(raw)
        except HeadError as exc:
            self._record(run, _Attempt((where[0] or "")[:253], where[1], reason=f"refused: {exc}"))
            await answer(writer, 400, f"refused: {exc}")
            return
        if connect:
            host, port = where
            if host is None:
                self._record(run, _Attempt(target[:253], 0, reason="a malformed CONNECT target (want host:port)"))
                await answer(writer, 400, "CONNECT wants host:port")
                return
            intercepted = egress_secrets.intercepts(run, host, port) and self.mitm is not None
            opened = await self._upstream(run, host, port, writer, secret_host=intercepted)
            if opened is None:
                return
            attempt, up_reader, up_writer = opened
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if intercepted:
                await self.mitm.intercept(run, attempt, host, port, reader, writer, up_reader, up_writer)
                return
            await _relay(attempt, egress_secrets.guard(run, attempt, reader), writer, up_reader, up_writer)
            return
        await self._forward(run, head, reader, writer)

    async def _upstream(self, run: ProxyRun, host: str, port: int, writer: asyncio.StreamWriter, *,
                        secret_host: bool = False
                        ) -> tuple[_Attempt, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Decide, resolve, check every address, connect; record the attempt; answer the client on refusal.
        ``secret_host``: an intercepted CONNECT to the host:port of one of the run's secrets at egress, which the
        caller named, so it counts as allowlisted (by name; its addresses are checked like any other's)."""
        attempt = self._record(run, _Attempt(host[:253], port))
        decision = self.policy.decide_name(host, port)
        if not decision.allowed and secret_host:
            names = ", ".join(s.name for s in run.secrets.for_destination(host, port))
            decision = Decision(True, f"the host of the secret at egress {names}")
        if not decision.allowed:
            attempt.reason = decision.reason
            await answer(writer, 403, f"denied {host}:{port} ({decision.reason})")
            return None
        literal = literal_address(host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                found = await asyncio.wait_for(resolve(host, port), RESOLVE_TIMEOUT_S)
            except (OSError, TimeoutError, UnicodeError, ValueError) as exc:
                attempt.reason = f"allowlisted, but it does not resolve ({exc or type(exc).__name__})"
                await answer(writer, 502, f"{host} does not resolve")
                return None
            local = local_addresses()
            addresses = []
            refusals: list[tuple[IPAddress, str]] = []
            for text in found:
                try:
                    address = ipaddress.ip_address(text.split("%", 1)[0])
                except ValueError:
                    continue
                verdict = self.policy.decide_address(address, port, local)
                if verdict.allowed:
                    addresses.append(address)
                else:
                    refusals.append((address, verdict.reason))
            if not addresses:
                attempt.reason = refusals[0][1] if refusals else "allowlisted, but it resolves to no address"
                attempt.address = str(refusals[0][0]) if refusals else ""
                await answer(writer, 403, f"denied {host}:{port} ({attempt.reason})")
                return None
        failure: BaseException | None = None
        for address in addresses:
            attempt.address = str(address)
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(str(address), port, limit=HEAD_LIMIT), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                failure = exc
                continue
            attempt.allowed, attempt.reason = True, decision.reason
            run.writers.add(up_writer)
            self._open.add(up_writer)
            return attempt, up_reader, up_writer
        attempt.allowed = True
        attempt.reason = f"{decision.reason}; the connection failed ({failure or 'timed out'})"
        await answer(writer, 502, f"cannot connect to {host}:{port}")
        return None

    async def _forward(self, run: ProxyRun, head: Head, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        """One plain-HTTP request, decided on its own URL; the connection closes after the response."""
        method, target, version = head.start
        try:
            url = urlsplit(target)
            port = url.port or 80
        except ValueError:
            url, port = None, 0
        if url is None or url.scheme.lower() != "http" or not url.hostname:
            self._record(run, _Attempt(target[:253], 0, reason="not an absolute http:// URL or CONNECT"))
            await answer(writer, 400, "this proxy serves CONNECT and absolute http:// URLs")
            return
        opened = await self._upstream(run, url.hostname, port, writer)
        if opened is None:
            return
        attempt, up_reader, up_writer = opened
        reader = egress_secrets.guard(run, attempt, reader)  # a placeholder in the body cuts the request
        try:
            lines = [f"{method} {url.path or '/'}{'?' + url.query if url.query else ''} {version}"]
            lines += [f"{name}: {value}" for name, value in head.fields if name.lower() not in _HOP_HEADERS]
            lines += [f"Host: {url.netloc.rpartition('@')[2]}", "Connection: close"]
            _send(up_writer, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), attempt, "sent")
            if any("100-continue" in value.lower() for value in head.values("expect")):
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if head.chunked:
                await _copy_chunked(reader, up_writer, attempt)
            else:
                await _copy_exactly(reader, up_writer, head.length, attempt)
            await up_writer.drain()
            # The response: its head says the connection closes; the rest is relayed as it comes.
            while True:
                raw = await asyncio.wait_for(up_reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
                try:
                    reply = parse_head(raw, response=True)
                except HeadError as exc:
                    attempt.reason += f"; its response was refused: {exc}"
                    await answer(writer, 502, f"{url.hostname} sent a malformed response head ({exc})")
                    return
                informational = reply.start[1].startswith("1") and reply.start[1] != "101"
                _send(writer, raw if informational else closing_head(reply), attempt, "received")
                if not informational:
                    break
            await _pump(up_reader, writer, attempt, "received")
        except HeadError as exc:
            attempt.allowed, attempt.reason = False, f"refused: {exc}"
            await answer(writer, 400, f"refused: {exc}")
        finally:
            run.writers.discard(up_writer)
            self._open.discard(up_writer)
            up_writer.transport.abort()


# Connections from sandboxes open through every proxy of this process: each costs two of its file descriptors (its
# own and its upstream's), so several sandboxes' code at MAX_CONNECTIONS each could take them all (EMFILE for
# everything else the caller does, on systems whose soft limit is 1024).
_process_lock = threading.Lock()
_process_open = 0


def _process_cap() -> int:
    """How many connections from sandboxes this process's proxies admit at once: a quarter of its file limit (so
    half of its descriptors at most), never fewer than 16."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else max(16, soft // 4)


def _admit() -> bool:
    global _process_open
    with _process_lock:
        if _process_open >= _process_cap():
            return False
        _process_open += 1
        return True


def _release() -> None:
    global _process_open
    with _process_lock:
        _process_open -= 1


async def through_egress(egress: EgressProxy | None, secrets: RunSecrets | None,
                         run: Callable[[ProxyRun | None], Awaitable[ExecResult]]) -> ExecResult:
    """``run`` given a fresh socket of ``egress`` (None without one), its attempts then put on its result: a local
    backend's exec in network mode proxy. ``secrets``: the spec's ``egress``."""
    if egress is None:
        return await run(None)
    started = await anyio.to_thread.run_sync(egress.start_run, secrets)
    try:
        result = await run(started)
    finally:
        with anyio.CancelScope(shield=True):
            attempts, dropped = await anyio.to_thread.run_sync(egress.finish_run, started)
    return with_egress(result, attempts, dropped)


def with_egress(result: ExecResult, attempts: list[EgressAttempt], dropped: int) -> ExecResult:
    """``result`` carrying its run's attempts, and notes: when more were made than kept, and each destination
    whose TLS handshake failed (where an allowed attempt alone would leave the code's error unexplained)."""
    notes = list(result.notes)
    if dropped:
        notes.append(f"egress: {dropped} more connection attempts than the {MAX_RECORDS} listed in egress")
    failed = {(a.host, a.port): a.reason for a in attempts if TLS_FAILED in a.reason}
    notes += [f"egress: {host}:{port}: {reason}" for (host, port), reason in list(failed.items())[:5]]
    if result.exit_code != 0 and any(text in result.stderr for text in _UNPROXIED_ERRORS):
        notes.append(UNPROXIED_NOTE)
    return result.model_copy(update={"egress": attempts, "notes": notes})


def _url_destination(target: str) -> tuple[str | None, int]:
    """(host, port) of an absolute http:// URL; (None, 0) when it is not one."""
    try:
        url = urlsplit(target)
        return url.hostname, url.port or 80
    except ValueError:
        return None, 0


def _authority(target: str) -> tuple[str | None, int]:
    """(host, port) of a CONNECT target ``host:port`` / ``[v6]:port``; (None, 0) when malformed."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        return None, 0
    if host.startswith("["):
        if not host.endswith("]"):
            return None, 0
        host = host[1:-1]
    elif ":" in host:
        return None, 0
    return host, int(port)




def _send(writer: asyncio.StreamWriter, data: bytes, attempt: _Attempt, way: str) -> None:
    writer.write(data)
    setattr(attempt, way, getattr(attempt, way) + len(data))


async def _copy_exactly(reader: Any, writer: asyncio.StreamWriter, length: int,
                        attempt: _Attempt) -> None:
    while length > 0:
        data = await reader.read(min(length, _CHUNK))
        if not data:
            raise asyncio.IncompleteReadError(b"", length)
        _send(writer, data, attempt, "sent")
        length -= len(data)
        await writer.drain()


async def _copy_chunked(reader: Any, writer: asyncio.StreamWriter, attempt: _Attempt) -> None:
    """A chunked body, its framing checked (a malformed chunk line is a HeadError) and re-written as read."""
    while True:
        size = await read_chunk_size(reader)
        _send(writer, b"%x\r\n" % size, attempt, "sent")
        await _copy_exactly(reader, writer, size, attempt)
        await read_chunk_end(reader, size)
        _send(writer, b"\r\n", attempt, "sent")
        if size == 0:
            return


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, attempt: _Attempt, way: str,
                watch: _TlsClient | None = None) -> bool:
    """Copy until EOF (then half-close ``dst``); False when a side failed. ``watch`` sees what is copied."""
    try:
        while True:
            data = await src.read(_CHUNK)
            if not data:
                break
            if watch is not None:
                watch.feed(data)
            _send(dst, data, attempt, way)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
        return True
    except (OSError, RuntimeError):
        return False


async def _relay(attempt: _Attempt, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter) -> None:
    """Both ways until both ends are done; a failure on one side closes both. A TLS handshake the sandbox's client
    refused is said on the attempt (``_TlsClient``)."""
    hello = _TlsClient()
    out = asyncio.ensure_future(_pump(reader, up_writer, attempt, "sent", hello))
    back = asyncio.ensure_future(_pump(up_reader, writer, attempt, "received"))
    try:
        for done in asyncio.as_completed([out, back]):
            if not await done:
                break
    finally:
        up_writer.transport.abort()
        writer.transport.abort()
        await asyncio.gather(out, back, return_exceptions=True)
        if hello.refused:
            attempt.reason += (f"; {TLS_FAILED} in the sandbox: its client sent an alert instead of finishing it, most "
                               f"often a certificate it does not trust. {TLS_HINT}")


class _TlsClient:
    """What a client sends at the start of a tunnel, read as TLS records: after its ClientHello (and a
    ChangeCipherSpec), a client that accepts the server's certificate sends its Finished, one that refuses it an
    alert instead (a plain one, or in TLS 1.3 an encrypted record of exactly 19 bytes: 2 of alert, 1 of type, a
    16-byte tag). Only that one record is judged; nothing is judged on a tunnel that is not TLS."""

    def __init__(self) -> None:
        self.refused = False
        self._judged = False
        self._hello = False
        self._buf = b""
        self._skip = 0

    def feed(self, data: bytes) -> None:
        if self._judged:
            return
        self._buf += data
        while not self._judged:
            dropped = min(self._skip, len(self._buf))
            self._buf, self._skip = self._buf[dropped:], self._skip - dropped
            if self._skip or len(self._buf) < 5:
                return
            kind, length = self._buf[0], int.from_bytes(self._buf[3:5], "big")
            if not self._hello:
                self._hello = kind == 22
                self._judged = not self._hello
            elif kind != 20:
                self.refused = kind == 21 or (kind == 23 and length == 19)
                self._judged = True
            self._buf, self._skip = self._buf[5:], length






__all__ = ["CA_VARIABLES", "FORWARDER", "MOUNT_POINT", "EgressProxy", "ProxyRun", "local_addresses",
           "resolve", "sweep_orphans", "with_egress"]
