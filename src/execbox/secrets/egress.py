"""Secrets at egress as a caller gives them: ``{NAME: (destination, value)}`` or CODE_EXEC_EGRESS_SECRETS entries,
checked (one host or address and port per secret; ``+body`` opts in to request bodies). What the proxy does with
them is execbox.kit.proxy.secrets."""

from __future__ import annotations

import ipaddress
import re
import secrets as random
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from execbox.policy.egress import hostname
from execbox.secrets.values import Secret, check_secrets

# What no request head may carry (a field value is HT, SP, visible ASCII and bytes from 0x80).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")

PLACEHOLDER_PREFIX = "EXECBOX-PLACEHOLDER-"
_ALNUM = string.ascii_letters + string.digits

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


def placeholder_for(value: bytes) -> bytes:
    """A random token as long as ``value`` (in bytes), so that swapping one for the other changes no length."""
    size = len(value)
    prefix = PLACEHOLDER_PREFIX if size >= len(PLACEHOLDER_PREFIX) + 12 else ""
    return (prefix + "".join(random.choice(_ALNUM) for _ in range(size - len(prefix)))).encode()


class RunSecrets:
    """One run's secrets at egress: their placeholders, and the proxy run they were attached to."""

    def __init__(self, given: Mapping[str, tuple[str, int, Secret]]) -> None:
        self.secrets = [EgressSecret(name, host, port, secret.reveal().encode(),
                                     placeholder_for(secret.reveal().encode()), isinstance(secret, InBody))
                        for name, (host, port, secret) in given.items()]
        self.longest = max((len(s.placeholder) for s in self.secrets), default=0)
        #: Set when a proxy run took them (a backend that runs no execbox proxy never does).
        self.attached = False

    def __repr__(self) -> str:
        return f"RunSecrets({[(s.name, s.host, s.port) for s in self.secrets]})"

    def __reduce__(self) -> Any:
        raise TypeError("RunSecrets hold secret values and are not pickled")

    @property
    def names(self) -> list[str]:
        return sorted(s.name for s in self.secrets)

    def env(self) -> dict[str, str]:
        """What the sandbox's variables hold: the placeholders."""
        return {s.name: s.placeholder.decode() for s in self.secrets}

    def values(self) -> dict[str, str]:
        """The real values by name (for the run's redactor, in case one comes back some other way)."""
        return {s.name: s.value.decode() for s in self.secrets}

    def for_destination(self, host: str, port: int) -> list[EgressSecret]:
        host = host.lower().rstrip(".")
        return [s for s in self.secrets if s.host == host and s.port == port]

    def carried(self, data: bytes | bytearray) -> EgressSecret | None:
        """The secret whose placeholder ``data`` holds, if any."""
        return next((s for s in self.secrets if s.placeholder in data), None)
