"""Where execbox keeps its own files on this host: the one XDG lookup every other module asks.

A relative XDG_* value is ignored, as the XDG base directory specification says. As root the caches live under
/var/cache/execbox: a sandbox user must be able to reach the package cache, and /root is 0700."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from execbox.errors import ConfigError

#: CODE_EXEC_AUDIT_LOG=off: no audit log.
OFF = "off"
# Places a sandbox can see: the system directories bubblewrap binds read-only, the kernel's views.
EXPOSED_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/sys", "/dev")
# Every session directory execbox makes under the temporary directory starts with this.
WORKSPACE_PREFIX = "execbox-"
#: Places execbox uses as root, whatever HOME says.
SYSTEM_CACHE = Path("/var/cache/execbox")
SYSTEM_STATE = Path("/var/lib/execbox")


def _xdg(variable: str, fallback: str) -> Path:
    value = os.environ.get(variable) or ""
    return Path(value) if value.startswith("/") else Path(os.path.expanduser("~")) / fallback


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/execbox, else ~/.cache/execbox."""
    return _xdg("XDG_CACHE_HOME", ".cache") / "execbox"


def state_dir() -> Path:
    """$XDG_STATE_HOME/execbox, else ~/.local/state/execbox: the audit log and its key."""
    return _xdg("XDG_STATE_HOME", ".local/state") / "execbox"


def cache_dir() -> Path:
    """The caches' parent (packages, engine probes): /var/cache/execbox as root, else user_cache_dir()."""
    return SYSTEM_CACHE if os.geteuid() == 0 else user_cache_dir()


def own_places() -> list[Path]:
    """Every place above, as root or not: what the guard never lets a sandbox reach."""
    return [user_cache_dir(), state_dir(), SYSTEM_CACHE, SYSTEM_STATE]


def default_path() -> Path:
    """Where the audit log is when CODE_EXEC_AUDIT_LOG is unset."""
    return state_dir() / "audit.jsonl"


def resolve_path(value: str | None) -> str:
    """The log path a CODE_EXEC_AUDIT_LOG value means ("off", or an absolute path), or ConfigError when a
    sandbox could reach it."""
    if value is not None and value.strip().lower() == OFF:
        return OFF
    path = os.path.abspath(os.path.expanduser(value)) if value and value.strip() else str(default_path())
    reach = exposed(path)
    if reach:
        raise ConfigError(f"CODE_EXEC_AUDIT_LOG={path!r} is {reach}, where a sandbox could read or write it. Put the "
                          "log in a private directory (the default is $XDG_STATE_HOME/execbox/audit.jsonl), or "
                          "set it to off", env_var="CODE_EXEC_AUDIT_LOG")
    return path


def exposed(path: str) -> str | None:
    """Why a sandbox could reach ``path``, or None: under a system directory bubblewrap binds, or inside a
    session directory (a workspace) execbox made under the temporary directory."""
    candidates = {os.path.normpath(path)}
    with contextlib.suppress(OSError, ValueError):
        candidates.add(os.path.realpath(path))
    tmp = {os.path.normpath(tempfile.gettempdir())}
    with contextlib.suppress(OSError, ValueError):
        tmp.add(os.path.realpath(tempfile.gettempdir()))
    for p in candidates:
        for top in EXPOSED_DIRS:
            if p == top or p.startswith(top + "/"):
                return f"under {top}"
        for t in tmp:
            if p.startswith(t.rstrip("/") + "/"):
                first = p[len(t.rstrip("/")) + 1:].split("/")[0]
                if first.startswith(WORKSPACE_PREFIX):
                    return f"inside a sandbox workspace ({t}/{first})"
    return None
