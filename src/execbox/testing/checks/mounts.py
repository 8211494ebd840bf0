"""The checks of what is mounted in the sandbox: a host path is bound read-only unless writable, and a refused path
is refused; an extra tmpfs path is writable, empty, kept across a sandbox's execs and gone in the next sandbox."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from execbox import Mount, RefusedError
from execbox.testing.framework import Family, Kit, expect, expect_raises, shown

family = Family()


@family.check("a claimed mount shows the host path read-only unless writable, and a refused path is refused")
def check_mounts(kit: Kit) -> None:
    kit.require(mounts=True)
    claim = "a claimed mount shows the host path read-only unless writable"
    with tempfile.TemporaryDirectory() as ro, tempfile.TemporaryDirectory() as rw:
        Path(ro, "in.txt").write_text("from the host\n")
        os.chmod(ro, 0o755)
        os.chmod(Path(ro, "in.txt"), 0o644)
        os.chmod(rw, 0o777)  # the sandbox user may be another uid than this process's
        result = kit.run("cat /workspace/ro/in.txt; touch /workspace/ro/new; echo ro=$?; echo w > /data/rw/out.txt; "
                         "echo rw=$?", mounts=[Mount(ro, "/workspace/ro"), Mount(rw, "/data/rw", writable=True)])
        expect(result.stdout.startswith("from the host\n") and "ro=1" in result.stdout and "rw=0" in result.stdout,
               claim, "the file read, the read-only write refused, the writable one done", shown(result))
        expect(sorted(os.listdir(ro)) == ["in.txt"], claim, "nothing new in the read-only source", os.listdir(ro))
        expect(Path(rw, "out.txt").read_text() == "w\n", claim, "the write in the writable source", os.listdir(rw))
    expect_raises(RefusedError, lambda: kit.run("true", mounts=[Mount("/", "/data")]), claim, "a mount of /")


# The sandbox user owns the tmpfs (-O), it starts empty, and it takes a write; the marker says how far it got.
_TMPFS_PROBE = 'cd /var/tmp && [ -O . ] && [ -z "$(ls -A)" ] && echo kept > kit && echo fresh-and-writable'


@family.check("a claimed tmpfs path is writable by the sandbox user, empty, kept across a sandbox's execs and gone "
              "in the next sandbox; one over a place the sandbox provides is refused")
def check_tmpfs(kit: Kit) -> None:
    kit.require(tmpfs=True)
    claim = "a claimed tmpfs path is writable, empty, kept across a sandbox's execs and gone in the next sandbox"
    for attempt in ("the first sandbox", "the next sandbox"):
        result = kit.run(_TMPFS_PROBE, tmpfs=["/var/tmp"])
        expect(result.stdout == "fresh-and-writable\n", claim, f"/var/tmp empty, the sandbox user's and writable in "
               f"{attempt}", shown(result))
    if kit.caps.persistent_sessions:
        with kit.runner.sandbox(kit.backend, network=kit.net, tmpfs=["/var/tmp"]) as sb:
            first = sb.exec(_TMPFS_PROBE)
            second = sb.exec("cat /var/tmp/kit")
        expect(first.stdout == "fresh-and-writable\n" and second.stdout == "kept\n", claim,
               "what one exec wrote in /var/tmp read by the next exec of the sandbox",
               f"{shown(first)}; {shown(second)}")
    expect_raises(RefusedError, lambda: kit.run("true", tmpfs=["/proc/x"]), claim, "a tmpfs in /proc")

