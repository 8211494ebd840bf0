"""The limit that cut a run short, in one sentence on ExecResult (contract.results.explain), for API users and the
MCP tools alike."""

from __future__ import annotations

from execbox import ExecResult, Limits, Runner, Settings
from execbox.contract.models import EgressAttempt
from execbox.contract.results import explain
from execbox.errors import BackendUnavailableError
from execbox.runner import run_blocking
from execbox.testing import engine_missing


def explained(result: ExecResult, timeout: float = 30, asked: float | None = None, network: str = "none") -> ExecResult:
    return explain(result, timeout=timeout, asked_timeout=asked, max_timeout=30, memory_mb=512, network=network)


def test_a_timeout_below_the_maximum_is_retryable_at_the_maximum_it_is_not() -> None:
    short = explained(ExecResult(exit_code=124, timed_out=True), timeout=5)
    assert (short.limit, short.retryable) == ("timeout", True)
    assert short.explanation.startswith("killed after 5 s: timeout") and "up to 30 s" in short.explanation
    full = explained(ExecResult(exit_code=124, timed_out=True), timeout=30)
    assert (full.limit, full.retryable) == ("timeout", False)
    assert full.explanation.startswith("killed after 30 s: timeout, the longest allowed")


def test_a_clamped_timeout_is_said() -> None:
    result = explained(ExecResult(exit_code=0), timeout=30, asked=100)
    assert result.notes == ["the requested timeout of 100 s was clamped to 30 s, the maximum "
                            "(CODE_EXEC_MAX_TIMEOUT_SEC)"]
    assert result.limit is None and result.explanation == "" and not result.retryable
    assert explained(ExecResult(exit_code=0), timeout=10, asked=10).notes == []


def test_out_of_memory_names_the_limit() -> None:
    result = explained(ExecResult(exit_code=137, oom_killed=True))
    assert result.limit == "memory" and result.explanation.startswith("killed: out of memory (512 MiB)")
    assert not result.retryable


def test_network_off_is_said_only_when_the_failure_looks_like_it() -> None:
    failed = ExecResult(exit_code=1, stderr="urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in "
                                            "name resolution>")
    result = explained(failed)
    assert result.limit == "network"
    assert result.explanation.startswith("network is off in this sandbox (mode none)")
    assert explained(failed, network="egress").limit is None
    assert explained(ExecResult(exit_code=1, stderr="ZeroDivisionError")).limit is None
    assert explained(ExecResult(exit_code=0, stderr="Could not resolve host: x")).limit is None


def test_the_proxys_refusal_is_named() -> None:
    failed = ExecResult(exit_code=1, egress=[EgressAttempt(host="evil.example", port=443, allowed=False,
                                                           reason="not in the allowlist")])
    result = explained(failed, network="proxy")
    assert result.limit == "network"
    assert result.explanation.startswith("the egress proxy refused evil.example:443 (not in the allowlist)")


def test_api_users_get_the_same_sentences_from_a_real_run() -> None:
    with Runner(Settings(backend="bubblewrap", max_timeout_sec=5)) as runner:
        try:
            caps = run_blocking(runner.aio.backend("bubblewrap").check)
        except BackendUnavailableError as exc:
            engine_missing(f"bubblewrap cannot run here: {exc}")
        slow = runner.run(["sleep", "10"], timeout=1)
        assert (slow.limit, slow.retryable) == ("timeout", True)
        assert slow.explanation.startswith("killed after 1 s: timeout")
        clamped = runner.run(["true"], timeout=60)
        assert "clamped to 5 s" in " ".join(clamped.notes)
        if "memory" not in caps.limits:
            return  # no cgroups for execbox here: bubblewrap cannot enforce a memory limit
        hog = runner.run_code("b = bytearray(400 << 20)\nb[::4096] = b'x' * len(b[::4096])",
                              limits=Limits(memory_mb=128))
        assert hog.oom_killed and hog.limit == "memory"
        assert hog.explanation.startswith("killed: out of memory (128 MiB)")
