"""The conformance kit against the ssh backend on a real OpenSSH server (tests/support/sshd.py)."""

from __future__ import annotations

import pytest

from execbox import Runner, Settings
from execbox.testing.conformance import BackendConformance, Kit
from tests.support.sshd import SshServer, paramiko_installed, sshd_server  # noqa: F401  (fixtures)


class TestSshConformance(BackendConformance):
    backend_name = "ssh"

    @pytest.fixture
    def runner(self, paramiko_installed, sshd_server: SshServer,  # noqa: F811  (the fixtures imported above)
               monkeypatch: pytest.MonkeyPatch) -> Runner:
        for name, value in sshd_server.settings_env().items():
            monkeypatch.setenv(name, value)
        # the test server is disposable: the operator's attestation is what lets the guard admit it
        monkeypatch.setenv("CODE_EXEC_SSH_SANDBOXED", "true")
        return Runner(Settings.from_env(backend="ssh"))

    # CODE_EXEC_SSH_SANDBOXED is the operator's word that the host is disposable; the test's "remote" host is
    # this machine (sshd on loopback), so the kit rightly finds this host's files, processes and mount
    # namespace from inside. An attested sandbox is not an enforced one.
    ATTESTED = "the test's ssh host is this machine (loopback sshd): nothing isolates it, the sandbox is attested"

    @pytest.mark.xfail(strict=True, raises=AssertionError, reason=ATTESTED)
    def test_sandbox_host_files_hidden(self, kit: Kit) -> None:
        super().test_sandbox_host_files_hidden(kit)

    @pytest.mark.xfail(strict=True, raises=AssertionError, reason=ATTESTED)
    def test_sandbox_host_processes_hidden(self, kit: Kit) -> None:
        super().test_sandbox_host_processes_hidden(kit)

    @pytest.mark.xfail(strict=True, raises=AssertionError, reason=ATTESTED)
    def test_sandbox_request_env_stays_inside(self, kit: Kit) -> None:
        super().test_sandbox_request_env_stays_inside(kit)
