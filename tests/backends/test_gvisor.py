"""The gvisor backend against real runsc: the conformance kit, then what the kit does not see (the kernel the code
talks to, no_new_privs, a SIGKILLed caller, gc, the settings)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from execbox import Limits, Runner, SandboxError, Settings
from execbox.backends.gvisor.session import cgroup_parents, sessions_dir
from execbox.errors import BackendUnavailableError, ConfigError
from execbox.runner import run_blocking
from execbox.testing import engine_missing
from execbox.testing.conformance import BackendConformance, Kit
from execbox.testing.host import host_processes

pytestmark = pytest.mark.engine


class TestGvisorConformance(BackendConformance):
    backend_name = "gvisor"

    @pytest.fixture
    def runner(self) -> Runner:
        return Runner(Settings.from_env(backend="gvisor"))

    # Found: the session sets no host_owner, so its file calls work as root and what an upload (a restored snapshot's
    # workspace too) creates is root's: a fork cannot change the files it started with. host_owner alone is not the
    # fix: the sandbox user cannot reach the workspace on the host (under execbox's 0700 state directory).
    @pytest.mark.xfail(strict=True, reason="gvisor uploads (and restored workspaces) are root's, unwritable inside")
    def test_snapshot_forks_isolated(self, kit: Kit) -> None:
        super().test_snapshot_forks_isolated(kit)  # type: ignore[misc]


@pytest.fixture(scope="module")
def runner() -> Runner:
    runner = Runner(Settings.from_env(backend="gvisor"))
    try:
        run_blocking(runner.aio.backend("gvisor").check)
    except BackendUnavailableError as exc:
        engine_missing(f"gvisor cannot run here: {exc}")
    return runner


def test_the_code_talks_to_gvisors_kernel_with_no_new_privs(runner: Runner) -> None:
    result = runner.run_code("import ctypes, os\nprint(os.uname().release, ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))",
                             backend="gvisor")
    release, no_new_privs = result.stdout.split()
    assert release != os.uname().release  # the Sentry's made-up kernel, not the host's
    assert no_new_privs == "1"


def _sandbox_processes(session_id: str) -> list[int]:
    return [pid for pid, argv in host_processes() if any(session_id in arg for arg in argv)]


def test_a_sigkilled_caller_leaves_nothing_running_and_gc_removes_its_directory(runner: Runner) -> None:
    holder = textwrap.dedent("""
        import sys, time
        from execbox import Runner, Settings
        sb = Runner(Settings.from_env(backend="gvisor")).sandbox(backend="gvisor").__enter__()
        print(sb.exec("echo up").stdout.strip(), flush=True)
        time.sleep(600)
    """)
    before = set(os.listdir(sessions_dir()))
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        (session,) = set(os.listdir(sessions_dir())) - before
        assert _sandbox_processes(session)  # runsc and its sandbox run on the host
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while _sandbox_processes(session) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sandbox_processes(session) == []
    removed = run_blocking(runner.aio.backend("gvisor").gc)
    assert os.path.join(sessions_dir(), session) in removed
    assert not Path(sessions_dir(), session).exists()
    assert [parent for parent in cgroup_parents() if os.path.exists(os.path.join(parent, session))] == []


def test_missing_runsc_is_unavailable_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_GVISOR_RUNSC", "/nonexistent/runsc")
    with pytest.raises(BackendUnavailableError) as info:
        run_blocking(Runner(Settings.from_env(backend="gvisor")).aio.backend("gvisor").check)
    assert info.value.env_var == "CODE_EXEC_GVISOR_RUNSC"


def test_a_runsc_others_can_replace_is_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    planted = tmp_path / "runsc"
    planted.write_bytes(b"#!/bin/sh\n")
    planted.chmod(0o777)
    monkeypatch.setenv("CODE_EXEC_GVISOR_RUNSC", str(planted))
    with pytest.raises(BackendUnavailableError, match="cannot be trusted"):
        run_blocking(Runner(Settings.from_env(backend="gvisor")).aio.backend("gvisor").check)


@pytest.mark.parametrize("value", ["0:0", "1000:0", "nobody"])
def test_root_or_garbage_sandbox_user_is_a_config_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CODE_EXEC_GVISOR_USER", value)
    with pytest.raises(ConfigError):
        _ = Runner(Settings.from_env(backend="gvisor")).aio.backend("gvisor").settings


def test_a_memory_bomb_ends_its_command_and_then_its_session_with_the_reason(runner: Runner) -> None:
    # Over the limit the memory cgroup's OOM killer takes the whole Sentry: the command's result, then a refusal.
    with runner.sandbox(backend="gvisor", limits=Limits(memory_mb=128)) as sb:
        result = sb.run_code("print('allocating', flush=True)\nb = bytearray(768 << 20)\nprint('survived')")
        assert "survived" not in result.stdout and result.exit_code == 137
        with pytest.raises(SandboxError, match="memory limit is 128 MiB"):
            sb.exec(["true"])


def test_a_command_that_cannot_run_is_126_or_127_with_the_reason(runner: Runner) -> None:
    with runner.sandbox(backend="gvisor") as sb:
        not_executable, missing = sb.exec(["/etc/passwd"]), sb.exec(["no-such-command"])
    assert (not_executable.exit_code, missing.exit_code) == (126, 127)
    assert "Permission denied" in not_executable.stderr and "not found" in missing.stderr


@pytest.mark.engine
def test_auto_runs_on_gvisor_and_passes_it_over_for_egress_it_cannot_give() -> None:
    with Runner(Settings.from_env(backend="auto", network="none")) as runner:
        try:
            plain = runner.run(["true"])
        except BackendUnavailableError as exc:
            engine_missing(f"no sandbox backend runs here: {exc}")
        if plain.backend != "gvisor":
            engine_missing(f"auto did not find the gvisor backend here: {runner.aio.auto_passed_over}")
        egress = runner.run(["true"], network="egress")
    assert egress.backend not in ("gvisor", None) and egress.ok, egress
    assert any(line.startswith("gvisor: it does not offer network mode 'egress'")
               for line in runner.aio.auto_passed_over), runner.aio.auto_passed_over
