"""What of the host the sandbox sees: the system directories and pieces of /etc bound read-only, the paths that
must never be bound (``unsafe_bind``, judged again at every exec), and the mask over execbox's own directory."""

from __future__ import annotations

import contextlib
import os
import tempfile

from execbox import plugin

WORKSPACE = "/workspace"
# What a program needs from /etc (plus /etc/python3*); everything else of the host's /etc stays out.
# TLS gets the CA certificates and the OpenSSL config only, never all of /etc/ssl or /etc/pki: their
# private/ directories hold keys readable by a group (ssl-cert) that a non-root caller may be in, and an
# unprivileged bwrap keeps the caller's supplementary groups.
ETC_PIECES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone",
    "ssl/certs", "ssl/cert.pem", "ssl/openssl.cnf",  # Debian, Ubuntu, Arch, Alpine, SUSE
    "pki/tls/certs", "pki/tls/cert.pem", "pki/tls/openssl.cnf", "pki/ca-trust",  # Fedora, RHEL
    "ca-certificates", "ca-certificates.conf", "crypto-policies", "nsswitch.conf", "host.conf",
    "gai.conf", "protocols", "services", "mime.types", "os-release", "debian_version", "locale.alias",
    "locale.conf",
)
# Host paths that must never be visible, whatever CODE_EXEC_BWRAP_RO_BINDS says.
FORBIDDEN = ("/", "/home", "/root", "/run", "/var/run", "/proc", "/sys", "/dev", "/boot", "/etc", "/var", "/tmp",
             WORKSPACE)
MAX_PATH = 4096


def forbidden_places() -> list[str]:
    """FORBIDDEN plus what is forbidden on this host: the temporary directory that holds every session's
    workspace, and the caller's home (wherever they are, also through symlinks)."""
    places = set(FORBIDDEN)
    for path in (tempfile.gettempdir(), os.path.expanduser("~")):
        if path.startswith("/"):
            places.add(os.path.normpath(path))
            with contextlib.suppress(OSError, ValueError):
                places.add(os.path.realpath(path))
    return sorted(places)


def unsafe_bind(raw: str) -> str | None:
    """Why ``raw`` must not be bound into the sandbox, or None. Judged again at every exec: a path may
    have become a symlink since the settings were read."""
    if "\0" in raw or len(raw) > MAX_PATH:
        return f"{raw[:100]!r}... is not a usable path (a NUL byte, or longer than {MAX_PATH})"
    if not raw.startswith("/"):
        return f"{raw!r} is not an absolute path"
    places = forbidden_places()
    bad = _clash(os.path.normpath(raw), places)
    if bad:
        return f"{raw!r} would expose {bad} to the sandbox"
    try:
        # bwrap follows a symlink in the source: judge where it really points too
        real = os.path.realpath(raw, strict=True)
    except (OSError, RuntimeError) as exc:  # missing, a symlink loop, or unreadable
        return f"{raw!r} cannot be bound: {getattr(exc, 'strerror', None) or exc}"
    bad = _clash(real, places)
    return f"{raw!r} leads to {real!r}, which would expose {bad} to the sandbox" if bad else None


def _clash(path: str, places: list[str]) -> str | None:
    """The forbidden place that ``path`` is, lies below, or contains."""
    for bad in places:
        if path == bad or (bad != "/" and path.startswith(bad + "/")) or bad.startswith(path.rstrip("/") + "/"):
            return bad
    return None


def system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    pieces = list(ETC_PIECES)
    with contextlib.suppress(OSError):
        pieces += sorted(n for n in os.listdir("/etc") if n.startswith("python3"))
    for piece in pieces:
        if os.path.lexists(f"/etc/{piece}"):
            args += ["--ro-bind-try", f"/etc/{piece}", f"/etc/{piece}"]
    return args


def masks(bound: list[str]) -> list[str]:
    """Cover the execbox install directory with an empty tmpfs when a bound path contains it."""
    here = os.path.dirname(os.path.realpath(plugin.__file__))  # the execbox package
    if any(here == b or here.startswith(b.rstrip("/") + "/") for b in bound):
        return ["--tmpfs", here]
    return []
