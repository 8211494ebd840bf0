"""vercel_sandbox: every session is a Vercel Sandbox (a Firecracker microVM) in Vercel's cloud (SDK ``vercel``
>= 0.12, its function-style ``vercel.sandbox.sync`` API; extra ``vercel``).

Policy, translated to Vercel's own controls (and refused when Vercel cannot enforce it):

    network none   network_policy=NetworkPolicy.deny_all()      egress   NetworkPolicy.allow_all()
    network proxy  NetworkPolicy.custom(allow={name: ()}, subnets=NetworkPolicySubnets(allow=CIDR entries,
                   deny=the ranges execbox refuses that no entry names)): Vercel's allowlist, on any port; an
                   empty allowlist is deny_all(); an entry with a port is refused; results say what execbox cannot see
    cpu            SandboxResources(vcpus=) whole vCPUs; a fraction is refused
    memory         not settable on its own: Vercel gives 2048 MB per vCPU. Not claimed, so a memory
                   limit you set (in a request or CODE_EXEC_MEMORY_MB) is refused (every result says so)
    lifetime       execution_time_limit= seconds; the session is stopped at it
    exec timeout   run_process(kill_after=) seconds: the service SIGKILLs the command

Credentials: the SDK resolves them in this process on the first call (VERCEL_OIDC_TOKEN, or VERCEL_TOKEN +
VERCEL_PROJECT_ID + VERCEL_TEAM_ID); nothing of them goes into the sandbox.

Runs. One non-persistent sandbox per session; files through ``sb.fs``; stdout and stderr arrive as decoded
text chunks and go straight into the bounded capture (run_process is given text streams, so the SDK keeps
nothing). The exit code of a command killed by a signal is 128+signal (a shell wrapper makes it so); a run
is timed out when it was killed (SIGKILL) and its kill_after had passed. After a timeout in a session every
process the run started is killed (found by a marker variable). Sandboxes carry execbox tags, so ``gc``
destroys orphans.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from execbox.plugin import (
    REMOTE_LABELS,
    RUN_MARKER,
    SIGKILL_EXIT_CODE,
    BackendSettings,
    BackendUnavailableError,
    Capabilities,
    ExecboxError,
    ExecResult,
    ExecSpec,
    ExecutionBackend,
    RemoteSession,
    SandboxError,
    SandboxFileNotFoundError,
    SessionSpec,
    TextCapture,
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

log = logging.getLogger("execbox.backends.vercel_sandbox")
WORKSPACE = "/vercel/sandbox"  # the sandbox's default working directory
MEMORY_NOTE = ("vercel_sandbox: memory is Vercel's 2048 MB per vCPU; the default CODE_EXEC_MEMORY_MB does not apply "
               "and a memory limit you set is refused")


class VercelSettings(BackendSettings):
    image: str = setting("CODE_EXEC_VERCEL_IMAGE", "",
                      "Vercel Container Registry image for sandboxes; empty = Vercel's default")


def _sync() -> Any:
    from vercel.sandbox import sync

    return sync


class VercelSession(RemoteSession):
    def __init__(self, backend: VercelSandboxBackend, sandbox: Any, oneshot: bool) -> None:
        super().__init__(sandbox, WORKSPACE, oneshot=oneshot)
        self.backend = backend
        self.kill_ref = sandbox.name  # get_sandbox finds it again

    def sdk_error(self, exc: Exception, doing: str, path: str | None = None) -> ExecboxError | None:
        sync = _sync()
        if path is not None and isinstance(exc, sync.SandboxPathNotFoundError):
            return SandboxFileNotFoundError(f"no such file in the workspace: {path!r}")
        if path is not None and isinstance(exc, sync.SandboxFilesystemError):
            return WorkspacePathError(f"{doing} in the workspace failed: {exc}")
        if isinstance(exc, sync.SandboxError):
            return self.backend.sdk_error(exc, doing)
        return None

    def run_exec(self, request: ExecSpec) -> ExecResult:
        marker = new_run_marker()
        env = {**sandbox_env(request.env, home=WORKSPACE), RUN_MARKER: marker}
        out = TextCapture(request.max_output_bytes, request.on_output, "stdout", redactor=request.redactor)
        err = TextCapture(request.max_output_bytes, request.on_output, "stderr", redactor=request.redactor)
        argv = wrapped_argv(request.argv)
        started = time.monotonic()
        done = self.sb.run_process(argv[0], argv[1:], cwd=request.workdir, env=env,
                                   kill_after=request.timeout, stdout=out, stderr=err, input=request.stdin)
        duration = time.monotonic() - started
        code = done.returncode
        # The SDK does not say why a process ended. kill_after is the service's SIGKILL: a run timed out when
        # it was killed (137 through the wrapper, -9 if the service reports the signal) after its deadline.
        # Elapsed time alone is not enough: a command that fails on its own in the last round trip before the
        # deadline keeps its exit code.
        timed_out = code in (SIGKILL_EXIT_CODE, -signal.SIGKILL) and duration >= request.timeout
        if timed_out and not self.oneshot:
            self._reap(marker)
        return build_result(exit_code=code, stdout=out.capture, stderr=err.capture, timed_out=timed_out,
                            duration_s=duration)

    def _reap(self, marker: str) -> None:
        argv = reap_argv(marker)
        try:
            self.sb.run_process(argv[0], argv[1:], capture_output=True, kill_after=30)
        except _sync().SandboxError as exc:
            log.warning("could not reap the processes of a timed-out run: %s", exc)

    def run_small(self, argv: list[str]) -> tuple[int, str]:
        done = self.sb.run_process(argv[0], argv[1:], capture_output=True, kill_after=30)
        return done.returncode, done.stdout or ""

    def read_bytes(self, target: str) -> bytes:
        data: bytes = self.sb.fs.read_bytes(target)
        return data

    def write_bytes(self, target: str, data: bytes) -> None:
        self.sb.fs.write_bytes(target, data)  # the path first, then the data (unlike modal)

    def dispose(self) -> None:
        _finish(self.sb)


def _finish(sandbox: Any) -> None:
    """Stop the session, then destroy the sandbox for good."""
    try:
        sandbox.stop()
        sandbox.destroy()
    except Exception as exc:  # noqa: BLE001 - its execution_time_limit still ends it, and gc finds it
        log.warning("could not destroy vercel sandbox %s: %s (it stops at its time limit; `execbox gc` "
                    "removes it)", getattr(sandbox, "name", "?"), exc)


class VercelSandboxBackend(ExecutionBackend[VercelSettings]):
    name = "vercel_sandbox"
    extra = "vercel"
    summary = "a Vercel Sandbox (Firecracker microVM) in Vercel's cloud; files live in the remote sandbox"
    capabilities = Capabilities(
        sandbox=True,
        isolation="microvm",
        network_modes=frozenset({"none", "egress", "proxy"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"cpu", "wall_time"}),
        remote=True,
        streaming=True,  # run_process writes each log chunk to the text streams as it arrives
    )

    settings_model = VercelSettings
    sdk = "vercel.sandbox.sync"

    def notes(self) -> list[str]:
        return [MEMORY_NOTE]

    def credentials_error(self, detail: str = "") -> BackendUnavailableError:
        return missing_credentials(
            "vercel_sandbox",
            f"Vercel did not accept the credentials: {detail}" if detail else "no Vercel credentials are set",
            fix="set VERCEL_OIDC_TOKEN (`vercel env pull`), or VERCEL_TOKEN, VERCEL_PROJECT_ID and VERCEL_TEAM_ID",
            env_var="VERCEL_TOKEN")

    def sdk_error(self, exc: Exception, doing: str) -> ExecboxError:
        sync = _sync()
        if isinstance(exc, sync.SandboxCredentialsError) or getattr(exc, "status_code", None) in (401, 403):
            return self.credentials_error(str(exc))
        if getattr(exc, "status_code", None) in (404, 410):
            return SandboxError(f"the vercel sandbox is gone while {doing} ({exc}); it may have reached its time "
                                "limit", backend=self.name)
        return SandboxError(f"vercel failed while {doing}: {exc}", backend=self.name)

    async def probe(self) -> Capabilities:
        import os

        self.settings  # noqa: B018 - an invalid setting is a ConfigError here
        oidc = os.environ.get("VERCEL_OIDC_TOKEN") or os.environ.get("VERCEL_OIDC_TOKEN_FILE")
        token = all(os.environ.get(v) for v in ("VERCEL_TOKEN", "VERCEL_PROJECT_ID", "VERCEL_TEAM_ID"))
        if not (oidc or token):
            raise self.credentials_error()
        return self.capabilities

    async def open_session(self, spec: SessionSpec) -> VercelSession:
        if spec.network not in ("none", "egress", "proxy"):
            raise UnsupportedPolicyError(f"refused: vercel_sandbox cannot enforce network mode {spec.network!r} (it "
                                         "enforces none, egress and proxy)", backend=self.name)
        allowlist = self.shared.provider_allowlist(self.name) if spec.network == "proxy" else None
        cpus = spec.limits.cpus
        if cpus is not None and not float(cpus).is_integer():
            raise UnsupportedPolicyError(
                f"refused: Vercel allocates whole vCPUs and cannot enforce {cpus} CPUs. Ask for a whole number "
                "(limits.cpus or CODE_EXEC_CPUS)", backend=self.name, env_var="CODE_EXEC_CPUS")
        sandbox = await create_cleanly(lambda made: self._create(spec, made, allowlist), _finish)
        session = VercelSession(self, sandbox, spec.oneshot)
        if allowlist is not None:
            session.result_notes.append(allowlist.note("vercel"))
        return session

    def _create(self, spec: SessionSpec, made: list[Any], allowlist: Any = None) -> None:
        sync = _sync()
        policy = sync.NetworkPolicy.deny_all() if spec.network == "none" else sync.NetworkPolicy.allow_all()
        if allowlist is not None:
            subnets = sync.NetworkPolicySubnets(allow=[str(net) for net in allowlist.networks],
                                                deny=[str(net) for net in allowlist.refused_networks])
            policy = sync.NetworkPolicy.custom(allow={name: () for name in allowlist.domains}, subnets=subnets) \
                if allowlist.domains or allowlist.networks else sync.NetworkPolicy.deny_all()
        resources = sync.SandboxResources(vcpus=int(spec.limits.cpus)) if spec.limits.cpus else None
        try:
            made.append(sync.create_sandbox(
                image=self.settings.image or None, execution_time_limit=spec.lifetime_s, resources=resources,
                persistent=False, network_policy=policy, tags=REMOTE_LABELS.make(spec.lifetime_s)))
        except sync.SandboxError as exc:
            raise self.sdk_error(exc, "creating a sandbox") from exc

    async def kill(self, ref: str) -> None:
        await sdk_call(self._kill, ref)

    def _kill(self, ref: str) -> None:
        """`execbox kill`: stop and destroy the sandbox ``ref`` (its name), only one execbox made on this host."""
        sync = _sync()
        try:
            sandbox = sync.get_sandbox(name=ref)
            ours = REMOTE_LABELS.made_here(dict(sandbox.tags or {}))
        except sync.SandboxError as exc:
            if getattr(exc, "status_code", None) not in (400, 404, 410):
                raise self.sdk_error(exc, f"looking up sandbox {ref}") from exc
            ours = False
        if not ours:
            raise SandboxError(f"no vercel sandbox {ref!r} of execbox on this host", backend=self.name)
        try:
            sandbox.stop()
            sandbox.destroy()
        except sync.SandboxError as exc:
            raise self.sdk_error(exc, f"ending sandbox {ref}") from exc

    async def gc(self) -> list[str]:
        return await sdk_call(self._gc)

    def _gc(self) -> list[str]:
        sync = _sync()
        removed = []
        query = sync.SandboxQueryByCreatedAt(tag=sync.TagFilter(key=REMOTE_LABELS.mark, value="1"))
        try:
            for sandbox in sync.query_sandboxes(query=query):
                reason = REMOTE_LABELS.orphan_reason(dict(sandbox.tags or {}))
                if reason:
                    sandbox.destroy()
                    removed.append(f"vercel sandbox {sandbox.name} ({reason})")
        except sync.SandboxError as exc:
            raise self.sdk_error(exc, "listing sandboxes") from exc
        return removed
