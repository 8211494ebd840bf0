"""The framework the conformance checks are written in and run by: ``Kit`` (one backend and what it claims
here), ``Check`` and the ``Family`` that registers a module's checks, the verdicts and ``expect``, and
``run_check``, which turns one check's outcome into a ``CheckResult``.

A check takes a ``Kit`` and either returns (the claim holds; optionally a note saying what was seen), raises
``AssertionError`` whose message names the claim, what was expected and what was seen, or raises

- ``NotClaimed``: the backend does not claim what the check proves (a skip), or
- ``Unavailable``: the check cannot run on this machine (a skip on a laptop, a failure in CI).

No check trusts an absence it has not shown it could see: each first proves its probe ran (the probe's own
output, a host-side control) before it counts "nothing found" as the claim holding.

Every request goes through the public API (``execbox.Runner``), so the guard, the env policy and the
result builder are part of what is checked. Only ``execbox``, ``execbox.plugin`` and ``execbox.testing``
are imported: a third-party backend's author has the same kit.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from execbox import BackendUnavailableError, Capabilities, ExecResult, Runner, Sandbox, run_blocking
from execbox.plugin import NetworkMode, Verdict

# How long past its timeout a run may take to come back (kill, clean-up, a slow shared machine).
DEADLINE_SLACK_S = 20.0
SANDBOX = "sandbox=True"
# The isolations that put a kernel of their own between the code and this host's: a user-space kernel (gVisor's
# Sentry) or a virtual machine's. Claiming one is claiming what the kernel checks prove.
OWN_KERNEL = ("gvisor", "microvm")


class NotClaimed(Exception):
    """The backend does not claim what this check proves: the check does not apply (a skip)."""


class Unavailable(Exception):
    """This machine cannot run the check (no engine, no compiler): a skip on a laptop, a failure in CI."""


def expect(ok: bool, claim: str, expected: str, seen: object) -> None:
    """Fail with a message that names the claim, what was expected and what was seen."""
    if not ok:
        text = seen if isinstance(seen, str) else repr(seen)
        if len(text) > 2000:
            text = text[:1000] + " ... " + text[-1000:]
        raise AssertionError(f"{claim}: expected {expected}; saw {text}")


def reported(result: ExecResult, claim: str, probe: str) -> Any:
    """The JSON the probe printed on its first line; a probe that did not report is a failure, not a pass."""
    try:
        return json.loads(result.stdout.splitlines()[0])
    except (ValueError, IndexError):
        raise AssertionError(f"{claim}: expected the {probe} to report (JSON); saw {shown(result)}") from None


def shown(result: ExecResult) -> str:
    """An ExecResult, briefly, for assertion messages."""
    return (f"exit {result.exit_code} (timed_out={result.timed_out}, oom_killed={result.oom_killed}), "
            f"stdout {result.stdout[-600:]!r}, stderr {result.stderr[-600:]!r}")


@dataclass
class Kit:
    """One backend as the checks see it: a runner, the backend's name and what it claims here."""

    runner: Runner
    backend: str
    caps: Capabilities
    verdict: Verdict | None = None

    @classmethod
    def open(cls, runner: Runner, backend: str) -> Kit:
        """What ``backend`` claims on this machine (its ``check()``); Unavailable when it cannot run here."""
        impl = runner.aio.backend(backend)
        try:
            # Through the runner, under its bound: a check that never returns is a BackendTimeoutError, not a hang.
            caps = run_blocking(functools.partial(runner.aio.select, backend))[1]
        except BackendUnavailableError as exc:
            raise Unavailable(f"backend {backend} cannot run here: {exc}") from exc
        kit = cls(runner, backend, caps)
        # The sandbox claim is conditional on how the backend is configured here (e.g. not when started by
        # root): its verdict says which, and the guard refuses what the verdict disowns.
        kit.verdict = runner.aio.verdict(impl, kit.net)
        return kit

    @property
    def net(self) -> NetworkMode:
        """The network mode the checks run with: none when the backend enforces it."""
        return "none" if "none" in self.caps.network_modes else min(self.caps.network_modes)

    def run(self, command: str | Sequence[str], **kw: Any) -> ExecResult:
        result = self.runner.run(command, backend=self.backend, network=kw.pop("network", self.net), **kw)
        expect(result.backend == self.backend, "the result names its backend", repr(self.backend), repr(result.backend))
        return result

    def code(self, code: str, **kw: Any) -> ExecResult:
        return self.runner.run_code(code, backend=self.backend, network=self.net, **kw)

    def sandbox(self) -> Sandbox:
        return self.runner.sandbox(self.backend, network=self.net)

    def require(self, *, sessions: bool = False, files: bool = False, network: str | None = None,
                limit: str | None = None, sandbox: bool = False, local: bool = False, mounts: bool = False,
                tmpfs: bool = False, own_kernel: bool = False, snapshot: bool = False,
                memory_snapshot: bool = False) -> None:
        """Raise NotClaimed unless the backend claims all of these. ``local``: the code runs on this machine (not
        ``remote``), so its identity there is this host's business. ``own_kernel``: an isolation in OWN_KERNEL."""
        caps = self.caps
        if own_kernel and caps.isolation not in OWN_KERNEL:
            raise NotClaimed(f"the backend claims isolation {caps.isolation!r}, which runs the code on this host's "
                             f"kernel (a kernel of its own is claimed by isolation {' or '.join(OWN_KERNEL)})")
        if sandbox and not caps.sandbox:
            raise NotClaimed(f"the backend does not claim {SANDBOX}")
        if sandbox and self.verdict is not None and not self.verdict.sandbox:
            raise NotClaimed(f"configured as it is here, the backend says it is not a sandbox: {self.verdict.reason}")
        if local and caps.remote:
            raise NotClaimed("the code runs on another machine (remote=True): its uid, capabilities and namespaces "
                             "there are the provider's boundary, not this host's")
        if sessions and not caps.persistent_sessions:
            raise NotClaimed("the backend does not claim persistent sessions")
        if files and not caps.file_transfer:
            raise NotClaimed("the backend does not claim file transfer")
        if network and network not in caps.network_modes:
            raise NotClaimed(f"the backend does not claim network mode {network!r}")
        if limit and limit not in caps.limits:
            raise NotClaimed(f"the backend does not claim the {limit} limit")
        if mounts and not caps.mounts:
            raise NotClaimed("the backend does not claim mounts (host paths bound in)")
        if tmpfs and not caps.tmpfs:
            raise NotClaimed("the backend does not claim tmpfs (extra writable tmpfs paths)")
        if snapshot and not caps.snapshot:
            raise NotClaimed("the backend does not claim snapshot (a sandbox's files kept, forked and rolled back)")
        if memory_snapshot and not caps.memory_snapshot:
            raise NotClaimed("the backend does not claim memory_snapshot (a sandbox's processes and memory kept, not "
                             "only its files)")


Body = Callable[[Kit], "str | None"]


@dataclass(frozen=True)
class Check:
    name: str
    claim: str
    body: Body


class Family:
    """The checks of one module, in the order they are written there. ``execbox.testing.checks`` puts the
    families together into ``CHECKS``."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def check(self, claim: str) -> Callable[[Body], Body]:
        """Register a check under its function's name (without ``check_``), proving ``claim``."""

        def register(fn: Body) -> Body:
            self.checks.append(Check(fn.__name__.removeprefix("check_"), claim, fn))
            return fn

        return register


E = TypeVar("E", bound=BaseException)


def expect_raises(kind: type[E], call: Callable[[], object], claim: str, what: str) -> None:
    try:
        outcome = call()
    except kind:
        return
    raise AssertionError(f"{claim}: expected {kind.__name__} for {what}; saw it succeed with {outcome!r}")


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``status`` pass, fail or skip; ``message`` what was seen or why."""

    name: str
    claim: str
    status: Literal["pass", "fail", "skip"]
    message: str = ""
    duration_s: float = 0.0


def run_check(one: Check, kit: Kit, time_box_s: float | None = None) -> CheckResult:
    """Run one check, turning its outcome into a CheckResult (an unexpected error is a failure). With
    ``time_box_s``, a check still running after that long is a failure and is left behind (a daemon thread):
    whatever the backend does, the verdicts keep coming."""
    if time_box_s is None:
        return _run_check(one, kit)
    verdict: concurrent.futures.Future[CheckResult] = concurrent.futures.Future()

    def body() -> None:
        try:
            verdict.set_result(_run_check(one, kit))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            verdict.set_exception(exc)

    threading.Thread(target=body, daemon=True, name=f"execbox-check-{one.name}").start()
    try:
        return verdict.result(timeout=time_box_s)
    except concurrent.futures.TimeoutError:
        return CheckResult(one.name, one.claim, "fail", f"{one.claim}: expected the check to finish within its time "
                           f"box of {time_box_s:g} s; it did not, and was left behind", round(time_box_s, 2))


def _run_check(one: Check, kit: Kit) -> CheckResult:
    started = time.monotonic()
    status: Literal["pass", "fail", "skip"] = "pass"
    try:
        message = one.body(kit) or ""
    except NotClaimed as exc:
        status, message = "skip", f"not claimed: {exc}"
    except Unavailable as exc:
        status, message = "skip", f"cannot run here: {exc}"
    except AssertionError as exc:
        status, message = "fail", str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken sandbox is a failed check, reported, not a crash
        status, message = "fail", f"{type(exc).__name__}: {exc}"
    return CheckResult(one.name, one.claim, status, message, round(time.monotonic() - started, 2))
