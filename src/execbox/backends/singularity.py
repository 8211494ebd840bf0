"""singularity: run code in an Apptainer / SingularityCE container, for HPC hosts where Docker is not allowed.

A one-shot run is ``<binary> exec --containall --cleanenv --no-home --bind <ws>:/workspace --pwd <dir>
[--net --network none] IMAGE argv...``: its own mount, PID and IPC namespaces, an empty home and /tmp,
nothing of the host environment but the filtered request env (``APPTAINERENV_*`` / ``SINGULARITYENV_*``),
and, when the host allows it, an empty network namespace. A persistent session is an instance started
with the same flags; each exec joins it with ``exec instance://NAME``.

What Apptainer enforces is weaker than Docker: the container runs as the calling user on the host kernel,
with no seccomp filter and no cgroup limits unless the site configured them, so the only limit claimed is
the wall-clock timeout. Network none is claimed only when a probe at ``check()`` shows the host allows
``--net --network none`` for this user; otherwise only the host network is offered (and refused by the
guard as not a sandbox).

The binary gets a few host variables and, of its own ``APPTAINER_*``/``SINGULARITY_*`` settings, only the
cache, tmp and config dirs: HPC modules also set ``APPTAINER_BIND``/``SINGULARITY_BINDPATH``, which would
quietly bind host paths (``$HOME``, project dirs) into every container.

A timeout kills the run's process tree (execbox's subreaper). In a session that is not enough: an orphan
inside the instance's PID namespace is re-parented to the instance's init, out of the subreaper's reach, so
after a timeout every process of the instance except its init is SIGKILLed from inside (``kill -9 -1``,
as docker's sessions do): background processes and concurrent execs of that session die too. Where the
site gives instances no PID namespace (apptainer.conf ``allow pid ns = no``), orphans stay in execbox's
own PID namespace and reach the subreaper; what still carries the run's marker is killed too.

spython is not used at run time: its ``execute`` has no timeout and reads all output into memory, its
instance start swallows failures, and it only ever runs a binary called ``singularity``. The binary is
driven directly with execbox's bounded, tree-killing process runner instead. The ``singularity`` extra
still installs spython, for callers who script Apptainer themselves; the tests use it to check that the
fake answers spython's own calls.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from execbox.plugin import (
    REAP_SCRIPT,
    RUN_MARKER,
    BackendSettings,
    BackendUnavailableError,
    Capabilities,
    ExecRequest,
    ExecResult,
    ExecSpec,
    ExecutionBackend,
    Limits,
    SandboxError,
    Session,
    SessionSpec,
    Settings,
    Verdict,
    create_cleanly,
    kill_session_processes,
    name_owner,
    orphaned_dirs,
    owner_tag,
    pid_alive,
    reaped,
    remove_tree,
    run_process,
    safe_read,
    safe_write,
    sandbox_env,
    setting,
)

NAME = "singularity"
WORKSPACE = "/workspace"
CONTAIN = ["--containall", "--cleanenv", "--no-home"]
NET_NONE = ["--net", "--network", "none"]
_PROBE_TIMEOUT_S = 600.0  # the first probe may pull and convert the image
_START_TIMEOUT_S = 600.0  # instance start, which may pull too
_INSTANCE_PREFIX = "execbox"
_WORKSPACE_PREFIX = "execbox-sing-"
# Host variables the binary itself needs. Of its own settings only these dirs: never the *ENV_* ones (they
# would be injected into the container), never *_BIND/*_BINDPATH (host paths bound in) or anything else.
_HOST_VARS = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "XDG_RUNTIME_DIR")
_BINARY_VARS = tuple(f"{p}_{d}" for p in ("APPTAINER", "SINGULARITY") for d in ("CACHEDIR", "TMPDIR", "CONFIGDIR"))
# sh -c KILL execbox MARKER HOST_PIDNS, run in the instance after a timeout. With a PID namespace of its own,
# kill(-1) hits every process in it except its init and this shell (the kernel skips processes outside the
# namespace, so nothing of the host can be hit). The readlink must succeed and differ from execbox's own
# namespace: without that check `kill -9 -1` would kill everything this user runs on the host. Without a
# namespace, orphans went to execbox's subreaper; REAP kills what still carries the run's marker.
_KILL_AFTER_TIMEOUT = (
    'ns=$(readlink /proc/self/ns/pid 2>/dev/null)\n'
    'if [ -n "$ns" ] && [ "$ns" != "$2" ]; then kill -9 -1; echo killed-all; exit 0; fi\n'
    'echo no-pid-namespace\n' + REAP_SCRIPT)


class SingularitySettings(BackendSettings):
    binary: str | None = setting(
        "CODE_EXEC_SINGULARITY_BINARY", None,
        "apptainer or singularity executable (name or path); default: apptainer, else singularity, from PATH")
    image: str = setting(
        "CODE_EXEC_SINGULARITY_IMAGE", "docker://python:3.12-slim",
        "Container image: a .sif file, a sandbox directory, or a URI the binary can pull (docker://, oras://)")
    tmpdir: Path | None = setting(
        "CODE_EXEC_SINGULARITY_TMPDIR", None, "Host directory for the per-run workspaces; default: the system tmp dir")


class SingularitySession(Session):
    workspace = WORKSPACE
    host_workspace: str  # bound at /workspace: whole files and directories move on the host side

    def __init__(self, backend: SingularityBackend, spec: SessionSpec, host_dir: str, instance: str | None) -> None:
        self.backend = backend
        self.spec = spec
        self.host_dir = host_dir
        self.host_workspace = host_dir
        self.instance = instance
        # `execbox kill`: a session's instance by its name; a one-shot's processes by its workspace on their
        # command lines (the bind)
        self.kill_ref = instance or host_dir
        self._closed = False

    def _argv(self, request: ExecSpec) -> list[str]:
        b = self.backend
        pwd = ["--pwd", request.workdir]
        if self.instance:
            return [b.binary, "exec", "--cleanenv", *pwd, f"instance://{self.instance}", *request.argv]
        return [b.binary, "exec", *b.container_flags(self.spec, self.host_dir), *pwd, b.settings.image,
                *request.argv]

    async def exec(self, request: ExecSpec) -> ExecResult:
        run_id = secrets.token_hex(8)
        outcome = await run_process(
            reaped(self._argv(request)),
            env=self.backend.host_env(request.env, run_id),
            cwd=self.host_dir,
            stdin=request.stdin,
            timeout=request.timeout,
            max_output_bytes=request.max_output_bytes,
            on_output=request.on_output,
            redactor=request.redactor,
        )
        result = outcome.to_result()
        if outcome.timed_out and self.instance:
            result.notes.extend(await self._kill_leftovers(run_id))
        return result

    async def _kill_leftovers(self, run_id: str) -> list[str]:
        """After a timeout: kill what the run left in the instance (see the module docstring); notes if unsure."""
        done = await self.backend.run_binary(
            ["exec", "--cleanenv", f"instance://{self.instance}", "/bin/sh", "-c", _KILL_AFTER_TIMEOUT, "execbox",
             run_id, os.readlink("/proc/self/ns/pid")], timeout=30)
        if "killed-all" in done.stdout or (done.returncode == 0 and "no-pid-namespace" in done.stdout):
            return []
        return [f"singularity: after the timeout, killing what the run left in the instance {self.instance} "
                f"failed (exit {done.returncode}: {_tail(done.stderr)}); processes may still run there until "
                "the session is closed"]

    async def write_file(self, path: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(safe_write, self.host_dir, path, data)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        return await anyio.to_thread.run_sync(lambda: safe_read(self.host_dir, path, max_bytes=max_bytes))

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.close_blocking)

    def close_blocking(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.instance:
                self.backend.call_binary(["instance", "stop", "-t", "5", self.instance], timeout=60)
        finally:
            remove_tree(self.host_dir)


class SingularityBackend(ExecutionBackend[SingularitySettings]):
    name = NAME
    extra = "singularity"
    summary = ("an Apptainer/Singularity container (--containall --cleanenv --no-home) as the calling user; "
               "namespaces without seccomp or cgroups, weaker than docker")
    capabilities = Capabilities(
        sandbox=True,
        isolation="namespace",
        network_modes=frozenset({"none", "host"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"wall_time"}),
        streaming=True,
    )

    settings_model = SingularitySettings

    def __init__(self, execbox_settings: Settings, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(execbox_settings, options)
        self._notes: list[str] = []
        self.version = ""

    # --- the binary ---------------------------------------------------------------------------------

    @property
    def binary(self) -> str:
        configured = self.settings.binary
        found = shutil.which(configured) if configured else (shutil.which("apptainer") or shutil.which("singularity"))
        if not found:
            what = f"CODE_EXEC_SINGULARITY_BINARY={configured} is not an executable" if configured else \
                "neither apptainer nor singularity is on PATH"
            raise BackendUnavailableError(
                what, backend=NAME, env_var="CODE_EXEC_SINGULARITY_BINARY",
                fix="install Apptainer (https://apptainer.org/docs/admin/main/installation.html) or load its "
                    "module (`module load apptainer`), or set CODE_EXEC_SINGULARITY_BINARY to its path")
        return found

    @property
    def env_prefix(self) -> str:
        return "SINGULARITYENV_" if "singularity" in Path(self.binary).name else "APPTAINERENV_"

    def container_flags(self, spec: SessionSpec, host_dir: str) -> list[str]:
        net = NET_NONE if spec.network == "none" else []
        return [*CONTAIN, "--bind", f"{host_dir}:{WORKSPACE}", *net]

    def host_env(self, request_env: dict[str, str], run_id: str | None = None) -> dict[str, str]:
        """The binary's own environment: a few host variables, plus the container's env under the prefix."""
        env = {k: os.environ[k] for k in (*_HOST_VARS, *_BINARY_VARS) if k in os.environ}
        inner = sandbox_env(request_env, home=WORKSPACE)
        # the image's PATH and the HOME apptainer makes stay, unless the caller set them
        inner.pop("HOME", None)
        if "PATH" not in request_env:
            inner.pop("PATH", None)
        if run_id:
            inner[RUN_MARKER] = run_id
        prefix = self.env_prefix
        env.update({prefix + k: v for k, v in inner.items()})
        return env

    async def run_binary(self, args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        """A short control command (probe, instance start/stop): output is small, timeout enforced."""
        return await anyio.to_thread.run_sync(lambda: self.call_binary(args, timeout=timeout))

    def call_binary(self, args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        """``run_binary``, blocking."""
        argv = [self.binary, *args]
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.host_env({}),
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout:g}s")
        except OSError as exc:
            return subprocess.CompletedProcess(argv, 127, "", str(exc))

    # --- contract -----------------------------------------------------------------------------------

    async def probe(self) -> Capabilities:
        return await self._check()

    async def _check(self) -> Capabilities:
        binary = self.binary
        version = await self.run_binary(["--version"], timeout=60)
        if version.returncode != 0:
            raise BackendUnavailableError(f"`{binary} --version` failed: {_tail(version.stderr)}", backend=NAME,
                                          fix="repair the Apptainer installation (`apptainer --version` must work)")
        self.version = version.stdout.strip()
        image = self.settings.image
        if "://" not in image and not os.path.exists(image):
            raise BackendUnavailableError(
                f"the image {image} does not exist", backend=NAME, env_var="CODE_EXEC_SINGULARITY_IMAGE",
                fix="set CODE_EXEC_SINGULARITY_IMAGE to a .sif file (e.g. `apptainer build python.sif "
                    "docker://python:3.12-slim`) or to a docker:// URI")
        probe_dir = tempfile.mkdtemp(prefix="execbox-sing-probe-", dir=self.settings.tmpdir)
        try:
            spec_host = SessionSpec("host", Limits(), True, 60)
            base = await self.run_binary(["exec", *self.container_flags(spec_host, probe_dir), image, "true"],
                                         timeout=_PROBE_TIMEOUT_S)
            if base.returncode != 0:
                raise BackendUnavailableError(
                    f"`{Path(binary).name} exec --containall ... {image} true` failed: {_tail(base.stderr)}",
                    backend=NAME, env_var="CODE_EXEC_SINGULARITY_IMAGE",
                    fix="check that the image can be pulled or opened, and that this user may run containers here")
            spec_none = SessionSpec("none", Limits(), True, 60)
            net = await self.run_binary(["exec", *self.container_flags(spec_none, probe_dir), image, "true"],
                                        timeout=_PROBE_TIMEOUT_S)
        finally:
            remove_tree(probe_dir)
        caps = self.capabilities
        if net.returncode != 0:
            self._notes = [f"singularity: this host refuses `--net --network none` ({_tail(net.stderr)}); only the "
                           "host network is available, which the guard does not count as a sandbox"]
            caps = caps.model_copy(update={"network_modes": frozenset({"host"})})
        return caps

    def notes(self) -> list[str]:
        return list(self._notes)

    def verdict(self, request: ExecRequest) -> Verdict:
        if os.geteuid() == 0:
            # Apptainer runs the code as the calling user: started by root, that is host root with root's
            # capabilities (the conformance kit shows it). Not a sandbox; run execbox as an unprivileged user.
            return Verdict(False, "apptainer started by root runs the code as host root with its capabilities; "
                                  "run execbox as an unprivileged user")
        return super().verdict(request)

    async def open_session(self, spec: SessionSpec) -> SingularitySession:
        # a bad setting or a missing binary is raised here, before anything is made
        image, _ = self.settings.image, self.binary
        host_dir = tempfile.mkdtemp(prefix=f"{_WORKSPACE_PREFIX}{owner_tag()}-", dir=self.settings.tmpdir)
        if spec.oneshot:
            return SingularitySession(self, spec, host_dir, None)
        instance = f"{_INSTANCE_PREFIX}-{owner_tag()}-{secrets.token_hex(6)}"

        def start(made: list[SingularitySession]) -> None:
            # recorded first: a failed, timed-out or cancelled start may still have left the instance running
            made.append(SingularitySession(self, spec, host_dir, instance))
            started = self.call_binary(["instance", "start", *self.container_flags(spec, host_dir), image, instance],
                                       timeout=_START_TIMEOUT_S)
            if started.returncode != 0:
                raise SandboxError(f"could not start the instance {instance}: {_tail(started.stderr)}", backend=NAME)

        # runs `instance start` to its end even if the caller is cancelled meanwhile, then stops what it made
        return await create_cleanly(start, SingularitySession.close_blocking)

    async def kill(self, ref: str) -> None:
        if not ref.startswith("/"):
            await self._stop_instance(ref)
            return
        tmpdir = self.settings.tmpdir
        await anyio.to_thread.run_sync(lambda: kill_session_processes(
            ref, _WORKSPACE_PREFIX, str(tmpdir) if tmpdir else None, owner_file=False))

    async def _stop_instance(self, name: str) -> None:
        """A session's instance stopped (its close's call): only an instance execbox named, that is running."""
        listed = await self.run_binary(["instance", "list", "--json"], timeout=60)
        try:
            running = {str(i.get("instance", "")) for i in json.loads(listed.stdout or "{}").get("instances", [])}
        except (json.JSONDecodeError, AttributeError):
            running = set()
        if name_owner(name, f"{_INSTANCE_PREFIX}-") is None or name not in running:
            raise SandboxError(f"no singularity instance {name!r} of execbox on this host", backend=NAME)
        stopped = await self.run_binary(["instance", "stop", "-t", "5", name], timeout=60)
        if stopped.returncode != 0:
            raise SandboxError(f"could not stop the instance {name}: {_tail(stopped.stderr)}", backend=NAME)

    async def gc(self) -> list[str]:
        """Stop instances and remove workspaces whose execbox process is gone: both are named pid-starttime
        (owner_tag), so a dead owner's pid reused by a new process does not keep them."""
        removed = []
        listed = await self.run_binary(["instance", "list", "--json"], timeout=60)
        try:
            instances = json.loads(listed.stdout or "{}").get("instances", [])
        except json.JSONDecodeError:
            instances = []
        for item in instances:
            name = str(item.get("instance", ""))
            owner = name_owner(name, f"{_INSTANCE_PREFIX}-")
            if owner is not None and not pid_alive(*owner):
                stopped = await self.run_binary(["instance", "stop", "-t", "5", name], timeout=60)
                if stopped.returncode == 0:
                    removed.append(f"instance {name}")
        # by the name alone: the workspace is the code's to write, an owner file there would be the code's word
        tmpdir = self.settings.tmpdir
        for path in orphaned_dirs(_WORKSPACE_PREFIX, str(tmpdir) if tmpdir else None, owner_file=False):
            remove_tree(path)
            removed.append(path)
        return removed


def _tail(text: str, limit: int = 400) -> str:
    text = (text or "").strip()
    return text[-limit:] if text else "(no output)"
