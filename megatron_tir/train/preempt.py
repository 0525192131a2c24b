"""Stopping a run cleanly: Slurm's pre-timeout signal (SIGUSR1) and SIGTERM end the run after the step in
progress, with a run checkpoint, and exit status 0.

``StopSignals`` (a context manager, entered by ``run_training`` around the loop) turns the signals into
a flag; the loop asks :func:`agreed` at the end of every step, which all-reduces (MAX, on the group's
device) this rank's flags, so every rank takes the same decision at the same step: the signal may reach
the ranks at different moments, the checkpoint is collective. The same call settles the time-based
checkpoint interval (``trainer.checkpoint.minutes``), whose clocks differ slightly between ranks.
"""

from __future__ import annotations

import logging
import signal

import torch

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignals:
    """SIGUSR1 / SIGTERM -> ``received`` (the first signal's name); the previous handlers come back on exit."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame) -> None:
        if self.received is None:
            log.warning("%s: the run stops after this step, with a checkpoint", signal.Signals(signum).name)
        self.received = self.received or signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def agreed(*flags: bool) -> list[bool]:
    """Each flag OR-ed over all ranks (one all-reduce); collective."""
    from megatron_tir.policy.parallel import collective_device

    values = torch.tensor([float(f) for f in flags], device=collective_device())
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]
