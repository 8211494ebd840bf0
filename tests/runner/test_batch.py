"""runner.map and `execbox batch`: one item's failure, timeout, refusal or runaway output is that item's outcome;
the batch never stops for it, never runs more than its concurrency, ends when a backend never returns, and leaves
nothing behind when it is closed, interrupted or signalled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from execbox import AsyncRunner, ConfigError, ExecRequest, Runner, Settings
from execbox.errors import BackendUnavailableError
from execbox.runner.batch import ORDERED_WINDOW, BatchItem, BatchSummary
from execbox.runner.loop_thread import run_blocking
from execbox.testing import engine_missing
from tests.backends.test_docker import engine  # noqa: F401 - fixture
from tests.support import readme, stuck_backends
from tests.support.containers import containers_of
from tests.support.fixtures import FakeDistributions

#: A liveness bound, far above what the batches below need.
LIVENESS_S = 90
REPO = Path(__file__).resolve().parents[2]


def _local() -> Runner:
    return Runner(Settings(backend="local_subprocess", local=True, network="host", max_concurrent=4))


def test_items_of_every_kind_come_back_in_input_order_each_with_its_outcome(local_mode: None) -> None:
    items: list[Any] = ["print('code')", ["sh", "-c", "echo argv; exit 3"], ExecRequest(code="print(4)"),
                        {"argv": ["sh", "-c", "sleep 0.3; echo late"]}, 42, {"argv": []},
                        {"code": "import time; time.sleep(5)", "timeout": 0.5}]
    with _local() as runner, runner.map(items, progress=False) as batch:
        got = list(batch)
    assert [item.index for item in got] == list(range(len(items)))
    assert [item.outcome for item in got] == ["passed", "failed", "passed", "passed", "error", "error", "timed_out"]
    assert got[0].result is not None and got[0].result.stdout == "code\n"
    assert got[1].result is not None and got[1].result.exit_code == 3
    assert got[3].result is not None and got[3].result.stdout == "late\n"
    assert isinstance(got[4].error, ConfigError) and "a int" in got[4].error.message
    assert isinstance(got[5].error, ConfigError) and "argv is empty" in got[5].error.message
    summary = batch.summary
    assert summary.counts == {"passed": 3, "failed": 1, "timed_out": 1, "refused": 0, "error": 2}
    assert summary.total == 7 and summary.ended is not None and summary.percentile(0.99) is not None
    assert str(summary).startswith("7 items in ")
    assert got[1].to_dict()["index"] == 1 and got[1].to_dict()["exit_code"] == 3
    assert got[4].to_dict() == {"index": 4, "error": got[4].error.to_dict()}


def test_never_more_than_its_concurrency_and_as_completed_when_asked(local_mode: None, tmp_path: Path) -> None:
    """Each item marks itself running in a host directory (local_subprocess: the host's /tmp) and counts the
    others; the first item is the slowest, so as completed it comes after the next one."""
    probe = tmp_path / "running"
    probe.mkdir()
    step = f"mkdir {probe}/$$; ls {probe} | wc -l; sleep {{}}; rmdir {probe}/$$"
    items = [["sh", "-c", step.format(1.5)]] + [["sh", "-c", step.format(0.2)] for _ in range(9)]
    with _local() as runner:
        got = list(runner.map(items, concurrency=2, ordered=False, progress=False))
    assert sorted(item.index for item in got) == list(range(10))
    order = [item.index for item in got]
    assert order.index(0) > order.index(1)  # the slow first item came out after a later one: nothing waited for it
    seen = [int(item.result.stdout) for item in got if item.result is not None]
    assert len(seen) == 10 and max(seen) <= 2 and max(seen) == 2


def test_a_lazy_iterator_of_items_is_read_as_the_batch_goes(local_mode: None) -> None:
    pulled: list[int] = []

    def items() -> Iterator[str]:
        for i in range(20):
            pulled.append(i)
            yield f"print({i})"

    with _local() as runner, runner.map(items(), concurrency=1, progress=False) as batch:
        first = next(batch)
        assert first.result is not None and first.result.stdout == "0\n"
        # Not read ahead to the end: the window of started items, one waiting for it, one pulled since the first left.
        assert len(pulled) <= ORDERED_WINDOW + 2
        rest = list(batch)
    assert [item.result.stdout for item in rest if item.result] == [f"{i}\n" for i in range(1, 20)]


def test_a_concurrency_the_runner_cannot_give_is_refused_up_front(local_mode: None) -> None:
    with _local() as runner:
        for bad in (0, 5, -1, 2.5, True, "2"):
            with pytest.raises(ConfigError, match="concurrency"):
                runner.map(["print(1)"], concurrency=bad)  # type: ignore[arg-type]


def test_a_failing_iterator_of_items_is_the_callers_error_after_what_ran(local_mode: None) -> None:
    def items() -> Iterator[str]:
        yield "print(1)"
        raise ValueError("the caller's own bug")

    with _local() as runner, runner.map(items(), progress=False) as batch:
        with pytest.raises(ValueError, match="the caller's own bug"):
            list(batch)


@pytest.fixture
def stuck(only_local_builtin: None, fake_dists: FakeDistributions) -> Iterator[None]:
    fake_dists.add(stuck_backends.DISTRIBUTION, ep_name="stuck", value="tests.support.stuck_backends")
    stuck_backends.RELEASE.clear()
    yield
    stuck_backends.RELEASE.set()


@pytest.mark.anyio
async def test_a_backend_that_never_returns_times_each_item_out_and_the_batch_ends(stuck: None) -> None:
    settings = Settings(backend="stuck_exec", network="none", backend_grace_sec=1.0, open_timeout_sec=2.0,
                        max_concurrent=2)
    async with AsyncRunner(settings) as runner:
        with anyio.fail_after(LIVENESS_S):
            async with runner.map([{"argv": ["true"], "timeout": 1}] * 3, progress=False) as batch:
                got = [item async for item in batch]
    assert [item.outcome for item in got] == ["timed_out"] * 3
    assert all(item.error is not None and "did not return" in item.error.message for item in got)


# --- docker and bubblewrap --------------------------------------------------------------------------------------


@pytest.fixture(params=["docker", "bubblewrap"])
def engine_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    try:
        run_blocking(AsyncRunner(Settings.from_env()).backend(name).check)
    except BackendUnavailableError as exc:
        engine_missing(f"{name} cannot run here: {exc}")
    return name


@pytest.mark.engine
def test_an_endless_printer_in_a_batch_is_cut_at_its_deadline_and_the_rest_pass(engine_name: str) -> None:
    items: list[Any] = [{"code": "while True: print('x' * 4096)", "timeout": 2}] + [f"print({i})" for i in range(5)]
    started = time.monotonic()
    with Runner(Settings.from_env()) as runner:
        got = list(runner.map(items, backend=engine_name, concurrency=2, progress=False))
    assert time.monotonic() - started < LIVENESS_S
    runaway = got[0].result
    assert runaway is not None and runaway.timed_out and runaway.truncated
    assert [item.result.stdout for item in got[1:] if item.result] == [f"{i}\n" for i in range(5)]


@pytest.mark.engine
def test_the_warm_pool_serves_a_batch(engine_name: str) -> None:
    with Runner(Settings.from_env().model_copy(update={"pool_size": 2})) as runner:
        runner.warm(engine_name)
        got = list(runner.map(["print(1)"] * 6, backend=engine_name, concurrency=2, progress=False))
    assert all(item.ok for item in got)
    assert any(item.result is not None and item.result.pooled for item in got)


@pytest.mark.engine
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_execbox_batch_stopped_by_a_signal_leaves_no_container(engine: Any, tmp_path: Path,  # noqa: F811
                                                               stop: signal.Signals) -> None:
    source = tmp_path / "items.jsonl"
    source.write_text('"print(0)"\n' + '{"argv": ["sleep", "60"]}\n' * 6)
    child = subprocess.Popen([sys.executable, "-c", "from execbox.program import main; main()", "batch",
                              "--backend", "docker", "--concurrency", "2", str(source)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    try:
        assert child.stdout is not None
        first = child.stdout.readline()  # the quick item's result, printed (and flushed) as it finished
        deadline = time.monotonic() + LIVENESS_S
        while len(containers_of(engine, child.pid)) < 2 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.2)
        assert len(containers_of(engine, child.pid)) == 2, child.stderr.read() if child.stderr else ""
        child.send_signal(stop)
        out, err = child.communicate(timeout=LIVENESS_S)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, err
    assert json.loads(first)["stdout"] == "0\n" and out == ""  # what finished was printed, nothing after
    assert "interrupted" in err and "Traceback" not in err
    assert containers_of(engine, child.pid) == []


def test_execbox_batch_reads_json_lines_and_prints_one_result_per_item(local_mode: None, tmp_path: Path) -> None:
    source = tmp_path / "items.jsonl"
    source.write_text('{"code": "print(1)"}\n"print(2)"\n\n["sh", "-c", "exit 4"]\nnot json\n7\n')
    done = subprocess.run([sys.executable, "-c", "from execbox.program import main; main()", "batch",
                           "--no-progress", "-"], input=source.read_text(), capture_output=True, text=True,
                          timeout=LIVENESS_S, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2, 3, 4]
    assert [line.get("stdout") for line in lines[:2]] == ["1\n", "2\n"] and lines[2]["exit_code"] == 4
    assert "line 5: not JSON" in lines[3]["error"]["message"] and "a JSON int" in lines[4]["error"]["message"]
    assert done.returncode == 1 and "5 items in" in done.stderr and "2 passed, 1 failed" in done.stderr


def test_a_summary_of_nothing_is_well_formed() -> None:
    empty = BatchSummary()
    assert empty.percentile(0.5) is None and "0 items" in str(empty)
    item = BatchItem(0, error=ConfigError("x"))
    assert item.outcome == "error" and not item.ok


@pytest.mark.engine
def test_the_readme_examples_run_as_printed(tmp_path: Path) -> None:
    python, shell = (readme.blocks("### Many runs at once: `runner.map` and `execbox batch`", language)[0]
                     for language in ("python", "sh"))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, timeout=LIVENESS_S,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["0 passed 0", "1 passed 1"] and lines[20].strip() == "20 failed"
    assert lines[21].startswith("21 timed_out") and "20 passed, 1 failed, 1 timed out" in lines[22]
    done = subprocess.run(["bash", "-euc", shell], capture_output=True, text=True, timeout=LIVENESS_S, cwd=tmp_path,
                          env=env)
    assert done.returncode == 1, done.stderr  # the third item exits 4
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["index"], r["exit_code"], r["stdout"]) for r in results] == [(0, 0, "1\n"), (1, 0, "2\n"), (2, 4, "")]


@pytest.mark.anyio
async def test_a_bug_under_one_item_is_that_items_error_and_the_batch_goes_on() -> None:
    from execbox import ExecResult
    from execbox.runner.batch import AsyncBatch
    from execbox.runner.scheduler import Slots

    class Host:
        slots = Slots(2)

        async def execute(self, request: ExecRequest, *, backend: str | None = None) -> ExecResult:
            if request.code == "boom":
                raise RuntimeError("a bug below the runner")
            return ExecResult(exit_code=0, stdout="ok\n")

    async with AsyncBatch(Host(), ["print(1)", "boom", "print(2)"], progress=False) as batch:
        got = [item async for item in batch]
    assert [item.outcome for item in got] == ["passed", "error", "passed"]
    assert got[1].error is not None and "RuntimeError: a bug below the runner" in got[1].error.message
