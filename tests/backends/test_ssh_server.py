"""The test sshd itself: a real OpenSSH server on 127.0.0.1 that accepts only the generated key."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.sshd import SshServer, paramiko_installed, sshd_server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("paramiko_installed")


def connect(server: SshServer, known_hosts: str | None = None, key_file: str | None = None):
    import paramiko

    client = paramiko.SSHClient()
    client.load_host_keys(known_hosts or server.known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(server.host, server.port, username=server.user, key_filename=key_file or server.key_file,
                   allow_agent=False, look_for_keys=False, timeout=10)
    return client


def test_key_login_with_strict_host_key_checking(sshd_server: SshServer) -> None:
    client = connect(sshd_server)
    try:
        _, stdout, _ = client.exec_command("id -un; pwd")
        assert stdout.read().decode().split() == [sshd_server.user, f"/home/{sshd_server.user}"]
    finally:
        client.close()


def test_unknown_host_key_refused(sshd_server: SshServer, paramiko_installed, tmp_path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(paramiko_installed.SSHException, match="not found in known_hosts"):
        connect(sshd_server, known_hosts=str(empty))


def test_other_key_refused(sshd_server: SshServer, paramiko_installed, tmp_path) -> None:
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    with pytest.raises(paramiko_installed.AuthenticationException):
        connect(sshd_server, key_file=str(other))


def test_listens_only_on_loopback(sshd_server: SshServer) -> None:
    config = (sshd_server.workdir / "sshd_config").read_text()
    assert "ListenAddress 127.0.0.1\n" in config
    assert "UsePAM no\n" in config and "PasswordAuthentication no\n" in config
