"""The tools the MCP server offers, with schemas and descriptions written for a model.

Every tool answers with a result, never a crash: bad arguments, refusals and broken sandboxes come back as an
error result (``isError``) whose text says what to change. A finished run is not an error, whatever its exit
code: the result carries the exit code, stdout and stderr (each capped, the middle replaced by a marker that
says how many bytes were left out) and, when a limit cut the run short, one sentence naming it and whether
retrying can help. Structured content carries the same fields for clients that read JSON.

(No ``from __future__ import annotations`` here: the tool signatures carry closures — the approval resolvers
— that the SDK reads from the evaluated annotations.)
"""

import base64
import copy
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal, Protocol

from mcp.server.mcpserver import Context, Elicit, ElicitationResult, MCPServer, Resolve
from mcp.server.mcpserver.resolve import AcceptedElicitation
from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from execbox.config.settings import Settings
from execbox.contract.models import CellResult, ExecResult
from execbox.errors import ExecboxError
from execbox.mcp.grants import ALL_TOOLS, GrantRequest
from execbox.mcp.review import Approval, Gate

MAX_LISTED = 1000


# The structured content of each tool's result, published as its outputSchema (a client validates a result against
# it; an error result has none: its error is text, and data under _meta, ERROR_META).


class Egress(BaseModel):
    host: str
    port: int
    allowed: bool
    reason: str
    bytes_sent: int = 0
    bytes_received: int = 0


class Denied(BaseModel):
    host: str
    port: int
    reason: str


class RunOutput(BaseModel):
    """A finished run (run_code, run_command, shell)."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    oom_killed: bool
    truncated: bool
    limit: Literal["timeout", "memory", "network"] | None
    explanation: str
    retryable: bool
    duration_s: float
    backend: str
    notes: list[str]
    egress: list[Egress] | None = Field(default=None, description="network mode proxy: the connections it made")
    egress_denied: list[Denied] | None = None


class CellOutputItem(BaseModel):
    kind: Literal["display", "result"]
    mime_types: list[str]
    text: str | None


class CellErrorOut(BaseModel):
    name: str
    value: str
    traceback: str


class CellOutput(BaseModel):
    """A Python cell (python)."""

    ok: bool
    execution_count: int
    stdout: str
    stderr: str
    outputs: list[CellOutputItem]
    error: CellErrorOut | None
    timed_out: bool
    oom_killed: bool
    state_lost: bool
    truncated: bool
    notes: list[str]


class WriteOutput(BaseModel):
    path: str
    size: int


class ReadOutput(BaseModel):
    path: str
    size: int
    encoding: Literal["text", "base64"]
    content: str


class Entry(BaseModel):
    path: str
    type: str
    size: int


class ListOutput(BaseModel):
    path: str
    entries: list[Entry]
    truncated: bool


class SnapshotOutput(BaseModel):
    snapshot_id: str
    name: str | None
    size: int = Field(description="bytes it keeps")
    created: str = Field(description="when it was taken (ISO 8601, UTC)")
    dropped: list[str] = Field(description="ids of this session's oldest snapshots, removed to keep its latest only")


class RollbackOutput(BaseModel):
    snapshot_id: str
    state_lost: bool = Field(description="the python tool's interpreter starts fresh: its variables are gone")


class DelegateOutput(BaseModel):
    token: str
    grant: dict[str, Any] = Field(description="the grant as issued: tools, backends, network, limits, expiry")
    how: str


def exec_result(result: ExecResult) -> CallToolResult:
    """A finished run, as a model reads it (text) and as a client parses it (structured content)."""
    data: dict[str, Any] = {
        "exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr,
        "timed_out": result.timed_out, "oom_killed": result.oom_killed, "truncated": result.truncated,
        "limit": result.limit, "explanation": result.explanation, "retryable": result.retryable,
        "duration_s": result.duration_s, "backend": result.backend, "notes": list(result.notes),
    }
    if result.egress:  # network mode proxy: every connection the code made, allowed or not (the first 100)
        data["egress"] = [{"host": a.host, "port": a.port, "allowed": a.allowed, "reason": a.reason,
                           "bytes_sent": a.bytes_sent, "bytes_received": a.bytes_received} for a in result.egress[:100]]
    denied = [a for a in result.egress if not a.allowed]
    if denied:
        data["egress_denied"] = [{"host": a.host, "port": a.port, "reason": a.reason} for a in denied[:20]]
    lines = [f"exit code: {result.exit_code} (backend {result.backend}, {result.duration_s:.2f} s)"]
    if result.explanation:
        lines.append(f"{result.explanation} (retrying can help: {'yes' if result.retryable else 'no'})")
    lines += [f"note: {note}" for note in result.notes]
    lines += [f"egress denied: {a['host']}:{a['port']} ({a['reason']})" for a in data.get("egress_denied", [])]
    allowed = sorted({f"{a.host}:{a.port}" for a in result.egress if a.allowed})
    if allowed:
        lines.append(f"egress allowed: {', '.join(allowed[:20])}" + (" ..." if len(allowed) > 20 else ""))
    lines += ["stdout:" + ("\n" + result.stdout if result.stdout else " (empty)"),
              "stderr:" + ("\n" + result.stderr if result.stderr else " (empty)")]
    return CallToolResult(content=[TextContent(type="text", text="\n".join(lines))], structured_content=data)


def cell_result(result: CellResult, max_images: int = 8) -> CallToolResult:
    """A Python cell, as a model reads it: its printed output, the values it displayed (text, and images as
    image content a model can look at), the exception if it raised, and whether the interpreter's state
    survived."""
    outputs: list[dict[str, Any]] = []
    images: list[ImageContent] = []
    lines = [f"cell {result.execution_count} ({result.backend}, {result.duration_s:.2f} s)"]
    if result.state_lost:
        lines.append("the interpreter's earlier state (variables, imports) is gone: this cell ran in a fresh one")
    if result.timed_out:
        lines.append("the cell was stopped at its timeout")
    lines += [f"note: {note}" for note in result.notes]
    for output in result.outputs:
        mimes = sorted(output.data)
        outputs.append({"kind": output.kind, "mime_types": mimes, "text": output.text})
        for mime in ("image/png", "image/jpeg"):
            if mime in output.data and output.binary(mime) is not None and len(images) < max_images:
                images.append(ImageContent(type="image", data=output.data[mime], mime_type=mime))
                break
        if output.text is not None:
            lines.append(("value: " if output.kind == "result" else "display: ") + output.text)
    if result.stdout:
        lines.append("stdout:\n" + result.stdout)
    stderr = result.stderr
    if result.error is not None and result.error.traceback and result.error.traceback in stderr:
        # The interpreter printed the traceback to stderr too: the error block below shows it once.
        head, _, tail = stderr.rpartition(result.error.traceback)
        stderr = head + tail
    if stderr.strip():
        lines.append("stderr:\n" + stderr)
    if result.error is not None:
        lines.append(f"error: {result.error.name}: {result.error.value}\n{result.error.traceback}".rstrip())
    data: dict[str, Any] = {
        "ok": result.ok, "execution_count": result.execution_count, "stdout": result.stdout,
        "stderr": result.stderr, "outputs": outputs, "error": result.error.model_dump() if result.error else None,
        "timed_out": result.timed_out, "oom_killed": result.oom_killed, "state_lost": result.state_lost,
        "truncated": result.truncated, "notes": list(result.notes),
    }
    return CallToolResult(content=[TextContent(type="text", text="\n".join(lines)), *images],
                          structured_content=data)


#: Where an error result carries the error as data (type, message, retryable, ...): in _meta, not structured
#: content, which a client validates against the tool's outputSchema (the MCP Inspector does, errors included).
ERROR_META = "io.execbox/error"


def error_result(error: ExecboxError | str) -> CallToolResult:
    """A call that could not do what was asked: what went wrong, and what to change."""
    if isinstance(error, ExecboxError):
        data: dict[str, Any] = error.to_dict()
        text = f"{type(error).__name__}: {error.message}"
    else:
        data = {"type": "Refused", "message": error, "retryable": False}
        text = error
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True, _meta={ERROR_META: data})


def data_result(data: dict[str, Any], text: str | None = None) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text or json.dumps(data, indent=1))],
                          structured_content=data)


Timeout = Annotated[float | None, Field(
    gt=0, allow_inf_nan=False,
    description="Seconds before the run is killed. Leave it out for the default, which is also the maximum.")]
Network = Annotated[Literal["none", "egress", "proxy", "host"] | None, Field(
    description="Network mode for this run; leave it out for the server's default (usually none: "
    "no network). proxy = only allowlisted hosts (package indexes) through a proxy.")]
Backend = Annotated[str | None, Field(
    max_length=64, description="Sandbox backend; leave it out for the server's default.")]


class ToolHost(Protocol):
    """What the tools call on the server's state (``McpApp``, which imports this module, not the other way): its
    settings, the tools it offers, the approval gate, and the handlers every tool hands its arguments to."""

    settings: Settings
    tools: list[str]

    async def gate(self, ctx: Context, tool: str, kind: str, text: str) -> Elicit[Approval] | Gate: ...

    async def call(self, ctx: Context, tool: str, approval: Any, **args: Any) -> CallToolResult: ...

    async def files(self, ctx: Context, tool: str, **args: Any) -> CallToolResult: ...

    async def snapshots(self, ctx: Context, tool: str, **args: Any) -> CallToolResult: ...

    async def delegate(self, ctx: Context, ask: GrantRequest) -> CallToolResult: ...


def register_tools(server: MCPServer, app: ToolHost) -> None:
    """Add the tools ``app`` offers to ``server``."""
    s = app.settings

    async def gate_run_code(code: str, language: str, ctx: Context) -> Elicit[Approval] | Gate:
        return await app.gate(ctx, "run_code", "bash" if language == "bash" else "python", code)

    async def gate_run_command(command: str, ctx: Context) -> Elicit[Approval] | Gate:
        return await app.gate(ctx, "run_command", "shell", command)

    async def gate_shell(command: str, ctx: Context) -> Elicit[Approval] | Gate:
        return await app.gate(ctx, "shell", "shell", command)

    async def gate_python(code: str, ctx: Context) -> Elicit[Approval] | Gate:
        return await app.gate(ctx, "python", "python", code)

    async def run_code(
        code: Annotated[str, Field(max_length=4 << 20, description="The program's source code.")],
        approval: Annotated[ElicitationResult[Approval], Resolve(gate_run_code)],
        ctx: Context,
        language: Annotated[Literal["python", "bash"], Field(
            description="python (Python 3) or bash.")] = "python",
        timeout_s: Timeout = None,
        network: Network = None,
        backend: Backend = None,
    ) -> Annotated[CallToolResult, RunOutput]:
        return await app.call(ctx, "run_code", approval, code=code, language=language, timeout_s=timeout_s,
                              network=network, backend=backend)

    async def run_command(
        command: Annotated[str, Field(min_length=1, max_length=1 << 20, description=(
            "A shell command line, run by /bin/sh -c in the sandbox's workspace, e.g. "
            "\"python3 -c 'print(1)' && ls -la\"."))],
        approval: Annotated[ElicitationResult[Approval], Resolve(gate_run_command)],
        ctx: Context,
        timeout_s: Timeout = None,
        network: Network = None,
        backend: Backend = None,
    ) -> Annotated[CallToolResult, RunOutput]:
        return await app.call(ctx, "run_command", approval, command=command, timeout_s=timeout_s, network=network,
                              backend=backend)

    async def shell(
        command: Annotated[str, Field(min_length=1, max_length=1 << 20, description=(
            "A shell command line, run by /bin/sh -c in your persistent sandbox's workspace."))],
        approval: Annotated[ElicitationResult[Approval], Resolve(gate_shell)],
        ctx: Context,
        timeout_s: Timeout = None,
    ) -> Annotated[CallToolResult, RunOutput]:
        return await app.call(ctx, "shell", approval, command=command, timeout_s=timeout_s)

    async def python(
        code: Annotated[str, Field(min_length=1, max_length=4 << 20, description=(
            "Python code to run in your persistent interpreter, like a notebook cell."))],
        approval: Annotated[ElicitationResult[Approval], Resolve(gate_python)],
        ctx: Context,
        timeout_s: Timeout = None,
    ) -> Annotated[CallToolResult, CellOutput]:
        return await app.call(ctx, "python", approval, code=code, timeout_s=timeout_s)

    async def write_file(
        path: Annotated[str, Field(min_length=1, max_length=4096, description=(
            "Where to write, relative to the workspace (directories are created), e.g. \"src/main.py\"."))],
        content: Annotated[str, Field(max_length=96 << 20, description="The file's content.")],
        ctx: Context,
        encoding: Annotated[Literal["text", "base64"], Field(
            description="text (UTF-8) or base64 (for binary content).")] = "text",
    ) -> Annotated[CallToolResult, WriteOutput]:
        return await app.files(ctx, "write_file", path=path, content=content, encoding=encoding)

    async def read_file(
        path: Annotated[str, Field(min_length=1, max_length=4096, description=(
            "The file to read, relative to the workspace."))],
        ctx: Context,
    ) -> Annotated[CallToolResult, ReadOutput]:
        return await app.files(ctx, "read_file", path=path)

    async def list_files(
        ctx: Context,
        path: Annotated[str, Field(max_length=4096, description=(
            "The directory to list, relative to the workspace; \".\" is the workspace itself."))] = ".",
        recursive: Annotated[bool, Field(description="Also list everything below it.")] = False,
    ) -> Annotated[CallToolResult, ListOutput]:
        return await app.files(ctx, "list_files", path=path, recursive=recursive)

    async def snapshot(
        ctx: Context,
        name: Annotated[str | None, Field(max_length=200, description=(
            "A label for it, e.g. \"before refactor\"; leave it out for none."))] = None,
    ) -> Annotated[CallToolResult, SnapshotOutput]:
        return await app.snapshots(ctx, "snapshot", name=name)

    async def rollback(
        snapshot_id: Annotated[str, Field(min_length=1, max_length=64, description=(
            "The id a snapshot call of this session returned."))],
        ctx: Context,
    ) -> Annotated[CallToolResult, RollbackOutput]:
        return await app.snapshots(ctx, "rollback", snapshot_id=snapshot_id)

    async def delegate(
        tools: Annotated[list[str], Field(min_length=1, max_length=len(ALL_TOOLS), description=(
            "The tools the sub-agent may use: a subset of yours."))],
        ctx: Context,
        label: Annotated[str, Field(max_length=200, description="Who it is for, e.g. \"test-writer\".")] = "",
        backends: Annotated[list[str] | None, Field(max_length=32, description=(
            "Backends it may use; leave it out for yours."))] = None,
        network: Annotated[list[Literal["none", "egress", "proxy", "host"]] | None, Field(
            max_length=4, description="Network modes it may use; leave it out for yours.")] = None,
        egress: Annotated[list[str] | None, Field(max_length=256, description=(
            "Egress allowlist entries it may reach; leave it out for yours."))] = None,
        timeout_s: Annotated[float | None, Field(gt=0, allow_inf_nan=False, description=(
            "Its longest run, seconds; at most yours."))] = None,
        memory_mb: Annotated[int | None, Field(gt=0, description=(
            "Its memory per sandbox, MiB; at most yours."))] = None,
        max_output_bytes: Annotated[int | None, Field(gt=0, description=(
            "Its output cap per stream, bytes; at most yours."))] = None,
        posture: Annotated[Literal[0, 1, 3] | None, Field(description=(
            "0 = one-shot runs only, 1 = also a persistent sandbox; at most yours."))] = None,
        expires_in_s: Annotated[float | None, Field(gt=0, allow_inf_nan=False, description=(
            "How long the grant lasts, seconds; never longer than yours or the server's grant lifetime."))] = None,
    ) -> Annotated[CallToolResult, DelegateOutput]:
        try:
            ask = GrantRequest(tools=tools, label=label, backends=backends, network=network, egress=egress,
                               timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                               posture=posture, expires_in_s=expires_in_s)
        except ValueError as exc:
            return error_result(f"invalid grant request: {exc}")
        return await app.delegate(ctx, ask)

    functions: dict[str, Callable[..., Any]] = {
        "run_code": run_code, "run_command": run_command, "shell": shell, "python": python, "write_file": write_file,
        "read_file": read_file, "list_files": list_files, "snapshot": snapshot, "rollback": rollback,
        "delegate": delegate}
    described = descriptions(s, set(app.tools))
    for name in app.tools:
        server.add_tool(functions[name], name=name, description=described[name], annotations=ANNOTATIONS[name](s))


ANNOTATIONS: dict[str, Any] = {
    "run_code": lambda s: ToolAnnotations(title="Run code in a sandbox", destructive_hint=False, open_world_hint=False),
    "run_command": lambda s: ToolAnnotations(title="Run a command in a sandbox", destructive_hint=False,
                                             open_world_hint=False),
    "shell": lambda s: ToolAnnotations(title="Shell in your sandbox", destructive_hint=s.posture == 3,
                                       open_world_hint=False),
    "python": lambda s: ToolAnnotations(title="Python in your sandbox", destructive_hint=False, open_world_hint=False),
    "write_file": lambda s: ToolAnnotations(title="Write a file", destructive_hint=False, idempotent_hint=True),
    "read_file": lambda s: ToolAnnotations(title="Read a file", read_only_hint=True),
    "list_files": lambda s: ToolAnnotations(title="List files", read_only_hint=True),
    # Both change only the session's own sandbox (its state, or a copy of it kept until the session ends).
    "snapshot": lambda s: ToolAnnotations(title="Snapshot your sandbox", destructive_hint=False, open_world_hint=False),
    "rollback": lambda s: ToolAnnotations(title="Roll your sandbox back", destructive_hint=False, idempotent_hint=True,
                                          open_world_hint=False),
    "delegate": lambda s: ToolAnnotations(title="Delegate a narrower grant", read_only_hint=True),
}


def descriptions(s: Settings, offered: set[str]) -> dict[str, str]:
    """Each tool's description for a caller that has the tools ``offered``: it names only tools the caller has."""
    limits = (f"Limits: {s.max_timeout_sec:g} s (default and maximum), {s.memory_mb} MiB of memory, "
              f"{s.max_output_bytes} bytes of output per stream (the middle of longer output is replaced by a "
              "marker that says how many bytes were left out).")
    result_doc = ("Returns the exit code, stdout and stderr, and, when a limit cut the run short, one sentence "
                  "naming it and whether retrying can help. A non-zero exit code is a result, not an error.")
    approval_doc = ("Commands that are hard to take back (deleting outside the workspace, git push, publishing a "
                    "package, piping a download into a shell, writing to a device...) first need the user's "
                    "approval; if it is refused, do not retry.")
    reading = " with `shell` (head -c, tail -c, sed -n)" if "shell" in offered else ""
    return {
        "run_code": (
            "Run a Python or bash program in a fresh, isolated sandbox that is thrown away afterwards: nothing "
            "persists between calls" + (" (use `shell` for that)" if "shell" in offered else "") + ". "
            f"{limits} {result_doc} {approval_doc}"),
        "run_command": (
            "Run a shell command line in a fresh, isolated sandbox that is thrown away afterwards. "
            f"{limits} {result_doc} {approval_doc}"),
        "shell": (
            "Run a shell command in your persistent sandbox (one per MCP session, opened on first use"
            + (", on this host itself: it is not a sandbox" if s.posture == 3 else "") + "). Files you write and "
            "packages you install stay until the session ends; each call starts a new /bin/sh in the workspace, "
            "so `cd` and variables do not carry over: chain them with && in one call. "
            f"{limits} {result_doc} {approval_doc}"),
        "python": (
            "Run Python in your persistent interpreter (in your sandbox, like a notebook): variables, imports "
            "and open files stay from call to call. The value of the last expression and display()ed objects "
            "come back (images as images); matplotlib figures come back as PNG without saving them. A cell "
            "past its timeout is interrupted; if the interpreter has to be killed, the result says its state "
            f"was lost. {limits} {approval_doc}"),
        "write_file": (
            "Write a file into your persistent sandbox's workspace (replacing it if it exists). Use "
            "encoding=base64 for binary content. Returns the path and the number of bytes written."),
        "read_file": (
            "Read a file from your persistent sandbox's workspace. Text comes back as text; other content as "
            f"base64, with its size. Files over {s.max_output_bytes} bytes are refused" + (
                f": read parts of them{reading}." if reading else ".")),
        "list_files": (
            "List a directory of your persistent sandbox's workspace: each entry's path, type (file, directory, "
            f"symlink, other) and size in bytes; links are shown, never followed; at most {MAX_LISTED} entries."),
        "snapshot": (
            "Keep the state of your persistent sandbox (its files, and packages you installed) as a snapshot, to "
            "come back to with `rollback`: an undo point before something risky. Returns its id and size. Your "
            "snapshots are removed when this session ends, and only your latest are kept (taking one more past the "
            "bound removes your oldest: `dropped` names them); processes and the python tool's variables are not "
            "kept."),
        "rollback": (
            "Return your persistent sandbox to a snapshot this session took (`snapshot`): files written and packages "
            "installed since are gone, and the python tool's interpreter starts fresh. The snapshot stays, for "
            "another rollback."),
        "delegate": (
            "Issue a narrower grant for a sub-agent: which of your tools ("
            + ", ".join(t for t in ALL_TOOLS if t in offered) + "), backends, network modes and limits it may "
            "use, never more than yours. Returns a token; the sub-agent's MCP client presents it as "
            "`Authorization: Bearer <token>` (HTTP) or EXECBOX_MCP_GRANT=<token> (its own stdio server). At the "
            "last level of delegation a grant is a leaf: it cannot run code or delegate."),
    }


def tailor(name: str, schema: dict[str, Any], *, tools: list[str], networks: list[str], backends: list[str],
           posture: int) -> dict[str, Any]:
    """A tool's input schema as one caller may use it: the enums of network modes, backends, tools and postures
    list only what its grant allows (the server still checks every call)."""
    schema = copy.deepcopy(schema)
    props: dict[str, Any] = schema.get("properties", {})
    if name == "delegate":
        _enum(props.get("tools"), tools)
        _enum(props.get("network"), networks)
        _enum(props.get("backends"), backends)
        _enum(props.get("posture"), [p for p in (0, 1, 3) if p <= posture])
    elif "network" in props:
        _enum(props.get("network"), networks)
        _enum(props.get("backend"), backends)
    return schema


def _enum(prop: dict[str, Any] | None, allowed: list[Any]) -> None:
    """Set the enum of a property (a value, or the items of a list; either may be nullable) to ``allowed``."""
    if prop is None:
        return
    for branch in prop.get("anyOf", [prop]):
        target = branch.get("items", branch)
        if target.get("type") != "null":
            target["enum"] = list(allowed)
            target.pop("const", None)


def read_result(path: str, data: bytes | None, cap: int) -> CallToolResult:
    """A file read for a model: text, or base64 with its size; ``None`` (or more than ``cap``) is a file over the
    output cap, refused with how to read parts of it."""
    if data is None or len(data) > cap:
        size = f"more than {cap} bytes" if data is None else f"{len(data)} bytes"
        return error_result(f"refused to read {path!r}: it holds {size}, over the output cap of {cap} bytes "
                            "(CODE_EXEC_MAX_OUTPUT_BYTES); read parts of it with shell (head -c, tail -c, sed -n)")
    try:
        text = data.decode()
        encoding, content = ("text", text) if "\0" not in text else ("base64", base64.b64encode(data).decode())
    except UnicodeDecodeError:
        encoding, content = "base64", base64.b64encode(data).decode()
    body = {"path": path, "size": len(data), "encoding": encoding, "content": content}
    header = f"{path}: {len(data)} bytes" + (", base64" if encoding == "base64" else "")
    return data_result(body, f"{header}\n{content}")


def accepted(approval: Any) -> Any:
    """The resolved approval's data (a Gate or an Approval), or None when the person declined or cancelled."""
    return approval.data if isinstance(approval, AcceptedElicitation) else None
