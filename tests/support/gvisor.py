"""The docker backend run a second time under gVisor: the runtime is the one the set-up registered
(``execbox.testing.gvisor_runtime``: skipped on a laptop without it, failed in CI)."""

from __future__ import annotations

import pytest

from execbox.testing import gvisor_runtime

# The parameter under which a test of docker (and bubblewrap) runs a second time, with docker's runtime gVisor.
DOCKER_GVISOR = "docker-gvisor"


def backend_for(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backend a test parametrized with DOCKER_GVISOR beside the backends' names runs: docker, with
    CODE_EXEC_DOCKER_RUNTIME set to gVisor for the test, for that parameter; the named backend otherwise. A test
    marked ``not_gvisor(reason)`` is left out of the gVisor pass, saying why."""
    param: str = request.param
    if param != DOCKER_GVISOR:
        return param
    if (marker := request.node.get_closest_marker("not_gvisor")) is not None:
        pytest.skip(f"not in the gVisor pass: {marker.args[0]}")
    monkeypatch.setenv("CODE_EXEC_DOCKER_RUNTIME", gvisor_runtime())
    return "docker"
