"""What hostile code leaves in its workspace must not hurt the host side, on the real engines: a tree
thousands of levels deep, directories it made unreadable, a FIFO, a socket, a symlink out and a sparse
5 GiB file. Reads are refused past the cap, close and gc never raise, and nothing stays on disk."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

from execbox import BackendUnavailableError, FileTooLargeError, Runner, SandboxError, Settings, run_blocking
from execbox.testing import engine_missing

pytestmark = pytest.mark.engine

HOSTILE = r"""
import os, socket, sys
sys.setrecursionlimit(100)
for i in range(3000):
    os.mkdir("d"); os.chdir("d")
open("leaf", "w").write("x")
os.chdir("/workspace")
os.makedirs("locked/inner"); open("locked/inner/f", "w").write("x")
os.chmod("locked/inner", 0); os.chmod("locked", 0o500)
os.mkfifo("fifo")
socket.socket(socket.AF_UNIX).bind("sock")
os.symlink("/etc", "out")
with open("sparse", "wb") as fh:
    try:
        fh.truncate(5 << 30)
    except OSError:  # a 1 GiB file-size rlimit (bubblewrap): just under it
        fh.truncate((1 << 30) - 4096)
print("planted")
"""


PREFIX = {"docker": "docker", "bubblewrap": "bwrap"}


@pytest.fixture(params=["docker", "bubblewrap"])
def runner(request: pytest.FixtureRequest) -> Runner:
    runner = Runner(Settings(backend=request.param, max_read_bytes=1 << 20, disk_mb=8192))
    try:
        run_blocking(runner.aio.backend(request.param).check)
    except BackendUnavailableError as exc:
        engine_missing(f"{request.param} cannot run here: {exc}")
    return runner


def leftovers(runner: Runner) -> set[str]:
    """This process's workspaces (and disk images) of the runner's backend."""
    return set(glob.glob(f"{tempfile.gettempdir()}/execbox-{PREFIX[runner.settings.backend]}-{os.getpid()}-*"))


def test_hostile_leftovers_are_refused_on_read_and_removed_on_close(runner: Runner) -> None:
    before = leftovers(runner)
    with runner.sandbox() as sb:
        planted = sb.run_code(HOSTILE, timeout=60)
        assert planted.exit_code == 0 and planted.stdout == "planted\n", planted
        with pytest.raises(FileTooLargeError, match=r"\d{10} bytes, over the read cap of 1048576"):
            sb.read_file("sparse")
        assert sb.read_file("/".join(["d"] * 3000) + "/leaf") == b"x"
    assert leftovers(runner) <= before, "the workspace (or its disk image) outlived the session"


def test_a_one_shot_run_that_plants_the_same_leaves_nothing(runner: Runner) -> None:
    before = leftovers(runner)
    result = runner.run_code(HOSTILE, timeout=60)
    assert result.exit_code == 0, result
    assert leftovers(runner) <= before


def test_a_full_workspace_makes_write_file_a_clear_error(runner: Runner) -> None:
    if "disk" not in run_blocking(runner.aio.backend(runner.settings.backend).check).limits:
        pytest.skip("this backend does not claim the disk limit here")  # not an engine: a capability
    with Runner(Settings(backend=runner.settings.backend, disk_mb=16)).sandbox() as sb:
        sb.exec("dd if=/dev/zero of=fill bs=1M count=64 2>/dev/null; true", timeout=30)
        with pytest.raises(SandboxError, match="the workspace is full") as info:
            sb.write_file("more.bin", b"x" * (4 << 20))
        assert info.value.env_var == "CODE_EXEC_DISK_MB"
