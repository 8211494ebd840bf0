"""Waiting for a warm pool to fill, for the pool tests of each backend."""

from __future__ import annotations

import time

from execbox import Runner


def wait_ready(runner: Runner, want: int = 2) -> None:
    deadline = time.monotonic() + 60
    while runner.warm() < want:
        assert time.monotonic() < deadline, "the pool never filled"
        time.sleep(0.05)
