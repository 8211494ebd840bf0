"""modal: every session is a Modal Sandbox (gVisor) in Modal's cloud (SDK ``modal``, extra ``modal``).

Policy, translated to Modal's own controls (and refused when Modal cannot enforce it):

    network none   block_network=True                egress   no block (Modal's default)
    network proxy  outbound_domain_allowlist (names, *.domain) + outbound_cidr_allowlist (CIDR entries): Modal's
                   allowlist, on any port; an entry with a port is refused; results say what execbox cannot see
    memory         memory=(MiB, MiB): request = hard limit (a plain int would only be a request)
    cpu            cpu=(cores, cores): request = hard limit
    lifetime       timeout= whole seconds (a sandbox dies at it, whatever runs in it)
    exec timeout   exec(timeout=) whole seconds, rounded up; Modal then reports -1 and ends the streams

Credentials: ``modal.Client.from_env()`` reads MODAL_TOKEN_ID/MODAL_TOKEN_SECRET (or ~/.modal.toml) in this
process; the client object is passed to every call, and nothing of it goes into the sandbox's env.

Snapshots. ``sb.snapshot_filesystem()`` keeps the whole filesystem of the live sandbox (what apt or pip installed
outside the workspace) as a Modal image, named in the snapshot by its id (refs ``{"image": "im-..."}``); a sandbox
started from the snapshot is created from ``Image.from_id(id)``, with today's network and limits, and the runner
unpacks the workspace into it as everywhere. The image is kept as long as the snapshot store keeps a snapshot
(``ttl``: CODE_EXEC_SNAPSHOT_MAX_AGE_SEC and an hour): Modal has no call that deletes one, so removing a snapshot
leaves its image until then (Modal's own storage, reachable only with these credentials). Processes are not kept.

Runs. One sandbox per session (a one-shot run is a session of one exec); files go in and out through
``sb.filesystem`` (paths checked inside the sandbox once code has run, so a planted symlink cannot lead a
read out of /workspace); stdout and stderr are read as they stream, into the bounded capture, so memory
stays at the cap. After a timeout in a session, every process the run started is killed (a setsid
grandchild too, found by a marker variable). Every sandbox is tagged (see REMOTE_LABELS) so ``gc``
terminates orphans.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from execbox.plugin import (
    REMOTE_LABELS,
    RUN_MARKER,
    BackendSettings,
    BackendUnavailableError,
    BoundedCapture,
    Capabilities,
    ExecboxError,
    ExecResult,
    ExecSpec,
    ExecutionBackend,
    RemoteSession,
    SandboxError,
    SandboxFileNotFoundError,
    SessionSpec,
    SnapshotError,
    SnapshotParts,
    SnapshotPlace,
    SnapshotRestore,
    UnsupportedPolicyError,
    WorkspacePathError,
    build_result,
    create_cleanly,
    missing_credentials,
    new_run_marker,
    reap_argv,
    sandbox_env,
    sdk_call,
    setting,
    wrapped_argv,
)

log = logging.getLogger("execbox.backends.modal")
WORKSPACE = "/workspace"
STDIN_CHUNK = 1 << 20  # modal buffers at most 2 MiB of stdin between drains
MAX_LIFETIME_S = 24 * 3600  # Modal's longest sandbox timeout
IMAGE_REF = "image"  # a snapshot's Modal image id, in SnapshotParts.refs
IMAGE_TTL_MARGIN_S = 3600  # the image outlives the snapshot's own age bound, measured from a little later


class ModalSettings(BackendSettings):
    app: str = setting("CODE_EXEC_MODAL_APP", "execbox", "Modal app that owns execbox's sandboxes (created if missing)")
    image: str = setting("CODE_EXEC_MODAL_IMAGE", "", "Registry image for Modal sandboxes; empty = Modal's debian_slim")


def _modal_errors() -> Any:
    import modal.exception

    return modal.exception


class ModalSession(RemoteSession):
    def __init__(self, backend: ModalBackend, sandbox: Any, oneshot: bool) -> None:
        super().__init__(sandbox, WORKSPACE, oneshot=oneshot)
        self.backend = backend
        self.kill_ref = sandbox.object_id  # Sandbox.from_id finds it again

    def sdk_error(self, exc: Exception, doing: str, path: str | None = None) -> ExecboxError | None:
        errors = _modal_errors()
        if not isinstance(exc, errors.Error):
            return None
        if path is not None and isinstance(exc, errors.SandboxFilesystemNotFoundError):
            return SandboxFileNotFoundError(f"no such file in the workspace: {path!r}")
        if path is not None and isinstance(exc, errors.SandboxFilesystemError):
            return WorkspacePathError(f"{doing} in the workspace failed: {exc}")
        if isinstance(exc, errors.AuthError):
            return self.backend.credentials_error(str(exc))
        if isinstance(exc, (errors.ConflictError, errors.NotFoundError, errors.SandboxTerminatedError,
                            errors.SandboxTimeoutError)):
            return SandboxError(f"the modal sandbox is gone while {doing} ({exc}); it may have reached its lifetime",
                                backend="modal")
        return SandboxError(f"modal failed while {doing}: {exc}", backend="modal")

    def run_exec(self, request: ExecSpec) -> ExecResult:
        marker = new_run_marker()
        env = {**sandbox_env(request.env, home=WORKSPACE), RUN_MARKER: marker}
        out, err = request.captures()
        started = time.monotonic()
        proc = self.sb.exec(*wrapped_argv(request.argv), timeout=max(1, math.ceil(request.timeout)),
                            workdir=request.workdir, env=env, text=False)
        feeder = threading.Thread(target=_feed, args=(proc.stdin, request.stdin), daemon=True)
        feeder.start()
        drain_err = threading.Thread(target=_drain, args=(proc.stderr, err), daemon=True)
        drain_err.start()
        _drain(proc.stdout, out)
        drain_err.join()
        code = proc.wait()
        timed_out = code == -1  # Modal's way of saying the exec outlived its timeout
        if timed_out and not self.oneshot:
            self._reap(marker)
        return build_result(exit_code=code, stdout=out, stderr=err, timed_out=timed_out,
                            duration_s=time.monotonic() - started)

    def _reap(self, marker: str) -> None:
        """Kill what the timed-out run left behind (a setsid grandchild keeps running after Modal's kill)."""
        try:
            self.sb.exec(*reap_argv(marker), timeout=30, text=False).wait()
        except _modal_errors().Error as exc:
            log.warning("could not reap the processes of a timed-out run: %s", exc)

    def run_small(self, argv: list[str]) -> tuple[int, str]:
        proc = self.sb.exec(*argv, timeout=30, text=False)
        data = proc.stdout.read()
        return proc.wait(), data.decode(errors="replace")

    def read_bytes(self, target: str) -> bytes:
        data: bytes = self.sb.filesystem.read_bytes(target)
        return data

    def write_bytes(self, target: str, data: bytes) -> None:
        self.sb.filesystem.write_bytes(data, target)  # data first, then the path (unlike vercel)

    def dispose(self) -> None:
        _terminate(self.sb)

    async def snapshot(self, place: SnapshotPlace, *, memory: bool) -> SnapshotParts:
        # The whole filesystem, the workspace included (the runner packs that too, and unpacks it over the image).
        image_id: str = await sdk_call(self._translated, "taking a filesystem snapshot", None, self._snapshot_image)
        return SnapshotParts(memory=False, source=self.backend.source(), refs={IMAGE_REF: image_id})

    def _snapshot_image(self) -> str:
        shared = self.backend.shared
        # Modal gives up before the runner does (its bound on a snapshot is the open timeout).
        image = self.sb.snapshot_filesystem(timeout=max(1, math.floor(shared.open_timeout_sec) - 5),
                                            ttl=math.ceil(shared.snapshot_max_age_sec) + IMAGE_TTL_MARGIN_S)
        image_id: str = image.object_id
        return image_id


def _image_of(restore: SnapshotRestore) -> str:
    image_id = restore.parts.refs.get(IMAGE_REF, "")
    if not image_id.startswith("im-"):
        raise SnapshotError(f"snapshot {restore.place.id} names no Modal image: not one the modal backend took")
    return image_id


def _terminate(sandbox: Any) -> None:
    try:
        sandbox.terminate()
    except Exception as exc:  # noqa: BLE001 - the sandbox still dies at its lifetime, and gc finds it
        log.warning("could not terminate modal sandbox %s: %s (it ends at its lifetime; `execbox gc` "
                    "removes it)", getattr(sandbox, "object_id", "?"), exc)


def _feed(stdin: Any, data: bytes | None) -> None:
    try:
        for i in range(0, len(data or b""), STDIN_CHUNK):
            stdin.write(data[i:i + STDIN_CHUNK])  # type: ignore[index]
            stdin.drain()
        stdin.write_eof()
        stdin.drain()
    except Exception as exc:  # noqa: BLE001 - a command that exits without reading its stdin is not an error
        log.debug("stdin not fully delivered: %s", exc)


def _drain(stream: Any, capture: BoundedCapture) -> None:
    for chunk in stream:
        capture.write(chunk)


class ModalBackend(ExecutionBackend[ModalSettings]):
    name = "modal"
    extra = "modal"
    summary = "a Modal Sandbox (gVisor) in Modal's cloud; files live in the remote sandbox"
    capabilities = Capabilities(
        sandbox=True,
        isolation="gvisor",
        network_modes=frozenset({"none", "egress", "proxy"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "cpu", "wall_time"}),
        remote=True,
        streaming=True,  # the exec's StreamReaders yield chunks as they arrive
        snapshot=True,  # snapshot_filesystem(): the whole filesystem as a Modal image, started again by its id
    )

    settings_model = ModalSettings
    sdk = "modal"

    def credentials_error(self, detail: str = "") -> BackendUnavailableError:
        return missing_credentials(
            "modal", (f"Modal did not accept the credentials: {detail}" if detail else "no Modal credentials are set"),
            fix="set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET (from `modal token new`), or a profile in ~/.modal.toml",
            env_var="MODAL_TOKEN_ID")

    async def probe(self) -> Capabilities:
        self.settings  # noqa: B018 - an invalid setting is a ConfigError here
        token = os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET")
        oauth = os.environ.get("MODAL_OAUTH_REFRESH_TOKEN")
        config = Path(os.environ.get("MODAL_CONFIG_PATH") or Path.home() / ".modal.toml")
        if not (token or oauth or config.is_file()):
            raise self.credentials_error()
        return self.capabilities

    def _client(self) -> Any:
        import modal
        import modal.exception

        try:
            return modal.Client.from_env()
        except modal.exception.AuthError as exc:
            raise self.credentials_error(str(exc)) from exc

    async def open_session(self, spec: SessionSpec) -> ModalSession:
        if spec.network not in ("none", "egress", "proxy"):
            raise UnsupportedPolicyError(f"refused: modal cannot enforce network mode {spec.network!r} (it enforces "
                                         "none, egress and proxy)", backend=self.name)
        allowlist = self.shared.provider_allowlist(self.name) if spec.network == "proxy" else None
        if spec.lifetime_s > MAX_LIFETIME_S:
            raise UnsupportedPolicyError(f"refused: a Modal sandbox lives at most {MAX_LIFETIME_S} s; ask for a "
                                         "shorter lifetime", backend=self.name)
        sandbox = await create_cleanly(lambda made: self._create(spec, made, allowlist), _terminate)
        session = ModalSession(self, sandbox, spec.oneshot)
        # A snapshot's files may hold a link the code planted: paths are resolved in the sandbox from the start.
        session.dirty = spec.restore is not None
        if allowlist is not None:
            session.result_notes.append(allowlist.note("modal"))
        return session

    def _create(self, spec: SessionSpec, created: list[Any], allowlist: Any = None) -> None:
        import modal

        errors = _modal_errors()
        client = self._client()
        try:
            app = modal.App.lookup(self.settings.app, create_if_missing=True, client=client)
            if spec.restore is not None:
                image = modal.Image.from_id(_image_of(spec.restore), client=client)
            elif self.settings.image:
                image = modal.Image.from_registry(self.settings.image)
            else:
                image = modal.Image.debian_slim()
            kwargs: dict[str, Any] = {}
            if spec.limits.memory_mb:
                kwargs["memory"] = (spec.limits.memory_mb, spec.limits.memory_mb)
            if spec.limits.cpus:
                kwargs["cpu"] = (spec.limits.cpus, spec.limits.cpus)
            if allowlist is not None:  # either list given (even empty) makes Modal's network an allowlist
                kwargs["outbound_domain_allowlist"] = list(allowlist.domains)
                kwargs["outbound_cidr_allowlist"] = [str(net) for net in allowlist.networks]
            created.append(modal.Sandbox.create(
                app=app, image=image, workdir=WORKSPACE, timeout=max(1, math.ceil(spec.lifetime_s)),
                block_network=spec.network == "none", tags=REMOTE_LABELS.make(spec.lifetime_s), client=client,
                **kwargs))
        except errors.AuthError as exc:
            raise self.credentials_error(str(exc)) from exc
        except errors.NotFoundError as exc:
            if spec.restore is None:
                raise SandboxError(f"modal could not create a sandbox: {exc}", backend=self.name) from exc
            raise SnapshotError(f"snapshot {spec.restore.place.id}: Modal no longer has its image ({exc}); images "
                                "expire, Modal deleting them after their time (CODE_EXEC_SNAPSHOT_MAX_AGE_SEC when "
                                "it was taken): take a new snapshot") from exc
        except errors.Error as exc:
            raise SandboxError(f"modal could not create a sandbox: {exc}", backend=self.name) from exc

    def source(self) -> str:
        """The image a sandbox comes from, as a snapshot records it."""
        return f"modal {self.settings.image or 'debian_slim'}"

    async def delete_snapshot(self, place: SnapshotPlace, parts: SnapshotParts) -> None:
        # Nothing to call: Modal has no deletion for a filesystem snapshot's image; it expires at its ttl
        # (CODE_EXEC_SNAPSHOT_MAX_AGE_SEC and an hour when it was taken), which bounds what a removed snapshot leaves.
        return None

    async def kill(self, ref: str) -> None:
        await sdk_call(self._kill, ref)

    def _kill(self, ref: str) -> None:
        """`execbox kill`: terminate the sandbox ``ref`` (its object id), only one execbox made on this host."""
        import modal

        errors = _modal_errors()
        try:
            sandbox = modal.Sandbox.from_id(ref, client=self._client())
            ours = REMOTE_LABELS.made_here(sandbox.get_tags())
        except errors.AuthError as exc:
            raise self.credentials_error(str(exc)) from exc
        except (errors.NotFoundError, errors.InvalidError):
            ours = False
        if not ours:
            raise SandboxError(f"no modal sandbox {ref!r} of execbox on this host", backend=self.name)
        try:
            sandbox.terminate()
        except errors.Error as exc:
            raise SandboxError(f"modal could not terminate sandbox {ref}: {exc}", backend=self.name) from exc

    async def gc(self) -> list[str]:
        return await sdk_call(self._gc)

    def _gc(self) -> list[str]:
        import modal

        errors = _modal_errors()
        client = self._client()
        removed = []
        try:
            app = modal.App.lookup(self.settings.app, client=client)
        except errors.NotFoundError:
            return []
        except errors.AuthError as exc:
            raise self.credentials_error(str(exc)) from exc
        for sb in modal.Sandbox.list(app_id=app.app_id, tags={REMOTE_LABELS.mark: "1"}, client=client):
            reason = REMOTE_LABELS.orphan_reason(sb.get_tags())
            if reason:
                sb.terminate()
                removed.append(f"modal sandbox {sb.object_id} ({reason})")
        return removed

