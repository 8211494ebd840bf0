"""Network mode proxy on the remote backends (against their fakes): the allowlist goes to each provider's own
allowlist parameters, exactly; what a provider's allowlist cannot say (a port) is refused; an empty allowlist is
the provider's deny-all; every result says what execbox does not see; every call binds against the real SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from execbox import Runner, Settings, UnsupportedPolicyError
from execbox.policy.egress import DEFAULT_REGISTRIES
from tests.backends.remote_fixtures import check_calls_against_real_sdk, fake_service

SDK = {"modal": "modal", "daytona": "daytona", "vercel_sandbox": "vercel"}
EXTRA = ["api.example.com", "*.corp.example", "203.0.113.0/24"]


@pytest.fixture(params=sorted(SDK))
def remote(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    backend = request.param
    for service in fake_service(SDK[backend], monkeypatch):
        yield backend, service


def run(backend: str, **settings: Any) -> Any:
    runner = Runner(Settings.from_env(backend=backend, network="proxy", **settings))
    try:
        return runner.run(["echo", "ran"], timeout=30)
    finally:
        runner.close()


def sent(backend: str, service: Any) -> dict[str, Any]:
    """The network parameters of the last sandbox the backend created."""
    if backend == "modal":
        kwargs = service.calls_to("Sandbox.create")[-1].kwargs
        return {k: kwargs.get(k) for k in ("block_network", "outbound_domain_allowlist", "outbound_cidr_allowlist")}
    if backend == "daytona":
        params = service.calls_to("Daytona.create")[-1].args[0]
        return {k: getattr(params, k) for k in ("network_block_all", "domain_allow_list", "network_allow_list")}
    policy = service.calls_to("create_sandbox")[-1].kwargs["network_policy"]
    subnets = policy.subnets
    return {"mode": policy.mode, "allow": sorted(policy.allow), "subnets_allow": subnets and list(subnets.allow),
            "subnets_deny": subnets and list(subnets.deny)}


def test_the_allowlist_becomes_the_providers_allowlist(remote: tuple[str, Any]) -> None:
    backend, service = remote
    result = run(backend, egress_allow=EXTRA)
    assert result.exit_code == 0 and result.stdout == "ran\n"
    assert result.egress == []
    provider = {"vercel_sandbox": "vercel"}.get(backend, backend)
    assert any(note.startswith(f"network proxy on {provider}: {provider} enforces the allowlist") and
               "does not see the connection attempts" in note for note in result.notes), result.notes
    names = [*DEFAULT_REGISTRIES, "api.example.com", "*.corp.example"]
    got = sent(backend, service)
    if backend == "modal":
        assert got == {"block_network": False, "outbound_domain_allowlist": names,
                       "outbound_cidr_allowlist": ["203.0.113.0/24"]}
    elif backend == "daytona":
        assert got == {"network_block_all": False, "domain_allow_list": ",".join(names),
                       "network_allow_list": "203.0.113.0/24"}
    else:
        assert got["mode"] == "custom" and got["allow"] == sorted(names)
        assert got["subnets_allow"] == ["203.0.113.0/24"]
        # the ranges execbox refuses itself are denied to the provider too
        assert {"10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "fc00::/7"} <= set(got["subnets_deny"])
    check_calls_against_real_sdk(SDK[backend], service)


def test_an_empty_allowlist_is_the_providers_deny_all(remote: tuple[str, Any]) -> None:
    backend, service = remote
    assert run(backend, egress_defaults=False).exit_code == 0
    got = sent(backend, service)
    if backend == "modal":  # either list given, even empty, makes Modal's network an allowlist of nothing
        assert got == {"block_network": False, "outbound_domain_allowlist": [], "outbound_cidr_allowlist": []}
    elif backend == "daytona":  # empty lists would not be an allowlist there
        assert got["network_block_all"] is True
    else:
        assert got["mode"] == "deny-all"


def test_an_entry_with_a_port_is_refused_not_widened(remote: tuple[str, Any]) -> None:
    backend, service = remote
    with pytest.raises(UnsupportedPolicyError, match="names a port, and the provider's allowlist has no ports") as exc:
        run(backend, egress_allow=["db.example:5432"])
    assert exc.value.env_var == "CODE_EXEC_EGRESS_ALLOW"


def test_daytona_refuses_an_ipv6_network(monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in fake_service("daytona", monkeypatch):
        with pytest.raises(UnsupportedPolicyError, match="IPv4 networks only.*fd00::/8"):
            run("daytona", egress_allow=["[fd00::/8]"])


def test_the_fakes_sandbox_has_no_route_with_an_allowlist(remote: tuple[str, Any]) -> None:
    backend, _ = remote
    runner = Runner(Settings.from_env(backend=backend, network="proxy"))
    try:
        probe = "import socket; print(sorted(n for _, n in socket.if_nameindex()))"
        result = runner.run(["python3", "-c", probe], timeout=30)
    finally:
        runner.close()
    assert result.stdout.strip() == "['lo']", result
