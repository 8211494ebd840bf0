"""What network mode proxy adds, measured side by side in one run (the machine is shared and noisy: compare
ratios and differences, not absolute numbers).

    .venv/bin/python bench/bench_proxy.py [--runs 10] [--requests 50] [--backends bubblewrap,docker]

- per connection: a plain-HTTP GET and a CONNECT tunnel (open it, send a GET through it, read the answer) to a
  server on this host's loopback (allowed by a CIDR entry), each one a new connection; from inside a sandbox
  through the forwarder and the proxy, and from the host directly; medians per request;
- per one-shot run: `true` in network mode none and in mode proxy, interleaved (the proxy thread and its
  directory, the forwarder's python3 in front of the command, the per-run socket); medians.
"""

from __future__ import annotations

import argparse
import http.server
import json
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

from _common import median_ms  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox import Runner, Settings

# Times N sequential requests, each on a new connection: plain HTTP via the proxy variables (or directly), and a
# CONNECT tunnel opened by hand (or a direct connection). Prints the medians in ms.
PROBE = textwrap.dedent("""
    import json, os, socket, statistics, sys, time, urllib.parse
    port, n, proxied = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "proxied"
    proxy = urllib.parse.urlsplit(os.environ.get("HTTP_PROXY", "")) if proxied else None

    def exchange(data, connect=None):
        with socket.create_connection(connect or ("127.0.0.1", port), timeout=10) as s:
            s.sendall(data)
            got = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return got
                got += chunk

    def http_get():
        target = ("GET http://127.0.0.1:%d/x HTTP/1.0\\r\\n\\r\\n" % port) if proxied else "GET /x HTTP/1.0\\r\\n\\r\\n"
        assert exchange(target.encode(), (proxy.hostname, proxy.port) if proxied else None).endswith(b"ok")

    def tunnel():
        head = ("CONNECT 127.0.0.1:%d HTTP/1.1\\r\\n\\r\\n" % port) if proxied else ""
        via = (proxy.hostname, proxy.port) if proxied else None
        got = exchange((head + "GET /x HTTP/1.0\\r\\n\\r\\n").encode(), via)
        assert got.endswith(b"ok"), got

    out = {}
    for name, fn in (("http", http_get), ("connect", tunnel)):
        fn()
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1000)
        out[name] = statistics.median(samples)
    print(json.dumps(out))
""")


class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--backends", default="bubblewrap,docker")
    args = parser.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    probe = ["python3", "-c", PROBE, str(port), str(args.requests)]

    host = json.loads(subprocess.run([sys.executable, *probe[1:], "direct"], capture_output=True, text=True,
                                     check=True).stdout)
    print(f"per connection, median of {args.requests} requests, ms (a new connection each)")
    print(f"  {'':34} {'plain HTTP':>10} {'CONNECT':>10}")
    print(f"  {'host, direct':34} {host['http']:10.2f} {host['connect']:10.2f}")
    rows = []
    for backend in args.backends.split(","):
        settings = Settings.from_env(backend=backend, egress_allow=[f"127.0.0.1/32:{port}"], egress_defaults=False,
                                     local=True)  # a loopback destination: the guard admits it only in local mode
        runner = Runner(settings)
        with runner.sandbox(backend, network="proxy") as sb:
            result = sb.exec([*probe, "proxied"], timeout=120)
            assert result.exit_code == 0, result
            inside = json.loads(result.stdout)
        print(f"  {backend + ', through the proxy':34} {inside['http']:10.2f} {inside['connect']:10.2f}   "
              f"(+{inside['http'] - host['http']:.2f} / +{inside['connect'] - host['connect']:.2f})")
        none, proxied = [], []
        median_ms(lambda r=runner: r.run(["true"], network="proxy"), 1)  # warm-up of both paths
        for _ in range(args.runs):  # interleaved, so that load on the machine hits both alike
            none.append(timed(lambda r=runner: r.run(["true"], network="none")))
            proxied.append(timed(lambda r=runner: r.run(["true"], network="proxy")))
        rows.append((backend, statistics.median(none), statistics.median(proxied)))
        runner.close()
    print(f"per one-shot run `true`, median of {args.runs} interleaved pairs, ms")
    for backend, none_ms, proxy_ms in rows:
        print(f"  {backend:12} network none {none_ms:7.1f}   network proxy {proxy_ms:7.1f}   "
              f"(+{proxy_ms - none_ms:.1f}, x{proxy_ms / none_ms:.2f})")
    server.shutdown()


if __name__ == "__main__":
    main()
