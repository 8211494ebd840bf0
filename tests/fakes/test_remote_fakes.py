"""The remote-SDK fakes behave like their SDKs where our backends depend on it: errors in the same situations,
commands that really run, network deny that really holds, timeouts that really end things."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from execbox.fakes import _box
from execbox.testing import engine_missing


@pytest.fixture(autouse=True)
def _boxes_run_here() -> None:
    reason = _box.unavailable_reason()
    if reason:
        engine_missing(reason)


@pytest.fixture
def listener() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield srv.getsockname()[1]
    srv.close()


def probe(port: int) -> str:
    return (f"import socket; s = socket.socket(); s.settimeout(2)\n"
            f"try:\n    s.connect(('127.0.0.1', {port})); print('CONNECTED')\n"
            f"except OSError as e:\n    print('BLOCKED')")


# --- modal -----------------------------------------------------------------------------------------------


@pytest.fixture
def modal_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from execbox.fakes import modal as fake

    for var in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(var, raising=False)
    with fake.installed() as service:
        yield service


def test_modal_credentials(modal_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    import modal
    import modal.exception

    with pytest.raises(modal.exception.AuthError, match="Token missing"):
        modal.Client.from_env()
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-wrong")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-wrong")
    with pytest.raises(modal.exception.AuthError, match="UNAUTHENTICATED"):
        modal.App.lookup("x", create_if_missing=True)


def test_modal_sandbox(modal_fake, monkeypatch: pytest.MonkeyPatch, listener: int) -> None:
    import modal
    import modal.exception

    for k, v in modal_fake.credentials.items():
        monkeypatch.setenv(k, v)
    app = modal.App.lookup("t", create_if_missing=True)
    with pytest.raises(modal.exception.InvalidError):
        modal.Sandbox.create(app=app, workdir="relative")
    sb = modal.Sandbox.create(app=app, block_network=True, workdir="/w", timeout=60, tags={"k": "v"})
    assert [s.object_id for s in modal.Sandbox.list(app_id=app.app_id, tags={"k": "v"})] == [sb.object_id]
    p = sb.exec("python3", "-c", probe(listener), text=False)
    assert p.stdout.read() == b"BLOCKED\n"
    with pytest.raises(modal.exception.InvalidError):
        p2 = sb.exec("sh", "-c", "exit 3")
        p2.returncode  # noqa: B018 - before wait(): modal raises
    assert p2.wait() == 3
    assert sb.exec("sh", "-c", "kill -9 $$").wait() == 137
    started = time.monotonic()
    slow = sb.exec("sleep", "30", timeout=1)
    assert slow.stdout.read() == "" and slow.wait() == -1  # an exec timeout is -1, not an exception
    assert time.monotonic() - started < 10
    sb.filesystem.write_bytes(b"data", "/w/sub/f")
    assert sb.exec("cat", "sub/f").stdout.read() == "data"
    with pytest.raises(modal.exception.SandboxFilesystemNotFoundError):
        sb.filesystem.read_bytes("/w/missing")
    with pytest.raises(modal.exception.InvalidError):
        sb.filesystem.read_bytes("relative")
    sb.terminate()
    with pytest.raises(modal.exception.ConflictError):
        sb.exec("true")
    with pytest.raises(modal.exception.NotFoundError):
        modal.Sandbox.from_id("sb-nope")
    assert modal_fake.calls_to("Sandbox.create")[-1].kwargs["block_network"] is True


def test_modal_memory_limit_only_as_a_tuple(modal_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """An int is a request (a minimum) in modal; only (request, limit) is a limit, and the fake enforces it."""
    import modal

    for k, v in modal_fake.credentials.items():
        monkeypatch.setenv(k, v)
    app = modal.App.lookup("t", create_if_missing=True)
    hog = "b = bytearray(512 * 1024 * 1024); print('survived')"
    loose = modal.Sandbox.create(app=app, memory=128)
    assert loose.exec("python3", "-c", hog).stdout.read() == "survived\n"
    tight = modal.Sandbox.create(app=app, memory=(128, 128))
    p = tight.exec("python3", "-c", hog)
    assert p.stdout.read() == "" and p.wait() != 0


def test_modal_lifetime_ends_the_sandbox(modal_fake, monkeypatch: pytest.MonkeyPatch) -> None:
    import modal
    import modal.exception

    for k, v in modal_fake.credentials.items():
        monkeypatch.setenv(k, v)
    sb = modal.Sandbox.create(app=modal.App.lookup("t", create_if_missing=True), timeout=1)
    with pytest.raises(modal.exception.SandboxTimeoutError):
        sb.wait()
    assert sb.returncode == 124


# --- daytona ----------------------------------------------------------------------------------------------


@pytest.fixture
def daytona_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from execbox.fakes import daytona as fake

    for var in ("DAYTONA_API_KEY", "DAYTONA_JWT_TOKEN", "DAYTONA_ORGANIZATION_ID"):
        monkeypatch.delenv(var, raising=False)
    with fake.installed() as service:
        yield service


def test_daytona(daytona_fake, monkeypatch: pytest.MonkeyPatch, listener: int) -> None:
    import daytona

    with pytest.raises(daytona.DaytonaAuthenticationError, match="DAYTONA_API_KEY"):
        daytona.Daytona()
    monkeypatch.setenv("DAYTONA_API_KEY", "wrong")
    with pytest.raises(daytona.DaytonaAuthenticationError):
        daytona.Daytona().create()
    monkeypatch.setenv("DAYTONA_API_KEY", daytona_fake.credentials["DAYTONA_API_KEY"])
    client = daytona.Daytona()
    with pytest.raises(TypeError, match="network_blockall"):
        daytona.CreateSandboxFromImageParams(image="python:3.12", network_blockall=True)
    params = daytona.CreateSandboxFromImageParams(image="python:3.12", name="n1", network_block_all=True,
                                                  labels={"a": "b"}, resources=daytona.Resources(cpu=1, memory=1))
    sb = client.create(params)
    out = sb.process.exec(f"python3 -c \"{probe(listener)}\"; echo to-err >&2; exit 4", timeout=20)
    assert (out.exit_code, out.result) == (4, "BLOCKED\nto-err\n")  # stdout and stderr combined, as the SDK does
    assert sb.process.exec("kill -9 $$").exit_code == -1
    with pytest.raises(daytona.DaytonaTimeoutError):
        sb.process.exec("sleep 30", timeout=1)
    sb.fs.upload_files([daytona.FileUpload(b"x", "d/f")])
    assert sb.fs.download_file("/home/daytona/d/f") == b"x"
    with pytest.raises(daytona.DaytonaFileNotFoundError):
        sb.fs.download_file("missing")
    assert [s.name for s in client.list(daytona.ListSandboxesQuery(labels={"a": "b"}))] == ["n1"]
    sb.stop()
    with pytest.raises(daytona.DaytonaError):
        sb.process.exec("true")
    again = client.get("n1")
    again.start()
    assert again.process.exec("cat d/f").result == "x"
    again.delete()
    with pytest.raises(daytona.DaytonaNotFoundError):
        client.get("n1")


# --- vercel ------------------------------------------------------------------------------------------------


@pytest.fixture
def vercel_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from execbox.fakes import vercel as fake

    for var in ("VERCEL_TOKEN", "VERCEL_PROJECT_ID", "VERCEL_TEAM_ID", "VERCEL_OIDC_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with fake.installed() as service:
        yield service


def test_vercel(vercel_fake, monkeypatch: pytest.MonkeyPatch, listener: int,
                capsys: pytest.CaptureFixture[str]) -> None:
    from vercel.sandbox import sync

    with pytest.raises(sync.SandboxCredentialsError, match="VERCEL_TOKEN"):
        sync.create_sandbox()
    for k, v in vercel_fake.credentials.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TypeError):
        sync.create_sandbox(timeout=5)
    sb = sync.create_sandbox(name="v1", network_policy=sync.NetworkPolicy.deny_all(), tags={"execbox": "1"})
    done = sb.run_process("python3", ["-c", probe(listener)], capture_output=True)
    assert (done.returncode, done.stdout) == (0, "BLOCKED\n")
    sb.run_process("sh", ["-c", "echo printed-locally"])  # stdout=None: to the local stdout, not captured
    assert "printed-locally" in capsys.readouterr().out
    started = time.monotonic()
    killed = sb.run_process("sleep", ["30"], kill_after=1, capture_output=True)
    assert killed.returncode == 137 and time.monotonic() - started < 10
    sb.fs.write_bytes("a/b.txt", b"v")
    assert sb.fs.read_bytes("/vercel/sandbox/a/b.txt") == b"v"
    with pytest.raises(sync.SandboxPathNotFoundError):
        sb.fs.read_bytes("nope")
    query = sync.SandboxQueryByCreatedAt(tag=sync.TagFilter(key="execbox", value="1"))
    assert [s.name for s in sync.query_sandboxes(query=query)] == ["v1"]
    sb.stop()
    sb.destroy()
    with pytest.raises(sync.SandboxApiError) as info:
        sync.get_sandbox(name="v1")
    assert info.value.status_code == 404


def test_uninstall_restores_the_sdk_and_removes_the_boxes(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from execbox.fakes import modal as fake

    before = sys.modules.get("modal")
    with fake.installed() as service:
        for k, v in service.credentials.items():
            monkeypatch.setenv(k, v)
        import modal

        assert modal is not before and modal.__spec__.origin is None
        sb = modal.Sandbox.create(app=modal.App.lookup("t", create_if_missing=True))
        assert sb.box.dir.exists()
    assert sys.modules.get("modal") is before
    assert not sb.box.dir.exists() and not sb.box.running
