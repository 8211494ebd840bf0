"""The execbox command line: run, backends, doctor, gc, image build.

Exit status of `execbox run`: the command's own; 124 if it timed out; 125 if the guard or the policy
refused; 126 if the backend is unavailable; 2 for a usage or configuration error.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import anyio
import click

from execbox.audit import log as audit_log
from execbox.config import paths
from execbox.config.settings import EnvSettings, Settings
from execbox.contract.backend import bounded
from execbox.contract.models import NETWORK_MODES, ExecRequest, ExecResult, Language, Mount
from execbox.contract.output import OutputEvent, stream_events
from execbox.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    ExecboxError,
    RefusedError,
    WorkspacePathError,
)
from execbox.files.workspace import normalize, safe_write
from execbox.registry import get_registry
from execbox.runner import AsyncRunner, Runner, run_blocking
from execbox.secrets.values import Secret

if TYPE_CHECKING:
    from execbox.contract.backend import ExecutionBackend

T = TypeVar("T")
EXIT_TIMEOUT, EXIT_REFUSED, EXIT_UNAVAILABLE, EXIT_USAGE = 124, 125, 126, 2
CHECK_TIMEOUT_S = 20.0
#: The time box of each check of `doctor --self-check` (the slowest, a warm pool member's start and runs, take ~1 min).
CHECK_BOX_S = 300.0


def _exit_code(exc: ExecboxError) -> int:
    if isinstance(exc, RefusedError):
        return EXIT_REFUSED
    if isinstance(exc, BackendUnavailableError):
        return EXIT_UNAVAILABLE
    if isinstance(exc, (ConfigError, WorkspacePathError)):
        return EXIT_USAGE
    return 1


def _fail(exc: ExecboxError, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"error": exc.to_dict()}))
    else:
        click.echo(f"execbox: {type(exc).__name__}: {exc.message}", err=True)
    sys.exit(_exit_code(exc))


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def _read_stdin(cap: int, as_json: bool) -> bytes:
    data = sys.stdin.buffer.read(cap + 1)
    if len(data) > cap:
        _fail(ConfigError(f"--stdin holds more than {cap} bytes (CODE_EXEC_MAX_STDIN_BYTES); pass large data as a "
                          "file in the workspace, or raise the cap", env_var="CODE_EXEC_MAX_STDIN_BYTES"), as_json)
    return data


def _secrets(specs: tuple[str, ...], as_json: bool) -> dict[str, Secret]:
    """``--secret NAME`` (the value of NAME here) or ``--secret NAME=@FILE``; never a value on the command line,
    where process listings and shell history would keep it."""
    secrets: dict[str, Secret] = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if sep and not source.startswith("@"):
            _usage(f"--secret {name}=...: a value on the command line shows in process listings and shell history; "
                   f"export {name} and pass --secret {name}, or put it in a file and pass --secret {name}=@FILE",
                   as_json)
        try:
            secrets[name] = Secret.from_file(source[1:]) if sep else Secret.from_env(name)
        except ConfigError as exc:
            _fail(exc, as_json)
    return secrets


def _usage(message: str, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"error": {"type": "UsageError", "message": message, "retryable": False,
                                         "backend": None, "env_var": None}}))
        sys.exit(EXIT_USAGE)
    raise click.UsageError(message)


def _settings(as_json: bool) -> Settings:
    try:
        return Settings.from_env()
    except ConfigError as exc:
        _fail(exc, as_json)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="execbox")
def main() -> None:
    """Run untrusted code behind a real sandbox boundary."""


@main.command(context_settings={"ignore_unknown_options": False})
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
@click.option("--workdir", help="Working directory, relative to the workspace.")
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
@click.option("--collect", "collect", multiple=True, metavar="GLOB",
              help="Return the workspace files matching GLOB, e.g. 'out/*.png' (repeatable; with --out or --json).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="After the run, copy the --collect matches (or else the whole workspace) into DIR.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(backend: str | None, network: str | None, timeout: float | None, max_output_bytes: int | None,
        env_pairs: tuple[str, ...], secret_specs: tuple[str, ...], workdir: str | None, code: str | None,
        language: str, pass_stdin: bool, as_json: bool, file_specs: tuple[str, ...], dir_specs: tuple[str, ...],
        mount_specs: tuple[str, ...], collect: tuple[str, ...], out_dir: str | None,
        command: tuple[str, ...], as_jsonl: bool = False) -> None:
    """Run a command (after --) or --code in a fresh sandbox.

    \b
    execbox run -- python3 -c 'print(1)'
    execbox run --code 'print(1)'
    execbox run --file data.csv --collect 'out/*.png' --out results -- python3 plot.py
    """
    if bool(command) == bool(code):
        _usage("give a command after -- or --code CODE, not both and not neither", as_json)
    if as_json and as_jsonl:
        _usage("give --json (one object at the end) or --jsonl (events as they arrive), not both", True)
    mode = "json" if as_json else "jsonl" if as_jsonl else "text"
    uploads, mounts = _file_options(file_specs, dir_specs, mount_specs, as_json)
    if collect and not (out_dir or as_json):
        _usage("--collect needs --out DIR (or --json, which carries the files base64-encoded)", as_json)
    env = {}
    for pair in env_pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            _usage(f"--env takes NAME=VALUE, got {pair!r}", as_json)
        env[name] = value
    secrets = _secrets(secret_specs, as_json)
    settings = _settings(as_json)
    runner = Runner(settings)
    # SIGTERM (timeout(1), systemd, kubernetes) and SIGHUP (a closed terminal or ssh session) must clean up like
    # Ctrl-C: the sandbox is removed on the way out.
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, _interrupt)
    # Only on request: an inherited pipe that never closes must not hang a run. Bounded: never more than the cap
    # in memory, and a larger input is refused, not cut.
    stdin = _read_stdin(settings.max_stdin_bytes, as_json) if pass_stdin and sys.stdin is not None else None
    fields: dict[str, Any] = {"network": network, "timeout": timeout, "max_output_bytes": max_output_bytes,
                              "workdir": workdir, "env": env, "stdin": stdin or None, "secrets": secrets or None,
                              "mounts": mounts or None, "collect": list(collect) or None}
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        request = (ExecRequest(argv=list(command), **fields) if command
                   else ExecRequest(code=code, language=cast(Language, language), **fields))
    except ValueError as exc:
        _usage(str(exc), as_json)
    try:
        if backend is None and settings.backend == "auto":
            picked, _ = run_blocking(runner.aio.select)
            backend = picked.name
            click.echo(f"execbox: using backend {backend} (CODE_EXEC_BACKEND=auto)", err=True)
        downloads = [(".", out_dir)] if out_dir and not collect else []
        result = _execute(runner, mode, request, backend=backend, upload=uploads, download=downloads)
        if out_dir and collect:
            _write_collected(result.files, out_dir)
    except ExecboxError as exc:
        _fail(exc, as_json)
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
    ours = os.path.basename(sys.argv[0]) == "execbox" or os.path.realpath(sys.argv[0]) == os.path.realpath(__file__)
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
            _usage(f"{option} takes LOCAL[:REMOTE], got {spec!r}", as_json)
        if want_dir != os.path.isdir(local) or not os.path.exists(local):
            _usage(f"{option} {local}: not {'a directory' if want_dir else 'a file'} here", as_json)
        uploads.append((local, remote or os.path.basename(os.path.abspath(local))))
    mounts = []
    for spec in mount_specs:
        try:
            mounts.append(Mount.parse(spec))
        except (ValueError, ExecboxError) as exc:
            _usage(getattr(exc, "message", None) or str(exc), as_json)
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
        sys.exit(_exit_code(exc))


async def _probe(runner: AsyncRunner, name: str) -> dict[str, Any]:
    """What `backends` and `doctor` say of one backend: can it run here, and what does it enforce."""
    cls = runner.registry.get(name).cls
    row: dict[str, Any] = {"name": cls.name, "summary": cls.summary, "available": False, "reason": None,
                           "fix": None, "capabilities": cls.capabilities.model_dump(mode="json"),
                           "notes": [], "details": {}}
    try:
        backend = runner.backend(name)
        row["notes"] = backend.notes()
        # The runner's bound, not a cancel scope: a check blocked in a thread does not hear a cancellation.
        caps = await bounded(backend.check(), CHECK_TIMEOUT_S, backend=backend, doing="its availability check")
        row["available"] = True
        row["capabilities"] = caps.model_dump(mode="json")
        row["details"] = backend.details()
        row["notes"] = backend.notes()
    except BackendTimeoutError:
        row["reason"] = f"the availability check did not answer within {CHECK_TIMEOUT_S:g}s"
    except BackendUnavailableError as exc:
        row["reason"], row["fix"] = exc.reason, exc.fix
    except ExecboxError as exc:
        row["reason"] = exc.message
        if exc.env_var:
            row["fix"] = f"change or unset {exc.env_var}"
    except Exception as exc:  # a third-party check that breaks must not take the listing down
        row["reason"] = f"its availability check failed: {exc!r}"
        row["fix"] = f"report this to the maintainers of {runner.registry.get(name).distribution!r}"
    return row


def _probe_all(runner: AsyncRunner) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}

        async def one(name: str) -> None:
            rows[name] = await _probe(runner, name)
            rows[name]["distribution"] = runner.registry.get(name).distribution

        async with anyio.create_task_group() as tg:
            for name in runner.registry.names():
                tg.start_soon(one, name)
        return [rows[n] for n in runner.registry.names()]

    return run_blocking(go)


@main.command()
@click.option("--json", "as_json", is_flag=True)
def backends(as_json: bool) -> None:
    """List every registered backend: where it comes from, whether it runs here, what it enforces."""
    runner = AsyncRunner(_settings(as_json))
    rows = _probe_all(runner)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        caps = row["capabilities"]
        state = "available" if row["available"] else "unavailable"
        click.echo(f"{row['name']:<17} {state:<12} sandbox={str(caps['sandbox']).lower():<5} "
                   f"isolation={caps['isolation']:<10} network={','.join(caps['network_modes']) or '-'}  "
                   f"limits={','.join(caps['limits']) or '-'}  [{row['distribution']}]")
        if not row["available"]:
            click.echo(f"{'':<17} why: {row['reason']}" + (f"\n{'':<17} fix: {row['fix']}" if row["fix"] else ""))
        for note in row["notes"]:
            click.echo(f"{'':<17} note: {note}")
    for problem in runner.registry.problems:
        click.echo(f"warning: {problem}", err=True)


def _guard_verdict(runner: AsyncRunner, backend: ExecutionBackend, row: dict[str, Any]) -> tuple[bool, str]:
    """Would the guard admit a default request on this backend here? (allowed, why)"""
    settings = runner.settings
    request = ExecRequest(argv=["true"], network=settings.network)
    verdict = backend.verdict(request)
    try:
        runner.guard.check_verdict(backend, request)
        runner.guard.check_secrets(backend)
        if row["available"]:
            from execbox.contract.models import Capabilities

            runner.guard.check_policy(backend, Capabilities(**row["capabilities"]), request, set())
    except RefusedError as exc:
        return False, exc.message
    kind = "sandbox" if verdict.sandbox else "not a sandbox (admitted: CODE_EXEC_LOCAL=true)"
    if verdict.attested:
        kind += " (attested by the operator, not enforced by execbox)"
    return True, f"admitted: {kind}; {verdict.reason}"


def _variables(model: type[EnvSettings] | None) -> list[dict[str, Any]]:
    """A settings model's variables, each with its default and the value this environment sets (if any)."""
    if model is None:
        return []
    return [{"variable": var, "default": default, "meaning": meaning,
             "set": "(hidden)" if var in audit_log.SECRET_VARIABLES and var in os.environ else os.environ.get(var)}
            for var, default, meaning in model.env_vars()]


def _self_check(runner: AsyncRunner, name: str | None, as_json: bool, time_box_s: float) -> list[dict[str, Any]]:
    """The kit's checks, each under ``time_box_s``; in text mode each verdict is printed as soon as it is reached."""
    from execbox.testing.checks import CHECKS, CheckResult, self_check  # the kit's checks, run outside pytest

    if name is None:
        try:
            name = run_blocking(runner.select)[0].name
        except ExecboxError as exc:
            _fail(exc, as_json)
    backend = name

    def say(check: CheckResult) -> None:
        click.echo(f"self-check {backend}: {check.status:<4} {check.name}: {check.message}")

    if not as_json:
        click.echo(f"self-check {backend}: {len(CHECKS)} checks, each within {time_box_s:g} s")
    found = self_check(backend, runner.settings, time_box_s=time_box_s, on_result=None if as_json else say)
    return [{"backend": backend, **dataclasses.asdict(r)} for r in found]


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--self-check", "run_self_check", is_flag=True,
              help="Also run the conformance kit's checks against one backend (--backend, default: auto's pick).")
@click.option("--backend", "check_backend", help="The backend --self-check runs against.")
@click.option("--check-timeout", "check_timeout", type=click.FloatRange(min=0, min_open=True), default=CHECK_BOX_S,
              show_default=True, help="--self-check: the time box of each check, seconds; one still running then "
              "fails and is left behind.")
def doctor(as_json: bool, run_self_check: bool, check_backend: str | None, check_timeout: float) -> None:
    """Check every backend here: can it run, what it enforces, the guard's verdict, how to fix what is missing,
    and which variables configure it.

    Exits 0 when at least one sandbox backend can run here (and, with --self-check, every check that ran
    passed), 1 otherwise.
    """
    runner = AsyncRunner(_settings(as_json))
    rows = _probe_all(runner)
    for row in rows:
        row["settings"] = _variables(runner.registry.get(row["name"]).cls.settings_model)
        row["guard_admits"], row["guard_verdict"], row["sandbox_here"] = False, row["reason"], False
        if row["available"]:
            backend = runner.backend(row["name"])
            row["guard_admits"], row["guard_verdict"] = _guard_verdict(runner, backend, row)
            verdict = backend.verdict(ExecRequest(argv=["true"], network=runner.settings.network))
            # Counts only a real sandbox here: not one the guard refuses, not one that is only attested.
            row["sandbox_here"] = row["guard_admits"] and verdict.sandbox and not verdict.attested
    try:
        auto = run_blocking(runner.select)[0].name if runner.settings.backend == "auto" else runner.settings.backend
    except ExecboxError:
        auto = None
    checks = _self_check(runner, check_backend, as_json, check_timeout) if run_self_check else []
    core_settings = _variables(Settings)
    audit_health = audit_log.health(runner.audit)
    ok = any(r["sandbox_here"] for r in rows) and not any(c["status"] == "fail" for c in checks)
    report = {"ok": ok, "selected_backend": auto, "local_mode": runner.settings.local,
              "network": runner.settings.network, "settings": core_settings, "backends": rows,
              "plugin_problems": runner.registry.problems, "self_check": checks,
              "audit": audit_health}
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for row in rows:
            caps = row["capabilities"]
            mark = "ok  " if row["available"] else "--  "
            click.echo(f"{mark}{row['name']}  [{row['distribution']}]")
            if row["available"]:
                modes = ", ".join(caps["network_modes"]) or "none of the modes"
                click.echo(f"      enforces here: isolation {caps['isolation']}; network {modes}; "
                           f"limits {', '.join(caps['limits']) or 'none'}")
            else:
                click.echo(f"      cannot run: {row['reason']}")
                if row["fix"]:
                    click.echo(f"      fix: {row['fix']}")
            if row["available"]:
                click.echo(f"      guard: {row['guard_verdict']}")
            for key, value in row["details"].items():
                click.echo(f"      {key}: {value}")
            for note in row["notes"]:
                click.echo(f"      note: {note}")
            for var in row["settings"]:
                if var["set"] is not None:
                    click.echo(f"      set: {var['variable']}={var['set']}")
        for var in core_settings:
            if var["set"] is not None:
                click.echo(f"set: {var['variable']}={var['set']}")
        for problem in runner.registry.problems:
            click.echo(f"warning: {problem}")
        click.echo(f"audit log: {audit_health['path']} ({audit_health['chain']} chain)" if audit_health["enabled"]
                   else "audit log: off")
        for problem in audit_health["problems"]:
            click.echo(f"warning: {problem}")
        click.echo("")
        if ok:
            click.echo(f"ok: a sandbox backend can run here; CODE_EXEC_BACKEND={runner.settings.backend} uses "
                       f"{auto or '(see above)'}")
        else:
            click.echo("no sandbox backend can run here: apply one of the fixes above (e.g. install bubblewrap, or "
                       "start docker)")
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--backend", "only", help="Only this backend.")
@click.option("--json", "as_json", is_flag=True)
def gc(only: str | None, as_json: bool) -> None:
    """Remove expired and orphaned sandboxes that execbox created (never another program's)."""
    runner = AsyncRunner(_settings(as_json))
    if only:
        try:
            runner.registry.get(only)
        except ConfigError as exc:
            _fail(exc, as_json)
    names = [only] if only else runner.registry.names()
    removed: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}

    async def go() -> None:
        for name in names:
            try:
                # No check() first: a backend's own start-up sweep would remove the orphans before gc counts them.
                backend = runner.backend(name)
                backend.require_sdk()
                # Bounded as an open is (CODE_EXEC_OPEN_TIMEOUT_SEC): a gc that never returns is skipped, said.
                removed[name] = await bounded(backend.gc(), backend.settings.open_timeout_sec, backend=backend,
                                              doing="gc")
            except BackendUnavailableError as exc:
                skipped[name] = exc.reason
            except ExecboxError as exc:  # e.g. a backend setting is invalid: that backend only
                skipped[name] = exc.message

    try:
        run_blocking(go)
    except ExecboxError as exc:
        _fail(exc, as_json)
    for name, ids in removed.items():
        if ids:
            note = runner.audit.record("gc", backend=name, removed=ids)
            if note:
                click.echo(f"execbox: note: {note}", err=True)
    if as_json:
        click.echo(json.dumps({"removed": removed, "skipped": skipped}))
        return
    for name, ids in removed.items():
        click.echo(f"{name}: removed {len(ids)}" + (f": {', '.join(ids)}" if ids else ""))
    if only and only in skipped:
        click.echo(f"{only}: not available here: {skipped[only]}", err=True)


@main.group("audit")
def audit_group() -> None:
    """The audit log of every run, refusal and sandbox (CODE_EXEC_AUDIT_LOG): verify its chain, show its records."""


def _audit_source(log: str | None, as_json: bool) -> tuple[Path, bytes | None]:
    settings = _settings(as_json)
    try:
        key = audit_log.AuditLog.from_settings(settings).key
    except ConfigError as exc:
        _fail(exc, as_json)
    path = log or settings.audit_log
    if not path or path == paths.OFF:
        _usage("the audit log is off (CODE_EXEC_AUDIT_LOG=off): give --log PATH to read one", as_json)
    return Path(path), key


@audit_group.command("verify")
@click.option("--log", help="The log file (default: CODE_EXEC_AUDIT_LOG); its rotated files are read with it.")
@click.option("--json", "as_json", is_flag=True)
def audit_verify(log: str | None, as_json: bool) -> None:
    """Check the whole chain (every rotated file) and the head file; name the first record that was edited,
    removed or reordered, and a log cut short.

    Exits 0 when intact; 1 when tampered or damaged (or there is nothing to verify); 2 when records are HMAC'd
    and no key (CODE_EXEC_AUDIT_KEY or CODE_EXEC_AUDIT_KEY_FILE) was given to check them.
    """
    path, key = _audit_source(log, as_json)
    report = audit_log.verify(path, key)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        for warning in report.warnings:
            click.echo(f"warning: {warning}", err=True)
        if report.problem:
            click.echo(f"audit log {path}: NOT intact: {report.problem}", err=True)
        elif report.unauthenticated:
            click.echo(f"audit log {path}: {report.records} records chained, but their MACs were NOT checked: set "
                       "CODE_EXEC_AUDIT_KEY or CODE_EXEC_AUDIT_KEY_FILE to the key", err=True)
        else:
            click.echo(f"audit log {path}: intact: {report.records} records in {report.files} file(s), up to seq "
                       f"{report.last_seq}" + (" (HMAC checked)" if key else ""))
    sys.exit(0 if report.ok else 1 if report.problem else EXIT_USAGE)


@audit_group.command("show")
@click.option("--log", help="The log file (default: CODE_EXEC_AUDIT_LOG); its rotated files are read with it.")
@click.option("--session", help="Only the records of this session (one-shot runs have their own).")
@click.option("--since", help="Only records since: an ISO date or time (UTC), or an age (30m, 2h, 7d).")
@click.option("--json", "as_json", is_flag=True, help="The records as JSON Lines, as written.")
def audit_show(log: str | None, session: str | None, since: str | None, as_json: bool) -> None:
    """Print the audit log's records, oldest first (`execbox audit verify` checks they are as written)."""
    path, _ = _audit_source(log, as_json)
    try:
        after = audit_log.parse_since(since) if since else None
    except ConfigError as exc:
        _fail(exc, as_json)
    for rec in audit_log.records(path, session=session, since=after):
        click.echo(json.dumps(rec, ensure_ascii=False) if as_json else audit_log.summary(rec))


@main.command()
@click.option("--socket", "socket_path", metavar="PATH", help="Where to listen (default: CODE_EXEC_SERVER).")
def serve(socket_path: str | None) -> None:
    """Keep execbox loaded and run the `execbox` command lines handed to it on a local socket (opt-in).

    With CODE_EXEC_SERVER naming the socket, the `execbox` program forks each command line from this process
    instead of starting Python and importing execbox anew: same output, exit status, streams, working directory
    and environment, ~0.3 s sooner. Only this user's command lines are served. Ends on SIGTERM, SIGINT or SIGHUP.

    \b
    export CODE_EXEC_SERVER=$XDG_RUNTIME_DIR/execbox.sock
    execbox serve &
    execbox run -- echo hi
    """
    from execbox import resident, resident_server

    settings = _settings(False)
    path = socket_path or (str(settings.server) if settings.server else None)
    if not path:
        _usage(f"give --socket PATH, or set {resident.SERVER_VAR}", False)
    _preload(settings)
    try:
        resident_server.serve(path, _run_command_line, ready=lambda: click.echo(
            f"execbox serve: listening on {path} (pid {os.getpid()}); command lines run here when "
            f"{resident.SERVER_VAR}={path}", err=True))
    except resident_server.ServeError as exc:
        _fail(ConfigError(str(exc), env_var=resident.SERVER_VAR), False)


def _preload(settings: Settings) -> None:
    """Import what a command line's first run imports: every backend's module and installed SDK, and anyio's
    event loop. Nothing is started or connected: the children forked afterwards share no thread or socket."""
    import importlib

    importlib.import_module("anyio._backends._asyncio")
    for entry in get_registry(settings.load_plugins, settings.disable_plugins).backends.values():
        sdk = entry.cls.sdk
        with contextlib.suppress(Exception):  # a missing or broken SDK is the backend's own error, at first use
            if sdk:
                importlib.import_module(sdk)


def _run_command_line(argv: list[str]) -> object:
    """One command line in a child of `execbox serve`: as `execbox ARGV...` would run it."""
    return main.main(args=argv, prog_name="execbox")


@main.command("mcp")
@click.option("--http", "http", metavar="HOST:PORT",
              help="Serve streamable HTTP on HOST:PORT (PORT alone: 127.0.0.1) instead of stdio; needs a token.")
@click.option("--token-file", type=click.Path(dir_okay=False), help="File holding the HTTP bearer token "
              "(instead of EXECBOX_MCP_TOKEN).")
def mcp_command(http: str | None, token_file: str | None) -> None:
    """Serve execbox to agents over the Model Context Protocol (stdio by default).

    \b
    CODE_EXEC_ENABLED=true execbox mcp                       # stdio, for an MCP client's config
    EXECBOX_MCP_TOKEN=... execbox mcp --http 127.0.0.1:8765  # streamable HTTP at /mcp
    """
    import importlib.util

    if importlib.util.find_spec("mcp") is None:
        _fail(BackendUnavailableError("the MCP server needs the mcp SDK, which is not installed",
                                      fix="pip install 'execbox[mcp]'"), False)
    from execbox.mcp.server import serve_http, serve_stdio, server_token
    from execbox.mcp.settings import McpSettings

    try:
        settings, mcp_settings = Settings.from_env(), McpSettings.from_env()
        if http is None:
            anyio.run(serve_stdio, settings, mcp_settings)
            return
        host, _, port = http.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            _usage(f"--http takes HOST:PORT (or PORT), got {http!r}", False)
        token = server_token(mcp_settings, token_file)
        host = host.strip("[]") or "127.0.0.1"
        if host not in ("127.0.0.1", "localhost", "::1"):
            click.echo(f"execbox mcp: listening on {host}, beyond this machine: every request needs the token; "
                       "put TLS in front of it", err=True)
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"execbox mcp: serving http://{shown}:{port}/mcp", err=True)
        anyio.run(serve_http, settings, mcp_settings, host, int(port), token)
    except ExecboxError as exc:
        _fail(exc, False)


@main.group()
def image() -> None:
    """Sandbox images for the docker backend."""


@image.command("build")
@click.option("--tag", default=None, help="Image tag (default: the default image's; with extra content, its name "
              "with the recipe hash as suffix).")
@click.option("--package", "debs", multiple=True, metavar="NAME",
              help="A Debian package to add (repeatable), e.g. python3-numpy; from the Debian mirror, no registry.")
@click.option("--pip", "pip_reqs", multiple=True, metavar="REQ",
              help="A Python requirement to install (repeatable), fetched as a wheel by this host's pip.")
@click.option("--requirements", "req_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              metavar="FILE", help="A requirements file (repeatable), fetched the same way.")
@click.option("--force", is_flag=True, help="Rebuild even when an up-to-date image exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def image_build(tag: str | None, debs: tuple[str, ...], pip_reqs: tuple[str, ...], req_files: tuple[str, ...],
                force: bool, as_json: bool) -> None:
    """Build a sandbox image from Debian's packages (debootstrap + docker import); no registry needed.

    \b
    execbox image build                                  # the default image
    execbox image build --package python3-numpy          # -> execbox-sandbox:bookworm-<recipe hash>
    execbox image build --pip 'rich==13.7.1' --tag my-image:1
    """
    from pathlib import Path

    from execbox.backends.docker import image as docker_image

    try:
        result = docker_image.build_image(tag, force=force, packages=docker_image.DEFAULT_PACKAGES + debs,
                                          pip=pip_reqs, requirements=tuple(Path(f) for f in req_files))
    except docker_image.ImageBuildError as exc:
        click.echo(f"execbox image: error: {exc}", err=True)
        sys.exit(1)
    except ExecboxError as exc:  # e.g. pip on the host failing to fetch the --pip packages
        _fail(exc, as_json)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(result)))
        return
    state = "built" if result.built else "up to date"
    click.echo(f"{result.tag}: {state} ({result.image_id[:19]}, {result.size_bytes / 1e6:.0f} MB)")
    if result.tag != docker_image.DEFAULT_TAG:
        click.echo(f"use it: CODE_EXEC_DOCKER_IMAGE={result.tag}, or execbox.sandbox('docker', image="
                   f"{result.tag!r})", err=True)



if __name__ == "__main__":
    main()
