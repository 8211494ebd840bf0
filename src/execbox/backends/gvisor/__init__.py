"""gvisor: every sandbox a gVisor user-space kernel run directly by ``runsc``, with no daemon (as bubblewrap runs).

The boundary of a sandbox (one per session; a one-shot is a session of one exec):

    kernel         the code's system calls are served by gVisor's Sentry (platform ptrace; kvm or systrap by
                   CODE_EXEC_GVISOR_PLATFORM, a start that hangs given up after CODE_EXEC_GVISOR_START_TIMEOUT_S),
                   never by the host kernel; runsc's own seccomp filters confine the Sentry and its gofer; every
                   command first loads the shared deny list (the kit's compiled_filter, bound in read-only):
                   runsc 20221219's exec does not apply a container's OCI filter to an exec'd process
    network        none: a loopback-only network stack (runsc --network=none); proxy: the egress proxy's
                   directory (kit/proxy/server.py) bound read-only at /run/execbox and its Unix socket opened
                   through runsc --host-uds=open, a forwarder run by the image's python3 in front of the command
                   relaying to it (as bubblewrap does); host is not offered
    identity       65534:65534 inside (CODE_EXEC_GVISOR_USER) with no capabilities and no_new_privs. Without
                   root: runsc --rootless --ignore-cgroups, whose user namespace maps only the caller's uid, to
                   0 inside: the code runs as uid 0 of gVisor's kernel with no capabilities, the caller's uid on
                   the host (the conformance kit's "not root" check says so); no memory or disk limit then
    filesystem     the root filesystem read-only (the sandbox image exported once: rootfs.py), /tmp a sized
                   tmpfs, and one writable host path, the session's workspace, at /workspace
    limits         rlimits (CPU seconds, 1 GiB files, no core dumps); memory through runsc's cgroup
                   (linux.resources of the OCI spec) as root: over it the OOM killer takes the whole Sentry, so
                   that command is killed (137) and the session is gone; the disk limit as a size-limited
                   workspace as root. Not claimed: cpu (a cfs quota on runsc's cgroup did not throttle the code
                   here), pids (a host pids cgroup counts the Sentry's threads: a limit of 64 killed the sandbox)
    time           at a deadline every process of the sandbox user but init is SIGKILLed inside (kill -9 -1);
                   init (a python3 loop of the image's) reaps the orphans a session's commands leave
    caller's death ``runsc run`` stays attached behind the kit's reaper, whose parent-death signal kills runsc
                   and its sandbox when execbox dies, however it dies
    output         runsc exec's stdout and stderr are Unix sockets: gVisor's writes to a full host pipe come
                   back short, and a writer that does not retry (python -u) loses the rest

A session is a directory ``execbox-gvisor-PID-STARTTIME-*`` under ``state_dir()/gvisor/sessions`` holding its
OCI bundle (``config.json`` built here), runsc's state (``--root``) and the workspace; a sandbox's cgroup is
named after it. What a killed execbox leaves (the directory, empty cgroups, a half-made export) is removed by
the next process's first ``check`` and by `execbox gc`. The root filesystem lives in
``state_dir()/gvisor/rootfs/<image id>`` (~3 s and 158 MB for the default image, made once).

Modules: ``settings`` (CODE_EXEC_GVISOR_*), ``rootfs`` (the cached root filesystem), ``session`` (the bundle,
runsc run / exec / delete), ``backend`` (check, sessions, gc).
"""
