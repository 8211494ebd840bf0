"""The bubblewrap backend's own settings (CODE_EXEC_BWRAP_*), each checked as it is read."""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

from pydantic import field_validator
from pydantic_settings import NoDecode

from execbox.backends.bubblewrap.filesystem import MAX_PATH, unsafe_bind
from execbox.plugin import BackendSettings, comma_list, setting, uid_gid

_CGROUP_NAME = re.compile(r"[A-Za-z0-9._@:+/-]*")


class BubblewrapSettings(BackendSettings):
    path: str = setting("CODE_EXEC_BWRAP_PATH", "bwrap", "The bwrap binary: a name on PATH or an absolute path; "
                        "root-owned and writable by nobody else when execbox runs as root", max_length=MAX_PATH)
    user: str = setting("CODE_EXEC_BWRAP_USER", "65534:65534",
                     "Host uid:gid the sandbox runs as when execbox runs as root (never 0)")
    tmpfs_mb: int = setting("CODE_EXEC_BWRAP_TMPFS_MB", 512, "Size of the /tmp tmpfs and of each tmpfs= path (counts "
                            "against memory; a tmpfs= path at most the disk limit; without root a sandbox's are "
                            "each exec's own, not kept across its execs), MiB",
                            gt=0, le=1 << 20)
    cgroups: Literal["auto", "off"] = setting(
        "CODE_EXEC_BWRAP_CGROUPS", "auto", "auto: memory/pids/cpu limits through a cgroup per exec when the host "
        "lets execbox create one; off: rlimits only")
    cgroup_parent: str = setting(
        "CODE_EXEC_BWRAP_CGROUP_PARENT", "", "cgroup (path under the cgroup mount) in which execbox creates one "
        "cgroup per exec; empty = execbox's own cgroup", max_length=MAX_PATH)
    ro_binds: Annotated[list[str], NoDecode] = setting(
        "CODE_EXEC_BWRAP_RO_BINDS", [], "Comma list of extra host paths bound read-only at the same place (e.g. "
        "/opt/agent-venv); a path that is, lies below or holds /, /home, /root, /run, /var/run, /proc, /sys, /dev, "
        "/boot, /etc, /var, /tmp, /workspace, the temp directory or your home is refused", max_length=64)

    _split_lists = field_validator("ro_binds", mode="before")(comma_list)

    @field_validator("path")
    @classmethod
    def _binary(cls, value: str) -> str:
        if "\0" in value or not value.strip():
            raise ValueError("give the bwrap binary's name on PATH or its absolute path")
        if "/" in value and not value.startswith("/"):
            raise ValueError(f"{value!r} is neither a name on PATH nor an absolute path")
        return value

    _user = field_validator("user")(uid_gid)

    @field_validator("cgroup_parent")
    @classmethod
    def _cgroup_path(cls, value: str) -> str:
        # Joined under the cgroup mount and created as root: a ".." would make directories and write files
        # anywhere on the host.
        if value and (not value.startswith("/") or os.path.normpath(value) != value.rstrip("/") or "/." in value
                      or not _CGROUP_NAME.fullmatch(value)):
            raise ValueError(f"{value[:200]!r} is not a plain absolute cgroup path like /execbox (letters, digits, "
                             "._-@:+ and /, no . or .. components)")
        return value if value in ("", "/") else value.rstrip("/")

    @field_validator("ro_binds")
    @classmethod
    def _safe_binds(cls, paths: list[str]) -> list[str]:
        for raw in paths:
            reason = unsafe_bind(raw)
            if reason:
                raise ValueError(reason)
        return paths

    def host_identity(self) -> tuple[int, int] | None:
        """The uid:gid to drop to before bwrap, when execbox runs as root; None when it does not."""
        if os.geteuid() != 0:
            return None
        uid, _, gid = self.user.partition(":")
        return int(uid), int(gid)
