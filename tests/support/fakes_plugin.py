"""Backends for the tests of the runner and its layers, registered through an entry point like any third-party plugin.

They run commands exactly like local_subprocess (a local process in a temporary workspace) but declare
other capabilities, so the guard, the policy and the runner can be tested without a real engine.
They are NOT sandboxes: never use them outside these tests.
"""

from __future__ import annotations

from collections.abc import Callable

from execbox import BackendUnavailableError, Capabilities, hookimpl
from execbox.backends.local_subprocess import LocalSubprocessBackend

DISTRIBUTION = "execbox-test-fakes"


class FakeSandbox(LocalSubprocessBackend):
    """Claims container isolation and every network mode; the guard takes it at its word."""

    name = "fake_sandbox"
    summary = "test double that claims to be a container sandbox"
    capabilities = Capabilities(
        sandbox=True,
        isolation="container",
        network_modes=frozenset({"none", "egress", "host"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "cpu", "pids", "wall_time"}),
    )


class FakeNamespace(FakeSandbox):
    """A sandbox that enforces little: network none only, no resource limits but wall time."""

    name = "fake_namespace"
    capabilities = Capabilities(
        sandbox=True, isolation="namespace", network_modes=frozenset({"none"}), limits=frozenset({"wall_time"}),
    )


class FakeDown(FakeSandbox):
    """A sandbox whose engine is not running here."""

    name = "fake_down"
    REASON = "the fake daemon is not running"
    FIX = "start the fake daemon with `fake-daemon start`"

    async def probe(self) -> Capabilities:
        raise BackendUnavailableError(self.REASON, backend=self.name, fix=self.FIX)


@hookimpl
def execbox_register_backends(register: Callable[[type], None]) -> None:
    for cls in (FakeSandbox, FakeNamespace, FakeDown):
        register(cls)
