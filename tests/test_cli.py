"""The execbox CLI: run (--json, exit statuses, --env, --workdir, stdin), backends --json, doctor --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from execbox.cli import main
from tests.support.fakes_plugin import DISTRIBUTION, FakeDown
from tests.support.fixtures import (  # noqa: F401  (fixtures)
    fake_backends,
    fake_dists,
    fresh_registry,
    home,
    local_mode,
    only_local_builtin,
    workspaces,
)

LOCAL = ["--backend", "local_subprocess"]


def cli(*args: str, input: bytes | str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def error_of(result: Result) -> dict:
    data = json.loads(result.stdout)
    assert set(data) == {"error"}
    assert {"type", "message", "retryable"} <= set(data["error"])
    return data["error"]


@pytest.fixture(autouse=True)
def _registry(fake_backends: object, home: Path) -> None:
    """local_subprocess plus the fakes; a HOME of the test's own for the seed scan."""


class TestRun:
    def test_the_commands_own_exit_status_and_output(self, local_mode: None) -> None:
        result = cli("run", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
        assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")

    def test_json_prints_the_result_object(self, local_mode: None) -> None:
        result = cli("run", "--json", "--", "sh", "-c", "echo hi; exit 3")
        data = json.loads(result.stdout)
        assert result.exit_code == 3
        assert (data["exit_code"], data["stdout"], data["backend"], data["timed_out"]) == (
            3, "hi\n", "local_subprocess", False)
        assert set(data) >= {"exit_code", "stdout", "stderr", "timed_out", "truncated", "oom_killed", "duration_s",
                             "backend", "filtered_env"}

    def test_stdin_is_bounded_and_a_larger_one_refused_not_cut(self, local_mode: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_MAX_STDIN_BYTES", "10")
        assert cli("run", "--stdin", "--", "wc", "-c", input=b"x" * 10).stdout.strip() == "10"
        refused = cli("run", "--json", "--stdin", "--", "wc", "-c", input=b"x" * 11)
        assert refused.exit_code == 2
        assert error_of(refused)["env_var"] == "CODE_EXEC_MAX_STDIN_BYTES"

    def test_code_and_language(self, local_mode: None) -> None:
        assert cli("run", "--code", "print(6 * 7)").stdout == "42\n"
        assert cli("run", "--language", "bash", "--code", "echo $((6 * 7))").stdout == "42\n"

    def test_stdin_is_passed_through_with_the_flag(self, local_mode: None) -> None:
        result = cli("run", "--stdin", "--", "cat", input=b"piped \xc3\xa9 data")
        assert (result.exit_code, result.stdout) == (0, "piped é data")

    def test_stdin_is_not_read_without_the_flag(self, local_mode: None) -> None:
        result = cli("run", "--", "sh", "-c", "cat; echo end", input=b"not for the command")
        assert (result.exit_code, result.stdout) == (0, "end\n")

    def test_env_name_value_reaches_the_command_and_secrets_are_dropped(self, local_mode: None) -> None:
        result = cli("run", "--json", "--env", "GREETING=hi=there", "--env", "GITHUB_TOKEN=ghp_s3cr3tvalue",
                     "--", "sh", "-c", 'echo "$GREETING|${GITHUB_TOKEN:-unset}"')
        data = json.loads(result.stdout)
        assert data["stdout"] == "hi=there|unset\n" and data["filtered_env"] == ["GITHUB_TOKEN"]
        assert "ghp_s3cr3tvalue" not in result.stdout + result.stderr

    def test_timeout_exits_124(self, local_mode: None) -> None:
        result = cli("run", "--timeout", "0.3", "--", "sleep", "10")
        assert result.exit_code == 124 and "timed out" in result.stderr
        result = cli("run", "--json", "--timeout", "0.3", "--", "sleep", "10")
        assert result.exit_code == 124 and json.loads(result.stdout)["timed_out"] is True

    def test_output_cap(self, local_mode: None) -> None:
        result = cli("run", "--json", "--max-output-bytes", "100", "--", "python3", "-c", "print('x' * 10000)")
        data = json.loads(result.stdout)
        assert data["truncated"] and data["stdout"].startswith("x" * 50 + "\n[... execbox: 9901 bytes omitted")

    def test_workdir_under_the_workspace(self, local_mode: None) -> None:
        # --code places its file under .execbox/, so that directory exists.
        result = cli("run", "--workdir", ".execbox", "--code", "import os; print(os.getcwd())")
        assert result.exit_code == 0 and result.stdout.strip().endswith("/.execbox")

    def test_a_new_workdir_works(self, local_mode: None) -> None:
        result = CliRunner().invoke(main, ["run", "--workdir", "sub", "--", "pwd"])
        assert result.exit_code == 0 and result.stdout.strip().endswith("/sub")

    def test_a_workdir_escaping_the_workspace_is_not_exit_1(self, local_mode: None) -> None:
        result = cli("run", "--json", "--workdir", "../..", "--", "true")
        assert result.exit_code in (2, 125)
        assert error_of(result)["type"] == "WorkspacePathError"

    def test_refused_not_a_sandbox_exits_125(self, home: Path) -> None:
        result = cli("run", *LOCAL, "--network", "host", "--", "true")
        assert result.exit_code == 125
        assert "NotASandboxError" in result.stderr and "local_subprocess" in result.stderr
        assert "CODE_EXEC_LOCAL" in result.stderr and result.stdout == ""

    def test_refused_as_json(self) -> None:
        result = cli("run", *LOCAL, "--json", "--network", "host", "--", "true")
        error = error_of(result)
        assert result.exit_code == 125
        assert (error["type"], error["retryable"]) == ("NotASandboxError", False)
        assert "CODE_EXEC_LOCAL" in error["message"]

    def test_refused_policy_exits_125(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_LOCAL", "true")
        result = cli("run", *LOCAL, "--json", "--", "true")  # network none, which local_subprocess cannot enforce
        assert result.exit_code == 125 and error_of(result)["type"] == "UnsupportedPolicyError"

    def test_a_wallet_seed_exits_125_without_showing_it(self, local_mode: None, home: Path) -> None:
        from tests.guard.test_secrets import mnemonic

        seed = mnemonic(12)  # at most one repeated word: what the scanner flags
        (home / ".env").write_text(f"MNEMONIC={seed}\n")
        for args in (("run", "--", "true"), ("run", "--json", "--", "true")):
            result = cli(*args)
            assert result.exit_code == 125
            assert str(home / ".env") in result.stdout + result.stderr
            assert seed not in result.stdout + result.stderr
        assert error_of(result)["type"] == "SecretFileError"

    def test_unavailable_exits_126_and_says_not_to_retry(self) -> None:
        result = cli("run", "--backend", "fake_down", "--", "true")
        assert result.exit_code == 126 and "not retry" in result.stderr and FakeDown.FIX in result.stderr
        result = cli("run", "--backend", "fake_down", "--json", "--", "true")
        error = error_of(result)
        assert result.exit_code == 126
        assert (error["type"], error["retryable"]) == ("BackendUnavailableError", False)
        assert FakeDown.REASON in error["message"] and "not retry" in error["message"]

    def test_auto_says_which_backend_it_picked(self) -> None:
        result = cli("run", "--", "echo", "hi")
        assert result.exit_code == 0 and result.stdout == "hi\n"
        assert "using backend fake_sandbox" in result.stderr

    @pytest.mark.parametrize(
        "args",
        [
            ["run"],
            ["run", "--code", "print(1)", "--", "true"],
            ["run", "--env", "NOEQUALS", "--", "true"],
            ["run", "--env", "=value", "--", "true"],
            ["run", "--network", "lan", "--", "true"],
            ["run", "--timeout", "0", "--", "true"],
            ["run", "--language", "ruby", "--code", "1"],
        ],
        ids=["no command", "command and --code", "env without =", "env without name", "network", "timeout", "language"],
    )
    def test_usage_errors_exit_2(self, local_mode: None, args: list[str]) -> None:
        result = cli(*args)
        assert result.exit_code == 2 and result.stdout == ""
        assert "Usage:" in result.stderr

    def test_an_invalid_setting_exits_2_naming_the_variable(self, local_mode: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_NETWORK", "foo")
        result = cli("run", "--json", "--", "true")
        error = error_of(result)
        assert result.exit_code == 2 and error["type"] == "ConfigError" and "CODE_EXEC_NETWORK" in error["message"]

    def test_an_unknown_backend_exits_2(self, local_mode: None) -> None:
        result = cli("run", "--backend", "nope", "--", "true")
        assert result.exit_code == 2 and "unknown backend 'nope'" in result.stderr


class TestBackends:
    def test_json_rows(self) -> None:
        result = cli("backends", "--json")
        assert result.exit_code == 0
        rows = {row["name"]: row for row in json.loads(result.stdout)}
        assert sorted(rows) == ["fake_down", "fake_namespace", "fake_sandbox", "local_subprocess"]
        for row in rows.values():
            assert {"name", "distribution", "available", "reason", "capabilities"} <= set(row)
            assert {"sandbox", "isolation", "network_modes", "limits", "persistent_sessions", "file_transfer",
                    "remote"} <= set(row["capabilities"])
        local = rows["local_subprocess"]
        assert (local["distribution"], local["available"], local["reason"]) == ("execbox", True, None)
        assert local["capabilities"]["sandbox"] is False and local["capabilities"]["network_modes"] == ["host"]
        down = rows["fake_down"]
        assert (down["distribution"], down["available"]) == (DISTRIBUTION, False)
        assert (down["reason"], down["fix"]) == (FakeDown.REASON, FakeDown.FIX)

    def test_text_says_why_and_how_to_fix(self) -> None:
        result = cli("backends")
        assert result.exit_code == 0
        assert f"why: {FakeDown.REASON}" in result.stdout and f"fix: {FakeDown.FIX}" in result.stdout
        assert "local_subprocess" in result.stdout and "[execbox]" in result.stdout

    def test_a_broken_plugin_is_a_warning_not_a_crash(self, fake_dists: object) -> None:
        fake_dists.add("broken-plugin", source="raise ImportError('missing dependency xyz')\n")  # type: ignore[attr-defined]
        with pytest.warns(Warning, match="broken-plugin"):
            result = cli("backends", "--json")
        assert result.exit_code == 0 and "local_subprocess" in result.stdout


class TestDoctor:
    def test_lists_the_variables_of_execbox_and_of_each_backend(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_MEMORY_MB", "512")
        report = json.loads(cli("doctor", "--json").stdout)
        core = {v["variable"]: v for v in report["settings"]}
        assert core["CODE_EXEC_MEMORY_MB"]["set"] == "512" and core["CODE_EXEC_MEMORY_MB"]["default"] == 1024
        assert core["CODE_EXEC_CPUS"]["set"] is None
        assert all(row["settings"] == [] for row in report["backends"])  # the fakes declare no settings model

    def test_self_check_catches_a_backend_that_only_claims_to_be_a_sandbox(self,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_BACKEND", "fake_sandbox")  # a host process that claims container isolation
        # The boundary's checks and one claim it keeps, not the whole kit (~30 s; the conformance suites run it)
        claims = ("sandbox_host_files_hidden", "sandbox_host_processes_hidden", "sandbox_not_host_root",
                  "exit_codes_are_data")
        result = cli("doctor", "--json", "--self-check", *(f"--check={name}" for name in claims))
        report = json.loads(result.stdout)
        assert sorted(c["name"] for c in report["self_check"]) == sorted(claims)
        failed = {c["name"] for c in report["self_check"] if c["status"] == "fail"}
        assert {"sandbox_host_files_hidden", "sandbox_host_processes_hidden"} <= failed
        assert "exit_codes_are_data" not in failed
        assert ("sandbox_not_host_root" in failed) == (os.geteuid() == 0)
        assert all(c["backend"] == "fake_sandbox" for c in report["self_check"])
        assert result.exit_code == 1 and report["ok"] is False

    def test_only_local_subprocess_is_not_ok(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tests.support import fixtures as support

        monkeypatch.setattr(support.plugins, "entry_points", lambda *, group: [])
        result = cli("doctor", "--json")
        report = json.loads(result.stdout)
        assert result.exit_code == 1 and report["ok"] is False and report["selected_backend"] is None
        (local,) = report["backends"]
        assert local["name"] == "local_subprocess" and local["available"] is True
        assert local["sandbox_here"] is False and local["guard_admits"] is False
        assert "CODE_EXEC_LOCAL" in local["guard_verdict"]

    def test_local_mode_admits_local_subprocess_but_it_is_still_no_sandbox(self, local_mode: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
        from tests.support import fixtures as support

        monkeypatch.setattr(support.plugins, "entry_points", lambda *, group: [])
        result = cli("doctor", "--json")
        report = json.loads(result.stdout)
        assert result.exit_code == 1 and report["ok"] is False and report["local_mode"] is True
        (local,) = report["backends"]
        assert local["guard_admits"] is True and "not a sandbox" in local["guard_verdict"]

    def test_a_sandbox_that_runs_here_is_ok(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_BACKEND", "fake_sandbox")
        result = cli("doctor", "--json")
        report = json.loads(result.stdout)
        assert result.exit_code == 0 and report["ok"] is True and report["selected_backend"] == "fake_sandbox"
        rows = {row["name"]: row for row in report["backends"]}
        assert rows["fake_sandbox"]["sandbox_here"] and rows["fake_sandbox"]["guard_admits"]
        assert rows["fake_sandbox"]["distribution"] == DISTRIBUTION
        assert not rows["fake_down"]["available"] and rows["fake_down"]["fix"] == FakeDown.FIX
        assert rows["fake_down"]["sandbox_here"] is False
        # Default network none: local_subprocess is refused for not being a sandbox before the policy is asked.
        assert rows["local_subprocess"]["guard_admits"] is False
        assert report["plugin_problems"] == []

    def test_text_report(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_BACKEND", "fake_sandbox")
        result = cli("doctor")
        assert result.exit_code == 0
        assert "ok: a sandbox backend can run here" in result.stdout
        assert f"fix: {FakeDown.FIX}" in result.stdout

    def test_auto_reports_the_backend_it_would_select(self) -> None:
        result = cli("doctor", "--json")
        report = json.loads(result.stdout)
        assert result.exit_code == 0 and report["selected_backend"] == "fake_sandbox"

    def test_a_broken_plugin_is_listed_as_a_problem(self, fake_dists: object, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_BACKEND", "fake_sandbox")
        fake_dists.add("broken-plugin", source="raise ImportError('missing dependency xyz')\n")  # type: ignore[attr-defined]
        with pytest.warns(Warning, match="broken-plugin"):
            result = cli("doctor", "--json")
        problems = json.loads(result.stdout)["plugin_problems"]
        assert len(problems) == 1 and "broken-plugin" in problems[0] and "missing dependency xyz" in problems[0]


def test_the_installed_script_with_the_real_registry(tmp_path: Path) -> None:
    """The venv's `execbox` script, in a clean process with the registry as installed (other backends may
    be there too: only the local_subprocess row and the structure are checked)."""
    script = Path(sys.executable).with_name("execbox")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_"))}
    env["HOME"] = str(tmp_path)
    refused = subprocess.run([str(script), "run", "--json", "--backend", "local_subprocess", "--network", "host",
                              "--", "true"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert refused.returncode == 125
    assert json.loads(refused.stdout)["error"]["type"] == "NotASandboxError"
    listed = subprocess.run([str(script), "backends", "--json"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["local_subprocess"]["distribution"] == "execbox" and rows["local_subprocess"]["available"] is True
    for row in rows.values():
        assert {"name", "distribution", "available", "reason", "capabilities"} <= set(row)
        assert row["available"] or row["reason"], row


class TestSecondReviewEdges:
    def test_timeout_message_names_the_timeout_that_applied(self, local_mode: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_MAX_TIMEOUT_SEC", "0.5")
        result = cli("run", "--timeout", "100", "--", "sleep", "10")
        assert result.exit_code == 124 and "timed out after 0.5s" in result.stderr

    def test_usage_errors_under_json_are_one_json_object(self, local_mode: None) -> None:
        result = cli("run", "--json", "--env", "NOEQUALS", "--", "true")
        assert result.exit_code == 2 and error_of(result)["type"] == "UsageError"
        result = cli("run", "--json")
        assert result.exit_code == 2 and "--code" in error_of(result)["message"]

    def test_json_errors_carry_the_variable_to_set(self, monkeypatch: pytest.MonkeyPatch) -> None:
        result = cli("run", "--json", "--backend", "local_subprocess", "--", "true")
        assert result.exit_code == 125 and error_of(result)["env_var"] == "CODE_EXEC_LOCAL"

    def test_gc_of_an_unknown_backend_is_a_usage_error(self) -> None:
        assert cli("gc", "--backend", "nope").exit_code == 2

    def test_an_operator_limit_refusal_names_the_variable(self, local_mode: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_CPUS", "0.5")
        result = cli("run", "--json", "--", "true")
        error = error_of(result)
        assert result.exit_code == 125 and error["env_var"] == "CODE_EXEC_CPUS" and "CODE_EXEC_CPUS" in error["message"]


def test_sigterm_to_the_cli_cleans_up_like_ctrl_c(tmp_path: Path) -> None:
    """timeout(1), systemd and kubernetes stop programs with SIGTERM: the run's processes and workspace go too."""
    import signal
    import time
    import uuid

    import psutil

    marker = f"execbox-sigterm-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_"))}
    env.update(CODE_EXEC_LOCAL="true", CODE_EXEC_NETWORK="host", TMPDIR=str(tmp_path))
    proc = subprocess.Popen([str(Path(sys.executable).with_name("execbox")), "run", "--backend", "local_subprocess",
                             "--", "python3", "-c", "import time; time.sleep(60)", marker],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def running() -> list[int]:  # the sandboxed command itself (the CLI's own argv holds the marker too)
        return [p.pid for p in psutil.process_iter(["cmdline"])
                if (p.info["cmdline"] or [])[:2] == ["python3", "-c"] and marker in p.info["cmdline"]]

    deadline = time.monotonic() + 30
    while not running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(), "the command never started"
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    time.sleep(0.5)
    assert running() == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("execbox-")] == []


class TestAudit:
    """`execbox audit verify/show`, and what run, gc and doctor do with the audit log."""

    @staticmethod
    def log() -> Path:
        return Path(os.environ["XDG_STATE_HOME"]) / "execbox" / "audit.jsonl"

    def test_verify_passes_after_runs_and_names_an_edited_record(self, local_mode: None) -> None:
        for word in ("one", "two", "three"):
            assert cli("run", *LOCAL, "--", "echo", word).exit_code == 0
        ok = cli("audit", "verify")
        assert ok.exit_code == 0 and "intact: 3 records" in ok.stdout
        lines = self.log().read_text().splitlines(keepends=True)
        lines[1] = lines[1].replace('"exit_code":0', '"exit_code":1')
        self.log().write_text("".join(lines))
        bad = cli("audit", "verify", "--json")
        report = json.loads(bad.stdout)
        assert bad.exit_code == 1 and report["ok"] is False
        assert report["problem"].startswith("record seq 2 (audit.jsonl:2) was edited")

    def test_verify_a_log_given_by_path_names_a_truncation(self, local_mode: None, tmp_path: Path) -> None:
        for _ in range(3):
            cli("run", *LOCAL, "--", "true")
        copy = tmp_path / "copy.jsonl"
        copy.write_text("".join(self.log().read_text().splitlines(keepends=True)[:2]))
        copy.with_name("copy.jsonl.head").write_bytes(self.log().with_name("audit.jsonl.head").read_bytes())
        result = cli("audit", "verify", "--log", str(copy))
        assert result.exit_code == 1 and "truncated" in result.stderr and "seq 3" in result.stderr

    def test_verify_an_hmac_log_without_the_key_is_not_a_pass(self, local_mode: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_AUDIT_KEY", "s3cret-key")
        cli("run", *LOCAL, "--", "true")
        assert cli("audit", "verify").exit_code == 0
        monkeypatch.delenv("CODE_EXEC_AUDIT_KEY")
        result = cli("audit", "verify")
        assert result.exit_code == 2 and "NOT checked" in result.stderr

    def test_show_filters_by_session_and_since(self, local_mode: None) -> None:
        cli("run", *LOCAL, "--", "true")
        cli("run", *LOCAL, "--", "false")
        records = [json.loads(line) for line in cli("audit", "show", "--json").stdout.splitlines()]
        assert [r["exit_code"] for r in records] == [0, 1]
        only = cli("audit", "show", "--json", "--session", records[1]["session"]).stdout.splitlines()
        assert [json.loads(line)["seq"] for line in only] == [2]
        assert cli("audit", "show", "--since", "1h").stdout.count(" exec ") == 2
        assert cli("audit", "show", "--since", "2999-01-01").stdout == ""
        text = cli("audit", "show").stdout.splitlines()
        assert "exit=1" in text[1] and "backend=local_subprocess" in text[1]
        bad = cli("audit", "show", "--since", "yesterday-ish")
        assert bad.exit_code == 2 and "--since" in bad.stderr

    def test_a_refused_run_is_in_the_log(self, home: Path) -> None:
        assert cli("run", *LOCAL, "--", "true").exit_code == 125
        (line,) = cli("audit", "show").stdout.splitlines()
        assert "refused" in line and "NotASandboxError" in line

    def test_gc_records_what_it_removed(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from execbox.backends.local_subprocess import LocalSubprocessBackend

        async def removed(self: LocalSubprocessBackend) -> list[str]:
            return ["execbox-local-123-456-abc", "execbox-local-789-012-def"]

        monkeypatch.setattr(LocalSubprocessBackend, "gc", removed)
        assert cli("gc", "--backend", "local_subprocess").exit_code == 0
        (record,) = [json.loads(line) for line in cli("audit", "show", "--json").stdout.splitlines()]
        assert record["event"] == "gc" and record["backend"] == "local_subprocess"
        assert record["removed"] == ["execbox-local-123-456-abc", "execbox-local-789-012-def"]

    def test_doctor_warns_when_the_log_is_off(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_AUDIT_LOG", "off")
        assert "warning: the audit log is off" in cli("doctor").stdout
        audit = json.loads(cli("doctor", "--json").stdout)["audit"]
        assert audit["enabled"] is False and audit["problems"]
        assert cli("audit", "verify").exit_code == 2

    def test_doctor_reports_a_failed_write_and_never_prints_the_key(self, local_mode: None, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("CODE_EXEC_AUDIT_LOG", str(tmp_path / "file" / "audit.jsonl"))
        monkeypatch.setenv("CODE_EXEC_AUDIT_KEY", "do-not-print-me")
        with pytest.warns(RuntimeWarning):
            result = cli("run", *LOCAL, "--", "echo", "hi")
        assert result.exit_code == 0 and result.stdout == "hi\n"
        assert "note: audit log: this exec was NOT recorded" in result.stderr
        text = cli("doctor").stdout
        assert "audit write(s) failed" in text and "cannot be written" in text
        assert "do-not-print-me" not in text and "do-not-print-me" not in cli("doctor", "--json").stdout
