"""A program that leaves a sync sandbox (or a runner with a warm pool) open exits anyway, promptly, and leaves no
sandbox behind. Found measuring: a script that raised while a sandbox was open hung at exit for good, its session's
container running (the portal's clean-up waited on its event-loop thread, frozen by then)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.backends.test_docker import engine  # noqa: F401 - fixture
from tests.support.containers import containers_of

SCRIPT = textwrap.dedent("""
    import os, sys
    from execbox import Runner, Settings
    network = "host" if sys.argv[1] == "local_subprocess" else "none"  # local_subprocess enforces no other
    settings = Settings(backend=sys.argv[1], local=True, network=network, pool_size=int(sys.argv[2]))
    runner = Runner(settings).__enter__()          # never closed
    sandbox = runner.sandbox().__enter__()         # never closed
    result = sandbox.exec("pwd")
    print(result.stdout.strip(), flush=True)
    raise SystemExit(3)                            # an error outside any `with`
""")


def leave_open(backend: str, pool: int) -> tuple[subprocess.CompletedProcess[str], int]:
    child = subprocess.Popen([sys.executable, "-c", SCRIPT, backend, str(pool)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "CODE_EXEC_AUDIT_LOG": "off"})
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"the program hung at exit with its sandbox open: {err[-2000:]}")
    return subprocess.CompletedProcess(child.args, child.returncode, out, err), child.pid


@pytest.mark.parametrize("pool", [0, 2])
def test_a_forgotten_local_sandbox_is_closed_at_exit(pool: int) -> None:
    done, _ = leave_open("local_subprocess", pool)
    assert done.returncode == 3, done.stderr
    workspace = done.stdout.strip()
    assert workspace and not os.path.exists(workspace), f"the session's workspace {workspace} was left"


def test_a_forgotten_docker_sandbox_and_pool_leave_no_container(engine: Any) -> None:  # noqa: F811
    done, pid = leave_open("docker", 2)
    assert done.returncode == 3, done.stderr
    left = containers_of(engine, pid)
    assert not left, f"containers of the exited program: {left}"


FORKS = textwrap.dedent("""
    import os, sys
    from execbox import Runner, Settings
    from execbox.errors import SandboxError
    settings = Settings(backend="local_subprocess", local=True, network="host", pool_size=int(sys.argv[1]))
    with Runner(settings) as runner, runner.sandbox() as sandbox:
        print(sandbox.exec("pwd").stdout.strip(), flush=True)
        pid = os.fork()                             # what multiprocessing's fork workers do
        if pid == 0:
            try:
                sandbox.exec("true")
                print("the child used its parent's sandbox", flush=True)
            except SandboxError:
                print("child: not its sandbox", flush=True)
            sys.exit(5)                              # the child's exit must not wait on the parent's loop thread
        _, status = os.waitpid(pid, 0)
        print(f"child exit {os.waitstatus_to_exitcode(status)}", flush=True)
        print(sandbox.exec("echo parent still has it").stdout.strip(), flush=True)
""")


@pytest.mark.parametrize("pool", [0, 2])
def test_a_forked_child_exits_and_leaves_its_parents_sandbox_alone(pool: int) -> None:
    # Found reviewing: a child forked while a sync sandbox was open hung at exit for good (its inherited portal's
    # clean-up waited on the parent's event-loop thread, which the child does not have).
    child = subprocess.Popen([sys.executable, "-c", FORKS, str(pool)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "CODE_EXEC_AUDIT_LOG": "off"}, start_new_session=True)
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the hung grandchild too: it holds the pipes
        out, err = child.communicate()
        pytest.fail(f"hung: {out} {err[-2000:]}")
    lines = out.splitlines()
    assert child.returncode == 0, err
    assert lines[1:] == ["child: not its sandbox", "child exit 5", "parent still has it"], out
    assert not os.path.exists(lines[0]), "the workspace outlived the sandbox"
