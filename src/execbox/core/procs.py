"""Running a local process with the timeout and output rules: streamed into a bounded capture, the whole
process tree killed at the deadline. Shared by every backend whose sandbox is a local process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass

import anyio

from execbox.core.models import ExecResult
from execbox.core.output import BoundedCapture
from execbox.core.results import build_result, exit_status

_REAPER = os.path.join(os.path.dirname(__file__), "_reaper.py")
_CHUNK = 65536
# After the deadline: how long the tree gets to die before the process group is SIGKILLed, and how long
# the pipes may stay open after that (a process that escaped everything must not hang the caller).
_GRACE_S = 2.0


@dataclass
class ProcessOutcome:
    exit_code: int
    stdout: BoundedCapture
    stderr: BoundedCapture
    timed_out: bool
    duration_s: float

    def to_result(self, *, oom_killed: bool = False) -> ExecResult:
        return build_result(exit_code=self.exit_code, stdout=self.stdout, stderr=self.stderr,
                            timed_out=self.timed_out, duration_s=self.duration_s, oom_killed=oom_killed)


def reaped(argv: list[str], *, rlimits: dict[str, int] | None = None) -> list[str]:
    """``argv`` wrapped so that every process it starts dies with it (see _reaper.py)."""
    config = json.dumps({"parent": os.getpid(), "rlimits": rlimits or {}})
    return [sys.executable, "-I", "-S", _REAPER, config, *argv]


async def _pump(stream: asyncio.StreamReader, capture: BoundedCapture) -> None:
    while chunk := await stream.read(_CHUNK):
        capture.write(chunk)


async def _feed(writer: asyncio.StreamWriter, data: bytes | None) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()
        await writer.wait_closed()


async def run_process(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    stdin: bytes | None,
    timeout: float,
    max_output_bytes: int,
    terminate_signal: int = signal.SIGTERM,
) -> ProcessOutcome:
    """Run ``argv`` (usually already wrapped by ``reaped`` or a sandbox launcher) to completion or deadline.

    At the deadline ``terminate_signal`` goes to the process, whose job is to kill its tree; after a grace
    period the whole process group is SIGKILLed. Cancellation kills the same way before re-raising.
    """
    out, err = BoundedCapture(max_output_bytes), BoundedCapture(max_output_bytes)
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    assert proc.stdin and proc.stdout and proc.stderr
    io = asyncio.gather(_feed(proc.stdin, stdin), _pump(proc.stdout, out), _pump(proc.stderr, err))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
        except TimeoutError:
            timed_out = True
            await _kill(proc, terminate_signal)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(io), _GRACE_S)
    except BaseException:
        # Shielded: the caller's cancellation must not cut the kill short (anyio re-delivers it).
        with anyio.CancelScope(shield=True):
            await _kill(proc, terminate_signal)
        raise
    finally:
        io.cancel()
        with contextlib.suppress(BaseException):
            await io
    return ProcessOutcome(
        exit_code=exit_status(proc.returncode),
        stdout=out,
        stderr=err,
        timed_out=timed_out,
        duration_s=time.monotonic() - started,
    )


async def _kill(proc: asyncio.subprocess.Process, first: int) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(first)
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), _GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
