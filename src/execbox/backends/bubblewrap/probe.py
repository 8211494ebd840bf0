"""``check``: decide once per configuration what runs here (``host_report``): a trusted bwrap that is new enough,
the launcher's tools, libseccomp, cgroups, the size-limited workspace; proved end to end by a test sandbox.
What cannot work is a BackendUnavailableError with the fix."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import tempfile
from typing import Any

import anyio

from execbox.backends.bubblewrap.cgroups import CgroupPlan, plan_cgroups
from execbox.backends.bubblewrap.filesystem import WORKSPACE
from execbox.backends.bubblewrap.launcher import LAUNCH_TOOLS, TOOLS_PATH, ULIMIT_UNITS
from execbox.backends.bubblewrap.report import HostReport
from execbox.backends.bubblewrap.session import SANDBOX_UID, SESSION_PREFIX, BubblewrapSession
from execbox.backends.bubblewrap.settings import BubblewrapSettings
from execbox.plugin import (
    DENIED_SYSCALLS,
    BackendUnavailableError,
    Capabilities,
    ExecResult,
    ExecSpec,
    Limits,
    SandboxError,
    SeccompUnavailable,
    SessionSpec,
    compiled_filter,
    mount_sized,
    owner_tag,
    release_sized,
    remove_tree,
    sized_workspace_unavailable,
    untrusted_binary,
)

_REPORTS: dict[tuple[Any, ...], HostReport] = {}

_USERNS_FIX = (
    "let unprivileged users create user namespaces: `sysctl -w user.max_user_namespaces=15000`; on Debian <= 10 "
    "`sysctl -w kernel.unprivileged_userns_clone=1`; on Ubuntu >= 23.10 allow bwrap in AppArmor (or `sysctl -w "
    "kernel.apparmor_restrict_unprivileged_userns=0`); in a container, run it with a seccomp/AppArmor profile that "
    "allows unshare. Or use the docker backend"
)


def unavailable(reason: str, fix: str, env_var: str | None = None) -> BackendUnavailableError:
    return BackendUnavailableError(f"bubblewrap: {reason}", backend="bubblewrap", fix=fix, env_var=env_var)


async def _output(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                stdin=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")


async def host_report(settings: BubblewrapSettings, core_limits: Limits, claims: Capabilities) -> HostReport:
    """Decide once per configuration what runs here, narrowing the backend's ``claims`` to it; raises
    BackendUnavailableError with the fix."""
    key = (settings.model_dump_json(), os.geteuid())
    if key in _REPORTS:
        return _REPORTS[key]
    if not sys.platform.startswith("linux"):
        raise unavailable(f"needs Linux namespaces; this is {sys.platform}", "use the docker backend")
    bwrap = shutil.which(settings.path)
    if not bwrap:
        raise unavailable(f"{settings.path!r} not found", "apt-get install bubblewrap (Fedora: dnf install "
                           "bubblewrap; Arch: pacman -S bubblewrap) or set CODE_EXEC_BWRAP_PATH",
                           "CODE_EXEC_BWRAP_PATH")
    # Exec the file itself: a symlink on the way (PATH entries) may change after this check.
    bwrap = os.path.realpath(bwrap)
    untrusted = untrusted_binary(bwrap)
    if untrusted:
        raise unavailable(f"{bwrap} cannot be trusted to be the sandbox: {untrusted}",
                           "point CODE_EXEC_BWRAP_PATH at the distribution's bwrap (e.g. /usr/bin/bwrap)",
                           "CODE_EXEC_BWRAP_PATH")
    if os.stat(bwrap).st_mode & stat.S_ISUID:
        raise unavailable(f"{bwrap} is setuid root; execbox supports only the unprivileged (user namespace) bwrap",
                           "use a bwrap without the setuid bit (Debian, Ubuntu and Fedora ship it so) via "
                           "CODE_EXEC_BWRAP_PATH", "CODE_EXEC_BWRAP_PATH")
    _, version = await _output(bwrap, "--version")
    if not version.startswith("bubblewrap "):
        raise unavailable(f"{bwrap} --version says {version.strip()[:100]!r}, not bubblewrap",
                           "point CODE_EXEC_BWRAP_PATH at the distribution's bwrap (e.g. /usr/bin/bwrap)",
                           "CODE_EXEC_BWRAP_PATH")
    _, usage = await _output(bwrap, "--help")
    features = frozenset(f for f in ("--size", "--disable-userns", "--json-status-fd", "--args") if f in usage)
    if not {"--json-status-fd", "--args"} <= features:
        raise unavailable(f"{version.strip()} is too old (no --args/--json-status-fd)",
                           "install bubblewrap >= 0.5 (Debian 12, Ubuntu 22.04 and newer have it)")
    tools = await _launch_tools()
    try:
        compiled_filter()
    except SeccompUnavailable as exc:
        raise unavailable(str(exc), "apt-get install libseccomp2 (Fedora: dnf install libseccomp)") from None
    plan, reason = await anyio.to_thread.run_sync(plan_cgroups, settings)
    disk_reason = await anyio.to_thread.run_sync(_disk_reason, settings.host_identity())
    report = HostReport(_capabilities(claims, plan, not disk_reason), bwrap, version.strip(), features,
                        settings.host_identity(), plan, reason, DENIED_SYSCALLS, disk_reason, tools)
    # Prove it end to end: a real sandbox, with the cgroup and the seccomp filter, must run.
    result = await _probe(report, settings, core_limits)
    if result.exit_code != 0 and plan is not None:
        # A host that lets us create cgroups but not join them: fall back to rlimits only, and say so.
        failed = f"joining the cgroup failed: {result.stderr.strip()[-300:]}"
        report = HostReport(_capabilities(claims, None, not disk_reason), bwrap, version.strip(), features,
                            settings.host_identity(), None, failed, DENIED_SYSCALLS, disk_reason,
                            tools)
        result = await _probe(report, settings, core_limits)
    if result.exit_code != 0 or result.stdout.strip() != str(SANDBOX_UID):
        detail = (result.stderr or result.stdout).strip()[-500:]
        fix = _USERNS_FIX if ("namespace" in detail or "uid map" in detail) else "see the error above"
        raise unavailable(f"a test sandbox did not start (exit {result.exit_code}): {detail}", fix)
    _REPORTS[key] = report
    return report


async def _launch_tools() -> dict[str, str]:
    """The launcher's tools: sh (whose ulimit must count in POSIX units) and util-linux's setpriv (with
    --pdeathsig, util-linux >= 2.33)."""
    tools = {}
    for name in LAUNCH_TOOLS:
        found = shutil.which(name, path=TOOLS_PATH)
        if not found:
            raise unavailable(f"{name} not found (the launcher needs sh and setpriv)",
                               "apt-get install util-linux (Fedora: dnf install util-linux-core)")
        path = os.path.realpath(found)
        untrusted = untrusted_binary(path)
        if untrusted:
            raise unavailable(f"{path} cannot be trusted to start the sandbox: {untrusted}",
                               "reinstall it from the distribution (util-linux, dash or bash)")
        tools[name] = path
    _, usage = await _output(tools["setpriv"], "--help")
    if "--pdeathsig" not in usage:
        raise unavailable(f"{tools['setpriv']} has no --pdeathsig (util-linux older than 2.33)",
                           "install util-linux >= 2.33 (Debian 10, Ubuntu 20.04, Fedora 29 and newer have it)")
    wrong = await _ulimit_units_wrong(tools["sh"])
    if wrong:
        raise unavailable(f"{tools['sh']} does not count ulimit in POSIX units, which the launcher's limits "
                           f"assume: {wrong}", "make /bin/sh a POSIX shell (dash, bash or busybox sh)")
    return tools


# /proc/self/limits' names for ulimit's letters, and a test value for each (in units).
_ULIMIT_NAMES = {"c": "Max core file size", "f": "Max file size", "t": "Max cpu time", "v": "Max address space"}
_ULIMIT_PROBE = {"c": 3, "f": 5, "t": 7, "v": 1 << 20}


async def _ulimit_units_wrong(sh: str) -> str:
    """What the shell's ulimit does differently from ``ULIMIT_UNITS`` (soft = hard), or ""."""
    sets = " && ".join(f"ulimit -{letter} {value}" for letter, value in _ULIMIT_PROBE.items())
    code, out = await _output(sh, "-c", f'{sets} && while IFS= read -r line; do echo "$line"; done < /proc/self/limits')
    if code != 0:
        return f"ulimit failed ({code}): {out.strip()[-200:]}"
    rows = {line[:26].strip(): line[26:].split() for line in out.splitlines()}
    for letter, value in _ULIMIT_PROBE.items():
        want = str(value * ULIMIT_UNITS[letter])
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


def _capabilities(claims: Capabilities, plan: CgroupPlan | None, sized_workspace: bool) -> Capabilities:
    """The backend's ``claims`` with the limits enforced here."""
    limits = frozenset({"wall_time"}) | (plan.limits if plan else frozenset())
    return claims.model_copy(
        update={"limits": limits | ({"disk"} if sized_workspace else set())})


def _disk_reason(owner: tuple[int, int] | None) -> str:
    """Why a session's workspace cannot be size-limited here ("" when it can), proved by mounting a small one."""
    reason = sized_workspace_unavailable()
    if reason:
        return reason
    trial = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{owner_tag()}-")  # named so that gc finds it after a crash
    workspace = os.path.join(trial, "workspace")
    try:
        os.mkdir(workspace, 0o700)
        mount_sized(workspace, 8, owner or (os.getuid(), os.getgid()))
        return ""
    except OSError as exc:
        return f"a size-limited workspace could not be mounted here: {exc}"
    finally:
        release_sized(workspace)
        remove_tree(trial)
