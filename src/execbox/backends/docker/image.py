"""Build the docker backend's sandbox image without any container registry.

No registry is reachable from the machines execbox is tested on, so the image comes from
Debian's own packages: ``debootstrap --variant=minbase`` a bookworm root filesystem with
Python 3, trim what a sandbox never reads (apt lists, docs, man pages), then ``docker import``
it with a non-root default user, ``/workspace`` as working directory and a plain environment.

The image carries a label with a hash of the recipe below. Building again is a no-op while an
image with the same tag and the same recipe exists, so scripts can call it unconditionally.

Extra content: more Debian packages (``packages``, through debootstrap ``--include``: no registry
needed) and Python packages (``pip`` requirements and ``requirements`` files; a file is read here and each
line checked as a ``pip`` requirement, pip is never handed the file). Python packages are
fetched on the host by the host's own pip and configuration (its index, its certificates), as wheels
only, for the image's Python (``execbox.plugin.packages``: no sdist is built, no package code runs on
the host), then installed into the root filesystem by its own pip with ``--no-index``: the build needs
no network of its own. An image with extra content gets a tag that says so: the default name with the
recipe hash as suffix (``execbox-sandbox:bookworm-3f2a...``), and labels listing what it holds.

Entry points: :func:`build_image` (the CLI's ``execbox image build`` calls it) and, for scripts
that run before the CLI is installed, ``python -m execbox.backends.docker.image build [--tag T]``.
docker-py is imported lazily, inside the functions that talk to the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from execbox.plugin import (
    PYTHON_TARGET_PROBE,
    BackendUnavailableError,
    ExecboxError,
    PythonTarget,
    check_requirements,
    pip_download,
    read_requirements,
)

DEFAULT_TAG = "execbox-sandbox:bookworm"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# ca-certificates, pip and venv: what a package install needs (through the proxy network mode).
DEFAULT_PACKAGES = ("python3", "coreutils", "ca-certificates", "python3-pip", "python3-venv")
# 65534:65534 is nobody:nogroup in Debian; the backend passes its own user for every container,
# this is only the default for someone running the image by hand.
DEFAULT_USER = "65534:65534"
RECIPE_LABEL = "io.execbox.image.recipe"
IMAGE_LABEL = "io.execbox.image"
PACKAGES_LABEL = "io.execbox.image.packages"
PIP_LABEL = "io.execbox.image.pip"
# Bump when the trimming or the image config below changes, so old images get rebuilt.
RECIPE_VERSION = 1

# Paths (relative to the rootfs) that a sandbox never needs. Copyright files stay: the image is
# redistributed Debian software and those notices must travel with it.
_TRIM_GLOBS = (
    "var/lib/apt/lists/*",
    "var/cache/apt/*",
    "var/cache/debconf/*-old",
    "var/cache/man/*",
    "var/log/*",
    "usr/share/man/*",
    "usr/share/info/*",
    "usr/share/locale/*",
    "usr/share/lintian/*",
    "usr/share/doc-base/*",
)

Log = Callable[[str], None]


class ImageBuildError(ExecboxError):
    """Building the sandbox image failed; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class BuildResult:
    tag: str
    image_id: str
    built: bool  # False when an up-to-date image already existed
    seconds: float
    size_bytes: int
    recipe: str


def _stderr_log(msg: str) -> None:
    print(f"execbox image: {msg}", file=sys.stderr, flush=True)


def image_changes(user: str = DEFAULT_USER) -> list[str]:
    """Dockerfile instructions applied on import (``docker import --change``)."""
    return [
        f"USER {user}",
        "WORKDIR /workspace",
        # HOME on the size-limited /tmp tmpfs: the root filesystem is read-only at run time.
        ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "
         "LANG=C.UTF-8 HOME=/tmp"),
        'CMD ["python3"]',
    ]


def recipe_hash(suite: str, packages: tuple[str, ...], user: str, pip: tuple[str, ...] = ()) -> str:
    """Hash of everything that decides the image's content (not the mirror: same archive). Unpinned pip
    requirements resolve to whatever the index has at build time: pin versions for a reproducible image."""
    recipe: dict[str, Any] = {
        "version": RECIPE_VERSION,
        "suite": suite,
        "variant": "minbase",
        "packages": sorted(packages),
        "trim": _TRIM_GLOBS,
        "changes": image_changes(user),
    }
    if pip:  # absent otherwise: the default image keeps its hash
        recipe["pip"] = sorted(pip)
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def recipe_tag(recipe: str, base: str = DEFAULT_TAG) -> str:
    """The tag of an image with extra content: the default name, the recipe hash as suffix."""
    return f"{base}-{recipe[:12]}"


def check_packages(names: tuple[str, ...]) -> tuple[str, ...]:
    """Debian package names as debootstrap --include takes them (comma-separated, so no commas or spaces)."""
    for name in names:
        if not name or not all(c.isalnum() or c in "+-.:" for c in name) or not name[0].isalnum():
            raise ImageBuildError(f"{name!r} is not a Debian package name (letters, digits, + - . :), e.g. "
                                  "python3-numpy")
    return names


def find_debian_mirror(suite: str = DEFAULT_SUITE, etc_apt: str = "/etc/apt") -> str:
    """The first apt source serving ``suite`` (deb822 ``.sources`` or one-line ``.list``)."""
    files = sorted(glob.glob(f"{etc_apt}/sources.list.d/*.sources"))
    for path in files:
        for stanza in Path(path).read_text().split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[0].isspace():
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if (
                "deb" in fields.get("types", "").split()
                and suite in fields.get("suites", "").split()
                and fields.get("enabled", "yes").lower() != "no"
                and fields.get("uris")
            ):
                return fields["uris"].split()[0]
    lists = [f"{etc_apt}/sources.list", *sorted(glob.glob(f"{etc_apt}/sources.list.d/*.list"))]
    for path in lists:
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                words = [w for w in line.split("#", 1)[0].split() if not w.startswith("[")]
                if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                    return words[1]
    return DEFAULT_MIRROR


def _docker_client() -> Any:
    # The same engine the backend uses: DOCKER_HOST, then the docker context, then the default socket.
    from execbox.backends.docker.engine import connect

    try:
        return connect()[0]
    except BackendUnavailableError as exc:
        raise ImageBuildError(exc.message, backend="docker") from None


def _existing(client: Any, tag: str) -> Any:
    import docker

    try:
        return client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.APIError as exc:  # e.g. an invalid reference format
        raise ImageBuildError(f"the engine refused the tag {tag!r}: {exc.explanation or exc}. Give a tag like "
                              "name:version (lowercase, no spaces)", backend="docker") from None


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    # Parallel test workers may all ask for the image at once; one builds, the others wait.
    lock_dir = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()
    with open(os.path.join(lock_dir, "execbox-image-build.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _unmount_below(root: Path) -> None:
    # debootstrap mounts /proc and /sys inside the target; a failed run can leave them there,
    # and deleting through a live mount must never happen.
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as fh:
        points = [line.split()[1] for line in fh if line.split()[1].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


def _debootstrap(rootfs: Path, suite: str, mirror: str, packages: tuple[str, ...],
                 cache_dir: Path, log_path: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed: apt-get install debootstrap "
                              "(scripts/bootstrap.sh installs it)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
           f"--cache-dir={cache_dir}", suite, str(rootfs), mirror]
    with open(log_path, "wb") as log_fh:
        proc = subprocess.run(cmd, stdout=log_fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-10:]
        raise ImageBuildError(
            f"debootstrap failed (exit {proc.returncode}) against mirror {mirror}; "
            f"full log: {log_path}\n" + "\n".join(tail)
        )


def _apt_install(rootfs: Path, packages: tuple[str, ...], cache_dir: Path, log_path: Path) -> None:
    """More Debian packages, by the root filesystem's own apt with --no-install-recommends (debootstrap's own
    resolver pulls in far more: python3-matplotlib through --include brought gcc, boost and scipy, 1.2 GB).
    From the same mirror debootstrap used; downloaded packages are cached in ``cache_dir`` across builds."""
    archives = rootfs / "var/cache/apt/archives"
    cache_dir.mkdir(parents=True, exist_ok=True)
    archives.mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LANG": "C.UTF-8"}
    mounted: list[Path] = []
    try:
        for source, point, args in ((str(cache_dir), archives, ["--bind"]), ("proc", rootfs / "proc", ["-t", "proc"])):
            done = subprocess.run(["mount", *args, source, str(point)], check=False, capture_output=True, text=True)
            if done.returncode != 0:
                raise ImageBuildError(f"cannot mount {source} into the image's root for apt-get: "
                                      f"{done.stderr.strip()[-300:]} (building needs root)")
            mounted.append(point)
        with open(log_path, "ab") as log_fh:
            for cmd in (["apt-get", "update", "-o", "Acquire::Languages=none"],
                        ["apt-get", "install", "-y", "--no-install-recommends", *packages]):
                proc = subprocess.run(["chroot", str(rootfs), *cmd], stdout=log_fh, stderr=subprocess.STDOUT,
                                      env=env, check=False)
                if proc.returncode != 0:
                    tail = log_path.read_text(errors="replace").splitlines()[-10:]
                    raise ImageBuildError(f"apt-get {cmd[1]} failed in the image (exit {proc.returncode}); full log: "
                                          f"{log_path}\n" + "\n".join(tail))
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "-l", str(point)], check=False)


def _trim(rootfs: Path) -> None:
    for pattern in _TRIM_GLOBS:
        for path in glob.glob(str(rootfs / pattern)):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
    doc = rootfs / "usr/share/doc"
    for file in doc.rglob("*") if doc.is_dir() else ():
        if file.is_file() and not file.is_symlink() and file.name != "copyright":
            file.unlink()
    # Docker provides /dev, /proc, /sys, /etc/hosts and resolv.conf at run time.
    for sub in ("dev", "proc", "sys", "run"):
        d = rootfs / sub
        if d.is_dir():
            for child in d.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    (rootfs / "workspace").mkdir(mode=0o755, exist_ok=True)


def _pip_into(rootfs: Path, work: Path, pip: tuple[str, ...], log: Log) -> None:
    """Fetch ``pip`` (checked requirements) as wheels on the host for the rootfs's Python, then install them into
    it with its own pip and no index."""
    probe = subprocess.run(["chroot", str(rootfs), "python3", "-c", PYTHON_TARGET_PROBE], capture_output=True,
                           text=True, check=False)
    if probe.returncode != 0:
        raise ImageBuildError(f"the image's python3 does not run: {probe.stderr.strip()[-300:]}")
    target = PythonTarget.parse(probe.stdout)
    wheels = rootfs / "tmp" / "execbox-wheels"
    wheels.mkdir(parents=True)
    log(f"pip: fetching {', '.join(pip)} as wheels for Python {target.major}.{target.minor} on the host")
    done = pip_download(list(pip), wheels, target)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise ImageBuildError(f"pip on the host could not fetch the Python packages as wheels (only wheels are used: "
                              f"no sdist is built on the host): {tail}")
    names = sorted(p.name for p in wheels.iterdir() if p.suffix == ".whl")
    log(f"pip: installing {len(names)} wheel(s) into the image")
    install = subprocess.run(
        ["chroot", str(rootfs), "python3", "-m", "pip", "install", "--no-index", "--no-cache-dir",
         "--break-system-packages", "--root-user-action=ignore", "--disable-pip-version-check",
         "--find-links", "/tmp/execbox-wheels", *(f"/tmp/execbox-wheels/{n}" for n in names)],
        capture_output=True, text=True, check=False, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})
    shutil.rmtree(wheels)
    if install.returncode != 0:
        (work / "pip.log").write_text(install.stdout + install.stderr)
        raise ImageBuildError(f"pip could not install the wheels into the image: "
                              f"{install.stderr.strip()[-600:]}")


def build_image(
    tag: str | None = DEFAULT_TAG,
    *,
    suite: str = DEFAULT_SUITE,
    mirror: str | None = None,
    packages: tuple[str, ...] = DEFAULT_PACKAGES,
    user: str = DEFAULT_USER,
    force: bool = False,
    client: Any = None,
    log: Log = _stderr_log,
    pip: tuple[str, ...] = (),
    requirements: tuple[Path, ...] = (),
) -> BuildResult:
    """Build (or find up to date) the sandbox image ``tag``; returns what happened and its size.

    Needs root (debootstrap) and a reachable Docker engine. A tag that exists but was not built
    by execbox is never overwritten unless ``force`` is set. ``tag`` None: the default tag, or for
    an image with more than the default content, ``recipe_tag`` (the hash says what is in it).
    ``packages``: Debian packages (``DEFAULT_PACKAGES`` and any more); ``pip``, ``requirements``:
    Python packages fetched as wheels on the host (see the module docstring). A requirements file is read here,
    each line checked as a ``pip`` requirement is (``read_requirements``); pip never sees the file.
    """
    started = time.monotonic()
    check_packages(packages)
    pip = _checked_pip(pip, requirements)
    recipe = recipe_hash(suite, packages, user, pip)
    extra = bool(pip or set(packages) - set(DEFAULT_PACKAGES))
    tag = tag or (recipe_tag(recipe) if extra else DEFAULT_TAG)
    client = client or _docker_client()

    def up_to_date() -> Any:
        image = _existing(client, tag)
        if image is None:
            return None
        labels = image.labels or {}
        if labels.get(RECIPE_LABEL) == recipe and not force:
            return image
        if IMAGE_LABEL not in labels and not force:
            raise ImageBuildError(
                f"image {tag} exists and was not built by execbox; choose another tag "
                "(--tag) or pass --force to replace it"
            )
        return None

    if (image := up_to_date()) is not None:
        log(f"{tag} is up to date ({image.short_id}, recipe {recipe})")
        return BuildResult(tag, image.id, False, time.monotonic() - started,
                           image.attrs.get("Size", 0), recipe)
    if os.geteuid() != 0:
        raise ImageBuildError(
            "building the image runs debootstrap, which needs root: "
            f"sudo {sys.executable} -m execbox.backends.docker.image build --tag {tag}"
        )

    with _build_lock():
        # Another process may have built it while we waited for the lock.
        if not force and (image := up_to_date()) is not None:
            log(f"{tag} was built by another process ({image.short_id})")
            return BuildResult(tag, image.id, False, time.monotonic() - started,
                               image.attrs.get("Size", 0), recipe)
        mirror = mirror or find_debian_mirror(suite)
        work = Path(tempfile.mkdtemp(prefix="execbox-image-", dir="/var/tmp"))
        try:
            rootfs = work / "rootfs"
            base = tuple(p for p in packages if p in DEFAULT_PACKAGES)
            more = tuple(p for p in packages if p not in DEFAULT_PACKAGES)
            log(f"debootstrap {suite} (minbase + {', '.join(base)}) from {mirror}")
            t0 = time.monotonic()
            _debootstrap(rootfs, suite, mirror, base,
                         Path("/var/cache/execbox/debootstrap"), work / "debootstrap.log")
            log(f"debootstrap done in {time.monotonic() - t0:.0f}s")
            _unmount_below(rootfs)
            if more:
                log(f"apt-get install --no-install-recommends {' '.join(more)}")
                t0 = time.monotonic()
                _apt_install(rootfs, more, Path("/var/cache/execbox/apt"), work / "apt.log")
                log(f"apt-get done in {time.monotonic() - t0:.0f}s")
                _unmount_below(rootfs)
            if pip:
                _pip_into(rootfs, work, pip, log)
            log("trimming")
            _trim(rootfs)
            tarball = work / "rootfs.tar"
            subprocess.run(
                ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(tarball), "."],
                check=True,
            )
            log(f"importing {tarball.stat().st_size / 1e6:.0f} MB into the engine as {tag}")
            repository, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "")
            added = sorted(set(packages) - set(DEFAULT_PACKAGES))
            changes = image_changes(user) + [
                f"LABEL {IMAGE_LABEL}=1 {RECIPE_LABEL}={recipe} io.execbox.image.suite={suite} "
                f"{PACKAGES_LABEL}={json.dumps(','.join(added))} {PIP_LABEL}={json.dumps(';'.join(pip))}",
            ]
            result = client.api.import_image(
                src=str(tarball), repository=repository, tag=version or "latest", changes=changes
            )
        finally:
            _unmount_below(work)
            shutil.rmtree(work, ignore_errors=True)

    image = _existing(client, tag)
    if image is None or image.labels.get(RECIPE_LABEL) != recipe:
        raise ImageBuildError(f"docker import did not produce {tag}: {result!r}")
    seconds = time.monotonic() - started
    size = image.attrs.get("Size", 0)
    log(f"built {tag} ({image.short_id}) in {seconds:.0f}s, {size / 1e6:.0f} MB")
    return BuildResult(tag, image.id, True, seconds, size, recipe)


def _checked_pip(pip: tuple[str, ...], files: tuple[Path, ...]) -> tuple[str, ...]:
    """``pip`` and every requirements file's lines, each checked: what the host's pip is given, names only."""
    try:
        checked = check_requirements(pip)
        for path in files:
            checked += read_requirements(path)
    except ExecboxError as exc:
        raise ImageBuildError(exc.message) from None
    return tuple(checked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m execbox.backends.docker.image")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the sandbox image from Debian packages (needs root)")
    b.add_argument("--tag", default=None, help="default: the default tag, or with extra content its recipe tag")
    b.add_argument("--suite", default=DEFAULT_SUITE)
    b.add_argument("--mirror", default=None, help="Debian mirror (default: the host's apt source)")
    b.add_argument("--include", default="", help="extra Debian packages, comma-separated")
    b.add_argument("--pip", action="append", default=[], help="a Python requirement (repeatable)")
    b.add_argument("--requirements", action="append", default=[], help="a requirements file (repeatable)")
    b.add_argument("--force", action="store_true", help="rebuild even when up to date")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    extra = tuple(p for p in args.include.split(",") if p)
    try:
        result = build_image(args.tag, suite=args.suite, mirror=args.mirror,
                             packages=DEFAULT_PACKAGES + extra, force=args.force, pip=tuple(args.pip),
                             requirements=tuple(Path(p) for p in args.requirements))
    except ExecboxError as exc:  # ImageBuildError, and what pip or the engine raised on the way
        print(f"execbox image: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
