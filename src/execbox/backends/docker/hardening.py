"""The hardening table: checked on the create arguments before the engine sees them (``hardened``), and on the
container as the engine built it (``built_problems``), so neither a future edit nor an engine default, plugin
or daemon.json setting can weaken one container unnoticed. Also the seccomp profile and the runtimes admitted
(judged by the binary and arguments the engine runs, never by the name they are registered under).

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
import re
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

# OCI runtimes execbox admits, by the binary the engine runs (not the name it is registered under): the isolation
# each gives. Anything else (nvidia, sysbox, a wrapper script) may add devices, mounts or hooks the table cannot
# see, and is refused.
RUNTIME_BINARIES: dict[str, str] = {
    "runc": "container", "crun": "container",
    "io.containerd.runc.v2": "container", "containerd-shim-runc-v2": "container",
    "runsc": "gvisor", "io.containerd.runsc.v1": "gvisor", "containerd-shim-runsc-v1": "gvisor",
    "kata-runtime": "microvm", "io.containerd.kata.v2": "microvm", "containerd-shim-kata-v2": "microvm",
}

# The runtime arguments execbox admits, per kind: flag -> the values admitted (None: any value; a bool flag takes
# "true"/"false"). Every other flag is refused (fail closed); runsc's in _WEAKENING with the reason it weakens gVisor.
_ANY = None
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:=,+@-]+")  # what a shell reads as one word, unchanged
_BOOL = frozenset({"true", "false"})
_GVISOR_FLAGS: dict[str, frozenset[str] | None] = {
    "platform": frozenset({"ptrace", "kvm", "systrap"}),
    "network": frozenset({"sandbox", "none"}),
    "root": _ANY, "log": _ANY, "log-format": frozenset({"text", "json", "json-k8s"}),
    "systemd-cgroup": _BOOL,
    "oci-seccomp": frozenset({"true"}),  # required: without it runsc ignores the profile (judge_runtime)
    # A connect to a host socket visible in the sandbox's mounts, as under runc (execbox's proxy socket).
    "host-uds": frozenset({"none", "open"}),
    "file-access": frozenset({"exclusive", "shared"}), "file-access-mounts": frozenset({"exclusive", "shared"}),
    "overlay2": frozenset({"none", "root:memory"}),
    # Performance knobs of gVisor's own network stack: what the sandbox can reach stays the same.
    "gso": _BOOL, "software-gso": _BOOL, "rx-checksum-offload": _BOOL, "tx-checksum-offload": _BOOL,
    "num-network-channels": _ANY, "buffer-pooling": _BOOL,
}
_CONTAINER_FLAGS: dict[str, frozenset[str] | None] = {
    "root": _ANY, "log": _ANY, "log-format": frozenset({"text", "json"}), "systemd-cgroup": _BOOL,
    "cgroup-manager": frozenset({"cgroupfs", "systemd"}),  # crun's spelling of systemd-cgroup
}
_ADMITTED: dict[str, dict[str, frozenset[str] | None]] = {
    "gvisor": _GVISOR_FLAGS, "container": _CONTAINER_FLAGS, "microvm": {},
}
_LOGS_ACTIVITY = "logs what the sandboxed code does (its syscalls, files, packets: secrets too) on the host"
_WEAKENING = {
    "network=host": "gives the sandbox the host kernel's network stack instead of gVisor's",
    "host-uds": "lets the sandbox create or bind sockets on the host's filesystem",
    "fsgofer-host-uds": "lets the sandbox create or bind sockets on the host's filesystem",
    "ignore-cgroups": "the engine's memory, cpu and pids limits would not apply",
    "rootless": "runs the sandbox without the user namespace and capability drop gVisor sets up as root",
    "net-raw": "gives the sandbox raw sockets",
    "allow-flag-override": "lets annotations of the container change the runtime's flags",
    "overlay": "keeps /workspace writes in the sandbox's memory: results would never reach the host",
    "overlay2": "keeps /workspace writes in the sandbox's memory: results would never reach the host",
    "platform": "is not a platform execbox knows (ptrace, kvm, systrap)",
    **{flag: _LOGS_ACTIVITY for flag in ("debug", "debug-log", "debug-log-fd", "debug-command", "strace",
                                         "strace-syscalls", "strace-event", "strace-log-size", "log-packets",
                                         "pcap-log", "profile", "trace")},
}


@dataclass(frozen=True)
class Runtime:
    """The engine's runtime ``name`` as judged: what it runs, the isolation it gives, why it is refused."""

    name: str
    binary: str
    isolation: str | None  # None: refused
    problem: str | None = None
    args: tuple[str, ...] = ()
    platform: str | None = None  # gVisor: as given in its arguments, None for runsc's default
    network: str | None = None  # gVisor's network stack: "sandbox" (its own netstack) or "none" (loopback only)
    host_uds: str = "none"  # gVisor: which host unix sockets the sandbox may reach ("open": connect to one it sees)


def _boolean(admitted: frozenset[str] | None) -> bool:
    return admitted is not None and admitted <= _BOOL


def _flag_pairs(args: Sequence[str]) -> list[tuple[str, str | None, str]]:
    """Go-style flags as (name, value or None, as written): -f, --f, -f=v, --f=v, and -f v for a flag that takes a
    value (one admitted with values other than true/false)."""
    pairs: list[tuple[str, str | None, str]] = []
    rest = list(args)
    while rest:
        word = rest.pop(0)
        if not word.startswith("-") or word in ("-", "--"):
            pairs.append(("", None, word))
            continue
        name, eq, value = word.lstrip("-").partition("=")
        if not eq and not _boolean({**_GVISOR_FLAGS, **_CONTAINER_FLAGS}.get(name, _BOOL)) and rest \
                and not rest[0].startswith("-"):
            value, eq = rest.pop(0), "="
            word = f"{word} {value}"
        pairs.append((name, value if eq else None, word))
    return pairs


def judge_runtime(name: str, entry: dict[str, Any] | None) -> Runtime:
    """The engine's runtime ``name`` (its entry in ``docker info`` Runtimes) judged by the binary it runs and the
    arguments it runs it with, whatever the name."""
    entry = entry or {}
    path = str(entry.get("path") or entry.get("runtimeType") or name)
    args = tuple(str(a) for a in entry.get("runtimeArgs") or ())
    # dockerd runs a runtime with arguments through a script it writes unquoted (`exec PATH ARGS "$@"`): the shell
    # splits and expands each word again, so a word that is not one plain shell word is refused, not read
    unplain = next((word for word in (path, *args) if not _PLAIN_WORD.fullmatch(word)), None)
    if unplain is not None:
        return Runtime(name, os.path.basename(path), None, f"runtime {name} is registered with {unplain!r}, which "
                       "is not one plain word (dockerd passes its path and arguments through a shell unquoted)", args)
    if os.path.isabs(path) and os.path.exists(path):
        path = os.path.realpath(path)  # a link named runsc that points at a wrapper is the wrapper
    binary = os.path.basename(path)
    isolation = RUNTIME_BINARIES.get(binary)

    def refused(why: str) -> Runtime:
        return Runtime(name, binary, None, f"runtime {name} {why}", args)

    if isolation is None:
        return refused(f"runs {binary}, not a runtime execbox knows to isolate at least as well as runc (known: "
                       f"{', '.join(sorted({b for b in RUNTIME_BINARIES if '.' not in b}))})")
    if entry.get("options"):
        return refused(f"passes options to {binary} ({', '.join(sorted(entry['options']))}) that execbox cannot "
                       "read; register it with a path and runtimeArgs instead")
    admitted = _ADMITTED[isolation]
    flags: dict[str, str] = {}
    for flag, value, written in _flag_pairs(args):
        given = "true" if value is None and _boolean(admitted.get(flag, _BOOL)) else value
        allowed = admitted.get(flag, frozenset())
        if flag in admitted and given is not None and (allowed is _ANY or given in allowed):
            flags[flag] = given
            continue
        weakening = _WEAKENING if isolation == "gvisor" else {}
        why = (weakening.get(f"{flag}={given}") or weakening.get(flag)
               or ("is test-only, unsafe by its own name" if flag.upper().startswith(("TESTONLY", "EXPERIMENTAL"))
                   else None))
        shown = ", ".join(f"--{f}" for f in sorted(admitted)) or "none"
        return refused(f"runs {binary} with {written}: " + (why if why else
                       f"an argument execbox does not know to be safe (admitted: {shown})"))
    if isolation != "gvisor":
        return Runtime(name, binary, isolation, None, args)
    if flags.get("oci-seccomp") != "true":
        return refused("runs runsc without --oci-seccomp: gVisor would ignore the container's seccomp profile, "
                       "execbox's deny list (user namespaces, ...), inside the sandbox")
    return Runtime(name, binary, isolation, None, args, flags.get("platform"), flags.get("network", "sandbox"),
                   flags.get("host-uds", "none"))


# What gVisor does not enforce under the docker backend, whatever its arguments: the code's processes live in the
# Sentry, so the host's pids cgroup counts the Sentry's threads, not them (fork never fails at the limit, and a
# low limit stops the sandbox from starting: seen with runsc 20221219 on cgroup v1). Memory, cpu and disk hold:
# the cgroup bounds the Sentry's memory and CPU, and the workspace is the same sized bind.
GVISOR_UNENFORCED = {
    "pids": "under gVisor the host's pids cgroup counts the Sentry's threads, not the code's processes (fork never "
            "fails at the limit)",
}


def gvisor_unenforced(runtime: Runtime) -> dict[str, str]:
    """The network modes and limits the docker backend cannot enforce on the judged gVisor ``runtime``, and why:
    what gVisor never enforces here, egress without runsc's own network stack, proxy without host unix sockets."""
    found = dict(GVISOR_UNENFORCED)
    if runtime.network != "sandbox":
        found["egress"] = (f"the runtime runs runsc with --network={runtime.network}, so a container has no network "
                           "stack but loopback (egress needs runsc's own, --network=sandbox)")
    if runtime.host_uds != "open":
        # open: connect to a host socket the sandbox can see through its mounts, as any runc container can; not
        # create (host sockets made by the code) nor all.
        found["proxy"] = ("proxy mode connects to a host unix socket bound into the sandbox, which runsc allows only "
                          f"with --host-uds=open (the runtime runs it with --host-uds={runtime.host_uds})")
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
    runtime: str | None  # the runtime check() judged, by its registered name
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
    # The runtime check() judged, by name; None only when nothing was judged, and then nothing is admitted.
    want("HostConfig.Runtime", hc.get("Runtime"), c.runtime)
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
