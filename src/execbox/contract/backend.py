"""The contract every backend implements, built-in or third-party.

A backend is a class with two pieces of class-level data, ``name`` and ``capabilities``, and one way in:
``open_session``. A one-shot run is a session opened with ``oneshot=True``, used for one exec and closed;
a backend may use that hint to run the command directly (e.g. ``docker run``) instead of keeping a sandbox up.
The runner places files, applies the policy and the guard; backends only run what they are given.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import posixpath
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import IO, Any, ClassVar, Generic, TypeVar, cast

import anyio
from typing_extensions import TypeVar as DefaultedTypeVar

from execbox.config.settings import EnvSettings, Settings
from execbox.contract.models import Capabilities, ExecRequest, ExecResult, ExecSpec, Limits, Mount, NetworkMode
from execbox.contract.snapshots import SnapshotParts, SnapshotPlace, SnapshotRestore
from execbox.errors import (
    BackendTimeoutError,
    ConfigError,
    MissingExtraError,
    SandboxError,
    UnsupportedPolicyError,
)
from execbox.files import transfer
from execbox.files.transfer import HELPER_TIMEOUT_S, FileInfo, Transfer, TransferLimits
from execbox.files.workspace import as_owner
from execbox.policy.egress import EgressPolicy, ProviderAllowlist, provider_allowlist
from execbox.telemetry import record_swept

#: How long a successful ``check()`` answer is trusted, per backend instance.
CHECK_TTL_S = 30.0

T = TypeVar("T")
#: A backend's own settings model (``ExecutionBackend[S]``); a backend without knobs leaves it out.
S = DefaultedTypeVar("S", bound=EnvSettings, default=EnvSettings, covariant=True)  # read-only: self.settings


@dataclass(frozen=True)
class SharedSettings:
    """What a backend reads of execbox's own settings (the CODE_EXEC_* variables): a narrow view, so that a backend
    depends on these few values and not on the runner's whole ``Settings``."""

    #: The default memory, CPU and process limits (CODE_EXEC_MEMORY_MB, _CPUS, _PIDS_LIMIT).
    default_limits: Limits
    #: How long an engine's probed facts may be reused across processes (CODE_EXEC_PROBE_CACHE_SEC), seconds.
    probe_cache_sec: float
    #: Network mode proxy's allowlist as given (CODE_EXEC_EGRESS_ALLOW, _EGRESS_DEFAULTS) and the CA bundle the
    #: proxy trusts (CODE_EXEC_CA_BUNDLE); ``egress_policy()`` and ``provider_allowlist()`` turn them into rules.
    egress_allow: tuple[str, ...]
    egress_defaults: bool
    ca_bundle: Path | None
    #: The runner's bounds on the backend's calls (see ``bounded``), seconds: open_session and check; past an
    #: exec's timeout, and for close; the longest timeout a request may ask for.
    open_timeout_sec: float
    backend_grace_sec: float
    max_timeout_sec: float
    #: The bounds of packing a snapshot's part (CODE_EXEC_SNAPSHOT_MAX_TOTAL_MB in bytes, _MAX_TRANSFER_FILES).
    snapshot_max_bytes: int = 20480 << 20
    max_transfer_files: int = 100_000
    #: How long a snapshot is kept (CODE_EXEC_SNAPSHOT_MAX_AGE_SEC), seconds: what a provider keeps of one (a
    #: Modal image) is given that lifetime where the provider takes one.
    snapshot_max_age_sec: float = 7 * 86400.0

    @classmethod
    def of(cls, settings: Settings) -> SharedSettings:
        return cls(
            default_limits=Limits(memory_mb=settings.memory_mb, cpus=settings.cpus, pids=settings.pids_limit),
            probe_cache_sec=settings.probe_cache_sec, egress_allow=tuple(settings.egress_allow),
            egress_defaults=settings.egress_defaults, ca_bundle=settings.ca_bundle,
            open_timeout_sec=settings.open_timeout_sec, backend_grace_sec=settings.backend_grace_sec,
            max_timeout_sec=settings.max_timeout_sec, snapshot_max_bytes=settings.snapshot_max_total_mb << 20,
            max_transfer_files=settings.max_transfer_files, snapshot_max_age_sec=settings.snapshot_max_age_sec)

    def egress_policy(self) -> EgressPolicy:
        """The allowlist of network mode proxy, for the host-side proxy (``EgressProxy``)."""
        try:
            return EgressPolicy.build(list(self.egress_allow), defaults=self.egress_defaults)
        except ValueError as exc:  # the settings validated it already; a policy built in code may not be
            raise ConfigError(f"CODE_EXEC_EGRESS_ALLOW: {exc}", env_var="CODE_EXEC_EGRESS_ALLOW") from None

    def provider_allowlist(self, backend: str) -> ProviderAllowlist:
        """Network mode proxy on a remote backend: the allowlist as a provider's own allowlist takes it; refused
        (UnsupportedPolicyError) when an entry names a port, which no provider's allowlist has."""
        try:
            return provider_allowlist(EgressPolicy.build(list(self.egress_allow), defaults=self.egress_defaults))
        except ValueError as exc:
            raise UnsupportedPolicyError(f"refused: network mode proxy on {backend}: CODE_EXEC_EGRESS_ALLOW entry "
                                         f"{exc}", backend=backend, env_var="CODE_EXEC_EGRESS_ALLOW") from None


@dataclass(frozen=True)
class Verdict:
    """Whether a backend, configured as it is for one request, is a sandbox."""

    sandbox: bool
    reason: str
    # True when the sandbox status is the operator's word, not something execbox enforces.
    attested: bool = False


@dataclass(frozen=True)
class SessionSpec:
    """What a sandbox is opened with; fixed for its whole life."""

    network: NetworkMode
    limits: Limits
    oneshot: bool
    # How long the sandbox may live, for backends that must say so up front (remote providers).
    lifetime_s: float
    # A caller-chosen name, for backends that can resume a named sandbox (daytona).
    name: str | None = None
    # Host paths to bind in (sources resolved and admitted by the guard); only for backends claiming ``mounts``.
    mounts: tuple[Mount, ...] = ()
    # Absolute sandbox paths that get an empty writable tmpfs each (admitted by the guard); only for backends
    # claiming ``tmpfs``. Sized like the sandbox's /tmp, within the disk limit.
    tmpfs: tuple[str, ...] = ()
    # Start in a snapshot's state (only for backends claiming ``snapshot``): the snapshot's files, checked.
    restore: SnapshotRestore | None = None


@dataclass(frozen=True)
class OwnedSandbox:
    """A live sandbox a backend finds by its ownership labels or files (``ExecutionBackend.owned``)."""

    #: What ``ExecutionBackend.kill`` takes: the ``Session.kill_ref`` of the session it is.
    ref: str
    #: ``owner_id()`` of the process that made it (host:pid:start time); "" when its labels or files do not say.
    owner: str
    #: When it was made (Unix seconds), if its labels or files say.
    created: float | None = None


class Session(ABC):
    """One live sandbox: a workspace that persists across execs until ``close``.

    Paths given to ``write_file``/``read_file`` are already normalised by the runner: relative, POSIX,
    with no ``..``. ``read_file`` must never follow a symlink out of the workspace.
    """

    #: Where the workspace is, as the sandboxed command sees it (e.g. "/workspace").
    workspace: str
    #: The workspace as a directory on this host, for sessions that have one (docker, bubblewrap, local
    #: launchers). Set it and ``list_files``/``upload``/``download`` work on that directory directly (symlink-safe,
    #: bounded); leave it None and they run find and tar inside the sandbox through ``exec``.
    host_workspace: str | None = None
    #: uid:gid that files placed in ``host_workspace`` are given (when execbox runs as root), or None.
    host_owner: tuple[int, int] | None = None
    #: What the sandbox was opened with; set by the runner right after ``open_session``.
    session_spec: SessionSpec | None = None
    #: What ``ExecutionBackend.kill`` takes to end this sandbox from another process (`execbox kill`): a name
    #: found again by its ownership labels or files, never a secret. None: it cannot be ended from outside.
    kill_ref: str | None = None
    #: Why the runner gave up on this sandbox (see ``broken``); an attribute, not a table keyed by the session,
    #: which a plugin's session (a dataclass, say) need not be hashable for.
    _runner_broken: str | None = None

    @abstractmethod
    async def exec(self, spec: ExecSpec) -> ExecResult:
        """Run ``spec.argv`` and report what happened (build the result with ``build_result``). The spec is
        complete and frozen: the runner resolved the request, placed its files and made the workdir absolute."""

    @abstractmethod
    async def write_file(self, path: str, data: bytes) -> None: ...

    @abstractmethod
    async def read_file(self, path: str, max_bytes: int) -> bytes:
        """The file's bytes; a file larger than ``max_bytes`` is refused (FileTooLargeError) without being
        read into memory, whatever its apparent size (a sparse file costs the sandbox no disk)."""

    @abstractmethod
    async def close(self) -> None:
        """Remove everything the session created. Must be safe to call twice."""

    async def snapshot(self, place: SnapshotPlace, *, memory: bool) -> SnapshotParts:
        """Write this live sandbox's state into ``place.directory``: what the code changed outside the workspace
        (packages installed with apt or pip count; the runner packs the workspace itself), and with ``memory`` its
        processes and their memory. The
        sandbox goes on running afterwards, unchanged. Only for backends claiming ``snapshot`` (``memory``: claiming
        ``memory_snapshot``); the runner never calls it otherwise."""
        raise UnsupportedPolicyError("this backend does not claim the capability 'snapshot'")

    async def arm(self) -> None:
        """Start ahead what the first exec needs, while nothing waits for it: the warm pool calls this on each
        member it opens (whose only exec comes later). Default: nothing. An error leaves the member unused."""
        return None

    async def run_script(self, script: str, *args: str, max_output: int = 1 << 16,
                         stdin: bytes | None = None) -> tuple[int, str, bool]:
        """Run a small sh script inside the sandbox, as its user, through this session's own exec: (exit code,
        stdout, cut). The in-sandbox file walkers and the file calls outside the workspace use it; a script that
        overruns HELPER_TIMEOUT_S is a SandboxError."""
        spec = self.session_spec
        result = await self.exec(ExecSpec(
            argv=["/bin/sh", "-c", script, "execbox", *args], env={}, stdin=stdin, workdir=self.workspace,
            timeout=HELPER_TIMEOUT_S, max_output_bytes=max_output,
            network=spec.network if spec else "none", limits=spec.limits if spec else Limits()))
        if result.timed_out:
            raise SandboxError(f"a file-transfer helper did not finish within {HELPER_TIMEOUT_S:g}s in the sandbox")
        return result.exit_code, result.stdout, result.truncated

    # -- whole files and directories: defaults every backend with file_transfer gets (files/transfer.py) --

    async def list_files(self, path: str, *, recursive: bool, limits: TransferLimits) -> list[FileInfo]:
        """The entries of the directory ``path`` ("" = the workspace; everything below it with ``recursive``), or
        the one entry of a file; never following a link, bounded by ``limits``."""
        if self.host_workspace is not None:
            root, owner = self.host_workspace, self.host_owner

            def walk() -> list[FileInfo]:
                with _reached(root) as top, as_owner(owner):  # as the sandbox user: a sealed directory is not listed
                    return transfer.host_list(top, path, recursive=recursive, limits=limits)

            return await anyio.to_thread.run_sync(walk)
        return await transfer.sandbox_list(self, path, recursive=recursive, limits=limits)

    async def download(self, path: str, out: IO[bytes], *, limits: TransferLimits) -> Transfer:
        """Write a tar of ``path`` ("" = the workspace) to ``out``: members named under its basename ("." for the
        workspace), symlinks stored as links and never followed, refused past ``limits`` before reading."""
        if self.host_workspace is not None:
            root, owner = self.host_workspace, self.host_owner

            def pack() -> Transfer:
                # as the sandbox user: a file the code made unreadable is refused (asked for) or left out (skipped)
                with _reached(root) as top, as_owner(owner):
                    return transfer.host_pack(top, path, out, limits=limits)

            return await anyio.to_thread.run_sync(pack)
        await transfer.sandbox_pack(self, path, out, limits=limits)
        return Transfer()

    async def upload(self, path: str, archive: IO[bytes], *, limits: TransferLimits) -> Transfer:
        """Extract a tar whose members are named under ``basename(path)`` ("." when ``path`` is the workspace) so
        that it becomes ``path``; never through a symlink the code planted."""
        prefix = posixpath.basename(path) if path else "."
        if self.host_workspace is not None:
            root, owner = self.host_workspace, self.host_owner

            def unpack() -> Transfer:
                # as the sandbox user: a directory the code made read-only stays unwritten
                with _reached(root) as top, as_owner(owner):
                    return transfer.host_unpack(top, path, archive, limits=limits, prefix=prefix, owner=owner,
                                                keep_symlinks=True)

            return await anyio.to_thread.run_sync(unpack)
        await transfer.sandbox_unpack(self, path, archive, limits=limits)
        return Transfer()


@contextlib.contextmanager
def _reached(workspace: str) -> Iterator[int]:
    """The workspace directory, opened by execbox itself: the way to it (execbox's own state, 0700) is execbox's
    to walk; what is below it, the sandbox user's (``as_owner``)."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


_swept: set[tuple[int, str]] = set()
_swept_lock = threading.Lock()


def _first_sweep(pid: int, scope: str) -> bool:
    """True once per (process, scope): the caller sweeps."""
    with _swept_lock:
        if (pid, scope) in _swept:
            return False
        _swept.add((pid, scope))
        return True


class ExecutionBackend(ABC, Generic[S]):
    """Base class of every backend; ``S`` is its own settings model (``self.settings``)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    #: The extra that installs this backend's SDK, for `pip install 'execbox[<extra>]'` hints.
    extra: ClassVar[str | None] = None
    #: The module this backend cannot work without (its SDK), imported lazily and only by the backend itself.
    #: Missing, the backend is listed as unavailable with the pip hint; nothing else of execbox needs it.
    sdk: ClassVar[str | None] = None
    #: One line for `execbox backends`.
    summary: ClassVar[str] = ""
    #: The backend's own knobs: a BackendSettings subclass (the ``S`` of ``ExecutionBackend[S]``), one environment
    #: variable per field. Read them as ``self.settings``; `execbox doctor` and the README's tables list them from here.
    settings_model: ClassVar[type[EnvSettings] | None] = None
    #: Run ``gc`` after the first successful ``check`` in each process (a forked child sweeps again): what
    #: callers that died (SIGKILL, a crash) left on this host or engine goes without an `execbox gc`.
    sweeps_on_first_use: ClassVar[bool] = False
    #: ``verdict`` judges what ``check`` found (ray: the cluster's nodes), so the runner checks before it asks; the
    #: verdict itself never probes (it runs on the event loop).
    verdict_needs_check: ClassVar[bool] = False

    def __init__(self, execbox_settings: Settings, options: Mapping[str, Any] | None = None) -> None:
        """``execbox_settings``: the runner's, of which the backend keeps the narrow view ``self.shared``. ``options``
        are values of ``settings_model`` given in code (by field name); they take precedence over the environment,
        so two runners in one process can use, say, two images."""
        self.shared = SharedSettings.of(execbox_settings)
        self._checked: tuple[float, Capabilities] | None = None
        self._given = dict(options or {})
        known = set(self.settings_model.model_fields) if self.settings_model else set()
        unknown = sorted(set(self._given) - known)
        if unknown:
            raise ConfigError(
                f"backend {self.name!r} has no option {', '.join(map(repr, unknown))}; it takes: "
                f"{', '.join(sorted(known)) or 'no options'}. Fix the option's name", backend=self.name)

    @cached_property
    def settings(self) -> S:
        """This backend's own settings (an instance of ``settings_model``), validated once, on first use (so a
        misconfigured backend is still listed by `execbox backends`); an invalid value is a ConfigError naming its
        variable."""
        if self.settings_model is None:
            raise ConfigError(f"backend {self.name!r} declares no settings_model", backend=self.name)
        try:
            return cast(S, self.settings_model(**self._given))
        except ConfigError as exc:
            exc.backend = self.name
            raise

    async def check(self) -> Capabilities:
        """What this backend really enforces here, or BackendUnavailableError (with the fix).

        The one rule of when a backend is probed: the first ``check()`` of an instance runs ``probe()``; a
        successful answer is trusted for CHECK_TTL_S seconds, then probed again; a failure is never cached
        (the operator may fix it and retry at once). The runner checks before every sandbox it opens.
        """
        cached = self._checked
        if cached is not None and time.monotonic() - cached[0] < CHECK_TTL_S:
            return cached[1]
        self.require_sdk()
        caps = await self.probe()
        self._checked = (time.monotonic(), caps)
        if self.sweeps_on_first_use and _first_sweep(os.getpid(), self.sweep_scope()):
            with contextlib.suppress(Exception):  # a start-up sweep must never stop a run
                record_swept(len(await self.gc()), backend=self.name)
        return caps

    def sweep_scope(self) -> str:
        """What one start-up sweep covers, once per process: by default the backend (its host); docker: its
        engine. Called after ``probe``."""
        return self.name

    def present_here(self) -> str | None:
        """What this machine has that the backend would use, found without its SDK (docker: an engine's socket
        that answers), or None. Asked only when the SDK is missing: `execbox doctor` then warns."""
        return None

    def require_sdk(self) -> None:
        """MissingExtraError with the pip command when the backend's SDK is not importable."""
        if self.sdk is None:
            return
        try:
            found = importlib.util.find_spec(self.sdk) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            hint = f"pip install 'execbox[{self.extra}]'" if self.extra else f"install the {self.sdk!r} package"
            present = self.present_here()
            here = f", though {present} is here: auto picks a weaker sandbox until it is" if present else ""
            raise MissingExtraError(f"the {self.name} backend needs the `{self.sdk}` package, which is not "
                                    f"installed{here}", backend=self.name, fix=hint, extra=self.extra,
                                    present=present)

    async def probe(self) -> Capabilities:
        """Find out whether this backend can run here and what it enforces; override this, not ``check``.

        Raise BackendUnavailableError (with the fix) if it cannot run here. Return the capabilities it really
        enforces here; by default the declared ones. A backend whose limits depend on the host (cgroups,
        runtimes) narrows them here.
        """
        return self.capabilities

    async def aclose(self) -> None:  # noqa: B027 - optional: most backends hold nothing between calls
        """Release what the instance holds (engine clients, connections); the runner calls it when it closes."""

    def verdict(self, request: ExecRequest) -> Verdict:
        """Is this backend, configured as it is (``self.settings``), a sandbox for this request? The guard asks this
        with the request resolved: its network mode, limits and timeout are the settings' defaults where the caller
        gave none, as the sandbox will run them."""
        if not self.capabilities.sandbox:
            return Verdict(False, f"backend {self.name!r} runs code with the privileges of its host user")
        if request.network == "host":
            return Verdict(False, "network mode 'host' shares the host's network with the sandboxed code")
        return Verdict(True, f"isolation {self.capabilities.isolation}")

    def unenforced(self, what: str) -> str | None:
        """Why this backend, as ``check`` found it here, does not enforce ``what`` (a network mode or a limit) that
        its class claims: the guard's refusal says it. None when there is nothing more to say than that."""
        return None

    def notes(self) -> list[str]:
        """Facts every result of this backend carries (e.g. an attested sandbox)."""
        return []

    def details(self) -> dict[str, Any]:
        """What ``check`` found on this host (binary versions, cgroups, ...), for `execbox doctor`."""
        return {}

    @abstractmethod
    async def open_session(self, spec: SessionSpec) -> Session:
        """Start a sandbox for ``spec`` (network, limits, lifetime; ``spec.oneshot`` when it will serve exactly
        one exec) and return its session."""

    async def delete_snapshot(self, place: SnapshotPlace, parts: SnapshotParts) -> None:  # noqa: B027 - optional
        """Remove what a snapshot keeps outside its directory (``parts.refs``); the runner removes the directory.
        Must be safe to call twice and for a snapshot whose refs are already gone."""

    async def gc(self) -> list[str]:
        """Remove expired or orphaned resources this backend created (only its own). Returns what was removed."""
        return []

    async def owned(self) -> list[OwnedSandbox] | None:
        """Every sandbox this backend made that is there now on this host (found as gc finds them: its ownership
        labels or files), whichever process of this user holds it, or held it and is gone. `execbox ps` lists
        those no record names (an orphan, whose owner is gone, or one whose owner wrote no record), and leaves out a
        record whose sandbox is not among them. Cheap (a directory listing, one API call), and never starting an
        engine that is not running. None (the default): it cannot say; the records are listed as they are."""
        return None

    async def kill(self, ref: str) -> None:
        """End the live sandbox whose ``Session.kill_ref`` is ``ref``, held by any process of this user on this
        host (`execbox kill`): only one this backend made (its ownership labels or files say so); its owner's next
        call fails. SandboxError when there is no such sandbox."""
        raise UnsupportedPolicyError(f"the {self.name} backend cannot end a sandbox from another process: "
                                     "its owner closes it (or `execbox gc` once the owner is gone)", backend=self.name)


# --- the runner's bound on every backend call -------------------------------------------------------------------

#: Calls given up on, kept referenced until they end (a backend may ignore cancellation for ever).
_abandoned: set[asyncio.Future[Any]] = set()


def broken(session: Session) -> str | None:
    """Why this session is broken (a call on it overran its bound and it was closed), or None."""
    return session._runner_broken


def _forget(done: asyncio.Future[Any]) -> None:
    _abandoned.discard(done)
    if not done.cancelled():
        done.exception()  # retrieved: nobody else will


def _start(call: Awaitable[T]) -> tuple[asyncio.Future[T], anyio.CancelScope]:
    """``call`` as a task of its own, and the scope that cancels it. Cancelled through an anyio scope, not
    ``task.cancel()``: a backend's shielded clean-up (a worker thread still creating a sandbox, which
    lifecycle.create_cleanly then removes) is waited for, where a bare asyncio cancel raises at once and leaves
    the thread to remove what it made later, after the caller has gone on (or exited)."""
    scope = anyio.CancelScope()

    async def run() -> T:
        with scope:
            return await call
        raise asyncio.CancelledError  # the scope took the cancellation: the call did not return

    return asyncio.ensure_future(run()), scope


def _abandon(task: asyncio.Future[Any], scope: anyio.CancelScope,
             late: Callable[[Any], Awaitable[object]] | None = None) -> None:
    def ended(done: asyncio.Future[Any]) -> None:
        _forget(done)
        if late is not None and not done.cancelled() and done.exception() is None:
            # e.g. a sandbox that opened after all: nobody will use it, so it is closed
            cleanup = asyncio.ensure_future(late(done.result()))
            _abandoned.add(cleanup)
            cleanup.add_done_callback(_forget)

    scope.cancel()
    _abandoned.add(task)
    task.add_done_callback(ended)


async def bounded(call: Awaitable[T], seconds: float, *, backend: ExecutionBackend, doing: str,
                  session: Session | None = None, late: Callable[[T], Awaitable[object]] | None = None) -> T:
    """``await call``, for at most ``seconds``: the one bound the runner puts on every backend call (open, exec,
    file calls, close), so that a backend that never returns cannot hang its caller.

    The call runs as a task of its own. Past ``seconds`` it is cancelled and abandoned, not waited for (a backend
    may ignore cancellation, or block in a thread): ``session``, if given, is closed under its own bound and marked
    broken (``broken``), ``late`` gets what the call returns if it ever does (a sandbox opened too late is closed),
    and BackendTimeoutError names the backend and the call. A caller cancelled meanwhile cancels the call and waits
    for it (its clean-up: the sandbox's processes killed) at most CODE_EXEC_BACKEND_GRACE_SEC, then abandons it and
    closes ``session`` as above; what it returns all the same goes to ``late`` too. Costs a task and a timer per
    call (a few microseconds)."""
    task, scope = _start(call)
    try:
        done, _ = await asyncio.wait((task,), timeout=seconds)
    except BaseException:
        if not task.done():
            scope.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait((task,), timeout=backend.shared.backend_grace_sec)
        if not task.done():
            _abandon(task, scope, late)
            if session is not None:  # deaf to cancellation for the whole grace: still running in it, state unknown
                await close_bounded(session, backend, reason=f"backend {backend.name!r} did not end {doing} within "
                                    f"{backend.shared.backend_grace_sec:g} s of its caller's cancellation")
        elif not task.cancelled() and task.exception() is None and late is not None:
            # It returned all the same (a sandbox opened as the caller went): nobody will use it, so it is closed.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):  # the cancellation propagates
                await late(task.result())
        raise
    if done:
        return task.result()
    _abandon(task, scope, late)
    what = f"backend {backend.name!r} did not return from {doing} within {seconds:g} s"
    if session is not None:
        await close_bounded(session, backend, reason=what)
        what += "; the call was abandoned and its sandbox closed (any later call on it fails)"
    else:
        what += "; the call was abandoned"
    raise BackendTimeoutError(f"{what}. The backend is stuck or far slower than its bound (CODE_EXEC_BACKEND_GRACE_SEC "
                              "past the timeout; CODE_EXEC_OPEN_TIMEOUT_SEC to open): report it to its maintainers",
                              backend=backend.name, env_var="CODE_EXEC_BACKEND_GRACE_SEC")


async def close_bounded(session: Session, backend: ExecutionBackend, *, reason: str | None = None) -> None:
    """Close ``session``, shielded from the caller's cancellation and given up after CODE_EXEC_BACKEND_GRACE_SEC
    (BackendTimeoutError). With ``reason`` (a call on it overran), the session is marked broken and a failing close
    is not raised: the overrun is what the caller hears. A session closed that way is not closed again."""
    if session._runner_broken is not None:
        return
    session._runner_broken = reason
    seconds = backend.shared.backend_grace_sec
    task, scope = _start(session.close())
    with anyio.CancelScope(shield=True):
        done, _ = await asyncio.wait((task,), timeout=seconds)
    if done:
        if reason is None:
            task.result()
        else:
            with contextlib.suppress(Exception):
                task.result()
        return
    _abandon(task, scope)
    session._runner_broken = reason or f"backend {backend.name!r} did not close it within {seconds:g} s"
    if reason is None:
        raise BackendTimeoutError(f"backend {backend.name!r} did not return from close within {seconds:g} s; the close "
                                  "was abandoned (what it leaves, its gc removes). Report it to its maintainers",
                                  backend=backend.name, env_var="CODE_EXEC_BACKEND_GRACE_SEC")
