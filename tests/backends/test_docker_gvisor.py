"""The docker backend a second time, with its runtime set to gVisor (runsc, a user-space kernel): the conformance
kit, including the checks only a kernel of its own passes (which a runc container claiming gvisor fails), and what
the backend refuses under gVisor, naming why."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from execbox import Limits, Runner, SandboxError, Settings, UnsupportedPolicyError
from execbox.backends.docker import hardening as h
from execbox.testing import engine_missing, gvisor_runtime
from execbox.testing.checks import CHECKS, Kit
from execbox.testing.conformance import BackendConformance
from execbox.testing.probes import CPU_BURN_PROBE
from tests.backends import test_docker as base

engine = base.engine
no_leaks = base.no_leaks

CPU_CGROUP = Path("/sys/fs/cgroup/cpuacct/docker")


def gvisor_runner(monkeypatch: pytest.MonkeyPatch) -> Runner:
    monkeypatch.setenv("CODE_EXEC_DOCKER_RUNTIME", gvisor_runtime())
    return Runner(Settings.from_env(backend="docker"))


@pytest.mark.engine
class TestDockerGvisorConformance(BackendConformance):
    backend_name = "docker"

    @pytest.fixture
    def runner(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> Runner:
        return gvisor_runner(monkeypatch)

    # Found: runsc returns a short write (64 KiB) on an exec's stdout pipe where Linux blocks until all is written,
    # and the image's PYTHONUNBUFFERED=1 makes Python's sys.stdout.write drop what a short write left (buffered,
    # or under runc, all 2 MB arrive: the same exec by docker-py shows both). A fix is the docker backend's to choose.
    @pytest.mark.xfail(strict=True, reason="runsc's short pipe writes and PYTHONUNBUFFERED=1: Python drops the rest of "
                                           "a 2 MB write")
    def test_output_cap_keeps_head_and_tail(self, kit: Kit) -> None:
        super().test_output_cap_keeps_head_and_tail(kit)  # type: ignore[misc]

    def test_cpu_limit_holds(self, kit: Kit) -> None:
        """The kit's probe reads its CPU time from the Sentry, which counts a busy task's wall time (1.2 to 2.4
        CPU-seconds seen for the same run): measured where the limit is enforced, the container's cgroup, instead.
        Two busy processes for 2 s under a 0.5-CPU limit use about 1 CPU-second there, not the ~4 they would use
        unthrottled on two idle cores."""
        kit.require(limit="cpu")
        with kit.runner.sandbox("docker", network="none", limits=Limits(cpus=0.5)) as sb:
            usage = CPU_CGROUP / sb.aio._session._keeper_id / "cpuacct.usage"  # type: ignore[union-attr]
            if not usage.exists():
                engine_missing(f"no cgroup v1 cpuacct for the container here ({usage})")
            before = int(usage.read_text())
            started = time.monotonic()
            result = sb.exec(["python3", "-c", CPU_BURN_PROBE], timeout=30)
            wall = time.monotonic() - started
            used = (int(usage.read_text()) - before) / 1e9
        assert result.exit_code == 0 and result.stdout.startswith("CPU"), result
        assert 0.2 <= used < 0.5 * wall + 0.6, f"{used:.2f} CPU-seconds on the host in {wall:.2f} s at 0.5 CPU"


# --- what gVisor changes in the docker backend's claims ---------------------------------------------------------


@pytest.mark.engine
def test_a_runc_container_claiming_gvisor_fails_the_kernel_checks(engine: Any) -> None:
    """The kernel checks discriminate: the same hardened container on runc, claimed as gVisor, fails them."""
    runner = Runner(Settings.from_env(backend="docker"))
    kit = Kit.open(runner, "docker")
    assert kit.caps.isolation == "container"
    liar = Kit(runner, "docker", kit.caps.model_copy(update={"isolation": "gvisor"}), kit.verdict)
    with pytest.raises(AssertionError, match=r"^isolation='gvisor' \(a kernel of its own\): expected a boot id other "
                                             r"than this host's"):
        CHECKS["own_kernel_not_the_hosts"].body(liar)
    # execbox's seccomp profile refuses keyctl and bpf to runc too: the host kernel's own files give it away.
    with pytest.raises(AssertionError, match=r"^isolation='gvisor' \(host kernel interfaces unreachable\): expected "
                                             r"none of this host kernel's own files readable inside; saw the same "
                                             r"/sys/kernel/notes"):
        CHECKS["own_kernel_host_interfaces_unreachable"].body(liar)


@pytest.mark.engine
def test_what_gvisor_cannot_enforce_here_is_refused_naming_why(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = gvisor_runner(monkeypatch)
    kit = Kit.open(runner, "docker")
    assert kit.caps.isolation == "gvisor" and "pids" not in kit.caps.limits
    with pytest.raises(UnsupportedPolicyError, match=r"cannot enforce the pids limit here \(pids: under gVisor the "
                                                     r"host's pids cgroup counts the Sentry's threads"):
        runner.run(["true"], backend="docker", network="none", limits=Limits(pids=32))
    name = gvisor_runtime()
    judged = h.judge_runtime(name, runner.aio.backend("docker").engine_facts()["Runtimes"][name])
    for mode, words in (("egress", "--network="), ("proxy", "--host-uds=open")):
        if mode in kit.caps.network_modes:
            continue  # this registration gives runsc what the mode needs: the kit proves it
        with pytest.raises(UnsupportedPolicyError, match=f"cannot enforce network mode '{mode}' here: .*{words}"):
            runner.run(["true"], backend="docker", network=mode)
    assert ("egress" in kit.caps.network_modes) == (judged.network == "sandbox")


@pytest.mark.engine
def test_a_memory_bomb_in_a_session_ends_the_sandbox_and_says_so(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under runc the kernel kills the one process (test_docker.py); under gVisor the container's cgroup holds the
    Sentry too, so the limit usually ends the whole sandbox: an error naming the limit, not a stopped container
    unexplained. Sometimes (seen in CI, under load) the Sentry's own allocation fails first and the code gets a
    MemoryError in a sandbox that lives on: a result that says so, promptly, is right too."""
    runner = gvisor_runner(monkeypatch)
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))\n"
    with runner.sandbox("docker", network="none", limits=Limits(memory_mb=128)) as sb:
        assert sb.exec(["echo", "alive"]).stdout == "alive\n"
        started = time.monotonic()
        try:
            result = sb.run_code(bomb, timeout=120)
        except SandboxError as exc:
            assert re.search(r"killed at its memory limit \(128 MiB\): the whole sandbox", str(exc)), exc
        else:
            assert not result.timed_out and (result.oom_killed or "MemoryError" in result.stderr), result
            assert sb.exec(["echo", "alive"]).stdout == "alive\n"  # the sandbox lived on: the code failed alone
        # Found: the engine keeps the exec's stream open when the Sentry dies; the session asks in silences.
        assert time.monotonic() - started < 60, "the dead container ended the run, not its deadline"


# --- the runtime's arguments, read --------------------------------------------------------------------------------


def _runsc(*args: str) -> h.Runtime:
    return h.judge_runtime("any-name", {"path": "/usr/bin/runsc", "runtimeArgs": [*args, "--oci-seccomp"]})


@pytest.mark.parametrize("args, read", [
    (["--network=none"], ("none", None, "none")),
    (["-network", "none"], ("none", None, "none")),
    (["--host-uds=open", "--platform", "ptrace"], ("sandbox", "ptrace", "open")),
])
def test_the_judge_reads_each_spelling(args: list[str], read: tuple[str, str | None, str]) -> None:
    judged = _runsc(*args)
    assert judged.problem is None and (judged.network, judged.platform, judged.host_uds) == read


def test_gvisor_unenforced_names_the_argument() -> None:
    plain = h.gvisor_unenforced(_runsc())
    assert set(plain) == {"pids", "proxy"} and "--host-uds=none" in plain["proxy"]
    nonet = h.gvisor_unenforced(_runsc("--network=none", "--host-uds=open"))
    assert set(nonet) == {"pids", "egress"} and "--network=none" in nonet["egress"]
    assert _runsc("--host-uds=all").isolation is None  # more than connecting: the runtime itself is refused
