"""The checks of the conformance kit, as plain functions that pytest and ``self_check`` both run.

A check takes a ``Kit`` (a runner set up for one backend, and what that backend claims here) and either
returns (the claim holds; optionally a note saying what was seen), raises ``AssertionError`` whose message
names the claim, what was expected and what was seen, or raises

- ``NotClaimed``: the backend does not claim what the check proves (a skip), or
- ``Unavailable``: the check cannot run on this machine (a skip on a laptop, a failure in CI).

No check trusts an absence it has not shown it could see: each first proves its probe ran (the probe's own
output, a host-side control) before it counts "nothing found" as the claim holding.

Every request goes through the public API (``execbox.Runner``), so the guard, the env policy and the
result builder are part of what is checked. Only ``execbox``, ``execbox.plugin`` and ``execbox.testing``
are imported: a third-party backend's author has the same kit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from execbox import (
    BackendTimeoutError,
    BackendUnavailableError,
    Capabilities,
    ExecResult,
    Limits,
    Mount,
    OutputEvent,
    RefusedError,
    Runner,
    Sandbox,
    Settings,
    TransferTooLargeError,
    WorkspacePathError,
    run_blocking,
)
from execbox.plugin import TIMEOUT_EXIT_CODE, ExecRequest, NetworkMode, Verdict

# How long past its timeout a run may take to come back (kill, clean-up, a slow shared machine).
DEADLINE_SLACK_S = 20.0
SANDBOX = "sandbox=True"


class NotClaimed(Exception):
    """The backend does not claim what this check proves: the check does not apply (a skip)."""


class Unavailable(Exception):
    """This machine cannot run the check (no engine, no compiler): a skip on a laptop, a failure in CI."""


def expect(ok: bool, claim: str, expected: str, seen: object) -> None:
    """Fail with a message that names the claim, what was expected and what was seen."""
    if not ok:
        text = seen if isinstance(seen, str) else repr(seen)
        if len(text) > 2000:
            text = text[:1000] + " ... " + text[-1000:]
        raise AssertionError(f"{claim}: expected {expected}; saw {text}")


def reported(result: ExecResult, claim: str, probe: str) -> Any:
    """The JSON the probe printed on its first line; a probe that did not report is a failure, not a pass."""
    try:
        return json.loads(result.stdout.splitlines()[0])
    except (ValueError, IndexError):
        raise AssertionError(f"{claim}: expected the {probe} to report (JSON); saw {shown(result)}") from None


def shown(result: ExecResult) -> str:
    """An ExecResult, briefly, for assertion messages."""
    return (f"exit {result.exit_code} (timed_out={result.timed_out}, oom_killed={result.oom_killed}), "
            f"stdout {result.stdout[-600:]!r}, stderr {result.stderr[-600:]!r}")


@dataclass
class Kit:
    """One backend as the checks see it: a runner, the backend's name and what it claims here."""

    runner: Runner
    backend: str
    caps: Capabilities
    verdict: Verdict | None = None

    @classmethod
    def open(cls, runner: Runner, backend: str) -> Kit:
        """What ``backend`` claims on this machine (its ``check()``); Unavailable when it cannot run here."""
        impl = runner.aio.backend(backend)
        try:
            # Through the runner, under its bound: a check that never returns is a BackendTimeoutError, not a hang.
            caps = run_blocking(functools.partial(runner.aio.select, backend))[1]
        except BackendUnavailableError as exc:
            raise Unavailable(f"backend {backend} cannot run here: {exc}") from exc
        kit = cls(runner, backend, caps)
        # The sandbox claim is conditional on how the backend is configured here (e.g. not when started by
        # root): its verdict says which, and the guard refuses what the verdict disowns.
        kit.verdict = impl.verdict(ExecRequest(argv=["true"], network=kit.net))
        return kit

    @property
    def net(self) -> NetworkMode:
        """The network mode the checks run with: none when the backend enforces it."""
        return "none" if "none" in self.caps.network_modes else min(self.caps.network_modes)

    def run(self, command: str | Sequence[str], **kw: Any) -> ExecResult:
        result = self.runner.run(command, backend=self.backend, network=kw.pop("network", self.net), **kw)
        expect(result.backend == self.backend, "the result names its backend", repr(self.backend), repr(result.backend))
        return result

    def code(self, code: str, **kw: Any) -> ExecResult:
        return self.runner.run_code(code, backend=self.backend, network=self.net, **kw)

    def sandbox(self) -> Sandbox:
        return self.runner.sandbox(self.backend, network=self.net)

    def require(self, *, sessions: bool = False, files: bool = False, network: str | None = None,
                limit: str | None = None, sandbox: bool = False, local: bool = False, mounts: bool = False) -> None:
        """Raise NotClaimed unless the backend claims all of these. ``local``: the code shares this host's
        kernel (not ``remote``), so its identity there is this host's business."""
        caps = self.caps
        if sandbox and not caps.sandbox:
            raise NotClaimed(f"the backend does not claim {SANDBOX}")
        if sandbox and self.verdict is not None and not self.verdict.sandbox:
            raise NotClaimed(f"configured as it is here, the backend says it is not a sandbox: {self.verdict.reason}")
        if local and caps.remote:
            raise NotClaimed("the code runs on another machine (remote=True): its uid, capabilities and namespaces "
                             "there are the provider's boundary, not this host's")
        if sessions and not caps.persistent_sessions:
            raise NotClaimed("the backend does not claim persistent sessions")
        if files and not caps.file_transfer:
            raise NotClaimed("the backend does not claim file transfer")
        if network and network not in caps.network_modes:
            raise NotClaimed(f"the backend does not claim network mode {network!r}")
        if limit and limit not in caps.limits:
            raise NotClaimed(f"the backend does not claim the {limit} limit")
        if mounts and not caps.mounts:
            raise NotClaimed("the backend does not claim mounts (host paths bound in)")


Body = Callable[[Kit], "str | None"]


@dataclass(frozen=True)
class Check:
    name: str
    claim: str
    body: Body


CHECKS: dict[str, Check] = {}


def check(claim: str) -> Callable[[Body], Body]:
    """Register a check under its function's name (without ``check_``), proving ``claim``."""

    def register(fn: Body) -> Body:
        name = fn.__name__.removeprefix("check_")
        CHECKS[name] = Check(name, claim, fn)
        return fn

    return register


E = TypeVar("E", bound=BaseException)


def expect_raises(kind: type[E], call: Callable[[], object], claim: str, what: str) -> None:
    try:
        outcome = call()
    except kind:
        return
    raise AssertionError(f"{claim}: expected {kind.__name__} for {what}; saw it succeed with {outcome!r}")


# --- host-side helpers ----------------------------------------------------------------------------


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


# --- probes ----------------------------------------------------------------------------------------

PROBE_CONNECT = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect(("127.0.0.1", int(sys.argv[1])))
        print("CONNECTED")
    except OSError as exc:
        print("BLOCKED", exc)
    print("IFACES", " ".join(sorted(name for _, name in socket.if_nameindex())))
""")

ESCAPING_GRANDCHILD = textwrap.dedent("""
    import os, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                with open("tick", "a") as fh:
                    fh.write("x")
                time.sleep(0.1)
        os._exit(0)
    while not os.path.exists("tick"):  # the grandchild is running before the deadline can come
        time.sleep(0.05)
    print("GRANDCHILD RUNNING", flush=True)
    time.sleep(1000)
""")

# A one-shot run whose setsid, double-forked grandchild carries a marker in its command line; the run says
# so only once the grandchild is up (it created its file), so a grandchild that never started is seen.
ESCAPING_MARKED_GRANDCHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    if os.fork() == 0:
        os.setsid()
        subprocess.Popen(["python3", "-c", "import time; open('up', 'w').close(); time.sleep(1000)", sys.argv[1]])
        os._exit(0)
    while not os.path.exists("up"):
        time.sleep(0.05)
    print("GRANDCHILD RUNNING", flush=True)
    time.sleep(1000)
""")

# Prints what the process is, from inside; then stays up (at most argv[2] seconds) so that the host can
# look at it from outside, and leaves early on SIGWINCH (ignored by default, so an early one is harmless).
IDENTITY_PROBE = textwrap.dedent("""
    import json, os, signal, sys, time
    seen = []
    signal.signal(signal.SIGWINCH, lambda *_: seen.append(1))
    def read(path, link=False):
        try:
            if link:
                return os.readlink(path)
            with open(path) as fh:
                return fh.read()
        except OSError as exc:
            return "unreadable: %s" % exc
    print(json.dumps({"pid": os.getpid(), "status": read("/proc/self/status"), "uid_map": read("/proc/self/uid_map"),
                      "gid_map": read("/proc/self/gid_map"), "userns": read("/proc/self/ns/user", True)}), flush=True)
    end = time.monotonic() + float(sys.argv[2])
    while not seen and time.monotonic() < end:
        time.sleep(0.02)
""")

CANARY_PROBE = textwrap.dedent("""
    import json, sys
    seen = {}
    for path in sys.argv[1:]:
        try:
            with open(path, "rb") as fh:
                seen[path] = "READ " + fh.read(200).decode(errors="replace")
        except OSError as exc:
            seen[path] = "ERROR " + type(exc).__name__
    print(json.dumps(seen))
""")

# The marker comes reversed, so that this probe's own command line does not hold it.
PROCESS_PROBE = textwrap.dedent("""
    import json, os, sys
    marker = sys.argv[1][::-1].encode()
    me, listed, hits = str(os.getpid()), [], []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as fh:
                    argv = fh.read().split(b"\\0")
            except OSError:
                continue
            listed.append(entry)
            if marker in argv:
                hits.append(entry)
    print(json.dumps({"self_listed": me in listed, "listed": len(listed), "hits": hits}))
""")

# unshare(CLONE_NEWUSER) in a forked child (a threaded process gets EINVAL whatever the sandbox allows).
USERNS_PROBE = textwrap.dedent("""
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    pid = os.fork()
    if pid == 0:
        rc = libc.unshare(0x10000000)
        os._exit(0 if rc == 0 else min(100 + ctypes.get_errno(), 250))
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status == 0:
        print("USERNS created")
    elif status < 0:
        print("USERNS refused: killed by signal", -status)
    else:
        print("USERNS refused:", errno.errorcode.get(status - 100, status - 100))
""")

# A library whose constructor records which process loaded it: on stderr, and in a log file at a host path
# compiled in. The mount namespace and boot id tell a host-side process (this host's kernel and mount
# namespace, i.e. the test's own) from the sandboxed code, wherever each record ended up.
PRELOAD_SOURCE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

static void slurp(const char *path, char *buf, int size, int link) {
    int n = -1;
    if (link) {
        n = (int)readlink(path, buf, size - 1);
    } else {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) { n = (int)read(fd, buf, size - 1); close(fd); }
    }
    if (n > 0 && buf[n - 1] == '\n') n--;
    if (n > 0) buf[n] = '\0';
}

__attribute__((constructor)) static void execbox_probe(void) {
    char mnt[64] = "?", boot[64] = "?", comm[32] = "?", line[320];
    slurp("/proc/self/ns/mnt", mnt, sizeof mnt, 1);
    slurp("/proc/sys/kernel/random/boot_id", boot, sizeof boot, 0);
    slurp("/proc/self/comm", comm, sizeof comm, 0);
    int len = snprintf(line, sizeof line, "EXECBOX-PROBE %s mnt=%s boot=%s pid=%d uid=%d comm=%s\n",
                       EXECBOX_TOKEN, mnt, boot, (int)getpid(), (int)getuid(), comm);
    if (len <= 0 || len >= (int)sizeof line) return;
    int fd = open(EXECBOX_HOST_LOG, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0) { if (write(fd, line, len) < 0) {} close(fd); }
    if (write(2, line, len) < 0) {}
}
"""


# --- exit codes and streams ---------------------------------------------------------------------------


@check("exit codes are data")
def check_exit_codes_are_data(kit: Kit) -> None:
    claim = "exit codes are data"
    ok = kit.run(["true"])
    expect(ok.exit_code == 0, claim, "exit 0 from `true`", shown(ok))
    three = kit.run("exit 3")
    expect((three.exit_code, three.timed_out) == (3, False), claim, "exit 3, not timed out, from `exit 3`",
           shown(three))
    killed = kit.run("kill -9 $$")
    expect(killed.exit_code == 137, claim, "exit 137 (128 + SIGKILL) from `kill -9 $$`", shown(killed))


@check("stdout and stderr are kept apart")
def check_stdout_and_stderr_kept_apart(kit: Kit) -> None:
    result = kit.run("echo to-out; echo to-err >&2")
    expect((result.stdout, result.stderr) == ("to-out\n", "to-err\n"), "stdout and stderr are kept apart",
           "stdout 'to-out\\n' and stderr 'to-err\\n'", shown(result))


@check("stdin is delivered")
def check_stdin_is_delivered(kit: Kit) -> None:
    small = kit.run(["cat"], stdin=b"hello stdin\n")
    expect(small.stdout == "hello stdin\n", "stdin is delivered", "cat to echo 'hello stdin\\n'", shown(small))
    big = kit.run(["wc", "-c"], stdin=b"x" * 1_000_000)
    expect(big.stdout.strip() == "1000000", "stdin is delivered", "wc -c to count 1000000 bytes", shown(big))


@check("output is decoded as UTF-8, invalid bytes replaced")
def check_utf8_and_invalid_bytes(kit: Kit) -> None:
    result = kit.code("import sys\nprint('héllo ✓ 世界')\nsys.stdout.flush()\n"
                      "sys.stdout.buffer.write(b'bad \\xff\\xfe end')")
    want = "héllo ✓ 世界\nbad \ufffd\ufffd end"
    expect(result.stdout == want, "output is decoded as UTF-8", repr(want), shown(result))


@check("python and bash code run")
def check_python_and_bash_code(kit: Kit) -> None:
    py = kit.code("print(6 * 7)")
    expect(py.stdout == "42\n", "python code runs", "'42\\n'", shown(py))
    sh = kit.code("echo $((6 * 7))", language="bash")
    expect(sh.stdout == "42\n", "bash code runs", "'42\\n'", shown(sh))


@check("code is not on the command line")
def check_code_is_not_on_the_command_line(kit: Kit) -> None:
    claim = "code is not on the command line"
    marker = uuid.uuid4().hex
    result = kit.code(f"# {marker}\nimport os\nprint(open('/proc/self/cmdline','rb').read())")
    # The positive signal: the probe did print its command line (the interpreter is on it).
    expect(result.exit_code == 0 and "python" in result.stdout, claim, "the probe to print its command line",
           shown(result))
    expect(marker not in result.stdout, claim, "the code's text absent from /proc/self/cmdline", result.stdout)


# --- output cap -----------------------------------------------------------------------------------------


@check("output over the cap keeps its head and tail")
def check_output_cap_keeps_head_and_tail(kit: Kit) -> None:
    claim = "output over the cap keeps its head and tail"
    cap = 10_000
    result = kit.code("import sys\nsys.stdout.write('HEAD' + 'x' * 2_000_000 + 'TAIL')\n"
                      "sys.stderr.write('ERRHEAD' + 'y' * 500_000 + 'ERRTAIL')", max_output_bytes=cap)
    expect(result.exit_code == 0 and result.truncated, claim, "exit 0 and truncated=True", shown(result))
    for name, text, head, tail in (("stdout", result.stdout, "HEAD", "TAIL"),
                                   ("stderr", result.stderr, "ERRHEAD", "ERRTAIL")):
        expect(text.startswith(head) and text.endswith(tail) and "bytes omitted" in text, claim,
               f"{name} to start with {head}, end with {tail} and say 'bytes omitted'",
               text[:80] + " ... " + text[-80:])
        expect(len(text.encode()) <= cap + 200, claim, f"{name} within {cap} bytes (+200 for the notice)",
               f"{len(text.encode())} bytes")


@check("output under the cap is not truncated")
def check_small_output_is_not_truncated(kit: Kit) -> None:
    result = kit.run(["printf", "%s", "abc"], max_output_bytes=3)
    expect((result.stdout, result.truncated) == ("abc", False), "output under the cap is not truncated",
           "stdout 'abc', truncated=False", shown(result))


# --- streaming ----------------------------------------------------------------------------------------------

# Says "ready", then waits (at most 15 s) for the caller to answer with a file "go" in the workspace: only a
# caller that saw "ready" while the command ran can make it print "got-go". No clock is compared.
HANDSHAKE = ('echo ready; i=0; while [ ! -e go ] && [ "$i" -lt 150 ]; do sleep 0.1; i=$((i+1)); done; '
             '[ -e go ] && echo got-go || echo no-go')


def _events(stream: Any) -> tuple[list[OutputEvent], ExecResult]:
    """Drain an async stream (``runner.aio.stream(...)``) from sync code: its events and its result."""

    async def drain() -> tuple[list[OutputEvent], ExecResult]:
        events: list[OutputEvent] = []
        async for event in stream:
            if isinstance(event, OutputEvent):
                events.append(event)
            else:
                return events, event
        raise AssertionError("a stream ends with its result")

    return run_blocking(drain)


@check("a claimed stream delivers output while the command runs")
def check_streaming_delivers_output_while_running(kit: Kit) -> str:
    claim = "a claimed stream delivers output while the command runs"
    if not kit.caps.streaming:
        raise NotClaimed("the backend does not claim streaming (its output reaches the caller when a run ends)")
    if kit.caps.persistent_sessions and kit.caps.file_transfer:
        async def handshake() -> tuple[list[str], ExecResult | None]:
            seen: list[str] = []
            async with kit.runner.aio.sandbox(kit.backend, network=kit.net) as sb:
                async for event in sb.stream(["/bin/sh", "-c", HANDSHAKE], timeout=60):
                    if not isinstance(event, OutputEvent):
                        return seen, event
                    seen.append(event.text)
                    if "ready" in "".join(seen) and "ready" in event.text:
                        await sb.write_file("go", b"")  # the answer, while the command still waits for it
            return seen, None

        seen, result = run_blocking(handshake)
        expect(result is not None and result.stdout == "ready\ngot-go\n", claim,
               "the command to see the caller's answer to its first line ('ready\\ngot-go\\n')",
               f"{shown(result) if result else 'no result'}; events {seen!r}")
        return "the caller answered the first line while the command ran"
    # No session to answer in: the first line must come in an event of its own, before the second (2 s later).
    events, result = _events(kit.runner.aio.stream("echo early; sleep 2; echo late", backend=kit.backend,
                                                   network=kit.net))
    texts = [e.text for e in events if e.kind == "output"]
    first = next((i for i, t in enumerate(texts) if "early" in t), None)
    second = next((i for i, t in enumerate(texts) if "late" in t), None)
    expect(result.stdout == "early\nlate\n" and first is not None and second is not None and first < second, claim,
           "'early' in an event before the one with 'late' (written 2 s after it)",
           f"{shown(result)}; events {texts!r}")
    return "the first line arrived in an event before the second"


@check("streamed output is exactly the result's, cut at the cap like it")
def check_streamed_output_is_the_result(kit: Kit) -> None:
    claim = "streamed output is exactly the result's, cut at the cap like it"
    cap = 10_000
    code = ("import sys\nsys.stdout.write('HEAD' + 'x' * 300000 + 'TAIL')\nsys.stdout.flush()\n"
            "sys.stderr.write('caf\\u00e9 ' * 3)")
    plain = kit.code(code, max_output_bytes=cap)
    events, streamed = _events(kit.runner.aio.stream_code(code, backend=kit.backend, network=kit.net,
                                                          max_output_bytes=cap))
    same = ("exit_code", "stdout", "stderr", "truncated", "timed_out")
    expect(all(getattr(plain, f) == getattr(streamed, f) for f in same), claim,
           f"the streamed run's {', '.join(same)} equal to the plain run's", f"{shown(plain)} vs {shown(streamed)}")
    expect(plain.truncated and plain.stderr == "café café café ", claim, "stdout truncated, stderr whole",
           shown(plain))
    for name, text in (("stdout", streamed.stdout), ("stderr", streamed.stderr)):
        joined = "".join(e.text for e in events if e.stream == name and e.kind == "output")
        expect(joined == text, claim, f"the {name} events, joined, to be the result's {name}",
               f"{len(joined)} characters, {joined[:60]!r}...{joined[-60:]!r}")
    drops = [i for i, e in enumerate(events) if e.kind == "dropped"]
    expect([events[i].stream for i in drops] == ["stdout"], claim, "one 'dropped' event, for stdout",
           [e.model_dump() for e in events if e.kind == "dropped"])
    before = "".join(e.text for e in events[:drops[0]] if e.stream == "stdout")
    expect(len(before.encode()) <= cap - cap // 2, claim,
           f"at most the head ({cap - cap // 2} bytes) of stdout delivered before it says it drops",
           f"{len(before.encode())} bytes")


# --- time -------------------------------------------------------------------------------------------------


@check("a timeout ends the run, reported as exit 124 + timed_out")
def check_timeout_ends_the_run(kit: Kit) -> None:
    started = time.monotonic()
    result = kit.run(["sleep", "1000"], timeout=1)
    took = time.monotonic() - started
    # One result builder: every backend reports a timeout with the same exit code.
    expect((result.exit_code, result.timed_out, result.oom_killed) == (TIMEOUT_EXIT_CODE, True, False),
           "a timeout is reported the same on every backend", f"exit {TIMEOUT_EXIT_CODE}, timed_out, not oom_killed",
           shown(result))
    expect(took < 1 + DEADLINE_SLACK_S, "a timeout ends the run", f"back within {1 + DEADLINE_SLACK_S:.0f} s",
           f"{took:.1f} s")


@check("a timeout kills a setsid grandchild in a session")
def check_timeout_kills_setsid_grandchild(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a timeout kills a setsid grandchild in a session"
    with kit.sandbox() as sb:
        result = sb.run_code(ESCAPING_GRANDCHILD, timeout=5)
        expect(result.timed_out and "GRANDCHILD RUNNING" in result.stdout, claim,
               "the grandchild started (GRANDCHILD RUNNING) and the run timed out", shown(result))
        time.sleep(1.0)
        first = len(sb.read_file("tick"))
        time.sleep(1.5)
        later = len(sb.read_file("tick"))
        expect(first > 0 and later == first, claim, "the grandchild's file to stop growing after the deadline",
               f"{first} bytes, then {later} bytes 1.5 s later")


@check("a timeout kills a setsid grandchild of a one-shot run")
def check_timeout_kills_setsid_grandchild_of_a_one_shot_run(kit: Kit) -> None:
    if kit.caps.remote:
        raise NotClaimed("the sandbox's processes run on another host: not observable from here")
    claim = "a timeout kills a setsid grandchild of a one-shot run"
    marker = f"execbox-escape-{uuid.uuid4().hex}"
    result = kit.run(["python3", "-c", ESCAPING_MARKED_GRANDCHILD, marker], timeout=3)
    expect(result.timed_out and "GRANDCHILD RUNNING" in result.stdout, claim,
           "the grandchild started (GRANDCHILD RUNNING) and the run timed out", shown(result))
    left = alive_with(marker)
    expect(left == [], claim, "no process with the marker after the deadline", f"host pids {left}")


# Output without end, past the deadline: the kill must land while the pipe is full, and the capture stay bounded.
ENDLESS = {"python": ["python3", "-c", "while True: print('x' * 1000)"], "yes": ["yes"]}
ENDLESS_CAP = 10_000


def _endless_ended(run: Callable[[list[str]], ExecResult], claim: str, *, pooled: bool | None = None) -> None:
    for name, argv in ENDLESS.items():
        started = time.monotonic()
        result = run(argv)
        took = time.monotonic() - started
        expect(result.timed_out and result.exit_code == TIMEOUT_EXIT_CODE, claim,
               f"endless output ({name}) to time out (exit {TIMEOUT_EXIT_CODE}, timed_out)", shown(result))
        size = max(len(result.stdout.encode()), len(result.stderr.encode()))
        expect(result.truncated and size <= ENDLESS_CAP + 200, claim,
               f"the output of {name} truncated to its cap ({ENDLESS_CAP} bytes, +200 for the notice)",
               f"truncated={result.truncated}, {size} bytes")
        expect(took < 2 + DEADLINE_SLACK_S, claim, f"back within {2 + DEADLINE_SLACK_S:.0f} s", f"{took:.1f} s")
        if pooled is not None:
            expect(result.pooled == pooled, claim, "the run to have used a warm pool member", f"pooled={result.pooled}")


@check("endless output past the deadline ends a one-shot run, its output bounded")
def check_endless_output_ends_a_one_shot_run(kit: Kit) -> None:
    _endless_ended(lambda argv: kit.run(argv, timeout=2, max_output_bytes=ENDLESS_CAP),
                   "endless output past the deadline ends a one-shot run, its output bounded")


@check("endless output past the deadline ends an exec in a session, its output bounded")
def check_endless_output_ends_a_session_exec(kit: Kit) -> None:
    kit.require(sessions=True)
    with kit.sandbox() as sb:
        _endless_ended(lambda argv: sb.exec(argv, timeout=2, max_output_bytes=ENDLESS_CAP),
                       "endless output past the deadline ends an exec in a session, its output bounded")
        after = sb.exec(["echo", "alive"], timeout=10)
        expect(after.stdout.strip() == "alive", "the session still serves after an endless run was killed",
               "stdout 'alive'", shown(after))


@check("endless output past the deadline ends a run in a warm pool member, its output bounded")
def check_endless_output_ends_a_pool_member_run(kit: Kit) -> None:
    kit.require(sessions=True)
    claim = "endless output past the deadline ends a run in a warm pool member, its output bounded"
    settings = kit.runner.settings.model_copy(update={"pool_size": 1})
    with Runner(settings, options=kit.runner.aio.options) as runner:

        def run(argv: list[str]) -> ExecResult:
            deadline = time.monotonic() + 120  # a liveness bound for the member's start
            while runner.warm(kit.backend, network=kit.net) < 1:
                expect(time.monotonic() < deadline, claim, "a warm member ready within 120 s",
                       f"errors {runner.aio.pool.errors}")
                time.sleep(0.05)
            return runner.run(argv, backend=kit.backend, network=kit.net, timeout=2, max_output_bytes=ENDLESS_CAP)

        _endless_ended(run, claim, pooled=True)


@check("nothing is left running after a run")
def check_nothing_left_running_after_a_run(kit: Kit) -> None:
    if kit.caps.remote:
        raise NotClaimed("the sandbox's processes run on another host: not observable from here")
    claim = "nothing is left running after a run"
    marker = f"execbox-leak-{uuid.uuid4().hex}"
    # "started" only once the detached shell is up and still running, so a shell that died at once is seen.
    code = textwrap.dedent(f"""
        import os, subprocess, time
        p = subprocess.Popen(['sh', '-c', 'touch up; sleep 1000; : {marker}'], start_new_session=True)
        while not os.path.exists('up'):
            time.sleep(0.05)
        print('started' if p.poll() is None else 'died')
    """)
    result = kit.code(code)
    expect(result.stdout == "started\n", claim, "the detached process to be running ('started')", shown(result))
    left = alive_with(marker)
    expect(left == [], claim, "no process with the marker after the run", f"host pids {left}")


# --- env policy -------------------------------------------------------------------------------------------


@check("the env policy: the request's variables pass, secrets and the host's environment do not")
def check_env_policy(kit: Kit) -> None:
    claim = "the env policy"
    env = {"VISIBLE": "yes", "OPENAI_API_KEY": "sk-secret", "GITHUB_PAT": "pat", "PYTHONHASHSEED": "0"}
    with host_env("EXECBOX_CONFORMANCE_HOST_ONLY", "host-value-must-not-leak"):
        result = kit.code("import os, json\nprint(json.dumps(dict(os.environ)))", env=env)
    seen = reported(result, claim, "probe of the environment")
    expect(seen.get("VISIBLE") == "yes" and seen.get("PYTHONHASHSEED") == "0", claim,
           "VISIBLE=yes and PYTHONHASHSEED=0 from the request", seen)
    leaked = sorted({"OPENAI_API_KEY", "GITHUB_PAT", "EXECBOX_CONFORMANCE_HOST_ONLY"} & set(seen))
    expect(not leaked, claim, "no secret-looking or host-only variable inside", leaked)
    expect("host-value-must-not-leak" not in result.stdout and "sk-secret" not in result.stdout, claim,
           "no secret value in the output", result.stdout)
    expect(result.filtered_env == ["GITHUB_PAT", "OPENAI_API_KEY"], claim,
           "filtered_env ['GITHUB_PAT', 'OPENAI_API_KEY']", result.filtered_env)


# --- files ------------------------------------------------------------------------------------------------


@check("request files are placed and workdir is honoured")
def check_request_files_and_workdir(kit: Kit) -> None:
    result = kit.run("cat in.txt; pwd", files={"sub/in.txt": b"data\n"}, workdir="sub")
    expect(result.stdout.startswith("data\n") and result.stdout.rstrip().endswith("/sub"),
           "request files are placed and workdir is honoured", "'data' then a directory ending in /sub", shown(result))


@check("files round-trip through a session")
def check_file_round_trip(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "files round-trip through a session"
    payload = bytes(range(256)) * 64
    with kit.sandbox() as sb:
        sb.write_file("in/data.bin", payload)
        reverse = "d = open('in/data.bin', 'rb').read(); open('out.bin', 'wb').write(d[::-1]); print(len(d))"
        result = sb.exec(["python3", "-c", reverse])
        expect(result.stdout == f"{len(payload)}\n", claim, f"the code to read {len(payload)} bytes", shown(result))
        back = sb.read_file("out.bin")
        expect(back == payload[::-1], claim, "the reversed payload read back", f"{len(back)} other bytes")


@check("session state persists between execs")
def check_session_state_persists(kit: Kit) -> None:
    kit.require(sessions=True)
    with kit.sandbox() as sb:
        wrote = sb.exec("echo kept > state.txt")
        expect(wrote.exit_code == 0, "session state persists", "the write to succeed", shown(wrote))
        read = sb.exec(["cat", "state.txt"])
        expect(read.stdout == "kept\n", "session state persists", "'kept' from the earlier exec", shown(read))


@check("paths outside the workspace are refused")
def check_paths_outside_the_workspace_refused(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    with kit.sandbox() as sb:
        for bad in ("../escape.txt", "/etc/passwd", "a/../../b"):
            claim = "paths outside the workspace are refused"
            expect_raises(WorkspacePathError, functools.partial(sb.read_file, bad), claim, f"read_file({bad!r})")
            expect_raises(WorkspacePathError, functools.partial(sb.write_file, bad, b"x"), claim,
                          f"write_file({bad!r})")


@check("a symlink the code planted is refused on read-back")
def check_planted_symlink_refused_on_read_back(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a symlink the code planted is refused on read-back"
    with kit.sandbox() as sb:
        planted = sb.exec("ln -s /etc/passwd out.txt && ln -s /etc linked")
        expect(planted.exit_code == 0, claim, "the code to plant the links", shown(planted))
        expect_raises(WorkspacePathError, lambda: sb.read_file("out.txt"), claim, "read_file of a link to /etc/passwd")
        expect_raises(WorkspacePathError, lambda: sb.read_file("linked/passwd"), claim,
                      "read_file through a link to /etc")


# --- whole files and directories ----------------------------------------------------------------------------


def _local_tree(root: Path) -> dict[str, Any]:
    """Every entry below ``root``, never followed: file -> (bytes, executable), directory -> "dir", link -> "link"."""
    found: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = "link"
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = (path.read_bytes(), os.access(path, os.X_OK))
    return found


def _sample_tree(root: Path) -> None:
    (root / "deep/er/est").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_text("alpha\n")
    (root / "space name.txt").write_bytes(b"\x00\xff binary \n")
    (root / "deep/er/est/x.bin").write_bytes(os.urandom(300 << 10))
    (root / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (root / "run.sh").chmod(0o755)
    for path in [root, *root.rglob("*")]:  # readable by a sandbox user other than this process's
        if path.is_dir():
            path.chmod(0o755)


@check("a directory round-trips through upload, list_files and download, byte for byte")
def check_directory_round_trip(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a directory round-trips through upload, list_files and download, byte for byte"
    with tempfile.TemporaryDirectory() as tmp:
        src, back = Path(tmp, "src"), Path(tmp, "back")
        src.mkdir()
        _sample_tree(src)
        with kit.sandbox() as sb:
            sb.upload(src, "data")
            ran = sb.exec(["sh", "-c", "cat data/a.txt && wc -c < data/deep/er/est/x.bin && ./data/run.sh"])
            expect(ran.stdout.split() == ["alpha", str(300 << 10), "ran"], claim,
                   "the code to read the uploaded files and run the executable one", shown(ran))
            listing = {e.path: (e.type, e.size) for e in sb.list_files("data", recursive=True)}
            expect(listing.get("data/deep/er/est/x.bin") == ("file", 300 << 10) and listing.get("data/empty") ==
                   ("directory", 0) and listing.get("data/a.txt") == ("file", 6), claim,
                   "list_files to give every path with its type and size", listing)
            top = {e.name: e.type for e in sb.list_files(".")}
            expect(top.get("data") == "directory", claim, "data listed at the top of the workspace", top)
            sb.download("data", back)
        expect(_local_tree(back) == _local_tree(src), claim, "the downloaded tree to equal the uploaded one",
               sorted(set(_local_tree(back).items()) ^ set(_local_tree(src).items()), key=str)[:6])


@check("a symlink the code planted is not followed on download, and not created here")
def check_planted_symlink_not_followed_on_download(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a symlink the code planted is not followed on download, and not created here"
    with tempfile.TemporaryDirectory() as tmp, kit.sandbox() as sb:
        planted = sb.exec("mkdir -p out/sub && echo kept > out/sub/ok.txt && ln -s /etc/passwd out/passwd && "
                          "ln -s / out/root && ln -s ../../.. out/sub/up && ln -s /etc/passwd single")
        expect(planted.exit_code == 0, claim, "the code to plant the links", shown(planted))
        moved = sb.download("out", Path(tmp, "out"))
        tree = _local_tree(Path(tmp, "out"))
        expect(tree == {"sub": "dir", "sub/ok.txt": (b"kept\n", False)}, claim,
               "only the real file and directory, no link and nothing read through one", tree)
        expect(any("out/passwd" in s for s in moved.skipped), claim, "the skipped link reported", moved.skipped)
        sb.download("single", Path(tmp, "single"))
        expect(not os.path.lexists(Path(tmp, "single")), claim, "no file made for a downloaded link",
               os.listdir(tmp))


@check("read_file of a directory says to use list_files or download")
def check_read_file_of_a_directory(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "read_file of a directory says to use list_files or download"
    with kit.sandbox() as sb:
        made = sb.exec("mkdir -p d && echo x > d/f.txt")
        expect(made.exit_code == 0, claim, "the code to make a directory", shown(made))
        for path in (".", "d"):
            try:
                sb.read_file(path)
            except WorkspacePathError as exc:
                expect("list_files" in exc.message and "download" in exc.message, claim,
                       "the error to name list_files and download", exc.message)
            else:
                raise AssertionError(f"{claim}: read_file({path!r}) returned instead of raising WorkspacePathError")


@check("a download or listing over its bounds is refused before it is read (sparse file, many entries, deep)")
def check_transfer_bounds(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a transfer over its bounds is refused before it is read"
    tight = kit.runner.settings.model_copy(update={"max_transfer_bytes": 1 << 20, "max_transfer_files": 64})
    runner = Runner(tight)
    hostile = ("import os\n"
               "with open('big.bin', 'wb') as f:\n"
               "    try: f.truncate(5 << 30)\n"
               "    except OSError: f.truncate(900 << 20)  # a file-size rlimit (bubblewrap: 1 GiB)\n"
               "os.makedirs('many')\n"
               "for i in range(100): open(f'many/f{i}', 'w').close()\n"
               "p = 'deep'\n"
               "for i in range(300): p += '/d'\n"
               "os.makedirs(p)\n")
    with tempfile.TemporaryDirectory() as tmp, runner.sandbox(kit.backend, network=kit.net) as sb:
        made = sb.exec(["python3", "-c", hostile])
        expect(made.exit_code == 0, claim, "the code to build the hostile tree (python3)", shown(made))
        expect_raises(TransferTooLargeError, lambda: sb.download("big.bin", Path(tmp, "big")), claim,
                      "download of a sparse 5 GiB file")
        expect(not os.path.lexists(Path(tmp, "big")), claim, "nothing written for the refused file", os.listdir(tmp))
        expect_raises(TransferTooLargeError, lambda: sb.list_files("many"), claim, "list_files of 100 entries")
        expect_raises(TransferTooLargeError, lambda: sb.download("deep", Path(tmp, "deep")), claim,
                      "download of a 300-level tree")


@check("collect returns the files a one-shot run wrote, never a link")
def check_collect(kit: Kit) -> None:
    kit.require(files=True)
    claim = "collect returns the files a one-shot run wrote, never a link"
    result = kit.run("mkdir -p out/sub && printf png > out/a.png && printf txt > out/a.txt && printf deep > "
                     "out/sub/b.png && ln -s /etc/passwd out/c.png", collect=["out/**/*.png"])
    expect(result.files == {"out/a.png": b"png", "out/sub/b.png": b"deep"}, claim,
           "exactly the two PNG files", {k: v[:20] for k, v in result.files.items()})
    expect(any("out/c.png" in n for n in result.notes), claim, "a note on the link left out", result.notes)


@check("a claimed mount shows the host path read-only unless writable, and a refused path is refused")
def check_mounts(kit: Kit) -> None:
    kit.require(mounts=True)
    claim = "a claimed mount shows the host path read-only unless writable"
    with tempfile.TemporaryDirectory() as ro, tempfile.TemporaryDirectory() as rw:
        Path(ro, "in.txt").write_text("from the host\n")
        os.chmod(ro, 0o755)
        os.chmod(Path(ro, "in.txt"), 0o644)
        os.chmod(rw, 0o777)  # the sandbox user may be another uid than this process's
        result = kit.run("cat /workspace/ro/in.txt; touch /workspace/ro/new; echo ro=$?; echo w > /data/rw/out.txt; "
                         "echo rw=$?", mounts=[Mount(ro, "/workspace/ro"), Mount(rw, "/data/rw", writable=True)])
        expect(result.stdout.startswith("from the host\n") and "ro=1" in result.stdout and "rw=0" in result.stdout,
               claim, "the file read, the read-only write refused, the writable one done", shown(result))
        expect(sorted(os.listdir(ro)) == ["in.txt"], claim, "nothing new in the read-only source", os.listdir(ro))
        expect(Path(rw, "out.txt").read_text() == "w\n", claim, "the write in the writable source", os.listdir(rw))
    expect_raises(RefusedError, lambda: kit.run("true", mounts=[Mount("/", "/data")]), claim, "a mount of /")


# --- network ------------------------------------------------------------------------------------------------


def expect_no_route(kit: Kit, network: NetworkMode, claim: str) -> None:
    """A direct connection from the sandbox to a listener on the host's loopback never arrives, and the
    sandbox has no interface but lo (where it runs on this host)."""
    listener = Listener()
    try:
        # The control: the listener the probe aims at does accept a connection from the host.
        socket.create_connection(("127.0.0.1", listener.port), timeout=3).close()
        expect(listener.wait_for(1) == 1, claim, "the host's own control connection to be accepted",
               f"{listener.accepted} accepted")
        result = kit.run(["python3", "-c", PROBE_CONNECT, str(listener.port)], network=network)
        expect(result.exit_code == 0 and "BLOCKED" in result.stdout, claim, "the probe to report BLOCKED",
               shown(result))
        expect("CONNECTED" not in result.stdout and listener.wait_for(2, 0.5) == 1, claim,
               "no connection from the sandbox to a listener on the host's loopback",
               f"{listener.accepted - 1} connection(s) from the sandbox")
        if not kit.caps.remote:
            ifaces = result.stdout.split("IFACES", 1)[1].split()
            expect(ifaces in ([], ["lo"]), claim, "no interface but lo", ifaces)
    finally:
        listener.close()


@check("network mode none: no connection leaves the sandbox")
def check_network_none_enforced(kit: Kit) -> None:
    kit.require(network="none")
    expect_no_route(kit, "none", "network mode 'none'")


# --- network mode proxy --------------------------------------------------------------------------------------


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


# Fetches argv[1] through the proxy the variables name (plain HTTP), then the same URL's path through a CONNECT
# tunnel opened by hand; NO_PROXY is dropped, so a loopback destination goes to the proxy too.
PROBE_PROXY_FETCH = textwrap.dedent("""
    import json, os, socket, sys, urllib.parse, urllib.request
    for name in ("NO_PROXY", "no_proxy"):
        os.environ.pop(name, None)
    url, out = sys.argv[1], {"proxy": os.environ.get("HTTP_PROXY", "")}
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            out["http"] = "FETCHED " + response.read().decode()
    except Exception as exc:
        out["http"] = "REFUSED %s %s" % (type(exc).__name__, exc)
    try:
        proxy = urllib.parse.urlsplit(out["proxy"])
        target = urllib.parse.urlsplit(url)
        with socket.create_connection((proxy.hostname, proxy.port), timeout=10) as s:
            head = "CONNECT %s HTTP/1.1\\r\\n\\r\\nGET %s HTTP/1.0\\r\\n\\r\\n"
            s.sendall((head % (target.netloc, target.path)).encode())
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        out["connect"] = data.decode(errors="replace")
    except Exception as exc:
        out["connect"] = "REFUSED %s %s" % (type(exc).__name__, exc)
    print(json.dumps(out))
""")


def _proxy_runner(kit: Kit, allow: list[str]) -> Runner:
    """The kit's runner with network mode proxy and an allowlist of exactly ``allow``. The kit's destinations
    listen on this host's loopback, which the guard admits only in local mode: so the runner is local."""
    settings = kit.runner.settings.model_copy(update={"egress_allow": allow, "egress_defaults": False,
                                                      "network": "proxy", "local": True})
    return Runner(settings, options=kit.runner.aio.options)


def _local_proxy(kit: Kit) -> None:
    kit.require(network="proxy")
    if kit.caps.remote:
        raise NotClaimed("the code runs on another machine: its provider enforces the allowlist, and a destination "
                         "on this host is out of its reach either way")


@contextlib.contextmanager
def _proxied_fetch(kit: Kit, claim: str, host: str, path: str) -> Iterator[tuple[TokenServer, ExecResult, Any]]:
    """A token server on this host's loopback (its address allowlisted), and the fetch probe's run against
    ``host``:port/``path`` in network mode proxy: (server, result, what the probe reported)."""
    _local_proxy(kit)
    server = TokenServer()
    try:
        expect(server.fetch("control") == "TOKEN control", claim, "the host's own control fetch to work",
               server.connections)
        with _proxy_runner(kit, [f"127.0.0.1/32:{server.port}"]) as runner:
            result = runner.run(["python3", "-c", PROBE_PROXY_FETCH, f"http://{host}:{server.port}/{path}"],
                                backend=kit.backend, network="proxy")
        yield server, result, reported(result, claim, "fetch probe")
    finally:
        server.close()


@check("network mode proxy: an allowlisted destination is reached through the proxy variables, and recorded")
def check_proxy_allowed_destination_is_reached(kit: Kit) -> None:
    claim = "network mode 'proxy' (allowed destination)"
    token = uuid.uuid4().hex
    with _proxied_fetch(kit, claim, "127.0.0.1", token) as (server, result, seen):
        expect(seen["proxy"].startswith("http://"), claim, "HTTP_PROXY set in the sandbox", seen)
        expect(seen["http"] == f"FETCHED TOKEN {token}", claim, "a plain-HTTP fetch through the proxy", seen)
        expect(seen["connect"].startswith("HTTP/1.1 200") and seen["connect"].endswith(f"TOKEN {token}"), claim,
               "a CONNECT tunnel through the proxy", seen)
        allowed = [a for a in result.egress if a.allowed and a.port == server.port and a.bytes_received > 0]
        expect(len(allowed) == 2 and all(a.address == "127.0.0.1" for a in allowed), claim,
               "both connections in the result's egress record, allowed, with bytes", result.egress)
        expect(server.connections == 3, claim, "exactly the two proxied connections at the server",
               f"{server.connections - 1} connection(s)")


@check("network mode proxy: a name outside the allowlist is refused and recorded, and nothing is connected")
def check_proxy_denied_name_is_recorded(kit: Kit) -> None:
    claim = "network mode 'proxy' (denied name)"
    # The address is allowlisted, the name is not: a proxy that resolved "localhost" would reach the server.
    with _proxied_fetch(kit, claim, "localhost", "denied") as (server, result, seen):
        expect(seen["http"].startswith("REFUSED") and "TOKEN" not in seen["connect"], claim,
               "both fetches refused", seen)
        denied = [a for a in result.egress if a.host == "localhost"]
        expect(len(denied) == 2 and not any(a.allowed or a.bytes_received for a in denied)
               and all("not in the allowlist" in a.reason for a in denied), claim,
               "two refusals of localhost in the egress record, 'not in the allowlist'", result.egress)
        time.sleep(0.2)
        expect(server.connections == 1, claim, "no connection at the server", f"{server.connections - 1}")


@check("network mode proxy: a direct connection, ignoring the proxy, has no route")
def check_proxy_direct_socket_has_no_route(kit: Kit) -> None:
    kit.require(network="proxy")
    expect_no_route(kit, "proxy", "network mode 'proxy' (direct socket)")


# --- limits ---------------------------------------------------------------------------------------------------


@check("a claimed memory limit holds")
def check_memory_limit_holds(kit: Kit) -> None:
    kit.require(limit="memory")
    claim = "the memory limit (128 MiB)"
    result = kit.code("print('allocating', flush=True)\nb = bytearray(768 * 1024 * 1024)\nprint('survived')",
                      limits=Limits(memory_mb=128), timeout=20)
    expect("allocating" in result.stdout, claim, "the probe to start ('allocating')", shown(result))
    expect("survived" not in result.stdout and (result.exit_code != 0 or result.oom_killed), claim,
           "a 768 MiB allocation to fail or be killed", shown(result))


@check("a claimed cpu limit holds")
def check_cpu_limit_holds(kit: Kit) -> None:
    kit.require(limit="cpu")
    if kit.caps.remote:
        raise NotClaimed("a remote provider enforces CPU on its own hosts: not measurable from here")
    claim = "the cpu limit (0.5 CPU)"
    # Two busy processes for 2 s of wall time under a 0.5-CPU limit may use ~1 CPU-second; unthrottled on
    # two idle cores they would use ~4. (A busy machine can only make the unthrottled case look throttled.)
    code = textwrap.dedent("""
        import os, time
        end = time.monotonic() + 2.0
        for _ in range(2):
            if os.fork() == 0:
                while time.monotonic() < end:
                    pass
                os._exit(0)
        for _ in range(2):
            os.wait()
        t = os.times()
        print("CPU", round(t.children_user + t.children_system, 2))
    """)
    result = kit.code(code, limits=Limits(cpus=0.5), timeout=20)
    words = result.stdout.split()
    expect(result.exit_code == 0 and words[:1] == ["CPU"], claim, "the probe to report its CPU time", shown(result))
    used = float(words[1])
    # The positive signal: the busy children did run (and the measurement works).
    expect(used >= 0.2, claim, "the busy children to use some CPU (>= 0.2 CPU-seconds)", f"{used} CPU-seconds")
    expect(used < 1.6, claim, "under 1.6 CPU-seconds for 2 s at 0.5 CPU", f"{used} CPU-seconds")


@check("a claimed pids limit holds")
def check_pids_limit_holds(kit: Kit) -> None:
    kit.require(limit="pids")
    claim = "the pids limit (32)"
    code = textwrap.dedent("""
        import os, time
        n, stopped = 0, "never"
        for _ in range(500):
            try:
                if os.fork() == 0:
                    time.sleep(20)
                    os._exit(0)
                n += 1
            except OSError as exc:
                stopped = exc.__class__.__name__
                break
        print("FORKED", n, stopped)
    """)
    result = kit.code(code, limits=Limits(pids=32), timeout=15)
    words = result.stdout.split()
    expect(words[:1] == ["FORKED"] and len(words) == 3, claim, "the probe to report how many forks succeeded",
           shown(result))
    expect(int(words[1]) < 32 and words[2] != "never", claim, "fork to fail before 32 processes",
           f"{words[1]} forks, stopped by {words[2]}")


@check("a claimed disk limit holds")
def check_disk_limit_holds(kit: Kit) -> None:
    kit.require(limit="disk")
    claim = "the disk limit (16 MiB)"
    # Writes 64 MiB into the workspace and syncs each MiB (a write that only reached the page cache has not
    # hit the filesystem's limit yet); reports how far it got and why it stopped.
    code = textwrap.dedent("""
        import errno, os
        written, stopped = 0, "never"
        fd = os.open("fill.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for _ in range(64):
                written += os.write(fd, b"x" * (1 << 20))
                os.fsync(fd)
        except OSError as exc:
            stopped = errno.errorcode.get(exc.errno, str(exc.errno))
        os.close(fd)
        print("WROTE", os.stat("fill.bin").st_blocks * 512, stopped)
    """)
    result = kit.code(code, limits=Limits(disk_mb=16), timeout=30)
    words = result.stdout.split()
    expect(words[:1] == ["WROTE"] and len(words) == 3, claim, "the probe to report how much it wrote",
           shown(result))
    expect(words[2] in ("ENOSPC", "EDQUOT"), claim, "writing 64 MiB to fail with ENOSPC (or EDQUOT)",
           f"stopped by {words[2]} after {words[1]} bytes on disk")
    expect(int(words[1]) <= 17 << 20, claim, "at most 16 MiB (+1 MiB of slack) on disk",
           f"{words[1]} bytes on disk")


# --- sandbox=True ----------------------------------------------------------------------------------------------


def _status_fields(status: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in status.splitlines()) if v}


def _ints(value: str | None) -> list[int]:
    return [int(v) for v in (value or "").split()]


def _map_ids(ids: list[int], id_map: str) -> list[int | None]:
    """``ids`` translated through a /proc/<pid>/uid_map (or gid_map) into the parent user namespace."""
    rows = [tuple(int(x) for x in line.split()) for line in id_map.splitlines() if len(line.split()) == 3]
    return [next((outer + i - inner for inner, outer, count in rows if inner <= i < inner + count), None)
            for i in ids]


class _HostView(threading.Thread):
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
                caught = int(_status_fields(status).get("SigCgt", "0"), 16)
                if caught & (1 << (signal.SIGWINCH - 1)):
                    self.views[pid] = status
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGWINCH)
            time.sleep(0.02)


def _identity(kit: Kit, *, watch: bool) -> tuple[dict[str, Any], str | None]:
    """What the probe says about itself from inside, and (``watch``) its /proc status as this host sees it."""
    marker = f"execbox-identity-{uuid.uuid4().hex}"
    view = _HostView(marker)
    if watch:
        view.start()
    try:
        result = kit.run(["python3", "-c", IDENTITY_PROBE, marker, "5" if watch else "0"], timeout=60)
    finally:
        view.done.set()
        if watch:
            view.join()
    inside: dict[str, Any] = reported(result, SANDBOX, "identity probe")
    expect("Uid" in _status_fields(inside["status"]), SANDBOX, "/proc/self/status readable inside", inside["status"])
    # The host's view of the very process that reported: its pid in the innermost namespace matches.
    host = next((s for s in view.views.values() if _ints(_status_fields(s).get("NSpid"))[-1:] == [inside["pid"]]),
                None)
    return inside, host


@check(f"{SANDBOX}: the code does not run as host root")
def check_sandbox_not_host_root(kit: Kit) -> str:
    kit.require(sandbox=True, local=True)
    claim = f"{SANDBOX} (not host root)"
    inside, host = _identity(kit, watch=True)
    mine = _status_fields(inside["status"])
    if host is not None:
        fields, where = _status_fields(host), "as this host sees the sandboxed process"
        uids, gids, groups = _ints(fields["Uid"]), _ints(fields["Gid"]), _ints(fields.get("Groups"))
    elif inside["userns"] == os.readlink("/proc/self/ns/user"):
        where = "inside, in this host's own user namespace"
        uids, gids, groups = _ints(mine["Uid"]), _ints(mine["Gid"]), _ints(mine.get("Groups"))
    else:
        # Not a process this host can see (another kernel, e.g. gVisor): judge by its own id maps.
        where = "inside, mapped into the parent user namespace (the process is not visible from this host)"
        maps = [_map_ids(_ints(mine["Uid"]), inside["uid_map"]), _map_ids(_ints(mine["Gid"]), inside["gid_map"]),
                _map_ids(_ints(mine.get("Groups")), inside["gid_map"])]
        uids, gids, groups = ([i for i in m if i is not None] for m in maps)
    seen = f"Uid {uids}, Gid {gids}, Groups {groups} ({where})"
    expect(0 not in uids, claim, "the code to run as a non-root uid of this host", seen)
    expect(0 not in gids and 0 not in groups, claim, "the code to hold no root group of this host", seen)
    return seen


@check(f"{SANDBOX}: the code holds no capabilities")
def check_sandbox_no_capabilities(kit: Kit) -> str:
    kit.require(sandbox=True, local=True)
    claim = f"{SANDBOX} (no capabilities)"
    fields = _status_fields(_identity(kit, watch=False)[0]["status"])
    caps = {name: fields.get(name) for name in ("CapEff", "CapPrm", "CapBnd")}
    expect(None not in caps.values(), claim, "CapEff, CapPrm and CapBnd in /proc/self/status", caps)
    expect(all(int(v or "1", 16) == 0 for v in caps.values()), claim, "CapEff, CapPrm and CapBnd all zero", caps)
    return str(caps)


@check(f"{SANDBOX}: no-new-privileges is set")
def check_sandbox_no_new_privileges(kit: Kit) -> str:
    kit.require(sandbox=True, local=True)
    claim = f"{SANDBOX} (no-new-privileges)"
    nnp = _status_fields(_identity(kit, watch=False)[0]["status"]).get("NoNewPrivs")
    expect(nnp == "1", claim, "NoNewPrivs: 1 in /proc/self/status", f"NoNewPrivs: {nnp}")
    return "NoNewPrivs: 1"


@check(f"{SANDBOX}: new user namespaces cannot be created")
def check_sandbox_no_new_user_namespaces(kit: Kit) -> str:
    kit.require(sandbox=True, local=True)
    claim = f"{SANDBOX} (no new user namespaces)"
    result = kit.run(["python3", "-c", USERNS_PROBE])
    expect("USERNS" in result.stdout, claim, "the probe to report on unshare(CLONE_NEWUSER)", shown(result))
    expect("USERNS created" not in result.stdout, claim, "unshare(CLONE_NEWUSER) to be refused", result.stdout.strip())
    return result.stdout.strip()


@contextlib.contextmanager
def _canaries() -> Iterator[dict[str, str]]:
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


@check(f"{SANDBOX}: files on the host are not readable")
def check_sandbox_host_files_hidden(kit: Kit) -> str:
    kit.require(sandbox=True)
    claim = f"{SANDBOX} (host files hidden)"
    control = f"control-{uuid.uuid4().hex}"
    with _canaries() as canaries:
        result = kit.run(["python3", "-c", CANARY_PROBE, "canary-control.txt", *canaries],
                         files={"canary-control.txt": control.encode()})
    seen: dict[str, str] = reported(result, claim, "canary probe")
    # The positive signal: the probe reads a file it was given, so an unreadable canary means hidden.
    expect(seen.get("canary-control.txt") == f"READ {control}", claim, "the probe to read its own workspace file",
           seen)
    read = {path: seen.get(path) for path, content in canaries.items() if content in (seen.get(path) or "")}
    expect(not read, claim, "host canary files unreadable from inside", f"read from inside: {read}")
    return f"canaries not readable: {seen}"


@check(f"{SANDBOX}: host processes are not visible")
def check_sandbox_host_processes_hidden(kit: Kit) -> str:
    kit.require(sandbox=True)
    claim = f"{SANDBOX} (host processes hidden)"
    if not os.path.isdir("/proc"):
        raise Unavailable("this host has no /proc: cannot start and find a marker process")
    marker = f"execbox-hostproc-{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while host.pid not in [pid for pid, argv in host_processes() if marker in argv]:
            expect(time.monotonic() < deadline, claim, "the host's marker process to be listed on the host", "nothing")
            time.sleep(0.02)
        result = kit.run(["python3", "-c", PROCESS_PROBE, marker[::-1]])
    finally:
        host.kill()
        host.wait()
    seen: dict[str, Any] = reported(result, claim, "process probe")
    # The positive signal: the probe does list processes (it finds itself), so a missing marker means hidden.
    expect(seen["self_listed"], claim, "the probe to find its own process in /proc", seen)
    expect(not seen["hits"], claim, f"the host's marker process (host pid {host.pid}) not visible inside",
           f"it at pid(s) {seen['hits']} among {seen['listed']} processes")
    return f"{seen['listed']} processes visible inside, none of the host's marker"


def _probe_records(text: str, token: str) -> list[dict[str, str]]:
    records = []
    for line in text.splitlines():
        words = line.split()
        if words[:2] == ["EXECBOX-PROBE", token]:
            records.append(dict(w.partition("=")[::2] for w in words[2:]))
    return records


@check(f"{SANDBOX}: nothing from the request's environment reaches a host-side process")
def check_sandbox_request_env_stays_inside(kit: Kit) -> str:
    kit.require(sandbox=True)
    claim = f"{SANDBOX} (the request's environment stays inside)"
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise Unavailable("no C compiler (gcc/cc) on this host to build the LD_PRELOAD probe")
    token = uuid.uuid4().hex
    here = {"mnt": os.readlink("/proc/self/ns/mnt"),
            "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip()}
    with tempfile.TemporaryDirectory(prefix="execbox-preload-") as tmp:
        folder = Path(tmp)
        folder.chmod(0o755)  # a host-side process of another uid can load the library and write the log
        log, source, lib = folder / "host.log", folder / "probe.c", folder / "probe.so"
        log.touch()
        log.chmod(0o666)
        source.write_text(PRELOAD_SOURCE)
        built = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(lib), str(source),
                                f'-DEXECBOX_TOKEN="{token}"', f'-DEXECBOX_HOST_LOG="{log}"'],
                               capture_output=True, text=True, check=False)
        if built.returncode != 0:
            raise Unavailable(f"cannot build the LD_PRELOAD probe with {compiler}: {built.stderr.strip()[-500:]}")
        lib.chmod(0o755)
        # The host's copy by its host path, and the copy the code wrote into its workspace, relative.
        preload = f"{lib} ./execbox-probe.so"
        # The control: a host process that gets this environment does leave a record.
        subprocess.run(["/bin/sh", "-c", ":"], env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": preload}, cwd=tmp,
                       capture_output=True, check=False)
        if not any(r.get("mnt") == here["mnt"] for r in _probe_records(log.read_text(), token)):
            raise Unavailable(f"the LD_PRELOAD probe does not load on this host (nothing in {log})")
        log.write_text("")
        result = kit.run(["/bin/sh", "-c", "echo ran"], env={"LD_PRELOAD": preload},
                         files={"execbox-probe.so": lib.read_bytes()})
        records = _probe_records(log.read_text() + "\n" + result.stderr, token)
    expect(result.stdout.strip().endswith("ran"), claim, "the run to happen ('ran')", shown(result))
    # One line per process (a record can be both in the log and on stderr, and each copy of the library writes).
    host_side = sorted({f"{r.get('comm')} (pid {r.get('pid')}, uid {r.get('uid')})" for r in records
                        if (r.get("mnt"), r.get("boot")) == (here["mnt"], here["boot"])})
    expect(not host_side, claim, "no process in this host's mount namespace to load the library named by the "
           "request's LD_PRELOAD", "; ".join(host_side))
    inside = len({r.get("pid") for r in records if r.get("mnt") != here["mnt"]})
    reached = "LD_PRELOAD" in result.stderr or inside > 0
    return (f"no host-side process loaded it; inside, {inside} process(es) did"
            + ("" if reached else " (the backend did not pass LD_PRELOAD to the code)"))


# --- outside pytest -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``status`` pass, fail or skip; ``message`` what was seen or why."""

    name: str
    claim: str
    status: Literal["pass", "fail", "skip"]
    message: str = ""
    duration_s: float = 0.0


def run_check(one: Check, kit: Kit, time_box_s: float | None = None) -> CheckResult:
    """Run one check, turning its outcome into a CheckResult (an unexpected error is a failure). With
    ``time_box_s``, a check still running after that long is a failure and is left behind (a daemon thread):
    whatever the backend does, the verdicts keep coming."""
    if time_box_s is None:
        return _run_check(one, kit)
    verdict: concurrent.futures.Future[CheckResult] = concurrent.futures.Future()

    def body() -> None:
        try:
            verdict.set_result(_run_check(one, kit))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            verdict.set_exception(exc)

    threading.Thread(target=body, daemon=True, name=f"execbox-check-{one.name}").start()
    try:
        return verdict.result(timeout=time_box_s)
    except concurrent.futures.TimeoutError:
        return CheckResult(one.name, one.claim, "fail", f"{one.claim}: expected the check to finish within its time "
                           f"box of {time_box_s:g} s; it did not, and was left behind", round(time_box_s, 2))


def _run_check(one: Check, kit: Kit) -> CheckResult:
    started = time.monotonic()
    status: Literal["pass", "fail", "skip"] = "pass"
    try:
        message = one.body(kit) or ""
    except NotClaimed as exc:
        status, message = "skip", f"not claimed: {exc}"
    except Unavailable as exc:
        status, message = "skip", f"cannot run here: {exc}"
    except AssertionError as exc:
        status, message = "fail", str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken sandbox is a failed check, reported, not a crash
        status, message = "fail", f"{type(exc).__name__}: {exc}"
    return CheckResult(one.name, one.claim, status, message, round(time.monotonic() - started, 2))


def self_check(backend_name: str, settings: Settings | None = None, *, checks: Iterable[str] | None = None,
               time_box_s: float | None = None,
               on_result: Callable[[CheckResult], object] | None = None) -> list[CheckResult]:
    """Run the conformance checks against ``backend_name`` outside pytest; one CheckResult per check, in order.

    ``settings``: the execbox Settings to build the runner from (default: from the environment).
    ``checks``: names from ``CHECKS`` to run (default: all). When the backend cannot run here, the result is
    a single ``skip`` named ``available`` that says why. ``time_box_s``: each check's time box (see run_check).
    ``on_result``: called with each verdict as soon as it is reached (`execbox doctor --self-check` prints it).
    """
    runner = Runner(settings or Settings.from_env())
    names = list(CHECKS) if checks is None else list(checks)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {sorted(CHECKS)}")
    results: list[CheckResult] = []

    def reached(result: CheckResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    try:
        kit = Kit.open(runner, backend_name)
    except Unavailable as exc:
        reached(CheckResult("available", f"backend {backend_name} can run here", "skip", str(exc)))
        return results
    except BackendTimeoutError as exc:
        reached(CheckResult("available", f"backend {backend_name} can run here", "fail", exc.message))
        return results
    for name in names:
        reached(run_check(CHECKS[name], kit, time_box_s))
    return results
