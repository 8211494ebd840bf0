"""Host-side access to what sandboxed code left: removal that survives any tree, reads that are bounded."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from execbox import FileTooLargeError, WorkspacePathError
from execbox.files.workspace import remove_tree, safe_read

ROOT = os.geteuid() == 0


def as_unprivileged(fn: Callable[[], None]) -> None:
    """Run ``fn`` as a non-root owner (uid 65534 when the tests run as root: root needs no access back)."""
    if not ROOT:
        fn()
        return
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged part failed (its traceback is above)"


def deep_tree(top: Path, depth: int) -> None:
    """``depth`` nested directories under ``top``, built relative to each other (no path is ever that long)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as fh:
            fh.write("x")
    finally:
        os.close(fd)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory the unprivileged owner can reach (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="execbox-test-ws-"))
    base.chmod(0o755)
    if ROOT:
        os.chown(base, 65534, 65534)
    yield base
    remove_tree(str(base))


class TestRemoveTree:
    def test_a_tree_deeper_than_the_recursion_limit(self, scratch: Path) -> None:
        tree = scratch / "tree"
        tree.mkdir()
        deep_tree(tree, max(3000, sys.getrecursionlimit() + 500))
        remove_tree(str(tree))
        assert not tree.exists()

    def test_modes_sockets_fifos_and_many_files(self, scratch: Path) -> None:
        tree, outside = scratch / "tree", scratch / "outside"

        def build_and_remove() -> None:
            outside.mkdir(mode=0o755)
            (outside / "keep").write_text("keep")
            (tree / "locked" / "deep").mkdir(parents=True)
            (tree / "locked" / "deep" / "f").write_text("x")
            (tree / "ro").mkdir()
            for i in range(2000):
                (tree / "ro" / f"f{i}").write_text("x")
            os.mkfifo(tree / "fifo")
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(str(tree / "sock"))
            (tree / "out").symlink_to(outside)
            (tree / "locked" / "up").symlink_to(outside)
            (tree / "ro").chmod(0o500)
            (tree / "locked" / "deep").chmod(0)
            (tree / "locked").chmod(0)
            tree.chmod(0o500)
            remove_tree(str(tree))

        as_unprivileged(build_and_remove)
        assert not tree.exists()
        assert (outside / "keep").read_text() == "keep" and outside.stat().st_mode & 0o777 == 0o755

    def test_a_symlink_in_place_of_the_tree_goes_not_its_target(self, scratch: Path) -> None:
        victim = scratch / "victim"
        victim.mkdir()
        (victim / "keep").write_text("keep")
        (scratch / "tree").symlink_to(victim)
        remove_tree(str(scratch / "tree"))
        assert not (scratch / "tree").is_symlink() and (victim / "keep").exists()

    def test_a_missing_tree_is_fine(self, scratch: Path) -> None:
        remove_tree(str(scratch / "nothing"))


class TestBoundedRead:
    def test_a_sparse_file_over_the_cap_is_refused_without_being_read(self, tmp_path: Path) -> None:
        with open(tmp_path / "sparse", "wb") as fh:
            fh.truncate(5 << 30)  # 5 GiB that cost no disk
        with pytest.raises(FileTooLargeError, match="5368709120 bytes, over the read cap of 1024") as info:
            safe_read(str(tmp_path), "sparse", max_bytes=1024)
        assert info.value.env_var == "CODE_EXEC_MAX_READ_BYTES"

    def test_a_file_at_the_cap_is_read(self, tmp_path: Path) -> None:
        (tmp_path / "f").write_bytes(b"x" * 1024)
        assert safe_read(str(tmp_path), "f", max_bytes=1024) == b"x" * 1024

    def test_a_fifo_is_refused_and_does_not_hang(self, tmp_path: Path) -> None:
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(WorkspacePathError, match="not a regular file"):
            safe_read(str(tmp_path), "fifo", max_bytes=1024)
