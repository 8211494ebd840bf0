"""The conformance kit against the singularity backend wired to the fake apptainer (execbox.fakes.apptainer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox.fakes import apptainer as fake
from execbox.testing import engine_missing
from execbox.testing.conformance import BackendConformance


class TestSingularityConformance(BackendConformance):
    backend_name = "singularity"

    @pytest.fixture
    def runner(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
        if not fake.bwrap_usable():
            engine_missing("the fake apptainer runs containers through bubblewrap, which cannot make namespaces here")
        binary = fake.install(tmp_path / "bin", "apptainer", log_file=tmp_path / "apptainer.log", state=tmp_path / "state")
        image = tmp_path / "python.sif"
        image.write_bytes(b"fake image: the fake runs the host's own /usr")
        monkeypatch.setenv("CODE_EXEC_SINGULARITY_BINARY", str(binary))
        monkeypatch.setenv("CODE_EXEC_SINGULARITY_IMAGE", str(image))
        yield Runner(Settings.from_env(backend="singularity"))
        fake.stop_all(tmp_path / "state")  # the fake's instances are real processes: none may outlive a test
