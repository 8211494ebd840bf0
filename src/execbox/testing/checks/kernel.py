"""Checks of a kernel of its own (isolation ``gvisor`` or ``microvm``): the code runs on a kernel that is not
this host's, and the host kernel's interfaces (its keyrings, BPF, sysctls, its own files) are out of its reach.
A container on this host's kernel fails the first (same boot id, same uname), whatever seccomp profile it has:
so a backend cannot claim gVisor's boundary with runc's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from execbox.testing.framework import Family, Kit, Unavailable, expect, reported
from execbox.testing.probes import KERNEL_PROBE

family = Family()

# Files of the host kernel itself, readable by any uid: its build notes (a build id), its crash-dump layout.
HOST_KERNEL_FILES = ("/sys/kernel/notes", "/sys/kernel/vmcoreinfo")


def _claim(kit: Kit, what: str) -> str:
    return f"isolation={kit.caps.isolation!r} ({what})"


def _probe(kit: Kit, claim: str, *paths: str) -> dict[str, Any]:
    result = kit.run(["python3", "-c", KERNEL_PROBE, *paths], timeout=60)
    seen: dict[str, Any] = reported(result, claim, "kernel probe")
    return seen


@family.check("a kernel of its own: the code runs on a kernel that is not this host's")
def check_own_kernel_not_the_hosts(kit: Kit) -> str:
    kit.require(own_kernel=True, local=True)
    claim = _claim(kit, "a kernel of its own")
    seen = _probe(kit, claim)
    host_boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    inside = f"uname {seen['release']} {seen['version']}, boot id {seen['boot_id']}"
    # The positive signal: the probe read its kernel's name. (gVisor has no boot id: no file is not the host's.)
    expect(bool(seen["release"]), claim, "the probe to read its kernel's uname", inside)
    expect(seen["boot_id"] != host_boot, claim, f"a boot id other than this host's ({host_boot})", inside)
    host = os.uname()
    expect((seen["release"], seen["version"]) != (host.release, host.version), claim,
           f"a kernel other than this host's (uname {host.release} {host.version})", inside)
    return f"{inside}; /proc/version {seen['proc_version']}"


@family.check("a kernel of its own: the host kernel's keyrings, BPF, sysctls and own files are out of reach")
def check_own_kernel_host_interfaces_unreachable(kit: Kit) -> str:
    kit.require(own_kernel=True, local=True)
    claim = _claim(kit, "host kernel interfaces unreachable")
    host = {}
    for path in HOST_KERNEL_FILES:
        try:
            host[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            continue
    if not host:
        raise Unavailable(f"this host shows none of {', '.join(HOST_KERNEL_FILES)} to compare with")
    seen = _probe(kit, claim, *host)
    expect(str(seen["keyctl"]).startswith("REFUSED"), claim, "raw keyctl (the user keyring) refused", seen["keyctl"])
    expect(str(seen["bpf"]).startswith("REFUSED"), claim, "raw bpf (an array map) refused", seen["bpf"])
    expect(str(seen["sysctl_write"]).startswith("REFUSED"), claim, "/proc/sys/kernel/core_pattern not writable",
           seen["sysctl_write"])
    shared = sorted(path for path, digest in host.items() if seen["files"].get(path) == digest)
    expect(not shared, claim, "none of this host kernel's own files readable inside",
           f"the same {', '.join(shared)} as this host's")
    return (f"keyctl {seen['keyctl']}, bpf {seen['bpf']}, sysctl write {seen['sysctl_write']}, "
            f"host kernel files inside: {seen['files']}")
