"""Backends that claim ``sandbox=True`` and lie: the conformance kit must catch each lie, naming the claim.

``liar_host_root`` is no sandbox at all: host root behind ``unshare --net`` (host files, processes and
capabilities in plain view; the request's environment given to the host-side launcher). Every other liar
is a real sandbox with one wall taken out, so that exactly one check fails on it:

    liar_mapped_root   bubblewrap started by root: the sandbox uid maps onto host root
    liar_caps          every capability (in its own user namespace)
    liar_nnp           a docker container without no-new-privileges
    liar_userns        nested user namespaces allowed
    liar_host_files    the host's /tmp and $HOME bound in, read-only
    liar_host_procs    the host's PID namespace and /proc
    liar_env_leak      the request's environment also set on the host-side launcher (``env K=V setpriv ...``)
    liar_proxy_open    claims network mode proxy, and gives the code the host's network instead
    liar_gvisor        claims isolation gvisor (a kernel of its own), and runs the code on this host's kernel

Two more lie about what they run rather than how they isolate it: ``liar_unlimited`` claims memory, cpu,
pids and disk limits and enforces none; ``liar_broken`` claims everything and runs nothing (every command "exits
127"), so a check that passes on it passes vacuously.

Snapshot liars claim ``snapshot`` on the honest sandbox with a /tmp kept across its execs:
``liar_snapshot_keeps_nothing`` (its Session.snapshot keeps nothing of /tmp), ``liar_snapshot_drops_tmp`` (a
restore never puts /tmp back), ``liar_snapshot_shared_tmp`` (one /tmp, HOME in it, for every sandbox),
``liar_snapshot_memory`` (claims memory_snapshot, keeps files only), ``liar_snapshot_undeletable`` (its
delete_snapshot fails); ``kit_honest_snapshot`` keeps its claim, and ``kit_snapshot_no_pip`` too, with no pip.

``kit_honest`` is that sandbox with every wall in place: the whole kit passes on it. They are built from
the public plugin kit only. NEVER use them outside these tests.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import anyio

from execbox import plugin

DISTRIBUTION = "execbox-test-liars"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ROOT = os.geteuid() == 0
NOBODY = (65534, 65534)

CLAIMS = plugin.Capabilities(sandbox=True, isolation="namespace", network_modes=frozenset({"none"}),
                             persistent_sessions=True, file_transfer=True, limits=frozenset({"wall_time"}))


class Liar(plugin.ExecutionBackend):
    capabilities = CLAIMS
    session: type[plugin.HostWorkspaceSession]
    #: What this machine needs for the liar to run at all (None: it can run).
    needs: Callable[[], str | None] = staticmethod(lambda: None)

    async def check(self) -> plugin.Capabilities:
        missing = type(self).needs()
        if missing:
            raise plugin.BackendUnavailableError(missing, backend=self.name)
        return self.capabilities

    async def open_session(self, spec: plugin.SessionSpec) -> plugin.HostWorkspaceSession:
        return self.session(prefix="execbox-liar-")


# --- host root behind a network namespace -----------------------------------------------------------------


class HostRootSession(plugin.HostWorkspaceSession):
    def launcher(self, argv: list[str]) -> list[str]:
        return ["unshare", "--net", "--", *argv]


def _root() -> str | None:
    return None if ROOT else "only root can run code as host root"


class HostRoot(Liar):
    name = "liar_host_root"
    session = HostRootSession
    needs = staticmethod(_root)


# --- a bubblewrap sandbox with one wall out ---------------------------------------------------------------


def _bwrap() -> str | None:
    if shutil.which("bwrap") is None:
        return "bwrap is not installed"
    probe = subprocess.run(["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--ro-bind", "/", "/",
                            "true"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"bwrap cannot make namespaces here: {probe.stderr.strip()}"


class BwrapSession(plugin.HostWorkspaceSession):
    """As root, bwrap runs as nobody (so the sandbox uid is not host root); the code runs as uid 1000 with no
    capabilities, no new user namespaces, its own PID, network and mount namespaces (the host's /usr and /etc
    read-only, a private /tmp) and only the request's environment (set by bwrap, not inherited)."""

    drop_root = True
    namespaces = ["--unshare-all", "--unshare-user", "--disable-userns"]
    identity = ["--uid", "1000", "--gid", "1000"]
    proc = ["--proc", "/proc"]
    binds: list[str] = []
    leak_env = False

    def __init__(self, prefix: str = "execbox-liar-") -> None:
        super().__init__(prefix)
        self.owner = NOBODY if ROOT and self.drop_root else None
        if self.owner:
            os.chown(self.workspace, *self.owner)

    def command(self, request: plugin.ExecSpec) -> list[str]:
        args = ["bwrap", *self.namespaces, "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                *self.identity, "--clearenv"]
        for name, value in plugin.sandbox_env(request.env, home=self.workspace).items():
            args += ["--setenv", name, value]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        args += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", *self.proc, "--dev", "/dev",
                 "--tmpfs", "/tmp", *self.binds, "--bind", self.workspace, self.workspace,
                 "--chdir", request.workdir or self.workspace, "--", *request.argv]
        drop = ["setpriv", "--reuid", str(NOBODY[0]), "--regid", str(NOBODY[1]), "--clear-groups", "--"]
        # The leak: `env` gives the request's variables to setpriv and bwrap, host-side processes.
        leak = ["env", *(f"{k}={v}" for k, v in request.env.items())] if self.leak_env else []
        return [*leak, *(drop if self.owner else []), *args]

    async def exec(self, request: plugin.ExecSpec) -> plugin.ExecResult:
        outcome = await plugin.run_process(plugin.reaped(self.command(request)), env={"PATH": PATH},
                                           cwd=self.workspace, stdin=request.stdin, timeout=request.timeout,
                                           max_output_bytes=request.max_output_bytes)
        return outcome.to_result()

    async def write_file(self, path: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(lambda: plugin.safe_write(self.workspace, path, data, owner=self.owner))


class Honest(Liar):
    """The reference the liars depart from: it holds every claim, so the whole kit passes on it."""

    name = "kit_honest"
    session = BwrapSession
    needs = staticmethod(_bwrap)


class MappedRootSession(BwrapSession):
    drop_root = False


class CapsSession(BwrapSession):
    identity = ["--uid", "0", "--gid", "0", "--cap-add", "ALL"]


class UsernsSession(BwrapSession):
    namespaces = ["--unshare-all", "--unshare-user"]


class HostFilesSession(BwrapSession):
    binds = ["--ro-bind", "/tmp", "/tmp", "--ro-bind", str(Path.home()), str(Path.home())]


class HostProcsSession(BwrapSession):
    namespaces = ["--unshare-user", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--disable-userns"]
    proc = ["--ro-bind", "/proc", "/proc"]


class EnvLeakSession(BwrapSession):
    leak_env = True


class ProxyOpenSession(BwrapSession):
    """Network mode proxy as the host's network: no proxy, no record, every route open."""

    def command(self, request: plugin.ExecSpec) -> list[str]:
        args = super().command(request)
        if request.network == "proxy":
            args.insert(args.index("--unshare-all") + 1, "--share-net")
        return args


def _bwrap_as_root() -> str | None:
    return _root() or _bwrap()


class MappedRoot(Liar):
    name = "liar_mapped_root"
    session = MappedRootSession
    needs = staticmethod(_bwrap_as_root)


class Caps(Liar):
    name = "liar_caps"
    session = CapsSession
    needs = staticmethod(_bwrap)


class Userns(Liar):
    name = "liar_userns"
    session = UsernsSession
    needs = staticmethod(_bwrap)


class HostFiles(Liar):
    name = "liar_host_files"
    session = HostFilesSession
    needs = staticmethod(_bwrap)


class HostProcs(Liar):
    name = "liar_host_procs"
    session = HostProcsSession
    needs = staticmethod(_bwrap)


class EnvLeak(Liar):
    name = "liar_env_leak"
    session = EnvLeakSession
    needs = staticmethod(_bwrap)


class ProxyOpen(Liar):
    name = "liar_proxy_open"
    capabilities = CLAIMS.model_copy(update={"network_modes": frozenset({"none", "proxy"})})
    session = ProxyOpenSession
    needs = staticmethod(_bwrap)


class Gvisor(Liar):
    """The honest sandbox, claiming gVisor's user-space kernel: its walls hold, but the kernel is this host's."""

    name = "liar_gvisor"
    capabilities = CLAIMS.model_copy(update={"isolation": "gvisor"})
    session = BwrapSession
    needs = staticmethod(_bwrap)


# --- a docker container without no-new-privileges -----------------------------------------------------------


def _image() -> str:
    from execbox.backends.docker.image import DEFAULT_TAG

    return os.environ.get("CODE_EXEC_DOCKER_IMAGE", DEFAULT_TAG)


def _docker() -> str | None:
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    probe = subprocess.run(["docker", "image", "inspect", _image()], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"docker or the image {_image()} is missing: {probe.stderr.strip()}"


class NoNnpSession(BwrapSession):
    """Hardened like execbox's docker backend (nobody, every capability dropped, read-only, no network,
    the default seccomp profile), but without ``--security-opt no-new-privileges``."""

    def command(self, request: plugin.ExecSpec) -> list[str]:
        args = ["docker", "run", "--rm", "-i", "--init", "--network", "none", "--cap-drop", "ALL",
                "--user", "%d:%d" % NOBODY, "--read-only", "--tmpfs", "/tmp",
                "-v", f"{self.workspace}:{self.workspace}", "-w", request.workdir or self.workspace]
        for name, value in plugin.sandbox_env(request.env, home=self.workspace).items():
            args += ["-e", f"{name}={value}"]
        return [*args, _image(), *request.argv]


class NoNnp(Liar):
    name = "liar_nnp"
    session = NoNnpSession
    needs = staticmethod(_docker)


# --- limits claimed, not enforced; nothing run at all -------------------------------------------------------

EVERYTHING = CLAIMS.model_copy(update={"isolation": "gvisor",
                                      "limits": frozenset({"memory", "cpu", "pids", "disk", "wall_time"}),
                                      "network_modes": frozenset({"none", "proxy"}), "mounts": True, "streaming": True,
                                      "tmpfs": True, "snapshot": True, "memory_snapshot": True})


class UnlimitedSession(plugin.HostWorkspaceSession):
    """A plain host process: no rlimits, no cgroup."""

    async def exec(self, request: plugin.ExecSpec) -> plugin.ExecResult:
        outcome = await plugin.run_process(plugin.reaped(request.argv), env=plugin.sandbox_env(request.env,
                                           home=self.workspace), cwd=request.workdir or self.workspace,
                                           stdin=request.stdin, timeout=request.timeout,
                                           max_output_bytes=request.max_output_bytes)
        return outcome.to_result()


class Unlimited(Liar):
    name = "liar_unlimited"
    capabilities = EVERYTHING
    session = UnlimitedSession


class BrokenSession(plugin.HostWorkspaceSession):
    def launcher(self, argv: list[str]) -> list[str]:
        return ["/bin/sh", "-c", "exit 127"]


class Broken(Liar):
    name = "liar_broken"
    capabilities = EVERYTHING
    session = BrokenSession


class NoTmpfs(Liar):
    """Claims extra tmpfs paths and makes none: the sandbox of the honest one, with no /var/tmp to write."""

    name = "liar_no_tmpfs"
    capabilities = CLAIMS.model_copy(update={"tmpfs": True})
    session = BwrapSession
    needs = staticmethod(_bwrap)


# --- snapshots: claimed, and kept wrongly ----------------------------------------------------------------------


class KeptTmpSession(BwrapSession):
    """The honest sandbox with a /tmp kept across its execs (a host directory of the session's, as a container's
    tmpfs is), snapshotted and restored with the plugin kit's pack_sandbox_paths / restore_sandbox_paths."""

    home: str | None = None  # HOME inside (None: the workspace)
    keeps = True  # Session.snapshot packs /tmp (else an empty list of kept paths)

    def __init__(self, prefix: str = "execbox-liar-") -> None:
        super().__init__(prefix)
        self.host_owner = self.owner  # the file calls (a snapshot's workspace restored) as the sandbox user
        self.tmp = self.shared_tmp() or tempfile.mkdtemp(prefix="execbox-liar-tmp-")
        if self.owner:
            os.chown(self.tmp, *self.owner)
        self.binds = ["--bind", self.tmp, "/tmp"]
        self.limits = plugin.TransferLimits(64 << 20, 10_000)

    def shared_tmp(self) -> str | None:
        return None

    def command(self, request: plugin.ExecSpec) -> list[str]:
        args = super().command(request)
        if self.home is not None:
            args[args.index("HOME") + 1] = self.home
        return args

    async def snapshot(self, place: plugin.SnapshotPlace, *, memory: bool) -> plugin.SnapshotParts:
        await plugin.pack_sandbox_paths(self, place, ["/tmp"] if self.keeps else [], limits=self.limits)
        return plugin.SnapshotParts(memory=memory, source="this host's /usr (a liar)")

    async def close(self) -> None:
        await super().close()
        if self.shared_tmp() is None:
            plugin.remove_tree(self.tmp)


class SnapshotHonest(Liar):
    """Claims snapshot and keeps it: the snapshot checks pass on it."""

    name = "kit_honest_snapshot"
    capabilities = CLAIMS.model_copy(update={"snapshot": True})
    session: type[KeptTmpSession] = KeptTmpSession
    needs = staticmethod(_bwrap)
    restores = True  # open_session unpacks the snapshot's /tmp

    async def open_session(self, spec: plugin.SessionSpec) -> plugin.HostWorkspaceSession:
        session = self.session(prefix="execbox-liar-")
        if self.restores:
            await plugin.restore_sandbox_paths(session, spec, self.shared)
        return session


class KeepsNothingSession(KeptTmpSession):
    keeps = False


class SnapshotKeepsNothing(SnapshotHonest):
    """Its Session.snapshot keeps nothing of /tmp (the runner's workspace part is all there is)."""

    name = "liar_snapshot_keeps_nothing"
    session = KeepsNothingSession


class SnapshotDropsTmp(SnapshotHonest):
    """Keeps /tmp in the snapshot, and a restore never puts it back."""

    name = "liar_snapshot_drops_tmp"
    restores = False


_SHARED_TMP: list[str] = []


class SharedTmpSession(KeptTmpSession):
    """One /tmp for every sandbox of the process, HOME (so pip's --user packages) in it."""

    home = "/tmp"

    def shared_tmp(self) -> str | None:
        if not _SHARED_TMP:
            _SHARED_TMP.append(tempfile.mkdtemp(prefix="execbox-liar-shared-tmp-"))
            atexit.register(plugin.remove_tree, _SHARED_TMP[0])
        return _SHARED_TMP[0]


class SnapshotSharedTmp(SnapshotHonest):
    """Every sandbox's /tmp is the same directory: a fork's change shows in the others, a rollback undoes nothing
    there (HOME and pip's --user packages included)."""

    name = "liar_snapshot_shared_tmp"
    session = SharedTmpSession


class SnapshotMemory(SnapshotHonest):
    """Claims memory_snapshot and keeps files only: a restored interpreter starts fresh."""

    name = "liar_snapshot_memory"
    capabilities = CLAIMS.model_copy(update={"snapshot": True, "memory_snapshot": True})


class SnapshotUndeletable(SnapshotHonest):
    """Its delete_snapshot fails: what a snapshot keeps is never removed."""

    name = "liar_snapshot_undeletable"

    async def delete_snapshot(self, place: plugin.SnapshotPlace, parts: plugin.SnapshotParts) -> None:
        raise plugin.SandboxError("this backend removes no snapshot")


class NoPipSession(KeptTmpSession):
    def command(self, request: plugin.ExecSpec) -> list[str]:
        args = super().command(request)
        at = args.index("/usr") + 2  # once /usr is bound: pip's package hidden under an empty tmpfs
        return [*args[:at], "--tmpfs", "/usr/lib/python3/dist-packages/pip", *args[at:]]


class SnapshotNoPip(SnapshotHonest):
    """Keeps its claim, in a sandbox with no pip: the package check cannot run (a skip that says why)."""

    name = "kit_snapshot_no_pip"
    session = NoPipSession


LIARS: list[type[Liar]] = [Honest, HostRoot, MappedRoot, Caps, NoNnp, Userns, HostFiles, HostProcs, EnvLeak, Unlimited,
                           Broken, ProxyOpen, NoTmpfs, Gvisor, SnapshotHonest, SnapshotKeepsNothing, SnapshotDropsTmp,
                           SnapshotSharedTmp, SnapshotMemory, SnapshotUndeletable, SnapshotNoPip]


@plugin.hookimpl
def execbox_register_backends(register: Callable[[type], None]) -> None:
    for cls in LIARS:
        register(cls)
