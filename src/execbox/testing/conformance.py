"""The conformance kit for pytest: every check of ``execbox.testing.checks`` as a test method of your backend's
test class.

One line is enough (the runner is built from the environment's settings)::

    from execbox.testing.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        backend_name = "my_backend"

Override the ``runner`` fixture to set the backend up differently (``execbox.Runner(execbox.Settings(...))``).
Which checks run follows the capabilities the backend reports from ``check()``: a check of a capability it
does not claim is skipped with that reason, a claimed capability whose check fails is a failure naming the
claim, and a check this machine cannot run (no engine, no compiler) skips on a laptop and fails in CI.
A check that fails for a known reason is overridden in the subclass with ``pytest.mark.xfail(strict=True)``::

    @pytest.mark.xfail(strict=True, reason="...")
    def test_sandbox_host_processes_hidden(self, kit):
        super().test_sandbox_host_processes_hidden(kit)

Outside pytest, ``execbox.testing.self_check(name)`` runs the same checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest

from execbox import Capabilities, Runner, Settings
from execbox.testing import engine_missing
from execbox.testing.checks import CHECKS
from execbox.testing.framework import DEADLINE_SLACK_S, Check, Kit, NotClaimed, Unavailable
from execbox.testing.host import Listener
from execbox.testing.probes import PROBE_CONNECT

__all__ = ["DEADLINE_SLACK_S", "PROBE_CONNECT", "BackendConformance", "Kit", "Listener"]


class BackendConformance:
    """Subclass and set ``backend_name``; a ``test_<check>`` method runs for every check in ``CHECKS``."""

    backend_name: ClassVar[str]

    @pytest.fixture
    def runner(self) -> Runner:
        return Runner(Settings.from_env(backend=self.backend_name))

    @pytest.fixture
    def kit(self, runner: Runner) -> Kit:
        try:
            return Kit.open(runner, self.backend_name)
        except Unavailable as exc:
            engine_missing(str(exc))

    @pytest.fixture
    def caps(self, kit: Kit) -> Capabilities:
        return kit.caps

    @pytest.fixture
    def net(self, kit: Kit) -> str:
        return kit.net


def _run_in_pytest(one: Check, kit: Kit) -> None:
    try:
        one.body(kit)
    except NotClaimed as exc:
        pytest.skip(str(exc))
    except Unavailable as exc:
        engine_missing(str(exc))


def _as_test(one: Check) -> Callable[[BackendConformance, Kit], None]:
    def test(self: BackendConformance, kit: Kit) -> None:
        _run_in_pytest(one, kit)

    test.__name__ = test.__qualname__ = f"test_{one.name}"
    test.__doc__ = one.claim
    return test


for _check in CHECKS.values():
    setattr(BackendConformance, f"test_{_check.name}", _as_test(_check))
