"""Which host paths may be bound into a sandbox (``execbox.Mount``), judged once when the sandbox opens.

A mount hands the code a piece of the host, so the guard refuses, for every backend and in local mode too:

- ``/`` itself, and any directory that holds a home directory (your home itself, ``/home``, ``/root``): mount a
  directory below it (``~/src/repo``), never the home;
- the Docker socket and anything holding it (``/run``, ``/var/run``), the kernel's and the system's private
  places (``/proc``, ``/sys``, ``/dev``, ``/boot``, ``/etc/shadow``, ``/etc/ssh``, ``/etc/ssl/private``...);
- secret-bearing places, whether the source is one, lies inside one or holds one: ``~/.ssh``, ``~/.gnupg``,
  ``~/.aws``, ``~/.kube``, ``~/.docker``, ``~/.config/gcloud``, ``~/.netrc``, ``~/.git-credentials``... and, in
  the tree being mounted, any directory or file with such a name (``.ssh``, ``id_rsa``, ...);
- execbox's own state: the temp directory that holds every session's workspace (and those workspaces), its
  caches and state directories, its install directory;
- a tree holding a wallet seed or private key in an env file (``.env``, ``.env.*``, ``.envrc``; the seed scan of
  ``guard.secrets``, with its bounds), or too large to scan (more than ``SCAN_MAX_ENTRIES`` entries or deeper than
  ``SCAN_MAX_DEPTH``): fail closed;
- a read-only source with mount points below it: the engine would leave those writable.

Both the path as given and where it really leads (symlinks resolved) are judged; the resolved path is what the
backend binds, so what was judged is what the sandbox gets.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from execbox.config import paths
from execbox.contract.models import MOUNT_TARGETS_REFUSED, WORKSPACE_DIR, Mount
from execbox.errors import ConfigError, RefusedError, SecretFileError
from execbox.guard.secrets import _is_env_name, scan_files

SCAN_MAX_ENTRIES = 200_000
SCAN_MAX_DEPTH = 256
SECRET_DIR_NAMES = frozenset({".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".password-store"})
SECRET_FILE_NAMES = frozenset({"id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", ".netrc", ".git-credentials",
                               ".pypirc"})
DOCKER_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock")
SYSTEM_PRIVATE = ("/proc", "/sys", "/dev", "/boot", "/run", "/var/run", "/etc/shadow", "/etc/gshadow",
                  "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh", "/etc/ssl/private")
HOME_SECRETS = (".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".config/gcloud", ".config/gh",
                ".password-store", ".local/share/keyrings", ".netrc", ".git-credentials", ".pypirc", ".npmrc")


def _real(path: str) -> str:
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return os.path.normpath(path)


def _both(path: str) -> set[str]:
    return {os.path.normpath(path), _real(path)}


def _home() -> str:
    return os.path.expanduser("~")


def execbox_state_dirs(extra: Sequence[str] = ()) -> list[str]:
    """execbox's own places: caches, state, the install directory, and whatever the caller adds (the package
    cache)."""
    install = str(Path(__file__).resolve().parents[1])
    return [*map(str, paths.own_places()), install, *extra]


def _inside(path: str, place: str) -> bool:
    return path == place or path.startswith(place.rstrip("/") + "/")


def _holds(path: str, place: str) -> bool:
    return _inside(place, path)


def mount_problem(source: str, *, state: Sequence[str] = ()) -> str | None:
    """Why ``source`` may not be mounted into a sandbox (its path alone, not yet its tree), or None."""
    if not os.path.lexists(source):
        return f"{source} does not exist"
    home = _home()
    homes = {p for h in (home, "/home", "/root") for p in _both(h)}
    sockets = {p for s in DOCKER_SOCKETS for p in _both(s)}
    docker_host = os.environ.get("DOCKER_HOST", "")
    if docker_host.startswith("unix://"):
        sockets |= _both(docker_host[len("unix://"):])
    temp = _both(tempfile.gettempdir())
    secrets = {p for rel in HOME_SECRETS for h in {home, _real(home)} for p in _both(os.path.join(h, rel))}
    secrets |= {p for s in SYSTEM_PRIVATE for p in _both(s)}
    own = {p for s in execbox_state_dirs(state) for p in _both(s)}
    for path in sorted(_both(source)):
        shown = path if path == os.path.normpath(source) else f"{path} (where {source} leads)"
        if path == "/":
            return f"{shown} is the whole host"
        if os.path.dirname(path) == "/home":
            return f"{shown} is a home directory: mount a directory below it, never the home itself"
        for place in sorted(homes):
            if _holds(path, place):
                return (f"{shown} holds a home directory ({place}): mount a directory below it (e.g. "
                        f"{os.path.join(home, 'project')}), never the home itself")
        for place in sorted(sockets):
            if _holds(path, place):
                return f"{shown} holds the Docker socket ({place}), which is root on this host"
        for place in sorted(secrets):
            if _inside(path, place) or _holds(path, place):
                return f"{shown} is, lies in or holds {place}, where secrets or the system's private state live"
        for place in sorted(temp):
            if _holds(path, place):
                return f"{shown} holds the temp directory {place}, where every sandbox's workspace lives"
            if _inside(path, place) and path[len(place.rstrip("/")) + 1:].startswith("execbox-"):
                return f"{shown} is a sandbox workspace of execbox (in {place})"
        for place in sorted(own):
            if _inside(path, place) or _holds(path, place):
                return f"{shown} is, lies in or holds {place}, execbox's own state"
        parts = set(path.split("/"))
        named = sorted(parts & SECRET_DIR_NAMES)
        if named:
            return f"{shown} lies in a {named[0]} directory, where credentials live"
    return None


def _submounts(real: str) -> list[str]:
    below = []
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) > 4:
                    point = fields[4].encode().decode("unicode_escape")  # \040 and friends
                    if point != real and _inside(point, real):
                        below.append(point)
    except OSError:
        pass
    return below


def scan_tree(real: str) -> tuple[str | None, list[Path]]:
    """(why the tree at ``real`` may not be mounted, or None; the env files in it to seed-scan). Bounded and
    iterative; never follows a link (a link in the tree is the sandbox's to resolve, in its own view)."""
    try:
        top = os.lstat(real)
    except OSError as exc:
        return f"{real} cannot be read: {exc.strerror}", []
    if not stat.S_ISDIR(top.st_mode):
        name = os.path.basename(real)
        if name in SECRET_FILE_NAMES:
            return f"{real} is a credentials file", []
        return None, [Path(real)] if _is_env_name(name) else []
    envs: list[Path] = []
    seen = 0
    stack: list[tuple[str, int]] = [(real, 0)]
    while stack:
        path, depth = stack.pop()
        if depth > SCAN_MAX_DEPTH:
            return (f"{real} is deeper than {SCAN_MAX_DEPTH} levels; the guard cannot scan it for secrets (fail "
                    "closed): mount a smaller directory"), []
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue  # unreadable to us: the sandbox user cannot read it either
        for entry in entries:
            seen += 1
            if seen > SCAN_MAX_ENTRIES:
                return (f"{real} holds more than {SCAN_MAX_ENTRIES} entries; the guard cannot scan it for secrets "
                        "(fail closed): mount a smaller directory"), []
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                if entry.name in SECRET_DIR_NAMES:
                    return f"{real} holds {entry.path}, where credentials live", []
                stack.append((entry.path, depth + 1))
            elif entry.name in SECRET_FILE_NAMES:
                return f"{real} holds {entry.path}, a credentials file", []
            elif _is_env_name(entry.name):
                envs.append(Path(entry.path))
    return None, envs


def admit_mounts(mounts: Sequence[Mount], *, backend: str, state: Sequence[str] = ()) -> tuple[Mount, ...]:
    """The mounts with their sources resolved, once each is judged safe to hand to the code; else RefusedError
    (SecretFileError for a seed in the tree) naming the mount and what to change."""
    admitted: list[Mount] = []
    targets: set[str] = set()
    for mount in mounts:
        if mount.target in targets:
            raise ConfigError(f"two mounts have the target {mount.target}: give each its own place", backend=backend)
        targets.add(mount.target)
        problem = mount_problem(mount.source, state=state)
        real = _real(mount.source)
        if problem is None and not mount.writable and os.path.isdir(real):
            below = _submounts(real)
            if below:
                problem = (f"{real} has mount points below it ({', '.join(below[:3])}), which a read-only mount "
                           "would leave writable: mount them separately, or a directory without them")
        envs: list[Path] = []
        if problem is None:
            problem, envs = scan_tree(real)
        if problem:
            raise RefusedError(f"refused: mount {mount.source} -> {mount.target}: {problem}. Mount another "
                               "directory, or copy what the code needs in with upload() / --dir", backend=backend)
        findings = scan_files(envs)
        if findings:
            where = "; ".join(f"{f.path} ({f.kind})" for f in findings)
            raise SecretFileError(f"refused: mount {mount.source} -> {mount.target} would show the code a wallet "
                                  f"secret in {where}. Move the seed or key out of that tree, or mount another "
                                  "directory", backend=backend)
        admitted.append(Mount(real, mount.target, mount.writable))
    # Outer targets first: a mount below another one's target lands on top of it.
    return tuple(sorted(admitted, key=lambda m: (m.target.count("/"), m.target)))


def admit_upload(local: str, *, backend: str | None = None, state: Sequence[str] = ()) -> None:
    """An upload hands the code a copy of a host path: the same places are refused as for a mount, and the same
    seed scan runs over it."""
    problem = mount_problem(os.path.abspath(local), state=state)
    envs: list[Path] = []
    if problem is None:
        problem, envs = scan_tree(_real(local))
    if problem:
        raise RefusedError(f"refused: upload of {local}: {problem}. Upload another path", backend=backend)
    findings = scan_files(envs)
    if findings:
        where = "; ".join(f"{f.path} ({f.kind})" for f in findings)
        raise SecretFileError(f"refused: the upload of {local} would hand the code a wallet secret in {where}. Move "
                              "the seed or key out of that tree, or upload another path", backend=backend)


__all__ = ["admit_mounts", "admit_upload", "execbox_state_dirs", "mount_problem", "scan_tree"]


def tmpfs_problem(path: str) -> str | None:
    """Why an extra tmpfs may not go at ``path`` (absolute and clean: the request model saw to that), or None: not
    over the root, the workspace or a parent of it, nor at, in or above a place the sandbox provides itself (the
    kernel's views, /tmp, execbox's own mounts, the system it runs)."""
    if path == "/":
        return "tmpfs path '/' would cover the sandbox's whole root filesystem; name a directory such as /var/tmp"
    if path == WORKSPACE_DIR or WORKSPACE_DIR.startswith(path + "/"):
        return (f"tmpfs path {path!r} would cover the workspace ({WORKSPACE_DIR}); name another directory such as "
                "/var/tmp")
    if path.startswith(WORKSPACE_DIR + "/"):
        return (f"tmpfs path {path!r} lies in the workspace, which is writable already (and counted in the disk "
                "limit); name a directory outside it such as /var/tmp")
    for place in MOUNT_TARGETS_REFUSED:
        if path == place or path.startswith(place + "/"):
            if place == "/tmp":
                return f"tmpfs path {path!r} lies in /tmp, which is a writable tmpfs already"
            return f"tmpfs path {path!r} lies in {place}, which the sandbox provides itself; name another directory"
        if place.startswith(path + "/"):
            return (f"tmpfs path {path!r} would cover {place}, which the sandbox provides itself; name a directory "
                    "below it that holds none of those, such as /var/tmp")
    return None


def admit_tmpfs(paths: Sequence[str], *, backend: str) -> tuple[str, ...]:
    """The tmpfs paths, or RefusedError naming the first one that may not have one."""
    for path in paths:
        problem = tmpfs_problem(path)
        if problem:
            raise RefusedError(f"refused: {problem}", backend=backend)
    return tuple(paths)

