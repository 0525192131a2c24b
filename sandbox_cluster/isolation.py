"""Host isolation primitives used by a zygote: namespaces, mounts, cgroups, seccomp, uids.

Each primitive either works or raises ``OSError``/``RuntimeError`` with the reason; the
zygote turns that into a ``Protection(active=False, detail=...)`` that is logged at start
and reported in STATUS replies. Nothing here is silently skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import re
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
libc.unshare.argtypes = (ctypes.c_int,)
libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACE_FLAGS = (
    CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET
)

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

# Directories a non-root process can usually write to; each gets a private size-limited tmpfs.
WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
WORKDIR = "/tmp"
_MNT_DETACH = 2


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    check(libc.unshare(flags), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(
        libc.mount(
            source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def prctl(option: int, arg: int = 0) -> None:
    check(libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


# --------------------------------------------------------------------------- namespaces / mounts


# Kept writable in the zygote's mount namespace: the zygote manages cgroups under /sys and a
# cell sets its own /proc/self/oom_score_adj; /dev holds device nodes (and our /dev/shm tmpfs).
_KEEP_WRITABLE = ("/proc", "/sys", "/dev")
_MOUNT_FLAG_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}


def remount_read_only(keep: list[str], keep_trees: tuple[str, ...] = _KEEP_WRITABLE) -> int:
    """Make every mount but ``keep`` and those under ``keep_trees`` read-only (in the caller's
    private mount namespace), so a cell can write nowhere on the host (e.g. a world-writable
    /run/lock)."""
    done = 0
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if target in keep or any(target == k or target.startswith(k + "/") for k in keep_trees):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= _MOUNT_FLAG_OPTIONS.get(option, 0)
        mount("none", target, None, flags)
        done += 1
    return done


def disable_ipc() -> None:
    """In the caller's own IPC namespace: no SysV message queues, semaphores or shared memory,
    no POSIX message queues (objects a cell could leave behind for the next one)."""
    unshare(CLONE_NEWIPC)
    for path, value in (("/proc/sys/kernel/msgmni", "0"), ("/proc/sys/kernel/shmmni", "0"),
                        ("/proc/sys/fs/mqueue/queues_max", "0"), ("/proc/sys/kernel/shm_rmid_forced", "1")):
        with open(path, "w") as f:
            f.write(value)
    with open("/proc/sys/kernel/sem") as f:
        semmsl, semmns, semopm, _ = f.read().split()
    with open("/proc/sys/kernel/sem", "w") as f:
        f.write(f"{semmsl} {semmns} {semopm} 0")


def mount_private_tmpfs(size_mb: int, inodes: int, uid: int, gid: int, root: str = "",
                        sticky: tuple[str, ...] = ()) -> list[str]:
    """Mount a size- and inode-limited tmpfs owned by the slot uid over each world-writable dir under
    ``root`` (creating it there if ``root`` is given); returns the mount points (without
    ``root``). Those in ``sticky`` are root's and mode 1777 instead, like a host's /tmp."""
    mounted = []
    for path in WORLD_WRITABLE_DIRS:
        if root:
            os.makedirs(root + path, mode=0o755, exist_ok=True)
        elif not os.path.isdir(path):
            continue
        mode = "1777,uid=0,gid=0" if path in sticky else f"0700,uid={uid},gid={gid}"
        mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,nr_inodes={inodes},mode={mode}")
        mounted.append(path)
    if WORKDIR not in mounted:
        raise RuntimeError(f"{WORKDIR} does not exist; no working directory")
    return mounted


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WIPE_BATCH = 4096  # names unlinked per directory listing: the memory a wipe needs stays small


def fresh_tmpfs(path: str, size_mb: int, inodes: int, uid: int, gid: int) -> None:
    """Replace the private tmpfs at ``path`` (one ``mount_private_tmpfs`` made, holding no
    mount) by an empty one: everything in it goes at once, in the kernel, whatever its shape."""
    check(libc.umount2(path.encode(), _MNT_DETACH), f"umount {path}")
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,nr_inodes={inodes},mode=0700,uid={uid},gid={gid}")


def inodes_used(path: str) -> int:
    st = os.statvfs(path)
    return st.f_files - st.f_ffree


def wipe_dir(path: str, keep: frozenset[str] | set[str] = frozenset()) -> int:
    """Remove everything inside ``path`` but the entries named in ``keep`` (full paths of
    entries directly in ``path``: root's directories that lead to an exposed tree), as root: a
    cell's chmod tricks do not stop it. Returns the entries removed.

    Any tree a cell can build is removed in time linear in its entries, with constant memory
    and no recursion: one directory fd at a time, names relative to it (a 5,000-deep tree has
    paths far past PATH_MAX), a bounded batch of names per listing, up through ``..`` (nothing
    else runs in the tree: the cell's processes are dead)."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        return 0
    top = os.path.normpath(path)
    skip = {os.path.basename(k) for k in keep if os.path.dirname(os.path.normpath(k)) == top}
    below: list[str] = []  # the names from ``path`` down to the directory ``fd`` is
    removed = 0
    try:
        while True:
            batch, sub = [], None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if not below and entry.name in skip:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        sub = entry.name
                        break
                    batch.append(entry.name)
                    if len(batch) >= _WIPE_BATCH:
                        break
            for name in batch:
                try:
                    os.unlink(name, dir_fd=fd)
                    removed += 1
                except FileNotFoundError:
                    pass
            if sub is not None:
                fd = _enter(fd, sub)
                below.append(sub)
            elif batch:
                continue  # (listed again: what is left)
            elif not below:
                return removed
            else:  # empty: up, and remove it
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                os.rmdir(below.pop(), dir_fd=fd)
                removed += 1
    finally:
        os.close(fd)


def _enter(fd: int, name: str) -> int:
    """Open the subdirectory ``name`` of ``fd`` (closing ``fd``), whatever mode the cell left it in."""
    try:
        sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=fd, follow_symlinks=False)
        sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
    os.close(fd)
    return sub


# --------------------------------------------------------------------------- scheduling


def boost_priority(boost: int) -> int:
    """Lower the calling process's nice value by ``boost`` (before it starts threads: they
    inherit it); returns the nice value it had, which cells get back. The broker, workers and
    zygotes only wait and route, so running them ahead of the cells keeps heartbeats, timeouts
    and hand-offs on time on a busy node. Needs CAP_SYS_NICE; without it nothing changes."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if boost:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, max(-20, base - boost))
        except PermissionError:
            log.info("cannot raise the scheduling priority (no CAP_SYS_NICE); running at nice %d", base)
    return base


# --------------------------------------------------------------------------- uids


class UidLease:
    """An unprivileged uid reserved for one slot on this host (flock on a lock file, released on exit)."""

    LOCK_DIR = Path("/run/sandbox-cluster")

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd = fd

    @classmethod
    def acquire(cls, first: int = 61000, count: int = 2000) -> UidLease:
        if os.geteuid() != 0:  # cannot switch users: every cell runs as the worker's own uid (reported)
            return cls(os.geteuid(), -1)
        cls.LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        for uid in range(first, first + count):
            fd = os.open(cls.LOCK_DIR / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(uid, fd)
        raise RuntimeError(f"no free sandbox uid in [{first}, {first + count})")

    @property
    def fd(self) -> int:
        return self._fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# --------------------------------------------------------------------------- cgroups (v1)


def _own_cgroup_path(controller: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    raise RuntimeError(f"cgroup controller {controller} not in /proc/self/cgroup")


class SlotCgroup:
    """One v1 cgroup directory of one controller (memory or pids) for one slot, held by open
    directory fds: it stays reachable after the zygote pivots into the cells' root (no /sys)."""

    def __init__(self, controller: str, name: str) -> None:
        root = Path("/sys/fs/cgroup") / controller
        if not (root / "cgroup.procs").exists():
            raise RuntimeError(f"cgroup v1 controller {controller} is not mounted at {root}")
        origin = root / _own_cgroup_path(controller).lstrip("/")
        self.path = origin / "sandbox-cluster" / name
        self.path.mkdir(parents=True, exist_ok=True)
        self._name = name
        flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        self._origin_fd = os.open(origin, flags)
        self._parent_fd = os.open(self.path.parent, flags)
        self._fd = os.open(self.path, flags)
        self.kill_all()

    def enter(self) -> None:
        """Move the calling process (the zygote) in: its forks are born here, with no per-cell
        migration (a v1 cgroup migration waits for an RCU grace period: milliseconds)."""
        self.write("cgroup.procs", 0)

    def has(self, key: str) -> bool:
        try:
            os.stat(key, dir_fd=self._fd)
        except FileNotFoundError:
            return False
        return True

    def write(self, key: str, value: str | int, dir_fd: int | None = None) -> None:
        fd = os.open(key, os.O_WRONLY, dir_fd=self._fd if dir_fd is None else dir_fd)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)

    def read(self, key: str) -> str:
        fd = os.open(key, os.O_RDONLY, dir_fd=self._fd)
        try:
            return os.read(fd, 1 << 16).decode()
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        return [int(x) for x in self.read("cgroup.procs").split()]

    def kill_all(self, deadline_s: float = 10.0, keep: tuple[int, ...] = ()) -> bool:
        """SIGKILL every process in the cgroup but the caller and ``keep`` until none is left
        (killed processes still need CPU to exit: on a loaded host that takes seconds); True
        if none is."""
        end = time.monotonic() + deadline_s
        spared = {os.getpid(), *keep}
        while True:
            pids = [p for p in self.pids() if p not in spared]
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > end:
                return False
            reap_zombies()
            time.sleep(0.001)

    def remove(self) -> None:
        self.kill_all()
        try:
            self.write("cgroup.procs", 0, dir_fd=self._origin_fd)  # leave, so the directory can go
        except OSError:
            pass
        try:
            os.rmdir(self._name, dir_fd=self._parent_fd)
        except OSError as exc:
            log.warning("could not remove cgroup %s: %s", self.path, exc)
        for fd in (self._fd, self._parent_fd, self._origin_fd):
            os.close(fd)


def memory_oom_kills(cg: SlotCgroup) -> int:
    for line in cg.read("memory.oom_control").splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def set_memory_limit(cg: SlotCgroup, limit_bytes: int, with_swap: bool) -> None:
    """Set memory (and memory+swap when the host has swap accounting) to the same limit (-1: none)."""
    if not with_swap:
        cg.write("memory.limit_in_bytes", limit_bytes)
        return
    current = int(cg.read("memory.limit_in_bytes"))
    lowering = limit_bytes != -1 and limit_bytes < current
    # memory.memsw.limit_in_bytes must stay >= memory.limit_in_bytes at every step
    keys = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
    for key in keys if lowering else reversed(keys):
        cg.write(key, limit_bytes)


def procs_of_uid(uid: int) -> list[int]:
    """Fallback tree discovery when no cgroup is available: every process owned by ``uid``."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    out.append(int(entry.name))
            except FileNotFoundError:
                pass
    return out


def reap_zombies() -> None:
    """Reap children reparented to us (we are a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# --------------------------------------------------------------------------- seccomp

_DENIED_SYSCALLS = (
    # debugging / other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # namespaces and mounts
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # kernel and host state
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "adjtimex",
    "iopl", "ioperm", "sethostname", "setdomainname",
    # large attack surface, not needed by Python cells
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init",
    "open_by_handle_at", "name_to_handle_at",
    # no sockets at all (socketpair stays allowed: pipes between a cell's own processes)
    "socket",
)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


class CompiledSeccomp:
    """A seccomp program compiled once (in the zygote); ``load()`` in a cell is two prctl calls."""

    def __init__(self, bpf: bytes) -> None:
        if not bpf or len(bpf) % 8:
            raise RuntimeError(f"libseccomp exported {len(bpf)} bytes of BPF (not whole instructions)")
        self._code = ctypes.create_string_buffer(bpf, len(bpf))
        self._prog = _SockFprog(len(bpf) // 8, ctypes.addressof(self._code))
        self.instructions = len(bpf) // 8

    def load(self) -> None:
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(self._prog), 0, 0),
               "prctl(PR_SET_SECCOMP)")


def build_seccomp_filter() -> CompiledSeccomp:
    """A filter that allows everything except the calls above (EPERM) and namespace-creating clones.

    Compiled to BPF once per zygote; each forked cell only installs it. Syscalls of other
    architectures (e.g. i386 via int 0x80) hit libseccomp's bad-arch action (kill).
    """
    import pyseccomp as seccomp

    flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)
    for name in _DENIED_SYSCALLS:
        try:
            flt.add_rule(eperm, name)
        except (OSError, ValueError, RuntimeError):
            log.debug("syscall %s unknown on this architecture", name)
    for flag in NAMESPACE_FLAGS:
        flt.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, out of seccomp's reach: make libc fall back to clone.
    try:
        flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    except (OSError, ValueError, RuntimeError):
        pass
    fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            flt.export_bpf(out)
        bpf = os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)
    return CompiledSeccomp(bpf)
