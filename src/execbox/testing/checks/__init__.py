"""Every conformance check, one module per family, and ``self_check``, which runs them outside pytest.

``CHECKS`` holds them all, in the order they run (and ``execbox doctor --self-check`` lists them). The names a
check is written with live in ``execbox.testing.framework``, the programs it runs in the sandbox in
``execbox.testing.probes``, what it does on this host in ``execbox.testing.host``; the ones checks and tests
used to import from here before the split still can.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from execbox import BackendTimeoutError, Runner, Settings
from execbox.testing.checks import (
    commands,
    environment,
    files,
    isolation,
    kernel,
    limits,
    mounts,
    network,
    output,
    snapshots,
    timeouts,
    transfer,
)
from execbox.testing.framework import (
    DEADLINE_SLACK_S,
    SANDBOX,
    Check,
    CheckResult,
    Kit,
    NotClaimed,
    Unavailable,
    expect,
    expect_raises,
    reported,
    run_check,
    shown,
)
from execbox.testing.host import Listener, alive_with, host_env, host_processes
from execbox.testing.probes import PROBE_CONNECT

# The families in the order their checks run: the command and its output first, the boundary last.
FAMILIES = (commands.family, output.family, timeouts.family, environment.family, files.family, transfer.family,
            mounts.family, snapshots.family, network.family, limits.family, isolation.family,
            kernel.family)
CHECKS: dict[str, Check] = {one.name: one for family in FAMILIES for one in family.checks}

__all__ = [
    "CHECKS",
    "DEADLINE_SLACK_S",
    "PROBE_CONNECT",
    "SANDBOX",
    "Check",
    "CheckResult",
    "Kit",
    "Listener",
    "NotClaimed",
    "Unavailable",
    "alive_with",
    "expect",
    "expect_raises",
    "host_env",
    "host_processes",
    "reported",
    "run_check",
    "self_check",
    "shown",
]


def self_check(backend_name: str, settings: Settings | None = None, *, checks: Iterable[str] | None = None,
               time_box_s: float | None = None,
               on_result: Callable[[CheckResult], object] | None = None) -> list[CheckResult]:
    """Run the conformance checks against ``backend_name`` outside pytest; one CheckResult per check, in order.

    ``settings``: the execbox Settings to build the runner from (default: from the environment).
    ``checks``: names from ``CHECKS`` to run (default: all). When the backend cannot run here, the result is
    a single ``skip`` named ``available`` that says why. ``time_box_s``: each check's time box (see run_check).
    ``on_result``: called with each verdict as soon as it is reached (`execbox doctor --self-check` prints it).
    """
    runner = Runner(settings or Settings.from_env())
    names = list(CHECKS) if checks is None else list(checks)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {sorted(CHECKS)}")
    results: list[CheckResult] = []

    def reached(result: CheckResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    try:
        kit = Kit.open(runner, backend_name)
    except Unavailable as exc:
        reached(CheckResult("available", f"backend {backend_name} can run here", "skip", str(exc)))
        return results
    except BackendTimeoutError as exc:
        reached(CheckResult("available", f"backend {backend_name} can run here", "fail", exc.message))
        return results
    for name in names:
        reached(run_check(CHECKS[name], kit, time_box_s))
    return results
