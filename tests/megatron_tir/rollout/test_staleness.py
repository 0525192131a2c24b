"""The staleness bound: admission keeps in-order work within eta versions; the consumption
check drops what a long tail pushed past it."""

import random

import pytest

from megatron_tir.rollout.staleness import StalenessBound


def _simulate(eta: int, batch: int, steps: int, *, seed: int, tail: float, fifo: bool = False):
    """Engines admit as fast as allowed; each group takes a random time (a long tail with
    probability ``tail``; ``fifo``: all take the same time, so they finish in admission order);
    the learner consumes ``batch`` finished groups per version."""
    rng = random.Random(seed)
    bound = StalenessBound(batch=batch, max_staleness=eta)
    version, clock, running, done, trained = 0, 0, [], [], []
    while version < steps:
        while bound.try_admit(version):
            running.append((clock + (3 if fifo else 50 if rng.random() < tail else rng.randint(1, 4)), version))
        clock += 1
        for item in [r for r in running if r[0] <= clock]:
            running.remove(item)
            bound.finished()
            done.append(item[1])
        while len(done) >= batch:  # one update consumes a batch
            take, done = done[:batch], done[batch:]
            kept = [v for v in take if bound.fresh_enough(v, version)]
            trained.extend(version - v for v in kept)
            version += 1
    return bound, trained


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_no_trained_group_older_than_eta(eta):
    bound, lags = _simulate(eta, batch=4, steps=30, seed=eta, tail=0.1)
    assert lags and max(lags) <= eta
    # eta = 0 is synchronous (one batch in flight: nothing can go stale); above it the long
    # tails overtaken by later groups are caught by the consumption check
    assert (bound.dropped > 0) == (eta > 0)


def test_in_order_work_is_never_dropped_and_reaches_the_bound():
    # a group admitted at version v is among the first (eta + v + 1) * batch: in order it is
    # consumed by version v + eta at the latest
    bound, lags = _simulate(1, batch=4, steps=20, seed=0, tail=0.0, fifo=True)
    assert bound.dropped == 0 and max(lags) == 1  # the producer runs one version ahead


def test_admission_capacity_by_hand():
    b = StalenessBound(batch=2, max_staleness=1)
    assert b.capacity(0) == 4  # (1 + 0 + 1) * 2
    assert all(b.try_admit(0) for _ in range(4)) and not b.try_admit(0)
    b.finished()
    assert not b.try_admit(0) and b.try_admit(1)  # a new version opens 2 more slots
    b.abandoned()
    assert b.running == 3 and b.accepted == 1
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBound(batch=2, max_staleness=-1)
