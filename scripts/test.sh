#!/usr/bin/env bash
# The whole test suite, with all its set-up (see scripts/setup.sh). Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
"$repo/scripts/setup.sh"
cd "$repo"
# Before the suite, what keeps the code easy to change: lint, strict types, the import-layer contracts (layers
# import downward; backends use only the plugin kit), and README variable tables generated from the settings.
bin="$repo/.venv/bin"
"$bin/ruff" check --quiet src tests bench examples scripts
"$bin/mypy"
"$bin/lint-imports" --no-cache >/dev/null || "$bin/lint-imports" --no-cache
"$bin/python" scripts/readme_settings.py --check
# As root the set-up just installed and started every engine, so a test that finds one missing is a
# failure, not a skip (execbox.testing.engine_missing); CI runs as root and also sets CI=true.
if [ "$(id -u)" -eq 0 ]; then export EXECBOX_REQUIRE_ENGINES=1; fi
exec "$repo/.venv/bin/python" -m pytest -q -ra --durations=15 "$@"
