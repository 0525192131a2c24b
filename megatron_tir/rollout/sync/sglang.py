"""Weight sync into SGLang servers: the trainer drives the client's control endpoints.

One sync, in SGLang 0.5.23's order (``srt/managers/scheduler_components/weight_updater.py``
refuses weight updates outside a begin/end session; ``/flush_cache`` refuses while the
scheduler holds requests):

    pause (abort or retract) -> begin_weight_update -> buckets (flush_cache: false,
      weight_version: the next version) -> end_weight_update -> flush_cache (retried
      while the scheduler drains) -> resume

The session is ended and generation resumed on failure too, and the error re-raised.

Restarts: before each sync the servers are asked for ``/model_info``
(``SGLangEngine.wait_servers_back``): one that does not answer within ``rejoin_timeout_s``
while others do is left out -- the sync goes on with the servers that answered, and the late
one is marked down and stale (no work) until a later sync finds it back and brings it to the
current version; only when none answers does the sync wait as long as a load takes
(``SGLangEngineConfig.restart_timeout_s``), then fail naming them. One whose version is not
the engine's restarted (launch weights, not in the group). :class:`DistributedWeightSync`
rebuilds the group (new name and port: the others leave the old one) whenever a server
restarted or the set of servers changed, before the buckets go out; the sync brings every
server it reaches to the new version, and the client gives a restarted one work again.

Colocated (:class:`TensorWeightSync`; the servers share the trainer's GPUs), around each
training phase: ``offload()`` = pause -> flush (retried until the scheduler is idle) -> ``/release_memory_occupation`` (weights,
kv_cache, cuda_graph: srt/constants.py ``GPU_MEMORY_ALL_TYPES``) -> [the trainer trains]
-> ``update``: ``/resume_memory_occupation`` weights -> begin .. buckets .. end -> flush
-> ``/resume_memory_occupation`` kv_cache + cuda_graph -> resume. SGLang requires it so
(``srt/managers/scheduler_components/weight_updater.py``): release asserts an idle
scheduler, resume removes each tag from ``offload_tags`` (a tag not released kills the
scheduler), and a weight load or a forward pass into memory still released writes into
pages the memory saver unmapped. The IPC handles open only on the GPU's own node:
``start()`` refuses servers that are not on this node (:func:`check_node_local`).

Versions: ``start()`` reads every server's current ``weight_version`` (``GET
/model_info``; ``"default"`` at launch, srt/arg_groups/fields/serving.py); each
``update`` sends the next integer as ``weight_version`` with every bucket, which the
server adopts on success (``tokenizer_control_mixin.py``) and records for its requests in
flight (``scheduler.py`` ``record_weight_version_change``), so ``/generate`` reports per
token which version sampled it (``meta_info.weight_versions``).

:class:`DistributedWeightSync` broadcasts over a process group the servers join
(``/init_weights_update_group``; NCCL on GPUs, gloo in the CPU tests): rank 0 is this
trainer rank, the servers' TP ranks follow. Each bucket is one broadcast in SGLang's
flattened-bucket format (``load_format="flattened_bucket"``: the distributed path of 0.5.23
receives it as one uint8 tensor, ``model_runner_components/weight_updater.py``
``_receive_bucketed_weights_from_distributed``; ``load_format=None``: one per tensor). The
trainer sends through this rank only here; with pipeline stages the trainer uses
:mod:`megatron_tir.rollout.sync.stages` (every stage's sender in a group of its own). Before building it every server's
``/server_info`` must show ``dp_size`` 1 (SGLang asserts it) and a ``tp_size``, which
sets the rank offsets. :class:`TensorWeightSync` is the colocated path (the server shares
this rank's GPUs): CUDA IPC handles, one serialized payload per server TP rank.

Their methods are coroutines on the engine's event loop; :func:`call_blocking` runs one
from synchronous code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import threading
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_tir.rollout.engines.base import PauseMode
from megatron_tir.rollout.engines.base import pause_mode as as_pause_mode
from megatron_tir.rollout.engines.base import MEMORY_TAGS
from megatron_tir.rollout.sync.base import FLATTENED, WEIGHTS_TAG, Bucket, check_bucket, flatten
from megatron_tir.rollout.sync.group_join import GroupJoin, group_from_store, wait_outside_c10d

if TYPE_CHECKING:
    import torch

    from megatron_tir.rollout.engines.sglang.client import SGLangEngine

log = logging.getLogger(__name__)

T = TypeVar("T")
SYNC_PAUSE_MODES = (PauseMode.ABORT, PauseMode.RETRACT)  # IN_PLACE keeps requests running: no flush


@dataclass(kw_only=True, slots=True)
class DistributedWeightSyncConfig:
    master_address: str  # this trainer rank's address, reachable from the servers (IPv4, IPv6 or a name)
    master_port: int
    group_name: str = "megatron_tir_weights"
    backend: str = "nccl"  # gloo works on CPU (tests)
    timeout_s: float = 600.0  # joining the group; one bucket (its broadcast and every server's answer)
    # before a sync: how long a server that does not answer is waited for while others do (then the sync goes
    # on without it); None: the engine's SGLangEngineConfig.rejoin_timeout_s
    rejoin_timeout_s: float | None = None
    pause_mode: PauseMode = PauseMode.ABORT  # what a sync does with requests in flight
    load_format: str | None = FLATTENED  # one broadcast per bucket; None: one per tensor

    def __post_init__(self) -> None:
        if self.load_format not in (None, FLATTENED):
            raise ValueError(f"load_format must be {FLATTENED!r} or None, got {self.load_format!r}")
        if not self.master_address:
            raise ValueError("master_address is empty")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if not self.group_name:
            raise ValueError("group_name is empty")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.rejoin_timeout_s is not None and not self.rejoin_timeout_s > 0:
            raise ValueError(f"rejoin_timeout_s must be > 0 (or None: the engine's), got {self.rejoin_timeout_s}")
        self.pause_mode = as_pause_mode(self.pause_mode)
        if self.pause_mode not in SYNC_PAUSE_MODES:
            raise ValueError(f"pause_mode must be abort or retract for a weight sync, got {self.pause_mode.value}")


def tcp_init_method(host: str, port: int) -> str:
    """``tcp://host:port`` with an IPv6 literal in brackets (as SGLang's ``NetworkAddress.to_tcp``)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:  # a host name
        pass
    return f"tcp://{host}:{port}"


def join_process_group(*, master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
                       backend: str, timeout_s: float):
    """Rank ``rank`` of a weight-update group: a process group outside the trainer's default world,
    joined by the servers (SGLang's ``init_custom_process_group``: a TCP rendezvous at
    ``master_address:port``, then :func:`~megatron_tir.rollout.sync.group_join.group_from_store`).
    Rank 0 hosts the rendezvous store; the trainer joins as rank 0 through
    :class:`~megatron_tir.rollout.sync.group_join.GroupJoin` (a join that can be given up).

    The store is built here, not with ``c10d.rendezvous("tcp://...")``: under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE=True`` in every worker's environment) that rendezvous assumes the
    elastic agent hosts the store and makes rank 0 a client too, so nobody would listen at
    ``master_port`` and the servers' join would time out (torch ``distributed/rendezvous.py``
    ``_create_c10d_store``; found by the rehearsal, docs/rehearsal.md). The store is the one the
    rendezvous builds otherwise: a ``TCPStore`` hosted by rank 0, multi-tenant, libuv."""
    import torch.distributed

    store = torch.distributed.TCPStore(host_name=master_address, port=master_port, world_size=world_size,
                                       is_master=rank == 0, timeout=timedelta(seconds=timeout_s), multi_tenant=True,
                                       use_libuv=True)
    return group_from_store(store, world_size=world_size, rank=rank, group_name=group_name, backend=backend,
                            timeout_s=timeout_s)


AFTER_FAILURE_S = 30.0  # each call that ends a failed sync (end session, resume): bounded, best effort


async def _run_sync(engine: SGLangEngine, mode: PauseMode, load, version: int | None = None) -> int:
    """pause -> begin -> ``await load(version)`` -> end -> flush -> resume; the session ends and
    generation resumes on failure too. Returns the new version.

    After ``offload`` (the engine is paused, its memory released): resume the weights
    first, and the KV cache and CUDA graphs after the flush, before resuming generation.

    On failure the error raised is the first one (a server's own answer, typically), not one of the
    calls that end the session after it: those are best effort, each bounded by ``AFTER_FAILURE_S``
    (a server stuck in its receive answers nothing else either) and logged when they fail.
    ``version``: the one the servers adopt (a resumed run's); None: one more than the engine's.
    """
    version = engine.weight_version + 1 if version is None else version
    released = engine.released_memory
    error: BaseException | None = None
    try:
        if not released:
            await engine.pause(mode=mode)
        if WEIGHTS_TAG in released:
            await engine.resume_memory_occupation([WEIGHTS_TAG])
        await engine.begin_weight_update()
        try:
            await load(str(version))
        except BaseException as exc:
            error = exc
            raise
        finally:
            await _then(engine.end_weight_update(), error)
        await engine.flush_cache()
    except BaseException as exc:
        error = error or exc
        raise
    finally:
        try:
            await _then(engine.resume_memory_occupation(), error)  # the rest (kv_cache, cuda_graph); none: no call
        finally:
            await _then(engine.resume(), error)
    if engine.weight_version != version:  # every server adopted it (the client records it on success)
        raise RuntimeError(f"weight sync: the servers report version {engine.weight_version}, not {version}")
    return version


async def _then(call: Coroutine[Any, Any, Any], error: BaseException | None) -> None:
    """``await call``; after a failure (``error``) best effort: bounded, its own failure logged."""
    if error is None:
        await call
        return
    try:
        await asyncio.wait_for(call, AFTER_FAILURE_S)
    except Exception as exc:  # noqa: BLE001 - the first error is the one raised
        log.warning("weight sync failed (%s); ending the session: %s", type(error).__name__,
                    f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def call_blocking(engine: SGLangEngine, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the engine's event loop from synchronous code and return its result.

    The loop may be running in another thread (the coroutine is handed to it) or idle
    (it runs the coroutine until done); from inside that loop, ``await`` instead.
    """
    loop = engine.loop
    if loop is None or loop.is_closed():
        coro.close()
        raise RuntimeError("the engine has no event loop yet: start it (await engine.start()) on the rollout loop")
    if loop.is_running():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("call_blocking was called from the engine's own event loop: await the coroutine")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()
    return loop.run_until_complete(coro)


def _daemon_call(fn, name: str = "weight-sync-group") -> concurrent.futures.Future:
    """Run ``fn`` in a daemon thread (a group join or a broadcast that never completes must not block exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            if not future.cancelled():
                future.set_exception(exc)
            else:
                log.debug("abandoned weight-update group join ended: %r", exc)
            return
        if not future.cancelled():
            future.set_result(result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


ANSWER_GRACE_S = 5.0  # after a broadcast failed: how long the servers' own answer (why) is waited for
# after a server refused a bucket it received: how long its broadcast's end is waited for (its thread sees it
# within group_join.POLL_S; a loaded machine's thread and loop take longer) before the group is taken for broken
SENT_GRACE_S = 5.0


async def bucket_done(announce: asyncio.Future, sent: asyncio.Future, *, timeout_s: float, what: str) -> None:
    """A bucket is loaded when every server answered its announcement (``announce``) and this rank's
    broadcast of it ended (``sent``). The first failure raises at once: a server that refused the bucket
    never receives it, so the broadcast would wait out the group's timeout -- the error is the server's
    own answer. A broadcast that failed first waits ``ANSWER_GRACE_S`` for the servers' answer (their
    reason, when they give one). Neither within ``timeout_s``: SGLangError saying which side is missing.
    An abandoned broadcast thread ends at its group's timeout (the caller drops the group); it waits in
    Python meanwhile, so the process can exit before that (``group_join.wait_outside_c10d``)."""
    from megatron_tir.rollout.engines.sglang.wire import SGLangError

    sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned one: nobody awaits it
    try:
        done, _ = await asyncio.wait({announce, sent}, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        if announce in done and announce.exception() is not None:
            raise announce.exception()
        if sent in done and sent.exception() is not None:
            answered, _ = await asyncio.wait({announce}, timeout=ANSWER_GRACE_S)
            why = f"{type(sent.exception()).__name__}: {sent.exception()}"
            if answered and announce.exception() is not None:
                raise SGLangError(f"{announce.exception()} (the broadcast of {what}: {why})")
            raise SGLangError(f"the broadcast of {what} failed: {why}")
        if announce not in done:
            raise SGLangError(f"no answer to {what} from the servers within {timeout_s:g} s "
                              f"(a server stuck in its receive; timeout_s)")
        if sent not in done:
            raise SGLangError(f"the broadcast of {what} did not end within {timeout_s:g} s (timeout_s)")
    finally:
        if not announce.done():
            announce.cancel()
            await asyncio.gather(announce, return_exceptions=True)


class DistributedWeightSync:
    """Rank 0 broadcasts HF-named tensors to every server's TP ranks (see the module docstring).

    ``await start()`` once, ``await update(buckets)`` per sync, ``await close()`` at the end;
    all on the event loop the engine uses.
    """

    def __init__(self, engine: SGLangEngine, config: DistributedWeightSyncConfig) -> None:
        self.engine = engine
        self.config = config
        self.group = None
        self.world_size = 0
        self.group_name = config.group_name
        self.rebuilds = 0  # groups rebuilt for servers that restarted or were left out
        self.members: tuple[str, ...] = ()  # the servers in the group (URLs)
        self.broken = False  # a bucket failed with its broadcast in flight: the group is rebuilt, never reused
        self._sending: asyncio.Future | None = None  # the last bucket's broadcast thread
        self.next_version: int | None = None  # a resumed run's version for the next update (EngineWeightSync)

    async def start(self) -> None:
        """Check the servers and read their weight version, then build the group; fails at once
        when a server cannot join."""
        await self.engine.server_info(refresh=True)
        await self.engine.fetch_weight_version()
        await self._join(self.config.group_name, self.config.master_port, refresh=False)

    async def _join(self, group_name: str, master_port: int, *, refresh: bool = True) -> None:
        """The servers' ``/init_weights_update_group`` (bounded by ``timeout_s``) beside this rank's own join;
        either failing gives the other up. A hung server join ends with the servers' side named: this rank's
        store waits ``timeout_s`` too, and a failure of it waits ``ANSWER_GRACE_S`` for their answer."""
        from megatron_tir.rollout.engines.sglang.wire import SGLangError

        cfg = self.config
        infos = await self.engine.server_info(refresh=refresh)
        world_size = 1 + sum(info["tp_size"] for info in infos)
        join = GroupJoin(master_address=cfg.master_address, master_port=master_port, world_size=world_size,
                         group_name=group_name, backend=cfg.backend, timeout_s=cfg.timeout_s)
        joined = asyncio.wrap_future(join.future)
        init = asyncio.ensure_future(asyncio.wait_for(self.engine.init_weights_update_group(
            master_address=cfg.master_address, master_port=master_port, group_name=group_name,
            backend=cfg.backend), cfg.timeout_s))
        try:
            await asyncio.wait({joined, init}, return_when=asyncio.FIRST_EXCEPTION)
            if joined.done() and joined.exception() is not None and not init.done():
                await asyncio.wait({init}, timeout=ANSWER_GRACE_S)  # the servers' answer says why, if they give one
            if init.done() and isinstance(init.exception(), TimeoutError):
                raise SGLangError(f"no answer to /init_weights_update_group ({group_name}) from the servers within "
                                  f"{cfg.timeout_s:g} s (timeout_s)")
            if init.done() and init.exception() is not None:
                raise init.exception()
            group = await joined
            await init
        except BaseException:
            if not init.done():
                init.cancel()
                await asyncio.gather(init, return_exceptions=True)
            # its thread ends (at once unless a gloo group waits for a server): not left in c10d; off the loop
            # (counting the missing servers in connects to the store)
            await asyncio.get_running_loop().run_in_executor(None, join.cancel)
            raise
        self.group, self.world_size, self.group_name = group, world_size, group_name
        self.members = tuple(s.url for s in self.engine.sync_targets)
        log.info("weight-update group %s ready (world size %d)", group_name, world_size)

    def _droppable(self) -> bool:
        """Whether the group can be destroyed here: not broken, or its broadcast thread has ended since (a
        broken group with a thread still inside is dropped instead; its name stays taken in this process)."""
        return not self.broken or self._sending is None or self._sending.done()

    async def rejoin(self) -> bool:
        """Before a sync: the servers that take part (``SGLangEngine.wait_servers_back``); when one
        restarted (its weight version is not the engine's: it is not in the group any more) or the
        set of servers changed (one left out, or back), rebuild the group for them under a new
        name and port. Returns whether it rebuilt."""
        import torch.distributed as dist

        behind = await self.engine.wait_servers_back(self.config.rejoin_timeout_s)
        targets = self.engine.sync_targets
        members = tuple(s.url for s in targets)
        if (not behind and members == self.members and not any(s.stale for s in targets) and not self.broken
                and self.group is not None):  # (None: the last rebuild failed; a broadcast would use the default group)
            return False
        log.warning("rebuilding weight-update group %s for %s (restarted: %s%s)", self.group_name,
                    ", ".join(members), ", ".join(s.url for s in targets if s.stale) or "none",
                    "; the last sync failed" if self.broken else "")
        await self.engine.destroy_weights_update_group(self.group_name, best_effort=True)
        if self.group is not None and self._droppable():
            dist.destroy_process_group(self.group)
        self.group, self.broken = None, False
        from megatron_tir.ports import free_port

        self.rebuilds += 1
        await self._join(f"{self.config.group_name}-{self.rebuilds}", free_port())
        return True

    async def offload(self) -> None:
        """The servers have GPUs of their own: nothing to free."""
        return None

    async def update(self, buckets: Iterable[Bucket]) -> int:
        """One sync: every bucket announced to all servers and broadcast from rank 0."""
        import torch.distributed as dist

        if self.group is None and not self.rebuilds:
            raise RuntimeError("DistributedWeightSync.start() was not called")
        await self.rejoin()

        async def load(weight_version: str) -> None:
            for index, bucket in enumerate(buckets):
                bucket = check_bucket(bucket)
                announce = asyncio.ensure_future(self.engine.update_weights_from_distributed(
                    names=[n for n, _ in bucket], dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket], group_name=self.group_name,
                    weight_version=weight_version, load_format=self.config.load_format))
                payload = ([flatten(bucket)] if self.config.load_format == FLATTENED
                           else [t.contiguous() for _, t in bucket])

                def broadcast(payload=payload, group=self.group, gloo=self.config.backend == "gloo") -> None:
                    for tensor in payload:
                        work = dist.broadcast(tensor, src=0, group=group, async_op=True)
                        # gloo's wait lasts until the servers received or the group's timeout: waited for in
                        # Python (an abandoned one must not come back from c10d while the process exits,
                        # group_join.wait_outside_c10d); NCCL's returns once queued
                        if gloo:
                            wait_outside_c10d(work)
                        else:
                            work.wait()

                sent = self._sending = asyncio.wrap_future(_daemon_call(broadcast, "weight-sync-send"))
                try:
                    await bucket_done(announce, sent, timeout_s=self.config.timeout_s,
                                      what=f"bucket {index} ({len(bucket)} tensors)")
                except BaseException:
                    # a broadcast still in flight, or one that failed (a timed-out gloo/NCCL group is dead):
                    # the group is rebuilt, never reused
                    await asyncio.wait({sent}, timeout=SENT_GRACE_S)
                    self.broken = not sent.done() or sent.cancelled() or sent.exception() is not None
                    raise

        version, self.next_version = await _run_sync(self.engine, self.config.pause_mode, load, self.next_version), None
        log.info("weights (version %d) sent to %d of %d server(s)", version, len(self.engine.sync_targets),
                 len(self.engine.pool.servers))
        return version

    async def close(self) -> None:
        """Leave the group on the servers and here."""
        import torch.distributed as dist

        if self.group is None:
            return
        try:
            await self.engine.destroy_weights_update_group(self.group_name, best_effort=self.broken)
        finally:
            if self._droppable():
                dist.destroy_process_group(self.group)
            self.group = None


def serialize_for_tp_ranks(bucket: list[tuple[str, torch.Tensor]], tp_size: int, *,
                           flattened: bool = False) -> list[str]:
    """One base64 ``MultiprocessingSerializer`` dump of ``bucket`` per server TP rank (CUDA only).

    SGLang's ``deserialize_own_rank`` reads entry ``tp_rank`` after
    ``monkey_patch_torch_reductions`` (CUDA IPC handles keyed by device UUID), so the dump
    is made after the same patch, once per rank (each rank's copy is released separately).
    ``flattened``: the dump is ``{"flattened_tensor", "metadata"}`` of SGLang's
    ``FlattenedTensorBucket`` (``srt/weight_sync/tensor_bucket.py``), what
    ``load_format="flattened_bucket"`` reads (``model_runner_components/weight_updater.py``
    ``_update_weights_from_flattened_bucket``): one IPC handle per bucket, not per tensor.
    """
    bucket = check_bucket((0, bucket))
    on_cpu = [name for name, tensor in bucket if not tensor.is_cuda]
    if on_cpu:
        raise ValueError(f"update_weights_from_tensor shares CUDA memory; {on_cpu[:3]} are not on a GPU")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    payload: object = list(bucket)
    if flattened:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        flat = FlattenedTensorBucket(named_tensors=list(bucket))
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(tp_size)]


def node_addresses() -> frozenset[str]:
    """This node's IP addresses (its host names resolved, and loopback)."""
    import socket

    found = {"127.0.0.1", "::1"}
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            found.update(info[4][0] for info in socket.getaddrinfo(name, None))
        except OSError:
            pass
    return frozenset(found)


def check_node_local(urls: Iterable[str], local: frozenset[str] | None = None) -> None:
    """ValueError (one line) when a server is not on this node: CUDA IPC handles open only there."""
    import socket
    from urllib.parse import urlsplit

    local = node_addresses() if local is None else local
    remote = []
    for url in urls:
        host = urlsplit(url).hostname or ""
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            addresses = set()
        if not any(a in local or ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
            remote.append(url)
    if remote:
        raise ValueError(f"colocated weight sync (CUDA IPC) needs every SGLang server on this trainer rank's node; "
                         f"{', '.join(remote)} are elsewhere (run them colocated per node, or use the broadcast sync)")


class TensorWeightSync:
    """Colocated sync: CUDA IPC handles of this rank's tensors to every server TP rank."""

    def __init__(self, engine: SGLangEngine, *, pause_mode: PauseMode | str = PauseMode.ABORT,
                 local_addresses: Iterable[str] | None = None, rejoin_timeout_s: float | None = None,
                 load_format: str | None = FLATTENED) -> None:
        if load_format not in (None, FLATTENED):
            raise ValueError(f"load_format must be {FLATTENED!r} or None, got {load_format!r}")
        self.load_format = load_format
        if rejoin_timeout_s is not None and not rejoin_timeout_s > 0:
            raise ValueError(f"rejoin_timeout_s must be > 0 (or None: the engine's), got {rejoin_timeout_s}")
        self.rejoin_timeout_s = rejoin_timeout_s
        mode = as_pause_mode(pause_mode)
        self.local_addresses = None if local_addresses is None else frozenset(local_addresses)
        if mode not in SYNC_PAUSE_MODES:
            raise ValueError(f"pause_mode must be abort or retract for a weight sync, got {mode.value}")
        self.engine = engine
        self.pause_mode = mode
        self.next_version: int | None = None  # a resumed run's version for the next update (EngineWeightSync)

    async def start(self) -> None:
        """Refuse servers on other nodes, check the servers and read their weight version."""
        check_node_local(self.engine.config.server_urls, self.local_addresses)
        await self.engine.server_info(refresh=True)
        await self.engine.fetch_weight_version()

    async def offload(self) -> None:
        """Before training: pause generation, wait for an idle scheduler, free the servers' weights,
        KV cache and CUDA graphs.

        Release asserts an idle scheduler (weight_updater.py ``is_fully_idle``) and an abort
        pause returns while the scheduler may still hold the aborted batch: ``/flush_cache``
        succeeds only on an idle scheduler, so it is retried first (``SGLangEngine.flush_cache``).
        """
        await self.engine.wait_servers_back(self.rejoin_timeout_s)
        await self.engine.pause(mode=self.pause_mode)
        await self.engine.flush_cache()
        await self.engine.release_memory_occupation(list(MEMORY_TAGS))

    async def update(self, buckets: Iterable[Bucket]) -> int:
        """One sync into every server that answers (``SGLangEngine.wait_servers_back``); a server
        that restarted is updated with the others (no group to rebuild)."""
        await self.engine.wait_servers_back(self.rejoin_timeout_s)
        tp_sizes = [info["tp_size"] for info in await self.engine.server_info(refresh=True)]

        async def load(weight_version: str) -> None:
            for bucket in buckets:
                tensors = check_bucket(bucket)
                payloads = [serialize_for_tp_ranks(tensors, tp, flattened=self.load_format == FLATTENED)
                            for tp in tp_sizes]
                await self.engine.update_weights_from_tensor(payloads, weight_version=weight_version,
                                                             load_format=self.load_format)

        version, self.next_version = await _run_sync(self.engine, self.pause_mode, load, self.next_version), None
        return version

    async def close(self) -> None:
        return None
