"""Progress of a long phase that reads in a log file: a heartbeat line at most every minute.

On a terminal a phase shows a tqdm bar; under ``nohup``, in a Slurm job or any log file a bar
prints nothing (tqdm disables itself), and a 30-minute rollout phase would be 30 minutes of
silence. :func:`phase_progress` picks: the bar on a terminal, a :class:`Heartbeat` otherwise.
Both take ``update(n, tokens=...)`` and are context managers (the heartbeat then also beats from a
thread while nothing finishes: a first turn, or one micro-batch of a large model, can take minutes).
A heartbeat line::

    heartbeat | rollout step 3/10 | 96/256 traj | 412 tok/s | phase ETA ~6 min 40 s | step ETA ~9 min 5 s

is logged at INFO (logger ``megatron_tir.heartbeat``) when ``interval_s`` (60 s, or
``$MEGATRON_TIR_HEARTBEAT_S``) has passed since the phase started or since the last line, so a
short phase logs nothing. The rates count from the
phase's start; the phase ETA is what is left at the completion rate so far, shown once a tenth
of the phase is done (trajectories decoded together finish in bursts: an early ETA runs long);
the step ETA adds ``rest_of_step_s`` (the caller's estimate of the step's other phases, e.g. the
last step's).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("megatron_tir.heartbeat")
INTERVAL_ENV = "MEGATRON_TIR_HEARTBEAT_S"  # seconds between heartbeat lines (default 60)
INTERVAL_S = 60.0
# no ETA before this share of the phase is done: trajectories decoded together finish in bursts, so the
# first few completions say little about the rest
ETA_AFTER = 0.1


def interval_s() -> float:
    """The heartbeat interval: ``$MEGATRON_TIR_HEARTBEAT_S`` or 60 s; ValueError naming the variable if bad."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={text!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{INTERVAL_ENV} must be a positive number of seconds, got {text!r}")
    return value


def format_duration(seconds: float) -> str:
    """``42 s``, ``6 min 40 s``, ``1 h 12 min``."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Heartbeat:
    """Counts a phase's work and logs a progress line at most every ``interval_s`` seconds."""

    def __init__(self, phase: str, total: int | None, *, unit: str = "traj", interval_s: float = INTERVAL_S,
                 rest_of_step_s: float | None = None, logger: logging.Logger = log,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"heartbeat interval_s must be > 0, got {interval_s}")
        if total is not None and total < 0:
            raise ValueError(f"heartbeat total must be >= 0, got {total}")
        self.phase, self.total, self.unit, self.interval_s = phase, total, unit, interval_s
        self.rest_of_step_s, self.logger, self.clock = rest_of_step_s, logger, clock
        self.done = 0
        self.tokens = 0
        self.lines = 0
        self._t0 = self._last = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, n: int = 1, *, tokens: int = 0) -> None:
        """``n`` more units done (``tokens`` generated with them); logs a line when one is due."""
        self.done += n
        self.tokens += tokens
        self.beat()

    def beat(self) -> None:
        """Log a line if ``interval_s`` has passed since the last one (from ``update`` or the ticking thread)."""
        with self._lock:
            now = self.clock()
            if now - self._last < self.interval_s:
                return
            self._last = now
            self.lines += 1
        self.logger.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        """The heartbeat line as of ``now``."""
        now = self.clock() if now is None else now
        elapsed = max(now - self._t0, 1e-9)
        parts = ["heartbeat", self.phase]
        parts.append(f"{self.done}/{self.total} {self.unit}" if self.total is not None else f"{self.done} {self.unit}")
        if self.tokens:
            parts.append(f"{self.tokens / elapsed:.0f} tok/s")
        if self.total and max(2, self.total * ETA_AFTER) <= self.done < self.total:
            left = (self.total - self.done) * elapsed / self.done
            parts.append(f"phase ETA ~{format_duration(left)}")
            if self.rest_of_step_s is not None:
                parts.append(f"step ETA ~{format_duration(left + self.rest_of_step_s)}")
        elif not self.done:
            parts.append(f"{format_duration(elapsed)} in, nothing finished yet")
        return " | ".join(parts)

    def __enter__(self) -> Heartbeat:
        """Also beat from a daemon thread while nothing finishes (until the block ends)."""
        def tick() -> None:
            while not self._stop.wait(min(self.interval_s, 5.0)):
                self.beat()

        self._thread = threading.Thread(target=tick, name=f"heartbeat-{self.phase}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class _Bar:
    """tqdm behind the heartbeat's interface (tokens are not shown on the bar)."""

    def __init__(self, phase: str, total: int | None, unit: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=phase, unit=unit, leave=False)

    def update(self, n: int = 1, *, tokens: int = 0) -> None:
        self._bar.update(n)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


def is_terminal(stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def phase_progress(phase: str, total: int | None, *, unit: str = "traj", interval: float | None = None,
                   rest_of_step_s: float | None = None, stream=None):
    """A tqdm bar when ``stream`` (stderr) is a terminal, else a :class:`Heartbeat` for the log file
    (every ``interval`` seconds; default :func:`interval_s`)."""
    if is_terminal(stream):
        return _Bar(phase, total, unit)
    return Heartbeat(phase, total, unit=unit, interval_s=interval or interval_s(), rest_of_step_s=rest_of_step_s)
