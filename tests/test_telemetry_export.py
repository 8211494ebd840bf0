"""Export from execbox's own processes (issue 31): `execbox run` and `execbox batch` over OTLP under the caller's
TRACEPARENT, also through `execbox serve`, bounded at exit; `execbox mcp --http`'s Prometheus page at /metrics,
behind the server token. Each in a process of its own: the global providers are set there, not in this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from execbox import resident
from execbox.telemetry import FLUSH_AT_EXIT_S
from tests.support import otlp

EXECBOX = str(Path(sys.executable).parent / "execbox")
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CODE_EXEC_", "EXECBOX_", "OTEL_")) and k not in ("TRACEPARENT", "TRACESTATE")}
    env.update(HOME=str(tmp_path), CODE_EXEC_LOCAL="true", CODE_EXEC_NETWORK="host", CODE_EXEC_AUDIT_LOG="off",
               CODE_EXEC_BACKEND="local_subprocess", **extra)
    return env


def _commands(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    items = tmp_path / "items.jsonl"
    items.write_text('["sh", "-c", "echo one"]\n["sh", "-c", "echo two"]\n')
    yield "run", ["run", "--", "sh", "-c", "echo traced"]
    yield "batch", ["batch", str(items)]


def _assert_in_the_callers_trace(receiver: otlp.Receiver, runs: int) -> None:
    spans = receiver.spans()
    assert spans, receiver.received.keys()
    assert {span.trace_id.hex() for span in spans} == {TRACE_ID}, spans
    tops = [span for span in spans if span.name == "execbox.run"]
    assert len(tops) == runs and {span.parent_span_id.hex() for span in tops} == {PARENT_ID}, tops
    assert {"execbox.exec", "execbox.admit"} <= {span.name for span in spans}
    assert {"execbox.run.duration", "execbox.sandboxes.live"} <= receiver.metric_names()


def test_a_cli_run_exports_its_spans_under_the_callers_traceparent(tmp_path: Path) -> None:
    for name, args in _commands(tmp_path):
        with otlp.receiver() as receiver:
            env = _env(tmp_path, TRACEPARENT=TRACEPARENT, TRACESTATE="vendor=opaque",
                       OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url)
            done = subprocess.run([EXECBOX, *args], capture_output=True, text=True, env=env, timeout=120,
                                  cwd=tmp_path)
            assert done.returncode == 0, done.stderr
            assert "traced" in done.stdout or '"index": 1' in done.stdout, done.stdout
            _assert_in_the_callers_trace(receiver, 1 if name == "run" else 2)
            assert "telemetry" not in done.stderr, done.stderr


def test_a_malformed_traceparent_is_no_parent_and_no_error(tmp_path: Path) -> None:
    with otlp.receiver() as receiver:
        env = _env(tmp_path, TRACEPARENT="00-not-a-trace-context", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url)
        done = subprocess.run([EXECBOX, "run", "--", "true"], capture_output=True, text=True, env=env, timeout=120,
                              cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    (run,) = [span for span in receiver.spans() if span.name == "execbox.run"]
    assert run.parent_span_id == b"" and run.trace_id.hex() != TRACE_ID  # a trace of its own


def test_through_execbox_serve_the_clients_environment_decides(tmp_path: Path) -> None:
    """The server forks each command line into the client's environment: its TRACEPARENT and OTLP endpoint are the
    child's. The server itself imports no opentelemetry (its own import log says so) and keeps one thread."""
    path, log = str(tmp_path / "execbox.sock"), tmp_path / "serve.err"
    with log.open("w") as err:  # a file, not a pipe: the import log is longer than a pipe holds
        server = subprocess.Popen([EXECBOX, "serve", "--socket", path],
                                  env={**_env(tmp_path), "PYTHONPROFILEIMPORTTIME": "1"}, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(path), log.read_text()[-2000:]
        for name, args in _commands(tmp_path):
            with otlp.receiver() as receiver:
                env = _env(tmp_path, TRACEPARENT=TRACEPARENT, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
                           **{resident.SERVER_VAR: path})
                done = subprocess.run([EXECBOX, *args], capture_output=True, text=True, env=env, timeout=120,
                                      cwd=tmp_path)
                assert done.returncode == 0, done.stderr
                _assert_in_the_callers_trace(receiver, 1 if name == "run" else 2)
        assert len(os.listdir(f"/proc/{server.pid}/task")) == 1
    finally:
        server.terminate()
        server.wait(timeout=60)
    imported = [line.split("|")[-1].strip() for line in log.read_text().splitlines() if line.startswith("import time:")]
    assert len(imported) > 100, imported  # the control: the log is the server's
    assert not [name for name in imported if name.startswith("opentelemetry")], imported


def test_a_collector_that_never_answers_does_not_hold_a_run(tmp_path: Path) -> None:
    with otlp.silent_collector() as url:
        # the exporter's own timeout is long here: only execbox's bound ends the wait
        env = _env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=url, OTEL_EXPORTER_OTLP_TIMEOUT="120")
        started = time.monotonic()
        done = subprocess.run([EXECBOX, "run", "--", "sh", "-c", "exit 3"], capture_output=True, text=True, env=env,
                              timeout=120, cwd=tmp_path)
        took = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    assert f"telemetry export did not finish within {FLUSH_AT_EXIT_S:g}s" in done.stderr, done.stderr
    assert FLUSH_AT_EXIT_S <= took < FLUSH_AT_EXIT_S + 20, took


def test_without_the_exporter_a_run_says_so_and_runs(tmp_path: Path) -> None:
    _shadow(tmp_path / "blocked", "opentelemetry.exporter.otlp")
    env = _env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=_pythonpath(tmp_path))
    done = subprocess.run([EXECBOX, "run", "--", "true"], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "is not installed; this command is not exported. Fix: pip install opentelemetry-sdk " \
           "opentelemetry-exporter-otlp-proto-http" in done.stderr, done.stderr


def _shadow(root: Path, module: str) -> None:
    """A package at ``module`` under ``root`` whose import fails as a missing one does."""
    package = root.joinpath(*module.split("."))
    package.mkdir(parents=True, exist_ok=True)
    missing = f"No module named '{module}'"
    (package / "__init__.py").write_text(f"raise ModuleNotFoundError({missing!r}, name={module!r})\n")


def _pythonpath(tmp_path: Path) -> str:
    return os.pathsep.join([str(tmp_path / "blocked"), *filter(None, [os.environ.get("PYTHONPATH")])])


# --- execbox mcp --http: /metrics ----------------------------------------------------------------------------------


@pytest.mark.engine
def test_the_mcp_server_serves_prometheus_text_behind_its_token(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    pytest.importorskip("prometheus_client")
    import anyio

    from tests.mcp.support import env, get, http_client, http_server, usable

    usable("bubblewrap")
    server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="bubblewrap",
                 CODE_EXEC_SHELL_BACKEND="bubblewrap", CODE_EXEC_POOL_SIZE="0")
    grant: list[str] = []

    async def main(url: str, token: str) -> None:
        async with http_client(url, token) as client:
            result = await client.call_tool("run_command", {"command": "echo counted"})
            assert (result.structured_content or {}).get("stdout") == "counted\n", result
            delegated = await client.call_tool("delegate", {"tools": ["run_code"], "label": "helper"})
            grant.append((delegated.structured_content or {})["token"])

    with http_server(server) as (url, token, proc):
        anyio.run(main, url, token)
        metrics = url.removesuffix("/mcp") + "/metrics"
        status, content_type, page = get(metrics, token)
        # refused exactly as /mcp refuses: no token, a wrong one
        refusals = {(get(where, bad)[0], get(where, bad)[2]) for where in (url, metrics) for bad in (None, "x" * 32)}
        as_grant = get(metrics, grant[0])
        posted = get(metrics, token, "POST")
    _, err = proc.communicate(timeout=60)
    assert status == 200 and content_type.startswith("text/plain; version="), (status, content_type, page)
    assert 'execbox_run_duration_seconds_count{execbox_backend="bubblewrap",execbox_outcome="ok"' in page, page
    # buckets in seconds (the SDK's default ones are for milliseconds)
    assert 'execbox_run_duration_seconds_bucket{execbox_backend="bubblewrap",execbox_outcome="ok",le="0.5"' in page
    assert "execbox_sandboxes_live" in page and "# TYPE execbox_run_duration_seconds histogram" in page, page
    assert "python_gc_objects_collected_total" not in page, page  # a registry of its own: nothing else leaks in
    assert len(refusals) == 1 and next(iter(refusals))[0] == 401, refusals
    assert as_grant[0] == 403 and "server token" in as_grant[2], as_grant
    assert posted[0] == 405, posted
    port = url.split(":")[-1].split("/")[0]
    assert f"serving metrics at http://127.0.0.1:{port}/metrics" in err, err


def test_without_the_prometheus_reader_metrics_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from tests.mcp.support import env, get, http_server

    _shadow(tmp_path / "blocked", "prometheus_client")
    server = env(PYTHONPATH=_pythonpath(tmp_path))
    with http_server(server) as (url, token, proc):
        metrics = url.removesuffix("/mcp") + "/metrics"
        status, _, body = get(metrics, token)
        unauthorized = get(metrics, None)[0]
    _, err = proc.communicate(timeout=60)
    assert status == 501 and json.loads(body)["fix"] == "pip install 'execbox[prometheus]'", (status, body)
    assert unauthorized == 401
    assert "no metrics at /metrics" in err and "pip install 'execbox[prometheus]'" in err, err
    assert "Traceback" not in err, err
