"""The testing kit: what proves a backend keeps its claims, for execbox's own tests and for a backend's author.

- ``engine_missing(reason)``: a test that needs a real engine (docker, sshd, bubblewrap) calls it when the
  engine is absent: it skips with the reason on a laptop and FAILS when CI is set (``CI=true``) or
  ``EXECBOX_REQUIRE_ENGINES=1``, so a green CI never hides a skipped sandbox test.
- ``BackendConformance`` (in ``execbox.testing.conformance``): the conformance kit for pytest; subclass it
  in a test module and set ``backend_name``.
- ``self_check(backend_name, settings=None, *, checks=None) -> list[CheckResult]``: the same checks outside
  pytest; each result is pass, fail or skip with a message.
- ``PeakRss``: the peak growth of this process's memory while a block runs.
- ``gvisor_runtime()``: the Docker runtime that runs gVisor here (what the set-up registered), for a test that
  sets ``CODE_EXEC_DOCKER_RUNTIME`` to it; without one, ``engine_missing`` with the reason and what to run.

Inside: ``framework`` (how a check is written and run), ``checks/`` (the checks, one module per family, and
``self_check``), ``probes`` (the programs they run in the sandbox), ``host`` (what they do on this host).
"""

from __future__ import annotations

import os
from typing import NoReturn, Self


def engines_required() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1") or os.environ.get("EXECBOX_REQUIRE_ENGINES") == "1"


def engine_missing(reason: str) -> NoReturn:
    import pytest

    if engines_required():
        pytest.fail(f"a required engine is missing (CI must not skip this): {reason}", pytrace=False)
    pytest.skip(reason)


def gvisor_runtime() -> str:
    """The name of the Docker runtime that runs gVisor here: the one ``scripts/gvisor_setup.py`` registered and
    recorded (``execbox.plugin.gvisor_record``), as long as the engine still lists it as recorded. Otherwise
    ``engine_missing`` with why (skipped on a laptop, failed under CI / EXECBOX_REQUIRE_ENGINES)."""
    name, reason = _gvisor_here()
    if reason:
        engine_missing(reason)
    return name


_GVISOR: list[tuple[str, str | None]] = []  # what _gvisor_here found, asked once per process


def _gvisor_here() -> tuple[str, str | None]:
    if _GVISOR:
        return _GVISOR[0]
    import shutil

    from execbox.plugin import GVISOR_RECORD, gvisor_record

    setup = "as root: scripts/bootstrap.sh (it installs runsc and registers it in the Docker engine)"
    record = gvisor_record()
    found: tuple[str, str | None]
    if shutil.which("runsc") is None and record is None:
        found = ("", f"gVisor is not installed here (no runsc); {setup}")
    elif record is None:
        found = ("", f"gVisor is not registered in the Docker engine (no {GVISOR_RECORD}); {setup}")
    else:
        name = str(record["runtime"])
        try:
            import docker

            client = docker.from_env(timeout=10)
            try:
                entry = (client.info().get("Runtimes") or {}).get(name)
            finally:
                client.close()
        except Exception as exc:  # no SDK, no engine: the reason, whatever docker-py raised
            found = (name, f"no Docker engine answers to run gVisor under ({type(exc).__name__}: {exc})")
        else:
            wanted = {"path": record.get("path"), "runtimeArgs": record.get("runtimeArgs")}
            found = (name, None) if entry == wanted else (
                name, f"the Docker engine's runtime {name} is {entry}, not what the set-up recorded ({wanted}); "
                      f"{setup}")
    _GVISOR.append(found)
    return found


__all__ = ["CheckResult", "PeakRss", "engine_missing", "engines_required", "gvisor_runtime", "self_check"]


def __getattr__(name: str) -> object:
    # The checks import the whole public API: loaded on first use, not with the engine helpers.
    if name in ("CheckResult", "self_check"):
        from execbox.testing import checks

        return getattr(checks, name)
    raise AttributeError(f"module 'execbox.testing' has no attribute {name!r}")


class PeakRss:
    """Samples this process's resident memory while the block runs: ``growth`` is the peak over the start,
    in bytes. For checks (and benchmarks) that streaming output leaves the caller's memory flat."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.growth = 0

    def __enter__(self) -> Self:
        import threading

        try:
            import psutil
        except ImportError:
            engine_missing("psutil is not installed (the dev extra): pip install -e '.[dev]'")
        self._me = psutil.Process()
        self._baseline = self._peak = self._me.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._me.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._me.memory_info().rss)
        self.growth = self._peak - self._baseline
