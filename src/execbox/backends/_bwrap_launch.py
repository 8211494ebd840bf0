"""Starts bwrap with the run's limits and stays beside it, so that nothing it starts outlives the caller.

Started by the bubblewrap backend as ``python -I -S _bwrap_launch.py KEY=VALUE... -- COMMAND...``. The
launcher forks; the child sets the rlimits, moves itself into the run's cgroups, opens the files bwrap
reads (argument list, seccomp program, status), drops to the unprivileged host uid when started as root
(so that even the host kernel sees the sandbox as that uid, not as root) and execs bwrap with an empty
environment. Doing this in a fresh process, not in a ``preexec_fn``, keeps it out of execbox's own
(threaded) process. Standard library only, and few imports: it runs on every exec.

Why the launcher stays instead of becoming bwrap: ``bwrap --die-with-parent`` leaves a window. The
sandbox's pid 1 asks for its parent-death signal only once it has set the sandbox up; a caller killed
before that (SIGKILL, OOM) leaves a sandbox that nobody will ever kill. So the launcher is a child
subreaper (an orphaned pid 1 is re-parented to it, not to the host's init), learns of the caller's
death through its own parent-death signal, and on that, on SIGTERM (the deadline) or on SIGHUP/SIGINT,
SIGKILLs every process left under it and exits. Killing the sandbox's pid 1 ends its PID namespace,
setsid and double-forked processes included. It also exits only once bwrap's pid 1 is gone, so a
finished exec has no process left behind.

    rlimit=NAME:VALUE   resource.RLIMIT_NAME, soft = hard (repeatable)
    cgroup=PATH         a cgroup.procs file to write bwrap's pid to (repeatable)
    args=PATH           NUL-separated bwrap options (bwrap --args: environment values stay off the
                        command line); the command itself follows ``--`` on ours
    seccomp=PATH        compiled seccomp program for bwrap --seccomp
    status=PATH         file bwrap writes its JSON status to (child-pid once the sandbox exists)
    user=UID:GID        host identity to drop to (only when started as root)
    bwrap=PATH          the bwrap binary
    parent=PID          the caller: if it is already gone when the launcher starts, nothing is started
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # importing typing would cost every exec ~20 ms
    from types import FrameType
    from typing import NoReturn

EXIT_LAUNCH_FAILED = 125
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def fail(message: str) -> NoReturn:
    os.write(2, f"execbox: bubblewrap launch failed: {message}\n".encode())
    os._exit(EXIT_LAUNCH_FAILED)


def prctl(libc: ctypes.CDLL, option: int, value: int) -> None:
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def children() -> list[int]:
    """Our children, zombies included (after bwrap's death its orphaned pid 1 is one of them)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as fh:
            return [int(pid) for pid in fh.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: look at every process's parent
        found: list[int] = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    if int(fh.read().rsplit(b")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
        return found


def kill_all() -> None:
    """SIGKILL everything under us, again for each orphan re-parented to us, until nothing is left."""
    while True:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def stop(signum: int, _frame: FrameType | None) -> None:
    kill_all()
    os._exit(128 + signum)


def start_bwrap(opts: dict[str, str], rlimits: list[str], cgroups: list[str], command: list[str],
                libc: ctypes.CDLL) -> NoReturn:
    """In the forked child: limits, cgroups, files, identity, then exec bwrap. Never returns."""
    try:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        for spec in rlimits:
            name, _, value = spec.partition(":")
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(value), int(value)))
        pid = str(os.getpid()).encode()
        for procs in cgroups:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        args_fd = os.open(opts["args"], os.O_RDONLY)
        seccomp_fd = os.open(opts["seccomp"], os.O_RDONLY)
        status_fd = os.open(opts["status"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd in (args_fd, seccomp_fd, status_fd):
            os.set_inheritable(fd, True)
        if "user" in opts:
            uid, _, gid = opts["user"].partition(":")
            os.setgroups([])
            os.setresgid(int(gid), int(gid), int(gid))
            os.setresuid(int(uid), int(uid), int(uid))
            if os.getuid() == 0 or os.geteuid() == 0:
                fail("still root after dropping privileges")
        # A change of identity clears the parent-death signal: ask for it only now, and bwrap keeps it.
        prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != int(opts["launcher"]):
            os._exit(EXIT_LAUNCH_FAILED)
        argv = [opts["bwrap"], "--seccomp", str(seccomp_fd), "--json-status-fd", str(status_fd),
                "--args", str(args_fd), "--", *command]
        os.execve(opts["bwrap"], argv, {})
    except (OSError, KeyError, ValueError, AttributeError, OverflowError) as exc:
        fail(f"{type(exc).__name__}: {exc}")


def main() -> None:
    rlimits: list[str] = []
    cgroups: list[str] = []
    opts: dict[str, str] = {}
    try:
        split = sys.argv.index("--")
        command = sys.argv[split + 1:]
        for item in sys.argv[1:split]:
            key, _, value = item.partition("=")
            if key == "rlimit":
                rlimits.append(value)
            elif key == "cgroup":
                cgroups.append(value)
            else:
                opts[key] = value
        libc = ctypes.CDLL(None, use_errno=True)
        for sig in _STOP_SIGNALS:
            signal.signal(sig, stop)
        prctl(libc, PR_SET_CHILD_SUBREAPER, 1)
        prctl(libc, PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != int(opts["parent"]):  # the caller died before we could watch it
            os._exit(EXIT_LAUNCH_FAILED)
        opts["launcher"] = str(os.getpid())
    except (OSError, KeyError, ValueError) as exc:
        fail(f"{type(exc).__name__}: {exc}")
    bwrap = os.fork()
    if bwrap == 0:
        start_bwrap(opts, rlimits, cgroups, command, libc)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            fail("bwrap vanished")
        if pid == bwrap:
            break
    code = os.waitstatus_to_exitcode(status)
    kill_all()
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
