"""The egress policy of network mode proxy (policy/egress.py): entries, names, ports and resolved addresses."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from execbox import Settings
from execbox.errors import ConfigError
from execbox.policy.egress import (
    DEFAULT_REGISTRIES,
    EgressPolicy,
    embedded_ipv4,
    literal_address,
    parse_entry,
    refused_because,
)


def policy(*allow: str, defaults: bool = False) -> EgressPolicy:
    return EgressPolicy.build(allow, defaults=defaults)


# --- entries -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kind", "ports"), [
    ("pypi.org", "name", {80, 443}),
    ("PyPI.org.", "name", {80, 443}),
    ("*.example.com", "suffix", {80, 443}),
    ("example.com:8443", "name", {8443}),
    ("*.example.com:8080", "suffix", {8080}),
    ("10.0.0.0/8", "network", {80, 443}),
    ("10.0.0.5", "network", {80, 443}),
    ("10.0.0.0/8:5432", "network", {5432}),
    ("fd00::/8", "network", {80, 443}),
    ("[fd00::/8]:8080", "network", {8080}),
    ("[::1]", "network", {80, 443}),
])
def test_entries_parse(text: str, kind: str, ports: set[int]) -> None:
    entry = parse_entry(text)
    assert (entry.kind, set(entry.ports)) == (kind, ports)


@pytest.mark.parametrize(("text", "says"), [
    ("*", "every host"),
    ("*:443", "every host"),
    ("a.*.com", "first label"),
    ("10.1.2.3/8", "write the network as 10.0.0.0/8"),
    ("127.1", "looks like an IP address"),
    ("2130706433", "looks like an IP address"),
    ("example.com:0", "port"),
    ("example.com:65536", "port"),
    ("example.com:http", "port"),
    ("exa mple.com", "not a host name"),
    ("-bad.com", "not a host name"),
    ("bücher.de", "xn--"),
    ("[fd00::/8", "IPv6"),
    ("[10.0.0.0/8]", "IPv6"),
    ("fd00::zz", "IPv6"),
])
def test_bad_entries_say_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("*", r"\*").replace(".", r"\.").replace("[", r"\[")):
        parse_entry(text)


def test_settings_refuse_a_bad_entry_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_EGRESS_ALLOW", "ok.example, 192.168.1.1/16")
    with pytest.raises(ConfigError, match="CODE_EXEC_EGRESS_ALLOW.*192.168.0.0/16") as exc:
        Settings.from_env()
    assert exc.value.env_var == "CODE_EXEC_EGRESS_ALLOW"


def test_settings_split_the_list_and_default_to_the_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_EGRESS_ALLOW", " api.example.com , *.corp.example:8443,")
    settings = Settings.from_env()
    assert settings.egress_allow == ["api.example.com", "*.corp.example:8443"]
    assert settings.egress_defaults is True
    monkeypatch.setenv("CODE_EXEC_CA_BUNDLE", "/nonexistent/ca.pem")
    with pytest.raises(ConfigError, match="CODE_EXEC_CA_BUNDLE"):
        Settings.from_env()


# --- names and ports ---------------------------------------------------------------------------------------


def test_defaults_allow_the_registries_on_80_and_443_only() -> None:
    p = EgressPolicy.build()
    for host in ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "github.com", "crates.io",
                 "proxy.golang.org", "rubygems.org", "repo1.maven.org", "deb.debian.org"):
        assert p.decide_name(host, 443).allowed, host
        assert p.decide_name(host, 80).allowed, host
    assert not p.decide_name("pypi.org", 22).allowed
    assert "port 22 is not allowed for pypi.org" in p.decide_name("pypi.org", 22).reason
    assert not EgressPolicy.build(defaults=False).decide_name("pypi.org", 443).allowed


def test_names_are_exact_and_wildcards_only_where_written() -> None:
    p = policy("example.com", "*.corp.example")
    assert p.decide_name("example.com", 443).allowed
    assert p.decide_name("EXAMPLE.com.", 443).allowed
    assert p.decide_name("a.corp.example", 443).allowed
    assert p.decide_name("a.b.corp.example", 443).allowed
    for host in ("www.example.com", "example.com.evil.test", "notexample.com", "corp.example", "xcorp.example",
                 "evil.test"):
        decision = p.decide_name(host, 443)
        assert not decision.allowed and decision.reason == "not in the allowlist", host


def test_a_port_entry_replaces_the_default_ports() -> None:
    p = policy("db.example:5432")
    assert p.decide_name("db.example", 5432).allowed
    assert not p.decide_name("db.example", 443).allowed


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1", "0x7f.0.0.1", "2130706433", "017700000001", "::1", "[::1]",
                                  "::ffff:127.0.0.1", "203.0.113.80", "fe80::1%eth0"])
def test_ip_literals_are_denied_unless_a_network_entry_holds_them(host: str) -> None:
    decision = EgressPolicy.build().decide_name(host, 443)
    assert not decision.allowed and "IP address" in decision.reason


def test_an_ip_literal_in_a_network_entry_is_allowed_on_its_ports() -> None:
    p = policy("10.0.0.0/8:8080", "[fd00::/8]")
    assert p.decide_name("10.1.2.3", 8080).allowed
    assert not p.decide_name("10.1.2.3", 443).allowed
    assert p.decide_name("fd00::5", 443).allowed
    assert not p.decide_name("fe80::5", 443).allowed


def test_literal_forms_a_resolver_would_take() -> None:
    assert literal_address("127.1") == ipaddress.ip_address("127.0.0.1")
    assert literal_address("0x7f.1") == ipaddress.ip_address("127.0.0.1")
    assert literal_address("2130706433") == ipaddress.ip_address("127.0.0.1")
    assert literal_address("[::1]") == ipaddress.ip_address("::1")
    assert literal_address("pypi.org") is None
    assert literal_address("1.2.3.4.5") is None


# --- resolved addresses ------------------------------------------------------------------------------------

REFUSED = ["127.0.0.1", "127.255.0.9", "10.0.0.1", "172.16.5.5", "172.31.255.255", "192.168.1.1", "169.254.169.254",
           "169.254.170.2", "100.64.0.1", "100.100.100.200", "0.0.0.0", "224.0.0.1", "255.255.255.255",
           "168.63.129.16", "192.0.0.192", "198.18.0.1", "::", "::1", "fd00::1", "fd00:ec2::254", "fe80::1",
           "ff02::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1", "64:ff9b::a00:1",
           "2002:7f00:1::1", "2002:a9fe:a9fe::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2"]
ALLOWED = ["203.0.113.80", "192.0.2.10", "198.51.100.7", "151.101.0.223", "8.8.8.8", "2001:db8::1",
           "2a04:4e42::223", "::ffff:151.101.0.223", "64:ff9b::9765:df"]


@pytest.mark.parametrize("address", REFUSED)
def test_private_loopback_link_local_metadata_and_their_v6_forms_are_refused(address: str) -> None:
    decision = EgressPolicy.build().decide_address(ipaddress.ip_address(address), 443)
    assert not decision.allowed, address
    assert decision.reason.startswith("resolves to ") and str(ipaddress.ip_address(address)) in decision.reason


@pytest.mark.parametrize("address", ALLOWED)
def test_public_and_documentation_addresses_are_not_refused(address: str) -> None:
    # not `is_global`: this machine's registry front is 203.0.113.80 (TEST-NET-3)
    assert EgressPolicy.build().decide_address(ipaddress.ip_address(address), 443).allowed, address


def test_this_hosts_own_addresses_are_refused_even_when_public() -> None:
    own = ipaddress.ip_address("192.0.2.2")
    decision = EgressPolicy.build().decide_address(own, 443, local=[own])
    assert not decision.allowed and "an address of this host" in decision.reason
    mapped = ipaddress.ip_address("::ffff:192.0.2.2")
    assert not EgressPolicy.build().decide_address(mapped, 443, local=[own]).allowed


def test_a_cidr_entry_allows_a_private_address_a_name_resolves_to() -> None:
    p = policy("internal.example", "10.1.0.0/16")
    assert p.decide_address(ipaddress.ip_address("10.1.2.3"), 443).allowed
    assert not p.decide_address(ipaddress.ip_address("10.2.0.1"), 443).allowed
    assert not policy("10.1.0.0/16:8080").decide_address(ipaddress.ip_address("10.1.2.3"), 443).allowed


# --- properties --------------------------------------------------------------------------------------------

_REFUSED_V4 = [ipaddress.ip_network(n) for n in ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8",
                                                 "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16",
                                                 "224.0.0.0/4", "240.0.0.0/4")]
_v4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)


def _in_refused_range(address: ipaddress.IPv4Address) -> bool:
    return any(address in net for net in _REFUSED_V4)


@given(_v4)
def test_every_v4_address_in_a_refused_range_is_refused_in_every_v6_form(address: ipaddress.IPv4Address) -> None:
    p = EgressPolicy.build()
    forms = [address, ipaddress.IPv6Address(f"::ffff:{address}"), ipaddress.IPv6Address(f"64:ff9b::{address}"),
             ipaddress.IPv6Address((0x2002 << 112) | (int(address) << 80) | 1)]
    if int(address) > 1:
        forms.append(ipaddress.IPv6Address(int(address)))  # ::a.b.c.d
    for form in forms:
        if _in_refused_range(address):
            assert not p.decide_address(form, 443).allowed, form
    assert embedded_ipv4(forms[1]) == address


@given(_v4)
def test_refusal_agrees_with_the_ranges(address: ipaddress.IPv4Address) -> None:
    if _in_refused_range(address):
        assert refused_because(address) is not None


@given(st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,20}){1,3}", fullmatch=True),
       st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True))
def test_a_name_matches_its_exact_entry_and_wildcards_only_below(name: str, label: str) -> None:
    if name.endswith("-") or label.endswith("-") or any(part.endswith("-") for part in name.split(".")):
        return
    exact = policy(name)
    assert exact.decide_name(name, 443).allowed
    assert not exact.decide_name(f"{label}.{name}", 443).allowed
    wild = policy(f"*.{name}")
    assert wild.decide_name(f"{label}.{name}", 443).allowed
    assert not wild.decide_name(name, 443).allowed
    assert not wild.decide_name(f"{label}{name}", 443).allowed


@given(st.text(max_size=40))
def test_any_entry_text_parses_or_is_a_value_error(text: str) -> None:
    try:
        parse_entry(text)
    except ValueError:
        pass


@given(st.text(max_size=60), st.integers(0, 70000))
def test_any_requested_host_gets_a_decision(host: str, port: int) -> None:
    decision = EgressPolicy.build().decide_name(host, port)
    assert decision.reason
    if decision.allowed:
        assert host.lower().removesuffix(".") in DEFAULT_REGISTRIES and port in (80, 443)


def test_a_provider_allowlist_takes_names_and_networks_and_refuses_ports() -> None:
    from execbox.policy.egress import provider_allowlist

    allowlist = provider_allowlist(policy("a.example", "*.b.example", "10.1.0.0/16", "[fd00::/8]"))
    assert allowlist.domains == ("a.example", "*.b.example")
    assert [str(n) for n in allowlist.networks] == ["10.1.0.0/16", "fd00::/8"]
    denied = {str(n) for n in allowlist.refused_networks}
    assert "127.0.0.0/8" in denied and "10.0.0.0/8" not in denied and "fc00::/7" not in denied
    assert "does not see the connection attempts" in allowlist.note("modal")
    with pytest.raises(ValueError, match="names a port"):
        provider_allowlist(policy("a.example:8443"))


# --- the guard: an allowlist that reaches this host is a setting that widens the boundary ----------------------


def _guard_verdict(allow: list[str], *, local: bool = False, network: str = "proxy") -> Any:
    from execbox.contract.models import ExecRequest
    from execbox.guard.guard import Guard
    from execbox.registry import get_registry

    settings = Settings(egress_allow=allow, network=network, local=local)
    backend = get_registry().get("bubblewrap").cls(settings)
    return Guard(settings).check_verdict(backend, ExecRequest(argv=["true"], network=network))


@pytest.mark.parametrize("entry", ["127.0.0.1/32:8080", "127.0.0.0/8", "0.0.0.0/0", "[::1]:8080", "[::/0]",
                                   "168.63.129.16/32", "169.254.169.254/32", "169.254.0.0/16:80",
                                   "[fd00:ec2::254/128]", "[::ffff:0:0/96]:8080", "[::ffff:127.0.0.1/128]",
                                   "[::ffff:169.254.169.254/128]"])
def test_an_entry_reaching_this_host_is_refused_unless_local(entry: str) -> None:
    from execbox.errors import NotASandboxError

    with pytest.raises(NotASandboxError, match="lets the proxy connect to this host itself") as caught:
        _guard_verdict(["pypi.org", entry])
    assert repr(entry) in str(caught.value) and "CODE_EXEC_LOCAL" in str(caught.value)
    assert not _guard_verdict([entry], local=True).sandbox  # admitted in local mode, and said so


def test_an_entry_holding_one_of_this_hosts_own_addresses_is_refused() -> None:
    from execbox.errors import NotASandboxError
    from execbox.kit.proxy.server import local_addresses

    own = sorted(str(a) for a in local_addresses() if a.version == 4 and not a.is_loopback)
    if not own:
        pytest.skip("capability: this host has no non-loopback IPv4 address")
    with pytest.raises(NotASandboxError, match=own[0].replace(".", r"\.")):
        _guard_verdict([f"{own[0]}/32:443"])


def test_a_network_elsewhere_and_names_are_admitted() -> None:
    from execbox.kit.proxy.server import local_addresses

    far = "198.51.100.0/24"
    assert not any(a in ipaddress.ip_network(far) for a in local_addresses() if a.version == 4)
    assert _guard_verdict(["pypi.org", "localhost", far, "*.example.com"]).sandbox
    assert _guard_verdict(["127.0.0.1/32"], network="none").sandbox  # the allowlist is the proxy's only
