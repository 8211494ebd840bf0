"""inspect_ai's sandbox environment ``execbox``: every sample gets an execbox sandbox, on any backend, behind the guard.

    from inspect_ai.util import SandboxEnvironmentSpec
    from execbox.integrations.inspect_ai import ExecboxSandboxConfig

    Task(..., sandbox=SandboxEnvironmentSpec("execbox", ExecboxSandboxConfig(backend="docker", pool=2)))

Registered through inspect's ``inspect_ai`` entry point (``pip install 'execbox[inspect]'``). The lifecycle:
``task_init`` makes one runner per configuration, checks its backend and opens ``pool`` sandboxes ahead;
``sample_init`` hands one out (or opens one); ``sample_cleanup`` closes it and opens the next one ahead;
``task_cleanup`` closes what is left and the runner; ``inspect sandbox cleanup execbox`` runs ``execbox gc``.
Every command runs as the sandbox's one unprivileged user: ``exec(user=...)`` naming another user (root too) is
refused with SandboxUserUnsupportedError, by design.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import execbox
from execbox.errors import (
    BackendTimeoutError,
    ConfigError,
    ExecboxError,
    FileTooLargeError,
    SandboxError,
)
from execbox.integrations import missing_extra

try:
    from inspect_ai.util import (
        ExecResult,
        OutputLimitExceededError,
        SandboxEnvironment,
        SandboxEnvironmentConfigType,
        SandboxEnvironmentLimits,
        SandboxUnavailableError,
        SandboxUserUnsupportedError,
        sandboxenv,
    )
except ImportError as exc:
    raise missing_extra(__name__, "inspect_ai", "inspect", exc) from exc

__all__ = ["ExecboxSandboxConfig", "ExecboxSandboxEnvironment"]


class ExecboxSandboxConfig(BaseModel):
    """How the samples' sandboxes are made; every field is an execbox option, judged by the guard as any other."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str | None = None
    """execbox backend (docker, bubblewrap, ...); None: CODE_EXEC_BACKEND, else the strongest one here."""
    image: str | None = None
    """The image of an image-based backend (docker's ``image`` option)."""
    network: Literal["none", "egress", "proxy", "host"] | None = None
    """Network mode; None: CODE_EXEC_NETWORK (``none`` by default)."""
    limits: execbox.Limits | None = None
    """Memory, CPUs, processes and disk per sandbox; None: the CODE_EXEC_* defaults."""
    mounts: tuple[execbox.Mount, ...] = ()
    """Host paths bound into every sandbox (read-only unless ``writable``)."""
    tmpfs: tuple[str, ...] = ("/var/tmp",)
    """Extra writable tmpfs paths; inspect's injected tools (text_editor(), ...) need /var/tmp."""
    pool: int = Field(default=0, ge=0, le=64)
    """Sandboxes kept open ahead of the samples that will take them (0: each sample opens its own)."""
    timeout: float = Field(default=600.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    """Seconds an exec may run: the timeout of an exec given none, and the most one may ask for."""
    lifetime_s: float = Field(default=86400.0, gt=0, allow_inf_nan=False)
    """The longest a sandbox may live (the backstop that removes one whose owner died)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The backend's own options (execbox.sandbox keywords), e.g. ``{"runtime": "runsc"}``."""

    def __hash__(self) -> int:  # inspect keeps sandbox specs in sets; ``options`` is a dict
        return hash(self.model_dump_json())


def _config(config: SandboxEnvironmentConfigType | None) -> ExecboxSandboxConfig:
    """The typed config from what a task gave: nothing, the model, or the path of a JSON or YAML file of it (read
    once: inspect runs task_init in the task's directory, the samples wherever they are)."""
    if config is None:
        return ExecboxSandboxConfig()
    if isinstance(config, ExecboxSandboxConfig):
        return config
    if isinstance(config, str) and config in _files:
        return _files[config]
    import yaml  # inspect_ai's own dependency; YAML is a superset of JSON

    try:
        if isinstance(config, str):
            typed = _files[config] = ExecboxSandboxConfig.model_validate(
                yaml.safe_load(Path(config).read_text(encoding="utf-8")))
            return typed
        return ExecboxSandboxConfig.model_validate(config.model_dump())
    except (OSError, ValidationError, yaml.YAMLError) as exc:
        raise ConfigError(f"the execbox sandbox config {config!r} is not an ExecboxSandboxConfig: {exc}") from exc


_files: dict[str, ExecboxSandboxConfig] = {}


def _bounds(config: ExecboxSandboxConfig) -> execbox.Settings:
    """The runner's settings: the environment's, with inspect's output and read limits and the task's timeout as
    execbox's bounds. A bound the operator set (CODE_EXEC_MAX_*, anything but its default) stays a ceiling: a task
    file never raises it."""
    env = execbox.Settings.from_env()
    wanted = {"max_output_bytes": SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE,
              "max_read_bytes": SandboxEnvironmentLimits.MAX_READ_FILE_SIZE, "max_timeout_sec": config.timeout}
    bounds = {name: value if getattr(env, name) == type(env).model_fields[name].default
              else min(value, getattr(env, name)) for name, value in wanted.items()}
    return execbox.Settings.from_env(**bounds)


@dataclass(eq=False)
class _Configured:
    """One runner per configuration and the sandboxes it opened ahead (``pool``)."""

    config: ExecboxSandboxConfig
    runner: execbox.AsyncRunner
    ready: list[execbox.AsyncSandbox] = field(default_factory=list)
    closing: bool = False
    #: The tasks using it (two tasks with equal configs share it): the last one's task_cleanup closes it.
    tasks: int = 0

    @classmethod
    def make(cls, config: ExecboxSandboxConfig) -> _Configured:
        return cls(config, execbox.AsyncRunner(_bounds(config)))

    async def open(self) -> execbox.AsyncSandbox:
        c = self.config
        options = {**c.options, **({"image": c.image} if c.image else {})}
        sandbox = self.runner.sandbox(c.backend, network=c.network, limits=c.limits, mounts=c.mounts, tmpfs=c.tmpfs,
                                      lifetime_s=c.lifetime_s, **options)
        return await sandbox.__aenter__()

    async def take(self) -> execbox.AsyncSandbox:
        return self.ready.pop() if self.ready else await self.open()

    async def fill(self) -> None:
        """Open sandboxes until ``pool`` are ready; the first failure is raised once the others are done."""
        failures: list[ExecboxError] = []

        async def one() -> None:
            try:
                sandbox = await self.open()
            except ExecboxError as exc:
                failures.append(exc)
                return
            if self.closing or len(self.ready) >= self.config.pool:
                await sandbox.close()
            else:
                self.ready.append(sandbox)

        async with anyio.create_task_group() as tasks:
            for _ in range(self.config.pool - len(self.ready)):
                tasks.start_soon(one)
        if failures:
            raise failures[0]

    async def aclose(self) -> None:
        self.closing = True
        with anyio.CancelScope(shield=True):
            while self.ready:
                await self.ready.pop().close()
            await self.runner.aclose()


# One per configuration, for this process: task_init makes it, sample_init finds it (or makes it: the self-check
# and a caller outside an eval start at sample_init), task_cleanup ends it.
_configured: dict[ExecboxSandboxConfig, _Configured] = {}


def _state(config: SandboxEnvironmentConfigType | None) -> _Configured:
    typed = _config(config)
    found = _configured.get(typed)
    if found is None:
        found = _configured[typed] = _Configured.make(typed)
    return found


_BUILTINS: dict[type[OSError], tuple[int, str]] = {
    IsADirectoryError: (errno.EISDIR, "Is a directory"),
    PermissionError: (errno.EACCES, "Permission denied"),
    FileNotFoundError: (errno.ENOENT, "No such file or directory"),
}


@contextlib.contextmanager
def _errors(sandbox: execbox.AsyncSandbox, file: str | None = None) -> Iterator[None]:
    """execbox's errors as inspect documents them: a file call's as the built-in naming the file; a sandbox that
    broke (a backend call overran its bound, and execbox closed it) as SandboxUnavailableError, so a tool reports
    the sandbox's failure, never as the command's output."""
    try:
        yield
    except (IsADirectoryError, PermissionError, FileNotFoundError) as exc:  # execbox's typed file errors are these
        if file is None:
            raise
        kind = next(kind for kind in _BUILTINS if isinstance(exc, kind))
        raise kind(*_BUILTINS[kind], file) from exc
    except FileTooLargeError as exc:  # content left out: possibly large, possibly binary
        raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None) from exc
    except SandboxError as exc:
        if isinstance(exc, BackendTimeoutError) or sandbox.broken is not None:
            raise SandboxUnavailableError(exc.message) from exc
        raise


# How the launchers report an argv[0] the kernel would not execute (docker's in-container `timeout`, bwrap's
# execvp, a shell): one line, nothing on stdout. Matched only for the caller's own argv[0].
_NOT_EXECUTABLE = re.compile(r"(?:timeout: failed to run command|bwrap: execvp|\S+: \d+: exec:) ?"
                             r"[‘'\"]?(?P<cmd>.+?)[’'\"]?: Permission denied")


def _not_executable(cmd: list[str], result: execbox.ExecResult) -> bool:
    stderr = result.stderr.strip()
    if result.ok or result.stdout or "\n" in stderr or not cmd:
        return False
    found = _NOT_EXECUTABLE.fullmatch(stderr)
    return found is not None and found["cmd"] == cmd[0]


@sandboxenv(name="execbox")
class ExecboxSandboxEnvironment(SandboxEnvironment):
    """One sample's sandbox: an execbox AsyncSandbox (the per-sample directory is its workspace, /workspace)."""

    def __init__(self, sandbox: execbox.AsyncSandbox, configured: _Configured) -> None:
        super().__init__()
        self.sandbox = sandbox
        self._configured = configured
        self._identity: set[str] | None = None
        self._closed = False

    def _live(self) -> execbox.AsyncSandbox:
        if self._closed:
            raise SandboxUnavailableError("this sample's execbox sandbox was closed (sample_cleanup)")
        return self.sandbox

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return ExecboxSandboxConfig.model_validate(config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        configured = _state(config)
        configured.tasks += 1
        # Fail fast, before any sample: the backend must be able to open a session here (and the guard say yes).
        await configured.runner.select(configured.config.backend, session=True)
        await configured.fill()

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        configured = _state(config)
        return {"default": cls(await configured.take(), configured)}

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        configured = None
        with anyio.CancelScope(shield=True):
            for environment in environments.values():
                env = environment.as_type(ExecboxSandboxEnvironment)
                configured, env._closed = env._configured, True
                await env.sandbox.close()
        if configured is not None and not interrupted and not configured.closing:
            # The next sample's sandbox, opened now rather than when it starts; if it cannot be, that sample opens
            # its own and says why.
            with contextlib.suppress(ExecboxError):
                await configured.fill()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        key = _config(config)
        configured = _configured.get(key)
        if configured is None:
            return
        configured.tasks -= 1
        if configured.tasks <= 0:
            del _configured[key]
            await configured.aclose()

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """`execbox gc` (of the backend ``id`` names, else of all): what execbox made and no live owner holds
        (expired, orphaned); a running eval's sandboxes are kept."""
        only = ["--backend", id] if id else []
        result = await anyio.run_process([sys.executable, "-m", "execbox.cli", "gc", "--json", *only], check=False)
        if result.returncode != 0:
            raise SandboxError(f"execbox gc failed: {result.stderr.decode(errors='replace')[-800:]}")
        removed = json.loads(result.stdout).get("removed", {})
        for backend, ids in removed.items():
            print(f"execbox gc: {backend}: removed {len(ids)}")

    async def _user_ok(self, user: str) -> bool:
        if self._identity is None:
            with _errors(self.sandbox):
                who = await self.sandbox.exec(["sh", "-c", "id -u; id -un"], timeout=30)
            self._identity = set(who.stdout.split()) if who.ok else set()
        return user in self._identity

    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        sandbox = self._live()
        if user is not None and not await self._user_ok(user):
            raise SandboxUserUnsupportedError(
                f"execbox runs every command as the sandbox's one unprivileged user; it cannot run as {user!r}: no "
                "exec gets root or another user, by design")
        with _errors(sandbox):
            result = await sandbox.exec(cmd, stdin=input, workdir=cwd, env=env, timeout=timeout,
                                        max_output_bytes=SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE)
        if result.timed_out:
            error = TimeoutError(f"Command timed out after {timeout or self._configured.config.timeout} seconds")
            error.truncated_output = result.stdout + result.stderr  # type: ignore[attr-defined] # as docker's
            raise error
        if result.truncated:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                                           result.stdout + result.stderr)
        if _not_executable(cmd, result):
            raise PermissionError(errno.EACCES, "Permission denied: the sandbox cannot execute it", cmd[0])
        return ExecResult(success=result.ok, returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        with _errors(self._live(), file):
            await self.sandbox.write_file(file, contents)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        with _errors(self._live(), file):
            data = await self.sandbox.read_file(file, max_bytes=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE)
        return data.decode("utf-8") if text else data  # bytes as they are: newlines (CRLF) kept

