#!/usr/bin/env bash
# The outside MCP clients the suite drives (tests/mcp/test_outside_clients.py), from the npm registry into
# .cache/node (gitignored): Node 22 as an npm package (the Inspector needs node >= 22.19; the machine's may be
# older), the MCP Inspector and the MCP conformance suite, pinned. Idempotent: skipped when the stamp matches.
# No npm: it says so and carries on (the tests skip, or fail under EXECBOX_REQUIRE_ENGINES).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
prefix="$repo/.cache/node"
say() { printf 'setup: %s\n' "$*"; }
packages=(node@22.23.3 @modelcontextprotocol/inspector@2.12.0 @modelcontextprotocol/conformance@0.1.16)
stamp="$prefix/.execbox-installed"
if [ "$(cat "$stamp" 2>/dev/null)" = "${packages[*]}" ] && [ -x "$prefix/node_modules/node/bin/node" ]; then
    say "node tools up to date"
    exit 0
fi
if ! command -v npm >/dev/null; then
    say "no npm: skipping Node 22, the MCP Inspector and the conformance suite (their tests skip)"
    exit 0
fi
say "installing ${packages[*]} into .cache/node"
mkdir -p "$prefix"
# Two steps: Node 22 first, then the clients installed with it first on PATH (their install scripts and
# engine checks see node 22, not the machine's).
npm install --prefix "$prefix" --save-exact --no-audit --no-fund --loglevel=error "${packages[0]}"
PATH="$prefix/node_modules/node/bin:$PATH" npm install --prefix "$prefix" --save-exact --no-audit --no-fund --loglevel=error \
    "${packages[@]}"
"$prefix/node_modules/node/bin/node" --version >/dev/null
echo "${packages[*]}" >"$stamp"
