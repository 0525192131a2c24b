"""Isolation set-up and probing for one zygote: every layer the host allows, each reported.

``Layers.set_up`` enters them in order: subreaper, clean environment, uid switch, an empty
network namespace, an IPC namespace with SysV IPC and POSIX queues disabled, the slot's
memory and pids cgroups (held by fds), the compiled seccomp filter, then the filesystem: a
private mount namespace in which the cells' root is built (``rootfs``: an allowlist of the
host, read-only, a minimal /etc and /dev, a /proc of the pid namespace, private
size-limited /tmp, /var/tmp and /dev/shm) and pivoted into. A layer the host refuses is
recorded as a ``Protection(active=False, detail=why)``, logged, and reported in every
STATUS reply; ``require_full_isolation`` makes the worker refuse to start. Without a root
the zygote falls back to the host's tree, read-only, with private tmpfs scratch; without a
private mount namespace, to a fresh private directory on the host. Also here: what the
zygote does to the slot between requests (kill the cell's tree, wipe the scratch, set the
memory limit).
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import tempfile

from .. import isolation, rootfs
from ..limits import SandboxLimits
from ..protocol import Protection
from .cell import CELL_ENV
from .warm import import_warm_modules

log = logging.getLogger(__name__)

REMOUNT_ABOVE_INODES = 512  # a scratch tmpfs holding more is replaced, not wiped entry by entry


class Layers:
    def __init__(self, *, uid: int, limits: SandboxLimits) -> None:
        self.uid = uid
        self.gid = uid
        self.limits = limits
        self.protections: list[Protection] = []
        self.memory_cg: isolation.SlotCgroup | None = None
        self.pids_cg: isolation.SlotCgroup | None = None
        self.seccomp: isolation.CompiledSeccomp | None = None
        self.swap_accounting = False
        self.can_switch_uid = os.geteuid() == 0
        self.tmpfs_dirs: list[str] = []  # our own tmpfs mounts (private mount namespace)
        self.exposed: list[str] = []  # host paths the cells' root shows (read-only)
        self.keep: frozenset[str] = frozenset()  # root's dirs in the scratch leading to exposed paths
        self.workdir = isolation.WORKDIR
        self.scratch_dirs: list[str] = []  # what is wiped after each cell: only dirs this zygote owns
        self.oom_kills = 0
        self.memory_limit = -1  # what memory.limit_in_bytes holds now (-1: none)

    def _protect(self, name: str, fn) -> object:
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - any failure means "not given", with its reason
            self.protections.append(Protection(name=name, active=False, detail=f"{type(exc).__name__}: {exc}"))
            log.warning("protection %s NOT active: %s", name, exc)
            return None
        self.protections.append(Protection(name=name, active=True, detail=out if isinstance(out, str) else ""))
        return out

    def set_up(self, pid_namespace: str | Exception | None = None) -> None:
        """Enter every isolation layer the host allows; ``pid_namespace``: the outcome of
        ``_enter_pid_namespace`` (done before, it forks), None when not tried."""
        self._protect("subreaper", lambda: isolation.prctl(isolation.PR_SET_CHILD_SUBREAPER, 1))
        self._protect("clean_environment", self._check_clean_env)

        def uid_switch() -> str:
            if not self.can_switch_uid:
                raise PermissionError("worker is not root; cells run as the worker's uid")
            return f"uid={self.uid}"

        self._protect("uid_switch", uid_switch)

        def empty_netns() -> str:
            isolation.unshare(isolation.CLONE_NEWNET)
            return "own empty network namespace (loopback down)"

        self._protect("network_namespace", empty_netns)

        def ipc() -> str:
            isolation.disable_ipc()
            return "own IPC namespace; SysV IPC and POSIX message queues disabled"

        self._protect("ipc_namespace", ipc)
        name = f"uid-{self.uid}"

        def pids_cgroup() -> isolation.SlotCgroup:
            cg = isolation.SlotCgroup("pids", name)
            cg.write("pids.max", self.limits.max_processes + 2)  # + the zygote and the next cell, forked ahead
            return cg

        def memory_cgroup() -> isolation.SlotCgroup:
            cg = isolation.SlotCgroup("memory", name)
            self.swap_accounting = cg.has("memory.memsw.limit_in_bytes")
            self.oom_kills = isolation.memory_oom_kills(cg)
            return cg

        self.memory_cg = self._protect("cgroup_memory", memory_cgroup)
        self.pids_cg = self._protect("cgroup_pids", pids_cgroup)
        self.seccomp = self._protect("seccomp", isolation.build_seccomp_filter)

        no_ns = RuntimeError("no private mount namespace")
        read_only: list[object] = [no_ns]
        allowlist: list[object] = [no_ns]
        pid_ns: list[object] = [pid_namespace if pid_namespace is not None else RuntimeError("not tried")]

        def private_tmp() -> str:
            isolation.unshare(isolation.CLONE_NEWNS)
            isolation.mount("none", "/", None, isolation.MS_REC | isolation.MS_PRIVATE)
            try:
                import_warm_modules()  # their shared libraries are mapped now: part of the allowlist
                exposed, masked = rootfs.exposed_paths(self.limits.expose)
                root = rootfs.build_root(exposed, masked, rootfs.literal_paths(self.limits.expose),
                                         uid=self.uid, gid=self.gid, scratch_mb=self.limits.tmpfs_mb,
                                         scratch_inodes=self.limits.tmpfs_inodes)
            except OSError as exc:  # degraded (reported): the host's tree, read-only, with a private scratch
                allowlist[0] = exc
                self.tmpfs_dirs = isolation.mount_private_tmpfs(self.limits.tmpfs_mb, self.limits.tmpfs_inodes,
                                                                self.uid, self.gid)
                try:
                    done = isolation.remount_read_only(keep=self.tmpfs_dirs)
                    read_only[0] = f"{done} mounts read-only (all but the scratch tmpfs, /proc, /sys, /dev)"
                except OSError as exc2:
                    read_only[0] = exc2
                if isinstance(pid_namespace, str):
                    try:  # a /proc that shows this pid namespace only
                        isolation.mount("proc", "/proc", "proc",
                                        isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC)
                    except OSError as exc2:
                        pid_ns[0] = exc2
            else:
                self.exposed, self.tmpfs_dirs, self.keep = exposed, root.scratch, frozenset(root.keep)
                allowlist[0] = (f"own root: {len(exposed)} host paths read-only, minimal /etc and /dev"
                                + (f", {len(masked)} project dirs hidden" if masked else ""))
                read_only[0] = "every mount of the cells' root but the scratch tmpfs and /proc"
                log.debug("exposed to cells (read-only): %s", ", ".join(exposed))
            return (f"{','.join(self.tmpfs_dirs)} ({self.limits.tmpfs_mb} MiB, "
                    f"{self.limits.tmpfs_inodes} inodes each)")

        if self._protect("private_tmpfs", private_tmp) is not None:
            self.scratch_dirs = list(self.tmpfs_dirs)
        else:  # degraded (reported): a fresh private dir on the host, never a shared one like /tmp
            prefix = f"sandbox-cell-{self.uid}-"
            for stale in glob.glob(os.path.join(tempfile.gettempdir(), glob.escape(prefix) + "*")):
                # a killed zygote's: this uid is leased to this slot alone on the host
                isolation.wipe_dir(stale)
                os.rmdir(stale)
            self.workdir = tempfile.mkdtemp(prefix=prefix)
            if self.can_switch_uid:
                os.chown(self.workdir, self.uid, self.gid)
            self.scratch_dirs = [self.workdir]

        def filesystem_allowlist() -> str:
            if isinstance(allowlist[0], Exception):
                raise allowlist[0]
            return allowlist[0]

        self._protect("filesystem_allowlist", filesystem_allowlist)

        def read_only_filesystem() -> str:
            if isinstance(read_only[0], Exception):
                raise read_only[0]
            return read_only[0]

        self._protect("read_only_filesystem", read_only_filesystem)

        def own_pids() -> str:
            if isinstance(pid_ns[0], Exception):
                raise pid_ns[0]
            if self.tmpfs_dirs == []:
                raise RuntimeError("no private mount namespace for a /proc of the pid namespace")
            return pid_ns[0]

        self._protect("pid_namespace", own_pids)

        def tree_kill() -> str:
            if self.pids_cg is not None or self.memory_cg is not None:
                return "every process in the slot cgroup"
            if self.can_switch_uid:
                return "every process of the slot uid"
            raise RuntimeError("no cgroup and no own uid: only the cell's process group is killed")

        self._protect("process_tree_kill", tree_kill)
        # rlimits are always available (setrlimit needs no privilege to lower limits).
        self.protections.append(Protection(name="rlimits", active=True, detail="cpu,as,fsize,nproc,nofile,core"))

    def enter_cgroups(self) -> None:
        """Move the (warmed-up) zygote into its slot cgroups, so cells are born there. Call this
        after the warm-up: memory the zygote touched before stays charged outside the slot."""
        for cg in (self.memory_cg, self.pids_cg):
            if cg is not None:
                cg.enter()

    @staticmethod
    def _check_clean_env() -> str:
        extra = sorted(set(os.environ) - set(CELL_ENV) - {"PYTHONPATH", "PYTHONHASHSEED", "LC_CTYPE"})
        if extra:
            raise RuntimeError(f"zygote environment has unexpected variables: {', '.join(extra)}")
        return "zygote exec'd with a minimal environment"

    # ---- between requests

    def set_memory_limit(self, limit_bytes: int) -> None:
        """The slot's memory cgroup limit (-1: none); raises OSError (then the limit is lifted)."""
        if self.memory_cg is None or limit_bytes == self.memory_limit:
            return
        try:
            isolation.set_memory_limit(self.memory_cg, limit_bytes, self.swap_accounting)
        except OSError:
            self.lift_memory_limit()
            raise
        self.memory_limit = limit_bytes

    def lift_memory_limit(self) -> None:
        if self.memory_cg is not None:
            try:
                isolation.set_memory_limit(self.memory_cg, -1, self.swap_accounting)
                self.memory_limit = -1
            except OSError as exc:
                log.error("could not lift the memory limit: %s", exc)

    def new_oom_kill(self) -> bool:
        """Whether the slot's memory cgroup OOM-killed a process since the last call."""
        if self.memory_cg is None:
            return False
        kills = isolation.memory_oom_kills(self.memory_cg)
        new, self.oom_kills = kills > self.oom_kills, kills
        return new

    def kill_tree(self, pid: int, spare: int | None) -> None:
        """Kill every process the cell ``pid`` left behind (setsid orphans included; never the
        ``spare`` forked ahead) and reap them."""
        cg = self.pids_cg or self.memory_cg
        if cg is not None:
            if not cg.kill_all(keep=() if spare is None else (spare,)):
                log.error("cgroup %s still has processes after kill", cg.path)
        elif self.can_switch_uid:
            for _ in range(1000):
                pids = isolation.procs_of_uid(self.uid)
                if not pids:
                    break
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                isolation.reap_zombies()
        elif pid > 0:  # the weakest fallback (reported as process_tree_kill missing): the cell's own session
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        isolation.reap_zombies()

    def wipe_scratch(self) -> None:
        """Empty the scratch dirs: entry by entry, or, for a private tmpfs holding many entries
        and no exposed tree, by mounting a fresh one over it (constant time, in the kernel; the
        cell forked ahead enters /tmp only once its request came)."""
        for d in self.scratch_dirs:
            if d in self.tmpfs_dirs and not any(os.path.dirname(k) == d for k in self.keep):
                try:
                    if isolation.inodes_used(d) > REMOUNT_ABOVE_INODES:
                        isolation.fresh_tmpfs(d, self.limits.tmpfs_mb, self.limits.tmpfs_inodes, self.uid, self.gid)
                        continue
                except OSError as exc:
                    log.warning("could not replace the tmpfs at %s (%s); wiping it entry by entry", d, exc)
            isolation.wipe_dir(d, self.keep)

    def close(self) -> None:
        for cg in (self.memory_cg, self.pids_cg):
            if cg is not None:
                cg.remove()
        if self.workdir != isolation.WORKDIR:  # the degraded mode's own dir
            isolation.wipe_dir(self.workdir)
            os.rmdir(self.workdir)
