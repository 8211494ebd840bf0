"""A persistent Python interpreter per session, for ``run_cell``: variables, imports and open files persist.

Why not Jupyter (jupyter_client + ipykernel)? ipykernel would have to be inside every sandbox: in every
image (Debian has python3-ipykernel, but the default image and any image a caller brings lack it), in the
host Python that bubblewrap binds, on every SSH host and remote provider; and ZeroMQ's IPC sockets are
reachable from here only for backends whose workspace is a host directory. What is needed is small: run a
cell, stream its output, return its displayed values as MIME bundles, interrupt it. So the interpreter is
``payload.py``: standard library only, any ``python3`` >= 3.8, talking JSON over a Unix socket in
the workspace (works with network none). Values with ``_repr_*_`` methods (pandas, IPython.display
objects) come back as Jupyter-style MIME bundles, and matplotlib figures as PNG through an inline backend.

How it runs, on any backend with persistent sessions:

    the supervisor   one long exec of the session (``python3 -I -S -c SOURCE serve SOCKET``) that lives
                     until the session closes; it starts the interpreter process and enforces each cell's
                     deadline inside the sandbox: SIGINT at the timeout, SIGKILL ``INTERRUPT_GRACE_S`` later
    each cell        a short exec of a relay (``CLIENT``) that sends the cell and copies the supervisor's JSON
                     lines to its stdout; they reach this process through the exec's streamed output
                     (``ExecSpec.on_output``), or at its end on a backend that does not stream

What this side trusts: nothing. Every line is parsed with a bound (``CellParser``): the cell's stdout and
stderr are bounded captures (head and tail, as for any run), rich outputs are capped by
CODE_EXEC_MAX_DISPLAY_BYTES in all, an over-long line is skipped, not buffered. A supervisor that stops
answering is killed from here and the result says the state was lost. State is never lost silently: a
cell that had to kill the interpreter, or the first cell after the interpreter died (a memory limit, a
timed-out ``exec`` in a session that kills every sandbox process), says ``state_lost`` with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from execbox.contract.models import CellError, CellResult, DisplayData, ExecResult, ExecSpec, Limits, NetworkMode
from execbox.contract.output import BoundedCapture, LiveOutput, StreamName
from execbox.errors import SandboxError
from execbox.secrets.values import Redactor

SOURCE = Path(__file__).with_name("payload.py").read_text()
#: How long a cell has, after its timeout's SIGINT, to stop before the interpreter is killed (state lost).
INTERRUPT_GRACE_S = 2.0
#: How long a cell's relay waits for the supervisor's socket (a supervisor just started).
STARTUP_WAIT_S = 30.0
#: How long past the cell's own deadline (and the grace) the relay may run before this side gives up on it.
RELAY_SLACK_S = 15.0
#: The supervisor's own stdout/stderr (it prints nothing unless it fails): kept for the error message.
SERVER_OUTPUT_BYTES = 64 << 10
_LINE_OVERHEAD = 1 << 20
#: Rich outputs one cell may return, whatever their size (each is an object in this process).
MAX_DISPLAYS = 1000
#: JSON structure one line may hold (commas, colons, brackets): parsing builds an object per item, so a line of
#: tiny items would cost far more memory than its length; a line over this is skipped unparsed.
MAX_LINE_ITEMS = 500_000

CLIENT = """\
import socket, sys, time
path, wait = sys.argv[1], float(sys.argv[2])
request = sys.stdin.buffer.read()
deadline = time.monotonic() + wait
while True:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        break
    except OSError:
        s.close()
        if time.monotonic() > deadline:
            sys.stdout.write('{"t":"nokernel"}\\n')
            sys.exit(3)
        time.sleep(0.02)
s.sendall(request)
out = sys.stdout.buffer
while True:
    data = s.recv(65536)
    if not data:
        break
    out.write(data)
    out.flush()
"""

RunExec = Callable[[ExecSpec], Awaitable[ExecResult]]

__all__ = ["CLIENT", "INTERRUPT_GRACE_S", "SOURCE", "CellParser", "CellResult", "Kernel"]


#: Display data nested deeper than this is dropped (a hostile _repr_json_ could nest thousands deep).
MAX_DISPLAY_DEPTH = 64


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value``, counted without recursion (stops past the limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            if deepest > MAX_DISPLAY_DEPTH:
                return deepest
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


class CellParser:
    """The relay's stdout (JSON lines from inside the sandbox), parsed as it arrives with every size bounded."""

    def __init__(self, max_output: int, max_display: int, live: LiveOutput | None = None,
                 redactor: Redactor | None = None) -> None:
        self.max_line = max_display + _LINE_OVERHEAD
        self.max_display = max_display
        self.buf = bytearray()
        self.skipping = False
        self.fed = 0
        self.captures: dict[StreamName, BoundedCapture] = {
            "stdout": BoundedCapture(max_output, live.feed if live else None, "stdout", redactor=redactor),
            "stderr": BoundedCapture(max_output, live.feed if live else None, "stderr", redactor=redactor),
        }
        self.outputs: list[DisplayData] = []
        self.display_bytes = 0
        self.dropped_displays = 0
        self.bad_lines = 0
        self.done: dict[str, Any] | None = None
        self.nokernel = False
        self.refused: str | None = None

    def feed(self, stream: StreamName, data: bytes) -> None:
        """An ``on_output`` callback: only the relay's stdout carries frames."""
        if stream != "stdout" or self.done is not None:
            return
        self.fed += len(data)
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            if self.skipping:
                if end >= 0:
                    self.skipping = False
            elif len(self.buf) + len(piece) > self.max_line:
                self.buf.clear()
                self.bad_lines += 1
                self.skipping = end < 0
            else:
                self.buf += piece
                if end >= 0:
                    line, self.buf = bytes(self.buf), bytearray()
                    self.line(line, len(line))
            if end < 0:
                break
            start = end + 1

    def line(self, raw: bytes, size: int) -> None:
        if not raw.strip():
            return  # a blank line is no frame (the end of a non-streaming backend's output)
        if sum(raw.count(c) for c in (b",", b":", b"[", b"{")) > MAX_LINE_ITEMS:
            self.bad_lines += 1
            return
        try:
            frame = json.loads(raw)
        except (ValueError, RecursionError):
            self.bad_lines += 1
            return
        if not isinstance(frame, dict):
            self.bad_lines += 1
            return
        kind = frame.get("t")
        if kind == "stream" and frame.get("s") in ("stdout", "stderr") and isinstance(frame.get("d"), str):
            self.captures[frame["s"]].write(frame["d"].encode("utf-8", errors="replace"))
        elif kind == "drop" and frame.get("s") in ("stdout", "stderr") and isinstance(frame.get("n"), int):
            self.captures[frame["s"]].skip(frame["n"])
        elif kind == "display":
            self.display(frame, size)
        elif kind == "done":
            self.done = frame
        elif kind == "nokernel":
            self.nokernel = True
        elif kind == "error":
            self.refused = str(frame.get("message"))[:200]

    def display(self, frame: dict[str, Any], size: int) -> None:
        data, metadata = frame.get("data"), frame.get("metadata")
        if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
            self.bad_lines += 1
            return
        if self.display_bytes + size > self.max_display or len(self.outputs) >= MAX_DISPLAYS:
            self.dropped_displays += 1
            return
        if _depth(data) > MAX_DISPLAY_DEPTH or _depth(metadata) > MAX_DISPLAY_DEPTH:
            # A value nested this deep breaks serialising (and redacting) the result: dropped, and counted.
            self.dropped_displays += 1
            return
        self.display_bytes += size
        self.outputs.append(DisplayData(kind="result" if frame.get("kind") == "result" else "display", data=data,
                                        metadata=metadata if isinstance(metadata, dict) else {}))

    def finish(self, result: ExecResult) -> None:
        """After the relay ended: a backend that does not stream delivers its whole output now."""
        if self.fed == 0 and result.stdout:
            self.feed("stdout", result.stdout.encode("utf-8", errors="replace") + b"\n")
        elif self.buf and not self.skipping and self.done is None:
            line, self.buf = bytes(self.buf), bytearray()
            self.line(line, len(line))


def _error(value: object) -> CellError | None:
    if not isinstance(value, dict):
        return None
    return CellError(name=str(value.get("name") or "Error")[:200], value=str(value.get("value") or "")[:65536],
                     traceback=str(value.get("traceback") or "")[:1 << 20])


class Kernel:
    """The interpreter of one session. ``run_cell`` runs one cell at a time; ``close`` before the session's."""

    def __init__(self, run: RunExec, *, workspace: str, network: NetworkMode, limits: Limits, lifetime_s: float,
                 max_output_bytes: int, max_display_bytes: int, streaming: bool, backend: str) -> None:
        self._run = run
        self.workspace = workspace
        self.network = network
        self.limits = limits
        self.lifetime_s = lifetime_s
        self.max_output_bytes = max_output_bytes
        self.max_display_bytes = max_display_bytes
        self.streaming = streaming
        self.backend = backend
        self._lock = asyncio.Lock()
        self._server: asyncio.Future[ExecResult] | None = None
        self._socket = ""
        self._created = time.monotonic()
        self._has_state = False  # a cell has run in the current interpreter: losing it must be said
        self._abandoned = False  # the caller gave up on the last cell: the next one takes over from it

    # -- the supervisor --

    def _spec(self, argv: list[str], *, stdin: bytes, timeout: float, cap: int,
              on_output: Callable[[StreamName, bytes], None] | None = None) -> ExecSpec:
        return ExecSpec(argv=argv, stdin=stdin, workdir=self.workspace, timeout=timeout, max_output_bytes=cap,
                        network=self.network, limits=self.limits, on_output=on_output)

    def _start(self) -> None:
        self._socket = f".execbox/kernel-{secrets.token_hex(6)}.sock"
        # Relative to the workspace (each exec starts there): no Unix socket path limit, whatever the workspace.
        spec = self._spec(["python3", "-I", "-S", "-c", SOURCE, "serve", self._socket], stdin=SOURCE.encode(),
                          timeout=max(1.0, self.lifetime_s - (time.monotonic() - self._created)),
                          cap=SERVER_OUTPUT_BYTES)
        self._server = asyncio.ensure_future(self._run(spec))
        self._has_state = False

    async def _stop(self, *, ask: bool) -> None:
        """End the supervisor (and the interpreter): ask it to exit, then cancel its exec (the backend kills it)."""
        server, self._server = self._server, None
        if server is None:
            return
        if ask and not server.done():
            with contextlib.suppress(Exception):
                await self._relay(b'{"op":"shutdown"}\n', wait=1.0, timeout=5.0)
        if not server.done():
            server.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({server}, timeout=10)
        if server.done() and not server.cancelled():
            server.exception()  # retrieved: its failure was reported, or does not matter any more

    def _server_gone(self) -> str:
        """Why the supervisor's exec ended, in words."""
        server = self._server
        if server is None or not server.done():
            return "the interpreter's supervisor stopped answering"
        if server.cancelled():
            return "the interpreter's supervisor was stopped"
        exc = server.exception()
        if exc is not None:
            return f"the interpreter's supervisor failed: {exc}"
        result = server.result()
        tail = (result.stderr or result.stdout).strip()[-500:]
        how = "timed out" if result.timed_out else f"exit {result.exit_code}"
        return f"the interpreter's supervisor ended ({how}){': ' + tail if tail else ''}"

    async def _relay(self, request: bytes, *, wait: float, timeout: float,
                     parser: CellParser | None = None) -> ExecResult:
        cap = SERVER_OUTPUT_BYTES
        if parser is not None and not self.streaming:
            # Everything comes in the result: room for the frames of the largest allowed cell.
            cap = 8 * self.max_output_bytes + 2 * self.max_display_bytes + _LINE_OVERHEAD
        spec = self._spec(["python3", "-I", "-S", "-c", CLIENT, self._socket, f"{wait:g}"], stdin=request,
                          timeout=timeout, cap=min(cap, 1 << 30), on_output=parser.feed if parser else None)
        return await self._run(spec)

    # -- cells --

    async def run_cell(self, code: str, *, timeout: float, live: LiveOutput | None = None,
                       redactor: Redactor | None = None) -> CellResult:
        """``redactor``: what redacts the cell's output as it is captured (the secrets its sandbox was given)."""
        async with self._lock:
            notes: list[str] = []
            lost_before = False
            if self._server is not None and self._server.done():
                if self._has_state:
                    lost_before = True
                    notes.append(f"the interpreter's state was lost before this cell: {self._server_gone()}; this "
                                 "cell ran in a fresh interpreter")
                await self._stop(ask=False)
            fresh = self._server is None
            if fresh:
                self._start()
            if live is not None:
                live.set_cap(self.max_output_bytes)
            result = await self._cell(code, timeout, fresh, live, redactor)
            if lost_before:
                result = result.model_copy(update={"state_lost": True})
            return result.model_copy(update={"notes": [*notes, *result.notes], "backend": self.backend})

    async def _cell(self, code: str, timeout: float, fresh: bool, live: LiveOutput | None,
                    redactor: Redactor | None = None) -> CellResult:
        parser = CellParser(self.max_output_bytes, self.max_display_bytes, live, redactor)
        request = json.dumps({"op": "execute", "code": code, "timeout": timeout, "grace": INTERRUPT_GRACE_S,
                              "max_output": self.max_output_bytes, "max_display": self.max_display_bytes,
                              "takeover": self._abandoned}, ensure_ascii=True).encode() + b"\n"
        wait = STARTUP_WAIT_S if fresh else 5.0
        started = time.monotonic()
        server = self._server
        assert server is not None
        relay = asyncio.ensure_future(self._relay(request, wait=wait, parser=parser,
                                                  timeout=timeout + 2 * INTERRUPT_GRACE_S + wait + RELAY_SLACK_S))
        try:
            await asyncio.wait({relay, server}, return_when=asyncio.FIRST_COMPLETED)
            if not relay.done():  # the supervisor ended first: its socket closed, the relay follows shortly
                await asyncio.wait({relay}, timeout=5)
        finally:
            if not relay.done():
                # Given up (cancelled): the supervisor interrupts the cell when the relay goes, or, where the
                # backend leaves a cancelled exec running (docker), when the next cell takes over.
                self._abandoned = True
                relay.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait({relay})
        if relay.cancelled():
            outcome: ExecResult | None = None
        else:
            outcome = relay.result()  # a broken sandbox (SandboxError) propagates as for any exec
            parser.finish(outcome)
        duration = time.monotonic() - started
        done = parser.done
        if done is not None:
            self._abandoned = False
            return self._from_done(parser, done, duration)
        if fresh and server.done() and (parser.fed == 0 or parser.nokernel):
            # The supervisor never served a cell: no python3, a sandbox that cannot run it. Not a cell's result.
            reason = self._server_gone()
            await self._stop(ask=False)
            raise SandboxError(f"the Python interpreter could not start in the sandbox: {reason}. run_cell needs "
                               "python3 (3.8 or later) in the sandbox", backend=self.backend)
        if parser.refused:
            raise SandboxError(f"the session's interpreter refused the cell ({parser.refused}): is something in the "
                               "sandbox holding its socket?", backend=self.backend)
        timed_out = outcome is not None and outcome.timed_out
        if server.done():
            why = self._server_gone()
        elif timed_out:
            why = "the interpreter did not answer within the cell's timeout and was stopped"
        else:
            why = "the interpreter's answer was cut short or unreadable; it was stopped"
        await self._stop(ask=not server.done())
        had_state, self._has_state = self._has_state, False
        return CellResult(
            stdout=parser.captures["stdout"].text(), stderr=parser.captures["stderr"].text(),
            outputs=parser.outputs, timed_out=timed_out,
            truncated=any(c.truncated for c in parser.captures.values()),
            error=CellError(name="InterpreterLost", value=why), state_lost=had_state or timed_out,
            duration_s=round(duration, 4), notes=[f"{why}; the next cell starts a fresh interpreter"])

    def _from_done(self, parser: CellParser, done: dict[str, Any], duration: float) -> CellResult:
        notes = []
        state_lost = bool(done.get("state_lost"))
        lost = done.get("lost")
        if state_lost:
            notes.append(f"the interpreter's state was lost: {str(lost or 'the interpreter died')[:500]}; the next "
                         "cell starts a fresh interpreter")
        inside = done.get("dropped_displays")
        dropped = parser.dropped_displays + (inside if isinstance(inside, int) and inside > 0 else 0)
        if dropped:
            notes.append(f"{dropped} rich output(s) dropped: over CODE_EXEC_MAX_DISPLAY_BYTES "
                         f"({self.max_display_bytes} bytes per cell), {MAX_DISPLAYS} outputs, or nested deeper than "
                         f"{MAX_DISPLAY_DEPTH} levels")
        if parser.bad_lines:
            notes.append(f"{parser.bad_lines} unreadable or oversized line(s) from the interpreter were skipped")
        count = done.get("count")
        count = count if isinstance(count, int) and count >= 0 else 0
        error = _error(done.get("error"))
        timed_out = bool(done.get("timed_out"))
        # A cell that completed leaves state behind; one that killed the interpreter leaves none.
        self._has_state = not (state_lost and count == 0)
        if state_lost and count == 0 and error is None:
            error = CellError(name="InterpreterLost", value=str(lost or "the interpreter died")[:2000])
        return CellResult(
            outputs=parser.outputs,
            stdout=parser.captures["stdout"].text(), stderr=parser.captures["stderr"].text(),
            error=error, execution_count=count, timed_out=timed_out,
            truncated=any(c.truncated for c in parser.captures.values()),
            oom_killed=bool(done.get("oom")) and not timed_out, state_lost=state_lost,
            duration_s=round(duration, 4), notes=notes)

    async def close(self) -> None:
        await self._stop(ask=False)
