"""The CLI never hangs on a backend that never returns: `execbox run` ends with the typed error and the exit status
of a SandboxError, and `execbox doctor --self-check` prints each verdict as it is reached, each check within its time
box, naming the claims that failed. The backend is a plugin installed as a real distribution for the process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from execbox.testing.checks import Check, run_check
from tests.support import stuck_backends

SCRIPT = Path(sys.executable).with_name("execbox")
ROOT = Path(__file__).resolve().parents[1]
#: Liveness bounds: far above what the bounds set below add up to.
RUN_LIVENESS_S, DOCTOR_LIVENESS_S = 120, 900


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A process whose installed distributions include the stuck backends' (an entry point in the execbox group)."""
    installed = stuck_backends.site(tmp_path)
    (tmp_path / "home").mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_"))}
    return {**clean, "HOME": str(tmp_path / "home"), "PYTHONPATH": f"{installed}{os.pathsep}{ROOT}",
            "CODE_EXEC_BACKEND_GRACE_SEC": "1", "CODE_EXEC_OPEN_TIMEOUT_SEC": "2", "CODE_EXEC_MAX_TIMEOUT_SEC": "1"}


def test_run_ends_with_the_typed_error(env: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run([str(SCRIPT), "run", "--backend", "stuck_exec", "--", "true"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=RUN_LIVENESS_S)
    assert done.returncode == 1, done.stderr  # a SandboxError's status
    assert "BackendTimeoutError: backend 'stuck_exec' did not return from exec" in done.stderr


def test_doctor_self_check_streams_each_verdict_and_names_the_failed_claims(env: dict[str, str],
                                                                            tmp_path: Path) -> None:
    # The checks named, not all of the kit's (each stuck exec costs its bound, ~2 s): enough to see the first
    # verdict printed while the others still run, and a claim that holds passing between the failed ones.
    claims = ("exit_codes_are_data", "escaping_paths_refused", "timeout_ends_the_run",
              "endless_output_ends_a_session_exec")
    proc = subprocess.Popen([str(SCRIPT), "doctor", "--self-check", "--backend", "stuck_exec", "--check-timeout", "60",
                             *(f"--check={name}" for name in claims)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        read: list[str] = []
        while not read or not read[-1].startswith("self-check stuck_exec: fail"):
            read.append(proc.stdout.readline())
            assert read[-1], proc.stderr.read() if proc.stderr else ""
        streamed = proc.poll() is None  # a verdict printed while the other checks still run
        rest, _ = proc.communicate(timeout=DOCTOR_LIVENESS_S)
    finally:
        proc.kill()
        proc.wait()
    assert streamed
    lines = [line.rstrip("\n") for line in read] + rest.splitlines()
    assert "self-check stuck_exec: 4 checks, each within 60 s" in lines
    verdicts = [line.split()[2:4] for line in lines
                if line.startswith("self-check stuck_exec: ") and " checks, " not in line]
    assert sorted(name.rstrip(":") for _, name in verdicts) == sorted(claims)  # only the checks named ran
    failed = {name.rstrip(":") for status, name in verdicts if status == "fail"}
    assert failed == {"exit_codes_are_data", "timeout_ends_the_run", "endless_output_ends_a_session_exec"}
    assert all("did not return from exec" in line for line in lines if line.startswith("self-check stuck_exec: fail"))
    assert ["pass", "escaping_paths_refused:"] in verdicts
    assert proc.returncode == 1


def test_doctor_refuses_a_check_the_kit_does_not_have(env: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run([str(SCRIPT), "doctor", "--self-check", "--backend", "stuck_exec", "--check", "no_such",
                           "--check=--json"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=RUN_LIVENESS_S)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "no such check: --json, no_such" in done.stderr


def test_a_check_past_its_time_box_fails_and_is_left_behind() -> None:
    started = time.monotonic()
    verdict = run_check(Check("slow", "a slow claim", lambda kit: time.sleep(30)), None, time_box_s=0.5)  # type: ignore[arg-type]
    assert verdict.status == "fail" and "time box of 0.5 s" in verdict.message and "a slow claim" in verdict.message
    assert time.monotonic() - started < 25  # liveness: not the 30 s the check would take


def test_backends_lists_a_backend_whose_check_never_returns(env: dict[str, str], tmp_path: Path) -> None:
    # Its check blocks in a thread that cancellation cannot reach: a time box by cancellation alone waits for ever.
    done = subprocess.run([str(SCRIPT), "backends", "--json"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=RUN_LIVENESS_S)
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert rows["stuck_probe"]["available"] is False
    # within the open timeout (2 s here), not doctor's 20 s: a check waits no longer than opening a sandbox would
    assert "did not answer within 2s" in rows["stuck_probe"]["reason"]
    assert rows["stuck_exec"]["available"] is True


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_run_stopped_while_its_backend_is_stuck_leaves_nothing(env: dict[str, str], tmp_path: Path,
                                                                 stop: signal.Signals) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([str(SCRIPT), "run", "--backend", "stuck_exec", "--", "true"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**env, "TMPDIR": str(scratch), "CODE_EXEC_MAX_TIMEOUT_SEC": "600"})
    try:
        deadline = time.monotonic() + RUN_LIVENESS_S
        while not list(scratch.glob("execbox-stuck-*")):  # its sandbox is open and its exec stuck
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=RUN_LIVENESS_S)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert not list(scratch.glob("execbox-stuck-*"))


def test_gc_on_a_backend_whose_gc_never_returns_ends_and_says_so(env: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run([str(SCRIPT), "gc", "--backend", "stuck_gc", "--json"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=RUN_LIVENESS_S)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert "backend 'stuck_gc' did not return from gc" in report["skipped"]["stuck_gc"]


def test_doctor_self_check_on_a_backend_whose_check_never_returns_fails_it(env: dict[str, str],
                                                                            tmp_path: Path) -> None:
    done = subprocess.run([str(SCRIPT), "doctor", "--self-check", "--backend", "stuck_probe"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=RUN_LIVENESS_S)
    verdicts = [line for line in done.stdout.splitlines()
                if line.startswith(("self-check stuck_probe: pass", "self-check stuck_probe: fail",
                                    "self-check stuck_probe: skip"))]
    assert len(verdicts) == 1 and verdicts[0].startswith("self-check stuck_probe: fail available: "), done.stdout
    assert "did not return from its availability check" in verdicts[0]
    assert done.returncode == 1, done.stderr
