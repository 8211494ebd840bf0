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
    from collections.abc import Mapping, Sequence
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
        Language,
        Limits,
        Mount,
        NetworkMode,
    )
    from execbox.contract.output import OnText, OutputEvent
    from execbox.errors import (
        BackendTimeoutError,
        BackendUnavailableError,
        BusyError,
        ConfigError,
        ExecboxError,
        FileTooLargeError,
        MissingExtraError,
        NotASandboxError,
        PluginError,
        RefusedError,
        SandboxError,
        SandboxFileNotFoundError,
        SandboxIsADirectoryError,
        SandboxLostError,
        SandboxPermissionError,
        SecretFileError,
        SnapshotError,
        TransferTooLargeError,
        UnsupportedPolicyError,
        WorkspacePathError,
    )
    from execbox.files.transfer import FileInfo, Transfer
    from execbox.runner import AsyncRunner, AsyncSandbox, Runner, Sandbox, run_blocking
    from execbox.runner.batch import AsyncBatch, Batch, BatchItem, BatchSummary
    from execbox.runner.pipeline import Uploads
    from execbox.runner.snapshots import Snapshot
    from execbox.secrets.egress import Given
    from execbox.secrets.values import Secret

# Each public name and the module it lives in, imported on first use (PEP 562): `import execbox.cli` or a plugin's
# `from execbox import hookimpl` loads only what it names, not the runner, every model and their dependencies.
_LAZY = {
    **dict.fromkeys(["ExecutionBackend", "Session", "SessionSpec", "Verdict"], "execbox.contract.backend"),
    **dict.fromkeys(["BackendTimeoutError", "BackendUnavailableError", "BusyError", "ConfigError", "ExecboxError",
                     "FileTooLargeError", "MissingExtraError", "NotASandboxError", "PluginError", "RefusedError",
                     "SandboxError", "SandboxFileNotFoundError", "SandboxIsADirectoryError", "SandboxLostError",
                     "SandboxPermissionError", "SecretFileError", "SnapshotError", "TransferTooLargeError",
                     "UnsupportedPolicyError", "WorkspacePathError"],
                    "execbox.errors"),
    **dict.fromkeys(["PluginWarning", "hookimpl"], "execbox.contract.hookspecs"),
    **dict.fromkeys(["Capabilities", "CellError", "CellResult", "DisplayData", "EgressAttempt", "ExecRequest",
                     "ExecResult", "Limits", "Mount"], "execbox.contract.models"),
    **dict.fromkeys(["FileInfo", "Transfer"], "execbox.files.transfer"),
    "OutputEvent": "execbox.contract.output",
    "Secret": "execbox.secrets.values",
    "Settings": "execbox.config.settings",
    **dict.fromkeys(["AsyncRunner", "AsyncSandbox", "Runner", "Sandbox", "run_blocking"], "execbox.runner"),
    **dict.fromkeys(["AsyncBatch", "Batch", "BatchItem", "BatchSummary"], "execbox.runner.batch"),
    "Snapshot": "execbox.runner.snapshots",
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
    "AsyncBatch",
    "AsyncRunner",
    "AsyncSandbox",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "Batch",
    "BatchItem",
    "BatchSummary",
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
    "MissingExtraError",
    "Mount",
    "NotASandboxError",
    "OutputEvent",
    "PluginError",
    "PluginWarning",
    "RefusedError",
    "Runner",
    "Sandbox",
    "SandboxError",
    "SandboxFileNotFoundError",
    "SandboxIsADirectoryError",
    "SandboxLostError",
    "SandboxPermissionError",
    "Secret",
    "SecretFileError",
    "Session",
    "SessionSpec",
    "Settings",
    "Snapshot",
    "SnapshotError",
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


def run(command: str | Sequence[str], *, backend: str | None = None, network: NetworkMode | None = None,
        timeout: float | None = None, env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
        files: Mapping[str, bytes | str] | None = None, workdir: str | None = None, max_output_bytes: int | None = None,
        limits: Limits | None = None, mounts: Sequence[Mount] | None = None,
        tmpfs: Sequence[str] | None = None, collect: Sequence[str] | None = None,
        secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
        on_stdout: OnText | None = None, on_stderr: OnText | None = None, upload: Uploads | None = None,
        download: Uploads | None = None, options: Mapping[str, Any] | None = None) -> ExecResult:
    """Run a command (argv list, or a string for /bin/sh -c) in a fresh sandbox. See AsyncRunner.run."""
    from execbox.runner import Runner

    with Runner() as runner:
        return runner.run(
            command,
                backend=backend, network=network, timeout=timeout, env=env, stdin=stdin, files=files, workdir=workdir,
                max_output_bytes=max_output_bytes, limits=limits, mounts=mounts,
                tmpfs=tmpfs, collect=collect, secrets=secrets,
                secrets_at_egress=secrets_at_egress, on_stdout=on_stdout, on_stderr=on_stderr, upload=upload,
                download=download, options=options)


def run_code(code: str, language: Language = "python", *, backend: str | None = None,
             network: NetworkMode | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
             stdin: bytes | str | None = None, files: Mapping[str, bytes | str] | None = None,
             workdir: str | None = None, max_output_bytes: int | None = None, limits: Limits | None = None,
             mounts: Sequence[Mount] | None = None,
             tmpfs: Sequence[str] | None = None, collect: Sequence[str] | None = None,
             secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
             on_stdout: OnText | None = None, on_stderr: OnText | None = None, upload: Uploads | None = None,
             download: Uploads | None = None, options: Mapping[str, Any] | None = None) -> ExecResult:
    """Run Python or bash code in a fresh sandbox. See AsyncRunner.run_code."""
    from execbox.runner import Runner

    with Runner() as runner:
        return runner.run_code(
            code, language,
                backend=backend, network=network, timeout=timeout, env=env, stdin=stdin, files=files, workdir=workdir,
                max_output_bytes=max_output_bytes, limits=limits, mounts=mounts,
                tmpfs=tmpfs, collect=collect, secrets=secrets,
                secrets_at_egress=secrets_at_egress, on_stdout=on_stdout, on_stderr=on_stderr, upload=upload,
                download=download, options=options)


def sandbox(backend: str | None = None, *, network: NetworkMode | None = None, limits: Limits | None = None,
            name: str | None = None, lifetime_s: float = 3600.0, mounts: Sequence[Mount] | None = None,
            tmpfs: Sequence[str] | None = None,
            package_cache: bool = False, pip: Sequence[str] | None = None,
            secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
            from_snapshot: Snapshot | str | None = None, **options: Any) -> Sandbox:
    """A persistent sandbox: ``with execbox.sandbox() as sb: sb.exec(...)``; backend options as keywords
    (``execbox.sandbox("docker", image="my-image")``). See AsyncRunner.sandbox."""
    from execbox.runner import AsyncRunner, Sandbox

    inner = AsyncRunner().sandbox(
        backend,
        network=network, limits=limits, name=name, lifetime_s=lifetime_s, mounts=mounts,
        tmpfs=tmpfs, package_cache=package_cache,
        pip=pip, secrets=secrets, secrets_at_egress=secrets_at_egress, from_snapshot=from_snapshot, **options)
    inner.owns_runner = True
    return Sandbox(inner)


async def arun(command: str | Sequence[str], *, backend: str | None = None, network: NetworkMode | None = None,
               timeout: float | None = None, env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
               files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
               max_output_bytes: int | None = None, limits: Limits | None = None, mounts: Sequence[Mount] | None = None,
               tmpfs: Sequence[str] | None = None,
               collect: Sequence[str] | None = None, secrets: Mapping[str, Secret | str] | None = None,
               secrets_at_egress: Given | None = None, on_stdout: OnText | None = None, on_stderr: OnText | None = None,
               upload: Uploads | None = None, download: Uploads | None = None,
               options: Mapping[str, Any] | None = None) -> ExecResult:
    """``run``, awaited. See AsyncRunner.run."""
    from execbox.runner import AsyncRunner

    async with AsyncRunner() as runner:
        return await runner.run(
            command,
                backend=backend, network=network, timeout=timeout, env=env, stdin=stdin, files=files, workdir=workdir,
                max_output_bytes=max_output_bytes, limits=limits, mounts=mounts,
                tmpfs=tmpfs, collect=collect, secrets=secrets,
                secrets_at_egress=secrets_at_egress, on_stdout=on_stdout, on_stderr=on_stderr, upload=upload,
                download=download, options=options)


async def arun_code(code: str, language: Language = "python", *, backend: str | None = None,
                    network: NetworkMode | None = None, timeout: float | None = None,
                    env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                    files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
                    max_output_bytes: int | None = None, limits: Limits | None = None,
                    mounts: Sequence[Mount] | None = None,
                    tmpfs: Sequence[str] | None = None, collect: Sequence[str] | None = None,
                    secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
                    on_stdout: OnText | None = None, on_stderr: OnText | None = None, upload: Uploads | None = None,
                    download: Uploads | None = None, options: Mapping[str, Any] | None = None) -> ExecResult:
    """``run_code``, awaited. See AsyncRunner.run_code."""
    from execbox.runner import AsyncRunner

    async with AsyncRunner() as runner:
        return await runner.run_code(
            code, language,
                backend=backend, network=network, timeout=timeout, env=env, stdin=stdin, files=files, workdir=workdir,
                max_output_bytes=max_output_bytes, limits=limits, mounts=mounts,
                tmpfs=tmpfs, collect=collect, secrets=secrets,
                secrets_at_egress=secrets_at_egress, on_stdout=on_stdout, on_stderr=on_stderr, upload=upload,
                download=download, options=options)


def asandbox(backend: str | None = None, *, network: NetworkMode | None = None, limits: Limits | None = None,
             name: str | None = None, lifetime_s: float = 3600.0, mounts: Sequence[Mount] | None = None,
             tmpfs: Sequence[str] | None = None,
             package_cache: bool = False, pip: Sequence[str] | None = None,
             secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
             from_snapshot: Snapshot | str | None = None, **options: Any) -> AsyncSandbox:
    """``async with execbox.asandbox() as sb: await sb.exec(...)``. See AsyncRunner.sandbox."""
    from execbox.runner import AsyncRunner

    inner = AsyncRunner().sandbox(
        backend,
        network=network, limits=limits, name=name, lifetime_s=lifetime_s, mounts=mounts,
        tmpfs=tmpfs, package_cache=package_cache,
        pip=pip, secrets=secrets, secrets_at_egress=secrets_at_egress, from_snapshot=from_snapshot, **options)
    inner.owns_runner = True
    return inner
