"""The snapshot checks catch lies: a backend claiming ``snapshot`` that keeps nothing outside the workspace, one whose
restore drops /tmp, one whose sandboxes share /tmp, one claiming ``memory_snapshot`` with files only, and one that
never removes a snapshot each fail the checks of what they break, naming the claim; the honest one passes them."""

from __future__ import annotations

import pytest

from execbox.testing import engine_missing, self_check
from execbox.testing.checks import CHECKS, CheckResult
from execbox.testing.conformance import BackendConformance
from tests.support.fixtures import FakeDistributions, fake_dists, only_local_builtin  # noqa: F401  (fixtures)
from tests.testing.lying_backends import DISTRIBUTION

pytestmark = pytest.mark.engine

SNAPSHOT_CHECKS = [name for name in CHECKS if name.startswith("snapshot_")]

# The claim each check names, then what it expected, when a liar breaks it.
FAILS_WITH = {
    "snapshot_forks_isolated": "snapshot=True (forks isolated): expected ",
    "snapshot_rollback_undoes_files": "snapshot=True (rollback undoes files): expected the files as they were at the "
                                      "snapshot",
    "snapshot_rollback_undoes_a_package": "snapshot=True (rollback undoes a package): expected the import to fail "
                                          "after the rollback",
    "snapshot_memory_kept": "memory_snapshot=True (a variable survives): expected kit_value 41 again after the "
                            "rollback",
    "snapshot_files_only_says_state_lost": "snapshot=True (state_lost after a files-only rollback): expected the "
                                           "first cell to read the snapshot's files",
    "snapshot_nothing_left_behind": "snapshot=True (nothing left behind): expected ",
    "snapshot_damaged_refused": "snapshot=True (a damaged snapshot refused): expected a sandbox started from the "
                                "intact snapshot to read its files",
}

OUTSIDE_LOST = {"snapshot_forks_isolated", "snapshot_rollback_undoes_files", "snapshot_files_only_says_state_lost",
                "snapshot_damaged_refused"}
BREAKS = {
    "liar_snapshot_keeps_nothing": OUTSIDE_LOST,
    "liar_snapshot_drops_tmp": OUTSIDE_LOST,
    "liar_snapshot_shared_tmp": {"snapshot_forks_isolated", "snapshot_rollback_undoes_files",
                                 "snapshot_rollback_undoes_a_package"},
    "liar_snapshot_memory": {"snapshot_memory_kept"},
}


@pytest.fixture
def liars(only_local_builtin: None, fake_dists: FakeDistributions) -> None:
    fake_dists.add(DISTRIBUTION, ep_name="liars", value="tests.testing.lying_backends")


def _results(backend: str, checks: list[str]) -> dict[str, CheckResult]:
    results = {r.name: r for r in self_check(backend, checks=checks)}
    if "available" in results:
        engine_missing(results["available"].message)
    return results


def test_every_snapshot_check_is_broken_by_a_liar() -> None:
    assert set(FAILS_WITH) == set(SNAPSHOT_CHECKS)
    assert set().union(*BREAKS.values()) | {"snapshot_nothing_left_behind"} == set(SNAPSHOT_CHECKS)


def test_the_honest_snapshot_backend_passes(liars: None) -> None:
    results = _results("kit_honest_snapshot", SNAPSHOT_CHECKS)
    seen = {name: (r.status, r.message) for name, r in results.items()}
    assert {name for name, (status, _) in seen.items() if status != "pass"} == {"snapshot_memory_kept"}, seen
    assert seen["snapshot_memory_kept"] == ("skip", "not claimed: the backend does not claim memory_snapshot (a "
                                            "sandbox's processes and memory kept, not only its files)")


@pytest.mark.parametrize("liar", sorted(BREAKS))
def test_a_snapshot_lie_fails_exactly_the_checks_of_what_it_breaks(liars: None, liar: str) -> None:
    results = _results(liar, SNAPSHOT_CHECKS)
    seen = {name: (r.status, r.message) for name, r in results.items()}
    failed = {name for name, (status, _) in seen.items() if status == "fail"}
    assert failed == BREAKS[liar], seen
    for name in failed:
        assert seen[name][1].startswith(FAILS_WITH[name]), seen[name]


def test_a_backend_that_never_removes_a_snapshot_fails_nothing_left_behind(liars: None) -> None:
    [result] = _results("liar_snapshot_undeletable", ["snapshot_nothing_left_behind"]).values()
    assert result.status == "fail" and result.message.startswith(FAILS_WITH[result.name]), result


def test_the_package_check_skips_without_pip_and_says_so(liars: None) -> None:
    [result] = _results("kit_snapshot_no_pip", ["snapshot_rollback_undoes_a_package"]).values()
    assert result.status == "skip", result
    assert result.message.startswith("cannot run here: the sandbox has no pip to install a package with"), result
    assert "No module named pip" in result.message, result


def test_snapshot_checks_skip_on_a_backend_that_does_not_claim_it(liars: None) -> None:
    results = _results("kit_honest", SNAPSHOT_CHECKS)
    assert {r.message for r in results.values()} == {
        "not claimed: the backend does not claim snapshot (a sandbox's files kept, forked and rolled back)"}


def test_the_pytest_form_skips_an_unclaimed_snapshot_check(liars: None) -> None:
    # The path a backend author's test class takes: a skip with the reason, not a pass.
    from execbox import Runner, Settings
    from execbox.testing.checks import Kit

    kit = Kit.open(Runner(Settings.from_env()), "kit_honest")
    with pytest.raises(pytest.skip.Exception, match="does not claim snapshot"):
        BackendConformance().test_snapshot_forks_isolated(kit)  # type: ignore[attr-defined]
