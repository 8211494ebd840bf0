"""Checks of the claimed resource limits (memory, cpu, pids, disk), each pushed past its limit."""

from __future__ import annotations

from execbox import Limits
from execbox.testing.framework import Family, Kit, NotClaimed, expect, shown
from execbox.testing.probes import CPU_BURN_PROBE, DISK_FILL_PROBE, FORK_PROBE

family = Family()


@family.check("a claimed memory limit holds")
def check_memory_limit_holds(kit: Kit) -> None:
    kit.require(limit="memory")
    claim = "the memory limit (128 MiB)"
    result = kit.code("print('allocating', flush=True)\nb = bytearray(768 * 1024 * 1024)\nprint('survived')",
                      limits=Limits(memory_mb=128), timeout=20)
    expect("allocating" in result.stdout, claim, "the probe to start ('allocating')", shown(result))
    expect("survived" not in result.stdout and (result.exit_code != 0 or result.oom_killed), claim,
           "a 768 MiB allocation to fail or be killed", shown(result))


@family.check("a claimed cpu limit holds")
def check_cpu_limit_holds(kit: Kit) -> None:
    kit.require(limit="cpu")
    if kit.caps.remote:
        raise NotClaimed("a remote provider enforces CPU on its own hosts: not measurable from here")
    claim = "the cpu limit (0.5 CPU)"
    # Two busy processes for 2 s of wall time under a 0.5-CPU limit may use ~1 CPU-second; unthrottled on
    # two idle cores they would use ~4. (A busy machine can only make the unthrottled case look throttled.)
    result = kit.code(CPU_BURN_PROBE, limits=Limits(cpus=0.5), timeout=20)
    words = result.stdout.split()
    expect(result.exit_code == 0 and words[:1] == ["CPU"], claim, "the probe to report its CPU time", shown(result))
    used = float(words[1])
    # The positive signal: the busy children did run (and the measurement works).
    expect(used >= 0.2, claim, "the busy children to use some CPU (>= 0.2 CPU-seconds)", f"{used} CPU-seconds")
    expect(used < 1.6, claim, "under 1.6 CPU-seconds for 2 s at 0.5 CPU", f"{used} CPU-seconds")


@family.check("a claimed pids limit holds")
def check_pids_limit_holds(kit: Kit) -> None:
    kit.require(limit="pids")
    claim = "the pids limit (32)"
    result = kit.code(FORK_PROBE, limits=Limits(pids=32), timeout=15)
    words = result.stdout.split()
    expect(words[:1] == ["FORKED"] and len(words) == 3, claim, "the probe to report how many forks succeeded",
           shown(result))
    expect(int(words[1]) < 32 and words[2] != "never", claim, "fork to fail before 32 processes",
           f"{words[1]} forks, stopped by {words[2]}")


@family.check("a claimed disk limit holds")
def check_disk_limit_holds(kit: Kit) -> None:
    kit.require(limit="disk")
    claim = "the disk limit (16 MiB)"
    result = kit.code(DISK_FILL_PROBE, limits=Limits(disk_mb=16), timeout=30)
    words = result.stdout.split()
    expect(words[:1] == ["WROTE"] and len(words) == 3, claim, "the probe to report how much it wrote",
           shown(result))
    expect(words[2] in ("ENOSPC", "EDQUOT"), claim, "writing 64 MiB to fail with ENOSPC (or EDQUOT)",
           f"stopped by {words[2]} after {words[1]} bytes on disk")
    expect(int(words[1]) <= 17 << 20, claim, "at most 16 MiB (+1 MiB of slack) on disk",
           f"{words[1]} bytes on disk")
