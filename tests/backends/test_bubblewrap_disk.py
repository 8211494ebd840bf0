"""The disk limit on bubblewrap: as root each session's workspace is a size-limited filesystem of its own
(files.disk); writing past it fails with ENOSPC inside, the host's disk grows by at most the limit, and the
mount goes with the session (or with gc, when its owner was killed). Where that cannot be done the limit is
not claimed, and a request that demands it is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from execbox import Limits, Runner, Settings
from execbox.backends.bubblewrap.session import BubblewrapSession
from execbox.contract.models import Capabilities
from execbox.errors import BackendUnavailableError, SandboxError, UnsupportedPolicyError
from execbox.files import disk
from execbox.runner import run_blocking
from execbox.testing import engine_missing

pytestmark = pytest.mark.engine
LIMIT_MB = 24
WRITE_PAST = f"""
import errno, os
try:
    with open("big", "wb") as fh:
        for _ in range({LIMIT_MB * 2}):
            fh.write(b"x" * (1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
    print("wrote it all")
except OSError as exc:
    print("errno", errno.errorcode[exc.errno])
"""


@pytest.fixture
def scratch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="execbox-disk-"))
    path.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    for root in path.glob("execbox-bwrap-*"):
        disk.release_sized(str(root / "workspace"))
    subprocess.run(["rm", "-rf", str(path)], check=False)


def checked(runner: Runner) -> Capabilities:
    try:
        return run_blocking(runner.aio.backend("bubblewrap").check)
    except BackendUnavailableError as exc:
        engine_missing(f"bubblewrap cannot run here: {exc}")


def require_disk(runner: Runner) -> None:
    if "disk" not in checked(runner).limits:
        report = runner.aio.backend("bubblewrap").report
        engine_missing(f"the disk limit is not enforced here: {report.disk_reason if report else 'no report'}")


def test_the_disk_limit_is_claimed_exactly_where_a_sized_workspace_can_be_made(scratch: Path) -> None:
    runner = Runner(Settings(backend="bubblewrap"))
    caps = checked(runner)
    assert ("disk" in caps.limits) == (disk.unavailable_reason() is None)
    report = runner.aio.backend("bubblewrap").report
    assert report is not None and report.facts()["disk"].startswith("not limited") != ("disk" in caps.limits)
    assert not list(scratch.iterdir()), "the check's trial mount was left behind"


def test_writing_past_the_limit_fails_with_enospc_and_the_host_grows_by_the_limit_at_most(scratch: Path) -> None:
    runner = Runner(Settings(backend="bubblewrap", disk_mb=LIMIT_MB))
    require_disk(runner)
    with runner.sandbox("bubblewrap") as sb:
        session = sb.aio._session
        assert isinstance(session, BubblewrapSession)
        workspace = session.host_workspace
        result = sb.run_code(WRITE_PAST, timeout=60)
        assert result.stdout.strip() == "errno ENOSPC", result
        image = os.stat(workspace + disk.IMAGE_SUFFIX)
        assert image.st_blocks * 512 <= (LIMIT_MB + 1) << 20, "the host's disk grew past the limit"
        fs = os.statvfs(workspace)
        assert fs.f_blocks * fs.f_frsize <= LIMIT_MB << 20
        # The sandbox still works, and can make room again.
        assert sb.exec("rm big && echo small > f && cat f").stdout == "small\n"
        assert os.stat(workspace).st_uid == (65534 if os.geteuid() == 0 else os.getuid())
    assert not disk.is_mounted(workspace) and not os.path.exists(session.root)


def test_a_sized_workspace_left_by_a_killed_caller_is_released_by_gc(scratch: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    runner = Runner(Settings(backend="bubblewrap"))
    require_disk(runner)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODE_EXEC_")} | {"TMPDIR": str(scratch)}
    program = ("import execbox\nwith execbox.sandbox('bubblewrap') as sb:\n"
               "    sb.exec('echo started > started; sleep 600', timeout=600)\n")
    caller = subprocess.Popen([sys.executable, "-c", program], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(scratch.glob("execbox-bwrap-*/workspace/started")):
        assert caller.poll() is None and time.monotonic() < deadline, caller.stderr.read() if caller.stderr else ""
        time.sleep(0.05)
    [root] = [p for p in scratch.glob(f"execbox-bwrap-{caller.pid}-*")]
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    workspace = str(root / "workspace")
    time.sleep(0.5)  # the launcher kills the sandbox at once; its mount stays until a sweep
    assert disk.is_mounted(workspace)
    removed = run_blocking(runner.aio.backend("bubblewrap").gc)
    assert str(root) in removed
    assert not disk.is_mounted(workspace) and not root.exists()


def test_without_a_sized_workspace_the_limit_is_refused_when_demanded(monkeypatch: pytest.MonkeyPatch,
                                                                      scratch: Path) -> None:
    """What a host without root (or loop devices) gets: no disk claim, and a demand for it refused."""
    from execbox.backends.bubblewrap import probe

    monkeypatch.setattr(probe, "sized_workspace_unavailable", lambda: "a size-limited workspace needs root")
    monkeypatch.setenv("CODE_EXEC_BWRAP_TMPFS_MB", "511")  # another configuration: probed afresh
    runner = Runner(Settings(backend="bubblewrap"))
    caps = checked(runner)
    assert "disk" not in caps.limits
    with pytest.raises(UnsupportedPolicyError, match="disk"):
        runner.run(["true"], backend="bubblewrap", limits=Limits(disk_mb=100))
    with pytest.raises(UnsupportedPolicyError, match="CODE_EXEC_DISK_MB"):
        Runner(Settings(backend="bubblewrap", disk_mb=100)).run(["true"], backend="bubblewrap")
    # Not demanded: the run goes ahead on a plain workspace.
    assert runner.run("echo ok", backend="bubblewrap").stdout == "ok\n"


@pytest.fixture
def slow_mount(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sized workspace is made in the background while the launcher starts; a slow one widens that window."""
    mount = disk.mount_sized

    def slowly(*args: object) -> None:
        time.sleep(0.5)
        mount(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk, "mount_sized", slowly)


def test_bwrap_starts_only_once_the_slow_workspace_is_mounted(scratch: Path, slow_mount: None) -> None:
    runner = Runner(Settings(backend="bubblewrap", disk_mb=LIMIT_MB))
    require_disk(runner)
    result = runner.run("stat -f -c '%b %S' /workspace", backend="bubblewrap", timeout=30)
    blocks, size = result.stdout.split()
    assert int(blocks) * int(size) <= LIMIT_MB << 20, f"the sandbox saw the host's filesystem: {result.stdout}"


def test_a_one_shots_files_land_on_its_sized_workspace_made_meanwhile(scratch: Path, slow_mount: None) -> None:
    runner = Runner(Settings(backend="bubblewrap", disk_mb=LIMIT_MB))
    require_disk(runner)
    # Placed right after the session opened, while its workspace was still being made: written below the mount,
    # they would be hidden under it.
    result = runner.run("cat data/early.txt", files={"data/early.txt": "placed early"}, backend="bubblewrap",
                        timeout=30)
    assert (result.exit_code, result.stdout) == (0, "placed early"), result


def test_a_sandboxs_host_workspace_is_mounted_when_it_opens(scratch: Path, slow_mount: None) -> None:
    """The kit's host_workspace is usable by whoever holds a session: only one-shots make it in the background."""
    runner = Runner(Settings(backend="bubblewrap", disk_mb=LIMIT_MB))
    require_disk(runner)
    with runner.sandbox("bubblewrap") as sb:
        session = sb.aio._session
        assert isinstance(session, BubblewrapSession)
        assert disk.is_mounted(session.host_workspace)


def test_a_workspace_that_cannot_be_made_fails_the_run_and_leaves_nothing(scratch: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    runner = Runner(Settings(backend="bubblewrap", disk_mb=LIMIT_MB))
    require_disk(runner)

    def failing(path: str, *args: object) -> None:
        time.sleep(0.2)  # the launcher is waiting at its gate by then
        raise OSError("no free loop device")

    monkeypatch.setattr(disk, "mount_sized", failing)
    with pytest.raises(SandboxError, match="size-limited workspace: no free loop device"):
        runner.run("touch /workspace/ran", backend="bubblewrap", timeout=30)
    assert not list(scratch.glob("execbox-bwrap-*")), "the session's directory was left"
