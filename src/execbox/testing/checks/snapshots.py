"""Checks of snapshots (``Capabilities(snapshot=True)``): a fork's children and a rollback see exactly the state they
should, in the workspace (the runner's part) and outside it, under /tmp (the backend's part: HOME and pip's --user
live there on some); a package installed after a snapshot is gone after a rollback; a file-only snapshot's first
cell says ``state_lost`` (and with ``memory_snapshot`` a variable survives); closing and deleting leave nothing;
a corrupted or truncated snapshot is refused whole, with no sandbox left open."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from execbox import ExecboxError, Sandbox, Snapshot, SnapshotError
from execbox.plugin import state_dir
from execbox.testing.framework import Family, Kit, Unavailable, expect, shown
from execbox.testing.host import pure_wheel

family = Family()

FORKS = 4
# Outside the workspace, where only the backend's part of a snapshot keeps it.
OUTSIDE = "/tmp/execbox-kit-snapshot.txt"
LATER = "/tmp/execbox-kit-later.txt"
# What the state of a sandbox reads as: the workspace file, then the one outside ("-": missing).
_READ = f"for f in kit.txt {OUTSIDE}; do cat \"$f\" 2>/dev/null || echo -; done"
PACKAGE = "execbox_kit_snapshot_probe"


def _claim(what: str) -> str:
    return f"snapshot=True ({what})"


def _write(sb: Sandbox, value: str, claim: str) -> None:
    done = sb.exec(f"echo {value} > kit.txt && echo {value} > {OUTSIDE}")
    expect(done.exit_code == 0, claim, f"the code to write {value!r} in the workspace and in {OUTSIDE}", shown(done))


def _read(sb: Sandbox) -> tuple[str, ...]:
    return tuple(sb.exec(_READ).stdout.split())


def _python(sb: Sandbox, claim: str) -> None:
    """python3 runs in the sandbox: what a check asks of it next is not mistaken for a missing interpreter."""
    ran = sb.exec(["python3", "-c", "print(3)"])
    expect(ran.stdout == "3\n", claim, "python3 to run in the sandbox", shown(ran))


def _mine(kit: Kit, sb: Sandbox) -> list[str]:
    """The ids of the snapshots taken of ``sb`` that the runner lists."""
    return [s.id for s in kit.runner.snapshots() if s.origin == sb.aio.id]


@family.check("snapshot=True: each of 4 forks starts in the parent's state, and a change in one (in the workspace "
              "and under /tmp) shows in that fork only, never in the parent")
def check_snapshot_forks_isolated(kit: Kit) -> str:
    kit.require(snapshot=True)
    claim = _claim("forks isolated")
    with kit.sandbox() as sb:
        _write(sb, "parent", claim)
        children: list[Sandbox] = []
        forking = _failure(lambda: children.extend(sb.fork(FORKS)))
        expect(forking is None, claim, f"{FORKS} forks started", forking)
        try:
            started = [_read(child) for child in children]
            expect(started == [("parent", "parent")] * FORKS, claim,
                   f"every fork to start with the parent's files (workspace, {OUTSIDE})", started)
            for index, child in enumerate(children):
                _write(child, f"child-{index}", claim)
            seen = [_read(child) for child in children]
            expect(seen == [(f"child-{i}", f"child-{i}") for i in range(FORKS)], claim,
                   "each fork to see its own change only", seen)
            parent = _read(sb)
            expect(parent == ("parent", "parent"), claim, "the parent unchanged by its forks", parent)
        finally:
            for child in children:
                child.close()
    return f"{FORKS} forks, each with its own workspace and {OUTSIDE}"


@family.check("snapshot=True: a rollback undoes the files written after the snapshot, in the workspace and under "
              "/tmp, and keeps those written before")
def check_snapshot_rollback_undoes_files(kit: Kit) -> None:
    kit.require(snapshot=True)
    claim = _claim("rollback undoes files")
    with kit.sandbox() as sb:
        _write(sb, "before", claim)
        snap = sb.snapshot()
        try:
            _write(sb, "after", claim)
            later = sb.exec(f"echo later > later.txt && echo later > {LATER}")
            expect(later.exit_code == 0, claim, "the code to write new files after the snapshot", shown(later))
            sb.rollback(snap)
            seen = sb.exec(f"{_READ}; ls later.txt {LATER} 2>&1 >/dev/null | wc -l")
            expect(seen.stdout.split() == ["before", "before", "2"], claim, "the files as they were at the snapshot "
                   f"(kit.txt and {OUTSIDE} 'before', later.txt and {LATER} gone)", shown(seen))
        finally:
            kit.runner.delete_snapshot(snap)


# From /, so the workspace is not what finds the module; the user's site-packages are where pip --user put it.
_IMPORT = f"cd / && python3 -c 'import {PACKAGE}; print({PACKAGE}.MARK)'"


@family.check("snapshot=True: a rollback undoes a package pip --user installed after the snapshot")
def check_snapshot_rollback_undoes_a_package(kit: Kit) -> None:
    kit.require(snapshot=True)
    claim = _claim("rollback undoes a package")
    with kit.sandbox() as sb:
        _python(sb, claim)
        pip = sb.exec("python3 -m pip --version || echo no-pip")
        if "no-pip" in pip.stdout:
            raise Unavailable(f"the sandbox has no pip to install a package with: {shown(pip)}")
        snap = sb.snapshot()
        try:
            wheel, data = pure_wheel(PACKAGE, "1.0", {f"{PACKAGE}.py": b"MARK = 'installed after the snapshot'\n"})
            sb.write_file(wheel, data)
            # Debian's python refuses --user installs (PEP 668) unless told; an older pip ignores the variable.
            installed = sb.exec(f"PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --user --no-index --no-deps "
                                f"--disable-pip-version-check ./{wheel} && rm {wheel} && {_IMPORT}")
            expect(installed.exit_code == 0 and "installed after the snapshot" in installed.stdout, claim,
                   "the wheel installed with pip --user and imported", shown(installed))
            sb.rollback(snap)
            after = sb.exec(_IMPORT)
            expect(after.exit_code != 0 and "ModuleNotFoundError" in after.stderr, claim,
                   "the import to fail after the rollback (ModuleNotFoundError)", shown(after))
        finally:
            kit.runner.delete_snapshot(snap)


@family.check("memory_snapshot=True: a run_cell variable survives a rollback and a sandbox started from the snapshot")
def check_snapshot_memory_kept(kit: Kit) -> None:
    kit.require(snapshot=True, sessions=True, memory_snapshot=True)
    claim = "memory_snapshot=True (a variable survives)"
    with kit.sandbox() as sb:
        _python(sb, claim)
        first = sb.run_cell("kit_value = 41")
        expect(first.ok, claim, "the cell to run", first)
        snap = sb.snapshot(memory=True)
        try:
            changed = sb.run_cell("kit_value = 0")
            expect(changed.ok, claim, "the cell to run", changed)
            sb.rollback(snap)
            back = sb.run_cell("print(kit_value + 1)")
            expect(back.ok and not back.state_lost and back.stdout == "42\n", claim,
                   "kit_value 41 again after the rollback, state kept", back)
            with kit.runner.sandbox(from_snapshot=snap) as started:
                seen = started.run_cell("print(kit_value + 1)")
            expect(seen.ok and not seen.state_lost and seen.stdout == "42\n", claim,
                   "kit_value 41 in a sandbox started from the snapshot", seen)
        finally:
            kit.runner.delete_snapshot(snap)


@family.check("snapshot=True: after a rollback to a snapshot of files only, the first cell runs in a fresh "
              "interpreter over the snapshot's files and says state_lost; the next does not")
def check_snapshot_files_only_says_state_lost(kit: Kit) -> None:
    kit.require(snapshot=True, sessions=True)
    claim = _claim("state_lost after a files-only rollback")
    with kit.sandbox() as sb:
        _write(sb, "before", claim)
        set_it = sb.run_cell("kit_value = 41")
        expect(set_it.ok, claim, "the cell to run", set_it)
        snap = sb.snapshot()
        try:
            _write(sb, "after", claim)
            sb.rollback(snap)
            # The cell proves the rollback happened (the snapshot's files) before its missing variable counts.
            first = sb.run_cell(f"print(open('kit.txt').read().strip(), open('{OUTSIDE}').read().strip())\n"
                                "print('kit_value' in globals())")
            expect(first.stdout.split() == ["before", "before", "False"], claim,
                   f"the first cell to read the snapshot's files (kit.txt, {OUTSIDE}) without kit_value", first)
            expect(first.state_lost, claim, "the first cell after the rollback to say state_lost", first)
            second = sb.run_cell("1 + 1")
            expect(second.ok and not second.state_lost, claim, "the next cell not to say state_lost", second)
        finally:
            kit.runner.delete_snapshot(snap)


@family.check("snapshot=True: closing a fork's children removes the snapshot they started from; a deleted snapshot "
              "is gone; the snapshots' gc then finds none of them")
def check_snapshot_nothing_left_behind(kit: Kit) -> None:
    kit.require(snapshot=True)
    claim = _claim("nothing left behind")
    store = state_dir() / "snapshots"  # the runner's store: one directory per snapshot id
    with kit.sandbox() as sb:
        _write(sb, "parent", claim)
        children = sb.fork(2)
        try:
            forked = _mine(kit, sb)
            expect(len(forked) == 1 and (store / forked[0]).is_dir(), claim,
                   f"the fork's snapshot listed by runner.snapshots() and kept under {store}", forked)
        finally:
            failed = [_failure(child.close) for child in children]
        expect(failed == [None] * len(children), claim, "the fork's children to close, removing their snapshot",
               failed)
        left = _mine(kit, sb)
        expect(not left, claim, "the fork's snapshot gone once its children closed", left)
        snap = sb.snapshot()
        expect(_mine(kit, sb) == [snap.id], claim, "the new snapshot listed", _mine(kit, sb))
        deleting = _failure(lambda: kit.runner.delete_snapshot(snap))
        expect(deleting is None, claim, "runner.delete_snapshot to remove the snapshot", deleting)
    gone = [forked[0], snap.id]
    kept = sorted({*_mine(kit, sb)} | {i for i in gone if os.path.lexists(store / i)})
    expect(not kept, claim, f"the deleted snapshot unlisted and nothing of either left under {store}", kept)
    # The gc removes this user's expired and half-written snapshots (what it is for): only ours count here.
    collected = sorted(set(kit.runner.gc_snapshots()) & set(gone))
    expect(not collected, claim, "the snapshots' gc to find nothing of them", collected)


def _failure(call: Callable[[], object]) -> str | None:
    """What ``call`` raised (an ExecboxError), or None: a removal that fails is a claim that fails, said."""
    try:
        call()
    except ExecboxError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _refused(kit: Kit, snap: Snapshot, what: str, claim: str, sb: Sandbox) -> None:
    """Starting from ``snap`` and rolling ``sb`` back to it are refused with SnapshotError; no sandbox is left
    open, and ``sb`` goes on as it was."""
    slots = kit.runner.aio.slots.in_use
    started = kit.runner.sandbox(from_snapshot=snap)
    try:
        started.open()
    except SnapshotError:
        pass
    else:
        started.close()
        raise AssertionError(f"{claim}: expected SnapshotError for a sandbox started from {what}; saw it open")
    expect(kit.runner.aio.slots.in_use == slots, claim, f"no sandbox left open by the refused start from {what}",
           f"{kit.runner.aio.slots.in_use - slots} more sandbox(es) holding a slot")
    try:
        sb.rollback(snap)
    except SnapshotError:
        pass
    else:
        raise AssertionError(f"{claim}: expected SnapshotError for a rollback to {what}; saw it done")
    expect(kit.runner.aio.slots.in_use == slots, claim, f"no sandbox left open by the refused rollback to {what}",
           f"{kit.runner.aio.slots.in_use - slots} more sandbox(es) holding a slot")
    seen = _read(sb)
    expect(seen == ("later", "later"), claim, f"the sandbox as it was after the refused rollback to {what}", seen)


def _damaged(directory: Path, claim: str, change: Callable[[Path], None], *, backend_part: bool) -> str:
    """Change one file of a snapshot's directory: its packed workspace, or (``backend_part``) the largest file of
    the backend's part when it keeps one there."""
    target = directory / "workspace.tar"
    if backend_part:
        data = [p for p in (directory / "data").rglob("*") if p.is_file() and not p.is_symlink()]
        target = max(data, key=lambda p: p.stat().st_size, default=target)
    expect(target.is_file() and target.stat().st_size > 1, claim, f"the snapshot's files under {directory}",
           sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) if directory.is_dir() else "nothing")
    change(target)
    return str(target.relative_to(directory))


def _flip(path: Path) -> None:
    with open(path, "r+b") as file:
        file.seek(path.stat().st_size // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


@family.check("snapshot=True: a corrupted snapshot (a byte flipped) and a truncated one are refused with "
              "SnapshotError, whole: no sandbox starts from them and a rollback to them leaves the sandbox as it was")
def check_snapshot_damaged_refused(kit: Kit) -> str:
    kit.require(snapshot=True)
    claim = _claim("a damaged snapshot refused")
    store = state_dir() / "snapshots"
    with kit.sandbox() as sb:
        _write(sb, "intact", claim)
        corrupted, truncated = sb.snapshot(), sb.snapshot()
        try:
            # The control: intact, it restores (in the workspace and outside it), so a refusal is the damage's.
            with kit.runner.sandbox(from_snapshot=truncated) as restored:
                seen = _read(restored)
            expect(seen == ("intact", "intact"), claim, f"a sandbox started from the intact snapshot to read its "
                   f"files (workspace, {OUTSIDE})", seen)
            _write(sb, "later", claim)
            flipped = _damaged(store / corrupted.id, claim, _flip, backend_part=False)
            _refused(kit, corrupted, f"a snapshot with a byte flipped in {flipped}", claim, sb)
            cut = _damaged(store / truncated.id, claim, _truncate, backend_part=True)
            _refused(kit, truncated, f"a snapshot with {cut} truncated", claim, sb)
        finally:
            kit.runner.delete_snapshot(corrupted)
            kit.runner.delete_snapshot(truncated)
    return f"refused: a byte flipped in {flipped}, {cut} truncated"
