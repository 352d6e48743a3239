"""The seccomp filter of a sandboxed call: a denylist, compiled once by libseccomp (through
pyseccomp, its ctypes binding) into the BPF program bwrap installs with `--seccomp FD`.

bwrap installs it after it has built the sandbox (namespaces, mounts: the calls it needs itself)
and just before it execs the code, in the namespace's init too. What it denies, with EPERM:
kernel interfaces a sandboxed program has no use for and where kernel exploits live (io_uring,
bpf, perf_event_open, userfaultfd, keyrings, kernel modules and kexec), looking into other
processes (ptrace, process_vm_*, kcmp, pidfd_getfd), mounting and namespaces, and the ways of
holding memory that no RLIMIT_AS counts (memfd_create, memfd_secret, System V shared memory and
message queues). Everything else is allowed: the filter narrows the kernel's surface, the
namespaces and rlimits of services/tools/sandbox.py do the confining.

clone3 passes its flags in memory, which a filter cannot read: it answers ENOSYS, so that libc
falls back to clone, whose flags it can read (a new namespace through clone is EPERM). Calls of
another architecture (i386 through int 0x80, x32 on x86_64) kill the process: nothing in the
sandbox has a reason to make them, and a filter of native numbers would not see what they are.
"""

from __future__ import annotations

import errno
import tempfile

# Denied with EPERM. Every name must be one libseccomp knows (an unknown one fails the build).
DENIED_SYSCALLS: tuple[str, ...] = (
    # Kernel surfaces of their own.
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "fanotify_init",
    "lookup_dcookie",
    # Other processes.
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    # The kernel and the machine.
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "vhangup",
    # Mounting and namespaces.
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    "unshare",
    "setns",
    "personality",
    # Memory no address space counts.
    "memfd_create",
    "memfd_secret",
    "shmget",
    "msgget",
)

# clone's namespace flags (linux/sched.h): a clone with any of them is EPERM.
CLONE_NAMESPACE_FLAGS: tuple[int, ...] = (
    0x00000080,  # CLONE_NEWTIME
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing, or would not build the filter."""


def build_filter() -> bytes:
    """The filter as a BPF program for the native architecture (what `bwrap --seccomp` reads)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError) as error:  # RuntimeError: the library is missing
        raise SeccompUnavailable(
            f"no seccomp filter: {error} (install libseccomp2 and the pyseccomp package)"
        ) from error
    try:
        syscall_filter = seccomp.SyscallFilter(seccomp.ALLOW)
        syscall_filter.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
        denied = seccomp.ERRNO(errno.EPERM)
        for name in DENIED_SYSCALLS:
            syscall_filter.add_rule(denied, name)
        syscall_filter.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        for flag in CLONE_NAMESPACE_FLAGS:
            # clone's flags are its first argument on x86_64 and aarch64 alike.
            has_flag = seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag)
            syscall_filter.add_rule(denied, "clone", has_flag)
        with tempfile.TemporaryFile() as program:
            syscall_filter.export_bpf(program)
            program.seek(0)
            return program.read()
    except OSError as error:
        raise SeccompUnavailable(f"libseccomp would not build the filter: {error}") from error
