"""The pipeline's stages: a request is judged once, before any sandbox opens (runner.pipeline.admit): a refused
mount, upload, package cache or secret at egress is one `refused` audit record, like every other refusal, and no
sandbox was opened for it; the spec carries the run's redactor to wherever a backend builds its captures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from execbox import (
    AsyncRunner,
    ExecRequest,
    Mount,
    NotASandboxError,
    RefusedError,
    Runner,
    Settings,
    UnsupportedPolicyError,
)
from execbox.audit import reader as audit_reader
from tests.support import stuck_backends
from tests.support.fixtures import FakeDistributions

SECRET = "sk-test-0123456789abcdef"


@pytest.fixture(autouse=True)
def installed(only_local_builtin: None, fake_dists: FakeDistributions, home: Path) -> Iterator[None]:
    fake_dists.add(stuck_backends.DISTRIBUTION, ep_name="stuck", value="tests.support.stuck_backends")
    stuck_backends.OPENS.clear()
    yield
    stuck_backends.RELEASE.set()


def events() -> list[dict[str, Any]]:
    return list(audit_reader.records(Path(Settings().audit_log or "")))


def _runner(backend: str = "counting", network: str = "none") -> Runner:
    return Runner(Settings(backend=backend, shell_backend=backend, network=network))  # type: ignore[arg-type]


def _one_refusal(error: type[Exception], *, oneshot: bool = True) -> dict[str, Any]:
    (record,) = events()
    assert record["event"] == "refused" and record["oneshot"] is oneshot
    assert record["error"]["type"] == error.__name__
    return record


def test_a_refused_mount_is_one_refused_record_and_opens_nothing(home: Path) -> None:
    with _runner() as runner, pytest.raises(RefusedError, match="never the home itself"):
        runner.run("true", mounts=[Mount(str(home), "/workspace/home")])
    _one_refusal(RefusedError)
    assert stuck_backends.OPENS == []


def test_a_refused_upload_is_one_refused_record_and_opens_nothing(home: Path) -> None:
    with _runner() as runner, pytest.raises(RefusedError, match="upload of"):
        runner.run("true", upload={str(home): "home"})
    _one_refusal(RefusedError)
    assert stuck_backends.OPENS == []


def test_a_sandbox_whose_mount_is_refused_is_one_refused_record_and_never_opens(home: Path) -> None:
    with _runner() as runner:
        sandbox = runner.sandbox(mounts=[Mount(str(home), "/workspace/home")])
        with pytest.raises(RefusedError, match="never the home itself"):
            sandbox.__enter__()
    assert _one_refusal(RefusedError, oneshot=False)["session"] == sandbox.aio.id
    assert stuck_backends.OPENS == []


def test_a_refused_upload_into_a_sandbox_is_one_refused_record(home: Path) -> None:
    with _runner() as runner, runner.sandbox() as sb:
        with pytest.raises(RefusedError, match="upload of"):
            sb.upload(home, "home")
        sid = sb.aio.id
    refused = [r for r in events() if r["event"] == "refused"]
    assert len(refused) == 1 and refused[0]["session"] == sid and refused[0]["error"]["type"] == "RefusedError"


@pytest.mark.parametrize(("backend", "network", "words"), [
    ("counting", "none", "need network mode proxy"),
    ("counting_remote", "proxy", "hands network mode proxy to its provider"),
])
def test_secrets_at_egress_that_cannot_be_carried_are_refused_before_a_sandbox_opens(
        backend: str, network: str, words: str) -> None:
    with _runner(backend, network) as runner, pytest.raises(UnsupportedPolicyError, match=words):
        runner.run("true", secrets_at_egress={"API_KEY": ("api.example.com", SECRET)})
    _one_refusal(UnsupportedPolicyError)
    assert stuck_backends.OPENS == []


def test_a_sandbox_with_secrets_at_egress_it_cannot_carry_never_opens() -> None:
    with _runner() as runner:
        sandbox = runner.sandbox(secrets_at_egress={"API_KEY": ("api.example.com", SECRET)})
        with pytest.raises(UnsupportedPolicyError, match="need network mode proxy"):
            sandbox.__enter__()
    _one_refusal(UnsupportedPolicyError, oneshot=False)
    assert stuck_backends.OPENS == []


def test_judge_asks_the_guard_about_the_default_configuration_and_records_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = AsyncRunner(Settings(backend="counting", network="none"))
    assert runner.judge(runner.backend("counting")).sandbox
    with pytest.raises(NotASandboxError):
        runner.judge(runner.backend("local_subprocess"))
    with pytest.raises(UnsupportedPolicyError, match="network mode 'none'"):
        runner.judge(runner.backend("counting_remote"),
                     stuck_backends.CLAIMS.model_copy(update={"network_modes": frozenset({"proxy"})}))
    assert events() == [] and stuck_backends.OPENS == []


def test_a_sandbox_whose_backend_cannot_bind_the_package_cache_is_one_refused_record() -> None:
    with _runner("dataclass_ok") as runner:
        sandbox = runner.sandbox(package_cache=True)
        with pytest.raises(UnsupportedPolicyError, match="cannot bind the package cache"):
            sandbox.__enter__()
    _one_refusal(UnsupportedPolicyError, oneshot=False)


def test_the_redactor_travels_in_the_spec_to_a_capture_made_in_the_backends_own_thread() -> None:
    seen: list[str] = []
    with _runner("own_thread") as runner:
        result = runner.run(["sh", "-c", 'echo "key=$API_KEY"'], secrets={"API_KEY": SECRET}, on_stdout=seen.append)
    assert result.stdout == "key=[secret API_KEY]\n" and "".join(seen) == result.stdout
    assert not any("redacted after the run" in note for note in result.notes)


def test_a_tmpfs_path_over_a_place_the_sandbox_provides_is_one_refused_record_naming_it() -> None:
    with _runner() as runner, pytest.raises(RefusedError, match="'/run/x' lies in /run"):
        runner.run("true", tmpfs=["/run/x"])
    assert _one_refusal(RefusedError)["config"]["tmpfs"] == ["/run/x"]
    assert stuck_backends.OPENS == []


def test_a_backend_that_cannot_make_a_tmpfs_refuses_the_option_by_name() -> None:
    with _runner("dataclass_ok") as runner:
        sandbox = runner.sandbox(tmpfs=["/var/tmp"])
        with pytest.raises(UnsupportedPolicyError, match=r"cannot make the extra tmpfs paths asked for \(tmpfs="):
            sandbox.__enter__()
    _one_refusal(UnsupportedPolicyError, oneshot=False)


def test_a_sandboxs_tmpfs_is_in_its_spec_and_audit_record_and_fixed_for_its_execs() -> None:
    with _runner() as runner, runner.sandbox(tmpfs=["/var/tmp", "/home/x/"]) as sb:
        session = sb.aio._session
        assert session is not None and session.session_spec is not None
        assert session.session_spec.tmpfs == ("/var/tmp", "/home/x")
        with pytest.raises(UnsupportedPolicyError, match="tmpfs paths are fixed when it opens"):
            sb._call(sb.aio.execute, ExecRequest(argv=["true"], tmpfs=["/var/tmp"]))
    opened = next(r for r in events() if r["event"] == "sandbox.open")
    assert opened["config"]["tmpfs"] == ["/var/tmp", "/home/x"]

