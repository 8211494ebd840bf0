"""Issue 28's figures: gVisor against runc, and the daemonless gvisor backend against a bare `runsc do`, side by
side in one run on the same image (the machine is shared and noisy: compare ratios).

    .venv/bin/python bench/bench_gvisor.py [--runs 20] [--job-runs 3] [--runtime runsc] [--readme]

- the docker backend with its runtime the engine's runc / the gVisor registration --runtime (what
  CODE_EXEC_DOCKER_RUNTIME names; default: that variable, else runsc, the name the set-up registers): a one-shot
  `true`; then in a session open under each: `true`, `python3 -c 'import json'`, 1000 fork+exec of /bin/true, and
  10k small files written, read back and removed, in the workspace (a host directory bound in: gVisor's gofer
  serves it) and in /tmp (each job one exec: the figure includes the exec's own cost, the session `true` row);
- the daemonless `gvisor` backend (runsc without an engine): a one-shot `true` and a session exec `true`, against
  a bare `runsc do` of `true` with the backend's network and platform flags, in its root filesystem (made from the
  same image; no workspace, no cgroup limits, no uid drop, no seccomp deny list, no output capture: what runsc
  itself costs). Without that backend installed, its rows say so.
Every figure's configurations are interleaved run by run, each round starting one configuration later. Before it
is timed, each configuration shows the kernel its code sees: gVisor's (4.4.0 here) is not the host's, so a gVisor
row cannot silently be a runc one. --readme rewrites the README rows between the bench:gvisor markers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator

from _common import p99, write_readme  # bench/_common.py (run from the repo: python bench/NAME.py)
from bench_pool import interleaved, med

from execbox import ExecboxError, Runner, Settings
from execbox.backends.docker import image as docker_image
from execbox.registry import get_registry

Rows = list[tuple[str, str]]
FORKS = "i=0; while [ $i -lt 1000 ]; do /bin/true; i=$((i+1)); done"
FILES = ("mkdir gvbench && cd gvbench && i=0; while [ $i -lt 10000 ]; do echo $i > $i; i=$((i+1)); done; "
         "cat * > /dev/null; cd .. && rm -rf gvbench")
JOB_TIMEOUT = 300  # seconds: 10k files in the workspace take gVisor ~35 s here (the runner's default cap is 30)
# (label, command, workdir (None: the workspace), heavy): a heavy job runs --job-runs times, the rest --runs times.
SESSION_JOBS: list[tuple[str, str, str | None, bool]] = [
    ("session exec `true`", "true", None, False),
    ("`python3 -c 'import json'` in a session", "python3 -c 'import json'", None, False),
    ("1000 fork+exec of `/bin/true` in a session", FORKS, None, True),
    ("10k small files written, read back and removed in the workspace, in a session", FILES, None, True),
    ("the same 10k files in /tmp (a tmpfs: under gVisor it lives in the Sentry, no gofer)", FILES, "/tmp", True),
]


def ok(result: object) -> None:
    """A timed run that failed would time something else: stop there."""
    assert getattr(result, "exit_code", None) == 0, result


def kernel(run: Callable[[str], object]) -> str:
    result = run("uname -r")
    ok(result)
    return str(getattr(result, "stdout", "")).strip()


def registration(name: str) -> str:
    """The engine's entry for runtime ``name``: its binary and arguments (which platform, which network)."""
    if not shutil.which("docker"):  # a host without an engine: the daemonless rows are still measured
        return "no docker CLI here"
    done = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True,
                          check=False)
    entry = (json.loads(done.stdout) if done.returncode == 0 else {}).get(name) or {}
    return " ".join([entry.get("path", "?"), *entry.get("runtimeArgs", [])])


def figure(samples: dict[str, list[float]], first: str, second: str) -> str:
    a, b = med(samples[first]), med(samples[second])
    return f"{a:.0f} / {b:.0f} ms (x{b / a:.2f}); p99 {p99(samples[first]):.0f} / {p99(samples[second]):.0f} ms"


def show(label: str, samples: dict[str, list[float]], first: str, second: str) -> None:
    print(f"  {label:<86} {first} / {second}: {figure(samples, first, second)}")


def docker_figures(runtime: str, runs: int, job_runs: int, rows: Rows) -> None:
    settings = Settings.from_env(backend="docker", max_timeout_sec=JOB_TIMEOUT)
    with Runner(settings, options={"docker": {"runtime": "runc"}}) as runc, \
            Runner(settings, options={"docker": {"runtime": runtime}}) as gvisor:
        measure_docker({"runc": runc, "gVisor": gvisor}, runtime, runs, job_runs, rows)


def measure_docker(runners: dict[str, Runner], runtime: str, runs: int, job_runs: int, rows: Rows) -> None:
    host = os.uname().release
    what = f"docker, runc / gVisor ({runtime}: {registration(runtime)})"
    try:
        seen = {name: kernel(lambda c, r=runner: r.run(c)) for name, runner in runners.items()}
    except ExecboxError as exc:  # the engine, or this registration, refused: say why and measure the rest
        print(f"{what}: not measured ({exc})")
        rows.append((f"{what}: every figure", f"not measured: {exc}"))
        return
    assert seen["runc"] == host and seen["gVisor"] != host, f"host kernel {host}, the sandboxes saw {seen}"
    print(f"{what}; kernel seen: runc {seen['runc']} (the host's), gVisor {seen['gVisor']}")
    got = interleaved({name: lambda r=runner: ok(r.run("true")) for name, runner in runners.items()}, runs)
    show("one-shot `true`", got, "runc", "gVisor")
    rows.append((f"{what}: one-shot `true`", figure(got, "runc", "gVisor")))
    with runners["runc"].sandbox("docker") as plain, runners["gVisor"].sandbox("docker") as gvisor:
        sessions = {"runc": plain, "gVisor": gvisor}
        for label, command, workdir, heavy in SESSION_JOBS:
            got = interleaved({name: lambda s=sb, c=command, w=workdir: ok(s.exec(c, workdir=w, timeout=JOB_TIMEOUT))
                               for name, sb in sessions.items()}, job_runs if heavy else runs)
            show(label, got, "runc", "gVisor")
            rows.append((f"docker, runc / gVisor: {label}", figure(got, "runc", "gVisor")))


@contextlib.contextmanager
def image_rootfs(given: str | None) -> Iterator[str]:
    """The root the bare `runsc do` runs in: the backend's own root filesystem when it names one, else the sandbox
    image's files exported into a temporary directory (the same image)."""
    if given:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="execbox-gvbench-") as root:
        made = subprocess.run(["docker", "create", docker_image.DEFAULT_TAG, "true"], capture_output=True, text=True,
                              check=True).stdout.strip()
        try:
            subprocess.run(["sh", "-c", f"docker export {shlex.quote(made)} | tar -x -C {shlex.quote(root)}"],
                           check=True)
        finally:
            subprocess.run(["docker", "rm", made], capture_output=True, check=False)
        yield root


def bare_runsc(root: str, platform: str) -> list[str]:
    """`true` in gVisor with no engine and nothing of execbox, with the backend's runsc flags (no network, its
    platform; rootless when not root): the image's files under runsc do's tmpfs overlay, nothing reaches the host."""
    rootless = [] if os.geteuid() == 0 else ["--rootless", "--ignore-cgroups"]
    return ["runsc", *rootless, "--network=none", f"--platform={platform}", "do", "-quiet", "-root", root, "-cwd",
            "/", "--", "/bin/true"]


def daemonless_figures(runs: int, rows: Rows) -> None:
    what = "daemonless: bare `runsc do` / the gvisor backend"
    if "gvisor" not in get_registry().names():
        reason = "no backend named gvisor is installed here"
        print(f"{what}: not measured ({reason})")
        rows.append((f"{what}: one-shot `true`", f"not measured: {reason}"))
        return
    with Runner(Settings.from_env(backend="gvisor")) as runner:
        measure_daemonless(runner, what, runs, rows)


def measure_daemonless(runner: Runner, what: str, runs: int, rows: Rows) -> None:
    try:
        seen = kernel(lambda c: runner.run(c))
    except ExecboxError as exc:
        print(f"{what}: not measured ({exc})")
        rows.append((f"{what}: one-shot `true`", f"not measured: {exc}"))
        return
    assert seen != os.uname().release, f"the gvisor backend's code saw the host's kernel {seen}"
    details = runner.aio.backend("gvisor").details()  # what its check found: the platform, the root filesystem
    platform = str(details.get("platform") or "ptrace")
    with image_rootfs(details.get("rootfs")) as root:
        argv = bare_runsc(root, platform)
        got = interleaved({"bare": lambda: subprocess.run(argv, check=True, timeout=60, capture_output=True),
                           "execbox": lambda: ok(runner.run("true"))}, runs)
    print(f"{what} (platform {platform}); kernel seen {seen}; bare: {shlex.join(argv)}")
    show("one-shot `true`", got, "bare", "execbox")
    rows.append((f"{what} (platform {platform}): one-shot `true`", figure(got, "bare", "execbox")))
    with runner.sandbox("gvisor") as sb:
        session = interleaved({"execbox": lambda: ok(sb.exec("true"))}, runs)["execbox"]
    print(f"  session exec `true`: median {med(session):.0f} ms, p99 {p99(session):.0f} ms")
    rows.append(("the gvisor backend: session exec `true` (runsc do has no sessions)",
                 f"{med(session):.0f} ms; p99 {p99(session):.0f} ms"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20, help="runs of each light figure (one-shots, `true`, json)")
    parser.add_argument("--job-runs", type=int, default=3, help="runs of the fork- and file-heavy jobs")
    parser.add_argument("--runtime", default=os.environ.get("CODE_EXEC_DOCKER_RUNTIME") or "runsc",
                        help="the engine's gVisor registration (CODE_EXEC_DOCKER_RUNTIME for the gVisor figures)")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's rows for these figures")
    args = parser.parse_args()
    version = subprocess.run(["runsc", "--version"], capture_output=True, text=True, check=False).stdout
    print(f"median / p99 of {args.runs} runs ({args.job_runs} for the heavy jobs), interleaved; "
          f"{version.splitlines()[0] if version else 'runsc: not found'}; host kernel {os.uname().release}")
    rows: Rows = []
    docker_figures(args.runtime, args.runs, args.job_runs, rows)
    daemonless_figures(args.runs, rows)
    if args.readme:
        write_readme("gvisor", rows, f"`.venv/bin/python bench/bench_gvisor.py --runs {args.runs} --job-runs "
                                     f"{args.job_runs} --runtime {args.runtime} --readme`")


if __name__ == "__main__":
    main()
