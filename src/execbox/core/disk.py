"""A workspace that cannot grow past a size: an ext4 image of its own, loop-mounted on the directory.

Why this shape: the workspace is a host directory (files go in and out through the host), so a limit on
the container's or namespace's own filesystem does not cover it, and Docker's ``--storage-opt size``
needs overlay2 on XFS with project quotas, which most hosts lack. A sparse image file per sandbox,
formatted and loop-mounted on the workspace, works on any Linux host where execbox runs as root: a write
past the limit fails with ENOSPC inside the sandbox, and the host's disk grows by at most the image's
size. The image lives beside the workspace (``<workspace>.disk``), never inside the sandbox's reach.
Without root (or without mkfs.ext4 / loop devices) the limit is not available, and backends do not claim
the ``disk`` limit: a request that demands it is refused by the guard.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess

IMAGE_SUFFIX = ".disk"
_TOOLS = ("mkfs.ext4", "mount", "umount")


def unavailable_reason() -> str | None:
    """Why a size-limited workspace cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "a size-limited workspace needs root (a loop-mounted filesystem per sandbox)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} missing (apt-get install e2fsprogs mount)"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices on this host (/dev/loop-control is missing)"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    if done.returncode != 0:
        raise OSError(f"{argv[0]} failed ({done.returncode}): {done.stderr.strip()[-300:]}")


def mount_sized(path: str, size_mb: int, owner: tuple[int, int]) -> None:
    """Make the empty directory ``path`` a filesystem of ``size_mb`` MiB whose root belongs to ``owner``.

    Raises OSError when it cannot; leaves nothing behind then."""
    image = path + IMAGE_SUFFIX
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_mb << 20)  # sparse: costs the host only what the sandbox writes
    finally:
        os.close(fd)
    try:
        # No journal, no reserved blocks: the sandbox gets exactly size_mb; lazy init keeps mkfs instant.
        _run("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
             "-E", f"root_owner={owner[0]}:{owner[1]},lazy_itable_init=1,nodiscard", image)
        _run("mount", "-o", "loop,nosuid,nodev,noatime", image, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(image)
        raise
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(path, "lost+found"))
    os.chmod(path, 0o700)


def is_mounted(path: str) -> bool:
    real = os.fsencode(os.path.realpath(path))
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", "rb") as fh:
        for line in fh:
            fields = line.split()
            # The kernel writes space, tab, newline and backslash in a mount point as octal escapes (\040...).
            if len(fields) > 4 and re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4]) == real:
                return True
    return False


def release_sized(path: str) -> None:
    """Unmount ``path`` if a sized workspace is mounted there and delete its image. Safe on a plain directory,
    and safe to call twice. A busy mount is detached lazily: it goes when its last user (a dying sandbox)
    does, and the image's space with it."""
    if is_mounted(path):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _run("umount", path)
        if is_mounted(path):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _run("umount", "-l", path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + IMAGE_SUFFIX)
