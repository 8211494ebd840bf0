"""What OpenTelemetry tracing costs a one-shot, measured side by side in one run (the machine is shared and noisy:
compare the pairs).

    .venv/bin/python bench/bench_telemetry.py [--runs 200] [--backend bubblewrap] [--readme]

One run of `true`, tracing off and on, interleaved (off, on, on, off, off, on, ...): median and p99 of each, and the
median of the per-pair difference; then what a run records, timed alone (the same spans and metric points). "On" is
the SDK's TracerProvider and MeterProvider with the in-memory span exporter and metric reader (every span and metric
point recorded and kept; no network). "Off" is execbox as it runs where nothing loaded opentelemetry
(``execbox.telemetry.active`` answering False): the path of every user without it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from unittest import mock

from _common import median_ms, p99, write_readme  # bench/_common.py (run from the repo: python bench/NAME.py)
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import execbox.telemetry as telemetry
from execbox import ExecResult, Runner, Settings


def recorded(result: ExecResult) -> None:
    """What execbox records of a one-shot, without the run: the same spans, attributes and metric points."""
    attrs = {"execbox.backend": "bubblewrap", "execbox.network": "none"}
    with telemetry.span("execbox.run") as run:
        with telemetry.span("execbox.admit", {"execbox.opening": False}) as admit:
            telemetry.annotate(admit, {"execbox.verdict": "admitted", **attrs})
        with telemetry.span("execbox.sandbox.open", {**attrs, "execbox.pooled": False}):
            telemetry.sandbox_opened("bubblewrap")
        with telemetry.span("execbox.exec", attrs) as exec_span:
            telemetry.annotate(exec_span, {"process.exit.code": 0, "execbox.outcome": telemetry.outcome(result),
                                           "execbox.timed_out": False, "execbox.oom_killed": False})
        telemetry.record_run(result, backend="bubblewrap")
        with telemetry.span("execbox.sandbox.close", attrs):
            telemetry.sandbox_opened("bubblewrap", -1)
        telemetry.annotate(run, {"execbox.outcome": "ok", "execbox.pooled": False})
    telemetry.record_queued(0.0, backend="bubblewrap")


def median_us(fn: Callable[[], object], runs: int) -> float:
    return median_ms(fn, runs) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--backend", default="bubblewrap")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's bench:telemetry rows")
    args = parser.parse_args()

    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    local = args.backend == "local_subprocess"
    runner = Runner(Settings(backend=args.backend, local=local, network="host" if local else "none",
                             audit_log="off"))
    off = mock.patch.object(telemetry, "active", lambda: False)

    def once(traced: bool) -> float:
        started = time.perf_counter()
        if traced:
            result = runner.run(["true"])
        else:
            with off:
                result = runner.run(["true"])
        assert result.ok, result
        return (time.perf_counter() - started) * 1000

    once(False), once(True)  # warm-up: the backend's check, imports, the first instruments
    pairs = []
    for i in range(args.runs):  # which goes first alternates: a run's clean-up must not weigh on one side only
        if i % 2:
            on_ms = once(True)
            pairs.append((once(False), on_ms))
        else:
            pairs.append((once(False), once(True)))
    result = runner.run(["true"])
    runner.close()
    spans = len(exporter.get_finished_spans()) - 5
    assert spans == 5 * (args.runs + 1), spans  # each traced run was traced: run, admit, open, exec, close
    offs, ons = [p[0] for p in pairs], [p[1] for p in pairs]
    diff = statistics.median(b - a for a, b in pairs)
    n = args.runs * 10
    alone = median_us(lambda: recorded(result), n)
    rows = [
        (f"one-shot `true` on {args.backend}, tracing off", f"{statistics.median(offs):.1f} ms / {p99(offs):.1f} ms"),
        (f"one-shot `true` on {args.backend}, tracing on (SDK, in-memory exporter)",
         f"{statistics.median(ons):.1f} ms / {p99(ons):.1f} ms"),
        ("added by tracing, median of the per-pair difference", f"{diff:+.2f} ms"),
        ("what a run records, alone (its 5 spans with their attributes, its metric points; no sandbox)",
         f"{alone:.0f} µs"),
    ]
    for what, value in rows:
        print(f"{what}: {value}")
    print(f"({args.runs} interleaved pairs; {spans // (args.runs + 1)} spans per traced run)")
    if args.readme:
        write_readme("telemetry", rows, f"`.venv/bin/python bench/bench_telemetry.py --runs {args.runs} --readme`",
                     figure="median / p99")


if __name__ == "__main__":
    main()
