"""llm-sandbox's one-shot `print(1)`: time to the result, and with its session closed. Run by bench_pool.py --peer
with the peer's own venv (llm-sandbox is never installed into the project's environment)."""

import json
import logging
import sys
import time

from llm_sandbox import SandboxSession


def one(image: str) -> tuple[float, float]:
    started = time.perf_counter()
    # skip_environment_setup: no venv and pip upgrade per session (those need the network; the peer's fastest path)
    with SandboxSession(lang="python", image=image, keep_template=True, verbose=False,
                        skip_environment_setup=True) as session:
        result = session.run("print(1)")
        returned = time.perf_counter()
        assert result.stdout.strip() == "1", result
    return (returned - started) * 1000, (time.perf_counter() - started) * 1000


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    image, runs = sys.argv[1], int(sys.argv[2])
    one(image)  # warm-up
    print(json.dumps([one(image) for _ in range(runs)]))
