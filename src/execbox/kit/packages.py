"""Python packages fetched on the host, by a trusted step, for sandboxes that must not fetch them themselves.

Two users: the per-user wheel cache that sessions see read-only (``fill_cache``; ``AsyncSandbox.pip_install``),
and the wheels baked into a docker image (``pip_download``; ``execbox image build --pip``).

Why the cache is filled here and only read in the sandbox: anything a sandbox writes is the hostile code's
output. A cache that two sandboxes could write would let one plant a trojaned ``numpy-1.26.4-...whl`` for the
next. So sandboxes get the cache read-only, and only this step adds to it: requirements given by the caller
(PEP 508 names and versions; URLs, paths and pip options are refused), fetched by the host's own pip with the
host's configuration (its index, its certificates, ``pip config list``), wheels only (``--only-binary=:all:``:
no sdist is built, so no package code runs on the host), written to a staging directory and renamed into the
cache one whole file at a time under a lock. The target interpreter's tags (Python version, machine, glibc)
come from the sandbox; at worst a lying sandbox gets wheels that do not fit it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from execbox.config import paths
from execbox.errors import ConfigError, SandboxError
from execbox.kit.processes import reaped

#: Where the cache appears inside a sandbox (read-only).
SANDBOX_DIR = "/opt/execbox/pip"
#: Prints what ``PythonTarget.parse`` reads: major minor machine libc-name libc-version.
PROBE = ("import platform, sys; print(sys.version_info[0], sys.version_info[1], platform.machine(), "
         "*platform.libc_ver())")
PIP_TIMEOUT_S = 900.0
#: A comment in a requirements file, as pip reads one: from a ``#`` at the start or after white space.
_COMMENT = re.compile(r"(^|\s+)#.*$")


def default_cache_dir(configured: Path | None = None) -> Path:
    """CODE_EXEC_PACKAGE_CACHE, else /var/cache/execbox/pip as root (a sandbox user must be able to reach it;
    /root is 0700), else $XDG_CACHE_HOME/execbox/pip."""
    if configured is not None:
        return configured
    return paths.cache_dir() / "pip"


@dataclass(frozen=True)
class PythonTarget:
    """The interpreter wheels are fetched for."""

    major: int
    minor: int
    machine: str
    glibc: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str) -> PythonTarget:
        words = text.split()
        try:
            major, minor, machine = int(words[0]), int(words[1]), words[2]
        except (IndexError, ValueError):
            raise SandboxError(f"cannot tell which Python the sandbox has (it printed {text[:200]!r}); it needs "
                               "python3 on PATH") from None
        if not machine.replace("_", "").isalnum():
            raise SandboxError(f"the sandbox reported an odd machine name {machine[:50]!r}")
        glibc = None
        if len(words) >= 5 and words[3] == "glibc":
            with contextlib.suppress(ValueError, IndexError):
                found = words[4].split(".")
                glibc = (int(found[0]), int(found[1]))
        return cls(major, minor, machine, glibc)

    @classmethod
    def here(cls) -> PythonTarget:
        import platform

        return cls.parse(f"{sys.version_info[0]} {sys.version_info[1]} {platform.machine()} "
                         + " ".join(platform.libc_ver()))

    def pip_args(self) -> list[str]:
        """pip download's options for this interpreter (manylinux tags down from its glibc)."""
        py = f"{self.major}{self.minor}"
        args = ["--only-binary=:all:", "--python-version", f"{self.major}.{self.minor}", "--implementation", "cp"]
        for abi in (f"cp{py}", "abi3", "none"):
            args += ["--abi", abi]
        platforms = []
        if self.glibc:
            major, minor = self.glibc
            platforms += [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 4, -1)]
            legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
            platforms += [f"{name}_{self.machine}" for m, name in legacy.items() if (major, minor) >= (2, m)]
        platforms.append(f"linux_{self.machine}")
        for name in platforms:
            args += ["--platform", name]
        return args


#: What pip takes a requirement ending in for a local archive (``pip._internal.utils.filetypes``), whatever its
#: valid PEP 508 name says: ``evil.tar.gz`` is a file of the current directory to pip, built if it is an sdist.
_ARCHIVE_SUFFIXES = (".zip", ".whl", ".tar.bz2", ".tbz", ".tar.xz", ".txz", ".tlz", ".tar.lz", ".tar.lzma",
                     ".tar.gz", ".tgz", ".tar")
#: The largest requirements file read (a pinned lock file of a big project is a few tens of KiB).
MAX_REQUIREMENTS_FILE = 1 << 20
#: The longest single requirement: pip's own parser is quadratic on some spellings (``rich===[[[...``), so a
#: 1 MiB line would keep the host's pip busy until its timeout. A name, extras, specifiers and a marker fit.
MAX_REQUIREMENT_LENGTH = 1000


def check_requirements(requirements: Sequence[str]) -> list[str]:
    """PEP 508 requirements (``numpy``, ``pandas>=2,<3``, ``rich[jupyter]==13.7.1``, markers allowed); a URL, a
    path, an archive's file name or a pip option is a ConfigError: the host step must fetch from the host's
    index, nowhere else, and nothing given may make the host's pip build or run code."""
    from packaging.requirements import InvalidRequirement, Requirement

    checked = []
    for raw in requirements:
        if not isinstance(raw, str) or not raw.strip():
            raise ConfigError(f"invalid requirement {raw!r}: give a package name, e.g. 'numpy' or 'pandas>=2'")
        text = raw.strip()
        if len(text) > MAX_REQUIREMENT_LENGTH:
            raise ConfigError(f"refused requirement {text[:200]!r}...: longer than {MAX_REQUIREMENT_LENGTH} "
                              "characters")
        if text.startswith("-") or "/" in text.split(";")[0] or "\\" in text or "\0" in text:
            raise ConfigError(f"refused requirement {text[:200]!r}: only names and versions from the index "
                              "(no options, paths or URLs)")
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise ConfigError(f"invalid requirement {text[:200]!r}: {exc}") from None
        if any(spec.operator == "===" for spec in req.specifier):
            # Arbitrary equality takes any string as a version, which pip's own parser reads otherwise than ours
            # (rich===1.tar.gz was a local archive to it, rich===[:] no requirement at all): refused outright.
            raise ConfigError(f"refused requirement {text[:200]!r}: arbitrary equality (===); pin with == instead")
        if req.url:
            raise ConfigError(f"refused requirement {text[:200]!r}: a URL requirement; give a name and version "
                              "from the index")
        # The name, or the whole requirement before its marker less a trailing [extras], as pip tests it:
        # rich===1.tar.gz (the arbitrary equality operator takes any version) was the file /rich===1.tar.gz to pip.
        end = text.split(";")[0].strip().lower()
        if end.endswith("]") and "[" in end:  # no regex: the arbitrary version may be 1 MiB of brackets
            end = end[:end.rindex("[")]
        if req.name.lower().endswith(_ARCHIVE_SUFFIXES) or end.endswith(_ARCHIVE_SUFFIXES):
            raise ConfigError(f"refused requirement {text[:200]!r}: pip takes that name for a local archive file; "
                              "give a name and version from the index")
        checked.append(text)
    return checked


def read_requirements(path: Path) -> list[str]:
    """The requirements of a requirements file, each checked as ``check_requirements`` checks one given alone,
    for pip's command line: the file itself never reaches pip (its ``-r``, ``-e``, ``--index-url``, ``-f``,
    nested files and ``${VAR}`` expansion would each let it fetch from elsewhere or build on the host). Read
    strictly: UTF-8, at most ``MAX_REQUIREMENTS_FILE`` bytes, one requirement per line (LF or CRLF), ``#``
    comments and blank lines skipped; an option line, a per-requirement option (``--hash``), a continued line
    (``\\`` at the end), a bare CR, NUL or any other control character is a ConfigError naming the line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO does not hang us
    except OSError as exc:
        raise ConfigError(f"cannot read the requirements file {path}: {exc.strerror or exc}") from None
    try:  # checked before open(): a directory's descriptor made open() raise, and leak it
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"the requirements file {path} is not a regular file")
        with open(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_REQUIREMENTS_FILE + 1)
    except OSError as exc:  # EIO and the like (/proc/self/mem is a regular file)
        raise ConfigError(f"cannot read the requirements file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_REQUIREMENTS_FILE:
        raise ConfigError(f"the requirements file {path} is larger than {MAX_REQUIREMENTS_FILE} bytes")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the requirements file {path} is not UTF-8 (byte {exc.start})") from None
    checked = []
    for number, line in enumerate(text.replace("\r\n", "\n").split("\n"), start=1):
        where = f"{path}:{number}"
        bad = next((ch for ch in line if ch != "\t" and unicodedata.category(ch) in ("Cc", "Zl", "Zp")), None)
        if bad is not None:
            raise ConfigError(f"{where}: refused: the control character {bad!r} (a bare CR, NUL, ...) is not part "
                              "of a requirement")
        line = _COMMENT.sub("", line).strip()
        if not line:
            continue
        if line.endswith("\\"):
            raise ConfigError(f"{where}: refused: a continued line; put the requirement on one line")
        if " -" in line or "\t-" in line:
            raise ConfigError(f"{where}: refused {line[:200]!r}: pip options (--hash, --config-settings, ...) are "
                              "not taken from a requirements file; give names and versions only")
        try:
            checked += check_requirements([line])
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc.message}") from None
    return checked


def _pip(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)  # the host's own pip configuration: index, certificates, proxies
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    # Reaped: pip and whatever it starts (a build backend) die with this process, also when it is SIGKILLed; at
    # the timeout the reaper's SIGTERM ends the whole tree (SIGKILL would leave pip to init). In /, whose files only
    # root makes: no name can be a file of the caller's directory to pip (and an empty temporary one would outlive
    # a SIGKILLed caller). -P: nor is / put on the module search path.
    try:
        proc = subprocess.Popen(reaped([sys.executable, "-P", "-m", "pip", *args]), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                                cwd="/")
    except FileNotFoundError as exc:
        raise SandboxError(f"cannot run pip on the host: {exc}") from None
    try:
        out, err = proc.communicate(timeout=PIP_TIMEOUT_S)
    except BaseException as exc:
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise SandboxError(f"pip on the host did not finish within {PIP_TIMEOUT_S:g}s") from None
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def pip_download(requirements: Sequence[str], dest: Path, target: PythonTarget, *,
                 requirement_files: Sequence[Path] = (), find_links: Sequence[Path] = (),
                 no_index: bool = False) -> subprocess.CompletedProcess[str]:
    """``pip download`` on the host into ``dest``: wheels only, for ``target``, with the host's pip settings, of
    ``requirements`` and the lines of ``requirement_files``, each checked (``check_requirements``,
    ``read_requirements``): pip gets names and versions on its command line, never a file."""
    checked = check_requirements(requirements)
    for path in requirement_files:
        checked += read_requirements(path)
    args = ["download", "--dest", str(dest.absolute()), "--progress-bar", "off", *target.pip_args()]
    for path in find_links:
        args += ["--find-links", str(path.absolute())]
    if no_index:
        args.append("--no-index")
    return _pip([*args, "--", *checked])


@dataclass
class CacheFill:
    """What one fill did: wheels it fetched now, wheels that were already in the cache."""

    downloaded: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    with open(cache / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def ensure_cache(cache: Path) -> Path:
    """The cache directory, made (0755: the sandbox user reads it) if missing; it must be a real directory."""
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(cache)
    if not os.path.isdir(cache) or os.path.islink(cache) or st.st_uid != os.geteuid():
        raise ConfigError(f"the package cache {cache} is not a directory of yours (a symlink, or another user's); "
                          "point CODE_EXEC_PACKAGE_CACHE elsewhere", env_var="CODE_EXEC_PACKAGE_CACHE")
    if st.st_mode & 0o022:
        raise ConfigError(f"the package cache {cache} is writable by other users, who could plant wheels in it: "
                          f"chmod go-w {cache}", env_var="CODE_EXEC_PACKAGE_CACHE")
    return cache


def fill_cache(cache: Path, requirements: Sequence[str], target: PythonTarget) -> CacheFill:
    """Make sure wheels for ``requirements`` (and their dependencies) for ``target`` are in ``cache``: first
    from the cache alone (no network), else with the host's index; new wheels are renamed in whole."""
    requirements = check_requirements(requirements)
    ensure_cache(cache)
    with _locked(cache), tempfile.TemporaryDirectory(prefix=".staging-", dir=cache) as staging:
        stage = Path(staging)
        offline = pip_download(requirements, stage, target, find_links=[cache], no_index=True)
        if offline.returncode == 0:
            return CacheFill(cached=sorted(p.name for p in stage.iterdir()))
        shutil.rmtree(stage)
        stage.mkdir()
        online = pip_download(requirements, stage, target, find_links=[cache])
        if online.returncode != 0:
            tail = "\n".join(online.stderr.strip().splitlines()[-8:])
            raise SandboxError(f"pip on the host could not fetch {', '.join(requirements)} as wheels for Python "
                               f"{target.major}.{target.minor} ({target.machine}): {tail}. Only wheels are fetched "
                               "(no sdist builds on the host); check the names, or the index in `pip config list`")
        fill = CacheFill()
        for wheel in sorted(stage.iterdir()):
            if not wheel.is_file() or wheel.is_symlink():
                continue
            final = cache / wheel.name
            if final.exists():
                fill.cached.append(wheel.name)
                continue
            os.chmod(wheel, 0o644)
            os.rename(wheel, final)  # same file system: the whole file appears at once
            fill.downloaded.append(wheel.name)
        return fill
