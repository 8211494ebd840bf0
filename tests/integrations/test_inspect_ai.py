"""execbox as inspect_ai's sandbox environment: inspect's own provider self-check against docker and bubblewrap, a
real eval whose scripted model calls bash(), python() and text_editor(), the README's example, the config, the
lifecycle and the error mapping, and the pip hint without inspect_ai."""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from inspect_ai import eval as inspect_eval
from inspect_ai.util import (
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentLimits,
    SandboxEnvironmentSpec,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
)
from inspect_ai.util._sandbox import self_check
from inspect_ai.util._sandbox.limits import override_max_exec_output_size

# inspect's provider self-check: its checks are plain async test_* functions over a `sandbox_env` fixture (below).
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

import execbox
from execbox.errors import BackendUnavailableError, ConfigError
from execbox.integrations.inspect_ai import ExecboxSandboxConfig, ExecboxSandboxEnvironment
from execbox.testing import engine_missing, gvisor_runtime
from tests.fixtures.inspect_ai.tools_task import CALLS, scripted_model, tools_task

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The self-check's sandboxes: docker, bubblewrap and docker under gVisor.
CONFIGS = {
    "docker": ExecboxSandboxConfig(backend="docker"),
    "bubblewrap": ExecboxSandboxConfig(backend="bubblewrap"),
    "gvisor": ExecboxSandboxConfig(backend="docker", options={"runtime": "runsc"}),
}

#: The self-check's known failures, each with its reason (None: on every configuration); the README lists the same.
#: Strict xfails: one that starts passing fails the run, so this list stays true.
_BWRAP_TMP = ("bubblewrap without root: /tmp is a fresh tmpfs for each exec of a session (each exec is its own bwrap; "
              "as root a session keeps one), so what one call leaves in /tmp the next does not see")
KNOWN_FAILURES: dict[tuple[str, str | None], str] = {
    ("test_exec_as_user", None): "every command runs as the sandbox's one unprivileged user: exec as root or another "
                                 "user is refused (SandboxUserUnsupportedError), by design",
    ("test_cwd_absolute", "bubblewrap, not root"): _BWRAP_TMP,
    ("test_read_and_write_file_including_directory_absolute", "bubblewrap, not root"): _BWRAP_TMP,
    ("test_write_text_file_is_directory", "bubblewrap, not root"): _BWRAP_TMP,
    ("test_write_binary_file_is_directory", "bubblewrap, not root"): _BWRAP_TMP,
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The module's runners write their audit log to a fresh place (the per-test one comes after they are made)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CODE_EXEC_AUDIT_LOG", str(tmp_path_factory.mktemp("audit") / "audit.jsonl"))
        yield


async def _started(config: ExecboxSandboxConfig) -> None:
    try:
        await ExecboxSandboxEnvironment.task_init("test", config)
    except BackendUnavailableError as exc:
        engine_missing(f"{config.backend} cannot run here: {exc}")


@pytest.fixture(scope="module", params=list(CONFIGS))
async def provider(request: pytest.FixtureRequest, audit_dir: None) -> AsyncIterator[SandboxEnvironment]:
    """One sample's sandbox per configuration, through inspect's lifecycle, shared by the module's checks."""
    config = CONFIGS[request.param]
    if request.param == "gvisor":  # the runtime the set-up registered (skipped on a laptop without it; CI fails)
        config = config.model_copy(update={"options": {"runtime": gvisor_runtime()}})
    await _started(config)
    environments = await ExecboxSandboxEnvironment.sample_init("test", config, {})
    yield environments["default"]
    await ExecboxSandboxEnvironment.sample_cleanup("test", config, environments, False)
    await ExecboxSandboxEnvironment.task_cleanup("test", config, True)


class _StricterGrace:
    """The self-check waits 5 s after a timeout before it looks for the processes left over, for providers that
    kill them asynchronously; execbox has killed them when exec returns, so 0.5 s (a stricter check, 18 s less)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(anyio, name)

    @staticmethod
    async def sleep(seconds: float) -> None:
        await anyio.sleep(min(seconds, 0.5))


@pytest.fixture
def sandbox_env(provider: SandboxEnvironment, request: pytest.FixtureRequest,
                monkeypatch: pytest.MonkeyPatch) -> SandboxEnvironment:
    """The fixture inspect's self-check asks for; a known failure is a strict xfail with its reason."""
    name, config = request.node.originalname, request.node.callspec.params["provider"]
    reason = KNOWN_FAILURES.get((name, None)) or KNOWN_FAILURES.get((name, config)) or (
        KNOWN_FAILURES.get((name, f"{config}, not root")) if os.geteuid() != 0 else None)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    monkeypatch.setattr(self_check, "anyio", _StricterGrace())
    return provider


def test_known_failures_are_the_readmes() -> None:
    section = README.read_text(encoding="utf-8").split("## inspect_ai", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"`(test_\w+)`(?: \(([\w, ]+)\))?", section.split("known failures", 1)[1])
    assert {(name, config or None) for name, config in listed} == KNOWN_FAILURES.keys()


@pytest.mark.engine
async def test_exec_errors_map_to_inspects(provider: SandboxEnvironment) -> None:
    with override_max_exec_output_size(1024), pytest.raises(OutputLimitExceededError, match="limit of 1 KiB"):
        await provider.exec(["head", "-c", "4096", "/dev/zero"])
    with pytest.raises(SandboxUserUnsupportedError, match="by design"):
        await provider.exec(["id"], user="root")
    me = (await provider.exec(["id", "-un"])).stdout.strip()
    assert (await provider.exec(["id", "-un"], user=me)).stdout.strip() == me  # the sandbox's own user is fine


@pytest.mark.engine
async def test_a_closed_sandbox_is_unavailable(audit_dir: None) -> None:
    config = ExecboxSandboxConfig(backend="bubblewrap")
    environments = await ExecboxSandboxEnvironment.sample_init("test", config, {})
    await ExecboxSandboxEnvironment.sample_cleanup("test", config, environments, True)
    with pytest.raises(SandboxUnavailableError, match="closed"):
        await environments["default"].exec(["true"])
    await ExecboxSandboxEnvironment.task_cleanup("test", config, True)


@pytest.mark.engine
async def test_the_pool_opens_sandboxes_ahead_and_closes_what_is_left(audit_dir: None) -> None:
    from execbox.integrations import inspect_ai as provider_module

    config = ExecboxSandboxConfig(backend="bubblewrap", pool=2)
    await _started(config)
    ready = provider_module._configured[config].ready
    assert len(ready) == 2
    environments = await ExecboxSandboxEnvironment.sample_init("test", config, {})
    taken = environments["default"].as_type(ExecboxSandboxEnvironment).sandbox
    assert len(ready) == 1 and taken not in ready
    await ExecboxSandboxEnvironment.sample_cleanup("test", config, environments, False)
    assert len(ready) == 2  # the next sample's, opened as this one ended
    left = list(ready)
    await ExecboxSandboxEnvironment.task_cleanup("test", config, True)
    for sandbox in [taken, *left]:
        with pytest.raises(execbox.SandboxError, match="closed"):
            sandbox.workspace  # noqa: B018 - closed


@pytest.mark.engine
async def test_two_tasks_with_one_config_share_it_until_the_last_ends(audit_dir: None) -> None:
    from execbox.integrations import inspect_ai as provider_module

    config = ExecboxSandboxConfig(backend="bubblewrap")
    await ExecboxSandboxEnvironment.task_init("first", config)
    await ExecboxSandboxEnvironment.task_init("second", config)
    await ExecboxSandboxEnvironment.task_cleanup("first", config, True)
    environments = await ExecboxSandboxEnvironment.sample_init("second", config, {})  # still open for the second
    assert (await environments["default"].exec(["echo", "ok"])).stdout == "ok\n"
    await ExecboxSandboxEnvironment.sample_cleanup("second", config, environments, False)
    await ExecboxSandboxEnvironment.task_cleanup("second", config, True)
    assert config not in provider_module._configured


def test_a_bound_the_operator_set_stays_a_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    from execbox.integrations.inspect_ai import _bounds

    config = ExecboxSandboxConfig(backend="bubblewrap", timeout=600)
    unset = _bounds(config)  # nothing set: inspect's limits and the task's timeout
    assert unset.max_timeout_sec == 600 and unset.max_output_bytes == SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
    monkeypatch.setenv("CODE_EXEC_MAX_TIMEOUT_SEC", "5")
    monkeypatch.setenv("CODE_EXEC_MAX_OUTPUT_BYTES", "1000")
    capped = _bounds(config)
    assert capped.max_timeout_sec == 5 and capped.max_output_bytes == 1000
    assert capped.max_read_bytes == SandboxEnvironmentLimits.MAX_READ_FILE_SIZE


@pytest.mark.engine
async def test_a_config_the_guard_refuses_fails_task_init(audit_dir: None) -> None:
    config = ExecboxSandboxConfig(backend="bubblewrap", pool=2, tmpfs=("/proc/x",))
    try:
        with pytest.raises(execbox.RefusedError, match="/proc"):  # the error itself, not an ExceptionGroup
            await _started(config)
    finally:
        await ExecboxSandboxEnvironment.task_cleanup("test", config, True)


@pytest.mark.engine
async def test_cli_cleanup_is_execbox_gc(capsys: pytest.CaptureFixture[str]) -> None:
    await ExecboxSandboxEnvironment.cli_cleanup("bubblewrap")
    assert "execbox gc: bubblewrap: removed" in capsys.readouterr().out


def test_inspect_finds_execbox_through_its_entry_point() -> None:
    from importlib.metadata import entry_points

    from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

    # What inspect loads from the installed package's metadata (ensure_entry_points), and what it then finds.
    [entry] = [e for e in entry_points(group="inspect_ai") if e.name == "execbox"]
    assert entry.load() is importlib.import_module("execbox.integrations.inspect_ai")
    assert registry_find_sandboxenv("execbox") is ExecboxSandboxEnvironment


def test_config_round_trips_through_inspect() -> None:
    config = ExecboxSandboxConfig(backend="docker", image="execbox-sandbox:bookworm", network="none",
                                  limits=execbox.Limits(memory_mb=512, cpus=0.5), pool=3, timeout=120,
                                  mounts=(execbox.Mount(source="/srv/data", target="/data"),),
                                  tmpfs=("/var/tmp", "/home/agent"), options={"runtime": "runc"})
    spec = SandboxEnvironmentSpec("execbox", config)
    back = SandboxEnvironmentSpec.model_validate(json.loads(spec.model_dump_json()))  # as a log is read back
    assert back.config == config and isinstance(back.config, ExecboxSandboxConfig)
    assert hash(back.config) == hash(config)  # inspect keeps specs in sets
    assert ExecboxSandboxEnvironment.config_deserialize({}) == ExecboxSandboxConfig()


def test_config_from_a_file_and_bad_configs(tmp_path: Path) -> None:
    from execbox.integrations.inspect_ai import _config

    path = tmp_path / "execbox.yaml"
    path.write_text("backend: bubblewrap\npool: 1\ntmpfs: [/var/tmp]\n")
    assert _config(str(path)) == ExecboxSandboxConfig(backend="bubblewrap", pool=1)
    typo = tmp_path / "typo.json"
    typo.write_text('{"backend": "bubblewrap", "pools": 1}')
    with pytest.raises(ConfigError, match="pools"):
        _config(str(typo))
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        _config(str(tmp_path / "nowhere.yaml"))


def test_without_inspect_ai_the_import_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in sys.modules if name.split(".")[0] == "inspect_ai"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "execbox.integrations.inspect_ai")
    with pytest.raises(BackendUnavailableError, match=re.escape("pip install 'execbox[inspect]'")):
        importlib.import_module("execbox.integrations.inspect_ai")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No name resolves but loopback's: whatever inspect would fetch (a tokenizer, a model) fails the eval."""
    asked: list[str] = []
    resolve = socket.getaddrinfo

    def loopback_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(str(host))
        if host not in ("localhost", "127.0.0.1", "::1"):
            raise OSError(f"this test runs offline: no lookup of {host}")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    return asked


def _run(tasks: Any, log_dir: Path, **kwargs: Any) -> Any:
    # In a thread of its own: the module's async fixtures keep anyio's event loop running on this thread until the
    # module ends, and inspect's eval starts a loop of its own (anyio.run), which a thread may run only one of
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        [log] = pool.submit(inspect_eval, tasks, display="none", log_dir=str(log_dir), log_format="json",
                            **kwargs).result()
    assert log.status == "success", log.error
    return log


@pytest.mark.engine
def test_an_eval_runs_bash_python_and_text_editor(tmp_path: Path, offline: list[str], audit_dir: None) -> None:
    log = _run(tools_task(backend="docker"), tmp_path)
    [sample] = log.samples
    outputs = [m.text for m in sample.messages if m.role == "tool"]
    errors = [m.error for m in sample.messages if m.role == "tool" and m.error]
    assert not errors and len(outputs) == len(CALLS)
    assert "bash says 42 as nobody" in outputs[0]
    assert "python says 42" in outputs[1]
    assert "editor wrote this" in outputs[3] and outputs[4] == "editor wrote this\n"
    assert sample.scores and next(iter(sample.scores.values())).value == "C"
    assert not [host for host in offline if host not in ("localhost", "127.0.0.1", "::1")]


@pytest.mark.engine
def test_the_readme_example_runs(tmp_path: Path, offline: list[str], audit_dir: None,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    section = README.read_text(encoding="utf-8").split("## inspect_ai", 1)[1].split("\n## ", 1)[0]
    example = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert example is not None
    task_file = tmp_path / "hello_execbox.py"
    task_file.write_text(example[1])
    monkeypatch.chdir(tmp_path)  # as a user runs it: `inspect eval hello_execbox.py`
    log = _run(task_file.name, tmp_path / "logs", model=scripted_model([("bash", {"command": "python3 -V"})], "3.11"))
    assert "Python 3." in [m.text for m in log.samples[0].messages if m.role == "tool"][0]
    assert log.eval.sandbox is not None and log.eval.sandbox.type == "execbox"
