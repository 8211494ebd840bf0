"""The one list of system calls every execbox sandbox denies, whatever enforces it.

The kit compiles it into a BPF filter with libseccomp (``kit/seccomp.py``: bwrap loads it, gvisor's commands
too); docker hands it to the engine as a seccomp profile (``backends/docker``). All read these tuples, so a call
added here is denied on every one. The list is names, not numbers: libseccomp resolves them for each architecture.

Denied calls fail with EPERM. Two need more than a name:

- ``unshare`` and ``clone`` are denied only with ``CLONE_NEWUSER`` in their flags (argument 0 on x86_64 and
  aarch64): a new user namespace is where most unprivileged kernel exploits start, while plain ``clone`` is
  how every thread and process is made.
- ``clone3`` passes its flags in memory a filter cannot read, so it fails with ENOSYS and libc falls back to
  ``clone``, whose flags the filter sees.
- ``socket`` is denied for ``AF_VSOCK``: vsock is not network-namespaced, so a sandbox without a network
  could still talk to the hypervisor or its host over it.
"""

from __future__ import annotations

import errno

CLONE_NEWUSER = 0x10000000
AF_VSOCK = 40

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
    "io_uring_register", "name_to_handle_at", "open_by_handle_at", "uselib",
    # the kernel log (addresses that defeat KASLR) where dmesg_restrict is off
    "syslog",
    # kernel and machine control (need capabilities anyway; denied for defence in depth)
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "iopl", "ioperm", "quotactl", "lookup_dcookie",
)

# Denied only with CLONE_NEWUSER in the flags (argument 0).
DENIED_WITH_NEWUSER: tuple[str, ...] = ("unshare", "clone")

# socket(family, ...) denied for these families (argument 0).
DENIED_SOCKET_FAMILIES: tuple[int, ...] = (AF_VSOCK,)

# Fail with ENOSYS ("not implemented") so libc falls back to a call the filter can judge.
ENOSYS_SYSCALLS: tuple[str, ...] = ("clone3",)

DENY_ERRNO = errno.EPERM
