"""Declared secrets on the real sandboxes (docker, bubblewrap; local_subprocess where it means something): the
command gets the value and uses it; the caller sees ``[secret NAME]``; and while the command runs, the value is
nowhere else: no host process's command line, no host process's environment but the command's own, no file
the run left (on the host or in the sandbox), not in the container's inspect output, labels or exec records,
not in the engine's log, execbox's log records or the audit log."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from execbox import ExecResult, Runner, Secret, Settings
from execbox.errors import BackendUnavailableError
from execbox.runner import run_blocking
from execbox.secrets.values import encodings
from execbox.testing import engine_missing
from tests.support.waiting import wait_until

pytestmark = pytest.mark.engine

NAME = "OPENAI_API_KEY"
DOCKERD_LOG = Path("/var/log/execbox-dockerd.log")
# Waits for the command to exist; never part of an assertion about speed.
WAIT_S = 60.0


@pytest.fixture(params=["docker", "bubblewrap", "local_subprocess"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name: str = request.param
    if name == "local_subprocess":
        monkeypatch.setenv("CODE_EXEC_LOCAL", "true")
    try:
        run_blocking(Runner(Settings.from_env()).aio.backend(name).check)
    except BackendUnavailableError as exc:
        engine_missing(f"{name} cannot run here: {exc}")
    return name


def network(backend: str) -> str:
    return "host" if backend == "local_subprocess" else "none"


def secret_value() -> str:
    return f"sk-test-{uuid.uuid4().hex}"


def forms_of(value: str) -> list[bytes]:
    """The value as the caller gives it, every encoding the redactor knows, and the octal escapes it travels in."""
    return sorted(encodings(value) | {"".join(f"\\{b:03o}" for b in value.encode()).encode()})


# --- the command uses it; the caller sees labels --------------------------------------------------------------

USE = f"""
import base64, hashlib, json, os, sys
from urllib.parse import quote
v = os.environ["{NAME}"]
print("sha", hashlib.sha256(v.encode()).hexdigest())
print("raw", v)
print("b64", base64.b64encode(v.encode()).decode(), "hex", v.encode().hex(), "url", quote(v, safe=""))
print("json", json.dumps({{"key": v}}))
print("stderr", v, file=sys.stderr)
"""


def test_a_script_uses_the_secret_and_printing_it_gives_the_label(backend: str) -> None:
    value = secret_value()
    with Runner() as runner:
        result = runner.run_code(USE, backend=backend, network=network(backend), secrets={NAME: Secret(value)})
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"sha {hashlib.sha256(value.encode()).hexdigest()}"  # the command had the real value
    label = f"[secret {NAME}]"
    assert lines[1:] == [f"raw {label}", f"b64 {label} hex {label} url {label}", f'json {{"key": "{label}"}}']
    assert result.stderr == f"stderr {label}\n"
    assert result.secrets == [NAME]
    assert not [f for f in forms_of(value) if f in result.model_dump_json().encode()]


def test_a_value_split_across_stream_chunks_is_redacted_in_the_stream(backend: str) -> None:
    value = secret_value()
    code = (f"import os, sys, time\nv = os.environ['{NAME}']\n"
            "for i in range(3):\n    sys.stdout.write(v[:9]); sys.stdout.flush(); time.sleep(0.05)\n"
            "    sys.stdout.write(v[9:] + '\\n'); sys.stdout.flush(); time.sleep(0.05)\n")
    chunks: list[str] = []
    with Runner() as runner:
        result = runner.run_code(code, backend=backend, network=network(backend), secrets={NAME: value},
                                 on_stdout=chunks.append)
    assert "".join(chunks) == result.stdout == f"[secret {NAME}]\n" * 3
    assert not any(value[i:i + 6] in "".join(chunks) for i in range(len(value) - 5))


# --- nowhere else ---------------------------------------------------------------------------------------------

HOLD = f"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
v = os.environ["{NAME}"].encode()
found = []
for top in sys.argv[2:]:
    for root, dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as fh:
                    if v in fh.read(1 << 20):
                        found.append(path)
            except OSError:
                pass
print("files holding it:", found, flush=True)
time.sleep(120)
"""


def command_argv(marker: str, backend: str) -> list[str]:
    """The command, and where it looks for files holding the value: its workspace, and its /tmp if its own."""
    return ["python3", "-c", HOLD, marker, ".", *([] if backend == "local_subprocess" else ["/tmp"])]


def the_command(argv: list[str]) -> int | None:
    """The host pid of the sandboxed command itself (whatever namespace it is in)."""
    want = b"\0".join(a.encode() for a in argv) + b"\0"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == want:
                return int(pid)
    return None


def host_processes_holding(forms: list[bytes], allowed: int) -> list[str]:
    """Every host process whose command line, or whose environment (but the command's own), holds the value."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for what in ("cmdline", "environ"):
            try:
                data = Path(f"/proc/{pid}/{what}").read_bytes()
            except OSError:  # gone, or a kernel thread
                continue
            if any(f in data for f in forms) and not (what == "environ" and int(pid) == allowed):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
                found.append(f"pid {pid} {what} ({cmd!r})")
    return found


def files_holding(forms: list[bytes]) -> list[str]:
    """Regular files under execbox's temporary directories (workspaces, session dirs, proxy dirs) holding it."""
    found = []
    tmp = tempfile.gettempdir()
    for entry in os.listdir(tmp):
        if not entry.startswith("execbox"):
            continue
        for root, _dirs, files in os.walk(os.path.join(tmp, entry)):
            for name in files:
                path = os.path.join(root, name)
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode) and st.st_size <= 1 << 20:
                        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                        with os.fdopen(fd, "rb") as fh:
                            data = fh.read()
                        if any(f in data for f in forms):
                            found.append(path)
    return found


def containers_holding(forms: list[bytes]) -> list[str]:
    """execbox's containers (and their exec records) whose inspect output holds it: config, env, labels, args."""
    from execbox.backends.docker import engine as de

    client, _, _ = de.connect()
    found = []
    for container in client.containers.list(ignore_removed=True, all=True, filters={"label": "io.execbox"}):
        blobs = {"inspect": json.dumps(container.attrs), "labels": json.dumps(container.labels)}
        for exec_id in container.attrs.get("ExecIDs") or []:
            with contextlib.suppress(Exception):
                blobs[f"exec {exec_id[:12]}"] = json.dumps(client.api.exec_inspect(exec_id))
        found += [f"{container.name}: {where}" for where, blob in blobs.items()
                  if any(f in blob.encode() for f in forms)]
    return found


@contextlib.contextmanager
def running(target: Any) -> Iterator[dict[str, Any]]:
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["result"] = target()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    try:
        yield box
    finally:
        thread.join(WAIT_S)


def test_while_it_runs_the_value_is_nowhere_but_in_the_command(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    nowhere_but_in_the_command(backend, False, caplog)


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
def test_a_docker_exec_in_a_session_too(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    """A session's exec takes another path on docker (docker exec into the running container)."""
    nowhere_but_in_the_command(backend, True, caplog)


def nowhere_but_in_the_command(backend: str, session: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    value, marker = secret_value(), f"marker-{uuid.uuid4().hex}"
    forms, argv = forms_of(value), command_argv(marker, backend)
    printed: list[str] = []
    engine_log = DOCKERD_LOG.stat().st_size if backend == "docker" and DOCKERD_LOG.exists() else None
    with Runner() as runner, contextlib.ExitStack() as stack:
        if session:
            sb = stack.enter_context(runner.sandbox(backend, network=network(backend), secrets={NAME: value}))

            def target() -> ExecResult:
                return sb.exec(argv, timeout=WAIT_S, on_stdout=printed.append)
        else:
            def target() -> ExecResult:
                return runner.run(argv, backend=backend, network=network(backend), timeout=WAIT_S,
                                  secrets={NAME: value}, on_stdout=printed.append)

        with running(target) as box:
            assert wait_until(lambda: printed or box, WAIT_S), "the command never started"
            pid = the_command(argv)
            assert pid is not None, box
            assert Path(f"/proc/{pid}/environ").read_bytes().count(value.encode()) == 1  # it is there, once
            assert host_processes_holding(forms, allowed=pid) == []
            assert files_holding(forms) == []
            if backend == "docker":
                assert containers_holding(forms) == []
            os.kill(pid, signal.SIGTERM)
        result = box.get("result")
        assert isinstance(result, ExecResult), box
        audit = Path(runner.audit.path).read_bytes()
    assert result.exit_code == 0, result
    assert result.stdout == "files holding it: []\n"  # nothing in the sandbox's workspace or /tmp either
    assert result.secrets == [NAME]
    assert not [f for f in forms if f in caplog.text.encode()]
    assert NAME.encode() in audit and not [f for f in forms if f in audit]
    if engine_log is not None:
        with DOCKERD_LOG.open("rb") as fh:
            fh.seek(engine_log)
            assert not [f for f in forms if f in fh.read()]
