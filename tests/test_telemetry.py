"""OpenTelemetry (issue 31): the spans and metrics of real runs, read back through the SDK's in-memory exporter
and metric reader; what is never in them (env values, secrets, placeholders, output); and that nothing imports
opentelemetry unless the application did."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, UpDownCounter
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from execbox import Limits, NotASandboxError, Runner, Settings
from execbox.runner import run_blocking
from execbox.testing import engine_missing
from tests.support import otlp
from tests.support.pool import wait_ready

# The global providers can be set once per process: this module's, set on first use and kept.
EXPORTER = InMemorySpanExporter()
# Delta: each collection holds what was recorded since the one before (the fixture's), so each test counts its own.
READER = InMemoryMetricReader(preferred_temporality={
    kind: AggregationTemporality.DELTA for kind in (Counter, UpDownCounter, Histogram)})
_installed: list[bool] = []


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    if not _installed:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))
        _installed.append(True)
    EXPORTER.clear()
    READER.get_metrics_data()  # what earlier tests recorded is collected here, not counted in this one
    yield EXPORTER


def bubblewrap() -> Runner:
    runner = Runner(Settings.from_env(backend="bubblewrap"))
    try:
        caps = run_blocking(runner.aio.backend("bubblewrap").check)
    except Exception as exc:  # noqa: BLE001 - the engine's absence, said as the suite says it
        engine_missing(f"bubblewrap cannot run here: {exc}")
    runner.caps = caps  # type: ignore[attr-defined]
    return runner


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in finished}


def metric_points() -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """Every metric point the reader holds, by metric name: (attributes, value or histogram count)."""
    data = READER.get_metrics_data()
    points: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    points.setdefault(metric.name, []).append(
                        (dict(point.attributes or {}), value if value is not None else getattr(point, "count", None)))
    return points


@pytest.mark.engine
def test_one_run_is_one_span_tree_under_the_callers_span(spans: InMemorySpanExporter) -> None:
    runner = bubblewrap()
    tracer = trace.get_tracer("the caller")
    with tracer.start_as_current_span("agent step") as caller:
        result = runner.run(["sh", "-c", "echo hi"], timeout=20)
    assert result.ok, result
    named = by_name(spans.get_finished_spans())
    assert set(named) >= {"agent step", "execbox.run", "execbox.admit", "execbox.sandbox.open", "execbox.exec",
                          "execbox.sandbox.close"}, named
    trace_id = caller.get_span_context().trace_id
    assert {span.context.trace_id for span in named.values()} == {trace_id}
    run = named["execbox.run"]
    assert run.parent is not None and run.parent.span_id == caller.get_span_context().span_id
    for child in ("execbox.admit", "execbox.sandbox.open", "execbox.exec", "execbox.sandbox.close"):
        parent = named[child].parent
        assert parent is not None and parent.span_id == run.context.span_id, child
    exec_attrs = dict(named["execbox.exec"].attributes or {})
    assert exec_attrs["process.exit.code"] == 0 and exec_attrs["execbox.outcome"] == "ok"
    assert exec_attrs["execbox.backend"] == "bubblewrap" and exec_attrs["execbox.network"] == "none"
    assert exec_attrs["execbox.timed_out"] is False and exec_attrs["execbox.oom_killed"] is False
    assert exec_attrs["execbox.oneshot"] is True
    assert "process.command_args" not in exec_attrs  # the operator did not opt in
    assert dict(named["execbox.admit"].attributes or {})["execbox.verdict"] == "admitted"
    assert dict(named["execbox.sandbox.open"].attributes or {})["execbox.pooled"] is False
    assert dict(run.attributes or {})["execbox.outcome"] == "ok"
    points = metric_points()
    assert ({"execbox.backend": "bubblewrap", "execbox.outcome": "ok"}, 1) in points["execbox.run.duration"]
    assert any(labels == {"execbox.backend": "bubblewrap"} for labels, _ in points["execbox.run.queue_time"])
    # opened and closed: the live gauge (an up-down counter) is back where it was
    assert sum(value for labels, value in points["execbox.sandboxes.live"] if labels["execbox.backend"] ==
               "bubblewrap") == 0


@pytest.mark.engine
def test_a_sandboxs_spans_have_the_callers_parent_and_the_command_only_when_opted_in(
        spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_OTEL_COMMAND_ARGS", "1")
    runner = bubblewrap()
    with trace.get_tracer("the caller").start_as_current_span("agent step") as caller:
        with runner.sandbox("bubblewrap") as sb:
            sb.write_file("a.txt", "x")
            sb.exec(["cat", "a.txt"])
            sb.download("a.txt", str(Path(os.environ["HOME"]) / "a.txt"))
    named = by_name(spans.get_finished_spans())
    for name in ("execbox.admit", "execbox.sandbox.open", "execbox.exec", "execbox.files.download",
                 "execbox.sandbox.close"):
        parent = named[name].parent
        assert parent is not None and parent.span_id == caller.get_span_context().span_id, name
    assert dict(named["execbox.exec"].attributes or {})["process.command_args"] == ("cat", "a.txt")
    assert dict(named["execbox.exec"].attributes or {})["execbox.oneshot"] is False
    assert dict(named["execbox.files.download"].attributes or {})["execbox.files.count"] == 1


def test_a_refusal_says_its_reason_on_the_span_and_in_the_counter(spans: InMemorySpanExporter,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    runner = Runner(Settings.from_env(backend="local_subprocess"))  # not a sandbox: refused outside local mode
    with pytest.raises(NotASandboxError):
        runner.run(["true"])
    named = by_name(spans.get_finished_spans())
    admit = dict(named["execbox.admit"].attributes or {})
    assert admit["execbox.verdict"] == "refused" and admit["execbox.refusal.reason"] == "NotASandboxError"
    assert dict(named["execbox.run"].attributes or {})["error.type"] == "NotASandboxError"
    assert named["execbox.run"].status.status_code == trace.StatusCode.ERROR
    assert "execbox.sandbox.open" not in named  # refused before any sandbox opens
    refusals = metric_points()["execbox.refusals"]
    assert ({"execbox.refusal.reason": "NotASandboxError", "execbox.backend": "local_subprocess"}, 1) \
        in refusals, refusals


@pytest.mark.engine
def test_a_timeout_and_an_oom_say_their_outcome(spans: InMemorySpanExporter) -> None:
    runner = bubblewrap()
    if "memory" not in runner.caps.limits:  # type: ignore[attr-defined]
        engine_missing("bubblewrap enforces no memory limit here (no cgroups)")
    slow = runner.run(["sleep", "30"], timeout=1)
    oom = runner.run_code("b = []\nwhile True:\n    b.append(bytearray(16 << 20))", limits=Limits(memory_mb=96),
                          timeout=20)
    assert slow.timed_out and oom.oom_killed, (slow, oom)
    execs = [dict(span.attributes or {}) for span in spans.get_finished_spans() if span.name == "execbox.exec"]
    assert [(a["execbox.outcome"], a["execbox.timed_out"], a["execbox.oom_killed"], a["execbox.limit"])
            for a in execs] == [("timeout", True, False, "timeout"), ("oom", False, True, "memory")]
    points = metric_points()
    assert points["execbox.run.timeouts"] == [({"execbox.backend": "bubblewrap"}, 1)]
    assert points["execbox.run.oom_kills"] == [({"execbox.backend": "bubblewrap"}, 1)]
    outcomes = {labels["execbox.outcome"] for labels, _ in points["execbox.run.duration"]}
    assert outcomes == {"timeout", "oom"}


@pytest.mark.engine
def test_docker_a_timeout_and_an_oom_say_their_outcome(spans: InMemorySpanExporter) -> None:
    runner = Runner(Settings.from_env(backend="docker"))
    try:
        run_blocking(runner.aio.backend("docker").check)
    except Exception as exc:  # noqa: BLE001
        engine_missing(f"docker cannot run here: {exc}")
    slow = runner.run(["sleep", "30"], timeout=1)
    oom = runner.run_code("b = []\nwhile True:\n    b.append(bytearray(16 << 20))", limits=Limits(memory_mb=128),
                          timeout=30)
    assert slow.timed_out and oom.oom_killed, (slow, oom)
    execs = [dict(s.attributes or {}) for s in spans.get_finished_spans() if s.name == "execbox.exec"]
    assert [(a["execbox.outcome"], a["execbox.backend"], a["process.exit.code"]) for a in execs] == [
        ("timeout", "docker", slow.exit_code), ("oom", "docker", 137)]
    points = metric_points()
    assert points["execbox.run.timeouts"] == [({"execbox.backend": "docker"}, 1)]
    assert points["execbox.run.oom_kills"] == [({"execbox.backend": "docker"}, 1)]


@pytest.mark.engine
def test_no_span_or_metric_holds_an_env_value_a_secret_a_placeholder_or_output(
        spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = bubblewrap()
    env_value, secret, at_egress = "env-value-7f3a9c", "injected-secret-51d2e8", "egress-secret-value-0c4b77aa9e"
    command = 'echo "OUTPUT-9e1d $GREETING $API_KEY $TOKEN"; echo ERRTEXT-4a2c >&2'
    result = runner.run(command, env={"GREETING": env_value}, secrets={"API_KEY": secret},
                        secrets_at_egress={"TOKEN": ("example.com", at_egress)}, network="proxy", timeout=30)
    assert result.ok and result.stdout.startswith("OUTPUT-9e1d "), result
    placeholder = result.stdout.split()[-1]
    assert placeholder and placeholder != at_egress
    # the run's own span tree, and a refused one that names the same values
    with pytest.raises(NotASandboxError):
        runner.run(command, env={"GREETING": env_value}, secrets={"API_KEY": secret}, backend="local_subprocess")
    exported: list[str] = []
    for span in spans.get_finished_spans():
        exported += [span.name, *(f"{k}={v}" for k, v in (span.attributes or {}).items())]
        exported += [f"{e.name} {dict(e.attributes or {})}" for e in span.events]
        exported.append(span.status.description or "")
    for name, points in metric_points().items():
        exported += [f"{name} {labels}" for labels, _ in points]
    assert len(exported) > 20
    text = "\n".join(exported)
    for forbidden in (env_value, secret, at_egress, placeholder, "OUTPUT-9e1d", "ERRTEXT-4a2c", "[REDACTED"):
        assert forbidden not in text, forbidden


def test_nothing_imports_opentelemetry_unless_the_application_did(tmp_path: Path) -> None:
    """With the extra absent (its import blocked) and with it present but not imported: a run works and leaves
    no opentelemetry module loaded."""
    code = """
        import json, sys
        if sys.argv[1] == "absent":
            class Absent:
                def find_spec(self, name, path=None, target=None):
                    if name.split(".")[0] == "opentelemetry":
                        raise ModuleNotFoundError(f"No module named {name!r}")
            sys.meta_path.insert(0, Absent())
        from execbox import Runner, Settings
        with Runner(Settings.from_env(local=True, network="host")) as runner:
            result = runner.run(["true"], backend="local_subprocess")
            with runner.sandbox("local_subprocess") as sb:
                sb.exec(["true"])
        assert result.exit_code == 0, result
        print(json.dumps([m for m in sys.modules if m.startswith("opentelemetry")]))
    """
    for how in ("absent", "present"):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), how], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "[]", (how, done.stdout)


def test_a_pooled_run_says_so_and_the_pool_depth_is_a_gauge(spans: InMemorySpanExporter, tmp_path: Path) -> None:
    settings = Settings(backend="local_subprocess", local=True, network="host", pool_size=2)
    with Runner(settings) as runner:
        wait_ready(runner)
        first = metric_points()
        depth = first["execbox.pool.depth"]
        assert depth == [({"execbox.backend": "local_subprocess"}, 2)], depth
        result = runner.run(["true"])
        assert result.pooled, result
    named = by_name(spans.get_finished_spans())
    assert dict(named["execbox.sandbox.open"].attributes or {})["execbox.pooled"] is True
    assert dict(named["execbox.run"].attributes or {})["execbox.pooled"] is True
    # two members opened (+2 when the depth was read), one used and removed, the other closed with the runner (-2)
    live = [value for points in (first, metric_points()) for _, value in points["execbox.sandboxes.live"]]
    assert live == [2, -2], live


@pytest.mark.engine
def test_an_mcp_tool_calls_spans_continue_the_trace_its_meta_names(spans: InMemorySpanExporter) -> None:
    """A client's ``_meta.traceparent`` is the parent of the server's ``tools/call`` span (the MCP SDK's, with the
    GenAI ``execute_tool`` attributes), and execbox's spans are below it."""
    pytest.importorskip("mcp")
    import anyio
    from mcp import Client

    from execbox.mcp.server import McpApp
    from execbox.mcp.settings import McpSettings

    bubblewrap()  # skips without the engine
    app = McpApp(Settings.from_env(enabled=True, posture=1, backend="bubblewrap", shell_backend="bubblewrap"),
                 McpSettings.from_env(), "stdio")
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"

    async def main() -> None:
        async with app.running(), Client(app.server) as client:
            result = await client.call_tool("shell", {"command": "echo traced"},
                                            meta={"traceparent": f"00-{trace_id}-{parent_id}-01"})
            assert (result.structured_content or {})["stdout"] == "traced\n", result

    anyio.run(main)
    finished = spans.get_finished_spans()
    named = by_name(finished)
    tool = named["tools/call shell"]
    assert tool.parent is not None and f"{tool.parent.span_id:016x}" == parent_id
    assert dict(tool.attributes or {})["gen_ai.operation.name"] == "execute_tool"
    execbox_spans = [s for s in finished if s.name.startswith("execbox.")]
    assert {"execbox.exec", "execbox.sandbox.open"} <= {s.name for s in execbox_spans}
    # the session's sandbox outlives the call: its close, when the session ends, is a trace of its own
    in_call = [s for s in execbox_spans if s.name != "execbox.sandbox.close"]
    assert {f"{s.context.trace_id:032x}" for s in in_call} == {trace_id}
    assert {s.parent.span_id for s in in_call if s.parent} == {tool.context.span_id}


@pytest.mark.engine
def test_a_snapshot_a_fork_and_a_rollback_are_spans(spans: InMemorySpanExporter) -> None:
    runner = bubblewrap()
    if not runner.caps.snapshot:  # type: ignore[attr-defined]
        engine_missing("bubblewrap keeps no snapshots here")
    with runner.sandbox("bubblewrap") as sb:
        sb.write_file("a.txt", "kept")
        snap = sb.snapshot("first")
        (child,) = sb.fork(1)
        child.close()
        sb.write_file("a.txt", "changed")
        sb.rollback(snap)
        assert sb.read_file("a.txt") == b"kept"
    runner.delete_snapshot(snap)
    finished = spans.get_finished_spans()
    names = [s.name for s in finished]
    assert names.count("execbox.snapshot") == 2, names  # the one asked for, and the fork's
    fork, rollback = by_name(finished)["execbox.fork"], by_name(finished)["execbox.rollback"]
    assert dict(fork.attributes or {})["execbox.fork.count"] == 1
    assert dict(rollback.attributes or {})["execbox.backend"] == "bubblewrap"
    # a rollback opens the new sandbox and closes the old one, below its span
    below = {s.name for s in finished if s.parent is not None and s.parent.span_id == rollback.context.span_id}
    assert below == {"execbox.sandbox.open", "execbox.sandbox.close"}, below
    snapshot = next(s for s in finished if s.name == "execbox.snapshot")
    assert dict(snapshot.attributes or {})["execbox.snapshot.memory"] is False


@pytest.mark.engine
def test_the_mcp_http_server_exports_over_otlp_to_the_endpoint_the_standard_variables_name(
        spans: InMemorySpanExporter) -> None:
    """`execbox mcp --http` with OTEL_EXPORTER_OTLP_ENDPOINT: a receiver of OTLP/HTTP gets the tool call's spans,
    in the caller's trace (the SDK's client sends it in ``_meta.traceparent``), and execbox's metrics, once the
    server stops."""
    pytest.importorskip("mcp")
    import anyio

    from tests.mcp.support import env, get, http_client, http_server, usable

    usable("bubblewrap")

    async def main(url: str, token: str) -> None:
        async with http_client(url, token) as client:
            result = await client.call_tool("run_command", {"command": "echo exported"})
            assert (result.structured_content or {}).get("stdout") == "exported\n", result

    with otlp.receiver() as receiver:
        server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="bubblewrap",
                     CODE_EXEC_SHELL_BACKEND="bubblewrap", CODE_EXEC_POOL_SIZE="0",
                     OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url)
        with http_server(server) as (url, token, proc):
            with trace.get_tracer("the caller").start_as_current_span("agent step") as caller:
                anyio.run(main, url, token)
            # the Prometheus reader beside OTLP's, on the same meter provider (when its extra is installed)
            status, _, page = get(url.removesuffix("/mcp") + "/metrics", token)
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    trace_id = f"{caller.get_span_context().trace_id:032x}"
    exported = [(span.name, span.trace_id.hex()) for span in receiver.spans()]
    assert ("tools/call run_command", trace_id) in exported and ("execbox.exec", trace_id) in exported, exported
    names = receiver.metric_names()
    assert {"execbox.run.duration", "execbox.sandboxes.live"} <= names, names
    if importlib.util.find_spec("prometheus_client") is not None:
        assert status == 200 and "execbox_run_duration_seconds_count{" in page, (status, page)


@pytest.mark.engine
def test_each_cell_is_a_span_with_its_outcome(spans: InMemorySpanExporter) -> None:
    runner = bubblewrap()
    with runner.sandbox("bubblewrap") as sb:
        assert sb.run_cell("x = 1").ok
        assert not sb.run_cell("1 / 0").ok
    cells = [dict(s.attributes or {}) for s in spans.get_finished_spans() if s.name == "execbox.cell"]
    assert [(c["execbox.outcome"], c["execbox.backend"]) for c in cells] == [("ok", "bubblewrap"),
                                                                           ("error", "bubblewrap")]
    outcomes = sorted(labels["execbox.outcome"] for labels, _ in metric_points()["execbox.run.duration"])
    assert outcomes == ["error", "ok"], outcomes


@pytest.mark.engine
def test_egress_denied_by_the_proxy_is_counted(spans: InMemorySpanExporter) -> None:
    runner = bubblewrap()
    code = ("import urllib.request\ntry:\n    urllib.request.urlopen('http://not-allowed.invalid/', timeout=20)\n"
            "except Exception as exc:\n    print('refused', type(exc).__name__)\n")
    result = runner.run_code(code, network="proxy", timeout=60)
    assert result.stdout.startswith("refused") and [a.allowed for a in result.egress] == [False], result
    (attrs,) = [dict(s.attributes or {}) for s in spans.get_finished_spans() if s.name == "execbox.exec"]
    assert (attrs["execbox.egress.allowed"], attrs["execbox.egress.denied"]) == (0, 1)
    assert metric_points()["execbox.egress.connections"] == [
        ({"execbox.backend": "bubblewrap", "execbox.egress.allowed": False}, 1)]


@pytest.mark.engine
def test_orphans_a_backends_start_up_sweep_removes_are_counted() -> None:
    """In a fresh process (the sweep runs once per process): a workspace left by a dead process is swept on the
    first run, and counted."""
    bubblewrap()
    # A stand-in for a shared /tmp (mode 1777, reachable by the sandbox user): the sweep looks only there.
    scratch = Path(tempfile.mkdtemp(prefix="execbox-test-tmp-"))
    scratch.chmod(0o1777)
    code = """
        import json, pathlib, subprocess, tempfile
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = pathlib.Path(tempfile.gettempdir()) / f"execbox-bwrap-{dead.pid}-abc"
        (stale / "workspace").mkdir(parents=True)
        from execbox import Runner, Settings
        assert Runner(Settings.from_env(backend="bubblewrap")).run(["true"]).ok
        points = [(dict(p.attributes), p.value) for r in reader.get_metrics_data().resource_metrics
                  for s in r.scope_metrics for m in s.metrics if m.name == "execbox.orphans.swept"
                  for p in m.data.data_points]
        print(json.dumps([points, stale.exists()]))
    """
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "TMPDIR": str(scratch)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    points, left = json.loads(done.stdout.splitlines()[-1])
    assert points == [[{"execbox.backend": "bubblewrap"}, 1]] and not left, (points, left)


@pytest.mark.engine
def test_an_mcp_reviews_refusals_are_counted_by_reason(spans: InMemorySpanExporter, tmp_path: Path) -> None:
    """A command the review refuses is in `execbox.refusals` as the pipeline's refusals are: a rule's deny, a
    client that cannot ask for the approval needed, a person who did not approve. An allowed one is not."""
    pytest.importorskip("mcp")
    import anyio
    from mcp import Client

    from execbox.mcp.server import McpApp
    from execbox.mcp.settings import McpSettings
    from tests.mcp.support import Asked

    bubblewrap()  # skips without the engine
    rules = tmp_path / "rules"
    rules.write_text("deny \\bcurl\\b.*169\\.254\\.169\\.254\n")
    settings = Settings.from_env(enabled=True, backend="bubblewrap", shell_backend="bubblewrap", review_rules=rules)

    async def call(command: str, **client: Any) -> bool:
        app = McpApp(settings, McpSettings.from_env(), "stdio")
        async with app.running(), Client(app.server, **client) as session:
            return bool((await session.call_tool("run_command", {"command": command})).is_error)

    async def main() -> list[bool]:
        return [await call("curl http://169.254.169.254/latest"), await call("git push origin main"),
                await call("git push origin main", elicitation_callback=Asked(approve=False)),
                await call("echo fine")]

    assert anyio.run(main) == [True, True, True, False]
    refusals = metric_points()["execbox.refusals"]
    assert sorted(labels["execbox.refusal.reason"] for labels, _ in refusals) == [
        "ReviewDeclined", "ReviewDenied", "ReviewUnattended"], refusals
    assert {labels["execbox.backend"] for labels, _ in refusals} == {"bubblewrap"}
