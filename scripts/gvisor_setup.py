#!/usr/bin/env python3
"""Register gVisor (runsc) in the local Docker engine with the arguments this host needs, found by probing; as root.

    scripts/gvisor_setup.py                      probe, register runsc, reload the engine, write the record
    scripts/gvisor_setup.py --register NAME ARG...   register runsc under NAME with ARGs (tests' own registrations)
    scripts/gvisor_setup.py --unregister NAME        remove NAME (only a registration that runs runsc)

Probes (each with `runsc do /bin/true`, bounded: a platform that hangs is a platform that does not work):
- platform: kvm when /dev/kvm exists and a sandbox runs on it within 5 s (nested KVM often hangs), else ptrace;
- network: gVisor's own network stack (--network=sandbox) when a sandbox starts with it, else --network=none
  (the Sentry has no network stack at all: loopback only; never --network=host, which would hand the sandbox
  the host kernel's network stack).
The registration also has --host-uds=open: a connect to a Unix socket bound into the sandbox (network mode
proxy's), as runc allows; creating or binding sockets on the host stays refused. And --oci-seccomp: the
container's seccomp profile (execbox's deny list) is applied inside gVisor too (runsc ignores it otherwise).
/etc/docker/daemon.json is merged, never overwritten: only runtimes.<NAME> changes, every other key and runtime
stays. The engine is reloaded with SIGHUP (never restarted) and this waits until `docker info` lists the entry.
What was probed is written to /var/lib/execbox/gvisor.json (execbox.plugin.GVISOR_RECORD; `execbox doctor` shows
it). Idempotent: with the same runsc, kernel and registration a second run probes nothing and writes nothing.
Standard library only: it runs before execbox is installed. Exit status 0 when gVisor is registered and live (or
registered for an engine not running yet), 2 when it cannot be here (not root, no runsc, runsc does not run).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, NoReturn

NAME = "runsc"
DAEMON_JSON = os.environ.get("EXECBOX_DAEMON_JSON", "/etc/docker/daemon.json")
RECORD = "/var/lib/execbox/gvisor.json"  # execbox.kit.gvisor.GVISOR_RECORD
KVM_WAIT_S = 5.0
PROBE_WAIT_S = 20.0
RELOAD_WAIT_S = 15.0


def say(message: str) -> None:
    print(f"gvisor: {message}", flush=True)


def cannot(message: str) -> NoReturn:
    print(f"gvisor: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def probe(runsc: str, *flags: str, wait_s: float) -> str | None:
    """None when `runsc FLAGS do /bin/true` succeeds within wait_s, else why not (its last line of error)."""
    proc = subprocess.Popen([runsc, *flags, "do", "/bin/true"], cwd="/", stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the sandbox and gofer it started are in its session
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process outside the session may hold stderr
            proc.communicate(timeout=5)
        return f"no answer within {wait_s:g} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {proc.returncode}"


def probe_host(runsc: str) -> dict[str, Any]:
    why: dict[str, str] = {}
    platform = "ptrace"
    if os.path.exists("/dev/kvm"):
        kvm = probe(runsc, "--platform=kvm", "--network=none", wait_s=KVM_WAIT_S)
        why["kvm"] = kvm or "ok"
        platform = "ptrace" if kvm else "kvm"
    else:
        why["kvm"] = "no /dev/kvm"
    ptrace = probe(runsc, f"--platform={platform}", "--network=none", wait_s=PROBE_WAIT_S)
    if ptrace:
        cannot(f"runsc does not run here (--platform={platform} --network=none do /bin/true: {ptrace})")
    netstack = probe(runsc, f"--platform={platform}", "--network=sandbox", wait_s=PROBE_WAIT_S)
    why["netstack"] = netstack or "ok"
    network = "none" if netstack else "sandbox"
    summary = f"platform {platform}" + (f" (kvm: {why['kvm']})" if platform != "kvm" else "")
    summary += ("; network sandbox (gVisor's netstack)" if network == "sandbox" else
                f"; network none, loopback only (gVisor's netstack: {netstack})")
    return {"platform": platform, "network": network, "why": why, "summary": summary}


def load_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        cannot(f"{path} is not valid JSON ({exc}); fix it first, nothing was changed")
    if not isinstance(data, dict) or not isinstance(data.get("runtimes", {}), dict):
        cannot(f"{path} is not a JSON object with a runtimes object; fix it first, nothing was changed")
    return data


def write_json(path: str, data: dict[str, Any], mode: int) -> None:
    """Whole or not at all, on disk before it replaces the old; an existing file keeps its mode and owner, and a
    symlink stays one (its target is written)."""
    path = os.path.realpath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    try:
        st = os.stat(path)
        mode, owner = st.st_mode & 0o7777, (st.st_uid, st.st_gid)
    except FileNotFoundError:
        owner = (0, 0)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".execbox-")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(temp, mode)
        os.chown(temp, *owner)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def engine_runtimes() -> dict[str, Any] | None:
    """The runtimes the local engine has now (GET /info on its socket), or None when no engine answers."""
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if not host.startswith("unix://"):
        cannot(f"DOCKER_HOST={host} is not a local engine; unset it to register gVisor in the local one")
    conn = _UnixHTTP(host[len("unix://"):])
    try:
        conn.request("GET", "/info")
        response = conn.getresponse()
        info = json.loads(response.read()) if response.status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    runtimes = info.get("Runtimes") if isinstance(info, dict) else None
    return runtimes if isinstance(runtimes, dict) else None


def dockerd_pid() -> int | None:
    candidates = []
    try:
        with open("/var/run/docker.pid") as fh:
            candidates.append(int(fh.read().strip()))
    except (OSError, ValueError):
        pass
    out = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True).stdout.split()
    candidates += [int(p) for p in out if p.isdigit()]
    for pid in candidates:
        try:
            with open(f"/proc/{pid}/comm") as fh:
                if fh.read().strip() == "dockerd":
                    return pid
        except OSError:
            continue
    return None


def apply(name: str, entry: dict[str, Any] | None) -> None:
    """Make runtimes.<name> of daemon.json ``entry`` (None: absent) and live in the engine (or, when no engine
    runs, what it starts with)."""
    config = load_json(DAEMON_JSON)
    runtimes = config.setdefault("runtimes", {})
    if runtimes.get(name) != entry:
        if name in runtimes:
            say(f"{DAEMON_JSON}: runtimes.{name} was {json.dumps(runtimes[name])}")
        if entry is None:
            runtimes.pop(name, None)
        else:
            runtimes[name] = entry
        if not runtimes:
            del config["runtimes"]
        write_json(DAEMON_JSON, config, 0o644)
        say(f"{DAEMON_JSON}: runtimes.{name} " + ("removed" if entry is None else f"= {json.dumps(entry)}"))
    live = engine_runtimes()
    if live is None:
        say("no docker engine answers: the registration takes effect when dockerd starts")
        return
    if live.get(name) == entry:
        return
    pid = dockerd_pid()
    if pid is None:
        cannot("the docker engine answers but no local dockerd was found to reload; reload it yourself "
               "(kill -HUP <pid of dockerd>), never restart someone's engine for this")
    os.kill(pid, signal.SIGHUP)  # dockerd re-reads daemon.json; running containers are untouched
    deadline = time.monotonic() + RELOAD_WAIT_S
    while time.monotonic() < deadline:
        live = engine_runtimes() or {}
        if live.get(name) == entry:
            say(f"dockerd (pid {pid}) reloaded: runtime {name} " + ("gone" if entry is None else "live"))
            return
        time.sleep(0.1)
    cannot(f"dockerd (pid {pid}) did not list runtime {name} as written within {RELOAD_WAIT_S:g} s of SIGHUP; "
           f"its log says why (a daemon.json it cannot read keeps the old configuration)")


def setup(runsc: str) -> None:
    version = subprocess.run([runsc, "--version"], capture_output=True, text=True).stdout.splitlines()
    facts = {"runtime": NAME, "path": runsc, "version": (version[0].split()[-1] if version else "unknown"),
             "kernel": os.uname().release}
    record = load_json(RECORD)
    if all(record.get(k) == v for k, v in facts.items()) and record.get("platform") and record.get("network"):
        found = {k: record[k] for k in ("platform", "network", "why", "summary")}
    else:
        say(f"probing runsc {facts['version']} on kernel {facts['kernel']}")
        found = probe_host(runsc)
    # --host-uds=open: network mode proxy's socket, bound into the sandbox, may be connected to (as under runc);
    # without it gVisor resets the connection. Creating or binding host sockets stays refused.
    # --oci-seccomp: the container's seccomp profile (execbox's deny list) applies inside the Sentry too; runsc
    # ignores it otherwise, and execbox refuses such a registration.
    found["runtimeArgs"] = [f"--platform={found['platform']}", f"--network={found['network']}", "--host-uds=open",
                            "--oci-seccomp"]
    apply(NAME, {"path": runsc, "runtimeArgs": found["runtimeArgs"]})
    new = {**facts, **found}
    if new != {k: record.get(k) for k in new}:
        write_json(RECORD, {**new, "probed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, 0o644)
        say(f"recorded in {RECORD}: {found['summary']}")
    else:
        say(f"runtime {NAME} registered and live ({found['summary']})")


def main(argv: list[str]) -> None:
    if os.geteuid() != 0:
        cannot("registering gVisor in the Docker engine needs root: sudo scripts/bootstrap.sh")
    runsc = shutil.which("runsc")
    if runsc is None:
        cannot("runsc is not installed: apt-get install runsc (Debian 12 and later), or gVisor's own packages "
               "(https://gvisor.dev/docs/user_guide/install/)")
    runsc = os.path.realpath(runsc)
    if argv[:1] == ["--register"] and len(argv) >= 2:
        apply(argv[1], {"path": runsc, "runtimeArgs": argv[2:]})
    elif argv[:1] == ["--unregister"] and len(argv) == 2:
        current = load_json(DAEMON_JSON).get("runtimes", {}).get(argv[1])
        if current is not None and (not isinstance(current, dict)
                                    or os.path.basename(str(current.get("path"))) != "runsc"):
            cannot(f"runtime {argv[1]} does not run runsc; this script removes only its own kind")
        apply(argv[1], None)
    elif not argv:
        setup(runsc)
    else:
        cannot(f"unknown arguments {argv} (see the top of {sys.argv[0]})")


if __name__ == "__main__":
    if os.geteuid() == 0:  # one set-up at a time: two could each merge daemon.json from one old copy, losing an entry
        os.makedirs(os.path.dirname(RECORD), mode=0o755, exist_ok=True)
        with open(RECORD + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            main(sys.argv[1:])
    else:
        main(sys.argv[1:])  # says what to run as root
