"""A cgroup per exec, where the host lets execbox create one (v1 or v2): where they go (``plan_cgroups``, proved
by creating one), the run's own (``RunCgroup``: its limits, its OOM count, its removal) and where a sweep looks
for what a killed execbox left (``cgroup_sweep_dirs``)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
import uuid
from dataclasses import dataclass, field

from execbox.backends.bubblewrap.settings import BubblewrapSettings
from execbox.plugin import Limits, owner_tag

CGROUP_PREFIX = "execbox-"
# cgroup controllers execbox uses; each enforces the limit of the same name.
_CONTROLLERS = ("memory", "pids", "cpu")


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
            remove_cgroup(path)
        self.dirs.clear()


def _write(base: str, name: str, value: str) -> None:
    with open(os.path.join(base, name), "w") as fh:
        fh.write(value)


def remove_cgroup(path: str) -> bool:
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
