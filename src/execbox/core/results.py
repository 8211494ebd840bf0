"""The one place an ExecResult is built from what a backend observed.

Every backend reports the same facts the same way: a run killed at its deadline has ``timed_out`` true and
exit code 124 (the convention of GNU ``timeout``, and the CLI's own exit status for a timeout), whatever
signal the backend used to kill it; a process that died of a signal is ``128 + signal``; an OOM kill is
only reported for a run that did not time out; output is the bounded capture's head and tail.
"""

from __future__ import annotations

from execbox.core.models import ExecResult
from execbox.core.output import BoundedCapture

#: The exit code of every run that was killed at its deadline, on every backend.
TIMEOUT_EXIT_CODE = 124


def exit_status(code: int | None) -> int:
    """A raw status as the shell reports it: a negative (signal) status becomes 128+signal; unknown is 137."""
    if code is None:
        return 137
    return 128 - code if code < 0 else code


def build_result(*, exit_code: int | None, stdout: BoundedCapture, stderr: BoundedCapture, timed_out: bool,
                 duration_s: float, oom_killed: bool = False, notes: list[str] | None = None) -> ExecResult:
    """The result of one run. ``exit_code`` is what the backend saw (None when it could not tell)."""
    return ExecResult(
        exit_code=TIMEOUT_EXIT_CODE if timed_out else exit_status(exit_code),
        stdout=stdout.text(),
        stderr=stderr.text(),
        timed_out=timed_out,
        truncated=stdout.truncated or stderr.truncated,
        oom_killed=oom_killed and not timed_out,
        duration_s=round(duration_s, 4),
        notes=list(notes or []),
    )


def failed_to_start(exit_code: int, message: str) -> ExecResult:
    """A command that could not be executed at all (127 not found, 126 not executable), like a shell says."""
    return ExecResult(exit_code=exit_code, stderr=message if message.endswith("\n") else message + "\n")
