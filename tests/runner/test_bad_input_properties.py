"""Property-based: whatever a caller passes to the API or the CLI, the answer is a result or an ExecboxError,
never another exception, and nothing is left behind.

The commands that do run are harmless ones (true, echo, printf, cat, exit N) with arbitrary arguments: the
properties are about the inputs around the command, and local mode runs them unsandboxed on this host.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import execbox
from execbox import ExecboxError, ExecResult, Limits
from execbox.cli import main

SAFE_PROGRAMS = ["true", "echo", "printf", "cat"]
ANY_TEXT = st.text(max_size=40)  # includes NUL, lone surrogates and every other code point
GARBAGE = st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=8), st.lists(st.integers(), max_size=2))

commands = st.one_of(
    st.sampled_from(["true", "echo hi", "exit 3", "cat", "   ", ""]),
    st.builds(lambda prog, args: [prog, *args], st.sampled_from(SAFE_PROGRAMS), st.lists(ANY_TEXT, max_size=3)),
    st.just([]),
    GARBAGE,
)
keywords = st.fixed_dictionaries({}, optional={
    "env": st.one_of(st.dictionaries(ANY_TEXT, ANY_TEXT, max_size=3), GARBAGE),
    "stdin": st.one_of(st.binary(max_size=64), ANY_TEXT, GARBAGE),
    "files": st.one_of(st.dictionaries(ANY_TEXT, st.one_of(st.binary(max_size=16), ANY_TEXT, GARBAGE), max_size=3),
                       GARBAGE),
    "workdir": st.one_of(ANY_TEXT, st.text(alphabet="a/.", max_size=4000), GARBAGE),
    "timeout": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), GARBAGE),
    "max_output_bytes": st.one_of(st.integers(-2, 1 << 40), GARBAGE),
    "network": st.one_of(st.sampled_from(["none", "host", "egress", "proxy", "bogus"]), GARBAGE),
    "limits": st.one_of(st.builds(Limits, memory_mb=st.one_of(st.none(), st.integers(1, 4096))), GARBAGE),
})
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def leftovers(local_mode: None, workspaces: Path) -> Iterator[Path]:
    tempfile.tempdir = str(workspaces)
    yield workspaces


def _answer(call: Any) -> ExecResult | ExecboxError:
    try:
        result = call()
    except ExecboxError as exc:
        assert exc.message, "an error must say what to change"
        return exc
    assert isinstance(result, ExecResult)
    return result


@PROPERTY
@given(command=commands, kw=keywords)
def test_run_answers_with_a_result_or_an_execbox_error(leftovers: Path, command: Any, kw: dict[str, Any]) -> None:
    _answer(lambda: execbox.run(command, **kw))
    assert list(leftovers.iterdir()) == []


@PROPERTY
@given(code=st.one_of(ANY_TEXT, GARBAGE), language=st.one_of(st.sampled_from(["python", "bash", "ruby"]), GARBAGE))
def test_run_code_answers_with_a_result_or_an_execbox_error(leftovers: Path, code: Any, language: Any) -> None:
    _answer(lambda: execbox.run_code(code, language, timeout=5))
    assert list(leftovers.iterdir()) == []


@PROPERTY
@given(path=st.one_of(ANY_TEXT, st.text(alphabet="ab/.", max_size=5000), GARBAGE),
       data=st.one_of(st.binary(max_size=32), ANY_TEXT, GARBAGE))
def test_session_file_calls_answer_with_data_or_an_execbox_error(leftovers: Path, path: Any, data: Any) -> None:
    with execbox.sandbox() as sb:
        _answer(lambda: (sb.write_file(path, data), ExecResult(exit_code=0))[1])
        try:
            sb.read_file(path)
        except ExecboxError:
            pass
        _answer(lambda: sb.exec(["cat", path] if isinstance(path, str) else path))
    try:
        sb.exec(["true"])
    except ExecboxError:
        pass  # after close: an ExecboxError, checked by the type of what propagates
    assert list(leftovers.iterdir()) == []


cli_options = st.lists(st.one_of(
    st.tuples(st.sampled_from(["--timeout", "--max-output-bytes", "--network", "--env", "--workdir", "--backend",
                               "--language"]), ANY_TEXT.filter(lambda t: "\0" not in t)),
    st.tuples(st.sampled_from(["--json", "--stdin"])),
), max_size=4)


@PROPERTY
@given(options=cli_options, args=st.lists(ANY_TEXT.filter(lambda t: "\0" not in t), max_size=3),
       stdin=st.binary(max_size=32))
def test_cli_run_never_raises_past_click(leftovers: Path, options: list[tuple[str, ...]], args: list[str],
                                         stdin: bytes) -> None:
    argv = ["run", *[part for option in options for part in option], "--", "printf", "%s", *args]
    result = CliRunner().invoke(main, argv, input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert list(leftovers.iterdir()) == []


@PROPERTY
@given(backend=st.one_of(ANY_TEXT.filter(lambda t: "\0" not in t), st.sampled_from(["local_subprocess", "docker"])))
def test_cli_gc_never_raises_past_click(leftovers: Path, backend: str) -> None:
    result = CliRunner().invoke(main, ["gc", "--backend", backend, "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
