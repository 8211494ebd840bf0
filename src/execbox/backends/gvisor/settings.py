"""The gvisor backend's own settings (CODE_EXEC_GVISOR_*), each checked as it is read."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from execbox.plugin import BackendSettings, setting, uid_gid


class GvisorSettings(BackendSettings):
    runsc: str = setting("CODE_EXEC_GVISOR_RUNSC", "runsc", "The runsc binary: a name on PATH or an absolute path",
                         max_length=4096)
    platform: Literal["ptrace", "kvm", "systrap"] = setting(
        "CODE_EXEC_GVISOR_PLATFORM", "ptrace", "gVisor's platform (how it traps the code's system calls); ptrace "
        "works everywhere, kvm needs /dev/kvm (probed with a timeout: it hangs on some hosts)")
    image: str = setting("CODE_EXEC_GVISOR_IMAGE", "execbox-sandbox:bookworm", "Docker image exported once into "
                         "the cached root filesystem (needs a docker engine the first time)", max_length=512)
    rootfs: str = setting("CODE_EXEC_GVISOR_ROOTFS", "", "A prepared root filesystem directory to use instead of "
                          "exporting CODE_EXEC_GVISOR_IMAGE (for hosts with no docker engine)", max_length=4096)
    user: str = setting("CODE_EXEC_GVISOR_USER", "65534:65534",
                        "uid:gid the code runs as inside the sandbox when execbox runs as root (never 0)")
    tmpfs_mb: int = setting("CODE_EXEC_GVISOR_TMPFS_MB", 512, "Size of the sandbox's /tmp tmpfs, MiB (counts "
                            "against memory)", gt=0, le=1 << 20)
    start_timeout_s: float = setting("CODE_EXEC_GVISOR_START_TIMEOUT_S", 30.0, "How long a sandbox may take to "
                                     "start before it is given up (a platform that hangs becomes an error)",
                                     gt=0, le=600)

    @field_validator("runsc")
    @classmethod
    def _binary(cls, value: str) -> str:
        if "\0" in value or not value.strip() or ("/" in value and not value.startswith("/")):
            raise ValueError("give the runsc binary's name on PATH or its absolute path")
        return value

    @field_validator("rootfs")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if value and ("\0" in value or not value.startswith("/")):
            raise ValueError("give the root filesystem as an absolute directory path")
        return value

    _user = field_validator("user")(uid_gid)
