"""Secrets at egress as a caller gives them: ``{NAME: (destination, value)}`` or CODE_EXEC_EGRESS_SECRETS entries,
checked (one host or address and port per secret; ``+body`` opts in to request bodies). What the proxy does with
them is execbox.kit.proxy.secrets."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from execbox.policy.egress import hostname
from execbox.secrets.values import Secret, check_secrets

# What no request head may carry (a field value is HT, SP, visible ASCII and bytes from 0x80).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")

#: What a caller gives: ``{NAME: (host or "host:port", value or Secret)}``.
Given = Mapping[str, tuple[str, "Secret | str"]]


#: The opt-in, at the end of a secret's destination, to substitute it in request bodies too (see the module's
#: docstring for the risk it takes).
IN_BODY = "+body"


@dataclass(frozen=True)
class EgressSecret:
    name: str
    host: str
    port: int
    value: bytes
    placeholder: bytes
    #: Substituted in request bodies too (the destination ended with IN_BODY), not only in the request head.
    body: bool = False


class InBody(Secret):
    """A secret at egress whose destination opted in to bodies (``IN_BODY``): what ``check`` gives for one."""

    __slots__ = ()


def parse_destination(spec: str) -> tuple[str, int]:
    """``api.example.com`` (port 443) or ``api.example.com:8443`` / ``[::1]:8443``; ValueError if malformed.
    (``check`` takes the ``IN_BODY`` suffix off first.)"""
    host, port = spec.strip().lower(), 443
    if host.startswith("["):
        inner, _, rest = host[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isascii() and rest[1:].isdigit()):
            raise ValueError(f"{spec!r}: after [address] give nothing or :port, the port a number")
        host, port = inner, int(rest[1:]) if rest else 443
    elif host.count(":") == 1:
        host, _, text = host.partition(":")
        if not (text.isascii() and text.isdigit()):
            raise ValueError(f"{spec!r}: the port is not a number")
        port = int(text)
    bad_v6 = ":" in host and address_of(host) is None
    if not host or not 0 < port < 65536 or any(c in host for c in "/@ *?#") or bad_v6:
        raise ValueError(f"{spec!r} is not one host name or address (no wildcard, path or user)")
    if address_of(host) is None:
        hostname(host, spec)
    return host.rstrip("."), port


def address_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check(given: Mapping[str, Any]) -> dict[str, tuple[str, int, Secret]]:
    """Secrets at egress, checked: ``{NAME: (host or host:port, value or Secret)}``; ValueError saying what to
    change."""
    if not isinstance(given, Mapping):
        raise ValueError(f"secrets_at_egress is a {type(given).__name__}; give {{NAME: (host, value)}}")
    values: dict[str, Secret | str] = {}
    hosts: dict[str, tuple[str, int]] = {}
    bodies: set[str] = set()
    for name, pair in given.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str):
            raise ValueError(f"secrets_at_egress[{str(name)[:60]!r}]: give a pair (host, value), e.g. "
                             "('api.openai.com', Secret.from_env('OPENAI_API_KEY'))")
        spec = pair[0].strip()
        if spec.lower().endswith(IN_BODY):
            spec = spec[:-len(IN_BODY)]
            bodies.add(name)
        hosts[name] = parse_destination(spec)
        values[name] = pair[1]
    checked = check_secrets(values)
    for name, secret in checked.items():
        if _CONTROL.search(secret.reveal()):
            raise ValueError(f"secrets_at_egress[{name!r}]: its value holds a control character (CR, LF, ESC, ...), "
                             "which the request head it is swapped into cannot carry (a CR or LF would split it)")
    return {name: (*hosts[name], InBody(secret.reveal(), origin=secret.origin) if name in bodies else secret)
            for name, secret in checked.items()}


def from_setting(entries: list[str], environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, int, Secret]]:
    """CODE_EXEC_EGRESS_SECRETS (``NAME=host[:port]``, or ``NAME=host[:port]+body`` to substitute in request
    bodies too; the value from execbox's own environment variable NAME)."""
    from execbox.errors import ConfigError

    given: dict[str, tuple[str, Secret]] = {}
    for entry in entries:
        name, _, host = entry.partition("=")
        try:
            given[name] = (host, Secret.from_env(name, environ))
        except ConfigError as exc:
            raise ConfigError(f"CODE_EXEC_EGRESS_SECRETS names {name}: {exc.message}",
                              env_var="CODE_EXEC_EGRESS_SECRETS") from None
    try:
        return check(given)
    except ValueError as exc:
        raise ConfigError(f"CODE_EXEC_EGRESS_SECRETS: {exc}", env_var="CODE_EXEC_EGRESS_SECRETS") from None


def parse_setting(entry: str) -> str:
    """One CODE_EXEC_EGRESS_SECRETS entry, checked for shape (ValueError says what to write)."""
    name, sep, host = entry.partition("=")
    if not sep or not name or not host:
        raise ValueError(f"CODE_EXEC_EGRESS_SECRETS entry {entry!r}: write NAME=host or NAME=host:port, +body at "
                         "the end to substitute in request bodies too (the value comes from execbox's own "
                         "environment variable NAME, never from this setting)")
    parse_destination(host[:-len(IN_BODY)] if host.lower().endswith(IN_BODY) else host)
    return entry
