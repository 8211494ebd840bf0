"""The MCP server behind ``execbox mcp``: the tools, the grants, the postures and the approvals, on the official
``mcp`` SDK (v2: MCPServer, resolvers that elicit, the streamable HTTP app).

Every call goes through the runner — its guard, its env policy, its limits, its audit log — never around it.
Each call is attributed to its caller in the audit log: the MCP client's name and the grant chain.

Transports. stdio (the default): one client, the process's own; when the client closes the pipe, exits or dies,
the server closes its sandboxes and exits. HTTP (``--http HOST:PORT``, streamable HTTP): bound to 127.0.0.1
unless told otherwise, and every request needs ``Authorization: Bearer <token>``: the server token
(EXECBOX_MCP_TOKEN or --token-file) or a delegated grant's token; anything else is a 401 whose challenge points at
no OAuth metadata, and /.well-known/* is a 404: the server is no OAuth resource, a client is to send the token.
GET /metrics is the server's metrics in the Prometheus text format, behind the same check, for the server token
only (a grant's token is an agent's: 403).
A session is bound to the credential that opened it. A persistent sandbox (posture 1) belongs to an MCP session:
over stdio, the process; over HTTP, the Mcp-Session-Id session, closed when the client deletes it or it is idle for
EXECBOX_MCP_IDLE_SEC. (The 2026-07-28 protocol over HTTP has no sessions: its requests get one-shot tools only.)
"""

from __future__ import annotations

import contextlib
import hmac
import importlib.metadata
import json
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.abc
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Context, Elicit, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.types import CallToolResult, InputRequiredResult
from pydantic import ValidationError

from execbox.audit import fields as audit_fields
from execbox.config.settings import Settings
from execbox.contract.models import NETWORK_MODES, CellResult, ExecResult, Limits, NetworkMode
from execbox.contract.results import clamp_note, timed_out
from execbox.contract.review import ReviewDecision, ReviewRequest, strictest
from execbox.errors import ConfigError, ExecboxError, FileTooLargeError, NotASandboxError, SandboxError
from execbox.guard.commands import rules_off
from execbox.mcp import postures
from execbox.mcp.grants import (
    CODE_TOOLS,
    SESSION_TOOLS,
    Grant,
    GrantError,
    GrantRequest,
    Signer,
    load_key,
    narrow,
    root_grant,
)
from execbox.mcp.review import Approval, Gate, decisions, question, refusal
from execbox.mcp.settings import MIN_TOKEN_CHARS, McpSettings
from execbox.mcp.tools import (
    MAX_LISTED,
    accepted,
    cell_result,
    data_result,
    descriptions,
    error_result,
    exec_result,
    read_result,
    register_tools,
    tailor,
)
from execbox.runner import AsyncRunner, AsyncSandbox
from execbox.runner.snapshots import Snapshot
from execbox.telemetry import PROMETHEUS_FIX, Exporting, record_refusal

#: Warm sandboxes per configuration for the server's one-shot tools, unless CODE_EXEC_POOL_SIZE says otherwise.
SERVER_POOL_SIZE = 2
#: How long a posture-1 sandbox may live: the backstop for a server that is killed (the session ends it first).
SESSION_LIFETIME_S = 24 * 3600.0
SANDBOX_WORKSPACE = "/workspace"
GRANT_SCOPE_KEY = "execbox.grant"
#: Where `execbox mcp --http` serves its metrics (Prometheus text exposition format).
METRICS_PATH = "/metrics"
OFF = ("code execution is off on this server (CODE_EXEC_ENABLED is not true): it offers no tools; its operator "
       "turns them on with CODE_EXEC_ENABLED=true")


def instructions(tools: list[str]) -> str:
    """What the server tells a client about itself: only the tools it offers."""
    if not tools:
        return f"execbox runs code in isolated sandboxes, but {OFF}."
    said = ["execbox runs code in isolated sandboxes. run_code and run_command start a fresh sandbox for each call"]
    if "shell" in tools:
        said.append("; shell, python, write_file, read_file and list_files share one persistent sandbox for this "
                    "session")
    if "snapshot" in tools:
        said.append(", which snapshot keeps and rollback returns to")
    return "".join(said) + (". Results carry the exit code, capped output and, when a limit cut a run short, one "
                            "sentence saying which and whether retrying can help.")


#: Who sets the ceiling of a grantee's timeout.
GRANT_TIMEOUT = "your grant's timeout_s"
R = TypeVar("R", ExecResult, CellResult)


@dataclass
class Plan:
    """Where and how a call runs, as its grant and the settings allow."""

    backend: str
    workspace: str
    network: NetworkMode | None = None
    timeout: float | None = None
    limits: Limits | None = None
    max_output_bytes: int | None = None
    sandbox: AsyncSandbox | None = None


@dataclass
class SessionScope:
    """One MCP session's persistent sandbox (posture 1 and 3), opened on first use."""

    key: str
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    sandbox: AsyncSandbox | None = None
    closed: bool = False
    #: The snapshots its sandbox took (the snapshot tool): its undo history, removed with it.
    snapshots: dict[str, Snapshot] = field(default_factory=dict)


class _Server(MCPServer[Any]):
    """The SDK's server, with arguments that fail the tool's schema answered as a readable error result (each
    field and its problem), not pydantic's report with its input values and documentation links."""

    async def call_tool(self, name: str, arguments: dict[str, Any],
                        context: Context[Any, Any] | None = None) -> CallToolResult | InputRequiredResult:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            if isinstance(exc, UnexpectedToolError) or not isinstance(exc.__cause__, ValidationError):
                raise
            problems = [f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}"
                        for e in exc.__cause__.errors(include_url=False, include_input=False)]
            return error_result(ConfigError(f"invalid arguments for {name}: " + "; ".join(problems)))


class McpApp:
    """The server's state: settings, the runner, the signer, the root grant, the sessions' sandboxes."""

    def __init__(self, settings: Settings, mcp_settings: McpSettings, transport: postures.Transport, *,
                 runner: AsyncRunner | None = None) -> None:
        postures.check_startup(settings, transport)
        rules_off(settings)  # a misspelt CODE_EXEC_REVIEW_OFF stops the server at start, not at the first call
        if "pool_size" not in settings.model_fields_set:
            # A server lives long and answers one call after another: one-shots come from a warm pool (filled
            # after a configuration's first run) unless the operator set CODE_EXEC_POOL_SIZE (0 turns it off).
            settings = settings.model_copy(update={"pool_size": SERVER_POOL_SIZE})
        self.settings = settings
        self.mcp_settings = mcp_settings
        self.transport = transport
        self.tools = postures.offered_tools(settings)
        self.signer = Signer(load_key(mcp_settings.key_file))
        self.root = root_grant(self.tools, settings.posture, settings.network)
        self.own_grant = self.root
        if mcp_settings.grant is not None:  # a sub-agent's own stdio server, under the grant it was given
            self.own_grant = self.signer.verify(mcp_settings.grant.get_secret_value())
        self.runner = runner or AsyncRunner(settings)
        self.scopes: dict[str, SessionScope] = {}
        self._tasks: anyio.abc.TaskGroup | None = None
        self._backends: list[str] | None = None
        self.server = _Server("execbox", version=importlib.metadata.version("execbox"),
                              instructions=instructions(self.tools), log_level="WARNING",
                              middleware=[self._filter_tools])
        register_tools(self.server, self)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[McpApp]:
        """The app for the server's life: on the way out (also cancelled, also on SIGTERM) every session's
        sandbox is closed and removed, then the runner's backends."""
        try:
            async with self.runner, anyio.create_task_group() as tasks:
                self._tasks = tasks
                try:
                    yield self
                finally:
                    with anyio.CancelScope(shield=True):
                        await self.close_all()
                    tasks.cancel_scope.cancel()
        finally:
            self._tasks = None

    async def close_all(self) -> None:
        scopes, self.scopes = list(self.scopes.values()), {}
        for scope in scopes:
            await self._close_scope(scope)

    # --- callers and grants ---------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None, server_token: str) -> Grant | None:
        """The grant an HTTP request's Authorization header carries: the server's own grant (the root, or
        EXECBOX_MCP_GRANT's) for the server token, a delegated grant for a valid grant token; None (a 401) else."""
        if not authorization or not authorization[:7].lower() == "bearer ":
            return None
        token = authorization[7:].strip()
        if hmac.compare_digest(token.encode(), server_token.encode()):
            return self.own_grant
        try:
            return self.signer.verify(token)
        except GrantError:
            return None

    def grant_for(self, request: Any) -> Grant:
        scope = getattr(request, "scope", None)
        if not isinstance(scope, Mapping):
            return self.own_grant  # stdio: the process's own grant
        grant = scope.get(GRANT_SCOPE_KEY)
        if not isinstance(grant, Grant):
            raise GrantError("refused: this request carries no grant")
        return grant

    def check(self, grant: Grant, tool: str) -> None:
        if tool not in self.tools:
            raise GrantError(f"refused: this server does not offer {tool!r}")
        grant.check_tool(tool)
        if tool in CODE_TOOLS and grant.leaf(self.mcp_settings.max_depth):
            raise GrantError(f"refused: your grant ({grant.describe()}) is a leaf, and a leaf never runs code")
        if tool in SESSION_TOOLS and grant.posture < 1:
            raise GrantError(f"refused: {tool} needs posture 1 and your grant has posture {grant.posture}")
        if tool in SESSION_TOOLS and self.settings.posture == 3 and grant.posture < 3:
            raise GrantError(f"refused: this server's persistent shell is the host itself (posture 3), and your grant "
                             f"has posture {grant.posture}")

    def _sandboxed(self, backend: str, network: NetworkMode, what: str) -> None:
        """An agent's code runs in a sandbox; only posture 3's shell is the host. CODE_EXEC_LOCAL=true lets the
        operator's own API and CLI runs use an unsandboxed backend, never an agent's tool."""
        verdict = self.runner.verdict(self.runner.backend(backend), network)
        if not verdict.sandbox:
            raise NotASandboxError(
                f"refused: {what} runs an agent's code only in a sandbox, and backend {backend!r} with network "
                f"{network!r} is not one here ({verdict.reason}). Use a sandbox backend and network mode"
                + ("" if self.settings.posture == 3 else "; only AGENT_COMPUTE_POSTURE=3's shell runs on the host"),
                backend=backend)

    @staticmethod
    def chain(ctx: Context, grant: Grant) -> list[str]:
        params = ctx.session.client_params
        client = params.client_info.name if params is not None else "unknown"
        return [f"mcp:{client[:64]}", *(f"grant:{g}" for g in grant.chain)]

    async def _filter_tools(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        """tools/list shows a caller only the tools its grant allows, each described and its enums listed as that
        grant allows (network modes, backends, the tools and postures it may delegate)."""
        result = await call_next(ctx)
        if ctx.method != "tools/list" or result is None:
            return result
        try:
            grant = self.grant_for(ctx.request)
        except GrantError:
            grant = None
        if grant is None:
            return {**result, "tools": []} if isinstance(result, Mapping) else result.model_copy(update={"tools": []})
        allowed = [t for t in self.tools if t in grant.tools and _visible(self, grant, t)]
        said = descriptions(self.settings, set(allowed))
        enums: dict[str, Any] = {"tools": allowed, "networks": self.networks(grant), "backends": self.backends(grant),
                                 "posture": grant.posture}
        if isinstance(result, Mapping):  # the wire form (camelCase keys)
            return {**result, "tools": [
                {**t, "description": said[t["name"]], "inputSchema": tailor(t["name"], t["inputSchema"], **enums)}
                for t in result.get("tools", []) if t.get("name") in allowed]}
        return result.model_copy(update={"tools": [
            t.model_copy(update={"description": said[t.name], "input_schema": tailor(t.name, t.input_schema, **enums)})
            for t in getattr(result, "tools", []) if t.name in allowed]})

    def networks(self, grant: Grant) -> list[str]:
        """The network modes a caller may ask for, in the order of NETWORK_MODES."""
        return [m for m in NETWORK_MODES if m in grant.network
                and not (grant.egress is not None and m in ("egress", "proxy"))]

    def backends(self, grant: Grant) -> list[str]:
        """The backends a caller may name: the sandboxes this server may use (the configured backend and auto's
        candidates that are sandboxes here, judged on the configuration alone), within the grant's."""
        if self._backends is None:
            names = [self.settings.backend] if self.settings.backend != "auto" else []
            names += [n for n in self.runner.auto_candidates() if n not in names]
            self._backends = []
            for name in names:
                with contextlib.suppress(ExecboxError):
                    if self.runner.verdict(self.runner.backend(name)).sandbox:
                        self._backends.append(name)
        return [b for b in self._backends if grant.backends is None or b in grant.backends]

    # --- persistent sandboxes ---------------------------------------------------------------------------------

    def _scope_for(self, ctx: Context) -> SessionScope:
        if self.transport == "stdio":
            key = "stdio"
        else:
            # The SDK keeps the session's Connection (its id and its teardown stack) on the per-request session
            # proxy only; there is no public accessor yet (mcp 2.3).
            connection = getattr(ctx.request_context.session, "_connection", None)
            session_id = getattr(connection, "session_id", None)
            if connection is None or not session_id:
                raise SandboxError(
                    "a persistent sandbox needs an MCP session, and this request has none (the 2026-07-28 protocol "
                    "over HTTP is stateless). Connect with the initialize handshake (a session with an "
                    "Mcp-Session-Id) or over stdio, or use run_code / run_command")
            key = f"http:{session_id}"
            if key not in self.scopes:
                connection.exit_stack.push_async_callback(self._end_session, key)
        scope = self.scopes.get(key)
        if scope is None:
            scope = self.scopes[key] = SessionScope(key)
        return scope

    async def _end_session(self, key: str) -> None:
        """The MCP session ended (deleted, idle, its connection gone): remove its sandbox, in the background so
        the SDK's bounded teardown never cuts a slow removal short."""
        scope = self.scopes.pop(key, None)
        if scope is None:
            return
        scope.closed = True
        if self._tasks is not None:
            self._tasks.start_soon(self._close_scope, scope)
        else:
            await self._close_scope(scope)

    async def _close_scope(self, scope: SessionScope) -> None:
        scope.closed = True
        await self._close_scope_sandbox(scope)

    async def _close_scope_sandbox(self, scope: SessionScope) -> None:
        """The session's sandbox closed and removed, and the snapshots it took: they were its undo history, not
        the operator's (one that cannot be removed now is left to `execbox snapshot gc` when it expires)."""
        sandbox, scope.sandbox = scope.sandbox, None
        snapshots, scope.snapshots = list(scope.snapshots.values()), {}
        with anyio.CancelScope(shield=True):
            try:
                if sandbox is not None:
                    await sandbox.close()
            finally:
                for snap in snapshots:
                    with contextlib.suppress(ExecboxError):
                        await self.runner.delete_snapshot(snap)

    async def session_sandbox(self, ctx: Context, grant: Grant, chain: list[str]) -> AsyncSandbox:
        scope = self._scope_for(ctx)
        async with scope.lock:
            if scope.closed:
                raise SandboxError("this MCP session has ended; its sandbox is gone")
            if scope.sandbox is not None and scope.sandbox.broken is not None:
                # A backend call overran its bound (the call's BackendTimeoutError said the sandbox was closed):
                # the session goes on in a fresh one rather than failing every call until it ends.
                await self._close_scope_sandbox(scope)
            if scope.sandbox is None:
                s = self.settings
                impl, caps = await self.runner.select(postures.persistent_backend(s))
                grant.check_backend(impl.name)
                network: NetworkMode = "host" if s.posture == 3 else postures.session_network(s, caps)
                try:
                    grant.check_network(network)
                except GrantError:
                    network = "none"
                    grant.check_network(network)
                if s.posture != 3:
                    self._sandboxed(impl.name, network, "the persistent sandbox")
                sandbox = self.runner.sandbox(impl.name, network=network, limits=_limits(grant),
                                              lifetime_s=SESSION_LIFETIME_S)
                with audit_fields.caller(*chain):
                    await sandbox.__aenter__()
                scope.sandbox = sandbox
            return scope.sandbox

    # --- the tools ------------------------------------------------------------------------------------------------

    async def plan(self, ctx: Context, grant: Grant, tool: str, chain: list[str], *, network: NetworkMode | None = None,
                   backend: str | None = None, timeout_s: float | None = None) -> Plan:
        self.check(grant, tool)
        timeout = _least(timeout_s, grant.limits.timeout_s)
        if tool in SESSION_TOOLS:
            sandbox = await self.session_sandbox(ctx, grant, chain)
            assert sandbox.backend is not None
            return Plan(sandbox.backend.name, sandbox.workspace, timeout=timeout, sandbox=sandbox,
                        max_output_bytes=grant.limits.max_output_bytes)
        # checked first (cached): auto's pick, and a verdict on what the check found (ray judges its nodes)
        name = (await self.runner.select(backend or self.settings.backend))[0].name
        grant.check_backend(name)
        mode = network or self.settings.network
        grant.check_network(mode)
        self._sandboxed(name, mode, tool)
        return Plan(name, SANDBOX_WORKSPACE, network=mode, timeout=timeout, limits=_limits(grant),
                    max_output_bytes=grant.limits.max_output_bytes)

    async def _prepare(self, ctx: Context, tool: str, kind: str, text: str,
                       args: Mapping[str, Any]) -> tuple[Grant, list[str], Plan, ReviewRequest, list[ReviewDecision]]:
        grant = self.grant_for(ctx.request_context.request)
        chain = self.chain(ctx, grant)
        plan = await self.plan(ctx, grant, tool, chain, network=args.get("network"), backend=args.get("backend"),
                               timeout_s=args.get("timeout_s"))
        request = ReviewRequest(tool=tool, kind=kind, text=text, workspace=plan.workspace,  # type: ignore[arg-type]
                                backend=plan.backend, posture=self.settings.posture, chain=chain)
        # Off the event loop: a review reads up to 256 KiB of shell (1 MiB of Python), and plugins' hooks are sync code.
        found = await anyio.to_thread.run_sync(decisions, request, self.settings, self.runner.registry)
        return grant, chain, plan, request, found

    async def gate(self, ctx: Context, tool: str, kind: str, text: str, **args: Any) -> Elicit[Approval] | Gate:
        """The approval resolver: refuse, allow, or ask the person at the client (MCP elicitation)."""
        try:
            _, _, _, request, found = await self._prepare(ctx, tool, kind, text, args)
        except ExecboxError as exc:
            return Gate(action="deny", message=exc.message, error=exc.to_dict())
        action = strictest(found)
        if action == "allow":
            return Gate(action="allow")
        if action == "deny":
            return Gate(action="deny", message=refusal(request, found, unattended=False))
        if not _can_elicit(ctx):
            return Gate(action="deny", unattended=True, message=refusal(request, found, unattended=True))
        return Elicit(question(request, found), Approval)

    async def call(self, ctx: Context, tool: str, approval: Any, **args: Any) -> CallToolResult:
        """run_code, run_command, shell: after the approval resolver, run through the runner."""
        outcome = accepted(approval)
        if isinstance(outcome, Gate) and outcome.error is not None:
            return error_result(_error(outcome.error))
        text = args["code"] if tool in ("run_code", "python") else args["command"]
        kind = {"run_code": "bash" if args.get("language") == "bash" else "python", "python": "python"}.get(
            tool, "shell")
        try:
            grant, chain, plan, request, found = await self._prepare(ctx, tool, kind, text, args)
        except ExecboxError as exc:
            return error_result(exc)
        decision = strictest(found)
        if isinstance(outcome, Gate):
            verdict = "allowed" if outcome.action == "allow" else ("unattended" if outcome.unattended else "denied")
        elif isinstance(outcome, Approval):
            verdict = "approved" if outcome.approve else "declined"
        else:
            verdict = getattr(approval, "action", "declined")  # decline / cancel
        allowed = verdict == "approved" or (verdict == "allowed" and decision == "allow")
        with audit_fields.caller(*chain):
            await self.runner.audit.arecord(
                "review", tool=tool, decision=decision, outcome=verdict, backend=plan.backend,
                command_sha256=audit_fields.sha256(text), rules=[d.rule for d in found],
                reasons=[f"{d.source}: {d.reason}" for d in found])
        if not allowed:
            # counted as the pipeline counts its refusals: by reason (denied by a rule, not askable, not approved)
            record_refusal("ReviewDenied" if decision == "deny" else "ReviewUnattended" if verdict == "unattended"
                           else "ReviewDeclined", backend=plan.backend)
            return error_result(outcome.message if isinstance(outcome, Gate) and outcome.message
                                else refusal(request, found, unattended=False))
        try:
            with audit_fields.caller(*chain):
                if tool == "python":
                    assert plan.sandbox is not None  # a session tool: plan() opened the session's sandbox
                    # No %pip: the host would fetch packages for a sandbox whose grant may say network none.
                    cell = await plan.sandbox.run_cell(text, timeout=plan.timeout, pip=False)
                    return cell_result(self._within_grant(cell, grant, args.get("timeout_s"), plan.timeout))
                if plan.sandbox is not None:
                    result = await plan.sandbox.exec(text, timeout=plan.timeout, max_output_bytes=plan.max_output_bytes)
                elif tool == "run_code":
                    result = await self.runner.run_code(
                        text, args.get("language", "python"), backend=plan.backend, network=plan.network,
                        timeout=plan.timeout, limits=plan.limits, max_output_bytes=plan.max_output_bytes)
                else:
                    result = await self.runner.run(text, backend=plan.backend, network=plan.network,
                                                   timeout=plan.timeout, limits=plan.limits,
                                                   max_output_bytes=plan.max_output_bytes)
        except ExecboxError as exc:
            return error_result(exc)
        return exec_result(self._within_grant(result, grant, args.get("timeout_s"), plan.timeout))

    def _within_grant(self, result: R, grant: Grant, asked: float | None, timeout: float | None) -> R:
        """The result as the grantee must hear it when its grant caps the timeout below the operator's maximum: the
        clamp and the ceiling are the grant's (the runner names CODE_EXEC_MAX_TIMEOUT_SEC, which this caller cannot
        reach)."""
        cap = grant.limits.timeout_s
        if cap is None or cap >= self.settings.max_timeout_sec or timeout is None:
            return result
        notes: list[str] = list(result.notes)
        clamped = clamp_note(asked, cap, GRANT_TIMEOUT)
        if clamped is not None:
            notes.append(clamped)
        update: dict[str, Any] = {}
        if result.timed_out:
            words, retryable = timed_out(timeout, cap, GRANT_TIMEOUT)
            if isinstance(result, ExecResult):
                update = {"explanation": words, "retryable": retryable}
            else:
                notes.append(words)
        return result.model_copy(update={**update, "notes": notes})

    async def files(self, ctx: Context, tool: str, **args: Any) -> CallToolResult:
        """write_file, read_file, list_files in the session's sandbox."""
        try:
            grant = self.grant_for(ctx.request_context.request)
            chain = self.chain(ctx, grant)
            plan = await self.plan(ctx, grant, tool, chain)
            sandbox = plan.sandbox
            assert sandbox is not None
            with audit_fields.caller(*chain):
                if tool == "write_file":
                    data = _decode(args["content"], args["encoding"], self.settings.max_read_bytes)
                    await sandbox.write_file(args["path"], data)
                    return data_result({"path": args["path"], "size": len(data)},
                                       f"wrote {len(data)} bytes to {args['path']}")
                if tool == "read_file":
                    cap = self.settings.max_output_bytes
                    try:  # refused unread past the output cap: an agent's read never loads more than it can see
                        return read_result(args["path"], await sandbox.read_file(args["path"], max_bytes=cap), cap)
                    except FileTooLargeError:
                        return read_result(args["path"], None, cap)
                entries = await list_entries(sandbox, args["path"], bool(args["recursive"]))
        except ExecboxError as exc:
            return error_result(exc)
        shown = entries[:MAX_LISTED]
        lines = [f"{e['type'][0]} {e['size']:>10} {e['path']}" for e in shown]
        if len(entries) > MAX_LISTED:
            lines.append(f"... {len(entries) - MAX_LISTED} more entries not shown; list a subdirectory")
        return data_result({"path": args["path"], "entries": shown, "truncated": len(entries) > MAX_LISTED},
                           "\n".join(lines) or "(empty)")

    async def snapshots(self, ctx: Context, tool: str, **args: Any) -> CallToolResult:
        """snapshot and rollback of the session's sandbox; a rollback only to a snapshot this session took."""
        try:
            grant = self.grant_for(ctx.request_context.request)
            chain = self.chain(ctx, grant)
            plan = await self.plan(ctx, grant, tool, chain)
            scope, sandbox = self._scope_for(ctx), plan.sandbox
            assert sandbox is not None
            with audit_fields.caller(*chain):
                if tool == "snapshot":
                    snap = await sandbox.snapshot(args["name"])
                    if scope.closed or scope.sandbox is not sandbox:  # the session ended meanwhile: not kept
                        with anyio.CancelScope(shield=True):
                            await self.runner.delete_snapshot(snap)
                        raise SandboxError("this MCP session's sandbox closed while the snapshot was taken; it "
                                           "was not kept")
                    scope.snapshots[snap.id] = snap
                    dropped = await self._drop_oldest_snapshots(scope)
                    return data_result(
                        {"snapshot_id": snap.id, "name": snap.name, "size": snap.size,
                         "created": snap.created.isoformat(timespec="seconds"), "dropped": dropped},
                        f"snapshot {snap.id} taken ({snap.size} bytes); rollback with snapshot_id={snap.id} returns "
                        "your sandbox to this state"
                        + (f"; this session keeps {len(scope.snapshots)} snapshots at most: the oldest "
                           f"({', '.join(dropped)}) removed" if dropped else ""))
                back = scope.snapshots.get(args["snapshot_id"])  # never a path: only this session's own ids
                if back is None:
                    return error_result(
                        f"refused: {args['snapshot_id'][:64]!r} is not a snapshot this session took (or its "
                        "sandbox was replaced since). Roll back only to an id your snapshot calls returned: "
                        + (", ".join(list(scope.snapshots)[-20:]) or "this session has taken none"))
                await sandbox.rollback(back)
        except ExecboxError as exc:
            return error_result(exc)
        return data_result({"snapshot_id": back.id, "state_lost": not back.memory},
                           f"rolled back to snapshot {back.id}: files and packages since are gone"
                           + ("; the python interpreter starts fresh" if not back.memory else ""))

    async def _drop_oldest_snapshots(self, scope: SessionScope) -> list[str]:
        """A session's undo history is bounded (EXECBOX_MCP_MAX_SNAPSHOTS): past it, its oldest snapshots go, so one
        agent cannot fill the store every session of this server shares."""
        dropped = []
        while len(scope.snapshots) > self.mcp_settings.max_snapshots:
            oldest = scope.snapshots.pop(next(iter(scope.snapshots)))  # a dict keeps the order they were taken in
            with anyio.CancelScope(shield=True), contextlib.suppress(ExecboxError):
                await self.runner.delete_snapshot(oldest)  # one not removable now expires and is collected
            dropped.append(oldest.id)
        return dropped

    async def delegate(self, ctx: Context, ask: GrantRequest) -> CallToolResult:
        try:
            parent = self.grant_for(ctx.request_context.request)
            self.check(parent, "delegate")
            child = narrow(parent, ask, max_depth=self.mcp_settings.max_depth,
                           default_ttl_s=self.mcp_settings.grant_ttl_sec)
        except ExecboxError as exc:
            return error_result(exc)
        token = self.signer.issue(child)
        with audit_fields.caller(*self.chain(ctx, parent)):
            await self.runner.audit.arecord("grant.issue", grant=child.public())
        how = ("Give this token to the sub-agent's MCP client: over HTTP as the header `Authorization: Bearer "
               "<token>`; for a stdio server of its own, as EXECBOX_MCP_GRANT=<token> (with this server's "
               "EXECBOX_MCP_KEY_FILE).")
        return data_result({"token": token, "grant": child.public(), "how": how},
                           f"{how}\ntoken: {token}\ngrant: {child.public()}")


async def list_entries(sandbox: AsyncSandbox, path: str, recursive: bool) -> list[dict[str, Any]]:
    """A directory's entries (path, type, size), from the sandbox's list_files (links listed, never followed)."""
    listed = await sandbox.list_files(path, recursive=recursive)
    return [{"path": e.path, "type": e.type, "size": e.size} for e in listed]


def _visible(app: McpApp, grant: Grant, tool: str) -> bool:
    try:
        app.check(grant, tool)
    except GrantError:
        return False
    return True


def _least(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _limits(grant: Grant) -> Limits | None:
    g = grant.limits
    if g.memory_mb is None and g.cpus is None and g.pids is None and g.disk_mb is None:
        return None
    return Limits(memory_mb=g.memory_mb, cpus=g.cpus, pids=g.pids, disk_mb=g.disk_mb)


def _can_elicit(ctx: Context) -> bool:
    capabilities = ctx.client_capabilities
    elicitation = capabilities.elicitation if capabilities is not None else None
    return elicitation is not None and (elicitation.form is not None or elicitation.url is None)


def _error(data: Mapping[str, Any]) -> ExecboxError:
    return GrantError(str(data.get("message", "refused"))) if data.get("type") == "GrantError" else ExecboxError(
        str(data.get("message", "refused")))


def _decode(content: str, encoding: str, cap: int) -> bytes:
    import base64
    import binascii

    if encoding == "base64":
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError("content is not valid base64; send text with encoding=text, or valid base64") from None
    else:
        try:
            data = content.encode()
        except UnicodeEncodeError:
            raise ConfigError("content is not valid text (a lone surrogate); send it as base64") from None
    if len(data) > cap:
        raise ConfigError(f"content is {len(data)} bytes, over the cap of {cap} bytes (CODE_EXEC_MAX_READ_BYTES)")
    return data


# --- transports -------------------------------------------------------------------------------------------------


class BearerAuth:
    """ASGI middleware: every HTTP request needs the server token or a grant token; else 401. It answers
    METRICS_PATH itself (``exporting``'s Prometheus page)."""

    def __init__(self, app: Any, state: McpApp, token: str, exporting: Exporting | None = None) -> None:
        self.app = app
        self.state = state
        self.token = token
        self.exporting = exporting

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        if scope["type"] == "http" and str(scope.get("path", "")).startswith("/.well-known/"):
            # Not an OAuth resource (nor an authorization server): a client that looks for their metadata
            # (RFC 9728, RFC 8414, OpenID discovery) is told there is none, and asks its user for the token.
            await _answer(send, 404, b'{"error": "not found: this server takes a bearer token (Authorization: '
                                     b'Bearer <token>), not OAuth"}')
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), None)
        grant = self.state.authenticate(header, self.token)
        if grant is None:
            # A challenge with no resource_metadata: nothing for a client to discover, only a token to send.
            await _answer(send, 401, b'{"error": "unauthorized: send Authorization: Bearer <token> (the server token, '
                                     b'EXECBOX_MCP_TOKEN, or a grant token)"}',
                          (b"www-authenticate", b'Bearer realm="execbox"'))
            return
        if scope["type"] == "http" and scope.get("path") == METRICS_PATH:
            await self._metrics(scope, send, grant)
            return
        scope = {**scope, GRANT_SCOPE_KEY: grant,
                 # The SDK binds a session to the principal that opened it: a request with another credential is
                 # answered as if the session did not exist.
                 "user": AuthenticatedUser(AccessToken(token=grant.id, client_id=grant.id, scopes=[]))}
        await self.app(scope, receive, send)

    async def _metrics(self, scope: Mapping[str, Any], send: Any, grant: Grant) -> None:
        if grant is not self.state.own_grant:  # what every caller of the server did is the operator's to see
            await _answer(send, 403, b'{"error": "forbidden: /metrics takes the server token (EXECBOX_MCP_TOKEN or '
                                     b'--token-file), not a grant token"}')
            return
        if scope.get("method") != "GET":
            await _answer(send, 405, b'{"error": "method not allowed: GET /metrics"}', (b"allow", b"GET"))
            return
        page = self.exporting.metrics_page() if self.exporting is not None else None
        if page is None:
            missing = self.exporting.missing if self.exporting is not None else None
            body = json.dumps({"error": f"metrics need the Prometheus reader, which is not installed ({missing}): "
                                        f"{PROMETHEUS_FIX}", "fix": PROMETHEUS_FIX})
            await _answer(send, 501, body.encode())
            return
        text, content_type = page
        await _answer(send, 200, text, content_type=content_type.encode())


async def _answer(send: Any, status: int, body: bytes, *headers: tuple[bytes, bytes],
                  content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type), *headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


async def _signals(stop: Any) -> None:
    """Ctrl-C, SIGTERM and SIGHUP end the server cleanly: its sandboxes are removed on the way out."""
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async for _ in signals:
            stop()
            return


async def serve_stdio(settings: Settings, mcp_settings: McpSettings, *,
                      ready: Callable[[McpApp], None] | None = None) -> None:
    """Serve over stdio; ``ready`` is told once the server has accepted its settings (before that, a refusal)."""
    app = McpApp(settings, mcp_settings, "stdio")
    if ready is not None:
        ready(app)
    async with app.running(), anyio.create_task_group() as tasks:
        tasks.start_soon(_signals, tasks.cancel_scope.cancel)
        await app.server.run_stdio_async()
        tasks.cancel_scope.cancel()


def server_token(mcp_settings: McpSettings, token_file: str | None) -> str:
    """The bearer token an HTTP server requires; refuses to go on without a usable one."""
    token = None
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as fh:
                token = fh.read(4096).strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {token_file!r} cannot be read ({exc.strerror})") from None
    elif mcp_settings.token is not None:
        token = mcp_settings.token.get_secret_value().strip()
    if not token:
        raise ConfigError("refused: `execbox mcp --http` never serves without authentication. Set EXECBOX_MCP_TOKEN "
                          "or pass --token-file FILE (a random token of 16 characters or more)",
                          env_var="EXECBOX_MCP_TOKEN")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"refused: the MCP token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                          "(e.g. `python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`)",
                          env_var="EXECBOX_MCP_TOKEN")
    return token


def _uvicorn_server() -> type[Any]:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn without its own signal handlers: it re-raises a caught SIGTERM after shutting down, which would
        kill the process before the sandboxes are removed. The server's signal task stops it instead."""

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    return QuietServer


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, or a ConfigError saying why there is none (the port is taken, ...)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --http HOST:PORT") \
            from None


async def serve_http(settings: Settings, mcp_settings: McpSettings, host: str, port: int, token: str,
                     *, ready: Callable[[McpApp], None] | None = None, exporting: Exporting | None = None) -> None:
    """Serve streamable HTTP at /mcp, and ``exporting``'s metrics at METRICS_PATH; ``ready`` is told once the
    settings are accepted and the port is bound, so that nothing says "serving" before it is true."""
    import uvicorn

    _QuietServer = _uvicorn_server()
    app = McpApp(settings, mcp_settings, "http")
    sock = listen(host, port)
    starlette = app.server.streamable_http_app(host=host, session_idle_timeout=mcp_settings.session_idle_sec)
    config = uvicorn.Config(BearerAuth(starlette, app, token, exporting), host=host, port=port, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=5)
    server = _QuietServer(config)
    if ready is not None:
        ready(app)

    def stop() -> None:
        server.should_exit = True  # a graceful shutdown: the sessions end, their sandboxes are removed

    async with app.running(), anyio.create_task_group() as tasks:
        tasks.start_soon(_signals, stop)
        with sock:
            await server.serve(sockets=[sock])
        tasks.cancel_scope.cancel()


logging.getLogger("mcp").setLevel(logging.WARNING)
