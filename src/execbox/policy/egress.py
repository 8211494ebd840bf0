"""The egress policy of network mode ``proxy``: which destinations a sandbox may reach, decided without I/O.

An allowlist is a list of entries (``CODE_EXEC_EGRESS_ALLOW``, plus the package registries unless
``CODE_EXEC_EGRESS_DEFAULTS=false``):

    pypi.org              that exact name (not www.pypi.org), ports 80 and 443
    *.example.com         any name below example.com (a.example.com, a.b.example.com), not example.com
    example.com:8443      that name, port 8443 only (a port replaces the default ports of its entry)
    10.1.0.0/16           IP literals in that network, and names that resolve into it, even when the
    203.0.113.7           addresses are private (an address alone is a /32 or /128)
    [fd00::/8]:8080       IPv6 networks in brackets, with an optional port

A connection is allowed when all of these hold:

1. The name is allowlisted for the port (exact names; wildcards only where written). An IP literal
   (``CONNECT 10.0.0.1:443``, also ``127.1`` or ``2130706433``) counts only when a network entry holds it.
2. Every address it connects to is one the proxy resolved itself and checked here: loopback, private
   (RFC 1918), link-local (the cloud metadata address 169.254.169.254 among them), carrier-grade NAT,
   unique-local and link-local IPv6, unspecified, multicast, reserved and benchmarking ranges, the
   known cloud metadata addresses outside those, this host's own addresses, and the IPv4-mapped,
   IPv4-compatible, NAT64, 6to4 and Teredo forms of any of them are refused, even for an allowlisted
   name (DNS rebinding), unless a network entry names them. Documentation ranges (TEST-NET,
   2001:db8::/32) are not refused: some networks front public services with them, and ``not
   is_global`` would refuse those.

``decide_name`` is step 1, ``decide_address`` step 2; ``kit.proxy.server`` does the I/O around them.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_PORTS: frozenset[int] = frozenset({80, 443})

#: The package registries allowed by default (CODE_EXEC_EGRESS_DEFAULTS=true): the names their clients
#: (pip, npm, cargo, go, gem, mvn, apt, git over https) connect to for public packages.
DEFAULT_REGISTRIES: tuple[str, ...] = (
    "pypi.org", "files.pythonhosted.org",                                       # PyPI
    "registry.npmjs.org",                                                       # npm
    "github.com", "codeload.github.com", "objects.githubusercontent.com",       # GitHub (git, archives,
    "raw.githubusercontent.com", "release-assets.githubusercontent.com",        # release assets)
    "crates.io", "index.crates.io", "static.crates.io",                         # crates.io
    "proxy.golang.org", "sum.golang.org",                                       # the Go module proxy
    "rubygems.org", "index.rubygems.org",                                       # RubyGems
    "repo.maven.apache.org", "repo1.maven.org",                                 # Maven Central
    "deb.debian.org", "security.debian.org",                                    # Debian
)

_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)\Z")
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)\Z")

# Never a sandbox's destination unless a network entry names it: (network, what it is, in words).
_REFUSED: tuple[tuple[IPNetwork, str], ...] = tuple((ipaddress.ip_network(net), what) for net, what in (
    ("0.0.0.0/8", "an unspecified ('this network') address"),
    ("10.0.0.0/8", "a private address (RFC 1918)"),
    ("100.64.0.0/10", "a carrier-grade NAT address"),
    ("127.0.0.0/8", "a loopback address"),
    ("169.254.0.0/16", "a link-local address (cloud metadata lives here)"),
    ("172.16.0.0/12", "a private address (RFC 1918)"),
    ("192.0.0.0/24", "an IETF protocol address (cloud metadata lives here)"),
    ("192.168.0.0/16", "a private address (RFC 1918)"),
    ("198.18.0.0/15", "a benchmarking address (used inside networks)"),
    ("224.0.0.0/4", "a multicast address"),
    ("240.0.0.0/4", "a reserved address"),
    ("168.63.129.16/32", "a cloud metadata address (Azure)"),
    ("::/128", "an unspecified address"),
    ("::1/128", "a loopback address"),
    ("100::/64", "a discard-only address"),
    ("64:ff9b:1::/48", "a local NAT64 address"),
    ("2001::/32", "a Teredo tunnel address"),
    ("fc00::/7", "a unique-local address"),
    ("fe80::/10", "a link-local address"),
    ("fec0::/10", "a site-local address"),
    ("ff00::/8", "a multicast address"),
))
# Of those, where a connection reaches this host itself or its cloud's metadata service rather than a network
# (the guard refuses an allowlist entry holding one, with this host's own addresses, outside local mode).
HOST_NETWORKS: tuple[IPNetwork, ...] = (
    *(net for net, what in _REFUSED if what.startswith(("a loopback", "an unspecified")) or "metadata" in what),
    ipaddress.ip_network("fd00:ec2::254/128"),  # AWS's metadata service over IPv6 (inside fc00::/7)
)


@dataclass(frozen=True)
class Entry:
    """One allowlist entry, parsed."""

    text: str
    kind: Literal["name", "suffix", "network"]
    name: str = ""  # name: the host; suffix: the domain below which names match
    network: IPNetwork | None = None
    ports: frozenset[int] = DEFAULT_PORTS

    def matches_name(self, host: str) -> bool:
        if self.kind == "name":
            return host == self.name
        return self.kind == "suffix" and host.endswith("." + self.name)

    def holds(self, address: IPAddress) -> bool:
        return self.network is not None and address.version == self.network.version and address in self.network


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


def _port(text: str, entry: str) -> int:
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{entry!r}: the port {text!r} is not a number from 1 to 65535")
    return int(text)


def hostname(text: str, entry: str) -> str:
    """A lower-case DNS name (no trailing dot), or ValueError saying what is wrong with it."""
    if not text.isascii():
        raise ValueError(f"{entry!r}: write an internationalised name in its ASCII (xn--) form")
    name = text.lower().removesuffix(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{entry!r} is not a host name, *.domain, host:port or CIDR network")
    if _NUMERIC_LABEL.match(labels[-1]):
        raise ValueError(f"{entry!r} looks like an IP address: write an address as a network, e.g. 10.0.0.5 or "
                         "10.0.0.0/24 (IPv6 in brackets: [fd00::5])")
    return name


def _network(text: str, entry: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        if "host bits set" in str(exc):
            net = ipaddress.ip_network(text, strict=False)
            raise ValueError(f"{entry!r} has host bits set: write the network as {net}") from None
        return None


def parse_entry(raw: str) -> Entry:
    """One entry of CODE_EXEC_EGRESS_ALLOW; ValueError with what to write instead."""
    text = raw.strip()
    if not text:
        raise ValueError("an empty entry")
    if text in ("*", "*.", "*:*") or text.startswith("*:"):
        raise ValueError(f"{text!r} would allow every host: that is network mode egress, not an allowlist")
    ports = DEFAULT_PORTS
    body = text
    if text.startswith("["):
        inside, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: write an IPv6 network as [fd00::/8] or [fd00::/8]:8080")
        body = inside
        if rest:
            ports = frozenset({_port(rest[1:], text)})
        net = _network(body, text)
        if net is None or net.version != 6:
            raise ValueError(f"{text!r}: {body!r} in brackets is not an IPv6 address or network")
        return Entry(text, "network", network=net, ports=ports)
    if text.count(":") > 1:
        net = _network(text, text)
        if net is None:
            raise ValueError(f"{text!r} is not an IPv6 address or network (with a port: [fd00::/8]:8080)")
        return Entry(text, "network", network=net)
    if ":" in text:
        body, _, port = text.rpartition(":")
        ports = frozenset({_port(port, text)})
    net = _network(body, text)
    if net is not None:
        return Entry(text, "network", network=net, ports=ports)
    if body.startswith("*."):
        return Entry(text, "suffix", name=hostname(body[2:], text), ports=ports)
    if "*" in body:
        raise ValueError(f"{text!r}: a wildcard is only allowed as the first label, as in *.example.com")
    return Entry(text, "name", name=hostname(body, text), ports=ports)


def literal_address(host: str) -> IPAddress | None:
    """The address a host string denotes by itself, in any form a resolver would take (``127.1``,
    ``0x7f.0.0.1``, ``2130706433``, ``[::1]``, ``fe80::1%eth0``), or None for a name."""
    text = host.strip("[]")
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        pass
    labels = text.lower().removesuffix(".").split(".")
    if labels and all(_NUMERIC_LABEL.match(label) for label in labels) and len(labels) <= 4:
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, NAT64, 6to4), or None."""
    if address.version != 6:
        return None
    assert isinstance(address, ipaddress.IPv6Address)
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    value = int(address)
    if address in _NAT64 or (value >> 32 == 0 and value > 1):  # 64:ff9b::/96, or ::a.b.c.d (deprecated)
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    return None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def refused_because(address: IPAddress, local: Iterable[IPAddress] = ()) -> str | None:
    """Why ``address`` is never a sandbox's destination without a network entry, or None when it may be."""
    for net, what in _REFUSED:
        if address.version == net.version and address in net:
            return what
    if address in set(local):
        return "an address of this host"
    inner = embedded_ipv4(address)
    if inner is not None:
        why = refused_because(inner, local)
        if why:
            return f"an IPv6 form of {inner}, {why}"
    return None


@dataclass(frozen=True)
class EgressPolicy:
    """The allowlist of one sandbox; immutable, so one policy can serve many connections at once."""

    entries: tuple[Entry, ...]

    @classmethod
    def build(cls, allow: Iterable[str] = (), *, defaults: bool = True) -> EgressPolicy:
        """The policy for CODE_EXEC_EGRESS_ALLOW (``allow``) and CODE_EXEC_EGRESS_DEFAULTS (``defaults``)."""
        texts = [*(DEFAULT_REGISTRIES if defaults else ()), *allow]
        return cls(tuple(parse_entry(text) for text in texts))

    def decide_name(self, host: str, port: int) -> Decision:
        """Step 1: may the sandbox ask for ``host`` on ``port`` at all?"""
        literal = literal_address(host)
        if literal is not None:
            holding = [e for e in self.entries if e.holds(literal)]
            if not holding:
                return Decision(False, "an IP address, not an allowlisted name (allow it with a CIDR entry)")
            return self._port(holding, port, str(literal))
        name = host.lower().removesuffix(".")
        matching = [e for e in self.entries if e.matches_name(name)]
        if not matching:
            return Decision(False, "not in the allowlist")
        return self._port(matching, port, name)

    @staticmethod
    def _port(entries: list[Entry], port: int, what: str) -> Decision:
        for entry in entries:
            if port in entry.ports:
                return Decision(True, f"allowed by {entry.text}")
        ports = sorted({p for e in entries for p in e.ports})
        return Decision(False, f"port {port} is not allowed for {what} (allowed: {', '.join(map(str, ports))})")

    def decide_address(self, address: IPAddress, port: int, local: Iterable[IPAddress] = ()) -> Decision:
        """Step 2: may the proxy connect to ``address`` (which it resolved itself) on ``port``?"""
        holding = [e for e in self.entries if e.holds(address) and port in e.ports]
        if holding:
            return Decision(True, f"allowed by {holding[0].text}")
        why = refused_because(address, local)
        if why:
            return Decision(False, f"resolves to {why} ({address})")
        return Decision(True, "a public address")


@dataclass(frozen=True)
class ProviderAllowlist:
    """A policy as a remote provider's own allowlist takes it: names (``*.domain`` as written) and networks."""

    domains: tuple[str, ...]
    networks: tuple[IPNetwork, ...]

    @property
    def refused_networks(self) -> tuple[IPNetwork, ...]:
        """The ranges execbox refuses (``_REFUSED``) that no network entry overlaps: for a provider that takes a
        deny list too."""
        return tuple(net for net, _ in _REFUSED
                     if not any(net.version == n.version and net.overlaps(n) for n in self.networks))

    def note(self, provider: str) -> str:
        """What a result in network mode proxy on ``provider`` should say about what execbox does not see."""
        return (f"network proxy on {provider}: {provider} enforces the allowlist ({len(self.domains)} names, "
                f"{len(self.networks)} networks) on any port; execbox does not see the connection attempts "
                "(egress stays empty) or the addresses names resolve to there")


def provider_allowlist(policy: EgressPolicy) -> ProviderAllowlist:
    """``policy`` for a provider's allowlist; ValueError for an entry with a port of its own (providers' allowlists
    have no ports, and dropping the port would allow more than the entry says)."""
    domains, networks = [], []
    for entry in policy.entries:
        if entry.ports != DEFAULT_PORTS:
            raise ValueError(f"{entry.text!r} names a port, and the provider's allowlist has no ports: drop the "
                             "port (the provider then allows every port of that destination) or use a local backend")
        if entry.network is not None:
            networks.append(entry.network)
        else:
            domains.append(entry.name if entry.kind == "name" else f"*.{entry.name}")
    return ProviderAllowlist(tuple(dict.fromkeys(domains)), tuple(dict.fromkeys(networks)))


__all__ = ["DEFAULT_PORTS", "DEFAULT_REGISTRIES", "Decision", "EgressPolicy", "Entry", "ProviderAllowlist",
           "embedded_ipv4", "literal_address", "parse_entry", "provider_allowlist", "refused_because"]
