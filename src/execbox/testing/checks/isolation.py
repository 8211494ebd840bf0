"""Checks of ``sandbox=True``: the code is not host root, holds no capabilities, cannot gain privileges or
make user namespaces, sees neither the host's files nor its processes, and its request's environment
reaches no host-side process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from execbox.testing.framework import SANDBOX, Family, Kit, Unavailable, expect, reported, shown
from execbox.testing.host import HostView, canary_files, host_processes, status_fields
from execbox.testing.probes import CANARY_PROBE, IDENTITY_PROBE, PRELOAD_SOURCE, PROCESS_PROBE, USERNS_PROBE

family = Family()


def _ints(value: str | None) -> list[int]:
    return [int(v) for v in (value or "").split()]


def _map_ids(ids: list[int], id_map: str) -> list[int | None]:
    """``ids`` translated through a /proc/<pid>/uid_map (or gid_map) into the parent user namespace."""
    rows = [tuple(int(x) for x in line.split()) for line in id_map.splitlines() if len(line.split()) == 3]
    return [next((outer + i - inner for inner, outer, count in rows if inner <= i < inner + count), None)
            for i in ids]


def _identity(kit: Kit, *, watch: bool) -> tuple[dict[str, Any], str | None]:
    """What the probe says about itself from inside, and (``watch``) its /proc status as this host sees it."""
    marker = f"execbox-identity-{uuid.uuid4().hex}"
    view = HostView(marker)
    if watch:
        view.start()
    try:
        result = kit.run(["python3", "-c", IDENTITY_PROBE, marker, "5" if watch else "0"], timeout=60)
    finally:
        view.done.set()
        if watch:
            view.join()
    inside: dict[str, Any] = reported(result, SANDBOX, "identity probe")
    expect("Uid" in status_fields(inside["status"]), SANDBOX, "/proc/self/status readable inside", inside["status"])
    # The host's view of the very process that reported: its pid in the innermost namespace matches.
    host = next((s for s in view.views.values() if _ints(status_fields(s).get("NSpid"))[-1:] == [inside["pid"]]),
                None)
    return inside, host


@family.check(f"{SANDBOX}: the code does not run as host root")
def check_sandbox_not_host_root(kit: Kit) -> str:
    kit.require(sandbox=True, local=True)
    claim = f"{SANDBOX} (not host root)"
    inside, host = _identity(kit, watch=True)
    mine = status_fields(inside["status"])
    if host is not None:
        fields, where = status_fields(host), "as this host sees the sandboxed process"
        uids, gids, groups = _ints(fields["Uid"]), _ints(fields["Gid"]), _ints(fields.get("Groups"))
    elif inside["userns"] == os.readlink("/proc/self/ns/user"):
        where = "inside, in this host's own user namespace"
        uids, gids, groups = _ints(mine["Uid"]), _ints(mine["Gid"]), _ints(mine.get("Groups"))
    else:
        # Not a process this host can see (another kernel, e.g. gVisor): judge by its own id maps.
        where = "inside, mapped into the parent user namespace (the process is not visible from this host)"
        maps = [_map_ids(_ints(mine["Uid"]), inside["uid_map"]), _map_ids(_ints(mine["Gid"]), inside["gid_map"]),
                _map_ids(_ints(mine.get("Groups")), inside["gid_map"])]
        uids, gids, groups = ([i for i in m if i is not None] for m in maps)
    seen = f"Uid {uids}, Gid {gids}, Groups {groups} ({where})"
    expect(0 not in uids, claim, "the code to run as a non-root uid of this host", seen)
    expect(0 not in gids and 0 not in groups, claim, "the code to hold no root group of this host", seen)
    return seen


@family.check(f"{SANDBOX}: the code holds no capabilities")
def check_sandbox_no_capabilities(kit: Kit) -> str:
    kit.require(sandbox=True, local=True)
    claim = f"{SANDBOX} (no capabilities)"
    fields = status_fields(_identity(kit, watch=False)[0]["status"])
    caps = {name: fields.get(name) for name in ("CapEff", "CapPrm", "CapBnd")}
    expect(None not in caps.values(), claim, "CapEff, CapPrm and CapBnd in /proc/self/status", caps)
    expect(all(int(v or "1", 16) == 0 for v in caps.values()), claim, "CapEff, CapPrm and CapBnd all zero", caps)
    return str(caps)


@family.check(f"{SANDBOX}: no-new-privileges is set")
def check_sandbox_no_new_privileges(kit: Kit) -> str:
    kit.require(sandbox=True, local=True)
    claim = f"{SANDBOX} (no-new-privileges)"
    inside = _identity(kit, watch=False)[0]
    nnp = status_fields(inside["status"]).get("NoNewPrivs")
    if nnp is None:  # a kernel that does not show it there (gVisor) still answers prctl
        expect(inside.get("nnp") == 1, claim, "NoNewPrivs: 1 in /proc/self/status, or prctl(PR_GET_NO_NEW_PRIVS) 1",
               f"no NoNewPrivs field, prctl {inside.get('nnp')}")
        return "prctl(PR_GET_NO_NEW_PRIVS) 1 (no NoNewPrivs field in /proc/self/status)"
    expect(nnp == "1", claim, "NoNewPrivs: 1 in /proc/self/status", f"NoNewPrivs: {nnp}")
    return "NoNewPrivs: 1"


@family.check(f"{SANDBOX}: new user namespaces cannot be created")
def check_sandbox_no_new_user_namespaces(kit: Kit) -> str:
    kit.require(sandbox=True, local=True)
    claim = f"{SANDBOX} (no new user namespaces)"
    result = kit.run(["python3", "-c", USERNS_PROBE])
    expect("USERNS" in result.stdout, claim, "the probe to report on unshare(CLONE_NEWUSER)", shown(result))
    expect("USERNS created" not in result.stdout, claim, "unshare(CLONE_NEWUSER) to be refused", result.stdout.strip())
    return result.stdout.strip()


@family.check(f"{SANDBOX}: files on the host are not readable")
def check_sandbox_host_files_hidden(kit: Kit) -> str:
    kit.require(sandbox=True)
    claim = f"{SANDBOX} (host files hidden)"
    control = f"control-{uuid.uuid4().hex}"
    with canary_files() as canaries:
        result = kit.run(["python3", "-c", CANARY_PROBE, "canary-control.txt", *canaries],
                         files={"canary-control.txt": control.encode()})
    seen: dict[str, str] = reported(result, claim, "canary probe")
    # The positive signal: the probe reads a file it was given, so an unreadable canary means hidden.
    expect(seen.get("canary-control.txt") == f"READ {control}", claim, "the probe to read its own workspace file",
           seen)
    read = {path: seen.get(path) for path, content in canaries.items() if content in (seen.get(path) or "")}
    expect(not read, claim, "host canary files unreadable from inside", f"read from inside: {read}")
    return f"canaries not readable: {seen}"


@family.check(f"{SANDBOX}: host processes are not visible")
def check_sandbox_host_processes_hidden(kit: Kit) -> str:
    kit.require(sandbox=True)
    claim = f"{SANDBOX} (host processes hidden)"
    if not os.path.isdir("/proc"):
        raise Unavailable("this host has no /proc: cannot start and find a marker process")
    marker = f"execbox-hostproc-{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while host.pid not in [pid for pid, argv in host_processes() if marker in argv]:
            expect(time.monotonic() < deadline, claim, "the host's marker process to be listed on the host", "nothing")
            time.sleep(0.02)
        result = kit.run(["python3", "-c", PROCESS_PROBE, marker[::-1]])
    finally:
        host.kill()
        host.wait()
    seen: dict[str, Any] = reported(result, claim, "process probe")
    # The positive signal: the probe does list processes (it finds itself), so a missing marker means hidden.
    expect(seen["self_listed"], claim, "the probe to find its own process in /proc", seen)
    expect(not seen["hits"], claim, f"the host's marker process (host pid {host.pid}) not visible inside",
           f"it at pid(s) {seen['hits']} among {seen['listed']} processes")
    return f"{seen['listed']} processes visible inside, none of the host's marker"


def _probe_records(text: str, token: str) -> list[dict[str, str]]:
    records = []
    for line in text.splitlines():
        words = line.split()
        if words[:2] == ["EXECBOX-PROBE", token]:
            records.append(dict(w.partition("=")[::2] for w in words[2:]))
    return records


@family.check(f"{SANDBOX}: nothing from the request's environment reaches a host-side process")
def check_sandbox_request_env_stays_inside(kit: Kit) -> str:
    kit.require(sandbox=True)
    claim = f"{SANDBOX} (the request's environment stays inside)"
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise Unavailable("no C compiler (gcc/cc) on this host to build the LD_PRELOAD probe")
    token = uuid.uuid4().hex
    here = {"mnt": os.readlink("/proc/self/ns/mnt"),
            "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip()}
    with tempfile.TemporaryDirectory(prefix="execbox-preload-") as tmp:
        folder = Path(tmp)
        folder.chmod(0o755)  # a host-side process of another uid can load the library and write the log
        log, source, lib = folder / "host.log", folder / "probe.c", folder / "probe.so"
        log.touch()
        log.chmod(0o666)
        source.write_text(PRELOAD_SOURCE)
        built = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(lib), str(source),
                                f'-DEXECBOX_TOKEN="{token}"', f'-DEXECBOX_HOST_LOG="{log}"'],
                               capture_output=True, text=True, check=False)
        if built.returncode != 0:
            raise Unavailable(f"cannot build the LD_PRELOAD probe with {compiler}: {built.stderr.strip()[-500:]}")
        lib.chmod(0o755)
        # The host's copy by its host path, and the copy the code wrote into its workspace, relative.
        preload = f"{lib} ./execbox-probe.so"
        # The control: a host process that gets this environment does leave a record.
        subprocess.run(["/bin/sh", "-c", ":"], env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": preload}, cwd=tmp,
                       capture_output=True, check=False)
        if not any(r.get("mnt") == here["mnt"] for r in _probe_records(log.read_text(), token)):
            raise Unavailable(f"the LD_PRELOAD probe does not load on this host (nothing in {log})")
        log.write_text("")
        result = kit.run(["/bin/sh", "-c", "echo ran"], env={"LD_PRELOAD": preload},
                         files={"execbox-probe.so": lib.read_bytes()})
        records = _probe_records(log.read_text() + "\n" + result.stderr, token)
    expect(result.stdout.strip().endswith("ran"), claim, "the run to happen ('ran')", shown(result))
    # One line per process (a record can be both in the log and on stderr, and each copy of the library writes).
    host_side = sorted({f"{r.get('comm')} (pid {r.get('pid')}, uid {r.get('uid')})" for r in records
                        if (r.get("mnt"), r.get("boot")) == (here["mnt"], here["boot"])})
    expect(not host_side, claim, "no process in this host's mount namespace to load the library named by the "
           "request's LD_PRELOAD", "; ".join(host_side))
    inside = len({r.get("pid") for r in records if r.get("mnt") != here["mnt"]})
    reached = "LD_PRELOAD" in result.stderr or inside > 0
    return (f"no host-side process loaded it; inside, {inside} process(es) did"
            + ("" if reached else " (the backend did not pass LD_PRELOAD to the code)"))
