"""The docker backend judges a runtime by what the engine runs, not by its name: against the real engine, two
registrations this module makes (scripts/gvisor_setup.py --register, as root) and removes again: runsc with a
weakening argument is refused naming it; runsc with the set-up's arguments under a name execbox never heard of
is gVisor, and code run under it sees gVisor's kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from execbox import AsyncRunner, BackendUnavailableError, Settings
from execbox.plugin import gvisor_record
from execbox.testing import engine_missing, gvisor_runtime

pytestmark = pytest.mark.engine

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "gvisor_setup.py"
WEAK, SAFE = f"execbox-test-weak-{uuid.uuid4().hex[:6]}", f"execbox-test-gv-{uuid.uuid4().hex[:6]}"


def _setup(*args: str) -> None:
    done = subprocess.run([sys.executable, str(SETUP), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def registered() -> Iterator[list[str]]:
    """Registers WEAK (--network=host) and SAFE (the set-up's own arguments) in the engine; removes both after.
    The engine's facts are probed and kept first: each test then also proves a reload is seen at once."""
    gvisor_runtime()  # gVisor set up and live here, or skipped with the reason
    if os.geteuid() != 0:
        engine_missing("registering runtimes in the Docker engine needs root")
    record = gvisor_record()
    assert record is not None
    args = [str(a) for a in record["runtimeArgs"]]
    anyio.run(AsyncRunner(Settings.from_env()).backend("docker").check)  # the engine's facts kept before the reload
    try:
        _setup("--register", WEAK, *[a for a in args if not a.startswith("--network")], "--network=host")
        _setup("--register", SAFE, *args)
        yield args
    finally:
        _setup("--unregister", WEAK)
        _setup("--unregister", SAFE)


def test_a_registration_with_a_weakening_argument_is_refused_naming_it(
        registered: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_DOCKER_RUNTIME", WEAK)

    async def go() -> None:
        async with AsyncRunner(Settings.from_env()) as runner:
            await runner.run(["true"], backend="docker")

    with pytest.raises(BackendUnavailableError) as caught:
        anyio.run(go)
    message = str(caught.value)
    assert f"CODE_EXEC_DOCKER_RUNTIME={WEAK}" in message and "runs runsc with --network=host" in message


def test_a_safe_gvisor_registration_is_admitted_whatever_its_name(
        registered: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_DOCKER_RUNTIME", SAFE)

    async def go() -> tuple[Any, Any]:
        async with AsyncRunner(Settings.from_env()) as runner:
            _, caps = await runner.select("docker")
            return caps, await runner.run(["uname", "-r"], backend="docker")

    caps, result = anyio.run(go)
    assert caps.isolation == "gvisor" and result.isolation == "gvisor"
    assert result.exit_code == 0 and result.stdout.splitlines()[0] == "4.4.0", result
