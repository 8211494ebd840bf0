"""The command line that starts bwrap with the run's limits and keeps a watcher beside it, so that nothing it
starts outlives the caller. No interpreter: a POSIX shell and util-linux's ``setpriv`` (a Python launcher cost
every exec ~20 ms, most of it the interpreter and ctypes; this costs ~2 ms).

    caller ─ setpriv --pdeathsig TERM ─ sh WATCHER           (resident: the watcher, a process group leader)
                                          └ sh (subshell, ulimit) ─ setpriv [uid drop] --pdeathsig KILL
                                                                  ─ sh CHECK ─ bwrap (the monitor) ─ bwrap's pid 1 ...

The watcher (``WATCHER``) learns of the caller's death through its parent-death signal (SIGTERM, set by
setpriv before the shell starts; a caller already gone by then is seen in ``$PPID`` and nothing is started).
Its child, a subshell, moves itself into the run's cgroups, sets the rlimits (the shell's ``ulimit``, soft =
hard; a prlimit exec cost ~1 ms), opens the files bwrap reads (argument list, seccomp program, status) and
becomes, through a chain of execs that keep its pid: setpriv (as root: drops to the unprivileged host uid
with no groups, so that even the host kernel sees the sandbox as that uid; always: parent-death signal
SIGKILL, asked for after the uid change, which would clear it), a check that the watcher is still its parent
(else it exits before bwrap starts), the gate (``GATE``, the caller's first line on stdin: bwrap's workspace,
made while all this started, is ready), and bwrap with an empty-but-PATH environment.

Why the watcher stays instead of the shell becoming bwrap: ``bwrap --die-with-parent`` leaves a window.
bwrap's pid 1 asks for its parent-death signal only once it has set the sandbox up; a monitor killed before
that leaves a sandbox that nobody will ever kill. So on its parent-death signal, on SIGTERM (the deadline)
and on SIGHUP/SIGINT, the watcher stops the monitor (a stopped process reaps nothing: the pids it reads
stay its children's; it waits until the stop has landed, since a monitor inside clone() may still make bwrap's
pid 1), SIGKILLs the monitor's children (bwrap's pid 1: its PID namespace dies with every
process in it, setsid and double-forked ones included), the monitor and whatever is still in the run's
cgroups, and exits 128+signal. When the
monitor ends by itself, bwrap's pid 1 has its parent-death signal and dies with it; what bwrap left before
its sandbox existed (a pid 1 never released by a monitor that failed) is still in the watcher's process
group, and gets SIGTERM there (the watcher ignores it). ``run_process`` starts the watcher as a new
session, which the watcher checks: the group is its own.

The watcher's arguments: ``CALLER_PID ARGS_FILE SECCOMP_FILE STATUS_FILE N CGROUP_PROCS*N L LIMIT*L -- CHAIN...``,
a LIMIT being ``ulimit``'s option letter, ``=``, and the value in its POSIX units (``ULIMIT_UNITS``).
"""

from __future__ import annotations

from collections.abc import Sequence

EXIT_LAUNCH_FAILED = 125
# The launcher's tools, looked up on this PATH only (by the backend's check): what a root process runs must not
# come from the caller's PATH.
TOOLS_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
LAUNCH_TOOLS = ("sh", "setpriv")
# ulimit's option letters the launcher sets -> the bytes (or seconds) of one unit, as POSIX shells count them
# (dash, bash as sh, busybox); the backend's check confirms them against the shell it runs.
ULIMIT_UNITS = {"c": 512, "f": 512, "t": 1, "v": 1024}
# The variable that carries the watcher's pid to CHECK (bwrap clears the sandbox's environment itself).
_WATCHER_VAR = "EXECBOX_BWRAP_WATCHER"

# The watcher's functions, apart so that a test can run them.
FUNCTIONS = r"""
fail() { echo "execbox: bubblewrap launch failed: $*" >&2; exit 125; }
stat_of() {  # stat_of FILE: pid, ppid and process group from a /proc/PID/stat (the name may hold anything)
    st=; read -r st < "$1" 2>/dev/null || [ -n "$st" ] || return 1
    spid=${st%% *}
    set -- ${st##*) }
    sstate=$1 sppid=$2 spgrp=$3
}
children() {  # children of $1, zombies included (CONFIG_PROC_CHILDREN, else scan_children)
    if [ -e "/proc/$1/task/$1/children" ]; then
        kids=; read -r kids < "/proc/$1/task/$1/children"; echo "$kids"; return
    fi
    scan_children "$1"
}
scan_children() {  # every process whose parent is $1
    for s in /proc/[0-9]*/stat; do
        stat_of "$s" && [ "$sppid" = "$1" ] && echo "$spid"
    done
    return 0
}
stop() {
    trap '' TERM HUP INT
    # Only while the monitor is still our unreaped child: stopped, it reaps nothing, so the pids of its
    # children cannot be reused before they are killed.
    if [ -n "$child" ] && stat_of "/proc/$child/stat" && [ "$sppid" = "$$" ]; then
        kill -STOP "$child" 2>/dev/null
        # SIGSTOP lands when the monitor leaves the kernel: inside clone() it may still make bwrap's pid 1, which
        # has no parent-death signal yet. So its children are listed once it has stopped (or died), ~1 s at most.
        tries=0
        while stat_of "/proc/$child/stat" && [ "$sstate" != T ] && [ "$sstate" != t ] && [ "$sstate" != Z ] \
                && [ "$tries" -lt 300 ]; do
            tries=$((tries + 1))
            [ "$tries" -gt 200 ] && sleep 0.01
        done
        kill -KILL $(children "$child") "$child" 2>/dev/null
    fi
    # And whatever is still in the run's cgroups (every process of the sandbox is; the watcher is not).
    IFS='
'
    for procs in $cgroups; do
        while read -r p; do kill -KILL "$p" 2>/dev/null; done < "$procs"
    done
    kill -TERM 0 2>/dev/null
    exit $((128 + $1))
}
cgroups_of() {  # the watcher's arguments -> $cgroups, the files listing the run's processes, one a line
    shift 4
    k=$1 cgroups=
    shift
    while [ "$k" -gt 0 ]; do
        cgroups="$cgroups$1
"
        k=$((k - 1))
        shift
    done
}
"""

WATCHER = FUNCTIONS + r"""
child=
trap 'stop 15' TERM
trap 'stop 1' HUP
trap 'stop 2' INT
[ "$PPID" = "$1" ] || exit 125
cgroups_of "$@"
stat_of /proc/self/stat && [ "$spgrp" = "$$" ] || fail "the watcher must lead its own process group"
exec 9<&0
(
    exec 0<&9 9<&-
    stat_of /proc/self/stat || fail "cannot read /proc/self/stat"
    self=$spid args=$2 seccomp=$3 status=$4 n=$5
    shift 5
    while [ "$n" -gt 0 ]; do
        case $1 in  # v1's tasks file takes 0, the writer itself: no global lock, no RCU grace period (~10 ms)
            */tasks) echo 0 > "$1" ;;
            *) echo "$self" > "$1" ;;
        esac || fail "cannot join the cgroup $1"
        n=$((n - 1))
        shift
    done
    n=$1
    shift
    while [ "$n" -gt 0 ]; do  # soft and hard, as ulimit sets both when given neither -S nor -H
        ulimit "-${1%%=*}" "${1#*=}" || fail "cannot set the limit $1"
        n=$((n - 1))
        shift
    done
    [ "$1" = -- ] || fail "bad arguments"
    shift
    umask 077
    exec 3< "$args" 4< "$seccomp" 5> "$status" || fail "cannot open the run's files"
    EXECBOX_BWRAP_WATCHER=$$
    export EXECBOX_BWRAP_WATCHER
    exec "$@"
) &
child=$!
exec 9<&- 0</dev/null
wait "$child"
rc=$?
trap '' TERM HUP INT
kill -TERM 0 2>/dev/null
exit "$rc"
"""

# The first line on the launcher's stdin, written by the caller once bwrap may start (its workspace is ready); the
# command's own stdin follows untouched (sh's read takes no byte past the newline from a pipe).
GATE = b"go\n"
# The last step before bwrap, after the parent-death signal is set: is the watcher still there to kill us? Then
# the gate: a caller gone or failed before opening it closes the pipe instead, and nothing starts.
CHECK = (f'[ "$PPID" = "${_WATCHER_VAR}" ] || exit {EXIT_LAUNCH_FAILED}; unset {_WATCHER_VAR}; '
         f'IFS= read -r gate && [ "$gate" = go ] || exit {EXIT_LAUNCH_FAILED}; unset gate; exec "$@"')


def launch_argv(*, tools: dict[str, str], caller: int, bwrap: str, args_file: str, seccomp_file: str,
                status_file: str, rlimits: dict[str, int], cgroup_procs: Sequence[str],
                user: tuple[int, int] | None, command: Sequence[str]) -> list[str]:
    """The command line that runs ``command`` in bwrap (options in ``args_file``), watched as described above.

    ``tools``: absolute paths of ``sh`` and ``setpriv``; ``rlimits``: ulimit's option letters (``ULIMIT_UNITS``)
    -> value in bytes (seconds for ``t``), rounded down to the shell's units; ``user``: the host uid:gid to drop to
    (as root)."""
    sh, setpriv = tools["sh"], tools["setpriv"]
    limits = [f"{letter}={value // ULIMIT_UNITS[letter]}" for letter, value in rlimits.items()]
    chain = [setpriv]
    if user is not None:
        chain += [f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"]
    chain += ["--pdeathsig=KILL", "--", sh, "-c", CHECK, "execbox-bwrap-check",
              bwrap, "--seccomp", "4", "--json-status-fd", "5", "--args", "3", "--", *command]
    return [setpriv, "--pdeathsig=TERM", "--", sh, "-c", WATCHER, "execbox-bwrap", str(caller), args_file,
            seccomp_file, status_file, str(len(cgroup_procs)), *cgroup_procs, str(len(limits)), *limits, "--", *chain]
