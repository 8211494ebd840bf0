"""A real Ray cluster on this machine for the ray backend's tests: three nodes of one CPU each and a small object
store, started once and shut down when the module that uses it is done (also when a test failed). Module scope,
not session: the suite's other tests must not run beside three raylets, nor in a process connected to them (every
backend listing would then reach the cluster)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

NODES = 3
OBJECT_STORE_BYTES = 80 * 1024 * 1024


@contextlib.contextmanager
def local_cluster(nodes: int = NODES) -> Iterator[Any]:
    """A Ray cluster of ``nodes`` nodes on this machine, this process connected to it (ray.init); shut down on exit.
    The tests' fixture and bench/bench_ray.py start it alike."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@dataclass
class RayCluster:
    cluster: Any  # ray.cluster_utils.Cluster

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def workers(self) -> list[Any]:
        return list(self.cluster.worker_nodes)

    def add_node(self) -> Any:
        node = self.cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
        self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node: Any) -> None:
        self.cluster.remove_node(node, allow_graceful=False)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    pytest.importorskip("ray", reason="the ray extra is not installed: pip install 'execbox[ray]'")
    # the nodes' processes inherit this environment: no knob of the developer's shell reaches them
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(("CODE_EXEC_", "EXECBOX_"))}
    try:
        with local_cluster() as cluster:
            yield RayCluster(cluster)
    finally:
        os.environ.update(saved)
