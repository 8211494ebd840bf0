"""What the remote backends (modal, daytona, vercel_sandbox) share.

- Their SDKs are blocking: every call runs in a worker thread (``sdk_call``), and a cancelled caller is
  released at once while ``Session.close`` (shielded by the runner) terminates the remote sandbox, which
  ends whatever the abandoned thread was waiting for.
- Labels: every remote sandbox carries ``execbox=1``, its owner (host, pid, process start time), when it
  was created and when it expires, so ``gc`` removes only our own, and only expired or orphaned ones.
- ``RemoteSession``: what their sessions share: the file calls, the path check once code has run, a
  close that ends the sandbox once. Whole directories (``list_files``/``upload``/``download``) use the Session
  defaults: GNU find and tar run inside the remote sandbox, the archive moved with the file calls. Each
  provider supplies its exec, its small command, its file calls and how its SDK's errors translate.
- Shell snippets that run inside the remote sandbox: the argv wrapper (a signal death becomes
  128+signal whatever the provider reports, and every process the run starts carries a marker variable),
  the reaper that kills the marked processes after a timeout (a setsid grandchild included), and the path
  check that keeps ``read_file``/``write_file`` from following a symlink out of the workspace.
"""

from __future__ import annotations

import posixpath
import uuid
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from execbox.contract.backend import Session
from execbox.contract.models import ExecResult, ExecSpec
from execbox.contract.output import BoundedCapture, OnOutput, StreamName
from execbox.errors import BackendUnavailableError, ExecboxError, FileTooLargeError, WorkspacePathError
from execbox.files.workspace import is_directory_error
from execbox.kit.ownership import OwnerLabels
from execbox.secrets.values import Redactor

T = TypeVar("T")

#: The labels (tags) of every remote sandbox, for gc.
REMOTE_LABELS = OwnerLabels(mark="execbox", owner="execbox-owner", created="execbox-created",
                            expires="execbox-expires", persist="execbox-persist")
# Set in the environment of every command a run starts, so the reaper can find what escaped its group.
RUN_MARKER = "EXECBOX_RUN"
# What a run that hit its deadline reports when the provider gives no exit code of its own (SIGKILL).
SIGKILL_EXIT_CODE = 137


async def sdk_call(fn: Callable[..., T], *args: object) -> T:
    """Run a blocking SDK call in a worker thread; cancellation does not wait for it (see module doc)."""
    return await anyio.to_thread.run_sync(lambda: fn(*args), abandon_on_cancel=True)


def missing_credentials(backend: str, what: str, fix: str, env_var: str) -> BackendUnavailableError:
    return BackendUnavailableError(f"{what} (credentials stay in this process; they never enter the sandbox)",
                                   backend=backend, fix=fix, env_var=env_var)


# --- inside the sandbox ---------------------------------------------------------------------------------

# sh -c WRAP execbox ARGV...: runs ARGV as a child, so a signal death reaches us as 128+signal.
WRAP = '"$@"; exit $?'


def wrapped_argv(argv: list[str]) -> list[str]:
    return ["/bin/sh", "-c", WRAP, "execbox", *argv]


def new_run_marker() -> str:
    return uuid.uuid4().hex


# sh -c REAP_SCRIPT execbox MARKER: SIGKILL every process whose environment carries RUN_MARKER=<marker>, until none
# is left (a process forking while we scan is caught on the next pass).
REAP_SCRIPT = f"""
m="{RUN_MARKER}=$1"
for pass in 1 2 3 4 5 6 7 8 9 10; do
  found=
  for d in /proc/[0-9]*; do
    p=${{d#/proc/}}
    [ "$p" = "$$" ] && continue
    if {{ tr '\\0' '\\n' < "$d/environ"; }} 2>/dev/null | grep -qxF "$m"; then kill -9 "$p" 2>/dev/null; found=1; fi
  done
  [ -z "$found" ] && exit 0
  sleep 0.1
done
"""


def reap_argv(marker: str) -> list[str]:
    return ["/bin/sh", "-c", REAP_SCRIPT, "execbox", marker]


# sh -c CHECK execbox WORKSPACE RELPATH: prints the path with every symlink resolved; exit 4 when that is
# outside the workspace.
CHECK = """
w=$(realpath -- "$1") || exit 3
t=$(cd "$w" && realpath -m -- "$2") || exit 3
case "$t" in "${w%/}"/*) printf %s "$t" ;; *) exit 4 ;; esac
"""


def check_argv(workspace: str, rel: str) -> list[str]:
    return ["/bin/sh", "-c", CHECK, "execbox", workspace, rel]


def checked_path(rel: str, code: int, resolved: str) -> str:
    """The result of CHECK as a path, or the WorkspacePathError it means."""
    if code == 4:
        raise WorkspacePathError(
            f"refused {rel!r}: it is (or passes through) a symlink that leads out of the workspace")
    if code != 0 or not resolved.startswith("/"):
        raise WorkspacePathError(f"cannot resolve {rel!r} in the workspace (status {code})")
    return resolved


# --- the session ---------------------------------------------------------------------------------------


class RemoteSession(Session):
    """One remote sandbox (``sb``) as a session. Subclasses supply the provider's calls (all blocking, run in
    a worker thread here) and ``sdk_error``."""

    def __init__(self, sandbox: Any, workspace: str, *, oneshot: bool, dirty: bool = False) -> None:
        self.sb = sandbox
        self.workspace = workspace
        self.oneshot = oneshot
        # Once code has run, a path may be a planted symlink: then it is resolved inside the sandbox first.
        self.dirty = dirty
        self.closed = False
        #: Facts every result of this session carries (e.g. what a provider's network allowlist does not cover).
        self.result_notes: list[str] = []

    @abstractmethod
    def run_exec(self, request: ExecSpec) -> ExecResult: ...

    @abstractmethod
    def run_small(self, argv: list[str]) -> tuple[int, str]:
        """Run a short helper command (no stdin, little output): its exit code and its stdout."""

    @abstractmethod
    def read_bytes(self, target: str) -> bytes: ...

    @abstractmethod
    def write_bytes(self, target: str, data: bytes) -> None: ...

    @abstractmethod
    def dispose(self) -> None:
        """End the sandbox (terminate, delete or stop); log rather than raise, as a lifetime still ends it."""

    @abstractmethod
    def sdk_error(self, exc: Exception, doing: str, path: str | None = None) -> ExecboxError | None:
        """The execbox error an SDK exception means (``path`` is set for a file call), or None if it is not
        the SDK's."""

    async def exec(self, request: ExecSpec) -> ExecResult:
        self.dirty = True
        result: ExecResult = await sdk_call(self._translated, "running a command", None, self.run_exec, request)
        return result.model_copy(update={"notes": [*result.notes, *self.result_notes]}) if self.result_notes else result

    async def write_file(self, path: str, data: bytes) -> None:
        await sdk_call(self._translated, f"writing {path!r}", path,
                       lambda: self.write_bytes(self._target(path), bytes(data)))

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        return await sdk_call(self._translated, f"reading {path!r}", path, lambda: self._read_capped(path, max_bytes))

    def _read_capped(self, path: str, max_bytes: int) -> bytes:
        ran = self.dirty  # before any code ran, the workspace holds only what the caller wrote
        target = self._target(path)
        if ran:  # the size first, inside the sandbox: a sparse 5 GiB file must not cross the network to be refused
            code, out = self.run_small(["stat", "-c", "%s %F", "--", target])
            size, _, kind = out.strip().partition(" ")
            if code == 0 and kind == "directory":
                raise is_directory_error(path)
            if code == 0 and size.isdigit() and int(size) > max_bytes:
                raise FileTooLargeError(path, int(size), max_bytes)
        try:
            data = self.read_bytes(target)
        except ExecboxError:
            raise
        except Exception:
            if self.run_small(["test", "-d", target])[0] == 0:  # the provider's error for a directory says little
                raise is_directory_error(path) from None
            raise
        if len(data) > max_bytes:
            raise FileTooLargeError(path, len(data), max_bytes)
        return data

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await sdk_call(self.dispose)

    def _target(self, path: str) -> str:
        if not self.dirty:
            return posixpath.join(self.workspace, path)
        code, resolved = self.run_small(check_argv(self.workspace, path))
        return checked_path(path, code, resolved)

    def _translated(self, doing: str, path: str | None, fn: Callable[..., T], *args: object) -> T:
        try:
            return fn(*args)
        except ExecboxError:
            raise
        except Exception as exc:
            error = self.sdk_error(exc, doing, path)
            if error is None:
                raise
            raise error from exc


class TextCapture:
    """A text stream (write/flush) that feeds a BoundedCapture: for SDKs that deliver decoded chunks."""

    def __init__(self, cap: int, on_output: OnOutput | None = None, stream: StreamName = "stdout", *,
                 redactor: Redactor | None = None) -> None:
        self.capture = BoundedCapture(cap, on_output, stream, redactor=redactor)

    def write(self, text: str) -> int:
        self.capture.write(text.encode("utf-8", errors="replace"))
        return len(text)

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True
