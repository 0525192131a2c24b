"""The staleness bound of asynchronous training: which groups may start, which may be trained.

Policy versions count weight syncs: the engines' weights after ``v`` updates are version ``v``.
With a bound ``eta`` (``max_staleness``, in versions) and a train batch of ``batch`` groups:

* **admission** (AReaL, ``areal/core/staleness_manager.py``): a new group may start only while
  ``accepted + running + 1 <= (eta + v + 1) * batch`` where ``accepted`` counts groups finished
  since the start (consumed or waiting) and ``running`` the groups in flight. Over a run that
  keeps every trained group's oldest token within ``eta`` versions of the learner at the update
  that uses it, whatever the speed of the engines: the producer can be at most ``eta + 1``
  batches ahead of the consumer.
* **consumption**: a finished group whose *oldest* token was sampled at a version older than
  ``v - eta`` (``v``: the version the learner will update from) is dropped and counted, never
  trained -- a second guard for groups that were slowed down (very long tails) past the bound.

``eta = 0`` with one batch in flight at a time is synchronous training; the one-step overlap
(rollout N+1 during train N) is ``eta = 1`` with the sync between rounds.

Pure bookkeeping, no threads: the group producer calls it under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class StalenessBound:
    batch: int  # groups per train batch
    max_staleness: int  # eta, in policy versions
    accepted: int = 0  # groups finished so far (consumed, waiting or dropped)
    running: int = 0
    dropped: int = 0  # groups refused at consumption for staleness

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def capacity(self, version: int) -> int:
        """Groups that may still start at policy ``version``."""
        return max(0, (self.max_staleness + version + 1) * self.batch - self.accepted - self.running)

    def try_admit(self, version: int) -> bool:
        if self.capacity(version) <= 0:
            return False
        self.running += 1
        return True

    def finished(self) -> None:
        """A running group is complete (scored, ready to be consumed)."""
        assert self.running > 0, "finished() without a running group"
        self.running -= 1
        self.accepted += 1

    def abandoned(self) -> None:
        """A running group ends without being accepted: the filters rejected it, or it failed
        (its slot is free again; AReaL's ``on_rollout_rejected``)."""
        assert self.running > 0, "abandoned() without a running group"
        self.running -= 1

    def reclaim(self) -> None:
        """An accepted group leaves untrained (dropped for staleness): its slot is free again, so
        drops cannot starve admission."""
        assert self.accepted > 0, "reclaim() without an accepted group"
        self.accepted -= 1

    def fresh_enough(self, oldest_version: int, version: int) -> bool:
        """May a group whose oldest token has ``oldest_version`` train the update from ``version``?
        Counts the refusals in ``dropped``."""
        ok = version - oldest_version <= self.max_staleness
        if not ok:
            self.dropped += 1
        return ok
