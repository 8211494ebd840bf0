"""`execbox mcp --http`: never without a token (401 without or with a wrong one; it refuses to start without
one), posture 3 refused, the tools over streamable HTTP with the SDK's client, a session's sandbox removed when
the session ends, a sub-agent's bearer grant narrower than its parent's, approvals over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import httpx2
import pytest

from tests.mcp.support import SERVER, Asked, env, http_client, http_server, leftovers, text, usable, wait_gone

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}
ROOT = Path(__file__).resolve().parents[2]
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def test_http_refuses_to_start_without_a_token_or_with_posture_3() -> None:
    started = subprocess.run([*SERVER, "--http", "127.0.0.1:1"], env=env(CODE_EXEC_ENABLED="true"),
                             capture_output=True, text=True, timeout=60)
    assert started.returncode != 0 and "EXECBOX_MCP_TOKEN" in started.stderr
    started = subprocess.run([*SERVER, "--http", "127.0.0.1:1"], capture_output=True, text=True, timeout=60,
                             env=env(CODE_EXEC_ENABLED="true", EXECBOX_MCP_TOKEN="short"))
    assert started.returncode != 0 and "at least 16" in started.stderr
    started = subprocess.run([*SERVER, "--http", "127.0.0.1:1"], capture_output=True, text=True, timeout=60,
                             env=env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="3", CODE_EXEC_LOCAL="true",
                                     EXECBOX_MCP_TOKEN="t" * 32))
    assert started.returncode != 0 and "AGENT_COMPUTE_POSTURE=3 is a shell on this host" in started.stderr
    assert "HTTP server would hand that shell" in started.stderr and "serving" not in started.stderr
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port in use: refused before "serving" is said
        started = subprocess.run([*SERVER, "--http", f"127.0.0.1:{taken.getsockname()[1]}"], capture_output=True,
                                 text=True, timeout=60, env=env(CODE_EXEC_ENABLED="true", EXECBOX_MCP_TOKEN="t" * 32))
    assert started.returncode != 0 and "cannot listen on 127.0.0.1" in started.stderr
    assert "serving" not in started.stderr and "Traceback" not in started.stderr
    started = subprocess.run(SERVER, input="", capture_output=True, text=True, timeout=60,
                             env=env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="3"))
    assert started.returncode != 0 and "CODE_EXEC_LOCAL=true" in started.stderr


def test_http_without_the_token_or_with_a_wrong_one_is_401() -> None:
    with http_server(env(CODE_EXEC_ENABLED="true")) as (url, token, _):
        with httpx2.Client(timeout=30) as http:
            for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": token},
                            {"Authorization": f"Basic {token}"}, {"Authorization": "Bearer exg1.forged.grant"}):
                answer = http.post(url, json=INIT, headers={**ACCEPT, **headers})
                assert answer.status_code == 401, headers
                # A bearer challenge with nothing to discover: a client asks its user for the token.
                assert answer.headers["www-authenticate"].startswith("Bearer")
                assert "resource_metadata" not in answer.headers["www-authenticate"]
            # Not an OAuth resource: the metadata a spec-following client looks for is not there, token or not.
            base = url.removesuffix("/mcp")
            for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp",
                         "/.well-known/oauth-authorization-server", "/.well-known/openid-configuration"):
                for headers in ({}, {"Authorization": f"Bearer {token}"}):
                    assert http.get(base + path, headers=headers).status_code == 404, path
            answer = http.post(url, json=INIT, headers={**ACCEPT, "Authorization": f"Bearer {token}"})
            assert answer.status_code == 200
            session = answer.headers["mcp-session-id"]
            # A lone surrogate, escaped in the JSON (the SDK's client cannot even send it): the SDK's parser refuses
            # it before any tool sees it, and the server goes on serving.
            call = ('{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "run_command", '
                    '"arguments": {"command": "echo \\ud800"}}}')
            headers = {**ACCEPT, "Authorization": f"Bearer {token}", "Mcp-Session-Id": session,
                       "MCP-Protocol-Version": "2025-11-25"}
            http.post(url, content=json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
                      headers=headers)
            answer = http.post(url, content=call, headers=headers)
            assert answer.status_code == 400 and "Parse error" in answer.json()["error"]["message"]
            answer = http.post(url, content=call.replace("\\ud800", "ok"), headers=headers)
            assert answer.status_code == 200 and '"isError":false' in answer.text.replace(" ", "")


def test_tools_sessions_grants_and_approvals_over_http() -> None:
    usable("bubblewrap")
    # No warm pool: its members belong to the server, not to a session, and this test counts what a session left.
    server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="bubblewrap",
                 CODE_EXEC_POOL_SIZE="0")
    asked = Asked()

    async def main(url: str, token: str, pid: int) -> None:
        async with http_client(url, token, mode="legacy", elicitation_callback=asked) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            assert names == ["run_code", "run_command", "shell", "python", "write_file", "read_file", "list_files",
                             "snapshot", "rollback", "delegate"]
            result = await client.call_tool("run_code", {"code": "print('over http')"})
            assert result.structured_content is not None and result.structured_content["stdout"] == "over http\n"
            await client.call_tool("shell", {"command": "echo kept > s.txt"})
            result = await client.call_tool("shell", {"command": "cat s.txt"})
            assert result.structured_content is not None and result.structured_content["stdout"] == "kept\n"
            assert leftovers(pid), "the session's sandbox exists while the session lives"
            result = await client.call_tool("run_command", {"command": "npm publish"})
            assert asked.messages and "publishes a package" in asked.messages[0] and not result.is_error

            result = await client.call_tool("delegate", {"tools": ["run_code", "read_file"], "posture": 1,
                                                         "network": ["none"], "label": "sub"})
            assert result.structured_content is not None
            child = result.structured_content["token"]
            async with http_client(url, child, mode="legacy") as sub:
                assert [t.name for t in (await sub.list_tools()).tools] == ["run_code", "read_file"]
                for tool, args, why in [
                        ("shell", {"command": "id"}, "does not include the tool 'shell'"),
                        ("run_command", {"command": "id"}, "does not include the tool 'run_command'"),
                        ("run_code", {"code": "print(1)", "network": "host"}, "does not include network mode"),
                        ("delegate", {"tools": ["run_code"]}, "does not include the tool 'delegate'")]:
                    result = await sub.call_tool(tool, args)
                    assert result.is_error and why in text(result), (tool, text(result))
                result = await sub.call_tool("run_code", {"code": "print('sub')"})
                assert result.structured_content is not None and result.structured_content["stdout"] == "sub\n"
                # its own session, its own sandbox: the parent's file is not there
                result = await sub.call_tool("read_file", {"path": "s.txt"})
                assert result.is_error

        # the client closed its session (DELETE): its sandboxes are removed
        assert wait_gone(pid) == []

        async with http_client(url, token) as modern:  # 2026-07-28 over HTTP: no session, so no shell
            assert modern.protocol_version == "2026-07-28"
            result = await modern.call_tool("shell", {"command": "true"})
            assert result.is_error and "needs an MCP session" in text(result)
            assert not (await modern.call_tool("run_command", {"command": "true"})).is_error

    with http_server(server) as (url, token, proc):
        anyio.run(main, url, token, proc.pid)


@pytest.mark.parametrize("host", ["[::1]", "localhost"])
def test_http_host_forms_are_parsed(host: str) -> None:
    started = subprocess.run([*SERVER, "--http", f"{host}:notaport"], capture_output=True, text=True, timeout=60,
                             env=env(CODE_EXEC_ENABLED="true", EXECBOX_MCP_TOKEN="t" * 32))
    assert started.returncode == 2 and "HOST:PORT" in started.stderr


KILLED_HTTP_CLIENT = """
import anyio, sys
from tests.mcp.support import http_client

async def main(url, token):
    async with http_client(url, token, mode="legacy") as client:
        result = await client.call_tool("shell", {"command": "echo state > kept.txt"})
        assert not result.is_error, result
        print("ready", flush=True)
        await anyio.sleep(600)

anyio.run(main, sys.argv[1], sys.argv[2])
"""


def test_a_killed_http_clients_session_and_sandbox_end_when_idle() -> None:
    usable("bubblewrap")
    server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="bubblewrap",
                 EXECBOX_MCP_IDLE_SEC="2")
    with http_server(server) as (url, token, proc):
        client = subprocess.Popen([sys.executable, "-c", KILLED_HTTP_CLIENT, url, token], stdout=subprocess.PIPE,
                                  text=True, cwd=ROOT)
        try:
            assert client.stdout is not None and client.stdout.readline() == "ready\n"
            assert leftovers(proc.pid)
            client.kill()
            client.wait()
            assert wait_gone(proc.pid) == []  # no DELETE came: the idle timeout ended the session
            assert proc.poll() is None
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
