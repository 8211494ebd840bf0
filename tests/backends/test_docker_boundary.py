"""The docker boundary against settings, engines and callers that would widen it, on the real engine: the egress
network rule, the container as built checked against the contract, execbox's seccomp profile, the disk limit,
and the backstop that ends a killed caller's run without it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from execbox import Limits, NotASandboxError, Runner, Settings, UnsupportedPolicyError
from execbox.backends.docker import hardening as h
from execbox.backends.docker import session as ds
from execbox.errors import ConfigError
from execbox.files import disk
from execbox.kit.ownership import owner_id
from execbox.runner import run_blocking
from tests.backends import test_docker as base

pytestmark = pytest.mark.engine

# The real engine (the image built when missing), and the check that no test leaves a container behind.
engine = base.engine
no_leaks = base.no_leaks
ours = base.ours

REPO = Path(__file__).resolve().parents[2]


def runner_with(monkeypatch: pytest.MonkeyPatch, **env: str) -> Runner:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Runner(Settings.from_env(backend="docker"))


# --- egress: only a network execbox created --------------------------------------------------------------


@pytest.mark.parametrize("network", ["host", "bridge"])
def test_egress_on_a_network_of_the_engine_is_refused(engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                      network: str) -> None:
    """The hole: egress on the host network reached services bound to the host's 127.0.0.1."""
    runner = runner_with(monkeypatch, CODE_EXEC_DOCKER_EGRESS_NETWORK=network)
    with pytest.raises(NotASandboxError, match=f"CODE_EXEC_DOCKER_EGRESS_NETWORK={network}"):
        runner.run(["true"], network="egress")
    # Local mode admits what is not a sandbox, but egress still never uses a network execbox did not create.
    local = runner_with(monkeypatch, CODE_EXEC_LOCAL="true")
    with pytest.raises(ConfigError, match=f"CODE_EXEC_DOCKER_EGRESS_NETWORK={network}") as info:
        local.run(["true"], network="egress")
    assert info.value.env_var == "CODE_EXEC_DOCKER_EGRESS_NETWORK"
    assert runner.run(["true"]).exit_code == 0  # network none does not use it


@pytest.mark.parametrize("labels, options, words", [
    ({}, {"com.docker.network.bridge.enable_icc": "false"}, "no io.execbox label"),
    ({"io.execbox": "1"}, {}, "traffic between its containers is allowed"),
])
def test_egress_on_a_bridge_execbox_did_not_make_is_refused(engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                            labels: dict[str, str], options: dict[str, str],
                                                            words: str) -> None:
    name = f"execbox-test-{uuid.uuid4().hex[:8]}"
    network = engine.networks.create(name, driver="bridge", labels=labels, options=options)
    try:
        runner = runner_with(monkeypatch, CODE_EXEC_DOCKER_EGRESS_NETWORK=name)
        with pytest.raises(ConfigError, match=words) as info:
            runner.run(["true"], network="egress")
        assert info.value.env_var == "CODE_EXEC_DOCKER_EGRESS_NETWORK"
        assert f"CODE_EXEC_DOCKER_EGRESS_NETWORK={name} names an existing network" in str(info.value)
    finally:
        network.remove()


def test_egress_creates_its_own_bridge_and_uses_it(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"execbox-test-{uuid.uuid4().hex[:8]}"
    runner = runner_with(monkeypatch, CODE_EXEC_DOCKER_EGRESS_NETWORK=name)
    try:
        with runner.sandbox("docker", network="egress") as sb:
            (container,) = ours(engine)
            assert container.attrs["HostConfig"]["NetworkMode"] == name
            assert sb.exec(["true"]).exit_code == 0
        attrs = engine.networks.get(name).attrs
        assert (attrs["Driver"], attrs["Labels"], attrs["Options"]) == (
            "bridge", {"io.execbox": "1"}, {"com.docker.network.bridge.enable_icc": "false"})
    finally:
        with contextlib.suppress(Exception):
            engine.networks.get(name).remove()


# --- the container as built ----------------------------------------------------------------------------


def test_the_containers_execbox_builds_match_the_contract(engine: Any) -> None:
    runner = Runner(Settings.from_env(backend="docker"))
    with runner.sandbox("docker") as sb:
        session = sb.aio._session  # type: ignore[union-attr]
        (container,) = ours(engine)
        assert h.built_problems(container.attrs, session.contract(session.plan.keeper)) == []
        # and the checker does look: the same container against another user's contract is refused
        assert h.built_problems(container.attrs, session.contract(session.plan.user)) == [
            f"Config.User={session.plan.keeper!r} (the contract says {session.plan.user!r})"]


@pytest.mark.parametrize("extra, field", [
    ({"cap_add": ["NET_RAW"]}, "HostConfig.CapAdd"),
    ({"security_opt": ["no-new-privileges"]}, "HostConfig.SecurityOpt"),
    ({"pid_mode": "host"}, "HostConfig.PidMode"),
    ({"devices": ["/dev/null:/dev/extra-null:rwm"]}, "HostConfig.Devices"),
    ({"volumes": {"/var/tmp": {"bind": "/data", "mode": "rw"}}}, "HostConfig.Binds"),
    ({"mem_limit": "2048m", "memswap_limit": "2048m"}, "HostConfig.Memory"),
])
def test_a_container_the_engine_built_differently_is_removed_before_it_runs(
        engine: Any, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], field: str) -> None:
    """What the engine builds is checked against the contract, not against what was sent: here the arguments
    are changed after the create-time check, as a daemon default or an authorization plugin could."""
    real = ds.hardened
    monkeypatch.setattr(ds, "hardened", lambda kw, **k: {**real(kw, **k), **extra})
    marker = Path(tempfile.mkdtemp(prefix="execbox-test-")) / "ran"
    try:
        with pytest.raises(NotASandboxError, match="differs from execbox's hardening table") as info:
            Runner(Settings.from_env(backend="docker")).run(["touch", str(marker)])
        assert field in str(info.value)
        assert not marker.exists()
    finally:
        marker.parent.rmdir()


# --- seccomp: the shared deny list ---------------------------------------------------------------------

# (name, x86_64 number, aarch64 number, arguments): arguments that succeed when the call is allowed (or fail with
# another errno than EPERM), so EPERM is the profile's answer.
PROBES = [
    ("io_uring_setup", 425, 425, "1, params"),
    ("userfaultfd", 323, 282, "1"),  # UFFD_USER_MODE_ONLY: allowed to unprivileged code since Linux 5.11
    ("keyctl", 250, 219, "0, -3, 0"),  # KEYCTL_GET_KEYRING_ID of the session keyring
    ("bpf", 321, 280, "0, 0, 0"),
    ("perf_event_open", 298, 241, "0, 0, -1, -1, 0"),
    ("unshare_newuser", 272, 97, "0x10000000"),
    ("clone_newuser", 56, 220, "0x10000000 | 17, 0, 0, 0, 0"),
    ("mount", 165, 40, "b'none', b'/tmp', b'tmpfs', 0, 0"),
    ("socket_vsock", 41, 198, "40, 1, 0"),
]


def seccomp_probe(machine: str) -> str:
    column = {"x86_64": 1, "aarch64": 2}[machine]
    calls = "\n".join(f"call({name!r}, {probe[column]}, {probe[3]})" for probe in PROBES for name in [probe[0]])
    return textwrap.dedent("""
        import ctypes, errno, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        params = ctypes.create_string_buffer(120)
        def call(name, nr, *args):
            rc = libc.syscall(nr, *args)
            print(name, errno.errorcode.get(ctypes.get_errno(), "?") if rc < 0 else "ALLOWED")
    """) + calls + textwrap.dedent("""
        t = threading.Thread(target=lambda: None); t.start(); t.join()
        print("control", subprocess.run(["true"]).returncode)
    """)


def test_seccomp_denies_the_shared_list_inside_docker(engine: Any) -> None:
    machine = os.uname().machine
    if machine not in ("x86_64", "aarch64"):
        pytest.skip(f"no syscall table for {machine} in this test")
    result = Runner(Settings.from_env(backend="docker")).run(["python3", "-c", seccomp_probe(machine)])
    seen = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert seen.pop("control") == "0", result  # threads and processes still work (clone3 -> clone fallback)
    assert seen == {probe[0]: "EPERM" for probe in PROBES}, result


# x86_64 machine code: push rbx; mov eax, NR; mov ebx, ARG; xor ecx, ecx; int 0x80; pop rbx; ret
INT80 = textwrap.dedent("""
    import ctypes, mmap, os, struct, sys
    def int80(nr, arg):
        code = (b"\\x53\\xb8" + struct.pack("<I", nr) + b"\\xbb" + struct.pack("<I", arg)
                + b"\\x31\\xc9\\xcd\\x80\\x5b\\xc3")
        mem = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        mem.write(code)
        return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(mem)))()
    if int80(20, 0) != os.getpid():  # i386 getpid: is there a 32-bit syscall ABI at all?
        print("NO-IA32")
        sys.exit()
    print("io_uring_setup", int80(425, 1))  # i386 io_uring_setup(1, NULL): -EFAULT if allowed, -EPERM if denied
""")


def test_seccomp_holds_through_the_32_bit_syscall_abi(engine: Any) -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("int 0x80 is x86_64's compat ABI")
    result = Runner(Settings.from_env(backend="docker")).run(["python3", "-c", INT80])
    if result.stdout == "NO-IA32\n" or result.exit_code == 139:
        pytest.skip("this kernel has no IA-32 emulation: there is no compat ABI to go around the profile")
    assert result.stdout == "io_uring_setup -1\n", result


# --- disk --------------------------------------------------------------------------------------------------


def require_disk() -> None:
    reason = disk.unavailable_reason()
    if reason:
        pytest.skip(f"the disk limit is not available here ({reason}); the refusal is tested below")


def test_writing_past_the_disk_limit_fails_and_the_host_disk_stays_bounded(engine: Any) -> None:
    require_disk()
    runner = Runner(Settings.from_env(backend="docker"))
    assert "disk" in run_blocking(runner.aio.backend("docker").check).limits
    with runner.sandbox("docker", limits=Limits(disk_mb=32)) as sb:
        host_ws = sb.aio._session.host_workspace  # type: ignore[union-attr]
        result = sb.exec("head -c 64M /dev/zero > big; echo rc=$?; df -m /workspace | tail -1")
        assert "No space left on device" in result.stderr and "rc=1" in result.stdout, result
        assert int(result.stdout.split()[2]) <= 32, result.stdout  # the filesystem's size, in MiB
        written = os.stat(os.path.join(host_ws, "big")).st_size
        assert 16 << 20 < written <= 32 << 20
        image = host_ws + disk.IMAGE_SUFFIX
        assert os.stat(image).st_blocks * 512 <= (32 << 20)  # what the host's disk paid for it
        assert disk.is_mounted(host_ws)
        assert sb.exec("rm big && echo again > small && cat small").stdout == "again\n"  # space comes back
    assert not disk.is_mounted(host_ws) and not os.path.exists(host_ws) and not os.path.exists(image)


def test_one_shot_runs_get_the_disk_limit_too(engine: Any) -> None:
    require_disk()
    result = Runner(Settings.from_env(backend="docker")).run("head -c 64M /dev/zero > big", limits=Limits(disk_mb=16))
    assert result.exit_code != 0 and "No space left on device" in result.stderr, result


def test_without_root_the_disk_limit_is_not_claimed_and_a_demand_is_refused(engine: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox.backends.docker import backend

    monkeypatch.setattr(backend, "sized_workspace_unavailable", lambda: "a size-limited workspace needs root")
    runner = Runner(Settings.from_env(backend="docker"))
    assert "disk" not in run_blocking(runner.aio.backend("docker").check).limits
    with pytest.raises(UnsupportedPolicyError, match="cannot enforce the disk limit") as info:
        runner.run(["true"], limits=Limits(disk_mb=64))
    assert info.value.env_var == "CODE_EXEC_DISK_MB"
    # Not demanded: the run goes ahead, on a plain workspace.
    result = runner.run("grep -c ' /workspace ' /proc/mounts; touch x && echo ok")
    assert result.stdout.splitlines()[-1] == "ok", result


# --- a killed caller ---------------------------------------------------------------------------------------
#
# The caller runs under a hostname of its own (a UTS namespace): its containers' owner label then names another
# host, so no other execbox process on this machine (test runs, CLI calls: each sweeps orphans at start-up)
# removes them while the test watches. Only the engine-side backstop can stop them; the engine's events show
# that nothing killed them from outside. gc, run under the same hostname, then removes every leftover. The
# caller's watchdog (session.watch_owner), which would remove them at once, is stopped first: these tests are
# about what holds without it (test_docker_liveness tests the watchdog).

EXECBOX = str(REPO / ".venv/bin/execbox")


def under_own_hostname(host: str, argv: list[str]) -> list[str]:
    namespaces = ["--uts"] if os.geteuid() == 0 else ["--user", "--map-current-user", "--uts"]
    return ["unshare", *namespaces, "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv]


def start_caller(argv: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    host = f"execbox-caller-{uuid.uuid4().hex[:8]}"
    caller = subprocess.Popen(under_own_hostname(host, argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return caller, host + owner_id(caller.pid).removeprefix(owner_id(caller.pid).split(":")[0])


def stop_watchdog(caller: subprocess.Popen[bytes]) -> None:
    """Kill the watchdog the caller started with its first sandbox (its child running session._WATCHDOG)."""
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            stat_line = Path(f"/proc/{entry}/stat").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if int(stat_line.rsplit(b")", 1)[1].split()[1]) == caller.pid and ds._WATCHDOG.encode() in cmdline:
                os.kill(int(entry), signal.SIGKILL)
                return
    pytest.fail("the caller has no watchdog")


def running(engine: Any, owner: str) -> list[Any]:
    return engine.containers.list(ignore_removed=True, filters={"label": f"{ds.L_OWNER}={owner}", "status": "running"})


def leftovers(engine: Any, pid: int, owner: str) -> list[str]:
    """Everything a dead caller could have left: containers in any state, workspaces, disk images, mounts."""
    found = [c.name for c in engine.containers.list(ignore_removed=True, all=True,
                                                    filters={"label": f"{ds.L_OWNER}={owner}"})]
    found += [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(f"{ds.WORKSPACE_PREFIX}{pid}-")]
    found += [path for path in Path("/proc/self/mounts").read_text().split() if f"{ds.WORKSPACE_PREFIX}{pid}-" in path]
    return found


def await_running(engine: Any, owner: str) -> Any:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        containers = running(engine, owner)
        if containers:
            return containers[0]
        time.sleep(0.1)
    pytest.fail("the caller's container never ran")


def stopped_by_itself(engine: Any, container: Any, since: float, seconds: float) -> list[str]:
    """Wait until ``container`` no longer runs (fails after ``seconds``); the engine's events for it since
    ``since`` (epoch seconds), after its start and without execs: the backstop's die comes without a kill."""
    deadline = time.monotonic() + seconds
    while container.id in {c.id for c in engine.containers.list(ignore_removed=True, filters={"status": "running"})}:
        if time.monotonic() > deadline:
            pytest.fail(f"a container of the killed caller still runs {seconds:.0f} s later")
        time.sleep(0.2)
    events = engine.events(since=int(since), until=int(time.time()) + 1, decode=True,
                           filters={"container": container.id})
    actions = [e["Action"] for e in events if e.get("Type") == "container"]
    actions = actions[actions.index("start") + 1:] if "start" in actions else actions
    return [a for a in actions if not a.startswith(("exec_", "top"))]


def gc_removes_everything(engine: Any, pid: int, owner: str) -> None:
    assert leftovers(engine, pid, owner), "nothing was left for gc to remove"
    host = owner.split(":")[0]
    done = subprocess.run(under_own_hostname(host, [EXECBOX, "gc", "--backend", "docker"]), capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert leftovers(engine, pid, owner) == [], done.stdout


def test_a_killed_cli_run_ends_at_its_deadline_without_the_caller(engine: Any) -> None:
    timeout = 3
    since = time.time() - 1
    caller, owner = start_caller([EXECBOX, "run", "--backend", "docker", "--timeout", str(timeout), "--",
                                  "sleep", "600"])
    container = await_running(engine, owner)
    stop_watchdog(caller)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    killed = time.monotonic()
    assert stopped_by_itself(engine, container, since, timeout + ds.BACKSTOP_GRACE_S + 15)[:1] == ["die"]
    assert time.monotonic() - killed <= timeout + ds.BACKSTOP_GRACE_S + 5
    gc_removes_everything(engine, caller.pid, owner)


SESSION_CALLER = textwrap.dedent("""
    import sys
    from execbox import Limits, Runner, Settings
    limits = Limits(disk_mb=64) if sys.argv[3] == "disk" else None
    with Runner(Settings.from_env(backend="docker")).sandbox("docker", lifetime_s=float(sys.argv[1]),
                                                              limits=limits) as sb:
        sb.exec(["sleep", "600"], timeout=float(sys.argv[2]))
""")


def test_a_killed_session_caller_leaves_nothing_running(engine: Any) -> None:
    lifetime, timeout = 14, 3
    # With a sized workspace where the disk limit is available, so gc must unmount it too.
    sized = "disk" if disk.unavailable_reason() is None else "plain"
    since = time.time() - 1
    caller, owner = start_caller([sys.executable, "-c", SESSION_CALLER, str(lifetime), str(timeout), sized])
    container = await_running(engine, owner)
    deadline = time.monotonic() + 60
    while "sleep 600" not in str(container.top()["Processes"]):
        assert time.monotonic() < deadline, "the session's exec never started"
        time.sleep(0.1)
    stop_watchdog(caller)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    killed = time.monotonic()
    # The exec ends at its own deadline + grace, while the session lives on ...
    while "sleep 600" in str(container.top()["Processes"]):
        assert time.monotonic() - killed < timeout + ds.BACKSTOP_GRACE_S + 5, "the exec outlived its backstop"
        time.sleep(0.2)
    # ... and the session's container stops by itself at the end of its lifetime.
    assert stopped_by_itself(engine, container, since, lifetime + 15)[:1] == ["die"]
    gc_removes_everything(engine, caller.pid, owner)
