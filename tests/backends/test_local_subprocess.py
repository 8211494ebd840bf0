from __future__ import annotations

import pytest

from execbox import Runner, Settings
from execbox.testing.conformance import BackendConformance


class TestLocalSubprocessConformance(BackendConformance):
    backend_name = "local_subprocess"

    @pytest.fixture
    def runner(self) -> Runner:
        # Not a sandbox and shares the host network: only local mode with network host admits it.
        return Runner(Settings.from_env(backend="local_subprocess", local=True, network="host"))


def test_network_host_reaches_a_listener_the_test_started() -> None:
    """The positive control of the network checks: with the host network the probe does connect."""
    from execbox.testing.conformance import PROBE_CONNECT, Listener

    listener = Listener()
    try:
        runner = Runner(Settings.from_env(local=True, network="host"))
        result = runner.run(["python3", "-c", PROBE_CONNECT, str(listener.port)], backend="local_subprocess")
        assert "CONNECTED" in result.stdout
    finally:
        listener.close()
    assert listener.accepted == 1
