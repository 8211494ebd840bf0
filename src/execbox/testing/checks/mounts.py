"""The check of mounts: a host path is bound read-only unless writable, and a refused path is refused."""

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
