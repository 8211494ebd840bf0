"""A real OpenSSH server for tests, started on 127.0.0.1 by the test session.

What it sets up (root only, Debian's ``/usr/sbin/sshd``):

- a temp dir with its own ed25519 host key and its own ``sshd_config``
  (no PAM, public-key auth only, no forwarding, listening only on 127.0.0.1
  on a free port), so the machine's own sshd config and keys are never touched;
- a dedicated unprivileged user (``execbox-ssh-test``), created idempotently;
- a fresh client key for that user (authorized through the temp dir, never
  through the user's home) and a known_hosts file holding the server's key.

sshd runs in the foreground (``-D -e``) as a child of the test process, with a
parent-death signal so it cannot outlive the session even on a crash.

Use it as a fixture: ``from tests.support.sshd import sshd_server`` in a test module
(or a conftest) and ask for ``sshd_server``. When it cannot run (not root, sshd
missing) the fixture calls ``execbox.testing.engine_missing`` (skip on a laptop,
fail in CI); so does ``paramiko_installed`` when the ssh extra is missing.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from execbox.testing import engine_missing

SSHD = "/usr/sbin/sshd"
TEST_USER = "execbox-ssh-test"
_PR_SET_PDEATHSIG = 1


@dataclass
class SshServer:
    host: str
    port: int
    user: str
    key_file: str
    known_hosts: str
    workdir: Path
    host_key_file: str
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def settings_env(self) -> dict[str, str]:
        """The CODE_EXEC_SSH_* variables that point the backend at this server."""
        return {
            "CODE_EXEC_SSH_HOST": self.host,
            "CODE_EXEC_SSH_PORT": str(self.port),
            "CODE_EXEC_SSH_USER": self.user,
            "CODE_EXEC_SSH_KEY_FILE": self.key_file,
            "CODE_EXEC_SSH_KNOWN_HOSTS": self.known_hosts,
        }

    @property
    def log(self) -> str:
        path = self.workdir / "sshd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)


def why_not_runnable() -> str | None:
    """Why this machine cannot run the test sshd, or None when it can."""
    if os.geteuid() != 0:
        return "the test sshd needs root (it creates a user and runs /usr/sbin/sshd)"
    if not os.path.exists(SSHD):
        return "openssh-server is not installed (apt-get install -y openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is missing (apt-get install -y openssh-client)"
    return None


def ensure_test_user(name: str = TEST_USER) -> pwd.struct_passwd:
    """Create the unprivileged test user once; later calls reuse it."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--create-home", "--shell", "/bin/sh", name],
            check=True, capture_output=True,
        )
        entry = pwd.getpwnam(name)
    # useradd leaves the password as "!", which sshd without PAM reads as a
    # locked account and refuses even for key logins; "*" means "no password".
    subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True)
    return entry


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True, capture_output=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # runs in the child between fork and exec: SIGTERM when the test process dies
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _config(workdir: Path, port: int, user: str) -> str:
    return f"""\
ListenAddress 127.0.0.1
Port {port}
HostKey {workdir}/host_ed25519
PidFile none
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AuthenticationMethods publickey
# the key lives in the temp dir, not in the user's home; /tmp is world-writable,
# which StrictModes would reject for a path outside the home
AuthorizedKeysFile {workdir}/authorized_keys
StrictModes no
PermitRootLogin no
AllowUsers {user}
AllowTcpForwarding no
AllowAgentForwarding no
AllowStreamLocalForwarding no
X11Forwarding no
PermitTunnel no
PermitUserEnvironment no
PrintMotd no
MaxStartups 100
MaxSessions 50
ClientAliveInterval 5
ClientAliveCountMax 2
LogLevel VERBOSE
Subsystem sftp internal-sftp
"""


def _wait_ready(server: SshServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {server.proc.returncode}:\n{server.log}")
        try:
            with socket.create_connection((server.host, server.port), timeout=1) as s:
                if s.recv(64).startswith(b"SSH-2.0-"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd did not answer on {server.host}:{server.port}:\n{server.log}")


def start_sshd(user: str = TEST_USER) -> SshServer:
    """Start a private sshd on 127.0.0.1; the caller must call .stop()."""
    reason = why_not_runnable()
    if reason:
        raise RuntimeError(reason)
    ensure_test_user(user)
    # the privilege-separation dir sshd insists on (systemd creates it normally)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)

    workdir = Path(tempfile.mkdtemp(prefix="execbox-sshd-"))
    os.chmod(workdir, 0o755)  # sshd reads authorized_keys as root; the user needs nothing here
    _keygen(workdir / "host_ed25519", "execbox-test-host")
    _keygen(workdir / "client_ed25519", "execbox-test-client")
    shutil.copy(workdir / "client_ed25519.pub", workdir / "authorized_keys")
    os.chmod(workdir / "authorized_keys", 0o644)

    last_error = None
    for _ in range(5):  # a free port can be taken between probing and binding
        port = _free_port()
        config = workdir / "sshd_config"
        config.write_text(_config(workdir, port, user))
        host_pub = (workdir / "host_ed25519.pub").read_text().split()
        known_hosts = workdir / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
        subprocess.run([SSHD, "-t", "-f", str(config)], check=True, capture_output=True)
        log = open(workdir / "sshd.log", "ab")
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            preexec_fn=_die_with_parent,
        )
        log.close()
        server = SshServer(
            host="127.0.0.1", port=port, user=user,
            key_file=str(workdir / "client_ed25519"), known_hosts=str(known_hosts),
            workdir=workdir, host_key_file=str(workdir / "host_ed25519"), proc=proc,
        )
        try:
            _wait_ready(server)
            return server
        except RuntimeError as exc:
            last_error = exc
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)
    raise RuntimeError(f"could not start sshd: {last_error}")


def remote_processes(server: SshServer) -> list[str]:
    """`ps` lines of every process the test user owns (sshd's own excluded)."""
    out = subprocess.run(
        ["ps", "-u", server.user, "-o", "pid=,sid=,args="],
        capture_output=True, text=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip() and "sshd" not in line and "<defunct>" not in line]


_shared: SshServer | None = None


def shared_sshd() -> SshServer:
    """One sshd for the whole test process, started on first use."""
    global _shared
    if _shared is None or _shared.proc is None or _shared.proc.poll() is not None:
        _shared = start_sshd()
    return _shared


@pytest.fixture(scope="session")
def paramiko_installed():
    """The paramiko module: the ssh tests need it, so a missing one skips on a laptop and fails in CI."""
    try:
        import paramiko
    except ImportError:
        engine_missing("paramiko is not installed (pip install 'execbox[ssh]')")
    return paramiko


@pytest.fixture(scope="session")
def sshd_server():
    reason = why_not_runnable()
    if reason:
        engine_missing(reason)
    server = shared_sshd()
    yield server
    # several modules may import this fixture; each has its own session-scoped
    # copy, so stopping is idempotent and the first finalizer wins
    server.stop()
