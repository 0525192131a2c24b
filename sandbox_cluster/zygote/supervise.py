"""Per-request supervision: watch a running cell's output and clock, then name its outcome.

``watch`` (in the zygote) enforces the wall clock and the output cap while capturing head
and tail of both streams outside the zygote's heap; ``classify`` (in the worker) is the pure mapping from how the cell ended (the zygote's verdict,
exit status, CPU time, OOM kills) to a ``Status``, its exit code and message.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import select
import signal
import time
from collections.abc import Callable

from ..limits import SandboxLimits
from ..protocol import CellOutcome, ExecResult, Status
from .cell import EXIT_MEMORY, EXIT_SETUP


_SCRATCH = 1 << 16  # one read's worth
DESCENDANTS_DRAIN_S = 0.05  # after the cell ended, while its descendants still hold its pipes


def child_wakeups() -> int:
    """A pipe that gets a byte whenever a child of this process stops or exits (SIGCHLD through
    ``signal.set_wakeup_fd``; main thread only): ``watch`` wakes on a cell's stop with it. Returns
    its read end (non-blocking). A forked cell undoes it first thing (``cell.cell_main``)."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler: the kernel then signals stops too
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    return r


class Capture:
    """Keeps the head and the tail of one stream, counts the rest.

    The bytes live in an anonymous private mapping of their own, never in the zygote's heap,
    marked MADV_DONTFORK so no cell forked while it is filled inherits it, and unmapped by
    ``close`` (after the zygote sent them): nothing a cell printed outlives its request in
    the zygote. Reads go straight into the mapping (``os.readv``); the tail is a ring.
    """

    __slots__ = ("head_max", "tail_max", "total", "head_len", "tail_len", "tail_pos", "_map", "_view")

    def __init__(self, head_max: int, tail_max: int) -> None:
        self.head_max = head_max
        self.tail_max = tail_max
        self.total = 0
        self.head_len = 0
        self.tail_len = 0
        self.tail_pos = 0  # where the ring's next byte goes (and, once full, where it starts)
        self._map = mmap.mmap(-1, _SCRATCH + head_max + tail_max, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_DONTFORK)
        self._view = memoryview(self._map)

    def read_from(self, fd: int) -> int:
        """One read from ``fd``; the bytes read (0: end of file)."""
        n = os.readv(fd, [self._view[:_SCRATCH]])
        self._take(n)
        return n

    def add(self, data: bytes) -> None:
        for i in range(0, len(data), _SCRATCH):
            piece = data[i:i + _SCRATCH]
            self._view[:len(piece)] = piece
            self._take(len(piece))

    def _take(self, n: int) -> None:
        """Keep what the scratch holds (its first ``n`` bytes)."""
        self.total += n
        v, base = self._view, _SCRATCH
        used = min(n, self.head_max - self.head_len)
        if used:
            v[base + self.head_len:base + self.head_len + used] = v[:used]
            self.head_len += used
        rest, ring, size = n - used, base + self.head_max, self.tail_max
        if rest <= 0 or size == 0:
            return
        if rest >= size:
            v[ring:ring + size] = v[n - size:n]
            self.tail_pos, self.tail_len = 0, size
            return
        first = min(rest, size - self.tail_pos)
        v[ring + self.tail_pos:ring + self.tail_pos + first] = v[used:used + first]
        if rest > first:
            v[ring:ring + rest - first] = v[used + first:n]
        self.tail_pos = (self.tail_pos + rest) % size
        self.tail_len = min(self.tail_len + rest, size)

    def parts(self) -> tuple[memoryview, list[memoryview]]:
        """(the head, the tail in order as one or two pieces): views into the mapping."""
        base = _SCRATCH
        head = self._view[base:base + self.head_len]
        ring = base + self.head_max
        if self.tail_len < self.tail_max:
            return head, [self._view[ring:ring + self.tail_len]]
        return head, [self._view[ring + self.tail_pos:ring + self.tail_max], self._view[ring:ring + self.tail_pos]]

    def render(self) -> tuple[str, bool]:
        head, tail = self.parts()
        return render_output(bytes(head), b"".join(bytes(t) for t in tail), self.total)

    def close(self) -> None:
        self._view.release()
        self._map.close()


def render_output(head: bytes, tail: bytes, total: int) -> tuple[str, bool]:
    """A stream's text from its head, tail and total length; whether something was cut out."""
    dropped = total - len(head) - len(tail)
    if dropped <= 0:
        return (head + tail).decode("utf-8", "replace"), False
    marker = f"\n[... {dropped} bytes truncated ...]\n".encode()
    return (head + marker + tail).decode("utf-8", "replace"), True


@dataclasses.dataclass(kw_only=True, slots=True)
class Watched:
    verdict: Status | None  # TIMEOUT or OUTPUT_LIMIT when the zygote ended the cell
    exited_at: float | None  # when the cell ended (or its run time did: the deadline)
    reported: tuple[int, float] | None  # (exit code, CPU s) the cell wrote at its end
    captures: tuple[Capture, Capture]  # stdout, stderr
    streams: dict[int, Capture]  # the pipes still open (drained after the kill)


def watch(pid: int, *, timeout: float, start: float, out_r: int, err_r: int, limits: SandboxLimits,
          reported: Callable[[], tuple[int, float] | None], wakeups: int | None = None) -> Watched:
    """Read the cell's output until it ends, reports its end, passes the deadline or the
    output cap. ``reported()``: the cell's end-of-run report, once it has written one and stopped
    (see ``cell``), asked when its output closes and whenever a child changed state (``wakeups``:
    ``child_wakeups``' pipe); a cell that claims its end and runs on is answered at its exit or its
    deadline. Descendants that still hold the pipes when the cell has ended get ``DESCENDANTS_DRAIN_S``."""
    captures = (Capture(limits.output_head_bytes, limits.output_tail_bytes),
                Capture(limits.output_head_bytes, limits.output_tail_bytes))
    streams = {out_r: captures[0], err_r: captures[1]}
    pidfd = os.pidfd_open(pid)
    deadline = start + timeout
    out = Watched(verdict=None, exited_at=None, reported=None, captures=captures, streams=streams)
    ask = False  # a child changed state: ask for the report
    try:
        while streams or out.exited_at is None:
            if out.exited_at is None and (ask or not streams):  # did it report its end, and stop?
                ask, out.reported = False, reported()
                if out.reported is not None:
                    out.exited_at = time.monotonic()
                    if not streams:
                        break
                    deadline = min(deadline, out.exited_at + DESCENDANTS_DRAIN_S)
            now = time.monotonic()
            if now >= deadline:
                if out.exited_at is None:
                    out.verdict, out.exited_at = Status.TIMEOUT, now  # its run time ends with the deadline
                break
            watched = list(streams) + ([pidfd, wakeups] if out.exited_at is None else [])
            ready, _, _ = select.select([fd for fd in watched if fd is not None], [], [], deadline - now)
            for fd in ready:
                if fd == wakeups:
                    _drain_wakeups(wakeups)
                    ask = True
                    continue
                if fd == pidfd:
                    # The cell is done; descendants may still hold the pipes: drain briefly, then kill.
                    out.exited_at = time.monotonic()
                    deadline = min(deadline, out.exited_at + DESCENDANTS_DRAIN_S)
                    continue
                if not streams[fd].read_from(fd):
                    os.close(fd)
                    del streams[fd]
                    continue
                if captures[0].total + captures[1].total > limits.output_hard_cap_bytes:
                    out.verdict = Status.OUTPUT_LIMIT
                    break
            if out.verdict is not None:
                break
    except BaseException:
        for fd in streams:
            os.close(fd)
        raise
    finally:
        os.close(pidfd)
    return out


def _drain_wakeups(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def drain(streams: dict[int, Capture]) -> None:
    """Every writer is dead: read what the pipes still buffer, and close them."""
    for fd, cap in streams.items():
        os.set_blocking(fd, False)
        while True:
            try:
                if not cap.read_from(fd):
                    break
            except BlockingIOError:
                break
        os.close(fd)
    streams.clear()


def classify(*, verdict: Status | None, exit_code: int, cpu_time: float, cpu_limit: int, oom: bool,
             stderr: str, timeout: float, memory_mb: int, output_cap: int) -> tuple[Status, int, str]:
    """(status, exit code, message) of a cell that ended so: ``exit_code`` as
    ``os.waitstatus_to_exitcode`` gives it (negative: killed by that signal), ``oom``: the
    slot's memory cgroup killed a process during the request."""
    if verdict is Status.TIMEOUT:
        return verdict, exit_code, f"wall-clock timeout after {timeout:g} s"
    if verdict is Status.OUTPUT_LIMIT:
        return verdict, exit_code, f"output passed {output_cap} bytes; killed"
    assert verdict is None, verdict
    if exit_code == EXIT_MEMORY or (oom and exit_code != 0):  # (a child's OOM the cell survived: its result)
        return Status.MEMORY, 1 if exit_code == EXIT_MEMORY else exit_code, f"memory limit {memory_mb} MiB exceeded"
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and cpu_time >= cpu_limit - 0.1:
        return Status.TIMEOUT, exit_code, f"CPU time limit {cpu_limit} s exceeded"
    if exit_code == EXIT_SETUP:
        return Status.SANDBOX_ERROR, exit_code, stderr.strip().splitlines()[-1] if stderr.strip() else "setup failed"
    if exit_code == 0:
        return Status.OK, 0, ""
    return Status.ERROR, exit_code, f"killed by signal {signal.Signals(-exit_code).name}" if exit_code < 0 else ""


def exec_result(request_id: str, outcome: CellOutcome, stdout: tuple[bytes, bytes], stderr: tuple[bytes, bytes],
                output_cap: int) -> ExecResult:
    """The ``ExecResult`` of a cell that ended so (built by the worker, from what its zygote sent):
    ``stdout`` and ``stderr`` are (head, tail) as the zygote kept them."""
    if outcome.error:
        return ExecResult(id=request_id, status=Status.SANDBOX_ERROR, message=outcome.error)
    out, out_cut = render_output(*stdout, outcome.stdout[0])
    err, err_cut = render_output(*stderr, outcome.stderr[0])
    status, exit_code, message = classify(
        verdict=Status(outcome.verdict) if outcome.verdict else None, exit_code=outcome.exit_code,
        cpu_time=outcome.cpu_time, cpu_limit=outcome.cpu_limit, oom=outcome.oom, stderr=err,
        timeout=outcome.timeout, memory_mb=outcome.memory_mb, output_cap=output_cap)
    return ExecResult(id=request_id, status=status, stdout=out, stderr=err, exit_code=exit_code,
                      wall_time=outcome.wall_time, cpu_time=outcome.cpu_time, stdout_truncated=out_cut,
                      stderr_truncated=err_cut, message=message)
