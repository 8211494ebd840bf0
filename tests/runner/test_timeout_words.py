"""Clamps and ceilings of a timeout are always said, and named by whoever set them: run_cell says its clamp as exec
does, and an MCP grantee whose grant caps the timeout hears the grant's ceiling, not the operator's maximum."""

from __future__ import annotations

from types import SimpleNamespace

from execbox import CellResult, ExecResult, Runner, Settings
from execbox.contract.results import explain
from execbox.mcp.grants import GrantRequest, narrow, root_grant
from execbox.mcp.server import McpApp


def test_run_cell_says_its_timeout_was_clamped() -> None:
    with Runner(Settings(local=True, network="host", max_timeout_sec=5)) as runner, \
            runner.sandbox("local_subprocess") as sb:
        clamped = sb.run_cell("1 + 1", timeout=60)
        assert clamped.ok, clamped
        assert ("the requested timeout of 60 s was clamped to 5 s, the maximum (CODE_EXEC_MAX_TIMEOUT_SEC)"
                in clamped.notes)
        assert not any("clamped" in note for note in sb.run_cell("2", timeout=5).notes)


def _within_grant(result: ExecResult | CellResult, cap: float, asked: float | None) -> ExecResult | CellResult:
    grant = narrow(root_grant(["run_code", "python", "delegate"], 1), GrantRequest(tools=["run_code"], timeout_s=cap),
                   max_depth=2, default_ttl_s=60)
    app = SimpleNamespace(settings=Settings(max_timeout_sec=30))
    timeout = min(x for x in (asked, cap) if x is not None)
    return McpApp._within_grant(app, result, grant, asked, timeout)  # type: ignore[arg-type]


def test_a_grantee_capped_below_the_maximum_hears_the_grants_ceiling() -> None:
    # What the runner says of a 5 s run killed at its timeout, with the operator's maximum at 30 s:
    ran = explain(ExecResult(exit_code=124, timed_out=True), timeout=5, asked_timeout=5, max_timeout=30,
                  memory_mb=None, network="none")
    assert ran.retryable and "up to 30 s" in ran.explanation
    told = _within_grant(ran, cap=5, asked=60)
    assert isinstance(told, ExecResult) and not told.retryable
    assert told.explanation == ("killed after 5 s: timeout, the longest allowed (your grant's timeout_s); do less per "
                                "run or make it faster")
    assert told.notes == ["the requested timeout of 60 s was clamped to 5 s, the maximum (your grant's timeout_s)"]
    shorter = _within_grant(ran, cap=10, asked=5)
    assert isinstance(shorter, ExecResult) and shorter.retryable
    assert "up to 10 s, your grant's timeout_s" in shorter.explanation


def test_a_grantees_cell_says_the_grants_clamp_and_ceiling() -> None:
    cell = _within_grant(CellResult(timed_out=True), cap=5, asked=60)
    assert cell.notes == ["the requested timeout of 60 s was clamped to 5 s, the maximum (your grant's timeout_s)",
                          "killed after 5 s: timeout, the longest allowed (your grant's timeout_s); do less per run "
                          "or make it faster"]
    assert _within_grant(CellResult(), cap=5, asked=5).notes == []
