"""Every knob of execbox: from the environment or given in code, validated once.

Each field has one environment variable (``setting(VARIABLE, default, description)``). A settings object
is built the same two ways for the core and for every backend: ``Settings(backend="docker", local=True)``
(keywords by field name, taking precedence over the environment) or ``Settings.from_env()``. Field names
are never read from the environment, and an unknown keyword is an error, not ignored. An invalid value is
a ConfigError that names the variable and what it allows; never a silent fallback. Backends with knobs of
their own declare a subclass (``execbox.plugin.BackendSettings``) as their ``settings_model``.
"""

from __future__ import annotations

import re
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from execbox.config.paths import resolve_path
from execbox.errors import ConfigError
from execbox.policy.egress import parse_entry
from execbox.policy.network import NetworkMode
from execbox.secrets.egress import parse_setting

S = TypeVar("S", bound="EnvSettings")


def setting(variable: str, default: Any, description: str, **constraints: Any) -> Any:
    """A settings field read from the environment variable ``variable`` (constraints as pydantic's Field)."""
    return Field(default, validation_alias=AliasChoices(variable), description=description, **constraints)


def comma_list(value: Any) -> Any:
    """A before-validator: \"a, b\" -> [\"a\", \"b\"] (use with NoDecode list fields)."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


_ID_DIGITS = re.compile(r"[0-9]{1,10}")
_MAX_ID = (1 << 32) - 1


def uid_gid(value: str) -> str:
    """A validator body for a sandbox user: "uid[:gid]" as numbers, never 0, below (uid_t)-1 -> "uid:gid"."""
    uid, sep, gid = value.partition(":")
    if not (_ID_DIGITS.fullmatch(uid) and (not sep or _ID_DIGITS.fullmatch(gid))):
        raise ValueError("give uid:gid as numbers, e.g. 65534:65534")
    ids = (int(uid), int(gid or uid))
    if 0 in ids:
        raise ValueError("the sandbox must not run as root (uid or gid 0)")
    if max(ids) >= _MAX_ID:  # (uid_t)-1 means "unchanged" to setresuid; above it does not fit
        raise ValueError(f"uid and gid must be below {_MAX_ID}")
    return f"{ids[0]}:{ids[1]}"


class EnvSettings(BaseSettings):
    """Base of every settings class: reads the environment only (no .env files: they are where secrets live)."""

    model_config = SettingsConfigDict(populate_by_name=False, extra="ignore", frozen=True)

    def __init__(self, **values: Any) -> None:
        """The environment's values, with ``values`` (by field name) taking precedence."""
        cls = type(self)
        # pydantic-settings takes init keywords by the variable's name; field names are never read from the
        # environment (a variable called BACKEND must not choose the backend).
        by_alias = {_alias(cls, key): value for key, value in values.items()}
        try:
            super().__init__(**by_alias)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(cls, exc, given=set(values)),
                              env_var=_first_variable(cls, exc)) from None

    @classmethod
    def from_env(cls: type[S], **overrides: Any) -> S:
        """Same as ``cls(**overrides)``: the environment's values, ``overrides`` (by field name) on top."""
        return cls(**overrides)

    @classmethod
    def env_vars(cls) -> list[tuple[str, Any, str]]:
        """(variable, default, description) of every knob, for docs and `execbox doctor`."""
        rows = []
        for key, field in cls.model_fields.items():
            rows.append((_alias(cls, key), field.default, field.description or ""))
        return rows


def _alias(cls: type[BaseSettings], key: str) -> str:
    field = cls.model_fields.get(key)
    if field is None:
        raise ConfigError(f"{cls.__name__} has no setting {key!r}; known: {', '.join(sorted(cls.model_fields))}. "
                          "Fix the keyword's spelling")
    alias = field.validation_alias
    first = alias.choices[0] if isinstance(alias, AliasChoices) else key
    return first if isinstance(first, str) else key


def describe_validation_error(cls: type[BaseSettings], exc: ValidationError,
                              given: AbstractSet[str] = frozenset()) -> str:
    names = {key: _alias(cls, key) for key in cls.model_fields}
    by_var = {var: key for key, var in names.items()}
    parts = []
    in_code = False
    for err in exc.errors():
        key = str(err["loc"][0]) if err["loc"] else "?"
        var = names.get(key, key)
        if by_var.get(var, key) in given:
            in_code = True
            var = f"{by_var.get(var, key)} (given in code; variable {var})"
        msg = err["msg"]
        if err["type"] == "bool_parsing":
            msg = "allowed values are true or false (also 1/0, yes/no, on/off)"
        parts.append(f"{var}={err.get('input')!r} is invalid: {msg}")
    return "; ".join(parts) + (". Change the value." if in_code else ". Change or unset the variable.")


def _first_variable(cls: type[BaseSettings], exc: ValidationError) -> str | None:
    errors = exc.errors()
    if not errors or not errors[0]["loc"]:
        return None
    key = str(errors[0]["loc"][0])  # pydantic reports the variable's name (the alias)
    return _alias(cls, key) if key in cls.model_fields else key


class Settings(EnvSettings):
    """The core settings."""

    backend: str = setting(
        "CODE_EXEC_BACKEND", "auto", "backend for one-shot runs; `auto` = the strongest built-in sandbox here")
    shell_backend: str | None = setting(
        "SHELL_BACKEND", None, "backend for persistent sessions; (none) = CODE_EXEC_BACKEND")
    local: bool = setting(
        "CODE_EXEC_LOCAL", False, "local single-user mode: admits backends that are not sandboxes")
    enabled: bool = setting(
        "CODE_EXEC_ENABLED", False, "the agent surface (`execbox mcp`) offers code-execution tools; when false they "
        "are absent from its tool list. The CLI and the API ignore it")
    posture: int = setting(
        "AGENT_COMPUTE_POSTURE", 0, "what the agent surface offers: `0` one-shot sandboxes; `1` also one persistent "
        "sandbox per MCP session; `3` a shell on this host (needs CODE_EXEC_LOCAL=true and the stdio transport)")
    review_rules: Path | None = setting(
        "CODE_EXEC_REVIEW_RULES", None, "file of extra command-review rules, one `ask REGEX` or `deny REGEX` a line "
        "(see Approvals)")
    review_off: Annotated[list[str], NoDecode] = setting(
        "CODE_EXEC_REVIEW_OFF", [], "comma list of built-in command-review rules to switch off, by name")
    network: NetworkMode = setting(
        "CODE_EXEC_NETWORK", "none", "default network mode: `none`, `egress`, `proxy`, `host`")
    egress_allow: Annotated[list[str], NoDecode] = setting(
        "CODE_EXEC_EGRESS_ALLOW", [], "network mode `proxy`: comma list of destinations allowed besides the "
        "defaults: `host`, `*.domain`, `host:port`, CIDR (`10.0.0.0/8`, `[fd00::/8]:8080`)")
    egress_defaults: bool = setting(
        "CODE_EXEC_EGRESS_DEFAULTS", True, "network mode `proxy`: also allow the package registries (PyPI, npm, "
        "GitHub, crates.io, the Go proxy, RubyGems, Maven Central, Debian) on ports 80 and 443")
    egress_secrets: Annotated[list[str], NoDecode] = setting(
        "CODE_EXEC_EGRESS_SECRETS", [], "network mode `proxy`: comma list of `NAME=host[:port]`: the sandbox's NAME "
        "holds a placeholder, and the proxy puts execbox's own `$NAME` into the heads of HTTPS requests to that host "
        "only (`NAME=host[:port]+body`: into their bodies too)")
    ca_bundle: Path | None = setting(
        "CODE_EXEC_CA_BUNDLE", None, "network mode `proxy`: a PEM file of CA certificates the sandbox trusts instead "
        "of its own (a TLS-inspecting proxy); SSL_CERT_FILE, REQUESTS_CA_BUNDLE, PIP_CERT, ... point at it")
    max_output_bytes: int = setting(
        "CODE_EXEC_MAX_OUTPUT_BYTES", 100_000, "output cap per stream, bytes (head and tail kept)", gt=0, le=1 << 30)
    max_timeout_sec: float = setting(
        "CODE_EXEC_MAX_TIMEOUT_SEC", 30.0, "default and maximum timeout of a run, seconds",
        gt=0, le=7 * 86400, allow_inf_nan=False)
    backend_grace_sec: float = setting(
        "CODE_EXEC_BACKEND_GRACE_SEC", 30.0, "how long past a run's timeout a backend's exec may take to return (and "
        "how long a close, and a file call past CODE_EXEC_MAX_TIMEOUT_SEC, may take) before the runner abandons the "
        "call, closes the sandbox and raises BackendTimeoutError, seconds", gt=0, le=86400, allow_inf_nan=False)
    open_timeout_sec: float = setting(
        "CODE_EXEC_OPEN_TIMEOUT_SEC", 300.0, "how long a backend may take to open a sandbox (a container start, a "
        "remote provider's machine) before the runner abandons it and raises BackendTimeoutError, seconds",
        gt=0, le=86400, allow_inf_nan=False)
    max_concurrent: int | None = setting(
        "CODE_EXEC_MAX_CONCURRENT", None, "sandboxes alive at once per runner (a session holds one for its life); "
        "(none) = 4 per core, at most what the host's memory holds at CODE_EXEC_MEMORY_MB each", gt=0)
    queue_timeout_sec: float = setting(
        "CODE_EXEC_QUEUE_TIMEOUT_SEC", 60.0, "how long a run may wait for a free slot, seconds (apart from its "
        "timeout)", gt=0, allow_inf_nan=False)
    server: Path | None = setting(
        "CODE_EXEC_SERVER", None, "socket of an `execbox serve`: the `execbox` program hands its command line to it "
        "(a fork of a process with execbox loaded) instead of loading execbox itself; (none) = it never does")
    pool_size: int = setting(
        "CODE_EXEC_POOL_SIZE", 0, "warm pool: started, never-used sandboxes kept per configuration (0 = off); "
        "only inside `with Runner()` / `async with AsyncRunner()`", ge=0, le=64)
    pool_ttl_sec: float = setting(
        "CODE_EXEC_POOL_TTL_SEC", 300.0, "a warm sandbox unused for this long is removed, never handed out, seconds",
        gt=0, le=86400, allow_inf_nan=False)
    probe_cache_sec: float = setting(
        "CODE_EXEC_PROBE_CACHE_SEC", 60.0, "how long a new process may use what another found probing the same "
        "Docker engine (its API version and runtimes; a restarted engine is probed anew), seconds; 0 = always probe",
        ge=0, le=3600, allow_inf_nan=False)
    secret_files: Annotated[list[Path], NoDecode] = setting(
        "CODE_EXEC_SECRET_FILES", [], "comma list of extra files for the wallet-seed scan")
    memory_mb: int = setting(
        "CODE_EXEC_MEMORY_MB", 1024, "memory limit per sandbox, MiB, no swap headroom", gt=0, le=1 << 22)
    cpus: float = setting(
        "CODE_EXEC_CPUS", 1.0, "CPU limit per sandbox, cores", gt=0, le=1024, allow_inf_nan=False)
    pids_limit: int = setting(
        "CODE_EXEC_PIDS_LIMIT", 256, "process limit per sandbox", gt=0, le=1 << 22)
    disk_mb: int = setting(
        "CODE_EXEC_DISK_MB", 2048, "disk limit per sandbox (its workspace), MiB; where a backend can enforce it",
        gt=0, le=1 << 24)
    max_stdin_bytes: int = setting(
        "CODE_EXEC_MAX_STDIN_BYTES", 64 << 20, "largest stdin `execbox run --stdin` passes on, bytes; more is refused",
        gt=0, le=1 << 40)
    max_read_bytes: int = setting(
        "CODE_EXEC_MAX_READ_BYTES", 64 << 20, "largest file `read_file` returns, bytes; a larger one is refused",
        gt=0, le=1 << 40)
    max_display_bytes: int = setting(
        "CODE_EXEC_MAX_DISPLAY_BYTES", 16 << 20, "rich outputs (images, HTML, JSON) one `run_cell` returns, bytes "
        "in all; more are dropped, with a note", gt=0, le=1 << 28)
    max_transfer_bytes: int = setting(
        "CODE_EXEC_MAX_TRANSFER_BYTES", 512 << 20, "largest upload or download (all its files together, sparse "
        "files at full size), bytes; more is refused before it is read", gt=0, le=1 << 42)
    max_transfer_files: int = setting(
        "CODE_EXEC_MAX_TRANSFER_FILES", 100_000, "most entries an upload, download or listing walks; more is "
        "refused (trees deeper than 256 levels are refused too)", gt=0, le=1 << 24)
    snapshot_max_total_mb: int = setting(
        "CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB", 20480, "all snapshots of this user together (their files and the engine "
        "images they keep), MiB; a snapshot past it is refused and removed", gt=0, le=1 << 30)
    snapshot_max_age_sec: float = setting(
        "CODE_EXEC_SNAPSHOT_MAX_AGE_SEC", 7 * 86400.0, "how long a snapshot is kept: an older one is refused and "
        "`execbox snapshot gc` removes it, seconds", gt=0, le=366 * 86400, allow_inf_nan=False)
    package_cache: Path | None = setting(
        "CODE_EXEC_PACKAGE_CACHE", None, "per-user wheel cache that `pip_install` fills on the host and sandboxes "
        "see read-only (every sandbox whose backend takes mounts); (none) = /var/cache/execbox/pip as root, else "
        "~/.cache/execbox/pip")
    load_plugins: Annotated[list[str] | None, NoDecode] = setting(
        "EXECBOX_LOAD_PLUGINS", None,
        "comma list of third-party plugins to load (entry-point or distribution names); (none) = all; empty = none")
    auto_plugins: Annotated[list[str], NoDecode] = setting(
        "EXECBOX_AUTO_PLUGINS", [], "comma list of third-party backends (or distributions) `auto` may pick; by "
        "default it picks only built-ins, since a plugin's capabilities are its own claim")
    disable_plugins: Annotated[list[str], NoDecode] = setting(
        "EXECBOX_DISABLE_PLUGINS", [], "comma list of third-party plugins not to load")
    audit_log: str | None = setting(
        "CODE_EXEC_AUDIT_LOG", None, "audit log path (JSON Lines, hash-chained); (none) = "
        "$XDG_STATE_HOME/execbox/audit.jsonl, else ~/.local/state/execbox/audit.jsonl; `off` disables it; a path a "
        "sandbox could reach (a workspace, /usr, /etc, ...) is refused", validate_default=True)
    audit_key: SecretStr | None = setting(
        "CODE_EXEC_AUDIT_KEY", None, "key that makes the audit chain an HMAC-SHA256 chain (only its holder can "
        "rebuild it)")
    audit_key_file: Path | None = setting(
        "CODE_EXEC_AUDIT_KEY_FILE", None, "file holding the audit key (instead of CODE_EXEC_AUDIT_KEY)")
    audit_max_bytes: int = setting(
        "CODE_EXEC_AUDIT_MAX_BYTES", 64 << 20, "audit log size that starts a new file (the chain continues), bytes",
        ge=4096, le=1 << 40)
    audit_output: int = setting(
        "CODE_EXEC_AUDIT_OUTPUT", 0, "bytes of stdout and stderr text the audit log keeps per stream; 0 = only their "
        "SHA-256 and size", ge=0, le=1 << 20)
    otel_command_args: bool = setting(
        "CODE_EXEC_OTEL_COMMAND_ARGS", False, "OpenTelemetry: exec spans carry the command line "
        "(`process.command_args`); off by default, since a command line can hold a secret")

    _split_lists = field_validator("secret_files", "load_plugins", "auto_plugins", "disable_plugins", "egress_allow",
                                   "egress_secrets", "review_off", mode="before")(comma_list)

    @field_validator("egress_allow")
    @classmethod
    def _egress_entries(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            parse_entry(entry)  # a ValueError names the entry and what to write instead
        return entries

    @field_validator("egress_secrets")
    @classmethod
    def _egress_secret_entries(cls, entries: list[str]) -> list[str]:
        return [parse_setting(entry) for entry in entries]

    @field_validator("ca_bundle")
    @classmethod
    def _ca_bundle_file(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"{path} is not a file: name a PEM file of CA certificates")
        return path

    @field_validator("server", mode="before")
    @classmethod
    def _empty_means_no_server(cls, value: Any) -> Any:
        return None if value == "" else value  # as the `execbox` program reads it: CODE_EXEC_SERVER= is unset

    @field_validator("load_plugins", mode="before")
    @classmethod
    def _empty_means_none_loaded(cls, value: Any) -> Any:
        return [] if value == "" else value

    @field_validator("posture")
    @classmethod
    def _known_posture(cls, value: int) -> int:
        if value not in (0, 1, 3):
            raise ValueError("allowed values are 0, 1 or 3 (there is no posture 2)")
        return value

    @field_validator("audit_log")
    @classmethod
    def _audit_path(cls, value: str | None) -> str:
        return resolve_path(value)  # a ConfigError naming CODE_EXEC_AUDIT_LOG when a sandbox could reach it

    @property
    def session_backend(self) -> str:
        return self.shell_backend or self.backend


comma_list = comma_list


def _shown(value: Any) -> str:
    if value is None or value == [] or value == "":
        return "(none)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def settings_table(model: type[EnvSettings]) -> str:
    """The markdown table of a settings model's variables: the README's tables are generated from this."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for variable, default, description in model.env_vars():
        rows.append(f"| `{variable}` | {_shown(default)} | {description.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
