"""What ``check`` found on this host (``HostReport``): the capabilities enforced here and the facts behind them,
which every session builds its sandboxes from and `execbox doctor` shows."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

from execbox.backends.bubblewrap.cgroups import CgroupPlan
from execbox.plugin import Capabilities


@dataclass(frozen=True)
class HostReport:
    """What ``check`` found: the capabilities and the facts behind them (for `execbox doctor`)."""

    capabilities: Capabilities
    bwrap: str
    version: str
    features: frozenset[str]
    host_identity: tuple[int, int] | None
    cgroup: CgroupPlan | None
    cgroup_reason: str
    seccomp_syscalls: tuple[str, ...]
    # Why the workspace cannot be size-limited here; "" when it is (the disk limit).
    disk_reason: str
    # The launcher's sh and setpriv (absolute paths, checked like bwrap).
    tools: dict[str, str]

    @property
    def sized_workspace(self) -> bool:
        return not self.disk_reason

    def facts(self) -> dict[str, Any]:
        return {
            "bwrap": self.bwrap,
            "version": self.version,
            "runs_as": (f"uid {self.host_identity[0]} gid {self.host_identity[1]} (dropped from root)")
                       if self.host_identity
                       else f"uid {os.getuid()} (the caller)",
            "cgroup": f"v{self.cgroup.version}: " + ", ".join(sorted(self.cgroup.parents)) if self.cgroup
                      else f"none ({self.cgroup_reason})",
            "limits": sorted(self.capabilities.limits),
            "seccomp": "denies " + ", ".join(self.seccomp_syscalls),
            "disk": f"not limited ({self.disk_reason})" if self.disk_reason
                    else "workspace on a size-limited loop-mounted ext4",
            "disable_userns": "--disable-userns" in self.features,
            "tmpfs_size": "--size" in self.features,
            # run_code(language="python") needs the host's python3 under /usr (it is bound in)
            "python3": shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
                       or "missing: apt-get install python3 (dnf install python3)",
        }
