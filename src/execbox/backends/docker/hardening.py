"""The hardening table: checked on the create arguments before the engine sees them (``hardened``), and on the
container as the engine built it (``built_problems``), so neither a future edit nor an engine default, plugin
or daemon.json setting can weaken one container unnoticed. Also the seccomp profile and the runtimes admitted.

Seccomp. The engine's own default profile cannot be extended: a profile given with ``--security-opt seccomp=``
replaces it, and Docker 20.10 offers no way to name the built-in one and add to it. Copying Moby's 800-line
allowlist would mean owning and tracking a file we did not write. So the profile is execbox's own: allow by
default, deny the shared list of ``execbox.policy.seccomp`` (the one bubblewrap loads), with EPERM, and
``clone3`` with ENOSYS so libc falls back to ``clone``, whose CLONE_NEWUSER flag an argument filter sees. What
the engine's default denies beyond that list are calls the kernel already refuses to a process with no
capabilities under no-new-privileges (clock and time setting, module loading, ``vhangup``, NUMA policy of other
processes...), which every execbox container is. The profile lists the native architecture and its compat ABIs
(i386 and x32 on x86_64, arm on aarch64) so the same names are denied through ``int 0x80`` too.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from execbox.plugin import (
    CLONE_NEWUSER,
    DENIED_SOCKET_FAMILIES,
    DENIED_SYSCALLS,
    DENIED_WITH_NEWUSER,
    ENOSYS_SYSCALLS,
    PROXY_MOUNT_POINT,
    SECCOMP_DENY_ERRNO,
    ConfigError,
)

WORKSPACE = "/workspace"
TMPFS = "/tmp"
NOBODY = "65534:65534"

# OCI runtimes execbox admits, by the name registered in the engine: the isolation each gives, and the
# binaries that name may point at (a name is only trusted when the engine runs what it says). Anything else
# (nvidia, sysbox, a wrapper script) may add devices, mounts or hooks the table cannot see, and is refused.
KNOWN_RUNTIMES: dict[str, tuple[str, frozenset[str]]] = {
    "runc": ("container", frozenset({"runc"})),
    "io.containerd.runc.v2": ("container", frozenset({"runc", "io.containerd.runc.v2", "containerd-shim-runc-v2"})),
    "crun": ("container", frozenset({"crun"})),
    "runsc": ("gvisor", frozenset({"runsc"})),
    "kata-runtime": ("microvm", frozenset({"kata-runtime"})),
    "io.containerd.kata.v2": ("microvm", frozenset({"io.containerd.kata.v2", "containerd-shim-kata-v2"})),
}

# What gVisor does not enforce under the docker backend, whatever its arguments: the code's processes live in the
# Sentry, so the host's pids cgroup counts the Sentry's threads, not them (fork never fails at the limit, and a
# low limit stops the sandbox from starting: seen with runsc 20221219 on cgroup v1). Memory, cpu and disk hold:
# the cgroup bounds the Sentry's memory and CPU, and the workspace is the same sized bind.
GVISOR_UNENFORCED = {
    "pids": "under gVisor the host's pids cgroup counts the Sentry's threads, not the code's processes (fork never "
            "fails at the limit)",
}


def runtime_flags(args: Sequence[str]) -> dict[str, str]:
    """A runtime's arguments (``docker info`` runtimeArgs) as flag -> value: ``--network=none``, ``-network none``
    and a bare ``--flag`` (``true``) alike."""
    flags: dict[str, str] = {}
    words = list(args)
    for i, word in enumerate(words):
        if not word.startswith("-"):
            continue
        name, eq, value = word.lstrip("-").partition("=")
        if not eq:
            following = words[i + 1] if i + 1 < len(words) else ""
            value = following if following and not following.startswith("-") else "true"
        flags[name] = value
    return flags


def gvisor_unenforced(args: Sequence[str]) -> dict[str, str]:
    """The network modes and limits the docker backend cannot enforce on runsc run with ``args``, and why: what
    gVisor never enforces here, egress without runsc's own network stack, proxy without host unix sockets."""
    flags = runtime_flags(args)
    found = dict(GVISOR_UNENFORCED)
    if flags.get("network", "sandbox") != "sandbox":
        found["egress"] = (f"the runtime runs runsc with --network={flags['network']}, so a container has no network "
                           "stack but loopback (egress needs runsc's own, --network=sandbox)")
    if flags.get("host-uds", "none") != "open":
        # open: connect to a host socket the sandbox can see through its mounts, as any runc container can; not
        # create (host sockets made by the code) nor all.
        found["proxy"] = ("proxy mode connects to a host unix socket bound into the sandbox, which runsc allows only "
                          f"with --host-uds=open (the runtime runs it with --host-uds={flags.get('host-uds', 'none')})")
    return found


# Native architecture -> the seccomp architectures a process on it can issue system calls in.
_ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}


def parse_user(user: str) -> tuple[int, int]:
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def default_user() -> str:
    return NOBODY if os.geteuid() == 0 else f"{os.geteuid()}:{os.getegid()}"  # who owns what mkdtemp makes


def install_dir() -> Path:
    return Path(__file__).resolve().parents[2]


def runtime_problem(name: str, entry: dict[str, Any] | None) -> str | None:
    """Why the engine's runtime ``name`` (its entry in ``docker info`` Runtimes) is not admitted, or None."""
    known = KNOWN_RUNTIMES.get(name)
    if known is None:
        return (f"runtime {name} is not one execbox knows to isolate at least as well as runc "
                f"(known: {', '.join(sorted(KNOWN_RUNTIMES))})")
    entry = entry or {}
    binary = os.path.basename(str(entry.get("path") or entry.get("runtimeType") or name))
    if binary not in known[1]:
        return f"runtime {name} is registered in the engine as {binary}, which is not {name}"
    return None


@functools.cache
def seccomp_profile(machine: str | None = None, gvisor: bool = False) -> str:
    """The profile as the JSON string ``--security-opt seccomp=`` takes (the engine stores it verbatim). ``gvisor``:
    without the clone3 rule. runsc (20221219, --oci-seccomp) answers every errno action with EPERM whatever its
    errnoRet, so glibc, seeing EPERM and not ENOSYS, would not fall back to clone and no thread would start; and
    the Sentry has no clone3 to deny (it answers ENOSYS itself), so nothing is opened."""
    deny = {"action": "SCMP_ACT_ERRNO", "errnoRet": SECCOMP_DENY_ERRNO}
    newuser = {"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}
    rules: list[dict[str, Any]] = [
        {"names": sorted(DENIED_SYSCALLS), **deny},
        {"names": sorted(DENIED_WITH_NEWUSER), **deny, "args": [newuser]},
        *({"names": ["socket"], **deny, "args": [{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}]}
          for family in DENIED_SOCKET_FAMILIES),
        *([] if gvisor else [{"names": sorted(ENOSYS_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS}]),
    ]
    profile = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": _ARCHES.get(machine or platform.machine(), []),
               "syscalls": rules}
    return json.dumps(profile, sort_keys=True, separators=(",", ":"))


def security_opt(gvisor: bool = False) -> list[str]:
    return ["no-new-privileges", f"seccomp={seccomp_profile(gvisor=gvisor)}"]


def _contains(outer: Path, inner: Path) -> bool:
    return inner == outer or outer in inner.parents


def hardened(kw: dict[str, Any], *, socket_path: str | None,
             user_mounts: Sequence[tuple[str, str, bool]] = (), gvisor: bool = False) -> dict[str, Any]:
    """Refuse create arguments that break the hardening table. Returns ``kw`` unchanged. ``user_mounts``: the
    (source, target, writable) binds the guard admitted for this session (``execbox.Mount``); any other
    writable mount than the workspace is refused."""
    problems = []
    if kw.get("privileged"):
        problems.append("privileged mode")
    if kw.get("cap_add"):
        problems.append(f"added capabilities {kw['cap_add']}")
    if kw.get("cap_drop") != ["ALL"]:
        problems.append("capabilities not all dropped")
    if sorted(kw.get("security_opt") or []) != sorted(security_opt(gvisor)):
        problems.append("security options other than no-new-privileges and execbox's seccomp profile")
    if not kw.get("read_only"):
        problems.append("a writable root filesystem")
    for ns in ("pid_mode", "ipc_mode", "userns_mode", "uts_mode", "cgroupns"):
        if str(kw.get(ns) or "").startswith(("host", "container:")):
            problems.append(f"{ns}={kw[ns]}")
    if kw.get("devices") or kw.get("device_requests") or kw.get("volumes_from") or kw.get("volumes"):
        problems.append("devices or extra volumes")
    if not kw.get("init"):
        problems.append("no init process")
    uid, gid = parse_user(str(kw.get("user") or "0"))
    if uid == 0 or gid == 0:
        problems.append(f"user {kw.get('user')} (root)")
    for key in ("pids_limit", "mem_limit", "nano_cpus"):
        if not kw.get(key):
            problems.append(f"{key} unset")
    if kw.get("memswap_limit") != kw.get("mem_limit"):
        problems.append("swap headroom (memswap_limit != mem_limit)")
    mounts = kw.get("mounts") or []
    declared = {(src, dst) for src, dst, rw in user_mounts if rw}
    writable = [m for m in mounts if not m.get("ReadOnly") and (m.get("Source"), m.get("Target")) not in declared]
    if len(writable) != 1 or writable[0].get("Target") != WORKSPACE or writable[0].get("Type") != "bind":
        problems.append("the one writable mount must be the workspace bind at /workspace (besides the mounts the "
                        "caller asked for)")
    for m in writable:
        with contextlib.suppress(OSError):  # a missing source is the engine's error to report
            if os.stat(m.get("Source") or "/").st_mode & 0o022:
                problems.append(f"workspace {m.get('Source')} is writable by other local users")
    for m in mounts:
        if m.get("Type") != "bind" or (m.get("BindOptions") or {}).get("Propagation"):
            problems.append(f"mount at {m.get('Target')} is not a plain private bind")
    forbidden = [Path(os.path.expanduser("~")).resolve(), install_dir()]
    if socket_path:
        forbidden.append(Path(socket_path).resolve())
    forbidden.append(Path("/var/run/docker.sock").resolve())
    for m in mounts:
        source = Path(m.get("Source") or "/").resolve()
        for bad in forbidden:
            if _contains(source, bad):
                problems.append(f"mount of {source} exposes {bad}")
    if problems:
        raise ConfigError("refused: this container would not be a sandbox: " + "; ".join(problems)
                          + ". The docker backend only starts containers that match its hardening table")
    return kw


@dataclass(frozen=True)
class Contract:
    """What the engine must have built, in the terms ``docker inspect`` reports it."""

    user: str
    network: str  # HostConfig.NetworkMode: "none", "host" or the egress network's name
    workspace: str  # the host directory bound at /workspace
    memory_bytes: int
    nano_cpus: int
    pids: int
    runtime: str | None  # None: whatever the engine's default is, if it is a runtime execbox knows
    proxy_dir: str | None = None  # network mode proxy: the host directory bound read-only at PROXY_MOUNT_POINT
    mounts: tuple[tuple[str, str, bool], ...] = ()  # the caller's binds (execbox.Mount): source, target, writable
    tmpfs: tuple[str, ...] = ()  # the request's extra tmpfs paths, beside /tmp
    gvisor: bool = False  # the runtime was judged gVisor: its seccomp profile (security_opt(gvisor=True))


def built_problems(attrs: dict[str, Any], c: Contract) -> list[str]:
    """How the container the engine built (``container.attrs``) differs from the contract; [] when it does not.
    Each problem names the inspect field, so a refusal says what the engine changed."""
    hc = attrs.get("HostConfig") or {}
    config = attrs.get("Config") or {}
    problems = []

    def want(field: str, value: Any, expected: Any) -> None:
        if value != expected:
            problems.append(f"{field}={value!r} (the contract says {expected!r})")

    want("HostConfig.NetworkMode", hc.get("NetworkMode"), c.network)
    want("HostConfig.Privileged", hc.get("Privileged"), False)
    want("HostConfig.CapAdd", hc.get("CapAdd") or [], [])
    want("HostConfig.CapDrop", hc.get("CapDrop"), ["ALL"])
    want("Config.User", config.get("User"), c.user)
    for field, expected in (("PidMode", ""), ("IpcMode", "private"), ("UTSMode", ""), ("UsernsMode", ""),
                            ("CgroupnsMode", "private")):
        want(f"HostConfig.{field}", hc.get(field), expected)
    want("HostConfig.ReadonlyRootfs", hc.get("ReadonlyRootfs"), True)
    want("HostConfig.Init", hc.get("Init"), True)
    for field in ("Devices", "DeviceRequests", "DeviceCgroupRules", "Binds", "VolumesFrom", "Links", "Sysctls",
                  "PortBindings", "GroupAdd"):
        want(f"HostConfig.{field}", hc.get(field) or None, None)
    want("HostConfig.PublishAllPorts", bool(hc.get("PublishAllPorts")), False)
    want("HostConfig.OomKillDisable", bool(hc.get("OomKillDisable")), False)
    want("HostConfig.Memory", hc.get("Memory"), c.memory_bytes)
    want("HostConfig.MemorySwap", hc.get("MemorySwap"), c.memory_bytes)
    want("HostConfig.NanoCpus", hc.get("NanoCpus"), c.nano_cpus)
    want("HostConfig.PidsLimit", hc.get("PidsLimit"), c.pids)
    want("HostConfig.Tmpfs", sorted(hc.get("Tmpfs") or {}), sorted({TMPFS, *c.tmpfs}))
    options = sorted(hc.get("SecurityOpt") or [])
    if options != sorted(security_opt(c.gvisor)):
        # A profile is a page of JSON: named, not printed.
        shown = ["seccomp=<execbox's profile>" if o == f"seccomp={seccomp_profile(gvisor=c.gvisor)}" else
                 "seccomp=<another profile>" if o.startswith("seccomp=") and len(o) > 40 else o for o in options]
        problems.append(f"HostConfig.SecurityOpt={shown} (the contract says no-new-privileges and execbox's "
                        "seccomp profile, nothing else)")
    # systempaths=unconfined empties these: /proc/kcore, /proc/sys and friends would be open.
    if "/proc/kcore" not in (hc.get("MaskedPaths") or []):
        problems.append("HostConfig.MaskedPaths does not mask /proc/kcore")
    if "/proc/sys" not in (hc.get("ReadonlyPaths") or []):
        problems.append("HostConfig.ReadonlyPaths does not hold /proc/sys")
    runtime = hc.get("Runtime")
    if c.runtime is not None:
        want("HostConfig.Runtime", runtime, c.runtime)
    elif runtime not in KNOWN_RUNTIMES:
        problems.append(f"HostConfig.Runtime={runtime!r} (not a runtime execbox knows)")
    mounts = [(m.get("Type"), m.get("Source"), m.get("Destination"), m.get("RW")) for m in attrs.get("Mounts") or []]
    wanted = [("bind", c.workspace, WORKSPACE, True)]
    if c.proxy_dir:
        wanted.append(("bind", c.proxy_dir, PROXY_MOUNT_POINT, False))
    wanted += [("bind", source, target, writable) for source, target, writable in c.mounts]
    want("Mounts", sorted(mounts, key=str), sorted(wanted, key=str))
    for m in attrs.get("Mounts") or []:
        if m.get("Propagation") not in (None, "", "rprivate", "private"):
            problems.append(f"Mounts[{m.get('Destination')}].Propagation={m.get('Propagation')!r} (the contract says "
                            "rprivate: nothing mounted later on either side may show through)")
    return problems
