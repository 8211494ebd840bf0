"""What a SIGKILLed caller's local_subprocess session leaves (its workspace directory) is removed by gc, and only
that: never a live owner's workspace, never a directory another user made, one whose owner cannot be told, or
one of an older naming, and never anything a link points at.

Every caller runs with a private TMPDIR (this process's gc looks there too), so that no other execbox process on
this host sweeps the leftovers before the test has looked at them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox.plugin import OWNER_FILE, name_owner, remove_tree
from execbox.runner import run_blocking

EXECBOX = str(Path(sys.executable).with_name("execbox"))
PREFIX = "execbox-local-"

# Opens a local_subprocess session, writes a file in it from the command, prints the workspace (the command's
# cwd) and stays until killed.
HOLDER = """
import sys, time
from execbox import Runner, Settings
runner = Runner(Settings.from_env(backend="local_subprocess", local=True, network="host"))
with runner.sandbox() as sb:
    result = sb.exec(["sh", "-c", "echo precious > kept.txt && pwd"])
    print(result.stdout.strip(), flush=True)
    time.sleep(3600)
"""


@dataclass
class Place:
    tmp: Path
    children: list[subprocess.Popen[str]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CODE_EXEC_")}
        env.update(TMPDIR=str(self.tmp), CODE_EXEC_LOCAL="true")
        return env

    def holder(self) -> tuple[subprocess.Popen[str], Path]:
        """A live caller holding a session, and its workspace (checked to hold the file it wrote)."""
        child = subprocess.Popen([sys.executable, "-c", HOLDER], env=self.env(), stdout=subprocess.PIPE, text=True)
        self.children.append(child)
        assert child.stdout is not None
        workspace = Path(child.stdout.readline().strip())
        assert workspace.is_absolute() and (workspace / "kept.txt").read_text() == "precious\n", workspace
        return child, workspace

    def orphan(self) -> Path:
        """The session directory of a caller SIGKILLed while it held the session (left behind, as it was)."""
        child, workspace = self.holder()
        child.send_signal(signal.SIGKILL)
        child.wait()
        root = workspace.parent
        assert root.parent == self.tmp and name_owner(root.name, PREFIX) is not None, root
        assert (workspace / "kept.txt").exists()  # nothing cleaned it: only gc can
        return root


@pytest.fixture
def place(monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    tmp = Path(tempfile.mkdtemp(prefix="execbox-localgc-"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # this process's gc looks where the callers put things
    here = Place(tmp)
    try:
        yield here
    finally:
        for child in here.children:
            if child.poll() is None:
                child.kill()
            child.wait()
        remove_tree(str(tmp))


def gc_here() -> list[str]:
    return run_blocking(Runner(Settings(backend="local_subprocess", local=True)).aio.backend("local_subprocess").gc)


def test_gc_removes_the_workspace_a_sigkilled_caller_left(place: Place) -> None:
    root = place.orphan()
    removed = gc_here()
    assert removed == [str(root)]
    assert not os.path.lexists(root)
    assert gc_here() == []  # gone for good: nothing to report twice


def test_gc_in_another_process_keeps_a_live_sessions_workspace(place: Place) -> None:
    live_child, live = place.holder()
    dead = place.orphan()  # second: the first use in the live caller would have swept it
    out = subprocess.run([EXECBOX, "gc", "--backend", "local_subprocess", "--json"], env=place.env(),
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["removed"] == {"local_subprocess": [str(dead)]}
    assert not os.path.lexists(dead)
    assert live_child.poll() is None and (live / "kept.txt").read_text() == "precious\n"
    assert (live.parent / OWNER_FILE).is_file()


def test_the_next_first_use_sweeps_what_a_killed_caller_left(place: Place) -> None:
    root = place.orphan()
    run = subprocess.run([EXECBOX, "run", "--backend", "local_subprocess", "--network", "host", "--", "true"],
                         env=place.env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert not os.path.lexists(root)


def test_gc_never_follows_a_link_nor_takes_what_it_cannot_tell_is_an_orphan(place: Place) -> None:
    root = place.orphan()  # the positive control: gc does sweep here
    owner = name_owner(root.name, PREFIX)
    assert owner is not None
    dead = f"{PREFIX}{owner[0]}-{owner[1]}"  # names that claim the same dead owner
    target = place.tmp / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("x")

    link = place.tmp / f"{dead}-link"
    link.symlink_to(target)
    garbage = place.tmp / f"{dead}-garbage"  # an owner file gc cannot read as an owner: never judged
    garbage.mkdir()
    (garbage / OWNER_FILE).write_text("\x00 not an owner\n")
    (garbage / "f").write_text("x")
    older = place.tmp / f"{PREFIX}abc123_z"  # an older execbox's random name: it carries no owner
    older.mkdir()
    (older / "f").write_text("x")
    # A dead-owner session whose tree holds links out (an owner file and an entry that point at the target).
    (root / "workspace" / "out").symlink_to(target)
    (root / OWNER_FILE).unlink()
    (root / OWNER_FILE).symlink_to(target / "precious")
    foreign = place.tmp / f"{dead}-foreign"  # another user's directory with our prefix and a dead owner's name
    if os.geteuid() == 0:
        foreign.mkdir()
        (foreign / "f").write_text("x")
        os.chown(foreign / "f", 65534, 65534)
        os.chown(foreign, 65534, 65534)

    removed = gc_here()

    assert removed == [str(root)]
    assert not os.path.lexists(root)
    assert (target / "precious").read_text() == "x" and sorted(os.listdir(target)) == ["precious"]
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (garbage / "f").exists() and (older / "f").exists()
    if os.geteuid() == 0:
        assert (foreign / "f").exists()
