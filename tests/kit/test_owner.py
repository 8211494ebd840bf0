"""Owner identity for gc: host:pid:starttime, so a reused pid is not mistaken for a live owner."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from execbox.errors import SandboxError
from execbox.kit.ownership import (
    OWNER_FILE,
    kill_session_processes,
    owner_alive,
    owner_id,
    owner_tag,
    pid_alive,
    read_owner,
)


def test_owner_alive() -> None:
    assert owner_alive(owner_id()) is True
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert owner_alive(f"{socket.gethostname()}:{proc.pid}:1") is False
    # Same pid, different start time: the pid was reused by another process.
    assert owner_alive(f"{socket.gethostname()}:{os.getpid()}:1") is False
    assert owner_alive("some-other-host:1:1") is None
    assert owner_alive("") is None


def test_pid_alive() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert pid_alive(os.getpid()) and not pid_alive(proc.pid)


def test_read_owner_takes_only_a_file(tmp_path: Path) -> None:
    # What gc reads in a directory it may not have written itself: a FIFO must not hang it, a directory or a
    # link must not be read or followed; each is "no owner".
    cases = {"fifo": lambda p: os.mkfifo(p), "dir": lambda p: os.mkdir(p),
             "link": lambda p: os.symlink(tmp_path / "file" / OWNER_FILE, p)}
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / OWNER_FILE).write_text("host:1:2\n")
    assert read_owner(str(tmp_path / "file")) == "host:1:2"
    for name, make in cases.items():
        (tmp_path / name).mkdir()
        make(str(tmp_path / name / OWNER_FILE))
        assert read_owner(str(tmp_path / name)) is None, name


def test_a_pid_no_process_can_have_is_not_alive() -> None:
    assert pid_alive(9_999_999_999) is False
    assert owner_alive(f"{socket.gethostname()}:9999999999:1") is False


def test_owner_labels_are_one_vocabulary_however_spelled() -> None:
    """docker's io.execbox.* labels and the providers' execbox-* tags are judged by the one OwnerLabels."""
    import time

    from execbox.plugin import REMOTE_LABELS, OwnerLabels

    docker_like = OwnerLabels(mark="io.execbox", owner="io.execbox.owner", created="io.execbox.created",
                              expires="io.execbox.expires")
    dead = subprocess.Popen(["true"])
    dead.wait()
    for vocabulary in (docker_like, REMOTE_LABELS):
        live = vocabulary.make(600)
        assert live[vocabulary.mark] == "1" and vocabulary.orphan_reason(live) is None
        assert vocabulary.orphan_reason({**live, vocabulary.expires: str(int(time.time()) - 5)}) == "expired"
        dead_owner = f"{live[vocabulary.owner].split(':')[0]}:{dead.pid}:1"
        assert vocabulary.orphan_reason({**live, vocabulary.owner: dead_owner}) == "orphaned"
        assert vocabulary.orphan_reason({**live, vocabulary.mark: "yes", vocabulary.owner: dead_owner}) is None
    kept = REMOTE_LABELS.make(60, persist=True)
    assert REMOTE_LABELS.kept(kept) and REMOTE_LABELS.orphan_reason({**kept, REMOTE_LABELS.expires: "1"}) is None
    assert not docker_like.kept(docker_like.make(60, persist=True))  # docker keeps nothing on purpose


def test_kill_session_processes_takes_only_a_session_directory_execbox_made(tmp_path: Path) -> None:
    """`execbox kill`'s way into bubblewrap and gvisor: a process naming the directory dies; anything that is not a
    session directory of ours (another place, a planted link, no owner file, a path around it) is refused."""
    session = Path(tempfile.mkdtemp(prefix=f"execbox-test-{owner_tag()}-", dir=tmp_path))
    (session / OWNER_FILE).write_text(owner_id() + "\n")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--root={session}/runsc"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path)])
    try:
        planted = tmp_path / f"execbox-test-{owner_tag()}-planted"
        planted.symlink_to(session)
        unowned = Path(tempfile.mkdtemp(prefix=f"execbox-test-{owner_tag()}-", dir=tmp_path))
        for bad in ("/etc", str(tmp_path), str(planted), str(unowned), f"{session}/..", str(session / "runsc"),
                    str(tmp_path / "execbox-test-x"), ""):
            with pytest.raises(SandboxError, match="no sandbox session"):
                kill_session_processes(bad, "execbox-test-", str(tmp_path))
        with pytest.raises(SandboxError):  # the right directory under another prefix
            kill_session_processes(str(session), "execbox-other-", str(tmp_path))
        assert child.poll() is None and bystander.poll() is None
        assert kill_session_processes(str(session), "execbox-test-", str(tmp_path)) == 1
        assert child.wait(timeout=30) == -signal.SIGKILL
        assert bystander.poll() is None and session.is_dir()  # the directory stays: its owner removes it
    finally:
        for proc in (child, bystander):
            proc.kill()
            proc.wait()
