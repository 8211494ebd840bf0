"""``execbox image build --requirements FILE`` (backends.docker.image): the file is read and checked line by
line before anything else happens; a line that would make the host's pip build or run code is refused, and
the code it names never runs. No engine needed: the refusal comes before the engine is asked anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from execbox.backends.docker import image as docker_image
from execbox.backends.docker.image import ImageBuildError, build_image
from execbox.kit import packages


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, Path]:
    """A local project whose setup.py writes a marker file when anyone runs it; the marker's path."""
    marker = tmp_path / "setup-py-ran"
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "setup.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                   "from setuptools import setup\nsetup(name='proj', version='1.0')\n")
    return proj, marker


class NoEngine:
    """A docker client nobody may use: the build must be refused before it asks the engine anything."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the engine was asked for {name} before the requirements were checked")


def no_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
    raise AssertionError(f"pip was run: {args}")


@pytest.mark.parametrize("line", ["{proj}", "./proj", "proj/", "-e {proj}", "proj @ file://{proj}",
                                  "--index-url http://127.0.0.1:1/simple", "--extra-index-url http://127.0.0.1:1/",
                                  "--trusted-host 127.0.0.1", "-f http://127.0.0.1:1/", "-r {other}",
                                  "-c {other}", "rich @ http://127.0.0.1:1/rich-1-py3-none-any.whl",
                                  "proj.tar.gz", "rich==13.7.1 --hash=sha256:" + "0" * 64])
def test_a_requirements_line_that_would_run_code_or_fetch_elsewhere_is_refused(
        tmp_path: Path, project: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    proj, marker = project
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(packages, "_pip", no_pip)
    other = tmp_path / "other.txt"
    other.write_text(f"{proj}\n")
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("rich==13.7.1\n" + line.format(proj=proj, other=other) + "\n")
    with pytest.raises(ImageBuildError, match=f"{reqs}:2: (refused|invalid)"):
        build_image(None, requirements=(reqs,), client=NoEngine())
    assert not marker.exists()


def test_a_bare_cr_in_a_requirements_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packages, "_pip", no_pip)
    reqs = tmp_path / "requirements.txt"
    reqs.write_bytes(b"rich==13.7.1\r--index-url http://127.0.0.1:1/simple\n")
    with pytest.raises(ImageBuildError, match="control character"):
        build_image(None, requirements=(reqs,), client=NoEngine())


def test_the_files_requirements_are_the_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# pinned\nrich==13.7.1\n")
    asked: list[str] = []

    class Client:
        class images:  # noqa: N801 - docker-py's attribute
            @staticmethod
            def get(tag: str) -> object:
                asked.append(tag)
                return type("Image", (), {"labels": {docker_image.RECIPE_LABEL: recipe}, "short_id": "x", "id": "x",
                                          "attrs": {}})()

    recipe = docker_image.recipe_hash(docker_image.DEFAULT_SUITE, docker_image.DEFAULT_PACKAGES,
                                      docker_image.DEFAULT_USER, ("rich==13.7.1",))
    result = build_image(None, requirements=(reqs,), client=Client(), log=lambda _: None)
    assert not result.built and result.recipe == recipe and asked == [docker_image.recipe_tag(recipe)]
