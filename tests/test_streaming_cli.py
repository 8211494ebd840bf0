"""`execbox run` streams (issue 15): without --json the output is printed as it arrives (stdout to stdout,
stderr to stderr), --jsonl prints one event per line then the result, --json keeps one object at the end.
"As it arrives" is proven by a handshake: the command waits for a file this test creates only after it read
the command's first line from the CLI's stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_"))}
    env.update(CODE_EXEC_LOCAL="true", CODE_EXEC_BACKEND="local_subprocess", CODE_EXEC_NETWORK="host",
               XDG_STATE_HOME=str(tmp_path / "state"))
    return env


def handshake(go: Path) -> str:
    return (f'echo ready; i=0; while [ ! -e {go} ] && [ "$i" -lt 150 ]; do sleep 0.1; i=$((i+1)); done; '
            f'[ -e {go} ] && echo got-go || echo no-go; echo done >&2')


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "execbox.cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(tmp_path))


def test_run_prints_the_output_as_it_arrives(tmp_path: Path) -> None:
    go = tmp_path / "go"
    proc = start(tmp_path, "--", "/bin/sh", "-c", handshake(go))
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"  # read while the command still runs: it waits for the file
    go.touch()
    out, err = proc.communicate(timeout=60)
    assert (out, proc.returncode) == ("got-go\n", 0), err
    assert err.endswith("done\n")


def test_jsonl_streams_events_then_the_result(tmp_path: Path) -> None:
    go = tmp_path / "go"
    proc = start(tmp_path, "--jsonl", "--", "/bin/sh", "-c", handshake(go))
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == {"type": "stdout", "text": "ready\n"}
    go.touch()
    out, _ = proc.communicate(timeout=60)
    lines = [json.loads(line) for line in out.splitlines()]
    assert {"type": "stdout", "text": "got-go\n"} in lines and {"type": "stderr", "text": "done\n"} in lines
    result = lines[-1]
    assert result["type"] == "result" and result["stdout"] == "ready\ngot-go\n" and result["exit_code"] == 0
    assert proc.returncode == 0


def test_over_the_cap_the_terminal_shows_exactly_the_results_text(tmp_path: Path) -> None:
    command = ["--max-output-bytes", "1000", "--", "/bin/sh", "-c", "head -c 300000 /dev/zero | tr '\\0' x; echo END"]
    text = subprocess.run([sys.executable, "-m", "execbox.cli", "run", *command], capture_output=True, text=True,
                          env=cli_env(tmp_path), timeout=60)
    whole = subprocess.run([sys.executable, "-m", "execbox.cli", "run", "--json", *command], capture_output=True,
                           text=True, env=cli_env(tmp_path), timeout=60)
    result = json.loads(whole.stdout)
    assert result["truncated"] and "bytes omitted" in result["stdout"]
    assert text.stdout == result["stdout"] and text.returncode == whole.returncode == 0
    lines = subprocess.run([sys.executable, "-m", "execbox.cli", "run", "--jsonl", *command], capture_output=True,
                           text=True, env=cli_env(tmp_path), timeout=60).stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert [e for e in events if e["type"] == "dropped"] == [{"type": "dropped", "stream": "stdout"}]
    assert "".join(e["text"] for e in events if e["type"] == "stdout") == result["stdout"]


def test_json_keeps_one_object_at_the_end(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "execbox.cli", "run", "--json", "--", "/bin/sh", "-c",
                           "echo a; echo b >&2"], capture_output=True, text=True, env=cli_env(tmp_path), timeout=60)
    assert len(done.stdout.splitlines()) == 1
    assert json.loads(done.stdout)["stdout"] == "a\n" and json.loads(done.stdout)["stderr"] == "b\n"


@pytest.mark.parametrize(("args", "code"), [(["--json", "--jsonl"], 2), (["--jsonl", "--network", "none"], 125)])
def test_jsonl_errors_are_json_lines(tmp_path: Path, args: list[str], code: int) -> None:
    done = subprocess.run([sys.executable, "-m", "execbox.cli", "run", *args, "--", "true"], capture_output=True,
                          text=True, env=cli_env(tmp_path), timeout=60)
    assert done.returncode == code, done.stderr
    line = json.loads(done.stdout.splitlines()[-1])
    assert "error" in line and line["error"]["message"]
