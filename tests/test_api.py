"""The public Python API: run / run_code / sandbox and their async twins, JSON results, request errors,
cancellation, and what importing execbox costs."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest

import execbox
from execbox import Capabilities, ConfigError, ExecRequest, ExecResult
from tests.support.fixtures import (  # noqa: F401  (fixtures)
    anyio_backend,
    fresh_registry,
    home,
    local_mode,
    only_local_builtin,
    workspaces,
)

SDK_MODULES = ["docker", "paramiko", "modal", "daytona", "vercel", "spython"]

pytestmark = pytest.mark.usefixtures("only_local_builtin")


class TestSync:
    def test_run_an_argv(self, local_mode: None) -> None:
        result = execbox.run(["python3", "-c", "print('hello')"])
        assert (result.exit_code, result.stdout, result.backend, result.ok) == (0, "hello\n", "local_subprocess", True)

    def test_run_a_shell_string_with_env_and_stdin(self, local_mode: None) -> None:
        result = execbox.run('read line; echo "$GREETING $line"', env={"GREETING": "hi"}, stdin="there\n")
        assert result.stdout == "hi there\n"

    def test_run_code(self, local_mode: None) -> None:
        assert execbox.run_code("print(6 * 7)").stdout == "42\n"
        assert execbox.run_code("echo $((6 * 7))", language="bash").stdout == "42\n"

    def test_sandbox(self, local_mode: None, workspaces: Path) -> None:
        with execbox.sandbox() as sb:
            sb.write_file("data.txt", b"42")
            assert sb.exec(["cat", "data.txt"]).stdout == "42"
            assert sb.run_code("print(open('data.txt').read())").stdout == "42\n"
            sb.exec("echo back > out.txt")
            assert sb.read_file("out.txt") == b"back\n"
            assert len(list(workspaces.iterdir())) == 1
        assert list(workspaces.iterdir()) == []

    def test_a_closed_sandbox_says_how_to_use_it(self, local_mode: None) -> None:
        sb = execbox.sandbox()
        with pytest.raises(execbox.SandboxError, match="with execbox.sandbox"):
            sb.exec(["true"])  # never entered
        with sb:
            sb.write_file("a.txt", "x")
        for use in (lambda: sb.exec(["true"]), lambda: sb.read_file("a.txt"), lambda: sb.write_file("b", "y")):
            with pytest.raises(execbox.SandboxError, match="not open"):
                use()  # after close: an execbox error, never another exception

    def test_the_sync_api_works_inside_a_running_event_loop(self, local_mode: None) -> None:
        async def main() -> tuple[str, str]:
            result = execbox.run(["echo", "inside"])
            with execbox.sandbox() as sb:
                return result.stdout, sb.exec(["echo", "session"]).stdout

        assert asyncio.run(main()) == ("inside\n", "session\n")

    def test_one_shot_workspaces_are_removed(self, local_mode: None, workspaces: Path) -> None:
        execbox.run("echo x > file.txt")
        execbox.run(["false"])
        assert list(workspaces.iterdir()) == []


@pytest.mark.anyio
class TestAsync:
    async def test_arun(self, local_mode: None) -> None:
        result = await execbox.arun(["sh", "-c", "echo out; echo err >&2; exit 4"])
        assert (result.exit_code, result.stdout, result.stderr) == (4, "out\n", "err\n")

    async def test_arun_code(self, local_mode: None) -> None:
        assert (await execbox.arun_code("import sys; print(sys.stdin.read())", stdin=b"abc")).stdout == "abc\n"

    async def test_asandbox(self, local_mode: None, workspaces: Path) -> None:
        async with execbox.asandbox() as sb:
            await sb.write_file("a.txt", "one")
            assert (await sb.exec(["cat", "a.txt"])).stdout == "one"
            assert (await sb.run_code("open('b.txt', 'w').write('two')")).ok
            assert await sb.read_file("b.txt") == b"two"
        assert list(workspaces.iterdir()) == []

    async def test_runs_proceed_concurrently(self, local_mode: None) -> None:
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(execbox.arun, ["sleep", "0.5"])
        assert time.monotonic() - started < 1.8


def _processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


async def _cancel_a_sleep(marker: str, seen: dict[int, psutil.Process]) -> list[psutil.Process]:
    """arun `sleep` under move_on_after, cancelled as soon as its processes are up; returns what of them is
    alive the moment the cancelled call returns."""

    with anyio.fail_after(20):
        with anyio.move_on_after(15) as scope:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while len(seen) < 2:  # the reaper and the sleep
                        seen.update((p.pid, p) for p in _processes_with(marker))
                        await anyio.sleep(0.02)
                    scope.cancel()

                tg.start_soon(watch)
                await execbox.arun(["sleep", marker])
        assert scope.cancelled_caught
        return _alive(list(seen.values()))


def test_cancelling_arun_leaves_no_process_and_no_workspace(local_mode: None, workspaces: Path) -> None:
    marker = f"100.{uuid.uuid4().int % 10**6:06d}"
    seen: dict[int, psutil.Process] = {}
    anyio.run(_cancel_a_sleep, marker, seen)
    gc.collect()  # finalise the cancelled run's transports now, not while pytest formats a report
    assert {p.name() for p in seen.values() if p.is_running()} <= {"python", "python3", "sleep"}
    assert len(seen) == 2, "the run never started"
    assert list(workspaces.iterdir()) == []
    deadline = time.monotonic() + 5
    while _alive(list(seen.values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive(list(seen.values())) == []
    assert _processes_with(marker) == []


def test_a_cancelled_arun_returns_only_after_its_processes_are_dead(local_mode: None) -> None:
    marker = f"100.{uuid.uuid4().int % 10**6:06d}"
    seen: dict[int, psutil.Process] = {}
    alive_at_return = anyio.run(_cancel_a_sleep, marker, seen)
    gc.collect()
    assert len(seen) == 2, "the run never started"
    assert alive_at_return == []


def _portal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "execbox-portal" and t.is_alive()]


def test_a_runner_keeps_one_event_loop_thread_and_ends_it_when_dropped(local_mode: None) -> None:
    before = set(_portal_threads())
    runner = execbox.Runner()
    for _ in range(3):
        assert runner.run("true").ok
    (thread,) = set(_portal_threads()) - before  # else each call started a loop thread of its own
    del runner
    gc.collect()  # the runner's clean-up starts, in a thread of its own (never inside a collection)
    thread.join(10)
    assert not thread.is_alive(), "a dropped runner's loop thread still runs"


def test_a_sandbox_keeps_the_runner_it_came_from(local_mode: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner dropped while a sandbox it opened is in use must not close the backends that sandbox uses."""
    closed: list[object] = []
    aclose = execbox.AsyncRunner.aclose

    async def spied(self: execbox.AsyncRunner) -> None:
        closed.append(self)
        await aclose(self)

    monkeypatch.setattr(execbox.AsyncRunner, "aclose", spied)
    runner = execbox.Runner()
    assert runner.run("true").ok
    with runner.sandbox() as sb:
        del runner
        gc.collect()
        time.sleep(0.3)  # a dropped runner's clean-up runs in a thread of its own
        assert closed == [], "the runner's backends were closed under its open sandbox"
        assert sb.exec("echo still served").stdout == "still served\n"


def test_a_sandbox_a_runner_opens_runs_in_that_runner_s_loop_thread(local_mode: None) -> None:
    """One loop thread per runner: its sandboxes do not start their own; closing the runner closes those it left
    open in that loop (which stops with it)."""
    before = set(_portal_threads())
    with execbox.Runner() as runner:
        assert runner.run("true").ok
        with runner.sandbox() as sb:
            assert sb.exec("echo shared").stdout == "shared\n"
            assert len(set(_portal_threads()) - before) == 1, "the sandbox started a loop thread of its own"
        left_open = runner.sandbox().__enter__()
        assert left_open.exec("true").ok
    with pytest.raises(execbox.SandboxError, match="not open"):
        left_open.exec("true")
    assert not set(_portal_threads()) - before


def test_threads_sharing_a_runner_run_at_once(local_mode: None) -> None:
    """One loop thread serves them all: their runs proceed side by side, each gets its own result."""
    results: dict[int, str] = {}
    with execbox.Runner() as runner:
        def one(i: int) -> None:
            results[i] = runner.run(f"sleep 0.5; echo {i}").stdout

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert time.monotonic() - started < 1.8, "the runs went one after another"
    assert results == {i: f"{i}\n" for i in range(4)}


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt), also where the suite was started with SIGINT ignored (a
    background job of a non-interactive shell, as CI may be)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _interrupt_once_running(marker: str) -> threading.Thread:
    """Ctrl-C for the main thread (a real SIGINT: it wakes a blocked wait) once a process with ``marker`` runs."""
    def watch() -> None:
        deadline = time.monotonic() + 20
        while not _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


def test_ctrl_c_cancels_that_sync_run_alone_and_returns_once_it_is_cleaned_up(local_mode: None, workspaces: Path,
                                                                           ctrl_c: None) -> None:
    marker = f"100.{uuid.uuid4().int % 10**6:06d}"
    with execbox.Runner() as runner:
        _interrupt_once_running(marker)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            runner.run(["sleep", marker])
        assert time.monotonic() - started < 20, "the run was not interrupted"
        assert _alive(_processes_with(marker)) == [] and list(workspaces.iterdir()) == []
        assert runner.run("echo still usable").stdout == "still usable\n"


def test_ctrl_c_cancels_a_sandbox_exec_and_the_sandbox_goes_on(local_mode: None, ctrl_c: None) -> None:
    marker = f"100.{uuid.uuid4().int % 10**6:06d}"
    with execbox.sandbox() as sb:
        _interrupt_once_running(marker)
        with pytest.raises(KeyboardInterrupt):
            sb.exec(["sleep", marker])
        assert _alive(_processes_with(marker)) == []
        assert sb.exec("echo still open").stdout == "still open\n"


class TestModels:
    def test_exec_result_round_trips_through_json(self, local_mode: None) -> None:
        result = execbox.run(["printf", "caf\\303\\251 \\377"], env={"API_TOKEN": "x"})
        data = json.loads(result.model_dump_json())
        assert set(data) == {"exit_code", "stdout", "stderr", "timed_out", "truncated", "oom_killed", "duration_s",
                             "backend", "isolation", "filtered_env", "notes", "files", "egress", "queued_s", "pooled",
                             "limit", "explanation", "retryable", "secrets"}
        assert data["stdout"] == "café \ufffd" and data["filtered_env"] == ["API_TOKEN"]
        assert data["backend"] == "local_subprocess" and data["isolation"] == "process"
        assert ExecResult.model_validate_json(result.model_dump_json()) == result

    def test_capabilities_serialise_as_sorted_lists_and_round_trip(self) -> None:
        caps = Capabilities(sandbox=True, isolation="container", network_modes=frozenset({"none", "egress"}),
                            limits=frozenset({"pids", "memory"}))
        data = caps.model_dump(mode="json")
        assert data["network_modes"] == ["egress", "none"] and data["limits"] == ["memory", "pids"]
        assert Capabilities.model_validate_json(caps.model_dump_json()) == caps

    def test_capabilities_are_frozen_and_validated(self) -> None:
        caps = Capabilities(sandbox=False, isolation="process")
        with pytest.raises(ValueError):
            caps.sandbox = True  # type: ignore[misc]
        with pytest.raises(ValueError):
            Capabilities(sandbox=True, isolation="vm")  # type: ignore[arg-type]

    def test_a_request_with_binary_stdin_and_files_round_trips_through_json(self) -> None:
        request = ExecRequest(argv=["cat"], stdin=b"\xff\x00", files={"a.bin": b"\x80\x81"})
        assert ExecRequest.model_validate_json(request.model_dump_json()) == request


class TestBadRequests:
    @pytest.mark.parametrize(
        ("call", "message"),
        [
            (lambda: execbox.run([]), "argv is empty"),
            (lambda: execbox.run_code(None), "exactly one of argv"),  # type: ignore[arg-type]
            (lambda: execbox.run(["true"], env={"A=B": "1"}), "invalid environment variable name.*'A=B'"),
            (lambda: execbox.run(["true"], env={"": "1"}), "invalid environment variable name"),
            (lambda: execbox.run(["true"], env={"A": "x\0y"}), "invalid environment variable"),
            (lambda: execbox.run_code("x", language="ruby"), "language.*'python' or 'bash'"),
            (lambda: execbox.run(["true"], timeout=0), "timeout.*greater than 0"),
            (lambda: execbox.run(["true"], network="lan"), "network.*'none', 'egress', 'proxy' or 'host'"),
        ],
        ids=["empty argv", "neither", "= in name", "empty name", "NUL in value", "language", "timeout", "network"],
    )
    def test_a_bad_request_is_a_config_error_with_a_clear_message(self, local_mode: None, call: object,
                                                                  message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            call()  # type: ignore[operator]

    def test_a_bad_setting_is_a_config_error_before_anything_runs(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_NETWORK", "foo")
        with pytest.raises(ConfigError, match="CODE_EXEC_NETWORK"):
            execbox.run(["true"])


def _fresh_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout


def test_importing_execbox_and_running_help_import_no_backend_sdk() -> None:
    code = f"""
import sys
import execbox
after_import = sorted(sys.modules)
from execbox.cli import main
for args in (["--help"], ["run", "--help"], ["backends", "--help"], ["doctor", "--help"]):
    try:
        main(args)
    except SystemExit:
        pass
sdks = {SDK_MODULES!r}
print([m for m in sys.modules if m.split(".")[0] in sdks])
print([m for m in after_import if m.startswith("execbox.backends.")])
"""
    sdk_lines = _fresh_python(code).splitlines()[-2:]
    assert sdk_lines == ["[]", "[]"], sdk_lines


def test_building_the_registry_imports_no_backend_sdk() -> None:
    """Every built-in backend module is imported to register it; each must import its SDK lazily."""
    code = f"""
import sys, warnings
warnings.simplefilter("ignore")
from execbox.registry import get_registry
print(sorted(get_registry([]).backends))
print([m for m in sys.modules if m.split(".")[0] in {SDK_MODULES!r}])
"""
    names, sdks = _fresh_python(code).splitlines()[-2:]
    assert "local_subprocess" in names
    assert sdks == "[]", f"registered {names}, imported {sdks}"


def test_the_sdk_check_can_fail() -> None:
    """The control of the test above: the probe does see an SDK once something imports it."""
    installed = [m for m in SDK_MODULES if importlib.util.find_spec(m) is not None]
    if not installed:
        pytest.skip("no backend SDK is installed in this venv")
    out = _fresh_python(f"import sys, execbox, {installed[0]}; print({installed[0]!r} in sys.modules)")
    assert out.strip() == "True"


def test_all_is_complete_and_sorted() -> None:
    for name in execbox._LAZY:  # the names execbox imports on first use (PEP 562): each resolves
        getattr(execbox, name)
    public = {
        name for name, value in vars(execbox).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", "").startswith("execbox")
    }
    public.add("hookimpl")  # a pluggy marker instance: its __module__ is pluggy's
    assert execbox.__all__ == sorted(execbox.__all__)
    assert set(execbox.__all__) == public
    for name in execbox.__all__:
        assert hasattr(execbox, name), name


def test_read_file_takes_a_smaller_cap_and_refuses_unread(local_mode: None) -> None:
    with execbox.sandbox("local_subprocess", network="host") as sb:
        sb.write_file("big", b"x" * 5000)
        assert sb.read_file("big", max_bytes=5000) == b"x" * 5000
        with pytest.raises(execbox.FileTooLargeError, match="over the read cap of 100 bytes"):
            sb.read_file("big", max_bytes=100)
