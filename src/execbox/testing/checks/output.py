"""Checks of the output a caller gets: the cap keeps its head and tail, and streamed output equals the
result (and, when streaming is claimed, arrives while the command runs)."""

from __future__ import annotations

from typing import Any

from execbox import ExecResult, OutputEvent, run_blocking
from execbox.testing.framework import Family, Kit, NotClaimed, expect, shown
from execbox.testing.probes import HANDSHAKE

family = Family()


@family.check("output over the cap keeps its head and tail")
def check_output_cap_keeps_head_and_tail(kit: Kit) -> None:
    claim = "output over the cap keeps its head and tail"
    cap = 10_000
    result = kit.code("import sys\nsys.stdout.write('HEAD' + 'x' * 2_000_000 + 'TAIL')\n"
                      "sys.stderr.write('ERRHEAD' + 'y' * 500_000 + 'ERRTAIL')", max_output_bytes=cap)
    expect(result.exit_code == 0 and result.truncated, claim, "exit 0 and truncated=True", shown(result))
    for name, text, head, tail in (("stdout", result.stdout, "HEAD", "TAIL"),
                                   ("stderr", result.stderr, "ERRHEAD", "ERRTAIL")):
        expect(text.startswith(head) and text.endswith(tail) and "bytes omitted" in text, claim,
               f"{name} to start with {head}, end with {tail} and say 'bytes omitted'",
               text[:80] + " ... " + text[-80:])
        expect(len(text.encode()) <= cap + 200, claim, f"{name} within {cap} bytes (+200 for the notice)",
               f"{len(text.encode())} bytes")


@family.check("output under the cap is not truncated")
def check_small_output_is_not_truncated(kit: Kit) -> None:
    result = kit.run(["printf", "%s", "abc"], max_output_bytes=3)
    expect((result.stdout, result.truncated) == ("abc", False), "output under the cap is not truncated",
           "stdout 'abc', truncated=False", shown(result))


# --- streaming ----------------------------------------------------------------------------------------------


def _events(stream: Any) -> tuple[list[OutputEvent], ExecResult]:
    """Drain an async stream (``runner.aio.stream(...)``) from sync code: its events and its result."""

    async def drain() -> tuple[list[OutputEvent], ExecResult]:
        events: list[OutputEvent] = []
        async for event in stream:
            if isinstance(event, OutputEvent):
                events.append(event)
            else:
                return events, event
        raise AssertionError("a stream ends with its result")

    return run_blocking(drain)


@family.check("a claimed stream delivers output while the command runs")
def check_streaming_delivers_output_while_running(kit: Kit) -> str:
    claim = "a claimed stream delivers output while the command runs"
    if not kit.caps.streaming:
        raise NotClaimed("the backend does not claim streaming (its output reaches the caller when a run ends)")
    if kit.caps.persistent_sessions and kit.caps.file_transfer:
        async def handshake() -> tuple[list[str], ExecResult | None]:
            seen: list[str] = []
            async with kit.runner.aio.sandbox(kit.backend, network=kit.net) as sb:
                async for event in sb.stream(["/bin/sh", "-c", HANDSHAKE], timeout=60):
                    if not isinstance(event, OutputEvent):
                        return seen, event
                    seen.append(event.text)
                    if "ready" in "".join(seen) and "ready" in event.text:
                        await sb.write_file("go", b"")  # the answer, while the command still waits for it
            return seen, None

        seen, result = run_blocking(handshake)
        expect(result is not None and result.stdout == "ready\ngot-go\n", claim,
               "the command to see the caller's answer to its first line ('ready\\ngot-go\\n')",
               f"{shown(result) if result else 'no result'}; events {seen!r}")
        return "the caller answered the first line while the command ran"
    # No session to answer in: the first line must come in an event of its own, before the second (2 s later).
    events, result = _events(kit.runner.aio.stream("echo early; sleep 2; echo late", backend=kit.backend,
                                                   network=kit.net))
    texts = [e.text for e in events if e.kind == "output"]
    first = next((i for i, t in enumerate(texts) if "early" in t), None)
    second = next((i for i, t in enumerate(texts) if "late" in t), None)
    expect(result.stdout == "early\nlate\n" and first is not None and second is not None and first < second, claim,
           "'early' in an event before the one with 'late' (written 2 s after it)",
           f"{shown(result)}; events {texts!r}")
    return "the first line arrived in an event before the second"


@family.check("streamed output is exactly the result's, cut at the cap like it")
def check_streamed_output_is_the_result(kit: Kit) -> None:
    claim = "streamed output is exactly the result's, cut at the cap like it"
    cap = 10_000
    code = ("import sys\nsys.stdout.write('HEAD' + 'x' * 300000 + 'TAIL')\nsys.stdout.flush()\n"
            "sys.stderr.write('caf\\u00e9 ' * 3)")
    plain = kit.code(code, max_output_bytes=cap)
    events, streamed = _events(kit.runner.aio.stream_code(code, backend=kit.backend, network=kit.net,
                                                          max_output_bytes=cap))
    same = ("exit_code", "stdout", "stderr", "truncated", "timed_out")
    expect(all(getattr(plain, f) == getattr(streamed, f) for f in same), claim,
           f"the streamed run's {', '.join(same)} equal to the plain run's", f"{shown(plain)} vs {shown(streamed)}")
    expect(plain.truncated and plain.stderr == "café café café ", claim, "stdout truncated, stderr whole",
           shown(plain))
    for name, text in (("stdout", streamed.stdout), ("stderr", streamed.stderr)):
        joined = "".join(e.text for e in events if e.stream == name and e.kind == "output")
        expect(joined == text, claim, f"the {name} events, joined, to be the result's {name}",
               f"{len(joined)} characters, {joined[:60]!r}...{joined[-60:]!r}")
    drops = [i for i, e in enumerate(events) if e.kind == "dropped"]
    expect([events[i].stream for i in drops] == ["stdout"], claim, "one 'dropped' event, for stdout",
           [e.model_dump() for e in events if e.kind == "dropped"])
    before = "".join(e.text for e in events[:drops[0]] if e.stream == "stdout")
    expect(len(before.encode()) <= cap - cap // 2, claim,
           f"at most the head ({cap - cap // 2} bytes) of stdout delivered before it says it drops",
           f"{len(before.encode())} bytes")
