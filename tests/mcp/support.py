"""Helpers for the MCP tests: the server as a client starts it (stdio) or as a service (HTTP), the SDK's own
client, approval callbacks, and what a server left behind."""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.abc
import httpx2
import mcp.types as types
from anyio.from_thread import BlockingPortal, start_blocking_portal
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from execbox import Runner, Settings
from execbox.errors import BackendUnavailableError
from execbox.runner import run_blocking
from execbox.testing import engine_missing

BACKENDS = ["docker", "bubblewrap"]
SERVER = [sys.executable, "-m", "execbox.cli", "mcp"]


def usable(backend: str) -> None:
    with Runner(Settings(backend=backend)) as runner:
        try:
            run_blocking(runner.aio.backend(backend).check)
        except BackendUnavailableError as exc:
            engine_missing(f"{backend} cannot run here: {exc}")


def env(**values: str) -> dict[str, str]:
    """The server's environment: this one without any execbox knob of the developer's shell, ``values`` on top."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_", "AGENT_COMPUTE_"))
             and k != "SHELL_BACKEND" or k == "EXECBOX_REQUIRE_ENGINES"}
    return {**clean, **values}


def stdio(server_env: dict[str, str]) -> StdioServerParameters:
    return StdioServerParameters(command=SERVER[0], args=SERVER[1:], env=server_env)


class Asked:
    """An elicitation callback that answers every approval request the same way and keeps what it was asked."""

    def __init__(self, approve: bool = True, action: str = "accept") -> None:
        self.approve = approve
        self.action = action
        self.messages: list[str] = []

    async def __call__(self, context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        self.messages.append(params.message)
        if self.action != "accept":
            return types.ElicitResult(action=self.action)  # type: ignore[arg-type]
        return types.ElicitResult(action="accept", content={"approve": self.approve})


@contextlib.contextmanager
def held_client(server_env: dict[str, str]) -> Iterator[tuple[BlockingPortal, Client]]:
    """A stdio server and an SDK client connected to it, held open in a portal's event loop for sync tests (a
    module's fixture): the client is entered and left in one task, as the SDK needs."""

    async def hold(stop: anyio.Event, *, task_status: anyio.abc.TaskStatus[Client]) -> None:
        async with Client(stdio(server_env)) as client:
            task_status.started(client)
            await stop.wait()

    with start_blocking_portal() as portal:
        stop = portal.call(anyio.Event)
        done, client = portal.start_task(hold, stop)
        try:
            yield portal, client
        finally:
            portal.call(stop.set)
            done.result()


def text(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def http_server(server_env: dict[str, str],
                token: str | None = None) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    """`execbox mcp --http` on a free loopback port: (url, token, process); stopped with SIGTERM afterwards."""
    token = token or secrets.token_urlsafe(24)
    port = free_port()
    proc = subprocess.Popen([*SERVER, "--http", f"127.0.0.1:{port}"], env={**server_env, "EXECBOX_MCP_TOKEN": token},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the HTTP server did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp", token, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def get(url: str, token: str | None, method: str = "GET") -> tuple[int, str, str]:
    """A plain request to the HTTP server (its /metrics): status, content type, body."""
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


@contextlib.asynccontextmanager
async def http_client(url: str, token: str, **kw: Any) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30, read=300))
    async with http, Client(streamable_http_client(url, http_client=http), **kw) as client:
        yield client


def leftovers(pid: int) -> list[str]:
    """Sandboxes (docker containers and workspaces, bubblewrap sessions) whose owner is the process ``pid``."""
    found = glob.glob(os.path.join(tempfile.gettempdir(), f"execbox-bwrap-{pid}-*"))
    found += glob.glob(os.path.join(tempfile.gettempdir(), f"execbox-docker-{pid}-*"))
    with contextlib.suppress(Exception):
        import docker

        client = docker.from_env()
        try:
            for container in client.containers.list(ignore_removed=True, all=True,
                                                    filters={"label": "io.execbox.owner"}):
                if f":{pid}:" in container.labels.get("io.execbox.owner", ""):
                    found.append(f"container {container.name}")
        finally:
            client.close()
    return found


def wait_gone(pid: int, timeout: float = 60) -> list[str]:
    """Wait (bounded) until nothing of ``pid`` is left; what is left at the end."""
    deadline = time.monotonic() + timeout
    while (left := leftovers(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
