"""The audit log's cost, measured side by side in one run (the machine is shared and noisy: compare the pairs).

    .venv/bin/python bench/bench_audit.py [--runs 40] [--backend local_subprocess]

- one run of `true` with the audit log off and on, interleaved (off, on, off, on, ...), median of each and of the
  per-pair difference: the cost a caller sees per run;
- one ``AuditLog.record`` of an exec-sized record: SHA-256 chain, HMAC chain, and the same without the
  fdatasync (to show what the durability costs).

The log goes to a fresh directory on the filesystem of the default state path (where the log lives by default, so
the disk sync is the real one), removed afterwards; never the real log.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from _common import median_ms  # bench/_common.py (run from the repo: python bench/NAME.py)

from execbox import Runner, Settings
from execbox.audit import fields as audit_fields
from execbox.audit import log as audit
from execbox.audit import reader as audit_reader
from execbox.config import paths

EXEC_FIELDS = {  # the shape of a real exec record
    "session": "0123456789abcdef", "oneshot": True, "backend": "local_subprocess", "started": audit_fields.now_iso(),
    "config": {"network": "none", "limits": {"memory_mb": 1024, "cpus": 1.0, "pids": 256, "disk_mb": 2048},
               "isolation": "container", "timeout": 30.0, "max_output_bytes": 100000,
               "image": "execbox-sandbox:bookworm"},
    "argv_sha256": "0" * 64, "env": {"passed": ["LANG"], "dropped": []}, "exit_code": 0, "timed_out": False,
    "oom_killed": False, "truncated": False, "duration_s": 0.01,
    "stdout": {"sha256": "1" * 64, "bytes": 12}, "stderr": {"sha256": "2" * 64, "bytes": 0}, "egress": [],
}


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--backend", default="local_subprocess")
    args = parser.parse_args()

    base = paths.state_dir().parent
    base.mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix="bench-audit-", dir=base))
    try:
        local = args.backend == "local_subprocess"
        common = {"backend": args.backend, "local": local, "network": "host" if local else "none"}
        off = Runner(Settings(audit_log="off", **common))
        on = Runner(Settings(audit_log=str(where / "runs.jsonl"), **common))
        for runner in (off, on):
            runner.run(["true"])  # warm-up
        pairs = [(timed(lambda: off.run(["true"])), timed(lambda: on.run(["true"]))) for _ in range(args.runs)]
        a = statistics.median(p[0] for p in pairs)
        b = statistics.median(p[1] for p in pairs)
        d = statistics.median(p[1] - p[0] for p in pairs)
        print(f"one run of `true` on {args.backend}: audit off {a:.2f} ms, audit on {b:.2f} ms, added "
              f"{d:+.2f} ms per run (median of {args.runs} interleaved pairs)")
        off.close()
        on.close()

        plain = audit.AuditLog(where / "plain.jsonl")
        keyed = audit.AuditLog(where / "keyed.jsonl", key=os.urandom(32))
        n = args.runs * 5
        sha_ms = median_ms(lambda: plain.record("exec", **EXEC_FIELDS), n)
        hmac_ms = median_ms(lambda: keyed.record("exec", **EXEC_FIELDS), n)
        with mock.patch.object(os, "fdatasync", lambda fd: None):
            nosync_ms = median_ms(lambda: plain.record("exec", **EXEC_FIELDS), n)
        print(f"AuditLog.record (exec-sized record, {(where / 'plain.jsonl').stat().st_size // (2 * n + 2)} bytes): "
              f"sha256 chain {sha_ms * 1000:.0f} us, hmac chain {hmac_ms * 1000:.0f} us, without fdatasync "
              f"{nosync_ms * 1000:.0f} us (median of {n})")
        assert audit_reader.verify(where / "plain.jsonl").ok and audit_reader.verify(where / "runs.jsonl").ok
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
