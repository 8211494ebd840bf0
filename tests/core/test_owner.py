"""Owner identity for gc: host:pid:starttime, so a reused pid is not mistaken for a live owner."""

from __future__ import annotations

import os
import socket
import subprocess

from execbox.core.owner import owner_alive, owner_id, pid_alive


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
