"""Grants: what a caller of the MCP server may do, and narrower grants for the sub-agents it delegates to.

A grant names the tools a caller may use, the backends, network modes and egress entries, the limits (each a
maximum), the posture, and when it expires. The server's own grant (the *root*) is what its settings allow.
A caller with the ``delegate`` tool asks the server for a narrower grant for a sub-agent; the server signs it
(HMAC-SHA256 under its key, EXECBOX_MCP_KEY_FILE or a random per-process key) and returns a token that the
sub-agent's client presents: ``Authorization: Bearer <token>`` over HTTP, or EXECBOX_MCP_GRANT for a stdio
server of its own (which needs the same key file). Rules, enforced when a grant is issued:

- a grant only narrows its parent: every set is a subset, every limit at most the parent's, the posture at
  most the parent's, the expiry no later; asking for more is refused, naming what;
- the depth is bounded (EXECBOX_MCP_MAX_DEPTH, default 2): a grant at that depth is a *leaf*. A leaf cannot
  delegate, and a leaf grant never includes code execution (run_code, run_command, shell): the agents at the
  end of a delegation chain — the furthest from the person who started it, and the ones that read what
  everyone above handed down — may read and write files in their own sandbox, but run nothing;
- the chain of grant ids (root first) travels in the token and is recorded with every call in the audit log.

A token is ``exg1.<payload>.<mac>`` (base64url JSON; the MAC covers ``exg1.<payload>``), at most 8 KiB; a
wrong MAC, an expired or malformed grant is refused. There is no revocation list: keep grants short-lived
(EXECBOX_MCP_GRANT_TTL_SEC), or rotate the key, which voids every grant signed with it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from execbox.contract.models import NETWORK_MODES, NetworkMode
from execbox.errors import ConfigError, RefusedError

CODE_TOOLS = frozenset({"run_code", "run_command", "shell", "python"})
SESSION_TOOLS = frozenset({"shell", "python", "write_file", "read_file", "list_files", "snapshot", "rollback"})
ALL_TOOLS = ("run_code", "run_command", "shell", "python", "write_file", "read_file", "list_files", "snapshot",
             "rollback", "delegate")
PREFIX = "exg1"
MAX_TOKEN_BYTES = 8192
MIN_KEY_BYTES = 32


class GrantError(RefusedError):
    """A grant does not allow this, cannot be issued as asked, or a token is not a valid grant."""


class GrantLimits(BaseModel):
    """Maxima a grant allows; None: what the server's settings allow."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    memory_mb: int | None = Field(default=None, gt=0)
    cpus: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    pids: int | None = Field(default=None, gt=0)
    disk_mb: int | None = Field(default=None, gt=0)
    max_output_bytes: int | None = Field(default=None, gt=0)


class Grant(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=64)
    #: Grant ids from the root to this one.
    chain: tuple[str, ...] = Field(min_length=1, max_length=16)
    depth: int = Field(ge=0, le=16)
    label: str = Field(default="", max_length=200)
    tools: frozenset[str]
    #: None: every backend the server may use.
    backends: frozenset[str] | None = None
    network: frozenset[NetworkMode]
    #: None: the egress allowlist the operator configured; else only these entries.
    egress: tuple[str, ...] | None = None
    limits: GrantLimits = GrantLimits()
    posture: int = Field(ge=0, le=3)
    #: Unix time; None: never (the root).
    expires_at: float | None = None

    def leaf(self, max_depth: int) -> bool:
        return self.depth >= max_depth

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now or time.time()) >= self.expires_at

    def check_tool(self, tool: str) -> None:
        if tool not in self.tools:
            raise GrantError(f"refused: your grant ({self.describe()}) does not include the tool {tool!r}; it allows "
                             f"{', '.join(sorted(self.tools)) or 'no tools'}. Ask whoever delegated to you for it")
        if self.expired():
            raise GrantError(f"refused: your grant ({self.describe()}) has expired; ask for a new one")

    def check_backend(self, backend: str) -> None:
        if self.backends is not None and backend not in self.backends:
            raise GrantError(f"refused: your grant does not include the backend {backend!r}; it allows "
                             f"{', '.join(sorted(self.backends)) or 'none'}")

    def check_network(self, network: str) -> None:
        if network not in self.network:
            raise GrantError(f"refused: your grant does not include network mode {network!r}; it allows "
                             f"{', '.join(sorted(self.network)) or 'none'}")
        if self.egress is not None and network in ("egress", "proxy"):
            # Fail closed: the proxy's allowlist is the operator's (CODE_EXEC_EGRESS_ALLOW) for every sandbox;
            # this server cannot narrow it to a grant's entries, so a grant that narrows egress gets no network.
            raise GrantError(f"refused: your grant narrows egress to {', '.join(self.egress) or 'nothing'}, and this "
                             "server cannot enforce a per-grant allowlist; use network mode none")

    def describe(self) -> str:
        return f"grant {self.id}" + (f" '{self.label}'" if self.label else "") + f", depth {self.depth}"

    def public(self) -> dict[str, Any]:
        """The grant as a caller may see it."""
        data = self.model_dump(mode="json")
        data["tools"] = sorted(self.tools)
        data["network"] = sorted(self.network)
        if self.backends is not None:
            data["backends"] = sorted(self.backends)
        return data


class GrantRequest(BaseModel):
    """What a caller asks to delegate (the ``delegate`` tool's arguments). Unset fields inherit the parent's."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(min_length=1, max_length=len(ALL_TOOLS))
    backends: list[str] | None = Field(default=None, max_length=32)
    network: list[NetworkMode] | None = Field(default=None, max_length=len(NETWORK_MODES))
    egress: list[str] | None = Field(default=None, max_length=256)
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    memory_mb: int | None = Field(default=None, gt=0)
    max_output_bytes: int | None = Field(default=None, gt=0)
    posture: int | None = Field(default=None, ge=0, le=3)
    expires_in_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    label: str = Field(default="", max_length=200)


#: The network modes an agent may pick by itself: none, and proxy (default-deny, the allowlist the operator set).
AGENT_NETWORKS = frozenset({"none", "proxy"})


def root_grant(tools: Iterable[str], posture: int, network: str = "none") -> Grant:
    """The server's own grant: everything its settings allow (the runner's guard still judges every request).
    An agent may pick network none or proxy; a wider mode (egress, host) only when the operator chose it as
    CODE_EXEC_NETWORK — the agent's `network` argument must never widen what the operator set."""
    modes = set(AGENT_NETWORKS) | {network} | ({"host"} if posture == 3 else set())  # posture 3's shell: this host
    return Grant(id="root", chain=("root",), depth=0, label="the server's own grant", tools=frozenset(tools),
                 network=frozenset(modes), posture=posture)  # type: ignore[arg-type]


def narrow(parent: Grant, ask: GrantRequest, *, max_depth: int, default_ttl_s: float,
           now: float | None = None) -> Grant:
    """A child of ``parent`` as asked, or GrantError naming everything that would widen it."""
    now = now or time.time()
    if parent.expired(now):
        raise GrantError(f"refused: your grant ({parent.describe()}) has expired; it cannot delegate")
    depth = parent.depth + 1
    if depth > max_depth or "delegate" not in parent.tools:
        raise GrantError(f"refused: your grant ({parent.describe()}) is a leaf: it cannot delegate")
    wider: list[str] = []
    tools = frozenset(ask.tools)
    unknown = sorted(tools - set(ALL_TOOLS))
    if unknown:
        raise GrantError(f"refused: unknown tools {', '.join(unknown)}; the tools are {', '.join(ALL_TOOLS)}")
    if tools - parent.tools:
        wider.append(f"tools {', '.join(sorted(tools - parent.tools))}")
    backends = parent.backends if ask.backends is None else frozenset(ask.backends)
    if parent.backends is not None and backends is not None and backends - parent.backends:
        wider.append(f"backends {', '.join(sorted(backends - parent.backends))}")
    network = parent.network if ask.network is None else frozenset(ask.network)
    if network - parent.network:
        wider.append(f"network modes {', '.join(sorted(network - parent.network))}")
    egress = parent.egress if ask.egress is None else tuple(ask.egress)
    if parent.egress is not None and egress is not None and set(egress) - set(parent.egress):
        wider.append(f"egress entries {', '.join(sorted(set(egress) - set(parent.egress)))}")
    limits: dict[str, Any] = {}
    for name in ("timeout_s", "memory_mb", "max_output_bytes"):
        mine, theirs = getattr(ask, name), getattr(parent.limits, name)
        if mine is not None and theirs is not None and mine > theirs:
            wider.append(f"{name} {mine:g} (yours: {theirs:g})")
        limits[name] = mine if mine is not None else theirs
    for name in ("cpus", "pids", "disk_mb"):
        limits[name] = getattr(parent.limits, name)
    posture = parent.posture if ask.posture is None else ask.posture
    if posture > parent.posture or posture == 2:
        wider.append(f"posture {posture} (yours: {parent.posture})")
    if wider:
        raise GrantError(f"refused: a grant can only narrow its parent ({parent.describe()}); this asks for more: "
                         + "; ".join(wider))
    if depth >= max_depth and tools & (CODE_TOOLS | {"delegate"}):
        raise GrantError(
            f"refused: a grant at depth {depth} is a leaf (EXECBOX_MCP_MAX_DEPTH={max_depth}), and a leaf grant never "
            f"includes code execution or delegation; drop {', '.join(sorted(tools & (CODE_TOOLS | {'delegate'})))}")
    if posture == 0 and tools & SESSION_TOOLS:
        raise GrantError(f"refused: the tools {', '.join(sorted(tools & SESSION_TOOLS))} need posture 1 or more (a "
                         "persistent sandbox); ask for posture 1 or drop them")
    expires = now + min(ask.expires_in_s or default_ttl_s, default_ttl_s)  # EXECBOX_MCP_GRANT_TTL_SEC is the most
    if parent.expires_at is not None:
        expires = min(expires, parent.expires_at)
    grant_id = secrets.token_hex(8)
    return Grant(id=grant_id, chain=(*parent.chain, grant_id), depth=depth, label=ask.label, tools=tools,
                 backends=backends, network=network, egress=egress, limits=GrantLimits(**limits), posture=posture,
                 expires_at=expires)


def load_key(path: Path | None) -> bytes:
    """The signing key: the key file's bytes (owner-only, at least 32 bytes), else a random per-process key."""
    if path is None:
        return secrets.token_bytes(MIN_KEY_BYTES)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            mode = os.fstat(fd).st_mode
            key = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"EXECBOX_MCP_KEY_FILE {str(path)!r} cannot be read ({exc.strerror}); fix the path",
                          env_var="EXECBOX_MCP_KEY_FILE") from None
    if not stat.S_ISREG(mode) or mode & 0o077:
        raise ConfigError(f"EXECBOX_MCP_KEY_FILE {str(path)!r} must be a regular file only its owner can read "
                          "(chmod 600)", env_var="EXECBOX_MCP_KEY_FILE")
    key = key.strip()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"EXECBOX_MCP_KEY_FILE {str(path)!r} holds {len(key)} bytes; a key needs at least "
                          f"{MIN_KEY_BYTES} (e.g. `head -c 48 /dev/urandom | base64 > FILE`)",
                          env_var="EXECBOX_MCP_KEY_FILE")
    return key


class Signer:
    """Issues and verifies grant tokens under one key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, signed: bytes) -> str:
        return _b64(hmac.new(self._key, signed, hashlib.sha256).digest())

    def issue(self, grant: Grant) -> str:
        payload = _b64(grant.model_dump_json().encode())
        return f"{PREFIX}.{payload}.{self._mac(f'{PREFIX}.{payload}'.encode())}"

    def verify(self, token: str, now: float | None = None) -> Grant:
        """The grant a token carries; GrantError when it is not one this key signed, or it expired."""
        if not isinstance(token, str) or len(token) > MAX_TOKEN_BYTES or token.count(".") != 2:
            raise GrantError("refused: not a grant token")
        prefix, payload, mac = token.split(".")
        expected = self._mac(f"{prefix}.{payload}".encode())
        if prefix != PREFIX or not hmac.compare_digest(mac.encode(), expected.encode()):
            raise GrantError("refused: not a grant token this server signed (or it was altered)")
        try:
            grant = Grant.model_validate_json(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except (ValueError, ValidationError):
            raise GrantError("refused: a malformed grant token") from None
        if grant.expired(now):
            raise GrantError(f"refused: {grant.describe()} has expired; ask for a new one")
        return grant


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")
