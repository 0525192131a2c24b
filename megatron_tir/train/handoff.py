"""The rank-aware transport: how the other trainer ranks wait for rank 0, and how rows reach them.

Rank 0 alone does some phases of a step: the rollouts, the held-out evaluation, the step's log
line, dumps and plots. No other rank may wait for such a phase inside a collective of a group with
a watchdog (the default group's ``timeout``: a 32B evaluation takes minutes). They wait here:

* a small JSON header (data position, shapes, a phase's outcome or a stop cause) goes through the
  job's key-value store (the ``TCPStore`` every rank joined at start); a waiting rank polls it;
* rank 0 bumps a heartbeat counter in the store every ``poll_s``; a waiting rank that sees it stand
  still for ``alive_timeout_s``, or loses the store (rank 0 hosted it and died), raises
  :class:`InfrastructureError`, so a dead rank 0 still ends the job in bounded time: the wait is
  bounded by progress, not by a timeout;
* rows travel point to point on a gloo group of this hand-off (created once, every rank): rank 0
  sends each tensor-parallel group's rows **once**, to the group's first rank, which passes them on
  to its TP peers inside a gloo group of that TP group (they need the same rows); each pipeline
  stage receives only what it reads (:meth:`~megatron_tir.train.batch.TrainRows.for_stage`).
  Transfers start only once the header is out, so these groups' long timeout
  (:data:`HANDOFF_TIMEOUT`) is never what a waiting rank relies on.

``rank0_phase(key, fn)`` runs ``fn`` on rank 0 while the others wait here for its outcome (a
failure on rank 0 ends every rank with its one-line cause). The same wait carries the run's start
(:meth:`HandOff.start`: rank 0's engine and sandbox), each step's rows (:meth:`HandOff.take`: rank
0's :class:`~megatron_tir.train.producer.Producer` makes them) and the moment before a weight sync
whose collectives span every rank (:meth:`HandOff.before_sync`).

A step stops the run (:class:`TrainingStopped`, exit 1, nothing saved) when infrastructure ended
more than ``trainer.stop.infra_failure_share`` of its trajectories (the producer's header says so).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable

import torch

from megatron_tir.rollout.factory import InfrastructureError
from megatron_tir.train.batch import StepRollouts, TrainRows

HANDOFF_TIMEOUT = datetime.timedelta(hours=2)  # the gloo groups': a transfer starts once rank 0 is ready


class TrainingStopped(InfrastructureError):
    """The run cannot learn: a one-line cause (exit 1); the checkpoints already written stay."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:limit]}"


class HandOff:
    """Rank 0 -> every rank: a JSON header through the store, tensors point to point on gloo.
    Built collectively (every rank, once, after the model-parallel groups exist)."""

    def __init__(self, *, poll_s: float, alive_timeout_s: float) -> None:
        from megatron.core import parallel_state
        from torch.distributed.distributed_c10d import _get_default_store

        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.poll_s, self.alive_timeout_s = poll_s, alive_timeout_s
        self.store = torch.distributed.PrefixStore("megatron_tir/rollouts/", _get_default_store())
        self.group = torch.distributed.new_group(backend="gloo", timeout=HANDOFF_TIMEOUT)  # every rank, once
        # each rank's data-parallel replica and pipeline stage (first, last): the rows it gets and what of
        # them; its tensor-parallel group (the ranks that get the same rows)
        tp_ranks = tuple(torch.distributed.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()))
        view = (parallel_state.get_data_parallel_rank(), parallel_state.is_pipeline_first_stage(),
                parallel_state.is_pipeline_last_stage(), tp_ranks)
        views = [None] * self.world
        torch.distributed.all_gather_object(views, view, group=self.group)
        self.view_of = [(int(d), bool(f), bool(la)) for d, f, la, _ in views]
        self.tp_of = [tuple(int(r) for r in t) for *_, t in views]
        self.tp_group = None  # this rank's TP group on gloo (None at TP 1)
        for ranks in sorted(set(self.tp_of)):  # every rank creates every group, in the same order
            if len(ranks) > 1:
                g = torch.distributed.new_group(list(ranks), backend="gloo", timeout=HANDOFF_TIMEOUT)
                if self.rank in ranks:
                    self.tp_group = g
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.received_bytes = 0  # what this rank received last (tests and metrics)
        self.sent_bytes = 0  # rank 0: what it sent point to point last
        self._syncs = 0  # weight syncs that waited for rank 0 first: the key each waits on
        self._stop = threading.Event()
        self._beat = None
        if self.rank == 0:
            self.store.add("beat", 1)
            self._beat = threading.Thread(target=self._heartbeat, name="rank0-heartbeat", daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.store.add("beat", 1)
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def _leader(self, rank: int) -> int:
        """The rank that receives ``rank``'s rows from rank 0 (the first of its TP group)."""
        return min(self.tp_of[rank])

    # ------------------------------------------------------------------ rows

    def publish(self, key: str, header: dict, shares: list[TrainRows] | None = None) -> TrainRows | None:
        """Rank 0: ``header`` to every rank and, to each TP group of data-parallel replica ``dp``, what its
        pipeline stage reads of ``shares[dp]`` (:meth:`TrainRows.for_stage`). Returns rank 0's rows."""
        header = dict(header)
        if shares is None:
            self.store.set(key, json.dumps(header))
            return None
        parts = {_view_key(view): shares[view[0]].for_stage(first=view[1], last=view[2]) for view in set(self.view_of)}
        header["shapes"] = {k: {name: [str(v.dtype).removeprefix("torch."), list(v.shape)] for name, v in part.items()}
                            for k, part in parts.items()}
        header["lengths"] = {_view_key(view): shares[view[0]].attention_mask_BT.shape[1] for view in set(self.view_of)}
        self.store.set(key, json.dumps(header))
        sent = 0
        for r in range(1, self.world):
            if self._leader(r) == r:  # once per TP group: its first rank (rank 0's peers: below)
                for v in parts[_view_key(self.view_of[r])].values():
                    torch.distributed.send(_wire(v), dst=r, group=self.group)
                    sent += v.numel() * v.element_size()
        self.sent_bytes = sent
        mine = _view_key(self.view_of[0])
        if self.tp_group is not None:  # rank 0's own TP peers
            for v in parts[mine].values():
                torch.distributed.broadcast(_wire(v), src=0, group=self.tp_group)
        return TrainRows.from_stage(parts[mine], header["lengths"][mine])

    def receive(self, key: str, *, what: str) -> tuple[dict, TrainRows | None]:
        """Every rank but 0: wait (as long as rank 0 lives) for ``key``'s header, then this rank's rows
        (from rank 0 on a TP group's first rank, from that rank on its peers)."""
        self._wait(key, what=what)
        header = json.loads(self.store.get(key))
        shapes, lengths = header.pop("shapes", None), header.pop("lengths", None)
        if shapes is None:
            return header, None
        mine = _view_key(self.view_of[self.rank])
        leader = self._leader(self.rank)
        tensors, got = {}, 0
        for name, (dtype, shape) in shapes[mine].items():
            buf = torch.empty(shape, dtype=torch.uint8 if dtype == "bool" else getattr(torch, dtype))
            if leader == self.rank:
                torch.distributed.recv(buf, src=0, group=self.group)
            if self.tp_group is not None:
                torch.distributed.broadcast(buf, src=leader, group=self.tp_group)
            got += buf.numel() * buf.element_size()
            tensors[name] = buf.bool() if dtype == "bool" else buf
        self.received_bytes = got
        return header, TrainRows.from_stage(tensors, lengths[mine])

    # ------------------------------------------------------------------ the run's start, a step's rows

    def start(self, fn: Callable[[], object], *, what: str) -> object | None:
        """Rank 0: ``fn()`` (its start-up: engine, sandbox, producer), its outcome published; its result.
        Every other rank waits for that outcome (None; rank 0's failure ends it with the one-line cause)."""
        if self.rank == 0:
            try:
                started = fn()
            except BaseException as exc:
                self.publish("start", {"error": one_line(exc, 10_000)})
                raise
            self.publish("start", {"error": None})
            return started
        header, _ = self.receive("start", what=what)
        if header["error"] is not None:
            raise InfrastructureError(f"rank 0 could not start the rollouts: {header['error']}")
        return None

    def take(self, step: int, producer) -> StepRollouts:
        """This rank's share of step ``step``'s trained rows (blocks until rank 0 has them): rank 0's
        ``producer`` takes them (:meth:`~megatron_tir.train.producer.Producer.take`: started now unless they
        already run) and rank 0 deals them; elsewhere ``producer`` is None and the rows arrive here."""
        key = f"step/{step}"
        if self.rank != 0:
            header, rows = self.receive(key, what=f"step {step}'s rollouts")
            return _step_rollouts(header, rows, {}, [], {})
        try:
            produced = producer.take(step)
        except BaseException as exc:  # the other ranks end with the cause instead of waiting for rank 0's exit
            self.publish(key, {"stop": f"rank 0 failed in step {step}'s rollouts: {one_line(exc)}"})
            raise
        rows = self.publish(key, produced.header, produced.shares)
        self.forget(f"step/{step - 2}")  # every rank has read it: they trained step - 1 together
        return _step_rollouts(produced.header, rows, produced.metrics, produced.collected.sampled, produced.fates)

    def before_sync(self) -> None:
        """Before a weight sync whose collectives span every rank: the other ranks wait for rank 0 (which may
        first drain a step of rollouts: minutes) by polling the store as long as rank 0 lives, not inside the
        sync's collectives (a group's timeout)."""
        key = f"sync/{self._syncs}"
        self._syncs += 1
        if self.rank == 0:
            self.publish(key, {})
            self.forget(f"sync/{self._syncs - 2}")  # every rank read it: they synced together since
        else:
            self.receive(key, what="rank 0 to start the weight sync")

    # ------------------------------------------------------------------ rank-0 phases

    def rank0_phase(self, key: str, fn: Callable[[], dict | None], *, what: str) -> dict:
        """``fn()`` on rank 0 (its JSON-able result, or {}), while every other rank waits here for it
        (bounded by rank 0's heartbeat, not by a group's timeout). A failure in ``fn`` re-raises on rank 0
        and ends the others with an :class:`InfrastructureError` naming it. Returns ``fn``'s result on
        rank 0 and the published result elsewhere."""
        if self.rank == 0:
            try:
                result = fn() or {}
            except BaseException as exc:
                self.store.set(key, json.dumps({"error": f"rank 0 failed in {what}: {one_line(exc)}"}))
                raise
            self.store.set(key, json.dumps({"result": result}))
            return result
        self._wait(key, what=what)
        header = json.loads(self.store.get(key))
        if header.get("error"):
            raise InfrastructureError(header["error"])
        return header["result"]

    def _wait(self, key: str, *, what: str) -> None:
        beat, seen_at, sleep = None, time.monotonic(), 0.01
        while True:
            try:
                if self.store.check([key]):
                    return
                now_beat = self.store.add("beat", 0)
            except Exception as exc:  # noqa: BLE001 - the store lived on rank 0 (or its host) and is gone
                raise InfrastructureError(f"rank {self.rank} lost rank 0 while waiting for {what}: "
                                          f"{one_line(exc, 200)}") from None
            now = time.monotonic()
            if now_beat != beat:
                beat, seen_at = now_beat, now
            elif now - seen_at > self.alive_timeout_s:
                raise InfrastructureError(f"rank {self.rank}: rank 0 gave no sign of life for "
                                          f"{self.alive_timeout_s:g} s while this rank waited for {what}")
            time.sleep(sleep)
            sleep = min(sleep * 2, self.poll_s / 2)

    def forget(self, key: str) -> None:
        """Rank 0: drop a key every rank has read (elsewhere nothing)."""
        if self.rank != 0:
            return
        try:
            self.store.delete_key(key)
        except Exception:  # noqa: BLE001 - stores without delete (or gone): keys are small
            pass

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)


def _step_rollouts(header: dict, rows: TrainRows | None, metrics: dict, sampled: list, fates: dict) -> StepRollouts:
    if header["stop"] is not None:
        raise TrainingStopped(header["stop"])
    return StepRollouts(rows=rows, mini_batches=header["mini_batches"], metrics=metrics,
                        data_position=header["data_position"], schedule_switched_at=header["schedule_switched_at"],
                        rollout_budget=tuple(header["budget"]), turns=header["turns"], sampled=sampled, fates=fates,
                        data_consumed_ahead=list(header.get("consumed_ahead", [])))


def _view_key(view: tuple[int, bool, bool]) -> str:
    """``dp/first/last`` of a rank's view (data-parallel replica, first and last pipeline stage)."""
    return f"{view[0]}/{int(view[1])}/{int(view[2])}"


def _wire(t: torch.Tensor) -> torch.Tensor:
    return (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()
