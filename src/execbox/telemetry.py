"""OpenTelemetry spans and metrics of execbox (issue 31), through the official API's global providers.

Optional (``pip install 'execbox[otel]'``) and never imported here: execbox records only once something in the
process has imported ``opentelemetry`` (an application that configured a provider has, and so has
``opentelemetry-instrument``). Until then each call below is one ``sys.modules`` lookup; with the API imported but
no provider set, the API's no-op tracer and meter record nothing, and no attribute is even built.

execbox's own processes set providers up themselves (``export``), only when asked: `execbox run` and `execbox batch`
when OTEL_EXPORTER_OTLP_* is set (under the caller's TRACEPARENT), `execbox mcp` for OTLP likewise and over HTTP for
its /metrics page (``execbox[prometheus]``).

What is recorded is names, numbers and outcomes: never an env value, a secret, a placeholder or output text. The
command line (``process.command_args``) only when the operator opts in (CODE_EXEC_OTEL_COMMAND_ARGS): it can hold
a secret the caller typed.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import Span

SCOPE = "execbox"
Attrs = Mapping[str, str | bool | int | float | Sequence[str]]


def active() -> bool:
    """Whether the OpenTelemetry API is loaded in this process (by whoever configures a provider)."""
    return "opentelemetry.trace" in sys.modules


@contextlib.contextmanager
def span(name: str, attributes: Attrs | None = None) -> Iterator[Span | None]:
    """A span named ``name``, a child of the current one (the caller's, in this task or thread); None when
    OpenTelemetry is not loaded. An exception ending it sets its status and ``error.type`` (the semantic
    convention), never the message: a backend's error may quote what the code printed."""
    if not active():
        yield None
        return
    from opentelemetry import trace

    tracer = trace.get_tracer(SCOPE)
    with tracer.start_as_current_span(name, attributes=dict(attributes or {}), record_exception=False,
                                      set_status_on_exception=False) as current:
        try:
            yield current
        except BaseException as exc:
            if current.is_recording():
                current.set_attribute("error.type", type(exc).__qualname__)
                current.set_status(trace.StatusCode.ERROR)
            raise


def current_span() -> Span | None:
    """The current span (the caller's, or one of execbox's), or None when OpenTelemetry is not loaded."""
    if not active():
        return None
    from opentelemetry import trace

    return trace.get_current_span()


def annotate(current: Span | None, attributes: Attrs) -> None:
    """Attributes set on ``current`` once they are known (a no-op without a recording span)."""
    if current is not None and current.is_recording():
        current.set_attributes(dict(attributes))


def outcome(result: Any) -> str:
    """One word for how a run ended: timeout, oom, ok (exit 0) or error (any other exit)."""
    if result.timed_out:
        return "timeout"
    if result.oom_killed:
        return "oom"
    return "ok" if getattr(result, "exit_code", 0) == 0 and getattr(result, "error", None) is None else "error"


def carry() -> Callable[[], object]:
    """The current trace context, to be made current again in another thread's task (the sync facade's loop
    thread starts each call in a fresh context): what makes a sync caller's span the parent there too. The
    task's context is its own, dropped with it: nothing to detach."""
    if not active():
        return lambda: None
    from opentelemetry import context

    return functools.partial(context.attach, context.get_current())


# --- metrics -----------------------------------------------------------------------------------------------------


#: The histograms' buckets, in seconds (the SDK's default ones, 0 to 10000, are made for milliseconds: every run
#: would fall in the first two).
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class _Instruments:
    """The instruments, made once on first use (the API's meter is a proxy until a provider is set, then real)."""

    def __init__(self) -> None:
        from opentelemetry import metrics

        meter = metrics.get_meter(SCOPE)
        self.duration = meter.create_histogram("execbox.run.duration", unit="s",
                                               description="How long runs took, by backend and outcome",
                                               explicit_bucket_boundaries_advisory=SECONDS)
        self.queued = meter.create_histogram("execbox.run.queue_time", unit="s",
                                             description="How long runs waited for a sandbox slot",
                                             explicit_bucket_boundaries_advisory=SECONDS)
        self.timeouts = meter.create_counter("execbox.run.timeouts", description="Runs killed at their timeout")
        self.ooms = meter.create_counter("execbox.run.oom_kills", description="Runs killed at their memory limit")
        self.refusals = meter.create_counter("execbox.refusals", description="Requests refused, by reason")
        self.egress = meter.create_counter("execbox.egress.connections",
                                           description="Connections through the egress proxy, allowed or denied")
        self.swept = meter.create_counter("execbox.orphans.swept",
                                          description="Orphaned sandboxes removed by a backend's start-up sweep")
        self.live = meter.create_up_down_counter("execbox.sandboxes.live",
                                                 description="Sandboxes open in this process")
        meter.create_observable_gauge("execbox.pool.depth", callbacks=[_pool_depth],
                                      description="Warm sandboxes ready in the pool, by backend")


_instruments: _Instruments | None = None


def _meters() -> _Instruments | None:
    global _instruments
    if not active():
        return None
    if _instruments is None:
        _instruments = _Instruments()
    return _instruments


def record_run(result: Any, *, backend: str) -> None:
    """A run's duration, timeout or OOM kill, and its egress attempts (ExecResult, CellResult)."""
    if (m := _meters()) is None:
        return
    labels = {"execbox.backend": backend, "execbox.outcome": outcome(result)}
    m.duration.record(result.duration_s, labels)
    if result.timed_out:
        m.timeouts.add(1, {"execbox.backend": backend})
    if result.oom_killed:
        m.ooms.add(1, {"execbox.backend": backend})
    for attempt in getattr(result, "egress", ()):
        m.egress.add(1, {"execbox.backend": backend, "execbox.egress.allowed": attempt.allowed})


def record_queued(seconds: float, *, backend: str) -> None:
    """How long a run or a sandbox waited for a slot (CODE_EXEC_MAX_CONCURRENT)."""
    if (m := _meters()) is not None:
        m.queued.record(seconds, {"execbox.backend": backend})


def record_refusal(reason: str, *, backend: str | None) -> None:
    if (m := _meters()) is not None:
        m.refusals.add(1, {"execbox.refusal.reason": reason, "execbox.backend": backend or ""})


def record_swept(count: int, *, backend: str) -> None:
    if count and (m := _meters()) is not None:
        m.swept.add(count, {"execbox.backend": backend})


def sandbox_opened(backend: str, delta: int = 1) -> None:
    """A sandbox opened in this process (delta -1: closed)."""
    if (m := _meters()) is not None:
        m.live.add(delta, {"execbox.backend": backend})


class Pool(Protocol):
    def depths(self) -> Iterable[tuple[str, int]]: ...


_pools: weakref.WeakSet[Any] = weakref.WeakSet()


def watch_pool(pool: Pool) -> None:
    """Report ``pool``'s depth (by backend) while it lives."""
    _pools.add(pool)


def _pool_depth(options: CallbackOptions) -> Iterable[Observation]:
    from opentelemetry.metrics import Observation

    totals: dict[str, int] = {}
    for pool in list(_pools):
        for backend, depth in pool.depths():
            totals[backend] = totals.get(backend, 0) + depth
    return [Observation(depth, {"execbox.backend": backend}) for backend, depth in totals.items()]


# --- export: a long-running server's, and a CLI command's ---------------------------------------------------------

#: Any of these set: execbox exports its spans and metrics over OTLP (the standard variables; the SDK reads the rest
#: of them: headers, timeouts, OTEL_SERVICE_NAME, OTEL_METRIC_EXPORT_INTERVAL).
OTLP_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
OTLP_PACKAGES = "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
#: What serves the Prometheus page (`execbox mcp --http`'s /metrics): the SDK and its Prometheus reader.
PROMETHEUS_FIX = "pip install 'execbox[prometheus]'"
#: The most a process waits, as it ends, for what is pending to reach the collector: a collector that accepts the
#: connection and never answers must not hold a command (or a server's stop) for the exporter's own timeouts.
FLUSH_AT_EXIT_S = 3.0


class Exporting:
    """The SDK's providers that ``export`` set as the process's global ones: ONE meter provider for every reader
    (OTLP's, Prometheus's), and a tracer provider when spans go over OTLP."""

    def __init__(self, providers: list[Any], registry: Any | None, missing: str | None) -> None:
        self._providers = providers
        #: The private prometheus_client registry the Prometheus reader is in (None: no page served).
        self.registry = registry
        #: Why there is no Prometheus page although one was asked for (a module not installed), else None.
        self.missing = missing

    def metrics_page(self) -> tuple[bytes, str] | None:
        """The Prometheus text exposition of this process's metrics, and its content type; None without a reader."""
        if self.registry is None:
            return None
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def shutdown(self, timeout_s: float = FLUSH_AT_EXIT_S) -> bool:
        """Flush what is pending and stop the providers, waiting ``timeout_s`` at most (the flush goes on in a
        daemon thread, dropped when the process ends); False when it did not finish in time."""
        import threading

        def stop() -> None:
            for provider in self._providers:
                with contextlib.suppress(Exception):  # the SDK logs an exporter's failure; the process goes on
                    provider.shutdown()

        stopping = threading.Thread(target=stop, daemon=True, name="execbox-telemetry-flush")
        stopping.start()
        stopping.join(timeout_s)
        return not stopping.is_alive()


def export(environ: Mapping[str, str], *, prometheus: bool = False) -> Exporting | None:
    """The SDK's providers, set as the process's global ones, for what the environment asks: over OTLP/HTTP when it
    names an endpoint (OTLP_VARS), and to a Prometheus page when ``prometheus``. None when neither. Raises
    ModuleNotFoundError when OTLP is asked for and the SDK or its exporter (OTLP_PACKAGES) is not installed; a
    missing Prometheus reader is ``Exporting.missing`` instead (the page says so, the rest goes on)."""
    otlp = any(environ.get(var) for var in OTLP_VARS)
    if not otlp and not prometheus:
        return None
    readers: list[Any] = []
    registry, missing = None, None
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if prometheus:
        try:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry
        except ModuleNotFoundError as exc:
            missing = exc.name or "opentelemetry-exporter-prometheus"
        else:
            # A registry of its own: the page holds execbox's metrics, not whatever else registered in the default one
            registry = CollectorRegistry(auto_describe=True)
            readers.append(PrometheusMetricReader(registry=registry))
    if not readers:
        return Exporting([], None, missing)
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    # OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES) names the service when set; execbox's name otherwise
    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": "execbox"})
    # shutdown_on_exit=False: the SDK's own atexit shutdown would wait on the exporter unbounded; Exporting's is
    providers: list[Any] = [MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)]
    metrics.set_meter_provider(providers[0])
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(tracer_provider)
        providers.insert(0, tracer_provider)  # spans flushed first: the metrics' last collection follows them
    return Exporting(providers, registry, missing)


#: The caller's trace, in the environment (OpenTelemetry's environment-variable carrier: the W3C trace context's
#: headers as upper-case variables).
TRACE_VARS = ("TRACEPARENT", "TRACESTATE")


def export_from_cli(environ: Mapping[str, str]) -> Exporting | None:
    """For a CLI command that runs code (`execbox run`, `execbox batch`, also in a child of `execbox serve`): its spans
    and metrics over OTLP when the environment names an endpoint, flushed at exit within FLUSH_AT_EXIT_S; and the
    caller's trace (TRACEPARENT, TRACESTATE) as the parent of its spans, when something records them (that export,
    or an application's provider: `opentelemetry-instrument execbox ...`). Nothing imported, and None, otherwise.
    Raises ModuleNotFoundError as ``export`` does."""
    exporting = export(environ)
    if exporting is not None:
        import atexit

        atexit.register(flush, exporting)
    if environ.get("TRACEPARENT") and active():
        from opentelemetry import context, propagate

        # The variables are the W3C headers by another name: the configured propagator reads them as headers
        carrier = {name.lower(): environ[name] for name in TRACE_VARS if environ.get(name)}
        context.attach(propagate.extract(carrier))  # for the rest of the process: never detached
    return exporting


def flush(exporting: Exporting) -> None:
    """As a process ends: what is pending goes out within FLUSH_AT_EXIT_S, or is dropped with a line on stderr."""
    if not exporting.shutdown():
        sys.stderr.write(f"execbox: telemetry export did not finish within {FLUSH_AT_EXIT_S:g}s (is the OTLP "
                         "collector answering?); what was pending is dropped\n")
