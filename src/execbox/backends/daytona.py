"""daytona: every session is a Daytona sandbox in Daytona's cloud (SDK ``daytona``, extra ``daytona``).

Policy, translated to Daytona's own controls (and refused when Daytona cannot enforce it):

    network none   network_block_all=True            egress   no block
    network proxy  domain_allow_list (names, *.domain) + network_allow_list (IPv4 CIDR entries; IPv6 ones are
                   refused): Daytona's allowlist, on any port; an empty allowlist is network_block_all=True; an
                   entry with a port is refused; results say what execbox cannot see
    cpu            Resources(cpu=) whole CPUs; a fraction is refused
    memory         Resources(memory=) whole GiB, from CODE_EXEC_MEMORY_MB; a value that is not a whole
                   number of GiB is refused. A per-request memory limit is refused (Daytona's floor is 1 GiB)
    lifetime       ttl_minutes (rounded up): the sandbox is destroyed at it, whatever its state
    exec timeout   process.exec(timeout=) whole seconds, rounded up; Daytona kills the command, answers 408

Resources can only be given to sandboxes created from an image, so execbox always creates from
CODE_EXEC_DAYTONA_IMAGE. Credentials: ``Daytona()`` reads DAYTONA_API_KEY (or DAYTONA_JWT_TOKEN +
DAYTONA_ORGANIZATION_ID) in this process; nothing of them goes into the sandbox.

Runs. Daytona's exec returns stdout and stderr combined, whole, as one string, and cannot feed stdin. So a
run is: upload a small script (and the stdin) with the filesystem API; exec it, and it runs the argv with
stdin, stdout and stderr on files in the sandbox (a signal death becomes 128+signal); then cut the head and
the tail of each output file in the sandbox and download only those, so no more than the cap ever crosses
the network or sits in memory, and bytes arrive exactly as written. After a timeout in a session every
process the run started is killed (found by a marker variable).

Sessions. One sandbox per session, ephemeral (deleted when stopped) with the lifetime as its TTL.
DAYTONA_SANDBOX_PERSIST=true: a session stops its sandbox at the end instead of deleting it, and a later
session with the same name resumes it (refused if it was created with another network mode or limits).
Every sandbox carries execbox labels, so ``gc`` deletes orphans (never a persisted one).

Snapshots. ``sandbox.create_snapshot(name)`` keeps the live sandbox's filesystem (what apt or pip installed
outside the workspace) as a Daytona snapshot named ``execbox-<snapshot id>`` (refs ``{"snapshot": name}``); a
sandbox started from it is created with ``CreateSandboxFromSnapshotParams(snapshot=name)``, today's network and
lifetime, and the runner unpacks the workspace into it as everywhere. Such a sandbox takes its CPUs and memory
from the snapshot (Daytona sends resources only for image sandboxes): one whose resources differ from what the
session asks for is deleted and refused. ``daytona.snapshot.delete`` removes the snapshot with execbox's (by the
name, so even one whose taking was cut short). A snapshot is never a persisted, named sandbox (its name belongs to
the sandbox it was taken of). Processes are not kept.
"""

from __future__ import annotations

import logging
import math
import shlex
import threading
import time
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
    UnsupportedPolicyError,
    build_result,
    create_cleanly,
    missing_credentials,
    new_run_marker,
    reap_argv,
    sandbox_env,
    sdk_call,
    setting,
)

log = logging.getLogger("execbox.backends.daytona")
CTL = "/tmp/.execbox"  # run scripts and captured output, outside the workspace
SNAPSHOT_REF = "snapshot"  # a snapshot's Daytona snapshot name, in SnapshotParts.refs

# sh RUN CTL: run the argv that follows (written into the script) with its streams on files in CTL.
# Another run's directory stays while it is live or new (execs of a session may overlap: run_cell's
# interpreter; an upload may be in flight); the session names its finished ones to remove.
_RUN = """ctl={ctl}
for d in {root}/*; do
  [ "$d" = "$ctl" ] || [ -e "$d/live" ] || [ -n "$(find "$d" -maxdepth 0 -mmin -1 2>/dev/null)" ] || rm -rf -- "$d"
done
rm -rf -- {finished}
{argv} <"$ctl/stdin" >"$ctl/out" 2>"$ctl/err"
exit $?
"""

# sh COLLECT CTL HEAD TAIL: sizes of out and err on stdout; their head and tail cut into .h and .t files.
_COLLECT = """ctl=$1; head=$2; tail=$3
for s in out err; do
  f=$ctl/$s
  [ -f "$f" ] || : >"$f"
  n=$(wc -c <"$f")
  printf '%s %s\\n' "$s" "$n"
  if [ "$n" -gt $((head + tail)) ]; then head -c "$head" "$f" >"$f.h"; tail -c "$tail" "$f" >"$f.t"
  else cp "$f" "$f.h"; : >"$f.t"; fi
done
"""


class DaytonaSettings(BackendSettings):
    persist: bool = setting("DAYTONA_SANDBOX_PERSIST", False,
                         "Stop (not delete) a Daytona session's sandbox at its end; a later session with the same "
                         "name resumes it")
    image: str = setting("CODE_EXEC_DAYTONA_IMAGE", "python:3.12-slim",
                      "Image of Daytona sandboxes (Daytona sets CPU and memory only on image sandboxes)")


def _errors() -> Any:
    import daytona

    return daytona


def resources(spec: SessionSpec) -> tuple[int | None, int | None]:
    """(CPUs, GiB) for Daytona, or UnsupportedPolicyError: Daytona allocates whole CPUs and whole GiB."""
    cpus, memory_mb = spec.limits.cpus, spec.limits.memory_mb
    if cpus is not None and not float(cpus).is_integer():
        raise UnsupportedPolicyError(
            f"refused: Daytona allocates whole CPUs and cannot enforce {cpus} CPUs. Ask for a whole number "
            "(limits.cpus or CODE_EXEC_CPUS)", backend="daytona", env_var="CODE_EXEC_CPUS")
    if memory_mb is not None and memory_mb % 1024:
        raise UnsupportedPolicyError(
            f"refused: Daytona sets memory in whole GiB and cannot enforce {memory_mb} MiB. Set CODE_EXEC_MEMORY_MB "
            "to a multiple of 1024", backend="daytona", env_var="CODE_EXEC_MEMORY_MB")
    return (int(cpus) if cpus else None), (memory_mb // 1024 if memory_mb else None)


class DaytonaSession(RemoteSession):
    def __init__(self, backend: DaytonaBackend, sandbox: Any, workspace: str, *, oneshot: bool, persist: bool) -> None:
        # a resumed sandbox may hold anything: check paths from the start
        super().__init__(sandbox, workspace, oneshot=oneshot, dirty=persist)
        self.backend = backend
        self.persist = persist
        self.kill_ref = sandbox.id  # Daytona.get finds it again
        self._finished: list[str] = []  # control directories of runs collected, for the next run to remove
        self._finished_lock = threading.Lock()

    def sdk_error(self, exc: Exception, doing: str, path: str | None = None) -> ExecboxError | None:
        daytona = _errors()
        if path is not None and isinstance(exc, daytona.DaytonaNotFoundError):
            return SandboxFileNotFoundError(f"no such file in the workspace: {path!r}")
        if isinstance(exc, daytona.DaytonaAuthenticationError):
            return self.backend.credentials_error(str(exc))
        if isinstance(exc, daytona.DaytonaError):
            return SandboxError(f"daytona failed while {doing}: {exc}", backend="daytona")
        return None

    # --- exec ---

    def run_exec(self, request: ExecSpec) -> ExecResult:
        daytona = _errors()
        marker = new_run_marker()
        ctl = f"{CTL}/{marker}"
        with self._finished_lock:
            finished, self._finished = self._finished, []
        run = _RUN.format(ctl=shlex.quote(ctl), root=CTL, argv=shlex.join(request.argv),
                          finished=" ".join(shlex.quote(d) for d in finished))
        env = {**sandbox_env(request.env, home=self.workspace), RUN_MARKER: marker}
        started = time.monotonic()
        timed_out = False
        self.sb.fs.upload_files([
            daytona.FileUpload(source=b"", destination=f"{ctl}/live"),  # first: no other run removes the rest
            daytona.FileUpload(source=run.encode(), destination=f"{ctl}/run.sh"),
            daytona.FileUpload(source=_COLLECT.encode(), destination=f"{ctl}/collect.sh"),
            daytona.FileUpload(source=request.stdin or b"", destination=f"{ctl}/stdin"),
        ])
        try:
            response = self.sb.process.exec(f"sh {ctl}/run.sh", cwd=request.workdir, env=env,
                                            timeout=max(1, math.ceil(request.timeout)))
            code = response.exit_code
        except daytona.DaytonaTimeoutError:
            timed_out, code = True, None
        duration = time.monotonic() - started
        if timed_out and not self.oneshot:
            self._reap(marker)
        out, err = self._collect(ctl, request)
        with self._finished_lock:
            self._finished.append(ctl)
        return build_result(exit_code=code, stdout=out, stderr=err, timed_out=timed_out, duration_s=duration)

    def _collect(self, ctl: str, request: ExecSpec) -> tuple[BoundedCapture, BoundedCapture]:
        """Only the head and the tail of each stream leave the sandbox."""
        cap = request.max_output_bytes
        daytona = _errors()
        probe = BoundedCapture(cap)
        sizes = self.sb.process.exec(f"sh {ctl}/collect.sh {ctl} {probe.head_cap} {probe.tail_cap}", timeout=60)
        if sizes.exit_code != 0:
            raise SandboxError(f"could not collect the output of a run: {sizes.result.strip()}", backend="daytona")
        total = {name: int(n) for name, n in (line.split() for line in sizes.result.splitlines() if line.strip())}
        names = [f"{ctl}/{s}.{part}" for s in ("out", "err") for part in ("h", "t")]
        got = {r.source: r for r in self.sb.fs.download_files([daytona.FileDownloadRequest(source=n) for n in names])}
        captures = []
        for s in ("out", "err"):
            capture = BoundedCapture(cap, redactor=request.redactor)
            for part in ("h", "t"):
                item = got.get(f"{ctl}/{s}.{part}")
                if item is None or item.error or not isinstance(item.result, bytes):
                    raise SandboxError(f"could not download the {s} of a run: {getattr(item, 'error', 'missing')}",
                                       backend="daytona")
                capture.write(item.result)
            capture.total = total[s]  # what was cut out in the sandbox counts as omitted
            captures.append(capture)
        return captures[0], captures[1]

    def _reap(self, marker: str) -> None:
        try:
            self.sb.process.exec(shlex.join(reap_argv(marker)), timeout=30)
        except _errors().DaytonaError as exc:
            log.warning("could not reap the processes of a timed-out run: %s", exc)

    # --- files ---

    def run_small(self, argv: list[str]) -> tuple[int, str]:
        out = self.sb.process.exec(shlex.join(argv), timeout=30)
        return out.exit_code, out.result

    def read_bytes(self, target: str) -> bytes:
        return bytes(self.sb.fs.download_file(target) or b"")

    def write_bytes(self, target: str, data: bytes) -> None:
        self.sb.fs.upload_file(data, target)  # bytes: the content (a str would be read as a LOCAL file path)

    def dispose(self) -> None:
        (_stop if self.persist else _delete)(self.sb)

    async def snapshot(self, place: SnapshotPlace, *, memory: bool) -> SnapshotParts:
        # The whole filesystem, the workspace included (the runner packs that too, and unpacks it over this one).
        name = snapshot_name(place)
        # Daytona gives up before the runner does (its bound on a snapshot is the open timeout).
        seconds = max(1.0, self.backend.shared.open_timeout_sec - 5)
        await sdk_call(self._translated, "taking a snapshot", None,
                       lambda: self.sb.create_snapshot(name, timeout=seconds))
        return SnapshotParts(memory=False, source=f"daytona {self.backend.settings.image}", refs={SNAPSHOT_REF: name})


def snapshot_name(place: SnapshotPlace) -> str:
    """The Daytona snapshot of an execbox snapshot: named by its id, so that it is found without the manifest."""
    return f"execbox-{place.id}"


def _delete(sandbox: Any) -> None:
    try:
        sandbox.delete()
    except Exception as exc:  # noqa: BLE001 - its TTL still ends it, and gc finds it
        log.warning("could not delete daytona sandbox %s: %s (its TTL ends it; `execbox gc` removes it)",
                    getattr(sandbox, "id", "?"), exc)


def _stop(sandbox: Any) -> None:
    try:
        sandbox.stop()
    except Exception as exc:  # noqa: BLE001
        log.warning("could not stop persisted daytona sandbox %s: %s (Daytona's auto-stop will)",
                    getattr(sandbox, "name", "?"), exc)


class DaytonaBackend(ExecutionBackend[DaytonaSettings]):
    name = "daytona"
    extra = "daytona"
    summary = "a Daytona sandbox in Daytona's cloud; files live in the remote sandbox; DAYTONA_SANDBOX_PERSIST keeps it"
    capabilities = Capabilities(
        sandbox=True,
        isolation="container",
        network_modes=frozenset({"none", "egress", "proxy"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"cpu", "wall_time"}),
        remote=True,
        streaming=False,  # process.exec returns the output when the command ends; collected then
        snapshot=True,  # sandbox.create_snapshot(): the whole filesystem as a Daytona snapshot, started again by name
    )

    settings_model = DaytonaSettings
    sdk = "daytona"

    def credentials_error(self, detail: str = "", *, missing: bool = False) -> BackendUnavailableError:
        what = "no Daytona credentials are set" if missing or not detail else "Daytona did not accept the credentials"
        return missing_credentials(
            "daytona", what + (f": {detail}" if detail else ""),
            fix="set DAYTONA_API_KEY (or DAYTONA_JWT_TOKEN and DAYTONA_ORGANIZATION_ID)", env_var="DAYTONA_API_KEY")

    async def probe(self) -> Capabilities:
        self.settings  # noqa: B018 - an invalid setting is a ConfigError here
        await sdk_call(self._client)  # reads the credentials; makes no request
        return self.capabilities

    def _client(self) -> Any:
        import daytona

        try:
            return daytona.Daytona()  # reads the credentials; makes no request
        except daytona.DaytonaAuthenticationError as exc:
            raise self.credentials_error(str(exc), missing=True) from exc

    async def open_session(self, spec: SessionSpec) -> DaytonaSession:
        if spec.network not in ("none", "egress", "proxy"):
            raise UnsupportedPolicyError(f"refused: daytona cannot enforce network mode {spec.network!r} (it "
                                         "enforces none, egress and proxy)", backend=self.name)
        network = self._network(spec)
        cpus, gib = resources(spec)
        if not self.settings.image:
            raise UnsupportedPolicyError("refused: CODE_EXEC_DAYTONA_IMAGE is empty, and Daytona sets CPU and memory "
                                         "only on sandboxes created from an image. Set it (e.g. python:3.12-slim)",
                                         backend=self.name, env_var="CODE_EXEC_DAYTONA_IMAGE")
        persist = self.settings.persist and not spec.oneshot
        if persist and spec.name and spec.restore is not None:
            raise UnsupportedPolicyError(f"refused: the persisted Daytona sandbox {spec.name!r} cannot start from a "
                                         "snapshot (its name is the sandbox it was taken of, which a rollback "
                                         "keeps until the new one is up). Start it without a name, or without "
                                         "DAYTONA_SANDBOX_PERSIST", backend=self.name,
                                         env_var="DAYTONA_SANDBOX_PERSIST")
        where: dict[str, str] = {}
        sandbox = await create_cleanly(lambda made: self._open(spec, cpus, gib, persist, made, where),
                                               _stop if persist else _delete)
        session = DaytonaSession(self, sandbox, where["workspace"], oneshot=spec.oneshot, persist=persist)
        # A snapshot's files may hold a link the code planted: paths are resolved in the sandbox from the start.
        session.dirty = session.dirty or spec.restore is not None
        if spec.network == "proxy":
            session.result_notes.append(network["note"])
        return session

    def _network(self, spec: SessionSpec) -> dict[str, Any]:
        """Daytona's network parameters for the session's mode (and, for proxy, the results' note)."""
        if spec.network != "proxy":
            return {"network_block_all": spec.network == "none"}
        allowlist = self.shared.provider_allowlist(self.name)
        v6 = [str(net) for net in allowlist.networks if net.version == 6]
        if v6:
            raise UnsupportedPolicyError(f"refused: network mode proxy on daytona: its network_allow_list takes IPv4 "
                                         f"networks only, and CODE_EXEC_EGRESS_ALLOW names {', '.join(v6)}",
                                         backend=self.name, env_var="CODE_EXEC_EGRESS_ALLOW")
        if not allowlist.domains and not allowlist.networks:  # nothing allowed: Daytona's lists would allow all
            return {"network_block_all": True, "note": allowlist.note("daytona")}
        return {"network_block_all": False, "domain_allow_list": ",".join(allowlist.domains) or None,
                "network_allow_list": ",".join(str(net) for net in allowlist.networks) or None,
                "note": allowlist.note("daytona")}

    def _open(self, spec: SessionSpec, cpus: int | None, gib: int | None, persist: bool, made: list[Any],
              where: dict[str, str]) -> None:
        daytona = _errors()
        try:
            self._create_or_resume(spec, cpus, gib, persist, made)
            where["workspace"] = made[0].get_work_dir().rstrip("/") or "/"
        except daytona.DaytonaAuthenticationError as exc:
            raise self.credentials_error(str(exc)) from exc
        except daytona.DaytonaError as exc:
            raise SandboxError(f"daytona could not create a sandbox: {exc}", backend=self.name) from exc

    def _create_or_resume(self, spec: SessionSpec, cpus: int | None, gib: int | None, persist: bool,
                          made: list[Any]) -> None:
        daytona = _errors()
        client = self._client()
        if persist and spec.name:
            existing = self._resume(client, spec, cpus, gib, made)
            if existing:
                return
        lifetime = {} if persist else {"ephemeral": True, "ttl_minutes": max(1, math.ceil(spec.lifetime_s / 60))}
        common = {"labels": REMOTE_LABELS.make(spec.lifetime_s, persist=persist),
                  **{k: v for k, v in self._network(spec).items() if k != "note"}, **lifetime}
        if spec.restore is not None:
            self._restore(client, spec, cpus, gib, common, made)
            return
        params = daytona.CreateSandboxFromImageParams(
            image=self.settings.image, name=spec.name if persist else None,
            resources=daytona.Resources(cpu=cpus, memory=gib), **common)
        made.append(client.create(params, timeout=120))

    def _restore(self, client: Any, spec: SessionSpec, cpus: int | None, gib: int | None, common: dict[str, Any],
                 made: list[Any]) -> None:
        """A new sandbox from the session's snapshot (into ``made``), refused when it has other resources."""
        daytona = _errors()
        assert spec.restore is not None
        name = spec.restore.parts.refs.get(SNAPSHOT_REF, "")
        if not name.startswith("execbox-"):
            raise SnapshotError(f"snapshot {spec.restore.place.id} names no Daytona snapshot: not one the daytona "
                                "backend took")
        params = daytona.CreateSandboxFromSnapshotParams(snapshot=name, **common)
        try:
            made.append(client.create(params, timeout=120))
        except daytona.DaytonaNotFoundError as exc:
            raise SnapshotError(f"snapshot {spec.restore.place.id}: Daytona no longer has its snapshot {name!r} "
                                f"({exc}): take a new one") from exc
        sandbox = made[0]
        have = {"cpu": sandbox.cpu, "memory": sandbox.memory}
        differs = [k for k, want in (("cpu", cpus), ("memory", gib)) if want is not None and have[k] != want]
        if differs:
            raise UnsupportedPolicyError(
                f"refused: a sandbox started from Daytona snapshot {name!r} has "
                + ", ".join(f"{k}={have[k]!r}" for k in differs) + " (Daytona takes them from the snapshot) but this "
                "session asks for " + ", ".join(f"{k}={dict(cpu=cpus, memory=gib)[k]!r}" for k in differs)
                + ": start it with the limits the snapshot was taken with", backend=self.name)
        # The runs of the sandbox it was taken of left their control directories: none of them is live here.
        sandbox.process.exec(f"rm -rf -- {CTL}", timeout=30)

    def _resume(self, client: Any, spec: SessionSpec, cpus: int | None, gib: int | None, made: list[Any]) -> bool:
        """Start the persisted sandbox of this name again (into ``made``); False if there is none."""
        daytona = _errors()
        try:
            sandbox = client.get(spec.name)
        except daytona.DaytonaNotFoundError:
            return False
        labels = sandbox.labels or {}
        if not REMOTE_LABELS.kept(labels):
            raise UnsupportedPolicyError(f"refused: a Daytona sandbox named {spec.name!r} exists but execbox did not "
                                         "persist it; use another name", backend=self.name)
        network = self._network(spec)
        wanted = {"network_block_all": network["network_block_all"], "cpu": cpus, "memory": gib,
                  "domain_allow_list": network.get("domain_allow_list"),
                  "network_allow_list": network.get("network_allow_list")}
        have = {"network_block_all": bool(sandbox.network_block_all), "cpu": sandbox.cpu, "memory": sandbox.memory,
                "domain_allow_list": getattr(sandbox, "domain_allow_list", None),
                "network_allow_list": getattr(sandbox, "network_allow_list", None)}
        # the allowlists are compared when this session asks for one (None then means "none given")
        compared = {"domain_allow_list", "network_allow_list"} if spec.network == "proxy" else set()
        differs = [k for k, v in wanted.items() if (v is not None or k in compared) and have[k] != v]
        if differs:
            raise UnsupportedPolicyError(
                f"refused: the persisted Daytona sandbox {spec.name!r} was created with "
                + ", ".join(f"{k}={have[k]!r}" for k in differs) + " but this session asks for "
                + ", ".join(f"{k}={wanted[k]!r}" for k in differs)
                + "; a sandbox cannot change them. Delete it or use another name", backend=self.name)
        made.append(sandbox)  # from here on, a failure stops it again
        if sandbox.state != daytona.SandboxState.STARTED:
            sandbox.start(timeout=120)
        return True

    async def delete_snapshot(self, place: SnapshotPlace, parts: SnapshotParts) -> None:
        await sdk_call(self._delete_snapshot, parts.refs.get(SNAPSHOT_REF) or snapshot_name(place))

    def _delete_snapshot(self, name: str) -> None:
        daytona = _errors()
        try:
            self._client().snapshot.delete(name)
        except daytona.DaytonaNotFoundError:
            return  # removed already (a second call), or never made (a taking cut short before Daytona had it)
        except daytona.DaytonaAuthenticationError as exc:
            raise self.credentials_error(str(exc)) from exc
        except daytona.DaytonaError as exc:
            raise SandboxError(f"daytona could not delete snapshot {name!r}: {exc}", backend=self.name) from exc

    async def kill(self, ref: str) -> None:
        await sdk_call(self._kill, ref)

    def _kill(self, ref: str) -> None:
        """`execbox kill`: delete the sandbox ``ref`` (its id), only one execbox made on this host; one kept on
        purpose (a named, resumable one) is stopped instead, as its owner's close does."""
        daytona = _errors()
        client = self._client()
        try:
            sandbox = client.get(ref)
            labels = dict(sandbox.labels or {})
        except daytona.DaytonaAuthenticationError as exc:
            raise self.credentials_error(str(exc)) from exc
        except daytona.DaytonaError:  # not found, or not an id at all
            labels = {}
        if not REMOTE_LABELS.made_here(labels):
            raise SandboxError(f"no daytona sandbox {ref!r} of execbox on this host", backend=self.name)
        try:
            if REMOTE_LABELS.kept(labels):
                sandbox.stop()
            else:
                sandbox.delete()
        except daytona.DaytonaError as exc:
            raise SandboxError(f"daytona could not end sandbox {ref}: {exc}", backend=self.name) from exc

    async def gc(self) -> list[str]:
        return await sdk_call(self._gc)

    def _gc(self) -> list[str]:
        daytona = _errors()
        client = self._client()
        removed = []
        try:
            for sandbox in client.list(daytona.ListSandboxesQuery(labels={REMOTE_LABELS.mark: "1"})):
                reason = REMOTE_LABELS.orphan_reason(sandbox.labels or {})
                if reason:
                    sandbox.delete()
                    removed.append(f"daytona sandbox {sandbox.name} ({reason})")
        except daytona.DaytonaAuthenticationError as exc:
            raise self.credentials_error(str(exc)) from exc
        return removed
