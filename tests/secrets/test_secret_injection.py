"""Declared secrets through the runner, on local_subprocess: given to the command past the env policy,
redacted from stdout, stderr, streamed chunks, capped output, errors and the result; names only on the result
and in the audit log; refused when they cannot work. The real sandboxes: tests/backends/test_secrets_*.py."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import execbox
from execbox import ConfigError, Runner, SandboxError, Secret
from execbox.cli import main
from execbox.kit.sessions.host import HostWorkspaceSession
from execbox.secrets.values import Redactor, encodings
from tests.support.fixtures import (  # noqa: F401  (fixtures)
    home,
    local_mode,
)

KEY = "sk-proj-Zq81bXr4Tt0LmWv3"
NAME = "OPENAI_API_KEY"

USE = f"""
import base64, hashlib, os, sys
v = os.environ["{NAME}"]
print("match", hashlib.sha256(v.encode()).hexdigest())
print("raw", v)
print("b64", base64.b64encode(v.encode()).decode())
print("err", v, file=sys.stderr)
"""


def leaks(text: str | bytes, value: str = KEY) -> list[bytes]:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return [form for form in encodings(value) if form in data]


def test_a_script_gets_the_value_and_the_caller_sees_only_its_name(local_mode: None) -> None:
    with Runner() as runner:
        result = runner.run_code(USE, secrets={NAME: KEY}, env={"OTHER_API_KEY": KEY, "PLAIN": "1"})
    assert result.exit_code == 0, result.stderr
    assert f"match {hashlib.sha256(KEY.encode()).hexdigest()}" in result.stdout
    assert f"raw [secret {NAME}]" in result.stdout and f"b64 [secret {NAME}]" in result.stdout
    assert result.stderr == f"err [secret {NAME}]\n"
    assert result.secrets == [NAME]
    assert result.filtered_env == ["OTHER_API_KEY"]  # only a declared secret passes the env policy
    assert not leaks(result.model_dump_json())


def test_secrets_from_env_and_file_and_stdin_still_reaches_the_command(local_mode: None, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOST_TOKEN", KEY)
    (tmp_path / "key").write_text(KEY[::-1] + "\n")
    code = "import os, sys; print(os.environ['A'] == os.environ['B'][::-1], sys.stdin.read())"
    secrets = {"A": Secret.from_env("HOST_TOKEN"), "B": Secret.from_file(tmp_path / "key")}
    result = execbox.run_code(code, secrets=secrets, stdin="the input")
    assert result.stdout == "True the input\n", result.stderr
    assert result.secrets == ["A", "B"]


@pytest.mark.parametrize("bad, says", [
    ({NAME: "short"}, "at least 8 bytes"), ({"9LIVES": KEY}, "letters, digits"), ({"LD_PRELOAD": KEY}, "loader"),
    ({"A": 12345678}, "give a str"), ("A=x", "mapping"),
])
def test_secrets_that_cannot_work_are_a_config_error_that_never_repeats_the_value(local_mode: None, bad: object,
                                                                                  says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        execbox.run("true", secrets=bad)
    assert KEY not in info.value.message and "'short'" not in info.value.message


def test_a_name_given_as_env_and_secret_is_refused(local_mode: None) -> None:
    with pytest.raises(ConfigError, match="given more than once"):
        execbox.run("true", env={"TOKEN_X": "1"}, secrets={"TOKEN_X": KEY})


def test_a_value_split_over_streamed_chunks_is_still_redacted(local_mode: None) -> None:
    half = len(KEY) // 2
    code = (f"import os, sys, time\nv = os.environ['{NAME}']\nfor i in range(3):\n"
            f"    sys.stdout.write('x' + v[:{half}]); sys.stdout.flush(); time.sleep(0.05)\n"
            f"    sys.stdout.write(v[{half}:] + '\\n'); sys.stdout.flush(); time.sleep(0.05)\n")
    chunks: list[str] = []
    with Runner() as runner:
        result = runner.run_code(code, secrets={NAME: KEY}, on_stdout=chunks.append)
    assert "".join(chunks) == result.stdout == f"x[secret {NAME}]\n" * 3
    assert not any(leaks(c) for c in chunks)


def test_the_cap_keeps_no_fragment_and_the_marker_counts_the_redacted_stream(local_mode: None) -> None:
    code = f"import os\nv = os.environ['{NAME}']\nprint(('.' + v) * 300)\n"
    result = execbox.run_code(code, secrets={NAME: KEY}, max_output_bytes=101)
    assert result.truncated
    redacted = Redactor({NAME: KEY}).redact((("." + KEY) * 300 + "\n").encode())
    assert f"{len(redacted) - 101} bytes omitted" in result.stdout
    assert not any(KEY[i:i + 4] in result.stdout for i in range(len(KEY) - 3))


def test_a_backend_error_quoting_the_value_is_redacted(local_mode: None, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: HostWorkspaceSession, spec: object) -> None:
        raise SandboxError(f"the sandbox said: {KEY} and {base64.b64encode(KEY.encode()).decode()}")

    monkeypatch.setattr(HostWorkspaceSession, "exec", broken)
    with pytest.raises(SandboxError) as info:
        execbox.run("true", secrets={NAME: KEY})
    assert info.value.message == f"the sandbox said: [secret {NAME}] and [secret {NAME}]"
    assert KEY not in str(info.value)


def test_output_captured_outside_the_run_is_still_redacted_and_said(local_mode: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox.kit import processes as procs
    from execbox.kit.sessions import host as hostsession

    async def unredacted(*args: Any, **kw: Any) -> procs.ProcessOutcome:  # a backend capturing elsewhere
        return await procs.run_process(*args, **{**kw, "redactor": None})

    monkeypatch.setattr(hostsession, "run_process", unredacted)
    result = execbox.run_code(USE, secrets={NAME: KEY})
    assert f"raw [secret {NAME}]" in result.stdout and not leaks(result.stdout)
    assert any("redacted after the run" in note for note in result.notes)


def test_the_audit_log_has_the_names_and_never_a_value(local_mode: None) -> None:
    with Runner() as runner:
        runner.run_code(USE, secrets={NAME: KEY})
        path = Path(runner.audit.path)
    text = path.read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["secrets"] for r in records if r.get("event") == "exec"] == [[NAME]]
    assert not leaks(text)


def test_a_sandbox_gives_its_secrets_to_every_exec_and_an_exec_adds_its_own(local_mode: None) -> None:
    other = "another-secret-value-42"
    with execbox.sandbox(secrets={NAME: KEY}) as sb:
        first = sb.exec(f'echo "${NAME}"')
        second = sb.exec(f'echo "${NAME} $EXTRA"', secrets={"EXTRA": other})
        third = sb.exec('echo "${EXTRA:-unset}"')
    assert first.stdout == f"[secret {NAME}]\n" and first.secrets == [NAME]
    assert second.stdout == f"[secret {NAME}] [secret EXTRA]\n" and second.secrets == ["EXTRA", NAME]
    assert third.stdout == "unset\n"


def test_a_sandbox_refuses_bad_secrets_when_made() -> None:
    with pytest.raises(ConfigError, match="at least 8"):
        execbox.sandbox(secrets={NAME: "x"})


# --- the CLI ---


def test_cli_secret_from_the_environment_and_from_a_file(local_mode: None, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, KEY)
    (tmp_path / "tok").write_text(KEY[::-1] + "\n")
    result = CliRunner().invoke(main, ["run", "--secret", NAME, "--secret", f"TOK=@{tmp_path / 'tok'}", "--json", "--",
                                       "sh", "-c", f'echo "${NAME}"; [ "$TOK" = "{KEY[::-1]}" ] && echo file-ok'])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["stdout"] == f"[secret {NAME}]\nfile-ok\n" and out["secrets"] == [NAME, "TOK"]
    assert not leaks(result.output)


def test_cli_refuses_a_value_on_the_command_line_and_a_missing_variable(local_mode: None) -> None:
    result = CliRunner().invoke(main, ["run", "--secret", f"{NAME}={KEY}", "--", "true"])
    assert result.exit_code == 2 and "process listings" in result.output and KEY not in result.output
    result = CliRunner().invoke(main, ["run", "--secret", "NOT_SET_ANYWHERE_X", "--", "true"])
    assert result.exit_code == 2 and "not set" in result.output


def test_listings_and_collected_files_never_show_a_value(local_mode: None) -> None:
    with execbox.sandbox(secrets={NAME: KEY}) as sb:
        sb.exec(f'mkdir out && echo "$$" > "out/${NAME}.txt" && echo "key=${NAME}" > out/plain.txt')
        names = [(f.path, f.name) for f in sb.list_files("out")]
        collected = sb.exec("true", collect=["out/*"])
    assert sorted(names) == [(f"out/[secret {NAME}].txt", f"[secret {NAME}].txt"), ("out/plain.txt", "plain.txt")]
    assert sorted(collected.files) == [f"out/[secret {NAME}].txt", "out/plain.txt"]
    assert collected.files["out/plain.txt"] == f"key=[secret {NAME}]\n".encode()
    assert any("out/plain.txt" in note and "replaced" in note for note in collected.notes)
    assert not leaks(collected.model_dump_json())


def test_a_cell_reading_what_an_exec_left_is_redacted(local_mode: None) -> None:
    chunks: list[str] = []
    with execbox.sandbox(secrets={NAME: KEY}) as sb:
        sb.exec(f'echo "${NAME}" > left.txt')
        cell = sb.run_cell("print(open('left.txt').read().strip()); open('left.txt').read().strip()",
                           on_stdout=chunks.append)
    assert cell.stdout == f"[secret {NAME}]\n" and "".join(chunks) == cell.stdout
    assert f"[secret {NAME}]" in json.dumps([o.data for o in cell.outputs])  # the last expression's value
    assert not leaks(cell.model_dump_json())


PLANT = f"""
import os
os.makedirs("out", exist_ok=True)
v = os.environ["{NAME}"]
os.symlink(v, "out/link")   # a link whose target is the value: a download skips it and says why
os.mkfifo("out/" + v)       # a FIFO named after it
"""


def test_what_a_download_says_of_planted_files_never_shows_the_value(local_mode: None, tmp_path: Path) -> None:
    # Found attacking: the download's notes and Transfer.skipped quoted a link's target and a FIFO's name.
    with Runner() as runner:
        result = runner.run_code(PLANT, secrets={NAME: KEY}, download={"out": str(tmp_path / "one")})
        assert result.exit_code == 0, result.stderr
        assert any("download:" in note for note in result.notes), result.notes
        assert not leaks(result.model_dump_json())
        with runner.sandbox(secrets={NAME: KEY}) as sb:
            assert sb.run_code(PLANT).exit_code == 0
            moved = sb.download("out", tmp_path / "two")
            assert moved.skipped and not leaks(moved.model_dump_json())
    assert not leaks("\n".join(str(p) for p in tmp_path.rglob("*")))
