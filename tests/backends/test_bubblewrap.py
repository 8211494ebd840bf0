"""The bubblewrap backend against real bwrap: the conformance kit, then one test per wall of the sandbox
(each would fail if that wall were missing), then limits, seccomp, lifecycle and gc."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import execbox
from execbox import Limits, NotASandboxError, Runner, Settings, WorkspacePathError
from execbox.backends.bubblewrap import backend as bwbackend
from execbox.backends.bubblewrap import cgroups
from execbox.backends.bubblewrap import session as bwsession
from execbox.backends.bubblewrap.cgroups import CGROUP_PREFIX, RunCgroup, plan_cgroups
from execbox.backends.bubblewrap.filesystem import ETC_PIECES, FORBIDDEN, masks
from execbox.backends.bubblewrap.session import BubblewrapSession
from execbox.backends.bubblewrap.settings import BubblewrapSettings
from execbox.contract.backend import SessionSpec
from execbox.contract.models import Capabilities, ExecSpec
from execbox.errors import BackendUnavailableError, UnsupportedPolicyError
from execbox.plugin import OWNER_FILE, orphaned_dirs, owner_id, owner_tag
from execbox.runner import run_blocking
from execbox.testing import engine_missing
from execbox.testing.conformance import PROBE_CONNECT, BackendConformance, Listener

pytestmark = pytest.mark.engine
ROOT = os.geteuid() == 0


@pytest.fixture
def runner() -> Runner:
    return Runner(Settings.from_env(backend="bubblewrap"))


@pytest.fixture
def caps(runner: Runner) -> Capabilities:
    try:
        return run_blocking(runner.aio.backend("bubblewrap").check)
    except BackendUnavailableError as exc:
        engine_missing(f"bubblewrap cannot run here: {exc}")


def sh(runner: Runner, command: str, **kw: object) -> tuple[int, str, str]:
    result = runner.run(command, backend="bubblewrap", **kw)
    return result.exit_code, result.stdout, result.stderr


def sandbox_processes(marker: str) -> list[int]:
    """Host pids whose command line carries ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if marker.encode() in fh.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


class TestBubblewrapConformance(BackendConformance):
    backend_name = "bubblewrap"

    @pytest.fixture
    def runner(self) -> Runner:
        return Runner(Settings.from_env(backend="bubblewrap"))


# --- identity ------------------------------------------------------------------------------------


def test_runs_as_non_root_without_capabilities(runner: Runner, caps: Capabilities) -> None:
    code, out, _ = sh(runner, "id -u; id -g; "
                              "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp):' /proc/self/status")
    lines = out.split("\n")
    assert code == 0 and lines[:2] == ["1000", "1000"]
    status = dict(line.split(":\t") for line in lines[2:] if line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[cap], 16) == 0, (cap, status[cap])
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"


def test_host_sees_an_unprivileged_uid(runner: Runner, caps: Capabilities) -> None:
    """bwrap started by root would map the sandbox user onto host root: a root-owned host file in the
    workspace would then be writable from inside. The launcher drops to CODE_EXEC_BWRAP_USER first."""
    with runner.sandbox("bubblewrap") as sb:
        session = sb.aio._session
        assert isinstance(session, BubblewrapSession)
        host_file = Path(session.host_workspace) / "hosts-own.txt"
        host_file.write_text("host\n")
        host_file.chmod(0o644)  # owned by the test's own uid (root in CI)
        result = sb.exec("echo made > mine.txt; echo tampered >> hosts-own.txt")
        owner = os.stat(Path(session.host_workspace) / "mine.txt")
        if ROOT:
            assert result.exit_code != 0, "the sandbox wrote a file owned by host root"
            assert host_file.read_text() == "host\n"
            assert (owner.st_uid, owner.st_gid) == (65534, 65534)
        else:
            assert owner.st_uid == os.getuid() != 0


def test_without_root_a_sandboxs_tmpfs_paths_are_each_execs_own_sized_tmpfs(runner: Runner,
                                                                           caps: Capabilities) -> None:
    """Not root, nothing can mount a sized tmpfs that outlives one bwrap: a sandbox's tmpfs= paths (and /tmp) are
    then bwrap's own sized --tmpfs per exec, never an unbounded directory on the host's disk. (The suite runs as
    root here, so the argv a non-root session builds is what is checked.)"""
    report = runner.aio.backend("bubblewrap").report
    assert report is not None
    report = dataclasses.replace(report, host_identity=None, disk_reason="not under test")
    settings = BubblewrapSettings(tmpfs_mb=64)
    spec = SessionSpec(network="none", limits=Limits(disk_mb=16), oneshot=False, lifetime_s=60,
                       tmpfs=("/var/tmp",))
    session = BubblewrapSession(report, settings, spec)
    try:
        args = session._bwrap_args(ExecSpec(argv=["true"], workdir="/workspace", network="none", timeout=5,
                                                    max_output_bytes=100))
        assert not [name for name in os.listdir(session.root) if name.startswith(bwsession.TMPFS_PREFIX)]
    finally:
        session.destroy()
    tmpfs = {args[i + 1]: args[:i] for i, arg in enumerate(args) if arg == "--tmpfs"}  # path -> what precedes it
    bound = {args[i + 2] for i, arg in enumerate(args) if arg == "--bind"}
    assert {"/tmp", "/var/tmp"} <= tmpfs.keys() and not {"/tmp", "/var/tmp"} & bound
    if "--size" in report.features:  # /tmp its own size, the tmpfs= path at most the disk limit
        assert tmpfs["/tmp"][-2:] == ["--size", str(64 << 20)]
        perms = 2 if "--perms" in report.features else 0  # --perms 0700 between
        assert tmpfs["/var/tmp"][-2 - perms:][:2] == ["--size", str(16 << 20)]


def test_setuid_binaries_gain_nothing(runner: Runner, caps: Capabilities) -> None:
    code, out, _ = sh(runner, "for b in /usr/bin/su /usr/bin/passwd /usr/bin/newgrp /usr/bin/mount; do "
                              "[ -u $b ] && echo SETUID $b; done; grep ' /usr ' /proc/self/mountinfo")
    assert "nosuid" in out.split("\n")[-2]
    if "SETUID /usr/bin/newgrp" in out:
        # newgrp as root would print nothing and switch groups; unprivileged it cannot even set the gid.
        code, out, err = sh(runner, "newgrp root </dev/null; id -u")
        assert out.strip().endswith("1000")


# --- network -------------------------------------------------------------------------------------


def test_network_none_blocks_a_host_listener_and_host_reaches_it(caps: Capabilities) -> None:
    listener = Listener()
    try:
        blocked = Runner(Settings.from_env()).run(["python3", "-c", PROBE_CONNECT, str(listener.port)],
                                                  backend="bubblewrap", network="none")
        assert "BLOCKED" in blocked.stdout and blocked.stdout.split("IFACES")[1].split() in ([], ["lo"])
        assert listener.accepted == 0
        # Positive control: the same probe with the host network (local mode only) does connect.
        with pytest.raises(NotASandboxError):
            Runner(Settings.from_env()).run(["true"], backend="bubblewrap", network="host")
        host = Runner(Settings.from_env(local=True)).run(["python3", "-c", PROBE_CONNECT, str(listener.port)],
                                                         backend="bubblewrap", network="host")
        assert "CONNECTED" in host.stdout, host
    finally:
        listener.close()
    assert listener.accepted == 1


def test_network_egress_is_refused_not_weakened(runner: Runner, caps: Capabilities) -> None:
    with pytest.raises(UnsupportedPolicyError, match="egress"):
        runner.run(["true"], backend="bubblewrap", network="egress")


# --- filesystem ----------------------------------------------------------------------------------


def test_system_is_read_only_and_only_workspace_and_tmp_are_writable(runner: Runner, caps: Capabilities) -> None:
    probe = textwrap.dedent("""
        import os
        for path in ["/x", "/etc/x", "/etc/passwd", "/usr/x", "/usr/bin/python3", "/bin/x", "/lib/x", "/dev/x",
                     "/proc/x", "/var/x", "/home/x", "/root/x", "/run/x", "/opt/x", "/srv/x",
                     "/workspace/ok", "/tmp/ok", "/dev/shm/ok"]:
            try:
                with open(path, "a") as fh:
                    fh.write("x")
                print("WROTE", path)
            except OSError as exc:
                print("DENIED", path, exc.errno)
    """)
    result = runner.run_code(probe, backend="bubblewrap")
    wrote = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("WROTE")}
    assert wrote == {"/workspace/ok", "/tmp/ok", "/dev/shm/ok"}, result.stdout


def test_tmp_is_size_limited(runner: Runner, caps: Capabilities, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_BWRAP_TMPFS_MB", "8")
    small = Runner(Settings.from_env(backend="bubblewrap"))
    code, out, err = sh(small, "head -c 20000000 /dev/zero > /tmp/big; echo rc=$?; stat -c %s /tmp/big")
    assert "rc=1" in out and int(out.split()[-1]) <= 8 << 20 and "No space left" in err


def test_host_files_and_secrets_are_invisible(runner: Runner, caps: Capabilities,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"host-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("EXECBOX_TEST_HOST_SECRET", secret)
    with tempfile.TemporaryDirectory() as outside:
        marker = Path(outside) / "marker.txt"
        marker.write_text(secret)
        execbox_dir = str(Path(execbox.__file__).resolve().parent)
        probe = textwrap.dedent(f"""
            import glob, os
            print("ENV", os.environ.get("EXECBOX_TEST_HOST_SECRET"))
            for path in [{str(marker)!r}, {outside!r}, "/home", "/root", "/run", "/var/run/docker.sock",
                         "/etc/shadow", "/etc/sudoers", "/sys", {execbox_dir + '/runner'!r}, {sys.prefix!r}]:
                print("SEEN" if os.path.exists(path) else "ABSENT", path)
            # nothing of the host's processes or their environment is reachable through /proc
            blobs = []
            for f in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
                try:
                    blobs.append(open(f, "rb").read())
                except OSError:
                    pass
            print("PROCS", len(glob.glob("/proc/[0-9]*")), any({secret.encode()!r} in b for b in blobs))
            print(open("/etc/passwd").read())
        """)
        result = runner.run_code(probe, backend="bubblewrap")
    assert result.exit_code == 0, result.stderr
    assert "ENV None" in result.stdout and secret not in result.stdout.replace(f"{secret.encode()!r}", "")
    assert "SEEN" not in result.stdout, result.stdout
    procs = result.stdout.split("PROCS ")[1].split("\n")[0].split()
    assert int(procs[0]) <= 4 and procs[1] == "False"
    host_users = {line.split(":")[0] for line in Path("/etc/passwd").read_text().splitlines()} - {"root", "nobody"}
    inside_users = {line.split(":")[0] for line in result.stdout.split("\n") if line.count(":") >= 6}
    assert inside_users <= {"root", "sandbox", "nobody"} and not (inside_users & host_users)


def test_planted_symlink_to_a_host_secret_is_refused(runner: Runner, caps: Capabilities) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".secret") as host_secret:
        host_secret.write("do not read")
        host_secret.flush()
        with runner.sandbox("bubblewrap") as sb:
            assert sb.exec(f"ln -s {host_secret.name} out.txt && mkdir d && ln -s / d/up").exit_code == 0
            with pytest.raises(WorkspacePathError):
                sb.read_file("out.txt")
            with pytest.raises(WorkspacePathError):
                sb.read_file(f"d/up{host_secret.name}")
            # write_file must not follow the planted link either
            with pytest.raises(WorkspacePathError):
                sb.write_file("out.txt", b"overwrite")
        assert Path(host_secret.name).read_text() == "do not read"


def test_tls_gets_the_ca_certificates_but_no_private_keys(runner: Runner, caps: Capabilities) -> None:
    """/etc/ssl/private (root:ssl-cert 0710) must not be bound: a non-root caller in ssl-cert keeps that
    group inside an unprivileged bwrap. The CA bundle must be there, or TLS clients fail."""
    for piece in ETC_PIECES:
        for private in ("ssl/private", "pki/tls/private", "pki/tls/misc"):
            assert not private.startswith(piece + "/") and private != piece, f"/etc/{piece} exposes /etc/{private}"
    probe = ("import os, ssl\n"
             "print('PRIVATE' if os.path.lexists('/etc/ssl/private') else 'no-private')\n"
             "print(ssl.create_default_context().cert_store_stats()['x509_ca'])")
    host = subprocess.run(["/usr/bin/python3", "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    inside = runner.run_code(probe, backend="bubblewrap")
    assert inside.exit_code == 0, inside
    assert inside.stdout.split() == ["no-private", host[1]], (inside.stdout, host)


# --- seccomp -------------------------------------------------------------------------------------


SYSCALLS = textwrap.dedent("""
    import ctypes, errno, os, threading, subprocess
    libc = ctypes.CDLL(None, use_errno=True)
    def call(name, nr, *args):
        rc = libc.syscall(nr, *args)
        print(name, errno.errorcode.get(ctypes.get_errno(), "?") if rc < 0 else "ALLOWED")
    call("ptrace", 101, 16, 1, 0, 0)
    call("mount", 165, b"none", b"/tmp", b"tmpfs", 0, 0)
    call("umount2", 166, b"/tmp", 0)
    call("keyctl", 250, 0, 0, 0, 0)
    call("add_key", 248, b"user", b"k", b"v", 1, -2)
    call("request_key", 249, b"user", b"k", 0, 0)
    call("unshare_newuser", 272, 0x10000000)
    call("clone_newuser", 56, 0x10000000 | 17, 0, 0, 0, 0)
    call("setns", 308, 0, 0)
    call("bpf", 321, 0, 0, 0)
    call("perf_event_open", 298, 0, 0, -1, -1, 0)
    call("userfaultfd", 323, 0)
    call("io_uring_setup", 425, 1, 0)
    t = threading.Thread(target=lambda: None); t.start(); t.join()
    print("subprocess", subprocess.run(["true"]).returncode, "threads ok")
""")


def test_seccomp_blocks_what_sandboxed_code_has_no_business_with(runner: Runner, caps: Capabilities) -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    result = runner.run_code(SYSCALLS, backend="bubblewrap")
    seen = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert seen.pop("subprocess") == "0 threads ok", result
    assert seen and all(v == "EPERM" for v in seen.values()), seen


def test_filter_denies_the_listed_syscalls() -> None:
    from execbox.kit import seccomp as sc
    from execbox.policy import seccomp as policy

    try:
        program = sc.compiled_filter()
    except sc.SeccompUnavailable as exc:
        engine_missing(str(exc))
    assert len(program) % 8 == 0 and len(program) > 8 * len(policy.DENIED_SYSCALLS) // 2
    for name in ("ptrace", "mount", "keyctl", "add_key", "request_key", "bpf", "perf_event_open"):
        assert name in policy.DENIED_SYSCALLS
    assert {"unshare", "clone"} <= set(policy.DENIED_WITH_NEWUSER)


# --- limits and time -----------------------------------------------------------------------------


def require_limit(runner: Runner, caps: Capabilities, limit: str) -> None:
    """The limit tests need the cgroup limit; a host (or a probe that fell back to rlimits) without it is a
    missing engine: a skip on a laptop, a failure in CI, so a green CI never hides the fork and OOM tests."""
    if limit not in caps.limits:
        report = runner.aio.backend("bubblewrap").report
        engine_missing(f"the {limit} limit is not enforced here: {report.cgroup_reason if report else 'no report'}")


def host_latency() -> float:
    started = time.monotonic()
    subprocess.run(["true"], check=True)
    return time.monotonic() - started


def test_fork_bomb_is_held_and_the_host_stays_responsive(runner: Runner, caps: Capabilities) -> None:
    require_limit(runner, caps, "pids")
    marker = f"bomb-{uuid.uuid4().hex[:8]}"
    worst: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            worst.append(host_latency())
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = runner.run(f"b() {{ b | b & }}; b; sleep 3; : {marker}", backend="bubblewrap",
                            limits=Limits(pids=64), timeout=6)
    finally:
        stop.set()
        watcher.join()
    # held: forks fail inside, and the script itself carries on to its end
    assert "Cannot fork" in result.stderr and not result.timed_out, result
    # "Responsive", not fast: an unheld bomb stalls `true` for good; bench/bench_bubblewrap.py measures the latency.
    assert max(worst) < 15.0, f"the host stalled for {max(worst):.1f}s during the fork bomb"
    time.sleep(0.3)
    assert not sandbox_processes(marker)


def test_memory_bomb_is_reported_as_oom_killed(runner: Runner, caps: Capabilities) -> None:
    require_limit(runner, caps, "memory")
    result = runner.run_code("b = []\nwhile True:\n    b.append(bytearray(16 << 20))", backend="bubblewrap",
                             limits=Limits(memory_mb=96), timeout=20)
    assert result.oom_killed and not result.timed_out, result
    assert result.exit_code == 137


def test_cpu_limit_throttles(runner: Runner, caps: Capabilities) -> None:
    require_limit(runner, caps, "cpu")
    spin = textwrap.dedent("""
        import os, resource, time
        for _ in range(2):
            if os.fork() == 0:
                end = time.monotonic() + 1.5
                while time.monotonic() < end:
                    pass
                os._exit(0)
        os.wait(); os.wait()
        print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime)
    """)
    result = runner.run_code(spin, backend="bubblewrap", limits=Limits(cpus=0.25), timeout=20)
    # Two busy processes for 1.5 s of wall time would use ~3 CPU-seconds unthrottled (on 2 cores).
    assert float(result.stdout) < 1.0, result


def test_requests_for_limits_the_host_cannot_enforce_are_refused(monkeypatch: pytest.MonkeyPatch,
                                                                 caps: Capabilities) -> None:
    monkeypatch.setenv("CODE_EXEC_BWRAP_CGROUPS", "off")
    plain = Runner(Settings.from_env(backend="bubblewrap"))
    backend = plain.aio.backend("bubblewrap")
    assert run_blocking(backend.check).limits - {"disk"} == frozenset({"wall_time"})
    with pytest.raises(UnsupportedPolicyError, match="memory"):
        plain.run(["true"], backend="bubblewrap", limits=Limits(memory_mb=64))
    # Without the cgroup a run still works, with the rlimits (a per-process address-space cap).
    code, out, _ = sh(plain, "ulimit -v; ulimit -c; echo ok")
    assert code == 0 and out.split() == [str(1024 * 1024), "0", "ok"]


def test_one_gigabyte_of_output_is_capped_with_flat_memory(runner: Runner, caps: Capabilities) -> None:
    import psutil  # a dev dependency: missing it is a broken setup, not a reason to skip
    me = psutil.Process()
    before = me.memory_info().rss
    result = runner.run("head -c 1000000000 /dev/zero | tr '\\0' x; echo; echo END", backend="bubblewrap",
                        max_output_bytes=50_000, timeout=60)
    grown = me.memory_info().rss - before
    assert result.exit_code == 0 and result.truncated and result.stdout.endswith("END\n")
    assert grown < 64 << 20, f"the caller grew by {grown >> 20} MiB while capping 1 GB of output"


def test_setsid_grandchild_dies_at_the_deadline_and_nothing_survives(runner: Runner, caps: Capabilities) -> None:
    marker = f"escapee-{uuid.uuid4().hex[:8]}"
    code = textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "1000", "{marker}"])
            os._exit(0)
        time.sleep(1000)
    """)
    started = time.monotonic()
    result = runner.run_code(code, backend="bubblewrap", timeout=1.5)
    assert result.timed_out and time.monotonic() - started < 10
    time.sleep(0.3)
    assert not sandbox_processes(marker)


# --- sessions and lifecycle -----------------------------------------------------------------------


def test_session_persists_files_and_goes_away(runner: Runner, caps: Capabilities) -> None:
    with runner.sandbox("bubblewrap") as sb:
        session = sb.aio._session
        assert isinstance(session, BubblewrapSession)
        root = session.root
        sb.exec("mkdir -p lib && echo 'VALUE = 42' > lib/mod.py && chmod 000 lib")
        assert sb.exec("chmod 755 lib && PYTHONPATH=lib python3 -c 'import mod; print(mod.VALUE)'").stdout == "42\n"
        assert sb.exec("sleep 5", timeout=1).timed_out
        assert sb.exec("cat lib/mod.py").stdout == "VALUE = 42\n", "a timed-out exec must not end the session"
        sb.exec("mkdir -p locked/deep && touch locked/deep/f && chmod 000 locked")
    assert not os.path.exists(root)


def test_cgroups_are_removed_after_each_run(runner: Runner, caps: Capabilities) -> None:
    backend = runner.aio.backend("bubblewrap")
    plan = backend.report.cgroup if backend.report else None
    if plan is None:
        engine_missing(f"no cgroups for execbox on this host: {backend.report.cgroup_reason if backend.report else ''}")
    runner.run(["true"], backend="bubblewrap")
    mine = [name for parent in set(plan.parents.values()) for name in os.listdir(parent)
            if name.startswith(f"execbox-{os.getpid()}-")]
    assert not mine


def test_gc_removes_what_a_dead_process_left_and_nothing_else(caps: Capabilities, runner: Runner) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    tmp = tempfile.gettempdir()
    stale = Path(tmp) / f"execbox-bwrap-{dead.pid}-abc"
    (stale / "workspace").mkdir(parents=True)
    live = Path(tmp) / f"execbox-bwrap-{os.getpid()}-live"
    live.mkdir()
    other = Path(tmp) / "execbox-bwrapper-not-ours"
    other.mkdir()
    try:
        removed = run_blocking(runner.aio.backend("bubblewrap").gc)
        assert str(stale) in removed and not stale.exists()
        assert live.exists() and other.exists()
    finally:
        for path in (stale, live, other):
            shutil.rmtree(path, ignore_errors=True)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def scratch_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in for a shared /tmp (mode 1777) that gc and new sessions use as TMPDIR."""
    scratch = Path(tempfile.mkdtemp(prefix="execbox-test-tmp-"))
    scratch.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield scratch
    shutil.rmtree(scratch, ignore_errors=True)


def test_gc_takes_only_real_directories_of_its_own_user(scratch_tmp: Path) -> None:
    """Any local user can plant execbox-bwrap-<dead pid>-* in /tmp; gc (maybe run as root) must neither follow
    a symlink, nor chmod /tmp, nor remove someone else's directory."""
    pid = dead_pid()
    victim = scratch_tmp / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    victim.chmod(0o755)
    link = scratch_tmp / f"execbox-bwrap-{pid}-link"
    link.symlink_to(victim)
    stale = scratch_tmp / f"execbox-bwrap-{pid}-stale"
    (stale / "workspace" / "deep").mkdir(parents=True)
    (stale / "workspace").chmod(0)
    alien = scratch_tmp / f"execbox-bwrap-{pid}-alien"
    alien.mkdir()
    if ROOT:
        os.chown(alien, 65534, 65534)
    removed = bwbackend._gc([])
    assert removed == [str(stale)] and not stale.exists()
    assert stat_mode(scratch_tmp) == 0o1777, "gc changed the mode of the temp directory"
    assert stat_mode(victim) == 0o755 and (victim / "keep.txt").read_text() == "keep"
    assert link.is_symlink()
    assert alien.exists() == ROOT  # as root it belongs to uid 65534: not gc's to remove


def test_gc_takes_only_cgroups_of_its_own_user_whose_named_owner_is_gone(scratch_tmp: Path) -> None:
    """A cgroup parent is swept like the temp dir (real directories of ours, never through a link), but a cgroup
    holds no owner file: its name alone says whose it is. Plain directories stand in for cgroups here."""
    parent = scratch_tmp / "cgroup-parent"
    parent.mkdir()
    pid = dead_pid()
    stale = parent / f"{CGROUP_PREFIX}{pid}-1-stale"
    stale.mkdir()
    live = parent / f"{CGROUP_PREFIX}{owner_tag()}-live"
    live.mkdir()
    target = scratch_tmp / f"{CGROUP_PREFIX}{pid}-target"
    target.mkdir()
    link = parent / f"{CGROUP_PREFIX}{pid}-link"
    link.symlink_to(target)
    alien = parent / f"{CGROUP_PREFIX}{pid}-alien"
    alien.mkdir()
    if ROOT:
        os.chown(alien, 65534, 65534)
    # A file called "owner" that names a live owner does not keep a cgroup: only its name counts.
    claimed = parent / f"{CGROUP_PREFIX}{pid}-claimed"
    claimed.mkdir()
    (claimed / OWNER_FILE).write_text(owner_id() + "\n")
    assert str(claimed) not in orphaned_dirs(CGROUP_PREFIX, str(parent))
    assert str(claimed) in orphaned_dirs(CGROUP_PREFIX, str(parent), owner_file=False)
    (claimed / OWNER_FILE).unlink()
    removed = bwbackend._gc([str(parent)])
    assert sorted(removed) == sorted([str(stale), str(claimed)]) and not stale.exists() and not claimed.exists()
    assert live.is_dir() and link.is_symlink() and target.is_dir()
    assert alien.exists() == ROOT  # as root it belongs to uid 65534: not gc's to remove


def stat_mode(path: Path) -> int:
    return path.lstat().st_mode & 0o7777


def test_cancelled_open_session_leaves_no_directory(runner: Runner, caps: Capabilities, scratch_tmp: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The session directory is made in a worker thread; a caller cancelled meanwhile (asyncio's task.cancel,
    as asyncio.timeout does: it does not wait for the thread) must not leak it."""
    import asyncio

    from execbox.contract.backend import SessionSpec

    backend = runner.aio.backend("bubblewrap")
    started, release = threading.Event(), threading.Event()
    real = bwsession.compiled_filter

    def slow() -> bytes:  # holds the thread once the directory exists
        started.set()
        release.wait(30)
        return real()

    monkeypatch.setattr(bwsession, "compiled_filter", slow)

    async def scenario() -> None:
        task = asyncio.ensure_future(backend.open_session(SessionSpec("none", Limits(), False, 60.0)))
        await asyncio.to_thread(started.wait, 30)
        assert [p.name for p in scratch_tmp.iterdir() if p.name.startswith("execbox-bwrap-")]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

    asyncio.run(scenario())
    deadline = time.monotonic() + 30  # the worker thread finishes on its own, after the caller has gone
    while list(scratch_tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(scratch_tmp.iterdir())


# --- availability and settings --------------------------------------------------------------------


def test_missing_bwrap_is_unavailable_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_BWRAP_PATH", "/nonexistent/bwrap")
    backend = Runner(Settings.from_env()).aio.backend("bubblewrap")
    with pytest.raises(BackendUnavailableError, match="apt-get install bubblewrap") as info:
        run_blocking(backend.check)
    assert info.value.retryable is False and "retry" in info.value.message


@pytest.mark.parametrize("value", ["0:0", "1000:0", "root", "-1:5"])
def test_root_or_garbage_host_user_is_a_config_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from execbox.errors import ConfigError

    monkeypatch.setenv("CODE_EXEC_BWRAP_USER", value)
    with pytest.raises(ConfigError, match="CODE_EXEC_BWRAP_USER"):
        BubblewrapSettings.from_env()


@pytest.mark.parametrize("path", ["/", "/home/me", "/root", "/run/docker.sock", "/var", "/etc", "relative"])
def test_extra_binds_cannot_expose_host_secrets(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    from execbox.errors import ConfigError

    monkeypatch.setenv("CODE_EXEC_BWRAP_RO_BINDS", path)
    with pytest.raises(ConfigError, match="CODE_EXEC_BWRAP_RO_BINDS"):
        BubblewrapSettings.from_env()


def test_extra_read_only_bind_is_visible_and_read_only(monkeypatch: pytest.MonkeyPatch, caps: Capabilities) -> None:
    if not os.access("/opt", os.W_OK):
        pytest.skip("needs a writable /opt to make a directory outside the forbidden places")
    with tempfile.TemporaryDirectory(dir="/opt") as extra:
        os.chmod(extra, 0o755)
        Path(extra, "tool.txt").write_text("tool\n")
        os.chmod(Path(extra, "tool.txt"), 0o644)
        monkeypatch.setenv("CODE_EXEC_BWRAP_RO_BINDS", extra)
        code, out, _ = sh(Runner(Settings.from_env()), f"cat {extra}/tool.txt; touch {extra}/new; echo rc=$?")
        assert out.startswith("tool\n") and "rc=1" in out


class TestBubblewrapConformanceWithoutCgroups(BackendConformance):
    """The same kit on a host where execbox may not create cgroups: rlimits and the deadline only."""

    backend_name = "bubblewrap"

    @pytest.fixture
    def runner(self, monkeypatch: pytest.MonkeyPatch) -> Runner:
        monkeypatch.setenv("CODE_EXEC_BWRAP_CGROUPS", "off")
        return Runner(Settings.from_env(backend="bubblewrap"))


def test_cgroup_v2_plan_and_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The v2 path on a stand-in tree (this host may be v1): controllers enabled on the parent, then
    memory.max / swap 0 / pids.max / cpu.max written in a child per run."""
    parent = tmp_path / "execbox.slice"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (parent / "cgroup.subtree_control").write_text("\n")
    monkeypatch.setattr(cgroups, "_mounts", lambda: [(str(tmp_path), "/", "cgroup2", {"rw"})])
    monkeypatch.setattr(cgroups, "_own_cgroups", lambda: {"": "/execbox.slice"})
    plan, reason = plan_cgroups(BubblewrapSettings.from_env())
    assert plan is not None, reason
    assert (plan.version, plan.limits) == (2, frozenset({"memory", "pids", "cpu"}))
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    run = RunCgroup.create(plan, Limits(memory_mb=100, pids=7, cpus=1.5))
    child = Path(run.dirs["memory"])
    assert child.parent == parent and child.name.startswith(f"execbox-{os.getpid()}-")
    assert (child / "memory.max").read_text() == str(100 << 20)
    assert (child / "pids.max").read_text() == "7"
    assert (child / "cpu.max").read_text() == "150000 100000"
    assert run.procs_files() == [str(child / "cgroup.procs")]
    (child / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert run.oom_killed()


def test_cgroup_v2_busy_parent_is_reported_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    (tmp_path / "cgroup.subtree_control").mkdir()  # writing it fails, as EBUSY would on a real parent
    monkeypatch.setattr(cgroups, "_mounts", lambda: [(str(tmp_path), "/", "cgroup2", {"rw"})])
    monkeypatch.setattr(cgroups, "_own_cgroups", lambda: {"": "/"})
    plan, reason = plan_cgroups(BubblewrapSettings.from_env())
    assert plan is None and "CODE_EXEC_BWRAP_CGROUP_PARENT" in reason


def test_execbox_install_directory_is_masked_when_a_bind_contains_it(monkeypatch: pytest.MonkeyPatch,
                                                                     caps: Capabilities) -> None:
    """execbox installed under /usr (pip as root) would be visible through the /usr bind: it is covered."""
    package = Path(execbox.__file__).resolve().parent
    if any(str(package).startswith(bad + "/") for bad in FORBIDDEN if bad != "/"):
        pytest.skip(f"execbox is installed under a forbidden path ({package}); /usr masking is covered by masks")
    monkeypatch.setenv("CODE_EXEC_BWRAP_RO_BINDS", str(package.parent))
    code, out, _ = sh(Runner(Settings.from_env()), f"ls -A {package.parent}; echo ---; ls -A {package}")
    before, after = out.split("---\n")
    assert "execbox" in before.split() and after.strip() == "", out
    assert masks(["/usr"]) == ([] if not str(package).startswith("/usr/") else ["--tmpfs", str(package)])
