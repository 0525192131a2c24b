"""Rank functions for the rollout-source tests (spawned processes import them by name).

``CraftedService`` stands in for rank 0's RolloutService at the engine edge: it returns crafted,
scored groups (real ``Trajectory`` / ``Group`` records) after an asyncio sleep, on a real
``EventLoopThread``; everything after it -- the source, the hand-off, the Learner -- is real.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import torch

from megatron_tir.rollout.batch import Group
from megatron_tir.rollout.trajectory import FinishStatus, Trajectory
from megatron_tir.train.config import apply_overrides
from megatron_tir.train.recipes import load_recipe
from megatron_tir.rollout.event_loop import EventLoopThread

C, V = FinishStatus.COMPLETED, FinishStatus.VOID
# per group: (status, reward, model tokens) of each sample -- lengths differ so the dealing matters
SPECS = [
    [(C, 1.0, 9), (C, 0.0, 3), (V, 0.0, 6)],
    [(C, 0.0, 5), (C, 1.0, 7), (C, 0.0, 2)],
    [(C, 1.0, 4), (C, 1.0, 8), (C, 0.0, 6)],
    [(C, 0.0, 3), (C, 1.0, 5), (C, 1.0, 10)],
]


def crafted_groups(offset: int, n: int) -> list[Group]:
    out = []
    for g in range(n):
        gid = offset + g
        trajs = []
        for i, (status, reward, tokens) in enumerate(SPECS[gid % len(SPECS)]):
            t = Trajectory(group_id=gid, sample_index=i, prompt_ids=[1, 2, 3 + gid % 5])
            t.append_model_tokens([20 + (7 * gid + 3 * i + k) % 200 for k in range(tokens)],
                                  [-0.5 - 0.1 * k for k in range(tokens)], [0] * tokens)
            t.status, t.reward = status, reward
            trajs.append(t)
        out.append(Group(group_id=gid, problem=None, trajectories=trajs))
    return out


class CraftedService:
    def __init__(self, delay_s: float = 0.0, marker: str | None = None) -> None:
        self.delay_s, self.marker = delay_s, marker
        self.tokenizer = None
        self.weight_version = 0  # the crafted tokens' version (no sync happens here)
        self._loop = EventLoopThread()

    def submit(self, coro):
        return self._loop.submit(coro)

    async def arollout(self, problems, config, *, group_id_offset: int = 0, progress: bool = False):
        if self.marker:
            Path(self.marker).write_text("rolling")
        await asyncio.sleep(self.delay_s)
        return crafted_groups(group_id_offset, len(problems))

    def take_stale_responses(self) -> int:  # RolloutService's: no engine here, nothing dropped
        return 0

    def waiting(self) -> None:  # RolloutService's: no engine kind here, nothing to hand back
        pass

    def close(self) -> None:
        self._loop.close()


def source_config(prompts: int = 4, mini_batches: int = 1):
    return apply_overrides(load_recipe("tiny-cpu"), [
        f"trainer.sampling.prompts_per_step={prompts}", f"trainer.ppo.mini_batches={mini_batches}",
        "trainer.mode=simpletir", "trainer.progress=false"])


def slow_rollout_rank(rank: int, world: int, delay_s: float, out: str) -> None:
    """A 3 s process-group timeout and a rollout of ``delay_s``: the step completes on both ranks."""
    import time

    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.train.run import open_rollouts

    init_parallel(1, 1, timeout_s=3.0)
    with open_rollouts(source_config(), service_factory=lambda: CraftedService(delay_s), pad_id=0, poll_s=0.5,
                       alive_timeout_s=30.0) as r:
        t0 = time.monotonic()
        if r.producer is not None:
            r.producer.submit(1)
        got = r.handoff.take(1, r.producer)
        waited = time.monotonic() - t0
        ok = torch.ones(1)
        torch.distributed.all_reduce(ok)  # the default group is healthy after the long wait
        torch.save({"waited": waited, "rows": got.rows.batch_size, "all_reduce": float(ok)}, f"{out}/rank{rank}.pt")


def dp_update_rank(rank: int, world: int, out: str, pp: int = 1, model: str = "tiny-qwen2",
                   async_gae: bool = False) -> None:
    """One update from the source's rows (``world / pp`` data-parallel replicas of ``pp`` stages);
    saves what this rank received and (rank 0) the new weights. ``async_gae``: with the off-policy
    correction of ``trainer.async=one_step`` and a critic's GAE advantages (their metrics)."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.train.algorithm import build_algorithm
    from megatron_tir.train.run import open_rollouts

    init_parallel(1, pp)
    cfg = source_config(prompts=4, mini_batches=2)
    if async_gae:
        cfg = apply_overrides(cfg, ["trainer.async=one_step", "trainer.ppo.advantage=gae"])
    # adam_eps=1 makes Adam's first step ~ lr * grad (no per-element normalisation that turns float noise in
    # near-zero gradients into lr-sized steps): the update compared is the gradient of the batch
    learner = Learner(LearnerConfig(model=model, pp=pp, lr=1.0, adam_eps=1.0, max_tokens_per_microbatch=24))
    critic = Learner(LearnerConfig(model=model, pp=pp, head="value", max_tokens_per_microbatch=24)) if async_gae else None
    initial = {name: t.clone() for bucket in learner.hf_weights(1 << 30) for name, t in bucket}
    with open_rollouts(cfg, service_factory=CraftedService, pad_id=0) as r:
        if r.producer is not None:
            r.producer.submit(1)
        got = r.handoff.take(1, r.producer)
        metrics = build_algorithm(cfg, learner, critic=critic).update(1, got, {}).metrics
        from megatron.core import parallel_state

        view = (parallel_state.get_data_parallel_rank(), parallel_state.is_pipeline_first_stage(),
                parallel_state.is_pipeline_last_stage())
        received = {"rows": got.rows.tensors(), "bytes": r.handoff.received_bytes, "metrics": metrics, "view": view}
    weights = {name: t.clone() for bucket in learner.hf_weights(1 << 30) for name, t in bucket}
    torch.save(received, f"{out}/received_rank{rank}.pt")
    if rank == 0:
        torch.save({"initial": initial, "updated": weights}, f"{out}/weights.pt")


class SlowEvalService(CraftedService):
    """A CraftedService whose held-out evaluation (``rollout``) takes ``eval_s`` on rank 0, with the
    rest of RolloutService's surface a training loop touches (a sync that drains the buckets)."""

    def __init__(self, eval_s: float, tokenizer=None) -> None:
        super().__init__(0.0)
        self.eval_s, self.evaluations, self.tokenizer = eval_s, 0, tokenizer

    def rollout(self, problems, config, *, group_id_offset: int = 0, progress: bool = False, desc: str = ""):
        import time

        time.sleep(self.eval_s)
        self.evaluations += 1
        return crafted_groups(group_id_offset, len(problems))

    def sync_from(self, learner) -> int:
        from megatron_tir.rollout.sync import drain

        drain(learner.named_hf_buckets())
        return 0

    def offload(self) -> None:
        pass

    def engine_busy_s(self) -> float:
        return 0.0


def slow_eval_train_rank(rank: int, world: int, out: str, eval_s: float, timeout_s: float) -> None:
    """The real training loop on ``world`` ranks (data parallel) with a ``timeout_s`` default group and a
    rank-0 held-out evaluation of ``eval_s`` at step 0 and at the last step (1): every rank finishes."""
    import time

    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.train.checkpoint import TrainerState
    from megatron_tir.train.algorithm import build_algorithm
    from megatron_tir.train.loop import train
    from megatron_tir.train.run import open_rollouts

    init_parallel(1, 1, timeout_s=timeout_s)
    cfg = apply_overrides(source_config(prompts=4), ["trainer.steps=1", "data.eval_size=2", "trainer.eval_every=1"])
    learner = Learner(cfg.learner)
    t0 = time.monotonic()
    with open_rollouts(cfg, service_factory=lambda: SlowEvalService(eval_s, learner.tokenizer), pad_id=0, poll_s=0.5,
                       alive_timeout_s=60.0) as r:
        state = train(cfg, Path(out) / "run", TrainerState(), algorithm=build_algorithm(cfg, learner),
                      handoff=r.handoff, producer=r.producer, weights=r.weights)
        evaluations = r.producer.service.evaluations if rank == 0 else None
    torch.save({"step": state.step, "elapsed": time.monotonic() - t0, "evaluations": evaluations},
               f"{out}/rank{rank}.pt")


def colocated_order_rank(rank: int, world: int, out: str) -> None:
    """Two steps of the real loop with colocated engines (a crafted service stands in for the servers):
    each rank records, in order, the engine's release, its own gradient buffers' restore and offload, the
    weight sync, and whether its gradient buffers held memory when the sync read the weights."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.train.checkpoint import TrainerState
    from megatron_tir.train.algorithm import build_algorithm
    from megatron_tir.train.loop import train
    from megatron_tir.train.run import open_rollouts

    init_parallel(1, 1)
    cfg = apply_overrides(source_config(prompts=4), [
        "trainer.steps=2", "data.eval_size=0", "engine.kind=sglang", "engine.urls=[http://127.0.0.1:9]",
        "engine.colocated=true", "trainer.checkpoint.every=0"])
    learner = Learner(cfg.learner)
    events: list = []
    ddp = learner.ddp
    grads = lambda: sum(b.grad_data.untyped_storage().size() for b in ddp.buffers)  # noqa: E731
    for name in ("offload_grad_buffers", "restore_grad_buffers"):
        real = getattr(ddp, name)

        def wrapped(*a, _real=real, _name=name, **k):
            events.append(_name)
            return _real(*a, **k)
        setattr(ddp, name, wrapped)
    real_buckets = learner.named_hf_buckets

    def buckets(*a, **k):
        events.append(("sync", grads()))
        return real_buckets(*a, **k)
    learner.named_hf_buckets = buckets

    class Engine(SlowEvalService):
        def offload(self) -> None:
            events.append("engine_release")

    with open_rollouts(cfg, service_factory=lambda: Engine(0.0, learner.tokenizer), pad_id=0, poll_s=0.2,
                       alive_timeout_s=60.0) as r:
        train(cfg, Path(out) / "run", TrainerState(), algorithm=build_algorithm(cfg, learner),
              handoff=r.handoff, producer=r.producer, weights=r.weights)
    torch.save({"events": events, "grad_bytes": grads()}, f"{out}/rank{rank}.pt")


def watchdog_rank(rank: int, world: int, out: str, timeout_s: float, busy_s: float) -> None:
    """The control of the rank-0-phase tests: rank 0 busy for ``busy_s`` while rank 1 waits in a bare
    all-reduce of the default group (``init_parallel(timeout_s=...)``): rank 1's wait ends at the timeout."""
    import time

    from megatron_tir.policy.parallel import init_parallel

    init_parallel(1, 1, timeout_s=timeout_s)
    if rank == 0:
        time.sleep(busy_s)
        return
    t0 = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(1))
        outcome = "completed"
    except Exception as exc:  # noqa: BLE001 - the timeout is the outcome under test
        outcome = type(exc).__name__
    torch.save({"outcome": outcome, "waited": time.monotonic() - t0}, f"{out}/rank1.pt")
    os._exit(0)  # the group is broken: no orderly teardown


def handoff_rank(rank: int, world: int, out: str, tp: int) -> None:
    """Rank 0 publishes crafted shares (one per data-parallel replica) at ``tp``; every rank saves what it got."""
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.rollout.batch import collate
    from megatron_tir.train.batch import deal_rows, plan_update
    from megatron_tir.train.handoff import HandOff

    init_parallel(tp, 1)
    h = HandOff(poll_s=0.2, alive_timeout_s=30.0)
    try:
        cfg = source_config(prompts=4, mini_batches=2)
        plan = plan_update(collate(crafted_groups(0, 4), pad_id=0), mode=cfg.trainer.mode,
                           advantage=cfg.trainer.ppo.advantage, overlong=cfg.trainer.filters.overlong, mini_batches=2)
        shares = deal_rows(plan.rows, h.dp_size)
        if rank == 0:
            rows = h.publish("rows", {"n": 1}, shares)
        else:
            _, rows = h.receive("rows", what="the rows")
        torch.save({"rows": rows.tensors(), "expected": shares[h.view_of[rank][0]].tensors(),
                    "received": h.received_bytes, "sent": h.sent_bytes, "tp_of": h.tp_of}, f"{out}/rank{rank}.pt")
    finally:
        h.close()


def main() -> None:
    """``python source_ranks.py RANK WORLD PORT DELAY MARKER``: one rank of the rank-0-killed test."""
    rank, world, port, delay, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.train.run import open_rollouts

    init_parallel(1, 1, timeout_s=3.0)
    with open_rollouts(source_config(), service_factory=lambda: CraftedService(delay, marker), pad_id=0, poll_s=0.5,
                       alive_timeout_s=20.0) as r:
        if r.producer is not None:
            r.producer.submit(1)
        r.handoff.take(1, r.producer)


if __name__ == "__main__":
    main()
