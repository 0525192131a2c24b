"""One slot's zygote: the warm, root-owned interpreter that forks one isolated cell per request.

The next cell is forked ahead of its request, while the current one runs (fork() of a
warm interpreter costs milliseconds; on a machine with a free core it is off the
request's path) and waits for its request (``cell``). ``execute`` hands a request to it (a
memfd the worker wrote, passed on unread), watches it (``supervise``), and answers with the
outcome and the output, which the worker turns into the result; a cell that ran to its end, reported it
and stopped itself (the kernel's word that none of its code runs any more: ``cell``'s docstring) is
killed and answered at once, its reap, tree kill and scratch wipe following right after the answer
(``finish``), before the next request.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import signal
import socket
import time

import msgspec

from .. import hugepages
from ..limits import SandboxLimits
from ..protocol import CellOutcome, ExecRequest, ExecResult, Protection, encode, send_outcome
from .cell import HEADER, REPORT, CellSetup, cell_main, stdio_wrappers
from .layers import Layers
from .supervise import Capture, child_wakeups, drain, exec_result, watch

log = logging.getLogger(__name__)

_ZERO_PAGE = bytes(mmap.PAGESIZE)


@dataclasses.dataclass(slots=True)
class CellRun:
    """What ``execute`` gives back: the outcome, and the cell's output in its own mappings
    (``send`` them to the worker, then ``close``: they are unmapped)."""

    outcome: CellOutcome
    captures: tuple[Capture, Capture] | tuple[()] = ()

    def sizes(self) -> dict[str, tuple[int, int, int]]:
        out = {}
        for name, cap in zip(("stdout", "stderr"), self.captures):
            head, tail = cap.parts()
            out[name] = (cap.total, len(head), sum(len(t) for t in tail))
            head.release()
            for t in tail:
                t.release()
        return out

    def send(self, sock: socket.socket) -> None:
        views = []
        try:
            for cap in self.captures:
                head, tail = cap.parts()
                views += [head, *tail]
            send_outcome(sock, msgspec.structs.replace(self.outcome, **self.sizes()), views)
        finally:
            for v in views:
                v.release()

    def close(self) -> None:
        for cap in self.captures:
            cap.close()


@dataclasses.dataclass(slots=True)
class _Spare:
    pid: int
    ctrl: int  # our end of its socketpair: the request's header and memfd go here
    out_r: int
    err_r: int


class Zygote:
    def __init__(self, *, uid: int, limits: SandboxLimits, cell_nice: int | None = None) -> None:
        self.limits = limits
        self.cell_nice = cell_nice
        self.layers = Layers(uid=uid, limits=limits)
        self.served = 0
        self._cell: CellSetup | None = None  # fixed by setup()
        self._vm_size = 0  # the zygote's own address-space size (cells get it + memory_mb)
        self._spare: _Spare | None = None  # the next cell, forked ahead and waiting for its request
        self._pending: int | None = None  # pid of a cell answered for before it was reaped (see finish)
        self._seq = 0
        # One shared page every cell inherits (memory, not an fd): a cell that ran to its end writes
        # (request number, exit code, CPU time) there before closing its output and stopping itself,
        # so the zygote can answer without waiting for the exit itself (tearing down a forked
        # interpreter's page tables takes milliseconds); taken only from a stopped cell (its code can
        # write the page too), which is killed before the answer and reaped right after it.
        self._report = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self._wakeups: int | None = None  # a byte whenever a child stops or exits (setup(); main thread)

    @property
    def protections(self) -> list[Protection]:
        return self.layers.protections

    @property
    def exposed(self) -> list[str]:
        return self.layers.exposed

    @property
    def workdir(self) -> str:
        return self.layers.workdir

    def setup(self, pid_namespace: str | Exception | None = None) -> None:
        """Enter every isolation layer the host allows; ``pid_namespace``: the outcome of
        entering one (done before: it forks), None when not tried."""
        layers = self.layers
        layers.set_up(pid_namespace)
        self._wakeups = child_wakeups()
        self._cell = CellSetup(uid=layers.uid, gid=layers.gid, switch_uid=layers.can_switch_uid, nice=self.cell_nice,
                               workdir=layers.workdir, limits=self.limits,
                               in_memory_cgroup=layers.memory_cg is not None, seccomp=layers.seccomp,
                               report_page=self._report, stdio=stdio_wrappers())

    def close(self) -> None:
        self.finish()
        self._drop_spare()
        self.layers.close()

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
        assert self._cell is not None, "setup() first"
        ours, theirs = (s.detach() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (ours, theirs, out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        if pid == 0:  # ---------------------------------------------------- the cell
            cell_main(self._cell, theirs, out_w, err_w)
        for fd in (theirs, out_w, err_w):
            os.close(fd)
        return _Spare(pid=pid, ctrl=ours, out_r=out_r, err_r=err_r)

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
            for fd in (spare.ctrl, spare.out_r, spare.err_r):
                os.close(fd)
            try:
                os.kill(spare.pid, signal.SIGKILL)
                os.waitpid(spare.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def execute(self, timeout: float, memory_mb: int, request_fd: int) -> CellRun:
        """Run the request the worker wrote into the memfd ``request_fd`` (handed to the cell
        unread, and closed here): the zygote never holds what a request carries."""
        self.finish()  # (the serving loop calls it right after each answer; this is for any other caller)
        mem_bytes = memory_mb << 20
        cpu_limit = math.ceil(timeout + self.limits.cpu_slack_s)
        asked = {"timeout": timeout, "memory_mb": memory_mb, "cpu_limit": cpu_limit}
        try:
            try:
                self.layers.set_memory_limit(mem_bytes)
            except OSError as exc:
                return CellRun(CellOutcome(error=f"cgroup memory limit: {exc}", **asked))
            if self.served % 64 == 0:  # it barely changes once warm
                self._vm_size = _vm_size_bytes()
            self.served += 1
            spare, self._spare = self._live_spare() or self._spawn(), None
            self._seq += 1
            self._report[:] = _ZERO_PAGE  # all of it: no cell may leave anything for the next
            start = time.monotonic()
            _hand_over(spare.ctrl, HEADER.pack(self._vm_size + mem_bytes, cpu_limit, self._seq), request_fd)
        finally:
            os.close(request_fd)  # before the next fork: only the cell ever holds it
        self.prepare_next()  # fork the next cell now, on another core, while this one runs
        seen = watch(spare.pid, timeout=timeout, start=start, out_r=spare.out_r, err_r=spare.err_r,
                     limits=self.limits, reported=lambda: self._reported(spare.pid), wakeups=self._wakeups)
        if seen.reported is not None:  # answered now (killed already), reaped by finish() right after the answer
            drain(seen.streams)
            self._pending = spare.pid
            exit_code, cpu_time = seen.reported
            wall = seen.exited_at - start
        else:
            if seen.verdict is not None:
                _kill_cell(spare.pid)
            _, exit_status, rusage = os.wait4(spare.pid, 0)
            wall = (seen.exited_at or time.monotonic()) - start
            self._kill_tree(spare.pid)
            self.layers.wipe_scratch()  # before anything else: what the cell left in tmpfs counts in our cgroup
            drain(seen.streams)
            exit_code, cpu_time = os.waitstatus_to_exitcode(exit_status), rusage.ru_utime + rusage.ru_stime
        outcome = CellOutcome(verdict=seen.verdict.value if seen.verdict is not None else "", exit_code=exit_code,
                              wall_time=wall, cpu_time=cpu_time, oom=self.layers.new_oom_kill(), **asked)
        return CellRun(outcome, seen.captures)

    def run_request(self, req: ExecRequest) -> ExecResult:
        """Run ``req`` in-process and build its result, for a caller that holds the request
        anyway (tests, scripts); the serving loop uses ``execute`` and never sees one."""
        fd = os.memfd_create("request", os.MFD_CLOEXEC)
        _write_all(fd, encode(req))
        run = self.execute(req.timeout, req.memory_mb, fd)
        try:
            streams = []
            for cap in run.captures:
                head, tail = cap.parts()
                streams.append((bytes(head), b"".join(bytes(t) for t in tail)))
                head.release()
                for t in tail:
                    t.release()
            outcome = msgspec.structs.replace(run.outcome, **run.sizes())
            return exec_result(req.id, outcome, streams[0], streams[1], self.limits.output_hard_cap_bytes)
        finally:
            run.close()

    def _reported(self, pid: int) -> tuple[int, float] | None:
        """The cell's end-of-run report, once the kernel says the cell has stopped (see ``cell``): then the
        cell (and its process group) is killed at once, none of its code runs again; its CPU time at least
        the kernel's clock of the process (children it reaped are in the report only)."""
        seq, code, cpu = REPORT.unpack_from(self._report)
        if seq != self._seq or not _stopped(pid):
            return None
        cpu = max(cpu, _cpu_seconds(pid))
        _kill_cell(pid)
        return code, cpu

    def finish(self) -> None:
        """After an answer given on the cell's own report: reap it, kill what it left, wipe."""
        pid, self._pending = self._pending, None
        if pid is None:
            return
        _kill_cell(pid)  # (it has ended, or lied about it)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        self._kill_tree(pid)
        self.layers.wipe_scratch()

    def recover(self) -> None:
        """After an unexpected error mid-request: no process of the cell may survive it."""
        self.finish()
        self._drop_spare()
        self._kill_tree(-1)
        self.layers.wipe_scratch()
        self.layers.lift_memory_limit()

    def recollapse(self) -> None:
        """Merge the warm heap back into huge pages, with no cell sharing it (the spare is dropped)."""
        self._drop_spare()
        hugepages.collapse()

    def _kill_tree(self, pid: int) -> None:
        self.layers.kill_tree(pid, spare=None if self._spare is None else self._spare.pid)


def _kill_cell(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except ProcessLookupError:
            pass


def _stopped(pid: int) -> bool:
    """Whether our child ``pid`` is stopped: every thread of it (a group stop; the event is left for later)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is not None and info.si_code == os.CLD_STOPPED


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of process ``pid``, from the kernel (its CPU-time clock: CPUCLOCK_SCHED)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        return 0.0


def _exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited (a zombie, not reaped here, or reaped already)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _hand_over(ctrl: int, header: bytes, request_fd: int) -> None:
    """Send the waiting cell its header and the request's memfd, then hang up (its EOF)."""
    sock = socket.socket(fileno=ctrl)
    try:
        socket.send_fds(sock, [header], [request_fd])
    except (BrokenPipeError, ConnectionResetError):
        pass  # it died during its setup: its exit status says why
    finally:
        sock.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _vm_size_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
