"""run_cell's ``%pip install`` / ``!pip install`` lines (kernel/magics.py) and what agent frameworks need of a
sandbox: the reading of a cell (no engine), then on docker and bubblewrap a cell that installs a wheel from the
package cache of a sandbox opened without deciding on it, with ``open()``/``close()`` as a long-lived owner uses
them, refusals that are results, and the errors of an empty install and of a sandbox used before it opens."""

from __future__ import annotations

from pathlib import Path

import pytest

import execbox
from execbox import ConfigError, SandboxError, Settings
from execbox.audit import reader as audit_reader
from execbox.kernel.magics import MagicError, PipInstall, split_cell
from tests.support.wheels import MODULE, NAME, VALUE, Index, probe_cache, probe_index  # noqa: F401 - fixtures
from tests.test_kernel import _usable

# --- reading a cell, no engine --------------------------------------------------------------------------------


def test_python_is_python_whatever_its_lines_start_with() -> None:
    for code in ("x = 1", "y = (10\n% 3)", "s = '''\n!pip install x\n'''", "await f()", ""):
        assert split_cell(code) == [code]


@pytest.mark.parametrize("line", [
    "%pip install -q numpy 'pandas>=2'", "!pip install -U numpy pandas>=2", "!pip3 install numpy pandas>=2",
    "!python -m pip install --quiet numpy pandas>=2", "!python3 -m pip install numpy \\\n  pandas>=2",
])
def test_the_ways_to_spell_a_pip_install(line: str) -> None:
    parts = split_cell(f"a = 1\n{line}\nprint(a)")
    assert [type(p) for p in parts] == [str, PipInstall, str]
    install = parts[1]
    assert isinstance(install, PipInstall) and install.requirements == ("numpy", "pandas>=2")
    assert install.quiet == ("-q" in line or "--quiet" in line)
    # The Python after it keeps the cell's line numbers: a traceback points at the cell's own line.
    assert isinstance(parts[2], str) and parts[2].split("\n").index("print(a)") == len(line.split("\n")) + 1


def test_options_urls_and_paths_are_left_for_the_requirement_check() -> None:
    # pip_install's check refuses them (kit.packages.check_requirements): one rule, in one place.
    install = split_cell("!pip install -r reqs.txt https://x/y.whl ./pkg")[0]
    assert isinstance(install, PipInstall) and install.requirements == ("-r", "reqs.txt", "https://x/y.whl", "./pkg")


@pytest.mark.parametrize(("code", "says"), [
    ("!ls -la", "exec()"), ("%time f()", "only `%pip install`"), ("%%bash\necho hi", "cell magics"),
    ("!pip uninstall -y numpy", "`pip install` only"), ("!pip install 'unclosed", "cannot read"),
    ("if True:\n    !pip install numpy", "inside a block"), ("!pip", "`pip install` only"),
])
def test_other_magics_are_refused_with_what_to_do(code: str, says: str) -> None:
    with pytest.raises(MagicError, match=says.replace("(", r"\(").replace(")", r"\)")):
        split_cell(code)


# --- docker and bubblewrap --------------------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.parametrize("backend", ["docker", "bubblewrap"])
def test_a_cell_installs_from_the_package_cache_of_a_sandbox_opened_without_asking(
        backend: str, probe_cache: Index) -> None:
    with execbox.Runner() as runner:
        _usable(runner, backend)
    sb = execbox.sandbox(backend)  # no package_cache=True: nothing decided at open
    with pytest.raises(SandboxError, match=r"sb\.open\(\)"):
        sb.run_cell("1")
    assert sb.open() is sb and sb.open() is sb  # opening an open sandbox is a no-op
    try:
        with pytest.raises(ConfigError, match="no requirements"):
            sb.pip_install()
        assert sb.run_cell("before = 41").ok
        cell = sb.run_cell(f"print('installing')\n!pip install -q {NAME}\nimport {MODULE}\n"
                           f"({MODULE}.VALUE, before + 1)")
        assert cell.ok, cell
        assert cell.stdout == "installing\n" and [o.text for o in cell.outputs] == [f"({VALUE!r}, 42)"]
        assert any("package cache" in note for note in cell.notes)
        refused = sb.run_cell("x = 1\n!pip install https://example.invalid/x.whl")
        assert refused.error is not None and refused.error.name == "MagicError" and "URL" in refused.error.value
        assert not sb.run_cell("x").ok  # nothing of the refused cell ran
        other = sb.run_cell("!ls")
        assert other.error is not None and "exec()" in other.error.value
        cells = [r for r in audit_reader.records(Path(Settings().audit_log or "")) if r["event"] == "cell"]
        assert [r["error"] for r in cells[-2:]] == ["NameError", "MagicError"]  # refused cells are audited too
        missing = sb.run_cell("%pip install execbox-no-such-package")
        assert missing.error is not None and missing.error.name == "PipInstallError"
        assert "planted" not in sb.exec("touch /opt/execbox/pip/planted.whl 2>/dev/null && echo planted").stdout
        # Not asked for: the cache is pip_install's, the code's own environment is not pointed at it.
        assert "PIP_" not in sb.exec("env").stdout
    finally:
        sb.close()
        sb.close()  # closing twice is fine
    with pytest.raises(SandboxError, match="not open"):
        sb.run_cell("1")
    with pytest.raises(SandboxError, match="does not reopen"):
        sb.open()


@pytest.mark.engine
def test_a_package_cache_it_cannot_use_fails_the_install_not_the_sandbox(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with execbox.Runner() as runner:
        _usable(runner, "bubblewrap")
    link = tmp_path / "cache"
    link.symlink_to(tmp_path)  # ensure_cache refuses a symlink: someone else could point it anywhere
    monkeypatch.setenv("CODE_EXEC_PACKAGE_CACHE", str(link))
    with execbox.sandbox("bubblewrap") as sb:
        assert sb.exec("echo ok").stdout == "ok\n"
        with pytest.raises(ConfigError, match="symlink"):
            sb.pip_install(NAME)
        cell = sb.run_cell(f"%pip install {NAME}")
        assert cell.error is not None and cell.error.name == "PipInstallError" and "symlink" in cell.error.value
    with pytest.raises(ConfigError, match="symlink"), execbox.sandbox("bubblewrap", package_cache=True):
        pass


def test_a_cell_of_many_magic_lines_is_refused_quickly() -> None:
    # Each Python part is padded to the cell's line numbers: unbounded parts would cost the host quadratic memory.
    with pytest.raises(MagicError, match="on fewer lines"):
        split_cell("a = 1\n!pip install x\n" * 50_000)
    long = split_cell("!pip install " + "\\\n".join(["x"] * 100_000))  # a long continuation is joined linearly
    assert isinstance(long[0], PipInstall) and len(long[0].requirements) == 100_000
