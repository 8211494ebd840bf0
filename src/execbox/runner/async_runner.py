"""AsyncRunner: picks the backend, admits requests and runs one-shots through the pipeline; makes sandboxes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, AsyncIterable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from execbox.audit import fields as audit_fields
from execbox.audit import log as audit_log
from execbox.config.settings import Settings
from execbox.contract.backend import ExecutionBackend, OwnedSandbox, Session, SessionSpec, Verdict, bounded
from execbox.contract.models import (
    ISOLATION_STRENGTH,
    Capabilities,
    ExecRequest,
    ExecResult,
    Language,
    Limits,
    Mount,
    NetworkMode,
)
from execbox.contract.output import LiveOutput, OnText, OutputEvent, deliver, stream_events
from execbox.contract.snapshots import SnapshotParts
from execbox.errors import (
    BackendUnavailableError,
    ConfigError,
    ExecboxError,
    UnsupportedPolicyError,
)
from execbox.files import transfer
from execbox.files.transfer import Transfer
from execbox.files.workspace import normalize
from execbox.guard.guard import Guard
from execbox.kit import packages, transfers
from execbox.registry import BUILTIN_DISTRIBUTION, Registry, get_registry
from execbox.runner import live
from execbox.runner import snapshots as store
from execbox.runner.batch import AsyncBatch, Item
from execbox.runner.pipeline import (
    Uploads,
    _check,
    _close,
    _command_request,
    _enough_threads,
    _exec_audited,
    _files_s,
    _not_mounted,
    _open,
    _pairs,
    _request,
    _request_kw,
    _sandbox_attrs,
    _sandbox_secrets,
    _text,
    admit,
    backend_errors,
    configuration,
    resolve,
    transfer_bounds,
)
from execbox.runner.pool import WarmPool
from execbox.runner.sandbox import AsyncSandbox
from execbox.runner.scheduler import Slots, default_max_concurrent
from execbox.runner.snapshots import Snapshot
from execbox.secrets import egress as egress_given
from execbox.secrets import values as secrets_inject
from execbox.secrets.egress import Given
from execbox.secrets.values import Secret
from execbox.telemetry import annotate, outcome, record_queued, span

LOCAL_FALLBACK = "local_subprocess"
#: The most a listing (`execbox ps`, `backends`, `doctor`) waits for one backend's answer.
LISTING_BOUND_S = 20.0


class AsyncRunner:
    """Runs requests through the one path. ``options`` gives backends their settings in code, by backend name
    (``{"docker": {"image": "my-image"}}``), on top of the environment.

    Use it as ``async with AsyncRunner() as runner:`` to close what its backends opened (engine clients,
    connections) when done; a runner that is just dropped leaves that to the garbage collector. ``check()``
    answers are trusted for CHECK_TTL_S seconds per backend instance (see ExecutionBackend.check).
    """

    def __init__(self, settings: Settings | None = None, *,
                 options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.guard = Guard(self.settings)
        self.options = {name: dict(values) for name, values in (options or {}).items()}
        self._backends: dict[tuple[str, str], ExecutionBackend] = {}
        #: The audit log (CODE_EXEC_AUDIT_LOG): every exec, refusal and sandbox open/close is recorded; other parts
        #: (the MCP server's approvals, say) record through ``runner.audit.record(event, **fields)``.
        self.audit = audit_log.AuditLog.from_settings(self.settings)
        #: The concurrency cap, shared by every thread and loop that uses this runner.
        self.slots = Slots(self.settings.max_concurrent or default_max_concurrent(self.settings.memory_mb))
        #: Warm sandboxes; active only while the runner is entered (its background task group refills them).
        self.pool = WarmPool(self.settings.pool_size, self.settings.pool_ttl_sec,
                             record=lambda event, fields: self.audit.arecord(event, **fields),
                             longest_run_s=self.settings.max_timeout_sec + 60)
        self._background: Any = None
        self._pool_stop: anyio.Event | None = None
        #: What ``auto``'s last pick passed over, each candidate it preferred with why it did not run here.
        self.auto_passed_over: list[str] = []

    async def __aenter__(self) -> AsyncRunner:
        if self.settings.pool_size and self._background is None:
            self._background = anyio.create_task_group()
            self.pool.attach(await self._background.__aenter__())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def serve_pool(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Host the warm pool's background work until ``aclose``: for a caller that cannot enter the runner and
        leave it in one task (the sync facade runs this in its loop thread)."""
        async with anyio.create_task_group() as tasks:
            self.pool.attach(tasks)
            self._pool_stop = anyio.Event()
            task_status.started()
            await self._pool_stop.wait()
            tasks.cancel_scope.cancel()

    async def aclose(self) -> None:
        """Close the warm pool and every backend instance this runner made (engine clients, connections)."""
        background, self._background = self._background, None
        with anyio.CancelScope(shield=True):
            await self.pool.aclose()
        if self._pool_stop is not None:
            self._pool_stop.set()
        if background is not None:
            background.cancel_scope.cancel()
            await background.__aexit__(None, None, None)
        backends, self._backends = list(self._backends.values()), {}
        with anyio.CancelScope(shield=True):
            for backend in backends:
                await bounded(backend.aclose(), backend.shared.backend_grace_sec, backend=backend, doing="aclose")

    @property
    def listing_bound(self) -> float:
        """How long a listing waits for one backend (LISTING_BOUND_S, less when CODE_EXEC_OPEN_TIMEOUT_SEC is less:
        a listing need not wait longer than opening a sandbox would); one that does not answer in time is named."""
        return min(LISTING_BOUND_S, self.settings.open_timeout_sec)

    @property
    def registry(self) -> Registry:
        return get_registry(self.settings.load_plugins, self.settings.disable_plugins)

    def backend(self, name: str, options: Mapping[str, Any] | None = None) -> ExecutionBackend:
        """The instance of a registered backend with the runner's options for it, ``options`` on top; one per
        runner and set of options."""
        merged = {**self.options.get(name, {}), **(options or {})}
        key = (name, repr(sorted(merged.items())))
        if key not in self._backends:
            self._backends[key] = self.registry.get(name).cls(self.settings, merged)
        return self._backends[key]

    async def select(self, name: str | None = None, *, session: bool = False,
                     network: NetworkMode | None = None) -> tuple[ExecutionBackend, Capabilities]:
        """The backend to use and what it enforces here; ``auto`` picks the strongest sandbox that runs here and
        offers ``network`` (default: CODE_EXEC_NETWORK): gVisor with no network stack is passed over for egress."""
        name = name or (self.settings.session_backend if session else self.settings.backend)
        if name != "auto":
            backend = self.backend(name)
            return backend, await _check(backend)
        tried: list[str] = []
        probe = self.default_configuration(network)
        for candidate in self.auto_candidates():
            try:
                backend = self.backend(candidate)
                verdict = backend.verdict(probe)
                if not (verdict.sandbox or candidate == LOCAL_FALLBACK):
                    tried.append(f"- {candidate}: configured here, it is not a sandbox ({verdict.reason})")
                    continue
                caps = await _check(backend)
                if probe.network not in caps.network_modes and candidate != LOCAL_FALLBACK:
                    tried.append(f"- {candidate}: it does not offer network mode {probe.network!r} here")
                    continue
                self.auto_passed_over = [line.removeprefix("- ") for line in tried]
                return backend, caps
            except BackendUnavailableError as exc:
                if exc.env_var and exc.env_var in os.environ:
                    # The operator configured this backend (CODE_EXEC_DOCKER_RUNTIME, ...): falling back to a
                    # weaker sandbox is not what they asked for. Likewise a ConfigError is never skipped.
                    raise
                tried.append(f"- {candidate}: {exc.message}")
        local_hint = "" if self.settings.local else (
            "\n- or, only on your own machine for yourself: CODE_EXEC_LOCAL=true (runs local_subprocess, no sandbox)"
        )
        candidates = set(self.auto_candidates())
        for entry in sorted(self.registry.backends.values(), key=lambda e: e.name):
            if entry.cls.capabilities.sandbox and not entry.cls.capabilities.remote and entry.name not in candidates:
                tried.append(f"- {entry.name} (third-party, from {entry.distribution!r}): auto does not pick a plugin "
                             "on its own claim; name it in EXECBOX_AUTO_PLUGINS, or set CODE_EXEC_BACKEND to it")
        raise BackendUnavailableError(
            "no sandbox backend can run here (CODE_EXEC_BACKEND=auto). Install or start one of:\n"
            + "\n".join(tried or ["- (no sandbox backend is registered)"]) + local_hint,
            env_var="CODE_EXEC_BACKEND",
        )

    def auto_candidates(self) -> list[str]:
        """Local sandbox backends, strongest isolation first (microvm, gvisor, container, namespace: a backend's
        declared isolation, ISOLATION_STRENGTH), built-in before third-party, then by name; local_subprocess last
        and only in local mode. ``select`` picks the first that runs here and keeps why it passed each one before
        it over (``auto_passed_over``). Auto never changes a backend's configuration to make it stronger: docker
        runs gVisor only when CODE_EXEC_DOCKER_RUNTIME names a gVisor runtime (``execbox doctor`` says when the
        engine has one registered).

        A third-party backend's capabilities are its own claim: ``auto`` considers one only when the operator
        opted in by naming it in EXECBOX_AUTO_PLUGINS (name it as CODE_EXEC_BACKEND to use it directly)."""
        trusted = set(self.settings.auto_plugins)
        entries = [e for e in self.registry.backends.values()
                   if e.cls.capabilities.sandbox and not e.cls.capabilities.remote
                   and (e.distribution == BUILTIN_DISTRIBUTION or {e.name, e.distribution} & trusted)]
        entries.sort(key=lambda e: (-ISOLATION_STRENGTH[e.cls.capabilities.isolation],
                                    e.distribution != BUILTIN_DISTRIBUTION, e.name))
        names = [e.name for e in entries]
        if self.settings.local and LOCAL_FALLBACK in self.registry.backends:
            names.append(LOCAL_FALLBACK)
        return names

    def default_configuration(self, network: NetworkMode | None = None) -> ExecRequest:
        """This runner's default configuration (with ``network``, when given), resolved as a run's would be (the
        limits and timeout it would run with): what ``auto``, ``verdict`` and ``judge`` ask about."""
        return resolve(self.settings, configuration(network or self.settings.network))[0]

    def verdict(self, backend: ExecutionBackend, network: NetworkMode | None = None) -> Verdict:
        """The backend's own verdict on this runner's default configuration (with ``network``, when given): is it
        a sandbox here? The backend's answer alone; ``judge`` adds the guard's."""
        return backend.verdict(self.default_configuration(network))

    def judge(self, backend: ExecutionBackend, capabilities: Capabilities | None = None) -> Verdict:
        """Would the guard admit this runner's default configuration on ``backend`` here? The backend's verdict, or
        the guard's refusal raised (RefusedError): a question (``doctor``, ``backends``), so nothing is recorded.
        ``capabilities``: what the backend enforces here, when known (then the network mode is judged too)."""
        request = self.default_configuration()
        verdict = backend.verdict(request)
        self.guard.check_verdict(backend, request)
        self.guard.check_secrets(backend)
        if capabilities is not None:
            self.guard.check_policy(backend, capabilities, request, set())
        return verdict

    def prepare(self, request: ExecRequest) -> tuple[ExecRequest, list[str], set[str]]:
        """The request with this runner's settings applied (pipeline.resolve)."""
        return resolve(self.settings, request)

    async def execute(self, request: ExecRequest, *, backend: str | None = None,
                      output: LiveOutput | None = None, options: Mapping[str, Any] | None = None,
                      upload: Uploads | None = None, download: Uploads | None = None) -> ExecResult:
        """Run one request in a fresh sandbox that is gone afterwards, also on error or cancellation. ``output``
        receives the output as it arrives (see ``stream``). ``options``: the backend's own options for this run
        (``{"image": ...}`` for docker). ``upload``: local paths copied in first, ``{local: remote}``;
        ``download``: workspace paths copied out after the run, ``{remote: local}`` ("." = the whole workspace)."""
        with span("execbox.run") as current:
            result = await self._execute(request, backend=backend, output=output, options=options, upload=upload,
                                         download=download)
            annotate(current, {"execbox.backend": result.backend, "execbox.outcome": outcome(result),
                               "execbox.pooled": result.pooled, "execbox.queued_s": result.queued_s})
            return result

    async def _execute(self, request: ExecRequest, *, backend: str | None, output: LiveOutput | None,
                       options: Mapping[str, Any] | None, upload: Uploads | None,
                       download: Uploads | None) -> ExecResult:
        uploads, downloads = _pairs(upload, "upload"), _pairs(download, "download")
        admission = await admit(self, request, backend=backend, options=options, uploads=uploads)
        impl, resolved, mounts = admission.backend, admission.request, admission.mounts
        spec = SessionSpec(resolved.network or "none", resolved.limits or Limits(), True, (resolved.timeout or 1) + 60,
                           mounts=mounts, tmpfs=tuple(resolved.tmpfs))
        _enough_threads(self.slots.total)
        records: list[asyncio.Task[str | None]] = []  # the run's audit record, written beside its clean-up
        try:
            async with self.slots.slot(self.settings.queue_timeout_sec, "this run") as waited:
                record_queued(waited, backend=impl.name)
                # A warm member was opened without this run's mounts or tmpfs (the pool keys on network and limits).
                session = None if mounts or spec.tmpfs else self.pool.take(impl, spec)
                pooled = session is not None
                if session is None:
                    session = await _open(impl, spec)
                else:
                    with span("execbox.sandbox.open", _sandbox_attrs(impl, spec, pooled=True)):
                        pass  # taken from the pool: the open it saves is the point of the span
                session.session_spec = spec
                # Listed by `execbox ps` (and killable) while it runs, under its id in the audit log.
                oneshot_id = audit_fields.new_session_id()
                live.oneshot(oneshot_id, impl.name, session, spec, resolved.argv[0] if resolved.argv else
                             resolved.language, timeout_s=resolved.timeout or spec.lifetime_s, pooled=pooled)
                try:
                    with live.told_if_killed(oneshot_id, impl.name, "Run it again"):
                        for local, remote in uploads:
                            await self.upload_to(impl, session, local, remote)
                        result = await _exec_audited(self.audit, admission, session, output=output, records=records,
                                                     oneshot_id=oneshot_id)
                        for remote, local in downloads:
                            moved = await self.download_from(impl, session, remote, local,
                                                             secrets_inject.redactor_for(resolved.secrets))
                            result.notes.extend(f"download: {s}" for s in moved.skipped)
                finally:
                    live.closed(oneshot_id, marks=live.killed(oneshot_id))
                    if pooled:
                        await self.pool.discard(session)  # used once; removed in the background
                    else:
                        await _close(session, impl)
            notes = result.notes
            if self.pool.active and not pooled and impl.name in self.pool.errors:
                notes = [*notes, f"warm pool: starting a {impl.name} sandbox ahead failed "
                                 f"({self.pool.errors[impl.name]}); this run started its own"]
            # asyncio.shield: a cancellation landing here must not cancel the record task it would reach
            written = [note for note in [await asyncio.shield(record) for record in records] if note]
            return result.model_copy(update={"queued_s": waited, "pooled": pooled, "notes": [*notes, *written]})
        finally:
            if records:
                with anyio.CancelScope(shield=True):  # on disk before the run returns or raises, whatever happened
                    await asyncio.wait(records)  # neither raises nor cancels them, if interrupted

    @property
    def transfer_limits(self) -> transfer.TransferLimits:
        """The bounds of uploads, downloads and listings (CODE_EXEC_MAX_TRANSFER_BYTES / _FILES)."""
        return transfer_bounds(self.settings)

    def state_places(self) -> list[str]:
        """What of execbox's own a mount or an upload must never hand to the code, beyond the default places:
        the package cache, the audit log's directory and key file, the MCP server's grant-signing key."""
        places = [str(self.package_cache), str(store.root())]
        if self.audit.path is not None:
            places.append(str(self.audit.path.parent))
        if self.settings.audit_key_file is not None:
            places.append(str(self.settings.audit_key_file))
        if os.environ.get("EXECBOX_MCP_KEY_FILE"):
            places.append(os.environ["EXECBOX_MCP_KEY_FILE"])
        return places

    @property
    def package_cache(self) -> Path:
        """The per-user wheel cache (CODE_EXEC_PACKAGE_CACHE; see kit.packages)."""
        return packages.default_cache_dir(self.settings.package_cache)

    async def upload_to(self, backend: ExecutionBackend, session: Session, local: str, remote: str) -> Transfer:
        rel = normalize(_text(remote, "remote path"), session.workspace, allow_root=True, anywhere=True)
        _not_mounted(session, rel, "upload to")
        with span("execbox.files.upload", {"execbox.backend": backend.name}) as current, backend_errors(backend.name):
            moved = await bounded(transfers.upload_path(session, _text(os.fspath(local), "local path"), rel,
                                                       limits=self.transfer_limits),
                                  _files_s(backend), backend=backend, doing="an upload", session=session)
            annotate(current, _moved_attrs(moved))
        return moved

    async def download_from(self, backend: ExecutionBackend, session: Session, remote: str, local: str,
                            redactor: secrets_inject.Redactor | None = None) -> Transfer:
        """The download; what it says of the sandbox's files (skipped entries, errors) never shows a secret the
        sandbox was given (the code may have named a file or a link after one)."""
        rel = normalize(_text(remote, "remote path"), session.workspace, allow_root=True, anywhere=True)
        _not_mounted(session, rel, "download")
        with span("execbox.files.download", {"execbox.backend": backend.name}) as current, \
                secrets_inject.redacting(redactor), backend_errors(backend.name):
            moved = await bounded(transfers.download_path(session, rel, _text(os.fspath(local), "local path"),
                                                         limits=self.transfer_limits),
                                  _files_s(backend), backend=backend, doing="a download", session=session)
            annotate(current, _moved_attrs(moved))
        if redactor is not None:
            moved = moved.model_copy(update={"skipped": [redactor.redact_text(s) for s in moved.skipped]})
        return moved

    # -- snapshots: the store (runner.snapshots) and the backend's part of each --

    async def take_snapshot(self, backend: ExecutionBackend, session: Session, *, name: str | None, memory: bool,
                            network: NetworkMode, limits: Limits | None, origin: str) -> Snapshot:
        """A new snapshot of ``session``: its workspace packed through the session's bounded download, the rest
        written by the backend (bounded like an open), then hashed and sealed. Whatever fails or is cancelled
        midway leaves nothing: the backend's part and the directory are removed."""
        with span("execbox.snapshot", {"execbox.backend": backend.name, "execbox.snapshot.memory": memory}):
            return await self._take_snapshot(backend, session, name=name, memory=memory, network=network,
                                             limits=limits, origin=origin)

    async def _take_snapshot(self, backend: ExecutionBackend, session: Session, *, name: str | None, memory: bool,
                             network: NetworkMode, limits: Limits | None, origin: str) -> Snapshot:
        place = await anyio.to_thread.run_sync(store.new_place, backend.name)
        parts: SnapshotParts | None = None
        try:
            left = await anyio.to_thread.run_sync(store.room_left, self.settings)
            bounds = store.limits(self.transfer_limits, left)
            with store.over_the_bound(self.settings), backend_errors(backend.name):
                with open(store.workspace_of(place.id), "xb") as out:
                    await bounded(transfers.pack_workspace(session, out, limits=bounds), _files_s(backend),
                                  backend=backend, doing="packing the workspace for a snapshot", session=session)
                parts = await bounded(session.snapshot(place, memory=memory), backend.shared.open_timeout_sec,
                                      backend=backend, doing="snapshot", session=session,
                                      late=lambda late: backend.delete_snapshot(place, late))
            made = parts
            return await anyio.to_thread.run_sync(lambda: store.seal(
                place, name=name, backend=backend.name, network=network, limits=limits, parts=made, origin=origin,
                max_total_bytes=self.settings.snapshot_max_total_mb << 20))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._remove_snapshot(backend, place.id, parts)
            raise

    async def _remove_snapshot(self, backend: ExecutionBackend, snapshot_id: str,
                               parts: SnapshotParts | None) -> None:
        """What the backend keeps of a snapshot (its refs; for one never finished, what it can find by the id),
        then its directory. A backend that fails to remove its part leaves the directory for another try."""
        place = store.place_of(snapshot_id)
        await bounded(backend.delete_snapshot(place, parts or SnapshotParts(memory=False, source="")),
                      backend.shared.backend_grace_sec, backend=backend, doing="delete_snapshot")
        await anyio.to_thread.run_sync(store.remove, snapshot_id)

    async def load_snapshot(self, snapshot_id: str) -> Snapshot:
        """The snapshot ``snapshot_id``, checked against its content hash and age (SnapshotError otherwise)."""
        snapshot_id = _text(snapshot_id, "snapshot id")
        return await anyio.to_thread.run_sync(lambda: store.load(
            snapshot_id, max_age_s=self.settings.snapshot_max_age_sec))

    async def snapshots(self) -> list[Snapshot]:
        """Every snapshot of this user on this machine, oldest first."""
        return await anyio.to_thread.run_sync(store.listing)

    async def delete_snapshot(self, snapshot: Snapshot | str) -> None:
        """Remove a snapshot (or one by its id): its files and what its backend keeps of it; audited. A second
        call does nothing."""
        snapshot_id = snapshot.id if isinstance(snapshot, Snapshot) else _text(snapshot, "snapshot id")
        name = await anyio.to_thread.run_sync(store.backend_of, snapshot_id)
        if name is None:
            return  # gone already
        await anyio.to_thread.run_sync(store.refuse_if_being_written, snapshot_id)
        parts = await anyio.to_thread.run_sync(store.read_refs, snapshot_id)
        with backend_errors(name):
            await self._remove_snapshot(self.backend(name), snapshot_id, parts)
        await self.audit.arecord("snapshot.delete", snapshot=snapshot_id, snapshot_backend=name)

    async def gc_snapshots(self, backend: str | None = None) -> list[str]:
        """Remove the snapshots past CODE_EXEC_SNAPSHOT_MAX_AGE_SEC and those whose writer died before finishing
        them (only ``backend``'s, when named); their ids. One whose backend cannot remove its part now (gone,
        unreachable) is kept for the next time."""
        expired = [s.id for s in await anyio.to_thread.run_sync(store.expired, self.settings.snapshot_max_age_sec)
                   if backend in (None, s.backend)]
        gone = expired + await anyio.to_thread.run_sync(
            lambda: [i for i in store.leftovers() if backend in (None, store.backend_of(i))])
        removed = []
        for snapshot_id in gone:
            try:
                await self.delete_snapshot(snapshot_id)
            except ExecboxError:
                continue
            removed.append(snapshot_id)
        return removed

    async def sandboxes(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Every live sandbox of this user on this host (`execbox ps`): the runner's records (execbox.runner.live),
        checked against what each backend that can say finds by its ownership labels or files
        (ExecutionBackend.owned, each within listing_bound, all at once): a record whose sandbox is gone is
        left out, a sandbox no record names is listed (an orphan, or unrecorded). Also the backends that did not
        answer, and why (their records are listed as they are). A backend whose SDK or engine is not here is not
        asked (docker: no engine's socket answers)."""
        records = live.listing()  # first: see live.merged
        found: dict[str, list[OwnedSandbox] | None] = {}
        unanswered: dict[str, str] = {}

        async def ask(name: str) -> None:
            try:
                backend = self.backend(name)
                if type(backend).owned is ExecutionBackend.owned:
                    return  # it cannot say: nothing to start or import
                backend.require_sdk()
                found[name] = await bounded(backend.owned(), self.listing_bound, backend=backend,
                                            doing="listing its sandboxes")
            except BackendUnavailableError:  # its SDK or its engine is not here (or not usable from here)
                return
            except ExecboxError as exc:
                unanswered[name] = exc.message
            except Exception as exc:  # a plugin's bug: its records are listed as they are, `ps` goes on
                unanswered[name] = f"{type(exc).__name__}: {exc}"

        async with anyio.create_task_group() as tasks:
            for name in self.registry.names():
                tasks.start_soon(ask, name)
        return live.merged(records, found), unanswered

    async def kill(self, sandbox_id: str) -> dict[str, Any]:
        """End the live sandbox ``sandbox_id`` (from `execbox ps`), whichever process of this user on this host
        holds it (or held it: an orphan), through its backend; audited as sandbox.kill (with who asked). Its
        owner's next call on it is a SandboxError saying so. Returns its record (or `ps` row). ConfigError for an
        id that names no live sandbox here."""
        try:
            record, recorded = live.find(sandbox_id), True
        except ConfigError:  # an orphan, or a sandbox whose owner wrote no record: its backend finds it
            rows = [r for r in (await self.sandboxes())[0] if r["id"] == sandbox_id and r.get("kind") in (
                "orphan", "unrecorded")]
            if not rows:
                raise
            record, recorded = rows[0], False
        ref = record.get("ref")
        backend = self.backend(str(record.get("backend")))
        if not isinstance(ref, str) or not ref:
            raise UnsupportedPolicyError(f"sandbox {sandbox_id} cannot be ended from outside: its {backend.name} "
                                         "session names nothing its backend finds again", backend=backend.name)
        backend.require_sdk()
        if recorded:  # marked first: the owner's call that the kill interrupts already says why it failed
            live.mark_killed(sandbox_id, {"pid": os.getpid(), "uid": os.getuid()})
        try:
            await bounded(backend.kill(ref), backend.shared.open_timeout_sec, backend=backend, doing="kill")
        except BaseException:
            live.unmark_killed(sandbox_id)
            raise
        await self.audit.arecord("sandbox.kill", session=sandbox_id, backend=backend.name, owner_pid=record.get("pid"),
                                 pooled=bool(record.get("pooled")), kind=record.get("kind") or live.kind(record))
        return record

    async def warm(self, backend: str | None = None, *, network: NetworkMode | None = None,
                   limits: Limits | None = None, timeout: float | None = None) -> int:
        """Start filling the warm pool for one configuration now (rather than on its first run); returns how
        many members are ready at this moment. Needs CODE_EXEC_POOL_SIZE > 0 and an entered runner."""
        if not self.pool.active:
            raise ConfigError("the warm pool is off: set CODE_EXEC_POOL_SIZE (or Settings(pool_size=...)) and use "
                              "the runner as `async with AsyncRunner() as runner:`", env_var="CODE_EXEC_POOL_SIZE")
        admission = await admit(self, configuration(network, limits, timeout=timeout), backend=backend)
        impl, resolved = admission.backend, admission.request
        spec = SessionSpec(resolved.network or "none", resolved.limits or Limits(), True, (resolved.timeout or 1) + 60)
        self.pool.refill(impl, spec)
        return self.pool.ready(impl, spec)

    async def run(self, command: str | Sequence[str], *, backend: str | None = None, network: NetworkMode | None = None,
                  timeout: float | None = None, env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                  files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
                  max_output_bytes: int | None = None, limits: Limits | None = None,
                  on_stdout: OnText | None = None, on_stderr: OnText | None = None,
                  mounts: Sequence[Mount] | None = None,
                  tmpfs: Sequence[str] | None = None, collect: Sequence[str] | None = None,
                  upload: Uploads | None = None, download: Uploads | None = None,
                  options: Mapping[str, Any] | None = None,
                  secrets: Mapping[str, secrets_inject.Secret | str] | None = None,
                  secrets_at_egress: egress_given.Given | None = None) -> ExecResult:
        """Run a command (argv list, or a string for /bin/sh -c) in a fresh sandbox. ``on_stdout(text)`` /
        ``on_stderr(text)`` get the output as it arrives (the result is the same as without them). Files: see
        ``execute``; ``mounts`` bind host paths (read-only unless ``Mount(..., writable=True)``); ``collect``
        globs return matching workspace files on ``result.files``."""
        request = _command_request(command, **_request_kw(network, timeout, env, stdin, files, workdir,
                                                          max_output_bytes, limits, mounts, collect, secrets,
                                                          secrets_at_egress, tmpfs=tmpfs))
        return await deliver(lambda out: self.execute(request, backend=backend, output=out, options=options,
                                                      upload=upload, download=download), on_stdout, on_stderr)

    async def run_code(self, code: str, language: Language = "python", *, backend: str | None = None,
                       network: NetworkMode | None = None, timeout: float | None = None,
                       env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                       files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
                       max_output_bytes: int | None = None, limits: Limits | None = None,
                       mounts: Sequence[Mount] | None = None,
                       tmpfs: Sequence[str] | None = None, collect: Sequence[str] | None = None,
                       secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
                       on_stdout: OnText | None = None, on_stderr: OnText | None = None, upload: Uploads | None = None,
                       download: Uploads | None = None, options: Mapping[str, Any] | None = None) -> ExecResult:
        """Run code (``language``: python or bash) in a fresh sandbox, as a file, never on the command line; the
        keywords are ``run``'s."""
        request = _request(code=code, language=language, **_request_kw(
            network, timeout, env, stdin, files, workdir, max_output_bytes, limits, mounts, collect, secrets,
            secrets_at_egress, tmpfs=tmpfs))
        return await deliver(lambda out: self.execute(request, backend=backend, output=out, options=options,
                                                      upload=upload, download=download), on_stdout, on_stderr)

    def stream(self, command: str | Sequence[str], *, backend: str | None = None, network: NetworkMode | None = None,
               timeout: float | None = None, env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
               files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
               max_output_bytes: int | None = None, limits: Limits | None = None, mounts: Sequence[Mount] | None = None,
               tmpfs: Sequence[str] | None = None,
               collect: Sequence[str] | None = None, secrets: Mapping[str, Secret | str] | None = None,
               secrets_at_egress: Given | None = None) -> AsyncGenerator[OutputEvent | ExecResult, None]:
        """``async for event in runner.stream(cmd):`` OutputEvents as the output arrives, then the ExecResult."""
        request = _command_request(command, **_request_kw(
            network, timeout, env, stdin, files, workdir, max_output_bytes, limits, mounts, collect, secrets,
            secrets_at_egress, tmpfs=tmpfs))
        return stream_events(lambda out: self.execute(request, backend=backend, output=out))

    def stream_code(self, code: str, language: Language = "python", *, backend: str | None = None,
                    network: NetworkMode | None = None, timeout: float | None = None,
                    env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                    files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
                    max_output_bytes: int | None = None, limits: Limits | None = None,
                    mounts: Sequence[Mount] | None = None,
                    tmpfs: Sequence[str] | None = None, collect: Sequence[str] | None = None,
                    secrets: Mapping[str, Secret | str] | None = None,
                    secrets_at_egress: Given | None = None) -> AsyncGenerator[OutputEvent | ExecResult, None]:
        """``stream`` for code, as ``run_code`` runs it."""
        request = _request(code=code, language=language, **_request_kw(
            network, timeout, env, stdin, files, workdir, max_output_bytes, limits, mounts, collect, secrets,
            secrets_at_egress, tmpfs=tmpfs))
        return stream_events(lambda out: self.execute(request, backend=backend, output=out))

    def map(self, items: Iterable[Item] | AsyncIterable[Item], *, concurrency: int | None = None,
            ordered: bool = True, progress: bool | None = None, backend: str | None = None) -> AsyncBatch:
        """Run many one-shots, each item in its own fresh sandbox, ``concurrency`` at a time (default: this runner's
        slots, CODE_EXEC_MAX_CONCURRENT), through the warm pool when the runner has one. An item is Python code
        (str), a command (argv list), an ExecRequest or a mapping of its fields. ``async with runner.map(items) as
        batch: async for item in batch`` gives a BatchItem per item (its result, or the error that was its
        outcome), in input order or, ``ordered=False``, as they finish. ``progress``: a progress bar and summary on
        stderr (default: when stderr is a terminal); ``batch.summary`` counts outcomes either way."""
        return AsyncBatch(self, items, concurrency=concurrency, ordered=ordered, progress=progress, backend=backend)

    def sandbox(self, backend: str | None = None, *, network: NetworkMode | None = None, limits: Limits | None = None,
                name: str | None = None, lifetime_s: float = 3600.0, mounts: Sequence[Mount] | None = None,
                tmpfs: Sequence[str] | None = None,
                package_cache: bool = False, pip: Sequence[str] | None = None,
                secrets: Mapping[str, secrets_inject.Secret | str] | None = None,
                secrets_at_egress: egress_given.Given | None = None, from_snapshot: Snapshot | str | None = None,
                **options: Any) -> AsyncSandbox:
        """A persistent sandbox. Keywords beyond these are the backend's own options (its settings_model's fields,
        e.g. ``image=`` for docker), on top of the runner's and the environment's. ``mounts``: host paths bound
        in for the sandbox's life; ``tmpfs``: absolute paths that get an empty writable tmpfs each (e.g.
        ``["/var/tmp"]``), owned by the sandbox user. The per-user wheel cache is bound read-only (where pip looks)
        wherever the backend can; ``package_cache``: demand it (refused where the backend cannot bind it); ``pip``:
        requirements installed from it when the sandbox opens (implies ``package_cache``). ``secrets``:
        given to every exec (on top of an exec's own), redacted from what every exec returns; ``secrets_at_egress``
        likewise (network mode proxy). ``from_snapshot``: start in a snapshot's state (sb.snapshot(),
        runner.snapshots()), on its backend, with its network and limits unless named here; re-judged under today's
        settings."""
        sandbox = AsyncSandbox(self, backend, network=network, limits=limits, name=name, lifetime_s=lifetime_s,
                               options=options, mounts=mounts, tmpfs=tmpfs, package_cache=package_cache or bool(pip),
                               pip=pip, from_snapshot=from_snapshot)
        sandbox.secrets = _sandbox_secrets(secrets)
        sandbox.secrets_at_egress = _sandbox_secrets(secrets_at_egress, egress=True)
        return sandbox


def _moved_attrs(moved: Transfer) -> dict[str, int]:
    """What a transfer span says: counts and sizes, never a path (a file may be named after a secret)."""
    return {"execbox.files.count": moved.files, "execbox.files.bytes": moved.bytes,
            "execbox.files.skipped": len(moved.skipped)}
