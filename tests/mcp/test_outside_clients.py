"""`execbox mcp` driven by clients that are not ours: the official MCP Inspector's CLI over stdio and over HTTP
with a bearer token (the README's own command lines, then every tool once, code in a real docker sandbox), and
the official MCP conformance suite's server scenarios that apply to a real server.

Node 22, the Inspector and the conformance suite come from scripts/node_tools.sh (run by scripts/setup.sh) in
.cache/node; without them these tests skip (fail under EXECBOX_REQUIRE_ENGINES), as without an engine.

Conformance scenarios (@modelcontextprotocol/conformance 0.1.16, `conformance list --server`): run are
server-initialize (lifecycle), ping, tools-list, server-sse-multiple-streams (concurrent POST streams in one
session) and dns-rebinding-protection (Host/Origin checked). Not run, because they call the suite's own test
fixtures (tools named test_*, resources, prompts) that a real server does not have, or a capability execbox
does not declare: tools-call-* (the suite's test tools; tools-call-error "passes" only because the tool is
unknown), server-sse-polling (its test_reconnection tool), logging-set-level (no logging capability),
completion-complete, resources-*, prompts-*, json-schema-2020-12 and the elicitation-sep* scenarios (their
test tools). The suite sends no credentials: tests/mcp/node/bearer.cjs, preloaded into its node, adds the
server token to every request it makes and changes nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from execbox.testing import engine_missing
from tests.mcp.support import env, http_server, usable

ROOT = Path(__file__).resolve().parents[2]
MODULES = ROOT / ".cache" / "node" / "node_modules"
NODE = MODULES / "node" / "bin" / "node"
INSPECTOR = MODULES / "@modelcontextprotocol" / "inspector" / "clients" / "launcher" / "build" / "index.js"
CONFORMANCE = MODULES / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"
BEARER = Path(__file__).resolve().parent / "node" / "bearer.cjs"
SCENARIOS = ["server-initialize", "ping", "tools-list", "server-sse-multiple-streams", "dns-rebinding-protection"]
SERVER_ENV = {"CODE_EXEC_ENABLED": "true", "AGENT_COMPUTE_POSTURE": "1", "CODE_EXEC_BACKEND": "docker"}
# Each tool once, as --tool-arg pairs (the Inspector parses a value as JSON when it is JSON), and what its result
# must hold. Every Inspector call is a new MCP session, so read_file finds the fresh workspace empty: its real
# result is the sandbox's own "no such file" error; and rollback's, that the session took no such snapshot.
CALLS: list[tuple[str, list[str], str]] = [
    ("run_code", ["code=print(6 * 7)"], '"stdout": "42\\n"'),
    ("run_command", ["command=echo $((6 * 7))"], '"stdout": "42\\n"'),
    ("shell", ["command=echo kept > k.txt && cat k.txt"], '"stdout": "kept\\n"'),
    ("python", ["code=sum(range(10))"], '"text": "45"'),
    ("write_file", ["path=w.txt", "content=written"], '"size": 7'),
    ("read_file", ["path=w.txt"], "no such file in the workspace: 'w.txt'"),
    ("list_files", ["path=.", "recursive=true"], '"entries": ['),
    ("snapshot", ["name=first"], '"snapshot_id": "'),
    ("rollback", ["snapshot_id=0123456789abcdef"], "is not a snapshot this session took"),
    ("delegate", ['tools=["read_file"]', "posture=1"], '"token": "exg1.'),
]


@pytest.fixture(scope="module")
def node() -> Path:
    for path in (NODE, INSPECTOR, CONFORMANCE):
        if not path.exists():
            engine_missing(f"{path.relative_to(ROOT)} is missing: run scripts/setup.sh (scripts/node_tools.sh needs "
                           "npm and the npm registry)")
    usable("docker")
    return NODE


@pytest.fixture(scope="module")
def served(node: Path) -> Iterator[tuple[str, str]]:
    """One `execbox mcp --http` for the module: (url, token)."""
    with http_server(env(**SERVER_ENV)) as (url, token, _):
        yield url, token


def readme_lines() -> list[list[str]]:
    """The Inspector command lines of the README's MCP section, as argv (the shell's word splitting)."""
    text = (ROOT / "README.md").read_text()
    return [shlex.split(line) for line in re.findall(r"^npx @modelcontextprotocol/inspector .*$", text, re.M)]


def inspector(argv: list[str], *, url: str = "", token: str = "") -> subprocess.CompletedProcess[str]:
    """Run an Inspector command line as the README writes it, with this checkout's node, Inspector and execbox."""
    args = [a.replace("$EXECBOX_MCP_TOKEN", token) for a in argv[2:]]  # after `npx @modelcontextprotocol/...`
    # A loaded CI machine may take longer than the Inspector's 15 s to start a stdio server.
    args = [args[0], "--connect-timeout", "120000", *args[1:]]
    if url:
        args = [a.replace("http://127.0.0.1:8765/mcp", url) for a in args]
    if "--" in args:  # stdio: the server the Inspector starts is this checkout's, with its PYTHONPATH
        cut = args.index("--")
        assert args[cut + 1:] == ["execbox", "mcp"], args
        extra = ["-e", f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []
        args = [args[0], *extra, *args[1:cut], "--", sys.executable, "-m", "execbox.cli", "mcp"]
    return subprocess.run([str(NODE), str(INSPECTOR), *args], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env={**env(), "HOME": os.environ.get("HOME", "/root")})


def listed(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 0, done.stderr + done.stdout
    return [tool["name"] for tool in json.loads(done.stdout)["tools"]]


def called(done: subprocess.CompletedProcess[str], tool: str, expected: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(done.stdout) if done.stdout.startswith("{\n") else {}
    assert result, (tool, done.returncode, done.stdout, done.stderr)
    assert expected in json.dumps(result, indent=1) or expected in done.stdout, (tool, done.stdout)
    return result


def each_tool(url: str = "", token: str = "") -> list[tuple[str, str, subprocess.CompletedProcess[str]]]:
    """Every tool called once through the Inspector CLI (stdio when there is no url), in parallel."""
    target = [url, "--header", f"Authorization: Bearer {token}"] if url else []
    env_args = [] if url else [x for k, v in SERVER_ENV.items() for x in ("-e", f"{k}={v}")]
    server = [] if url else ["--", "execbox", "mcp"]

    def one(call: tuple[str, list[str], str]) -> tuple[str, str, subprocess.CompletedProcess[str]]:
        name, pairs, expected = call
        argv = ["npx", "@modelcontextprotocol/inspector", "--cli", *target, *env_args, "--method", "tools/call",
                "--tool-name", name, *(x for pair in pairs for x in ("--tool-arg", pair)), *server]
        return name, expected, inspector(argv, url=url, token=token)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return list(pool.map(one, CALLS))


def test_the_readme_inspector_lines_run_over_stdio_and_http(served: tuple[str, str]) -> None:
    url, token = served
    lines = readme_lines()
    assert len(lines) == 4, lines
    with ThreadPoolExecutor(max_workers=4) as pool:
        stdio_list, stdio_call, http_list, http_call = pool.map(lambda a: inspector(a, url=url, token=token), lines)
    assert listed(stdio_list) == ["run_code", "run_command", "delegate"]  # posture 0, the default
    assert listed(http_list) == [name for name, _, _ in CALLS]  # the served posture 1
    result = called(stdio_call, "run_code", '"stdout": "42\\n"')
    assert result["structuredContent"]["backend"] == "docker" and result["isError"] is False
    result = called(http_call, "run_command", "hello from Linux")
    assert result["structuredContent"]["exit_code"] == 0


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_the_inspector_calls_every_tool(served: tuple[str, str], transport: str) -> None:
    url, token = served if transport == "http" else ("", "")
    for name, expected, done in each_tool(url, token):
        result = called(done, name, expected)
        # The Inspector validates structured content against the tool's outputSchema and says so on failure.
        assert "output schema" not in done.stderr.lower() and "must have required property" not in done.stderr
        if name in ("read_file", "rollback"):  # each call a new session: nothing to read, no snapshot of its own
            assert result["isError"] is True and done.returncode != 0 and "structuredContent" not in result
        else:
            assert result["isError"] is False and done.returncode == 0, (name, done.stdout, done.stderr)
            assert "structuredContent" in result


def test_without_the_token_the_inspector_is_refused(served: tuple[str, str]) -> None:
    url, _ = served
    done = inspector(["npx", "@modelcontextprotocol/inspector", "--cli", url, "--stored-auth-only",
                      "--method", "tools/list"])
    assert done.returncode != 0 and "send Authorization: Bearer <token>" in done.stdout + done.stderr


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_conformance_scenarios_pass_over_http(served: tuple[str, str], scenario: str) -> None:
    url, token = served
    done = subprocess.run([str(NODE), "--require", str(BEARER), str(CONFORMANCE), "server", "--url", url,
                           "--scenario", scenario], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**env(), "EXECBOX_MCP_TOKEN": token, "EXECBOX_NODE_MODULES": str(MODULES)})
    assert done.returncode == 0 and " 0 failed" in done.stdout, done.stdout + done.stderr
