"""A backend's settings given in code: two runners in one process use two docker images, without os.environ."""

from __future__ import annotations

import io
import tarfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import execbox
from execbox import ConfigError, Runner, Settings
from execbox.backends.docker import image as docker_image
from tests.backends.test_docker import engine  # noqa: F401  (the real engine, image built when missing)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def second_image(engine: Any) -> Iterator[str]:  # noqa: F811
    """The sandbox image plus one marker file, built locally (no registry)."""
    tag = f"execbox-test-second:{uuid.uuid4().hex[:8]}"
    dockerfile = f"FROM {docker_image.DEFAULT_TAG}\nCOPY marker /etc/execbox-marker\n".encode()
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in (("Dockerfile", dockerfile), ("marker", b"second image\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    engine.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, network_mode="none")
    yield tag
    engine.images.remove(tag, force=True)


def test_two_runners_in_one_process_use_two_images(second_image: str) -> None:
    marker = ["cat", "/etc/execbox-marker"]
    with Runner(Settings(backend="docker")) as default, \
            Runner(Settings(backend="docker"), options={"docker": {"image": second_image}}) as other:
        first, second = default.run(marker), other.run(marker)
    assert first.exit_code != 0 and "No such file" in first.stderr, first
    assert (second.exit_code, second.stdout) == (0, "second image\n"), second


def test_a_sandbox_takes_the_image_as_a_keyword(second_image: str) -> None:
    with execbox.sandbox("docker", image=second_image) as sb:
        assert sb.exec(["cat", "/etc/execbox-marker"]).stdout == "second image\n"


def test_a_misspelled_option_says_which_exist(engine: Any) -> None:  # noqa: F811
    with pytest.raises(ConfigError, match="no option 'imgae'.*image"):
        with execbox.sandbox("docker", imgae="x"):
            pass
