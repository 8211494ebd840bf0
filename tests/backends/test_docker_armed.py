"""The docker one-shot's armed container: its shell stub (ARMED) runs exactly the script it was sent, with exactly
its words, environment and directory, refuses a script cut short, and leaves the command's stdin untouched; and
on the real engine the command's environment is not in the container's config."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execbox import Runner, SandboxError, Settings
from execbox.plugin import ARMED, armed_script
from tests.backends.test_docker import engine, no_leaks, ours  # noqa: F401 - fixtures

SH = shutil.which("sh") or "/bin/sh"
# Anything a process can be given: no NUL; surrogates are not text a caller can pass.
words = st.text(st.characters(blacklist_characters="\0", blacklist_categories=["Cs"]), max_size=40)
names = st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True)


def armed(data: bytes, workdir: str | None = None) -> subprocess.CompletedProcess[bytes]:
    """ARMED as the container runs it, here on the host's /bin/sh, fed ``data`` on stdin."""
    return subprocess.run([SH, "-c", ARMED], input=data, capture_output=True, timeout=30, cwd=workdir,
                          env={"PATH": os.environ["PATH"]})


@settings(max_examples=60, deadline=None)
@given(st.lists(words, max_size=6), st.dictionaries(names, words, max_size=4), st.binary(max_size=64))
def test_the_stub_runs_exactly_the_words_environment_and_stdin_it_was_sent(
        argv: list[str], env: dict[str, str], stdin: bytes) -> None:
    # printf prints each word NUL-terminated, env -0 the environment: both must round-trip exactly.
    with tempfile.TemporaryDirectory() as workdir:
        environment = {"PATH": os.environ["PATH"], **env}
        done = armed(armed_script(["printf", "%s\\0", "first", *argv], environment, workdir,
                                  backend="docker") + stdin)
        assert done.returncode == 0 and done.stdout.split(b"\0")[:-1] == [b"first", *(w.encode() for w in argv)]
        done = armed(armed_script(["env", "-0"], environment, workdir, backend="docker") + stdin)
        got = dict(item.split(b"=", 1) for item in done.stdout.split(b"\0") if item)
        assert got == {k.encode(): v.encode() for k, v in environment.items()}
        # and the command's stdin is what follows the script, in the directory asked for
        done = armed(armed_script(["sh", "-c", "pwd; cat"], {"PATH": os.environ["PATH"]}, workdir,
                                  backend="docker") + stdin)
        assert done.stdout == os.path.realpath(workdir).encode() + b"\n" + stdin


def test_a_script_cut_short_is_refused_and_nothing_of_it_runs(tmp_path: Any) -> None:
    marker = tmp_path / "ran"
    full = armed_script(["touch", str(marker)], {"PATH": os.environ["PATH"]}, str(tmp_path), backend="docker")
    length, script = full.split(b"\n", 1)
    for cut in (len(script) - 1, len(script) // 2, 1):
        done = armed(length + b"\n" + script[:cut])
        assert done.returncode == 125 and not marker.exists(), (cut, done)
    assert armed(b"").returncode == 0 and not marker.exists()  # closed before any command: nothing to run
    assert armed(full).returncode == 0 and marker.exists()  # the control: the whole script runs


def test_a_word_with_a_nul_byte_is_refused() -> None:
    with pytest.raises(SandboxError, match="NUL"):
        armed_script(["echo", "a\0b"], {}, "/workspace", backend="docker")


def test_the_commands_environment_is_not_in_the_containers_config(engine: Any) -> None:  # noqa: F811
    runner = Runner(Settings.from_env(backend="docker"))
    seen: list[list[str]] = []

    def watch() -> None:
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            for container in ours(engine):
                seen.append(container.attrs["Config"]["Env"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    result = runner.run("sleep 2; echo $ONLY_FOR_THE_RUN", env={"ONLY_FOR_THE_RUN": "k3y-v4lue"})
    watcher.join()
    assert result.exit_code == 0 and result.stdout == "k3y-v4lue\n", result
    assert seen, "the run's container was never seen"
    assert not any("k3y-v4lue" in item for env in seen for item in env), seen


def test_a_sessions_armed_first_exec_and_a_later_one_see_the_same(engine: Any) -> None:  # noqa: F811
    # The first exec of a session (a warm-pool member's only one) is served by the exec armed at start; the rest
    # start their own. Both must see the same words, environment, directory and stdin, and keep the deadline.
    runner = Runner(Settings.from_env(backend="docker"))
    probe = ["sh", "-c", 'printf "%s|" "$@"; echo "$ONLY|$(pwd)"; cat', "sh", "a b", "it's", "x\ny"]
    with runner.sandbox() as sandbox:
        sandbox.exec(["mkdir", "sub"])  # the armed one
        first = sandbox.exec(probe, env={"ONLY": "v\n1"}, stdin=b"in\x00put", workdir="sub")
        assert sandbox.exec(probe, env={"ONLY": "v\n1"}, stdin=b"in\x00put", workdir="sub").stdout == first.stdout
    with runner.sandbox() as sandbox:
        armed = sandbox.exec(probe, env={"ONLY": "v\n1"}, stdin=b"in\x00put", workdir="sub")
    assert armed.exit_code == 0 and first.exit_code == 0, (armed, first)
    assert first.stdout == armed.stdout == "a b|it's|x\ny|v\n1|/workspace/sub\nin\x00put", first.stdout
    with runner.sandbox() as sandbox:  # the whole environment too (review: the armed exec lacked HOSTNAME)
        assert sorted(sandbox.exec(["env"]).stdout.splitlines()) == sorted(sandbox.exec(["env"]).stdout.splitlines())
    with runner.sandbox() as sandbox:
        late = sandbox.exec("sleep 30", timeout=1)
        assert late.timed_out and sandbox.exec("echo still").stdout == "still\n", late

