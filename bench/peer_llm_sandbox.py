"""llm-sandbox's one-shot `print(1)`: time to the result, and with its session closed (bench environment only)."""
import json, logging, sys, time
logging.disable(logging.CRITICAL)
from llm_sandbox import SandboxSession
image, runs = sys.argv[1], int(sys.argv[2])
def one() -> tuple[float, float]:
    started = time.perf_counter()
    with SandboxSession(lang="python", image=image, keep_template=True, verbose=False, skip_environment_setup=True) as s:
        r = s.run("print(1)")
        result = time.perf_counter()
        assert r.stdout.strip() == "1", r
    return (result - started) * 1000, (time.perf_counter() - started) * 1000
one()
print(json.dumps([one() for _ in range(runs)]))
