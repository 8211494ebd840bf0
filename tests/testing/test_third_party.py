"""A third party runs the whole kit with one line: its backend's name (the runner comes from the settings)."""

from __future__ import annotations

import pytest

from execbox.testing.conformance import BackendConformance
from tests.support.fixtures import FakeDistributions
from tests.testing.lying_backends import DISTRIBUTION

pytestmark = pytest.mark.engine


@pytest.fixture(autouse=True)
def installed(only_local_builtin: None, fake_dists: FakeDistributions) -> None:
    """Stands in for `pip install` of the plugin: its entry point, registered through the hook."""
    fake_dists.add(DISTRIBUTION, ep_name="liars", value="tests.testing.lying_backends")


class TestHonestSandbox(BackendConformance):
    backend_name = "kit_honest"
