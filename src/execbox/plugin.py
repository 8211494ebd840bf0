"""The public plugin kit: everything a backend author needs, as a versioned contract.

A backend, built-in or third-party, imports from here and from ``execbox`` only, by name: ``__all__`` is every name
a plugin may use, and none is a module. The built-in backends use exactly these pieces. ``KIT_VERSION`` changes its
major number when a name here changes meaning or goes away; a new name is a minor change. CONTRIBUTING.md documents
each piece's contract.

    the contract     ExecutionBackend[S], Session, SessionSpec, ExecSpec (what Session.exec runs), Verdict,
                     Capabilities, ExecRequest, ExecResult, Limits, hookimpl and Register (the one hook:
                     ``execbox_register_backends(register: Register)``)
    settings         BackendSettings (pydantic-settings, one variable per field), setting, comma_list, uid_gid (a
                     sandbox user's validator): a backend's own knobs, its ``self.settings`` (an instance of S);
                     SharedSettings, its ``self.shared``: what it reads of execbox's own settings (default limits,
                     probe cache age, the egress allowlist, the runner's bounds); Settings (execbox's, what the
                     constructor is given and keeps only that view of)
    sessions         HostWorkspaceSession (a local launcher in front of the command: override ``launcher``; its
                     directory names its owner: sweep_orphaned_workspaces(prefix) in gc),
                     RemoteSession (a provider's sandbox: supply its exec, small command, file calls)
    processes        run_process + reaped (output cap, deadline, whole-tree kill), ProcessOutcome, CommandEnv;
                     untrusted_binary (a launcher binary that whoever can replace it would own the sandbox by);
                     start_process / finish_process / stop_process (run_process in halves, for a process started
                     ahead); ARMED + armed_script (a process that waits for its command on stdin)
                     (the request env reaches only the final command, never a host-side launcher)
    results          build_result, failed_to_start, TIMEOUT_EXIT_CODE, BoundedCapture; CellResult, CellError,
                     DisplayData (run_cell's result and its MIME bundles)
    streaming        ExecSpec.on_output (OnOutput), fed by the captures ``ExecSpec.captures()`` builds (or by
                     ``run_process(on_output=)``); declare ``Capabilities(streaming=True)`` when it reaches the
                     caller while the command runs; OutputEvent (what a streaming caller receives)
    env policy       sandbox_env (the whole environment of a sandboxed command), filter_env, host_env (the
                     minimal environment of every host-side helper)
    workspace        normalize, safe_read, safe_write, remove_tree (never follow a link, bounded reads,
                     removal that survives any tree the code built); a size-limited workspace: mount_sized,
                     mount_sized_soon, release_sized, sized_workspace_unavailable, SIZED_IMAGE_SUFFIX; mount_tmpfs
                     (a sized tmpfs kept across a session's execs)
    files            Session.list_files / upload / download have defaults (set ``Session.host_workspace`` when the
                     workspace is a host directory, else they run find and tar through ``exec``), TransferLimits,
                     FileInfo, Transfer; Mount (a host path to bind: declare ``Capabilities(mounts=True)`` and
                     honour ``SessionSpec.mounts``)
    packages         wheels fetched on the host with its pip configuration, for images and caches: PythonTarget
                     (from what PYTHON_TARGET_PROBE prints), check_requirements, read_requirements, pip_download
    policy           the one syscall deny list, for a backend that installs a filter: DENIED_SYSCALLS,
                     DENIED_WITH_NEWUSER (with CLONE_NEWUSER), DENIED_SOCKET_FAMILIES, ENOSYS_SYSCALLS,
                     SECCOMP_DENY_ERRNO; compiled_filter (all of it as a BPF program, through libseccomp;
                     SeccompUnavailable when it cannot be built)
    egress proxy     EgressProxy (the host-side proxy of network mode proxy, one per sandbox, built from
                     ``self.shared.egress_policy()``; a Unix socket bound in at PROXY_MOUNT_POINT), ProxyRun,
                     with_egress (a result with its run's attempts), through_egress (an exec given its run's
                     socket, its attempts put on its result), sweep_orphaned_proxies (for gc); a remote provider
                     takes ``self.shared.provider_allowlist(name)`` instead
    remote helpers   sdk_call (a blocking SDK call in a thread, abandoned on cancellation), missing_credentials,
                     REMOTE_LABELS (the providers' spelling of OwnerLabels), RUN_MARKER,
                     new_run_marker, wrapped_argv, reap_argv / REAP_SCRIPT (the in-sandbox reaper),
                     SIGKILL_EXIT_CODE, TextCapture
    lifecycle        create_cleanly (create in a worker thread without leaking on cancellation)
    snapshots        Capabilities(snapshot=, memory_snapshot=); Session.snapshot(place, memory=) writes a live
                     sandbox's state into SnapshotPlace.directory and returns SnapshotParts; open_session starts from
                     SessionSpec.restore (a SnapshotRestore); ExecutionBackend.delete_snapshot removes its refs;
                     pack_sandbox_paths / restore_sandbox_paths keep sandbox paths besides the workspace (the
                     runner keeps the workspace itself)
    state            state_dir (where execbox keeps its own files: a backend's caches and run state)
    probe cache      load_probe_facts / store_probe_facts: an engine's facts (never a verdict) kept across
                     processes for ``self.shared.probe_cache_sec``, keyed by what names the engine instance
    gVisor           gvisor_record (what the set-up probed: platform, network stack, the runtime it registered),
                     GVISOR_RECORD (where it is)
    gc ownership     owner_id, owner_alive, pid_alive (host:pid:start-time; a reused pid is not the owner);
                     OWNER_FILE, orphaned (a host directory that names its owner); owner_tag, name_owner
                     (PREFIX + pid-start + random names, and reading them back), orphaned_dirs (those of dead owners);
                     OwnerLabels (the labels of a sandbox that carries them: make, orphan_reason, kept);
                     kill_session_processes (`execbox kill` of a session directory's sandbox: its processes)
                     ExecutionBackend.owned, OwnedSandbox (the sandboxes it finds by its labels or files, for
                     `execbox ps`), owned_session_dirs (those of a backend whose kill_ref is its session directory)
                     ExecutionBackend.sweeps_on_first_use (gc after the first check of each process; the scope
                     of one sweep: sweep_scope)
    errors           the error tree of ``execbox`` (BackendUnavailableError with ``fix=``, SandboxError,
                     SandboxLostError: the machine a sandbox ran on is gone, BackendTimeoutError: what a backend
                     call that never returns becomes, see contract.backend.bounded)
"""

from __future__ import annotations

from execbox.config.paths import state_dir
from execbox.config.settings import EnvSettings as BackendSettings
from execbox.config.settings import Settings, comma_list, setting, uid_gid
from execbox.contract.backend import ExecutionBackend, OwnedSandbox, Session, SessionSpec, SharedSettings, Verdict
from execbox.contract.hookspecs import PluginWarning, Register, hookimpl
from execbox.contract.models import (
    Capabilities,
    CellError,
    CellResult,
    DisplayData,
    EgressAttempt,
    ExecRequest,
    ExecResult,
    ExecSpec,
    Limits,
    Mount,
    NetworkMode,
)
from execbox.contract.output import BoundedCapture, OnOutput, OutputEvent
from execbox.contract.results import TIMEOUT_EXIT_CODE, build_result, failed_to_start
from execbox.contract.snapshots import SnapshotParts, SnapshotPlace, SnapshotRestore
from execbox.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    ExecboxError,
    FileTooLargeError,
    MissingExtraError,
    NotASandboxError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxLostError,
    SandboxPermissionError,
    SnapshotError,
    TransferTooLargeError,
    UnsupportedPolicyError,
    WorkspacePathError,
)
from execbox.files.disk import IMAGE_SUFFIX as SIZED_IMAGE_SUFFIX
from execbox.files.disk import mount_sized, mount_sized_soon, mount_tmpfs, release_sized, tmpfs_path_mb
from execbox.files.disk import unavailable_reason as sized_workspace_unavailable
from execbox.files.transfer import FileInfo, Transfer, TransferLimits
from execbox.files.workspace import is_directory_error, normalize, remove_tree, safe_read, safe_write
from execbox.kit.gvisor import GVISOR_RECORD, gvisor_record
from execbox.kit.lifecycle import create_cleanly
from execbox.kit.ownership import (
    OWNER_FILE,
    OwnerLabels,
    kill_session_processes,
    name_owner,
    orphaned,
    orphaned_dirs,
    owned_session_dirs,
    owner_alive,
    owner_id,
    owner_tag,
    pid_alive,
)
from execbox.kit.packages import PROBE as PYTHON_TARGET_PROBE
from execbox.kit.packages import PythonTarget, check_requirements, pip_download, read_requirements
from execbox.kit.probecache import load_probe_facts, store_probe_facts
from execbox.kit.processes import (
    ARMED,
    CommandEnv,
    ProcessOutcome,
    armed_script,
    finish_process,
    reaped,
    run_process,
    start_process,
    stop_process,
    untrusted_binary,
)
from execbox.kit.proxy.server import MOUNT_POINT as PROXY_MOUNT_POINT
from execbox.kit.proxy.server import EgressProxy, ProxyRun, through_egress, with_egress
from execbox.kit.proxy.server import sweep_orphans as sweep_orphaned_proxies
from execbox.kit.seccomp import SeccompUnavailable, compiled_filter
from execbox.kit.sessions.host import HostWorkspaceSession, sweep_orphaned_workspaces
from execbox.kit.sessions.remote import (
    REAP_SCRIPT,
    REMOTE_LABELS,
    RUN_MARKER,
    SIGKILL_EXIT_CODE,
    RemoteSession,
    TextCapture,
    missing_credentials,
    new_run_marker,
    reap_argv,
    sdk_call,
    wrapped_argv,
)
from execbox.kit.snapshots import pack_sandbox_paths, restore_sandbox_paths, snapshot_limits
from execbox.policy.env import filter_env, host_env, sandbox_env
from execbox.policy.seccomp import (
    CLONE_NEWUSER,
    DENIED_SOCKET_FAMILIES,
    DENIED_SYSCALLS,
    DENIED_WITH_NEWUSER,
    ENOSYS_SYSCALLS,
)
from execbox.policy.seccomp import DENY_ERRNO as SECCOMP_DENY_ERRNO

# 1.1: streaming (OnOutput, OutputEvent, Capabilities.streaming), run_cell's models. 1.2: files (Session.list_files /
# upload / download with defaults, host_workspace, transfer, TransferLimits, FileInfo, Transfer), Mount and
# Capabilities.mounts, packages. 1.3: the hook's register(ref, name=...) registers a backend by "module:Class", imported
# only when that backend is used or all are listed. 1.4: owner_tag, name_owner, orphaned_dirs (parent, owner_file).
# 1.5: probecache (an engine's facts kept across processes; Settings.probe_cache_sec); ARMED, armed_script (moved
# from the docker backend), start_process, finish_process, stop_process; Session.arm (the warm pool's call);
# ExecutionBackend.sweeps_on_first_use and sweep_scope; HostWorkspaceSession names its directory for gc, and
# sweep_orphaned_workspaces removes those of dead owners. 1.6: disk.mount_sized_soon (the sized workspace made in
# the background while the backend starts what does not need it). 1.7: BackendTimeoutError (the runner bounds every
# backend call: a call that does not return within its bound is abandoned, its sandbox closed and marked broken).
# 2.0: names, never modules (disk, egress, packages, probecache, proxy, remote, seccomp_policy and transfer are gone:
# their names are exported, some renamed to say what they are without their module); ExecutionBackend[S] with
# self.settings (the backend's own, was self.options) and self.shared (SharedSettings: what it reads of execbox's
# settings, was the whole Settings as self.settings); the hook's register typed as Register. 2.1: Capabilities.tmpfs
# and SessionSpec.tmpfs (extra tmpfs paths), mount_tmpfs; safe_read(owner=) (file calls as the sandbox user);
# Session.run_script(stdin=); the runner hands file calls on absolute paths outside the workspace to run_script;
# present_here (what a backend would use is on this machine though its SDK is not: `execbox doctor` warns).
# 2.2: SandboxLostError (the machine a sandbox ran on is gone: the ray backend's lost node); TransferTooLargeError
# (a listing or transfer over its TransferLimits, for a backend that bounds one itself); tmpfs_path_mb (a tmpfs=
# path's size: /tmp's, within the disk limit) and is_directory_error (what reading a directory as a file says).
# 2.3: gvisor_record, GVISOR_RECORD (what the set-up probed and registered of gVisor on this host);
# ExecutionBackend.unenforced(what): why a network mode or limit the class claims is not enforced as check() found
# the backend here (the guard's refusal says it);
# state_dir (execbox's own state directory: a backend's cached root filesystems and run state live under it);
# uid_gid (a sandbox-user setting's validator); through_egress (a local exec in network mode proxy); untrusted_binary
# (why a launcher binary cannot be trusted, as root); compiled_filter, SeccompUnavailable (the deny list as a BPF
# program, moved from the bubblewrap backend: gvisor's commands load it too).
# 2.4: snapshots: Capabilities.snapshot and memory_snapshot, Session.snapshot, SessionSpec.restore, SnapshotPlace,
# SnapshotParts, SnapshotRestore, ExecutionBackend.delete_snapshot, pack_sandbox_paths, restore_sandbox_paths,
# snapshot_limits, SnapshotError (a provider's part of a snapshot expired or unknown).
# 2.5: Session.kill_ref and ExecutionBackend.kill (`execbox kill`: end a sandbox held by another process),
# kill_session_processes.
# 2.6: ExecutionBackend.owned and OwnedSandbox (the sandboxes a backend finds by its ownership labels or files, for
# `execbox ps` to list orphans and leave out records whose sandbox is gone; default None: it cannot say),
# owned_session_dirs.
KIT_VERSION = "2.6"

__all__ = [
    "ARMED",
    "armed_script",
    "BackendSettings",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BoundedCapture",
    "build_result",
    "Capabilities",
    "CellError",
    "CellResult",
    "check_requirements",
    "CLONE_NEWUSER",
    "comma_list",
    "CommandEnv",
    "compiled_filter",
    "ConfigError",
    "create_cleanly",
    "DENIED_SOCKET_FAMILIES",
    "DENIED_SYSCALLS",
    "DENIED_WITH_NEWUSER",
    "DisplayData",
    "EgressAttempt",
    "EgressProxy",
    "ENOSYS_SYSCALLS",
    "ExecboxError",
    "ExecRequest",
    "ExecResult",
    "ExecSpec",
    "ExecutionBackend",
    "failed_to_start",
    "FileInfo",
    "GVISOR_RECORD",
    "gvisor_record",
    "FileTooLargeError",
    "filter_env",
    "finish_process",
    "hookimpl",
    "host_env",
    "HostWorkspaceSession",
    "is_directory_error",
    "kill_session_processes",
    "KIT_VERSION",
    "Limits",
    "load_probe_facts",
    "missing_credentials",
    "MissingExtraError",
    "Mount",
    "mount_sized",
    "mount_sized_soon",
    "mount_tmpfs",
    "name_owner",
    "NetworkMode",
    "new_run_marker",
    "normalize",
    "NotASandboxError",
    "OnOutput",
    "orphaned",
    "orphaned_dirs",
    "OutputEvent",
    "owned_session_dirs",
    "OwnedSandbox",
    "owner_alive",
    "OWNER_FILE",
    "owner_id",
    "owner_tag",
    "OwnerLabels",
    "pid_alive",
    "pip_download",
    "PluginWarning",
    "ProcessOutcome",
    "PROXY_MOUNT_POINT",
    "ProxyRun",
    "PYTHON_TARGET_PROBE",
    "PythonTarget",
    "read_requirements",
    "reap_argv",
    "REAP_SCRIPT",
    "REMOTE_LABELS",
    "reaped",
    "Register",
    "release_sized",
    "RemoteSession",
    "remove_tree",
    "RUN_MARKER",
    "run_process",
    "safe_read",
    "safe_write",
    "sandbox_env",
    "SandboxError",
    "SandboxFileNotFoundError",
    "SandboxIsADirectoryError",
    "SandboxLostError",
    "SandboxPermissionError",
    "SnapshotError",
    "sdk_call",
    "SeccompUnavailable",
    "SECCOMP_DENY_ERRNO",
    "Session",
    "SessionSpec",
    "SnapshotParts",
    "pack_sandbox_paths",
    "restore_sandbox_paths",
    "snapshot_limits",
    "SnapshotPlace",
    "SnapshotRestore",
    "setting",
    "SharedSettings",
    "Settings",
    "SIGKILL_EXIT_CODE",
    "SIZED_IMAGE_SUFFIX",
    "sized_workspace_unavailable",
    "start_process",
    "state_dir",
    "stop_process",
    "store_probe_facts",
    "sweep_orphaned_proxies",
    "sweep_orphaned_workspaces",
    "TextCapture",
    "through_egress",
    "TIMEOUT_EXIT_CODE",
    "tmpfs_path_mb",
    "Transfer",
    "TransferLimits",
    "TransferTooLargeError",
    "uid_gid",
    "UnsupportedPolicyError",
    "untrusted_binary",
    "Verdict",
    "with_egress",
    "WorkspacePathError",
    "wrapped_argv",
]
