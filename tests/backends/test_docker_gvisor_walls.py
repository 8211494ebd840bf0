"""The walls of the docker backend (test_docker.py, test_docker_boundary.py) a second time, under gVisor: those the
runtime could change, less those the kit's gVisor pass proves already (non-root, host files, the env policy,
the deadline). Left out, with why: egress (refused under a --network=none runsc: test_docker_gvisor.py);
caps, no-new-privileges and the read-only root as test_docker.py reads them (gVisor's /proc and errno differ: the
kit's checks prove them); the fork and memory bombs (the host cgroup holds the Sentry, so either ends the whole
sandbox, not one process); the backstop tests (they watch the container through `docker top`, which runsc does
not serve); a gigabyte of output (past the 30 s timeout through the Sentry's pipes)."""

from __future__ import annotations

import pytest

from execbox.testing import gvisor_runtime
from tests.backends.test_docker import (
    engine,
    no_leaks,
    runner,
    test_cancelled_caller_leaves_no_container,
    test_no_docker_socket_inside,
    test_planted_symlink_to_a_host_secret_is_refused,
    test_raw_sockets_refused,
    test_session_timeout_kills_the_run_but_not_the_session,
    test_setuid_binary_gains_nothing,
    test_writes_outside_workspace_and_tmp_fail,
)
from tests.backends.test_docker_boundary import (
    test_one_shot_runs_get_the_disk_limit_too,
    test_seccomp_denies_the_shared_list_inside_docker,
    test_seccomp_holds_through_the_32_bit_syscall_abi,
    test_the_containers_execbox_builds_match_the_contract,
    test_writing_past_the_disk_limit_fails_and_the_host_disk_stays_bounded,
)

pytestmark = pytest.mark.engine

__all__ = [
    "engine", "no_leaks", "runner", "test_cancelled_caller_leaves_no_container", "test_no_docker_socket_inside",
    "test_one_shot_runs_get_the_disk_limit_too", "test_planted_symlink_to_a_host_secret_is_refused",
    "test_raw_sockets_refused", "test_seccomp_denies_the_shared_list_inside_docker",
    "test_seccomp_holds_through_the_32_bit_syscall_abi", "test_session_timeout_kills_the_run_but_not_the_session",
    "test_setuid_binary_gains_nothing", "test_the_containers_execbox_builds_match_the_contract",
    "test_writes_outside_workspace_and_tmp_fail",
    "test_writing_past_the_disk_limit_fails_and_the_host_disk_stays_bounded",
]


@pytest.fixture(autouse=True)
def _gvisor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here with docker's runtime set to gVisor (before its runner is built)."""
    monkeypatch.setenv("CODE_EXEC_DOCKER_RUNTIME", gvisor_runtime())
