"""bubblewrap: every exec in a fresh set of Linux namespaces made by ``bwrap``; no daemon, milliseconds.

The boundary, on every exec:

    namespaces     all unshared (user, pid, mount, ipc, uts, cgroup, and network unless 'host' is
                   asked for); a new session (no TIOCSTI into the caller's terminal); no new user
                   namespaces inside
    proxy          network mode proxy: the network namespace holds only loopback; the egress proxy
                   (kit/proxy/server.py) listens on a Unix socket bound read-only at /run/execbox, and a
                   forwarder run by the host's python3 in front of the command relays to it
    identity       uid/gid 1000 inside with no capabilities; when execbox runs as root the launcher
                   first drops to an unprivileged host uid with no groups (setpriv; CODE_EXEC_BWRAP_USER,
                   65534:65534), since bwrap started by root maps the sandbox user onto host root for
                   file access
    filesystem     an empty read-only root holding: /usr (and the /bin, /lib* links), the pieces of
                   /etc a program needs (no passwd/shadow of the host: a generated one), a fresh /proc
                   and /dev, /tmp and /dev/shm as size-limited tmpfs, and exactly one writable host
                   path, the session workspace, at /workspace. Never /home, /root, /run, host sockets
                   or the execbox install directory (masked when it lies under /usr)
    seccomp        ptrace, mounts, setns, keyrings, bpf, perf, userfaultfd, io_uring, new user
                   namespaces and kernel-module/kexec calls fail (kit/seccomp.py)
    limits         rlimits always (ulimit: no core dumps, 1 GiB files, CPU seconds); memory, pids and cpu
                   through a cgroup per exec where the host lets execbox create one (v1 or v2),
                   decided by ``check``: the capabilities report only what is enforced here; as
                   root, the workspace is a size-limited filesystem of its own (files.disk: the disk
                   limit, CODE_EXEC_DISK_MB), claimed only where ``check`` could mount one. A
                   one-shot's is mounted while its launcher starts, and bwrap waits at the launcher's
                   gate until it is; a sandbox's is mounted when it opens
    time           at the deadline the launcher's watcher kills bwrap's pid 1: its PID namespace dies with
                   every process in it, setsid and double-forked grandchildren included
    caller's death the launcher (launcher.py: a shell watcher, no interpreter) stays beside bwrap with
                   a parent-death signal: SIGKILL, SIGTERM or SIGHUP of execbox kills the sandbox at once,
                   also in the start-up window that bwrap --die-with-parent leaves open

A session is a directory ``execbox-bwrap-PID-STARTTIME-*`` in the temp dir (with an ``owner`` file,
kit.ownership) holding the workspace; it lives until ``close``; each exec is a new sandbox over it in a cgroup
``execbox-PID-STARTTIME-*``. What a killed execbox leaves (the directory, a mounted workspace, empty cgroups)
is removed by the first ``check`` of the next process that uses bubblewrap, and by `execbox gc`.

Modules: ``settings`` (CODE_EXEC_BWRAP_*), ``filesystem`` (what of the host is bound in, what never is),
``cgroups`` (a cgroup per exec: the plan, the run's, the sweep), ``launcher`` (the shell watcher and setpriv in
front of bwrap), ``report`` (what ``check`` found), ``probe`` (how it found it), ``session`` (the workspace and
each exec's sandbox), ``backend`` (check, sessions, the mounts, gc). The seccomp filter is the kit's
(``compiled_filter``).
"""
