"""run_cell on the remote backends, against their fakes (which run commands for real in a local box) and a real
OpenSSH server: the interpreter needs nothing of a backend but persistent sessions whose execs may overlap,
so it works on modal, vercel and ssh (streaming) and on daytona (whose output comes when an exec ends)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from execbox import Runner, Settings
from tests.backends.remote_fixtures import fake_service
from tests.support.sshd import SshServer, paramiko_installed, sshd_server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.engine

BACKEND = {"modal": "modal", "vercel": "vercel_sandbox", "daytona": "daytona"}


@pytest.fixture(params=sorted(BACKEND))
def remote(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for _ in fake_service(request.param, monkeypatch):
        yield BACKEND[request.param]


def test_state_persists_and_a_timeout_interrupts_on_a_remote_backend(remote: str) -> None:
    check_cells(remote)


def test_state_persists_and_a_timeout_interrupts_over_ssh(paramiko_installed: None, sshd_server: SshServer,  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in sshd_server.settings_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CODE_EXEC_SSH_SANDBOXED", "true")  # the test's server is disposable (attested)
    monkeypatch.setenv("CODE_EXEC_NETWORK", "host")  # the remote host's own network: all ssh claims
    check_cells("ssh")


def check_cells(remote: str) -> None:
    with Runner(Settings.from_env()) as runner, runner.sandbox(remote) as sb:
        chunks: list[str] = []
        one = sb.run_cell("x = 41\nprint('hi')\nx + 1", on_stdout=chunks.append)
        assert one.ok and one.stdout == "hi\n" and [o.text for o in one.outputs] == ["42"], one
        assert "".join(chunks) == "hi\n" and one.notes == []
        slow = sb.run_cell("import time\ntime.sleep(60)", timeout=2)
        assert slow.timed_out and not slow.state_lost and slow.error is not None
        assert slow.error.name == "KeyboardInterrupt"
        three = sb.run_cell("x += 1\nx")
        assert [o.text for o in three.outputs] == ["42"] and three.execution_count == 3
