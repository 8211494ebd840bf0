"""Runs one command and leaves none of its processes alive, however they tried to escape.

Started by execbox (``python -I -S _reaper.py CONFIG_JSON ARGV...``) in a new session. It makes itself a
child subreaper, so a grandchild that called setsid or double-forked is re-parented to it rather than to
init; when the command exits, or when execbox sends SIGTERM at the deadline, or when execbox itself dies
(PDEATHSIG), it SIGKILLs every descendant until none is left, then exits with the command's status.
Standard library only: it runs before anything of execbox is imported.

The reaper runs on the host with the caller's privileges, so it starts with a clean environment, never
the request's. The command's environment waits in an inherited descriptor (``CommandEnv`` in processes.py,
``NAME=VALUE\0`` records): with ``"env_fd"`` in the config the reaper reads it and gives it to the
command's execve alone; behind a launcher, ``_reaper.py --exec-env FD ARGV...`` is the last step
before the command and does the same there, after the launcher.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time

TYPE_CHECKING = False  # typing is not imported at run time: the reaper starts on every exec
if TYPE_CHECKING:
    from types import FrameType
    from typing import NoReturn

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


class Terminated(Exception):
    pass


def _on_signal(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated(signum)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree() -> None:
    me = os.getpid()
    while True:
        pids = _descendants(me)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
        time.sleep(0.005)


def read_env(fd: int) -> dict[bytes, bytes]:
    """The command's environment from descriptor ``fd``, which is closed: the command does not inherit it."""
    chunks: list[bytes] = []
    offset = 0
    try:
        while chunk := os.pread(fd, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        os.close(fd)
    except OSError as exc:
        os.write(2, f"execbox: the command's environment did not reach it (descriptor {fd}: {exc.strerror}); a "
                    "launcher must keep inherited descriptors open, and run_process needs command_env=\n".encode())
        os._exit(126)
    pairs = (item.partition(b"=") for item in b"".join(chunks).split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def exec_command(argv: list[str], env: dict[bytes, bytes] | None) -> NoReturn:
    """Become ``argv`` (searched on the PATH of its own environment): exits 127/126 if that fails."""
    # Python ignores these at start-up; an ignored signal stays ignored across execve, and a command must
    # die of a closed pipe or an exceeded file-size limit as it would anywhere else.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        if env is None:
            os.execvp(argv[0], argv)
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        os.write(2, f"execbox: cannot run {argv[0]!r}: {exc.strerror}\n".encode())
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


def exec_with_env() -> NoReturn:
    """``--exec-env FD ARGV...``: the step behind a launcher that gives the command its environment."""
    exec_command(sys.argv[3:], read_env(int(sys.argv[2])))


def main() -> NoReturn:
    config = json.loads(sys.argv[1])
    argv = sys.argv[2:]
    env = read_env(config["env_fd"]) if "env_fd" in config else None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    if os.getppid() != config["parent"]:  # execbox died before PDEATHSIG was armed
        sys.exit(137)
    pid = os.fork()
    if pid == 0:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        for name, value in config.get("rlimits", {}).items():
            resource.setrlimit(getattr(resource, name), (value, value))
        exec_command(argv, env)
    try:
        while True:
            waited, status = os.waitpid(pid, 0)
            if waited == pid:
                break
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
    except Terminated as exc:
        code = 128 + exc.args[0]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_tree()
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--exec-env":
        exec_with_env()
    else:
        main()
