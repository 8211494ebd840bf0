#!/usr/bin/env bash
# A sandboxed hello-world on the strongest backend available here, with all its set-up (scripts/setup.sh).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
"$repo/scripts/setup.sh" >&2
exec "$repo/.venv/bin/execbox" run --code 'import os, platform; print(f"hello from a sandbox: python {platform.python_version()}, uid {os.getuid()}")'
