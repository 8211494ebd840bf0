"""docker: every run in a hardened container on a real Docker engine (docker-py, extra ``docker``).

The boundary, on every container, with no knob that turns a part of it off:

    network        none by default; egress = a bridge network execbox created and labelled, with no traffic
                   between its containers (any other network is refused); proxy = no network at all, the
                   egress proxy's Unix socket bound read-only at /run/execbox (kit/proxy/server.py); host only on
                   request, and then the guard is told this is not a sandbox
    capabilities   all dropped; no-new-privileges; never --privileged, host PID/IPC/UTS/user/cgroup namespace,
                   added caps or devices
    seccomp        execbox's own profile: the deny list bubblewrap uses too (policy/seccomp.py)
    filesystem     read-only root; /tmp a size-limited tmpfs; exactly one writable host path, the
                   session workspace, at /workspace (size-limited where execbox runs as root); never the
                   Docker socket, $HOME or execbox itself
    limits         pids 256, memory 1024 MiB with no swap headroom, 1.0 CPU, disk 2048 MiB (CODE_EXEC_* settings)
    user           the caller's uid:gid, or 65534:65534 when execbox runs as root; another uid
                   (CODE_EXEC_DOCKER_USER) only as root, so the workspace is never open to other local users
    runtime        runc, crun, gVisor or kata only, named in CODE_EXEC_DOCKER_RUNTIME or the engine's default
    init           docker-init as PID 1: signals are delivered and zombies reaped
    deadline       on the host, and inside (coreutils timeout, a keep-alive bounded by the session lifetime),
                   so a run ends even when its caller was killed

The table is checked twice: on the create arguments (``hardening.hardened``), and on the container as the
engine built it (``hardening.built_problems``); a container that differs is removed before it runs.

Modules: ``engine`` (which engine, connect), ``hardening`` (the table, the inspect check, the seccomp profile,
the runtimes admitted), ``stream`` (attach/exec sockets into bounded captures), ``session`` (one-shot runs and
persistent sessions, the workspace, the backstop), ``backend`` (settings, check, verdict, gc), ``image`` (the
sandbox image built from Debian packages, no registry).
"""
