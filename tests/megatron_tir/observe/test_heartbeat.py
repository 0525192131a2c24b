"""The heartbeat: a progress line in a log file at most every interval, with rates and ETAs; a bar on a terminal."""

from __future__ import annotations

import io
import logging
import time

import pytest

from megatron_tir.observe import heartbeat as hb
from megatron_tir.observe.heartbeat import Heartbeat, format_duration, interval_s, phase_progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_line_at_most_every_interval_with_rate_and_etas(caplog):
    clock = Clock()
    beat = Heartbeat("rollout step 3/10", 100, interval_s=60.0, rest_of_step_s=150.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=hb.log.name):
        for _ in range(10):  # 10 trajectories in 50 s: no line yet
            clock.t += 5.0
            beat.update(1, tokens=200)
        assert not caplog.records
        clock.t += 10.0  # 60 s in, 11 done, 2,200 tokens
        beat.update(1, tokens=200)
        clock.t += 30.0  # 30 s after the line: none
        beat.update(1, tokens=200)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["heartbeat | rollout step 3/10 | 11/100 traj | 37 tok/s | phase ETA ~8 min 5 s | "
                     "step ETA ~10 min 35 s"]
    # by hand: 2,200 tokens / 60 s = 36.7 tok/s; 89 left at 60/11 s each = 485 s = 8 min 5 s; + 150 s


def test_no_eta_before_a_tenth_of_the_phase_is_done():
    clock = Clock()
    beat = Heartbeat("eval", 28, interval_s=1.0, clock=clock)
    clock.t += 60.0
    beat.done = 2  # 7%: an early burst says little about the rest
    assert beat.line() == "heartbeat | eval | 2/28 traj"
    beat.done = 3
    assert beat.line() == "heartbeat | eval | 3/28 traj | phase ETA ~8 min 20 s"  # 25 left x 20 s


def test_a_phase_with_nothing_finished_says_so_and_no_total_counts_only():
    clock = Clock()
    beat = Heartbeat("eval", None, unit="micro-batch", interval_s=1.0, clock=clock)
    clock.t += 125.0
    assert beat.line() == "heartbeat | eval | 0 micro-batch | 2 min 5 s in, nothing finished yet"


def test_the_context_beats_while_nothing_finishes(caplog):
    with caplog.at_level(logging.INFO, logger=hb.log.name):
        with Heartbeat("update", 4, unit="micro-batch", interval_s=0.05) as beat:
            end = time.monotonic() + 30  # one long micro-batch: nothing finishes (a 0.4 s sleep raced a loaded
            while beat.lines < 2 and time.monotonic() < end:  # machine's thread scheduling)
                time.sleep(0.01)
        lines = beat.lines
        time.sleep(0.2)
    assert lines >= 2 and beat.lines == lines  # the thread stopped with the block
    assert all("0/4 micro-batch" in r.getMessage() and "nothing finished yet" in r.getMessage()
               for r in caplog.records)


def test_terminal_gets_the_bar_a_file_gets_the_heartbeat():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(phase_progress("rollout", 8, stream=io.StringIO()), Heartbeat)
    assert not isinstance(phase_progress("rollout", 8, stream=Tty()), Heartbeat)


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv(hb.INTERVAL_ENV, raising=False)
    assert interval_s() == 60.0
    monkeypatch.setenv(hb.INTERVAL_ENV, "2.5")
    assert interval_s() == 2.5
    for bad in ("soon", "0", "-1", "nan"):
        monkeypatch.setenv(hb.INTERVAL_ENV, bad)
        with pytest.raises(ValueError, match=hb.INTERVAL_ENV):
            interval_s()


@pytest.mark.parametrize(("seconds", "text"), [(0, "0 s"), (59.6, "1 min 0 s"), (400, "6 min 40 s"),
                                               (4320, "1 h 12 min")])
def test_durations(seconds, text):
    assert format_duration(seconds) == text
