"""`execbox ps` and `execbox kill`: sandboxes held by another process (a helper python process), on docker,
bubblewrap and the warm pool, and one-shot runs' sandboxes; the owner's next call after a kill; stale records; ids
that name nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner, Result

from execbox import Settings
from execbox.audit import reader as audit_reader
from execbox.cli import main
from execbox.config import paths
from execbox.errors import BackendUnavailableError, SandboxError
from execbox.runner import AsyncRunner, live, run_blocking
from execbox.testing import engine_missing

pytestmark = pytest.mark.engine

# The owner: holds one sandbox (or, "pool", one warm-pool member) and runs each argv (a JSON line on stdin) in it.
HOLDER = textwrap.dedent("""
    import json, sys, time
    from execbox import Runner, Settings
    backend, mode = sys.argv[1], sys.argv[2]
    settings = Settings.from_env(backend=backend)
    settings = settings.model_copy(update={"pool_size": 1}) if mode == "pool" else settings
    network = "host" if backend == "local_subprocess" else None
    with Runner(settings) as runner:
        if mode == "oneshot":  # each argv a one-shot run of its own
            print("ready", flush=True)
            for line in iter(sys.stdin.readline, ""):
                try:
                    result = runner.run(json.loads(line), backend=backend, network=network, timeout=60,
                                        limits={"memory_mb": 256})
                    print("ok", result.exit_code, result.pooled, flush=True)
                except Exception as exc:
                    print("error", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)
            sys.exit(0)
        if mode == "pool":
            deadline = time.monotonic() + 90
            while (ready := runner.warm(backend)) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            print("ready", ready, runner.aio.pool.errors or "", flush=True)
            sys.stdin.readline()
            sys.exit(0)
        with runner.sandbox(backend, network=network, limits={"memory_mb": 256}) as sb:
            if mode == "unwatched":  # docker's watchdog stopped (as where it cannot start): a SIGKILL leaves an orphan
                import os
                from execbox.backends.docker import session as ds
                if os.getpid() in ds._watchdogs:
                    ds._watchdogs[os.getpid()].kill()
                    ds._watchdogs[os.getpid()].wait()
            print(sb.id, flush=True)
            for line in iter(sys.stdin.readline, ""):
                try:
                    result = sb.exec(json.loads(line), timeout=60)
                    print("ok", result.exit_code, flush=True)
                except Exception as exc:
                    print("error", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)
""")

SECRET = "s3cr3t-argument-value"


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


class Holder:
    """A python process that holds a sandbox of ``backend`` (or a pool member) until its stdin closes."""

    def __init__(self, backend: str, mode: str = "sandbox", **env: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, backend, mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **env})
        self.first = self.line()

    def line(self) -> str:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().strip()
        assert got, f"the holder ended: {self.proc.stderr.read() if self.proc.stderr else ''}"
        return got

    def call(self, *argv: str) -> str:
        self.send(*argv)
        return self.line()

    def send(self, *argv: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for holder in made:
        holder.end()


def require(backend: str) -> None:
    async def check() -> None:
        async with AsyncRunner(Settings.from_env(backend=backend)) as runner:
            await runner.backend(backend).check()

    try:
        run_blocking(check)
    except BackendUnavailableError as exc:
        engine_missing(f"{backend} cannot run here: {exc}")


def rows() -> dict[str, dict[str, object]]:
    done = cli("ps", "--json")
    assert done.exit_code == 0, done.output
    return {r["id"]: r for r in json.loads(done.stdout)["sandboxes"]}


def recorded() -> dict[str, dict[str, object]]:
    """The rows from records: other processes of this user (other tests' state dirs) have sandboxes too, which
    their backends find (unrecorded, or orphans)."""
    return {k: r for k, r in rows().items() if r["kind"] not in ("orphan", "unrecorded")}


def wait_running(sandbox_id: str, what: str) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while (row := rows().get(sandbox_id)) is None or row["running"] != what:
        assert time.monotonic() < deadline, row
        time.sleep(0.05)
    return row


@pytest.mark.parametrize("backend", ["bubblewrap", "docker", "gvisor"])
def test_ps_sees_another_process_sandbox_and_kill_ends_it(backend: str, holders: list[Holder]) -> None:
    require(backend)
    holder = Holder(backend)
    holders.append(holder)
    sandbox_id = holder.first
    row = rows()[sandbox_id]
    assert row["backend"] == backend and row["pid"] == holder.proc.pid and row["pooled"] is False
    assert row["kind"] == "sandbox"
    assert row["network"] == "none" and row["limits"]["memory_mb"] == 256  # type: ignore[index]
    assert row["running"] == "idle" and not row["killed"]
    assert 0 <= row["age_s"] < 120 and 3000 < row["left_s"] <= 3600  # type: ignore[operator]
    assert set(row) == set(__import__("execbox.cli.ps", fromlist=["FIELDS"]).FIELDS)

    holder.send("/bin/sh", "-c", f"sleep 300 # {SECRET}")  # what runs: argv[0]'s name only, never its arguments
    row = wait_running(sandbox_id, "sh")
    table = cli("ps").stdout
    assert table.splitlines()[0].split() == ["ID", "KIND", "BACKEND", "PID", "NETWORK", "LIMITS", "AGE", "LEFT",
                                             "RUNNING"]
    line = next(ln for ln in table.splitlines() if ln.startswith(sandbox_id))
    assert f" {backend} " in line and line.endswith(" sh") and "mem=256M" in line and " sandbox " in line, line
    assert SECRET not in table and SECRET not in json.dumps(rows())
    assert SECRET not in (live.live_dir() / f"{sandbox_id}.json").read_text()
    assert oct((live.live_dir() / f"{sandbox_id}.json").stat().st_mode & 0o777) == "0o600"

    killed = cli("kill", sandbox_id)
    assert killed.exit_code == 0, killed.output
    assert killed.stdout == f"killed {sandbox_id} ({backend}, held by pid {holder.proc.pid})\n"
    interrupted = holder.line()  # the exec the kill cut short: its owner is told why
    assert interrupted.startswith("error SandboxError") and "killed from outside" in interrupted, interrupted
    after = holder.call("true")  # the owner's next call: a clear error, at once
    assert after.startswith("error SandboxError") and "killed from outside (`execbox kill`)" in after, after
    assert rows()[sandbox_id]["killed"] is True
    records = list(audit_reader.records(paths.state_dir() / "audit.jsonl"))
    kill = [r for r in records if r["event"] == "sandbox.kill"]
    assert len(kill) == 1 and kill[0]["session"] == sandbox_id and kill[0]["backend"] == backend
    assert kill[0]["owner_pid"] == holder.proc.pid and kill[0]["caller"]["pid"] == os.getpid()

    holder.end()  # the owner closes it: its record goes
    assert holder.proc.returncode == 0, holder.proc.stderr.read() if holder.proc.stderr else ""
    assert sandbox_id not in rows()
    assert not list(live.live_dir().iterdir())


def test_docker_kill_removes_the_container(holders: list[Holder]) -> None:
    require("docker")
    holder = Holder("docker")
    holders.append(holder)
    sandbox_id = holder.first
    ref = json.loads((live.live_dir() / f"{sandbox_id}.json").read_text())["ref"]
    labels = ["--filter", f"label=io.execbox.session={ref}"]
    listed = subprocess.run(["docker", "ps", "-aq", *labels], capture_output=True, text=True, timeout=60, check=True)
    assert listed.stdout.strip()
    assert cli("kill", sandbox_id).exit_code == 0
    listed = subprocess.run(["docker", "ps", "-aq", *labels], capture_output=True, text=True, timeout=60, check=True)
    assert listed.stdout.strip() == ""


def test_ps_lists_a_warm_pool_member_and_kill_ends_it(holders: list[Holder]) -> None:
    require("bubblewrap")
    holder = Holder("bubblewrap", "pool")
    holders.append(holder)
    assert holder.first == "ready 1", holder.first
    listed = rows()
    members = [r for r in listed.values() if r["pid"] == holder.proc.pid]
    assert len(members) == 1 and members[0]["pooled"] is True and members[0]["running"] == "idle", listed
    member = str(members[0]["id"])
    assert member.startswith("pool-") and members[0]["kind"] == "pooled"
    assert next(ln for ln in cli("ps").stdout.splitlines() if ln.startswith(member)).split()[1] == "pooled"
    done = cli("kill", "--json", member)
    assert done.exit_code == 0 and json.loads(done.stdout) == {"killed": member, "backend": "bubblewrap",
                                                               "pid": holder.proc.pid}, done.output
    holder.end()
    assert holder.proc.returncode == 0, holder.proc.stderr.read() if holder.proc.stderr else ""
    assert member not in rows()


def test_a_stale_record_is_not_listed_and_gc_removes_it(holders: list[Holder]) -> None:
    require("bubblewrap")
    holder = Holder("bubblewrap")
    holders.append(holder)
    sandbox_id = holder.first
    assert sandbox_id in rows()
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(timeout=30)
    assert recorded() == {}
    ref = json.loads((live.live_dir() / f"{sandbox_id}.json").read_text())["ref"]
    orphan = [r for r in rows().values() if r["pid"] == holder.proc.pid]  # its backend still finds it
    assert [(r["kind"], r["id"]) for r in orphan] == [("orphan", f"bubblewrap-{os.path.basename(ref)}")], orphan
    assert (live.live_dir() / f"{sandbox_id}.json").exists()
    half = live.live_dir() / f".{sandbox_id}.{holder.proc.pid}.tmp"  # as if it died between a write and its rename
    half.write_text("{")
    refused = cli("kill", sandbox_id)
    assert refused.exit_code == 2 and "no live sandbox" in refused.stderr, refused.output
    done = cli("gc", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["removed"]["live records"] == [f"live record {sandbox_id} (owner gone)"]
    assert not (live.live_dir() / f"{sandbox_id}.json").exists() and not half.exists()
    assert not [r for r in rows().values() if r["pid"] == holder.proc.pid]  # gc removed its sandbox too


def test_a_backend_that_cannot_kill_refuses_and_the_sandbox_lives_on(holders: list[Holder]) -> None:
    holder = Holder("local_subprocess", CODE_EXEC_LOCAL="true")
    holders.append(holder)
    assert rows()[holder.first]["backend"] == "local_subprocess"
    done = cli("kill", holder.first)
    assert done.exit_code == 125 and "cannot be ended from outside" in done.stderr, done.output
    assert "Traceback" not in done.stderr and not rows()[holder.first]["killed"]
    assert holder.call("true") == "ok 0"  # its owner goes on using it


@pytest.mark.parametrize("bad", ["../x", "", "a" * 65, "no-such-sandbox", "x/y", "--"])
def test_kill_refuses_ids_that_name_no_live_sandbox(bad: str, tmp_path: Path) -> None:
    done = cli("kill", "--", bad)
    assert done.exit_code == 2 and done.stdout == "", done.output
    assert done.stderr.startswith("execbox: ConfigError: ") and "Traceback" not in done.stderr, done.stderr
    as_json = cli("kill", "--json", "--", bad)
    assert as_json.exit_code == 2 and json.loads(as_json.stdout)["error"]["type"] == "ConfigError"
    assert cli("kill").exit_code == 2  # no id at all: a usage error
    assert not any(r["event"] == "sandbox.kill" for r in audit_reader.records(paths.state_dir() / "audit.jsonl"))


def test_ps_with_nothing_live() -> None:
    assert cli("ps").stdout.splitlines()[0].split() == ["ID", "KIND", "BACKEND", "PID", "NETWORK", "LIMITS", "AGE",
                                                        "LEFT", "RUNNING"]
    said = json.loads(cli("ps", "--json").stdout)
    assert set(said) == {"sandboxes", "unanswered"} and said["unanswered"] == {} and recorded() == {}


def test_ps_and_kill_through_the_resident_server(holders: list[Holder], tmp_path: Path) -> None:
    from tests.test_resident import Server, _env

    require("bubblewrap")
    holder = Holder("bubblewrap")
    holders.append(holder)
    server = Server(str(tmp_path / "execbox.sock"), _env())
    try:
        listed = server.run("ps", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [r["id"] for r in json.loads(listed.stdout)["sandboxes"]] == [holder.first]
        done = server.run("kill", holder.first)
        assert done.returncode == 0 and done.stdout.startswith(f"killed {holder.first} "), done.stderr
        assert "killed from outside" in holder.call("true")
        bad = server.run("kill", "../x")
        assert bad.returncode == 2 and "ConfigError" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["bubblewrap", "docker"])
def test_ps_lists_a_one_shot_run_and_kill_ends_it(backend: str, holders: list[Holder]) -> None:
    require(backend)
    holder = Holder(backend, "oneshot")
    holders.append(holder)
    assert holder.first == "ready"
    assert holder.call("true") == "ok 0 False" and recorded() == {}  # a one-shot's record goes with its sandbox
    assert not list(live.live_dir().glob("*"))

    holder.send("/bin/sh", "-c", f"sleep 300 # {SECRET}")
    deadline = time.monotonic() + 60
    while not (listed := [r for r in rows().values() if r["pid"] == holder.proc.pid]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert len(listed) == 1, listed
    row = listed[0]
    sandbox_id = str(row["id"])
    assert row["kind"] == "one-shot" and row["backend"] == backend and row["running"] == "sh", row
    assert row["pooled"] is False and row["network"] == "none" and row["limits"]["memory_mb"] == 256  # type: ignore[index]
    assert 0 <= row["age_s"] < 60 and 0 < row["left_s"] <= 60  # type: ignore[operator]  # its timeout, not its backstop
    line = next(ln for ln in cli("ps").stdout.splitlines() if ln.startswith(sandbox_id))
    assert line.split()[1:3] == ["one-shot", backend] and line.endswith(" sh"), line
    assert SECRET not in json.dumps(rows()) and SECRET not in (live.live_dir() / f"{sandbox_id}.json").read_text()
    assert oct((live.live_dir() / f"{sandbox_id}.json").stat().st_mode & 0o777) == "0o600"

    killed = cli("kill", sandbox_id)
    assert killed.exit_code == 0, killed.output
    said = holder.line()  # the run the kill cut short says why, not the backend's symptom
    assert said.startswith("error SandboxError") and f"sandbox {sandbox_id} was killed from outside" in said, said
    assert recorded() == {} and not list(live.live_dir().glob("*"))  # its record and kill marker went with it
    records = list(audit_reader.records(paths.state_dir() / "audit.jsonl"))
    assert [r["session"] for r in records if r["event"] == "sandbox.kill"] == [sandbox_id]
    # the one-shot's id in `execbox ps` is its id in the audit log (the run the kill ended: its signal's status)
    assert [r["oneshot"] for r in records if r["event"].startswith("exec") and r["session"] == sandbox_id] == [True]
    assert holder.call("true") == "ok 0 False"  # the next run is unaffected


def test_a_one_shot_served_by_the_warm_pool_is_listed_as_one(holders: list[Holder]) -> None:
    require("bubblewrap")
    holder = Holder("bubblewrap", "oneshot", CODE_EXEC_POOL_SIZE="1")
    holders.append(holder)
    deadline = time.monotonic() + 90
    while not any(r["kind"] == "pooled" for r in rows().values()):
        assert time.monotonic() < deadline, rows()
        holder.call("true")  # the first run starts the refill of its configuration
        time.sleep(0.2)
    holder.send("/bin/sleep", "300")
    while not (running := [r for r in rows().values() if r["kind"] == "one-shot"]):
        assert time.monotonic() < deadline, rows()
        time.sleep(0.05)
    assert running[0]["pooled"] is True and running[0]["running"] == "sleep", running
    assert cli("kill", str(running[0]["id"])).exit_code == 0
    assert "killed from outside" in holder.line()


def test_an_unreadable_record_being_written_is_not_collected(tmp_path: Path) -> None:
    """A one-shot's record is created in place: gc must not take it for a broken one while it is written."""
    live.live_dir().mkdir(parents=True, exist_ok=True)
    fresh, old = live.live_dir() / "beingwritten.json", live.live_dir() / "broken.json"
    fresh.write_text("")
    old.write_text("{")
    os.utime(old, (time.time() - 120, time.time() - 120))
    assert recorded() == {}
    done = cli("gc", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["removed"]["live records"] == ["live record broken (owner gone)"]
    assert fresh.exists() and not old.exists()


def _gone_owner(holder: Holder) -> None:
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(timeout=30)


@pytest.mark.parametrize("backend", ["bubblewrap", "docker", "gvisor"])
def test_an_orphan_is_listed_from_its_backend_and_kill_ends_it(backend: str, holders: list[Holder]) -> None:
    """Its owner was SIGKILLed before gc ran: no record lists it (stale), its backend's labels or files do."""
    require(backend)
    holder = Holder(backend, "unwatched")
    holders.append(holder)
    record = json.loads((live.live_dir() / f"{holder.first}.json").read_text())
    _gone_owner(holder)
    listed = rows()
    assert holder.first not in listed
    orphans = [r for r in listed.values() if r["kind"] == "orphan" and r["pid"] == holder.proc.pid]
    assert len(orphans) == 1, listed
    orphan = orphans[0]
    assert orphan["backend"] == backend and orphan["running"] is None and 0 <= orphan["age_s"] < 120  # type: ignore[operator]
    line = next(ln for ln in cli("ps").stdout.splitlines() if ln.startswith(str(orphan["id"])))
    assert line.split()[1:4] == ["orphan", backend, str(holder.proc.pid)], line

    done = cli("kill", "--json", str(orphan["id"]))
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == {"killed": orphan["id"], "backend": backend, "pid": holder.proc.pid}
    assert orphan["id"] not in rows()
    if backend == "docker":
        labels = ["--filter", f"label=io.execbox.session={record['ref']}"]
        left = subprocess.run(["docker", "ps", "-aq", *labels], capture_output=True, text=True, timeout=60, check=True)
        assert left.stdout.strip() == ""
    else:
        assert not os.path.lexists(record["ref"])  # its session directory, as gc would have removed it
    kills = [r for r in audit_reader.records(paths.state_dir() / "audit.jsonl") if r["event"] == "sandbox.kill"]
    assert [(k["session"], k["kind"], k["owner_pid"]) for k in kills] == [(orphan["id"], "orphan", holder.proc.pid)]
    again = cli("kill", str(orphan["id"]))
    assert again.exit_code == 2 and "no live sandbox" in again.stderr, again.output


def test_a_sandbox_without_a_record_is_listed_as_unrecorded(holders: list[Holder],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    require("bubblewrap")
    monkeypatch.setattr(live, "_OPENING_S", 0.0)  # listed at once (not only once it is older than an open takes)
    holder = Holder("bubblewrap")
    holders.append(holder)
    for said in live.live_dir().glob(f"{holder.first}.*"):  # as if its owner could not write it
        said.unlink()
    listed = [r for r in rows().values() if r["pid"] == holder.proc.pid]
    assert [(r["kind"], r["backend"]) for r in listed] == [("unrecorded", "bubblewrap")], listed
    assert 0 <= listed[0]["age_s"] < 60, listed  # type: ignore[operator]
    holder.send("/bin/sh", "-c", "sleep 300")
    time.sleep(1)  # nothing says it runs: no record
    started = time.monotonic()
    assert cli("kill", str(listed[0]["id"])).exit_code == 0
    ended = holder.line()  # what ran is ended (no record: no marker tells its owner why)
    assert ended != "ok 0" and time.monotonic() - started < 30, ended


def test_a_record_whose_sandbox_its_backend_does_not_find_is_not_listed() -> None:
    live.live_dir().mkdir(parents=True, exist_ok=True)
    me = live.owner_id()
    for backend in ("bubblewrap", "local_subprocess"):  # local_subprocess cannot say: its record is taken as is
        record = {"id": f"gone-{backend.replace('_', '-')}", "owner": me, "pid": os.getpid(), "backend": backend,
                  "ref": "/tmp/execbox-bwrap-1-2-nosuchsession", "created": time.time(),
                  "deadline": time.time() + 60, "running": "idle"}
        (live.live_dir() / f"{record['id']}.json").write_text(json.dumps(record))
    assert list(recorded()) == ["gone-local-subprocess"]


def test_a_backend_that_never_answers_does_not_hang_ps(monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox.backends.bubblewrap.backend import BubblewrapBackend

    async def never(self: object) -> None:
        await anyio.sleep_forever()

    monkeypatch.setattr(BubblewrapBackend, "owned", never)
    monkeypatch.setenv("CODE_EXEC_OPEN_TIMEOUT_SEC", "1")
    live.live_dir().mkdir(parents=True, exist_ok=True)
    record = {"id": "held", "owner": live.owner_id(), "pid": os.getpid(), "backend": "bubblewrap", "ref": "/nowhere",
              "created": time.time(), "deadline": time.time() + 60, "running": "idle"}
    (live.live_dir() / "held.json").write_text(json.dumps(record))
    started = time.monotonic()
    done = cli("ps", "--json")
    assert done.exit_code == 0 and time.monotonic() - started < 20, done.output
    said = json.loads(done.stdout)
    assert "held" in [r["id"] for r in said["sandboxes"]] and "bubblewrap" in said["unanswered"], said
    table = cli("ps")
    assert "execbox: bubblewrap did not say which sandboxes it has" in table.stderr


def test_a_rolled_back_sandbox_is_listed_and_killed_as_its_new_session() -> None:
    """A rollback replaces the sandbox's session: its record names the new one (what its backend finds, and kills)."""
    require("bubblewrap")

    async def go() -> None:
        async with AsyncRunner(Settings.from_env(backend="bubblewrap")) as runner, runner.sandbox("bubblewrap") as sb:
            await sb.rollback(await sb.snapshot())
            ref = json.loads((live.live_dir() / f"{sb.id}.json").read_text())["ref"]
            assert ref and os.path.isdir(ref)
            assert (await runner.sandboxes())[0][0]["id"] == sb.id
            await runner.kill(sb.id)
            with pytest.raises(SandboxError, match="killed from outside"):
                await sb.exec("true")

    run_blocking(go)
