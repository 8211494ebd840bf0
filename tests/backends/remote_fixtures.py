"""Shared by the modal, daytona and vercel_sandbox backend tests: the fake installed with valid credentials,
and a check that every call the backend made binds against the REAL SDK's signature."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from execbox.fakes import _box
from execbox.testing import engine_missing

CREDENTIAL_VARS = {
    "modal": ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_PROFILE", "MODAL_CONFIG_PATH",
              "MODAL_OAUTH_REFRESH_TOKEN"),
    "daytona": ("DAYTONA_API_KEY", "DAYTONA_JWT_TOKEN", "DAYTONA_ORGANIZATION_ID", "DAYTONA_SANDBOX_PERSIST"),
    "vercel": ("VERCEL_TOKEN", "VERCEL_PROJECT_ID", "VERCEL_TEAM_ID", "VERCEL_OIDC_TOKEN", "VERCEL_OIDC_TOKEN_FILE"),
}

# Recorded call name -> the real member, "module:qualname".
REAL = {
    "modal": {
        "Client.from_env": "modal:Client.from_env",
        "App.lookup": "modal:App.lookup",
        "Image.debian_slim": "modal:Image.debian_slim",
        "Image.from_registry": "modal:Image.from_registry",
        "Image.from_id": "modal:Image.from_id",
        "Sandbox.create": "modal:Sandbox.create",
        "Sandbox.from_id": "modal:Sandbox.from_id",
        "Sandbox.list": "modal:Sandbox.list",
        "Sandbox.exec": "modal:Sandbox.exec",
        "Sandbox.terminate": "modal:Sandbox.terminate",
        "Sandbox.get_tags": "modal:Sandbox.get_tags",
        "Sandbox.snapshot_filesystem": "modal:Sandbox.snapshot_filesystem",
        "SandboxFilesystem.read_bytes": "modal.sandbox.sandbox:SandboxFilesystem.read_bytes",
        "SandboxFilesystem.write_bytes": "modal.sandbox.sandbox:SandboxFilesystem.write_bytes",
        "SandboxFilesystem.make_directory": "modal.sandbox.sandbox:SandboxFilesystem.make_directory",
    },
    "daytona": {
        "Daytona": "daytona:Daytona",
        "Daytona.create": "daytona:Daytona.create",
        "Daytona.get": "daytona:Daytona.get",
        "Daytona.list": "daytona:Daytona.list",
        "Process.exec": "daytona._sync.process:Process.exec",
        "FileSystem.upload_file": "daytona._sync.filesystem:FileSystem.upload_file",
        "FileSystem.upload_files": "daytona._sync.filesystem:FileSystem.upload_files",
        "FileSystem.download_file": "daytona._sync.filesystem:FileSystem.download_file",
        "FileSystem.download_files": "daytona._sync.filesystem:FileSystem.download_files",
        "Sandbox.start": "daytona:Sandbox.start",
        "Sandbox.stop": "daytona:Sandbox.stop",
        "Sandbox.delete": "daytona:Sandbox.delete",
        "Sandbox.create_snapshot": "daytona:Sandbox.create_snapshot",
        "SnapshotService.delete": "daytona._sync.snapshot:SnapshotService.delete",
    },
    "vercel": {
        "create_sandbox": "vercel.sandbox.sync:create_sandbox",
        "get_sandbox": "vercel.sandbox.sync:get_sandbox",
        "query_sandboxes": "vercel.sandbox.sync:query_sandboxes",
        "run_process": "vercel.sandbox.sync:SyncSandbox.run_process",
        "fs.read_bytes": "vercel.sandbox.sync:SyncSandboxFilesystem.read_bytes",
        "fs.write_bytes": "vercel.sandbox.sync:SyncSandboxFilesystem.write_bytes",
        "stop": "vercel.sandbox.sync:SyncSandbox.stop",
        "destroy": "vercel.sandbox.sync:SyncSandbox.destroy",
    },
}


def fake_service(sdk: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The fake of ``sdk`` installed, with the credentials it accepts in the environment (and no others)."""
    reason = _box.unavailable_reason()
    if reason:
        engine_missing(reason)
    for var in CREDENTIAL_VARS[sdk]:
        monkeypatch.delenv(var, raising=False)
    fake = importlib.import_module(f"execbox.fakes.{sdk}")
    with fake.installed() as service:
        for key, value in service.credentials.items():
            monkeypatch.setenv(key, value)
        yield service


def real_member(spec: str) -> Any:
    mod, _, qual = spec.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def check_calls_against_real_sdk(sdk: str, service: Any) -> None:
    """Bind every recorded call against the real SDK (which must be installed: the extras install it)."""
    import sys

    top = REAL[sdk][next(iter(REAL[sdk]))].split(":")[0].split(".")[0]
    calls = list(service.calls)
    # The fake is installed under the SDK's name; look at the real SDK with the fake out of the way.
    saved = {n: m for n, m in sys.modules.items() if n == top or n.startswith(top + ".")}
    for name in saved:
        del sys.modules[name]
    try:
        if importlib.util.find_spec(top) is None:
            engine_missing(f"the real {sdk} SDK is not installed: pip install 'execbox[{sdk}]'")
        problems = []
        for call in calls:
            spec = REAL[sdk].get(call.name)
            assert spec is not None, f"the backend called {call.name}, which test_fake_surfaces does not cover"
            sig = inspect.signature(real_member(spec))
            args = list(call.args)
            if next(iter(sig.parameters), None) in ("self", "cls"):
                args.insert(0, None)
            try:
                sig.bind(*args, **call.kwargs)
            except TypeError as exc:
                problems.append(f"{call.name}{call.args}{dict(call.kwargs)}: {exc}")
        assert not problems, "calls that the real SDK would refuse:\n" + "\n".join(problems)
    finally:
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]
        sys.modules.update(saved)


def assert_settings_read_on_use(backend_cls: type, settings_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """An invalid backend setting must not break constructing the backend (`execbox backends` builds them all):
    it is a ConfigError, naming the variable and the backend, from check()."""
    import anyio

    from execbox import Settings
    from execbox.errors import ConfigError
    from execbox.plugin import setting

    class WithAStrictKnob(settings_cls):  # type: ignore[misc,valid-type]
        knob: int = setting("CODE_EXEC_TEST_KNOB", 1, "a number, for this test")

    monkeypatch.setattr(backend_cls, "settings_model", WithAStrictKnob)
    monkeypatch.setenv("CODE_EXEC_TEST_KNOB", "x")
    backend = backend_cls(Settings.from_env())
    with pytest.raises(ConfigError) as info:
        anyio.run(backend.check)
    assert (info.value.env_var, info.value.backend) == ("CODE_EXEC_TEST_KNOB", backend_cls.name)


# The call each fake records for a command run in the sandbox, and what the sandbox is ended with.
EXEC_CALL = {"modal": "Sandbox.exec", "daytona": "Process.exec", "vercel": "run_process"}
END_CALL = {"modal": "Sandbox.terminate", "daytona": "Sandbox.delete", "vercel": "destroy"}


def check_session_file_calls(sdk: str, backend: str, service: Any) -> None:
    """What every remote session shares (_remote.RemoteSession): no path check while only execbox has written
    to the workspace, one in the sandbox before every file call once code has run, a missing file is a
    WorkspacePathError naming the path, and a second close ends nothing twice."""
    import anyio

    from execbox import Settings
    from execbox.contract.backend import SessionSpec
    from execbox.contract.models import ExecSpec, Limits
    from execbox.errors import WorkspacePathError
    from execbox.runner import AsyncRunner

    def path_checks() -> int:
        return len([c for c in service.calls_to(EXEC_CALL[sdk]) if "realpath -m" in repr(c.args)])

    async def go() -> None:
        impl = AsyncRunner(Settings.from_env()).backend(backend)
        session = await impl.open_session(SessionSpec("none", Limits(), oneshot=False, lifetime_s=120))
        try:
            await session.write_file("a.txt", b"one")
            assert await session.read_file("a.txt", 1000) == b"one"
            with pytest.raises(WorkspacePathError, match="no such file in the workspace: 'nope.txt'"):
                await session.read_file("nope.txt", 1000)
            assert path_checks() == 0
            request = ExecSpec(argv=["cat", "a.txt"], timeout=30, max_output_bytes=1000, network="none",
                               limits=Limits(), workdir=session.workspace)
            assert (await session.exec(request)).stdout == "one"
            await session.write_file("a.txt", b"two")
            assert await session.read_file("a.txt", 1000) == b"two"
            with pytest.raises(WorkspacePathError, match="no such file in the workspace: 'nope.txt'"):
                await session.read_file("nope.txt", 1000)
            assert path_checks() == 3
        finally:
            await session.close()
        await session.close()

    anyio.run(go)
    assert len(service.calls_to(END_CALL[sdk])) == 1


@pytest.fixture
def recorded() -> Callable[[str, Any], None]:
    return check_calls_against_real_sdk


def check_snapshots(backend: str) -> Any:
    """Snapshot, fork(2), rollback, a sandbox from the snapshot and its deletion, on a remote backend through its
    fake: the workspace (the runner's part) and a file outside it (the provider's) come back, what came after the
    snapshot is gone, forks are independent. Returns the snapshot (deleted by then)."""
    from execbox import Runner, Settings

    def outside(sb: Any) -> str:
        return str(sb.exec(["cat", "/tmp/kept"]).stdout.strip())

    runner = Runner(Settings.from_env(backend=backend))
    with runner.sandbox(backend) as sb:
        sb.write_file("a.txt", b"one")
        assert sb.exec(["sh", "-c", "echo outside > /tmp/kept"]).exit_code == 0
        snap = sb.snapshot("first")
        assert (snap.backend, snap.name, snap.memory) == (backend, "first", False) and snap.refs
        sb.write_file("a.txt", b"two")
        assert sb.exec(["sh", "-c", "echo later > /tmp/kept && echo new > b.txt"]).exit_code == 0
        forks = sb.fork(2)
        try:
            for fork in forks:
                assert fork.read_file("a.txt") == b"two" and outside(fork) == "later"
            forks[0].write_file("a.txt", b"fork")
            assert forks[1].read_file("a.txt") == b"two" and sb.read_file("a.txt") == b"two"
        finally:
            for fork in forks:
                fork.close()
        # the fork's snapshot is removed when its last sandbox closes
        assert [s.id for s in runner.snapshots()] == [snap.id]
        sb.rollback(snap)
        assert sb.read_file("a.txt") == b"one" and outside(sb) == "outside"
        assert sb.exec(["test", "-e", "b.txt"]).exit_code == 1
    with runner.sandbox(from_snapshot=snap) as again:
        assert again.read_file("a.txt") == b"one" and outside(again) == "outside"
    runner.delete_snapshot(snap)
    runner.delete_snapshot(snap)  # a second time does nothing
    assert runner.snapshots() == []
    return snap


def check_restored_session_checks_paths(backend: str) -> None:
    """A session the backend opens from a snapshot resolves paths in the sandbox before its first file call: the
    snapshot's files may hold a link the code planted, and no exec of the new session has run yet."""
    import anyio

    from execbox import Runner, Settings
    from execbox.contract.backend import SessionSpec
    from execbox.contract.models import Limits
    from execbox.contract.snapshots import SnapshotRestore
    from execbox.errors import WorkspacePathError
    from execbox.runner import snapshots as store

    runner = Runner(Settings.from_env(backend=backend))
    with runner.sandbox(backend) as sb:
        assert sb.exec(["ln", "-s", "/etc/hostname", "link"]).exit_code == 0
        snap = sb.snapshot()

    async def go() -> None:
        impl = runner.aio.backend(backend)
        restore = SnapshotRestore(store.place_of(snap.id), snap.parts)
        session = await impl.open_session(SessionSpec("none", Limits(), oneshot=False, lifetime_s=120,
                                                      restore=restore))
        try:
            with pytest.raises(WorkspacePathError, match="leads out of the workspace"):
                await session.read_file("link", 1000)
        finally:
            await session.close()

    anyio.run(go)
    runner.delete_snapshot(snap)


def check_kill(backend: str, ended: Callable[[str], bool], foreign: str) -> None:
    """`execbox kill` of a sandbox another runner holds ends it through the provider (``ended(ref)``), and its
    owner's next call says so; a sandbox execbox did not make (``foreign``, its ref) and a ref that names none
    are refused."""
    import json

    from execbox import Runner, Settings
    from execbox.errors import SandboxError
    from execbox.runner import AsyncRunner, live, run_blocking

    with Runner(Settings.from_env(backend=backend)).sandbox(backend) as sb:
        sb.exec("true")
        ref = json.loads((live.live_dir() / f"{sb.id}.json").read_text())["ref"]
        assert ref and not ended(ref)

        async def kill(what: str, *, direct: bool = False) -> None:
            async with AsyncRunner(Settings.from_env(backend=backend)) as other:
                await (other.backend(backend).kill(what) if direct else other.kill(what))

        run_blocking(lambda: kill(sb.id))
        assert ended(ref)
        with pytest.raises(SandboxError, match=r"killed from outside \(`execbox kill`\)"):
            sb.exec("true")
    for bad in (foreign, "no-such-sandbox"):
        with pytest.raises(SandboxError, match="no .* sandbox .* of execbox on this host"):
            run_blocking(lambda bad=bad: kill(bad, direct=True))  # type: ignore[misc]
    assert not ended(foreign)
