"""Sandbox paths and the errors of file calls, without a sandbox: what ``normalize`` makes of relative and absolute
paths, the typed errors (an execbox error and the built-in OSError at once, pickled whole), the host side's file
access as the sandbox user when execbox is root, and the command line counted as the kernel counts it."""

from __future__ import annotations

import base64
import errno
import os
import pickle
from pathlib import Path

import pytest

import execbox
from execbox import (
    ExecRequest,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxPermissionError,
    WorkspacePathError,
)
from execbox.contract.models import COMMAND_LINE_RESERVE, MAX_COMMAND_LINE_BYTES, command_line_bytes
from execbox.errors import SandboxError
from execbox.files.disk import tmpfs_path_mb
from execbox.files.transfer import sandbox_read
from execbox.files.workspace import is_directory_error, normalize, safe_read, safe_write

WS = "/workspace"


@pytest.mark.parametrize(("given", "expected"), [
    ("a/b.txt", "a/b.txt"), ("./a//b.txt", "a/b.txt"), ("/workspace/a/../b", "b"),
    ("/tmp/x", "/tmp/x"), ("/var/tmp//y/./z", "/var/tmp/y/z"), ("/etc/hostname", "/etc/hostname"),
    ("/workspace/../etc/passwd", "/etc/passwd"), ("/home/u/", "/home/u"),
])
def test_absolute_paths_anywhere_and_relative_ones_in_the_workspace(given: str, expected: str) -> None:
    assert normalize(given, WS, anywhere=True) == expected


@pytest.mark.parametrize("given", ["/..", "/../etc", "/tmp/../../etc", "/a/b/../../../c"])
def test_a_climb_above_the_root_is_refused_not_dropped(given: str) -> None:
    with pytest.raises(WorkspacePathError, match="climbs above /"):
        normalize(given, WS, anywhere=True)


@pytest.mark.parametrize("given", ["../x", "a/../../x", "..", "", "a\0b"])
def test_relative_paths_still_stay_in_the_workspace(given: str) -> None:
    with pytest.raises(WorkspacePathError):
        normalize(given, WS, anywhere=True)


def test_without_anywhere_an_absolute_path_outside_the_workspace_is_refused_as_before() -> None:
    with pytest.raises(WorkspacePathError, match="outside the workspace"):
        normalize("/tmp/x", WS)


@pytest.mark.parametrize(("error", "builtin", "code"), [
    (SandboxFileNotFoundError, FileNotFoundError, errno.ENOENT),
    (SandboxPermissionError, PermissionError, errno.EACCES),
    (SandboxIsADirectoryError, IsADirectoryError, errno.EISDIR),
])
def test_the_typed_errors_are_execbox_errors_and_the_builtins(error: type[execbox.ExecboxError],
                                                              builtin: type[OSError], code: int) -> None:
    exc = error("no such file in the sandbox: '/x'", backend="docker")
    assert isinstance(exc, WorkspacePathError) and isinstance(exc, execbox.SandboxError)
    assert isinstance(exc, builtin) and isinstance(exc, OSError)
    assert exc.errno == code and str(exc) == "no such file in the sandbox: '/x'"
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is error and again.errno == code and again.backend == "docker" and str(again) == str(exc)
    assert getattr(execbox, error.__name__) is error and error.__name__ in execbox.__all__


def test_the_host_side_errors_are_typed(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(SandboxFileNotFoundError):
        safe_read(str(tmp_path), "missing", max_bytes=10)
    with pytest.raises(SandboxIsADirectoryError):
        safe_read(str(tmp_path), "d", max_bytes=10)
    with pytest.raises(SandboxIsADirectoryError):
        safe_write(str(tmp_path), "d", b"x")


@pytest.mark.skipif(os.geteuid() != 0, reason="root passes every mode check: only then must execbox drop it")
def test_as_root_the_host_side_honours_the_modes_the_sandbox_user_set(tmp_path: Path) -> None:
    owner = (65534, 65534)
    os.chown(tmp_path, *owner)
    safe_write(str(tmp_path), "secret", b"s", owner=owner)
    safe_write(str(tmp_path), "ro", b"keep", owner=owner)
    (tmp_path / "secret").chmod(0o000)
    (tmp_path / "ro").chmod(0o444)
    (tmp_path / "sealed").mkdir(0o555)
    os.chown(tmp_path / "sealed", *owner)
    with pytest.raises(SandboxPermissionError):
        safe_read(str(tmp_path), "secret", max_bytes=10, owner=owner)
    with pytest.raises(SandboxPermissionError):
        safe_write(str(tmp_path), "ro", b"over", owner=owner)
    with pytest.raises(SandboxPermissionError):
        safe_write(str(tmp_path), "sealed/new", b"x", owner=owner)
    assert (tmp_path / "ro").read_bytes() == b"keep" and not (tmp_path / "sealed" / "new").exists()
    assert safe_read(str(tmp_path), "secret", max_bytes=10) == b"s"  # no owner: the host's own access, as before
    # The thread is root again afterwards: its identity was the sandbox user's for the call only.
    (tmp_path / "after").write_bytes(b"x")
    assert (tmp_path / "after").stat().st_uid == 0


def test_the_command_line_is_counted_as_the_kernel_counts_it() -> None:
    # Each string with its NUL, and a pointer per string plus the two NULL ones ending argv and envp.
    assert command_line_bytes(["ab", "c"], {"K": "v"}) == (3 + 2 + 4) + 8 * (3 + 2)
    budget = MAX_COMMAND_LINE_BYTES - COMMAND_LINE_RESERVE
    words = ["x" * 100_000] * 19  # 1.9 MB: over the old 1 MiB bound, under ARG_MAX
    assert command_line_bytes(["true", *words]) < budget
    ExecRequest(argv=["true", *words])
    with pytest.raises(ValueError, match="ARG_MAX"):
        ExecRequest(argv=["true", *(["x" * 100_000] * 21)])  # 2.1 MB
    with pytest.raises(ValueError, match="ARG_MAX"):  # the environment counts too
        ExecRequest(argv=["true", *words], env={"BIG": "y" * 200_000})
    with pytest.raises(ValueError, match="one word"):
        ExecRequest(argv=["echo", "x" * (128 << 10)])


def test_a_too_long_command_is_a_config_error_before_anything_runs() -> None:
    with pytest.raises(execbox.ConfigError, match="ARG_MAX"):
        execbox.run(["true", *(["x" * 100_000] * 21)], backend="bubblewrap")


class ScriptedShell:
    """A SandboxShell whose file helper answers with what it was given (output, and whether it was cut)."""

    workspace = WS

    def __init__(self, out: str, cut: bool, code: int = 0) -> None:
        self.out, self.cut, self.code = out, cut, code

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        raise AssertionError("sandbox_read goes through run_script")

    async def write_file(self, path: str, data: bytes) -> None:
        raise AssertionError("sandbox_read goes through run_script")

    async def run_script(self, script: str, *args: str, max_output: int = 1 << 16,
                         stdin: bytes | None = None) -> tuple[int, str, bool]:
        return self.code, self.out, self.cut


@pytest.mark.anyio
async def test_a_read_whose_helper_output_was_cut_or_is_not_base64_is_refused_not_corrupted() -> None:
    whole = base64.encodebytes(bytes(range(256)) * 4).decode()  # with base64's newlines
    assert await sandbox_read(ScriptedShell(whole, cut=False), "/var/tmp/f", 4096) == bytes(range(256)) * 4
    cut_short = whole[:whole.index("\n", 200) + 1]  # whole lines: it would decode, to the wrong bytes
    with pytest.raises(SandboxError, match="'/var/tmp/f'.*cut short"):
        await sandbox_read(ScriptedShell(cut_short, cut=True), "/var/tmp/f", 4096)
    with pytest.raises(SandboxError, match="not base64 for '/var/tmp/f'"):
        await sandbox_read(ScriptedShell("aGVsbG8*d29ybGQ=\n", cut=False), "/var/tmp/f", 4096)


@pytest.mark.anyio
async def test_reading_a_directory_says_the_same_wherever_it_is_read(tmp_path: Path) -> None:
    """One message for a directory read as a file: the workspace's host side, a path read in the sandbox (its file
    helper exits 14 on a directory; the ssh backend calls the same is_directory_error)."""
    (tmp_path / "d").mkdir()
    with pytest.raises(SandboxIsADirectoryError) as on_host:
        safe_read(str(tmp_path), "d", max_bytes=10)
    with pytest.raises(SandboxIsADirectoryError) as in_sandbox:
        await sandbox_read(ScriptedShell("", cut=False, code=14), "/var/tmp/d", 10)
    assert str(on_host.value) == str(is_directory_error("d"))
    assert str(in_sandbox.value) == str(is_directory_error("/var/tmp/d"))


def test_a_tmpfs_path_is_sized_like_tmp_within_the_disk_limit() -> None:
    assert (tmpfs_path_mb(512, None), tmpfs_path_mb(512, 64), tmpfs_path_mb(64, 512)) == (512, 64, 64)
