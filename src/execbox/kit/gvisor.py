"""What the set-up found when it installed gVisor on this host: ``scripts/gvisor_setup.py`` (run as root by
``scripts/bootstrap.sh``) probes the platform (kvm, else ptrace) and whether runsc's own network stack works here,
registers the runtime in the Docker engine with the arguments it found, and writes down what it probed in
GVISOR_RECORD, a file of root's that anyone may read. ``doctor`` and the tests say what it holds; a backend
still judges the runtime by what the engine runs (the record is a fact of the host, never a verdict).

The record: ``runtime`` (the name registered in the engine), ``path`` and ``version`` of runsc, ``kernel`` (the
host's release when probed), ``platform``, ``network`` ("sandbox": gVisor's netstack, or "none"), ``runtimeArgs``,
``why`` (what each probe answered) and a one-line ``summary``.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from execbox.config import paths

GVISOR_RECORD = paths.SYSTEM_STATE / "gvisor.json"
_MAX_RECORD = 64 << 10


def gvisor_record() -> dict[str, Any] | None:
    """The set-up's record, or None: none written, or a file that is not root's alone to write."""
    try:
        fd = os.open(GVISOR_RECORD, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022 or st.st_size > _MAX_RECORD:
            return None
        record = json.loads(os.read(fd, _MAX_RECORD))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return record if isinstance(record, dict) and isinstance(record.get("runtime"), str) else None
