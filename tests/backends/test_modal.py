"""The modal backend, against the modal fake (execbox.fakes.modal): the conformance kit, then what is
specific to Modal. The fake runs commands for real in a local box; tests/fakes/test_fake_surfaces.py keeps
it honest against the real SDK, and test_recorded_calls_bind_against_the_real_sdk binds the calls recorded
here against it (remote_fixtures.check_calls_against_real_sdk)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import anyio
import pytest

from execbox import Runner, Settings
from execbox.contract.models import Limits
from execbox.errors import BackendUnavailableError, SandboxError
from execbox.testing.conformance import BackendConformance
from tests.backends.remote_fixtures import (  # noqa: F401 - fixtures
    assert_settings_read_on_use,
    check_kill,
    check_restored_session_checks_paths,
    check_session_file_calls,
    check_snapshots,
    fake_service,
    recorded,
)


@pytest.fixture
def modal_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    yield from fake_service("modal", monkeypatch)


class TestModalConformance(BackendConformance):
    backend_name = "modal"

    @pytest.fixture
    def runner(self, modal_fake: object) -> Runner:
        return Runner(Settings.from_env(backend="modal"))


def create_call(service: object) -> dict:
    return dict(service.calls_to("Sandbox.create")[-1].kwargs)  # type: ignore[attr-defined]


def test_policy_is_translated_to_modal_controls(modal_fake) -> None:
    runner = Runner(Settings.from_env(backend="modal"))
    result = runner.run(["true"], network="none", limits=Limits(memory_mb=512, cpus=0.5), timeout=7)
    assert result.exit_code == 0
    sent = create_call(modal_fake)
    assert sent["block_network"] is True
    assert sent["memory"] == (512, 512) and sent["cpu"] == (0.5, 0.5)  # request = limit: a hard limit
    assert sent["timeout"] == 67  # the one-shot lifetime: timeout + 60 s
    assert sent["workdir"] == "/workspace"
    assert sent["tags"]["execbox"] == "1" and "execbox-expires" in sent["tags"]
    exec_call = modal_fake.calls_to("Sandbox.exec")[-1]
    assert exec_call.kwargs["timeout"] == 7 and exec_call.kwargs["text"] is False
    runner.run(["true"], network="egress")
    assert create_call(modal_fake)["block_network"] is False


def test_every_path_terminates_the_sandbox(modal_fake) -> None:
    runner = Runner(Settings.from_env(backend="modal"))
    runner.run(["true"])
    runner.run(["sleep", "100"], timeout=1)
    with runner.sandbox("modal") as sb:
        sb.exec("true")
    assert len(modal_fake.calls_to("Sandbox.terminate")) == 3
    assert all(s.poll() is not None for s in modal_fake.sandboxes.values())


def test_cancellation_terminates_the_sandbox(modal_fake) -> None:
    runner = Runner(Settings.from_env(backend="modal"))

    async def cancelled() -> None:
        with anyio.move_on_after(1.5):
            await runner.aio.run(["sleep", "100"], timeout=30)

    anyio.run(cancelled)
    assert modal_fake.calls_to("Sandbox.terminate")
    assert all(s.poll() is not None for s in modal_fake.sandboxes.values())


def test_cancelled_while_creating_terminates_what_was_created(modal_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from execbox.fakes import modal as fake

    real_create = fake.Sandbox.create

    def slow_create(*args: object, **kwargs: object) -> object:
        sandbox = real_create(*args, **kwargs)
        time.sleep(1.0)  # the reply is still on its way when the caller gives up
        return sandbox

    monkeypatch.setattr(fake.Sandbox, "create", staticmethod(slow_create))
    runner = Runner(Settings.from_env(backend="modal"))

    async def cancelled() -> None:
        with anyio.move_on_after(0.3):
            await runner.aio.run(["true"])

    anyio.run(cancelled)
    assert len(modal_fake.sandboxes) == 1 and modal_fake.calls_to("Sandbox.terminate")
    assert all(s.poll() is not None for s in modal_fake.sandboxes.values())
    assert not modal_fake.calls_to("Sandbox.exec")


def test_file_calls_check_paths_once_code_has_run(modal_fake) -> None:
    check_session_file_calls("modal", "modal", modal_fake)


def test_credentials_never_reach_the_sandbox(modal_fake) -> None:
    runner = Runner(Settings.from_env(backend="modal"))
    result = runner.run_code("import os, json; print(json.dumps(dict(os.environ)))")
    for value in modal_fake.credentials.values():
        assert value not in result.stdout
        assert not [c for c in modal_fake.sent(value) if c.name != "Client.from_env"]


def test_missing_credentials_is_not_retryable(modal_fake, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("MODAL_TOKEN_ID")
    monkeypatch.delenv("MODAL_TOKEN_SECRET")
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "none.toml"))
    runner = Runner(Settings.from_env(backend="modal"))
    with pytest.raises(BackendUnavailableError) as info:
        runner.run(["true"])
    assert info.value.retryable is False
    assert "MODAL_TOKEN_ID" in info.value.message and "MODAL_TOKEN_SECRET" in info.value.message
    assert not modal_fake.calls_to("Sandbox.create")


def test_invalid_token_is_not_retryable(modal_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-wrong")
    with pytest.raises(BackendUnavailableError) as info:
        Runner(Settings.from_env(backend="modal")).run(["true"])
    assert info.value.retryable is False and "MODAL_TOKEN_ID" in info.value.message


def test_an_invalid_setting_is_a_config_error_from_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox.backends.modal import ModalBackend, ModalSettings

    assert_settings_read_on_use(ModalBackend, ModalSettings, monkeypatch)


def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "modal", None)  # import modal -> ImportError, as when not installed
    from execbox.backends.modal import ModalBackend

    with pytest.raises(BackendUnavailableError, match=r"pip install 'execbox\[modal\]'"):
        anyio.run(ModalBackend(Settings.from_env()).check)


def test_sandbox_lost_mid_session_is_a_sandbox_error(modal_fake) -> None:
    runner = Runner(Settings.from_env(backend="modal"))
    with runner.sandbox("modal") as sb:
        next(iter(modal_fake.sandboxes.values())).terminate()
        with pytest.raises(SandboxError, match="gone"):
            sb.exec("true")


def test_gc_terminates_orphans_only(modal_fake) -> None:
    import modal

    from execbox.plugin import REMOTE_LABELS

    runner = Runner(Settings.from_env(backend="modal"))
    app = modal.App.lookup("execbox", create_if_missing=True)
    expired = modal.Sandbox.create(app=app, tags={**REMOTE_LABELS.make(60), "execbox-expires": "1"})
    orphan = modal.Sandbox.create(app=app, tags={**REMOTE_LABELS.make(60), "execbox-owner": _hostname() + ":1:1"})
    live = modal.Sandbox.create(app=app, tags=REMOTE_LABELS.make(600))
    foreign = modal.Sandbox.create(app=app, tags={"owner": "someone-else"})
    removed = anyio.run(runner.aio.backend("modal").gc)
    assert sorted(removed) == sorted([f"modal sandbox {expired.object_id} (expired)",
                                      f"modal sandbox {orphan.object_id} (orphaned)"])
    assert live.poll() is None and foreign.poll() is None
    live.terminate()
    foreign.terminate()


def _hostname() -> str:
    import socket

    return socket.gethostname()


def test_recorded_calls_bind_against_the_real_sdk(modal_fake, recorded) -> None:
    """Every call the backend made in a typical session is valid against the installed modal SDK."""
    runner = Runner(Settings.from_env(backend="modal"))
    with runner.sandbox("modal") as sb:
        sb.write_file("a.txt", b"x")
        sb.exec(["cat", "a.txt"], stdin=b"in")
        sb.read_file("a.txt")
        sb.run_code("import time; time.sleep(10)", timeout=1)
        snap = sb.snapshot()
        sb.rollback(snap)
    runner.delete_snapshot(snap)
    recorded("modal", modal_fake)


def test_execbox_gc_command_removes_orphans(modal_fake) -> None:
    import json

    import modal
    from click.testing import CliRunner

    from execbox.cli import main
    from execbox.plugin import REMOTE_LABELS

    app = modal.App.lookup("execbox", create_if_missing=True)
    orphan = modal.Sandbox.create(app=app, tags={**REMOTE_LABELS.make(60), "execbox-expires": "1"})
    result = CliRunner().invoke(main, ["gc", "--backend", "modal", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["removed"]["modal"] == [f"modal sandbox {orphan.object_id} (expired)"]
    assert orphan.poll() is not None


def test_snapshot_fork_rollback_and_delete(modal_fake) -> None:
    """The filesystem through snapshot_filesystem (an image, started again by its id), the workspace through the
    runner; Modal cannot delete an image, so a deleted snapshot leaves it to its ttl."""
    snap = check_snapshots("modal")
    image_id = snap.refs["image"]
    taken = modal_fake.calls_to("Sandbox.snapshot_filesystem")
    assert len(taken) == 2  # the snapshot, and the fork's
    week = 7 * 86400
    assert taken[0].kwargs["ttl"] == week + 3600 and 0 < taken[0].kwargs["timeout"] < 300
    assert [c.args[0] for c in modal_fake.calls_to("Image.from_id")].count(image_id) == 2  # rollback, from_snapshot
    assert image_id in modal_fake.images  # no delete in Modal: it expires


def test_an_expired_image_is_a_snapshot_error(modal_fake) -> None:
    from execbox.errors import SnapshotError

    runner = Runner(Settings.from_env(backend="modal"))
    with runner.sandbox("modal") as sb:
        sb.write_file("a.txt", b"one")
        snap = sb.snapshot()
    modal_fake.images[snap.refs["image"]] = (modal_fake.images[snap.refs["image"]][0], 0.0)  # past its ttl
    with pytest.raises(SnapshotError, match="no longer has its image"):
        with runner.sandbox(from_snapshot=snap):
            pass
    assert all(s.poll() is not None for s in modal_fake.sandboxes.values())
    runner.delete_snapshot(snap)


def test_a_restored_session_checks_paths_from_the_start(modal_fake) -> None:
    check_restored_session_checks_paths("modal")


def test_kill_terminates_the_sandbox_of_another_runner(modal_fake) -> None:
    import modal

    app = modal.App.lookup("execbox", create_if_missing=True)
    foreign = modal.Sandbox.create(app=app, tags={"owner": "someone-else"})
    check_kill("modal", lambda ref: modal_fake.sandboxes[ref].poll() is not None, foreign.object_id)
    foreign.terminate()
