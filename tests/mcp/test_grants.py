"""Grants: a child only narrows its parent, leaves never run code, tokens are signed and expire."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execbox.errors import ConfigError
from execbox.mcp.grants import (
    ALL_TOOLS,
    CODE_TOOLS,
    Grant,
    GrantError,
    GrantRequest,
    Signer,
    load_key,
    narrow,
    root_grant,
)

ROOT = root_grant(ALL_TOOLS, posture=1)


def child(parent: Grant = ROOT, max_depth: int = 2, **ask: object) -> Grant:
    return narrow(parent, GrantRequest(**ask), max_depth=max_depth, default_ttl_s=60)  # type: ignore[arg-type]


def test_a_child_inherits_what_it_does_not_narrow_and_records_the_chain() -> None:
    grant = child(tools=["run_code", "read_file", "delegate"], label="worker", timeout_s=10)
    assert grant.depth == 1 and grant.chain == ("root", grant.id) and grant.label == "worker"
    assert grant.tools == {"run_code", "read_file", "delegate"} and grant.network == ROOT.network
    assert grant.limits.timeout_s == 10 and grant.expires_at is not None
    grandchild = child(grant, tools=["read_file"], posture=1, timeout_s=5)
    assert grandchild.chain == ("root", grant.id, grandchild.id)


@pytest.mark.parametrize(("ask", "named"), [
    ({"tools": ["run_code", "shell"]}, "tools shell"),
    ({"tools": ["run_code"], "network": ["none", "host"]}, "network modes host"),
    ({"tools": ["run_code"], "timeout_s": 20}, "timeout_s 20"),
    ({"tools": ["run_code"], "posture": 1}, "posture 1"),
    ({"tools": ["run_code"], "backends": ["docker"]}, "backends docker"),
])
def test_a_child_never_widens_its_parent(ask: dict[str, object], named: str) -> None:
    parent = child(tools=["run_code", "delegate"], network=["none"], timeout_s=10, posture=0, backends=["bubblewrap"])
    with pytest.raises(GrantError, match="can only narrow its parent.*" + named):
        child(parent, max_depth=3, **ask)


def test_a_leaf_never_runs_code_nor_delegates() -> None:
    worker = child(tools=["run_code", "shell", "read_file", "delegate"])
    with pytest.raises(GrantError, match="leaf.*never includes code execution"):
        child(worker, tools=["run_code"])
    leaf = child(worker, tools=["read_file"])
    assert leaf.leaf(2) and not (leaf.tools & CODE_TOOLS)
    with pytest.raises(GrantError, match="leaf: it cannot delegate"):
        child(leaf, tools=["read_file"])
    with pytest.raises(GrantError, match="leaf"):
        child(ROOT, max_depth=1, tools=["run_code"])


def test_session_tools_need_posture_1_and_unknown_tools_are_named() -> None:
    with pytest.raises(GrantError, match="need posture 1"):
        child(tools=["shell"], posture=0)
    with pytest.raises(GrantError, match="unknown tools rm_rf"):
        child(tools=["rm_rf"])


def test_expiry_never_outlives_the_parent() -> None:
    parent = child(tools=["run_code", "read_file", "delegate"], expires_in_s=30)
    grand = child(parent, tools=["read_file"], posture=1, expires_in_s=3600)
    assert grand.expires_at is not None and parent.expires_at is not None
    assert grand.expires_at <= parent.expires_at
    old = narrow(ROOT, GrantRequest(tools=["run_code", "read_file", "delegate"]), max_depth=2, default_ttl_s=1,
                 now=time.time() - 10)
    assert old.expired()
    with pytest.raises(GrantError, match="expired"):
        old.check_tool("run_code")
    with pytest.raises(GrantError, match="expired"):
        child(old, tools=["read_file"], posture=1)


def test_tokens_are_signed_verified_and_refused_when_altered_expired_or_foreign() -> None:
    signer = Signer(os.urandom(32))
    grant = child(tools=["run_code"], label="sub")
    token = signer.issue(grant)
    assert signer.verify(token) == grant
    prefix, payload, mac = token.split(".")
    for bad in [f"{prefix}.{payload}.{mac[:-2]}AA", f"{prefix}.{payload[:-4]}AAAA.{mac}", "exg1.x.y", "nonsense",
                token + "." + mac, "x" * 10_000]:
        with pytest.raises(GrantError):
            signer.verify(bad)
    with pytest.raises(GrantError, match="not a grant token this server signed"):
        Signer(os.urandom(32)).verify(token)
    with pytest.raises(GrantError, match="expired"):
        signer.verify(token, now=time.time() + 3600)


def test_the_key_file_must_be_private_and_long_enough(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(os.urandom(48))
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="only its owner can read"):
        load_key(key)
    key.chmod(0o600)
    assert len(load_key(key)) >= 32
    key.write_bytes(b"short")
    with pytest.raises(ConfigError, match="at least 32"):
        load_key(key)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_key(tmp_path / "missing")
    assert load_key(None) != load_key(None)


TOOLS = st.lists(st.sampled_from(ALL_TOOLS), min_size=1, max_size=7, unique=True)
MODES = st.none() | st.lists(st.sampled_from(["none", "egress", "proxy", "host"]), max_size=4, unique=True)
LIMIT = st.none() | st.floats(min_value=0.5, max_value=1000)


@settings(max_examples=300, deadline=None)
@given(TOOLS, MODES, LIMIT, st.none() | st.sampled_from([0, 1, 3]), TOOLS, MODES, LIMIT,
       st.none() | st.sampled_from([0, 1, 3]))
def test_whatever_is_asked_a_granted_child_is_within_its_parent(
        tools: list[str], modes: list[str] | None, timeout: float | None, posture: int | None,
        tools2: list[str], modes2: list[str] | None, timeout2: float | None, posture2: int | None) -> None:
    parent = root_grant(ALL_TOOLS, posture=3)
    for ask in ((tools, modes, timeout, posture), (tools2, modes2, timeout2, posture2)):
        try:
            grant = narrow(parent, GrantRequest(tools=ask[0], network=ask[1], timeout_s=ask[2], posture=ask[3]),
                           max_depth=3, default_ttl_s=60)
        except GrantError:
            return
        assert grant.tools <= parent.tools and grant.network <= parent.network
        assert grant.posture <= parent.posture and grant.depth == parent.depth + 1
        if parent.limits.timeout_s is not None:
            assert grant.limits.timeout_s is not None and grant.limits.timeout_s <= parent.limits.timeout_s
        if grant.leaf(3):
            assert not grant.tools & (CODE_TOOLS | {"delegate"})
        parent = grant


def test_the_agent_never_widens_the_operators_network_and_grants_live_at_most_the_ttl() -> None:
    # Found attacking the server: with CODE_EXEC_NETWORK unset, an agent asked for network egress and reached
    # the host's services through the docker gateway. Now the root grant holds none and proxy (default-deny),
    # and a wider mode only when the operator chose it.
    assert root_grant(ALL_TOOLS, posture=1).network == {"none", "proxy"}
    assert root_grant(ALL_TOOLS, posture=1, network="egress").network == {"none", "proxy", "egress"}
    with pytest.raises(GrantError):
        ROOT.check_network("egress")
    with pytest.raises(GrantError):
        ROOT.check_network("host")
    now = time.time()
    long = narrow(ROOT, GrantRequest(tools=["run_code"], expires_in_s=1e9), max_depth=2, default_ttl_s=60, now=now)
    assert long.expires_at is not None and long.expires_at <= now + 60
