"""The docker backend: settings, engine access, what it enforces here (``check``), whether a request is
sandboxed as configured (``verdict``), sessions, and gc of everything it leaves behind."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import anyio
from pydantic import field_validator

from execbox.backends.docker.engine import (
    engine_config,
    engine_here,
    instance,
    is_local,
    locate,
    open_client,
    reload_done,
    unreachable,
)
from execbox.backends.docker.hardening import (
    Runtime,
    default_user,
    gvisor_unenforced,
    judge_runtime,
    parse_user,
)
from execbox.backends.docker.image import DEFAULT_TAG
from execbox.backends.docker.session import (
    DOCKER_LABELS,
    L_CREATED,
    L_OWNER,
    L_SESSION,
    L_WORKSPACE,
    LABEL,
    DockerSession,
    Plan,
    orphaned_workspaces,
    remove_workspace,
    watch_owner,
)
from execbox.plugin import (
    GVISOR_RECORD,
    BackendSettings,
    BackendUnavailableError,
    Capabilities,
    ConfigError,
    ExecRequest,
    ExecutionBackend,
    OwnedSandbox,
    SandboxError,
    SessionSpec,
    Settings,
    Verdict,
    gvisor_record,
    load_probe_facts,
    owner_alive,
    restore_sandbox_paths,
    setting,
    sized_workspace_unavailable,
    store_probe_facts,
    sweep_orphaned_proxies,
)

_EGRESS_VAR = "CODE_EXEC_DOCKER_EGRESS_NETWORK"
_RUNTIME_VAR = "CODE_EXEC_DOCKER_RUNTIME"
# Networks the engine itself provides: never a network execbox created for egress.
_ENGINE_NETWORKS = ("host", "bridge", "none", "default")
_ICC = "com.docker.network.bridge.enable_icc"


MAX_ID = (1 << 32) - 2


class DockerSettings(BackendSettings):
    """Knobs of the docker backend (the limits are the core's CODE_EXEC_MEMORY_MB/CPUS/PIDS_LIMIT/DISK_MB)."""

    image: str = setting("CODE_EXEC_DOCKER_IMAGE", DEFAULT_TAG,
                      "Sandbox image; build the default with `execbox image build`; pin registry images by digest")
    user: str | None = setting("CODE_EXEC_DOCKER_USER", None,
                            "uid[:gid] inside the container; default: yours, or 65534:65534 when execbox runs as "
                            "root; a uid other than yours needs execbox to run as root")
    runtime: str | None = setting(_RUNTIME_VAR, None,
                               "OCI runtime registered in the engine, judged by the binary it runs and its arguments: "
                               "runc, crun, runsc (gVisor; the set-up registers it as runsc) or kata; default: the "
                               "engine's")
    tmpfs_mb: int = setting("CODE_EXEC_DOCKER_TMPFS_MB", 512, "Size of the /tmp tmpfs and of each tmpfs= path (counts "
                            "against memory; a tmpfs= path at most the disk limit), MiB",
                            gt=0)
    egress_network: str = setting(_EGRESS_VAR, "execbox-egress",
                               "Bridge network for network mode egress; only one execbox created (labelled, no "
                               "traffic between containers); created when missing")

    @field_validator("user")
    @classmethod
    def _numeric_user(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9]+(:[0-9]+)?", value):
            raise ValueError("give a numeric uid or uid:gid such as 1000:1000 (names cannot be checked for root)")
        if value is not None and ":" not in value:
            value = f"{value}:{value}"  # docker would otherwise run a bare uid with gid 0
        if value is not None and any(int(part) > MAX_ID for part in value.split(":")):
            raise ValueError(f"uid and gid go up to {MAX_ID} (2^32-2; 2^32-1 means 'no id' to the kernel)")
        return value


def egress_network_problem(name: str, attrs: dict[str, Any] | None) -> str | None:
    """Why the network ``name`` (its inspect attrs; None when it does not exist yet) may not carry egress."""
    if name in _ENGINE_NETWORKS or name.startswith("container:"):
        return f"{_EGRESS_VAR}={name} is a network of the engine itself, not one execbox created"
    if attrs is None:
        return None
    wrong = []
    if attrs.get("Driver") != "bridge":
        wrong.append(f"driver {attrs.get('Driver')}, not bridge")
    if (attrs.get("Labels") or {}).get(LABEL) != "1":
        wrong.append(f"no {LABEL} label")
    if (attrs.get("Options") or {}).get(_ICC) != "false":
        wrong.append("traffic between its containers is allowed")
    if not wrong:
        return None
    return (f"{_EGRESS_VAR}={name} names an existing network that execbox did not create ({', '.join(wrong)}); "
            "egress only uses a bridge execbox created itself. Unset the variable, or name a network that does not "
            "exist yet and execbox creates it")


# What check() reads of `docker info`; only these are kept in the probe cache.
_INFO_FACTS = ("Runtimes", "DefaultRuntime", "MemoryLimit", "PidsLimit", "CpuCfsQuota")


def _import_docker() -> Any:
    """docker-py, without its ssh:// transport unless the engine may be reached over ssh.

    docker-py imports that transport (docker.transport.sshconn, and with it paramiko, invoke and cryptography:
    ~70 ms, half of importing docker) at import time, in a try/except ImportError; this backend only uses a local
    engine. So while docker is first imported, a None entry for that one module makes docker-py skip it; the entry
    is removed right after. Blocking paramiko itself would not do: another thread (the ssh backend) may import it
    at the same moment. With DOCKER_HOST=ssh://..., or a docker context selected (it may name an ssh host),
    docker is imported as usual.
    """
    import sys

    transport = "docker.transport.sshconn"
    if "docker" in sys.modules or transport in sys.modules or _engine_may_use_ssh():
        import docker

        return docker
    sys.modules[transport] = None  # type: ignore[assignment]
    try:
        import docker
    finally:
        if transport in sys.modules and sys.modules[transport] is None:
            del sys.modules[transport]
    return docker


def _docker_version() -> str:
    import docker

    return str(docker.__version__)


def _engine_may_use_ssh() -> bool:
    """True unless the engine is surely not ssh://: DOCKER_HOST names another scheme, or no docker context is
    selected (DOCKER_CONTEXT unset or default, and no currentContext in the docker config), as resolve_endpoint
    reads them."""
    host = os.environ.get("DOCKER_HOST")
    if host:
        return host.startswith("ssh://")
    if os.environ.get("DOCKER_CONTEXT", "default") != "default":
        return True
    config = os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")
    try:
        with open(config, "rb") as fh:
            return b"currentContext" in fh.read(1 << 20)
    except OSError:
        return False


class DockerBackend(ExecutionBackend[DockerSettings]):
    name = "docker"
    extra = "docker"
    sdk = "docker"
    settings_model = DockerSettings
    sweeps_on_first_use = True
    summary = "hardened containers on a Docker engine (DOCKER_HOST / context); gVisor via CODE_EXEC_DOCKER_RUNTIME"
    capabilities = Capabilities(
        sandbox=True,
        isolation="container",
        network_modes=frozenset({"none", "egress", "proxy", "host"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "cpu", "pids", "disk", "wall_time"}),
        streaming=True,  # attach / exec sockets are demultiplexed as they arrive (docker/stream.py)
        mounts=True,  # execbox.Mount: plain private binds, read-only unless asked, checked in the inspect output
        tmpfs=True,  # extra tmpfs paths (SessionSpec.tmpfs), the sandbox user's, checked in the inspect output
        snapshot=True,  # the workspace and the tmpfs paths (the root is read-only), packed inside as the user
    )

    def __init__(self, execbox_settings: Settings, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(execbox_settings, options)
        self._client: Any = None
        self.endpoint = ""
        self.origin = ""
        self.socket_path: str | None = None
        self._lock = threading.Lock()
        self._engine_key: list[object] | None = None  # the engine instance and docker-py, for the probe cache
        self._declared: dict[str, Any] = {}  # the runtimes the engine's config declares (engine_config)
        self._runtime: Runtime | None = None  # the runtime check() judged (named or the default), asked for by name
        self._unenforced: dict[str, str] = {}  # what check() found the judged runtime cannot enforce, and why

    def present_here(self) -> str | None:
        return engine_here()

    @property
    def user(self) -> str:
        return self.settings.user or default_user()

    # -- engine access --

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                _import_docker()  # before anything else imports docker (locate does)
                endpoint, params, origin = locate()
                if not is_local(endpoint):
                    raise BackendUnavailableError(
                        f"the Docker engine at {endpoint} (from {origin}) is not on this machine, and the "
                        "docker backend bind-mounts a local workspace directory", backend="docker",
                        fix="use a local engine (unix socket), or a remote backend", env_var="DOCKER_HOST")
                self._engine_key = self._key_of(endpoint)
                known = self._kept_facts() or {}
                self._client = open_client(endpoint, params, origin, known.get("api_version"))
                self.endpoint, self.origin = endpoint, origin
                if endpoint.startswith("unix://"):
                    self.socket_path = endpoint[len("unix://"):]
            return self._client

    def _key_of(self, endpoint: str) -> list[object] | None:
        """The probe cache's key for the engine at ``endpoint`` (and the runtimes its config declares, kept aside). A
        reload re-reads the config without a new socket: the key covers the config too."""
        engine, config = instance(endpoint), engine_config(endpoint)
        self._declared = config[1] if config else {}
        return [*engine, config[0], _docker_version()] if engine and config else None

    def _kept_facts(self) -> dict[str, Any] | None:
        """The probe cache's record for this engine, when it has one of the shape engine_facts stores."""
        if not self._engine_key:
            return None
        facts = load_probe_facts("docker", self._engine_key, self.shared.probe_cache_sec)
        if facts and isinstance(facts.get("info"), dict) and re.fullmatch(r"\d+\.\d+", str(facts.get("api_version"))):
            return facts
        return None

    def engine_facts(self) -> dict[str, Any]:
        """What ``check`` reads of ``docker info`` (runtimes, which limits the engine enforces) and the API
        version: from the probe cache when a process asked this engine lately, else asked now and kept."""
        self.client()
        if self.endpoint:  # asked again each check: a reload since the client opened is seen at once
            self._engine_key = self._key_of(self.endpoint)
        facts = self._kept_facts()
        if facts is None:
            info = self.call(lambda c: c.info())
            facts = {"api_version": self.call(lambda c: c.api.api_version),
                     "info": {k: info.get(k) for k in _INFO_FACTS}}
            key = self._engine_key
            # kept only once the engine runs what its config declares: facts read before a pending reload took
            # effect would be kept under the new config's key, and judge runtimes the engine no longer runs
            if key is not None and reload_done(self._declared, facts["info"].get("Runtimes") or {}):
                store_probe_facts("docker", key, facts)
        info_facts: dict[str, Any] = facts["info"]
        return info_facts

    def call(self, fn: Any) -> Any:
        """Run ``fn(client)``; a dropped engine becomes one non-retryable error naming the endpoint."""
        docker = _import_docker()
        import requests

        client = self.client()
        try:
            return fn(client)
        except docker.errors.ImageNotFound as exc:
            raise self._missing_image(exc) from None
        except docker.errors.APIError as exc:
            if exc.is_client_error() and "repository name" in str(exc.explanation or ""):  # a malformed image name
                raise ConfigError(f"CODE_EXEC_DOCKER_IMAGE is not a valid image reference: {exc.explanation}",
                                  backend="docker", env_var="CODE_EXEC_DOCKER_IMAGE") from None
            raise
        except (requests.exceptions.ConnectionError, ConnectionRefusedError, FileNotFoundError) as exc:
            raise unreachable(self.endpoint, self.origin, exc) from None

    def _missing_image(self, exc: BaseException) -> BackendUnavailableError:
        built = self.settings.image == DEFAULT_TAG
        fix = ("build it from Debian's packages, no registry needed (as root): execbox image build"
               if built else f"docker pull/load {self.settings.image}, or unset CODE_EXEC_DOCKER_IMAGE and run "
                             "`execbox image build` for the default image")
        return BackendUnavailableError(f"the sandbox image {self.settings.image} is not on the engine at "
                                       f"{self.endpoint}", backend="docker", fix=fix,
                                       env_var="CODE_EXEC_DOCKER_IMAGE")

    # -- contract --

    async def probe(self) -> Capabilities:
        return await anyio.to_thread.run_sync(self._check_blocking)

    async def aclose(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            await anyio.to_thread.run_sync(client.close)

    def _check_blocking(self) -> Capabilities:
        self.workspace_access()
        info = self.engine_facts()
        runtimes = info.get("Runtimes") or {}
        runtime = self.settings.runtime
        if runtime and runtime not in runtimes:
            raise BackendUnavailableError(
                f"{_RUNTIME_VAR}={runtime} is not a runtime of the engine at {self.endpoint} "
                f"(it has: {', '.join(sorted(runtimes))})", backend="docker", env_var=_RUNTIME_VAR,
                fix=f"register {runtime} in /etc/docker/daemon.json \"runtimes\" and restart dockerd "
                    f"(gVisor: runsc install), or unset {_RUNTIME_VAR}")
        used = runtime or str(info.get("DefaultRuntime") or "runc")
        judged = judge_runtime(used, runtimes.get(used))
        if judged.problem:
            which = f"{_RUNTIME_VAR}={runtime}" if runtime else f"the engine's default runtime ({_RUNTIME_VAR} unset)"
            raise BackendUnavailableError(
                f"{which} is not a sandbox execbox admits: {judged.problem}", backend="docker", env_var=_RUNTIME_VAR,
                fix=f"set {_RUNTIME_VAR} to a runtime registered in the engine that runs runc, crun, runsc or "
                    "kata-runtime with safe arguments (gVisor: as root, scripts/bootstrap.sh registers runsc)")
        self._runtime = judged
        self.call(lambda c: c.images.get(self.settings.image))
        limits = set(self.capabilities.limits)
        for limit, flag in (("memory", "MemoryLimit"), ("pids", "PidsLimit"), ("cpu", "CpuCfsQuota")):
            if info.get(flag) is False:
                limits.discard(limit)
        if sized_workspace_unavailable() is not None:
            limits.discard("disk")
        self._unenforced = gvisor_unenforced(judged) if judged.isolation == "gvisor" else {}
        return self.capabilities.model_copy(update={
            "isolation": judged.isolation, "limits": frozenset(limits - set(self._unenforced)),
            "network_modes": self.capabilities.network_modes - set(self._unenforced)})

    def unenforced(self, what: str) -> str | None:
        reason = self._unenforced.get(what)
        return f"{reason} ({_RUNTIME_VAR}={self._runtime.name})" if reason and self._runtime else None

    def details(self) -> dict[str, Any]:
        judged = self._runtime
        if judged is None:
            return {}
        shown = {"runtime": f"{judged.name} (runs {judged.binary}" + (f" {' '.join(judged.args)})" if judged.args
                                                                       else ")")}
        record = gvisor_record()
        if judged.isolation != "gvisor":
            runtimes = self.engine_facts().get("Runtimes") or {}
            names = sorted(runtimes, key=lambda n: (n != (record or {}).get("runtime"), n))
            usable = [n for n in names if judge_runtime(n, runtimes[n]).isolation == "gvisor"]
            if usable:  # auto never picks a runtime: this says how to get the stronger sandbox
                shown["gvisor"] = (f"the engine has it as runtime {usable[0]}: set {_RUNTIME_VAR}={usable[0]} to run "
                                   "every sandbox under gVisor (auto does not choose a runtime)")
        else:
            probed = record if record and record.get("path") and os.path.basename(str(record["path"])) == \
                judged.binary else None
            platform = judged.platform or "runsc's default (ptrace in releases before 2023)"
            network = {"none": "none (loopback only: network mode egress is refused)",
                       "sandbox": "gVisor's own (netstack)"}[judged.network or "sandbox"]
            shown.update({"gvisor platform": platform, "gvisor network stack": network})
            if probed:
                shown["gvisor probe"] = (f"runsc {probed.get('version')} on kernel {probed.get('kernel')}: "
                                         f"{probed.get('summary')} ({GVISOR_RECORD})")
        return shown

    def _egress_attrs(self) -> dict[str, Any] | None:
        import docker

        try:
            return self.call(lambda c: c.api.inspect_network(self.settings.egress_network))  # type: ignore[no-any-return]
        except docker.errors.NotFound:
            return None

    def sweep_scope(self) -> str:
        return f"docker {self.endpoint}"

    def workspace_access(self) -> None:
        """Refuse a sandbox user this process cannot give a private workspace to. A non-root caller can only
        let another uid write a directory in /tmp by opening it to every local user, and any of them could
        then swap the code file between our write and the run."""
        me = os.geteuid()
        uid, _ = parse_user(self.user)
        if me != 0 and uid != me:
            raise ConfigError(
                f"CODE_EXEC_DOCKER_USER={self.user} is not you (uid {me}): without root, execbox cannot hand "
                "another uid a workspace that other local users cannot also write. Unset CODE_EXEC_DOCKER_USER "
                f"(the code then runs as {me}:{os.getegid()}), set it to your own uid, or run execbox as root "
                "(the workspace is then given to that uid)", backend="docker", env_var="CODE_EXEC_DOCKER_USER")

    def verdict(self, request: ExecRequest) -> Verdict:
        """Every docker setting that moves the boundary, as the settings say it: the network, the user, the
        runtime, the egress network. What the engine has behind a name is checked where the engine is asked:
        the runtime's binary and arguments in ``check``, the egress network when a session opens, every container
        as built."""
        if request.network == "host":
            return Verdict(False, "network mode 'host' shares the host's network with the container")
        uid, gid = parse_user(self.user)
        if uid == 0 or gid == 0:
            return Verdict(False, f"CODE_EXEC_DOCKER_USER={self.user} runs the code as root (uid or gid 0) in the "
                                  "container; unset it or give a non-root uid:gid")
        runtime = self.settings.runtime
        if request.network == "egress":
            problem = egress_network_problem(self.settings.egress_network, None)
            if problem:
                return Verdict(False, problem)
        shown = f", runtime {runtime}" if runtime else ""
        return Verdict(True, f"hardened container as {self.user}{shown}")

    def plan(self, spec: SessionSpec) -> Plan:
        uid, _ = parse_user(self.user)
        keeper = "65533:65533" if uid != 65533 else "65532:65532"
        caps = self._checked[1] if self._checked else None
        return Plan(image=self.settings.image, user=self.user, keeper=keeper, limits=spec.limits, network=spec.network,
                    # The judged runtime by name, also when it is the engine's default: a default changed since
                    # (a reload, facts from the probe cache) is then a refused contract, never another runtime.
                    runtime=self._runtime.name if self._runtime else None, tmpfs_mb=self.settings.tmpfs_mb,
                    egress_network=self.settings.egress_network,
                    disk=caps is not None and "disk" in caps.limits, mounts=spec.mounts, tmpfs=spec.tmpfs,
                    gvisor=caps is not None and caps.isolation == "gvisor")

    async def open_session(self, spec: SessionSpec) -> DockerSession:
        if spec.network not in self.capabilities.network_modes:
            raise ConfigError(f"the docker backend cannot enforce network mode {spec.network!r}",
                              backend="docker", env_var="CODE_EXEC_NETWORK")
        self.workspace_access()
        if self._runtime is None:  # the runtime is judged before any container runs under it
            await self.check()
        watch_owner(parse_user(self.user)[0])
        session = DockerSession(self, spec, self.plan(spec))
        try:
            await anyio.to_thread.run_sync(session.prepare)
            if spec.network == "egress":
                await anyio.to_thread.run_sync(self._ensure_egress_network)
            await anyio.to_thread.run_sync(session.start)
            await restore_sandbox_paths(session, spec, self.shared)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await session.close()
            raise
        return session

    def _ensure_egress_network(self) -> None:
        """The egress bridge, created when missing; an existing network is used only if execbox made it."""
        import docker

        name = self.settings.egress_network
        attrs = self._egress_attrs()
        if attrs is None and egress_network_problem(name, None) is None:
            with contextlib.suppress(docker.errors.APIError):  # another process created it meanwhile
                self.call(lambda c: c.networks.create(
                    name, driver="bridge", labels={LABEL: "1"}, check_duplicate=True,
                    # no traffic between sandboxes on the same bridge
                    options={_ICC: "false"}))
            attrs = self._egress_attrs()
        problem = egress_network_problem(name, attrs)
        if problem:
            raise ConfigError(f"refused: {problem}", backend="docker", env_var=_EGRESS_VAR)

    async def gc(self) -> list[str]:
        return await anyio.to_thread.run_sync(self._gc_blocking)

    async def owned(self) -> list[OwnedSandbox] | None:
        if engine_here() is None:  # no engine answers here: none is started to ask it
            return None
        return await anyio.to_thread.run_sync(self._owned_blocking)

    def _owned_blocking(self) -> list[OwnedSandbox]:
        """One sandbox per session label, among the containers of ours that are not over (an exited one is a
        one-shot's end, or a session whose owner's deadline stopped it: gc removes those)."""
        found = self.call(lambda c: c.api.containers(all=True, filters={"label": LABEL}))
        sessions: dict[str, OwnedSandbox] = {}
        for item in found:
            labels = item.get("Labels") or {}
            if labels.get(L_SESSION) and item.get("State") not in ("exited", "dead", "removing"):
                created = labels.get(L_CREATED, "")
                sessions.setdefault(labels[L_SESSION], OwnedSandbox(
                    labels[L_SESSION], labels.get(L_OWNER, ""), float(created) if created.isdigit() else None))
        return list(sessions.values())

    async def kill(self, ref: str) -> None:
        await anyio.to_thread.run_sync(self._kill_blocking, ref)

    def _kill_blocking(self, ref: str) -> None:
        """Remove the containers of session ``ref``: only ours (the mark), made by a process on this host."""
        import docker

        found = self.call(lambda c: c.api.containers(all=True, filters={"label": [LABEL, f"{L_SESSION}={ref}"]}))
        ours = [item for item in found if DOCKER_LABELS.made_here(item.get("Labels") or {})]
        if not ours:
            raise SandboxError(f"no docker sandbox {ref!r} of execbox on this host", backend="docker")
        for item in ours:
            with contextlib.suppress(docker.errors.NotFound):
                self.call(lambda c, cid=item["Id"]: c.api.remove_container(cid, force=True))

    def _gc_blocking(self) -> list[str]:
        """Remove what execbox left behind: containers that expired or whose owner process is gone (a killed
        caller's container has stopped by itself at its deadline), then the workspaces of dead owners, sized
        mounts unmounted first. Only ours: a container without our label is never touched. The egress network
        stays: it holds no process and no data, and removing it would race with a session about to use it."""
        import docker

        removed = []
        now = time.time()
        for item in self.call(lambda c: c.api.containers(all=True, filters={"label": LABEL})):
            labels = item.get("Labels") or {}
            reason = DOCKER_LABELS.orphan_reason(labels, now)
            if reason is None:
                continue
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                self.call(lambda c, cid=item["Id"]: c.api.remove_container(cid, force=True))
            if owner_alive(labels.get(L_OWNER, "")) is False:  # an expired one's live owner removes its own
                remove_workspace(labels.get(L_WORKSPACE, ""))
            name = (item.get("Names") or [item["Id"][:12]])[0].lstrip("/")
            removed.append(f"docker container {name} ({reason})")
        for path in orphaned_workspaces(parse_user(self.user)[0]):
            if remove_workspace(path):
                removed.append(f"docker workspace {path} (orphaned)")
        removed += [f"egress proxy directory {path} (orphaned)" for path in sweep_orphaned_proxies()]
        return removed
