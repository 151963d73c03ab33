"""The system calls a sandboxed program is refused, as a seccomp BPF program that bwrap loads (``--seccomp FD``),
built with libseccomp (through ``pyseccomp``, its ctypes binding) and never written by hand.

Every call is allowed but these, which fail with ``EPERM`` (``clone3``: ``ENOSYS``, so the C library falls back to
``clone``, whose flags a filter can read): the kernel keyring (``keyctl``, ``add_key``, ``request_key``), io_uring,
``ptrace`` and other processes' memory, namespaces (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag),
mounts, BPF, ``perf_event_open``, kernel modules and kexec, ``userfaultfd``, ``memfd_create`` / ``memfd_secret``
and SysV shared memory, message queues and semaphores (memory outside the address-space limit). Without a cgroup to
bound a program's processes together, ``forks=False`` also refuses new processes (``clone`` without
``CLONE_THREAD``, ``fork``, ``vfork``): threads share one address space, so the address-space limit bounds them all.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from functools import cache
from pathlib import Path

from deepzero.errors import UserError

REFUSED = (
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "memfd_create", "memfd_secret",
    "shmget", "shmat", "msgget", "semget",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "lookup_dcookie", "syslog",
)  # fmt: skip
"""Refused with EPERM: what no solution needs and what would share or escape (the module docstring)."""
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME."""
CLONE_THREAD = 0x00010000


def build(forks: bool) -> bytes:
    """The filter as BPF bytes (``forks``: whether a program may start processes)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError) as err:  # RuntimeError: pyseccomp found no libseccomp
        raise UserError(
            "--sandbox bwrap",
            f"no seccomp filter can be built here ({err})",
            "pip install pyseccomp, and install libseccomp (apt install libseccomp2)",
        ) from None
    policy = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    refuse = seccomp.ERRNO(errno.EPERM)
    for name in REFUSED:
        try:
            policy.add_rule(refuse, name)
        except (ValueError, OSError, RuntimeError):  # a call this kernel's headers do not know
            continue
    policy.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in _bits(CLONE_NEW):
        policy.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    if not forks:
        policy.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
        policy.add_rule(refuse, "fork")
        policy.add_rule(refuse, "vfork")
    with tempfile.TemporaryFile() as fh:
        policy.export_bpf(fh)
        fh.seek(0)
        return fh.read()


def _bits(mask: int) -> list[int]:
    return [1 << i for i in range(mask.bit_length()) if mask >> i & 1]


@cache
def policy_file(forks: bool) -> str:
    """The filter in a file of this user's own (named by its content), for the referees to open for each program."""
    data = build(forks)
    folder = Path(tempfile.gettempdir()) / f"deepzero-seccomp-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise UserError("--sandbox bwrap", f"{folder} is not yours alone", f"remove {folder} and run again")
    path = folder / f"{hashlib.sha256(data).hexdigest()[:16]}.bpf"
    if not path.is_file() or path.read_bytes() != data:
        fresh = folder / f"{path.name}.{os.getpid()}"
        fresh.write_bytes(data)
        fresh.replace(path)
    return str(path)
