#!/usr/bin/env bash
# The whole test suite, with all its set-up (see scripts/setup.sh). Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
"$repo/scripts/setup.sh"
cd "$repo"
exec "$repo/.venv/bin/python" -m pytest -q -ra --durations=15 "$@"
