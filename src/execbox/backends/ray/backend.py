"""ray: the code runs on a node of a Ray cluster, in that node's own sandbox backend (driver side).

    connect       ray.init(CODE_EXEC_RAY_ADDRESS) unless this process is connected already; unreachable is
                  BackendUnavailableError ("do not retry until ..."); Ray not installed is the pip hint (sdk/extra)
    nodes         one host actor per alive node (node.NodeHost, pinned with NodeAffinitySchedulingStrategy,
                  soft=False), named per driver job; it owns that node's AsyncRunner and its slots
                  (CODE_EXEC_RAY_SLOTS_PER_NODE) and runs its backend (CODE_EXEC_RAY_NODE_BACKEND)
    placement     a new sandbox goes to the node with the most free slots (sessions open on it, by this driver)
    sessions      pinned: every exec and file call of a session goes to its node's actor; a one-shot opens, places
                  its files and runs in one call
    guard         capabilities = what every node enforces (intersection); a sandbox only when every node's
                  backend is one for the request's network; env policy and secrets ran on this driver (what
                  crosses is the planned spec: secrets travel in its stdin, redacted here from what comes back)
    bounds        the node's output cap, read cap and transfer bounds hold there; streamed output is the node's
                  capped head; files cross whole and bounded (write_file by its caller, read_file by max_bytes)
    failure       a node whose actor dies takes its sandboxes: SandboxLostError at once, never a re-run; a one-shot
                  lost that way is run again on another node only with CODE_EXEC_RAY_RETRY_ONESHOTS
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from execbox.plugin import (
    BackendSettings,
    BackendUnavailableError,
    Capabilities,
    ConfigError,
    EgressAttempt,
    ExecboxError,
    ExecRequest,
    ExecResult,
    ExecSpec,
    ExecutionBackend,
    FileInfo,
    MissingExtraError,
    SandboxError,
    SandboxLostError,
    Session,
    SessionSpec,
    TransferLimits,
    TransferTooLargeError,
    Verdict,
    build_result,
    sdk_call,
    setting,
)

log = logging.getLogger("execbox.backends.ray")
ACTOR_PREFIX = "execbox-host"
CONNECT_TIMEOUT_S = 5.0
# An actor Ray calls unavailable is asked again for this long: one that answers is kept (its call may or may not
# have run), one that does not is lost (a removed node first shows as unavailable, until its death is known)
UNAVAILABLE_GRACE_S = 5.0
# How often placement looks for nodes that joined (or came back after being given up on) since the last survey
RESURVEY_S = 10.0
# weakest first, to name what every node enforces
_STRENGTH = ["none", "process", "namespace", "container", "gvisor", "microvm", "remote_vm"]


class RaySettings(BackendSettings):
    address: str = setting(
        "CODE_EXEC_RAY_ADDRESS", "auto",
        "Ray cluster to run on: `auto` (the one this machine belongs to: RAY_ADDRESS, or `ray start`'s), `host:port` "
        "(its head), or `ray://host:port` (Ray Client); unused when the process is connected already (ray.init)")
    node_backend: str = setting(
        "CODE_EXEC_RAY_NODE_BACKEND", "auto",
        "Backend each node runs the code in (`auto`: the strongest sandbox there, as locally)")
    slots_per_node: int = setting(
        "CODE_EXEC_RAY_SLOTS_PER_NODE", 4, "Sandboxes each node runs at once (its runner's slots)", gt=0)
    retry_oneshots: bool = setting(
        "CODE_EXEC_RAY_RETRY_ONESHOTS", False,
        "Run a one-shot again on another node when its node dies under it (sessions are never re-run)")


@dataclass
class Node:
    """A node this driver runs on: its host actor and what it said it runs."""

    node_id: str
    ip: str
    actor: Any
    backend: str
    capabilities: Capabilities
    verdicts: dict[str, tuple[bool, str]]
    slots: int
    pid: int  # the host actor's process on the node (what its sandboxes name as their owner)
    open: int = 0  # sandboxes of this driver open on it now
    workspace: str | None = None  # where its sandboxes keep their workspace, once one opened
    ran: int = 0  # execs run on it, for details()
    answering: bool = True  # False while a call found its actor unavailable: nothing new is placed on it

    @property
    def label(self) -> str:
        return f"{self.ip} ({self.node_id[:12]})"


@dataclass
class _Cluster:
    nodes: dict[str, Node] = field(default_factory=dict)
    unusable: dict[str, str] = field(default_factory=dict)
    job: str = ""  # the driver job the actors belong to (a new ray.init is a new job: new actors)
    # every host actor's first handle, while its node is alive: an actor lives while its handles do, so a node
    # forgotten (lost) keeps its actor until the next survey adopts it again and closes what it held
    handles: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one survey at a time (they run in threads)
    surveyed_at: float = 0.0  # time.monotonic() of the last survey's start
    refreshing: bool = False  # a survey in the background, started by placement


_CLUSTERS: dict[tuple[str, int], _Cluster] = {}


def _error_classes(base: type[ExecboxError] = ExecboxError) -> dict[str, type[ExecboxError]]:
    found = {base.__name__: base}
    for sub in base.__subclasses__():
        found.update(_error_classes(sub))
    return found


def _rebuild(fields: dict[str, Any], node: Node) -> ExecboxError:
    """The execbox error a node reported, as the same class here, naming the node. Built without its constructor
    (whose arguments differ by class), so the attributes constructors set are set here: those the node sent
    (``fields["attrs"]``), else their defaults: a caller reads ``exc.reason`` or ``exc.errno`` as it would locally."""
    cls = _error_classes().get(fields.get("type", ""), SandboxError)
    exc = cls.__new__(cls)
    message = f"{fields.get('message', '')} (on ray node {node.label})"
    Exception.__init__(exc, message)
    exc.message = message
    exc.backend = fields.get("backend") or "ray"
    exc.env_var = fields.get("env_var")
    exc.retryable = bool(fields.get("retryable"))
    sent = fields.get("attrs") or {}
    if isinstance(exc, BackendUnavailableError):
        exc.reason = f"{sent.get('reason') or fields.get('message', '')} (on ray node {node.label})"
        exc.fix = sent.get("fix")
    if isinstance(exc, MissingExtraError):
        exc.extra, exc.present = sent.get("extra"), sent.get("present")
    if isinstance(exc, OSError):  # the typed file errors: errno as a local one has it
        exc.errno = sent.get("errno", getattr(cls, "errno_code", None))
    return exc


def _reachable(address: str) -> None:
    """Refuse an address nothing listens on at once: Ray itself waits minutes for a GCS that is not there."""
    if address == "auto":
        return  # Ray finds the local cluster itself, and says at once when there is none
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"CODE_EXEC_RAY_ADDRESS={address!r} is not `auto`, `host:port` or `ray://host:port`",
                          env_var="CODE_EXEC_RAY_ADDRESS")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {host}:{port}: {exc}") from None


class RaySession(Session):
    """A sandbox on one node: every call goes to that node's host actor."""

    def __init__(self, backend: RayBackend, node: Node, spec: SessionSpec, workspace: str, *, opened: bool) -> None:
        self.backend = backend
        self.node = node
        self.spec = spec
        self.workspace = workspace
        self.sid = uuid.uuid4().hex
        self._opened = opened
        self._pending: list[tuple[str, bytes]] = []  # a one-shot's files, sent with its command
        self._closed = False

    async def _call(self, method: str, *args: Any, called_off: bool = True) -> Any:
        ref = getattr(self.node.actor, method).remote(*args)
        return self.backend.reply(await self.backend.await_ref(ref, self.node, called_off=called_off), self.node)

    async def exec(self, spec: ExecSpec) -> ExecResult:
        files, self._pending = self._pending, []
        try:
            return await self._exec(spec, files)
        except SandboxLostError:
            if not (self.spec.oneshot and self.backend.settings.retry_oneshots):
                raise
            log.warning("ray node %s was lost under a one-shot; running it again on another node (asked for by "
                        "CODE_EXEC_RAY_RETRY_ONESHOTS)", self.node.label)
            self.node = await self.backend.place(exclude=self.node)
            self.sid, self._opened = uuid.uuid4().hex, False
            result = await self._exec(spec, files)  # a one-shot's files are all it had: placed again
            result.notes.append("ray: its first node was lost during the run; run again on this one "
                                "(CODE_EXEC_RAY_RETRY_ONESHOTS)")
            return result

    async def _exec(self, spec: ExecSpec, files: list[tuple[str, bytes]]) -> ExecResult:
        if spec.egress is not None:  # placeholders swapped by a proxy on this host: the node's proxy has no values
            raise SandboxError("secrets at egress cannot cross to a ray node: its egress proxy runs there",
                               backend="ray")
        opening = None if self._opened else (self.spec.network, self.spec.limits.model_dump(),
                                             self.spec.lifetime_s)
        command = {"argv": spec.argv, "env": spec.env, "stdin": spec.stdin, "timeout": spec.timeout,
                   "max_output_bytes": spec.max_output_bytes, "workspace": self.workspace}
        self._opened = True  # from here on the node may hold it: close() closes it
        out, err = spec.captures()
        if spec.on_output is None:
            fields = await self._call("run", self.sid, opening, files, command)
        else:
            fields = None
            gen = self.node.actor.run_streaming.options(num_returns="streaming").remote(
                self.sid, opening, files, command)
            async for ref in self.backend.stream_refs(gen, self.node):
                kind, value = await self.backend.await_ref(ref, self.node)
                if kind == "out":
                    for stream, text in value:
                        (out if stream == "stdout" else err).write(text.encode())
                else:
                    fields = self.backend.reply((kind, value), self.node)
            if fields is None:
                raise SandboxError(f"ray node {self.node.label} ended the run without its result", backend="ray")
        self.node.ran += 1
        # The node's capture is the one bounded as locally (head and tail); the streamed copy fed the caller.
        result = build_result(exit_code=fields["exit_code"], stdout=out, stderr=err, timed_out=fields["timed_out"],
                              duration_s=fields["duration_s"], oom_killed=fields["oom_killed"])
        return result.model_copy(update={
            "stdout": fields["stdout"], "stderr": fields["stderr"], "truncated": fields["truncated"],
            "exit_code": fields["exit_code"], "egress": [EgressAttempt(**attempt) for attempt in fields["egress"]],
            "notes": [*fields["notes"], f"ray: ran on node {self.node.label} in its {self.node.backend} sandbox"]})

    async def write_file(self, path: str, data: bytes) -> None:
        if not self._opened:
            self._pending.append((path, data))
            return
        await self._call("write_file", self.sid, path, data)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        self._need_open("read_file")
        data: bytes = await self._call("read_file", self.sid, path, max_bytes)
        return data

    async def list_files(self, path: str, *, recursive: bool, limits: TransferLimits) -> list[FileInfo]:
        self._need_open("list_files")
        found = await self._call("list_files", self.sid, path, recursive)  # bounded by the node's own limits
        if len(found) > limits.max_entries:  # and by this driver's, which may be tighter
            raise TransferTooLargeError(
                f"refused: listing {path or 'the workspace'!r} holds more than {limits.max_entries} entries. Raise "
                "CODE_EXEC_MAX_TRANSFER_FILES, or pick a smaller directory", backend="ray",
                env_var="CODE_EXEC_MAX_TRANSFER_FILES")
        return [FileInfo(**info) for info in found]

    def _need_open(self, doing: str) -> None:
        if not self._opened:
            raise SandboxError(f"{doing} before the one-shot ran: its sandbox opens with its command",
                               backend="ray")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._opened and self.backend.alive(self.node):
                # Never called off on the node: a caller that stops waiting must not leave the sandbox open there
                await self._call("close", self.sid, called_off=False)
            elif self._opened:
                # Set aside as lost since: its host actor may still be there holding the sandbox (a survey finds
                # it again by name), so it is told, without waiting on an answer that may never come
                with contextlib.suppress(Exception):
                    self.node.actor.close.remote(self.sid)
        except SandboxLostError:
            pass  # its node took it: nothing is left to close
        finally:
            self.node.open -= 1


class RayBackend(ExecutionBackend[RaySettings]):
    name = "ray"
    extra = "ray"
    sdk = "ray"
    summary = "a node of a Ray cluster, in that node's own sandbox backend; sessions pinned to their node"
    settings_model = RaySettings
    verdict_needs_check = True  # the verdict is on the nodes the check surveyed
    # What a cluster can offer at most; probe() narrows it to what every node enforces.
    capabilities = Capabilities(
        sandbox=True,
        isolation="microvm",
        network_modes=frozenset({"none", "egress", "proxy"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "cpu", "pids", "disk", "wall_time"}),
        remote=True,
        streaming=True,  # the node's actor yields the output as it arrives (a Ray streaming generator)
    )

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._turn = itertools.count()

    @property
    def _cluster(self) -> _Cluster:
        """The nodes as this process knows them, shared by every instance with this configuration: their actors,
        and how many sandboxes each holds (placement sees every runner's)."""
        key = (self.settings.node_backend, self.settings.slots_per_node)
        return _CLUSTERS.setdefault(key, _Cluster())

    @property
    def _nodes(self) -> dict[str, Node]:
        return self._cluster.nodes

    @property
    def _unusable(self) -> dict[str, str]:
        return self._cluster.unusable

    # --- the cluster -----------------------------------------------------------------------------------------

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        address = self.settings.address
        try:
            _reachable(address)
            # ERROR: Ray warns on stderr when connected from a thread other than the main one (every check is)
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - ConnectionError, grpc's, RuntimeError: every way in fails alike
            raise BackendUnavailableError(
                f"no Ray cluster answers at CODE_EXEC_RAY_ADDRESS={address!r} ({type(exc).__name__}: "
                f"{str(exc)[:300]}); do not retry until a cluster is up there",
                backend=self.name, env_var="CODE_EXEC_RAY_ADDRESS",
                fix="start one (`ray start --head` here, or your cluster's), or point CODE_EXEC_RAY_ADDRESS at it "
                    "(`auto`, or `ray://host:10001`)") from exc

    def _survey(self) -> None:
        """A host actor on every alive node without one, and what each runs; nodes gone are forgotten."""
        with self._cluster.lock:
            self._cluster.surveyed_at = time.monotonic()
            self._survey_locked()

    def _refresh_soon(self) -> None:
        """A survey in a thread of its own when the last is RESURVEY_S old: nodes that joined the cluster, or that
        answer again after being given up on, take sandboxes again. Placement never waits for it (a node listed
        alive but gone holds a survey up to CODE_EXEC_OPEN_TIMEOUT_SEC)."""
        cluster = self._cluster
        if cluster.refreshing or time.monotonic() - cluster.surveyed_at < RESURVEY_S:
            return
        cluster.refreshing = True

        def refresh() -> None:
            try:
                self._survey()
            except ExecboxError as exc:  # no node usable now: placement says so when it finds none
                log.info("ray: a background survey found no usable node: %s", exc)
            finally:
                cluster.refreshing = False

        threading.Thread(target=refresh, name="execbox-ray-survey", daemon=True).start()

    def _survey_locked(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from execbox.backends.ray.node import NodeHost

        self._connect()
        job = ray.get_runtime_context().get_job_id()
        if self._cluster.job != job:
            self._nodes.clear()
            self._cluster.handles.clear()
            self._cluster.job = job
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}  # type: ignore[no-untyped-call]
        for gone in set(self._nodes) - alive:
            self._nodes.pop(gone, None)  # lost() on the event loop may have popped it meanwhile
        for gone in set(self._cluster.handles) - alive:
            self._cluster.handles.pop(gone, None)
        # per driver job (its actors die with it) and configuration (another runner may name another backend)
        prefix = f"{ACTOR_PREFIX}-{job}-{self.settings.node_backend}-" \
                 f"{self.settings.slots_per_node}"
        host: Any = ray.remote(NodeHost)
        asked = {}
        for node_id in sorted(alive - set(self._nodes)):
            actor = host.options(
                name=f"{prefix}-{node_id}", get_if_exists=True, num_cpus=0, max_restarts=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.settings.node_backend, self.settings.slots_per_node)
            # the creating handle keeps a non-detached actor alive (one got back by name does not): kept first; a
            # dead actor's is dropped by lost()
            self._cluster.handles.setdefault(node_id, actor)
            asked[node_id] = (actor, actor.survey.remote())
        # one deadline for every node's answer, not one per node in turn
        ready = set(ray.wait([ref for _, ref in asked.values()], num_returns=len(asked),
                             timeout=self.shared.open_timeout_sec)[0]) if asked else set()
        for node_id, (actor, ref) in asked.items():
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer within CODE_EXEC_OPEN_TIMEOUT_SEC={self.shared.open_timeout_sec}")
                kind, value = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a node that cannot host its actor is left out, and said
                self._unusable[node_id] = f"its host actor did not start: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            if kind != "ok":
                self._unusable[node_id] = value.get("message", "")
                continue
            self._unusable.pop(node_id, None)
            self._nodes[node_id] = Node(node_id, value["ip"], actor, value["backend"],
                                        Capabilities(**value["capabilities"]),
                                        {k: tuple(v) for k, v in value["verdicts"].items()}, value["slots"],
                                        value["pid"])
        if not self._nodes:
            why = "; ".join(f"node {n[:12]}: {r}" for n, r in self._unusable.items()) or "the cluster has no node"
            raise BackendUnavailableError(
                f"no node of the Ray cluster can run sandboxes ({why}); do not retry until one can",
                backend=self.name, env_var="CODE_EXEC_RAY_NODE_BACKEND",
                fix="install a sandbox backend on the nodes (docker or bubblewrap) with execbox, or name one that "
                    "is there in CODE_EXEC_RAY_NODE_BACKEND")

    async def probe(self) -> Capabilities:
        self.settings  # noqa: B018 - an invalid setting is a ConfigError here
        await sdk_call(self._survey)
        return self._shared_capabilities()

    def _shared_capabilities(self) -> Capabilities:
        caps = [node.capabilities for node in list(self._nodes.values())]
        return Capabilities(
            sandbox=all(c.sandbox for c in caps),
            isolation=min((c.isolation for c in caps), key=_STRENGTH.index),
            network_modes=functools.reduce(frozenset.intersection, (c.network_modes for c in caps)),
            persistent_sessions=all(c.persistent_sessions for c in caps),
            file_transfer=all(c.file_transfer for c in caps),
            limits=functools.reduce(frozenset.intersection, (c.limits for c in caps)),
            remote=True,
            mounts=False,  # a host path of this driver is not on the node
            streaming=True,
        )

    def verdict(self, request: ExecRequest) -> Verdict:
        # On the nodes the last check found: never a survey here (it blocks; the runner checks first, see
        # verdict_needs_check). Not checked yet (a listing): no node known, so no sandbox claimed.
        if not self._nodes:
            self.require_sdk()  # without Ray, the pip hint
            return Verdict(False, "no node of the Ray cluster is known yet: the backend's check (`execbox doctor`, "
                                  "or any run) surveys them")
        network = request.network or "none"
        weak = [f"node {node.label}: {node.verdicts.get(network, (False, 'no verdict for ' + network))[1]}"
                for node in list(self._nodes.values()) if not node.verdicts.get(network, (False, ""))[0]]
        if weak:
            return Verdict(False, "not every node of the Ray cluster is a sandbox for this request: " + "; ".join(weak))
        backends = sorted({f"{node.backend}" for node in list(self._nodes.values())})
        return Verdict(True, f"every one of {len(self._nodes)} Ray node(s) runs a sandbox ({', '.join(backends)})")

    def details(self) -> dict[str, Any]:
        return {"nodes": {node.label: {"backend": node.backend, "slots": node.slots, "open": node.open,
                                       "ran": node.ran, "pid": node.pid} for node in list(self._nodes.values())},
                "unusable": dict(self._unusable)}

    # --- placement and calls ---------------------------------------------------------------------------------

    async def place(self, exclude: Node | None = None) -> Node:
        """The node with the most free slots (ties in turn), never ``exclude``."""
        nodes = [node for node in list(self._nodes.values()) if node is not exclude and node.answering]
        if nodes:
            self._refresh_soon()
        else:
            await sdk_call(self._survey)  # a node may have joined since
            nodes = [node for node in list(self._nodes.values()) if node is not exclude and node.answering]
        if not nodes:
            raise SandboxLostError("no other Ray node is alive to run on", backend=self.name)
        turn = next(self._turn)
        node = min(nodes, key=lambda n: ((n.open + 1) / n.slots, (nodes.index(n) - turn) % len(nodes)))
        node.open += 1
        return node

    def alive(self, node: Node) -> bool:
        return self._nodes.get(node.node_id) is node

    def lost(self, node: Node, exc: BaseException) -> SandboxLostError:
        """The node's actor died (the node with it, or its process): forget it, and say what went."""
        self._nodes.pop(node.node_id, None)
        self._cluster.surveyed_at = 0.0  # the next placement looks again: it may answer later, or another joined
        if type(exc).__name__ == "ActorDiedError" and self._cluster.handles.get(node.node_id) is node.actor:
            self._cluster.handles.pop(node.node_id)  # dead: the next survey starts a new one
        return SandboxLostError(
            f"ray node {node.label} was lost ({type(exc).__name__}): the sandbox on it and its files went with it, "
            "and the command was not run again anywhere. Open a new sandbox (its state must be rebuilt)",
            backend=self.name)

    async def unavailable(self, node: Node, exc: BaseException) -> SandboxError:
        """The node's actor did not answer a call (ActorUnavailableError). If it answers again within
        UNAVAILABLE_GRACE_S, it is there with its sandboxes: the node is kept and the call may be retried (it may or
        may not have run); if not, the node is lost."""
        import anyio
        import ray

        node.answering = False
        deadline = anyio.current_time() + UNAVAILABLE_GRACE_S
        try:
            while True:
                try:
                    with anyio.fail_after(max(0.1, deadline - anyio.current_time())):
                        await node.actor.live.remote()
                    break
                except ray.exceptions.ActorUnavailableError:
                    if anyio.current_time() >= deadline:
                        return self.lost(node, exc)
                    await anyio.sleep(0.25)
                except ray.exceptions.RayActorError as died:  # ActorDiedError: the actor is gone for good
                    return self.lost(node, died)
                except TimeoutError:
                    return self.lost(node, exc)
        finally:
            node.answering = True  # answered, or lost (forgotten), or given up on (cancelled): never stuck aside
        return SandboxError(
            f"ray node {node.label} is temporarily unavailable ({type(exc).__name__}): the call may or may not have "
            "run there, and it was not run again. Retry once the node answers", backend=self.name, retryable=True)

    async def await_ref(self, ref: Any, node: Node, *, called_off: bool = True) -> Any:
        """The node's answer to ``ref``. A caller that gives up calls the node's call off too (``called_off``),
        unless it is one that must run anyway (a close)."""
        import ray

        try:
            return await ref
        except ray.exceptions.ActorUnavailableError as exc:
            raise await self.unavailable(node, exc) from None
        except ray.exceptions.RayActorError as exc:  # ActorDiedError: the node or its actor is gone
            raise self.lost(node, exc) from None
        except ray.exceptions.RayTaskError as exc:  # a bug on the node, not an execbox error
            raise SandboxError(f"the host actor on ray node {node.label} failed: {str(exc)[:800]}",
                               backend=self.name) from None
        except BaseException:
            if called_off:
                ray.cancel(ref)  # the caller gave up: stop the node's call (its sandbox is closed next)
            raise

    async def stream_refs(self, gen: Any, node: Node) -> AsyncIterator[Any]:
        import ray

        try:
            async for ref in gen:
                yield ref
        except ray.exceptions.ActorUnavailableError as exc:
            raise await self.unavailable(node, exc) from None
        except ray.exceptions.RayActorError as exc:
            raise self.lost(node, exc) from None
        except BaseException:
            ray.cancel(gen)  # the caller gave up: stop the node's run (its sandbox is closed next)
            raise

    def reply(self, answer: tuple[str, Any], node: Node) -> Any:
        kind, value = answer
        if kind == "error":
            raise _rebuild(value, node)
        return value

    async def open_session(self, spec: SessionSpec) -> RaySession:
        if spec.mounts:
            raise ConfigError("the ray backend binds no host paths: the driver's paths are not on the nodes",
                              backend=self.name)
        node = await self.place()
        try:
            if spec.oneshot and node.workspace is not None:
                # opened with its command, in one call to the node
                return RaySession(self, node, spec, node.workspace, opened=False)
            session = RaySession(self, node, spec, "", opened=True)
            try:
                session.workspace = await session._call("open", session.sid, spec.network, spec.limits.model_dump(),
                                                        spec.lifetime_s)
            except BaseException:
                # given up on (cancelled, timed out): the node closes it, even once it opened; told even when the
                # node was set aside meanwhile (its host actor may still be there). Fire and forget: the caller leaves
                with contextlib.suppress(Exception):
                    node.actor.close.remote(session.sid)
                raise
            node.workspace = session.workspace
            return session
        except BaseException:
            node.open -= 1
            raise

    async def gc(self) -> list[str]:
        return []  # each node's host actor sweeps its own backend when it starts
