"""The network modes a run asks for: none (no network), egress (outbound only), proxy (through execbox's egress
proxy and its allowlist, execbox.policy.egress), host (the host's own network: not a sandbox's)."""

from __future__ import annotations

from typing import Literal

NetworkMode = Literal["none", "egress", "proxy", "host"]
NETWORK_MODES: tuple[str, ...] = ("none", "egress", "proxy", "host")
