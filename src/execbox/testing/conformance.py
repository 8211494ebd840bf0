"""The conformance kit: pytest checks that a backend does what its capabilities claim.

Use it from a test module of your backend::

    import pytest, execbox
    from execbox.testing.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        backend_name = "my_backend"

        @pytest.fixture
        def runner(self):
            return execbox.Runner(execbox.Settings.from_env(backend="my_backend"))

Which checks run follows the capabilities the backend reports from ``check()``; a check of a capability it
does not claim is skipped with that reason, and a claimed capability whose check fails is a failure.
Every request goes through the public API, so the guard and the env policy are part of what is checked.
"""

from __future__ import annotations

import json
import socket
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from execbox.core.errors import BackendUnavailableError, WorkspacePathError
from execbox.core.models import Capabilities, ExecResult, Limits
from execbox.core.results import TIMEOUT_EXIT_CODE
from execbox.runner import Runner, run_blocking
from execbox.testing import engine_missing

# How long past its timeout a run may take to come back (kill, clean-up, a slow shared machine).
DEADLINE_SLACK_S = 20.0


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
        self.port = self.sock.getsockname()[1]
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


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
    time.sleep(1000)
""")

# A one-shot run whose setsid, double-forked grandchild carries a marker in its command line.
ESCAPING_MARKED_GRANDCHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    if os.fork() == 0:
        os.setsid()
        subprocess.Popen(["python3", "-c", "import time; time.sleep(1000)", sys.argv[1]])
        os._exit(0)
    time.sleep(1000)
""")


def _alive_with(marker: str, settle_s: float = 1.0) -> list[int]:
    """Host processes whose command line holds ``marker``, after giving a kill in flight time to land."""
    try:
        import psutil
    except ImportError:
        engine_missing("psutil is needed to look for leftover processes: pip install 'execbox[dev]'")
    deadline = time.monotonic() + settle_s
    while True:
        alive = [p.pid for p in psutil.process_iter(["cmdline", "status"])
                 if marker in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


class BackendConformance:
    """Subclass and provide ``backend_name`` and a ``runner`` fixture (an execbox.Runner set up for it)."""

    backend_name: ClassVar[str]

    @pytest.fixture
    def runner(self) -> Runner:
        raise NotImplementedError("give the conformance class a `runner` fixture that returns an execbox.Runner")

    @pytest.fixture
    def caps(self, runner: Runner) -> Capabilities:
        backend = runner.aio.backend(self.backend_name)
        try:
            return run_blocking(backend.check)
        except BackendUnavailableError as exc:
            engine_missing(f"backend {self.backend_name} cannot run here: {exc}")

    @pytest.fixture
    def net(self, caps: Capabilities) -> str:
        """The network mode the checks run with: none when the backend enforces it."""
        return "none" if "none" in caps.network_modes else sorted(caps.network_modes)[0]

    @pytest.fixture
    def listener(self) -> Iterator[Listener]:
        listener = Listener()
        yield listener
        listener.close()

    def run(self, runner: Runner, net: str, command: Any, **kw: Any) -> ExecResult:
        result = runner.run(command, backend=self.backend_name, network=net, **kw)
        assert result.backend == self.backend_name
        return result

    def code(self, runner: Runner, net: str, code: str, **kw: Any) -> ExecResult:
        return runner.run_code(code, backend=self.backend_name, network=net, **kw)

    def require(self, caps: Capabilities, *, sessions: bool = False, files: bool = False,
                network: str | None = None, limit: str | None = None) -> None:
        if sessions and not caps.persistent_sessions:
            pytest.skip("the backend does not claim persistent sessions")
        if files and not caps.file_transfer:
            pytest.skip("the backend does not claim file transfer")
        if network and network not in caps.network_modes:
            pytest.skip(f"the backend does not claim network mode {network!r}")
        if limit and limit not in caps.limits:
            pytest.skip(f"the backend does not claim the {limit} limit")

    # --- exit codes and streams -------------------------------------------------------------------

    def test_exit_codes_are_data(self, runner: Runner, net: str) -> None:
        assert self.run(runner, net, ["true"]).exit_code == 0
        result = self.run(runner, net, "exit 3")
        assert (result.exit_code, result.timed_out) == (3, False)
        assert self.run(runner, net, "kill -9 $$").exit_code == 137

    def test_stdout_and_stderr_kept_apart(self, runner: Runner, net: str) -> None:
        result = self.run(runner, net, "echo to-out; echo to-err >&2")
        assert result.stdout == "to-out\n"
        assert result.stderr == "to-err\n"

    def test_stdin_is_delivered(self, runner: Runner, net: str) -> None:
        assert self.run(runner, net, ["cat"], stdin=b"hello stdin\n").stdout == "hello stdin\n"
        big = self.run(runner, net, ["wc", "-c"], stdin=b"x" * 1_000_000)
        assert big.stdout.strip() == "1000000"

    def test_utf8_and_invalid_bytes(self, runner: Runner, net: str) -> None:
        result = self.code(runner, net, "import sys\nprint('héllo ✓ 世界')\nsys.stdout.flush()\n"
                                        "sys.stdout.buffer.write(b'bad \\xff\\xfe end')")
        assert result.stdout == "héllo ✓ 世界\nbad \ufffd\ufffd end"

    def test_python_and_bash_code(self, runner: Runner, net: str) -> None:
        assert self.code(runner, net, "print(6 * 7)").stdout == "42\n"
        assert self.code(runner, net, "echo $((6 * 7))", language="bash").stdout == "42\n"

    def test_code_is_not_on_the_command_line(self, runner: Runner, net: str) -> None:
        marker = uuid.uuid4().hex
        result = self.code(runner, net, f"# {marker}\nimport os\nprint(open('/proc/self/cmdline','rb').read())")
        assert result.exit_code == 0
        assert marker not in result.stdout

    # --- output cap ---------------------------------------------------------------------------------

    def test_output_cap_keeps_head_and_tail(self, runner: Runner, net: str) -> None:
        cap = 10_000
        result = self.code(runner, net, "import sys\nsys.stdout.write('HEAD' + 'x' * 2_000_000 + 'TAIL')\n"
                                        "sys.stderr.write('ERRHEAD' + 'y' * 500_000 + 'ERRTAIL')",
                           max_output_bytes=cap)
        assert result.exit_code == 0
        assert result.truncated
        for text, head, tail in ((result.stdout, "HEAD", "TAIL"), (result.stderr, "ERRHEAD", "ERRTAIL")):
            assert text.startswith(head) and text.endswith(tail)
            assert "bytes omitted" in text
            assert len(text.encode()) <= cap + 200

    def test_small_output_is_not_truncated(self, runner: Runner, net: str) -> None:
        result = self.run(runner, net, ["printf", "%s", "abc"], max_output_bytes=3)
        assert (result.stdout, result.truncated) == ("abc", False)

    # --- time -------------------------------------------------------------------------------------

    def test_timeout_ends_the_run(self, runner: Runner, net: str) -> None:
        started = time.monotonic()
        result = self.run(runner, net, ["sleep", "1000"], timeout=1)
        # One result builder: every backend reports a timeout with the same exit code.
        assert (result.exit_code, result.timed_out, result.oom_killed) == (TIMEOUT_EXIT_CODE, True, False), result
        assert time.monotonic() - started < 1 + DEADLINE_SLACK_S

    def test_timeout_kills_setsid_grandchild(self, runner: Runner, net: str, caps: Capabilities) -> None:
        self.require(caps, sessions=True, files=True)
        with runner.sandbox(self.backend_name, network=net) as sb:
            result = sb.run_code(ESCAPING_GRANDCHILD, timeout=5)
            assert result.timed_out
            time.sleep(1.0)
            first = len(sb.read_file("tick"))
            time.sleep(1.5)
            assert len(sb.read_file("tick")) == first, "a setsid grandchild is still writing after the deadline"

    def test_timeout_kills_setsid_grandchild_of_a_one_shot_run(self, runner: Runner, net: str,
                                                               caps: Capabilities) -> None:
        if caps.remote:
            pytest.skip("the sandbox's processes run on another host")
        marker = f"execbox-escape-{uuid.uuid4().hex}"
        result = self.run(runner, net, ["python3", "-c", ESCAPING_MARKED_GRANDCHILD, marker], timeout=3)
        assert result.timed_out
        assert _alive_with(marker) == [], "a setsid grandchild outlived the deadline of a one-shot run"

    def test_nothing_left_running_after_a_run(self, runner: Runner, net: str, caps: Capabilities) -> None:
        if caps.remote:
            pytest.skip("the sandbox's processes run on another host")
        marker = f"execbox-leak-{uuid.uuid4().hex}"
        code = (f"import os, subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 1000; : {marker}'], "
                "start_new_session=True)\nprint('started')")
        assert self.code(runner, net, code).stdout == "started\n"
        assert _alive_with(marker) == [], "processes outlived the run"

    # --- env policy --------------------------------------------------------------------------------

    def test_env_policy(self, runner: Runner, net: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("EXECBOX_CONFORMANCE_HOST_ONLY", "host-value-must-not-leak")
        env = {"VISIBLE": "yes", "OPENAI_API_KEY": "sk-secret", "GITHUB_PAT": "pat", "PYTHONHASHSEED": "0"}
        result = self.code(runner, net, "import os, json\nprint(json.dumps(dict(os.environ)))", env=env)
        seen = json.loads(result.stdout)
        assert seen["VISIBLE"] == "yes" and seen["PYTHONHASHSEED"] == "0"
        assert "OPENAI_API_KEY" not in seen and "GITHUB_PAT" not in seen
        assert "EXECBOX_CONFORMANCE_HOST_ONLY" not in seen
        assert "host-value-must-not-leak" not in result.stdout and "sk-secret" not in result.stdout
        assert result.filtered_env == ["GITHUB_PAT", "OPENAI_API_KEY"]

    # --- files -------------------------------------------------------------------------------------

    def test_request_files_and_workdir(self, runner: Runner, net: str) -> None:
        result = self.run(runner, net, "cat in.txt; pwd", files={"sub/in.txt": b"data\n"}, workdir="sub")
        assert result.stdout.startswith("data\n") and result.stdout.rstrip().endswith("/sub")

    def test_file_round_trip(self, runner: Runner, net: str, caps: Capabilities) -> None:
        self.require(caps, sessions=True, files=True)
        payload = bytes(range(256)) * 64
        with runner.sandbox(self.backend_name, network=net) as sb:
            sb.write_file("in/data.bin", payload)
            result = sb.exec(["python3", "-c", "d = open('in/data.bin', 'rb').read(); open('out.bin', 'wb').write(d[::-1]); print(len(d))"])
            assert result.stdout == f"{len(payload)}\n"
            assert sb.read_file("out.bin") == payload[::-1]
            assert sb.exec(["cat", "in/data.bin"]).exit_code == 0

    def test_session_state_persists(self, runner: Runner, net: str, caps: Capabilities) -> None:
        self.require(caps, sessions=True)
        with runner.sandbox(self.backend_name, network=net) as sb:
            assert sb.exec("echo kept > state.txt").exit_code == 0
            assert sb.exec(["cat", "state.txt"]).stdout == "kept\n"

    def test_paths_outside_the_workspace_refused(self, runner: Runner, net: str, caps: Capabilities) -> None:
        self.require(caps, sessions=True, files=True)
        with runner.sandbox(self.backend_name, network=net) as sb:
            for bad in ("../escape.txt", "/etc/passwd", "a/../../b"):
                with pytest.raises(WorkspacePathError):
                    sb.read_file(bad)
                with pytest.raises(WorkspacePathError):
                    sb.write_file(bad, b"x")

    def test_planted_symlink_refused_on_read_back(self, runner: Runner, net: str, caps: Capabilities) -> None:
        self.require(caps, sessions=True, files=True)
        with runner.sandbox(self.backend_name, network=net) as sb:
            assert sb.exec("ln -s /etc/passwd out.txt && ln -s /etc linked").exit_code == 0
            with pytest.raises(WorkspacePathError):
                sb.read_file("out.txt")
            with pytest.raises(WorkspacePathError):
                sb.read_file("linked/passwd")

    # --- network -----------------------------------------------------------------------------------

    def test_network_none_enforced(self, runner: Runner, caps: Capabilities, listener: Listener) -> None:
        self.require(caps, network="none")
        result = self.run(runner, "none", ["python3", "-c", PROBE_CONNECT, str(listener.port)])
        assert result.exit_code == 0, result.stderr
        assert "BLOCKED" in result.stdout and "CONNECTED" not in result.stdout
        assert listener.accepted == 0
        if not caps.remote:
            ifaces = result.stdout.split("IFACES", 1)[1].split()
            assert ifaces in ([], ["lo"]), f"network none, yet the sandbox sees interfaces {ifaces}"

    # --- limits ------------------------------------------------------------------------------------

    def test_memory_limit_holds(self, runner: Runner, net: str, caps: Capabilities) -> None:
        self.require(caps, limit="memory")
        result = self.code(runner, net, "b = bytearray(768 * 1024 * 1024)\nprint('survived')",
                           limits=Limits(memory_mb=128), timeout=20)
        assert "survived" not in result.stdout
        assert result.exit_code != 0 or result.oom_killed

    def test_cpu_limit_holds(self, runner: Runner, net: str, caps: Capabilities) -> None:
        self.require(caps, limit="cpu")
        if caps.remote:
            pytest.skip("a remote provider enforces CPU on its own hosts: not measurable from here")
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
            print(round(t.children_user + t.children_system, 2))
        """)
        result = self.code(runner, net, code, limits=Limits(cpus=0.5), timeout=20)
        assert result.exit_code == 0, result.stderr
        assert float(result.stdout) < 1.6, f"0.5 CPU for 2 s, yet the run used {result.stdout.strip()} CPU-seconds"

    def test_pids_limit_holds(self, runner: Runner, net: str, caps: Capabilities) -> None:
        self.require(caps, limit="pids")
        code = textwrap.dedent("""
            import os, time
            n = 0
            for _ in range(500):
                try:
                    if os.fork() == 0:
                        time.sleep(20)
                        os._exit(0)
                    n += 1
                except OSError:
                    break
            print("forked", n)
        """)
        result = self.code(runner, net, code, limits=Limits(pids=32), timeout=15)
        forked = int(result.stdout.split()[-1]) if result.stdout.startswith("forked") else 0
        assert forked < 32, result
