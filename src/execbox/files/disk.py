"""A workspace that cannot grow past a size: an ext4 image of its own, loop-mounted on the directory.

Why this shape: the workspace is a host directory (files go in and out through the host), so a limit on
the container's or namespace's own filesystem does not cover it, and Docker's ``--storage-opt size``
needs overlay2 on XFS with project quotas, which most hosts lack. A sparse image file per sandbox,
formatted and loop-mounted on the workspace, works on any Linux host where execbox runs as root: a write
past the limit fails with ENOSPC inside the sandbox, and the host's disk grows by at most the image's
size. The image lives beside the workspace (``<workspace>.disk``), never inside the sandbox's reach.
Without root (or without mkfs.ext4 / loop devices) the limit is not available, and backends do not claim
the ``disk`` limit: a request that demands it is refused by the guard.

Fast, because every one-shot pays it: the filesystem is formatted once per process and size (a template: the
~1 MB that mkfs writes into a 2 GiB image, kept in memory and written into each new sparse image), and the loop
device and the mount are set up with their system calls (LOOP_CONFIGURE with autoclear, mount(2), umount2(2)),
not with mount(8) and umount(8): ~2 ms instead of ~13 ms, and ~2 instead of ~4 to release. And begun early
(``mount_sized_soon``): backends make it while they start what does not need it yet, a container or a launcher.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading

IMAGE_SUFFIX = ".disk"
_TOOLS = ("mkfs.ext4",)
_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE, _LOOP_SET_FD, _LOOP_SET_STATUS64 = 0x4C82, 0x4C0A, 0x4C00, 0x4C04
_LO_FLAGS_AUTOCLEAR = 4
# struct loop_info64: lo_flags after 5 u64 and 3 u32; struct loop_config: fd, block_size, loop_info64, reserved.
_LOOP_INFO_SIZE, _LO_FLAGS_OFFSET = 232, 5 * 8 + 3 * 4
_LOOP_CONFIG_SIZE = 8 + _LOOP_INFO_SIZE + 64
_MS_NOSUID, _MS_NODEV, _MS_NOATIME, _MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 4, 1024, 2, 8
_TEMPLATE_MAX = 16 << 20  # a bigger format (a huge disk limit) is made by mkfs each time, not kept in memory
_templates: dict[tuple[int, int, int], list[tuple[int, bytes]]] = {}
_templates_lock = threading.Lock()
_libc: ctypes.CDLL | None = None


def unavailable_reason() -> str | None:
    """Why a size-limited workspace cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "a size-limited workspace needs root (a loop-mounted filesystem per sandbox)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} missing (apt-get install e2fsprogs)"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices on this host (/dev/loop-control is missing)"
    return None


def _mkfs(image: str, owner: tuple[int, int]) -> None:
    # No journal, no reserved blocks: the sandbox gets exactly the size; lazy init keeps mkfs instant.
    done = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E",
                           f"root_owner={owner[0]}:{owner[1]},lazy_itable_init=1,nodiscard", image],
                          check=False, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    if done.returncode != 0:
        raise OSError(f"mkfs.ext4 failed ({done.returncode}): {done.stderr.strip()[-300:]}")


def _template(size_mb: int, owner: tuple[int, int]) -> list[tuple[int, bytes]] | None:
    """The data extents (offset, bytes) of a freshly formatted image of this size and owner, made once per process;
    None when they are too big to keep."""
    key = (size_mb, *owner)
    with _templates_lock:
        if key not in _templates:
            extents: list[tuple[int, bytes]] = []
            with tempfile.TemporaryDirectory(prefix="execbox-mkfs-") as scratch:
                image = os.path.join(scratch, "template")
                with open(image, "wb") as fh:
                    fh.truncate(size_mb << 20)
                _mkfs(image, owner)
                _settle_root(image, os.path.join(scratch, "root"))
                fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    end, offset, total = size_mb << 20, 0, 0
                    while offset < end:
                        try:
                            start = os.lseek(fd, offset, os.SEEK_DATA)
                        except OSError as exc:
                            if exc.errno == errno.ENXIO:  # no data after offset
                                break
                            raise
                        stop = os.lseek(fd, start, os.SEEK_HOLE)
                        total += stop - start
                        if total > _TEMPLATE_MAX:
                            extents = []
                            break
                        extents.append((start, os.pread(fd, stop - start, start)))
                        offset = stop
                finally:
                    os.close(fd)
            _templates[key] = extents
    return _templates[key] or None


def _settle_root(image: str, mount_point: str) -> None:
    """Give a new filesystem the root a workspace starts with: empty (no lost+found for the sandbox to trip over)
    and 0700. Done once in the template, each time only without one."""
    os.mkdir(mount_point, 0o700)
    _loop_mount(image, mount_point)
    try:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(mount_point, "lost+found"))
        os.chmod(mount_point, 0o700)
    finally:
        release_sized(mount_point)


def _write_image(image: str, size_mb: int, owner: tuple[int, int]) -> bool:
    """Write a formatted image; True when it came from the template (its root already settled)."""
    template = _template(size_mb, owner)
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_mb << 20)  # sparse: costs the host only what the sandbox writes
        for offset, data in template or ():
            os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
    if template is None:
        _mkfs(image, owner)
    return template is not None


def _sys() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _loop_mount(image: str, path: str) -> None:
    """Attach ``image`` to a free loop device (detached automatically when unmounted) and mount it on ``path``."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(50):  # another process may take the free device first
                device = f"/dev/loop{fcntl.ioctl(control, _LOOP_CTL_GET_FREE)}"
                loop = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                try:
                    _attach(loop, backing)
                    break
                except OSError as exc:
                    os.close(loop)
                    if exc.errno != errno.EBUSY:
                        raise OSError(exc.errno, f"cannot attach {image} to {device}: {exc.strerror}") from exc
            else:
                raise OSError(errno.EBUSY, "no free loop device")
        finally:
            os.close(control)
    finally:
        os.close(backing)
    try:  # the open loop device keeps it attached until the mount holds it
        _check(_sys().mount(os.fsencode(device), os.fsencode(path), b"ext4", _MS_NOSUID | _MS_NODEV | _MS_NOATIME,
                            None), f"mount {device} on {path}")
    finally:
        os.close(loop)


def _attach(loop: int, backing: int) -> None:
    info = bytearray(_LOOP_INFO_SIZE)
    struct.pack_into("=I", info, _LO_FLAGS_OFFSET, _LO_FLAGS_AUTOCLEAR)
    try:
        fcntl.ioctl(loop, _LOOP_CONFIGURE, struct.pack("=II", backing, 0) + bytes(info) + bytes(64))
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTTY):
            raise
        # Linux before 5.8 has no LOOP_CONFIGURE: attach, then set the flags (a window another opener could use).
        fcntl.ioctl(loop, _LOOP_SET_FD, backing)
        try:
            fcntl.ioctl(loop, _LOOP_SET_STATUS64, bytes(info))
        except OSError:
            fcntl.ioctl(loop, 0x4C01)  # LOOP_CLR_FD
            raise


def mount_sized(path: str, size_mb: int, owner: tuple[int, int]) -> None:
    """Make the empty directory ``path`` a filesystem of ``size_mb`` MiB whose root belongs to ``owner``.

    Raises OSError when it cannot; leaves nothing behind then."""
    image = path + IMAGE_SUFFIX
    settled = _write_image(image, size_mb, owner)
    try:
        _loop_mount(image, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(image)
        raise
    if not settled:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(path, "lost+found"))
        os.chmod(path, 0o700)


def mount_sized_soon(path: str, size_mb: int, owner: tuple[int, int]) -> concurrent.futures.Future[None]:
    """``mount_sized`` begun in a thread of its own, so that the caller starts meanwhile what does not need the
    workspace (a container, a launcher); wait on the future before anything may use it. Release with
    ``release_sized`` only once it is done (either way): until then part of the mount may still appear."""
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        done.set_running_or_notify_cancel()  # running: a waiter's cancel() no longer cancels the mount
        try:
            mount_sized(path, size_mb, owner)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=run, name="execbox-sized-workspace", daemon=True).start()
    return done


def tmpfs_path_mb(tmpfs_mb: int, disk_mb: int | None) -> int:
    """The size of a sandbox's extra tmpfs= path: the backend's /tmp size (``tmpfs_mb``), at most the disk limit."""
    return min(tmpfs_mb, disk_mb or tmpfs_mb)


def mount_tmpfs(path: str, size_mb: int, owner: tuple[int, int]) -> bool:
    """As root, mount an empty tmpfs of ``size_mb`` on the directory ``path``, owned by ``owner``, mode 0700; True
    when mounted (``release_sized`` unmounts it). Not root: False, and ``path`` stays a plain directory."""
    if os.geteuid() != 0:
        return False
    options = f"size={size_mb}m,mode=0700,uid={owner[0]},gid={owner[1]}".encode()
    _check(_sys().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options),
           f"mount a tmpfs on {path}")
    return True


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
    does, and the image's space with it (the loop device detaches itself then)."""
    target = os.fsencode(path)
    # No mount there: EINVAL (or ENOENT), nothing to do; /proc/self/mountinfo is not read (a host with many
    # containers has a long one, and every one-shot comes here).
    if _sys().umount2(target, _UMOUNT_NOFOLLOW) != 0 and ctypes.get_errno() == errno.EBUSY:
        _sys().umount2(target, _MNT_DETACH | _UMOUNT_NOFOLLOW)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + IMAGE_SUFFIX)
