"""The conformance kit against the ssh backend on a real OpenSSH server (tests/support/sshd.py)."""

from __future__ import annotations

import pytest

from execbox import Runner, Settings
from execbox.testing.conformance import BackendConformance
from tests.support.sshd import SshServer, paramiko_installed, sshd_server  # noqa: F401  (fixtures)


class TestSshConformance(BackendConformance):
    backend_name = "ssh"

    @pytest.fixture
    def runner(self, paramiko_installed, sshd_server: SshServer, monkeypatch: pytest.MonkeyPatch) -> Runner:
        for name, value in sshd_server.settings_env().items():
            monkeypatch.setenv(name, value)
        # the test server is disposable: the operator's attestation is what lets the guard admit it
        monkeypatch.setenv("CODE_EXEC_SSH_SANDBOXED", "true")
        return Runner(Settings.from_env(backend="ssh"))
