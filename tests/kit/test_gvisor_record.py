"""The set-up's gVisor record is read only when it is root's alone to write, and of the shape it writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from execbox.kit import gvisor


def test_only_a_record_root_alone_can_write_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "gvisor.json"
    monkeypatch.setattr(gvisor, "GVISOR_RECORD", record)
    assert gvisor.gvisor_record() is None  # none written
    record.write_text(json.dumps({"runtime": "runsc", "platform": "ptrace", "network": "none"}))
    record.chmod(0o644)
    if os.geteuid() == 0:
        assert gvisor.gvisor_record() == {"runtime": "runsc", "platform": "ptrace", "network": "none"}
    else:
        assert gvisor.gvisor_record() is None  # not root's: anyone could have written it
    record.chmod(0o664)
    assert gvisor.gvisor_record() is None  # its group may write it
    record.chmod(0o644)
    for text in ("{not json", json.dumps({"platform": "ptrace"}), json.dumps(["runsc"])):
        record.write_text(text)
        assert gvisor.gvisor_record() is None
