"""Snapshots through the API on real sandboxes: fork, rollback, restore, the store's bounds and checks, what is
kept and what is not, re-judging, audit records, and backends that cannot or never answer.

bubblewrap is the fast real sandbox here (HOME is the workspace: pip --user lands there); docker keeps /tmp too
(HOME is /tmp on its read-only root). The kit's checks (testing/checks) prove the same claims per backend."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from execbox import (
    BackendTimeoutError,
    BusyError,
    ConfigError,
    Mount,
    NotASandboxError,
    RefusedError,
    Runner,
    Settings,
    SnapshotError,
    UnsupportedPolicyError,
)
from execbox.runner import snapshots as store
from tests.audit.test_audit_runner import events
from tests.backends.test_docker import engine  # noqa: F401 (fixture)
from tests.mcp.support import usable
from tests.support import readme, stuck_backends, wheels
from tests.support.fixtures import FakeDistributions

SECRET = "s3cr3t-snapshot-value-81f2"
PIP_USER = "pip install --user --break-system-packages --no-index --no-deps"  # a wheel: nothing is built


@pytest.fixture(scope="module")
def bubblewrap() -> None:
    usable("bubblewrap")


@pytest.fixture
def runner(bubblewrap: None) -> Iterator[Runner]:
    with Runner(Settings(backend="bubblewrap")) as runner:
        yield runner
    assert _kept() == [], "every test removes what it kept"


def _kept() -> list[str]:
    return sorted(os.listdir(store.root())) if store.root().exists() else []


def test_forks_start_from_the_parent_and_change_only_themselves(runner: Runner) -> None:
    with runner.sandbox() as parent:
        parent.write_file("base.txt", "from the parent")
        children = parent.fork(3)
        try:
            for i, child in enumerate(children):
                child.write_file("own.txt", f"child {i}")
            for i, child in enumerate(children):
                assert child.read_file("base.txt") == b"from the parent"
                assert child.exec("cat own.txt").stdout == f"child {i}"
            assert parent.exec("ls").stdout == "base.txt\n"
            assert len({c.aio.id for c in children} | {parent.aio.id}) == 4
            assert len(runner.snapshots()) == 1  # the fork's, until its last child closes
        finally:
            for child in children:
                child.close()
        assert runner.snapshots() == [] and _kept() == []
        assert parent.exec("cat base.txt").stdout == "from the parent"  # the parent went on


def test_rollback_undoes_a_file_and_a_package_and_the_first_cell_says_state_lost(
        runner: Runner, tmp_path: Path) -> None:
    wheel = wheels.build_wheel(tmp_path)
    with runner.sandbox() as sb:
        sb.write_file("kept.txt", "before")
        assert sb.run_cell("x = 41\nx + 1").ok
        snap = sb.snapshot("clean")
        assert (snap.name, snap.backend, snap.memory, snap.network) == ("clean", "bubblewrap", False, "none")
        sb.upload(str(wheel), wheel.name)
        installed = sb.exec(f"python3 -m {PIP_USER} {wheel.name}", timeout=60)
        assert installed.exit_code == 0, installed.stderr
        assert sb.exec(f"python3 -c 'import {wheels.MODULE}'").exit_code == 0
        sb.write_file("kept.txt", "after")
        sb.write_file("later.txt", "after")
        opened_as = sb.aio.id
        sb.rollback(snap)
        assert sb.aio.id == opened_as  # the same sandbox, back in time
        assert sb.read_file("kept.txt") == b"before"
        assert sb.exec("ls").stdout == "kept.txt\n"
        assert sb.exec(f"python3 -c 'import {wheels.MODULE}'").exit_code != 0
        cell = sb.run_cell("'x' in globals()")
        assert cell.state_lost and any("state_lost" in n for n in cell.notes)
        assert not sb.run_cell("1").state_lost  # said once
        sb.rollback(snap)  # a snapshot serves many rollbacks
        runner.delete_snapshot(snap)
    assert _kept() == []


def test_a_sandbox_from_a_snapshot_gets_its_state_and_is_judged_anew(runner: Runner) -> None:
    with runner.sandbox() as sb:
        sb.write_file("a/b.txt", "deep")
        snap = sb.snapshot()
    with runner.sandbox(from_snapshot=snap) as again:
        assert again.read_file("a/b.txt") == b"deep"
        again.write_file("a/b.txt", "changed")
        again.rollback(snap.id)  # its id does as well as the Snapshot: from `execbox snapshot ls`, another process
        assert again.read_file("a/b.txt") == b"deep"
    with runner.sandbox(from_snapshot=snap.id) as by_id:
        assert by_id.read_file("a/b.txt") == b"deep"
    with pytest.raises(ConfigError, match="taken on the bubblewrap backend"):
        runner.sandbox("docker", from_snapshot=snap).open()
    runner.delete_snapshot(snap)
    with pytest.raises(SnapshotError, match="no snapshot"):
        runner.sandbox(from_snapshot=snap).open()


def test_a_snapshot_made_in_local_mode_does_not_bring_the_host_network_back(
        bubblewrap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_LOCAL", "true")
    with Runner(Settings.from_env(backend="bubblewrap")) as local, local.sandbox(network="host") as sb:
        snap = sb.snapshot()
    monkeypatch.delenv("CODE_EXEC_LOCAL")
    with Runner(Settings.from_env(backend="bubblewrap")) as today:
        with pytest.raises(NotASandboxError, match="CODE_EXEC_LOCAL"):
            today.sandbox(from_snapshot=snap).open()
        today.delete_snapshot(snap)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "manifest"])
def test_a_damaged_snapshot_is_refused_whole(runner: Runner, damage: str) -> None:
    with runner.sandbox() as sb:
        sb.write_file("data.bin", os.urandom(50_000))
        snap = sb.snapshot()
        sb.write_file("data.bin", "after")
        packed = store.workspace_of(snap.id)
        if damage == "flipped":
            _flip_a_byte(packed)
        elif damage == "truncated":
            os.truncate(packed, packed.stat().st_size // 2)
        else:
            (packed.parent / store.MANIFEST).write_text("{not json")
        with pytest.raises(SnapshotError, match="refused"):
            sb.rollback(snap)
        assert sb.read_file("data.bin") == b"after"  # never restored half-way: the sandbox is as it was
        with pytest.raises(SnapshotError, match="refused"):
            runner.sandbox(from_snapshot=snap).open()
        assert runner.aio.slots.in_use == 1  # only this sandbox holds a slot: nothing half-opened is left
    runner.delete_snapshot(snap.id)


def test_the_store_is_private_bounded_and_out_of_every_sandboxs_reach(
        runner: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    with runner.sandbox(secrets={"TOKEN": SECRET}) as sb:
        assert sb.exec("test -n \"$TOKEN\"").exit_code == 0
        snap = sb.snapshot()
        for directory, _, files in os.walk(store.root()):
            assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700, directory
            for name in files:  # the secret was given at run time, never written: it is nowhere in the store
                assert SECRET.encode() not in Path(directory, name).read_bytes()
        with pytest.raises(RefusedError, match="execbox"):
            runner.sandbox(mounts=[Mount(source=str(store.root()), target="/mnt/snapshots")]).open()
    monkeypatch.setenv("CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB", "1")
    with Runner(Settings.from_env(backend="bubblewrap")) as small, small.sandbox() as sb:
        sb.write_file("big.bin", os.urandom(2 << 20))
        with pytest.raises(SnapshotError, match="CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB"):
            sb.snapshot()
        assert [s.id for s in small.snapshots()] == [snap.id]  # the refused one left nothing
    runner.delete_snapshot(snap)


def test_expired_and_half_written_snapshots_are_collected(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    with runner.sandbox() as sb:
        old = sb.snapshot()
    half = store.new_place("bubblewrap")
    (half.directory.parent / store.WRITER).write_text("999999999 1")  # its writer died before the manifest
    mine = store.new_place("bubblewrap")  # this process is still writing it: not collected, nor removed by id
    assert sorted(runner.gc_snapshots()) == [half.id]
    with pytest.raises(SnapshotError, match="still being written"):
        runner.delete_snapshot(mine.id)
    assert (store.root() / mine.id).is_dir()
    monkeypatch.setenv("CODE_EXEC_SNAPSHOT_MAX_AGE_SEC", "0.001")
    with Runner(Settings.from_env(backend="bubblewrap")) as strict:
        with pytest.raises(SnapshotError, match="CODE_EXEC_SNAPSHOT_MAX_AGE_SEC"):
            strict.sandbox(from_snapshot=old).open()
        assert strict.gc_snapshots() == [old.id]
    store.remove(mine.id)
    assert _kept() == []


def test_snapshot_fork_rollback_restore_and_delete_are_audited(runner: Runner) -> None:
    with runner.sandbox() as sb:
        snap = sb.snapshot()
        sb.rollback(snap)
        for child in sb.fork(2):
            child.close()
    with runner.sandbox(from_snapshot=snap):
        pass
    runner.delete_snapshot(snap)
    seen = {e["event"]: e for e in events() if e["event"].startswith("snapshot.")}
    assert set(seen) == {"snapshot.create", "snapshot.rollback", "snapshot.fork", "snapshot.restore",
                         "snapshot.delete"}
    assert seen["snapshot.rollback"]["content_hash"] == snap.content_hash
    assert seen["snapshot.restore"]["snapshot"] == snap.id and len(seen["snapshot.fork"]["forks"]) == 2


def test_what_cannot_be_kept_is_refused_naming_the_capability(runner: Runner, local_mode: None) -> None:
    with runner.sandbox() as sb:
        with pytest.raises(UnsupportedPolicyError, match="memory_snapshot"):
            sb.snapshot(memory=True)
        snap = sb.snapshot()
        with pytest.raises(ConfigError, match="of another sandbox"), runner.sandbox() as other:
            other.rollback(snap)
    with Runner(Settings(backend="local_subprocess")) as local, local.sandbox() as sb:
        with pytest.raises(UnsupportedPolicyError, match="'snapshot'"):
            sb.snapshot()
    runner.delete_snapshot(snap)


@pytest.mark.parametrize("call", [
    lambda sb: sb.fork(0), lambda sb: sb.fork(65), lambda sb: sb.fork("2"), lambda sb: sb.fork(True),
    lambda sb: sb.rollback(42), lambda sb: sb.snapshot(name=3),
])
def test_bad_arguments_are_config_errors(runner: Runner, call: Any) -> None:
    with runner.sandbox() as sb, pytest.raises(ConfigError):
        call(sb)


@pytest.mark.parametrize("bad", ["../../etc", "", "ABCDEF0123456789", "0123456789abcdef/..", "-h", "x" * 65])
def test_a_snapshot_id_that_is_not_one_is_refused(runner: Runner, bad: str) -> None:
    with pytest.raises((SnapshotError, ConfigError)):
        runner.delete_snapshot(bad)


def test_a_snapshot_call_that_never_returns_is_bounded_and_leaves_nothing(
        only_local_builtin: None, local_mode: None, fake_dists: FakeDistributions) -> None:
    fake_dists.add(stuck_backends.DISTRIBUTION, ep_name="stuck", value="tests.support.stuck_backends")
    stuck_backends.RELEASE.clear()
    stuck_backends.DELETED.clear()
    try:
        settings = Settings(backend="stuck_snapshot", open_timeout_sec=1, backend_grace_sec=1)
        with Runner(settings) as runner, runner.sandbox(network="none") as sb:
            with pytest.raises(BackendTimeoutError, match="snapshot"):
                sb.snapshot()
            assert sb.aio.broken is not None
            assert _kept() == []  # the half-made snapshot's directory went, and the backend was asked to clean up
            assert len(stuck_backends.DELETED) == 1
    finally:
        stuck_backends.RELEASE.set()


@pytest.mark.engine
def test_docker_keeps_tmp_where_pip_user_packages_live(engine: Any, tmp_path: Path) -> None:
    wheel = wheels.build_wheel(tmp_path)
    with Runner(Settings(backend="docker")) as runner, runner.sandbox() as sb:
        sb.upload(str(wheel), wheel.name)
        assert sb.exec(f"{PIP_USER} {wheel.name} && rm {wheel.name}", timeout=60).exit_code == 0
        snap = sb.snapshot()
        [child] = sb.fork(1)
        with child:
            probe = f"python3 -c 'import {wheels.MODULE} as m; print(m.VALUE)'"
            assert child.exec(probe).stdout == f"{wheels.VALUE}\n"  # in /tmp/.local, outside the workspace
            sb.exec("rm -rf /tmp/.local")
            assert sb.exec(probe).exit_code != 0
            sb.rollback(snap)
            assert sb.exec(probe).stdout == f"{wheels.VALUE}\n"
        runner.delete_snapshot(snap)
    assert _kept() == []


def test_the_readme_example_runs_as_printed(runner: Runner) -> None:
    [example] = readme.blocks("### Snapshots: try, fork, roll back, resume later", "python")
    exec(compile(example, "README.md", "exec"), {})  # noqa: S102 - the README's own code


def test_what_the_code_left_is_kept_as_it_is_and_never_followed_out(runner: Runner) -> None:
    """Links to host files are kept as links (the host side never opens their targets); a FIFO is left out; a tree
    deeper than the transfer bound is refused with the transfer's own words, and nothing is kept."""
    with runner.sandbox() as sb:
        made = sb.exec("ln -s /etc/shadow shadow; ln -s / root; mkfifo pipe; mkdir -p d && echo x > d/f; "
                       "ln -s ../../../../../../etc/passwd d/up")
        assert made.exit_code == 0, made.stderr
        snap = sb.snapshot()
        kept = store.workspace_of(snap.id).read_bytes()
        assert b"root:" not in kept  # /etc/shadow and /etc/passwd of this host: never read
        with runner.sandbox(from_snapshot=snap) as again:
            listed = again.exec("readlink shadow root d/up; cat d/f; test -e pipe || echo no-fifo").stdout
            assert listed == "/etc/shadow\n/\n../../../../../../etc/passwd\nx\nno-fifo\n"
        runner.delete_snapshot(snap)
        deep = sb.exec("python3 -c \"import os\nfor _ in range(300): os.mkdir('n'); os.chdir('n')\"")
        assert deep.exit_code == 0, deep.stderr
        with pytest.raises(SnapshotError, match="deeper than"):
            sb.snapshot()
    assert _kept() == []


SNAPSHOTTER = """
import sys
from execbox import Runner, Settings
with Runner(Settings(backend="bubblewrap")) as runner, runner.sandbox() as sb:
    sb.exec("head -c 800M /dev/zero > big.bin", timeout=60)
    print("ready", flush=True)
    sb.snapshot()
"""


def test_a_caller_killed_while_snapshotting_leaves_what_gc_removes(bubblewrap: None, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    caller = subprocess.Popen([sys.executable, "-c", SNAPSHOTTER], stdout=subprocess.PIPE, text=True)
    assert caller.stdout is not None and caller.stdout.readline() == "ready\n"
    deadline = time.monotonic() + 60
    while not any((store.root() / d / store.WORKSPACE).exists() for d in _kept()):  # it is writing
        assert time.monotonic() < deadline and caller.poll() is None
        time.sleep(0.01)
    caller.send_signal(signal.SIGKILL)
    caller.wait(30)
    [half] = _kept()
    assert not (store.root() / half / store.MANIFEST).exists()
    with Runner(Settings(backend="bubblewrap")) as runner:
        assert runner.snapshots() == []  # a half-written one is never listed as a snapshot
        assert runner.gc_snapshots() == [half]
    assert _kept() == []


def test_a_fork_that_could_never_open_is_refused_at_once_and_a_failed_one_leaves_nothing(
        bubblewrap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with Runner(Settings(backend="bubblewrap", max_concurrent=3, queue_timeout_sec=1)) as runner:
        with runner.sandbox() as sb:
            with pytest.raises(ConfigError, match="CODE_EXEC_MAX_CONCURRENT"):
                sb.fork(3)
            with runner.sandbox():  # a slot taken by another sandbox: one of the two forks waits past its queue
                with pytest.raises(BusyError):  # the error as it is, not a group
                    sb.fork(2)
            assert runner.aio.slots.in_use == 1 and runner.snapshots() == []
    assert _kept() == []
