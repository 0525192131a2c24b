"""The observer of the ranks that write nothing (megatron_tir.train.loop._NoObserver): a resume restores
its grad-norm history, which must stay that run's (one per observer, not one shared by every instance)."""

from __future__ import annotations

from megatron_tir.train.loop import _NoObserver


def test_each_observer_has_its_own_grad_norm_history():
    first = _NoObserver()
    first.spikes.restore([1.0, 2.0, 3.0])  # what loop.run does on a resume of a non-zero rank
    second = _NoObserver()
    assert first.spikes.history == [1.0, 2.0, 3.0]
    assert second.spikes.history == []
    assert first.spikes is not second.spikes
