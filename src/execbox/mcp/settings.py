"""The MCP server's own knobs (``execbox mcp``); what the agent may do is in the core settings (CODE_EXEC_ENABLED,
AGENT_COMPUTE_POSTURE) and in its grant."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr

from execbox.config.settings import EnvSettings, setting

MIN_TOKEN_CHARS = 16


class McpSettings(EnvSettings):
    token: SecretStr | None = setting(
        "EXECBOX_MCP_TOKEN", None, "bearer token an HTTP client must present (`Authorization: Bearer ...`); "
        f"`execbox mcp --http` refuses to start without it (or --token-file); at least {MIN_TOKEN_CHARS} characters")
    key_file: Path | None = setting(
        "EXECBOX_MCP_KEY_FILE", None, "file holding the key that signs delegated grants (32 bytes or more); (none) = "
        "a random key per server process, so its grants end with it")
    grant: SecretStr | None = setting(
        "EXECBOX_MCP_GRANT", None, "a delegated grant the stdio server runs under (a sub-agent's own server); "
        "needs the issuing server's EXECBOX_MCP_KEY_FILE")
    max_depth: int = setting(
        "EXECBOX_MCP_MAX_DEPTH", 2, "delegation depth: grants at this depth are leaves (they cannot delegate and "
        "never include code execution)", ge=1, le=8)
    session_idle_sec: float = setting(
        "EXECBOX_MCP_IDLE_SEC", 900.0, "an HTTP MCP session (and its posture-1 sandbox) idle this long is closed, "
        "seconds", gt=0, le=7 * 86400, allow_inf_nan=False)
    grant_ttl_sec: float = setting(
        "EXECBOX_MCP_GRANT_TTL_SEC", 3600.0, "default lifetime of a delegated grant, seconds (never beyond its "
        "parent's)", gt=0, le=30 * 86400, allow_inf_nan=False)
    max_snapshots: int = setting(
        "EXECBOX_MCP_MAX_SNAPSHOTS", 16, "undo points one MCP session keeps (its `snapshot` tool): taking one more "
        "removes its oldest", ge=1, le=1024)
