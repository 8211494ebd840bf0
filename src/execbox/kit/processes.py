"""Running a local process with the timeout and output rules: streamed into a bounded capture, the whole
process tree killed at the deadline. Shared by every backend whose sandbox is a local process.

The request's environment reaches the sandboxed command only. Every process that runs on the host before
it (the reaper, a launcher such as ``unshare`` or ``bwrap``, a shell a launcher starts) runs with the
caller's privileges, so it gets ``host_env()``; in it, a request's LD_PRELOAD pointing at a library the
code wrote into its workspace, or a BASH_ENV, would run the code's choice with those privileges.
``CommandEnv`` carries the command's variables past them, off every command line and outside the
workspace, to the command's own execve (see _reaper.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

import anyio

from execbox.contract.models import ExecResult
from execbox.contract.output import BoundedCapture, OnOutput
from execbox.contract.results import build_result, exit_status
from execbox.errors import SandboxError
from execbox.policy.env import host_env, is_injection_name
from execbox.secrets.values import Redactor

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


class CommandEnv:
    """The sandboxed command's whole environment, held for its execve alone.

    The variables sit in an anonymous in-memory file (memfd: no path, nothing in the workspace or on a
    command line) whose descriptor the host-side processes inherit and never read. The last step before
    the command reads and closes it: the reaper itself (``reaped(..., command_env=)``) when nothing stands
    between them, or ``exec_step(argv)``, the command line a launcher runs in place of ``argv``. Pass it to
    ``run_process(command_env=)`` so the descriptor is inherited; close it (or use ``with``) afterwards.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        # Encoded here, so a value that cannot be an environment string fails in the caller, as before.
        data = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
        self.fd = os.memfd_create("execbox-env", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except BaseException:
            os.close(self.fd)
            raise

    def exec_step(self, argv: list[str]) -> list[str]:
        """``argv`` preceded by the step that gives it this environment: what a launcher should start."""
        return [sys.executable, "-I", "-S", _REAPER, "--exec-env", str(self.fd), *argv]

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> CommandEnv:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def reaped(argv: list[str], *, rlimits: dict[str, int] | None = None,
           command_env: CommandEnv | None = None) -> list[str]:
    """``argv`` wrapped so that every process it starts dies with it (see _reaper.py). With ``command_env``,
    ``argv`` is the command itself and gets that environment; without, ``argv`` inherits the reaper's."""
    config: dict[str, object] = {"parent": os.getpid(), "rlimits": rlimits or {}}
    if command_env is not None:
        config["env_fd"] = command_env.fd
    return [sys.executable, "-I", "-S", _REAPER, json.dumps(config), *argv]


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
    env: dict[str, str] | None = None,
    cwd: str,
    stdin: bytes | None,
    timeout: float,
    max_output_bytes: int,
    terminate_signal: int = signal.SIGTERM,
    command_env: CommandEnv | None = None,
    on_output: OnOutput | None = None,
    redactor: Redactor | None = None,
) -> ProcessOutcome:
    """Run ``argv`` (usually already wrapped by ``reaped`` or a sandbox launcher) to completion or deadline.

    ``env`` is the environment of the host-side process ``argv`` starts (default ``host_env()``), never the
    request's: loader and interpreter-injection variables are removed from it whatever a backend passes.
    The command's own variables travel in ``command_env``. At the deadline ``terminate_signal`` goes to the
    process, whose job is to kill its tree; after a grace period the whole process group is SIGKILLed.
    Cancellation kills the same way before re-raising. ``on_output`` (the spec's) receives the output as it
    is read, chunk by chunk, for a streaming caller; ``redactor`` (the spec's) redacts it as it is captured.
    """
    proc = await start_process(argv, env=env, cwd=cwd, command_env=command_env)
    return await finish_process(proc, stdin=stdin, timeout=timeout, max_output_bytes=max_output_bytes,
                                terminate_signal=terminate_signal, on_output=on_output, redactor=redactor)


async def start_process(argv: list[str], *, env: dict[str, str] | None = None, cwd: str,
                        command_env: CommandEnv | None = None) -> asyncio.subprocess.Process:
    """The first half of ``run_process``: ``argv`` started in a new session, its three streams pipes; for a
    process started ahead of its run (an armed one, see ``ARMED``). Hand it to ``finish_process`` or
    ``stop_process``, in the same event loop."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in (host_env() if env is None else env).items() if not is_injection_name(k)},
        cwd=cwd,
        start_new_session=True,
        pass_fds=(command_env.fd,) if command_env else (),
    )


async def finish_process(proc: asyncio.subprocess.Process, *, stdin: bytes | None, timeout: float,
                         max_output_bytes: int, terminate_signal: int = signal.SIGTERM,
                         on_output: OnOutput | None = None, redactor: Redactor | None = None) -> ProcessOutcome:
    """The second half of ``run_process``: ``stdin`` in, the output captured, the deadline ``timeout`` from now."""
    out = BoundedCapture(max_output_bytes, on_output, "stdout", redactor=redactor)
    err = BoundedCapture(max_output_bytes, on_output, "stderr", redactor=redactor)
    started = time.monotonic()
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


async def stop_process(proc: asyncio.subprocess.Process, terminate_signal: int = signal.SIGTERM) -> None:
    """End a started process that will not be finished (an armed one never used): as at a deadline; its stdin
    closed too, so that its transport can finish."""
    with anyio.CancelScope(shield=True):
        await _kill(proc, terminate_signal)
        if proc.stdin is not None:
            proc.stdin.close()


# A process started before its command is known (a warm sandbox's first run) waits in ARMED for one script on its
# stdin: the script's length on a line, then the script (head -c reads exactly that many bytes, so the command's
# own stdin follows untouched). A script cut short lacks its last line and is refused. Closed stdin: exit 0.
_ARMED_END = "\n#armed"
ARMED = f'IFS= read -r n || exit 0; s=$(head -c "$n"); case $s in *"{_ARMED_END}") eval "$s";; *) exit 125;; esac'


def armed_script(command: list[str], env: dict[str, str], workdir: str, *, backend: str,
                 cpu_s: int | None = None) -> bytes:
    """What an ARMED process runs: ``command`` in ``workdir`` with exactly ``env``, length first. ``cpu_s``: the
    run's CPU-time limit, lowered to that first (the process was armed before the run's timeout was known)."""
    words = [*(f"{k}={v}" for k, v in env.items()), *command]
    if any("\0" in w for w in [*words, workdir]):
        raise SandboxError("a command, variable or directory with a NUL byte cannot be passed to a process",
                           backend=backend)
    limit = f"ulimit -t {int(cpu_s)} && " if cpu_s is not None else ""
    script = f"{limit}cd -- {shlex.quote(workdir)} && exec env -i -- {shlex.join(words)}{_ARMED_END}"
    data = script.encode("utf-8", "surrogateescape")
    return b"%d\n" % len(data) + data


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


def untrusted_binary(path: str) -> str | None:
    """Why the binary at ``path`` (a sandbox launcher: bwrap, runsc) may not be what it claims, or None. As root,
    execbox would hand every sandbox to whoever can replace the file: it and each directory above it must be
    root's and writable by nobody else (a sticky directory protects root's file). Not as root: root's or the
    caller's."""
    allowed = {0} if os.geteuid() == 0 else {0, os.geteuid()}
    current = path
    while True:
        try:
            st = os.stat(current)
        except OSError as exc:
            return f"cannot stat {current}: {exc.strerror}"
        if st.st_uid not in allowed:
            return f"{current} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
            return f"{current} is writable by its group or by others"
        if current == "/":
            return None
        current = os.path.dirname(current)
