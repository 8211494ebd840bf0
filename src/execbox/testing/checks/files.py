"""Checks of files in a run and a session: request files and workdir, a round trip, state kept between
execs, paths that escape (a relative one out of the workspace, a `..` above `/`) or pass a planted symlink refused."""

from __future__ import annotations

import functools

from execbox import WorkspacePathError
from execbox.testing.framework import Family, Kit, expect, expect_raises, shown

family = Family()


@family.check("request files are placed and workdir is honoured")
def check_request_files_and_workdir(kit: Kit) -> None:
    result = kit.run("cat in.txt; pwd", files={"sub/in.txt": b"data\n"}, workdir="sub")
    expect(result.stdout.startswith("data\n") and result.stdout.rstrip().endswith("/sub"),
           "request files are placed and workdir is honoured", "'data' then a directory ending in /sub", shown(result))


@family.check("files round-trip through a session")
def check_file_round_trip(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "files round-trip through a session"
    payload = bytes(range(256)) * 64
    with kit.sandbox() as sb:
        sb.write_file("in/data.bin", payload)
        reverse = "d = open('in/data.bin', 'rb').read(); open('out.bin', 'wb').write(d[::-1]); print(len(d))"
        result = sb.exec(["python3", "-c", reverse])
        expect(result.stdout == f"{len(payload)}\n", claim, f"the code to read {len(payload)} bytes", shown(result))
        back = sb.read_file("out.bin")
        expect(back == payload[::-1], claim, "the reversed payload read back", f"{len(back)} other bytes")


@family.check("session state persists between execs")
def check_session_state_persists(kit: Kit) -> None:
    kit.require(sessions=True)
    with kit.sandbox() as sb:
        wrote = sb.exec("echo kept > state.txt")
        expect(wrote.exit_code == 0, "session state persists", "the write to succeed", shown(wrote))
        read = sb.exec(["cat", "state.txt"])
        expect(read.stdout == "kept\n", "session state persists", "'kept' from the earlier exec", shown(read))


@family.check("a relative path out of the workspace, or a '..' above '/', is refused")
def check_escaping_paths_refused(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    with kit.sandbox() as sb:
        for bad in ("../escape.txt", "a/../../b", "/../etc/passwd"):
            claim = "a relative path out of the workspace, or a '..' above '/', is refused"
            expect_raises(WorkspacePathError, functools.partial(sb.read_file, bad), claim, f"read_file({bad!r})")
            expect_raises(WorkspacePathError, functools.partial(sb.write_file, bad, b"x"), claim,
                          f"write_file({bad!r})")


@family.check("a symlink the code planted is refused on read-back")
def check_planted_symlink_refused_on_read_back(kit: Kit) -> None:
    kit.require(sessions=True, files=True)
    claim = "a symlink the code planted is refused on read-back"
    with kit.sandbox() as sb:
        planted = sb.exec("ln -s /etc/passwd out.txt && ln -s /etc linked")
        expect(planted.exit_code == 0, claim, "the code to plant the links", shown(planted))
        expect_raises(WorkspacePathError, lambda: sb.read_file("out.txt"), claim, "read_file of a link to /etc/passwd")
        expect_raises(WorkspacePathError, lambda: sb.read_file("linked/passwd"), claim,
                      "read_file through a link to /etc")
