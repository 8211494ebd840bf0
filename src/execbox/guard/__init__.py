"""The sandbox guard: one place, in front of every backend."""

from execbox.guard.guard import Guard
from execbox.guard.secrets import SecretFinding, find_secrets, scan_text

__all__ = ["Guard", "SecretFinding", "find_secrets", "scan_text"]
