"""Moving a directory in and out of a sandbox, measured side by side in one run (the machine is shared and noisy:
compare ratios).

    .venv/bin/python bench/bench_files.py [--runs 5] [--megabytes 50] [--backends docker,bubblewrap]

For each backend, an open session and a tree of MEGABYTES of random files (20 files in nested directories):
- upload the tree, download it back (execbox: a tar on this host, walked with O_NOFOLLOW at every level,
  bounded before reading, extracted the same way);
- the same bytes copied with `cp -a` between two host directories (what a plain copy costs here);
- list_files of the tree, recursive;
- collect of the tree's files from a one-shot run (read back through the bounded read_file, into memory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from _common import median_ms  # bench/_common.py (run from the repo: python bench/NAME.py)

import execbox


def make_tree(root: Path, megabytes: int) -> None:
    size = megabytes * 1_000_000 // 20
    for i in range(20):
        sub = root / f"part{i % 4}" / f"chunk{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"blob{i}.bin").write_bytes(os.urandom(size))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--megabytes", type=int, default=50)
    parser.add_argument("--backends", default="docker,bubblewrap")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-files-", dir="/opt" if os.access("/opt", os.W_OK) else None))
    try:
        src = base / "src"
        make_tree(src, args.megabytes)
        counter = iter(range(10**6))

        def plain_copy() -> None:
            dest = base / f"cp{next(counter)}"
            subprocess.run(["cp", "-a", str(src), str(dest)], check=True)
            shutil.rmtree(dest)

        copy = median_ms(plain_copy, args.runs)
        print(f"host cp -a of {args.megabytes} MB: {copy:.0f} ms")
        for backend in args.backends.split(","):
            with execbox.sandbox(backend) as sb:
                up = median_ms(lambda: sb.upload(src, f"data{next(counter)}"), args.runs)
                sb.upload(src, "data")

                def down() -> None:
                    dest = base / f"down{next(counter)}"
                    sb.download("data", dest)
                    shutil.rmtree(dest)

                dl = median_ms(down, args.runs)
                ls = median_ms(lambda: sb.list_files("data", recursive=True), args.runs)
            one = median_ms(lambda b=backend: execbox.run(["true"], backend=b), args.runs)
            collected = median_ms(lambda b=backend: execbox.run(
                ["true"], backend=b, upload={str(src): "data"}, collect=["data/**"]), args.runs)
            print(f"{backend}: upload {up:.0f} ms (x{up / copy:.2f} of cp -a), download {dl:.0f} ms "
                  f"(x{dl / copy:.2f}), list_files -R {ls:.1f} ms; one-shot `true` {one:.0f} ms, with the tree "
                  f"uploaded and collected back {collected:.0f} ms")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
