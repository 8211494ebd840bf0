"""The seccomp filter the bubblewrap backend hands to ``bwrap --seccomp FD``.

Why this shape: bwrap wants a compiled classic-BPF program. Compiling one by hand means owning the
per-architecture syscall numbers, the x32 and compat ABIs and argument checks; libseccomp (the C
library behind docker/runc, systemd and flatpak, ``libseccomp2`` on every Debian/Ubuntu/Fedora) does
all of that and is maintained. Its Python bindings are not usable from a virtualenv: Debian's
``python3-seccomp`` lives in the system interpreter's dist-packages, the official binding is not on
PyPI, and ``pyseccomp`` (a ctypes wrapper) has had no release since 2021. So we call the five
functions we need from libseccomp's stable C ABI (``libseccomp.so.2``) directly with ctypes.

The filter allows everything except what sandboxed code has no business with; blocked calls fail
with EPERM (``clone3`` with ENOSYS, so libc falls back to ``clone``, whose flags a filter can see).
Syscalls of a foreign architecture (i386 ``int 0x80`` on x86_64) kill the process: libseccomp's
default for an architecture the filter does not list.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

# libseccomp's constants (seccomp.h); stable across libseccomp 2.x.
_ACT_ALLOW = 0x7FFF0000
_CMP_MASKED_EQ = 7
_NR_SCMP_ERROR = -1

CLONE_NEWUSER = 0x10000000


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


# Denied outright. Grouped by why.
DENIED_SYSCALLS: tuple[str, ...] = (
    # reading or steering another process
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # mounts, old and new API, and changing root
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # joining other namespaces
    "setns",
    # kernel keyrings
    "keyctl", "add_key", "request_key",
    # kernel attack surface sandboxed code never needs
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "name_to_handle_at", "open_by_handle_at",
    # kernel and machine control (need capabilities anyway; denied for defence in depth)
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "iopl", "ioperm", "quotactl", "lookup_dcookie",
)

# Denied only with CLONE_NEWUSER in the flags (argument 0 on x86_64 and aarch64).
DENIED_WITH_NEWUSER: tuple[str, ...] = ("unshare", "clone")


class SeccompUnavailable(RuntimeError):
    """libseccomp cannot be loaded or refused to build the filter."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _load() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable(
            f"libseccomp.so.2 cannot be loaded ({exc}); install it: apt-get install libseccomp2"
            " (dnf install libseccomp)"
        ) from exc
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    lib.seccomp_release.restype = None
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    )
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.seccomp_export_bpf.restype = ctypes.c_int
    return lib


@functools.cache
def compiled_filter() -> bytes:
    """The filter as the BPF program bwrap loads; built once per process."""
    lib = _load()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        def add(name: str, action: int, *args: _ArgCmp) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr == _NR_SCMP_ERROR:
                return  # libseccomp too old to know this syscall; nothing on this kernel to block
            arr = (_ArgCmp * len(args))(*args) if args else None
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(args), arr)
            # -EEXIST/-EDOM: a pseudo-syscall with no number on this architecture; nothing to block
            if rc < 0 and -rc not in (errno.EDOM, errno.EEXIST):
                raise SeccompUnavailable(f"seccomp rule for {name} failed: {os.strerror(-rc)}")

        eperm = _act_errno(errno.EPERM)
        for name in DENIED_SYSCALLS:
            add(name, eperm)
        newuser = _ArgCmp(0, _CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
        for name in DENIED_WITH_NEWUSER:
            add(name, eperm, newuser)
        # clone3 passes its flags in memory a filter cannot read: make libc fall back to clone.
        add("clone3", _act_errno(errno.ENOSYS))

        fd = os.memfd_create("execbox-seccomp")
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)

