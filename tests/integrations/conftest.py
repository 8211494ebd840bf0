"""What the framework integrations' tests share: the engines they run on."""

from __future__ import annotations

import pytest

from execbox import Runner
from tests.test_kernel import _usable


@pytest.fixture(params=["docker", "bubblewrap"])
def backend(request: pytest.FixtureRequest) -> str:
    """A real engine each: skipped where it cannot run (a failure under EXECBOX_REQUIRE_ENGINES)."""
    with Runner() as runner:
        _usable(runner, request.param)
    return str(request.param)
