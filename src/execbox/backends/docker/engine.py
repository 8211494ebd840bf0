"""Which Docker engine, and errors that say which: DOCKER_HOST, then the docker context, then the default
socket, like the docker CLI; one BackendUnavailableError naming the endpoint when it does not answer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import re
import socket
import stat
import struct
from typing import Any

from execbox.plugin import BackendUnavailableError

DEFAULT_SOCKET = "unix:///var/run/docker.sock"


def resolve_endpoint(environ: dict[str, str] | None = None) -> tuple[str, dict[str, Any], str]:
    """(endpoint URL, DockerClient kwargs, where it came from), following DOCKER_HOST, then the docker
    context (DOCKER_CONTEXT or ~/.docker/config.json), then the default socket; like the docker CLI."""
    import docker
    from docker.context import ContextAPI

    env = dict(os.environ if environ is None else environ)
    params = docker.utils.kwargs_from_env(environment=env)
    if "base_url" in params:
        return params["base_url"], params, "DOCKER_HOST"
    name = env.get("DOCKER_CONTEXT")
    try:
        ctx = ContextAPI.get_context(name)
    except docker.errors.DockerException as exc:
        raise BackendUnavailableError(f"docker context {name!r} cannot be loaded: {exc}", backend="docker",
                                      fix="docker context ls; set DOCKER_CONTEXT to one of them or unset it") from None
    if ctx is None and name:
        raise BackendUnavailableError(f"docker context {name!r} does not exist", backend="docker",
                                      fix="docker context ls; set DOCKER_CONTEXT to one of them or unset it")
    if ctx is not None and ctx.Host and ctx.name != "default":
        # docker-py stores hosts it wrote itself as http+unix://; the CLI writes unix://
        host = re.sub(r"^http\+(unix|npipe)://", r"\1://", ctx.Host)
        params = {"base_url": host}
        if ctx.TLSConfig is not None:
            params["tls"] = ctx.TLSConfig
        return host, params, f"docker context {ctx.name!r}"
    return DEFAULT_SOCKET, {"base_url": DEFAULT_SOCKET}, "the default socket"


def engine_here(environ: dict[str, str] | None = None) -> str | None:
    """A Docker engine this machine has, found without docker-py: DOCKER_HOST as set, or a local socket that
    accepts a connection (the default one, the rootless one). None when there is none."""
    env = os.environ if environ is None else environ
    host = env.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return f"a Docker engine (DOCKER_HOST={host})"
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    candidates = [host.removeprefix("unix://")] if host else [
        DEFAULT_SOCKET.removeprefix("unix://"), *([f"{runtime_dir}/docker.sock"] if runtime_dir else [])]
    for path in candidates:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(0.5)
            probe.connect(path)
            return f"a Docker engine (unix://{path})"
    return None


def is_local(endpoint: str) -> bool:
    if endpoint.startswith(("unix://", "npipe://", "/")):
        return True
    host = re.sub(r"^[a-z+]+://", "", endpoint).split("/")[0].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "127.0.0.1", "::1")


def unreachable(endpoint: str, origin: str, exc: BaseException) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"cannot reach the Docker engine at {endpoint} (from {origin}): {exc}", backend="docker",
        fix="start the engine (as root: scripts/bootstrap.sh starts dockerd) or point DOCKER_HOST / "
            "DOCKER_CONTEXT at a running one; retrying will not help until then", env_var="DOCKER_HOST")


def connect(environ: dict[str, str] | None = None) -> tuple[Any, str, str]:
    """(docker.DockerClient, endpoint, origin) for the engine the environment selects; raises one
    BackendUnavailableError naming the endpoint when docker-py is missing or the engine does not answer."""
    endpoint, params, origin = locate(environ)
    return open_client(endpoint, params, origin), endpoint, origin


def locate(environ: dict[str, str] | None = None) -> tuple[str, dict[str, Any], str]:
    """resolve_endpoint, with docker-py missing or a malformed DOCKER_HOST as one BackendUnavailableError."""
    try:
        import docker
    except ImportError:
        raise BackendUnavailableError("docker-py is not installed", backend="docker",
                                      fix="pip install 'execbox[docker]'") from None
    try:
        return resolve_endpoint(environ)
    except (docker.errors.DockerException, ValueError) as exc:  # e.g. DOCKER_HOST=tcp://[::1
        raise BackendUnavailableError(
            f"DOCKER_HOST (or the docker context) is malformed: {exc}", backend="docker", env_var="DOCKER_HOST",
            fix="give DOCKER_HOST as unix:///path/docker.sock or tcp://host:port, or unset it") from None


def open_client(endpoint: str, params: dict[str, Any], origin: str, api_version: str | None = None) -> Any:
    """A docker.DockerClient for ``endpoint`` that answered a ping. ``api_version``: the engine's, when known
    (else docker-py asks the engine for it)."""
    import docker
    import requests

    try:
        client = docker.DockerClient(timeout=60, version=api_version, **params)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError, ValueError) as exc:
        raise unreachable(endpoint, origin, exc) from None
    return client


def instance(endpoint: str) -> list[object] | None:
    """What names the engine behind a unix-socket ``endpoint`` itself: the socket's device, inode and change
    time (a restarted or replaced daemon makes a new socket). None for any other endpoint, or no socket."""
    if not endpoint.startswith("unix://"):
        return None
    try:
        st = os.stat(endpoint[len("unix://"):])
    except OSError:
        return None
    return [endpoint, st.st_dev, st.st_ino, st.st_ctime_ns]


_MAX_CONFIG = 1 << 20


def engine_config(endpoint: str) -> tuple[str, dict[str, Any]] | None:
    """A digest of what a reload of the engine behind a unix-socket ``endpoint`` reads again (its daemon.json: the
    --config-file its command line names, else the default for its user) and of that command line, so facts kept
    in the probe cache change the moment the runtimes or the default runtime may have; and the runtimes that config
    declares (a reload not yet done shows other ones in ``docker info``). None when any of it cannot be read: then
    nothing is kept."""
    if not endpoint.startswith("unix://"):
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(endpoint[len("unix://"):])
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read(_MAX_CONFIG)
        words = [w.decode(errors="replace") for w in cmdline.split(b"\0")]
        config = next((w.split("=", 1)[1] for w in words if w.startswith("--config-file=")), None)
        if config is None and "--config-file" in words[:-1]:
            config = words[words.index("--config-file") + 1]
        if config is None:  # dockerd's defaults: root's, or a rootless engine's under its user's XDG config
            config = "/etc/docker/daemon.json" if uid == 0 else os.path.join(
                pwd.getpwuid(uid).pw_dir, ".config", "docker", "daemon.json")
        try:
            # O_NONBLOCK: a FIFO planted there must not hold the check; only a regular file is read
            fd = os.open(config, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                content = fh.read(_MAX_CONFIG)
        except FileNotFoundError:
            content = b"(none)"
    except (OSError, KeyError, ValueError, struct.error):
        return None
    try:
        declared = json.loads(content) if content != b"(none)" else {}
    except ValueError:
        declared = {}
    runtimes = declared.get("runtimes") if isinstance(declared, dict) else None
    digest = hashlib.sha256(cmdline + b"\0\0" + config.encode() + b"\0\0" + content).hexdigest()[:32]
    return digest, runtimes if isinstance(runtimes, dict) else {}


def reload_done(declared: dict[str, Any], live: dict[str, Any]) -> bool:
    """Does the engine run (``docker info`` Runtimes: ``live``) every runtime its config declares, as declared? Not
    yet when a reload is pending: facts read then are not kept under the new config's key."""
    def same(entry: Any, shown: Any) -> bool:
        return isinstance(entry, dict) and isinstance(shown, dict) and entry.get("path") == shown.get("path") and \
            list(entry.get("runtimeArgs") or []) == list(shown.get("runtimeArgs") or [])
    return all(same(entry, live.get(name)) for name, entry in declared.items())
