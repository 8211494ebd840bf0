"""Checks of whole files and directories: upload / list_files / download round trips, planted links never
followed, read_file of a directory, transfer bounds checked before reading, and collect."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from execbox import Runner, TransferTooLargeError, WorkspacePathError
from execbox.testing.framework import Family, Kit, expect, expect_raises, shown
from execbox.testing.probes import HOSTILE_TREE

family = Family()


def _local_tree(root: Path) -> dict[str, Any]:
    """Every entry below ``root``, never followed: file -> (bytes, executable), directory -> "dir", link -> "link"."""
    found: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = "link"
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = (path.read_bytes(), os.access(path, os.X_OK))
    return found


def _sample_tree(root: Path) -> None:
    (root / "deep/er/est").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_text("alpha\n")
    (root / "space name.txt").write_bytes(b"\x00\xff binary \n")
    (root / "deep/er/est/x.bin").write_bytes(os.urandom(300 << 10))
    (root / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (root / "run.sh").chmod(0o755)
    for path in [root, *root.rglob("*")]:  # readable by a sandbox user other than this process's
        if path.is_dir():
            path.chmod(0o755)


@family.check("a directory round-trips through upload, list_files and download, byte for byte")
def check_directory_round_trip(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a directory round-trips through upload, list_files and download, byte for byte"
    with tempfile.TemporaryDirectory() as tmp:
        src, back = Path(tmp, "src"), Path(tmp, "back")
        src.mkdir()
        _sample_tree(src)
        with kit.sandbox() as sb:
            sb.upload(src, "data")
            ran = sb.exec(["sh", "-c", "cat data/a.txt && wc -c < data/deep/er/est/x.bin && ./data/run.sh"])
            expect(ran.stdout.split() == ["alpha", str(300 << 10), "ran"], claim,
                   "the code to read the uploaded files and run the executable one", shown(ran))
            listing = {e.path: (e.type, e.size) for e in sb.list_files("data", recursive=True)}
            expect(listing.get("data/deep/er/est/x.bin") == ("file", 300 << 10) and listing.get("data/empty") ==
                   ("directory", 0) and listing.get("data/a.txt") == ("file", 6), claim,
                   "list_files to give every path with its type and size", listing)
            top = {e.name: e.type for e in sb.list_files(".")}
            expect(top.get("data") == "directory", claim, "data listed at the top of the workspace", top)
            sb.download("data", back)
        expect(_local_tree(back) == _local_tree(src), claim, "the downloaded tree to equal the uploaded one",
               sorted(set(_local_tree(back).items()) ^ set(_local_tree(src).items()), key=str)[:6])


@family.check("a symlink the code planted is not followed on download, and not created here")
def check_planted_symlink_not_followed_on_download(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a symlink the code planted is not followed on download, and not created here"
    with tempfile.TemporaryDirectory() as tmp, kit.sandbox() as sb:
        planted = sb.exec("mkdir -p out/sub && echo kept > out/sub/ok.txt && ln -s /etc/passwd out/passwd && "
                          "ln -s / out/root && ln -s ../../.. out/sub/up && ln -s /etc/passwd single")
        expect(planted.exit_code == 0, claim, "the code to plant the links", shown(planted))
        moved = sb.download("out", Path(tmp, "out"))
        tree = _local_tree(Path(tmp, "out"))
        expect(tree == {"sub": "dir", "sub/ok.txt": (b"kept\n", False)}, claim,
               "only the real file and directory, no link and nothing read through one", tree)
        expect(any("out/passwd" in s for s in moved.skipped), claim, "the skipped link reported", moved.skipped)
        sb.download("single", Path(tmp, "single"))
        expect(not os.path.lexists(Path(tmp, "single")), claim, "no file made for a downloaded link",
               os.listdir(tmp))


@family.check("read_file of a directory says to use list_files or download")
def check_read_file_of_a_directory(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "read_file of a directory says to use list_files or download"
    with kit.sandbox() as sb:
        made = sb.exec("mkdir -p d && echo x > d/f.txt")
        expect(made.exit_code == 0, claim, "the code to make a directory", shown(made))
        for path in (".", "d"):
            try:
                sb.read_file(path)
            except WorkspacePathError as exc:
                expect("list_files" in exc.message and "download" in exc.message, claim,
                       "the error to name list_files and download", exc.message)
            else:
                raise AssertionError(f"{claim}: read_file({path!r}) returned instead of raising WorkspacePathError")


@family.check("a download or listing over its bounds is refused before it is read (sparse file, many entries, deep)")
def check_transfer_bounds(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a transfer over its bounds is refused before it is read"
    tight = kit.runner.settings.model_copy(update={"max_transfer_bytes": 1 << 20, "max_transfer_files": 64})
    runner = Runner(tight)
    with tempfile.TemporaryDirectory() as tmp, runner.sandbox(kit.backend, network=kit.net) as sb:
        made = sb.exec(["python3", "-c", HOSTILE_TREE])
        expect(made.exit_code == 0, claim, "the code to build the hostile tree (python3)", shown(made))
        expect_raises(TransferTooLargeError, lambda: sb.download("big.bin", Path(tmp, "big")), claim,
                      "download of a sparse 5 GiB file")
        expect(not os.path.lexists(Path(tmp, "big")), claim, "nothing written for the refused file", os.listdir(tmp))
        expect_raises(TransferTooLargeError, lambda: sb.list_files("many"), claim, "list_files of 100 entries")
        expect_raises(TransferTooLargeError, lambda: sb.download("deep", Path(tmp, "deep")), claim,
                      "download of a 300-level tree")


@family.check("collect returns the files a one-shot run wrote, never a link")
def check_collect(kit: Kit) -> None:
    kit.require(files=True)
    claim = "collect returns the files a one-shot run wrote, never a link"
    result = kit.run("mkdir -p out/sub && printf png > out/a.png && printf txt > out/a.txt && printf deep > "
                     "out/sub/b.png && ln -s /etc/passwd out/c.png", collect=["out/**/*.png"])
    expect(result.files == {"out/a.png": b"png", "out/sub/b.png": b"deep"}, claim,
           "exactly the two PNG files", {k: v[:20] for k, v in result.files.items()})
    expect(any("out/c.png" in n for n in result.notes), claim, "a note on the link left out", result.notes)
