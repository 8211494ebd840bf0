"""The sandbox's root filesystem: the docker image exported once into a directory named by the image's content
id under execbox's state dir (``state_dir()/gvisor/rootfs/<id>``), shared read-only by every sandbox. One process
exports while others wait on a lock; an export is made in a ``.partial-*`` directory and renamed into place, so a
reader never sees half of one."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from execbox.plugin import BackendUnavailableError, host_env, remove_tree, state_dir

# What a sandbox mounts over: these must exist in a read-only root.
MOUNT_POINTS = ("proc", "dev", "sys", "tmp", "workspace")


def base_dir() -> Path:
    return state_dir() / "gvisor"


def _unavailable(reason: str, fix: str) -> BackendUnavailableError:
    return BackendUnavailableError(f"gvisor: {reason}", backend="gvisor", fix=fix, env_var="CODE_EXEC_GVISOR_ROOTFS")


@contextlib.contextmanager
def _locked(directory: Path, blocking: bool = True) -> Iterator[bool]:
    directory.mkdir(parents=True, exist_ok=True, mode=0o711)
    with open(directory / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


def _docker(*args: str, timeout: float = 120) -> str:
    docker = shutil.which("docker")
    if docker is None:
        raise FileNotFoundError("docker")
    done = subprocess.run([docker, *args], capture_output=True, text=True, timeout=timeout, env=host_env(),
                          check=False)
    if done.returncode != 0:
        raise OSError(done.stderr.strip()[-300:] or f"docker {args[0]} failed ({done.returncode})")
    return done.stdout.strip()


def ensure_rootfs(image: str) -> tuple[str, float]:
    """The root filesystem of ``image`` (exported now if it is not cached yet) and the seconds the export took
    (0 when cached)."""
    fix = ("build the sandbox image on a host with a docker engine (`execbox image build`), or set "
           "CODE_EXEC_GVISOR_ROOTFS to a prepared root filesystem directory, e.g. made as root by `debootstrap "
           "--variant=minbase --include=python3,ca-certificates bookworm /var/lib/execbox/rootfs` and `mkdir "
           "/var/lib/execbox/rootfs/workspace`")
    try:
        image_id = _docker("image", "inspect", "--format", "{{.Id}}", image, timeout=30)
    except FileNotFoundError:
        raise _unavailable("no root filesystem: CODE_EXEC_GVISOR_ROOTFS is unset and there is no docker CLI to "
                           f"export {image} from", fix) from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _unavailable(f"cannot read the image {image}: {exc}", fix) from None
    cache = base_dir() / "rootfs"
    target = cache / image_id.removeprefix("sha256:")[:16]
    if (target / ".complete").exists():
        return str(target), 0.0
    started = time.monotonic()
    with _locked(cache):
        if (target / ".complete").exists():  # another process exported it while we waited
            return str(target), 0.0
        partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache))
        container = ""
        try:
            os.chmod(partial, 0o755)
            container = _docker("create", image, "/bin/true", timeout=60)
            with subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE, env=host_env()) as export:
                untar = subprocess.run(["tar", "-x", "--numeric-owner", "-C", str(partial)], stdin=export.stdout,
                                       capture_output=True, check=False)
            if export.returncode != 0 or untar.returncode != 0:
                raise OSError(f"docker export | tar failed: {untar.stderr.decode(errors='replace')[-300:]}")
            for name in MOUNT_POINTS:
                (partial / name).mkdir(exist_ok=True)
            (partial / ".complete").write_text(image_id + "\n")
            os.rename(partial, target)
        except (OSError, subprocess.SubprocessError) as exc:
            remove_tree(str(partial))
            raise _unavailable(f"cannot export {image} into a root filesystem: {exc}", fix) from None
        finally:
            if container:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    _docker("rm", "-f", container, timeout=60)
    return str(target), time.monotonic() - started


def sweep_partial_exports() -> list[str]:
    """Half-made exports of a process that died while exporting (only when no export runs now)."""
    cache = base_dir() / "rootfs"
    if not cache.is_dir():
        return []
    removed = []
    with _locked(cache, blocking=False) as held:
        if held:
            for entry in cache.iterdir():
                if entry.name.startswith(".partial-") and entry.is_dir() and not entry.is_symlink():
                    remove_tree(str(entry))
                    removed.append(str(entry))
    return removed
