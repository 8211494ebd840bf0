"""The ray backend against the same node's local backend, side by side in one run, on a three-node Ray cluster
started here (ray.cluster_utils, one CPU and an 80 MB object store per node; every node is this machine).

    .venv/bin/python bench/bench_ray.py [--runs 20] [--items 1000] [--node-backend bubblewrap]

- one-shot `true`: the node's backend run locally / through ray (driver -> host actor -> the node's execbox),
  interleaved run by run: the difference is what the hop costs a one-shot;
- `runner.map` of `--items` `print(1)` one-shots: locally, and over the three nodes through ray (each node's
  share and its runs per second; the slots: CODE_EXEC_RAY_SLOTS_PER_NODE per node, the same total locally).
The nodes share this machine's cores, so the cluster's throughput here is one machine's, split three ways: the
per-node figure is what one node sustains while sharing its cores with two others.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

from bench_pool import p99

from execbox import Runner, Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the cluster the tests start
from tests.backends.ray_fixtures import NODES, local_cluster  # noqa: E402


def node_of(result: object) -> str:
    note = next(n for n in getattr(result, "notes", []) if n.startswith("ray: ran on node "))
    return note.split(" in its ")[0].removeprefix("ray: ran on node ")


def overhead(local: Runner, remote: Runner, backend: str, runs: int) -> tuple[list[float], list[float]]:
    local.run("true", backend=backend)
    remote.run("true")
    mine, hop = [], []
    for _ in range(runs):
        for runner, into, name in ((local, mine, backend), (remote, hop, "ray")):
            started = time.perf_counter()
            result = runner.run("true", backend=name)
            into.append((time.perf_counter() - started) * 1000)
            assert result.ok, result
    return mine, hop


def throughput(runner: Runner, backend: str, items: int) -> tuple[float, collections.Counter[str]]:
    started = time.perf_counter()
    with runner.map(["print(1)"] * items, backend=backend, progress=False) as batch:
        done = list(batch)
    took = time.perf_counter() - started
    bad = [item for item in done if not item.ok]
    assert not bad, bad[:3]
    share = collections.Counter(node_of(item.result) for item in done) if backend == "ray" else collections.Counter()
    return took, share


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=4, help="CODE_EXEC_RAY_SLOTS_PER_NODE")
    parser.add_argument("--node-backend", default="bubblewrap")
    args = parser.parse_args()
    with local_cluster():
        total = NODES * args.slots
        options = {"ray": {"node_backend": args.node_backend, "slots_per_node": args.slots}}
        with Runner(Settings(backend="ray", max_concurrent=total), options=options) as remote, \
                Runner(Settings(backend=args.node_backend, max_concurrent=total)) as local:
            mine, hop = overhead(local, remote, args.node_backend, args.runs)
            print(f"one-shot `true` ({args.runs} interleaved runs): {args.node_backend} locally "
                  f"{statistics.median(mine):.1f} ms (p99 {p99(mine):.1f}), through ray "
                  f"{statistics.median(hop):.1f} ms "
                  f"(p99 {p99(hop):.1f}): the hop adds {statistics.median(hop) - statistics.median(mine):+.1f} ms")
            local_s, _ = throughput(local, args.node_backend, args.items)
            ray_s, share = throughput(remote, "ray", args.items)
            print(f"{args.items} one-shots `print(1)` via runner.map, {total} at once: {args.node_backend} locally "
                  f"{args.items / local_s:.1f} runs/s ({local_s:.1f} s); through ray over {NODES} nodes "
                  f"{args.items / ray_s:.1f} runs/s ({ray_s:.1f} s)")
            for label, count in sorted(share.items()):
                print(f"  node {label}: {count} runs, {count / ray_s:.1f} runs/s")


if __name__ == "__main__":
    main()
