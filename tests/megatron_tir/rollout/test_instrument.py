"""InstrumentedEngine bookkeeping (used by the benchmark and the exactness tests); EngineActivity."""

import asyncio
import time

from megatron_tir.rollout.engines.base import FinishReason, SamplingParams
from megatron_tir.rollout.instrument import EngineCall, InstrumentedEngine
from scripted_engine import ScriptedEngine


def call(t0, t1, n=1):
    return EngineCall(prompt_ids=(1,), params=SamplingParams(max_new_tokens=4), token_ids=(7,) * n,
                      logprobs=(-1.0,) * n, finish_reason=FinishReason.LENGTH, t_start=t0, t_end=t1)


def test_busy_seconds_is_the_union_of_request_intervals(smollm2_tokenizer):
    inst = InstrumentedEngine(ScriptedEngine(smollm2_tokenizer, lambda ctx: "x"))
    inst.calls = [call(0.0, 1.0, 2), call(0.5, 2.0), call(3.0, 4.0), call(3.2, 3.5)]
    assert inst.busy_seconds() == 3.0  # [0, 2] and [3, 4]
    assert inst.generated_tokens == 5


def test_records_what_the_wrapped_engine_returned(smollm2_tokenizer):
    engine = ScriptedEngine(smollm2_tokenizer, lambda ctx: "Hello there, world.")
    inst = InstrumentedEngine(engine)
    gen = asyncio.run(inst.generate([1, 2, 3], SamplingParams(max_new_tokens=3)))
    (c,) = inst.calls
    assert c.prompt_ids == (1, 2, 3) and list(c.token_ids) == gen.token_ids and len(gen.token_ids) == 3
    assert c.finish_reason is FinishReason.LENGTH and c.t_end >= c.t_start


class Sleeper:
    """An engine whose request takes ``max_new_tokens / 100`` seconds and generates nothing; each request's
    span by the clock is kept (``spans``): a loaded machine stretches the sleeps, so the tests compare the
    meter with the spans that really happened, not with the nominal seconds."""
    eos_token_ids = (0,)
    weight_version = 0

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    async def generate(self, prompt_ids, params):
        from megatron_tir.rollout.engines.base import Generation

        start = time.perf_counter()
        await asyncio.sleep(params.max_new_tokens / 100)
        self.spans.append((start, time.perf_counter()))
        return Generation(token_ids=[], logprobs=[], finish_reason=FinishReason.LENGTH)


TOLERANCE_S = 0.05  # the meter's clock readings and the spans' are a few statements apart


def test_engine_activity_counts_time_with_a_request_in_flight_once():
    """Two overlapping requests, a gap, a third: busy = the union of their spans (by the clock)."""
    from megatron_tir.rollout.instrument import EngineActivity

    async def main():
        meter = EngineActivity(engine := Sleeper())
        t0 = time.perf_counter()
        await asyncio.gather(meter.generate([1], SamplingParams(max_new_tokens=20)),  # 0.2 s
                             meter.generate([1], SamplingParams(max_new_tokens=30)))  # 0.3 s, overlapping
        await asyncio.sleep(0.3)  # idle
        during = meter.busy_s()
        await meter.generate([1], SamplingParams(max_new_tokens=10))
        return during, meter.busy_s(), time.perf_counter() - t0, engine.spans

    during, busy, wall, spans = asyncio.run(main())
    (s1, e1), (s2, e2), (s3, e3) = sorted(spans)
    union = max(e1, e2) - min(s1, s2)
    assert union < (e1 - s1) + (e2 - s2) - 0.15  # they did overlap (by ~0.2 s), so union and sum differ
    assert abs(during - union) < TOLERANCE_S, (during, spans)  # the union, not the sum (~0.5 s)
    assert abs(busy - union - (e3 - s3)) < TOLERANCE_S, (busy, spans)  # the idle gap not counted
    assert wall >= 0.7


def test_engine_activity_does_not_count_a_sync_as_busy():
    """A request in flight across a sync (retracted, waiting for the new weights): the seconds inside
    ``paused()`` are not busy ones; paused with nothing in flight counts nothing either."""
    from megatron_tir.rollout.instrument import EngineActivity

    async def main():
        meter = EngineActivity(engine := Sleeper())
        request = asyncio.ensure_future(meter.generate([1], SamplingParams(max_new_tokens=60)))  # 0.6 s in flight
        await asyncio.sleep(0.1)
        p0 = time.perf_counter()
        with meter.paused():  # 0.3 s of the request's span: a sync
            await asyncio.sleep(0.3)
            inside = meter.busy_s()
        p1 = time.perf_counter()
        await request
        with meter.paused():  # nothing in flight
            await asyncio.sleep(0.1)
        return inside, meter.busy_s(), (p0, p1), engine.spans

    inside, busy, (p0, p1), [(s, e)] = asyncio.run(main())
    paused_in_flight = min(e, p1) - max(s, p0)
    assert paused_in_flight > 0.1, (s, e, p0, p1)  # the sync did fall inside the request (~0.3 s of it)
    assert abs(inside - (min(p0, e) - s)) < TOLERANCE_S, (inside, s, e, p0)  # only the seconds before the pause
    assert abs(busy - ((e - s) - paused_in_flight)) < TOLERANCE_S, (busy, s, e, p0, p1)  # in flight minus paused
