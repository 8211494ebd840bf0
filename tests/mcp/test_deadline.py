"""`execbox mcp` over stdio on a backend whose exec never returns: each tool call comes back, as an error naming
the backend and the call, and the server keeps answering (its one-shots and its session's sandbox alike)."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
from mcp import Client

from tests.mcp.support import Asked, env, stdio, text
from tests.support import stuck_backends

ROOT = Path(__file__).resolve().parents[2]
LIVENESS_S = 120


def test_tool_calls_on_a_backend_that_never_returns_come_back_as_errors(tmp_path: Path) -> None:
    installed = stuck_backends.site(tmp_path)
    server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="stuck_exec",
                 CODE_EXEC_BACKEND_GRACE_SEC="1", CODE_EXEC_OPEN_TIMEOUT_SEC="2", CODE_EXEC_MAX_TIMEOUT_SEC="1",
                 CODE_EXEC_POOL_SIZE="0", PYTHONPATH=f"{installed}{os.pathsep}{ROOT}", HOME=str(tmp_path))

    async def main() -> None:
        async with Client(stdio(server), elicitation_callback=Asked()) as client:
            with anyio.fail_after(LIVENESS_S):
                # The second shell call gets a fresh sandbox (stuck again), not the broken one for the session's life.
                for tool, args in (("run_command", {"command": "true"}), ("shell", {"command": "true"}),
                                   ("run_command", {"command": "echo again"}), ("shell", {"command": "true"})):
                    result = await client.call_tool(tool, args)
                    assert result.is_error and result.meta is not None, text(result)
                    error = result.meta["io.execbox/error"]  # an error result's data: outputSchema is the success's
                    assert (error["type"], error["backend"]) == ("BackendTimeoutError", "stuck_exec"), error
                    assert "did not return from exec" in error["message"]

    anyio.run(main)
