"""The wallet-seed scan on hostile input: it must stay linear (goal: 1 MiB well under a second).

    .venv/bin/python bench/bench_secrets.py [--runs 10]

- one 1 MiB file mixing every kind of adversarial line below, read and scanned (what a local-mode run pays once
  per changed env file);
- each kind alone filling 1 MiB, to show the worst one: the line that stalled the old hex-key pattern for 23 s,
  runs of list words that never make a seed, tiny tokens, byte arrays that never close, base58 and hex runs
  one character off a key.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

from _common import median_ms  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox.guard import scan_text

MIB = 1 << 20
ADVERSARIAL = {
    "old hex-key killer": "A_KEY_" * 680 + "=" + "0" * 63,
    "repeated list words": "abandon ability " * 250,
    "ten distinct list words": "abandon ability able about above absent absorb abstract absurd abuse 7 " * 40,
    "tiny tokens": "a " * 2000,
    "numbering": "7. " * 1300,
    "unclosed byte array": "[" + "1," * 2000,
    "byte array of 65": "[" + "1," * 64 + "1]",
    "brackets": "[1" * 2000,
    "hex one short": ("PRIVATE_KEY=0x" + "ab" * 31 + "c ") * 50,
    "named hex hashes": ("TX_HASH=0x" + "ab" * 32 + " ") * 50,
    "base58 in base64": ("+" + "2" * 88) * 45,
    "one long token": "x" * 4000,
}


def filled(line: str) -> str:
    return (line + "\n") * (MIB // (len(line) + 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ".env.example"
        lines = list(ADVERSARIAL.values())
        text = "".join(lines[i % len(lines)] + "\n" for i in range(MIB // 2000))[:MIB]
        path.write_text(text[:text.rfind("\n") + 1])
        assert scan_text(path.read_text()) is None  # nothing to find: the whole file is scanned
        mixed = median_ms(lambda: scan_text(path.read_text()), args.runs)
    print(f"seed scan, 1 MiB of mixed adversarial lines: {mixed:.0f} ms — median of {args.runs}")

    for name, line in ADVERSARIAL.items():
        content = filled(line)
        print(f"  {name:<28} {median_ms(functools.partial(scan_text, content), args.runs):6.0f} ms / MiB")


if __name__ == "__main__":
    main()
