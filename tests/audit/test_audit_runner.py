"""Every path through the runner writes its audit record: one-shot and session execs, refusals, sandbox
open/close, egress attempts, approvals through the record API, a failed write; and 8 processes x 50 runs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import execbox
from execbox import (
    EgressAttempt,
    ExecResult,
    NotASandboxError,
    Runner,
    SandboxError,
    Settings,
    UnsupportedPolicyError,
    WorkspacePathError,
)
from execbox.audit import fields as audit_fields
from execbox.audit import log as audit
from execbox.audit import reader as audit_reader
from execbox.kit.sessions.host import HostWorkspaceSession


def log_path() -> Path:
    return Path(Settings().audit_log or "")


def events(kind: str | None = None) -> list[dict[str, Any]]:
    found = list(audit_reader.records(log_path()))
    return [r for r in found if kind is None or r["event"] == kind]


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@pytest.fixture(autouse=True)
def _local(only_local_builtin: None, local_mode: None) -> None:
    """local_subprocess only, admitted (local mode, network host); HOME and the audit log are the test's own."""


def test_the_log_is_under_the_tests_state_dir_not_the_developers() -> None:
    assert log_path() == Path(os.environ["XDG_STATE_HOME"]) / "execbox" / "audit.jsonl"
    assert not log_path().exists()


def test_a_one_shot_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    with Runner() as runner:
        result = runner.run("cat; echo done >&2", env={"GREETING": "hi", "AWS_SECRET_ACCESS_KEY": "hunter2"},
                            stdin=b"some input", files={"data/in.txt": b"file body"}, timeout=20)
    assert result.ok and result.notes == []
    (rec,) = events()
    assert rec["event"] == "exec" and rec["oneshot"] is True and len(rec["session"]) == 16
    assert rec["backend"] == "local_subprocess"
    assert rec["config"]["network"] == "host" and rec["config"]["timeout"] == 20
    assert rec["config"]["isolation"] == "process" and rec["config"]["limits"]["memory_mb"] == 1024
    assert rec["argv_sha256"] == audit_fields.argv_sha256(["/bin/sh", "-c", "cat; echo done >&2"])
    assert rec["stdin_sha256"] == sha(b"some input") and rec["stdin_bytes"] == 10
    assert rec["files"] == {"data/in.txt": {"sha256": sha(b"file body"), "bytes": 9}}
    assert rec["env"] == {"passed": ["GREETING"], "dropped": ["AWS_SECRET_ACCESS_KEY"]}
    assert rec["exit_code"] == 0 and rec["timed_out"] is False and rec["oom_killed"] is False
    assert rec["duration_s"] == result.duration_s
    assert rec["stdout"] == {"sha256": sha("some input"), "bytes": 10}
    assert rec["stderr"] == {"sha256": sha("done\n"), "bytes": 5}
    assert rec["caller"]["pid"] == os.getpid() and rec["caller"]["uid"] == os.getuid()
    raw = log_path().read_text()
    assert "hunter2" not in raw and "some input" not in raw and "file body" not in raw  # hashes only
    assert audit_reader.verify(log_path()).ok


def test_code_is_hashed_and_output_kept_when_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_AUDIT_OUTPUT", "4")
    with Runner() as runner:
        runner.run_code("print('hello')")
    (rec,) = events("exec")
    assert rec["code_sha256"] == sha("print('hello')") and rec["language"] == "python"
    assert rec["stdout"]["text"] == "hell" and rec["stdout"]["text_truncated"] is True


def test_a_timed_out_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with Runner() as runner:
        result = runner.run("sleep 30", timeout=0.5)
    (rec,) = events("exec")
    assert result.timed_out and rec["timed_out"] is True and rec["exit_code"] == 124


def test_a_session_open_exec_and_close() -> None:
    with Runner() as runner, runner.sandbox() as sb:
        sb.exec("echo one > f")
        sb.exec(["cat", "f"])
        sid = sb.aio.id
    kinds = [(r["event"], r.get("session")) for r in events()]
    assert kinds == [("sandbox.open", sid), ("exec", sid), ("exec", sid), ("sandbox.close", sid)]
    opened, first, second, _ = events()
    assert opened["backend"] == "local_subprocess" and opened["config"]["network"] == "host"
    assert opened["config"]["lifetime_s"] == 3600.0
    assert first["oneshot"] is False and second["argv_sha256"] == audit_fields.argv_sha256(["cat", "f"])
    assert second["stdout"]["sha256"] == sha("one\n")


def test_a_run_that_raises_is_recorded_as_an_exec_error() -> None:
    with Runner() as runner, pytest.raises(WorkspacePathError) as info:
        runner.run("true", files={"../outside.txt": "x"})
    (rec,) = events()
    assert rec["event"] == "exec.error" and rec["error"]["type"] == "WorkspacePathError"
    assert rec["error"]["message"] == info.value.message and rec["files"]["../outside.txt"]["bytes"] == 1


def test_a_one_shot_whose_removal_fails_has_its_record_on_disk_before_the_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-shot's record is written while its sandbox is removed: a removal that fails must not lose it."""
    async def failing_close(self: HostWorkspaceSession) -> None:
        raise OSError("the removal failed")

    append = audit.AuditLog._append

    def slowly(self: audit.AuditLog, *args: Any) -> None:
        time.sleep(0.3)  # a slow disk: the record is still being written when the removal fails
        append(self, *args)

    monkeypatch.setattr(HostWorkspaceSession, "close", failing_close)
    monkeypatch.setattr(audit.AuditLog, "_append", slowly)
    # What a backend lets out is a SandboxError naming it (runner.backend_errors), its removal's failure included.
    with Runner() as runner, pytest.raises(SandboxError, match="OSError: the removal failed"):
        runner.run("echo hi")
    (rec,) = events()
    assert rec["event"] == "exec" and rec["stdout"]["sha256"] == sha("hi\n")


def test_a_one_shot_cancelled_while_its_record_is_written_ends_after_the_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    writing = threading.Event()
    append = audit.AuditLog._append

    def slowly(self: audit.AuditLog, *args: Any) -> None:
        writing.set()
        time.sleep(0.3)
        append(self, *args)

    monkeypatch.setattr(audit.AuditLog, "_append", slowly)

    async def cancelled_while_writing() -> list[dict[str, Any]]:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:
                async def cancel_once_writing() -> None:
                    await anyio.to_thread.run_sync(writing.wait, 20)
                    scope.cancel()

                tasks.start_soon(cancel_once_writing)
                await execbox.arun("echo hi")
        assert scope.cancelled_caught
        return events()  # read the moment the cancelled run gave way

    (rec,) = anyio.run(cancelled_while_writing)
    assert rec["event"] == "exec" and rec["stdout"]["sha256"] == sha("hi\n")


def test_a_guard_refusal_is_recorded_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_LOCAL", "false")
    with Runner() as runner, pytest.raises(NotASandboxError) as info:
        runner.run(["true"], env={"GREETING": "hi", "TOKEN": "secret-value"})
    (rec,) = events()
    assert rec["event"] == "refused" and rec["oneshot"] is True and rec["backend"] == "local_subprocess"
    assert rec["error"]["type"] == "NotASandboxError" and rec["error"]["message"] == info.value.message
    assert rec["argv_sha256"] == audit_fields.argv_sha256(["true"])
    assert rec["env"] == {"passed": ["GREETING"], "dropped": ["TOKEN"]}
    assert "secret-value" not in log_path().read_text()


def test_a_session_refusal_is_recorded() -> None:
    with Runner() as runner, runner.sandbox() as sb:
        with pytest.raises(UnsupportedPolicyError):
            sb.exec("true", network="none")
        sid = sb.aio.id
    refused = events("refused")
    assert len(refused) == 1 and refused[0]["session"] == sid and "cannot change it" in refused[0]["error"]["message"]


def test_a_refused_session_open_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_LOCAL", "false")
    runner = Runner()
    sandbox = runner.sandbox()
    with pytest.raises(NotASandboxError):
        sandbox.__enter__()
    (rec,) = events()
    assert rec["event"] == "refused" and rec["session"] == sandbox.aio.id and rec["oneshot"] is False
    assert "argv_sha256" not in rec  # the runner's probe is not the caller's command
    runner.close()


def test_egress_attempts_of_a_run_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = [EgressAttempt(host="pypi.org", port=443, allowed=True, reason="in the allowlist",
                              address="151.101.0.223", bytes_sent=517, bytes_received=4096),
                EgressAttempt(host="169.254.169.254", port=80, allowed=False, reason="a link-local address")]
    original = HostWorkspaceSession.exec

    async def with_egress(self: HostWorkspaceSession, spec: Any) -> ExecResult:
        result = await original(self, spec)
        return result.model_copy(update={"egress": attempts})

    monkeypatch.setattr(HostWorkspaceSession, "exec", with_egress)
    with Runner() as runner:
        runner.run("true")
    (rec,) = events("exec")
    assert rec["egress"] == [a.model_dump() for a in attempts]
    assert "egress=2 (1 denied)" in audit_reader.summary(rec)


def test_approvals_and_delegation_through_the_record_api() -> None:
    with Runner() as runner:
        with audit_fields.caller("mcp:claude-desktop", "agent:planner"), audit_fields.caller("agent:coder"):
            assert runner.audit.record("approval.request", tool="run", command_sha256=sha("rm -rf /")) is None
            assert runner.audit.record("approval.decision", tool="run", approved=False, by="user") is None
            runner.run("true")
        runner.run("true")
    request, decision, delegated, plain = events()
    chain = ["mcp:claude-desktop", "agent:planner", "agent:coder"]
    assert request["event"] == "approval.request" and request["caller"]["chain"] == chain
    assert decision["approved"] is False and decision["caller"]["chain"] == chain
    assert delegated["event"] == "exec" and delegated["caller"]["chain"] == chain
    assert "chain" not in plain["caller"]
    assert audit_reader.verify(log_path()).ok


def test_a_write_failure_is_a_note_on_the_result_and_the_run_returns(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("CODE_EXEC_AUDIT_LOG", str(blocker / "audit.jsonl"))
    with Runner() as runner, pytest.warns(RuntimeWarning, match="NOT recorded"):
        result = runner.run("echo still here")
    assert result.ok and result.stdout == "still here\n"
    assert any("audit log: this exec was NOT recorded" in note for note in result.notes)
    health = audit.health(runner.audit)
    assert health["failures"] == 1 and health["problems"]


def test_a_keyed_runner_writes_an_hmac_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_AUDIT_KEY", "k" * 32)
    with Runner() as runner:
        runner.run("true")
    (rec,) = events()
    assert rec["alg"] == "hmac-sha256"
    assert audit_reader.verify(log_path(), b"k" * 32).ok and not audit_reader.verify(log_path(), b"wrong").ok


WORKER = textwrap.dedent("""
    import sys
    from execbox import Runner, Settings
    with Runner(Settings(backend="local_subprocess", local=True, network="host")) as runner:
        for i in range(int(sys.argv[1])):
            result = runner.run(["true"])
            assert result.ok and not result.notes, result
""")


def test_eight_processes_of_fifty_runs_leave_one_valid_chain(tmp_path: Path) -> None:
    env = {**os.environ, "CODE_EXEC_AUDIT_MAX_BYTES": str(64 << 10)}  # rotations happen under contention too
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, "50"], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(8)]
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err.decode()
    report = audit_reader.verify(log_path())
    assert report.ok, report.problem
    execs = events("exec")
    assert len(execs) == 400 and report.records == 400 and report.files > 1
    assert {r["caller"]["pid"] for r in execs} == {w.pid for w in workers}
    assert [r["seq"] for r in audit_reader.records(log_path())] == list(range(1, 401))
    assert all(json.loads(line) for f in audit.log_files(log_path()) for line in f.read_text().splitlines())
