"""The testing kit: what proves a backend keeps its claims, for execbox's own tests and for a backend's author.

- ``engine_missing(reason)``: a test that needs a real engine (docker, sshd, bubblewrap) calls it when the
  engine is absent: it skips with the reason on a laptop and FAILS when CI is set (``CI=true``) or
  ``EXECBOX_REQUIRE_ENGINES=1``, so a green CI never hides a skipped sandbox test.
- ``BackendConformance`` (in ``execbox.testing.conformance``): the conformance kit for pytest; subclass it
  in a test module and set ``backend_name``.
- ``self_check(backend_name, settings=None, *, checks=None) -> list[CheckResult]``: the same checks outside
  pytest; each result is pass, fail or skip with a message.
- ``PeakRss``: the peak growth of this process's memory while a block runs.

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


__all__ = ["CheckResult", "PeakRss", "engine_missing", "engines_required", "self_check"]


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
