"""What declared secrets cost (issue 17), side by side in one run:

    .venv/bin/python bench/bench_secret_injection.py [--runs 10] [--backend bubblewrap]

- the redactor alone: 1 MiB of text and of hex (the worst ordinary case: every position could begin a hex
  form), whole and streamed in 4 KiB chunks, with three secrets declared;
- a run that prints 1 MiB, without and with a secret (the capture redacts every byte);
- a short run, without a secret, with one, and with one 64 KiB secret (the wrapper reads its line byte by byte);
- secrets at egress need a TLS server of your own, so they are measured by tests, not here.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

from _common import median_ms  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox import Runner, Settings
from execbox.secrets.values import Redactor

KEY = "sk-proj-9fQ2xLm7Tz0aBcD3kP"
MIB = 1 << 20


def stream(redactor: Redactor, data: bytes) -> None:
    s = redactor.stream()
    for i in range(0, len(data), 4096):
        s.feed(data[i:i + 4096])
    s.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--backend", default="bubblewrap")
    args = parser.parse_args()

    redactor = Redactor({"A": KEY, "B": os.urandom(20).hex(), "C": "p@ss/word+with spaces&more=1"})
    text = (b"lorem ipsum dolor sit amet, consectetur adipiscing elit 0123456789 abcdef\n" * 15000)[:MIB]
    hexed = os.urandom(MIB // 2).hex().encode()
    for name, data in (("text", text), ("hex", hexed)):
        whole = median_ms(functools.partial(redactor.redact, data), args.runs)
        chunked = median_ms(functools.partial(stream, redactor, data), args.runs)
        print(f"redactor, 1 MiB of {name}: {whole:.1f} ms whole, {chunked:.1f} ms in 4 KiB chunks "
              f"(median of {args.runs})")

    network = "host" if args.backend == "local_subprocess" else "none"
    with Runner(Settings.from_env(local=args.backend == "local_subprocess")) as runner:
        def run(code: str, **kw: object) -> float:
            started = time.perf_counter()
            result = runner.run_code(code, backend=args.backend, network=network, **kw)
            assert result.exit_code == 0, result.stderr
            return (time.perf_counter() - started) * 1000

        big = "import sys; sys.stdout.write(('lorem ipsum dolor sit amet ' * 40 + '\\n') * 1000)"
        cases = [
            ("a run printing 1 MiB", big, {"max_output_bytes": 2 * MIB}, {"secrets": {"K": KEY}}),
            ("a short run", "print(1)", {}, {"secrets": {"K": KEY}}),
            ("a short run", "print(1)", {}, {"secrets": {"K": "x" * (64 << 10)}}),
        ]
        for label, code, base, extra in cases:
            # Interleaved pairs (without, with): the machine's drift cancels out of the paired difference.
            run(code, **base), run(code, **base, **extra)
            pairs = [(run(code, **base), run(code, **base, **extra)) for _ in range(args.runs)]
            size = len(next(iter(extra["secrets"].values())))  # type: ignore[attr-defined]
            print(f"{args.backend}: {label}: {statistics.median(a for a, _ in pairs):.0f} ms without, "
                  f"{statistics.median(b for _, b in pairs):.0f} ms with one {size}-byte secret; paired difference "
                  f"{statistics.median(b - a for a, b in pairs):+.1f} ms (median of {args.runs} pairs)")


if __name__ == "__main__":
    main()
