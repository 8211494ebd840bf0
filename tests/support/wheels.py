"""A tiny pure-Python wheel and a PEP 503 index serving it on loopback, counting every wheel download: the local
package source of the package-cache and image-build tests (no public index, no network beyond 127.0.0.1)."""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from execbox.testing.host import pure_wheel

NAME = "execbox-probe-pkg"
MODULE = "execbox_probe_pkg"
VERSION = "1.0"
VALUE = "probe-ok"


def build_wheel(directory: Path, name: str = NAME, version: str = VERSION, value: str = VALUE) -> Path:
    """``<module>-<version>-py3-none-any.whl`` with ``VALUE = value`` in the module, a valid RECORD."""
    module = name.replace("-", "_")
    filename, data = pure_wheel(name, version, {f"{module}/__init__.py": f"VALUE = {value!r}\n".encode()})
    wheel = directory / filename
    wheel.write_bytes(data)
    return wheel


@dataclass
class Index:
    url: str
    root: Path
    downloads: list[str] = field(default_factory=list)


@contextmanager
def serve_index(root: Path, wheels: list[Path]) -> Iterator[Index]:
    """A PEP 503 simple index of ``wheels`` on 127.0.0.1; ``Index.downloads`` lists every wheel fetched."""
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    by_project: dict[str, list[Path]] = {}
    for wheel in wheels:
        target = files / wheel.name
        target.write_bytes(wheel.read_bytes())
        project = wheel.name.split("-")[0].replace("_", "-").lower()
        by_project.setdefault(project, []).append(target)
    for project, found in by_project.items():
        page = root / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="../../files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
                        f"{w.name}</a>\n" for w in found)
        (page / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    index = Index("", root)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kw: object) -> None:
            super().__init__(*args, directory=str(root), **kw)  # type: ignore[arg-type]

        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            if self.path.split("?")[0].endswith(".whl"):
                index.downloads.append(os.path.basename(self.path))
            super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    index.url = f"http://127.0.0.1:{server.server_address[1]}/simple"
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()


def host_pip_uses(index: Index, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point this host's pip at ``index`` alone: no config file, no find-links, no other index."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index.url)


@pytest.fixture(scope="module")
def probe_index() -> Iterator[Index]:
    """The probe wheel on a loopback index, for a module's tests; its ``root`` is in a directory every sandbox
    user can reach (as root, docker and bubblewrap run the code as 65534), beside the package cache."""
    shared = Path(tempfile.mkdtemp(prefix="wheels-", dir="/opt" if os.access("/opt", os.W_OK) else None))
    shared.chmod(0o755)
    try:
        with serve_index(shared / "index", [build_wheel(shared)]) as index:
            yield index
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture
def probe_cache(probe_index: Index, monkeypatch: pytest.MonkeyPatch) -> Index:
    """This host's pip pointed at the probe index alone, and execbox's package cache beside it (empty at first:
    the module's first install fetches the wheel, the later ones find it cached)."""
    host_pip_uses(probe_index, monkeypatch)
    monkeypatch.setenv("CODE_EXEC_PACKAGE_CACHE", str(probe_index.root.parent / "cache"))
    return probe_index
