"""The kit catches lies: each sandbox check fails on the backend that breaks its claim (and only there),
naming the claim with what it expected and saw; a backend that runs nothing passes no check."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from execbox import Runner, Settings
from execbox.testing import engine_missing, self_check
from execbox.testing.checks import CHECKS, Kit, Unavailable
from execbox.testing.conformance import BackendConformance
from tests.support.fixtures import FakeDistributions
from tests.testing.lying_backends import DISTRIBUTION

pytestmark = pytest.mark.engine

SANDBOX_CHECKS = [name for name in CHECKS if name.startswith("sandbox_")]

# What each check says when the claim is broken: the claim, then what was expected, then what was seen.
FAILS_WITH = {
    "sandbox_not_host_root": r"^sandbox=True \(not host root\): expected the code to run as a non-root uid of this "
                             r"host; saw Uid \[0, 0, 0, 0\]",
    "sandbox_no_capabilities": r"^sandbox=True \(no capabilities\): expected CapEff, CapPrm and CapBnd all zero; "
                               r"saw \{'CapEff': '0*[1-9a-f]",
    "sandbox_no_new_privileges": r"^sandbox=True \(no-new-privileges\): expected NoNewPrivs: 1 in /proc/self/status; "
                                 r"saw NoNewPrivs: 0",
    "sandbox_no_new_user_namespaces": r"^sandbox=True \(no new user namespaces\): expected unshare\(CLONE_NEWUSER\) "
                                      r"to be refused; saw USERNS created",
    "sandbox_host_files_hidden": r"^sandbox=True \(host files hidden\): expected host canary files unreadable from "
                                 r"inside; saw read from inside: \{'/.*/canary': 'READ execbox-canary-",
    "sandbox_host_processes_hidden": r"^sandbox=True \(host processes hidden\): expected the host's marker process "
                                     r"\(host pid \d+\) not visible inside; saw it at pid\(s\) \['\d+'\]",
    "sandbox_request_env_stays_inside": r"^sandbox=True \(the request's environment stays inside\): expected no "
                                        r"process in this host's mount namespace to load the library named by the "
                                        r"request's LD_PRELOAD; saw \S+ \(pid \d+, uid \d+\)",
}

BREAKS = {
    "liar_host_root": set(SANDBOX_CHECKS),
    "liar_mapped_root": {"sandbox_not_host_root"},
    "liar_caps": {"sandbox_no_capabilities"},
    "liar_nnp": {"sandbox_no_new_privileges"},
    "liar_userns": {"sandbox_no_new_user_namespaces"},
    "liar_host_files": {"sandbox_host_files_hidden"},
    "liar_host_procs": {"sandbox_host_processes_hidden"},
    "liar_env_leak": {"sandbox_request_env_stays_inside"},
}


@pytest.fixture
def liars(only_local_builtin: None, fake_dists: FakeDistributions) -> None:
    """The liars, registered through the plugin hook like any third-party backend."""
    fake_dists.add(DISTRIBUTION, ep_name="liars", value="tests.testing.lying_backends")


@pytest.fixture
def kit_for(liars: None) -> Callable[[str], Kit]:
    def open_kit(name: str) -> Kit:
        try:
            return Kit.open(Runner(Settings.from_env()), name)
        except Unavailable as exc:
            engine_missing(str(exc))

    return open_kit


def test_every_sandbox_check_has_a_liar_and_a_message() -> None:
    assert set(FAILS_WITH) == set(SANDBOX_CHECKS) == set().union(*BREAKS.values())


@pytest.mark.parametrize("check", SANDBOX_CHECKS)
@pytest.mark.parametrize("liar", sorted(BREAKS))
def test_a_sandbox_check_fails_exactly_on_the_liars_that_break_its_claim(kit_for: Callable[[str], Kit], liar: str,
                                                                         check: str) -> None:
    kit = kit_for(liar)
    # Through the pytest method a subclass of the kit runs, so the path a backend author uses is what is proven.
    test = getattr(BackendConformance, f"test_{check}")
    if check in BREAKS[liar]:
        with pytest.raises(AssertionError, match=FAILS_WITH[check]):
            test(BackendConformance(), kit)
    else:
        test(BackendConformance(), kit)  # the liar's other walls hold: the check fails for its own claim only


def test_a_backend_that_runs_nothing_passes_no_check(liars: None) -> None:
    results = {r.name: r for r in self_check("liar_broken")}
    assert set(results) == set(CHECKS)
    # The one check that needs nothing to run: the runner refuses the paths before the backend sees them.
    refused_before_running = {"escaping_paths_refused"}
    passed = sorted(name for name, r in results.items() if r.status != "fail")
    assert passed == sorted(refused_before_running), {name: results[name].message for name in passed}
    for r in results.values():
        assert "expected" in r.message or r.status == "pass", r


def test_limits_claimed_but_not_enforced_fail(liars: None) -> None:
    # Not the cpu check: on a machine busy with other work an unthrottled probe may get under 1.6 CPU-seconds
    # (a busy machine can only make it pass, never fail a real limit).
    results = {r.name: r for r in self_check("liar_unlimited", checks=["memory_limit_holds", "pids_limit_holds",
                                                                         "disk_limit_holds"])}
    assert results["memory_limit_holds"].status == "fail"
    assert results["memory_limit_holds"].message.startswith(
        "the memory limit (128 MiB): expected a 768 MiB allocation to fail or be killed; saw exit 0")
    assert results["pids_limit_holds"].status == "fail"
    assert results["pids_limit_holds"].message.startswith(
        "the pids limit (32): expected fork to fail before 32 processes; saw 500 forks, stopped by never")
    assert results["disk_limit_holds"].status == "fail"
    assert results["disk_limit_holds"].message.startswith(
        "the disk limit (16 MiB): expected writing 64 MiB to fail with ENOSPC (or EDQUOT); saw stopped by never")


def test_a_tmpfs_claimed_but_not_made_fails_its_check(liars: None) -> None:
    (result,) = self_check("liar_no_tmpfs", checks=["tmpfs"])
    if result.status == "skip":
        engine_missing(result.message)
    assert result.status == "fail" and result.message.startswith(
        "a claimed tmpfs path is writable, empty, kept across a sandbox's execs and gone in the next sandbox: expected "
        "/var/tmp empty, the sandbox user's and writable in the first sandbox; saw exit"), result.message


def test_self_check_reports_each_broken_claim_of_host_root(liars: None) -> None:
    results = {r.name: r for r in self_check("liar_host_root", checks=SANDBOX_CHECKS)}
    if results["sandbox_not_host_root"].status == "skip":
        engine_missing(results["sandbox_not_host_root"].message)
    for name in SANDBOX_CHECKS:
        assert results[name].status == "fail", results[name]
        assert results[name].claim.startswith("sandbox=True: ")


KERNEL_CHECKS = [name for name in CHECKS if name.startswith("own_kernel_")]


def test_a_gvisor_claim_on_the_host_kernel_fails_naming_the_claim(liars: None) -> None:
    assert len(KERNEL_CHECKS) == 2
    results = {r.name: r for r in self_check("liar_gvisor", checks=KERNEL_CHECKS)}
    if any(r.status == "skip" for r in results.values()):
        engine_missing("; ".join(r.message for r in results.values()))
    seen = {name: r.message for name, r in results.items()}
    assert {r.status for r in results.values()} == {"fail"}, seen
    assert re.match(r"isolation='gvisor' \(a kernel of its own\): expected a boot id other than this host's "
                    r"\([0-9a-f-]{36}\); saw uname ", seen["own_kernel_not_the_hosts"]), seen
    # No seccomp in the liar: the host kernel grants the keyring (a runc container is refused it, and fails on
    # the host kernel's own files instead: tests/backends/test_docker_gvisor.py).
    assert seen["own_kernel_host_interfaces_unreachable"].startswith(
        "isolation='gvisor' (host kernel interfaces unreachable): expected raw keyctl (the user keyring) refused; "
        "saw GRANTED"), seen
    # The same sandbox claiming what it is (namespaces on this host's kernel) is not asked for a kernel of its own.
    assert {r.status for r in self_check("kit_honest", checks=KERNEL_CHECKS)} == {"skip"}


PROXY_CHECKS = [name for name in CHECKS if name.startswith("proxy_")]


def test_a_lying_proxy_claim_is_caught_by_every_proxy_check(liars: None) -> None:
    assert len(PROXY_CHECKS) == 3
    results = {r.name: r for r in self_check("liar_proxy_open", checks=PROXY_CHECKS)}
    if any(r.status == "skip" for r in results.values()):
        engine_missing("; ".join(r.message for r in results.values()))
    seen = {name: r.message for name, r in results.items()}
    assert seen["proxy_allowed_destination_is_reached"].startswith(
        "network mode 'proxy' (allowed destination): expected HTTP_PROXY set in the sandbox"), seen
    assert seen["proxy_denied_name_is_recorded"].startswith(
        "network mode 'proxy' (denied name): expected both fetches refused; saw {'proxy': '', 'http': 'FETCHED"), seen
    assert seen["proxy_direct_socket_has_no_route"].startswith(
        "network mode 'proxy' (direct socket): expected the probe to report BLOCKED; saw exit 0"), seen
    # Its network-none wall holds: the lie is the proxy claim alone.
    assert {r.status for r in self_check("liar_proxy_open", checks=["network_none_enforced"])} == {"pass"}


def test_self_check_of_an_unavailable_backend_says_why(liars: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no docker CLI
    [result] = self_check("liar_nnp")
    assert (result.name, result.status) == ("available", "skip")
    assert "the docker CLI is not installed" in result.message


def test_self_check_refuses_an_unknown_check_name() -> None:
    with pytest.raises(ValueError, match="unknown check"):
        self_check("local_subprocess", checks=["no_such_check"])
