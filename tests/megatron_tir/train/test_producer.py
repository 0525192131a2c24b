"""Rank 0's producer on its own (no process group): what a step's hand-off header says."""

from __future__ import annotations

from types import SimpleNamespace

from source_ranks import CraftedService, source_config

from megatron_tir.train.producer import STRATEGIES, Continuous, Producer, Rounds


def _producer(service, **overrides):
    return Producer(source_config(), service, position=0, consumed_ahead=(), schedule_switched_at=None, pad_id=0,
                    dp_size=1, **overrides)


def test_a_step_with_a_sandbox_that_became_unavailable_stops_the_run_with_its_line():
    service = CraftedService()
    try:
        service.sandbox = SimpleNamespace(unavailable="the sandbox is unavailable: 8 calls in a row failed")
        p = _producer(service)
        p.submit(1)
        produced = p.produce(1)
    finally:
        service.close()
    assert produced.header["stop"] == "the sandbox is unavailable: 8 calls in a row failed"
    assert produced.shares is None


def test_a_healthy_step_hands_off_rows_and_its_position():
    service = CraftedService()
    try:
        service.sandbox = SimpleNamespace(unavailable=None)
        p = _producer(service)
        assert not p.submitted(1) and p.idle
        p.submit(1)
        assert p.submitted(1) and not p.idle
        produced = p.produce(1)
    finally:
        service.close()
    assert produced.header["stop"] is None and produced.shares is not None
    assert produced.header["data_position"] == 4 and produced.metrics["filter/groups_kept"] == 4.0


def test_one_strategy_per_async_mode():
    assert STRATEGIES == {"off": Rounds, "one_step": Rounds, "full": Continuous}


def test_one_step_runs_ahead_and_drains_before_the_sync():
    """``one_step``: taking step 1 starts step 2's rounds (the last step starts none); ``drain_ahead``
    waits for them and says how long; ``off`` starts nothing ahead and drains nothing."""
    from megatron_tir.train.config import apply_overrides

    for mode, ahead in (("one_step", True), ("off", False)):
        service = CraftedService(delay_s=0.2)
        try:
            service.sandbox = SimpleNamespace(unavailable=None)
            p = Producer(apply_overrides(source_config(), [f"trainer.async={mode}", "trainer.steps=2"]), service,
                         position=0, consumed_ahead=(), schedule_switched_at=None, pad_id=0, dp_size=1)
            first = p.take(1)
            assert p.submitted(2) is ahead and first.header["data_position"] == 4
            drained = p.drain_ahead(1)
            assert (drained is not None and drained > 0.1) if ahead else drained is None  # 0.2 s rounds
            assert p.take(2).header["data_position"] == 8 and not p.submitted(3)  # the last step: nothing ahead
            assert p.drain_ahead(2) is None and p.idle
        finally:
            service.close()
