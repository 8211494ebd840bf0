"""ssh: run the command on a remote host over SSH (paramiko). Not a sandbox unless the operator attests it.

Code runs on the remote host with the SSH user's full privileges; execbox adds no isolation there, so
``capabilities.sandbox`` is false and the guard refuses this backend outside local mode. An operator who
points it at a disposable host sets CODE_EXEC_SSH_SANDBOXED=true: an attestation, not a guarantee, and
every result, ``execbox backends`` and ``execbox doctor`` say so.

How a run works:

- one connection per session (a one-shot run is a one-exec session), host key verified against
  CODE_EXEC_SSH_KNOWN_HOSTS: unknown or changed keys are refused, unless CODE_EXEC_SSH_AUTO_ADD_HOST_KEY=true
  (trust on first use, which the results then say);
- a fresh remote workspace ``<remote tmp>/execbox-<expiry>-<token>`` (mode 0700), made over SFTP, removed
  on close (``execbox gc`` removes expired ones a crashed client left behind);
- the command runs under a remote POSIX-sh wrapper (``_WRAPPER``) that starts it with ``env -i`` plus the
  filtered request env (sent on the channel's stdin, never through AcceptEnv and never in a long-lived
  argv), rlimits, and a marker variable; the wrapper runs as a child subreaper when the host has python3;
- the channel's stdin stays open as a lifeline: a ``kill`` line (the deadline) or EOF (connection
  dropped, client gone) makes the wrapper freeze and SIGKILL the run's whole tree: its session,
  its descendants (orphans included, through the subreaper) and anything carrying the marker;
- stdout and stderr are read as they arrive into bounded head+tail captures;
- files move over SFTP; every path component is lstat'ed so nothing follows a symlink.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
import secrets
import select
import shlex
import socket
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from execbox.plugin import (
    BackendSettings,
    BackendUnavailableError,
    BoundedCapture,
    Capabilities,
    ExecRequest,
    ExecResult,
    ExecSpec,
    ExecutionBackend,
    FileTooLargeError,
    SandboxError,
    SandboxFileNotFoundError,
    Session,
    SessionSpec,
    Settings,
    Verdict,
    WorkspacePathError,
    build_result,
    create_cleanly,
    is_directory_error,
    sandbox_env,
    setting,
)

NAME = "ssh"
_CHUNK = 65536
# After the deadline: how long the remote wrapper gets to kill the tree and report before the channel is
# closed; after the exit status: how long a pipe may stay open (held by a process that escaped the kill).
_KILL_GRACE_S = 10.0
_DRAIN_GRACE_S = 2.0
FILE_SIZE_BLOCKS = 2 * 1024 * 1024  # ulimit -f: 1 GiB in 512-byte blocks (2 GiB where the shell counts KiB)

# The remote wrapper (POSIX sh; needs awk, grep, cut, sort and /proc). Arguments: run token, workspace,
# working dir, stdin file or "", memory limit KiB or "", CPU seconds, file size blocks, the end line of the
# env block, then the argv to run. The env block comes first
# on stdin (shell-quoted words, then an end line); after it stdin is the lifeline read by the watcher.
_WRAPPER = r"""
tok=$1 ws=$2 wd=$3 inp=$4 mem=$5 cpu=$6 fsize=$7 endmark=$8
shift 8
exec 3<&0 </dev/null
envwords= ended=
while IFS= read -r line <&3; do
  if [ "$line" = "$endmark" ]; then ended=1; break; fi
  envwords=${envwords:+$envwords
}$line
done
[ -n "$ended" ] || exit 125
cd "$wd" || { echo "execbox: cannot enter $wd (is the remote workspace gone?)" >&2; exit 125; }
child= watcher=
collect() {
  read -r me _ </proc/self/stat
  { grep -l -a -F -e "EXECBOX_RUN_ID=$tok" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
    cat /proc/[0-9]*/stat 2>/dev/null | awk -v root="${child:-x}" -v top="$$" -v skip="$me ${watcher:-x}" '
      BEGIN { n = split(skip, s, " "); for (i = 1; i <= n; i++) skipped[s[i]] = 1 }
      { pid = $1; rest = $0; sub(/^.*\) /, "", rest); split(rest, f, " ")
        if (f[1] != "Z") { parent[pid] = f[2]; sess[pid] = f[4] } }
      END { for (p in parent)
              if (p == root || sess[p] == root || (parent[p] == top && !(p in skipped))) keep[p] = 1
            grown = 1
            while (grown) { grown = 0
              for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; grown = 1 } }
            for (p in keep) print p }'
  } | sort -u | grep -v -x -e "$$" -e "$me" -e "${watcher:-x}"
}
killtree() {
  frozen= n=0
  while [ $n -lt 100 ]; do
    new=
    for p in $(collect); do
      case " $frozen " in *" $p "*) ;; *) new="$new $p" ;; esac
    done
    [ -n "$new" ] || break
    kill -STOP $new 2>/dev/null
    frozen="$frozen$new"
    n=$((n + 1))
  done
  [ -z "$frozen" ] || kill -KILL $frozen 2>/dev/null
  return 0
}
finish() {
  trap '' TERM HUP INT PIPE USR1
  [ -z "$watcher" ] || kill "$watcher" 2>/dev/null
  killtree
  if [ "$2" = drop ]; then cd /; rm -rf -- "$ws"; fi
  exit "$1"
}
trap 'finish 137 drop' TERM HUP INT PIPE
trap 'finish 137 keep' USR1
( while IFS= read -r cmd <&3; do [ "$cmd" != kill ] || kill -USR1 $$; done; kill -TERM $$ ) >/dev/null 2>&1 &
watcher=$!
run() {
  exec 3<&-
  if [ -n "$inp" ]; then exec <"$inp"; rm -f -- "$inp"; fi
  ulimit -c 0 2>/dev/null
  ulimit -f "$fsize" 2>/dev/null
  ulimit -t "$cpu" 2>/dev/null
  if [ -n "$mem" ]; then
    ulimit -v "$mem" || { echo "execbox: cannot set the memory limit (ulimit -v $mem)" >&2; exit 125; }
  fi
  eval "exec $sid env -i $envwords \"\$@\""
}
sid=
if command -v setsid >/dev/null 2>&1; then sid=setsid; fi
run "$@" &
child=$!
wait "$child"
finish $? keep
"""

# The remote interpreter for the subreaper launcher (a test swaps it to exercise the fallback without it).
_REMOTE_PYTHON = "python3"
# Makes the wrapper a child subreaper (orphans of the run are re-parented to it, not to init) when the
# remote host has python3; the attribute survives the exec into sh.
_SUBREAPER = (
    "import ctypes, os, sys\n"
    "try:\n    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\nexcept Exception:\n    pass\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)

# Run on close and by gc. Arguments: the remote tmp dir, then session tokens. Kills whatever still carries
# a session's marker, then removes its workspace and stray stdin files. (Not the kit's REAP_SCRIPT: that one forks
# two processes per /proc entry and pass, cheap in a remote sandbox with a handful of processes, but on an
# ordinary host it would add most of a second to every close, that is to every one-shot run; one grep over
# all the environ files does the same here in milliseconds.)
_CLEANUP = r"""
dir=$1
shift
for tok in "$@"; do
  case $tok in *[!0-9a-z-]*|'') continue ;; esac
  pids=$(grep -l -a -F -e "EXECBOX_SESSION_ID=$tok" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
  if [ -n "$pids" ]; then kill -STOP $pids 2>/dev/null; kill -KILL $pids 2>/dev/null; fi
  rm -rf -- "$dir/execbox-$tok" "$dir/execbox-$tok".stdin-*
done
"""


#: A session's token (and ``kill_ref``): its expiry (Unix seconds), then 16 random hex digits.
_TOKEN = re.compile(r"[0-9]{1,12}-[0-9a-f]{16}")


class SshSettings(BackendSettings):
    host: str | None = setting("CODE_EXEC_SSH_HOST", None, "Remote host to run code on (required)")
    port: int = setting("CODE_EXEC_SSH_PORT", 22, "SSH port", gt=0, le=65535)
    user: str | None = setting("CODE_EXEC_SSH_USER", None, "Remote user; default: the local user name")
    key_file: Path | None = setting(
        "CODE_EXEC_SSH_KEY_FILE", None, "Private key for key authentication; default: ssh-agent and ~/.ssh/id_*")
    known_hosts: Path | None = setting(
        "CODE_EXEC_SSH_KNOWN_HOSTS", None,
        "known_hosts file the host key is checked against; default ~/.ssh/known_hosts")
    sandboxed: bool = setting(
        "CODE_EXEC_SSH_SANDBOXED", False,
        "Operator's attestation that the remote host is disposable, so the guard treats it as a sandbox")
    auto_add_host_key: bool = setting(
        "CODE_EXEC_SSH_AUTO_ADD_HOST_KEY", False,
        "Trust an unknown host key on first use and save it to the known_hosts file (a changed key is still refused)")
    connect_timeout: float = setting(
        "CODE_EXEC_SSH_CONNECT_TIMEOUT", 10.0, "TCP connect and handshake timeout, seconds", gt=0)
    remote_tmp: str = setting("CODE_EXEC_SSH_REMOTE_TMP", "/tmp", "Remote directory the per-run workspaces are made in")

    @property
    def target(self) -> str:
        return f"{self.user or _local_user()}@{self.host}:{self.port}"

    @property
    def known_hosts_path(self) -> Path:
        return self.known_hosts or Path.home() / ".ssh" / "known_hosts"


def _local_user() -> str:
    import getpass

    return getpass.getuser()


def _paramiko() -> Any:
    try:
        import paramiko
    except ImportError:
        raise BackendUnavailableError(
            "the ssh backend needs paramiko", backend=NAME, fix="pip install 'execbox[ssh]'") from None
    return paramiko


def _fingerprint(key: Any) -> str:
    import base64
    import hashlib

    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class _UnknownHostKey(Exception):
    def __init__(self, hostname: str, key: Any) -> None:
        super().__init__(hostname)
        self.hostname, self.key = hostname, key


class _Connection:
    """One authenticated SSH connection and its SFTP channel. Blocking; used from worker threads."""

    def __init__(self, settings: SshSettings) -> None:
        self.settings = settings
        self.client: Any = None
        self.sftp: Any = None
        self.sftp_lock = threading.Lock()
        self.accepted_new_key: str | None = None

    def open(self) -> _Connection:
        paramiko = _paramiko()
        s = self.settings
        if not s.host:
            raise BackendUnavailableError("no remote host is configured", backend=NAME,
                                          fix="set CODE_EXEC_SSH_HOST (and CODE_EXEC_SSH_USER, CODE_EXEC_SSH_KEY_FILE)",
                                          env_var="CODE_EXEC_SSH_HOST")
        known = s.known_hosts_path
        client = paramiko.SSHClient()
        if known.exists():
            client.load_host_keys(str(known))
        elif not s.auto_add_host_key:
            raise BackendUnavailableError(
                f"the known_hosts file {known} does not exist, so the host key of {s.host} cannot be verified",
                backend=NAME, env_var="CODE_EXEC_SSH_KNOWN_HOSTS",
                fix=f"check the host's key fingerprint out of band, then "
                    f"`ssh-keyscan -p {s.port} {s.host} >> {known}`; "
                    "or point CODE_EXEC_SSH_KNOWN_HOSTS at the right file")
        client.set_missing_host_key_policy(self._policy(paramiko, known))
        key_kw: dict[str, Any] = {"allow_agent": True, "look_for_keys": True}
        if s.key_file is not None:
            key_kw = {"key_filename": str(s.key_file), "allow_agent": False, "look_for_keys": False}
        try:
            client.connect(s.host, s.port, username=s.user or _local_user(), timeout=s.connect_timeout,
                           banner_timeout=s.connect_timeout, auth_timeout=s.connect_timeout, **key_kw)
            self.client = client
            self.sftp = client.open_sftp()
        except BaseException as exc:
            client.close()
            raise self._explain(paramiko, exc) from None
        return self

    def _policy(self, paramiko: Any, known: Path) -> Any:
        conn = self

        class Policy(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]  # paramiko has no types: an Any base
            def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
                if not conn.settings.auto_add_host_key:
                    raise _UnknownHostKey(hostname, key)
                # Trust on first use, as the operator asked; said in every result of this backend.
                client.get_host_keys().add(hostname, key.get_name(), key)
                known.parent.mkdir(parents=True, exist_ok=True)
                with open(known, "a") as fh:
                    fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
                conn.accepted_new_key = f"{hostname} {_fingerprint(key)}"

        return Policy()

    def _explain(self, paramiko: Any, exc: BaseException) -> BaseException:
        s = self.settings
        known = s.known_hosts_path
        if isinstance(exc, _UnknownHostKey):
            return BackendUnavailableError(
                f"the host key of {exc.hostname} ({_fingerprint(exc.key)}) is not in {known}; refusing an unknown host",
                backend=NAME, env_var="CODE_EXEC_SSH_KNOWN_HOSTS",
                fix=f"check that fingerprint out of band, then `ssh-keyscan -p {s.port} {s.host} >> {known}`; or set "
                    "CODE_EXEC_SSH_AUTO_ADD_HOST_KEY=true to trust it on first use")
        if isinstance(exc, paramiko.BadHostKeyException):
            return BackendUnavailableError(
                f"HOST KEY MISMATCH for {exc.hostname}: it offered {_fingerprint(exc.key)} but {known} expects "
                f"{_fingerprint(exc.expected_key)}; someone may be intercepting the connection",
                backend=NAME, env_var="CODE_EXEC_SSH_KNOWN_HOSTS",
                fix=f"if the host was really reinstalled, verify its new key out of band, remove the old one with "
                    f"`ssh-keygen -R '[{s.host}]:{s.port}' -f {known}` and add the new one")
        if isinstance(exc, paramiko.PasswordRequiredException):
            return BackendUnavailableError(
                f"the key {s.key_file} is encrypted and execbox does not ask for passphrases", backend=NAME,
                env_var="CODE_EXEC_SSH_KEY_FILE",
                fix="load it into ssh-agent and unset CODE_EXEC_SSH_KEY_FILE, or use a key without a passphrase")
        if isinstance(exc, paramiko.AuthenticationException):
            key = f"the key {s.key_file}" if s.key_file else "the agent's and ~/.ssh's keys"
            return BackendUnavailableError(
                f"authentication failed for {s.target} with {key}", backend=NAME, env_var="CODE_EXEC_SSH_KEY_FILE",
                fix="check CODE_EXEC_SSH_USER and CODE_EXEC_SSH_KEY_FILE, and that the public key is in the remote "
                    "user's authorized_keys")
        if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
            return BackendUnavailableError(
                f"connection refused by {s.host}:{s.port}", backend=NAME, env_var="CODE_EXEC_SSH_HOST",
                fix="start sshd on that host, or correct CODE_EXEC_SSH_HOST / CODE_EXEC_SSH_PORT")
        if isinstance(exc, (TimeoutError, socket.timeout)):
            return BackendUnavailableError(
                f"no answer from {s.host}:{s.port} within {s.connect_timeout:g}s", backend=NAME,
                env_var="CODE_EXEC_SSH_CONNECT_TIMEOUT",
                fix="check the host and port, a firewall in between, or raise CODE_EXEC_SSH_CONNECT_TIMEOUT")
        if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
            return BackendUnavailableError(
                f"cannot read the key file {s.key_file}: {exc.strerror}", backend=NAME,
                env_var="CODE_EXEC_SSH_KEY_FILE",
                fix="point CODE_EXEC_SSH_KEY_FILE at a readable private key")
        if isinstance(exc, (paramiko.SSHException, OSError, EOFError)):
            return BackendUnavailableError(
                f"cannot connect to {s.target}: {exc}", backend=NAME,
                fix="check that sshd runs there with its sftp subsystem enabled and that the settings are right")
        return exc

    @property
    def transport(self) -> Any:
        return self.client.get_transport() if self.client else None

    def alive(self) -> bool:
        t = self.transport
        return bool(t and t.is_active())

    def dropped(self, during: str) -> SandboxError:
        return SandboxError(
            f"the SSH connection to {self.settings.target} dropped {during}; the remote wrapper kills the run's "
            "processes and its workspace when its channel closes", backend=NAME, retryable=True)

    def run_small(self, script: str, args: list[str], timeout: float = 30.0) -> tuple[int, str]:
        """Run a short sh script to completion; its output is expected to be small."""
        command = " ".join(shlex.quote(a) for a in ["/bin/sh", "-c", script, "execbox", *args])
        try:
            chan = self.transport.open_session(timeout=timeout)
            chan.settimeout(timeout)
            chan.exec_command(command)
            chan.shutdown_write()
            out = bytearray()
            while data := chan.recv(_CHUNK):
                if len(out) < 1 << 20:
                    out += data
            while chan.recv_stderr_ready():
                chan.recv_stderr(_CHUNK)
            code = chan.recv_exit_status()
            chan.close()
        except Exception as exc:
            if not self.alive():
                raise self.dropped("during a maintenance command") from None
            raise SandboxError(f"remote command on {self.settings.target} failed: {exc}", backend=NAME) from None
        return code, out.decode(errors="replace")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.sftp is not None:
                self.sftp.close()
        with contextlib.suppress(Exception):
            if self.client is not None:
                self.client.close()
        self.sftp = self.client = None


def _lstat(sftp: Any, path: str) -> Any | None:
    try:
        return sftp.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if getattr(exc, "errno", None) == 2:
            return None
        raise


@dataclass
class _Run:
    """The state of one exec's channel while it is read."""

    out: BoundedCapture
    err: BoundedCapture
    started: float = field(default_factory=time.monotonic)
    timed_out: bool = False


class SshSession(Session):
    def __init__(self, backend: SshBackend, conn: _Connection, workspace: str, token: str) -> None:
        self.backend = backend
        self.conn = conn
        self.workspace = workspace
        self.token = token
        self.kill_ref = token  # its remote workspace's name, and the marker its processes carry
        self._closed = False
        self._has_python: bool | None = None

    # --- exec ---------------------------------------------------------------------------------------

    async def exec(self, request: ExecSpec) -> ExecResult:
        cancelled = threading.Event()
        try:
            return await anyio.to_thread.run_sync(self._exec, request, cancelled, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            cancelled.set()  # the worker sends the kill line and returns on its own
            raise

    def _command(self, request: ExecSpec, run_id: str, stdin_path: str) -> tuple[str, bytes]:
        limits = request.limits
        mem_kb = str(limits.memory_mb * 1024) if limits and limits.memory_mb else ""
        cpu = str(int(request.timeout) + 2)
        endmark = f"EXECBOX-ENV-END-{run_id}"
        args = [run_id, self.workspace, request.workdir, stdin_path, mem_kb, cpu,
                str(FILE_SIZE_BLOCKS), endmark]
        wrapper = " ".join(shlex.quote(a) for a in ["/bin/sh", "-c", _WRAPPER, "execbox-run", *args, *request.argv])
        py = shlex.quote(_REMOTE_PYTHON)
        subreaper = f"exec {py} -I -c " + shlex.quote(_SUBREAPER) + " " + wrapper
        command = f"if command -v {py} >/dev/null 2>&1; then {subreaper}; else exec {wrapper}; fi"
        env = sandbox_env(request.env, home=self.workspace)
        env["EXECBOX_RUN_ID"] = run_id
        env["EXECBOX_SESSION_ID"] = self.token
        words = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        return command, f"{words}\n{endmark}\n".encode()

    def _exec(self, request: ExecSpec, cancelled: threading.Event) -> ExecResult:
        conn = self.conn
        if not conn.alive():
            raise conn.dropped("before the run started")
        run_id = secrets.token_hex(8)
        stdin_path = ""
        if request.stdin:
            stdin_path = f"{self.workspace}.stdin-{run_id}"
            self._sftp_call(lambda sftp: self._put(sftp, stdin_path, request.stdin or b"", 0o600))
        command, env_block = self._command(request, run_id, stdin_path)
        run = _Run(*request.captures())
        try:
            chan = conn.transport.open_session(timeout=30)
            chan.exec_command(command)
            chan.sendall(env_block)
            code = self._pump(chan, run, request.timeout, cancelled)
        except SandboxError:
            raise
        except Exception as exc:
            if not conn.alive():
                raise conn.dropped("mid-run") from None
            raise SandboxError(f"the run on {conn.settings.target} failed: {exc}", backend=NAME) from None
        return build_result(exit_code=code, stdout=run.out, stderr=run.err, timed_out=run.timed_out,
                            duration_s=time.monotonic() - run.started)

    def _pump(self, chan: Any, run: _Run, timeout: float, cancelled: threading.Event) -> int:
        """Read both streams into the captures until the run ends; at the deadline ask the wrapper to kill."""
        deadline = run.started + timeout
        kill_sent_at: float | None = None
        exit_seen_at: float | None = None
        while True:
            while chan.recv_ready():
                run.out.write(chan.recv(_CHUNK))
            while chan.recv_stderr_ready():
                run.err.write(chan.recv_stderr(_CHUNK))
            now = time.monotonic()
            if chan.exit_status_ready():
                if chan.eof_received or chan.closed:
                    break
                exit_seen_at = exit_seen_at or now
                if now - exit_seen_at > _DRAIN_GRACE_S:
                    break  # a process that escaped the kill still holds the pipes
            elif chan.closed or not self.conn.alive():
                raise self.conn.dropped("mid-run")
            if kill_sent_at is None and (now >= deadline or cancelled.is_set()):
                run.timed_out = not cancelled.is_set()
                kill_sent_at = now
                chan.sendall(b"kill\n")
            elif kill_sent_at is not None and now - kill_sent_at > _KILL_GRACE_S:
                chan.close()
                return 137
            select.select([chan], [], [], 0.1)
        # the last bytes may arrive together with the exit status
        while chan.recv_ready():
            run.out.write(chan.recv(_CHUNK))
        while chan.recv_stderr_ready():
            run.err.write(chan.recv_stderr(_CHUNK))
        code: int = chan.recv_exit_status()
        chan.close()
        if code < 0:  # paramiko's value when the channel closed without an exit status
            if not self.conn.alive():
                raise self.conn.dropped("mid-run")
            raise SandboxError(f"{self.conn.settings.target} closed the run's channel without an exit status "
                               "(was sshd or the remote wrapper killed?)", backend=NAME, retryable=True)
        return code

    # --- files --------------------------------------------------------------------------------------

    def _sftp_call(self, fn: Any) -> Any:
        conn = self.conn
        if not conn.alive() or conn.sftp is None:
            raise conn.dropped("before a file transfer")
        try:
            with conn.sftp_lock:
                return fn(conn.sftp)
        except (WorkspacePathError, SandboxError):
            raise
        except Exception as exc:
            if not conn.alive():
                raise conn.dropped("during a file transfer") from None
            raise SandboxError(f"SFTP on {conn.settings.target} failed: {exc}", backend=NAME) from None

    @staticmethod
    def _put(sftp: Any, path: str, data: bytes, mode: int) -> None:
        with sftp.open(path, "wb") as fh:
            fh.set_pipelined(True)
            fh.chmod(mode)
            fh.write(data)

    def _walk(self, sftp: Any, rel: str, *, create: bool) -> tuple[str, Any | None]:
        """The remote path of ``rel`` and its lstat; refuses any symlink on the way (no component is followed)."""
        parts = rel.split("/")
        current = self.workspace
        for i, part in enumerate(parts):
            current = posixpath.join(current, part)
            st = _lstat(sftp, current)
            last = i == len(parts) - 1
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise WorkspacePathError(f"refused {rel!r}: {'it is' if last else 'it passes through'} a symlink")
            if last:
                return current, st
            if st is None:
                if not create:
                    raise SandboxFileNotFoundError(f"no such file in the workspace: {rel!r}")
                sftp.mkdir(current, 0o755)
            elif not stat.S_ISDIR(st.st_mode):
                raise WorkspacePathError(f"refused {rel!r}: {'/'.join(parts[:i + 1])!r} is not a directory")
        raise AssertionError("unreachable")

    def _read(self, sftp: Any, rel: str, max_bytes: int) -> bytes:
        path, st = self._walk(sftp, rel, create=False)
        if st is None:
            raise SandboxFileNotFoundError(f"no such file in the workspace: {rel!r}")
        if stat.S_ISDIR(st.st_mode):
            raise is_directory_error(rel)
        if not stat.S_ISREG(st.st_mode):
            raise WorkspacePathError(f"refused {rel!r}: not a regular file")
        if (st.st_size or 0) > max_bytes:
            raise FileTooLargeError(rel, st.st_size, max_bytes, backend=NAME)
        with sftp.open(path, "rb") as fh:
            opened = fh.stat()
            # the file we opened must be the one we checked (a swap to a symlink would show another file)
            if (opened.st_size, opened.st_mtime, opened.st_mode) != (st.st_size, st.st_mtime, st.st_mode):
                raise WorkspacePathError(f"refused {rel!r}: it changed while it was being opened")
            fh.prefetch(opened.st_size)
            data: bytes = fh.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise FileTooLargeError(rel, None, max_bytes, backend=NAME)
        return data

    def _write(self, sftp: Any, rel: str, data: bytes) -> None:
        path, st = self._walk(sftp, rel, create=True)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise WorkspacePathError(f"refused {rel!r}: it exists and is not a regular file")
        self._put(sftp, path, data, 0o644)

    async def write_file(self, path: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(self._sftp_call, lambda sftp: self._write(sftp, path, data))

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        return await anyio.to_thread.run_sync(self._sftp_call, lambda sftp: self._read(sftp, path, max_bytes))

    # --- close --------------------------------------------------------------------------------------

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.close_blocking)

    def close_blocking(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.conn.alive():
                with contextlib.suppress(SandboxError):
                    self.conn.run_small(_CLEANUP, [self.backend.settings.remote_tmp, self.token])
        finally:
            self.conn.close()


class SshBackend(ExecutionBackend[SshSettings]):
    name = NAME
    extra = "ssh"
    summary = ("runs code on a remote host over SSH (paramiko); "
               "not a sandbox unless CODE_EXEC_SSH_SANDBOXED=true attests it")
    capabilities = Capabilities(
        sandbox=False,
        isolation="process",
        # the remote host's own network, whatever it is: execbox cannot restrict it
        network_modes=frozenset({"host"}),
        persistent_sessions=True,
        file_transfer=True,
        limits=frozenset({"memory", "wall_time"}),
        remote=True,
        streaming=True,  # the channel is read as data arrives
    )

    settings_model = SshSettings
    sdk = "paramiko"

    def __init__(self, execbox_settings: Settings, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(execbox_settings, options)
        self._remote_notes: list[str] = []
        self._accepted_keys: list[str] = []

    def _connect(self) -> _Connection:
        conn = _Connection(self.settings).open()
        if conn.accepted_new_key:
            self._accepted_keys.append(conn.accepted_new_key)
        return conn

    async def probe(self) -> Capabilities:
        return await anyio.to_thread.run_sync(self._check)

    def _check(self) -> Capabilities:
        conn = self._connect()
        try:
            code, out = conn.run_small(
                "for c in awk grep cut sort rm env; do command -v $c >/dev/null 2>&1 || echo missing:$c; done; "
                "[ -r /proc/self/stat ] || echo missing:/proc; command -v python3 >/dev/null 2>&1 || echo no-python3; "
                "[ -d \"$1\" ] && [ -w \"$1\" ] || echo missing:tmp", [self.settings.remote_tmp])
        finally:
            conn.close()
        missing = [w.split(":", 1)[1] for w in out.split() if w.startswith("missing:")]
        if code != 0 or missing:
            raise BackendUnavailableError(
                f"{self.settings.target} lacks what the remote wrapper needs: {', '.join(missing) or f'exit {code}'}",
                backend=NAME, fix="install coreutils, grep and awk there (a POSIX login shell and /proc are needed), "
                f"and make CODE_EXEC_SSH_REMOTE_TMP={self.settings.remote_tmp} a writable directory")
        if "no-python3" in out.split():
            self._remote_notes = [
                f"{self.settings.host} has no python3, so the remote wrapper is not a subreaper: a grandchild that "
                "called setsid, cleared its environment and lost its parent can outlive a timeout"]
        return self.capabilities.model_copy(update={"sandbox": self.settings.sandboxed})

    def verdict(self, request: ExecRequest) -> Verdict:
        if self.settings.sandboxed:
            return Verdict(True, f"the operator attests that {self.settings.host} is a disposable host "
                                 "(CODE_EXEC_SSH_SANDBOXED=true); execbox does not isolate code there", attested=True)
        return Verdict(False, f"code runs on {self.settings.host or '(no host set)'} with the full privileges of the "
                              "SSH user; set CODE_EXEC_SSH_SANDBOXED=true only if that host is disposable")

    def notes(self) -> list[str]:
        notes = []
        if self.settings.sandboxed:
            notes.append(f"ssh: sandbox status is attested by the operator (CODE_EXEC_SSH_SANDBOXED=true), "
                         f"not enforced: code runs on {self.settings.host or '(no host set)'} "
                         "with the SSH user's full privileges")
        else:
            notes.append(f"ssh: not a sandbox: code runs on {self.settings.host or '(no host set)'} "
                         "with the SSH user's full privileges")
        if self.settings.auto_add_host_key:
            accepted = f" (accepted: {'; '.join(self._accepted_keys)})" if self._accepted_keys else ""
            notes.append("ssh: unknown host keys are trusted on first use (CODE_EXEC_SSH_AUTO_ADD_HOST_KEY=true)"
                         + accepted)
        return notes + self._remote_notes

    async def open_session(self, spec: SessionSpec) -> SshSession:
        # Connecting and making the workspace run to their end even if the caller is cancelled meanwhile; a
        # session the caller never got is then closed (remote clean-up, connection closed).
        return await create_cleanly(lambda made: self._open(spec, made), SshSession.close_blocking)

    def _open(self, spec: SessionSpec, made: list[SshSession]) -> None:
        conn = self._connect()
        token = f"{int(time.time() + spec.lifetime_s)}-{secrets.token_hex(8)}"  # _TOKEN
        workspace = posixpath.join(self.settings.remote_tmp, f"execbox-{token}")
        try:
            with conn.sftp_lock:
                conn.sftp.mkdir(workspace, 0o700)  # fails if it exists: never reuse a path someone planted
        except Exception as exc:
            conn.close()
            raise SandboxError(f"cannot create the remote workspace {workspace} on {self.settings.target}: {exc}",
                               backend=NAME) from None
        made.append(SshSession(self, conn, workspace, token))

    async def kill(self, ref: str) -> None:
        await anyio.to_thread.run_sync(self._kill, ref)

    def _kill(self, ref: str) -> None:
        """`execbox kill`: what the session ``ref`` runs on the remote host killed and its workspace removed (its
        close's clean-up); its owner's connection stays, for its owner's close. Only a workspace execbox names."""
        workspace = posixpath.join(self.settings.remote_tmp, f"execbox-{ref}")
        if _TOKEN.fullmatch(ref) is None:
            raise SandboxError(f"no ssh sandbox {ref!r} of execbox", backend=NAME)
        conn = self._connect()
        try:
            try:
                with conn.sftp_lock:
                    found = stat.S_ISDIR(conn.sftp.lstat(workspace).st_mode or 0)
            except OSError:
                found = False
            if not found:
                raise SandboxError(f"no ssh sandbox {ref!r} of execbox on {self.settings.target}", backend=NAME)
            conn.run_small(_CLEANUP, [self.settings.remote_tmp, ref], timeout=60)
        finally:
            conn.close()

    async def gc(self) -> list[str]:
        return await anyio.to_thread.run_sync(self._gc)

    def _gc(self) -> list[str]:
        """Remove expired remote workspaces (and kill their processes) that crashed clients left behind."""
        conn = self._connect()
        try:
            with conn.sftp_lock:
                names = conn.sftp.listdir(self.settings.remote_tmp)
            now = time.time()
            expired = []
            for entry in names:
                parts = entry.split("-")
                if (len(parts) == 3 and parts[0] == "execbox" and parts[1].isdigit() and int(parts[1]) < now
                        and len(parts[2]) == 16):
                    expired.append(entry.removeprefix("execbox-"))
            if not expired:
                return []
            conn.run_small(_CLEANUP, [self.settings.remote_tmp, *expired], timeout=120)
            where = self.settings
            return [f"{where.host}:{posixpath.join(where.remote_tmp, 'execbox-' + tok)}" for tok in expired]
        finally:
            conn.close()
