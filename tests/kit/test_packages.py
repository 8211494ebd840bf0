"""The host step's requirements (kit.packages): a requirements file is read by execbox, strictly, and every
line must pass the same check as a requirement given alone; what reaches the host's pip is names and versions
only, never the file, an option, a URL, a path or a name pip would take for a local archive."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pip._internal.req.constructors import install_req_from_line

from execbox.errors import ConfigError, ExecboxError
from execbox.kit import packages
from tests.support.wheels import NAME, build_wheel, host_pip_uses, serve_index


def reqs_file(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "requirements.txt"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def assert_plain(requirement: str) -> None:
    """What pip itself makes of ``requirement`` on its command line: a name from the index, no link, no file."""
    assert not requirement.startswith("-")
    parsed = install_req_from_line(requirement)
    assert parsed.link is None and parsed.req is not None, requirement


def test_a_file_of_pins_comments_and_markers_is_read_into_requirements(tmp_path: Path) -> None:
    path = reqs_file(tmp_path, "\ufeff# pinned\r\nrich==13.7.1  # the UI\r\n\n  pandas>=2,<3\n"
                               'numpy; python_version >= "3.9"\nrequests[socks]~=2.31\n\t\n')
    assert packages.read_requirements(path) == ["rich==13.7.1", "pandas>=2,<3", 'numpy; python_version >= "3.9"',
                                                "requests[socks]~=2.31"]


@pytest.mark.parametrize("line", [
    "--index-url http://127.0.0.1:1/simple", "-i http://127.0.0.1:1/simple", "--extra-index-url=http://127.0.0.1:1/",
    "--trusted-host 127.0.0.1", "-f http://127.0.0.1:1/links", "--find-links /tmp", "--no-index", "--pre",
    "-e .", "-e git+https://127.0.0.1/x.git#egg=x", "--editable ./proj", "-r other.txt", "-c constraints.txt",
    "--requirement=other.txt", "--no-binary :all:", "--only-binary=:none:", "--use-pep517",
    "rich==13.7.1 --hash=sha256:" + "0" * 64, "rich --config-settings=x=y", "rich\t--global-option=x",
    "rich @ https://127.0.0.1/rich-13.7.1-py3-none-any.whl", "rich@file:///tmp/rich.whl",
    "https://127.0.0.1/rich-13.7.1-py3-none-any.whl", "git+https://127.0.0.1/x.git", "file:///tmp/x",
    "./proj", "proj/", "/srv/proj", "..", "~/proj", "proj\\sub", "evil.tar.gz", "evil.zip", "Evil.WHL",
    "evil.tgz", "rich==13.7.1 \\", "${HOME}", "rich[", "rich==",
])
def test_each_option_url_path_or_odd_line_is_refused_with_its_line_number(tmp_path: Path, line: str) -> None:
    path = reqs_file(tmp_path, f"rich==13.7.1\n{line}\n")
    with pytest.raises(ConfigError) as caught:
        packages.read_requirements(path)
    assert f"{path}:2:" in caught.value.message


@pytest.mark.parametrize("content", [b"rich\r--index-url http://127.0.0.1:1/\n", b"rich\rnumpy", b"rich\0\n",
                                     b"rich\x0b--pre\n", b"rich\x0cnumpy\n", "rich\u2028numpy\n".encode(),
                                     "rich\x85numpy\n".encode(), b"rich\xff\n", b"rich\x1enumpy"])
def test_a_bare_cr_nul_other_line_breaks_and_non_utf8_are_refused(tmp_path: Path, content: bytes) -> None:
    with pytest.raises(ConfigError):
        packages.read_requirements(reqs_file(tmp_path, content))


def test_only_regular_files_of_bounded_size(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="larger than"):
        packages.read_requirements(reqs_file(tmp_path, "# x\n" * (packages.MAX_REQUIREMENTS_FILE // 4 + 1)))
    os.mkfifo(tmp_path / "fifo")  # read with O_NONBLOCK: refused, not waited on
    with pytest.raises(ConfigError, match="not a regular file"):
        packages.read_requirements(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="cannot read"):
        packages.read_requirements(tmp_path / "missing.txt")


def test_a_directory_or_an_unreadable_file_is_a_config_error_and_leaks_no_descriptor(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for path, why in ((tmp_path, "not a regular file"), (Path("/proc/self/mem"), "cannot read")):
        with pytest.raises(ConfigError, match=why):  # not IsADirectoryError, or OSError: EIO
            packages.read_requirements(path)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_name_pip_takes_for_an_archive_file_is_refused_given_alone_too() -> None:
    for name in ("evil.tar.gz", "evil.whl", "evil.tar", "evil.zip; python_version > '3'"):
        with pytest.raises(ConfigError, match="archive"):
            packages.check_requirements([name])


@pytest.mark.parametrize("requirement", ["rich===1.tar.gz", "rich[x]===1.ZIP ; python_version > '3'",
                                         "rich ===1.tgz\t", "rich===1.zip[x]"])
def test_an_arbitrary_equality_version_pip_takes_for_an_archive_file_is_refused(
        requirement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # '===' takes any version string, so the requirement's end is the archive's suffix, as pip tests it
    monkeypatch.chdir("/")  # where the host's pip runs
    assert install_req_from_line(requirement).link is not None  # pip: the local file /rich===1.tar.gz
    with pytest.raises(ConfigError, match=r"archive|arbitrary equality \(===\)"):
        packages.check_requirements([requirement])


def test_a_local_version_pip_takes_for_an_archive_file_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # '1.0+x.tar.gz' is a valid version (its local label may hold dots), and the end is an archive's suffix
    monkeypatch.chdir("/")
    requirement = "rich==1.0+x.tar.gz"
    assert install_req_from_line(requirement).link is not None
    with pytest.raises(ConfigError, match="archive"):
        packages.check_requirements([requirement])


def test_pip_is_given_names_only_after_an_end_of_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(packages, "_pip", lambda args: seen.append(args) or subprocess.CompletedProcess(args, 0))
    target = packages.PythonTarget.parse("3 11 x86_64 glibc 2.36")
    packages.pip_download(packages.read_requirements(reqs_file(tmp_path, "rich==13.7.1\nnumpy\n")), tmp_path, target)
    # A plugin's requirement_files too: read and checked, pip gets the names.
    packages.pip_download(["rich==13.7.1"], tmp_path, target, requirement_files=[reqs_file(tmp_path, "numpy\n")])
    for args in seen:
        assert "--only-binary=:all:" in args and "-r" not in args
        assert args[args.index("--"):] == ["--", "rich==13.7.1", "numpy"]
    with pytest.raises(ConfigError, match=":1: refused"):
        packages.pip_download([], tmp_path, target, requirement_files=[reqs_file(tmp_path, "-e .\n")])
    with pytest.raises(ConfigError):
        packages.pip_download(["-r/etc/passwd"], tmp_path, target)


def test_a_requirements_file_is_fetched_from_the_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = build_wheel(tmp_path)
    with serve_index(tmp_path / "index", [wheel]) as index:
        host_pip_uses(index, monkeypatch)
        monkeypatch.chdir(tmp_path)
        dest = tmp_path / "dest"
        dest.mkdir()
        requirements = packages.read_requirements(reqs_file(tmp_path, f"{NAME}==1.0  # pinned\n"))
        done = packages.pip_download(requirements, dest, packages.PythonTarget.here())
    assert done.returncode == 0, done.stderr
    assert [p.name for p in dest.iterdir()] == [wheel.name]


LINE_ALPHABET = st.sampled_from(list("abcz09-_.[],;<>=!~@:/\\#$ \t\"'()*%+?&") + ["\r", "\n", "\0", "\x0b", "é"])


@settings(max_examples=400, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(LINE_ALPHABET, max_size=40), st.text(max_size=40),
                 st.builds(lambda a, b: a + b, st.sampled_from(["rich", "-", "--", "./", "x @ ", "rich==1 "]),
                           st.text(LINE_ALPHABET, max_size=30)),
                 st.builds(lambda a, b, c: a + b + c, st.sampled_from(["rich===", "rich[x] ===", "x.tar"]),
                           st.text(LINE_ALPHABET, max_size=8),
                           st.sampled_from(["", ".zip", ".tar.gz", ".whl", "[x]", ".tgz[y]", ".ZIP ; os_name=='x'"]))))
@example(line="0===[:]")  # ours took it, pip's own parser did not (arbitrary equality: refused now)
def test_any_line_is_refused_or_a_plain_requirement(tmp_path: Path, line: str) -> None:
    try:
        checked = packages.read_requirements(reqs_file(tmp_path, line + "\n"))
    except ExecboxError as exc:
        assert isinstance(exc, ConfigError)
        return
    for requirement in checked:
        assert_plain(requirement)


def test_a_requirement_longer_than_the_bound_is_refused_before_pip_parses_it() -> None:
    # pip's parser is quadratic on `rich===[[[...`: such a line kept the host's pip busy until its timeout
    with pytest.raises(ConfigError, match="longer than"):
        packages.check_requirements(["rich===" + "[" * (packages.MAX_REQUIREMENT_LENGTH + 1)])
    assert packages.check_requirements(["rich==13.7.1"]) == ["rich==13.7.1"]
