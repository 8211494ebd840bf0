#!/usr/bin/env bash
# Everything the two README commands need, idempotent (a second run takes seconds):
#   1. as root: Debian packages (docker.io, openssh-server, bubblewrap, debootstrap), dockerd started
#      when no engine answers, gVisor (runsc) installed and registered in the engine with the arguments
#      this host needs, and the sandbox image built when it is missing (scripts/bootstrap.sh);
#   2. a virtual environment in .venv with execbox and all its extras installed (re-installed only when
#      pyproject.toml changed);
#   3. Node 22, the MCP Inspector and the MCP conformance suite in .cache/node (scripts/node_tools.sh).
# Not root and things missing: it says what to run and carries on, so the suite can still run (the
# tests that need an engine skip on a laptop; in CI, CI=true turns those skips into failures).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
say() { printf 'setup: %s\n' "$*"; }

venv="$repo/.venv"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv"
    "$python" -m venv "$venv"
fi
stamp="$venv/.execbox-installed"
want="$(sha256sum pyproject.toml examples/*/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    say "installing execbox with all extras into .venv (first run: a minute or two)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[all,dev]"
    echo "$want" >"$stamp"
else
    say "python environment up to date"
fi

# 3. Node 22, the MCP Inspector and the MCP conformance suite in .cache/node, for tests/mcp/test_outside_clients.py
#    (no npm, or no registry: their tests skip, and fail under EXECBOX_REQUIRE_ENGINES).
"$repo/scripts/node_tools.sh" || say "the node tools could not be installed; tests/mcp/test_outside_clients.py will skip"

if [ "$(id -u)" -eq 0 ]; then
    EXECBOX_PYTHON="$venv/bin/python" "$repo/scripts/bootstrap.sh" --image
else
    say "not root: skipping system packages, dockerd and the image; run 'sudo scripts/bootstrap.sh --image' for the engines"
fi
