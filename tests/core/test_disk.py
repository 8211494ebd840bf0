"""The size-limited workspace (core/disk.py): a real loop-mounted filesystem, as root."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from execbox.core import disk
from execbox.testing import engine_missing


@pytest.fixture
def sized(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A sized workspace, mounted on tmp_path / (the test's indirect parameter, or "ws")."""
    reason = disk.unavailable_reason()
    if reason:
        engine_missing(reason)
    path = tmp_path / getattr(request, "param", "ws")
    path.mkdir()
    disk.mount_sized(str(path), 8, (65534, 65534))
    yield path
    disk.release_sized(str(path))


def test_writing_past_the_size_fails_with_enospc_and_the_image_stays_small(sized: Path) -> None:
    assert disk.is_mounted(str(sized))
    assert (sized.stat().st_uid, sized.stat().st_mode & 0o777) == (65534, 0o700)
    assert os.listdir(sized) == []  # no lost+found for the sandbox to trip over
    with pytest.raises(OSError) as info, open(sized / "big", "wb") as fh:
        for _ in range(64):
            fh.write(b"\0" * (1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
    assert info.value.errno == errno.ENOSPC
    image = Path(str(sized) + disk.IMAGE_SUFFIX)
    assert image.stat().st_blocks * 512 <= 9 << 20  # the host's disk grew by the limit at most


def test_release_unmounts_removes_the_image_and_is_idempotent(sized: Path) -> None:
    (sized / "f").write_bytes(b"x" * 1000)
    disk.release_sized(str(sized))
    assert not disk.is_mounted(str(sized))
    assert not Path(str(sized) + disk.IMAGE_SUFFIX).exists()
    assert os.listdir(sized) == []  # what the sandbox wrote went with the image
    disk.release_sized(str(sized))


def test_release_of_a_plain_directory_touches_nothing(tmp_path: Path) -> None:
    (tmp_path / "keep").write_text("x")
    disk.release_sized(str(tmp_path))
    assert (tmp_path / "keep").read_text() == "x"


def test_unavailable_without_root_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in (disk.unavailable_reason() or "")


@pytest.mark.parametrize("sized", ["odd\nname \\ here"], indirect=True)
def test_a_mount_point_with_a_newline_space_and_backslash_is_seen_and_released(sized: Path) -> None:
    # Found reviewing: a TMPDIR with a newline left the sized workspace mounted (mountinfo escapes it as \012).
    assert disk.is_mounted(str(sized))
    disk.release_sized(str(sized))
    assert not disk.is_mounted(str(sized)) and not os.path.exists(str(sized) + disk.IMAGE_SUFFIX)
