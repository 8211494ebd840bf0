"""Installed as users install it: the bare package, and each extra alone, in a fresh virtual environment.

Without an SDK its backends are listed as unavailable with the `pip install 'execbox[...]'` hint; `backends`,
`doctor`, `gc` and `run` never print a traceback. The suite's own venv has every extra, so only this catches
an SDK imported where it must not be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ["", "docker", "ssh", "singularity", "modal", "daytona", "vercel", "mcp", "egress-secrets", "ray", "inspect",
          "smolagents", "pydantic-ai", "otel", "prometheus"]
# The backend each extra's SDK serves (singularity drives the apptainer binary; its extra only adds spython).
BACKEND_OF = {"docker": "docker", "ssh": "ssh", "modal": "modal", "daytona": "daytona", "vercel": "vercel_sandbox",
              "ray": "ray"}
# The integration each extra's framework serves (execbox.integrations).
INTEGRATION_OF = {"inspect": "inspect_ai", "smolagents": "smolagents", "pydantic-ai": "pydantic_ai"}
IMPORT_CHECK = """
import importlib, sys
try:
    importlib.import_module(sys.argv[1])
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
else:
    print("imported")
"""
ROOT = os.geteuid() == 0
#: What `execbox mcp --http` would serve at /metrics: a page with its extra, else the module that is missing.
PROMETHEUS_CHECK = """
from execbox.telemetry import export
exporting = export({}, prometheus=True)
print("page" if exporting.metrics_page() else f"missing {exporting.missing}")
"""


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True,
                   stdin=subprocess.DEVNULL, capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def environments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """extra -> the bin directory of a fresh venv with execbox[extra] (built as a wheel, installed by pip)."""
    root = tmp_path_factory.mktemp("install")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(REPO))
    wheel = next((root / "dist").glob("execbox-*.whl"))

    def make(extra: str) -> Path:
        target = root / (extra or "bare")
        venv.create(target, with_pip=False)  # this pip installs into it: no pip bootstrap per venv
        spec = f"{wheel}[{extra}]" if extra else str(wheel)
        _pip("--python", str(target / "bin" / "python"), "install", spec)
        return target / "bin"

    with ThreadPoolExecutor(max_workers=4) as pool:
        bins = dict(zip(EXTRAS, pool.map(make, EXTRAS), strict=True))
    yield bins


def _execbox(bin_dir: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_", "VIRTUAL_ENV"))}
    env.update(env_extra or {}, PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}")
    done = subprocess.run([str(bin_dir / "execbox"), *args], capture_output=True, text=True, env=env, timeout=180,
                          stdin=subprocess.DEVNULL, cwd=bin_dir.parent)
    assert "Traceback" not in done.stderr + done.stdout, f"execbox {' '.join(args)}:\n{done.stderr}"
    return done


@pytest.mark.parametrize("extra", EXTRAS, ids=[e or "bare" for e in EXTRAS])
def test_each_command_works_with_only_this_extra(environments: dict[str, Path], extra: str) -> None:
    bin_dir = environments[extra]
    rows = {row["name"]: row for row in json.loads(_execbox(bin_dir, "backends", "--json").stdout)}
    for other, backend in BACKEND_OF.items():
        if other == extra:
            assert "not installed" not in (rows[backend]["reason"] or ""), rows[backend]
        else:
            assert rows[backend]["available"] is False, rows[backend]
            assert rows[backend]["fix"] == f"pip install 'execbox[{other}]'", rows[backend]

    doctor = _execbox(bin_dir, "doctor", "--json")
    checked = {row["name"]: row for row in json.loads(doctor.stdout)["backends"]}
    assert set(checked) == set(rows)
    if ROOT and extra != "docker":  # the engine answers here, its extra is missing: doctor says so, not only auto
        warning = checked["docker"]["warning"] or ""
        assert "Docker engine" in warning and "pip install 'execbox[docker]'" in warning, checked["docker"]
        assert f"warning: {warning}" in _execbox(bin_dir, "doctor").stdout
    else:
        assert checked["docker"]["warning"] is None, checked["docker"]

    gc = json.loads(_execbox(bin_dir, "gc", "--json").stdout)
    for other, backend in BACKEND_OF.items():
        if other != extra:
            assert "not installed" in gc["skipped"][backend], gc

    ran = _execbox(bin_dir, "run", "--json", "--", "echo", "hi")
    if ROOT:  # the engines are installed (gvisor, bubblewrap: no SDK; docker with its extra): a sandbox runs it
        assert ran.returncode == 0, ran.stdout + ran.stderr
        result = json.loads(ran.stdout)
        assert result["stdout"] == "hi\n"
        # auto's pick among the local sandboxes that need no extra (docker's needs its own)
        assert result["backend"] in {"gvisor", "bubblewrap", *(["docker"] if extra == "docker" else [])}, result
        assert result["isolation"] in ("gvisor", "container", "namespace"), result
    else:  # a clear refusal or a run, never a crash
        assert ran.returncode in (0, 125, 126), ran.stdout + ran.stderr

    # A resident server starts with only this extra (it preloads every installed SDK, and skips the others),
    # and runs a command line handed to it as the program would.
    sock = str(bin_dir.parent / "serve.sock")
    server = subprocess.Popen([str(bin_dir / "execbox"), "serve", "--socket", sock], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=bin_dir.parent,
                              env={k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "EXECBOX_"))})
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(sock) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(sock), server.communicate(timeout=30)
        version = _execbox(bin_dir, "--version", env_extra={"CODE_EXEC_SERVER": sock})
        assert version.returncode == 0 and "version" in version.stdout and "no server" not in version.stderr, \
            version.stdout + version.stderr
    finally:
        server.terminate()
        _, err = server.communicate(timeout=60)
    assert "Traceback" not in err, err

    # An integration imports with its framework's extra, and without it says which extra to install.
    for other, module in INTEGRATION_OF.items():
        said = subprocess.run([str(bin_dir / "python"), "-c", IMPORT_CHECK, f"execbox.integrations.{module}"],
                              capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL).stdout.strip()
        assert said == "imported" if other == extra else f"pip install 'execbox[{other}]'" in said, (other, said)

    # The MCP server needs its extra, and says so without it.
    if extra == "mcp":
        served = _execbox(bin_dir, "mcp", "--help")
        assert served.returncode == 0 and "--http" in served.stdout, served.stdout + served.stderr
    else:
        served = _execbox(bin_dir, "mcp")
        assert served.returncode != 0 and "pip install 'execbox[mcp]'" in served.stdout + served.stderr, served

    # Secrets at egress need cryptography (the per-sandbox CA): without it, a clear error naming the extra.
    # (Another extra's SDK may bring cryptography along: paramiko does.)
    has_crypto = subprocess.run([str(bin_dir / "python"), "-c", "import cryptography"], check=False,
                                capture_output=True).returncode == 0
    assert has_crypto or extra != "egress-secrets"
    if ROOT and not has_crypto:
        sealed = _execbox(bin_dir, "run", "--json", "--", "true", env_extra={
            "CODE_EXEC_EGRESS_SECRETS": "API_KEY=api.example.com", "API_KEY": "s3cret-value-123",
            "CODE_EXEC_NETWORK": "proxy"})
        assert sealed.returncode != 0 and "pip install 'execbox[egress-secrets]'" in sealed.stdout + sealed.stderr, \
            sealed.stdout + sealed.stderr

    # The metrics page needs its extra (the SDK and its Prometheus reader); without it, what is missing is named.
    page = subprocess.run([str(bin_dir / "python"), "-c", PROMETHEUS_CHECK], capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert page.returncode == 0, page.stderr
    assert page.stdout.strip() == "page" if extra == "prometheus" else page.stdout.startswith("missing "), page.stdout
