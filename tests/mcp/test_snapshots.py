"""The snapshot and rollback tools (posture 1): an agent's undo history of its own session sandbox. A rollback takes
only a snapshot its session took; the session's snapshots go when its sandbox does; a backend that keeps no
snapshots answers with its refusal as a tool error."""

from __future__ import annotations

import anyio
import pytest
from mcp import Client

from execbox import Runner, Settings
from execbox.mcp.server import McpApp
from execbox.mcp.settings import McpSettings
from execbox.runner import snapshots as store
from tests.mcp.support import env, stdio, text, usable
from tests.support.fixtures import (  # noqa: F401 (fixtures)
    FakeDistributions,
    fake_backends,
    fake_dists,
    fresh_registry,
    only_local_builtin,
)

pytestmark = pytest.mark.engine


def test_an_agent_rolls_back_to_its_snapshot_and_only_to_its_own() -> None:
    usable("bubblewrap")
    with Runner(Settings.from_env(backend="bubblewrap")) as runner, runner.sandbox("bubblewrap") as other:
        foreign = other.snapshot("not the agent's")  # real, in the same store: still not this session's
    server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="bubblewrap")
    taken: list[str] = []

    async def main() -> None:
        with anyio.fail_after(240):
            await session()

    async def session() -> None:
        async with Client(stdio(server)) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            assert names[-3:] == ["snapshot", "rollback", "delegate"]
            await client.call_tool("write_file", {"path": "notes.txt", "content": "first"})
            await client.call_tool("python", {"code": "kept = 41"})
            made = await client.call_tool("snapshot", {"name": "before the edit"})
            assert not made.is_error, text(made)
            data = made.structured_content or {}
            assert data["name"] == "before the edit" and data["size"] > 0 and data["snapshot_id"] in text(made)
            taken.append(data["snapshot_id"])
            assert [s.id for s in store.listing()] == [foreign.id, data["snapshot_id"]]

            await client.call_tool("write_file", {"path": "notes.txt", "content": "second"})
            await client.call_tool("shell", {"command": "mkdir later && echo x > later/y"})
            back = await client.call_tool("rollback", {"snapshot_id": data["snapshot_id"]})
            assert not back.is_error, text(back)
            assert back.structured_content == {"snapshot_id": data["snapshot_id"], "state_lost": True}
            read = await client.call_tool("read_file", {"path": "notes.txt"})
            assert (read.structured_content or {})["content"] == "first"
            listed = await client.call_tool("list_files", {"path": "."})
            paths = [e["path"] for e in (listed.structured_content or {})["entries"]]
            assert "notes.txt" in paths and "later" not in paths, paths
            cell = await client.call_tool("python", {"code": "'kept' in dir()"})
            assert (cell.structured_content or {})["state_lost"] is True  # files only: the interpreter is new
            again = await client.call_tool("rollback", {"snapshot_id": data["snapshot_id"]})  # it stays
            assert not again.is_error, text(again)

            for stranger in (foreign.id, "../x", "0123456789abcdef", "--help"):
                refused = await client.call_tool("rollback", {"snapshot_id": stranger})
                assert refused.is_error and "is not a snapshot this session took" in text(refused), text(refused)
                assert data["snapshot_id"] in text(refused)  # it names what it may roll back to
            empty = await client.call_tool("rollback", {"snapshot_id": ""})
            assert empty.is_error and "snapshot_id" in text(empty)
            read = await client.call_tool("read_file", {"path": "notes.txt"})
            assert (read.structured_content or {})["content"] == "first"  # no refused rollback touched it

    anyio.run(main)
    # The session ended: its snapshot went with its sandbox; the one it did not take is still there.
    assert [s.id for s in store.listing()] == [foreign.id] and store.leftovers() == []
    assert store.backend_of(taken[0]) is None


def test_a_backend_that_keeps_no_snapshots_answers_with_its_refusal(fake_backends: FakeDistributions) -> None:  # noqa: F811
    settings = Settings.from_env(enabled=True, posture=1, backend="fake_sandbox")
    app = McpApp(settings, McpSettings.from_env(), "stdio")

    async def main() -> None:
        async with app.running(), Client(app.server) as client:
            refused = await client.call_tool("snapshot", {"name": "x"})
            assert refused.is_error and "does not claim the capability 'snapshot'" in text(refused), text(refused)
            unknown = await client.call_tool("rollback", {"snapshot_id": "0123456789abcdef"})
            assert unknown.is_error and "this session has taken none" in text(unknown)
            still = await client.call_tool("shell", {"command": "echo still here"})
            assert (still.structured_content or {})["stdout"] == "still here\n"

    anyio.run(main)
    assert store.listing() == [] and store.leftovers() == []


def test_a_sessions_undo_history_keeps_its_latest_snapshots_only() -> None:
    usable("bubblewrap")
    server = env(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND="bubblewrap",
                 EXECBOX_MCP_MAX_SNAPSHOTS="2")

    async def session() -> None:
        async with Client(stdio(server)) as client:
            taken = []
            for n in range(4):
                await client.call_tool("write_file", {"path": "n.txt", "content": str(n)})
                made = await client.call_tool("snapshot", {"name": f"step {n}"})
                assert not made.is_error, text(made)
                data = made.structured_content or {}
                taken.append(data["snapshot_id"])
                assert data["dropped"] == taken[-3:-2], data  # past two, each new one removes the oldest
                assert ("removed" in text(made)) == (n >= 2)
            assert sorted(s.id for s in store.listing()) == sorted(taken[-2:])  # gone from the store too
            refused = await client.call_tool("rollback", {"snapshot_id": taken[0]})
            assert refused.is_error and "is not a snapshot this session took" in text(refused)
            back = await client.call_tool("rollback", {"snapshot_id": taken[2]})
            assert not back.is_error, text(back)
            read = await client.call_tool("read_file", {"path": "n.txt"})
            assert (read.structured_content or {})["content"] == "2"

    async def main() -> None:
        with anyio.fail_after(240):
            await session()

    anyio.run(main)
    assert store.listing() == [] and store.leftovers() == []
