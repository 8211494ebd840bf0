"""Checks of the network modes: with ``none`` no connection leaves the sandbox; with ``proxy`` only
allowlisted destinations are reached, through the proxy, each attempt is recorded, and no direct route exists."""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

from execbox import ExecResult, Runner
from execbox.plugin import NetworkMode
from execbox.testing.framework import Family, Kit, NotClaimed, expect, reported, shown
from execbox.testing.host import Listener, TokenServer
from execbox.testing.probes import PROBE_CONNECT, PROBE_PROXY_FETCH

family = Family()


def expect_no_route(kit: Kit, network: NetworkMode, claim: str) -> None:
    """A direct connection from the sandbox to a listener on the host's loopback never arrives, and the
    sandbox has no interface but lo (where it runs on this host)."""
    listener = Listener()
    try:
        # The control: the listener the probe aims at does accept a connection from the host.
        socket.create_connection(("127.0.0.1", listener.port), timeout=3).close()
        expect(listener.wait_for(1) == 1, claim, "the host's own control connection to be accepted",
               f"{listener.accepted} accepted")
        result = kit.run(["python3", "-c", PROBE_CONNECT, str(listener.port)], network=network)
        expect(result.exit_code == 0 and "BLOCKED" in result.stdout, claim, "the probe to report BLOCKED",
               shown(result))
        expect("CONNECTED" not in result.stdout and listener.wait_for(2, 0.5) == 1, claim,
               "no connection from the sandbox to a listener on the host's loopback",
               f"{listener.accepted - 1} connection(s) from the sandbox")
        if not kit.caps.remote:
            ifaces = result.stdout.split("IFACES", 1)[1].split()
            expect(ifaces in ([], ["lo"]), claim, "no interface but lo", ifaces)
    finally:
        listener.close()


@family.check("network mode none: no connection leaves the sandbox")
def check_network_none_enforced(kit: Kit) -> None:
    kit.require(network="none")
    expect_no_route(kit, "none", "network mode 'none'")


# --- network mode proxy --------------------------------------------------------------------------------------


def _proxy_runner(kit: Kit, allow: list[str]) -> Runner:
    """The kit's runner with network mode proxy and an allowlist of exactly ``allow``. The kit's destinations
    listen on this host's loopback, which the guard admits only in local mode: so the runner is local."""
    settings = kit.runner.settings.model_copy(update={"egress_allow": allow, "egress_defaults": False,
                                                      "network": "proxy", "local": True})
    return Runner(settings, options=kit.runner.aio.options)


def _local_proxy(kit: Kit) -> None:
    kit.require(network="proxy")
    if kit.caps.remote:
        raise NotClaimed("the code runs on another machine: its provider enforces the allowlist, and a destination "
                         "on this host is out of its reach either way")


@contextlib.contextmanager
def _proxied_fetch(kit: Kit, claim: str, host: str, path: str) -> Iterator[tuple[TokenServer, ExecResult, Any]]:
    """A token server on this host's loopback (its address allowlisted), and the fetch probe's run against
    ``host``:port/``path`` in network mode proxy: (server, result, what the probe reported)."""
    _local_proxy(kit)
    server = TokenServer()
    try:
        expect(server.fetch("control") == "TOKEN control", claim, "the host's own control fetch to work",
               server.connections)
        with _proxy_runner(kit, [f"127.0.0.1/32:{server.port}"]) as runner:
            result = runner.run(["python3", "-c", PROBE_PROXY_FETCH, f"http://{host}:{server.port}/{path}"],
                                backend=kit.backend, network="proxy")
        yield server, result, reported(result, claim, "fetch probe")
    finally:
        server.close()


@family.check("network mode proxy: an allowlisted destination is reached through the proxy variables, and recorded")
def check_proxy_allowed_destination_is_reached(kit: Kit) -> None:
    claim = "network mode 'proxy' (allowed destination)"
    token = uuid.uuid4().hex
    with _proxied_fetch(kit, claim, "127.0.0.1", token) as (server, result, seen):
        expect(seen["proxy"].startswith("http://"), claim, "HTTP_PROXY set in the sandbox", seen)
        expect(seen["http"] == f"FETCHED TOKEN {token}", claim, "a plain-HTTP fetch through the proxy", seen)
        expect(seen["connect"].startswith("HTTP/1.1 200") and seen["connect"].endswith(f"TOKEN {token}"), claim,
               "a CONNECT tunnel through the proxy", seen)
        allowed = [a for a in result.egress if a.allowed and a.port == server.port and a.bytes_received > 0]
        expect(len(allowed) == 2 and all(a.address == "127.0.0.1" for a in allowed), claim,
               "both connections in the result's egress record, allowed, with bytes", result.egress)
        expect(server.connections == 3, claim, "exactly the two proxied connections at the server",
               f"{server.connections - 1} connection(s)")


@family.check("network mode proxy: a name outside the allowlist is refused and recorded, and nothing is connected")
def check_proxy_denied_name_is_recorded(kit: Kit) -> None:
    claim = "network mode 'proxy' (denied name)"
    # The address is allowlisted, the name is not: a proxy that resolved "localhost" would reach the server.
    with _proxied_fetch(kit, claim, "localhost", "denied") as (server, result, seen):
        expect(seen["http"].startswith("REFUSED") and "TOKEN" not in seen["connect"], claim,
               "both fetches refused", seen)
        denied = [a for a in result.egress if a.host == "localhost"]
        expect(len(denied) == 2 and not any(a.allowed or a.bytes_received for a in denied)
               and all("not in the allowlist" in a.reason for a in denied), claim,
               "two refusals of localhost in the egress record, 'not in the allowlist'", result.egress)
        time.sleep(0.2)
        expect(server.connections == 1, claim, "no connection at the server", f"{server.connections - 1}")


@family.check("network mode proxy: a direct connection, ignoring the proxy, has no route")
def check_proxy_direct_socket_has_no_route(kit: Kit) -> None:
    kit.require(network="proxy")
    expect_no_route(kit, "proxy", "network mode 'proxy' (direct socket)")
