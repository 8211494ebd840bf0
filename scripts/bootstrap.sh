#!/usr/bin/env bash
# Prepare a Debian 12 machine for execbox's real-engine tests: install the Debian packages the
# backends need (only when missing), start dockerd when no engine answers, install gVisor (runsc)
# and register it in the engine as the runtime "runsc" with the arguments this host needs
# (scripts/gvisor_setup.py probes them), and optionally build the sandbox image. Idempotent; a
# second run takes about a second.
#
#   scripts/bootstrap.sh            packages + dockerd + gVisor
#   scripts/bootstrap.sh --image    also build the sandbox image when it is missing
#
# Environment: EXECBOX_PYTHON (interpreter with execbox installed; default: the repo's .venv),
# DOCKERD_LOG (default /var/log/execbox-dockerd.log), DOCKERD_WAIT (seconds, default 60).
set -euo pipefail

say() { printf 'bootstrap: %s\n' "$*"; }
die() { printf 'bootstrap: error: %s\n' "$*" >&2; exit 1; }

want_image=0
for arg in "$@"; do
    case "$arg" in
        --image) want_image=1 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) die "unknown argument '$arg' (try --help)" ;;
    esac
done

repo_dir="$(cd "$(dirname "$0")/.." && pwd)"
is_root=0; [ "$(id -u)" -eq 0 ] && is_root=1

# --- 1. Debian packages -------------------------------------------------------------------
# docker.io pulls in containerd, runc, tini (docker-init) and iptables; uidmap is for rootless
# tools; openssh-server for the ssh backend's tests; bubblewrap and debootstrap speak for themselves.
packages=(docker.io iptables uidmap openssh-server bubblewrap libseccomp2 debootstrap ca-certificates)
missing=()
for p in "${packages[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)"
    [ "$status" = "install ok installed" ] || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
    if [ $is_root -eq 0 ]; then
        die "missing Debian packages: ${missing[*]}. Run as root:
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}
or run this script with sudo."
    fi
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1
    apt-get update -q >/dev/null
    # policy-rc.d: without systemd, package scripts must not try to start services; we start
    # dockerd ourselves below, and the ssh tests run their own sshd.
    policy=/usr/sbin/policy-rc.d; made_policy=0
    if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; made_policy=1; fi
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null || {
        [ $made_policy -eq 1 ] && rm -f "$policy"; die "apt-get install failed (rerun it to see why)"; }
    [ $made_policy -eq 1 ] && rm -f "$policy"
else
    say "packages present"
fi

# --- 2. Docker engine ----------------------------------------------------------------------
engine_answers() { timeout 10 docker info >/dev/null 2>&1; }

if engine_answers; then
    say "docker engine answers ($(docker info --format '{{.ServerVersion}} {{.Driver}}' 2>/dev/null))"
else
    # Only a local engine can be started from here; a remote DOCKER_HOST is the user's to fix.
    case "${DOCKER_HOST:-unix:///var/run/docker.sock}" in
        unix:///var/run/docker.sock|unix:///run/docker.sock) ;;
        *) die "DOCKER_HOST=$DOCKER_HOST does not answer; start that engine, or unset DOCKER_HOST to use a local one" ;;
    esac
    if [ -n "${DOCKER_CONTEXT:-}" ] && [ "$DOCKER_CONTEXT" != default ]; then
        die "docker context '$DOCKER_CONTEXT' does not answer; start that engine, or unset DOCKER_CONTEXT"
    fi
    if [ $is_root -eq 0 ]; then
        sock=/var/run/docker.sock
        if [ -S $sock ] && [ ! -w $sock ]; then
            die "$sock exists but you may not use it: sudo usermod -aG docker $(id -un) (then log in again), or run as root"
        fi
        die "no docker engine answers and starting dockerd needs root. Run:
    sudo $0"
    fi

    log="${DOCKERD_LOG:-/var/log/execbox-dockerd.log}"
    args=()
    # overlay2 needs the overlay filesystem; without it fall back to vfs explicitly (slow, but works).
    if ! grep -qw overlay /proc/filesystems && ! modprobe overlay 2>/dev/null; then
        say "no overlay filesystem: using storage driver vfs"
        args+=(--storage-driver=vfs)
    fi
    # Debian defaults to iptables-nft; when the kernel has no nf_tables, legacy may still work.
    if ! iptables -t nat -L -n >/dev/null 2>&1; then
        if iptables-legacy -t nat -L -n >/dev/null 2>&1; then
            say "iptables-nft unusable: switching to iptables-legacy"
            update-alternatives --set iptables /usr/sbin/iptables-legacy >/dev/null
            update-alternatives --set ip6tables /usr/sbin/ip6tables-legacy >/dev/null
        else
            say "no working iptables: starting dockerd with --iptables=false (egress network has no NAT)"
            args+=(--iptables=false)
        fi
    fi
    # cgroups: dockerd needs a mounted hierarchy (v1 or v2); no systemd here, so cgroupfs driver.
    [ -d /sys/fs/cgroup/memory ] || [ -f /sys/fs/cgroup/cgroup.controllers ] || \
        die "no cgroup hierarchy is mounted at /sys/fs/cgroup; mount one (apt-get install cgroupfs-mount && cgroupfs-mount)"

    # A pid file left by a dockerd that died makes the next one refuse to start.
    if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
        rm -f /var/run/docker.pid
    fi
    say "starting dockerd${args[*]:+ ${args[*]}} (log: $log)"
    setsid nohup /usr/sbin/dockerd "${args[@]}" >>"$log" 2>&1 </dev/null &
    pid=$!
    wait_s="${DOCKERD_WAIT:-60}"
    deadline=$((SECONDS + wait_s))
    until engine_answers; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 15 "$log" >&2 || true
            die "dockerd exited during start-up; its log is $log (last lines above)"
        fi
        [ $SECONDS -lt $deadline ] || { tail -n 15 "$log" >&2 || true
            die "dockerd (pid $pid) did not answer within ${wait_s}s; see $log"; }
        sleep 0.5
    done
    say "docker engine up ($(docker info --format '{{.ServerVersion}} {{.Driver}}' 2>/dev/null), pid $pid)"
fi

# --- 3. gVisor ------------------------------------------------------------------------------
# Optional: a distribution without the runsc package still gets the other engines; the tests that
# need gVisor then skip with this reason (and fail under EXECBOX_REQUIRE_ENGINES / CI).
if [ "$(dpkg-query -W -f='${Status}' runsc 2>/dev/null || true)" != "install ok installed" ] && \
        ! command -v runsc >/dev/null; then
    if [ $is_root -eq 0 ]; then
        say "gVisor is not installed: as root, apt-get install runsc, then run this script again"
    elif apt-cache show runsc >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-cache show runsc >/dev/null 2>&1; }; then
        say "installing runsc (gVisor)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends runsc >/dev/null || \
            say "apt-get install runsc failed (rerun it to see why); gVisor tests will skip"
    else
        say "this distribution has no runsc package: install gVisor from https://gvisor.dev/docs/user_guide/install/"
    fi
fi
if command -v runsc >/dev/null && [ $is_root -eq 1 ]; then
    gv_py="${EXECBOX_PYTHON:-}"
    [ -n "$gv_py" ] && [ -x "$gv_py" ] || gv_py="$(command -v python3 || true)"
    if [ -z "$gv_py" ]; then
        say "no python3 to register gVisor with: apt-get install python3, then run this script again"
    else
        "$gv_py" "$repo_dir/scripts/gvisor_setup.py" || say "gVisor is not registered (see above); gVisor tests will skip"
    fi
fi

# --- 4. Sandbox image (optional) ---------------------------------------------------------
if [ $want_image -eq 1 ]; then
    py="${EXECBOX_PYTHON:-$repo_dir/.venv/bin/python}"
    [ -x "$py" ] || die "no Python with execbox at $py; set EXECBOX_PYTHON or create the venv"
    "$py" -m execbox.backends.docker.image build
fi
say "done"
