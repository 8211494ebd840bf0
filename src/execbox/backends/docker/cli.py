"""The docker backend's commands: `execbox image build`, added to the execbox command line through the hook
``execbox_register_commands`` as a third-party backend adds its own."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from execbox.plugin import hookimpl


@hookimpl
def execbox_register_commands(cli: click.Group) -> None:
    cli.add_command(image)


@click.group()
def image() -> None:
    """Sandbox images for the docker backend."""


@image.command("build")
@click.option("--tag", default=None, help="Image tag (default: the default image's; with extra content, its name "
              "with the recipe hash as suffix).")
@click.option("--package", "debs", multiple=True, metavar="NAME",
              help="A Debian package to add (repeatable), e.g. python3-numpy; from the Debian mirror, no registry.")
@click.option("--pip", "pip_reqs", multiple=True, metavar="REQ",
              help="A Python requirement to install (repeatable), fetched as a wheel by this host's pip.")
@click.option("--requirements", "req_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              metavar="FILE", help="A requirements file (repeatable), fetched the same way.")
@click.option("--force", is_flag=True, help="Rebuild even when an up-to-date image exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def image_build(tag: str | None, debs: tuple[str, ...], pip_reqs: tuple[str, ...], req_files: tuple[str, ...],
                force: bool, as_json: bool) -> None:
    """Build a sandbox image from Debian's packages (debootstrap + docker import); no registry needed.

    \b
    execbox image build                                  # the default image
    execbox image build --package python3-numpy          # -> execbox-sandbox:bookworm-<recipe hash>
    execbox image build --pip 'rich==13.7.1' --tag my-image:1
    """
    from execbox.backends.docker import (
        image as docker_image,  # the builder (and docker-py) only when a build is asked for
    )

    # Any other ExecboxError (pip on the host failing to fetch the --pip packages) the CLI reports as its own.
    try:
        result = docker_image.build_image(tag, force=force, packages=docker_image.DEFAULT_PACKAGES + debs,
                                          pip=pip_reqs, requirements=tuple(Path(f) for f in req_files))
    except docker_image.ImageBuildError as exc:
        click.echo(f"execbox image: error: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(result)))
        return
    state = "built" if result.built else "up to date"
    click.echo(f"{result.tag}: {state} ({result.image_id[:19]}, {result.size_bytes / 1e6:.0f} MB)")
    if result.tag != docker_image.DEFAULT_TAG:
        click.echo(f"use it: CODE_EXEC_DOCKER_IMAGE={result.tag}, or execbox.sandbox('docker', image="
                   f"{result.tag!r})", err=True)

