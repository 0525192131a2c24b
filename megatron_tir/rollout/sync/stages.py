"""Weight sync from every pipeline stage: each stage's sender broadcasts its own stage's buckets
to the SGLang servers in a group of its own; nothing passes through a rank that does not own it.

Every trainer rank builds a :class:`StageWeightSync` and makes the same calls (``start``,
``update``, ``close``) at the same time, like a collective; what each does depends on its place:

* **rank 0** holds the engine (the HTTP client) and drives the servers: one weight-update group
  per stage, ``{group_name}-{generation}-pp{stage}``, whose rank 0 is that stage's sender and
  whose other ranks are every server's TP ranks (SGLang keeps several groups by name:
  ``srt/model_executor/model_runner_components/weight_updater.py``, ``_model_update_group``);
  it announces every bucket with ``load_format="flattened_bucket"`` (the server allocates one
  uint8 tensor, ``FlattenedTensorBucket.empty``, and receives one broadcast:
  ``receive_weights_from_distributed`` -> ``_receive_bucketed_weights_from_distributed``), inside
  the session of :func:`megatron_tir.rollout.sync.sglang._run_sync` (pause, begin, buckets, end,
  flush, resume). It computes the buckets' names and shapes from the model spec
  (``Learner.bucket_layout``), never from the tensors.
* **each stage's sender** (its first TP rank of replica 0; rank 0 is stage 0's) joins its
  stage's group and broadcasts its stage's buckets (``Learner.stage_buckets``), each checked
  against the layout rank 0 announced (sent to every rank first); building the next bucket (the
  TP gather, the HF split, the flattening) overlaps the broadcast of the current one (a sending
  thread; at most two buckets alive, a bucket's slot freed only once its bytes have gone, see
  :meth:`StageSender.send`).
* its TP peers take part in the gathers; every other rank only waits for the outcome.

Order. A server's scheduler handles one request at a time, and a group join or a receive holds
it until every rank of that group is there (``srt/managers/scheduler.py``'s event loop; the
join and receive in ``model_runner_components/weight_updater.py``), so two servers that took two
groups' requests in different orders would wait on each other for ever. Rank 0 therefore joins
the groups one stage after another and announces one bucket at a time to all servers, the
stages in turn (stage 0's first bucket, stage 1's first, stage 0's second, ...) -- slime's
per-stage senders take a lock around each bucket for the same reason. The stages work in
parallel where they can: a sender builds its next bucket while another stage's is on the wire,
and no stage's bytes take a hop to rank 0 first.

Restarts and failures: before each sync rank 0 asks every server for its version
(``SGLangEngine.wait_servers_back``): one that does not answer within ``rejoin_timeout_s`` while
others do is left out (the sync goes on; the late one gets no work until a later sync finds it
back and brings it to the current version), and only when none answers is the wait as long as a
load takes (``SGLangEngineConfig.restart_timeout_s``). When one restarted (its weight version is
not the engine's) or the set of servers changed, every group is rebuilt under a new generation
before the buckets go out. Any rank's error reaches every rank (one gather at the
end of each call), so all raise the same one-line error; a sender whose servers stopped
receiving gives up at the group's ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import socket
import threading
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from megatron_tir.rollout.engines.base import PauseMode
from megatron_tir.rollout.engines.base import pause_mode as as_pause_mode
from megatron_tir.rollout.sync.base import FLATTENED, Bucket, check_bucket, flatten, kept_bytes
from megatron_tir.rollout.sync.base import sync_failed
from megatron_tir.rollout.sync.group_join import GroupJoin
from megatron_tir.rollout.sync.sglang import SYNC_PAUSE_MODES, _run_sync

if TYPE_CHECKING:
    from megatron_tir.policy.weight_source import WeightSource
    from megatron_tir.rollout.engines.sglang.client import SGLangEngine

log = logging.getLogger(__name__)

Submit = Callable[[Coroutine[Any, Any, Any]], concurrent.futures.Future]
Layout = list[list[list[tuple[str, tuple[int, ...]]]]]  # stage -> bucket -> (HF name, shape)


@dataclass(kw_only=True, slots=True)
class StageWeightSyncConfig:
    group_name: str = "megatron_tir_weights"
    backend: str = "nccl"  # gloo works on CPU (tests, bench)
    timeout_s: float = 600.0  # joining a group; one broadcast
    # before a sync: how long a server that does not answer is waited for while others do (then the sync goes
    # on without it); None: the engine's SGLangEngineConfig.rejoin_timeout_s
    rejoin_timeout_s: float | None = None
    pause_mode: PauseMode = PauseMode.ABORT
    bucket_bytes: int = 256 << 20
    load_format: str | None = FLATTENED  # None: one broadcast per tensor (SGLang's default format)
    address: str | None = None  # this rank's address as the servers reach it; None: socket.getfqdn()
    # the trainer ranks' own gloo group: how long a rank waits for the others inside a sync (rank 0
    # waiting up to rejoin_timeout_s for the servers, then the transfer). The wait before a sync, while
    # rank 0 drains a step of rollouts, is not in it: WeightPush.update polls the store first (HandOff.before_sync)
    coordination_timeout_s: float = 7200.0

    def __post_init__(self) -> None:
        if not self.group_name:
            raise ValueError("group_name is empty")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {self.backend!r}")
        if not self.timeout_s > 0 or not self.coordination_timeout_s > 0:
            raise ValueError(f"timeout_s and coordination_timeout_s must be > 0, got "
                             f"{self.timeout_s}, {self.coordination_timeout_s}")
        if self.rejoin_timeout_s is not None and not self.rejoin_timeout_s > 0:
            raise ValueError(f"rejoin_timeout_s must be > 0 (or None: the engine's), got {self.rejoin_timeout_s}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.load_format not in (None, FLATTENED):
            raise ValueError(f"load_format must be {FLATTENED!r} or None, got {self.load_format!r}")
        self.pause_mode = as_pause_mode(self.pause_mode)
        if self.pause_mode not in SYNC_PAUSE_MODES:
            raise ValueError(f"pause_mode must be abort or retract for a weight sync, got {self.pause_mode.value}")


def round_robin(layout: Layout) -> list[tuple[int, list[tuple[str, tuple[int, ...]]]]]:
    """``(stage, bucket)`` in announcement order: the stages in turn, each stage's buckets in its order."""
    order = []
    for i in range(max((len(b) for b in layout), default=0)):
        order += [(stage, buckets[i]) for stage, buckets in enumerate(layout) if i < len(buckets)]
    return order


def check_announced(tensors: list, *, stage: int, index: int, layout: list[list[tuple[str, tuple[int, ...]]]],
                    dtype: str | None) -> None:
    """ValueError (one line) unless bucket ``index`` of ``stage`` has the names, shapes and dtype
    rank 0 announced (the servers allocate their receive buffers from the announcement)."""
    where = f"weight sync: stage {stage} bucket {index}"
    if index >= len(layout):
        raise ValueError(f"{where}: {tensors[0][0]} was not announced (the layout has {len(layout)} buckets)")
    announced = layout[index]
    for i, (name, tensor) in enumerate(tensors):
        if i >= len(announced):
            raise ValueError(f"{where}: {name} was not announced (the bucket has {len(announced)} tensors)")
        want_name, want_shape = announced[i]
        if name != want_name:
            raise ValueError(f"{where}: {name} where {want_name} was announced")
        if tuple(tensor.shape) != tuple(want_shape):
            raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, announced {tuple(want_shape)}")
        got = str(tensor.dtype).removeprefix("torch.")
        if dtype is not None and got != dtype:
            raise ValueError(f"{where}: {name} has dtype {got}, announced {dtype}")
    if len(tensors) < len(announced):
        raise ValueError(f"{where}: {announced[len(tensors)][0]} was announced but not built")


class StageSender:
    """A stage's sender: rank 0 of its stage's group with the servers; broadcasts its buckets."""

    def __init__(self, *, backend: str, timeout_s: float) -> None:
        self.backend, self.timeout_s = backend, timeout_s
        self.group = None
        self.group_name = ""
        self.sent: list[tuple[str, list[str], int]] = []  # (group, names, bytes) per bucket broadcast
        # CPU only: the two buckets' flattening buffers, kept between buckets and syncs (``kept_bytes``;
        # on a GPU the caching allocator does it; ~17 ms per fresh 50 MB on the 2-core machine)
        self.staging: list = [None, None]

    def join(self, *, address: str, port: int, world_size: int, group_name: str) -> GroupJoin:
        """Start joining (a daemon thread; ``cancel()`` gives it up and waits until it left c10d)."""
        self.group_name = group_name
        return GroupJoin(master_address=address, master_port=port, world_size=world_size, group_name=group_name,
                         backend=self.backend, timeout_s=self.timeout_s)

    def send(self, buckets: Iterable[Bucket], *, flattened: bool, stage: int = 0,
             layout: list[list[tuple[str, tuple[int, ...]]]] | None = None, dtype: str | None = None) -> None:
        """Broadcast every bucket (one tensor, or one per tensor); the next is built meanwhile.

        ``layout`` (with ``dtype``): this stage's buckets as rank 0 announced them to the servers,
        which allocate their receive buffers from it; a bucket that differs is refused (one-line
        ValueError naming the stage, the bucket and the first difference) before it goes out.

        At most two buckets are alive at once: the one on the wire and the one built next. A bucket
        takes a slot before it is built (before ``next(buckets)``: the gathers and the HF split
        happen there) and gives it back only once its bytes have gone. "Gone" needs care on NCCL:
        a blocking ``dist.broadcast`` returns once the operation is enqueued on NCCL's stream, not
        when it completed (torch.distributed docs, "Synchronous and asynchronous collective
        operations": for CUDA "it is not guaranteed that the CUDA operation is completed"), and
        ``Work.wait()`` on a CUDA collective only makes the current stream wait for it, without
        blocking the CPU (``Work.wait``'s docstring). So each broadcast is ``async_op=True``, then
        ``work.wait()``, then the current stream is synchronised (CUDA tensors only); on gloo
        ``wait()`` returns when the operation completed. Without that, the caching allocator keeps
        every enqueued bucket's memory until the stream reaches it, and the builder could hold a
        whole stage's gathered buckets (tens of GB at 32B)."""
        import torch
        import torch.distributed as dist

        slots = threading.Semaphore(2)
        pending: queue.Queue = queue.Queue()
        failed: list[BaseException] = []

        def send_one(names: list[str], payload: list) -> None:
            for tensor in payload:
                dist.broadcast(tensor, src=0, group=self.group, async_op=True).wait()
                if tensor.is_cuda:
                    torch.cuda.current_stream(tensor.device).synchronize()
            self.sent.append((self.group_name, names, sum(t.numel() * t.element_size() for t in payload)))

        def broadcast() -> None:
            while (item := pending.get()) is not None:
                try:
                    if not failed:  # keep taking buckets so the builder never blocks on a dead sender
                        send_one(*item)
                except BaseException as exc:  # handed to the builder below
                    failed.append(exc)
                finally:
                    item = None  # noqa: F841 - the bucket's memory goes before its slot does
                    slots.release()

        thread = threading.Thread(target=broadcast, name="weight-sync-sender", daemon=True)
        thread.start()
        built = 0
        try:
            it = iter(buckets)
            while True:
                slots.acquire()
                if failed:
                    break
                bucket = next(it, None)
                if bucket is None:
                    if layout is not None and built != len(layout):
                        raise ValueError(f"weight sync: stage {stage}: {built} buckets built, {len(layout)} announced")
                    break
                tensors = check_bucket(bucket)
                if layout is not None:
                    check_announced(tensors, stage=stage, index=built, layout=layout, dtype=dtype)
                item = ([n for n, _ in tensors], [flatten(tensors, out=self._staging_for(built, tensors))] if flattened
                        else [t.contiguous() for _, t in tensors])
                bucket = tensors = None  # the builder keeps no reference to a bucket it handed over
                pending.put(item)
                item = None
                built += 1
        finally:
            pending.put(None)
            thread.join()
        if failed:
            raise failed[0]

    def _staging_for(self, index: int, tensors: list) -> Any:
        """Bucket ``index``'s flattening buffer on the CPU (None elsewhere, or for a lone tensor,
        which goes as it is). Two alternate: bucket ``index`` takes its slot only once bucket
        ``index - 2`` has gone (``send``'s semaphore), so its buffer is free again."""
        if len(tensors) < 2 or any(t.device.type != "cpu" for _, t in tensors):
            return None
        return kept_bytes(self.staging, index % 2, sum(t.numel() * t.element_size() for _, t in tensors))

    def leave(self) -> None:
        import torch.distributed as dist

        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


class StageWeightSync:
    """One trainer rank's part of the per-stage sync (see the module docstring).

    Rank 0 passes the engine and ``submit`` (runs a coroutine on the engine's event loop and
    returns a ``concurrent.futures.Future``, e.g. ``EventLoopThread.submit``); other ranks pass
    neither. Build it on every rank at once (it makes a gloo group of all ranks). The trainer's
    :class:`~megatron_tir.rollout.sync.base.WeightSync`: ``update(source)`` on every rank.
    """

    wait_for_rank0 = True  # update starts with collectives on ``group`` (coordination_timeout_s)

    def __init__(self, config: StageWeightSyncConfig, *, engine: SGLangEngine | None = None,
                 submit: Submit | None = None) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_tir.policy.weights import is_stage_sender

        self.config = config
        self.rank = dist.get_rank()
        if (self.rank == 0) != (engine is not None and submit is not None):
            raise ValueError("StageWeightSync: rank 0 (only) passes the engine and submit")
        self.engine, self.submit = engine, submit
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.sender = StageSender(backend=config.backend, timeout_s=config.timeout_s) if is_stage_sender() else None
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.coordination_timeout_s))
        self.generation = -1
        self.group_names: list[str] = []
        self.rebuilds = 0  # groups rebuilt for servers that restarted or were left out
        self.members: tuple[str, ...] = ()  # rank 0: the servers in the groups (URLs)

    # ------------------------------------------------------------------ trainer-side collectives

    def _from_rank0(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _raise_any(self, error: BaseException | None, what: str, value: Any = None) -> Any:
        """Every rank's error (or None) to every rank; all raise the first. Returns rank 0's ``value``."""
        import torch.distributed as dist

        found: list[Any] = [None] * dist.get_world_size()
        message = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(found, (message, value), group=self.group)
        for rank, (message, _) in enumerate(found):
            if message is not None:
                failed = sync_failed(RuntimeError(f"({what}) on rank {rank}: {message}"))
                if error is not None and rank == self.rank:
                    raise failed from error
                raise failed
        return found[0][1]

    def _on_rank0(self, coro) -> Any:
        """Rank 0: run ``coro`` on the engine's loop; (result, error)."""
        try:
            return self.submit(coro).result(), None
        except Exception as exc:  # noqa: BLE001 - shared with every rank by _raise_any
            return None, exc

    # ------------------------------------------------------------------ groups

    async def _world_size(self) -> int:
        return 1 + sum(info["tp_size"] for info in await self.engine.server_info(refresh=True))

    async def _check_servers(self) -> bool:
        """Rank 0 before a sync: the servers that take part; True when one restarted or the set of
        servers changed (the groups are rebuilt for them)."""
        behind = await self.engine.wait_servers_back(self.config.rejoin_timeout_s)
        targets = self.engine.sync_targets
        return bool(behind) or tuple(s.url for s in targets) != self.members or any(s.stale for s in targets)

    async def _init_groups(self, endpoints: list[tuple[str, int]]) -> None:
        from megatron_tir.rollout.engines.sglang.wire import SGLangError

        self.members = tuple(s.url for s in self.engine.sync_targets)
        for stage, (address, port) in enumerate(endpoints):  # one stage at a time (see Order)
            join = self.engine.init_weights_update_group(master_address=address, master_port=port,
                                                         group_name=self.group_names[stage],
                                                         backend=self.config.backend)
            try:  # the senders' own join gives up at timeout_s too (not control_timeout_s)
                await asyncio.wait_for(join, self.config.timeout_s)
            except TimeoutError:
                raise SGLangError(f"no answer to /init_weights_update_group ({self.group_names[stage]}) from the "
                                  f"servers within {self.config.timeout_s:g} s (timeout_s)") from None

    async def _leave_groups(self, *, best_effort: bool) -> None:
        for name in self.group_names:
            await self.engine.destroy_weights_update_group(name, best_effort=best_effort)

    def _build_groups(self, world_size: int) -> None:
        """Every rank: new groups (one per stage) between the senders and the servers."""
        import torch.distributed as dist

        from megatron_tir.ports import free_port

        self.generation += 1
        self.group_names = [f"{self.config.group_name}-{self.generation}-pp{s}" for s in range(self.pp)]
        mine = None
        if self.sender is not None:
            mine = (self.stage, self.config.address or socket.getfqdn(), free_port())
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine, group=self.group)
        endpoints = dict((s, (a, p)) for s, a, p in (e for e in found if e is not None))
        assert sorted(endpoints) == list(range(self.pp)), f"one sender per stage, got {found}"
        joined = None
        if self.sender is not None:
            joined = self.sender.join(address=endpoints[self.stage][0], port=endpoints[self.stage][1],
                                      world_size=world_size, group_name=self.group_names[self.stage])
        error = None
        if self.rank == 0:
            _, error = self._on_rank0(self._init_groups([endpoints[s] for s in range(self.pp)]))
        servers_joined = self._from_rank0(error is None)  # a sender waits for its own join only if they did
        if joined is not None:
            try:
                if servers_joined:
                    self.sender.group = joined.result(timeout=self.config.timeout_s)
            except Exception as exc:  # noqa: BLE001
                error = error or exc
            if self.sender.group is None:  # given up: its thread ends here, not inside c10d at exit (group_join.py)
                joined.cancel()
        self._raise_any(error, "joining the weight-update groups")
        log.info("weight-update groups %s ready (world size %d each)", ", ".join(self.group_names), world_size)

    def _drop_groups(self) -> None:
        if self.sender is not None:
            self.sender.leave()
        if self.rank == 0:
            _, error = self._on_rank0(self._leave_groups(best_effort=True))
            if error is not None:
                log.info("leaving the old weight-update groups: %s", error)

    # ------------------------------------------------------------------ the protocol

    def start(self) -> None:
        """Check the servers, read their weight version, build the groups (every rank)."""
        world, error = None, None
        if self.rank == 0:
            async def check() -> int:
                await self.engine.server_info(refresh=True)
                await self.engine.fetch_weight_version()
                return await self._world_size()

            world, error = self._on_rank0(check())
        self._build_groups(self._raise_any(error, "start", world))

    def update(self, source: WeightSource, *, version: int | None = None) -> int:
        """One sync of ``source``'s weights (every rank); returns the engine's new weight version
        (``version``: a resumed run's, see ``WeightSync.update``; read on rank 0)."""
        plan, error = None, None
        if self.rank == 0:
            async def check() -> tuple[bool, int | None]:
                restarted = await self._check_servers()
                return restarted, await self._world_size() if restarted else None

            plan, error = self._on_rank0(check())
        restarted, world = self._raise_any(error, "waiting for the servers", plan)
        if restarted:
            log.warning("rebuilding the weight-update groups: a server restarted, was left out or is back")
            self._drop_groups()
            self.rebuilds += 1
            self._build_groups(world)
        cfg = self.config
        announced = None
        if self.rank == 0:
            announced = (source.bucket_layout(cfg.bucket_bytes), str(source.weight_dtype).removeprefix("torch."))
        layout, dtype = self._from_rank0(announced)  # what the servers will allocate: each sender checks against it
        transfer = None
        if self.rank == 0:
            transfer = self.submit(self._transfer(layout, dtype, version))
        error = None
        try:
            buckets = source.stage_buckets(cfg.bucket_bytes)
            if self.sender is not None:
                self.sender.send(buckets, flattened=cfg.load_format == FLATTENED, stage=self.stage,
                                 layout=layout[self.stage], dtype=dtype)
            else:
                for _ in buckets:  # a TP peer of a sender: the gathers
                    pass
        except Exception as exc:  # noqa: BLE001 - shared with every rank
            error = exc
        version = None
        if transfer is not None:
            try:
                version = transfer.result()
            except Exception as exc:  # noqa: BLE001
                from megatron_tir.rollout.engines.sglang.wire import SGLangError

                if error is None:
                    error = exc
                elif not isinstance(error, ValueError):  # a bucket built wrong here stays the error raised
                    # the servers' answer first: a bucket they refused leaves the broadcast to its timeout
                    error = SGLangError(f"{exc} (the broadcast: {type(error).__name__}: {error})")
        return self._raise_any(error, "sending the weights", version)

    async def _transfer(self, layout: Layout, dtype: str, version: int | None = None) -> int:
        """Rank 0: the sync session, one bucket announced at a time (see Order)."""
        from megatron_tir.rollout.engines.sglang.wire import SGLangError

        timeout_s = self.config.timeout_s

        async def load(weight_version: str) -> None:
            counts = [0] * len(layout)
            for stage, bucket in round_robin(layout):
                index, counts[stage] = counts[stage], counts[stage] + 1
                announce = self.engine.update_weights_from_distributed(
                    names=[n for n, _ in bucket], dtypes=[dtype] * len(bucket), shapes=[list(s) for _, s in bucket],
                    group_name=self.group_names[stage], weight_version=weight_version,
                    load_format=self.config.load_format)
                try:  # one bucket: its broadcast and every server's answer (not control_timeout_s)
                    await asyncio.wait_for(announce, timeout_s)
                except TimeoutError:
                    raise SGLangError(f"no answer to bucket {index} of stage {stage} ({len(bucket)} tensors) from the "
                                      f"servers within {timeout_s:g} s (a server stuck in its receive; timeout_s)"
                                      ) from None

        version = await _run_sync(self.engine, self.config.pause_mode, load, version)
        log.info("weights (version %d) sent from %d stage(s) to %d of %d server(s)", version, len(layout),
                 len(self.engine.sync_targets), len(self.engine.pool.servers))
        return version

    def close(self) -> None:
        """Leave the groups on the servers and here (every rank)."""
        if self.sender is not None:
            self.sender.leave()
        if self.rank == 0 and self.group_names:
            _, error = self._on_rank0(self._leave_groups(best_effort=False))
            if error is not None:
                log.warning("leaving the weight-update groups: %s", error)
        self.group_names = []
