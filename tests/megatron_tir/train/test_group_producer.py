"""The producer of ``trainer.async=full`` (megatron_tir.train.group_producer) with a scripted rollout
at the engine edge: each group finishes when the test releases it, its tokens carrying the versions
the test gives. Admission, staleness drops, the filter and the prompt positions a checkpoint records
are checked against the rules written out by hand (AReaL's bound: accepted + running <= (eta + v + 1) * batch)."""

from __future__ import annotations

import asyncio

import pytest

from megatron_tir.rollout.batch import Group
from megatron_tir.rollout.trajectory import FinishStatus, Trajectory
from megatron_tir.train.config import DataConfig, FilterConfig
from megatron_tir.train.data import PromptStream
from megatron_tir.train.group_producer import GroupProducer


class Scripted:
    """``arollout`` stand-in: group ``pos`` waits for ``release(pos, versions, rewards)``."""

    def __init__(self) -> None:
        self.version = 0
        self.gates: dict[int, asyncio.Future] = {}

    async def arollout(self, problems, cfg, *, group_id_offset: int):
        (problem,) = problems
        gate = self.gates[group_id_offset] = asyncio.get_running_loop().create_future()
        versions, rewards = await gate
        trajs = []
        for i, reward in enumerate(rewards):
            t = Trajectory(group_id=group_id_offset, sample_index=i, prompt_ids=[1, 2, 3],
                           problem_index=problem.index)
            t.append_model_tokens([5 + k for k in range(len(versions))], [-1.0] * len(versions), list(versions))
            t.status, t.reward = FinishStatus.COMPLETED, reward
            trajs.append(t)
        return [Group(group_id=group_id_offset, problem=problem, trajectories=trajs)]

    def release(self, pos: int, versions=(0,), rewards=(0.0, 1.0)) -> None:
        self.gates[pos].set_result((versions, rewards))


def producer(script: Scripted, *, batch=2, eta=1, max_groups=100, stream=None) -> GroupProducer:
    return GroupProducer(arollout=script.arollout, stream=stream or PromptStream(DataConfig()),
                         rollout_cfg=lambda: None, version=lambda: script.version, batch=batch, max_staleness=eta,
                         filters=FilterConfig(drop_zero_std=True), max_groups=max_groups)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_admission_follows_the_bound_and_a_sync_admits_the_next_batch():
    async def main():
        s = Scripted()
        p = producer(s, batch=2, eta=1)
        await p.start()
        await settle()
        started_v0 = sorted(s.gates)  # (eta + 0 + 1) * batch = 4 may run at version 0
        for pos in (0, 1):
            s.release(pos)
        taken = await p.take(2)
        await settle()
        after_take = sorted(s.gates)  # 2 accepted (taken) + 2 running = 4: nothing new before a sync
        s.version = 1
        await p.poke()
        await settle()
        after_sync = sorted(s.gates)  # capacity (1 + 1 + 1) * 2 = 6
        await p.stop()
        return started_v0, taken, after_take, after_sync

    started_v0, taken, after_take, after_sync = asyncio.run(main())
    assert started_v0 == [0, 1, 2, 3]
    assert [g.group_id for g in taken.collected.groups] == [0, 1] and taken.stale == 0
    assert after_take == [0, 1, 2, 3] and after_sync == [0, 1, 2, 3, 4, 5]
    assert taken.data_position == 2 and taken.consumed_ahead == [] and taken.in_flight == 2


def test_a_group_older_than_eta_is_dropped_counted_and_frees_its_slot():
    async def main():
        s = Scripted()
        p = producer(s, batch=1, eta=1)
        await p.start()
        await settle()  # positions 0, 1 run (2 slots at version 0)
        s.release(1, versions=(0, 0))
        first = await p.take(1)  # group 1 at version 0
        s.version = 2  # two syncs later, group 0 finishes: its oldest token is 2 versions old
        await p.poke()
        await settle()
        s.release(0, versions=(0, 2))
        s.release(2, versions=(1, 2))
        second = await p.take(1)
        await settle()
        started = sorted(s.gates)
        await p.stop()
        return first, second, p, started

    first, second, p, started = asyncio.run(main())
    assert started == [0, 1, 2, 3, 4]  # (1 + 2 + 1) * 1 - 2 accepted - 1 running: the dropped group's slot is reused
    assert [g.group_id for g in first.collected.groups] == [1]
    assert [g.group_id for g in second.collected.groups] == [2]
    assert second.stale == 1 and second.collected.removed["stale"] == 1 and p.bound.dropped == 1
    assert [g.group_id for g in second.collected.sampled] == [2, 0]  # reported once, at the take that dropped it
    from megatron_tir.observe.dumps import update_records
    from megatron_tir.rollout.batch import collate
    from megatron_tir.train.batch import plan_update
    from megatron_tir.train.producer import row_fates

    plan = plan_update(collate(second.collected.groups, pad_id=0), mode="simpletir", advantage="grpo",
                       overlong="keep", mini_batches=1)
    decided = row_fates(second.collected, plan)  # the producer's: the stale rule recorded at the take
    fates = update_records(second.collected.sampled, decided, drop_void=True, overlong="keep")
    assert fates[(0, 0)]["dropped_by"].startswith("stale") and fates[(2, 0)]["in_loss"]
    assert second.data_position == 3 and second.consumed_ahead == []


def test_groups_finish_out_of_order_and_the_checkpoint_position_returns_the_unconsumed_prompts():
    async def main():
        s = Scripted()
        stream = PromptStream(DataConfig())
        p = producer(s, batch=1, eta=2, stream=stream)  # 3 slots at version 0: positions 0, 1, 2
        await p.start()
        await settle()
        s.release(2)
        s.release(1, rewards=(1.0, 1.0))  # zero std: the filter drops it, its slot is free again
        taken = await p.take(1)
        await settle()
        await p.stop()
        return taken, sorted(s.gates)

    taken, started = asyncio.run(main())
    assert [g.group_id for g in taken.collected.groups] == [2]
    assert taken.collected.removed["zero_std"] == 1 and {g.group_id for g in taken.collected.sampled} == {1, 2}
    assert started == [0, 1, 2, 3]  # the filtered group's slot went to position 3
    assert taken.data_position == 0 and taken.consumed_ahead == [1, 2]  # 0 is in flight: back to the stream
    resumed = PromptStream(DataConfig(), position=taken.data_position, skip=taken.consumed_ahead)
    assert [resumed.draw()[0] for _ in range(3)] == [0, 3, 4]  # none lost, none drawn twice


def test_a_take_returns_short_once_max_groups_finished_without_enough_passing():
    async def main():
        s = Scripted()
        p = producer(s, batch=2, eta=1, max_groups=2)
        await p.start()
        await settle()
        s.release(0, rewards=(1.0, 1.0))
        s.release(1)
        taken = await asyncio.wait_for(p.take(2), 5)
        await p.stop()
        return taken

    taken = asyncio.run(main())
    assert [g.group_id for g in taken.collected.groups] == [1] and taken.collected.rounds == 2


def test_a_failed_group_ends_the_take_with_its_error():
    async def main():
        s = Scripted()
        p = producer(s, batch=1, eta=0)
        await p.start()
        await settle()
        s.gates[0].set_exception(RuntimeError("sandbox gone"))
        with pytest.raises(RuntimeError, match="sandbox gone"):
            await asyncio.wait_for(p.take(1), 5)
        await p.stop()

    asyncio.run(main())


# ---------------------------------------------------------------------- with a real engine across syncs


def test_full_mode_over_syncs_with_interruptions_on_the_local_engine(make_tiny_hf):
    """Three steps of eta = 1 against a LocalEngine whose syncs retract requests in flight (the sync
    of full mode), the engine running until a request is mid-way standing in for each update: no trained token is more than one
    version behind the weights the step updates from, trajectories are interrupted mid-turn and
    continue (never aborted), and every token's recorded version is the one whose weights give its
    engine log-prob (an independent forward pass per version, version_testing)."""
    from version_testing import check_versions_against_weights, weight_sets

    from megatron_tir.rollout import RolloutConfig, TIRRollout, collate
    from megatron_tir.rollout.engines.base import FinishReason, PauseMode
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig
    from megatron_tir.rollout.sync import buckets_of
    from megatron_tir.rollout.sync.local import LocalWeightSync
    from megatron_tir.train.metrics import interruption_metrics

    tiny = make_tiny_hf("qwen2", tie_word_embeddings=False)
    steps = 3
    sets = weight_sets(tiny, steps + 1)
    cfg = RolloutConfig(n_samples=2, max_turns=1, max_response_tokens=96, tools=False, seed=3)

    async def main():
        engine = LocalEngine(LocalEngineConfig(model=str(tiny), eos_token_ids=(0,), max_batch_size=4, seed=0))
        sync = LocalWeightSync(engine, pause_mode=PauseMode.RETRACT)
        driver = TIRRollout(engine, engine.tokenizer, None, cfg)

        async def arollout(problems, _cfg, *, group_id_offset):
            groups = await driver.run(problems, group_id_offset=group_id_offset)
            for t in groups[0].trajectories:
                t.reward = float(t.sample_index)  # a spread: the group filter keeps it
            return groups

        p = GroupProducer(arollout=arollout, stream=PromptStream(DataConfig()), rollout_cfg=lambda: cfg,
                          version=lambda: engine.weight_version, batch=2, max_staleness=1,
                          filters=FilterConfig(), max_groups=100)
        await p.start()
        steps_taken = []
        for step in range(1, steps + 1):
            taken = await p.take(2)
            steps_taken.append(taken)
            # "training": the engine keeps generating the next groups; the sync lands once one of them has 8
            # tokens (a fixed 0.05 s raced both ways: all done on an idle CPU, none started on a loaded one)
            while (live := list(engine._live)) and not any(len(r.token_ids) >= 8 and r.finish is None for r in live):
                await asyncio.sleep(0.002)
            await sync.update(buckets_of(sets[step], 64 << 10))
            await p.poke()
        await p.stop()
        await engine.close()
        return steps_taken

    steps_taken = asyncio.run(asyncio.wait_for(main(), 300))
    groups = [g for t in steps_taken for g in t.collected.groups]
    assert len(groups) == 2 * steps and len({g.group_id for g in groups}) == 2 * steps  # none twice
    for taken in steps_taken:
        for g in taken.collected.groups:
            for t in g.trajectories:
                lag = [taken.version - v for v in t.response_versions if v >= 0]
                assert lag and max(lag) <= 1 and min(lag) >= 0
                assert t.status.value != "aborted" and all(turn.finish_reason is not FinishReason.ABORT
                                                           for turn in t.turns)
    interrupted = interruption_metrics(groups)
    assert interrupted["rollout/interrupted_share"] > 0 and interrupted["rollout/interrupted_spans_mean"] >= 2
    batch = collate(groups, pad_id=0)
    check_versions_against_weights(batch, tiny, sets)


def test_a_held_producer_admits_nothing_new_and_resumes_where_the_bound_stands():
    """hold(True) (a held-out evaluation runs): groups in flight finish and are taken, but no slot
    they free is refilled, not even after a sync, until hold(False)."""
    async def main():
        s = Scripted()
        p = producer(s, batch=2, eta=1)
        await p.start()
        await settle()
        started = sorted(s.gates)  # (eta + 0 + 1) * batch = 4
        await p.hold(True)
        for pos in (0, 1):
            s.release(pos)
        taken = await p.take(2)
        s.version = 1
        await p.poke()  # the bound would admit 2 more: (1 + 1 + 1) * 2 - 2 taken - 2 running
        await settle()
        held = sorted(s.gates)
        await p.hold(False)
        await settle()
        released = sorted(s.gates)
        await p.stop()
        return started, taken, held, released

    started, taken, held, released = asyncio.run(main())
    assert started == [0, 1, 2, 3] and [g.group_id for g in taken.collected.groups] == [0, 1]
    assert held == [0, 1, 2, 3]
    assert released == [0, 1, 2, 3, 4, 5]


def test_critic_warmup_without_filter_keeps_zero_std_groups_and_a_later_step_removes_them():
    """critic.filter_in_warmup=false in ``full``: a warm-up step (here step 1 of warmup_steps=1) takes
    zero-std groups the filter would drop; a group kept that way but left for step 2 is removed there
    by the zero-std rule (ZeroTIR filters once the actor trains), and step 2's own finishes are filtered."""
    from megatron_tir.train.critic_update import CriticConfig, warmup_unfiltered

    critic = CriticConfig(warmup_steps=1, filter_in_warmup=False)

    async def main():
        s = Scripted()
        p = GroupProducer(arollout=s.arollout, stream=PromptStream(DataConfig()), rollout_cfg=lambda: None,
                          version=lambda: s.version, batch=2, max_staleness=1,
                          filters=FilterConfig(drop_zero_std=True), max_groups=100,
                          unfiltered=lambda step: warmup_unfiltered(critic, uses_critic=True, step=step), first_step=1)
        await p.start()
        await settle()
        for pos in (0, 1, 2):  # all zero std, finishing while step 1 (warm-up) is next
            s.release(pos, rewards=(1.0, 1.0))
        await settle()
        step1 = await p.take(2)
        s.version = 1
        await p.poke()
        await settle()
        for pos in (3, 4, 5):  # step 2 is past the warm-up: 3 zero std, 4 and 5 mixed
            s.release(pos, rewards=(1.0, 1.0) if pos == 3 else (0.0, 1.0))
        await settle()
        step2 = await p.take(2)
        await p.stop()
        return step1, step2

    step1, step2 = asyncio.run(main())
    assert [g.group_id for g in step1.collected.groups] == [0, 1]
    assert step1.collected.removed["zero_std"] == 0
    assert [g.group_id for g in step2.collected.groups] == [4, 5]
    assert step2.collected.rules[2] == "zero_std" and step2.collected.rules[3] == "zero_std"
    assert step2.collected.removed["zero_std"] == 2
    assert step2.data_position == 6 and step2.consumed_ahead == []
