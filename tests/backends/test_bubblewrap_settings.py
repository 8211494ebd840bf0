"""Settings never widen bubblewrap's boundary: a bad value is a ConfigError naming its variable (never another
exception), a bind that would show the sandbox a host secret is refused (also when it turns into one after the
settings were read), and a bwrap binary that someone else could replace is not used."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from execbox import Runner, Settings
from execbox.backends.bubblewrap.filesystem import unsafe_bind
from execbox.backends.bubblewrap.settings import BubblewrapSettings
from execbox.errors import BackendUnavailableError, ConfigError
from execbox.runner import run_blocking
from execbox.testing import engine_missing

ROOT = os.geteuid() == 0
LONG = "/opt/" + "a" * 5000

BAD_ENV = [
    ("CODE_EXEC_BWRAP_RO_BINDS", "/proc/1/root"),
    ("CODE_EXEC_BWRAP_RO_BINDS", "/proc/self/root"),
    ("CODE_EXEC_BWRAP_RO_BINDS", "/sys/fs/cgroup"),
    ("CODE_EXEC_BWRAP_RO_BINDS", "/workspace"),
    ("CODE_EXEC_BWRAP_RO_BINDS", LONG),
    ("CODE_EXEC_BWRAP_RO_BINDS", "/opt/execbox-does-not-exist-7f3a"),
    ("CODE_EXEC_BWRAP_RO_BINDS", ",".join(["/usr"] * 65)),
    ("CODE_EXEC_BWRAP_USER", "4294967296:1"),
    ("CODE_EXEC_BWRAP_USER", "1000:4294967296"),
    ("CODE_EXEC_BWRAP_USER", "4294967295"),
    ("CODE_EXEC_BWRAP_USER", "9" * 40),
    ("CODE_EXEC_BWRAP_USER", "\u0661\u0660\u0660\u0660"),  # Arabic-Indic digits: isdigit() says yes
    ("CODE_EXEC_BWRAP_USER", "1000:"),
    ("CODE_EXEC_BWRAP_CGROUP_PARENT", "/../../../etc/cron.d"),
    ("CODE_EXEC_BWRAP_CGROUP_PARENT", "/execbox/../../x"),
    ("CODE_EXEC_BWRAP_CGROUP_PARENT", "/execbox/./x"),
    ("CODE_EXEC_BWRAP_CGROUP_PARENT", "execbox"),
    ("CODE_EXEC_BWRAP_CGROUP_PARENT", "/exec\nbox"),
    ("CODE_EXEC_BWRAP_CGROUP_PARENT", "/" + "a" * 5000),
    ("CODE_EXEC_BWRAP_PATH", "bin/bwrap"),
    ("CODE_EXEC_BWRAP_PATH", "/" + "a" * 5000),
    ("CODE_EXEC_BWRAP_TMPFS_MB", "99999999999999"),
]


@pytest.mark.parametrize(("variable", "value"), BAD_ENV, ids=[f"{v}={x[:24]!r}" for v, x in BAD_ENV])
def test_bad_values_are_config_errors_naming_the_variable(monkeypatch: pytest.MonkeyPatch, variable: str,
                                                          value: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        BubblewrapSettings()
    assert info.value.env_var == variable and variable in str(info.value)


@pytest.mark.parametrize(("field", "value"), [
    ("ro_binds", ["/opt/a\0b"]),
    ("path", "/usr/bin/bw\0rap"),
    ("cgroup_parent", "/exec\0box"),
    ("user", "1000\0:1000"),
], ids=["ro_binds", "path", "cgroup_parent", "user"])
def test_nul_bytes_given_in_code_are_config_errors(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        BubblewrapSettings(**{field: value})
    assert info.value.env_var and info.value.env_var.startswith("CODE_EXEC_BWRAP_")


@pytest.fixture
def outside_dir() -> Iterator[Path]:
    """A directory outside every forbidden place, where this test may write (bind sources must exist)."""
    for base in ("/opt", "/srv", "/mnt"):
        if os.path.isdir(base) and os.access(base, os.W_OK):
            path = Path(tempfile.mkdtemp(prefix="execbox-bind-", dir=base))
            path.chmod(0o755)
            yield path
            shutil.rmtree(path, ignore_errors=True)
            return
    pytest.skip("needs a writable /opt, /srv or /mnt for a directory outside the forbidden places")


def test_session_temp_dir_and_home_cannot_be_bound(monkeypatch: pytest.MonkeyPatch, outside_dir: Path) -> None:
    """Every session's workspace lives in the temp dir: binding it (or a parent) shows this sandbox all the
    others. Likewise the caller's home, wherever it is."""
    temp, home, other = outside_dir / "sessions", outside_dir / "home-of-caller", outside_dir / "other"
    for path in (temp, home / "data", other):
        path.mkdir(parents=True)
    assert unsafe_bind(str(temp)) is None and unsafe_bind(str(home / "data")) is None  # not yet special
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("HOME", str(home))
    assert unsafe_bind(str(temp)) and unsafe_bind(str(outside_dir)) and unsafe_bind(str(home / "data"))
    assert unsafe_bind(str(other)) is None
    monkeypatch.setenv("CODE_EXEC_BWRAP_RO_BINDS", str(temp))
    with pytest.raises(ConfigError, match="CODE_EXEC_BWRAP_RO_BINDS"):
        BubblewrapSettings()


def test_a_symlink_to_a_secret_place_is_refused(monkeypatch: pytest.MonkeyPatch, outside_dir: Path) -> None:
    (outside_dir / "etc").symlink_to("/etc")
    monkeypatch.setenv("CODE_EXEC_BWRAP_RO_BINDS", str(outside_dir / "etc"))
    with pytest.raises(ConfigError, match="CODE_EXEC_BWRAP_RO_BINDS"):
        BubblewrapSettings()


def test_a_bind_that_becomes_a_symlink_later_is_refused_at_exec(monkeypatch: pytest.MonkeyPatch,
                                                                outside_dir: Path) -> None:
    data = outside_dir / "data"
    data.mkdir(mode=0o755)
    (data / "tool.txt").write_text("tool\n")
    monkeypatch.setenv("CODE_EXEC_BWRAP_RO_BINDS", str(data))
    runner = Runner(Settings(backend="bubblewrap"))
    try:
        run_blocking(runner.aio.backend("bubblewrap").check)
    except BackendUnavailableError as exc:
        engine_missing(f"bubblewrap cannot run here: {exc}")
    assert runner.run(["cat", str(data / "tool.txt")], backend="bubblewrap").stdout == "tool\n"
    shutil.rmtree(data)
    data.symlink_to("/root" if ROOT else os.path.expanduser("~"))
    with pytest.raises(ConfigError, match="CODE_EXEC_BWRAP_RO_BINDS"):
        runner.run(["ls", str(data)], backend="bubblewrap")


def copy_of_bwrap(where: Path) -> Path:
    real = shutil.which("bwrap")
    if not real:
        engine_missing("bwrap is not installed")
    where.mkdir(mode=0o755, parents=True, exist_ok=True)
    copy = where / "bwrap"
    shutil.copy2(real, copy)
    return copy


def refused_binary(monkeypatch: pytest.MonkeyPatch, path: Path) -> BackendUnavailableError:
    monkeypatch.setenv("CODE_EXEC_BWRAP_PATH", str(path))
    with pytest.raises(BackendUnavailableError) as info:
        run_blocking(Runner(Settings(backend="bubblewrap")).aio.backend("bubblewrap").check)
    assert info.value.env_var == "CODE_EXEC_BWRAP_PATH"
    return info.value


def test_a_bwrap_others_may_replace_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A bwrap anyone can rewrite would hand every sandbox (and, as root, the launcher's privileges) to them."""
    tmp_path.chmod(0o755)
    copy = copy_of_bwrap(tmp_path / "bin")
    copy.chmod(0o777)
    assert "writable" in refused_binary(monkeypatch, copy).message
    copy.chmod(0o755)
    (tmp_path / "bin").chmod(0o777)  # the file is fine, its directory is not: it can be swapped
    assert "writable" in refused_binary(monkeypatch, copy).message


def test_as_root_a_bwrap_owned_by_another_user_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if not ROOT:
        pytest.skip("the owner rule for root: a non-root caller may use its own bwrap")
    tmp_path.chmod(0o755)
    copy = copy_of_bwrap(tmp_path / "bin")
    os.chown(copy, 65534, 65534)
    assert "uid 65534" in refused_binary(monkeypatch, copy).message


def test_a_binary_that_is_not_bubblewrap_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'usage: --args --json-status-fd --size'\n")
    fake.chmod(0o755)
    assert "not bubblewrap" in refused_binary(monkeypatch, fake).message
