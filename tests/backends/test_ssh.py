"""The ssh backend against a real OpenSSH server: host keys, errors, attestation, env, workspaces, kills."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import anyio
import pytest

from execbox import (
    BackendUnavailableError,
    ExecRequest,
    Limits,
    NotASandboxError,
    Runner,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    Settings,
    WorkspacePathError,
)
from execbox.backends.ssh import SshBackend
from execbox.contract.backend import SessionSpec
from execbox.plugin import ExecSpec
from execbox.runner import AsyncRunner, run_blocking
from tests.support.sshd import SshServer, paramiko_installed, remote_processes, sshd_server  # noqa: F401  (fixtures)
from tests.support.waiting import wait_until

# every test here needs paramiko: missing, it is a skip on a laptop and a failure in CI (engine_missing)
pytestmark = pytest.mark.usefixtures("paramiko_installed")


@pytest.fixture
def ssh_env(sshd_server: SshServer, monkeypatch: pytest.MonkeyPatch):
    """Point the backend at the test server; returns a setter for more CODE_EXEC_SSH_* variables."""
    for name, value in sshd_server.settings_env().items():
        monkeypatch.setenv(name, value)

    def set_more(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_more


def runner(**settings) -> Runner:
    return Runner(Settings.from_env(backend="ssh", network="host", **settings))


def attested(ssh_env) -> Runner:
    ssh_env(CODE_EXEC_SSH_SANDBOXED="true")
    return runner()



def leftovers(server: SshServer, marker: str) -> list[str]:
    return [line for line in remote_processes(server) if marker in line]


def accepted_logins(server: SshServer) -> int:
    return server.log.count("Accepted publickey")


# --- host keys and connection errors ------------------------------------------------------------------

def test_unknown_host_key_refused(ssh_env, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    ssh_env(CODE_EXEC_SSH_KNOWN_HOSTS=str(empty), CODE_EXEC_SSH_SANDBOXED="true")
    with pytest.raises(BackendUnavailableError, match="is not in .*refusing an unknown host") as info:
        runner().run(["true"])
    assert "ssh-keyscan" in info.value.message and "SHA256:" in info.value.message
    assert info.value.env_var == "CODE_EXEC_SSH_KNOWN_HOSTS"
    assert empty.read_text() == ""


def test_missing_known_hosts_file_refused(ssh_env, tmp_path: Path) -> None:
    ssh_env(CODE_EXEC_SSH_KNOWN_HOSTS=str(tmp_path / "nope"), CODE_EXEC_SSH_SANDBOXED="true")
    with pytest.raises(BackendUnavailableError, match="does not exist"):
        runner().run(["true"])


def _other_host_key_line(server: SshServer, tmp_path: Path) -> str:
    other = tmp_path / "other_host"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, b64 = (tmp_path / "other_host.pub").read_text().split()[:2]
    return f"[{server.host}]:{server.port} {kind} {b64}\n"


def test_changed_host_key_refused_even_with_auto_add(sshd_server: SshServer, ssh_env, tmp_path: Path) -> None:
    wrong = tmp_path / "known_hosts"
    wrong.write_text(_other_host_key_line(sshd_server, tmp_path))
    for auto_add in ("false", "true"):
        ssh_env(CODE_EXEC_SSH_KNOWN_HOSTS=str(wrong), CODE_EXEC_SSH_SANDBOXED="true",
                CODE_EXEC_SSH_AUTO_ADD_HOST_KEY=auto_add)
        with pytest.raises(BackendUnavailableError, match="HOST KEY MISMATCH") as info:
            runner().run(["true"])
        assert "ssh-keygen -R" in info.value.message


def test_auto_add_is_opt_in_and_said(sshd_server: SshServer, ssh_env, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("")
    ssh_env(CODE_EXEC_SSH_KNOWN_HOSTS=str(known), CODE_EXEC_SSH_SANDBOXED="true",
            CODE_EXEC_SSH_AUTO_ADD_HOST_KEY="true")
    result = runner().run(["true"])
    assert result.exit_code == 0
    assert any("trusted on first use" in note and "SHA256:" in note for note in result.notes), result.notes
    host_pub = Path(sshd_server.host_key_file + ".pub").read_text().split()[1]
    assert f"[{sshd_server.host}]:{sshd_server.port} ssh-ed25519 {host_pub}" in known.read_text()


def test_authentication_failure(ssh_env, tmp_path: Path) -> None:
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    ssh_env(CODE_EXEC_SSH_KEY_FILE=str(other), CODE_EXEC_SSH_SANDBOXED="true")
    with pytest.raises(BackendUnavailableError, match="authentication failed for execbox-ssh-test@") as info:
        runner().run(["true"])
    assert info.value.env_var == "CODE_EXEC_SSH_KEY_FILE"


def test_connection_refused(ssh_env) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: a connect is refused
        ssh_env(CODE_EXEC_SSH_PORT=str(port), CODE_EXEC_SSH_SANDBOXED="true")
        with pytest.raises(BackendUnavailableError, match=f"connection refused by 127.0.0.1:{port}"):
            runner().run(["true"])


def test_no_host_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODE_EXEC_SSH_SANDBOXED", "true")
    with pytest.raises(BackendUnavailableError, match="no remote host") as info:
        runner().run(["true"])
    assert info.value.env_var == "CODE_EXEC_SSH_HOST"


# --- the sandbox status is an attestation ---------------------------------------------------------------

def test_not_a_sandbox_unless_attested(ssh_env) -> None:
    assert SshBackend.capabilities.sandbox is False
    with pytest.raises(NotASandboxError, match="full privileges of the SSH user"):
        runner().run(["true"])
    # local mode admits it, and the result says what it is
    result = runner(local=True).run(["true"])
    assert result.exit_code == 0 and any("not a sandbox" in note for note in result.notes)


def test_attested_sandbox_says_so_everywhere(ssh_env) -> None:
    r = attested(ssh_env)
    backend = r.aio.backend("ssh")
    caps = anyio.run(backend.check)
    assert caps.sandbox is True and caps.remote is True
    verdict = backend.verdict(ExecRequest(argv=["true"]))
    assert verdict.sandbox and verdict.attested
    result = r.run(["true"])
    assert any("attested by the operator" in note for note in result.notes)
    with r.sandbox("ssh", network="host") as sb:
        assert any("attested by the operator" in note for note in sb.exec("true").notes)


# --- env, workspace ------------------------------------------------------------------------------------

def test_only_the_filtered_request_env_reaches_the_remote(ssh_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANG", "de_DE.UTF-8")  # would be forwarded by AcceptEnv LANG in a stock config
    result = attested(ssh_env).run(["python3", "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                                   env={"VISIBLE": "a b\nc'd", "AWS_SECRET_ACCESS_KEY": "x"})
    seen = json.loads(result.stdout)
    assert seen.pop("VISIBLE") == "a b\nc'd"
    assert seen.pop("EXECBOX_RUN_ID") and seen.pop("EXECBOX_SESSION_ID")
    workspace = seen.pop("HOME")
    assert workspace.startswith("/tmp/execbox-")
    assert seen == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                    "TMPDIR": "/tmp", "PYTHONUNBUFFERED": "1"}
    assert result.filtered_env == ["AWS_SECRET_ACCESS_KEY"]


def test_env_values_are_not_in_the_wrappers_command_line(sshd_server: SshServer, ssh_env) -> None:
    secret = f"value-{uuid.uuid4().hex}"
    result = attested(ssh_env).run("sleep 0.5; ps -eo args", env={"SOME_SETTING": secret})
    assert result.exit_code == 0 and "execbox-run" in result.stdout
    assert secret not in result.stdout


def test_each_run_has_its_own_workspace_removed_afterwards(sshd_server: SshServer, ssh_env) -> None:
    r = attested(ssh_env)
    first = r.run("pwd; stat -c %a%U .").stdout.split()
    second = r.run(["pwd"]).stdout.split()
    assert first[0] != second[0]
    assert first[1] == f"700{sshd_server.user}"
    for path in (first[0], second[0]):
        assert path.startswith("/tmp/execbox-") and not os.path.exists(path)  # the sshd runs on this machine


# --- timeouts, leftovers, output -----------------------------------------------------------------------

ESCAPES = """
import os, subprocess, sys, time
marker = sys.argv[1]
subprocess.Popen(["sh", "-c", "sleep 300; : " + marker], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    os.environ.clear()
    if os.fork() == 0:
        os.execvp("sh", ["sh", "-c", "sleep 301; : " + marker])
    os._exit(0)
print("started", flush=True)
time.sleep(300)
"""


def test_timeout_kills_the_remote_tree(sshd_server: SshServer, ssh_env) -> None:
    marker = f"leak-{uuid.uuid4().hex}"
    started = time.monotonic()
    result = attested(ssh_env).run(["python3", "-c", ESCAPES, marker], timeout=2)
    assert result.timed_out and result.stdout == "started\n"
    assert time.monotonic() - started < 10
    assert wait_until(lambda: not leftovers(sshd_server, marker), 3), leftovers(sshd_server, marker)


def test_background_processes_die_with_a_finished_run(sshd_server: SshServer, ssh_env) -> None:
    marker = f"bg-{uuid.uuid4().hex}"
    result = attested(ssh_env).run(f"(setsid sh -c 'sleep 300; : {marker}' &) ; sleep 300 & echo done")
    assert result.stdout == "done\n" and not result.timed_out
    assert wait_until(lambda: not leftovers(sshd_server, marker), 3), leftovers(sshd_server, marker)


def test_output_cap_is_streamed_not_buffered(ssh_env) -> None:
    r = attested(ssh_env)
    tracemalloc.start()
    try:
        result = r.run("head -c 60000000 /dev/zero | tr '\\0' x; echo; echo END", max_output_bytes=4096, timeout=60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.truncated and result.stdout.endswith("END\n")
    assert len(result.stdout) < 4096 + 200
    assert peak < 16 * 1024 * 1024, f"peak {peak} bytes while streaming 60 MB"


# --- sessions, files ------------------------------------------------------------------------------------

def test_session_keeps_one_connection_and_one_workspace(sshd_server: SshServer, ssh_env) -> None:
    r = attested(ssh_env)
    with r.sandbox("ssh", network="host") as sb:
        logins = accepted_logins(sshd_server)
        dirs = {sb.exec(["pwd"]).stdout for _ in range(3)}
        sb.write_file("a/b.txt", b"x")
        assert sb.read_file("a/b.txt") == b"x"
        assert len(dirs) == 1 and accepted_logins(sshd_server) == logins
        workspace = dirs.pop().strip()
        assert os.path.isdir(workspace)
    assert not os.path.exists(workspace)


def test_writes_through_a_planted_symlink_refused(sshd_server: SshServer, ssh_env, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    user = pwd.getpwnam(sshd_server.user)
    os.chown(outside, user.pw_uid, user.pw_gid)
    os.chmod(tmp_path, 0o755)
    with attested(ssh_env).sandbox("ssh", network="host") as sb:
        assert sb.exec(f"ln -s {outside} dir && ln -s {outside}/f.txt file.txt").exit_code == 0
        for target in ("dir/x.txt", "file.txt"):
            with pytest.raises(WorkspacePathError, match="symlink"):
                sb.write_file(target, b"escaped")
        with pytest.raises(WorkspacePathError, match="symlink"):
            sb.read_file("dir/x.txt")
    assert list(outside.iterdir()) == []


def test_dropped_connection_raises_and_leaves_nothing_behind(sshd_server: SshServer, ssh_env) -> None:
    ssh_env(CODE_EXEC_SSH_SANDBOXED="true")
    backend = SshBackend(Settings.from_env())
    marker = f"drop-{uuid.uuid4().hex}"
    state: dict = {}

    async def main() -> None:
        session = await backend.open_session(SessionSpec("host", Limits(), True, 600))
        state["workspace"] = session.workspace
        request = ExecSpec(argv=["sh", "-c", f"sleep 300; : {marker}"], timeout=120, max_output_bytes=1000,
                           network="host", limits=Limits(), workdir=session.workspace)

        async def cut() -> None:
            await anyio.sleep(1.5)
            assert leftovers(sshd_server, marker)
            session.conn.transport.sock.shutdown(socket.SHUT_RDWR)  # the network goes away mid-run

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cut)
                with pytest.raises(SandboxError, match="dropped mid-run") as info:
                    await session.exec(request)
                state["error"] = info.value
        finally:
            await session.close()

    anyio.run(main)
    assert state["error"].retryable
    assert wait_until(lambda: not leftovers(sshd_server, marker), 5), leftovers(sshd_server, marker)
    assert wait_until(lambda: not os.path.exists(state["workspace"]), 5)


def remote_workspaces() -> set[str]:
    return {name for name in os.listdir("/tmp") if re.fullmatch(r"execbox-\d+-[0-9a-f]{16}", name)}


def test_cancelled_open_closes_the_connection_and_removes_the_workspace(ssh_env, monkeypatch: pytest.MonkeyPatch
                                                                       ) -> None:
    """L1: asyncio's own cancellation returns at once while the worker thread goes on connecting and making
    the workspace; the session nobody received must still be closed."""
    from execbox.backends import ssh

    ssh_env(CODE_EXEC_SSH_SANDBOXED="true")
    opened: list = []
    real_open = ssh._Connection.open

    def slow_open(self):
        conn = real_open(self)
        opened.append(conn)
        time.sleep(1.5)  # the caller gives up here; the workspace is made after that
        return conn

    monkeypatch.setattr(ssh._Connection, "open", slow_open)
    before = remote_workspaces()
    backend = SshBackend(Settings.from_env())
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(backend.open_session(SessionSpec("host", Limits(), True, 600)), 0.5))
    assert wait_until(lambda: opened and opened[0].client is None, 20), "the connection is still open"
    assert remote_workspaces() == before


def test_gc_removes_expired_workspaces_only(sshd_server: SshServer, ssh_env) -> None:
    user = pwd.getpwnam(sshd_server.user)
    expired = Path(f"/tmp/execbox-1-{uuid.uuid4().hex[:16]}")
    fresh = Path(f"/tmp/execbox-{int(time.time()) + 3600}-{uuid.uuid4().hex[:16]}")
    for path in (expired, fresh):
        path.mkdir(mode=0o700)
        (path / "f").write_text("x")
        for p in (path, path / "f"):
            os.chown(p, user.pw_uid, user.pw_gid)
    try:
        ssh_env(CODE_EXEC_SSH_SANDBOXED="true")
        removed = anyio.run(SshBackend(Settings.from_env()).gc)
        assert f"127.0.0.1:{expired}" in removed
        assert not expired.exists() and fresh.exists()
    finally:
        subprocess.run(["rm", "-rf", str(expired), str(fresh)], check=True)


def test_invalid_setting_is_reported_when_used_not_at_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox import ConfigError

    monkeypatch.setenv("CODE_EXEC_SSH_PORT", "not-a-port")
    backend = SshBackend(Settings.from_env())  # `execbox backends` must still list every backend
    with pytest.raises(ConfigError, match="CODE_EXEC_SSH_PORT='not-a-port' is invalid"):
        backend.verdict(ExecRequest(argv=["true"]))  # the guard asks: the answer is the setting to fix
    with pytest.raises(ConfigError, match="CODE_EXEC_SSH_PORT='not-a-port' is invalid"):
        anyio.run(backend.check)


def test_without_remote_python_the_wrapper_still_kills_session_and_marked_processes(
        sshd_server: SshServer, ssh_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fallback when the host has no python3 (no subreaper): the run's session, its descendants and every
    process that kept the run's marker variable still die; only a double-forked orphan that also cleared its
    environment could escape (said in the backend's notes)."""
    from execbox.backends import ssh

    monkeypatch.setattr(ssh, "_REMOTE_PYTHON", "no-such-python3")
    marker = f"nopy-{uuid.uuid4().hex}"
    code = ("import os, subprocess, sys, time\n"
            "subprocess.Popen(['sh', '-c', 'sleep 300; : ' + sys.argv[1]], start_new_session=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    os.execvp('sh', ['sh', '-c', 'sleep 301; : ' + sys.argv[1]])\n"
            "print('started', flush=True)\ntime.sleep(300)\n")
    result = attested(ssh_env).run(["python3", "-c", code, marker], timeout=2)
    assert result.timed_out and result.stdout == "started\n"
    assert wait_until(lambda: not leftovers(sshd_server, marker), 3), leftovers(sshd_server, marker)


def test_absolute_paths_outside_the_workspace_go_through_the_remote_shell(ssh_env) -> None:
    r = attested(ssh_env)
    # The test server is this host: its paths are the remote's, reached as the remote user.
    tmp_path = Path(tempfile.mkdtemp(prefix="execbox-ssh-abs-"))
    tmp_path.chmod(0o777)
    target = tmp_path / "abs" / "f.bin"
    with r.sandbox("ssh", network="host") as sb:
        sb.write_file(str(target), b"\x00remote")
        assert sb.read_file(str(target)) == b"\x00remote"
        assert sb.exec(["pwd"], workdir=str(tmp_path / "wd")).stdout.strip() == str(tmp_path / "wd")
        with pytest.raises(SandboxFileNotFoundError):
            sb.read_file(str(tmp_path / "missing"))
        with pytest.raises(SandboxIsADirectoryError):
            sb.read_file(str(tmp_path))
    shutil.rmtree(tmp_path, ignore_errors=True)


# --- execbox kill --------------------------------------------------------------------------------------------

def test_kill_ends_the_session_s_remote_processes_and_its_owner_is_told(sshd_server: SshServer, ssh_env) -> None:
    marker = f"killed-{uuid.uuid4().hex}"
    said: list[BaseException | object] = []
    with attested(ssh_env).sandbox("ssh", network="host") as sb:
        sb.write_file("kept.txt", b"x")
        workspace = sb.exec(["pwd"]).stdout.strip()

        def hold() -> None:
            try:
                said.append(sb.exec(f"sleep 300; : {marker}", timeout=120))
            except Exception as exc:
                said.append(exc)

        holder = threading.Thread(target=hold)
        holder.start()
        assert wait_until(lambda: leftovers(sshd_server, marker), 10)

        async def kill() -> None:
            async with AsyncRunner(Settings.from_env(backend="ssh")) as other:
                await other.kill(sb.id)

        run_blocking(kill)
        holder.join(30)
        assert not holder.is_alive() and not leftovers(sshd_server, marker)
        assert isinstance(said[0], SandboxError) and "killed from outside" in str(said[0]), said
        assert not os.path.exists(workspace)  # its files went with it
        with pytest.raises(SandboxError, match=r"killed from outside \(`execbox kill`\)"):
            sb.exec("true")


@pytest.mark.parametrize("ref", ["../etc", "1-2", "9999999999-0123456789abcdef", "x" * 40])
def test_kill_refuses_what_names_no_session_here(ssh_env, ref: str) -> None:
    ssh_env(CODE_EXEC_SSH_SANDBOXED="true")
    backend = SshBackend(Settings.from_env(backend="ssh"))
    with pytest.raises(SandboxError, match="no ssh sandbox"):
        run_blocking(lambda: backend.kill(ref))
