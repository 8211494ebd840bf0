"""The one error tree of execbox.

    ExecboxError                  base; every error carries backend, retryable, env_var
    ├── ConfigError               a setting or argument is invalid (names the variable and what it allows)
    ├── PluginError               a plugin could not be registered (e.g. two backends with one name)
    ├── RefusedError              the guard or the policy refused the request (CLI exit 125)
    │   ├── NotASandboxError      the backend, configured like this, is not a sandbox
    │   ├── SecretFileError       a wallet seed or private key is readable by an unsandboxed run
    │   └── UnsupportedPolicyError  the backend cannot enforce a network mode or limit (fail closed)
    ├── BackendUnavailableError   the backend cannot start here: daemon down, binary, SDK or credentials
    │                             missing (CLI exit 126; never retryable)
    ├── BusyError                 every sandbox slot stayed taken for the queue timeout (retryable)
    └── SandboxError              a sandbox broke while in use (connection dropped, container vanished)
        ├── SandboxLostError      the machine the sandbox ran on is gone (a Ray node died): its state went with it;
        │                         never retryable, nothing was re-run
        ├── BackendTimeoutError   a backend call did not return within its bound (the request's timeout plus
        │                         CODE_EXEC_BACKEND_GRACE_SEC): abandoned, its sandbox closed and marked broken
        ├── WorkspacePathError    a sandbox path is invalid (empty, NUL, ``..`` above ``/``, a planted symlink)
        │   ├── SandboxFileNotFoundError   no such file (also a FileNotFoundError)
        │   ├── SandboxPermissionError     the sandbox user may not read or write it (also a PermissionError)
        │   └── SandboxIsADirectoryError   a directory where a file was meant (also an IsADirectoryError)
        ├── FileTooLargeError     a file to read back is larger than the read cap (CODE_EXEC_MAX_READ_BYTES)
        └── TransferTooLargeError an upload, download or listing is over its bounds (bytes, entries, depth)

A command that runs and fails is not an error: it is an ExecResult with a non-zero exit code.
"""

from __future__ import annotations

import errno as _errno


class ExecboxError(Exception):
    """Base class of every execbox error."""

    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        retryable: bool | None = None,
        env_var: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.backend = backend
        self.env_var = env_var
        if retryable is not None:
            self.retryable = retryable

    def to_dict(self) -> dict[str, object]:
        return {
            "type": type(self).__name__,
            "message": self.message,
            "retryable": self.retryable,
            "backend": self.backend,
            "env_var": self.env_var,
        }


class ConfigError(ExecboxError):
    """A setting or argument is invalid."""


class PluginError(ExecboxError):
    """A backend plugin could not be registered."""


class RefusedError(ExecboxError):
    """The guard or the policy refused the request."""


class NotASandboxError(RefusedError):
    """The backend, as configured for this request, is not a sandbox."""


class SecretFileError(RefusedError):
    """A wallet seed or private key sits where an unsandboxed run could read it."""


class UnsupportedPolicyError(RefusedError):
    """The backend cannot enforce what the request asks for."""


class BackendUnavailableError(ExecboxError):
    """The backend cannot run here. Retrying will not help until the cause is fixed."""

    retryable = False

    def __init__(self, message: str, *, backend: str | None = None, fix: str | None = None, **kw: object) -> None:
        self.reason = message
        self.fix = fix
        full = message
        if fix:
            full = f"{message}. Fix: {fix}"
        if "retry" not in full:
            full += ". Do not retry until this is fixed."
        super().__init__(full, backend=backend, retryable=False, **kw)  # type: ignore[arg-type]


class MissingExtraError(BackendUnavailableError):
    """A package a backend (its SDK) or an integration (its framework) needs is not installed: ``fix`` is the
    ``pip install 'execbox[extra]'`` line. ``present`` names what this machine has that the backend would use
    (e.g. a Docker engine's socket), or is None: then `execbox doctor` warns, since ``auto`` quietly picks a weaker
    sandbox until the extra is installed."""

    def __init__(self, message: str, *, extra: str | None, present: str | None = None, **kw: object) -> None:
        self.extra = extra
        self.present = present
        super().__init__(message, **kw)  # type: ignore[arg-type]


class BusyError(ExecboxError):
    """Every sandbox slot (CODE_EXEC_MAX_CONCURRENT) stayed taken for the whole queue timeout; trying again later
    can help."""

    retryable = True


class SandboxError(ExecboxError):
    """A sandbox broke while in use."""


class SandboxLostError(SandboxError):
    """The machine a sandbox ran on is gone (a cluster node died or left): the sandbox, its files and whatever ran
    in it went with it. Raised at once, never after a silent re-run elsewhere; retrying the same sandbox cannot help
    (open a new one: its state has to be rebuilt)."""

    retryable = False


class SnapshotError(ExecboxError):
    """A snapshot that cannot be made or used: over the snapshot store's size bound, unknown, expired, or no
    longer what was written (corrupted or truncated: refused whole, never restored half-way)."""


class BackendTimeoutError(SandboxError):
    """A backend call (open, exec, a file call, close) did not return within its bound: the runner gave up on it,
    closed its sandbox (itself bounded) and marked it broken. Names the backend and the call; retrying may help
    once the backend is fixed or the host is less loaded."""

    retryable = True


class WorkspacePathError(SandboxError):
    """A sandbox path that cannot be used: invalid, climbing above ``/``, or through a link the code planted."""


class _SandboxOSError(WorkspacePathError):
    """A file call that failed as the same call by the sandbox user would: also the matching built-in OSError
    (``errno`` set), so code written for files (inspect_ai's providers, say) catches it as it would locally."""

    errno_code: int = 0
    errno: int | None  # OSError's, set from errno_code

    def __init__(self, message: str, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.errno = self.errno_code  # str() stays the message: strerror is unset


class SandboxFileNotFoundError(_SandboxOSError, FileNotFoundError):
    """No such file or directory in the sandbox."""

    errno_code = _errno.ENOENT


class SandboxPermissionError(_SandboxOSError, PermissionError):
    """The sandbox user may not do this (a mode the code set, a read-only place)."""

    errno_code = _errno.EACCES


class SandboxIsADirectoryError(_SandboxOSError, IsADirectoryError):
    """A directory where a file was meant (reading it, or writing over it)."""

    errno_code = _errno.EISDIR


class FileTooLargeError(SandboxError):
    """A file to read back is larger than the read cap; it was not read."""

    def __init__(self, rel: str, size: int | None, max_bytes: int, **kw: object) -> None:
        what = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
        super().__init__(
            f"refused to read {rel!r}: it holds {what}, over the read cap of {max_bytes} bytes. Raise "
            "CODE_EXEC_MAX_READ_BYTES if you expect files that large, or have the code write less",
            env_var="CODE_EXEC_MAX_READ_BYTES", **kw)  # type: ignore[arg-type]


class TransferTooLargeError(SandboxError):
    """An upload, download or listing is over its bounds (CODE_EXEC_MAX_TRANSFER_BYTES / _FILES, or depth);
    nothing past the bound was read."""
