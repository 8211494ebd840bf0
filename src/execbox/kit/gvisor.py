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

from typing import Any

from execbox.config import paths
from execbox.kit.probecache import read_owned_json

GVISOR_RECORD = paths.SYSTEM_STATE / "gvisor.json"


def gvisor_record() -> dict[str, Any] | None:
    """The set-up's record, or None: none written, or a file that is not root's alone to write."""
    record = read_owned_json(GVISOR_RECORD, owner=0)
    return record if isinstance(record, dict) and isinstance(record.get("runtime"), str) else None
