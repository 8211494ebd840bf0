"""The in-sandbox forwarder of network mode proxy under many connections, on real docker and bubblewrap with the
default pids limit. Found attacking (issue 25, B5): it started two threads per connection, and at ~132 open ones
the pids limit made thread creation fail, which ended its accept loop: the rest of the run had no egress. The
upstream is an HTTP listener this test starts on 127.0.0.1, allowed by a CIDR entry."""

from __future__ import annotations

import http.server
import textwrap
import threading
from collections.abc import Iterator

import pytest

from execbox import BackendUnavailableError, Runner, Settings
from execbox.kit.proxy import server as px
from execbox.runner import run_blocking
from execbox.testing import engine_missing

pytestmark = pytest.mark.engine

NAME = "upstream.test"


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"] if host == NAME else []

    monkeypatch.setattr(px, "resolve", resolve)  # a name: NO_PROXY sends 127.0.0.1 around the proxy
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


CODE = """
import os, socket, urllib.request
proxy = os.environ["HTTP_PROXY"].rsplit(":", 1)
held = []
for _ in range({count}):  # each held open, tunnelled to the upstream, past what two threads each allowed
    s = socket.create_connection((proxy[0][len("http://"):], int(proxy[1])), timeout=30)
    s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\\r\\n\\r\\n")
    assert s.recv(100).startswith(b"HTTP/1.1 200"), "tunnel refused"
    held.append(s)
print("held", len(held))
print(urllib.request.urlopen("http://{name}:{port}/", timeout=30).read().decode())
for s in held:
    s.close()
print(urllib.request.urlopen("http://{name}:{port}/", timeout=30).read().decode())
"""


@pytest.mark.parametrize("backend", ["docker", "bubblewrap"])
def test_hundreds_of_open_connections_leave_the_forwarder_serving(backend: str, upstream: int) -> None:
    settings = Settings.from_env(backend=backend, network="proxy", egress_defaults=False, local=True,
                                 egress_allow=[f"127.0.0.1/32:{upstream}", f"{NAME}:{upstream}"])
    assert settings.pids_limit == 256  # the default, which the old forwarder's threads ran out
    runner = Runner(settings)
    try:
        run_blocking(runner.aio.backend(backend).check)
    except BackendUnavailableError as exc:
        engine_missing(f"{backend} cannot run here: {exc}")
    with runner:
        result = runner.run_code(textwrap.dedent(CODE.format(count=200, port=upstream, name=NAME)), backend=backend,
                                 timeout=120)
    assert result.exit_code == 0, result
    assert result.stdout.splitlines() == ["held 200", "hello", "hello"]
    served = [a for a in result.egress if a.allowed]
    assert len(served) == 202 and all(a.port == upstream for a in served)
