"""The runner: backend selection (auto, SHELL_BACKEND), files and workdir, sessions, timeouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from execbox import BackendUnavailableError, Runner, Settings, WorkspacePathError


@pytest.fixture(autouse=True)
def _home(home: Path) -> None:
    """Every run here scans a HOME the test owns."""


class TestAuto:
    def test_auto_picks_the_strongest_sandbox_that_can_run_here(self, fake_backends: object) -> None:
        # fake_down (container, unavailable) sorts first and is skipped; fake_sandbox (container) beats namespace.
        from tests.support.fakes_plugin import FakeDown

        runner = Runner(Settings.from_env())
        assert runner.run(["true"]).backend == "fake_sandbox"
        (passed,) = runner.aio.auto_passed_over  # says why, for doctor and run
        assert passed.startswith(f"fake_down: {FakeDown.REASON}") and FakeDown.FIX in passed

    def test_auto_never_picks_local_subprocess_outside_local_mode(self, only_local_builtin: None,
                                                                  fake_dists: object) -> None:
        with pytest.raises(BackendUnavailableError) as info:
            Runner(Settings.from_env(network="host")).run(["true"])
        exc = info.value
        assert exc.retryable is False and exc.env_var == "CODE_EXEC_BACKEND"
        assert "no sandbox backend can run here" in exc.message and "CODE_EXEC_LOCAL=true" in exc.message

    def test_auto_lists_every_sandbox_it_tried_with_its_fix(self, only_local_builtin: None, fake_dists: object,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
        import execbox.backends

        monkeypatch.setattr(execbox.backends, "BUILTIN_BACKENDS",
                            [*execbox.backends.BUILTIN_BACKENDS, "fake_down = tests.support.fakes_plugin:FakeDown"])
        from tests.support.fakes_plugin import FakeDown

        with pytest.raises(BackendUnavailableError) as info:
            Runner(Settings.from_env()).run(["true"])
        assert f"- fake_down: {FakeDown.REASON}" in info.value.message and FakeDown.FIX in info.value.message

    def test_auto_falls_back_to_local_subprocess_in_local_mode(self, only_local_builtin: None,
                                                               fake_dists: object) -> None:
        result = Runner(Settings.from_env(local=True, network="host")).run(["true"])
        assert result.backend == "local_subprocess"


def test_shell_backend_is_used_for_sessions_and_code_exec_backend_for_runs(fake_backends: object) -> None:
    runner = Runner(Settings.from_env(backend="fake_down", shell_backend="fake_sandbox"))
    with pytest.raises(BackendUnavailableError):
        runner.run(["true"])
    with runner.sandbox() as sb:
        assert sb.backend is not None and sb.backend.name == "fake_sandbox"


def test_a_session_without_shell_backend_uses_code_exec_backend(fake_backends: object) -> None:
    runner = Runner(Settings.from_env(backend="fake_down"))
    with pytest.raises(BackendUnavailableError):
        with runner.sandbox():
            pass


class TestRuns:
    @pytest.fixture
    def runner(self, fake_backends: object) -> Runner:
        return Runner(Settings.from_env(backend="local_subprocess", local=True, network="host", max_timeout_sec=5))

    def test_files_are_placed_and_workdir_is_relative_to_the_workspace(self, runner: Runner) -> None:
        result = runner.run("pwd; cat data.txt", files={"sub/data.txt": "42"}, workdir="sub")
        lines = result.stdout.splitlines()
        assert lines[0].endswith("/sub") and lines[1] == "42"

    def test_a_workdir_escaping_the_workspace_is_refused(self, runner: Runner) -> None:
        with pytest.raises(WorkspacePathError):
            runner.run(["pwd"], workdir="../..")

    def test_a_file_escaping_the_workspace_is_refused(self, runner: Runner, tmp_path: Path) -> None:
        with pytest.raises(WorkspacePathError):
            runner.run(["true"], files={"../escape.txt": "x"})
        with pytest.raises(WorkspacePathError):
            runner.run(["true"], files={str(tmp_path / "abs.txt"): "x"})
        assert not (tmp_path / "abs.txt").exists()

    def test_the_workspace_itself_is_a_workdir(self, runner: Runner) -> None:
        with runner.sandbox() as sb:
            workspace = sb.exec(["pwd"]).stdout.strip()
            for named in (".", "./", workspace, workspace + "/"):
                assert sb.exec(["pwd"], workdir=named).stdout.strip() == workspace, named

    def test_a_missing_workdir_is_created_inside_the_sandbox(self, runner: Runner) -> None:
        result = runner.run(["pwd"], workdir="new/dir")
        assert result.exit_code == 0 and result.stdout.strip().endswith("/new/dir")

    def test_stdin_and_exit_codes_are_data(self, runner: Runner) -> None:
        result = runner.run("cat; exit 3", stdin="from stdin")
        assert (result.exit_code, result.stdout, result.ok) == (3, "from stdin", False)

    def test_stdout_and_stderr_are_kept_apart(self, runner: Runner) -> None:
        result = runner.run_code("import sys; print('out'); print('err', file=sys.stderr)")
        assert (result.stdout, result.stderr, result.ok) == ("out\n", "err\n", True)

    def test_bash_code(self, runner: Runner) -> None:
        assert runner.run_code('echo "${BASH_VERSION:+bash}"', "bash").stdout == "bash\n"

    def test_the_timeout_is_clamped_to_the_maximum_and_kills_the_run(self, fake_backends: object) -> None:
        runner = Runner(Settings.from_env(backend="local_subprocess", local=True, network="host", max_timeout_sec=0.5))
        result = runner.run(["sleep", "30"], timeout=1000)
        assert result.timed_out and not result.ok
        assert result.duration_s < 10

    def test_a_session_keeps_its_workspace_between_execs_and_removes_it_at_close(self, runner: Runner) -> None:
        with runner.sandbox() as sb:
            sb.exec("echo made > made.txt")
            sb.write_file("in/put.bin", b"\x00\xff")
            assert sb.read_file("made.txt") == b"made\n"
            assert sb.exec(["od", "-An", "-tx1", "in/put.bin"]).stdout.split() == ["00", "ff"]
            workspace = sb.exec(["pwd"]).stdout.strip()
            with pytest.raises(WorkspacePathError):
                sb.read_file("../../etc/passwd")
            assert Path(workspace).is_dir()
        assert not Path(workspace).exists()

    def test_a_planted_symlink_is_not_followed_by_read_file(self, runner: Runner, tmp_path: Path) -> None:
        target = tmp_path / "host-secret.txt"
        target.write_text("host only")
        with runner.sandbox() as sb:
            sb.exec(["ln", "-s", str(target), "link.txt"])
            with pytest.raises(WorkspacePathError, match="symlink"):
                sb.read_file("link.txt")


class TestLimitsAreNeverSilentlyDropped:
    def test_a_limit_the_operator_set_is_a_demand(self, fake_backends: object) -> None:
        from execbox import UnsupportedPolicyError

        # fake_namespace enforces no memory limit: with CODE_EXEC_MEMORY_MB set by the operator it must refuse...
        with pytest.raises(UnsupportedPolicyError) as info:
            Runner(Settings.from_env(memory_mb=256)).run(["true"], backend="fake_namespace")
        assert "memory" in info.value.message
        # ...while the built-in default applies only where a backend can enforce it.
        assert Runner(Settings.from_env()).run(["true"], backend="fake_namespace").exit_code == 0

    def test_a_session_refuses_per_exec_limits_it_was_not_opened_with(self, fake_backends: object) -> None:
        from execbox import Limits, UnsupportedPolicyError

        runner = Runner(Settings.from_env())
        with runner.sandbox("fake_sandbox", limits=Limits(memory_mb=128)) as sb:
            assert sb.exec(["true"], limits=Limits(memory_mb=128)).exit_code == 0
            with pytest.raises(UnsupportedPolicyError) as info:
                sb.exec(["true"], limits=Limits(memory_mb=64))
            assert "another sandbox" in info.value.message


def test_auto_skips_a_backend_that_is_not_a_sandbox_as_configured(fake_backends: object,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox import ExecutionBackend, Verdict
    from tests.support.fakes_plugin import FakeSandbox

    def verdict(self: ExecutionBackend, request: object) -> Verdict:
        if self.name == "fake_sandbox":
            return Verdict(False, "configured to run as root")
        return ExecutionBackend.verdict(self, request)  # type: ignore[arg-type]

    monkeypatch.setattr(FakeSandbox, "verdict", verdict)
    result = Runner(Settings.from_env()).run(["true"])
    assert result.backend == "fake_namespace"


def test_a_planted_fifo_is_refused_on_write_without_hanging(tmp_path: Path) -> None:
    import os

    from execbox.files.workspace import safe_write

    os.mkfifo(tmp_path / "out.txt")
    with pytest.raises(WorkspacePathError):
        safe_write(str(tmp_path), "out.txt", b"data")
    safe_write(str(tmp_path), "dir/file.txt", b"long content")
    safe_write(str(tmp_path), "dir/file.txt", b"short")
    assert (tmp_path / "dir" / "file.txt").read_bytes() == b"short"
