"""The one place an ExecResult is built from what a backend observed.

Every backend reports the same facts the same way: a run killed at its deadline has ``timed_out`` true and
exit code 124 (the convention of GNU ``timeout``, and the CLI's own exit status for a timeout), whatever
signal the backend used to kill it; a process that died of a signal is ``128 + signal``; an OOM kill is
only reported for a run that did not time out; output is the bounded capture's head and tail.
"""

from __future__ import annotations

import re

from execbox.contract.models import ExecResult
from execbox.contract.output import BoundedCapture

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


#: What a program prints when it cannot reach the network (resolver, socket, curl, pip, requests, Node).
NETWORK_ERRORS = re.compile(
    r"Temporary failure in name resolution|Name or service not known|nodename nor servname|getaddrinfo|"
    r"Could not resolve host|Network is unreachable|No route to host|Failed to establish a new connection|"
    r"EAI_AGAIN|ENOTFOUND|ENETUNREACH|Could not connect to|Connection refused", re.I)


#: Who sets the longest timeout, by default: the operator.
MAX_TIMEOUT_BY = "CODE_EXEC_MAX_TIMEOUT_SEC"


def clamp_note(asked_timeout: float | None, max_timeout: float, by: str = MAX_TIMEOUT_BY) -> str | None:
    """The note that a requested timeout was cut to the ceiling ``max_timeout`` set by ``by``, or None."""
    if asked_timeout is None or asked_timeout <= max_timeout:
        return None
    return f"the requested timeout of {asked_timeout:g} s was clamped to {max_timeout:g} s, the maximum ({by})"


def timed_out(timeout: float, max_timeout: float, by: str = MAX_TIMEOUT_BY) -> tuple[str, bool]:
    """What a run (or a cell) killed at its timeout is told, and whether a retry can help: the ceiling named is the
    one that binds the caller (the operator's maximum, or an MCP grant's)."""
    if timeout < max_timeout:
        return (f"killed after {timeout:g} s: timeout; a longer timeout (up to {max_timeout:g} s, {by}) may let it "
                "finish", True)
    return f"killed after {timeout:g} s: timeout, the longest allowed ({by}); do less per run or make it faster", False


def explain(result: ExecResult, *, timeout: float, asked_timeout: float | None, max_timeout: float,
            memory_mb: int | None, network: str, max_timeout_by: str = MAX_TIMEOUT_BY) -> ExecResult:
    """The result with the limit that cut the run short (or stood in its way) said in one plain sentence, and
    whether trying again can help; a timeout clamped to the maximum is said in ``notes``. The one place these
    sentences are written, for the API, the CLI and the MCP tools alike."""
    notes = list(result.notes)
    clamped = clamp_note(asked_timeout, max_timeout, max_timeout_by)
    if clamped is not None:
        notes.append(clamped)
    limit: str | None = None
    explanation, retryable = "", False
    if result.timed_out:
        limit = "timeout"
        explanation, retryable = timed_out(timeout, max_timeout, max_timeout_by)
    elif result.oom_killed:
        limit = "memory"
        size = f" ({memory_mb} MiB)" if memory_mb else ""
        explanation = f"killed: out of memory{size}; use less memory (smaller data, process it in chunks)"
    elif result.exit_code != 0:
        denied = [a for a in result.egress if not a.allowed]
        if network == "none" and NETWORK_ERRORS.search(result.stderr[-20_000:] + result.stdout[-4_000:]):
            limit = "network"
            explanation = "network is off in this sandbox (mode none); retrying will not reach the network"
        elif network == "proxy" and denied:
            limit = "network"
            explanation = (f"the egress proxy refused {denied[0].host}:{denied[0].port} ({denied[0].reason}); only "
                           "the allowlisted destinations can be reached")
    return result.model_copy(update={"notes": notes, "limit": limit, "explanation": explanation,
                                     "retryable": retryable})
