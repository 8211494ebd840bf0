"""`execbox serve` and the `execbox` program handing command lines to it (CODE_EXEC_SERVER).

The server is the real program, started as a process; every client is the real `execbox` program. What a
command line does through the server must be what it does without it: output, exit status, standard streams,
working directory, environment; and nothing may outlive a client, a child or the server that is killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import AliasChoices

from execbox import resident, resident_server
from execbox.config.settings import Settings
from tests.backends.test_docker import engine  # noqa: F401 - fixture
from tests.support.containers import containers_of
from tests.support.waiting import wait_until

EXECBOX = str(Path(sys.executable).parent / "execbox")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != resident.SERVER_VAR}
    env["CODE_EXEC_AUDIT_LOG"] = "off"
    env.update(extra)
    return env


class Server:
    def __init__(self, path: str, env: dict[str, str]) -> None:
        self.path = path
        self.proc = subprocess.Popen([EXECBOX, "serve", "--socket", path], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert wait_until(lambda: self.listening() or self.proc.poll() is not None, 60), "not listening"
        assert self.proc.poll() is None, self.proc.communicate()
        self.env = {**env, resident.SERVER_VAR: path}

    def listening(self) -> bool:  # a socket file may be there before this server listens on it (a stale one)
        with socket.socket(socket.AF_UNIX) as sock:
            try:
                sock.connect(self.path)
            except OSError:
                return False
        return True

    def run(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        kw.setdefault("env", self.env)
        kw.setdefault("timeout", 120)
        return subprocess.run([EXECBOX, *args], capture_output=True, text=True, **kw)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.terminate()
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(str(tmp_path / "execbox.sock"), _env())
    yield srv
    srv.stop()


def test_the_setting_is_the_variable_the_client_reads() -> None:
    # The client reads CODE_EXEC_SERVER before pydantic is imported: the declared setting must be that name.
    alias = Settings.model_fields["server"].validation_alias
    assert isinstance(alias, AliasChoices) and alias.choices[0] == resident.SERVER_VAR


def test_socket_is_private_and_removed_at_the_end(server: Server) -> None:
    mode = os.lstat(server.path).st_mode
    assert mode & 0o077 == 0, oct(mode)
    code, err = server.stop()
    assert code == 0, err
    assert not os.path.exists(server.path)


def test_a_command_line_behaves_as_without_the_server(server: Server, tmp_path: Path) -> None:
    # Output on the client's own streams, its exit status, its working directory (a relative --file), its
    # environment (a setting), and a usage error's status and message: each the same with and without.
    (tmp_path / "data.txt").write_text("from the client's directory\n")
    cases = [
        ["run", "--backend", "local_subprocess", "--network", "host", "--file", "data.txt", "--",
         "sh", "-c", "cat data.txt; echo to-stderr >&2; exit 7"],
        ["run", "--code", "x", "--", "true"],  # usage error: 2
        ["backends", "--json"],
    ]
    for args in cases:
        env = _env(CODE_EXEC_LOCAL="true")
        here = subprocess.run([EXECBOX, *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
        there = server.run(*args, cwd=tmp_path, env={**env, resident.SERVER_VAR: server.path})
        assert (there.returncode, there.stdout, there.stderr) == (here.returncode, here.stdout, here.stderr), args
        if args is cases[0]:
            assert there.returncode == 7 and there.stdout == "from the client's directory\n", there
            assert there.stderr.endswith("to-stderr\n"), there.stderr
    bad = server.run("run", "--backend", "local_subprocess", "--", "true",
                     env={**server.env, "CODE_EXEC_MAX_TIMEOUT_SEC": "soon"})
    assert bad.returncode == 2 and "CODE_EXEC_MAX_TIMEOUT_SEC" in bad.stderr, bad


def test_stdin_reaches_the_command(server: Server, tmp_path: Path) -> None:
    done = subprocess.run([EXECBOX, "run", "--backend", "local_subprocess", "--network", "host", "--stdin", "--",
                           "sh", "-c", 'cat; printf "%s|%s" "$1" "$2"', "sh", "a b", "é"],
                          input=b"piped input\n", capture_output=True, timeout=120,
                          env={**server.env, "CODE_EXEC_LOCAL": "true"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "piped input\na b|é".encode(), done.stdout


def test_bytes_that_are_not_utf8_arrive_as_they_would_here(server: Server, tmp_path: Path) -> None:
    # Arguments and variables go through as the kernel keeps them (bytes), so the CLI judges them the same way.
    odd = os.fsdecode(b"caf\xe9-\xff")
    args = [EXECBOX, "run", "--backend", "local_subprocess", "--network", "host", "--", "echo", odd]
    env = {**_env(), "CODE_EXEC_LOCAL": "true", "ODD": odd}
    here = subprocess.run(args, capture_output=True, timeout=120, env=env, cwd=tmp_path)
    there = subprocess.run(args, capture_output=True, timeout=120, env={**env, **server.env, "ODD": odd},
                           cwd=tmp_path)
    assert (there.returncode, there.stdout, there.stderr) == (here.returncode, here.stdout, here.stderr)


def test_no_server_there_runs_here_and_says_so(tmp_path: Path) -> None:
    done = subprocess.run([EXECBOX, "backends", "--json"], capture_output=True, text=True, timeout=120,
                          env=_env(**{resident.SERVER_VAR: str(tmp_path / "nobody.sock")}))
    assert done.returncode == 0 and done.stdout.startswith("["), done
    assert "no server of yours at CODE_EXEC_SERVER=" in done.stderr and "running without it" in done.stderr


def test_what_is_at_the_path_decides(tmp_path: Path) -> None:
    # A file that is not a socket is never replaced; a live server is not displaced; a dead one's socket is.
    path = tmp_path / "taken"
    path.write_text("precious")
    done = subprocess.run([EXECBOX, "serve", "--socket", str(path)], capture_output=True, text=True, timeout=60,
                          env=_env())
    assert done.returncode == 2 and "is not a socket" in done.stderr, done
    assert path.read_text() == "precious"
    stale = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(stale))
    dead.close()  # a socket file nobody listens on
    first = Server(str(stale), _env())
    try:
        again = subprocess.run([EXECBOX, "serve", "--socket", str(stale)], capture_output=True, text=True,
                               timeout=60, env=_env())
        assert again.returncode == 2 and "already listens" in again.stderr, again
        assert first.run("backends", "--json").returncode == 0
    finally:
        first.stop()


def test_malformed_requests_are_answered_and_the_server_goes_on(server: Server) -> None:
    for payload, fds in [(b"\x00\x00\x00\x05abc", [0, 1, 2, 0]), (resident.header(3) + b"abc", [0, 1]),
                         (resident.header(3) + b"abc", [0, 1, 2, 0, 1]),
                         (resident.header(1 << 30), [0, 1, 2, 0])]:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(server.path)
            socket.send_fds(sock, [payload], fds)
            sock.shutdown(socket.SHUT_WR)
            assert sock.makefile("rb").readline().startswith(b"error "), payload
    # The program never hands `serve` over; a client that does is refused.
    body = resident.encode_request(0o22, ["serve", "--socket", server.path + "2"], {})
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(server.path)
        socket.send_fds(sock, [resident.header(len(body))], [0, 1, 2, os.open(".", os.O_RDONLY)])
        sock.sendall(body)
        assert sock.makefile("rb").readline() == b"error a server does not start another server\n"
    assert server.run("backends", "--json").returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_another_user_is_refused() -> None:
    # Both ends check: the program runs the command itself rather than hand it to another user's server, and
    # the server answers another uid's connection with a refusal (even with the socket opened up to all).
    raw = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
           "print(s.makefile('rb').readline().decode(), end='')")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    with tempfile.TemporaryDirectory(dir="/tmp") as where:
        os.chmod(where, 0o755)
        server = Server(os.path.join(where, "s.sock"), _env())
        try:
            os.chmod(server.path, 0o666)
            program = subprocess.run([*as_nobody, EXECBOX, "--version"], capture_output=True, text=True,
                                     timeout=60, env=server.env, cwd="/")
            connection = subprocess.run([*as_nobody, sys.executable, "-c", raw, server.path], capture_output=True,
                                        text=True, timeout=60, cwd="/")
        finally:
            server.stop()
    assert program.returncode == 0 and "version" in program.stdout, program
    assert "it is uid 0's, not yours" in program.stderr
    assert connection.stdout == "error this server serves uid 0 only, not uid 65534; start your own with " \
                                "`execbox serve`\n", connection


def _child_pids(server: Server) -> list[int]:
    kids = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
    return [int(k) for k in kids]


@pytest.mark.parametrize("how", ["client SIGKILL", "server SIGKILL", "client SIGINT"])
def test_nothing_outlives_a_killed_client_or_server(engine: Any, server: Server, how: str) -> None:  # noqa: F811
    client = subprocess.Popen([EXECBOX, "run", "--backend", "docker", "--timeout", "300", "--", "sleep", "300"],
                              env=server.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: bool(_child_pids(server)), 30)
    child = _child_pids(server)[0]
    assert wait_until(lambda: bool(containers_of(engine, child)), 60), "the run never started"
    if how == "client SIGKILL":
        client.kill()
    elif how == "server SIGKILL":
        server.proc.kill()
    else:
        client.send_signal(signal.SIGINT)
    _, err = client.communicate(timeout=60)
    if how == "server SIGKILL":
        assert client.returncode == 1 and "ended before the command did" in err, err
    if how == "client SIGINT":
        assert client.returncode != 0
    # The child hangs up like a closed terminal: its container is removed well before the run's 300 s.
    assert wait_until(lambda: not containers_of(engine, child), 60), containers_of(engine, child)
    assert wait_until(lambda: not Path(f"/proc/{child}").exists() or
                      Path(f"/proc/{child}/stat").read_text().split(") ")[1].startswith("Z"), 30)
    if how != "server SIGKILL":
        assert server.run("backends", "--json").returncode == 0  # and the server goes on


def test_stopping_the_server_hangs_up_its_children(engine: Any, server: Server) -> None:  # noqa: F811
    client = subprocess.Popen([EXECBOX, "run", "--backend", "docker", "--timeout", "300", "--", "sleep", "300"],
                              env=server.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: bool(_child_pids(server)), 30)
    child = _child_pids(server)[0]
    assert wait_until(lambda: bool(containers_of(engine, child)), 60)
    started = time.monotonic()
    code, err = server.stop()
    assert code == 0, err
    client.communicate(timeout=60)
    assert client.returncode != 0
    assert not containers_of(engine, child)
    assert time.monotonic() - started < 300  # hung up, not waited out
    assert not os.path.exists(server.path)


@given(st.integers(0, 0o777), st.lists(st.text()), st.dictionaries(st.text(min_size=1), st.text()))
def test_requests_round_trip(umask: int, argv: list[str], env: dict[str, str]) -> None:
    def clean(s: str) -> str:  # what a process can hold: no NUL; a name has no '='
        return s.replace("\0", "")

    argv = [clean(a) for a in argv]
    env = {clean(k).replace("=", "") or "X": clean(v) for k, v in env.items()}
    try:
        body = resident.encode_request(umask, argv, env)
    except UnicodeEncodeError:  # a lone surrogate the file system encoding cannot carry: never in a real argv
        return
    assert resident.decode_request(body) == (umask, argv, env)


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_are_refused(body: bytes) -> None:
    try:
        umask, argv, env = resident.decode_request(body)
    except ValueError:
        return
    assert 0 <= umask <= 0o777 and all(isinstance(a, str) for a in argv) and all(k for k in env)


def test_the_client_imports_nothing_heavy(server: Server) -> None:
    # The point of the server: the program that hands its command line over loads neither pydantic, click nor
    # anyio (the child has them already). Control: without the server, the same command line loads all three.
    heavy = ("pydantic", "click", "anyio")

    def loaded(env: dict[str, str]) -> set[str]:
        done = subprocess.run([EXECBOX, "--version"], capture_output=True, text=True, timeout=120,
                              env={**env, "PYTHONPROFILEIMPORTTIME": "1"})
        assert done.returncode == 0, done.stderr
        lines = [line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
        return {name for name in lines if name.split(".")[0] in heavy}

    assert not loaded(server.env)
    assert {name.split(".")[0] for name in loaded(_env())} == set(heavy)


# --- found by the review of the server (each failed before its fix) ----------------------------------------

LISTENER = textwrap.dedent("""
    import socket, sys
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sys.argv[1])
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(5)
    got = b""
    try:
        while chunk := conn.recv(65536):
            got += chunk
    except OSError:
        pass
    print(len(got), flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another uid")
def test_the_client_hands_nothing_to_another_users_listener(tmp_path: Path) -> None:
    # Whoever can make the socket's path (a world-writable directory, a path left free) would get the client's
    # environment, its streams and its directory. The client checks who listens and runs the command itself.
    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        shared.chmod(0o1777)
        path = shared / "execbox.sock"
        evil = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                 "-c", LISTENER, str(path)], stdout=subprocess.PIPE, text=True, cwd="/")
        assert evil.stdout is not None and evil.stdout.readline().strip() == "ready"
        done = subprocess.run([EXECBOX, "--version"], capture_output=True, text=True, timeout=60,
                              env=_env(**{resident.SERVER_VAR: str(path), "MY_API_KEY": "sk-12345"}))
        assert done.returncode == 0 and "version" in done.stdout, done
        assert "it is uid 65534's, not yours" in done.stderr, done.stderr
        with socket.socket(socket.AF_UNIX) as poke:  # the client no longer connects at all: end the listener's wait
            poke.connect(str(path))
        out, _ = evil.communicate(timeout=30)
        assert out.strip() == "0", f"the listener got {out.strip()} bytes"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_child_ending_as_its_client_signals_does_not_bring_the_server_down() -> None:
    # The child's exit and its client's byte in one select batch, exit first: the second event found the child
    # reaped, and the server died of a KeyError, hanging up every run in flight.
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    listener = socket.socket(socket.AF_UNIX)
    server = resident_server._Server("unused", lambda argv: 0, listener, 0, os.pipe(), lambda *a: 0)
    server.children[pid] = resident_server._Child(ours, os.pidfd_open(pid))
    theirs.send(bytes([signal.SIGINT]))  # what the client's Ctrl-C relays

    class OneBatch:
        def select(self, timeout: float) -> list[tuple[Any, int]]:
            return [(SimpleNamespace(data=("exit", pid)), 1), (SimpleNamespace(data=("client", pid)), 1)]

        def unregister(self, what: object) -> None:
            pass

    server.selector = OneBatch()  # type: ignore[assignment]
    try:
        resident_server._step(server, timeout=0)
        assert theirs.recv(64) == b"exit 7\n"
        assert not server.children
    finally:
        listener.close()
        theirs.close()
        for fd in server.wake:
            os.close(fd)


def test_a_closed_stream_of_the_client_stays_closed(server: Server, tmp_path: Path) -> None:
    # A closed stdin was taken by the client's socket, and handed to the child as its stdin: `cat` read the
    # socket for ever. Now it reads nothing, as without the server.
    args = [EXECBOX, "run", "--backend", "local_subprocess", "--network", "host", "--stdin", "--", "cat"]
    for env in (_env(), server.env):
        done = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                              env={**env, "CODE_EXEC_LOCAL": "true"}, pass_fds=(), preexec_fn=lambda: os.close(0))
        assert (done.returncode, done.stdout) == (0, ""), done


def test_refused_requests_leave_no_descriptor_and_a_silent_client_stalls_nobody(server: Server) -> None:
    def open_fds() -> int:
        return len(os.listdir(f"/proc/{server.proc.pid}/fd"))

    assert server.run("--version").returncode == 0
    before = open_fds()
    for _ in range(5):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(server.path)
            socket.send_fds(sock, [resident.header(3) + b"abc"], [0, 1, 2, 0])
            assert sock.makefile("rb").readline().startswith(b"error malformed request"), "not refused"
    assert wait_until(lambda: open_fds() == before, 10), (open_fds(), before)
    with socket.socket(socket.AF_UNIX) as silent:  # connects, sends nothing, keeps the connection
        silent.connect(server.path)
        done = server.run("--version", timeout=resident_server.REQUEST_TIMEOUT_S - 1)
        assert done.returncode == 0, done


def test_a_server_started_without_standard_streams_still_serves(tmp_path: Path) -> None:
    path = str(tmp_path / "bare.sock")
    proc = subprocess.Popen(f'exec "{EXECBOX}" serve --socket "{path}" <&- >&- 2>&-', shell=True, env=_env())
    try:
        assert wait_until(lambda: os.path.exists(path), 60)
        done = subprocess.run([EXECBOX, "--version"], capture_output=True, text=True, timeout=60,
                              env=_env(**{resident.SERVER_VAR: path}))
        assert done.returncode == 0 and "version" in done.stdout, done
    finally:
        proc.terminate()
        proc.wait(60)


def test_serve_behind_a_double_dash_is_neither_handed_over_nor_run(server: Server) -> None:
    assert resident.starts_a_server(["--", "serve", "--socket", "x"])
    assert not resident.starts_a_server(["run", "--", "serve"])
    body = resident.encode_request(0o22, ["--", "serve", "--socket", server.path + "2"], {})
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(server.path)
        socket.send_fds(sock, [resident.header(len(body))], [0, 1, 2, os.open(".", os.O_RDONLY)])
        sock.sendall(body)
        assert sock.makefile("rb").readline() == b"error a server does not start another server\n"


def test_an_empty_variable_is_no_server(tmp_path: Path) -> None:
    done = subprocess.run([EXECBOX, "serve"], capture_output=True, text=True, timeout=60,
                          env=_env(**{resident.SERVER_VAR: ""}), cwd=tmp_path)
    assert done.returncode == 2 and "give --socket PATH, or set CODE_EXEC_SERVER" in done.stderr, done


def test_a_signal_the_client_ignores_is_not_relayed(server: Server) -> None:
    # Under nohup, or as a background job of a shell without job control, SIGINT/SIGHUP are ignored: the run
    # goes on, as it would without the server.
    client = subprocess.Popen([EXECBOX, "run", "--backend", "local_subprocess", "--network", "host", "--",
                               "sh", "-c", "sleep 2; echo finished"], env={**server.env, "CODE_EXEC_LOCAL": "true"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert wait_until(lambda: bool(_child_pids(server)), 30)
    client.send_signal(signal.SIGINT)
    out, err = client.communicate(timeout=60)
    assert (client.returncode, out) == (0, "finished\n"), err


def test_a_child_that_outlives_its_hang_up_is_killed_at_the_grace() -> None:
    # A child that ignores the SIGHUP sent when its client went away is killed once KILL_GRACE_S has passed.
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # first: the parent waits for setsid, then hangs up
        os.setsid()
        time.sleep(300)
        os._exit(0)
    ours, theirs = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX)
    server = resident_server._Server("unused", lambda argv: 0, listener, 0, os.pipe(), lambda *a: 0)
    server.children[pid] = resident_server._Child(ours, os.pidfd_open(pid))

    class Quiet:
        def select(self, timeout: float) -> list[tuple[Any, int]]:
            return []

        def unregister(self, what: object) -> None:
            pass

    server.selector = Quiet()  # type: ignore[assignment]
    try:
        assert wait_until(lambda: os.getsid(pid) == pid, 10)
        resident_server._hang_up(server, pid)
        resident_server._step(server, timeout=0)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the hang-up alone ended it: the test proves nothing"
        server.children[pid].kill_at = time.monotonic()  # the grace is over
        resident_server._step(server, timeout=0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        listener.close()
        theirs.close()
        for fd in server.wake:
            os.close(fd)


def test_two_servers_starting_at_once_over_a_stale_socket_leave_exactly_one_reachable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both find the dead server's socket; unlinks slowed so that, without the lock, the second removes the
    first one's new socket and binds its own (the first then listens where nobody can reach it)."""
    import threading

    path = str(tmp_path / "s.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a dead server's socket: nobody listens
    real_unlink, unlinks = os.unlink, []

    def slow_unlink(target: Any, *args: Any, **kw: Any) -> None:
        if target == path:
            unlinks.append(target)
            time.sleep(0.2 if len(unlinks) == 1 else 0.6)
        real_unlink(target, *args, **kw)

    monkeypatch.setattr(resident_server.os, "unlink", slow_unlink)
    got: list[object] = []
    barrier = threading.Barrier(2)

    def start() -> None:
        barrier.wait()
        try:
            got.append(resident_server._listen(path))
        except resident_server.ServeError as exc:
            got.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    listening = [item for item in got if isinstance(item, tuple)]
    refused = [item for item in got if isinstance(item, resident_server.ServeError)]
    try:
        assert len(listening) == 1 and len(refused) == 1, got
        assert "already listens" in str(refused[0])
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(path)  # the one that listens is the one at the path
        probe.close()
        assert os.lstat(path).st_ino == listening[0][1]
    finally:
        for listener, _ in listening:
            listener.close()


# --- the client checks the socket's path before it sends anything (issue 25, B6) ------------------------------


@contextlib.contextmanager
def recording_listener(path: str) -> Iterator[list[bytes]]:
    """A listener of this process (uid root in CI) at ``path``; what each connection sent, listed at the end."""
    import threading

    got: list[bytes] = []
    stop = threading.Event()
    srv = socket.socket(socket.AF_UNIX)
    old = os.umask(0o177)
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    srv.listen(4)
    srv.settimeout(0.1)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)  # then hang up: a client waiting for an answer ends
                data = b""
                with contextlib.suppress(OSError):
                    while chunk := conn.recv(65536):
                        data += chunk
                got.append(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        stop.set()
        thread.join(10)
        srv.close()


def _in_process(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXECBOX, "--version"], capture_output=True, text=True, timeout=60,
                          env=_env(**{resident.SERVER_VAR: path, "MY_API_KEY": "sk-12345"}))


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")


@pytest.mark.parametrize("case, why", [
    ("symlink", "it is a symbolic link"),
    pytest.param("other uid", "it is uid 65534's, not yours", marks=ROOT_ONLY),
    ("0666", "other users may use it (mode 0666)"),
    ("open directory", "other users may write to the directory"),
    pytest.param("foreign directory", "on its way is uid 65534's", marks=ROOT_ONLY),
    pytest.param("foreign link on the way", "the link 'via' on its way is uid 65534's", marks=ROOT_ONLY),
    # where hard links are not protected (fs.protected_hardlinks=0) another user may link any socket of ours or
    # root's into /tmp at our name: a second name of a private socket says it is not our server's
    ("hard link", "it has 2 names"),
])
def test_a_socket_someone_else_could_have_put_there_gets_nothing(tmp_path: Path, case: str, why: str) -> None:
    # The listener is this test's own (the caller's uid), so the peer-uid check alone passes it: what decides is
    # the path. Another user with a link in a shared directory got root's whole environment this way.
    where = tmp_path / "d"
    where.mkdir(mode=0o755)
    real = where / "real.sock"
    path = str(real)
    with recording_listener(str(real)) as got:
        if case == "symlink":
            os.symlink(real, where / "link.sock")
            path = str(where / "link.sock")
        elif case == "other uid":
            os.chown(real, 65534, 65534)
        elif case == "0666":
            real.chmod(0o666)
        elif case == "open directory":
            where.chmod(0o777)
        elif case == "foreign directory":
            os.chown(where, 65534, 65534)
        elif case == "hard link":
            os.link(real, where / "other.sock")
            path = str(where / "other.sock")
        elif case == "foreign link on the way":
            os.symlink(where, tmp_path / "via")
            os.lchown(tmp_path / "via", 65534, 65534)
            path = str(tmp_path / "via" / "real.sock")
        done = _in_process(path)
    assert done.returncode == 0 and "version" in done.stdout, done  # run here instead
    assert why in done.stderr and "running without it" in done.stderr, done.stderr
    assert got == [], f"the listener was handed {got}"


def test_a_private_socket_in_a_sticky_shared_directory_is_used(tmp_path: Path) -> None:
    # In /tmp another user may add a name but not replace ours: our own 0600 socket there is trusted.
    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        shared.chmod(0o1777)
        server = Server(str(shared / "execbox.sock"), _env())
        try:
            done = server.run("--version")
            relative = server.run("--version", env={**server.env, resident.SERVER_VAR: "execbox.sock"}, cwd=shared)
        finally:
            server.stop()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    for run in (done, relative):
        assert run.returncode == 0 and "version" in run.stdout and "running without it" not in run.stderr, run


@pytest.mark.parametrize("foreign", [pytest.param(True, marks=ROOT_ONLY), False])
def test_a_lock_file_someone_else_may_hold_is_refused_not_waited_on(tmp_path: Path, foreign: bool) -> None:
    import fcntl

    path = tmp_path / "s.sock"
    lock = tmp_path / "s.sock.lock"
    lock.touch(mode=0o600)
    if foreign:  # another user's lock file
        os.chown(lock, 65534, 65534)
    else:  # ours, but others may open it to read, which is all flock needs
        lock.chmod(0o644)
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as its other user would, to hold our server's start forever
        done = subprocess.run([EXECBOX, "serve", "--socket", str(path)], capture_output=True, text=True, timeout=60,
                              env=_env())
    assert done.returncode == 2 and "is not a private file of yours" in done.stderr, done
    assert not path.exists()


@pytest.mark.parametrize("foreign", [pytest.param(True, marks=ROOT_ONLY), False])
def test_a_socket_at_the_path_that_never_accepts_does_not_hold_the_start(tmp_path: Path, foreign: bool) -> None:
    # A listener whose queue is full: a blocking connect to it never returns. Another user's (in a sticky /tmp any
    # user may bind our name first) held root's `execbox serve` start forever, lock held; so did a wedged one of ours.
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as wedged:
        wedged.bind(str(path))
        wedged.listen(0)
        queued = []
        with contextlib.suppress(BlockingIOError):
            while len(queued) < 16:  # fill the queue; nobody accepts
                client = socket.socket(socket.AF_UNIX)
                queued.append(client)
                client.setblocking(False)
                client.connect(str(path))
        if foreign:
            os.chown(path, 65534, 65534)
        try:
            done = subprocess.run([EXECBOX, "serve", "--socket", str(path)], capture_output=True, text=True,
                                  timeout=60, env=_env())
        finally:
            for client in queued:
                client.close()
    assert done.returncode == 2, done
    assert ("is uid 65534's socket" if foreign else "accepts nothing") in done.stderr, done.stderr
