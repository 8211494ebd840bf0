"""The engine's gVisor runtime, for the tests that run the docker backend a second time under gVisor."""

from __future__ import annotations

import functools
import json
import os
import subprocess

import pytest

from execbox.testing import engine_missing


@functools.cache
def _runsc_registrations() -> tuple[list[str], str]:
    """The names the engine registers runsc under: the set-up's (runsc) first, then those that load execbox's
    seccomp profile inside (--oci-seccomp) and run with --network=none (a runsc without it cannot start a
    container on docker's network none here); else why there are none."""
    try:
        shown = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True,
                               timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"docker info failed: {exc}"
    if shown.returncode != 0:
        return [], f"docker info failed: {shown.stderr.strip()[-300:]}"
    runtimes = json.loads(shown.stdout or "{}") or {}
    names = [name for name, entry in runtimes.items() if os.path.basename(str(entry.get("path"))) == "runsc"]
    names.sort(key=lambda name: (name != "runsc", "--oci-seccomp" not in (runtimes[name].get("runtimeArgs") or []),
                                 "--network=none" not in (runtimes[name].get("runtimeArgs") or [])))
    return names, f"the Docker engine registers no runtime whose binary is runsc (it has: {', '.join(runtimes)})"


def gvisor_runtime() -> str:
    """The name to set CODE_EXEC_DOCKER_RUNTIME to for gVisor; skips (fails in CI) when the engine has none:
    scripts/setup installs and registers it."""
    names, reason = _runsc_registrations()
    if not names:
        engine_missing(reason)
    return names[0]


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
