"""The vercel_sandbox backend, against the vercel fake (execbox.fakes.vercel): the conformance kit, then what
is specific to Vercel Sandbox."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import anyio
import pytest

from execbox import Runner, Settings
from execbox.contract.models import Limits
from execbox.errors import BackendUnavailableError, UnsupportedPolicyError
from execbox.testing.conformance import BackendConformance
from tests.backends.remote_fixtures import (  # noqa: F401 - fixtures
    assert_settings_read_on_use,
    check_kill,
    check_session_file_calls,
    fake_service,
    recorded,
)


@pytest.fixture
def vercel_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    yield from fake_service("vercel", monkeypatch)


def runner(**kw: object) -> Runner:
    return Runner(Settings.from_env(backend="vercel_sandbox", **kw))


class TestVercelSandboxConformance(BackendConformance):
    backend_name = "vercel_sandbox"

    @pytest.fixture
    def runner(self, vercel_fake: object) -> Runner:
        return Runner(Settings.from_env(backend="vercel_sandbox"))


def create_call(service: object) -> dict:
    return dict(service.calls_to("create_sandbox")[-1].kwargs)  # type: ignore[attr-defined]


def test_policy_is_translated_to_vercel_controls(vercel_fake) -> None:
    result = runner(cpus=4.0).run(["true"], network="none", limits=Limits(cpus=2), timeout=5)
    assert result.exit_code == 0
    sent = create_call(vercel_fake)
    assert sent["network_policy"].mode == "deny-all"
    assert sent["resources"].vcpus == 2 and sent["resources"].memory is None
    assert sent["execution_time_limit"] == 65 and sent["persistent"] is False
    assert sent["tags"]["execbox"] == "1"
    run = vercel_fake.calls_to("run_process")[-1]
    assert run.kwargs["kill_after"] == 5
    assert run.kwargs["stdout"] not in (None, -1) and not run.kwargs["capture_output"]  # streamed, never buffered
    assert any("memory" in note for note in result.notes)
    runner().run(["true"], network="egress")
    assert create_call(vercel_fake)["network_policy"].mode == "allow-all"


def test_units_vercel_cannot_enforce_are_refused(vercel_fake) -> None:
    with pytest.raises(UnsupportedPolicyError, match="whole vCPUs"):
        runner().run(["true"], limits=Limits(cpus=0.5))
    with pytest.raises(UnsupportedPolicyError, match="memory"):
        runner().run(["true"], limits=Limits(memory_mb=512))
    assert not vercel_fake.calls_to("create_sandbox")


def test_every_path_destroys_the_sandbox(vercel_fake) -> None:
    r = runner()
    r.run(["true"])
    r.run(["sleep", "100"], timeout=1)
    with r.sandbox("vercel_sandbox") as sb:
        sb.exec("true")
    assert len(vercel_fake.calls_to("destroy")) == 3 and not vercel_fake.sandboxes


def test_cancellation_destroys_the_sandbox(vercel_fake) -> None:
    r = runner()

    async def cancelled() -> None:
        with anyio.move_on_after(1.5):
            await r.aio.run(["sleep", "100"], timeout=30)

    anyio.run(cancelled)
    assert vercel_fake.calls_to("destroy") and not vercel_fake.sandboxes


def slow_replies(monkeypatch: pytest.MonkeyPatch, *, delay: float, returncode: dict[int, int] | None = None) -> None:
    """The reply to a command run with kill_after=1 arrives ``delay`` seconds after the command ended (a slow
    network), with its return code mapped through ``returncode``."""
    import time

    from execbox.fakes import vercel as fake

    real = fake.SyncSandbox.run_process

    def slow(self: object, command: str, args: object = None, **kw: object) -> object:
        done = real(self, command, args, **kw)  # type: ignore[arg-type]
        if kw.get("kill_after") == 1:
            time.sleep(delay)
            done.returncode = (returncode or {}).get(done.returncode, done.returncode)
        return done

    monkeypatch.setattr(fake.SyncSandbox, "run_process", slow)


def test_a_command_that_fails_just_before_its_deadline_is_not_a_timeout(vercel_fake,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The reply arrives after the deadline, but the service did not kill the command: its own exit code stands."""
    slow_replies(monkeypatch, delay=1.5)
    r = runner()
    result = r.run("exit 3", timeout=1)
    assert (result.exit_code, result.timed_out) == (3, False)
    with r.sandbox("vercel_sandbox") as sb:
        in_session = sb.exec("exit 3", timeout=1)
        assert (in_session.exit_code, in_session.timed_out) == (3, False)
    assert not [c for c in vercel_fake.calls_to("run_process") if "EXECBOX_RUN=$1" in str(c.args)]  # no reaping


def test_a_command_killed_at_its_deadline_is_a_timeout_however_the_kill_is_reported(
        vercel_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_replies(monkeypatch, delay=0, returncode={137: -9})  # the service reports the signal, not 128+9
    result = runner().run(["sleep", "100"], timeout=1)
    assert (result.exit_code, result.timed_out) == (124, True)


def test_file_calls_check_paths_once_code_has_run(vercel_fake) -> None:
    check_session_file_calls("vercel", "vercel_sandbox", vercel_fake)


def test_credentials_never_reach_the_sandbox(vercel_fake) -> None:
    result = runner().run_code("import os, json; print(json.dumps(dict(os.environ)))")
    token = vercel_fake.credentials["VERCEL_TOKEN"]
    assert token not in result.stdout and not vercel_fake.sent(token)


def test_missing_credentials_is_not_retryable(vercel_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VERCEL_TOKEN")
    with pytest.raises(BackendUnavailableError) as info:
        runner().run(["true"])
    assert info.value.retryable is False
    assert all(v in info.value.message for v in ("VERCEL_TOKEN", "VERCEL_PROJECT_ID", "VERCEL_TEAM_ID"))


def test_invalid_token_is_not_retryable(vercel_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERCEL_TOKEN", "vcp_wrong")
    with pytest.raises(BackendUnavailableError) as info:
        runner().run(["true"])
    assert info.value.retryable is False


def test_an_invalid_setting_is_a_config_error_from_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox.backends.vercel_sandbox import VercelSandboxBackend, VercelSettings

    assert_settings_read_on_use(VercelSandboxBackend, VercelSettings, monkeypatch)


def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("vercel", "vercel.sandbox", "vercel.sandbox.sync"):
        monkeypatch.setitem(sys.modules, name, None)  # import -> ImportError, as when not installed
    from execbox.backends.vercel_sandbox import VercelSandboxBackend

    with pytest.raises(BackendUnavailableError, match=r"pip install 'execbox\[vercel\]'"):
        anyio.run(VercelSandboxBackend(Settings.from_env()).check)


def test_gc_destroys_orphans_only(vercel_fake) -> None:
    from vercel.sandbox import sync

    from execbox.plugin import REMOTE_LABELS

    sync.create_sandbox(name="expired", tags={**REMOTE_LABELS.make(60), "execbox-expires": "1"})
    sync.create_sandbox(name="live", tags=REMOTE_LABELS.make(600))
    sync.create_sandbox(name="foreign", tags={"team": "x"})
    removed = anyio.run(runner().aio.backend("vercel_sandbox").gc)
    assert removed == ["vercel sandbox expired (expired)"]
    assert sorted(vercel_fake.sandboxes) == ["foreign", "live"]


def test_recorded_calls_bind_against_the_real_sdk(vercel_fake, recorded) -> None:
    r = runner()
    with r.sandbox("vercel_sandbox") as sb:
        sb.write_file("a.txt", b"x")
        sb.exec(["cat", "a.txt"], stdin=b"in")
        sb.read_file("a.txt")
        sb.run_code("import time; time.sleep(10)", timeout=1)
    anyio.run(r.aio.backend("vercel_sandbox").gc)
    recorded("vercel", vercel_fake)


def test_kill_destroys_the_sandbox_of_another_runner(vercel_fake) -> None:
    from vercel.sandbox import sync

    sync.create_sandbox(name="foreign", tags={"team": "x"})
    check_kill("vercel_sandbox", lambda ref: ref not in vercel_fake.sandboxes, "foreign")
