"""`execbox snapshot ls | rm | gc`, and what `execbox gc` says of snapshots, against real snapshots taken on
bubblewrap: listed (sizes readable, expired ones marked), removed by id (what is not an id, or not one here, is
refused and removes nothing), collected when expired or half-written by a process that died; the same through a
resident `execbox serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from execbox import Runner, Settings
from execbox.audit import reader as audit_reader
from execbox.cli import main
from execbox.config import paths
from execbox.errors import BackendUnavailableError
from execbox.runner import run_blocking
from execbox.runner import snapshots as store
from execbox.runner.snapshots import Snapshot
from execbox.testing import engine_missing
from tests.test_resident import Server, _env

pytestmark = pytest.mark.engine


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def runner() -> Iterator[Runner]:
    with Runner(Settings.from_env(backend="bubblewrap")) as runner:
        try:
            run_blocking(runner.aio.backend("bubblewrap").check)
        except BackendUnavailableError as exc:
            engine_missing(f"bubblewrap cannot run here: {exc}")
        yield runner


@pytest.fixture
def two(runner: Runner) -> list[Snapshot]:
    """Two snapshots of one bubblewrap sandbox, the second holding a 3 MiB file."""
    with runner.sandbox("bubblewrap") as sb:
        sb.exec("echo first > a.txt")
        first = sb.snapshot("first")
        sb.exec("head -c 3145728 /dev/zero > big.bin")
        second = sb.snapshot()
    return [first, second]


def half_written_by_a_dead_process() -> str:
    """A snapshot directory begun by another process, which died before it sealed it."""
    code = "from execbox.runner import snapshots; print(snapshots.new_place('bubblewrap').id)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip()


def test_ls_shows_each_snapshot_and_rm_removes_it(two: list[Snapshot]) -> None:
    first, second = two
    listed = cli("snapshot", "ls", "--json")
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [r["id"] for r in rows] == [first.id, second.id]
    assert rows[0]["name"] == "first" and rows[1]["name"] is None
    assert rows[1]["size"] == second.size > 3 << 20
    assert {r["backend"] for r in rows} == {"bubblewrap"} and {r["network"] for r in rows} == {"none"}
    assert not rows[0]["memory"] and not rows[0]["expired"] and 0 <= rows[0]["age_s"] < 120
    assert rows[0]["source"] == first.source and rows[0]["created"].startswith(f"{first.created:%Y-%m-%dT%H:%M}")

    table = cli("snapshot", "ls").stdout.splitlines()
    assert table[0].split()[:5] == ["ID", "NAME", "BACKEND", "NETWORK", "CREATED"]
    assert table[1].startswith(f"{first.id}  first ") and " bubblewrap " in table[1]
    assert table[2].startswith(f"{second.id}  -  ") and " 3.0 MiB " in table[2], table[2]

    removed = cli("snapshot", "rm", first.id)
    assert (removed.exit_code, removed.stdout) == (0, f"removed {first.id}\n")
    assert [s.id for s in store.listing()] == [second.id] and not (store.root() / first.id).exists()
    records = list(audit_reader.records(paths.state_dir() / "audit.jsonl"))
    assert [r["snapshot"] for r in records if r["event"] == "snapshot.delete"] == [first.id]
    assert json.loads(cli("snapshot", "rm", second.id, "--json").stdout) == {"removed": [second.id]}
    assert cli("snapshot", "ls").stdout == "no snapshots kept for this user\n"
    assert cli("snapshot", "ls", "--json").stdout.strip() == "[]"


@pytest.mark.parametrize("bad", ["../x", "--help", "", "0123456789abcdef", "ABCDEF0123456789", "a" * 65])
def test_rm_refuses_what_is_not_a_snapshot_here_and_removes_nothing(two: list[Snapshot], bad: str) -> None:
    first, _ = two
    done = cli("snapshot", "rm", first.id, "--", bad)
    assert done.exit_code == 1 and done.stdout == "", done.output
    assert done.stderr.startswith("execbox: SnapshotError: ") and "Traceback" not in done.stderr, done.stderr
    assert ("no snapshot" if bad == "0123456789abcdef" else "is not a snapshot id") in done.stderr
    as_json = cli("snapshot", "rm", "--json", first.id, "--", bad)
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["error"]["type"] == "SnapshotError"
    assert len(store.listing()) == 2  # the good id among them was not removed either
    assert cli("snapshot", "rm").exit_code == 2  # no id at all: a usage error


def test_rm_refuses_a_snapshot_still_being_written_and_removes_nothing(two: list[Snapshot]) -> None:
    first, _ = two
    writing = store.new_place("bubblewrap")  # this (live) process is writing it
    try:
        done = cli("snapshot", "rm", first.id, writing.id)
        assert done.exit_code == 1 and "still being written" in done.stderr, done.output
        assert len(store.listing()) == 2 and (store.root() / writing.id).is_dir()
    finally:
        store.remove(writing.id)


def test_gc_removes_the_expired_and_the_half_written_and_keeps_the_rest(
        two: list[Snapshot], monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = two
    dead = half_written_by_a_dead_process()
    writing = store.new_place("bubblewrap").id  # begun by this process, alive: still being written
    assert store.leftovers() == [dead]
    time.sleep(3.5)
    with Runner(Settings.from_env(backend="bubblewrap")) as runner, runner.sandbox("bubblewrap") as sb:
        fresh = sb.snapshot("fresh")
    monkeypatch.setenv("CODE_EXEC_SNAPSHOT_MAX_AGE_SEC", "3")
    rows = {r["id"]: r for r in json.loads(cli("snapshot", "ls", "--json").stdout)}
    assert [rows[s.id]["expired"] for s in (first, second, fresh)] == [True, True, False]
    assert "(expired)" in cli("snapshot", "ls").stdout

    done = cli("snapshot", "gc", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == {"removed": [first.id, second.id, dead], "kept": 1}
    assert [s.id for s in store.listing()] == [fresh.id]
    assert sorted(p.name for p in store.root().iterdir()) == sorted([fresh.id, writing])
    again = cli("snapshot", "gc")
    assert again.stdout.splitlines()[0] == "snapshots: removed 0"
    assert "1 kept" in again.stdout and "`execbox snapshot rm ID`" in again.stdout


def test_execbox_gc_collects_expired_snapshots_and_says_how_many_it_keeps(
        two: list[Snapshot], monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = two
    text = cli("gc", "--backend", "bubblewrap")
    assert text.exit_code == 0, text.output
    said = text.stdout.splitlines()[-1]
    assert said.startswith("snapshots: 2 kept (3.0 MiB)"), said
    assert "`execbox snapshot rm ID`" in said and "`execbox snapshot gc`" in said
    assert len(store.listing()) == 2  # in date: never removed by gc

    other = cli("gc", "--backend", "local_subprocess", "--json")  # another backend's: not its snapshots
    assert json.loads(other.stdout)["snapshots"] == {"removed": [], "kept": 0}
    time.sleep(1.5)
    monkeypatch.setenv("CODE_EXEC_SNAPSHOT_MAX_AGE_SEC", "1")
    report = json.loads(cli("gc", "--backend", "bubblewrap", "--json").stdout)
    assert report["snapshots"] == {"removed": [first.id, second.id], "kept": 0}
    assert store.listing() == []


def test_the_snapshot_commands_through_a_resident_server(two: list[Snapshot], tmp_path: Path) -> None:
    first, second = two
    env = _env(XDG_STATE_HOME=os.environ["XDG_STATE_HOME"])
    server = Server(str(tmp_path / "execbox.sock"), env)
    try:
        for args in (["snapshot", "rm", "--", "../x"], ["snapshot", "rm", "0123456789abcdef", "--json"],
                     ["snapshot", "--help"]):
            here = subprocess.run([str(Path(sys.executable).parent / "execbox"), *args], capture_output=True,
                                  text=True, env=env, timeout=120)
            there = server.run(*args)
            assert (there.returncode, there.stdout, there.stderr) == (here.returncode, here.stdout, here.stderr)
            assert there.returncode in (0, 1) and there.stdout + there.stderr, there
        listed = json.loads(server.run("snapshot", "ls", "--json").stdout)
        assert [(r["id"], r["size"]) for r in listed] == [(first.id, first.size), (second.id, second.size)]
        removed = server.run("snapshot", "rm", first.id, second.id)
        assert (removed.returncode, removed.stdout) == (0, f"removed {first.id}\nremoved {second.id}\n")
        assert store.listing() == []
    finally:
        server.stop()
