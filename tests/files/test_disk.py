"""The size-limited workspace (files/disk.py): a real loop-mounted filesystem, as root."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from execbox.files import disk
from execbox.testing import engine_missing
from tests.support.waiting import wait_until


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


def _fill(path: Path) -> int | None:
    """Write 64 MiB into ``path`` (synced, MiB by MiB); the errno that stopped it, None when none did."""
    try:
        with open(path, "wb") as fh:
            for _ in range(64):
                fh.write(b"\0" * (1 << 20))
                fh.flush()
                os.fsync(fh.fileno())
    except OSError as exc:
        return exc.errno
    return None


def test_writing_past_the_size_fails_with_enospc_and_the_image_stays_small(sized: Path) -> None:
    assert disk.is_mounted(str(sized))
    assert (sized.stat().st_uid, sized.stat().st_mode & 0o777) == (65534, 0o700)
    assert os.listdir(sized) == []  # no lost+found for the sandbox to trip over
    assert _fill(sized / "big") == errno.ENOSPC
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


def _loops_backed_by(image: str) -> list[str]:
    """Loop devices whose backing file is ``image`` (the kernel's view: what a leak would leave attached)."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().strip().removesuffix(" (deleted)") == image:
                found.append(backing.parent.parent.name)
    return found


def test_the_loop_device_goes_with_the_mount(sized: Path) -> None:
    image = str(sized) + disk.IMAGE_SUFFIX
    assert _loops_backed_by(image), "no loop device behind the mount"
    disk.release_sized(str(sized))
    assert wait_until(lambda: not _loops_backed_by(image), 5), _loops_backed_by(image)


def test_workspaces_made_from_one_template_are_fresh_and_apart(sized: Path, tmp_path: Path) -> None:
    # The second one of this size and owner is written from the first one's format, not by mkfs.
    (sized / "mine").write_text("only here")
    other = tmp_path / "other"
    other.mkdir()
    disk.mount_sized(str(other), 8, (65534, 65534))
    try:
        assert os.listdir(other) == [] and (other.stat().st_uid, other.stat().st_mode & 0o777) == (65534, 0o700)
        (other / "theirs").write_text("x")
        assert sorted(os.listdir(sized)) == ["mine"]
        assert Path(str(other) + disk.IMAGE_SUFFIX).stat().st_blocks * 512 <= 4 << 20  # still sparse
        assert _fill(other / "big") == errno.ENOSPC
    finally:
        disk.release_sized(str(other))


def test_without_loop_configure_the_old_ioctls_attach_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Linux before 5.8 answers LOOP_CONFIGURE with EINVAL: LOOP_SET_FD and LOOP_SET_STATUS64 (autoclear) instead.
    reason = disk.unavailable_reason()
    if reason:
        engine_missing(reason)
    real, calls = fcntl.ioctl, []

    def old_kernel(fd: int, request: int, *args: Any) -> Any:
        calls.append(request)
        if request == disk._LOOP_CONFIGURE:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, request, *args)

    monkeypatch.setattr(fcntl, "ioctl", old_kernel)
    path = tmp_path / "old"
    path.mkdir()
    disk.mount_sized(str(path), 8, (65534, 65534))
    image = str(path) + disk.IMAGE_SUFFIX
    try:
        assert disk.is_mounted(str(path)) and _loops_backed_by(image)
        assert disk._LOOP_SET_FD in calls and disk._LOOP_SET_STATUS64 in calls
    finally:
        disk.release_sized(str(path))
    assert not disk.is_mounted(str(path))
    assert wait_until(lambda: not _loops_backed_by(image), 5)  # autoclear was set: nothing stays attached


def test_release_does_not_unmount_through_a_link(sized: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(sized)
    disk.release_sized(str(link))
    assert disk.is_mounted(str(sized))
