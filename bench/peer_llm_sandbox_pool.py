"""llm-sandbox's documented pooled runner: N `print(1)` runs, one thread per slot, each through a
PooledSandboxSession of one pool (create_pool_manager; its containers are reused across runs). Run by
bench_batch.py --peer with the peer's own venv (llm-sandbox is never installed into the project's environment)."""

import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from llm_sandbox.pool import PoolConfig, PooledSandboxSession, create_pool_manager


def main() -> None:
    logging.disable(logging.CRITICAL)
    image, items, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # skip_environment_setup: no venv and pip upgrade per container (those need the network; the peer's fastest path)
    pool = create_pool_manager(backend="docker", config=PoolConfig(max_pool_size=slots, min_pool_size=slots),
                               lang="python", image=image, skip_environment_setup=True, keep_template=True)

    def one(_: int) -> float:
        started = time.perf_counter()
        with PooledSandboxSession(pool_manager=pool) as session:
            result = session.run("print(1)")
        assert result.stdout.strip() == "1", result
        return (time.perf_counter() - started) * 1000

    with ThreadPoolExecutor(slots) as threads:
        list(threads.map(one, range(slots)))  # warm-up: the pool is filled and each container used once
        started = time.perf_counter()
        times = list(threads.map(one, range(items)))
        wall = time.perf_counter() - started
    pool.close()
    print(json.dumps({"wall_s": wall, "times_ms": times}))


if __name__ == "__main__":
    main()
