"""`execbox backends` and `execbox doctor`: which backends can run here, what they enforce, the guard's verdict,
the variables that configure them, and (doctor --self-check) the conformance kit's checks against one."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import anyio
import click

from execbox.audit import log as audit_log
from execbox.cli.common import fail, load_settings
from execbox.config.settings import EnvSettings, Settings
from execbox.contract.backend import bounded
from execbox.contract.models import Capabilities
from execbox.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    ExecboxError,
    MissingExtraError,
    RefusedError,
)
from execbox.runner import AsyncRunner, run_blocking

if TYPE_CHECKING:
    from execbox.contract.backend import ExecutionBackend

#: The time box of each check of `doctor --self-check` (the slowest, a warm pool member's start and runs, take ~1 min).
CHECK_BOX_S = 300.0


async def _probe(runner: AsyncRunner, name: str) -> dict[str, Any]:
    """What `backends` and `doctor` say of one backend: can it run here, and what does it enforce."""
    cls = runner.registry.get(name).cls
    row: dict[str, Any] = {"name": cls.name, "summary": cls.summary, "available": False, "reason": None,
                           "fix": None, "capabilities": cls.capabilities.model_dump(mode="json"),
                           "notes": [], "details": {}, "warning": None}
    bound = runner.listing_bound
    try:
        backend = runner.backend(name)
        row["notes"] = backend.notes()
        # The runner's bound, not a cancel scope: a check blocked in a thread does not hear a cancellation.
        caps = await bounded(backend.check(), bound, backend=backend, doing="its availability check")
        row["available"] = True
        row["capabilities"] = caps.model_dump(mode="json")
        row["details"] = backend.details()
        row["notes"] = backend.notes()
    except BackendTimeoutError:
        row["reason"] = f"the availability check did not answer within {bound:g}s"
    except MissingExtraError as exc:
        row["reason"], row["fix"] = exc.reason, exc.fix
        if exc.present:  # the engine is here, only its extra is not: auto quietly picks a weaker sandbox
            row["warning"] = (f"{exc.present} is here, but the {cls.name} backend needs its extra: {exc.fix} "
                              "(until then auto passes it over)")
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


@click.command()
@click.option("--json", "as_json", is_flag=True)
def backends(as_json: bool) -> None:
    """List every registered backend: where it comes from, whether it runs here, what it enforces."""
    runner = AsyncRunner(load_settings(as_json))
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
    try:
        verdict = runner.judge(backend, Capabilities(**row["capabilities"]) if row["available"] else None)
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


def _self_check(runner: AsyncRunner, name: str | None, as_json: bool, time_box_s: float,
                only: tuple[str, ...]) -> list[dict[str, Any]]:
    """The kit's checks (``only`` these when given), each under ``time_box_s``; in text mode each verdict is printed
    as soon as it is reached."""
    from execbox.testing.checks import CHECKS, CheckResult, self_check  # the kit's checks, run outside pytest

    if name is None:
        try:
            name = run_blocking(runner.select)[0].name
        except ExecboxError as exc:
            fail(exc, as_json)
    backend = name

    def say(check: CheckResult) -> None:
        click.echo(f"self-check {backend}: {check.status:<4} {check.name}: {check.message}")

    if not as_json:
        click.echo(f"self-check {backend}: {len(only or CHECKS)} checks, each within {time_box_s:g} s")
    found = self_check(backend, runner.settings, checks=only or None, time_box_s=time_box_s,
                       on_result=None if as_json else say)
    return [{"backend": backend, **dataclasses.asdict(r)} for r in found]


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--self-check", "run_self_check", is_flag=True,
              help="Also run the conformance kit's checks against one backend (--backend, default: auto's pick).")
@click.option("--backend", "check_backend", help="The backend --self-check runs against.")
@click.option("--check-timeout", "check_timeout", type=click.FloatRange(min=0, min_open=True), default=CHECK_BOX_S,
              show_default=True, help="--self-check: the time box of each check, seconds; one still running then "
              "fails and is left behind.")
@click.option("--check", "only", multiple=True, metavar="NAME",
              help="--self-check: run only this check (repeatable); default: every check of the kit.")
def doctor(as_json: bool, run_self_check: bool, check_backend: str | None, check_timeout: float,
           only: tuple[str, ...]) -> None:
    """Check every backend here: can it run, what it enforces, the guard's verdict, how to fix what is missing,
    and which variables configure it.

    Exits 0 when at least one sandbox backend can run here (and, with --self-check, every check that ran
    passed), 1 otherwise.
    """
    runner = AsyncRunner(load_settings(as_json))
    if only:
        from execbox.testing.checks import CHECKS  # the kit's checks: imported only for --self-check

        unknown = sorted(set(only) - set(CHECKS))
        if unknown:
            fail(ConfigError(f"no such check: {', '.join(unknown)}; the kit's checks are {', '.join(CHECKS)}"),
                 as_json)
    rows = _probe_all(runner)
    for row in rows:
        row["settings"] = _variables(runner.registry.get(row["name"]).cls.settings_model)
        row["guard_admits"], row["guard_verdict"], row["sandbox_here"] = False, row["reason"], False
        if row["available"]:
            backend = runner.backend(row["name"])
            row["guard_admits"], row["guard_verdict"] = _guard_verdict(runner, backend, row)
            verdict = runner.verdict(backend)
            # Counts only a real sandbox here: not one the guard refuses, not one that is only attested.
            row["sandbox_here"] = row["guard_admits"] and verdict.sandbox and not verdict.attested
    try:
        auto = run_blocking(runner.select)[0].name if runner.settings.backend == "auto" else runner.settings.backend
    except ExecboxError:
        auto = None
    passed_over = runner.auto_passed_over if runner.settings.backend == "auto" and auto else []
    checks = _self_check(runner, check_backend, as_json, check_timeout, only) if run_self_check else []
    core_settings = _variables(Settings)
    audit_health = audit_log.health(runner.audit)
    ok = any(r["sandbox_here"] for r in rows) and not any(c["status"] == "fail" for c in checks)
    report = {"ok": ok, "selected_backend": auto, "auto_passed_over": passed_over, "local_mode": runner.settings.local,
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
        for problem in [*runner.registry.problems, *(r["warning"] for r in rows if r["warning"])]:
            click.echo(f"warning: {problem}")
        click.echo(f"audit log: {audit_health['path']} ({audit_health['chain']} chain)" if audit_health["enabled"]
                   else "audit log: off")
        for problem in audit_health["problems"]:
            click.echo(f"warning: {problem}")
        click.echo("")
        if ok:
            click.echo(f"ok: a sandbox backend can run here; CODE_EXEC_BACKEND={runner.settings.backend} uses "
                       f"{auto or '(see above)'}")
            for why in passed_over:  # auto's order: microvm, gvisor, container, namespace
                click.echo(f"  auto passed over {why}")
        else:
            click.echo("no sandbox backend can run here: apply one of the fixes above (e.g. install bubblewrap, or "
                       "start docker)")
    sys.exit(0 if ok else 1)

