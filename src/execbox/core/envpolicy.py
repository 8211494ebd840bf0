"""The env policy: the sandbox inherits nothing from the host, and secret-looking names are dropped."""

from __future__ import annotations

import re

_SECRET_PARTS = (
    "API_KEY", "APIKEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "PRIVATE_KEY", "ACCESS_KEY",
    "MNEMONIC", "SEED", "CREDENTIAL", "AUTH", "COOKIE", "JWT", "DSN", "DATABASE_URL",
)
_ALLOWED = frozenset({"PYTHONHASHSEED"})
_SECRET_RE = re.compile("|".join(re.escape(p) for p in _SECRET_PARTS))

# The whole environment a sandboxed command starts with, before the caller's filtered variables.
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    if upper in _ALLOWED:
        return False
    return bool(_SECRET_RE.search(upper)) or upper.endswith("_PAT")


def filter_env(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Split the caller's variables into the ones passed on and the names dropped."""
    kept = {k: v for k, v in env.items() if not is_secret_name(k)}
    dropped = sorted(k for k in env if is_secret_name(k))
    return kept, dropped


def sandbox_env(request_env: dict[str, str], *, home: str, path: str = BASE_PATH) -> dict[str, str]:
    """The full environment for a sandboxed command: a minimal base plus the (already filtered) request env."""
    env = {"PATH": path, "HOME": home, "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONUNBUFFERED": "1"}
    env.update(request_env)
    return env
