"""The daytona backend, against the daytona fake (execbox.fakes.daytona): the conformance kit, then what is
specific to Daytona (units, persistence, the exec that has no stderr and no stdin)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

import anyio
import pytest

from execbox import Runner, Settings
from execbox.contract.backend import SessionSpec
from execbox.contract.models import Limits
from execbox.errors import BackendUnavailableError, ConfigError, UnsupportedPolicyError
from execbox.testing.conformance import BackendConformance
from tests.backends.remote_fixtures import (  # noqa: F401 - fixtures
    check_kill,
    check_restored_session_checks_paths,
    check_session_file_calls,
    check_snapshots,
    fake_service,
    recorded,
)


@pytest.fixture
def daytona_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    yield from fake_service("daytona", monkeypatch)


def runner(**kw: object) -> Runner:
    return Runner(Settings.from_env(backend="daytona", **kw))


class TestDaytonaConformance(BackendConformance):
    backend_name = "daytona"

    @pytest.fixture
    def runner(self, daytona_fake: object) -> Runner:
        return Runner(Settings.from_env(backend="daytona"))


def params(service: object) -> object:
    return service.calls_to("Daytona.create")[-1].args[0]  # type: ignore[attr-defined]


def test_policy_is_translated_to_daytona_controls(daytona_fake) -> None:
    result = runner(cpus=4.0).run(["true"], network="none", limits=Limits(cpus=2), timeout=5)
    assert result.exit_code == 0
    sent = params(daytona_fake)
    assert sent.network_block_all is True
    assert (sent.resources.cpu, sent.resources.memory) == (2, 1)  # whole CPUs; GiB (CODE_EXEC_MEMORY_MB=1024)
    assert sent.ephemeral is True and sent.ttl_minutes == 2  # lifetime 65 s, rounded up to minutes
    assert sent.labels["execbox"] == "1" and "execbox-expires" in sent.labels
    assert sent.image == "python:3.12-slim"
    runner().run(["true"], network="egress")
    assert params(daytona_fake).network_block_all is False


def test_real_sdk_accepts_the_params(daytona_fake) -> None:
    """The real pydantic model validates what the backend built (types, the GiB int, the labels)."""
    runner().run(["true"], network="none")
    sent = params(daytona_fake)
    saved = {n: m for n, m in sys.modules.items() if n == "daytona" or n.startswith("daytona.")}
    for n in saved:
        del sys.modules[n]
    try:
        import daytona

        given = dict(sent._given)
        given["resources"] = daytona.Resources(**dataclasses.asdict(given["resources"]))
        real = daytona.CreateSandboxFromImageParams(**given)
        assert real.network_block_all is True and real.resources.memory == 1
    finally:
        for n in [n for n in sys.modules if n == "daytona" or n.startswith("daytona.")]:
            del sys.modules[n]
        sys.modules.update(saved)


def test_units_daytona_cannot_enforce_are_refused(daytona_fake) -> None:
    with pytest.raises(UnsupportedPolicyError, match="whole CPUs"):
        runner().run(["true"], limits=Limits(cpus=0.5))
    with pytest.raises(UnsupportedPolicyError, match="memory"):  # the backend (whole GiB) or the guard refuses
        runner(memory_mb=1536).run(["true"])
    with pytest.raises(UnsupportedPolicyError, match="memory"):  # the guard: memory is not claimed
        runner().run(["true"], limits=Limits(memory_mb=2048))
    assert not daytona_fake.calls_to("Daytona.create")


def test_resources_are_whole_cpus_and_whole_gib() -> None:
    from execbox.backends.daytona import resources

    def spec(**limits: object) -> SessionSpec:
        return SessionSpec("none", Limits(**limits), oneshot=True, lifetime_s=60)

    assert resources(spec(cpus=2, memory_mb=3072)) == (2, 3)
    assert resources(spec()) == (None, None)
    with pytest.raises(UnsupportedPolicyError, match="CODE_EXEC_MEMORY_MB"):
        resources(spec(memory_mb=1536))
    with pytest.raises(UnsupportedPolicyError, match="CODE_EXEC_CPUS"):
        resources(spec(cpus=1.5))


def test_an_invalid_persist_value_is_a_config_error_of_daytona_only(daytona_fake,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings are read on use: DAYTONA_SANDBOX_PERSIST=maybe breaks daytona (naming the variable), not the
    construction of every backend."""
    from execbox.backends.daytona import DaytonaBackend

    monkeypatch.setenv("DAYTONA_SANDBOX_PERSIST", "maybe")
    backend = DaytonaBackend(Settings.from_env())
    with pytest.raises(ConfigError) as info:
        anyio.run(backend.check)
    assert info.value.env_var == "DAYTONA_SANDBOX_PERSIST" and "'maybe'" in info.value.message
    with pytest.raises(ConfigError, match="DAYTONA_SANDBOX_PERSIST"):
        runner().run(["true"], backend="daytona")
    assert not daytona_fake.calls_to("Daytona.create")
    monkeypatch.setenv("DAYTONA_SANDBOX_PERSIST", "false")  # fixed: the same backend works, nothing was cached
    assert anyio.run(backend.check).remote


def test_execbox_backends_lists_daytona_unavailable_when_its_setting_is_invalid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from click.testing import CliRunner

    from execbox.cli import main

    monkeypatch.setenv("DAYTONA_SANDBOX_PERSIST", "maybe")
    for command in (["backends", "--json"], ["doctor", "--json"]):
        result = CliRunner().invoke(main, command)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        data = json.loads(result.stdout)
        rows = {row["name"]: row for row in (data["backends"] if command[0] == "doctor" else data)}
        assert rows["daytona"]["available"] is False
        assert "DAYTONA_SANDBOX_PERSIST='maybe' is invalid" in rows["daytona"]["reason"]
        assert "local_subprocess" in rows  # every other backend is still listed


def test_output_is_cut_in_the_sandbox(daytona_fake) -> None:
    """Only the head and the tail are downloaded, never the whole output."""
    result = runner().run_code("import sys; sys.stdout.write('a' * 3_000_000)", max_output_bytes=1000)
    assert result.truncated and len(result.stdout.encode()) < 1200
    downloads = daytona_fake.calls_to("FileSystem.download_files")
    assert downloads and all(p.endswith((".h", ".t")) for p, _ in downloads[-1].args[0])


def test_every_path_deletes_the_sandbox(daytona_fake) -> None:
    r = runner()
    r.run(["true"])
    r.run(["sleep", "100"], timeout=1)
    with r.sandbox("daytona") as sb:
        sb.exec("true")
    assert len(daytona_fake.calls_to("Sandbox.delete")) == 3
    assert not daytona_fake.sandboxes


def test_cancellation_deletes_the_sandbox(daytona_fake) -> None:
    r = runner()

    async def cancelled() -> None:
        with anyio.move_on_after(1.5):
            await r.aio.run(["sleep", "100"], timeout=30)

    anyio.run(cancelled)
    assert daytona_fake.calls_to("Sandbox.delete") and not daytona_fake.sandboxes


def test_persist_stops_and_resumes_by_name(daytona_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYTONA_SANDBOX_PERSIST", "true")
    r = runner()
    with r.sandbox("daytona", name="keep-me") as sb:
        sb.write_file("notes.txt", b"remembered")
        sb.exec("pip --version > /dev/null; echo installed > state.txt")
    assert not daytona_fake.calls_to("Sandbox.delete") and daytona_fake.calls_to("Sandbox.stop")
    (kept,) = daytona_fake.sandboxes.values()
    assert kept.state.value == "stopped" and kept.labels["execbox-persist"] == "true"
    assert "execbox-expires" not in kept.labels and not params(daytona_fake).ephemeral
    with r.sandbox("daytona", name="keep-me") as sb:
        assert sb.read_file("notes.txt") == b"remembered"
        assert sb.exec(["cat", "state.txt"]).stdout == "installed\n"
    assert len(daytona_fake.calls_to("Daytona.create")) == 1 and daytona_fake.calls_to("Sandbox.start")
    assert anyio.run(r.aio.backend("daytona").gc) == []  # gc never removes a persisted sandbox
    with pytest.raises(UnsupportedPolicyError, match="network_block_all"):
        with r.sandbox("daytona", name="keep-me", network="egress"):
            pass


def test_persist_never_adopts_a_foreign_sandbox(daytona_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    import daytona

    daytona.Daytona().create(daytona.CreateSandboxFromImageParams(image="x", name="theirs"))
    monkeypatch.setenv("DAYTONA_SANDBOX_PERSIST", "true")
    with pytest.raises(UnsupportedPolicyError, match="did not persist"):
        with runner().sandbox("daytona", name="theirs"):
            pass


def test_file_calls_check_paths_once_code_has_run(daytona_fake) -> None:
    check_session_file_calls("daytona", "daytona", daytona_fake)


def test_credentials_never_reach_the_sandbox(daytona_fake) -> None:
    result = runner().run_code("import os, json; print(json.dumps(dict(os.environ)))")
    key = daytona_fake.credentials["DAYTONA_API_KEY"]
    assert key not in result.stdout and not daytona_fake.sent(key)


def test_missing_credentials_is_not_retryable(daytona_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DAYTONA_API_KEY")
    with pytest.raises(BackendUnavailableError) as info:
        runner().run(["true"])
    assert info.value.retryable is False and "DAYTONA_API_KEY" in info.value.message


def test_invalid_key_is_not_retryable(daytona_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYTONA_API_KEY", "wrong")
    with pytest.raises(BackendUnavailableError) as info:
        runner().run(["true"])
    assert info.value.retryable is False


def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "daytona", None)
    from execbox.backends.daytona import DaytonaBackend

    with pytest.raises(BackendUnavailableError, match=r"pip install 'execbox\[daytona\]'"):
        anyio.run(DaytonaBackend(Settings.from_env()).check)


def test_gc_deletes_orphans_only(daytona_fake) -> None:
    import daytona

    from execbox.plugin import REMOTE_LABELS

    client = daytona.Daytona()

    def make(name: str, labels: dict[str, str]) -> object:
        return client.create(daytona.CreateSandboxFromImageParams(image="x", name=name, labels=labels))

    make("expired", {**REMOTE_LABELS.make(60), "execbox-expires": "1"})
    make("live", REMOTE_LABELS.make(600))
    make("foreign", {"team": "other"})
    make("kept", REMOTE_LABELS.make(60, persist=True))
    removed = anyio.run(runner().aio.backend("daytona").gc)
    assert removed == ["daytona sandbox expired (expired)"]
    assert sorted(s.name for s in daytona_fake.sandboxes.values()) == ["foreign", "kept", "live"]


def test_recorded_calls_bind_against_the_real_sdk(daytona_fake, recorded) -> None:
    r = runner()
    with r.sandbox("daytona") as sb:
        sb.write_file("a.txt", b"x")
        sb.exec(["cat", "a.txt"], stdin=b"in")
        sb.read_file("a.txt")
        sb.run_code("import time; time.sleep(10)", timeout=1)
        snap = sb.snapshot()
        sb.rollback(snap)
    r.delete_snapshot(snap)
    anyio.run(r.aio.backend("daytona").gc)
    recorded("daytona", daytona_fake)


def test_snapshot_fork_rollback_and_delete(daytona_fake) -> None:
    """The filesystem through create_snapshot (a Daytona snapshot named by execbox's id, started again by name),
    the workspace through the runner; deleting execbox's snapshot deletes Daytona's."""
    snap = check_snapshots("daytona")
    name = snap.refs["snapshot"]
    assert name == f"execbox-{snap.id}"
    taken = daytona_fake.calls_to("Sandbox.create_snapshot")
    assert len(taken) == 2 and taken[0].args == (name,)  # the snapshot, and the fork's
    restored = [c.args[0] for c in daytona_fake.calls_to("Daytona.create") if getattr(c.args[0], "snapshot", None)]
    assert len(restored) == 4 and all(p.ephemeral and p.ttl_minutes for p in restored)  # 2 forks, rollback, again
    assert restored[-1].snapshot == name and restored[-1].labels["execbox"] == "1"
    assert daytona_fake.snapshots == {}  # the fork's too, when its last sandbox closed
    deleted = [c.args[0] for c in daytona_fake.calls_to("SnapshotService.delete")]
    assert deleted == [taken[1].args[0], name]  # the fork's, then this one's (once: the second call found none)


def test_a_restore_with_other_resources_is_refused(daytona_fake) -> None:
    r = runner()
    with r.sandbox("daytona") as sb:
        snap = sb.snapshot()
    with pytest.raises(UnsupportedPolicyError, match="takes them from the snapshot"):
        with runner(cpus=2.0).sandbox(from_snapshot=snap):
            pass
    assert len(daytona_fake.sandboxes) == 0  # the one started from it was deleted
    r.delete_snapshot(snap)


def test_a_snapshot_gone_from_daytona_is_a_snapshot_error(daytona_fake) -> None:
    from execbox.errors import SnapshotError

    r = runner()
    with r.sandbox("daytona") as sb:
        snap = sb.snapshot()
    daytona_fake.drop_snapshot(daytona_fake.find_snapshot(snap.refs["snapshot"]))
    with pytest.raises(SnapshotError, match="no longer has its snapshot"):
        with r.sandbox(from_snapshot=snap):
            pass
    r.delete_snapshot(snap)  # Daytona's is gone already: not an error
    assert r.snapshots() == []


def test_a_persisted_named_sandbox_does_not_start_from_a_snapshot(daytona_fake,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYTONA_SANDBOX_PERSIST", "true")
    r = runner()
    with r.sandbox("daytona", name="kept") as sb:
        sb.write_file("a.txt", b"one")
        snap = sb.snapshot()
        with pytest.raises(UnsupportedPolicyError, match="DAYTONA_SANDBOX_PERSIST"):
            sb.rollback(snap)
        assert sb.read_file("a.txt") == b"one"
    r.delete_snapshot(snap)


def test_a_restored_session_checks_paths_from_the_start(daytona_fake) -> None:
    check_restored_session_checks_paths("daytona")


def test_kill_deletes_the_sandbox_of_another_runner(daytona_fake) -> None:
    import daytona

    foreign = daytona.Daytona().create(daytona.CreateSandboxFromImageParams(image="x", name="foreign",
                                                                              labels={"team": "other"}))
    check_kill("daytona", lambda ref: ref not in daytona_fake.sandboxes, foreign.id)


def test_kill_stops_a_kept_sandbox_rather_than_deleting_it(daytona_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    import daytona

    from execbox.plugin import REMOTE_LABELS

    kept = daytona.Daytona().create(daytona.CreateSandboxFromImageParams(
        image="x", name="kept", labels=REMOTE_LABELS.make(60, persist=True)))
    anyio.run(runner().aio.backend("daytona").kill, kept.id)
    assert daytona_fake.sandboxes[kept.id].state == daytona.SandboxState.STOPPED
