"""What the server says about itself and its tools, as an MCP client reads it: its version, an outputSchema on
every tool that every result validates against, enums that offer only what the caller may use, one traceback
for a failed cell, bad arguments named field by field, and a server with code execution off that says so."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from anyio.from_thread import BlockingPortal
from mcp import Client

from execbox.mcp.tools import ERROR_META
from tests.mcp.support import SERVER, env, held_client, text, usable

CALLS: list[tuple[str, dict[str, Any]]] = [
    ("run_code", {"code": "print(6 * 7)"}), ("run_command", {"command": "echo hi"}),
    ("shell", {"command": "echo kept > s.txt"}), ("python", {"code": "x = 2\nx + 1"}),
    ("write_file", {"path": "w.txt", "content": "written"}), ("read_file", {"path": "w.txt"}),
    ("list_files", {"path": "."}), ("snapshot", {"name": "s"}), ("rollback", {"snapshot_id": "(the snapshot's)"}),
    ("delegate", {"tools": ["read_file"], "posture": 1}),
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BlockingPortal, Client]]:
    usable("bubblewrap")
    # Its own state (snapshots, audit log): a module's fixture starts before each test's private one.
    server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="bubblewrap",
                 XDG_STATE_HOME=str(tmp_path_factory.mktemp("state")))
    with held_client(server) as live:
        yield live


def test_the_server_names_its_version(live: tuple[BlockingPortal, Client]) -> None:
    _, client = live
    assert client.server_info.name == "execbox"
    assert client.server_info.version == importlib.metadata.version("execbox")


def test_every_tool_declares_an_output_schema_and_its_results_match_it(live: tuple[BlockingPortal, Client]) -> None:
    portal, client = live
    listed = {t.name: t for t in portal.call(client.list_tools).tools}
    assert set(listed) == {name for name, _ in CALLS}
    taken: dict[str, Any] = {}
    for name, args in CALLS:
        schema = listed[name].output_schema
        assert schema is not None and schema.get("type") == "object", name
        if name == "rollback":
            args = {"snapshot_id": taken["snapshot_id"]}
        # The SDK's client validates structured content against the schema (it raises when it does not match);
        # checked here once more, so that this test does not rest on the client alone.
        result = portal.call(client.call_tool, name, args)
        taken = result.structured_content or {}
        assert not result.is_error, (name, text(result))
        jsonschema.validate(result.structured_content, schema)
        assert set(result.structured_content or {}) >= set(schema.get("required", [])), name


def test_the_root_callers_enums_offer_only_what_it_may_use(live: tuple[BlockingPortal, Client]) -> None:
    portal, client = live
    listed = {t.name: t for t in portal.call(client.list_tools).tools}

    def enum(tool: str, prop: str) -> list[Any]:
        branches = listed[tool].input_schema["properties"][prop]["anyOf"]
        return next(b.get("items", b)["enum"] for b in branches if b.get("type") != "null")

    # The operator set no network: an agent may pick none or proxy (egress and host are the operator's to choose).
    assert enum("run_code", "network") == enum("run_command", "network") == ["none", "proxy"]
    assert enum("delegate", "network") == ["none", "proxy"]
    backends = enum("run_code", "backend")
    assert backends[0] == "bubblewrap" and "local_subprocess" not in backends
    assert enum("delegate", "posture") == [0, 1]
    tools = listed["delegate"].input_schema["properties"]["tools"]["items"]["enum"]
    assert tools == [name for name, _ in CALLS]
    assert "python" in listed["delegate"].description
    result = portal.call(client.call_tool, "run_code", {"code": "print(1)", "network": "host"})
    assert result.is_error and "does not include network mode 'host'" in text(result)


def test_a_failed_cell_shows_its_traceback_once(live: tuple[BlockingPortal, Client]) -> None:
    portal, client = live
    result = portal.call(client.call_tool, "python", {"code": "print('before')\ndef f():\n    1 / 0\nf()"})
    said = text(result)
    assert said.count("Traceback (most recent call last)") == 1, said
    assert "ZeroDivisionError: division by zero" in said and "before" in said
    assert result.structured_content is not None and result.structured_content["error"]["name"] == "ZeroDivisionError"


def test_a_pip_line_in_a_cell_does_not_make_the_host_fetch_packages(live: tuple[BlockingPortal, Client]) -> None:
    """run_cell installs %pip lines from the package cache, fetched on the host; an agent's grant may give its
    sandbox network none, so the server offers no %pip: the cell is refused before anything of it runs."""
    portal, client = live
    result = portal.call(client.call_tool, "python", {"code": "marker = 1\n%pip install six\nprint('after')"})
    said = text(result)
    assert "installing packages is not offered here" in said and "after" not in said, said
    assert result.structured_content is not None and result.structured_content["error"]["name"] == "MagicError"
    kept = portal.call(client.call_tool, "python", {"code": "'marker' in dir()"})
    assert "False" in text(kept)  # nothing of the refused cell ran


def test_bad_arguments_are_named_field_by_field(live: tuple[BlockingPortal, Client]) -> None:
    portal, client = live
    result = portal.call(client.call_tool, "run_code", {"timeout_s": -1, "network": "moon"})
    said = text(result)
    assert result.is_error and said.startswith("ConfigError: invalid arguments for run_code: "), said
    assert "code: Field required" in said and "timeout_s: Input should be greater than 0" in said
    assert "network: Input should be" in said
    assert "pydantic" not in said and "input_value" not in said and "http" not in said
    assert result.structured_content is None  # an error result is validated against no outputSchema
    assert result.meta is not None and result.meta[ERROR_META]["type"] == "ConfigError"


def test_with_code_execution_off_the_server_says_so_and_offers_nothing() -> None:
    messages = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}},
    ]
    # stdin stays open until the last answer: a server whose input ends may drop a request still in flight
    served = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env(CODE_EXEC_ENABLED="false"))
    watchdog = threading.Timer(60, served.kill)
    watchdog.start()
    try:
        assert served.stdin is not None and served.stdout is not None and served.stderr is not None
        served.stdin.write("".join(json.dumps(m) + "\n" for m in messages))
        served.stdin.flush()
        answers: dict[int, Any] = {}
        for line in served.stdout:
            answer = json.loads(line)
            answers[answer["id"]] = answer["result"]
            if len(answers) == 2:
                break
        served.stdin.close()
        stderr = served.stderr.read()
        assert served.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        served.kill()
    assert "code execution is off" in stderr and "CODE_EXEC_ENABLED=true" in stderr
    said = answers[1]["instructions"]
    assert "code execution is off" in said
    assert not any(tool in said for tool in ("run_code", "run_command", "shell", "python", "write_file"))
    assert answers[2]["tools"] == []
