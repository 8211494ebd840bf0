"""The probes: the programs the checks run inside the sandbox, each reporting what it saw there. A one-line
command stays in the check that runs it."""

from __future__ import annotations

import textwrap

PROBE_CONNECT = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect(("127.0.0.1", int(sys.argv[1])))
        print("CONNECTED")
    except OSError as exc:
        print("BLOCKED", exc)
    print("IFACES", " ".join(sorted(name for _, name in socket.if_nameindex())))
""")

ESCAPING_GRANDCHILD = textwrap.dedent("""
    import os, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                with open("tick", "a") as fh:
                    fh.write("x")
                time.sleep(0.1)
        os._exit(0)
    while not os.path.exists("tick"):  # the grandchild is running before the deadline can come
        time.sleep(0.05)
    print("GRANDCHILD RUNNING", flush=True)
    time.sleep(1000)
""")

# A one-shot run whose setsid, double-forked grandchild carries a marker in its command line; the run says
# so only once the grandchild is up (it created its file), so a grandchild that never started is seen.
ESCAPING_MARKED_GRANDCHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    if os.fork() == 0:
        os.setsid()
        subprocess.Popen(["python3", "-c", "import time; open('up', 'w').close(); time.sleep(1000)", sys.argv[1]])
        os._exit(0)
    while not os.path.exists("up"):
        time.sleep(0.05)
    print("GRANDCHILD RUNNING", flush=True)
    time.sleep(1000)
""")

# Prints what the process is, from inside; then stays up (at most argv[2] seconds) so that the host can
# look at it from outside, and leaves early on SIGWINCH (ignored by default, so an early one is harmless).
IDENTITY_PROBE = textwrap.dedent("""
    import json, os, signal, sys, time
    seen = []
    signal.signal(signal.SIGWINCH, lambda *_: seen.append(1))
    def read(path, link=False):
        try:
            if link:
                return os.readlink(path)
            with open(path) as fh:
                return fh.read()
        except OSError as exc:
            return "unreadable: %s" % exc
    try:  # prctl(PR_GET_NO_NEW_PRIVS): what a kernel says that does not show it in /proc/self/status (gVisor)
        import ctypes
        nnp = ctypes.CDLL(None, use_errno=True).prctl(39, 0, 0, 0, 0)
    except (OSError, AttributeError):
        nnp = None
    print(json.dumps({"pid": os.getpid(), "status": read("/proc/self/status"), "uid_map": read("/proc/self/uid_map"),
                      "gid_map": read("/proc/self/gid_map"), "userns": read("/proc/self/ns/user", True),
                      "nnp": nnp}), flush=True)
    end = time.monotonic() + float(sys.argv[2])
    while not seen and time.monotonic() < end:
        time.sleep(0.02)
""")

CANARY_PROBE = textwrap.dedent("""
    import json, sys
    seen = {}
    for path in sys.argv[1:]:
        try:
            with open(path, "rb") as fh:
                seen[path] = "READ " + fh.read(200).decode(errors="replace")
        except OSError as exc:
            seen[path] = "ERROR " + type(exc).__name__
    print(json.dumps(seen))
""")

# The marker comes reversed, so that this probe's own command line does not hold it.
PROCESS_PROBE = textwrap.dedent("""
    import json, os, sys
    marker = sys.argv[1][::-1].encode()
    me, listed, hits = str(os.getpid()), [], []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as fh:
                    argv = fh.read().split(b"\\0")
            except OSError:
                continue
            listed.append(entry)
            if marker in argv:
                hits.append(entry)
    print(json.dumps({"self_listed": me in listed, "listed": len(listed), "hits": hits}))
""")

# unshare(CLONE_NEWUSER) in a forked child (a threaded process gets EINVAL whatever the sandbox allows).
USERNS_PROBE = textwrap.dedent("""
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    pid = os.fork()
    if pid == 0:
        rc = libc.unshare(0x10000000)
        os._exit(0 if rc == 0 else min(100 + ctypes.get_errno(), 250))
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status == 0:
        print("USERNS created")
    elif status < 0:
        print("USERNS refused: killed by signal", -status)
    else:
        print("USERNS refused:", errno.errorcode.get(status - 100, status - 100))
""")

# A library whose constructor records which process loaded it: on stderr, and in a log file at a host path
# compiled in. The mount namespace and boot id tell a host-side process (this host's kernel and mount
# namespace, i.e. the test's own) from the sandboxed code, wherever each record ended up.
PRELOAD_SOURCE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

static void slurp(const char *path, char *buf, int size, int link) {
    int n = -1;
    if (link) {
        n = (int)readlink(path, buf, size - 1);
    } else {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) { n = (int)read(fd, buf, size - 1); close(fd); }
    }
    if (n > 0 && buf[n - 1] == '\n') n--;
    if (n > 0) buf[n] = '\0';
}

__attribute__((constructor)) static void execbox_probe(void) {
    char mnt[64] = "?", boot[64] = "?", comm[32] = "?", line[320];
    slurp("/proc/self/ns/mnt", mnt, sizeof mnt, 1);
    slurp("/proc/sys/kernel/random/boot_id", boot, sizeof boot, 0);
    slurp("/proc/self/comm", comm, sizeof comm, 0);
    int len = snprintf(line, sizeof line, "EXECBOX-PROBE %s mnt=%s boot=%s pid=%d uid=%d comm=%s\n",
                       EXECBOX_TOKEN, mnt, boot, (int)getpid(), (int)getuid(), comm);
    if (len <= 0 || len >= (int)sizeof line) return;
    int fd = open(EXECBOX_HOST_LOG, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0) { if (write(fd, line, len) < 0) {} close(fd); }
    if (write(2, line, len) < 0) {}
}
"""


# Says "ready", then waits (at most 15 s) for the caller to answer with a file "go" in the workspace: only a
# caller that saw "ready" while the command ran can make it print "got-go". No clock is compared.
HANDSHAKE = ('echo ready; i=0; while [ ! -e go ] && [ "$i" -lt 150 ]; do sleep 0.1; i=$((i+1)); done; '
             '[ -e go ] && echo got-go || echo no-go')


# Output without end, past the deadline: the kill must land while the pipe is full, and the capture stay bounded.
ENDLESS = {"python": ["python3", "-c", "while True: print('x' * 1000)"], "yes": ["yes"]}


# Fetches argv[1] through the proxy the variables name (plain HTTP), then the same URL's path through a CONNECT
# tunnel opened by hand; NO_PROXY is dropped, so a loopback destination goes to the proxy too.
PROBE_PROXY_FETCH = textwrap.dedent("""
    import json, os, socket, sys, urllib.parse, urllib.request
    for name in ("NO_PROXY", "no_proxy"):
        os.environ.pop(name, None)
    url, out = sys.argv[1], {"proxy": os.environ.get("HTTP_PROXY", "")}
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            out["http"] = "FETCHED " + response.read().decode()
    except Exception as exc:
        out["http"] = "REFUSED %s %s" % (type(exc).__name__, exc)
    try:
        proxy = urllib.parse.urlsplit(out["proxy"])
        target = urllib.parse.urlsplit(url)
        with socket.create_connection((proxy.hostname, proxy.port), timeout=10) as s:
            head = "CONNECT %s HTTP/1.1\\r\\n\\r\\nGET %s HTTP/1.0\\r\\n\\r\\n"
            s.sendall((head % (target.netloc, target.path)).encode())
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        out["connect"] = data.decode(errors="replace")
    except Exception as exc:
        out["connect"] = "REFUSED %s %s" % (type(exc).__name__, exc)
    print(json.dumps(out))
""")

# Two children busy for 2 s of wall time; prints the CPU-seconds they used.
CPU_BURN_PROBE = textwrap.dedent("""
    import os, time
    end = time.monotonic() + 2.0
    for _ in range(2):
        if os.fork() == 0:
            while time.monotonic() < end:
                pass
            os._exit(0)
    for _ in range(2):
        os.wait()
    t = os.times()
    print("CPU", round(t.children_user + t.children_system, 2))
""")

# Forks (each child sleeping) until fork fails or 500 are up; prints how many and what stopped it.
FORK_PROBE = textwrap.dedent("""
    import os, time
    n, stopped = 0, "never"
    for _ in range(500):
        try:
            if os.fork() == 0:
                time.sleep(20)
                os._exit(0)
            n += 1
        except OSError as exc:
            stopped = exc.__class__.__name__
            break
    print("FORKED", n, stopped)
""")

# Writes 64 MiB into the workspace and syncs each MiB (a write that only reached the page cache has not
# hit the filesystem's limit yet); prints the bytes on disk and the error that stopped it.
DISK_FILL_PROBE = textwrap.dedent("""
    import errno, os
    written, stopped = 0, "never"
    fd = os.open("fill.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for _ in range(64):
            written += os.write(fd, b"x" * (1 << 20))
            os.fsync(fd)
    except OSError as exc:
        stopped = errno.errorcode.get(exc.errno, str(exc.errno))
    os.close(fd)
    print("WROTE", os.stat("fill.bin").st_blocks * 512, stopped)
""")

# Builds what a transfer must refuse before reading it: a sparse 5 GiB file, a directory of 100 entries and
# a 300-level tree.
HOSTILE_TREE = ("import os\n"
                "with open('big.bin', 'wb') as f:\n"
                "    try: f.truncate(5 << 30)\n"
                "    except OSError: f.truncate(900 << 20)  # a file-size rlimit (bubblewrap: 1 GiB)\n"
                "os.makedirs('many')\n"
                "for i in range(100): open(f'many/f{i}', 'w').close()\n"
                "p = 'deep'\n"
                "for i in range(300): p += '/d'\n"
                "os.makedirs(p)\n")

# What kernel the code runs on, and which of the host kernel's interfaces it reaches: uname, /proc/version and
# the boot id; raw keyctl and bpf (a real request each, that a host kernel grants an unprivileged process); a
# /proc/sys/kernel file opened for writing (opened only: nothing is written); and the sha256 of each file named
# in argv (the host kernel's own, e.g. its build notes), or why it could not be read.
KERNEL_PROBE = textwrap.dedent("""
    import ctypes, errno, hashlib, json, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    numbers = {"x86_64": (250, 321), "aarch64": (219, 280)}.get(os.uname().machine)
    def outcome(rc):
        if rc >= 0:
            return "GRANTED %d" % rc
        return "REFUSED " + errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    def read(path):
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as exc:
            return "ERROR " + errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    out = {"release": os.uname().release, "version": os.uname().version, "proc_version": read("/proc/version"),
           "boot_id": read("/proc/sys/kernel/random/boot_id")}
    for key in ("proc_version", "boot_id"):
        if isinstance(out[key], bytes):
            out[key] = out[key].decode(errors="replace").strip()
    if numbers is None:
        out["keyctl"] = out["bpf"] = "UNKNOWN architecture " + os.uname().machine
    else:
        # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, create): the caller's user keyring, in the kernel.
        out["keyctl"] = outcome(libc.syscall(numbers[0], 0, -4, 1))
        # bpf(BPF_MAP_CREATE): a one-entry array map (type 2, 4-byte key and value).
        attr = (ctypes.c_uint32 * 18)(2, 4, 4, 1)
        rc = libc.syscall(numbers[1], 0, ctypes.byref(attr), ctypes.sizeof(attr))
        out["bpf"] = outcome(rc)
        if rc >= 0:
            os.close(rc)
    try:
        os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))
        out["sysctl_write"] = "OPENED"
    except OSError as exc:
        out["sysctl_write"] = "REFUSED " + errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    files = {}
    for path in sys.argv[1:]:
        data = read(path)
        files[path] = hashlib.sha256(data).hexdigest() if isinstance(data, bytes) else data
    out["files"] = files
    print(json.dumps(out))
""")
