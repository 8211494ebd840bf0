"""Paths anywhere in the sandbox, file calls as the sandbox user, a command line up to the kernel's limit and extra
tmpfs paths, on the real engines (docker and bubblewrap). One sandbox per backend serves the whole module (opened
with tmpfs=["/var/tmp"]); each test works in a directory of its own."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import execbox
from execbox import (
    RefusedError,
    Runner,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxPermissionError,
    Settings,
)
from execbox.runner import run_blocking
from execbox.testing import engine_missing

BACKENDS = ["docker", "bubblewrap"]
# 19 words of 100 kB: 1.9 MB of argv, over the old 1 MiB bound and under ARG_MAX (2 MiB with the environment).
BIG_ARGV = ["python3", "-c", "import sys; print(len(sys.argv), sum(map(len, sys.argv[1:])))", *(["x" * 100_000] * 19)]


@pytest.fixture(scope="module", params=BACKENDS)
def sb(request: pytest.FixtureRequest) -> Iterator[execbox.Sandbox]:
    name: str = request.param
    try:
        run_blocking(Runner(Settings(backend=name)).aio.backend(name).check)
    except execbox.BackendUnavailableError as exc:
        engine_missing(f"{name} cannot run here: {exc}")
    with execbox.sandbox(name, tmpfs=["/var/tmp"]) as sandbox:
        yield sandbox


def _name(sb: execbox.Sandbox) -> str:
    assert sb.backend is not None
    return sb.backend.name


@pytest.fixture
def here() -> str:
    """A fresh directory name for one test (the module's sandbox is shared)."""
    return f"t-{uuid.uuid4().hex[:8]}"


def test_absolute_paths_work_for_workdir_and_every_file_call(sb: execbox.Sandbox, here: str,
                                                             tmp_path: Path) -> None:
    # /var/tmp: the module's tmpfs, kept across execs (bubblewrap's /tmp is each exec's own).
    sb.write_file(f"/var/tmp/{here}/a/b.bin", b"\x00\xffbytes")  # its directories are made
    assert sb.exec(f"cat /var/tmp/{here}/a/b.bin").stdout == "\x00\ufffdbytes"
    assert sb.read_file(f"/var/tmp/{here}/a/b.bin") == b"\x00\xffbytes"
    assert b"root:x:0:0" in sb.read_file("/etc/passwd")  # anywhere the sandbox user may read
    assert sb.exec("pwd", workdir=f"/var/tmp/{here}/wd").stdout == f"/var/tmp/{here}/wd\n"  # made, as the sandbox user
    listed = sb.list_files(f"/var/tmp/{here}", recursive=True)
    assert [(e.path, e.type) for e in listed] == [
        (f"/var/tmp/{here}/a", "directory"), (f"/var/tmp/{here}/a/b.bin", "file"), (f"/var/tmp/{here}/wd", "directory")]
    local = tmp_path / "up.txt"
    local.write_text("uploaded")
    sb.upload(local, f"/var/tmp/{here}/up.txt")
    assert sb.exec(f"cat /var/tmp/{here}/up.txt").stdout == "uploaded"
    sb.download(f"/var/tmp/{here}/a", tmp_path / "down")
    assert (tmp_path / "down" / "b.bin").read_bytes() == b"\x00\xffbytes"
    # Relative paths are the workspace's, as before; an absolute one into it is the same file.
    sb.write_file(f"{here}/rel.txt", "r")
    assert sb.read_file(f"/workspace/{here}/rel.txt") == b"r"


def test_tmp_is_kept_across_a_sandboxs_execs(sb: execbox.Sandbox, here: str) -> None:
    if _name(sb) == "bubblewrap" and os.geteuid() != 0:
        pytest.skip("bubblewrap keeps /tmp across execs as root (a tmpfs of the session's); else it is each exec's")
    assert sb.exec(f"mkdir /tmp/{here}").exit_code == 0  # what inspect_ai's self-check does, then works in it
    sb.write_file(f"/tmp/{here}/f", "kept")
    assert sb.exec("cat f", workdir=f"/tmp/{here}").stdout == "kept"


@pytest.mark.parametrize("where", ["workspace", "/var/tmp"])
def test_file_calls_honour_the_modes_the_code_set(sb: execbox.Sandbox, here: str, where: str,
                                                  tmp_path: Path) -> None:
    d = here if where == "workspace" else f"/var/tmp/{here}"
    made = sb.exec(f"mkdir -p {d}/sealed && echo secret > {d}/s && chmod 000 {d}/s && echo keep > {d}/ro && "
                   f"chmod 444 {d}/ro && chmod 555 {d}/sealed")
    assert made.exit_code == 0, made.stderr
    with pytest.raises(SandboxPermissionError) as unreadable:
        sb.read_file(f"{d}/s")
    assert isinstance(unreadable.value, PermissionError)
    with pytest.raises(PermissionError):
        sb.write_file(f"{d}/ro", "overwritten")
    with pytest.raises(PermissionError):
        sb.write_file(f"{d}/sealed/new", "x")
    local = tmp_path / "up.txt"
    local.write_text("uploaded")
    with pytest.raises(PermissionError):
        sb.upload(local, f"{d}/sealed/up.txt")
    assert sb.exec(f"cat {d}/ro; ls -A {d}/sealed").stdout == "keep\n"
    with pytest.raises(SandboxIsADirectoryError) as is_dir:
        sb.read_file(f"{d}/sealed")
    assert isinstance(is_dir.value, IsADirectoryError)
    with pytest.raises(SandboxFileNotFoundError) as missing:
        sb.read_file(f"{d}/missing")
    assert isinstance(missing.value, FileNotFoundError)


def test_download_reads_as_the_sandbox_user(sb: execbox.Sandbox, here: str, tmp_path: Path) -> None:
    """What read_file refuses is not downloaded either: asked for, a SandboxPermissionError; inside a directory,
    left out with a note. (The workspace's host side: root's bypass of the modes must not apply.)"""
    made = sb.exec(f"mkdir -p {here}/sealed && echo ok > {here}/ok && echo secret > {here}/s && chmod 000 {here}/s && "
                   f"echo hidden > {here}/sealed/h && chmod 000 {here}/sealed")
    assert made.exit_code == 0, made.stderr
    with pytest.raises(SandboxPermissionError):
        sb.download(f"{here}/s", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    copied = sb.download(here, tmp_path / "d")
    assert (tmp_path / "d" / "ok").read_text() == "ok\n"
    assert not (tmp_path / "d" / "s").exists() and not (tmp_path / "d" / "sealed" / "h").exists()
    assert any("s: cannot be opened" in note for note in copied.skipped), copied.skipped
    assert any("sealed: unreadable directory" in note for note in copied.skipped), copied.skipped
    assert [e.path for e in sb.list_files(here, recursive=True)] == [f"{here}/ok", f"{here}/s", f"{here}/sealed"]


def test_writing_where_the_sandbox_user_may_not_is_a_permission_error(sb: execbox.Sandbox) -> None:
    for path in ("/etc/execbox-test", "/usr/execbox-test"):  # the read-only root
        with pytest.raises(SandboxPermissionError):
            sb.write_file(path, "x")


def test_var_tmp_is_writable_only_with_tmpfs_and_empty_in_the_next_sandbox(sb: execbox.Sandbox, here: str) -> None:
    made = sb.exec(f"echo hi > /var/tmp/{here} && stat -c %U:%a /var/tmp && ls -A /var/tmp")
    assert made.exit_code == 0, made.stderr
    owner = sb.exec("id -un").stdout.strip()
    assert made.stdout.splitlines()[0].split(":")[0] == owner  # the sandbox user's
    sb.write_file(f"/var/tmp/{here}.api", "kept across execs")
    assert sb.exec(f"cat /var/tmp/{here}.api").stdout == "kept across execs"
    backend = _name(sb)
    without = execbox.run(f"echo hi > /var/tmp/{here}", backend=backend)
    assert without.exit_code != 0  # a read-only root (docker); no /var at all (bubblewrap)
    fresh = execbox.run("ls -A /var/tmp && echo ok > /var/tmp/x && cat /var/tmp/x", backend=backend,
                        tmpfs=["/var/tmp"])
    assert fresh.stdout == "ok\n", fresh.stderr  # empty: nothing of the module's sandbox


@pytest.mark.parametrize(("path", "says"), [
    ("/", "root filesystem"), ("/workspace", "workspace"), ("/tmp", "writable tmpfs already"),
    ("/proc/x", "/proc"), ("/var", "/var/run"), ("/opt/execbox/x", "/opt/execbox"), ("/etc", "/etc"),
])
def test_bad_tmpfs_paths_are_refused_with_a_message_naming_them(path: str, says: str) -> None:
    with pytest.raises(RefusedError, match=says) as refused:
        execbox.run("true", backend="bubblewrap", tmpfs=[path])
    assert repr(path) in str(refused.value)


@pytest.mark.parametrize("path", ["/var/tmp\n/etc", "/var/tmp\r", "/var/tmp:ro", "/var/tmp,size=1g", "/var/\x7ftmp"])
def test_a_tmpfs_path_the_engines_could_read_two_ways_is_refused(path: str) -> None:
    """A bare CR or LF, docker's ':' and ',' separators: one name that an engine's syntax could read as two."""
    with pytest.raises(execbox.ConfigError, match="control character, ':' or ','"):
        execbox.run("true", backend="bubblewrap", tmpfs=[path])


def test_a_command_line_of_1_9_mib_runs(sb: execbox.Sandbox) -> None:
    result = sb.exec(BIG_ARGV)
    assert (result.exit_code, result.stdout) == (0, "20 1900000\n"), result.stderr
    oneshot = execbox.run(BIG_ARGV, backend=_name(sb), workdir="/tmp/w")  # the workdir's wrapper fits too
    assert (oneshot.exit_code, oneshot.stdout) == (0, "20 1900000\n"), oneshot.stderr


def test_a_command_line_over_the_kernels_limit_is_refused(sb: execbox.Sandbox) -> None:
    with pytest.raises(execbox.ConfigError, match="ARG_MAX"):
        sb.exec(["true", *(["x" * 100_000] * 21)])  # 2.1 MB


def test_the_cli_takes_tmpfs_and_says_so_in_its_help() -> None:
    from click.testing import CliRunner

    from execbox.cli import main as cli

    assert "--tmpfs PATH" in CliRunner().invoke(cli, ["run", "--help"]).stdout
    ran = CliRunner().invoke(cli, ["run", "--backend", "bubblewrap", "--tmpfs", "/var/tmp", "--workdir", "/var/tmp",
                                   "--", "sh", "-c", "echo ok > x && cat /var/tmp/x"])
    assert (ran.exit_code, ran.stdout) == (0, "ok\n"), ran.output
    refused = CliRunner().invoke(cli, ["run", "--backend", "bubblewrap", "--tmpfs", "/", "--", "true"])
    assert refused.exit_code == 125 and "root filesystem" in refused.output
