"""Turns the launching process into bwrap, set up so that everything bwrap starts inherits the limits.

Started by the bubblewrap backend as ``python -I -S _bwrap_launch.py KEY=VALUE... -- COMMAND...``; in this order it
sets the rlimits, moves itself into the run's cgroups, opens the files bwrap reads (argument list,
seccomp program, status), drops to the unprivileged host uid when started as root (so that even the
host kernel sees the sandbox as that uid, not as root), and execs bwrap with an empty environment.
Doing this in a fresh process, not in a ``preexec_fn``, keeps it out of execbox's own (threaded)
process. Standard library only, and few imports: it runs on every exec.

    rlimit=NAME:VALUE   resource.RLIMIT_NAME, soft = hard (repeatable)
    cgroup=PATH         a cgroup.procs file to write our pid to (repeatable)
    args=PATH           NUL-separated bwrap options (bwrap --args: environment values stay off the
                        command line); the command itself follows ``--`` on ours
    seccomp=PATH        compiled seccomp program for bwrap --seccomp
    status=PATH         file bwrap writes its JSON status to (child-pid once the sandbox exists)
    user=UID:GID        host identity to drop to (only when started as root)
    bwrap=PATH          the bwrap binary
"""

import os
import resource
import sys

EXIT_LAUNCH_FAILED = 125


def fail(message):
    os.write(2, f"execbox: bubblewrap launch failed: {message}\n".encode())
    os._exit(EXIT_LAUNCH_FAILED)


def main():
    rlimits, cgroups, opts = [], [], {}
    try:
        split = sys.argv.index("--")
        command = sys.argv[split + 1:]
        for item in sys.argv[1:split]:
            key, _, value = item.partition("=")
            if key == "rlimit":
                rlimits.append(value)
            elif key == "cgroup":
                cgroups.append(value)
            else:
                opts[key] = value
        for spec in rlimits:
            name, _, value = spec.partition(":")
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(value), int(value)))
        pid = str(os.getpid()).encode()
        for procs in cgroups:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        args_fd = os.open(opts["args"], os.O_RDONLY)
        seccomp_fd = os.open(opts["seccomp"], os.O_RDONLY)
        status_fd = os.open(opts["status"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd in (args_fd, seccomp_fd, status_fd):
            os.set_inheritable(fd, True)
        if "user" in opts:
            uid, _, gid = opts["user"].partition(":")
            os.setgroups([])
            os.setresgid(int(gid), int(gid), int(gid))
            os.setresuid(int(uid), int(uid), int(uid))
            if os.getuid() == 0 or os.geteuid() == 0:
                fail("still root after dropping privileges")
        argv = [opts["bwrap"], "--seccomp", str(seccomp_fd), "--json-status-fd", str(status_fd),
                "--args", str(args_fd), "--", *command]
        os.execve(opts["bwrap"], argv, {})
    except (OSError, KeyError, ValueError, AttributeError) as exc:
        fail(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
