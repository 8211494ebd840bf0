"""AsyncSandbox: a persistent sandbox whose execs, cells and file calls go through the pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from execbox.audit import fields as audit_fields
from execbox.contract.backend import ExecutionBackend, Session, SessionSpec, bounded, broken
from execbox.contract.models import (
    Capabilities,
    CellError,
    CellResult,
    ExecRequest,
    ExecResult,
    Language,
    Limits,
    Mount,
    NetworkMode,
)
from execbox.contract.output import LiveOutput, OnText, OutputEvent, deliver, stream_events
from execbox.contract.snapshots import SnapshotRestore
from execbox.errors import (
    BackendTimeoutError,
    ConfigError,
    RefusedError,
    SandboxError,
    UnsupportedPolicyError,
)
from execbox.files.transfer import FileInfo, Transfer
from execbox.files.workspace import is_directory_error, normalize
from execbox.kernel import magics
from execbox.kit import packages, transfers
from execbox.runner import live
from execbox.runner import snapshots as store
from execbox.runner.pipeline import (
    Admission,
    SandboxHost,
    _bytes,
    _cell_fields,
    _close,
    _command_request,
    _enough_threads,
    _exec_audited,
    _files_s,
    _open,
    _request,
    _request_kw,
    _session_exec,
    _text,
    admit,
    admit_upload_into,
    backend_errors,
    configuration,
    finish_cell,
)
from execbox.runner.snapshots import Snapshot
from execbox.secrets import values as secrets_inject
from execbox.secrets.egress import Given
from execbox.secrets.values import Secret
from execbox.telemetry import annotate, outcome, record_queued, record_run, span

if TYPE_CHECKING:
    from execbox.kernel.client import Kernel


class AsyncSandbox:
    """A persistent sandbox: files and installed packages survive between execs until it closes."""

    def __init__(self, runner: SandboxHost, backend: str | None, *, network: NetworkMode | None, limits: Limits | None,
                 name: str | None, lifetime_s: float, options: Mapping[str, Any] | None = None,
                 mounts: Sequence[Mount] | None = None, tmpfs: Sequence[str] | None = None,
                 package_cache: bool = False,
                 pip: Sequence[str] | None = None, from_snapshot: Snapshot | str | None = None) -> None:
        self.runner = runner
        self._mounts = list(mounts or [])
        self._tmpfs = [tmpfs] if isinstance(tmpfs, str) else list(tmpfs or [])
        self._package_cache = package_cache
        self._pip = packages.check_requirements(pip) if pip else []
        # Variables every exec of this sandbox gets from execbox itself (the package cache's pip settings).
        self._extra_env: dict[str, str] = {}
        # pip pointed at the package cache: every exec's with package_cache=True, else pip_install's own.
        self._pip_env: dict[str, str] = {}
        #: True when the sandbox was made by a module-level helper: it then closes its runner too.
        self.owns_runner = False
        self._backend_name = backend
        self._options = dict(options or {})
        self._network_asked = network
        self._network = network or runner.settings.network
        self._from_snapshot = from_snapshot
        # The first cell after a filesystem-only restore runs in a fresh interpreter: it says state_lost.
        self._state_lost_next = False
        # Fork children share the snapshot they started from: the last one to close removes it.
        self._fork_snapshot: _SharedSnapshot | None = None
        self._limits = limits
        self._name = name
        self._lifetime_s = lifetime_s
        self._session: Session | None = None
        self._kernel: Kernel | None = None  # run_cell's interpreter, started by the first cell
        #: Seconds this sandbox waited for a slot (CODE_EXEC_MAX_CONCURRENT) before it opened.
        self.queued_s = 0.0
        self.backend: ExecutionBackend | None = None
        self.capabilities: Capabilities | None = None
        #: This sandbox's id in the audit log (its open, execs and close carry it).
        self.id = audit_fields.new_session_id()
        # The sandboxes whose snapshots this one may roll back to: itself, and the one it was started from.
        self._lineage = {self.id}
        #: Secrets every exec gets (``sandbox(secrets=...)``); ``_given``: every secret any exec got, for redaction
        #: of what the code may have left in the workspace (listings).
        self.secrets: dict[str, secrets_inject.Secret] = {}
        self.secrets_at_egress: dict[str, tuple[str, int, secrets_inject.Secret]] = {}
        self._given: dict[str, secrets_inject.Secret] = {}
        #: How the sandbox was admitted when it opened (its backend, network, limits, mounts); its execs' rules.
        self.admission: Admission | None = None
        self._closed = False
        self._record: dict[str, Any] | None = None  # its record for `execbox ps` (runner.live), while open
        # Why the package cache is not bound, when the backend could bind it (a cache directory it refused).
        self._no_cache: ConfigError | None = None

    async def __aenter__(self) -> AsyncSandbox:
        return await self.open()

    async def open(self) -> AsyncSandbox:
        """Open the sandbox: what ``async with`` does on entering, for an owner that holds it longer than a block
        (``sb = await execbox.asandbox().open()`` ... ``await sb.close()``). An open sandbox is returned as it is;
        a closed one does not reopen."""
        if self._session is not None:
            return self
        if self._closed:
            raise SandboxError("this sandbox was closed and does not reopen: open another one")
        restoring = await self._snapshot_to_restore()
        opening = configuration(self._network, self._limits, mounts=self._mounts, secrets=self.secrets,
                                secrets_at_egress=self.secrets_at_egress, tmpfs=self._tmpfs)
        self.admission = await admit(self.runner, opening, backend=self._backend_name, options=self._options,
                                     opening=self.id, package_cache=self._package_cache)
        self.backend, self.capabilities = self.admission.backend, self.admission.capabilities
        resolved = self.admission.request
        mounts = self.admission.mounts
        if self.capabilities.mounts:  # bound wherever the backend can, so pip_install needs no decision at open
            cache = self.runner.package_cache
            try:
                mounts = (*mounts, *self._cache_mount(cache))
            except (ConfigError, OSError) as exc:
                problem = exc if isinstance(exc, ConfigError) else ConfigError(
                    f"cannot make the package cache {cache}: {exc.strerror or exc}", env_var="CODE_EXEC_PACKAGE_CACHE")
                if self._package_cache:
                    raise problem from None
                self._no_cache = problem  # said by pip_install, to the one who wants the cache
        restore = None
        if restoring is not None:
            restore = SnapshotRestore(store.place_of(restoring.id), restoring.parts)
            if not self.capabilities.snapshot:
                raise UnsupportedPolicyError(f"the {self.backend.name} backend does not claim the capability "
                                             "'snapshot': it cannot start a sandbox from one")
        spec = SessionSpec(self._network, resolved.limits or Limits(), False, self._lifetime_s, self._name,
                           mounts=mounts, tmpfs=tuple(resolved.tmpfs), restore=restore)
        _enough_threads(self.runner.slots.total)
        self.queued_s = await self.runner.slots.acquire(self.runner.settings.queue_timeout_sec, "this sandbox")
        record_queued(self.queued_s, backend=self.backend.name)
        try:
            self._session = await _open(self.backend, spec)
        except BaseException:
            self.runner.slots.release()
            raise
        self._session.session_spec = spec
        await self.runner.audit.arecord("sandbox.open", **audit_fields.sandbox_fields(self.id, self.backend, spec))
        self._record = live.opened(self.id, self.backend.name, self._session, spec, name=self._name)
        if restoring is not None:
            try:
                await self._restore_workspace(self.backend, self._session, restoring)
            except BaseException:
                await self.close()
                raise
            self._lineage.add(restoring.origin)
            await self.runner.audit.arecord("snapshot.restore", session=self.id, **_snapshot_fields(restoring))
        if self._pip:
            try:
                installed = await self.pip_install(*self._pip)
                if not installed.ok:
                    raise SandboxError(f"pip could not install {', '.join(self._pip)} in the sandbox from the "
                                       f"package cache: {installed.stderr[-800:]}", backend=self.backend.name)
            except BaseException:
                await self.close()
                raise
        return self

    async def _snapshot_to_restore(self) -> Snapshot | None:
        """The snapshot this sandbox starts from, read anew from the store and checked against its hash; its
        backend, network and limits become this sandbox's unless the caller named others (the admission then
        judges them under today's settings: a network mode since turned off is refused)."""
        if self._from_snapshot is None:
            return None
        snap = await self.runner.load_snapshot(_snapshot_id(self._from_snapshot, "from_snapshot"))
        if self._backend_name not in (None, "auto", snap.backend):
            raise ConfigError(f"snapshot {snap.id} was taken on the {snap.backend} backend: it starts only there, "
                              f"not on {self._backend_name}")
        self._backend_name = snap.backend
        self._network = self._network_asked or snap.network
        self._limits = self._limits or snap.limits
        self._state_lost_next = not snap.memory
        return snap

    async def _restore_workspace(self, backend: ExecutionBackend, session: Session, snap: Snapshot) -> None:
        """The snapshot's packed workspace, unpacked into ``session``'s through its own bounded upload."""
        limits = store.limits(self.runner.transfer_limits, snap.files_size)
        with open(store.workspace_of(snap.id), "rb") as archive, backend_errors(backend.name):
            await bounded(transfers.unpack_workspace(session, archive, limits=limits), _files_s(backend),
                          backend=backend, doing="restoring a snapshot's workspace", session=session)

    def _cache_mount(self, cache: Path) -> tuple[Mount, ...]:
        """The package cache, read-only at packages.SANDBOX_DIR, and pip pointed at it (offline when the network is
        none). Trusted: execbox's own directory, filled only on the host (kit.packages)."""
        packages.ensure_cache(cache)  # the admission said the backend can bind it
        self._pip_env = {"PIP_FIND_LINKS": packages.SANDBOX_DIR, "PIP_BREAK_SYSTEM_PACKAGES": "1",
                         "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        if self._network == "none":
            self._pip_env["PIP_NO_INDEX"] = "1"  # nothing to reach: do not make pip retry an index for minutes
        if self._package_cache:  # asked for: every exec's own pip finds the cache too; else only pip_install's
            self._extra_env = dict(self._pip_env)
        # model_construct: /opt/execbox is reserved for execbox's own mounts, which the caller's may not cover.
        return (Mount.model_construct(source=str(cache), target=packages.SANDBOX_DIR, writable=False),)

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the sandbox (what leaving ``async with`` does), and the runner it made for itself; a second call
        does nothing."""
        try:
            await self._close_session()
        finally:
            closed, self._closed = self._closed, True
            if self.owns_runner and not closed:
                await self.runner.aclose()

    async def _close_session(self) -> None:
        try:
            await self._close_live()
        finally:
            shared, self._fork_snapshot = self._fork_snapshot, None
            if shared is not None:
                with anyio.CancelScope(shield=True):
                    await shared.release()

    async def _close_live(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            with anyio.CancelScope(shield=True):
                await kernel.close()
        if self._session is not None:
            session, self._session = self._session, None
            try:
                assert self.backend is not None
                await _close(session, self.backend)
            finally:
                self.runner.slots.release()
                self._record = None
                live.closed(self.id)
                await self.runner.audit.arecord("sandbox.close", session=self.id,
                                                backend=self.backend.name if self.backend else None)

    @property
    def broken(self) -> str | None:
        """Why this sandbox is broken (a backend call on it overran its bound, and it was closed), or None."""
        return None if self._session is None else broken(self._session)

    def _live(self) -> tuple[ExecutionBackend, Session]:
        if self._session is None or self.backend is None:
            raise SandboxError("this sandbox is closed: open another one" if self._closed else
                               "this sandbox is not open yet: use it as `async with runner.sandbox() as sb:` and "
                               "call it inside that block, or open it first (`await sb.open()`)")
        if self._record is not None and live.killed(self.id):
            raise self._killed()
        why = broken(self._session)
        if why is not None:
            raise SandboxError(f"this sandbox is broken and was closed: {why}. Open another sandbox",
                               backend=self.backend.name)
        return self.backend, self._session

    def _killed(self) -> SandboxError:
        return live.killed_error(self.id, self._opened_on, "Close it and open another")

    @property
    def _opened_on(self) -> str | None:
        return self.backend.name if self.backend else None

    async def execute(self, request: ExecRequest, *, output: LiveOutput | None = None) -> ExecResult:
        session = self._live()[1]
        if self.secrets or self.secrets_at_egress:
            request = request.model_copy(update={"secrets": {**self.secrets, **request.secrets}, "secrets_at_egress": {
                **self.secrets_at_egress, **request.secrets_at_egress}})
        self._given.update(request.secrets)
        admission = await admit(self.runner, request, within=self._opened(), extra_env=self._extra_env)
        with self._running(request.argv[0] if request.argv else request.language):
            return await _exec_audited(self.runner.audit, admission, session, output=output)

    @contextlib.contextmanager
    def _running(self, what: str) -> Iterator[None]:
        """Its `execbox ps` record says ``what`` runs (argv[0] only), then idle again."""
        record = self._record
        if record is None:
            yield
            return
        live.running(record, what)
        try:
            with live.told_if_killed(self.id, self._opened_on, "Close it and open another"):
                yield
        finally:
            if self._record is record:
                live.running(record, live.IDLE)

    def _opened(self) -> Admission:
        assert self.admission is not None  # set by __aenter__, before any call reaches _live()
        return self.admission

    async def exec(self, command: str | Sequence[str], *, network: NetworkMode | None = None,
                   timeout: float | None = None, env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
                   files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
                   max_output_bytes: int | None = None, limits: Limits | None = None,
                   mounts: Sequence[Mount] | None = None, collect: Sequence[str] | None = None,
                   secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
                   on_stdout: OnText | None = None, on_stderr: OnText | None = None) -> ExecResult:
        """Run a command in this sandbox; ``on_stdout`` / ``on_stderr`` get the output as it arrives. The network,
        limits and mounts are the sandbox's (asking for others is refused)."""
        request = _command_request(command, **_request_kw(
            network, timeout, env, stdin, files, workdir, max_output_bytes, limits, mounts, collect, secrets,
            secrets_at_egress))
        return await deliver(lambda out: self.execute(request, output=out), on_stdout, on_stderr)

    async def run_code(self, code: str, language: Language = "python", *, network: NetworkMode | None = None,
                       timeout: float | None = None, env: Mapping[str, str] | None = None,
                       stdin: bytes | str | None = None, files: Mapping[str, bytes | str] | None = None,
                       workdir: str | None = None, max_output_bytes: int | None = None, limits: Limits | None = None,
                       mounts: Sequence[Mount] | None = None, collect: Sequence[str] | None = None,
                       secrets: Mapping[str, Secret | str] | None = None, secrets_at_egress: Given | None = None,
                       on_stdout: OnText | None = None, on_stderr: OnText | None = None) -> ExecResult:
        """Run code (python or bash) in this sandbox, as a file; the keywords are ``exec``'s."""
        request = _request(code=code, language=language, **_request_kw(
            network, timeout, env, stdin, files, workdir, max_output_bytes, limits, mounts, collect, secrets,
            secrets_at_egress))
        return await deliver(lambda out: self.execute(request, output=out), on_stdout, on_stderr)

    def stream(self, command: str | Sequence[str], *, network: NetworkMode | None = None, timeout: float | None = None,
               env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
               files: Mapping[str, bytes | str] | None = None, workdir: str | None = None,
               max_output_bytes: int | None = None, limits: Limits | None = None, mounts: Sequence[Mount] | None = None,
               collect: Sequence[str] | None = None, secrets: Mapping[str, Secret | str] | None = None,
               secrets_at_egress: Given | None = None) -> AsyncGenerator[OutputEvent | ExecResult, None]:
        """``async for event in sb.stream(cmd):`` OutputEvents as the output arrives, then the ExecResult."""
        request = _command_request(command, **_request_kw(
            network, timeout, env, stdin, files, workdir, max_output_bytes, limits, mounts, collect, secrets,
            secrets_at_egress))
        return stream_events(lambda out: self.execute(request, output=out))

    def stream_code(self, code: str, language: Language = "python", *, network: NetworkMode | None = None,
                    timeout: float | None = None, env: Mapping[str, str] | None = None,
                    stdin: bytes | str | None = None, files: Mapping[str, bytes | str] | None = None,
                    workdir: str | None = None, max_output_bytes: int | None = None, limits: Limits | None = None,
                    mounts: Sequence[Mount] | None = None, collect: Sequence[str] | None = None,
                    secrets: Mapping[str, Secret | str] | None = None,
                    secrets_at_egress: Given | None = None) -> AsyncGenerator[OutputEvent | ExecResult, None]:
        """``stream`` for code, as ``run_code`` runs it."""
        request = _request(code=code, language=language, **_request_kw(
            network, timeout, env, stdin, files, workdir, max_output_bytes, limits, mounts, collect, secrets,
            secrets_at_egress))
        return stream_events(lambda out: self.execute(request, output=out))

    async def run_cell(self, code: str, *, timeout: float | None = None, on_stdout: OnText | None = None,
                       on_stderr: OnText | None = None, pip: bool = True) -> CellResult:
        """Run Python in this sandbox's persistent interpreter (kernel/client.py): variables, imports and open files
        persist from cell to cell; the last expression's value and display()ed objects come back as MIME bundles,
        matplotlib figures as PNG. A cell past its timeout is interrupted (KeyboardInterrupt, state kept) or, if
        it does not stop, its interpreter is killed: the result then says ``state_lost``, never silently.

        ``%pip install ...`` and ``!pip install ...`` lines (kernel/magics.py) install with ``pip_install``, from the
        package cache, between the Python around them; any other magic is refused before anything runs. The parts
        run in order and the first that fails ends the cell; its result is theirs joined. ``timeout`` bounds each
        Python part; an install is bounded as ``pip_install``'s are. ``pip=False`` refuses pip lines too: for a
        caller that may not have the host fetch packages (the MCP server: its agents' sandboxes keep the network
        their grant gave them)."""
        backend = self._live()[0]
        code = _text(code, "code")
        try:
            parts = magics.split_cell(code)
            for part in parts:
                if isinstance(part, magics.PipInstall):
                    if not pip:
                        raise magics.MagicError(f"{part.line[:200]!r}: installing packages is not offered here (the "
                                                "host would fetch them for the sandbox); use a sandbox whose network "
                                                "lets pip run inside it, or an image that has them")
                    if not part.requirements:
                        raise magics.MagicError(f"{part.line[:200]!r} names nothing to install")
                    packages.check_requirements(part.requirements)
        except (magics.MagicError, ConfigError) as exc:  # the cell's own error, in the audit log as any cell's
            admission = await admit(self.runner, _request(code=code, language="python", timeout=timeout),
                                    within=self._opened(), extra_env=self._extra_env)
            refused = CellResult(error=CellError(name="MagicError", value=str(exc)), backend=backend.name,
                                 notes=["nothing in the cell ran"])
            fields = audit_fields.exec_fields(backend, admission.request, [], session=self.id, oneshot=False)
            note = await self.runner.audit.arecord("cell", **fields, **_cell_fields(refused, self.runner.audit))
            return refused if note is None else refused.model_copy(update={"notes": [*refused.notes, note]})
        results: list[CellResult] = []
        for part in parts:
            if isinstance(part, magics.PipInstall):
                results.append(await self._pip_cell(part, on_stdout, on_stderr))
            else:
                results.append(await self._cell(part, timeout, on_stdout, on_stderr))
            if not results[-1].ok:
                break
        return results[0] if len(results) == 1 else _joined(results)

    async def _pip_cell(self, part: magics.PipInstall, on_stdout: OnText | None,
                        on_stderr: OnText | None) -> CellResult:
        """A ``pip install`` line of a cell, as a cell's result: a refusal or a failed install is its error."""
        try:
            installed = await self.pip_install(*part.requirements, on_stdout=None if part.quiet else on_stdout,
                                               on_stderr=on_stderr)
        except (ConfigError, RefusedError, SandboxError) as exc:
            if isinstance(exc, BackendTimeoutError) or self.broken:
                raise  # the sandbox itself failed, not the install
            return CellResult(error=CellError(name="PipInstallError", value=str(exc)),
                              backend=self._opened().backend.name)
        error = None if installed.ok else CellError(
            name="PipInstallError", value=f"{part.line[:200]} failed (exit {installed.exit_code}): "
                                          f"{installed.stderr.strip()[-2000:]}")
        return CellResult(stdout="" if part.quiet else installed.stdout, stderr=installed.stderr, error=error,
                          timed_out=installed.timed_out, truncated=installed.truncated,
                          oom_killed=installed.oom_killed, duration_s=installed.duration_s,
                          backend=installed.backend, notes=installed.notes)

    async def _cell(self, code: str, timeout: float | None, on_stdout: OnText | None,
                    on_stderr: OnText | None) -> CellResult:
        backend, session = self._live()
        request = _request(code=code, language="python", timeout=timeout)
        admission = await admit(self.runner, request, within=self._opened(), extra_env=self._extra_env)
        resolved = admission.request
        if self._kernel is None:
            from execbox.kernel.client import Kernel  # only sandboxes that run cells need the kernel's client

            assert resolved.limits and resolved.max_output_bytes and self.capabilities
            self._kernel = Kernel(functools.partial(_session_exec, backend, session), workspace=session.workspace,
                                  network=self._network, limits=resolved.limits, lifetime_s=self._lifetime_s,
                                  max_output_bytes=resolved.max_output_bytes, streaming=self.capabilities.streaming,
                                  max_display_bytes=self.runner.settings.max_display_bytes, backend=backend.name)
        kernel, timeout_s = self._kernel, resolved.timeout or self.runner.settings.max_timeout_sec
        # The interpreter gets no secrets, but an exec of this sandbox may have left one where a cell reads it.
        redactor = self._redactor()
        if redactor is not None:
            (on_stdout, on_stderr), finish = secrets_inject.redacted_callbacks(redactor, on_stdout, on_stderr)
        with span("execbox.cell", {"execbox.backend": backend.name, "execbox.session": self.id}) as current:
            fields = audit_fields.exec_fields(backend, resolved, [], session=self.id, oneshot=False)
            try:
                # The interpreter's errors quote what the code left, too: redacted.
                with secrets_inject.redacting(redactor), self._running("python (cell)"):
                    result = await deliver(
                        lambda out: kernel.run_cell(code, timeout=timeout_s, live=out, redactor=redactor), on_stdout,
                        on_stderr)
            except BaseException as exc:  # recorded as an exec that raised is (a stuck backend, a broken sandbox)
                await self.runner.audit.arecord("cell.error", **fields, **audit_fields.error_fields(exc))
                raise
            if redactor is not None:
                await finish()
            result = finish_cell(result, admission, redactor)
            if self._state_lost_next:
                self._state_lost_next = False
                result = result.model_copy(update={"state_lost": True, "notes": [*result.notes, (
                    "state_lost: this sandbox was started from (or rolled back to) a snapshot of its files only: the "
                    "interpreter started fresh, and variables and imports of earlier cells are gone")]})
            note = await self.runner.audit.arecord("cell", **fields, **_cell_fields(result, self.runner.audit))
            annotate(current, {"execbox.outcome": outcome(result), "execbox.timed_out": result.timed_out,
                               "execbox.oom_killed": result.oom_killed, "execbox.state_lost": result.state_lost,
                               "execbox.duration_s": result.duration_s})
            record_run(result, backend=backend.name)
            return result if note is None else result.model_copy(update={"notes": [*result.notes, note]})

    # -- snapshots --

    async def snapshot(self, name: str | None = None, *, memory: bool = False) -> Snapshot:
        """Keep this sandbox's state: its workspace and what the code changed outside it (packages it installed),
        and with ``memory`` its processes and their memory, where the backend can (``memory_snapshot``). The
        sandbox goes on unchanged. Start sandboxes from it with ``runner.sandbox(from_snapshot=snap)``, or come
        back to it with ``rollback``. It is kept privately, bounded by CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB and
        CODE_EXEC_SNAPSHOT_MAX_AGE_SEC, until ``runner.delete_snapshot(snap)`` or ``execbox snapshot gc``."""
        backend, session = self._live()
        if name is not None:
            name = _text(name, "name")[:200]
        assert self.capabilities is not None
        if not self.capabilities.snapshot:
            raise UnsupportedPolicyError(f"the {backend.name} backend does not claim the capability 'snapshot': "
                                         "it cannot keep a sandbox's state (`execbox backends` lists who can)")
        if memory and not self.capabilities.memory_snapshot:
            raise UnsupportedPolicyError(
                f"the {backend.name} backend does not claim the capability 'memory_snapshot': it keeps files, not "
                f"processes (snapshot with memory=False; a run_cell interpreter then starts fresh). {store.NO_MEMORY}")
        snap = await self.runner.take_snapshot(backend, session, name=name, memory=memory, network=self._network,
                                               limits=self._limits, origin=self.id)
        await self.runner.audit.arecord("snapshot.create", session=self.id, **_snapshot_fields(snap))
        return snap

    async def fork(self, count: int = 1) -> list[AsyncSandbox]:
        """``count`` new sandboxes (1-64), each started from this one's state now; this one goes on running. Each
        is open and yours to close; the snapshot they started from is removed when the last of them closes."""
        with span("execbox.fork", {"execbox.fork.count": count if isinstance(count, int) else 0}):
            return await self._fork(count)

    async def _fork(self, count: int) -> list[AsyncSandbox]:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
            raise ConfigError(f"fork takes a count of 1 to 64 sandboxes, not {count!r}")
        self._live()
        if count >= self.runner.slots.total:  # this sandbox holds a slot: they could never all open
            raise ConfigError(f"fork({count}) needs {count} more sandbox slots while this one holds its own, and "
                              f"this runner has {self.runner.slots.total} (CODE_EXEC_MAX_CONCURRENT): fork fewer, or "
                              "raise it", env_var="CODE_EXEC_MAX_CONCURRENT")
        snap = await self.snapshot(f"fork of {self.id}")
        shared = _SharedSnapshot(self.runner, snap, count)
        forks = [self._started_from(snap) for _ in range(count)]
        failed: list[Exception] = []

        async def open_one(child: AsyncSandbox) -> None:
            try:
                await child.open()
            except Exception as exc:  # noqa: BLE001 - kept: raised as it is once every open has ended
                failed.append(exc)

        try:
            async with anyio.create_task_group() as group:
                for child in forks:
                    group.start_soon(open_one, child)
            if failed:
                raise failed[0]  # the first failure as it is, not a group (every open was bounded and has ended)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for child in forks:
                    await child.close()
                await self.runner.delete_snapshot(snap)
            raise
        for child in forks:
            child._fork_snapshot = shared
        await self.runner.audit.arecord("snapshot.fork", session=self.id, forks=[f.id for f in forks],
                                        **_snapshot_fields(snap))
        return forks

    def _started_from(self, snap: Snapshot) -> AsyncSandbox:
        child = AsyncSandbox(self.runner, snap.backend, network=self._network_asked, limits=self._limits,
                             name=None, lifetime_s=self._lifetime_s, options=self._options, mounts=self._mounts,
                             tmpfs=self._tmpfs, package_cache=self._package_cache, from_snapshot=snap)
        child.secrets, child.secrets_at_egress = dict(self.secrets), dict(self.secrets_at_egress)
        return child

    async def rollback(self, snapshot: Snapshot | str) -> None:
        """Return this sandbox to ``snapshot``, one taken of it (or of the sandbox it was started from): files
        and packages since are gone, and without memory a run_cell interpreter starts fresh (its first cell says
        ``state_lost``). The sandbox keeps its id and configuration; the snapshot stays for another rollback."""
        with span("execbox.rollback", {"execbox.backend": self._live()[0].name}):
            await self._rollback(snapshot)

    async def _rollback(self, snapshot: Snapshot | str) -> None:
        backend, old = self._live()
        snap = await self.runner.load_snapshot(_snapshot_id(snapshot, "rollback"))
        if snap.origin not in self._lineage or snap.backend != backend.name:
            raise ConfigError(f"snapshot {snap.id} was taken of another sandbox: rollback returns a sandbox only to "
                              "a snapshot of its own (start a new sandbox from it with from_snapshot=)")
        assert old.session_spec is not None
        spec = dataclasses.replace(old.session_spec, restore=SnapshotRestore(store.place_of(snap.id), snap.parts))
        self.queued_s += await self.runner.slots.acquire(self.runner.settings.queue_timeout_sec, "a rollback")
        try:
            new = await _open(backend, spec)
        except BaseException:
            self.runner.slots.release()
            raise
        new.session_spec = spec
        try:
            await self._restore_workspace(backend, new, snap)
        except BaseException:
            with anyio.CancelScope(shield=True):
                try:
                    await _close(new, backend)
                finally:
                    self.runner.slots.release()
            raise
        kernel, self._kernel, self._session = self._kernel, None, new
        if self._record is not None:  # the new session is what `execbox kill` ends now
            self._record["ref"] = new.kill_ref
            live.rewrite(self._record)
            live.running(self._record, live.IDLE)
        self._state_lost_next = not snap.memory
        with anyio.CancelScope(shield=True):
            try:
                if kernel is not None:
                    await kernel.close()
                await _close(old, backend)
            finally:
                self.runner.slots.release()
        await self.runner.audit.arecord("snapshot.rollback", session=self.id, **_snapshot_fields(snap))

    @property
    def workspace(self) -> str:
        """Where the workspace is inside the sandbox, as its commands see it (relative paths start there)."""
        return self._live()[1].workspace

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write the file ``path`` (relative to the workspace, or absolute anywhere in the sandbox), making its
        directories, as the sandbox user: a file or directory the code made read-only, or a place the sandbox user
        may not write (the read-only root), is refused (SandboxPermissionError); a directory there is
        SandboxIsADirectoryError."""
        backend, session = self._live()
        where = _text(path, "path")
        if normalize(where, session.workspace, allow_root=True, anywhere=True) == "":
            raise is_directory_error("")
        rel, content = normalize(where, session.workspace, anywhere=True), _bytes(data, "data")
        with backend_errors(backend.name):
            await bounded(transfers.write_path(session, rel, content), _files_s(backend), backend=backend,
                          doing="write_file", session=session)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The bytes of the file ``path`` (relative to the workspace, or absolute anywhere in the sandbox), read as
        the sandbox user: one the code made unreadable is SandboxPermissionError, a missing one
        SandboxFileNotFoundError, a directory SandboxIsADirectoryError. One over ``max_bytes`` (at most
        CODE_EXEC_MAX_READ_BYTES) is refused unread (FileTooLargeError)."""
        backend, session = self._live()
        if normalize(_text(path, "path"), session.workspace, allow_root=True, anywhere=True) == "":
            raise is_directory_error("")
        rel = normalize(path, session.workspace, anywhere=True)
        cap = min(max_bytes or self.runner.settings.max_read_bytes, self.runner.settings.max_read_bytes)
        with backend_errors(backend.name):
            return await bounded(transfers.read_path(session, rel, cap), _files_s(backend), backend=backend,
                                 doing="read_file", session=session)

    async def list_files(self, path: str = ".", *, recursive: bool = False) -> list[FileInfo]:
        """What is in the directory ``path`` of the workspace (or, absolute, anywhere in the sandbox: then the paths
        listed are absolute too; everything below it with ``recursive``): names, sizes and types, links shown as
        links (never followed); bounded by CODE_EXEC_MAX_TRANSFER_FILES."""
        backend, session = self._live()
        rel = normalize(_text(path, "path"), session.workspace, allow_root=True, anywhere=True)
        with secrets_inject.redacting(self._redactor()), backend_errors(backend.name):
            found = await bounded(transfers.list_path(session, rel, recursive=bool(recursive),
                                                      limits=self.runner.transfer_limits),
                                  _files_s(backend), backend=backend, doing="list_files", session=session)
        return secrets_inject.redact_listing(found, self._redactor())

    def _redactor(self) -> secrets_inject.Redactor | None:
        """Every secret this sandbox was given: the code may have left one in a file name."""
        given = {**self._given, **self.secrets}
        return secrets_inject.Redactor(given) if given else None

    async def upload(self, local_path: str | os.PathLike[str], remote: str | None = None) -> Transfer:
        """Copy a local file or directory into the workspace at ``remote`` (default: its name at the top of the
        workspace; "." = into the workspace itself), streamed as tar and bounded by CODE_EXEC_MAX_TRANSFER_BYTES.
        Links in the local tree are copied as links, never followed; the guard refuses the same places as for a
        mount (your home itself, ~/.ssh, ...) and scans the tree for wallet seeds."""
        backend, session = self._live()
        local = _text(os.fspath(local_path), "local path")
        await admit_upload_into(self.runner, self._opened(), local)
        return await self.runner.upload_to(backend, session, local,
                                           remote if remote is not None else os.path.basename(os.path.abspath(local)))

    async def download(self, remote: str, local_path: str | os.PathLike[str]) -> Transfer:
        """Copy a workspace file or directory ("." = the whole workspace) to ``local_path`` (the file, or inside
        it when it is an existing directory; a directory is made or merged into). Bounded by
        CODE_EXEC_MAX_TRANSFER_BYTES / _FILES before a byte is read; nothing is followed and no symlink, hard link
        or device the code left is created here (``skipped``)."""
        backend, session = self._live()
        return await self.runner.download_from(backend, session, remote, os.fspath(local_path), self._redactor())

    async def pip_install(self, *requirements: str, on_stdout: OnText | None = None,
                          on_stderr: OnText | None = None) -> ExecResult:
        """Install Python packages into this sandbox from the per-user package cache, which every sandbox whose
        backend takes mounts has read-only: the wheels are fetched on the host by a trusted step (kit.packages:
        the host's pip configuration, wheels only) when the cache lacks them, then pip installs them inside the
        sandbox with no index. The result is the install's; a note says how many wheels came from the cache and
        how many were fetched. ``run_cell`` sends its ``%pip install`` / ``!pip install`` lines here."""
        backend, session = self._live()
        if not requirements:
            raise ConfigError("pip_install() was given no requirements: name what to install, e.g. "
                              "sb.pip_install('numpy', 'pandas>=2')")
        reqs = packages.check_requirements(requirements)
        install = ["python3", "-m", "pip", "install", "--no-index", "--progress-bar", "off", *reqs]
        if not self._pip_env:
            # The admission's one rule (a backend that takes no mounts cannot bind the cache): one refused record.
            await admit(self.runner, _command_request(install), within=self._opened(), package_cache=True)
            raise self._no_cache or ConfigError("this sandbox has no package cache")
        probe = await self.exec(["python3", "-c", packages.PROBE], timeout=60)
        if not probe.ok:
            raise SandboxError(f"the sandbox has no working python3 to install into: {probe.stderr[-400:]}",
                               backend=backend.name)
        target = packages.PythonTarget.parse(probe.stdout)
        fill = await anyio.to_thread.run_sync(packages.fill_cache, self.runner.package_cache, reqs, target)
        # PIP_FIND_LINKS points pip at the cache; --no-index: nothing else is looked at.
        result = await self.exec(install, env=self._pip_env, on_stdout=on_stdout, on_stderr=on_stderr)
        note = (f"package cache: {len(fill.downloaded)} wheel(s) fetched on the host ({', '.join(fill.downloaded)}), "
                f"{len(fill.cached)} from the cache") if fill.downloaded else (
                f"package cache: every wheel came from the cache ({len(fill.cached)}), nothing was downloaded")
        return result.model_copy(update={"notes": [*result.notes, note]})


def _joined(results: list[CellResult]) -> CellResult:
    """The parts of one cell (Python and pip installs) as one result: their output in order, the last error."""
    last = results[-1]
    counts = [r.execution_count for r in results if r.execution_count]
    return CellResult(
        outputs=[o for r in results for o in r.outputs], stdout="".join(r.stdout for r in results),
        stderr="".join(r.stderr for r in results), error=last.error, execution_count=counts[-1] if counts else 0,
        timed_out=last.timed_out, truncated=any(r.truncated for r in results), oom_killed=last.oom_killed,
        state_lost=any(r.state_lost for r in results), duration_s=round(sum(r.duration_s for r in results), 4),
        backend=last.backend, notes=[n for r in results for n in r.notes])


def _snapshot_id(snapshot: object, what: str) -> str:
    if isinstance(snapshot, Snapshot):
        return snapshot.id
    if isinstance(snapshot, str):
        return snapshot
    raise ConfigError(f"{what} takes a Snapshot or its id (from sb.snapshot() or runner.snapshots()), not "
                      f"{type(snapshot).__name__}")


def _snapshot_fields(snap: Snapshot) -> dict[str, Any]:
    return {"snapshot": snap.id, "content_hash": snap.content_hash, "snapshot_backend": snap.backend,
            "memory": snap.memory}


class _SharedSnapshot:
    """The snapshot a fork's children started from, removed when the last of them closes."""

    def __init__(self, runner: SandboxHost, snap: Snapshot, holders: int) -> None:
        self.runner, self.snap, self.holders = runner, snap, holders

    async def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            await self.runner.delete_snapshot(self.snap)
