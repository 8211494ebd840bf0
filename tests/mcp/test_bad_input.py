"""Whatever a model sends to any tool — wrong types, missing or extra fields, paths out of the workspace, NULs,
invalid base64, unknown tools — the answer is an error result (or the protocol's own error for an unknown tool),
never a crash: the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from anyio.from_thread import BlockingPortal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client
from mcp.shared.exceptions import MCPError

from tests.mcp.support import env, held_client, text, usable

TOOLS = ["run_code", "run_command", "shell", "python", "write_file", "read_file", "list_files", "snapshot", "rollback",
         "delegate", "no_such_tool"]
KEYS = ["code", "command", "path", "content", "encoding", "language", "timeout_s", "network", "backend", "recursive",
        "tools", "posture", "expires_in_s", "memory_mb", "label", "name", "snapshot_id"]
ODD = st.sampled_from(["", "..", "../x", "/etc/passwd", "a/../../b", "\0", "x\0y", "/", "~", "a" * 5000,
                       "-1", "nan", "base64", "text", "python", "bash", "none", "host", "exg1.a.b", "!!notbase64!!"])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
                    | ODD, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=3), max_leaves=6)
ARGS = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), JSON, max_size=5)


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[BlockingPortal, Client]]:
    usable("bubblewrap")
    server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="bubblewrap",
                 CODE_EXEC_MAX_TIMEOUT_SEC="3")
    with held_client(server) as live:
        yield live


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(TOOLS), ARGS)
def test_bad_input_is_an_error_result_never_a_crash(live: tuple[BlockingPortal, Client], tool: str,
                                                    args: dict[str, Any]) -> None:
    portal, client = live
    try:
        result = portal.call(client.call_tool, tool, args)
    except MCPError as exc:
        assert tool == "no_such_tool" and "no_such_tool" in str(exc)
        return
    said = text(result)
    assert said
    if result.is_error:
        # An unexpected exception would be "Error executing tool X" with nothing after it (the SDK hides it).
        assert not said.rstrip().endswith(f"Error executing tool {tool}"), said
    else:
        assert isinstance(result.structured_content, dict)


def test_the_server_still_serves_afterwards(live: tuple[BlockingPortal, Client]) -> None:
    portal, client = live
    result = portal.call(client.call_tool, "run_code", {"code": "print('still here')"})
    assert result.structured_content is not None and result.structured_content["stdout"] == "still here\n"
