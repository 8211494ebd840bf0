"""Plain data that crosses the API: requests, results and capability claims. All JSON-serialisable."""

from __future__ import annotations

import base64
import os
import posixpath
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from execbox.contract.output import BoundedCapture, OnOutput
from execbox.policy.network import NETWORK_MODES as NETWORK_MODES  # the request model names them
from execbox.policy.network import NetworkMode as NetworkMode
from execbox.secrets import egress as egress_given
from execbox.secrets.egress import RunSecrets
from execbox.secrets.values import Redactor, Secret, check_secrets

Isolation = Literal["none", "process", "namespace", "container", "gvisor", "microvm", "remote_vm"]
LimitName = Literal["memory", "cpu", "pids", "disk", "wall_time"]
Language = Literal["python", "bash"]

# Strongest last; auto selection prefers the strongest sandbox that can run here.
ISOLATION_STRENGTH: dict[str, int] = {
    "none": 0, "process": 1, "namespace": 2, "container": 3, "gvisor": 4, "microvm": 5, "remote_vm": 5,
}
INTERPRETERS: dict[str, tuple[str, str]] = {"python": ("python3", "py"), "bash": ("bash", "sh")}
# argv and env together must fit the kernel's limit for one execve: ARG_MAX (2 MiB on Linux with the usual 8 MiB
# stack), counted as the kernel does (each string with its NUL, and a pointer per string plus the two NULL ones), and
# a single word at most MAX_ARG_STRLEN (128 KiB with its NUL). Refuse early, with a clear error, rather than fail
# inside a backend. COMMAND_LINE_RESERVE is what execbox's own wrappers and the sandbox's environment may add.
MAX_COMMAND_LINE_BYTES = 2 << 20
MAX_ARG_STRLEN = 128 << 10
COMMAND_LINE_RESERVE = 16 << 10


def command_line_bytes(words: list[str] | tuple[str, ...], env: dict[str, str] | None = None) -> int:
    """The bytes an execve of ``words`` with ``env`` takes of ARG_MAX, counted as the kernel counts them."""
    strings = [*words, *(f"{k}={v}" for k, v in (env or {}).items())]
    return sum(len(s.encode()) + 1 for s in strings) + 8 * (len(strings) + 2)


class Capabilities(BaseModel):
    """What a backend claims to enforce. The conformance kit checks every claim."""

    model_config = ConfigDict(frozen=True)

    sandbox: bool
    isolation: Isolation
    network_modes: frozenset[NetworkMode] = frozenset()
    persistent_sessions: bool = False
    file_transfer: bool = False
    limits: frozenset[LimitName] = frozenset()
    remote: bool = False
    # Host paths can be bound into the sandbox (``Mount``), read-only unless asked otherwise.
    mounts: bool = False
    # Output reaches a streaming caller while the command runs (ExecSpec.on_output is fed as bytes arrive).
    # Opt-in: a backend that does not stream still works, its output is delivered when the run ends.
    streaming: bool = False
    # An empty writable tmpfs can be put at an absolute path the request names (``ExecRequest.tmpfs``).
    tmpfs: bool = False
    # A live sandbox's filesystem (the workspace and what the code changed outside it) can be snapshotted and
    # restored (``Session.snapshot``, ``SessionSpec.restore``); ``memory_snapshot``: its processes and memory too.
    snapshot: bool = False
    memory_snapshot: bool = False

    @field_serializer("network_modes", "limits")
    def _sorted(self, value: frozenset[str]) -> list[str]:
        return sorted(value)


class Limits(BaseModel):
    """Resource limits. In a request, a set field is a demand: a backend that cannot enforce it refuses."""

    model_config = ConfigDict(frozen=True)

    memory_mb: int | None = Field(default=None, gt=0)
    cpus: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    pids: int | None = Field(default=None, gt=0)
    # The workspace and the sandbox's writable scratch together, MiB.
    disk_mb: int | None = Field(default=None, gt=0)

    def names(self) -> set[str]:
        fields = {"memory_mb": "memory", "cpus": "cpu", "pids": "pids", "disk_mb": "disk"}
        return {fields[k] for k, v in self.model_dump().items() if v is not None}


# Places a mount may not cover inside the sandbox, because the sandbox provides them itself: the kernel's views,
# the tmpfs, the package cache (/opt/execbox), the proxy's socket (/run/execbox: all of /run, and /var/run and
# /var/lock, which lead there), and the system it runs (a mount over /etc or /usr would replace the sandbox's own
# users, loader configuration or shell with host files). The workspace is judged apart.
MOUNT_TARGETS_REFUSED = ("/proc", "/sys", "/dev", "/tmp", "/opt/execbox", "/run", "/var/run", "/var/lock", "/etc",
                          "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/var/lib/dpkg")
WORKSPACE_DIR = "/workspace"


class Mount(BaseModel):
    """A host path bound into the sandbox at ``target``: read-only unless ``writable``.

    ``execbox.Mount("/src/repo", "/workspace/repo")``. The guard refuses sources that would expose the host
    (``/``, your home directory itself, the Docker socket, execbox's own state, secret-bearing places) and
    scans the tree for wallet seeds; only backends that claim ``mounts`` take them.
    """

    model_config = ConfigDict(frozen=True)

    source: str
    target: str
    writable: bool = False

    def __init__(self, source: str | os.PathLike[str] | None = None, target: str | None = None,
                 writable: bool = False, **kw: Any) -> None:
        if source is not None:
            kw["source"] = os.fspath(source)
        if target is not None:
            kw["target"] = target
        try:
            super().__init__(writable=writable, **kw)
        except ValidationError as exc:  # bad input is an ExecboxError, never another exception
            from execbox.errors import ConfigError

            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'mount'}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"invalid mount: {problems}") from None

    @field_validator("source")
    @classmethod
    def _host_path(cls, value: str) -> str:
        if not value.startswith("/") or "\0" in value:
            raise ValueError(f"mount source {value[:200]!r} must be an absolute host path (no NUL)")
        _encodable(value, "the mount source")
        return value

    @field_validator("target")
    @classmethod
    def _sandbox_path(cls, value: str) -> str:
        clean = posixpath.normpath(value) if value.startswith("/") else ""
        if not clean or "\0" in value or clean.startswith("//"):
            raise ValueError(f"mount target {value[:200]!r} must be an absolute path inside the sandbox")
        _encodable(value, "the mount target")
        if clean == "/" or WORKSPACE_DIR.startswith(clean.rstrip("/") + "/") or clean == WORKSPACE_DIR:
            raise ValueError(f"mount target {clean!r} would cover the sandbox's root or its workspace; mount below "
                             f"{WORKSPACE_DIR} (e.g. {WORKSPACE_DIR}/data) or at another directory such as /data")
        for bad in MOUNT_TARGETS_REFUSED:
            if clean == bad or clean.startswith(bad + "/"):
                raise ValueError(f"mount target {clean!r} lies in {bad}, which the sandbox provides itself; choose "
                                 f"another place, e.g. {WORKSPACE_DIR}/data or /data")
        return clean

    @classmethod
    def parse(cls, spec: str) -> Mount:
        """``HOST:SANDBOX[:rw|:ro]`` (the CLI's ``--mount``)."""
        parts = spec.split(":")
        writable = False
        if len(parts) == 3 and parts[2] in ("rw", "ro"):
            writable = parts.pop() == "rw"
        if len(parts) != 2 or not all(parts):
            from execbox.errors import ConfigError

            raise ConfigError(f"--mount takes HOST:SANDBOX[:rw], got {spec!r}")
        return cls(parts[0], parts[1], writable)


class ExecRequest(BaseModel):
    """One command to run. Either ``argv`` or ``code`` (+ ``language``)."""

    # stdin and files may hold any bytes: base64 in JSON. An invalid value is never repeated in an error (it may
    # be a secret).
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64", hide_input_in_errors=True)

    argv: list[str] | None = None
    code: str | None = None
    language: Language = "python"
    stdin: bytes | None = None
    env: dict[str, str] = Field(default_factory=dict)
    # Paths relative to the workspace -> contents, placed before the command runs.
    files: dict[str, bytes] = Field(default_factory=dict)
    # Relative to the workspace, or an absolute path anywhere in the sandbox; created if missing, as the sandbox user.
    workdir: str | None = None
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_output_bytes: int | None = Field(default=None, gt=0)
    network: NetworkMode | None = None
    limits: Limits | None = None
    # Host paths bound into the sandbox (one-shot runs; a session's mounts are fixed when it opens).
    mounts: list[Mount] = Field(default_factory=list)
    # Absolute sandbox paths that get an empty writable tmpfs each, owned by the sandbox user (e.g. "/var/tmp"); a
    # session's are fixed when it opens. The guard refuses the places the sandbox provides itself.
    tmpfs: list[str] = Field(default_factory=list)
    # Globs of workspace files to return on the result (``ExecResult.files``), e.g. "out/*.png" or "**/*.csv".
    collect: list[str] = Field(default_factory=list)
    # Declared secrets, name -> value (secrets.values): the command gets them as environment variables (past
    # the env policy), the caller sees ``[secret NAME]`` wherever one would show. Never serialised, never in repr.
    secrets: dict[str, Secret] = Field(default_factory=dict, exclude=True, repr=False)
    # Secrets at egress, name -> (host, port, value) (execbox.secrets.egress): the command gets a placeholder, the
    # egress proxy (network mode proxy) puts the value into HTTPS requests to that host only. Never serialised.
    secrets_at_egress: dict[str, tuple[str, int, Secret]] = Field(default_factory=dict, exclude=True, repr=False)

    @model_validator(mode="after")
    def _one_command(self) -> ExecRequest:
        if (self.argv is None) == (self.code is None):
            raise ValueError("give exactly one of argv (a command) or code")
        if self.argv is not None and not self.argv:
            raise ValueError("argv is empty: give the command to run, e.g. ['python3', '-c', 'print(1)']")
        return self

    @field_validator("secrets", mode="before")
    @classmethod
    def _secrets(cls, secrets: Any) -> dict[str, Secret]:
        return check_secrets(secrets or {})

    @field_validator("secrets_at_egress", mode="before")
    @classmethod
    def _secrets_at_egress(cls, given: Any) -> dict[str, tuple[str, int, Secret]]:
        return egress_given.check(given or {})

    @model_validator(mode="after")
    def _secrets_not_env(self) -> ExecRequest:
        names = [*self.env, *self.secrets, *self.secrets_at_egress]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} given more than once (env, secrets, secrets_at_egress); give each "
                             "once")
        return self

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not name or "=" in name or "\0" in name or "\0" in value:
                raise ValueError(f"invalid environment variable name or value: {name!r}")
            _encodable(name, "an environment variable name")
            _encodable(value, f"the value of {name!r}")
        return env

    @field_validator("argv")
    @classmethod
    def _argv_words(cls, argv: list[str] | None) -> list[str] | None:
        for word in argv or ():
            if "\0" in word:
                raise ValueError(f"argv word {word[:40]!r} holds a NUL byte, which no command line can carry")
            _encodable(word, "an argv word")
            if len(word.encode()) + 1 > MAX_ARG_STRLEN:
                raise ValueError(f"argv word {word[:40]!r}... is {len(word.encode())} bytes, over the kernel's limit "
                                 f"for one word ({MAX_ARG_STRLEN - 1} bytes): pass large data on stdin or as a file")
        return argv

    @model_validator(mode="after")
    def _command_line(self) -> ExecRequest:
        used = command_line_bytes(self.argv or [], self.env)
        if used > MAX_COMMAND_LINE_BYTES - COMMAND_LINE_RESERVE:
            raise ValueError(
                f"argv and env take {used} bytes of the kernel's limit for one command line (ARG_MAX, "
                f"{MAX_COMMAND_LINE_BYTES} bytes, of which execbox keeps {COMMAND_LINE_RESERVE} for its wrappers and "
                "the sandbox's environment): pass large data on stdin or as a file")
        return self

    @field_validator("tmpfs")
    @classmethod
    def _tmpfs_paths(cls, paths: list[str]) -> list[str]:
        clean: list[str] = []
        for path in paths:
            if not isinstance(path, str) or not path.startswith("/") or "\0" in path or path.startswith("//"):
                raise ValueError(f"tmpfs path {str(path)[:200]!r} must be an absolute path inside the sandbox, such "
                                 "as /var/tmp")
            _encodable(path, "a tmpfs path")
            _plain_path(path, "tmpfs path")
            if ".." in path.split("/"):
                raise ValueError(f"tmpfs path {path[:200]!r} must not hold '..': give the place itself")
            norm = posixpath.normpath(path)
            if norm not in clean:
                clean.append(norm)
        return clean

    @field_validator("collect")
    @classmethod
    def _globs(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            clean = posixpath.normpath(pattern) if pattern else ""
            if not clean or "\0" in pattern or clean.startswith(("/", "../")) or clean == "..":
                raise ValueError(f"collect pattern {pattern[:200]!r} must be a glob relative to the workspace, "
                                 "such as 'out/*.png' or '**/*.csv'")
            _encodable(pattern, "a collect pattern")
        return patterns

    @field_validator("code", "workdir")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        if value is not None:
            _encodable(value, "the text")
        return value

    def materialize(self, workspace: str) -> tuple[list[str], dict[str, bytes]]:
        """The argv to run and the files to place, given where the workspace is inside the sandbox.

        Code goes in as a file, never on the command line (process listings, ARG_MAX).
        """
        if self.argv is not None:
            return list(self.argv), dict(self.files)
        interpreter, suffix = INTERPRETERS[self.language]
        rel = f".execbox/code-{uuid.uuid4().hex[:12]}.{suffix}"
        files = dict(self.files)
        files[rel] = (self.code or "").encode()
        return [interpreter, posixpath.join(workspace, rel)], files


class ExecSpec(BaseModel):
    """One request as a session runs it: resolved once by the runner, every field set, frozen.

    ``argv`` is what to execute (code is already a file in the workspace), ``env`` is filtered, ``workdir``
    is absolute inside the sandbox, the request's files are already placed.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    stdin: bytes | None = None
    workdir: str
    timeout: float = Field(gt=0, allow_inf_nan=False)
    max_output_bytes: int = Field(gt=0)
    network: NetworkMode
    limits: Limits = Field(default_factory=Limits)
    # Set when the caller streams: called with (stream, bytes) as output arrives, from any thread. Backends pass
    # it on by building their captures with ``captures()`` (or ``run_process(on_output=)``); never serialised.
    on_output: OnOutput | None = Field(default=None, exclude=True, repr=False)
    # Set when the run has declared secrets: what redacts them from the output as it is captured (``captures()``,
    # ``run_process(redactor=)``; secrets.values). Never serialised.
    redactor: Redactor | None = Field(default=None, exclude=True, repr=False)
    # Set when the run has secrets at egress: the placeholders the egress proxy swaps for their values; a backend
    # hands them to its proxy run (``EgressProxy.start_run(spec.egress)``, ``env(spec.egress)``). Never serialised.
    egress: RunSecrets | None = Field(default=None, exclude=True, repr=False)

    def captures(self) -> tuple[BoundedCapture, BoundedCapture]:
        """This run's stdout and stderr captures: bounded by ``max_output_bytes``, streaming to ``on_output``,
        redacting with ``redactor``."""
        return (BoundedCapture(self.max_output_bytes, self.on_output, "stdout", redactor=self.redactor),
                BoundedCapture(self.max_output_bytes, self.on_output, "stderr", redactor=self.redactor))


def _plain_path(path: str, what: str) -> None:
    """A sandbox path that the engines' own syntax reads as one path: no control character (a bare CR or LF makes
    two lines of one name), no ':' or ',' (docker's mount and tmpfs option separators)."""
    if any(ord(c) < 0x20 or c == "\x7f" for c in path) or ":" in path or "," in path:
        raise ValueError(f"{what} {path[:200]!r} holds a control character, ':' or ',': name the place plainly")


def _encodable(text: str, what: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid text ({exc.reason} at {exc.start}): a lone surrogate has no bytes "
                         "to send") from None


class EgressAttempt(BaseModel):
    """One connection the sandboxed code asked the proxy for (network mode ``proxy``), allowed or denied."""

    model_config = ConfigDict(frozen=True)

    host: str
    port: int
    allowed: bool
    # Why, in words a caller (or a model) can act on: "not in the allowlist", "resolves to a private address".
    reason: str
    # The address the proxy resolved and connected to (or refused); "" when it never resolved.
    address: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    # Secrets at egress (names) the proxy put into this connection's requests; on a refusal, the ones it carried.
    secrets: list[str] = Field(default_factory=list)


class ExecResult(BaseModel):
    """What happened. A failed command is a result with a non-zero exit code, not an exception."""

    # collected files may hold any bytes: base64 in JSON.
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = False
    oom_killed: bool = False
    duration_s: float = 0.0
    backend: str = ""
    # The isolation the backend enforced for this run, as checked here (docker under runsc: "gvisor"); "" unknown.
    isolation: Isolation | Literal[""] = ""
    # Names the env policy dropped from the request; values are never kept.
    filtered_env: list[str] = Field(default_factory=list)
    # Names of the secrets declared for this run (given to the command, redacted from what came back).
    secrets: list[str] = Field(default_factory=list)
    # Facts the caller should know about this result, e.g. a sandbox status that is only attested.
    notes: list[str] = Field(default_factory=list)
    # When a limit cut the run short (or stood in its way): which one, "timeout", "memory" or "network"; None else.
    limit: Literal["timeout", "memory", "network"] | None = None
    # That limit in one plain sentence a caller (or a model) can act on: "killed after 30 s: timeout", "killed:
    # out of memory (1024 MiB)", "network is off in this sandbox (mode none)"; "" when no limit was hit.
    explanation: str = ""
    # Whether running it again can help (with the change the explanation names, e.g. a longer timeout).
    retryable: bool = False
    # Network mode proxy: every connection attempt of this run, in order (empty in other modes).
    egress: list[EgressAttempt] = Field(default_factory=list)
    # The workspace files the request's ``collect`` globs matched: path relative to the workspace -> bytes.
    files: dict[str, bytes] = Field(default_factory=dict)
    # Seconds the run waited for a free sandbox slot (CODE_EXEC_MAX_CONCURRENT), apart from its timeout.
    queued_s: float = 0.0
    # True when the run's sandbox came from the warm pool (started ahead, never used before).
    pooled: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class DisplayData(BaseModel):
    """One rich output of a Python cell, as a MIME bundle (the Jupyter convention): ``data`` maps a MIME type to
    its content: text for text types, base64 for binary ones (image/png), a JSON value for application/json.
    ``kind`` is "result" for the value of the cell's last expression, "display" for display() and figures."""

    kind: Literal["display", "result"] = "display"
    data: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def text(self) -> str | None:
        value = self.data.get("text/plain")
        return value if isinstance(value, str) else None

    def binary(self, mime: str) -> bytes | None:
        """The decoded bytes of a base64 type (``image/png``, ``image/jpeg``), or None when absent or not base64."""
        value = self.data.get(mime)
        if not isinstance(value, str):
            return None
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            return None


class CellError(BaseModel):
    """The exception a cell raised: its type name, its message and the formatted traceback."""

    name: str
    value: str = ""
    traceback: str = ""


class CellResult(BaseModel):
    """What one ``run_cell`` did in the session's Python interpreter. An exception in the cell is data
    (``error``), not an exception of execbox."""

    outputs: list[DisplayData] = Field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    error: CellError | None = None
    # Cells run so far in this interpreter, this one included: 1 in a fresh one.
    execution_count: int = 0
    timed_out: bool = False
    truncated: bool = False
    oom_killed: bool = False
    # The interpreter's earlier state (variables, imports, open files) is gone: this cell had to kill it, or
    # it had died since the last cell and this one ran in a fresh interpreter. ``notes`` say which.
    state_lost: bool = False
    duration_s: float = 0.0
    backend: str = ""
    notes: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The cell ran to its end without an exception (``state_lost`` is told apart: check it too)."""
        return self.error is None and not self.timed_out and not self.oom_killed
