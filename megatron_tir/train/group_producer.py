"""``trainer.async=full``: rollouts never stop; groups are admitted through the staleness bound.

A :class:`GroupProducer` lives on the rollout service's event loop (rank 0). It keeps starting
groups -- one prompt of the stream, ``n_samples`` trajectories, generated, scored and passed
through dynamic sampling's group filter together (a group is atomic) -- while the bound
(:class:`~megatron_tir.rollout.staleness.StalenessBound`, AReaL's rule) admits one more:
``accepted + running + 1 <= (eta + v + 1) * batch``, ``v`` the syncs since the producer started.
A group the filter rejects frees its slot (``abandoned``); one it keeps waits, in completion
order, until a step takes it (``take``). At the take a group whose *oldest* model token was
sampled more than ``eta`` versions before the weights the step updates from is dropped and
counted (``filter/groups_stale``), never trained.

A critic warm-up step with ``critic.filter_in_warmup`` false samples without the accuracy band and
the zero-std rule (``unfiltered(step)``, :func:`~megatron_tir.train.critic_update.warmup_unfiltered`).
A group finishing while the next step to take is such a step is kept without them, with the rule
they would have removed it by; a step past the warm-up that takes it removes it then by that rule
(so each step's batch is filtered as that step asks, whichever step the group was produced under).

The weight sync of this mode pauses the engine in ``retract`` mode: requests in flight wait,
drop their KV cache, and continue from prompt + tokens so far under the new weights (the
local engine's retract; SGLang's ``pause_generation`` ``mode="retract"``). The trajectory keeps
every token with the version and the log-prob of the weights that sampled it: an interruption
is not an abort, a void turn or a truncation -- the driver never sees it.

Prompt positions: a group's id is its prompt's position in the stream. Groups finish out of
order, so what a step has consumed (trained, filtered out or dropped) is not a prefix of the
stream: :meth:`data_position` is the first position not consumed and :meth:`consumed_ahead` the
consumed positions past it. A checkpoint stores both; the groups in flight (or finished and
not taken) at a checkpoint are not saved: their prompts go back to the stream and a resume
samples them again with the checkpoint's weights. No prompt is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from megatron_tir.rollout import Group, RolloutConfig
from megatron_tir.rollout.staleness import StalenessBound
from megatron_tir.train.sampling import Collected, group_rules
from megatron_tir.train.data import PromptStream

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Taken:
    """One step's take."""
    collected: Collected  # groups: the train batch; sampled: it + the groups filtered out or dropped since the last take
    stale: int  # groups dropped for staleness
    data_position: int  # the first prompt position not consumed (a checkpoint's)
    consumed_ahead: list[int]  # consumed positions past it
    in_flight: int  # groups running at the take
    version: int  # the weight version the step updates from


@dataclass(kw_only=True, slots=True)
class _Finished:
    group: Group
    oldest_version: int  # the oldest weight version of its model tokens (its admission version if it has none)
    filtered_by: str | None = None  # kept for a warm-up step: the full group filter's rule (None: it passes)


def oldest_version(group: Group, admitted_at: int) -> int:
    versions = [v for t in group.trajectories for v in t.response_versions if v >= 0]
    return min(versions) if versions else admitted_at


class GroupProducer:
    """See the module docstring. ``arollout(problems, cfg, group_id_offset)``: the service's
    rollout coroutine; ``rollout_cfg()`` the budgets in force (the turn schedule may switch them);
    ``version()`` the engine's weight version; ``filters`` ``trainer.filters``; ``unfiltered(step)``
    whether step ``step`` samples without the group filter's band and zero-std rule; ``first_step``
    the step of the first take (each take is the next step)."""

    def __init__(self, *, arollout, stream: PromptStream, rollout_cfg: Callable[[], RolloutConfig],
                 version: Callable[[], int], batch: int, max_staleness: int, filters, max_groups: int,
                 unfiltered: Callable[[int], bool] = lambda step: False, first_step: int = 1) -> None:
        self._arollout, self.stream, self._rollout_cfg, self._version = arollout, stream, rollout_cfg, version
        self.filters = filters
        self._unfiltered, self._step = unfiltered, first_step  # the step the next take serves
        self.bound = StalenessBound(batch=batch, max_staleness=max_staleness)
        self.max_groups = max_groups  # groups finished before a step takes what passed (dynamic sampling's bound)
        self._base = version()  # admission counts the syncs since the start
        self._running: dict[int, asyncio.Task] = {}  # prompt position -> its group's task
        self._ready: list[_Finished] = []  # kept by the filter, not taken yet, in completion order
        self._filtered: list[tuple[Group, str]] = []  # finished since the last take, not kept, with the rule
        self._removed = {"no_counted_rows": 0, "zero_std": 0, "accuracy": 0}
        self._finished_since_take = 0
        self._consumed: set[int] = set(stream.skip)
        self._error: BaseException | None = None
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._held = False  # a held-out evaluation runs: admit nothing new (see hold)

    # -------------------------------------------------------------- on the event loop

    async def start(self) -> None:
        self._changed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._admit_forever(), name="group-producer")

    async def poke(self) -> None:
        """The version changed (a sync): the bound may admit more."""
        self._changed.set()

    async def hold(self, held: bool) -> None:
        """While held, no new group is admitted (the groups in flight go on): a held-out
        evaluation gets the engine instead of sharing it with generation running ahead (in
        ``full`` an evaluation took 116-173 s where ``off``'s took 7-33 s). Released, admission
        resumes where the bound stands."""
        self._held = held
        self._changed.set()

    async def _admit_forever(self) -> None:
        while True:
            while not self._held and self._error is None and self.bound.try_admit(self._version() - self._base):
                self._launch()
            self._changed.clear()
            await self._changed.wait()

    def _launch(self) -> None:
        pos, problem = self.stream.draw()
        admitted_at = self._version()
        task = asyncio.get_running_loop().create_task(
            self._arollout([problem], self._rollout_cfg(), group_id_offset=pos), name=f"group-{pos}")
        self._running[pos] = task
        task.add_done_callback(lambda t, pos=pos, at=admitted_at: self._done(pos, at, t))

    def _done(self, pos: int, admitted_at: int, task: asyncio.Task) -> None:
        self._running.pop(pos, None)
        if task.cancelled():
            return
        if task.exception() is not None:
            self._error = self._error or task.exception()
            self.bound.abandoned()
            self._changed.set()
            return
        (group,) = task.result()
        f = self.filters
        (rule,) = group_rules([group], drop_zero_std=f.drop_zero_std, accuracy_lo=f.accuracy_lo,
                              accuracy_hi=f.accuracy_hi, overlong=f.overlong, min_rows=f.min_group_rows)
        waived = None
        if rule is not None and self._unfiltered(self._step):  # a warm-up step's: the band and zero-std off
            (waived,) = group_rules([group], drop_zero_std=False, accuracy_lo=0.0, accuracy_hi=1.0,
                                    overlong=f.overlong, min_rows=f.min_group_rows)
            rule, waived = waived, rule
        self._finished_since_take += 1
        if rule is None:
            self.bound.finished()
            self._ready.append(_Finished(group=group, oldest_version=oldest_version(group, admitted_at),
                                         filtered_by=waived))
        else:
            self.bound.abandoned()  # its slot is free again
            self._filtered.append((group, rule))
            self._removed[rule] += 1
        self._changed.set()

    async def take(self, want: int) -> Taken:
        """The next ``want`` fresh groups in completion order, waiting for them (fewer, even none,
        once ``max_groups`` finished since the last take without enough of them passing the filter)."""
        version = self._version()
        unfiltered = self._unfiltered(self._step)  # the step this take serves (the next is set at its end)
        taken: list[Group] = []
        stale: list[Group] = []
        while True:
            if self._error is not None:
                raise self._error
            while self._ready and len(taken) < want:
                f = self._ready.pop(0)
                if f.filtered_by is not None and not unfiltered:  # kept for the warm-up, taken past it
                    self.bound.reclaim()
                    self._filtered.append((f.group, f.filtered_by))
                    self._removed[f.filtered_by] += 1
                elif self.bound.fresh_enough(f.oldest_version, version):
                    taken.append(f.group)
                else:  # never trained
                    stale.append(f.group)
                    self.bound.reclaim()
            if len(taken) >= want or self._finished_since_take >= self.max_groups:
                break
            self._changed.clear()
            await self._changed.wait()
        done, self._filtered = self._filtered, []
        filtered = [g for g, _ in done]
        rules = {g.group_id: rule for g, rule in done} | {g.group_id: "stale" for g in stale}
        self._consumed.update(g.group_id for g in taken + stale + filtered)
        removed = self._removed | {"stale": len(stale)}
        self._removed = dict.fromkeys(self._removed, 0)
        rounds, self._finished_since_take = self._finished_since_take, 0
        self._step += 1
        self._changed.set()
        # what a checkpoint after this step records: the first position not consumed, the consumed ones past it
        first = min(list(self._running) + [f.group.group_id for f in self._ready], default=self.stream.position)
        self._consumed = {p for p in self._consumed if p >= first}
        return Taken(collected=Collected(groups=taken, sampled=taken + filtered + stale, rounds=rounds,
                                         removed=removed, rules=rules),
                     stale=len(stale), data_position=first, consumed_ahead=sorted(self._consumed),
                     in_flight=len(self._running), version=version)

    async def stop(self) -> None:
        """Cancel the admission loop and every group in flight (their prompts return to the stream)."""
        tasks = ([self._task] if self._task is not None else []) + list(self._running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()

