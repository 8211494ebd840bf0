"""`execbox run`: one command or piece of code in a fresh sandbox, its output shown as it arrives."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn, cast

import click

from execbox.cli.common import (
    EXIT_TIMEOUT,
    exit_code,
    export_telemetry,
    fail,
    load_settings,
    stop_signals_interrupt,
    usage,
)
from execbox.contract.models import NETWORK_MODES, ExecRequest, ExecResult, Language, Mount
from execbox.contract.output import OutputEvent, stream_events
from execbox.errors import ConfigError, ExecboxError
from execbox.files.workspace import normalize, safe_write
from execbox.runner import Runner, run_blocking
from execbox.secrets.values import Secret

#: The file `python -m execbox.cli` runs: a process started so is the execbox program too (see _end).
MAIN_FILE = Path(__file__).with_name("__main__.py")


def _read_stdin(cap: int, as_json: bool) -> bytes:
    data = sys.stdin.buffer.read(cap + 1)
    if len(data) > cap:
        fail(ConfigError(f"--stdin holds more than {cap} bytes (CODE_EXEC_MAX_STDIN_BYTES); pass large data as a "
                          "file in the workspace, or raise the cap", env_var="CODE_EXEC_MAX_STDIN_BYTES"), as_json)
    return data


def _secrets(specs: tuple[str, ...], as_json: bool) -> dict[str, Secret]:
    """``--secret NAME`` (the value of NAME here) or ``--secret NAME=@FILE``; never a value on the command line,
    where process listings and shell history would keep it."""
    secrets: dict[str, Secret] = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if sep and not source.startswith("@"):
            usage(f"--secret {name}=...: a value on the command line shows in process listings and shell history; "
                   f"export {name} and pass --secret {name}, or put it in a file and pass --secret {name}=@FILE",
                   as_json)
        try:
            secrets[name] = Secret.from_file(source[1:]) if sep else Secret.from_env(name)
        except ConfigError as exc:
            fail(exc, as_json)
    return secrets



@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--backend", help="Backend name (default: CODE_EXEC_BACKEND, auto = strongest sandbox here).")
@click.option("--network", type=click.Choice(NETWORK_MODES), help="Network mode (default: CODE_EXEC_NETWORK).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True),
              help="Seconds (capped at CODE_EXEC_MAX_TIMEOUT_SEC).")
@click.option("--max-output-bytes", type=click.IntRange(min=1),
              help="Bytes per stream (capped at CODE_EXEC_MAX_OUTPUT_BYTES).")
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="A variable for the command (repeatable).")
@click.option("--secret", "secret_specs", multiple=True, metavar="NAME|NAME=@FILE",
              help="A secret for the command, redacted from its output: NAME takes the value of NAME in this "
                   "environment, NAME=@FILE the text of FILE (repeatable). Never a value on the command line.")
@click.option("--workdir", help="Working directory: relative to the workspace, or an absolute sandbox path.")
@click.option("--code", help="Code to run instead of a command.")
@click.option("--language", type=click.Choice(["python", "bash"]), default="python", show_default=True)
@click.option("--stdin", "pass_stdin", is_flag=True, help="Pass this program's standard input to the command.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the result, or {\"error\": ...}.")
@click.option("--jsonl", "as_jsonl", is_flag=True,
              help="Print JSON lines as the output arrives: {\"type\": \"stdout\"|\"stderr\", \"text\"}, "
                   "{\"type\": \"dropped\", \"stream\"} past the output cap; then {\"type\": \"result\", ...} "
                   "or {\"type\": \"error\", ...}.")
@click.option("--file", "file_specs", multiple=True, metavar="LOCAL[:REMOTE]",
              help="Copy a local file into the workspace first (repeatable; REMOTE default: its name).")
@click.option("--dir", "dir_specs", multiple=True, metavar="LOCAL[:REMOTE]",
              help="Copy a local directory into the workspace first (repeatable; REMOTE default: its name).")
@click.option("--mount", "mount_specs", multiple=True, metavar="HOST:SANDBOX[:rw]",
              help="Bind a host path into the sandbox, read-only unless :rw (repeatable; docker, bubblewrap).")
@click.option("--tmpfs", "tmpfs", multiple=True, metavar="PATH",
              help="An empty writable tmpfs at this absolute sandbox path, e.g. /var/tmp, owned by the sandbox user "
                   "(repeatable; docker, bubblewrap).")
@click.option("--collect", "collect", multiple=True, metavar="GLOB",
              help="Return the workspace files matching GLOB, e.g. 'out/*.png' (repeatable; with --out or --json).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="After the run, copy the --collect matches (or else the whole workspace) into DIR.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(backend: str | None, network: str | None, timeout: float | None, max_output_bytes: int | None,
        env_pairs: tuple[str, ...], secret_specs: tuple[str, ...], workdir: str | None, code: str | None,
        language: str, pass_stdin: bool, as_json: bool, file_specs: tuple[str, ...], dir_specs: tuple[str, ...],
        mount_specs: tuple[str, ...], collect: tuple[str, ...], out_dir: str | None,
        command: tuple[str, ...], as_jsonl: bool = False, tmpfs: tuple[str, ...] = ()) -> None:
    """Run a command (after --) or --code in a fresh sandbox.

    \b
    execbox run -- python3 -c 'print(1)'
    execbox run --code 'print(1)'
    execbox run --file data.csv --collect 'out/*.png' --out results -- python3 plot.py
    """
    if bool(command) == bool(code):
        usage("give a command after -- or --code CODE, not both and not neither", as_json)
    if as_json and as_jsonl:
        usage("give --json (one object at the end) or --jsonl (events as they arrive), not both", True)
    mode = "json" if as_json else "jsonl" if as_jsonl else "text"
    uploads, mounts = _file_options(file_specs, dir_specs, mount_specs, as_json)
    if collect and not (out_dir or as_json):
        usage("--collect needs --out DIR (or --json, which carries the files base64-encoded)", as_json)
    env = {}
    for pair in env_pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            usage(f"--env takes NAME=VALUE, got {pair!r}", as_json)
        env[name] = value
    secrets = _secrets(secret_specs, as_json)
    settings = load_settings(as_json)
    export_telemetry()
    runner = Runner(settings)
    stop_signals_interrupt()
    # Only on request: an inherited pipe that never closes must not hang a run. Bounded: never more than the cap
    # in memory, and a larger input is refused, not cut.
    stdin = _read_stdin(settings.max_stdin_bytes, as_json) if pass_stdin and sys.stdin is not None else None
    fields: dict[str, Any] = {"network": network, "timeout": timeout, "max_output_bytes": max_output_bytes,
                              "workdir": workdir, "env": env, "stdin": stdin or None, "secrets": secrets or None,
                              "mounts": mounts or None, "collect": list(collect) or None, "tmpfs": list(tmpfs) or None}
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        request = (ExecRequest(argv=list(command), **fields) if command
                   else ExecRequest(code=code, language=cast(Language, language), **fields))
    except ValueError as exc:
        usage(str(exc), as_json)
    try:
        if backend is None and settings.backend == "auto":
            picked, _ = run_blocking(runner.aio.select)
            backend = picked.name
            click.echo(f"execbox: using backend {backend} (CODE_EXEC_BACKEND=auto)", err=True)
            for why in runner.aio.auto_passed_over:  # a stronger sandbox that did not run here, and why
                click.echo(f"execbox: auto passed over {why}", err=True)
        downloads = [(".", out_dir)] if out_dir and not collect else []
        result = _execute(runner, mode, request, backend=backend, upload=uploads, download=downloads)
        if out_dir and collect:
            _write_collected(result.files, out_dir)
    except ExecboxError as exc:
        fail(exc, as_json)
    if as_json:
        click.echo(result.model_dump_json())
    elif as_jsonl:
        click.echo(json.dumps({"type": "result", **json.loads(result.model_dump_json())}))
    else:  # the output itself was printed as it arrived (_execute)
        if result.timed_out:
            limit = min(request.timeout or settings.max_timeout_sec, settings.max_timeout_sec)
            click.echo(f"execbox: timed out after {limit:g}s", err=True)
        if result.oom_killed:
            click.echo("execbox: killed: out of memory", err=True)
        for note in result.notes:
            click.echo(f"execbox: note: {note}", err=True)
        for attempt in result.egress:  # network mode proxy: what the code was refused, and why
            if not attempt.allowed:
                click.echo(f"execbox: egress denied: {attempt.host}:{attempt.port} ({attempt.reason})", err=True)
    _end(EXIT_TIMEOUT if result.timed_out else result.exit_code)


def _end(code: int) -> NoReturn:
    """Exit `execbox run` with ``code``, without the interpreter's teardown when this process is the execbox program.

    By then the sandbox is gone, the audit record is written (unbuffered) and the output printed; what is left is
    the interpreter freeing every module and object one by one: ~50 ms after a docker run, more than the rest of
    execbox's own work on it. So the output is flushed, the atexit handlers run (temporary files, logging,
    coverage), and the process ends. Not when something else owns the process (a program or test that calls
    main() gets its SystemExit), nor while another thread still runs (the interpreter would wait for it).
    """
    ours = os.path.basename(sys.argv[0]) == "execbox" or os.path.realpath(sys.argv[0]) == os.path.realpath(MAIN_FILE)
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if (not ours or others or threading.current_thread() is not threading.main_thread()
            or sys.stdout is not sys.__stdout__ or sys.stderr is not sys.__stderr__):
        sys.exit(code)
    streams = [stream for stream in (sys.stdout, sys.stderr) if stream is not None]
    try:
        for stream in streams:
            stream.flush()
    except OSError:  # e.g. a closed pipe: the interpreter reports it as it always does
        sys.exit(code)
    atexit._run_exitfuncs()
    with contextlib.suppress(OSError):
        for stream in streams:
            stream.flush()
    os._exit(code)


def _file_options(file_specs: tuple[str, ...], dir_specs: tuple[str, ...], mount_specs: tuple[str, ...],
                  as_json: bool) -> tuple[list[tuple[str, str]], list[Mount]]:
    """--file / --dir as (local, remote) uploads, --mount as Mounts; a malformed one is a usage error."""
    uploads = []
    for spec, want_dir in [*((f, False) for f in file_specs), *((d, True) for d in dir_specs)]:
        local, _, remote = spec.partition(":")
        option = "--dir" if want_dir else "--file"
        if not local:
            usage(f"{option} takes LOCAL[:REMOTE], got {spec!r}", as_json)
        if want_dir != os.path.isdir(local) or not os.path.exists(local):
            usage(f"{option} {local}: not {'a directory' if want_dir else 'a file'} here", as_json)
        uploads.append((local, remote or os.path.basename(os.path.abspath(local))))
    mounts = []
    for spec in mount_specs:
        try:
            mounts.append(Mount.parse(spec))
        except (ValueError, ExecboxError) as exc:
            usage(getattr(exc, "message", None) or str(exc), as_json)
    return uploads, mounts


def _write_collected(files: dict[str, bytes], out_dir: str) -> None:
    """Write what --collect brought back under ``out_dir``, never through a link already there."""
    os.makedirs(out_dir, exist_ok=True)
    for rel, data in files.items():
        safe_write(out_dir, normalize(rel), data)


def _execute(runner: Runner, mode: str, request: ExecRequest, **kw: Any) -> ExecResult:
    """Run ``request``. "text": its output printed as it arrives, stdout to stdout and stderr to stderr (past the
    cap, the omission marker and the tail come at the end, so the terminal shows exactly the result's text);
    "jsonl": one JSON line per output event; "json": nothing until the end."""
    if mode == "json":
        return runner.execute(request, **kw)

    def show(event: OutputEvent) -> None:
        if mode == "jsonl":
            line = ({"type": event.stream, "text": event.text} if event.kind == "output"
                    else {"type": "dropped", "stream": event.stream})
            click.echo(json.dumps(line))
        elif event.kind == "output":
            stream = sys.stdout if event.stream == "stdout" else sys.stderr
            stream.write(event.text)
            stream.flush()

    async def go() -> ExecResult:
        async for event in stream_events(lambda out: runner.aio.execute(request, output=out, **kw)):
            if not isinstance(event, OutputEvent):
                return event
            show(event)
        raise AssertionError("a stream ends with its result")

    try:
        return run_blocking(go)
    except ExecboxError as exc:
        if mode != "jsonl":
            raise
        click.echo(json.dumps({"type": "error", "error": exc.to_dict()}))
        sys.exit(exit_code(exc))

