"""Per-request supervision: watch a running cell's output and clock, then name its outcome.

``watch`` enforces the wall clock and the output cap while capturing head and tail of both
streams; ``classify`` is the pure mapping from how the cell ended (the zygote's verdict,
exit status, CPU time, OOM kills) to a ``Status``, its exit code and message.
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import time
from collections.abc import Callable

from ..limits import SandboxLimits
from ..protocol import Status
from .cell import EXIT_MEMORY, EXIT_SETUP


class Capture:
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


@dataclasses.dataclass(kw_only=True, slots=True)
class Watched:
    verdict: Status | None  # TIMEOUT or OUTPUT_LIMIT when the zygote ended the cell
    exited_at: float | None  # when the cell ended (or its run time did: the deadline)
    reported: tuple[int, float] | None  # (exit code, CPU s) the cell wrote at its end
    captures: tuple[Capture, Capture]  # stdout, stderr
    streams: dict[int, Capture]  # the pipes still open (drained after the kill)


def watch(pid: int, *, timeout: float, start: float, out_r: int, err_r: int, limits: SandboxLimits,
          reported: Callable[[], tuple[int, float] | None]) -> Watched:
    """Read the cell's output until it ends, reports its end, passes the deadline or the
    output cap. ``reported()``: the cell's end-of-run report, once it has written one."""
    captures = (Capture(limits.output_head_bytes, limits.output_tail_bytes),
                Capture(limits.output_head_bytes, limits.output_tail_bytes))
    streams = {out_r: captures[0], err_r: captures[1]}
    pidfd = os.pidfd_open(pid)
    deadline = start + timeout
    out = Watched(verdict=None, exited_at=None, reported=None, captures=captures, streams=streams)
    try:
        while streams or out.exited_at is None:
            if not streams and out.exited_at is None:  # its output is closed: did it report its end?
                out.reported = reported()
                if out.reported is not None:
                    out.exited_at = time.monotonic()
                    break
            now = time.monotonic()
            if now >= deadline:
                if out.exited_at is None:
                    out.verdict, out.exited_at = Status.TIMEOUT, now  # its run time ends with the deadline
                break
            watched = list(streams) + ([pidfd] if out.exited_at is None else [])
            ready, _, _ = select.select(watched, [], [], deadline - now)
            for fd in ready:
                if fd == pidfd:
                    # The cell is done; descendants may still hold the pipes: drain briefly, then kill.
                    out.exited_at = time.monotonic()
                    deadline = min(deadline, out.exited_at + 0.05)
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    os.close(fd)
                    del streams[fd]
                    continue
                streams[fd].add(data)
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


def drain(streams: dict[int, Capture]) -> None:
    """Every writer is dead: read what the pipes still buffer, and close them."""
    for fd, cap in streams.items():
        os.set_blocking(fd, False)
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            cap.add(data)
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
