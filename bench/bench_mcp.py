"""What the MCP surface adds to a run, measured side by side in one run (the machine is shared: compare the pairs).

    .venv/bin/python bench/bench_mcp.py [--runs 30] [--backend bubblewrap]

- `true` through the runner directly, and through `execbox mcp` over stdio with the SDK's client (run_command;
  2026-07-28 protocol), interleaved (direct, mcp, direct, mcp, ...): medians and the median per-pair difference,
  the cost an agent's call pays for the protocol, the grant checks and the command review;
- a posture-1 `shell` call (the persistent sandbox is already open) against the same exec through AsyncSandbox;
- the command review alone, on a typical command line and on a 200-line script (microseconds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import anyio
from mcp import Client, StdioServerParameters

from execbox import AsyncRunner, Settings
from execbox.contract.review import ReviewRequest
from execbox.guard.commands import review


async def pairs(direct: object, mcp: object, runs: int) -> tuple[float, float, float]:
    a, b = [], []
    for _ in range(runs + 1):
        for samples, fn in ((a, direct), (b, mcp)):
            started = time.perf_counter()
            await fn()  # type: ignore[operator]
            samples.append((time.perf_counter() - started) * 1000)
    a, b = a[1:], b[1:]  # the first pair warms up
    return statistics.median(a), statistics.median(b), statistics.median(y - x for x, y in zip(a, b, strict=True))


async def main(runs: int, backend: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODE_EXEC_", "AGENT_COMPUTE_"))}
    env.update(CODE_EXEC_ENABLED="true", AGENT_COMPUTE_POSTURE="1", CODE_EXEC_BACKEND=backend,
               CODE_EXEC_AUDIT_LOG="off")
    params = StdioServerParameters(command=sys.executable, args=["-m", "execbox.cli", "mcp"], env=env)
    async with AsyncRunner(Settings(backend=backend, audit_log="off")) as runner, Client(params) as client:
        async with runner.sandbox(backend) as sandbox:
            await client.call_tool("shell", {"command": "true"})  # opens the session's sandbox
            one = await pairs(lambda: runner.run(["true"]),
                              lambda: client.call_tool("run_command", {"command": "true"}), runs)
            print(f"one-shot `true` on {backend}: direct {one[0]:.1f} ms, over MCP {one[1]:.1f} ms, "
                  f"per-pair difference {one[2]:.1f} ms (medians of {runs})")
            shell = await pairs(lambda: sandbox.exec(["true"]), lambda: client.call_tool("shell", {"command": "true"}),
                                runs)
            print(f"posture-1 exec `true` on {backend}: AsyncSandbox {shell[0]:.1f} ms, MCP shell {shell[1]:.1f} ms, "
                  f"per-pair difference {shell[2]:.1f} ms")
    settings = Settings()
    for label, text in (("a command line", "cd src && python3 -m pytest -q tests/ | tee log.txt && git status"),
                        ("a 200-line script",
                         "\n".join(f"echo step {i} && ls -la dir{i} | wc -l" for i in range(200)))):
        request = ReviewRequest(tool="shell", kind="shell", text=text)
        started = time.perf_counter()
        for _ in range(200):
            review(request, settings)
        print(f"command review of {label}: {(time.perf_counter() - started) / 200 * 1e6:.0f} µs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--backend", default="bubblewrap")
    args = parser.parse_args()
    anyio.run(main, args.runs, args.backend)
