"""One fake remote sandbox on this machine: what the modal, daytona and vercel fakes run commands in.

A box is a private root filesystem in a temporary directory (the host's /usr, /etc, ... bound read-only,
everything else its own: /tmp, /root, /workspace, /home/..., so absolute paths behave as in the remote
sandbox), its own PID namespace (stopping the box kills every process it started, setsid or
double-forked) and, when asked, its own network namespace holding only loopback (so "no network" is real,
not recorded). Commands enter it with ``nsenter`` + ``chroot``, with exactly the environment they are given.

It needs util-linux (``unshare``, ``nsenter``) and root, or unprivileged user namespaces;
``unavailable_reason()`` says why not. Standard library only, and nothing from execbox: the fakes work on
their own.

What it does not model: CPU limits (recorded by the fakes, not enforced), the provider's OS image (the
host's userland is used), and the memory limit is an address-space rlimit (``prlimit --as``), so a
runaway allocation fails with an error instead of an OOM kill.
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from execbox.files.workspace import remove_tree

# Host directories the box sees read-only (symlinks, e.g. /bin -> usr/bin, are copied as symlinks).
HOST_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Runs as PID 1 of the box (outside the chroot, so the host's python is there). It reaps orphans and
# exits when the process that created the box is gone, which takes the whole box down with it.
_INIT = """
import os, sys, time
owner = sys.argv[1]
os.write(1, b"ready\\n")
os.close(1)
while os.path.exists("/proc/" + owner):
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    time.sleep(0.2)
"""

# Runs inside the fresh namespaces before PID 1 takes over: builds the root (mounts stay in the box's
# private mount namespace and vanish with it).
_SETUP = r"""
set -e
root=$1; shift
for d in "$@"; do mount --bind -o ro "/$d" "$root/$d"; done
mount -t tmpfs -o mode=755,size=64k tmpfs "$root/dev"
for n in null zero full random urandom tty; do
  if [ -e "/dev/$n" ]; then touch "$root/dev/$n"; mount --bind "/dev/$n" "$root/dev/$n"; fi
done
mkdir "$root/dev/shm" "$root/dev/pts"
mount -t tmpfs -o mode=1777,size=64m tmpfs "$root/dev/shm"
ln -s /proc/self/fd "$root/dev/fd"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"
mount -t proc proc "$root/proc"
if [ "$EXECBOX_BOX_NET" = none ] && command -v ip >/dev/null 2>&1; then ip link set lo up; fi
exec "$EXECBOX_BOX_PYTHON" -I -S -c "$EXECBOX_BOX_INIT" "$EXECBOX_BOX_OWNER"
"""


def _userns() -> list[str]:
    """Without root, a user namespace maps us to root inside the box."""
    return [] if os.geteuid() == 0 else ["--user", "--map-root-user"]


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why boxes cannot run on this machine (None when they can)."""
    for tool in ("unshare", "nsenter", "chroot", "mount", "prlimit"):
        if shutil.which(tool) is None:
            return f"the remote-SDK fakes need `{tool}` (util-linux/coreutils) on PATH"
    probe = ["unshare", *_userns(), "--mount", "--pid", "--fork", "--kill-child", "--net", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the remote-SDK fakes cannot create namespaces here: {exc}"
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip()
        return ("the remote-SDK fakes need root or unprivileged user namespaces "
                f"(`unshare --mount --pid --net` failed: {detail})")
    return None


@dataclass
class Completed:
    returncode: int  # negative: killed by that signal (as subprocess reports it)
    stdout: bytes
    stderr: bytes
    timed_out: bool


class BoxError(RuntimeError):
    """The box itself failed (not the command in it)."""


class Box:
    """A private root + PID namespace (+ network namespace when ``network == "none"``)."""

    def __init__(self, *, network: str = "allow", dirs: tuple[str, ...] = (), memory_mb: int | None = None,
                 seed: Path | None = None) -> None:
        """``seed``: a directory ``save`` wrote (a provider's snapshot): the box starts with those files."""
        reason = unavailable_reason()
        if reason:
            raise BoxError(reason)
        self.network = network
        self.memory_mb = memory_mb
        self.dir = Path(tempfile.mkdtemp(prefix="execbox-fakebox-"))
        self.root = self.dir / "root"
        self.root.mkdir()
        for name in HOST_DIRS:
            host = Path("/") / name
            if host.is_symlink():
                (self.root / name).symlink_to(os.readlink(host))
            elif host.is_dir():
                (self.root / name).mkdir()
        for name in ("dev", "proc", "tmp", "root", "home", "var/tmp", "run"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "tmp", 0o1777)
        for d in dirs:
            (self.root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
        if seed is not None:
            _copy(seed, self.root)
        self._holder: subprocess.Popen[bytes] | None = None
        self._init_pid: int | None = None
        self.start()

    # --- life cycle -----------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._holder is not None and self._holder.poll() is None

    def start(self) -> None:
        """Start the namespaces over the box's root (again, after ``stop``: files survive, processes do not)."""
        if self.running:
            return
        binds = [n for n in HOST_DIRS if (Path("/") / n).is_dir() and not (Path("/") / n).is_symlink()]
        cmd = ["unshare", *_userns(), "--mount", "--pid", "--fork", "--kill-child"]
        if self.network == "none":
            cmd.append("--net")
        cmd += ["/bin/sh", "-c", _SETUP, "setup", str(self.root), *binds]
        env = {
            "PATH": PATH, "EXECBOX_BOX_PYTHON": sys.executable, "EXECBOX_BOX_INIT": _INIT,
            "EXECBOX_BOX_OWNER": str(os.getpid()), "EXECBOX_BOX_NET": self.network,
        }
        holder = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=env, start_new_session=True)
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if line != b"ready\n":
            holder.kill()
            _, err = holder.communicate()
            raise BoxError(f"the fake sandbox did not start: {err.decode(errors='replace').strip()}")
        self._holder = holder
        self._init_pid = self._find_init(holder.pid)

    @staticmethod
    def _find_init(unshare_pid: int) -> int:
        """The host pid of the box's PID 1: the only child of the unshare process."""
        for _ in range(200):
            try:
                children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
            except OSError:
                children = []
            if children:
                return int(children[0])
            time.sleep(0.01)
        raise BoxError("the fake sandbox's init process did not appear")

    def stop(self) -> None:
        """Kill every process in the box (PID 1 dying takes its namespace with it). Files stay."""
        holder, self._holder = self._holder, None
        if holder is None:
            return
        if self._init_pid:
            try:
                os.kill(self._init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            holder.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        for pipe in (holder.stdout, holder.stderr):
            if pipe:
                pipe.close()

    def destroy(self) -> None:
        self.stop()
        remove_tree(str(self.dir))

    def save(self, dest: Path) -> None:
        """The box's own files (what its code wrote anywhere: /tmp, /root, the workspace) into the new directory
        ``dest``, owners, modes and links kept: what a provider's filesystem snapshot holds. The host's
        directories and /dev, /proc are the box's mounts, not its files, and are left out."""
        dest.mkdir(mode=0o700)
        skip = {*HOST_DIRS, "dev", "proc"}
        for entry in sorted(self.root.iterdir()):
            if entry.name not in skip:
                _copy(entry, dest, whole=True)

    # --- commands ---------------------------------------------------------------------------------------

    def command(self, argv: list[str], *, cwd: str, env: dict[str, str]) -> list[str]:
        """The host command line that runs ``argv`` inside the box with exactly ``env`` and ``cwd``."""
        if not self.running:
            raise BoxError("the fake sandbox is not running")
        enter = ["nsenter", f"--target={self._init_pid}", "--mount", "--pid"]
        if os.geteuid() != 0:
            enter[1:1] = ["--user", "--preserve-credentials"]  # we are mapped to root in there already
        if self.network == "none":
            enter.append("--net")
        inner = ["/usr/sbin/chroot", str(self.root)]
        if self.memory_mb:
            inner += ["/usr/bin/prlimit", f"--as={self.memory_mb * 1024 * 1024}", "--"]
        inner += ["/usr/bin/env", "-i", f"--chdir={cwd}", *(f"{k}={v}" for k, v in env.items()), *argv]
        return [*enter, "--", *inner]

    def popen(self, argv: list[str], *, cwd: str, env: dict[str, str], stdin: int | None = subprocess.DEVNULL,
              stdout: int | None = subprocess.PIPE, stderr: int | None = subprocess.PIPE) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command(argv, cwd=cwd, env=env), stdin=stdin, stdout=stdout, stderr=stderr,
                                env={"PATH": PATH}, start_new_session=True)

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        """Kill a command and its process group (a setsid descendant stays, as in a real sandbox)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def run(self, argv: list[str], *, cwd: str, env: dict[str, str] | None = None, input: bytes | None = None,
            timeout: float | None = None, merge_stderr: bool = False) -> Completed:
        """Run to completion (or kill at ``timeout``) and return all of the output."""
        proc = self.popen(argv, cwd=cwd, env=env if env is not None else {"PATH": PATH},
                          stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                          stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
        return collect(proc, input=input, timeout=timeout)


def collect(proc: subprocess.Popen[bytes], *, input: bytes | None = None, timeout: float | None = None,
            grace: float = 1.0) -> Completed:
    """Feed ``input``, read both pipes until EOF; at ``timeout`` kill the group and read for ``grace`` more.

    Pipes still held open by an escaped process do not hang the caller past the grace period."""
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    buffers: dict[int, bytearray] = {}  # by fd
    for pipe, buf in ((proc.stdout, out), (proc.stderr, err)):
        if pipe is not None:
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe, selectors.EVENT_READ)
            buffers[pipe.fileno()] = buf
    pending = memoryview(input or b"")
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        if pending:
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    hard_stop = None
    while sel.get_map():
        now = time.monotonic()
        if deadline is not None and now >= deadline and not timed_out:
            timed_out = True
            Box.kill(proc)
            hard_stop = now + grace
        if hard_stop is None and proc.poll() is not None:
            hard_stop = now + grace  # the command is done; a straggler may hold the pipes only this long
        if hard_stop is not None and now >= hard_stop:
            break
        wait = [0.1]
        if deadline is not None and not timed_out:
            wait.append(max(0.0, deadline - now))
        for key, _ in sel.select(min(wait)):
            if key.fileobj is proc.stdin:
                try:
                    sent = os.write(key.fd, pending[:65536])
                except (BrokenPipeError, BlockingIOError) as exc:
                    sent = 0 if isinstance(exc, BlockingIOError) else len(pending)
                pending = pending[sent:]
                if not pending:
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            chunk = os.read(key.fd, 65536)
            if chunk:
                buffers[key.fd] += chunk
            else:
                sel.unregister(key.fileobj)
    for key in list(sel.get_map().values()):
        sel.unregister(key.fileobj)
    sel.close()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()
    if not timed_out and deadline is not None:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            proc.wait(remaining)
        except subprocess.TimeoutExpired:
            timed_out = True
            Box.kill(proc)
    if timed_out:
        Box.kill(proc)
    rc = proc.wait()
    return Completed(rc, bytes(out), bytes(err), timed_out)


# The file helpers run inside the box, as the providers' own file APIs do, so a symlink the sandboxed code
# planted resolves inside the box, never on the host. Exit codes: 2 no such file, 20 not a directory,
# 21 is a directory.
_WRITE = ('[ -d "$1" ] && exit 21; d=$(dirname -- "$1"); '
          '[ -e "$d" ] && [ ! -d "$d" ] && exit 20; mkdir -p -- "$d" 2>/dev/null || exit 20; exec cat > "$1"')
_READ = '[ -d "$1" ] && exit 21; [ -e "$1" ] || exit 2; exec cat -- "$1"'


def write_file(box: Box, path: str, data: bytes, *, cwd: str = "/") -> int:
    """Write inside the box; returns the helper's exit code (0 on success)."""
    return box.run(["/bin/sh", "-c", _WRITE, "sh", path], cwd=cwd, input=data, timeout=60).returncode


def read_file(box: Box, path: str, *, cwd: str = "/") -> tuple[int, bytes]:
    done = box.run(["/bin/sh", "-c", _READ, "sh", path], cwd=cwd, timeout=60)
    return done.returncode, done.stdout


def _copy(source: Path, dest: Path, *, whole: bool = False) -> None:
    """``cp -a``: ``source`` itself into ``dest`` (``whole``), else what ``source`` holds merged into ``dest``."""
    done = subprocess.run(["cp", "-a", "--", str(source) if whole else f"{source}/.", str(dest)],
                          capture_output=True, timeout=600)
    if done.returncode:
        raise BoxError(f"could not copy the fake sandbox's files: {done.stderr.decode(errors='replace').strip()}")
