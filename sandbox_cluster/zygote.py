"""The zygote: a warm, root-owned interpreter per slot that forks one isolated child per cell.

A worker starts it with ``python -m sandbox_cluster.zygote`` and a *clean* environment (so
neither its memory nor ``/proc/<pid>/environ`` holds the worker's secrets), hands it one
end of a socketpair, and speaks length-prefixed msgpack over it: requests in, results out.
The zygote holds no ZeroMQ state (ZeroMQ's threads do not survive ``fork``).

At start the zygote becomes pid 1 of its own pid namespace, enters its own network
namespace (only a down loopback), IPC namespace (SysV IPC and POSIX queues disabled) and
mount namespace (size-limited private tmpfs over /tmp, /var/tmp and /dev/shm, every other
host mount but /proc, /sys and /dev read-only, a /proc of its pid namespace), creates the
slot's memory and pids cgroups, compiles the seccomp filter, imports and *exercises* numpy
and sympy, freezes the GC so forked children do not copy-on-write the warm heap, collapses
that heap into huge pages (``hugepages``: fork and exit then copy and tear down far fewer
page-table entries) and moves into its cgroups. Each layer the host refuses is reported, not
skipped. Where the cell uid cannot read the interpreter's import directories (a Python under
a 0700 /root), they alone are bind-mounted back, read-only, under a tmpfs that hides the rest.

The next cell is forked ahead of its request, while the current one runs (fork() of a warm
interpreter costs milliseconds; on a machine with a free core it is off the request's path):
born in the slot's cgroups, it starts a new session, gets
fresh stdio pipes, closes every other fd, chdirs into the private /tmp, sets the
request-independent rlimits and waits, still root but having run no foreign code, for its
request on a pipe. Then it sets the CPU and address-space limits, drops to the slot's
uid/gid, loads seccomp, and runs the code in-process with the warm modules. The zygote
(pid 1 of its namespace, a child subreaper) enforces the wall clock and the output cap,
then kills the cell's whole process tree and wipes the tmpfs before it answers; a cell that
ran to its end reports it (exit code, CPU time) in a page of memory shared with the zygote
and closes its output, and is answered at once, the reap, tree kill and wipe following
right after the answer (``finish``), before the next request.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import gc
import io
import logging
import math
import mmap
import os
import resource
import select
import signal
import socket
import struct
import sys
import tempfile
import time

import msgspec

from . import hugepages, isolation, rootfs
from .limits import SandboxLimits
from .protocol import ExecRequest, ExecResult, Protection, Status, decode_request, encode, encode_msg

log = logging.getLogger(__name__)

EXIT_MEMORY = 252  # the cell raised MemoryError
EXIT_SETUP = 253  # the sandbox could not set the cell up (reported as sandbox_error)

CELL_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": isolation.WORKDIR,
    "TMPDIR": isolation.WORKDIR,
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

_LEN = struct.Struct("!I")
RECOLLAPSE_EVERY = 256  # requests between two re-collapses of the warm heap into huge pages


class ZygoteHello(msgspec.Struct, kw_only=True, frozen=True):
    protections: list[Protection]
    exposed: list[str] = msgspec.field(default_factory=list)


def decode_zygote_hello(data: bytes) -> ZygoteHello:
    return msgspec.msgpack.decode(data, type=ZygoteHello)


# --------------------------------------------------------------------------- framing (worker <-> zygote)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame, or None on a clean EOF."""
    header = _recv_exact(sock, _LEN.size)
    if header is None:
        return None
    (size,) = _LEN.unpack(header)
    payload = _recv_exact(sock, size)
    if payload is None:
        raise ConnectionError("peer closed mid-frame")
    return payload


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(min(size - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise ConnectionError("peer closed mid-frame")
            return None
        buf += chunk
    return bytes(buf)


# --------------------------------------------------------------------------- warm-up


def import_warm_modules() -> None:
    """Import what cells use (numpy, sympy): their shared libraries are then mapped."""
    import collections  # noqa: F401
    import linecache  # noqa: F401
    import traceback  # noqa: F401

    import numpy  # noqa: F401
    import sympy  # noqa: F401


def warm_up() -> None:
    """Import and actually call what cells use, so no child pays a lazy import or a cold cache."""
    import_warm_modules()
    import numpy as np
    import sympy

    x, y = sympy.symbols("x y")
    sympy.solve(x**2 - 4)
    sympy.solve(x**2 - 4, x)
    sympy.solve([x + y - 3, x - y - 1], [x, y])
    sympy.simplify(sympy.sin(x) ** 2 + sympy.cos(x) ** 2)
    sympy.integrate(x**2, x)
    sympy.expand((x + 1) ** 3)
    sympy.factorint(360)
    sympy.Rational(1, 3) + sympy.sqrt(2)
    sympy.latex(x**2 / 2)
    np.arange(100).sum()
    np.linalg.solve(np.eye(3), np.ones(3))
    np.random.default_rng(0).random(10).mean()
    str(np.array([1.5, 2.5]))


# --------------------------------------------------------------------------- output capture


class _Capture:
    """Keeps the head and the tail of one stream, counts the rest."""

    __slots__ = ("head", "tail", "total", "head_max", "tail_max")

    def __init__(self, head_max: int, tail_max: int) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.head_max = head_max
        self.tail_max = tail_max

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_max - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_max:
            self.tail += data
            if len(self.tail) > 2 * self.tail_max:
                del self.tail[: -self.tail_max]

    def render(self) -> tuple[str, bool]:
        tail = bytes(self.tail[-self.tail_max :]) if self.tail_max else b""
        dropped = self.total - len(self.head) - len(tail)
        if dropped <= 0:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace"), False
        marker = f"\n[... {dropped} bytes truncated ...]\n".encode()
        return (bytes(self.head) + marker + tail).decode("utf-8", "replace"), True


# --------------------------------------------------------------------------- the zygote


class Zygote:
    def __init__(self, *, uid: int, limits: SandboxLimits, cell_nice: int | None = None) -> None:
        self.uid = uid
        self.cell_nice = cell_nice
        self.gid = uid
        self.limits = limits
        self.protections: list[Protection] = []
        self.memory_cg: isolation.SlotCgroup | None = None
        self.pids_cg: isolation.SlotCgroup | None = None
        self.seccomp = None
        self.swap_accounting = False
        self.can_switch_uid = os.geteuid() == 0
        self.tmpfs_dirs: list[str] = []  # our own tmpfs mounts (private mount namespace)
        self.exposed: list[str] = []  # host paths the cells' root shows (read-only)
        self._keep: frozenset[str] = frozenset()  # root's dirs in the scratch leading to exposed paths
        self.workdir = isolation.WORKDIR
        self._scratch_dirs: list[str] = []  # what is wiped after each cell: only dirs this zygote owns
        self._oom_kills = 0
        self._memory_limit = -1  # what memory.limit_in_bytes holds now (-1: none)
        self._vm_size = 0  # the zygote's own address-space size (cells get it + memory_mb)
        self.served = 0
        self._spare: _Spare | None = None  # the next cell, forked ahead and waiting for its request
        self._pending: int | None = None  # pid of a cell answered for before it was reaped (see finish)
        self._seq = 0
        # One shared page every cell inherits (memory, not an fd): a cell that ran to its end writes
        # (request number, exit code, CPU time) there before closing its output, so the zygote can
        # answer without waiting for the exit itself (tearing down a forked interpreter's page
        # tables takes milliseconds); the process is reaped and its tree killed right after.
        self._status = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        # Built once, before any fork: a cell only dup2()s its pipes onto fds 0/1/2 underneath them.
        self._stdio = (
            io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace"),
            io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace"),
            io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                             line_buffering=True),
        )

    # ---- setup, once

    def _protect(self, name: str, fn) -> object:
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - any failure means "not given", with its reason
            self.protections.append(Protection(name=name, active=False, detail=f"{type(exc).__name__}: {exc}"))
            log.warning("protection %s NOT active: %s", name, exc)
            return None
        self.protections.append(Protection(name=name, active=True, detail=out if isinstance(out, str) else ""))
        return out

    def setup(self, pid_namespace: str | Exception | None = None) -> None:
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
            self._oom_kills = isolation.memory_oom_kills(cg)
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
                                         uid=self.uid, gid=self.gid, scratch_mb=self.limits.tmpfs_mb)
            except OSError as exc:  # degraded (reported): the host's tree, read-only, with a private scratch
                allowlist[0] = exc
                self.tmpfs_dirs = isolation.mount_private_tmpfs(self.limits.tmpfs_mb, self.uid, self.gid)
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
                self.exposed, self.tmpfs_dirs, self._keep = exposed, root.scratch, frozenset(root.keep)
                allowlist[0] = (f"own root: {len(exposed)} host paths read-only, minimal /etc and /dev"
                                + (f", {len(masked)} project dirs hidden" if masked else ""))
                read_only[0] = "every mount of the cells' root but the scratch tmpfs and /proc"
                log.debug("exposed to cells (read-only): %s", ", ".join(exposed))
            return f"{','.join(self.tmpfs_dirs)} ({self.limits.tmpfs_mb} MiB each)"

        if self._protect("private_tmpfs", private_tmp) is not None:
            self._scratch_dirs = list(self.tmpfs_dirs)
        else:  # degraded (reported): a fresh private dir on the host, never a shared one like /tmp
            self.workdir = tempfile.mkdtemp(prefix=f"sandbox-cell-{self.uid}-")
            if self.can_switch_uid:
                os.chown(self.workdir, self.uid, self.gid)
            self._scratch_dirs = [self.workdir]

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

    def close(self) -> None:
        self.finish()
        self._drop_spare()
        for cg in (self.memory_cg, self.pids_cg):
            if cg is not None:
                cg.remove()
        if self.workdir != isolation.WORKDIR:  # the degraded mode's own dir
            isolation.wipe_dir(self.workdir)
            os.rmdir(self.workdir)

    # ---- per request

    def prepare_next(self) -> None:
        """Fork the next cell now, while idle: it does the request-independent setup and waits,
        so a request does not wait for fork() (milliseconds for a warm interpreter)."""
        if self._spare is None:
            try:
                self._spare = self._spawn()
            except OSError as exc:
                log.warning("could not fork a cell ahead of time: %s", exc)

    def _spawn(self) -> _Spare:
        ctrl_r, ctrl_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (ctrl_r, ctrl_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        if pid == 0:  # ---------------------------------------------------- the cell
            self._child(ctrl_r, out_w, err_w)
        for fd in (ctrl_r, out_w, err_w):
            os.close(fd)
        return _Spare(pid=pid, ctrl_w=ctrl_w, out_r=out_r, err_r=err_r)

    def _live_spare(self) -> _Spare | None:
        """The cell forked ahead, unless it has died meanwhile (then it is dropped)."""
        spare = self._spare
        if spare is not None and _exited(spare.pid):
            log.warning("the cell forked ahead (pid %d) died before its request; forking another", spare.pid)
            self._drop_spare()  # (reaps it)
            return None
        return spare

    def _drop_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            for fd in (spare.ctrl_w, spare.out_r, spare.err_r):
                os.close(fd)
            try:
                os.kill(spare.pid, signal.SIGKILL)
                os.waitpid(spare.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def execute(self, req: ExecRequest) -> ExecResult:
        self.finish()  # (the serving loop calls it right after each answer; this is for any other caller)
        mem_bytes = req.memory_mb << 20
        if self.memory_cg is not None and mem_bytes != self._memory_limit:
            try:
                isolation.set_memory_limit(self.memory_cg, mem_bytes, self.swap_accounting)
            except OSError as exc:
                self._lift_memory_limit()
                return ExecResult(id=req.id, status=Status.SANDBOX_ERROR, message=f"cgroup memory limit: {exc}")
            self._memory_limit = mem_bytes
        if self.served % 64 == 0:  # it barely changes once warm
            self._vm_size = _vm_size_bytes()
        self.served += 1
        vm_size = self._vm_size
        cpu_limit = math.ceil(req.timeout + self.limits.cpu_slack_s)

        spare, self._spare = self._live_spare() or self._spawn(), None
        self._seq += 1
        self._status[:] = _ZERO_PAGE  # all of it: no cell may leave anything for the next
        start = time.monotonic()
        try:  # the waiting cell reads its request, then drops privileges and runs it
            _write_all(spare.ctrl_w, _CELL_HEADER.pack(vm_size + mem_bytes, cpu_limit, self._seq) + encode(req))
        except BrokenPipeError:
            pass  # it died during its setup: its exit status says why
        finally:
            os.close(spare.ctrl_w)
        pid, out_r, err_r = spare.pid, spare.out_r, spare.err_r
        self.prepare_next()  # fork the next cell now, on another core, while this one runs
        verdict, wall, exit_code, cpu_time, captures = self._supervise(pid, req.timeout, start, out_r, err_r)
        stdout, stdout_trunc = captures[0].render()
        stderr, stderr_trunc = captures[1].render()
        oom = False
        if self.memory_cg is not None:
            oom_kills = isolation.memory_oom_kills(self.memory_cg)
            oom, self._oom_kills = oom_kills > self._oom_kills, oom_kills
        message = ""
        if verdict is not None:
            status = verdict
            message = {
                Status.TIMEOUT: f"wall-clock timeout after {req.timeout:g} s",
                Status.OUTPUT_LIMIT: f"output passed {self.limits.output_hard_cap_bytes} bytes; killed",
            }[verdict]
        elif exit_code == EXIT_MEMORY or (oom and exit_code != 0):  # (a child's OOM the cell survived: its result)
            status, message = Status.MEMORY, f"memory limit {req.memory_mb} MiB exceeded"
            exit_code = 1 if exit_code == EXIT_MEMORY else exit_code
        elif exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and cpu_time >= cpu_limit - 0.1:
            status, message = Status.TIMEOUT, f"CPU time limit {cpu_limit} s exceeded"
        elif exit_code == EXIT_SETUP:
            status = Status.SANDBOX_ERROR
            message = stderr.strip().splitlines()[-1] if stderr.strip() else "setup failed"
        elif exit_code == 0:
            status = Status.OK
        else:
            status = Status.ERROR
            if exit_code < 0:
                message = f"killed by signal {signal.Signals(-exit_code).name}"
        return ExecResult(
            id=req.id, status=status, stdout=stdout, stderr=stderr, exit_code=exit_code,
            wall_time=wall, cpu_time=cpu_time, stdout_truncated=stdout_trunc, stderr_truncated=stderr_trunc,
            message=message,
        )

    def _supervise(self, pid: int, timeout: float, start: float, out_r: int, err_r: int):
        lim = self.limits
        captures = (_Capture(lim.output_head_bytes, lim.output_tail_bytes),
                    _Capture(lim.output_head_bytes, lim.output_tail_bytes))
        streams = {out_r: captures[0], err_r: captures[1]}
        pidfd = os.pidfd_open(pid)
        deadline = start + timeout
        verdict = None
        exited_at = None
        reported = None  # (exit code, CPU s) the cell wrote at its end
        try:
            while streams or exited_at is None:
                if not streams and exited_at is None:  # its output is closed: did it report its end?
                    reported = self._reported()
                    if reported is not None:
                        exited_at = time.monotonic()
                        break
                now = time.monotonic()
                if now >= deadline:
                    if exited_at is None:
                        verdict, exited_at = Status.TIMEOUT, now  # its run time ends with the deadline
                    break
                watch = list(streams) + ([pidfd] if exited_at is None else [])
                ready, _, _ = select.select(watch, [], [], deadline - now)
                for fd in ready:
                    if fd == pidfd:
                        # The cell is done; descendants may still hold the pipes: drain briefly, then kill.
                        exited_at = time.monotonic()
                        deadline = min(deadline, exited_at + 0.05)
                        continue
                    data = os.read(fd, 1 << 16)
                    if not data:
                        os.close(fd)
                        del streams[fd]
                        continue
                    streams[fd].add(data)
                    if captures[0].total + captures[1].total > lim.output_hard_cap_bytes:
                        verdict = Status.OUTPUT_LIMIT
                        break
                if verdict is not None:
                    break
            if reported is not None:  # answered now, reaped by finish() right after the answer
                self._pending = pid
                return None, exited_at - start, reported[0], reported[1], captures
            if verdict is not None:
                self._kill_cell(pid)
            _, exit_status, rusage = os.wait4(pid, 0)
            wall = (exited_at or time.monotonic()) - start
            self._kill_tree(pid)
            self._wipe_scratch()  # before anything else: what the cell left in tmpfs counts in our cgroup
            for fd, cap in streams.items():  # every writer is dead now: drain what is buffered
                os.set_blocking(fd, False)
                while True:
                    try:
                        data = os.read(fd, 1 << 16)
                    except BlockingIOError:
                        break
                    if not data:
                        break
                    cap.add(data)
        finally:
            os.close(pidfd)
            for fd in streams:
                os.close(fd)
        return verdict, wall, os.waitstatus_to_exitcode(exit_status), rusage.ru_utime + rusage.ru_stime, captures

    def _reported(self) -> tuple[int, float] | None:
        seq, code, cpu = _CELL_STATUS.unpack_from(self._status)
        return (code, cpu) if seq == self._seq else None

    def finish(self) -> None:
        """After an answer given on the cell's own report: reap it, kill what it left, wipe."""
        pid, self._pending = self._pending, None
        if pid is None:
            return
        self._kill_cell(pid)  # (it has ended, or lied about it)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        self._kill_tree(pid)
        self._wipe_scratch()

    def recover(self) -> None:
        """After an unexpected error mid-request: no process of the cell may survive it."""
        self.finish()
        self._drop_spare()
        self._kill_tree(-1)
        self._wipe_scratch()
        self._lift_memory_limit()

    def recollapse(self) -> None:
        """Merge the warm heap back into huge pages, with no cell sharing it (the spare is dropped)."""
        self._drop_spare()
        hugepages.collapse()

    def _wipe_scratch(self) -> None:
        for d in self._scratch_dirs:
            isolation.wipe_dir(d, self._keep)

    def _lift_memory_limit(self) -> None:
        if self.memory_cg is not None:
            try:
                isolation.set_memory_limit(self.memory_cg, -1, self.swap_accounting)
                self._memory_limit = -1
            except OSError as exc:
                log.error("could not lift the memory limit: %s", exc)

    def _kill_cell(self, pid: int) -> None:
        for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                target()
            except ProcessLookupError:
                pass

    def _kill_tree(self, pid: int) -> None:
        """Kill every process the cell left behind (setsid orphans included) and reap them."""
        cg = self.pids_cg or self.memory_cg
        if cg is not None:
            if not cg.kill_all(keep=() if self._spare is None else (self._spare.pid,)):
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

    def _child(self, ctrl_r: int, out_w: int, err_w: int):
        """Runs in the forked cell; never returns. Everything up to reading the request is done
        ahead of time (see ``prepare_next``); the request's code runs only after the drop."""
        try:
            os.setsid()
            if self.cell_nice is not None:  # back to the worker's own priority (the zygote may run ahead)
                os.setpriority(os.PRIO_PROCESS, 0, self.cell_nice)
            os.dup2(ctrl_r, 0)  # the request comes in on fd 0; the cell's stdin replaces it below
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            os.chdir(self.workdir)
            lim = self.limits
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_FSIZE, (lim.max_file_mb << 20, lim.max_file_mb << 20))
            resource.setrlimit(resource.RLIMIT_NPROC, (lim.max_processes, lim.max_processes))
            resource.setrlimit(resource.RLIMIT_NOFILE, (lim.max_open_files, lim.max_open_files))
            isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
            sys.stdin, sys.stdout, sys.stderr = self._stdio
            sys.argv = ["<cell>"]
            message = _read_to_eof(0)  # ------------------------------- waits here for its request
            if not message:
                os._exit(0)  # the zygote shut down before a request came
            as_limit, cpu_limit, seq = _CELL_HEADER.unpack_from(message)
            req = decode_request(message[_CELL_HEADER.size:])
            stdin_fd = os.memfd_create("stdin") if req.stdin else os.open(os.devnull, os.O_RDONLY)
            if req.stdin:
                os.write(stdin_fd, req.stdin.encode())
                os.lseek(stdin_fd, 0, os.SEEK_SET)
            os.dup2(stdin_fd, 0)
            os.close(stdin_fd)
            if self.memory_cg is not None:  # in the zygote's memory cgroup the running cell is the OOM
                fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)  # victim (not the next one, waiting)
                os.write(fd, b"1000")
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_limit + 1))
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
            if self.can_switch_uid:
                os.setgroups([])
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)
            isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)  # a uid change cleared it
            if os.environ.keys() != CELL_ENV.keys():  # the zygote's is already exactly CELL_ENV
                os.environ.clear()
                os.environ.update(CELL_ENV)
        except BaseException as exc:  # noqa: BLE001
            os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
            os._exit(EXIT_SETUP)
        for name, content in req.files.items():
            try:
                with open(name, "wb") as f:
                    f.write(content)
            except OSError as exc:
                os.write(2, f"could not write input file {name!r}: {exc}\n".encode())
                os._exit(1)
        if self.seccomp is not None:
            try:
                self.seccomp.load()
            except BaseException as exc:  # noqa: BLE001
                os.write(2, f"sandbox setup failed: seccomp: {exc}\n".encode())
                os._exit(EXIT_SETUP)
        code = _run_cell(req.code)
        try:  # report the end, then close the output: the zygote answers on both
            own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
            self._status[:_CELL_STATUS.size] = _CELL_STATUS.pack(seq, code, cpu)
            os.close(1)
            os.close(2)
        except BaseException:  # noqa: BLE001 - the cell's code broke something: the exit still tells
            pass
        os._exit(code)


@dataclasses.dataclass(slots=True)
class _Spare:
    pid: int
    ctrl_w: int  # the request goes here
    out_r: int
    err_r: int


_CELL_HEADER = struct.Struct("!QIQ")  # address-space limit (bytes), CPU limit (s), request number; then the request
_ZERO_PAGE = bytes(mmap.PAGESIZE)
_CELL_STATUS = struct.Struct("=Qid")  # request number, exit code, CPU seconds: what a cell reports at its end


def _exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited (a zombie, not reaped here, or reaped already)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_to_eof(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _run_cell(code: str) -> int:
    import linecache

    linecache.cache["<cell>"] = (len(code), None, code.splitlines(True), "<cell>")
    exit_code = 0
    try:
        exec(compile(code, "<cell>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        if exc.code is None:
            exit_code = 0
        elif isinstance(exc.code, int):
            exit_code = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            exit_code = 1
    except MemoryError as exc:
        try:
            _print_cell_traceback(exc)
        except MemoryError:
            os.write(2, b"MemoryError\n")
        exit_code = EXIT_MEMORY
    except BaseException as exc:  # noqa: BLE001 - the cell's own error, reported in stderr
        _print_cell_traceback(exc)
        exit_code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - closed / broken by the cell
            pass
    return exit_code


def _print_cell_traceback(exc: BaseException) -> None:
    """The traceback as a plain ``python file.py`` would print it: without the sandbox's own frame."""
    import traceback

    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _run_cell.__code__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _vm_size_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- entry point


def _enter_pid_namespace(keep_fd: int) -> str | Exception:
    """Become pid 1 of a new pid namespace, so cells see (and can signal) only their slot.

    ``unshare(CLONE_NEWPID)`` only moves the caller's future children, so the process the
    worker started stays outside as a shim: it forks the real zygote, forwards SIGTERM, and
    exits with it (and the zygote dies with the shim: PDEATHSIG). When pid 1 of a namespace
    dies, the kernel kills everything left in it.
    """
    try:
        isolation.unshare(isolation.CLONE_NEWPID)
    except OSError as exc:
        return exc
    child = os.fork()
    if child == 0:
        isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
        return "cells see only their own slot's processes (/proc remounted)"
    os.close(keep_fd)  # only the zygote holds the worker's socket: its death is the worker's EOF
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox_cluster.zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--limits", required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--cell-nice", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s zygote[uid {args.uid}] %(levelname)s %(message)s")
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent:
        return 1
    os.environ.pop("PYTHONPATH", None)  # only needed to start; cells get exactly CELL_ENV
    pid_namespace = _enter_pid_namespace(args.fd)  # from here on: pid 1 of a new pid namespace
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sock = socket.socket(fileno=args.fd)
    zygote = Zygote(uid=args.uid, limits=SandboxLimits.from_json(args.limits), cell_nice=args.cell_nice)
    try:
        zygote.setup(pid_namespace)
        warm_up()
        gc.collect()
        gc.freeze()
        huge = hugepages.collapse()  # before entering the cgroups: the warm heap is charged outside the slot
        log.info("warm heap: %d MiB in huge pages (%d collapsed)", hugepages.anon_huge_bytes() >> 20, huge)
        zygote.enter_cgroups()
        send_frame(sock, encode_msg(ZygoteHello(protections=zygote.protections, exposed=zygote.exposed)))
        zygote.prepare_next()
        while True:
            frame = recv_frame(sock)
            if frame is None:
                return 0
            try:
                req = decode_request(frame)
            except ValueError as exc:
                send_frame(sock, encode(ExecResult(id="", status=Status.SANDBOX_ERROR, message=str(exc))))
                continue
            try:
                result = zygote.execute(req)
            except Exception as exc:  # noqa: BLE001 - e.g. fork() refused: answer, clean up, keep serving
                log.exception("request %s failed inside the zygote", req.id)
                zygote.recover()
                result = ExecResult(id=req.id, status=Status.SANDBOX_ERROR, message=f"zygote: {exc}")
            send_frame(sock, encode(result))
            zygote.finish()
            if zygote.served % RECOLLAPSE_EVERY == 0:  # the zygote's writes since have split some
                zygote.recollapse()  # huge pages; a few ms to merge them back
            zygote.prepare_next()  # after the reply: forking the next cell is off the request's path
    except (ConnectionError, BrokenPipeError):
        return 0
    finally:
        zygote.close()


if __name__ == "__main__":
    sys.exit(main())
