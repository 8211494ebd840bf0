"""The probe cache keeps an engine's facts across processes only while they can be trusted: this user's private
file, the same key, not too old; anything else there is ignored, never read as facts."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from execbox.kit import probecache


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "probes"
    monkeypatch.setattr(probecache, "cache_dir", lambda: str(where))
    return where


KEY = ["unix:///run/x.sock", 1, 2, 3]
FACTS = {"api_version": "1.41", "info": {"DefaultRuntime": "runc"}}


def only_record(cache: Path) -> Path:
    (record,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return record


def test_stored_facts_come_back_for_the_same_key_only(cache: Path) -> None:
    probecache.store_probe_facts("docker", KEY, FACTS)
    assert probecache.load_probe_facts("docker", KEY, 60) == FACTS
    assert probecache.load_probe_facts("docker", [*KEY[:-1], 4], 60) is None
    assert probecache.load_probe_facts("podman", KEY, 60) is None
    assert probecache.load_probe_facts("docker", KEY, 0) is None  # 0: the cache is off
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    assert oct(only_record(cache).stat().st_mode & 0o777) == oct(0o600)


def test_a_record_older_than_the_limit_or_from_the_future_is_not_used(cache: Path) -> None:
    probecache.store_probe_facts("docker", KEY, FACTS)
    record = only_record(cache)
    data = json.loads(record.read_text())
    for at in (time.time() - 61, time.time() + 3600):
        record.write_text(json.dumps({**data, "at": at}))
        assert probecache.load_probe_facts("docker", KEY, 60) is None


def test_a_record_of_another_key_under_this_name_is_not_used(cache: Path) -> None:
    """The file name is a hash; the key inside is what counts (a collision, or a file copied in place)."""
    probecache.store_probe_facts("docker", KEY, FACTS)
    record = only_record(cache)
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "key": ["docker", "unix:///other.sock", 1, 2, 3]}))
    assert probecache.load_probe_facts("docker", KEY, 60) is None


@pytest.mark.parametrize("spoil", ["group-writable", "symlink", "not json", "not a dict", "facts not a dict",
                                   "huge", "fifo"])
def test_anything_but_a_private_well_formed_record_is_ignored(cache: Path, tmp_path: Path, spoil: str) -> None:
    probecache.store_probe_facts("docker", KEY, FACTS)
    record = only_record(cache)
    data = json.loads(record.read_text())
    if spoil == "group-writable":
        record.chmod(0o620)
    elif spoil == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text(record.read_text())
        elsewhere.chmod(0o600)
        record.unlink()
        record.symlink_to(elsewhere)
    elif spoil == "not json":
        record.write_text("{")
    elif spoil == "not a dict":
        record.write_text("[1, 2]")
    elif spoil == "facts not a dict":
        record.write_text(json.dumps({**data, "facts": ["runc"]}))
    elif spoil == "huge":
        record.write_text(json.dumps({**data, "pad": "x" * (100 << 10)}))
    elif spoil == "fifo":
        record.unlink()
        os.mkfifo(record, 0o600)  # a reader that opened it blocking would wait for ever
    assert probecache.load_probe_facts("docker", KEY, 60) is None


def test_a_directory_others_can_write_is_neither_read_nor_written(cache: Path) -> None:
    probecache.store_probe_facts("docker", KEY, FACTS)
    cache.chmod(0o777)
    assert probecache.load_probe_facts("docker", KEY, 60) is None
    only_record(cache).unlink()
    probecache.store_probe_facts("docker", KEY, FACTS)
    assert not [p for p in cache.iterdir()]


def test_a_directory_that_is_a_link_is_not_used(cache: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    cache.symlink_to(real)
    probecache.store_probe_facts("docker", KEY, FACTS)
    assert not list(real.iterdir())
    assert probecache.load_probe_facts("docker", KEY, 60) is None


def test_facts_that_cannot_be_written_are_simply_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(probecache, "cache_dir", lambda: str(blocker / "probes"))
    probecache.store_probe_facts("docker", KEY, FACTS)  # no error: the cache only saves time
    probecache.store_probe_facts("docker", KEY, {"unserialisable": object()})
    assert probecache.load_probe_facts("docker", KEY, 60) is None


def test_cache_dir_is_execbox_s_own_cache_place(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Inside a place the guard never mounts into a sandbox (guard.mounts.execbox_state_dirs)."""
    from execbox.guard.mounts import execbox_state_dirs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    where = probecache.cache_dir()
    assert any(where.startswith(place + "/") for place in execbox_state_dirs())


def test_the_engine_instance_changes_when_its_socket_is_made_anew(tmp_path: Path) -> None:
    """A restarted daemon binds its socket again: a new inode, so facts probed before are not used."""
    from execbox.backends.docker import engine

    path = tmp_path / "docker.sock"
    first = socket.socket(socket.AF_UNIX)
    first.bind(str(path))
    before = engine.instance(f"unix://{path}")
    first.close()
    path.unlink()
    second = socket.socket(socket.AF_UNIX)
    second.bind(str(path))
    after = engine.instance(f"unix://{path}")
    second.close()
    assert before is not None and after is not None and before != after
    assert engine.instance("tcp://127.0.0.1:2375") is None
    assert engine.instance(f"unix://{tmp_path}/missing.sock") is None
