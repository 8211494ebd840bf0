"""bubblewrap: every exec in a fresh set of Linux namespaces made by ``bwrap``; no daemon, milliseconds.

The boundary, on every exec:

    namespaces     all unshared (user, pid, mount, ipc, uts, cgroup, and network unless 'host' is
                   asked for); a new session (no TIOCSTI into the caller's terminal); no new user
                   namespaces inside
    proxy          network mode proxy: the network namespace holds only loopback; the egress proxy
                   (core/proxy.py) listens on a Unix socket bound read-only at /run/execbox, and a
                   forwarder run by the host's python3 in front of the command relays to it
    identity       uid/gid 1000 inside with no capabilities; when execbox runs as root the launcher
                   first drops to an unprivileged host uid with no groups (setpriv; CODE_EXEC_BWRAP_USER,
                   65534:65534), since bwrap started by root maps the sandbox user onto host root for
                   file access
    filesystem     an empty read-only root holding: /usr (and the /bin, /lib* links), the pieces of
                   /etc a program needs (no passwd/shadow of the host: a generated one), a fresh /proc
                   and /dev, /tmp and /dev/shm as size-limited tmpfs, and exactly one writable host
                   path, the session workspace, at /workspace. Never /home, /root, /run, host sockets
                   or the execbox install directory (masked when it lies under /usr)
    seccomp        ptrace, mounts, setns, keyrings, bpf, perf, userfaultfd, io_uring, new user
                   namespaces and kernel-module/kexec calls fail (bubblewrap_seccomp.py)
    limits         rlimits always (ulimit: no core dumps, 1 GiB files, CPU seconds); memory, pids and cpu
                   through a cgroup per exec where the host lets execbox create one (v1 or v2),
                   decided by ``check``: the capabilities report only what is enforced here; as
                   root, the workspace is a size-limited filesystem of its own (core.disk: the disk
                   limit, CODE_EXEC_DISK_MB), claimed only where ``check`` could mount one. A
                   one-shot's is mounted while its launcher starts, and bwrap waits at the launcher's
                   gate until it is; a sandbox's is mounted when it opens
    time           at the deadline the launcher's watcher kills bwrap's pid 1: its PID namespace dies with
                   every process in it, setsid and double-forked grandchildren included
    caller's death the launcher (_bwrap_launch.py: a shell watcher, no interpreter) stays beside bwrap with
                   a parent-death signal: SIGKILL, SIGTERM or SIGHUP of execbox kills the sandbox at once,
                   also in the start-up window that bwrap --die-with-parent leaves open

A session is a directory ``execbox-bwrap-PID-STARTTIME-*`` in the temp dir (with an ``owner`` file,
core.owner) holding the workspace; it lives until ``close``; each exec is a new sandbox over it in a cgroup
``execbox-PID-STARTTIME-*``. What a killed execbox leaves (the directory, a mounted workspace, empty cgroups)
is removed by the first ``check`` of the next process that uses bubblewrap, and by `execbox gc`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import math
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Annotated, Any, Literal, cast

import anyio
from pydantic import field_validator
from pydantic_settings import NoDecode

from execbox.backends import _bwrap_launch, bubblewrap_seccomp
from execbox.plugin import (
    ARMED,
    OWNER_FILE,
    BackendSettings,
    BackendUnavailableError,
    Capabilities,
    ConfigError,
    ExecResult,
    ExecSpec,
    ExecutionBackend,
    FileInfo,
    Limits,
    SandboxError,
    Session,
    SessionSpec,
    Settings,
    Transfer,
    TransferLimits,
    armed_script,
    comma_list,
    create_cleanly,
    disk,
    finish_process,
    orphaned_dirs,
    owner_id,
    owner_tag,
    proxy,
    remove_tree,
    safe_read,
    safe_write,
    sandbox_env,
    seccomp_policy,
    setting,
    start_process,
    stop_process,
)

# The launcher's tools (_bwrap_launch.py), looked up here only: what a root process runs must not come from PATH.
_TOOLS_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_LAUNCH_TOOLS = ("sh", "setpriv")
WORKSPACE = "/workspace"
SANDBOX_UID = SANDBOX_GID = 1000
FILE_SIZE_LIMIT = 1 << 30
SHM_MB = 64
# What a program needs from /etc (plus /etc/python3*); everything else of the host's /etc stays out.
# TLS gets the CA certificates and the OpenSSL config only, never all of /etc/ssl or /etc/pki: their
# private/ directories hold keys readable by a group (ssl-cert) that a non-root caller may be in, and an
# unprivileged bwrap keeps the caller's supplementary groups.
ETC_PIECES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone",
    "ssl/certs", "ssl/cert.pem", "ssl/openssl.cnf",  # Debian, Ubuntu, Arch, Alpine, SUSE
    "pki/tls/certs", "pki/tls/cert.pem", "pki/tls/openssl.cnf", "pki/ca-trust",  # Fedora, RHEL
    "ca-certificates", "ca-certificates.conf", "crypto-policies", "nsswitch.conf", "host.conf",
    "gai.conf", "protocols", "services", "mime.types", "os-release", "debian_version", "locale.alias",
    "locale.conf",
)
# Host paths that must never be visible, whatever CODE_EXEC_BWRAP_RO_BINDS says.
FORBIDDEN = ("/", "/home", "/root", "/run", "/var/run", "/proc", "/sys", "/dev", "/boot", "/etc", "/var", "/tmp",
             WORKSPACE)
MAX_PATH = 4096
MAX_ID = (1 << 32) - 1
_DIGITS = re.compile(r"[0-9]{1,10}")
_CGROUP_NAME = re.compile(r"[A-Za-z0-9._@:+/-]*")


def forbidden_places() -> list[str]:
    """FORBIDDEN plus what is forbidden on this host: the temporary directory that holds every session's
    workspace, and the caller's home (wherever they are, also through symlinks)."""
    places = set(FORBIDDEN)
    for path in (tempfile.gettempdir(), os.path.expanduser("~")):
        if path.startswith("/"):
            places.add(os.path.normpath(path))
            with contextlib.suppress(OSError, ValueError):
                places.add(os.path.realpath(path))
    return sorted(places)


def unsafe_bind(raw: str) -> str | None:
    """Why ``raw`` must not be bound into the sandbox, or None. Judged again at every exec: a path may
    have become a symlink since the settings were read."""
    if "\0" in raw or len(raw) > MAX_PATH:
        return f"{raw[:100]!r}... is not a usable path (a NUL byte, or longer than {MAX_PATH})"
    if not raw.startswith("/"):
        return f"{raw!r} is not an absolute path"
    places = forbidden_places()
    bad = _clash(os.path.normpath(raw), places)
    if bad:
        return f"{raw!r} would expose {bad} to the sandbox"
    try:
        # bwrap follows a symlink in the source: judge where it really points too
        real = os.path.realpath(raw, strict=True)
    except (OSError, RuntimeError) as exc:  # missing, a symlink loop, or unreadable
        return f"{raw!r} cannot be bound: {getattr(exc, 'strerror', None) or exc}"
    bad = _clash(real, places)
    return f"{raw!r} leads to {real!r}, which would expose {bad} to the sandbox" if bad else None


def _clash(path: str, places: list[str]) -> str | None:
    """The forbidden place that ``path`` is, lies below, or contains."""
    for bad in places:
        if path == bad or (bad != "/" and path.startswith(bad + "/")) or bad.startswith(path.rstrip("/") + "/"):
            return bad
    return None


SESSION_PREFIX = "execbox-bwrap-"
CGROUP_PREFIX = "execbox-"
# cgroup controllers execbox uses; each enforces the limit of the same name.
_CONTROLLERS = ("memory", "pids", "cpu")


class BubblewrapSettings(BackendSettings):
    path: str = setting("CODE_EXEC_BWRAP_PATH", "bwrap", "The bwrap binary: a name on PATH or an absolute path; "
                        "root-owned and writable by nobody else when execbox runs as root", max_length=MAX_PATH)
    user: str = setting("CODE_EXEC_BWRAP_USER", "65534:65534",
                     "Host uid:gid the sandbox runs as when execbox runs as root (never 0)")
    tmpfs_mb: int = setting("CODE_EXEC_BWRAP_TMPFS_MB", 512, "Size of the /tmp tmpfs (counts against memory), MiB",
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

    @field_validator("user")
    @classmethod
    def _uid_gid(cls, value: str) -> str:
        uid, sep, gid = value.partition(":")
        if not (_DIGITS.fullmatch(uid) and (not sep or _DIGITS.fullmatch(gid))):
            raise ValueError("give uid:gid as numbers, e.g. 65534:65534")
        ids = (int(uid), int(gid or uid))
        if 0 in ids:
            raise ValueError("the sandbox must not run as root (uid or gid 0)")
        if max(ids) >= MAX_ID:  # (uid_t)-1 means "unchanged" to setresuid; above it does not fit
            raise ValueError(f"uid and gid must be below {MAX_ID}")
        return f"{ids[0]}:{ids[1]}"

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


# --- cgroups --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupPlan:
    """Where per-exec cgroups go on this host: controller -> parent directory (v1: one per controller)."""

    version: int
    parents: dict[str, str]

    @property
    def limits(self) -> frozenset[str]:
        return frozenset(self.parents)


@dataclass
class RunCgroup:
    plan: CgroupPlan
    dirs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, plan: CgroupPlan, limits: Limits) -> RunCgroup:
        run = cls(plan)
        name = f"{CGROUP_PREFIX}{owner_tag()}-{uuid.uuid4().hex[:10]}"
        try:
            for controller, parent in plan.parents.items():
                path = os.path.join(parent, name)
                if path not in run.dirs.values():
                    os.mkdir(path, 0o755)
                run.dirs[controller] = path
            run._apply(limits)
        except OSError:
            run.remove()
            raise
        return run

    def _apply(self, limits: Limits) -> None:
        v1 = self.plan.version == 1
        if limits.memory_mb and "memory" in self.dirs:
            limit = str(limits.memory_mb * 1024 * 1024)
            base = self.dirs["memory"]
            if v1:
                _write(base, "memory.limit_in_bytes", limit)
                if os.path.exists(os.path.join(base, "memory.memsw.limit_in_bytes")):
                    _write(base, "memory.memsw.limit_in_bytes", limit)  # no swap headroom
            else:
                _write(base, "memory.max", limit)
                if os.path.exists(os.path.join(base, "memory.swap.max")):
                    _write(base, "memory.swap.max", "0")
        if limits.pids and "pids" in self.dirs:
            _write(self.dirs["pids"], "pids.max", str(limits.pids))
        if limits.cpus and "cpu" in self.dirs:
            period = 100_000
            quota = max(1000, int(limits.cpus * period))
            if v1:
                _write(self.dirs["cpu"], "cpu.cfs_period_us", str(period))
                _write(self.dirs["cpu"], "cpu.cfs_quota_us", str(quota))
            else:
                _write(self.dirs["cpu"], "cpu.max", f"{quota} {period}")

    def procs_files(self) -> list[str]:
        """The files through which the launcher joins the run's cgroups, and whose lists its watcher kills.

        v1: ``tasks``, written with 0 (the writing thread: the launcher's shell has no other). Moving a whole
        process through ``cgroup.procs`` takes the kernel's global threadgroup lock for writing, which waits for
        an RCU grace period: 5-15 ms of every exec on this kind of host. v2: ``cgroup.procs``."""
        name = "tasks" if self.plan.version == 1 else "cgroup.procs"
        return sorted({os.path.join(d, name) for d in self.dirs.values()})

    def oom_killed(self) -> bool:
        base = self.dirs.get("memory")
        if not base:
            return False
        name = "memory.oom_control" if self.plan.version == 1 else "memory.events"
        try:
            with open(os.path.join(base, name)) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        except OSError:
            pass
        return False

    def remove(self) -> None:
        """Kill whatever is still in the cgroups, then remove them (a leftover is swept by gc)."""
        for path in sorted(set(self.dirs.values())):
            _remove_cgroup(path)
        self.dirs.clear()


def _write(base: str, name: str, value: str) -> None:
    with open(os.path.join(base, name), "w") as fh:
        fh.write(value)


def _remove_cgroup(path: str) -> bool:
    for attempt in range(50):
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                return False
        if os.path.exists(os.path.join(path, "cgroup.kill")):
            with contextlib.suppress(OSError):
                _write(path, "cgroup.kill", "1")
        else:
            with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as fh:
                for pid in fh.read().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.01 * (attempt + 1))
    return False


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root within the hierarchy, fstype, super options) of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                found.append((fields[4], fields[3], rfields[0], set(rfields[2].split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for the v2 hierarchy) -> this process's cgroup path."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def _under(mount: str, root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` as seen through a mount of the hierarchy at ``root``."""
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    rel = path[len(root):] if root != "/" else path
    return os.path.join(mount, rel.lstrip("/"))


def plan_cgroups(settings: BubblewrapSettings) -> tuple[CgroupPlan | None, str]:
    """Where this host lets execbox create a cgroup per exec, proved by creating one; or why not."""
    if settings.cgroups == "off":
        return None, "CODE_EXEC_BWRAP_CGROUPS=off"
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError as exc:
        return None, f"cannot read this process's cgroups: {exc}"
    parents: dict[str, str] = {}
    version = 0
    for mount, root, fstype, opts in mounts:  # v1 first: a controller bound to v1 is not on v2
        if fstype != "cgroup":
            continue
        for controller in _CONTROLLERS:
            if controller in opts and controller not in parents and controller in own:
                path = settings.cgroup_parent or own[controller]
                where = _under(mount, root, path)
                if where and settings.cgroup_parent:
                    with contextlib.suppress(OSError):
                        os.makedirs(where, exist_ok=True)
                if where and os.path.isdir(where):
                    parents[controller], version = where, 1
    if not parents:
        for mount, root, fstype, _ in mounts:
            if fstype != "cgroup2" or "" not in own:
                continue
            where = _under(mount, root, settings.cgroup_parent or own[""])
            if where and settings.cgroup_parent:
                with contextlib.suppress(OSError):
                    os.makedirs(where, exist_ok=True)
            if not where or not os.path.isdir(where):
                continue
            try:
                with open(os.path.join(where, "cgroup.controllers")) as fh:
                    available = set(fh.read().split())
                wanted = [c for c in _CONTROLLERS if c in available]
                with open(os.path.join(where, "cgroup.subtree_control")) as fh:
                    enabled = set(fh.read().split())
                missing = [c for c in wanted if c not in enabled]
                if missing:
                    # Fails (EBUSY) when the parent holds processes itself: the v2 no-internal-process rule.
                    _write(where, "cgroup.subtree_control", " ".join("+" + c for c in missing))
            except OSError as exc:
                return None, (f"cgroup v2 at {where} does not let execbox create limited child cgroups "
                              f"({exc.strerror}); give execbox a delegated cgroup without processes of its own via "
                              "CODE_EXEC_BWRAP_CGROUP_PARENT")
            parents = {c: where for c in wanted}
            version = 2
            break
    if not parents:
        return None, "no memory, pids or cpu cgroup controller is mounted here"
    plan = CgroupPlan(version, parents)
    try:
        RunCgroup.create(plan, Limits(memory_mb=64, pids=16, cpus=0.5)).remove()
    except OSError as exc:
        return None, (f"cannot create a cgroup under {min(parents.values())} ({exc.strerror}); run execbox "
                      "as root, or point CODE_EXEC_BWRAP_CGROUP_PARENT at a cgroup delegated to this user")
    return plan, ""


def cgroup_sweep_dirs(settings: BubblewrapSettings) -> list[str]:
    """Every directory where this host's per-exec cgroups can be: below this process's own cgroup and below
    CODE_EXEC_BWRAP_CGROUP_PARENT, in each v1 hierarchy of our controllers and in v2. Creates nothing, and
    works with cgroups off (leftovers from an earlier configuration are still found)."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError:
        return []
    found = set()
    for mount, root, fstype, opts in mounts:
        keys = [c for c in _CONTROLLERS if c in opts] if fstype == "cgroup" else [""]
        for key in keys:
            for path in (own.get(key), settings.cgroup_parent):
                where = _under(mount, root, path) if path else None
                if where and os.path.isdir(where):
                    found.add(where)
    return sorted(found)


# --- the host -------------------------------------------------------------------------------------


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


_REPORTS: dict[tuple[Any, ...], HostReport] = {}

_USERNS_FIX = (
    "let unprivileged users create user namespaces: `sysctl -w user.max_user_namespaces=15000`; on Debian <= 10 "
    "`sysctl -w kernel.unprivileged_userns_clone=1`; on Ubuntu >= 23.10 allow bwrap in AppArmor (or `sysctl -w "
    "kernel.apparmor_restrict_unprivileged_userns=0`); in a container, run it with a seccomp/AppArmor profile that "
    "allows unshare. Or use the docker backend"
)


def _unavailable(reason: str, fix: str, env_var: str | None = None) -> BackendUnavailableError:
    return BackendUnavailableError(f"bubblewrap: {reason}", backend=BubblewrapBackend.name, fix=fix, env_var=env_var)


async def _output(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                stdin=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")


async def host_report(settings: BubblewrapSettings, core_limits: Limits) -> HostReport:
    """Decide once per configuration what runs here; raises BackendUnavailableError with the fix."""
    key = (settings.model_dump_json(), os.geteuid())
    if key in _REPORTS:
        return _REPORTS[key]
    if not sys.platform.startswith("linux"):
        raise _unavailable(f"needs Linux namespaces; this is {sys.platform}", "use the docker backend")
    bwrap = shutil.which(settings.path)
    if not bwrap:
        raise _unavailable(f"{settings.path!r} not found", "apt-get install bubblewrap (Fedora: dnf install "
                           "bubblewrap; Arch: pacman -S bubblewrap) or set CODE_EXEC_BWRAP_PATH",
                           "CODE_EXEC_BWRAP_PATH")
    # Exec the file itself: a symlink on the way (PATH entries) may change after this check.
    bwrap = os.path.realpath(bwrap)
    untrusted = _untrusted_binary(bwrap)
    if untrusted:
        raise _unavailable(f"{bwrap} cannot be trusted to be the sandbox: {untrusted}",
                           "point CODE_EXEC_BWRAP_PATH at the distribution's bwrap (e.g. /usr/bin/bwrap)",
                           "CODE_EXEC_BWRAP_PATH")
    if os.stat(bwrap).st_mode & stat.S_ISUID:
        raise _unavailable(f"{bwrap} is setuid root; execbox supports only the unprivileged (user namespace) bwrap",
                           "use a bwrap without the setuid bit (Debian, Ubuntu and Fedora ship it so) via "
                           "CODE_EXEC_BWRAP_PATH", "CODE_EXEC_BWRAP_PATH")
    _, version = await _output(bwrap, "--version")
    if not version.startswith("bubblewrap "):
        raise _unavailable(f"{bwrap} --version says {version.strip()[:100]!r}, not bubblewrap",
                           "point CODE_EXEC_BWRAP_PATH at the distribution's bwrap (e.g. /usr/bin/bwrap)",
                           "CODE_EXEC_BWRAP_PATH")
    _, usage = await _output(bwrap, "--help")
    features = frozenset(f for f in ("--size", "--disable-userns", "--json-status-fd", "--args") if f in usage)
    if not {"--json-status-fd", "--args"} <= features:
        raise _unavailable(f"{version.strip()} is too old (no --args/--json-status-fd)",
                           "install bubblewrap >= 0.5 (Debian 12, Ubuntu 22.04 and newer have it)")
    tools = await _launch_tools()
    try:
        bubblewrap_seccomp.compiled_filter()
    except bubblewrap_seccomp.SeccompUnavailable as exc:
        raise _unavailable(str(exc), "apt-get install libseccomp2 (Fedora: dnf install libseccomp)") from None
    plan, reason = await anyio.to_thread.run_sync(plan_cgroups, settings)
    disk_reason = await anyio.to_thread.run_sync(_disk_reason, settings.host_identity())
    report = HostReport(_capabilities(plan, not disk_reason), bwrap, version.strip(), features,
                        settings.host_identity(), plan, reason, seccomp_policy.DENIED_SYSCALLS, disk_reason, tools)
    # Prove it end to end: a real sandbox, with the cgroup and the seccomp filter, must run.
    result = await _probe(report, settings, core_limits)
    if result.exit_code != 0 and plan is not None:
        # A host that lets us create cgroups but not join them: fall back to rlimits only, and say so.
        failed = f"joining the cgroup failed: {result.stderr.strip()[-300:]}"
        report = HostReport(_capabilities(None, not disk_reason), bwrap, version.strip(), features,
                            settings.host_identity(), None, failed, seccomp_policy.DENIED_SYSCALLS, disk_reason,
                            tools)
        result = await _probe(report, settings, core_limits)
    if result.exit_code != 0 or result.stdout.strip() != str(SANDBOX_UID):
        detail = (result.stderr or result.stdout).strip()[-500:]
        fix = _USERNS_FIX if ("namespace" in detail or "uid map" in detail) else "see the error above"
        raise _unavailable(f"a test sandbox did not start (exit {result.exit_code}): {detail}", fix)
    _REPORTS[key] = report
    return report


async def _launch_tools() -> dict[str, str]:
    """The launcher's tools: sh (whose ulimit must count in POSIX units) and util-linux's setpriv (with
    --pdeathsig, util-linux >= 2.33)."""
    tools = {}
    for name in _LAUNCH_TOOLS:
        found = shutil.which(name, path=_TOOLS_PATH)
        if not found:
            raise _unavailable(f"{name} not found (the launcher needs sh and setpriv)",
                               "apt-get install util-linux (Fedora: dnf install util-linux-core)")
        path = os.path.realpath(found)
        untrusted = _untrusted_binary(path)
        if untrusted:
            raise _unavailable(f"{path} cannot be trusted to start the sandbox: {untrusted}",
                               "reinstall it from the distribution (util-linux, dash or bash)")
        tools[name] = path
    _, usage = await _output(tools["setpriv"], "--help")
    if "--pdeathsig" not in usage:
        raise _unavailable(f"{tools['setpriv']} has no --pdeathsig (util-linux older than 2.33)",
                           "install util-linux >= 2.33 (Debian 10, Ubuntu 20.04, Fedora 29 and newer have it)")
    wrong = await _ulimit_units_wrong(tools["sh"])
    if wrong:
        raise _unavailable(f"{tools['sh']} does not count ulimit in POSIX units, which the launcher's limits "
                           f"assume: {wrong}", "make /bin/sh a POSIX shell (dash, bash or busybox sh)")
    return tools


# /proc/self/limits' names for ulimit's letters, and a test value for each (in units).
_ULIMIT_NAMES = {"c": "Max core file size", "f": "Max file size", "t": "Max cpu time", "v": "Max address space"}
_ULIMIT_PROBE = {"c": 3, "f": 5, "t": 7, "v": 1 << 20}


async def _ulimit_units_wrong(sh: str) -> str:
    """What the shell's ulimit does differently from ``_bwrap_launch.ULIMIT_UNITS`` (soft = hard), or ""."""
    sets = " && ".join(f"ulimit -{letter} {value}" for letter, value in _ULIMIT_PROBE.items())
    code, out = await _output(sh, "-c", f'{sets} && while IFS= read -r line; do echo "$line"; done < /proc/self/limits')
    if code != 0:
        return f"ulimit failed ({code}): {out.strip()[-200:]}"
    rows = {line[:26].strip(): line[26:].split() for line in out.splitlines()}
    for letter, value in _ULIMIT_PROBE.items():
        want = str(value * _bwrap_launch.ULIMIT_UNITS[letter])
        got = rows.get(_ULIMIT_NAMES[letter], [])[:2]
        if got != [want, want]:
            return f"ulimit -{letter} {value} gave {got} (soft, hard), not {want}"
    return ""


async def _probe(report: HostReport, settings: BubblewrapSettings, limits: Limits) -> ExecResult:
    """`id -u` in a sandbox built exactly as a real exec would be."""
    request = ExecSpec(argv=["/bin/sh", "-c", "id -u"], timeout=20, max_output_bytes=4096, network="none",
                       limits=limits, workdir=WORKSPACE)
    probe = BubblewrapSession(report, settings, SessionSpec("none", limits, True, 60.0))
    try:
        return await probe.exec(request)
    except SandboxError as exc:
        return ExecResult(exit_code=125, stderr=str(exc))
    finally:
        with anyio.CancelScope(shield=True):  # a cancelled check must not leave the probe's directory
            await probe.close()


def _capabilities(plan: CgroupPlan | None, sized_workspace: bool) -> Capabilities:
    limits = frozenset({"wall_time"}) | (plan.limits if plan else frozenset())
    return BubblewrapBackend.capabilities.model_copy(
        update={"limits": limits | ({"disk"} if sized_workspace else set())})


def _untrusted_binary(path: str) -> str | None:
    """Why the bwrap at ``path`` may not be what it claims, or None. As root, execbox would hand every sandbox
    to whoever can replace the file: it and each directory above it must be root's and writable by nobody
    else (a sticky directory protects root's file). Not as root: root's or the caller's."""
    allowed = {0} if os.geteuid() == 0 else {0, os.geteuid()}
    current = path
    while True:
        try:
            st = os.stat(current)
        except OSError as exc:
            return f"cannot stat {current}: {exc.strerror}"
        if st.st_uid not in allowed:
            return f"{current} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
            return f"{current} is writable by its group or by others"
        if current == "/":
            return None
        current = os.path.dirname(current)


def _disk_reason(owner: tuple[int, int] | None) -> str:
    """Why a session's workspace cannot be size-limited here ("" when it can), proved by mounting a small one."""
    reason = disk.unavailable_reason()
    if reason:
        return reason
    trial = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{owner_tag()}-")  # named so that gc finds it after a crash
    workspace = os.path.join(trial, "workspace")
    try:
        os.mkdir(workspace, 0o700)
        disk.mount_sized(workspace, 8, owner or (os.getuid(), os.getgid()))
        return ""
    except OSError as exc:
        return f"a size-limited workspace could not be mounted here: {exc}"
    finally:
        disk.release_sized(workspace)
        remove_tree(trial)


# --- the sandbox ----------------------------------------------------------------------------------


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    pieces = list(ETC_PIECES)
    with contextlib.suppress(OSError):
        pieces += sorted(n for n in os.listdir("/etc") if n.startswith("python3"))
    for piece in pieces:
        if os.path.lexists(f"/etc/{piece}"):
            args += ["--ro-bind-try", f"/etc/{piece}", f"/etc/{piece}"]
    return args


def _masks(bound: list[str]) -> list[str]:
    """Cover the execbox install directory with an empty tmpfs when a bound path contains it."""
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if any(here == b or here.startswith(b.rstrip("/") + "/") for b in bound):
        return ["--tmpfs", here]
    return []


@dataclass
class _Launched:
    """One exec's sandbox as started: the files bwrap reads, its cgroup and its process (all gone on discard)."""

    args_file: str
    status_file: str
    cgroup: RunCgroup | None = None
    proc: asyncio.subprocess.Process | None = None
    loop: asyncio.AbstractEventLoop | None = None

    async def discard(self) -> None:
        """Stop the process if it still runs (an armed sandbox never used), then remove its files and cgroup."""
        if self.proc is not None and self.proc.returncode is None:
            await stop_process(self.proc)
        for path in (self.args_file, self.status_file):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self.cgroup:
            await anyio.to_thread.run_sync(self.cgroup.remove)


class BubblewrapSession(Session):
    workspace = WORKSPACE
    #: Network mode proxy: the session's egress proxy (its directory is bound in, one socket per exec).
    egress: proxy.EgressProxy | None = None
    host_workspace: str  # the host directory bound at /workspace: file transfer works on it directly

    def __init__(self, report: HostReport, settings: BubblewrapSettings, spec: SessionSpec,
                 core: Settings | None = None) -> None:
        self.report = report
        self.settings = settings
        self.spec = spec
        self.owner = report.host_identity
        self.host_owner = self.owner
        self.root = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{owner_tag()}-")
        self.host_workspace = os.path.join(self.root, "workspace")
        self._closed = False
        self._armed: _Launched | None = None
        self._sized: concurrent.futures.Future[None] | None = None  # the size-limited workspace being made
        try:
            if spec.network == "proxy":
                self.egress = proxy.EgressProxy.for_settings(core or Settings.from_env(), owner=self.owner)
            # root: 0711 so the dropped uid can reach its workspace but list nothing else here
            os.chmod(self.root, 0o711)
            self._write_private(OWNER_FILE, owner_id() + "\n", 0o644)
            os.mkdir(self.host_workspace, 0o700)
            if self.owner:
                os.chown(self.host_workspace, *self.owner)
            if report.sized_workspace and spec.limits.disk_mb:
                self._sized = disk.mount_sized_soon(self.host_workspace, spec.limits.disk_mb,
                                                    self.owner or (os.getuid(), os.getgid()))
                if not spec.oneshot:
                    # A sandbox's workspace (the kit's host_workspace, usable by anyone holding the session) is
                    # ready when it opens. A one-shot's is made while its launcher starts: the runner reaches it
                    # only through the methods, which wait, and bwrap waits at its gate (see _ready).
                    self._sized_done(self._sized.exception())
            self._write_private("passwd", f"root:x:0:0::/:/usr/sbin/nologin\nsandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:"
                                          f"sandbox:{WORKSPACE}:/bin/sh\nnobody:x:65534:65534::/:/usr/sbin/nologin\n",
                                0o644)
            self._write_private("group", f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n", 0o644)
            self._write_private("hosts", "127.0.0.1 localhost\n::1 localhost\n", 0o644)
            self._write_private("filter.bpf", bubblewrap_seccomp.compiled_filter(), 0o600)
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Unmount the size-limited workspace (if any) and remove the whole session directory."""
        if self.egress is not None:
            self.egress.close()
        if self._sized is not None:
            concurrent.futures.wait([self._sized])  # done either way: no part of the mount appears later
        disk.release_sized(self.host_workspace)
        remove_tree(self.root)

    def _write_private(self, name: str, data: str | bytes, mode: int) -> str:
        path = os.path.join(self.root, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.chmod(path, mode)
        return path

    def _bwrap_args(self, request: ExecSpec) -> list[str]:
        features = self.report.features
        args = ["--unshare-all", "--unshare-user"]
        if request.network == "host":
            args.append("--share-net")
        if "--disable-userns" in features:
            args.append("--disable-userns")
        args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL",
                 "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID), "--hostname", "execbox", "--clearenv"]
        env = sandbox_env(request.env, home=WORKSPACE)
        if self.egress is not None:
            env.update(self.egress.env(request.egress))
        for name, value in env.items():
            args += ["--setenv", name, value]
        args += _system_binds()
        for name in ("passwd", "group", "hosts"):
            args += ["--ro-bind", os.path.join(self.root, name), f"/etc/{name}"]
        if request.network == "host":
            args += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        sized = "--size" in features
        args += (["--size", str(SHM_MB << 20)] if sized else []) + ["--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        args += (["--size", str(self.settings.tmpfs_mb << 20)] if sized else []) + ["--tmpfs", "/tmp"]
        args += ["--bind", self.host_workspace, WORKSPACE]
        if self.egress is not None:  # the proxy's sockets: the only way out of the network namespace
            args += ["--ro-bind", self.egress.directory, proxy.MOUNT_POINT]
        for mount in self.spec.mounts:  # the caller's host paths (admitted by the guard), outer targets first
            self._check_mount_target(mount.target)
            args += ["--bind" if mount.writable else "--ro-bind", mount.source, mount.target]
        for extra in self.settings.ro_binds:
            unsafe = unsafe_bind(extra)
            if unsafe:
                raise ConfigError(f"CODE_EXEC_BWRAP_RO_BINDS: {unsafe}. Remove it from the variable",
                                  backend=BubblewrapBackend.name, env_var="CODE_EXEC_BWRAP_RO_BINDS")
            args += ["--ro-bind", extra, extra]
        args += _masks(["/usr", *self.settings.ro_binds])
        args += ["--remount-ro", "/"]
        args += ["--chdir", request.workdir]
        return args

    def _check_mount_target(self, target: str) -> None:
        """A mount below /workspace lands on a directory the code could have replaced (each exec is a new sandbox
        over the same workspace): refuse a link or a file there rather than mount wherever it leads."""
        if not target.startswith(WORKSPACE + "/"):
            return
        path = self.host_workspace
        for part in target[len(WORKSPACE) + 1:].split("/"):
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return  # bwrap makes it
            if not stat.S_ISDIR(st.st_mode):
                raise SandboxError(f"the mount point {target} was replaced by the code (it is no longer a "
                                   "directory); open a new sandbox", backend=BubblewrapBackend.name)

    def _rlimits(self, request: ExecSpec, cgroup: RunCgroup | None) -> dict[str, int]:
        """ulimit's letters (core dumps, file size, CPU seconds, address space) -> bytes or seconds (soft = hard)."""
        rlimits = {"c": 0, "f": FILE_SIZE_LIMIT, "t": math.ceil(request.timeout) + 1}
        limits = request.limits
        if limits.memory_mb and not (cgroup and "memory" in cgroup.dirs):
            # No memory cgroup here: a per-process address-space cap is the best there is (not claimed).
            rlimits["v"] = limits.memory_mb * 1024 * 1024
        return rlimits

    async def exec(self, request: ExecSpec) -> ExecResult:
        if self.egress is None:
            return await self._exec(request, None)
        run = await anyio.to_thread.run_sync(self.egress.start_run, request.egress)
        try:
            result = await self._exec(request, run)
        finally:
            with anyio.CancelScope(shield=True):
                attempts, dropped = await anyio.to_thread.run_sync(self.egress.finish_run, run)
        return proxy.with_egress(result, attempts, dropped)

    async def arm(self) -> None:
        """Start the first exec's sandbox now, waiting in ARMED for its command (as docker arms a session's first
        exec): a warm-pool member's run then costs no bwrap start. Not with network mode proxy, whose command is
        wrapped per run. The armed sandbox has the session's limits; its CPU-time limit, set for the session's
        lifetime, is lowered to the run's by the script."""
        if self.egress is not None or self._armed is not None:
            return
        spec = ExecSpec(argv=["/bin/sh", "-c", ARMED], env={}, workdir=WORKSPACE, timeout=self.spec.lifetime_s,
                        max_output_bytes=1, network=self.spec.network, limits=self.spec.limits)
        self._armed = await self._launch(spec, None)

    async def _exec(self, request: ExecSpec, run: proxy.ProxyRun | None) -> ExecResult:
        if self._closed:
            raise SandboxError("this bubblewrap session is closed", backend=BubblewrapBackend.name)
        armed, self._armed = self._armed, None
        if armed is not None and (request.limits != self.spec.limits or armed.loop is not asyncio.get_running_loop()
                                  or armed.proc is None or armed.proc.returncode is not None):
            await armed.discard()  # for another shape of run, in another event loop, or ended while it waited
            armed = None
        if armed is not None:
            script = armed_script(request.argv, sandbox_env(request.env, home=WORKSPACE), request.workdir,
                                  backend=BubblewrapBackend.name, cpu_s=self._rlimits(request, armed.cgroup)["t"])
            return await self._finish(armed, request, script + (request.stdin or b""))
        return await self._finish(await self._launch(request, run), request, request.stdin)

    async def _launch(self, request: ExecSpec, run: proxy.ProxyRun | None) -> _Launched:
        """``request``'s sandbox started (its cgroup, argument and status files, the watched bwrap); not fed yet."""
        tag = uuid.uuid4().hex[:12]
        launched = _Launched(self._write_private(f"args-{tag}", "\0".join(self._bwrap_args(request)) + "\0", 0o600),
                             os.path.join(self.root, f"status-{tag}"))
        try:
            if self.report.cgroup:
                try:
                    launched.cgroup = await anyio.to_thread.run_sync(RunCgroup.create, self.report.cgroup,
                                                                     request.limits)
                except OSError as exc:
                    raise SandboxError(f"cannot create the run's cgroup: {exc}",
                                       backend=BubblewrapBackend.name) from exc
            cgroup = launched.cgroup
            argv = _bwrap_launch.launch_argv(
                tools=self.report.tools, caller=os.getpid(), bwrap=self.report.bwrap, args_file=launched.args_file,
                seccomp_file=os.path.join(self.root, "filter.bpf"), status_file=launched.status_file,
                rlimits=self._rlimits(request, cgroup), cgroup_procs=cgroup.procs_files() if cgroup else [],
                user=self.owner, command=proxy.EgressProxy.command(run, request.argv) if run else request.argv)
            launched.proc = await start_process(argv, env={"PATH": _TOOLS_PATH}, cwd=self.root)
            launched.loop = asyncio.get_running_loop()
            await self._ready()  # made while the launcher started; only now may bwrap bind the workspace
            assert launched.proc.stdin is not None
            launched.proc.stdin.write(_bwrap_launch.GATE)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await launched.discard()
            raise
        return launched

    async def _finish(self, launched: _Launched, request: ExecSpec, stdin: bytes | None) -> ExecResult:
        try:
            assert launched.proc is not None
            outcome = await finish_process(launched.proc, stdin=stdin, timeout=request.timeout,
                                           max_output_bytes=request.max_output_bytes, on_output=request.on_output,
                                           redactor=request.redactor)
            oom = launched.cgroup.oom_killed() if launched.cgroup else False
            started = await anyio.to_thread.run_sync(_sandbox_started, launched.status_file)
            if not started and not outcome.timed_out:
                raise SandboxError(
                    f"bubblewrap did not start the sandbox (exit {outcome.exit_code}): "
                    f"{outcome.stderr.text().strip()[-500:]}",
                    backend=BubblewrapBackend.name)
            return outcome.to_result(oom_killed=oom)
        finally:
            with anyio.CancelScope(shield=True):
                await launched.discard()

    async def _ready(self) -> None:
        """Wait for the size-limited workspace (made in the background since the session opened); before anything
        touches the workspace, and before bwrap may start (the gate: the launcher's last step reads a line)."""
        if self._sized is not None:
            with contextlib.suppress(Exception):  # said by _sized_done; shielded: a cancelled waiter leaves it be
                await asyncio.shield(asyncio.wrap_future(self._sized))
            self._sized_done(self._sized.exception())

    @staticmethod
    def _sized_done(error: BaseException | None) -> None:
        if error is not None:
            raise SandboxError(f"cannot make the session's size-limited workspace: {error}",
                               backend=BubblewrapBackend.name) from error

    async def list_files(self, path: str, *, recursive: bool, limits: TransferLimits) -> list[FileInfo]:
        await self._ready()
        return await super().list_files(path, recursive=recursive, limits=limits)

    async def download(self, path: str, out: IO[bytes], *, limits: TransferLimits) -> Transfer:
        await self._ready()
        return await super().download(path, out, limits=limits)

    async def upload(self, path: str, archive: IO[bytes], *, limits: TransferLimits) -> Transfer:
        await self._ready()
        return await super().upload(path, archive, limits=limits)

    async def write_file(self, path: str, data: bytes) -> None:
        await self._ready()
        await anyio.to_thread.run_sync(lambda: safe_write(self.host_workspace, path, data, owner=self.owner))

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        await self._ready()
        return await anyio.to_thread.run_sync(lambda: safe_read(self.host_workspace, path, max_bytes=max_bytes))

    async def close(self) -> None:
        self._closed = True
        armed, self._armed = self._armed, None
        if armed is not None:
            await armed.discard()
        await anyio.to_thread.run_sync(self.destroy)


def _unreachable_by(path: str, identity: tuple[int, int] | None, writable: bool) -> str | None:
    """Why the host user ``identity`` (None: this process's user) cannot open ``path`` (x on every directory
    above, r on it, w too when ``writable``), or None. bwrap opens the source as that user."""
    if identity is None:
        return None if os.access(path, os.R_OK | (os.W_OK if writable else 0)) else "it is not readable" + (
            " and writable" if writable else "") + " by you"
    uid, gid = identity

    def allows(st: os.stat_result, bits: int) -> bool:
        shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
        return (st.st_mode >> shift) & bits == bits

    current = "/"
    for part in [p for p in path.split("/") if p]:
        try:
            st = os.stat(current)
        except OSError as exc:
            return f"{current} cannot be read: {exc.strerror}"
        if not allows(st, 1):
            return f"uid {uid} cannot enter {current}"
        current = os.path.join(current, part)
    try:
        st = os.stat(current)
    except OSError as exc:
        return f"{current} cannot be read: {exc.strerror}"
    need = 4 | (2 if writable else 0) | (1 if stat.S_ISDIR(st.st_mode) else 0)
    return None if allows(st, need) else f"uid {uid} cannot {'write' if writable else 'read'} {current}"


def _sandbox_started(status_file: str) -> bool:
    try:
        with open(status_file) as fh:
            return '"child-pid"' in fh.read()
    except OSError:
        return False


class BubblewrapBackend(ExecutionBackend):
    name = "bubblewrap"
    extra = None  # no Python SDK: needs the bwrap binary and libseccomp2 from the OS
    summary = "Linux namespaces with bwrap: no daemon, starts in milliseconds; shares the host kernel"
    capabilities = Capabilities(
        sandbox=True,
        isolation="namespace",
        network_modes=frozenset({"none", "proxy", "host"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "pids", "cpu", "wall_time"}),
        streaming=True,
        mounts=True,  # execbox.Mount as --ro-bind / --bind (a source the dropped uid can reach)
    )

    settings_model = BubblewrapSettings
    sweeps_on_first_use = True

    def __init__(self, settings: Settings, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(settings, options)
        self.report: HostReport | None = None

    @property
    def bwrap_settings(self) -> BubblewrapSettings:
        return cast(BubblewrapSettings, self.options)

    async def probe(self) -> Capabilities:
        core = self.settings
        self.report = await host_report(self.bwrap_settings, Limits(memory_mb=core.memory_mb, cpus=core.cpus,
                                                                    pids=core.pids_limit))
        return self.report.capabilities

    def details(self) -> dict[str, Any]:
        """What ``check`` found on this host (bwrap, identity, cgroups, seccomp), for `execbox doctor`."""
        return self.report.facts() if self.report else {}

    async def open_session(self, spec: SessionSpec) -> BubblewrapSession:
        if self.report is None:
            await self.check()
        report, settings = self.report, self.bwrap_settings
        assert report is not None
        if spec.network == "proxy" and not shutil.which("python3", path="/usr/local/bin:/usr/bin"):
            raise _unavailable("network mode proxy runs a small forwarder with python3 inside the sandbox, and "
                               "there is no python3 under /usr here", "apt-get install python3 (dnf install python3)")
        identity = settings.host_identity()
        for mount in spec.mounts:
            unreachable = _unreachable_by(mount.source, identity, mount.writable)
            if unreachable:
                raise ConfigError(f"cannot mount {mount.source}: {unreachable}. bubblewrap runs the sandbox as "
                                  f"{settings.user} (CODE_EXEC_BWRAP_USER) when execbox runs as root: make the path "
                                  "reachable by that user, or mount another one", backend=self.name,
                                  env_var="CODE_EXEC_BWRAP_USER")
        return await create_cleanly(lambda made: made.append(BubblewrapSession(report, settings, spec, self.settings)),
                                    lambda session: session.destroy())

    async def gc(self) -> list[str]:
        """Session directories, size-limited workspaces and cgroups (v1 and v2) of execbox processes that are
        gone; needs no ``check`` first."""
        settings = self.bwrap_settings
        plan = self.report.cgroup if self.report else None

        def sweep() -> list[str]:
            dirs = set(cgroup_sweep_dirs(settings)) | set(plan.parents.values() if plan else ())
            return _gc(sorted(dirs)) + proxy.sweep_orphans()

        return await anyio.to_thread.run_sync(sweep)


def _gc(cgroup_dirs: list[str]) -> list[str]:
    """Session directories (and their size-limited workspaces) and cgroups left by execbox processes that are
    gone (a crash, a SIGKILL); a cgroup's processes are killed first. orphaned_dirs takes only real directories
    of ours: anyone can plant an execbox-bwrap-* name (a symlink, a directory) in a shared /tmp, and gc may run
    as root; a cgroup holds no owner file, so its name alone says whose it is."""
    removed = []
    with contextlib.suppress(OSError):
        for path in orphaned_dirs(SESSION_PREFIX):
            disk.release_sized(os.path.join(path, "workspace"))  # the mount first: a mount point cannot go
            remove_tree(path)
            removed.append(path)
    for parent in cgroup_dirs:
        with contextlib.suppress(OSError):
            removed += [path for path in orphaned_dirs(CGROUP_PREFIX, parent, owner_file=False)
                        if _remove_cgroup(path)]
    return removed


__all__ = ["BubblewrapBackend", "BubblewrapSession", "BubblewrapSettings"]
