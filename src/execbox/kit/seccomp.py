"""The seccomp filter as a compiled BPF program: bubblewrap hands it to ``bwrap --seccomp FD``; gvisor's commands
load it themselves inside the sandbox (runsc exec does not apply the container's OCI filter to them).

Why this shape: both want a compiled classic-BPF program. Compiling one by hand means owning the
per-architecture syscall numbers, the x32 and compat ABIs and argument checks; libseccomp (the C
library behind docker/runc, systemd and flatpak, ``libseccomp2`` on every Debian/Ubuntu/Fedora) does
all of that and is maintained. Its Python bindings are not usable from a virtualenv: Debian's
``python3-seccomp`` lives in the system interpreter's dist-packages, the official binding is not on
PyPI, and ``pyseccomp`` (a ctypes wrapper) has had no release since 2021. So we call the five
functions we need from libseccomp's stable C ABI (``libseccomp.so.2``) directly with ctypes.

The filter allows everything except the calls listed in ``execbox.policy.seccomp``, the one deny
list docker's seccomp profile is built from too; blocked calls fail with EPERM (``clone3`` with ENOSYS, so
libc falls back to ``clone``, whose flags a filter can see).
Syscalls of a foreign architecture (i386 ``int 0x80`` on x86_64) kill the process: libseccomp's
default for an architecture the filter does not list.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

from execbox.policy.seccomp import (
    CLONE_NEWUSER,
    DENIED_SOCKET_FAMILIES,
    DENIED_SYSCALLS,
    DENIED_WITH_NEWUSER,
    ENOSYS_SYSCALLS,
)
from execbox.policy.seccomp import DENY_ERRNO as SECCOMP_DENY_ERRNO

# libseccomp's constants (seccomp.h); stable across libseccomp 2.x.
_ACT_ALLOW = 0x7FFF0000
_CMP_EQ = 4
_CMP_MASKED_EQ = 7
_NR_SCMP_ERROR = -1


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


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
    """The filter as a BPF program; built once per process."""
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

        deny = _act_errno(SECCOMP_DENY_ERRNO)
        for name in DENIED_SYSCALLS:
            add(name, deny)
        newuser = _ArgCmp(0, _CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
        for name in DENIED_WITH_NEWUSER:
            add(name, deny, newuser)
        for family in DENIED_SOCKET_FAMILIES:
            add("socket", deny, _ArgCmp(0, _CMP_EQ, family, 0))
        for name in ENOSYS_SYSCALLS:
            add(name, _act_errno(errno.ENOSYS))

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

