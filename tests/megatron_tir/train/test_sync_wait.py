"""The per-stage weight sync's wait (``WeightPush.update``: ``HandOff.before_sync``): while rank 0 is slow to
reach the sync (it drains a step of rollouts first, ``trainer.async=one_step``), the other ranks
wait by polling the store as long as rank 0 lives, not inside a collective whose timeout runs out."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from source_ranks import CraftedService, source_config  # noqa: E402

from megatron_tir.policy.parallel import run_ranks  # noqa: E402

GROUP_TIMEOUT_S = 2.0
RANK0_LATE_S = 6.0


class CollectiveSync:
    """Stands in for StageWeightSync: its ``update`` starts with a collective on a gloo group of
    every rank with a short timeout, as the real one's coordination group (``coordination_timeout_s``)."""

    wait_for_rank0 = True  # as StageWeightSync: the weight push lets the other ranks wait for rank 0 first

    def __init__(self) -> None:
        self.group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        self.updates = 0

    def update(self, learner) -> int:
        found = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(found, learner, group=self.group)
        self.updates += 1
        return self.updates

    def close(self) -> None:
        pass


def late_rank0_sync(rank: int, world: int, out: str) -> None:
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.train.run import open_rollouts

    init_parallel(1, 1, timeout_s=GROUP_TIMEOUT_S)
    with open_rollouts(source_config(), service_factory=CraftedService, pad_id=0, poll_s=0.5,
                       alive_timeout_s=30.0) as r:
        r.weights.sync = CollectiveSync()
        t0 = time.monotonic()
        for sync in range(2):
            if rank == 0:
                time.sleep(RANK0_LATE_S)  # the drain of a step of rollouts
            r.weights.update(f"weights {sync}")
        torch.save({"waited": time.monotonic() - t0, "updates": r.weights.sync.updates}, f"{out}/rank{rank}.pt")


def test_ranks_wait_for_a_late_rank_0_longer_than_the_sync_groups_timeout(tmp_path):
    run_ranks(late_rank0_sync, 2, str(tmp_path))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["updates"] == 2 and got["waited"] >= 2 * RANK0_LATE_S - 0.5
