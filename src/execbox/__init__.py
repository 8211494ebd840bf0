"""execbox: run untrusted code behind a real sandbox boundary, on many backends, through one guard.

    import execbox
    result = execbox.run_code("print('hello')")
    with execbox.sandbox() as sb:
        sb.write_file("data.txt", b"42")
        sb.exec(["cat", "data.txt"])
"""

from __future__ import annotations

# Not typing's: `import execbox` must stay light (the `execbox` program imports it before handing its command line
# to a resident server); mypy reads any TYPE_CHECKING as true.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from execbox.config.settings import Settings
    from execbox.contract.backend import ExecutionBackend, Session, SessionSpec, Verdict
    from execbox.contract.hookspecs import PluginWarning, hookimpl
    from execbox.contract.models import (
        Capabilities,
        CellError,
        CellResult,
        DisplayData,
        EgressAttempt,
        ExecRequest,
        ExecResult,
        Limits,
        Mount,
    )
    from execbox.contract.output import OutputEvent
    from execbox.errors import (
        BackendTimeoutError,
        BackendUnavailableError,
        BusyError,
        ConfigError,
        ExecboxError,
        FileTooLargeError,
        NotASandboxError,
        PluginError,
        RefusedError,
        SandboxError,
        SecretFileError,
        TransferTooLargeError,
        UnsupportedPolicyError,
        WorkspacePathError,
    )
    from execbox.files.transfer import FileInfo, Transfer
    from execbox.runner import AsyncRunner, AsyncSandbox, Runner, Sandbox, run_blocking
    from execbox.secrets.values import Secret

# Each public name and the module it lives in, imported on first use (PEP 562): `import execbox.cli` or a plugin's
# `from execbox import hookimpl` loads only what it names, not the runner, every model and their dependencies.
_LAZY = {
    **dict.fromkeys(["ExecutionBackend", "Session", "SessionSpec", "Verdict"], "execbox.contract.backend"),
    **dict.fromkeys(["BackendTimeoutError", "BackendUnavailableError", "BusyError", "ConfigError", "ExecboxError",
                     "FileTooLargeError", "NotASandboxError", "PluginError", "RefusedError", "SandboxError",
                     "SecretFileError", "TransferTooLargeError", "UnsupportedPolicyError", "WorkspacePathError"],
                    "execbox.errors"),
    **dict.fromkeys(["PluginWarning", "hookimpl"], "execbox.contract.hookspecs"),
    **dict.fromkeys(["Capabilities", "CellError", "CellResult", "DisplayData", "EgressAttempt", "ExecRequest",
                     "ExecResult", "FileInfo", "Limits", "Mount", "Transfer"], "execbox.contract.models"),
    "OutputEvent": "execbox.contract.output",
    "Secret": "execbox.secrets.values",
    "Settings": "execbox.config.settings",
    **dict.fromkeys(["AsyncRunner", "AsyncSandbox", "Runner", "Sandbox", "run_blocking"], "execbox.runner"),
}

if not TYPE_CHECKING:  # hidden from mypy, so a misspelt name is still an error there rather than Any

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'execbox' has no attribute {name!r}")
        import importlib

        try:
            value = getattr(importlib.import_module(module), name)
        except AttributeError as exc:  # `from execbox import X` would say only "cannot import name", hiding why
            raise ImportError(f"execbox.{name}: importing {module} failed: {exc!r}", name=module) from exc
        globals()[name] = value  # once: later lookups are plain attribute reads
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AsyncRunner",
    "AsyncSandbox",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BusyError",
    "Capabilities",
    "CellError",
    "CellResult",
    "ConfigError",
    "DisplayData",
    "EgressAttempt",
    "ExecRequest",
    "ExecResult",
    "ExecboxError",
    "ExecutionBackend",
    "FileInfo",
    "FileTooLargeError",
    "Limits",
    "Mount",
    "NotASandboxError",
    "OutputEvent",
    "PluginError",
    "PluginWarning",
    "RefusedError",
    "Runner",
    "Sandbox",
    "SandboxError",
    "Secret",
    "SecretFileError",
    "Session",
    "SessionSpec",
    "Settings",
    "Transfer",
    "TransferTooLargeError",
    "UnsupportedPolicyError",
    "Verdict",
    "WorkspacePathError",
    "arun",
    "arun_code",
    "asandbox",
    "hookimpl",
    "run",
    "run_blocking",
    "run_code",
    "sandbox",
]


def run(command: str | Sequence[str], **kw: Any) -> ExecResult:
    """Run a command (argv list, or a string for /bin/sh -c) in a fresh sandbox. See AsyncRunner.run."""
    from execbox.runner import Runner

    with Runner() as runner:
        return runner.run(command, **kw)


def run_code(code: str, language: str = "python", **kw: Any) -> ExecResult:
    """Run Python or bash code in a fresh sandbox."""
    from execbox.runner import Runner

    with Runner() as runner:
        return runner.run_code(code, language, **kw)  # type: ignore[arg-type]


def sandbox(backend: str | None = None, **kw: Any) -> Sandbox:
    """A persistent sandbox: ``with execbox.sandbox() as sb: sb.exec(...)``; backend options as keywords
    (``execbox.sandbox("docker", image="my-image")``)."""
    from execbox.runner import AsyncRunner, Sandbox

    inner = AsyncRunner().sandbox(backend, **kw)
    inner.owns_runner = True
    return Sandbox(inner)


async def arun(command: str | Sequence[str], **kw: Any) -> ExecResult:
    from execbox.runner import AsyncRunner

    async with AsyncRunner() as runner:
        return await runner.run(command, **kw)


async def arun_code(code: str, language: str = "python", **kw: Any) -> ExecResult:
    from execbox.runner import AsyncRunner

    async with AsyncRunner() as runner:
        return await runner.run_code(code, language, **kw)  # type: ignore[arg-type]


def asandbox(backend: str | None = None, **kw: Any) -> AsyncSandbox:
    """``async with execbox.asandbox() as sb: await sb.exec(...)``."""
    from execbox.runner import AsyncRunner

    inner = AsyncRunner().sandbox(backend, **kw)
    inner.owns_runner = True
    return inner
