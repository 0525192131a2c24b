"""What every weight sync is: the trainer's weights into one kind of engine.

Two layers. :class:`WeightSync` is the trainer's one contract, the same on every rank and for
every engine kind: ``update(source)`` with the policy's
:class:`~megatron_tir.policy.weight_source.WeightSource`, called by every rank at the same time
(the per-stage SGLang sync, :mod:`megatron_tir.rollout.sync.stages`, is one). An engine that
only the rank holding it can reach has an :class:`EngineWeightSync` (rank 0, coroutines on the
engine's event loop, buckets in: ``local``, ``sglang``'s colocated and broadcast syncs), put on
every rank by :class:`Rank0WeightSync`: rank 0 loads, the other ranks drain their part of the
buckets' collectives. ``megatron_tir.rollout.factory.ENGINE_KINDS`` says which a kind uses.

An engine sync owns the whole update of its engine -- pause, load, flush, resume -- so nothing
else pauses an engine. Where the engine shares the trainer's devices (colocated SGLang,
the in-process LocalEngine) ``offload()`` runs before each training phase: it pauses
generation and releases the engine's memory (``weights``, ``kv_cache``, ``cuda_graph``);
the next ``update`` then takes the weights back, loads, takes back the KV cache and CUDA
graphs and resumes -- SGLang 0.5.23's order (see :func:`megatron_tir.rollout.sync.sglang`). After a sync the engine's ``weight_version`` is one more than
before (every generated token records the version that sampled it; see
``Generation.versions``), or, for a resumed run's first sync, the version its checkpoint saved.
A sync that fails raises the run's one-line stop (``InfrastructureError``) with the servers' own
error text; every call of it is bounded (``megatron_tir.rollout.sync.sglang``).

Buckets are ``(stage, [(HF name, full tensor), ...])``: the pipeline stage the tensors
come from (``Learner.named_hf_buckets`` relays every stage's to rank 0;
``Learner.stage_buckets`` gives each stage's to that stage's sender, for
:mod:`megatron_tir.rollout.sync.stages`) and the tensors themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from megatron_tir.policy.weight_source import WeightSource

Tensors = list[tuple[str, "torch.Tensor"]]
Bucket = tuple[int, Tensors]  # (pipeline stage, tensors)


class WeightSync(Protocol):
    """The trainer's weight sync: every rank calls each method at the same time (a collective)."""

    # True: ``update`` starts with collectives among the trainer ranks, so the caller first lets the
    # other ranks wait for rank 0 through the hand-off (bounded by rank 0's heartbeat, not a group's
    # timeout: rank 0 may drain a step of rollouts before it syncs)
    wait_for_rank0: bool

    def update(self, source: WeightSource, *, version: int | None = None) -> int | None:
        """Load ``source``'s current weights into the engine; the engine's new weight version on
        the rank holding it (None or the same elsewhere). ``version``: the version the engine gets
        (a resumed run continues its numbering); None: one more than the engine's."""
        ...

    def close(self) -> None: ...


class Rank0WeightSync:
    """A sync only rank 0 drives, on every rank: rank 0's ``load(source)`` (the rollout service
    running its :class:`EngineWeightSync` on the engine's event loop); every other rank drains
    ``source.named_hf_buckets()``, its part of the collective export."""

    wait_for_rank0 = False  # the export's collectives are the only ones, and rank 0 takes part at once

    def __init__(self, load: Callable[[WeightSource], int] | None) -> None:
        self.load = load  # rank 0 only

    def update(self, source: WeightSource, *, version: int | None = None) -> int | None:
        if self.load is None:
            drain(source.named_hf_buckets())
            return None
        try:
            return self.load(source) if version is None else self.load(source, version=version)
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise sync_failed(exc) from exc

    def close(self) -> None:
        return None  # the engine sync is closed with the service that started it


def sync_failed(exc: BaseException) -> Exception:
    """A failed weight sync as the run's one-line stop (``InfrastructureError``, the servers' own error text)."""
    from megatron_tir.rollout.factory import InfrastructureError  # (factory imports this module)

    if isinstance(exc, InfrastructureError):
        return exc
    return InfrastructureError(f"weight sync failed: {' '.join(str(exc).split()) or type(exc).__name__}")


def through_rank0(cfg, service, pause_mode) -> Rank0WeightSync:
    """``EngineKind.weight_sync`` of a kind whose engine only rank 0 reaches: rank 0's service
    (``sync_from``, looked up at each sync) loads, the other ranks (``service`` None) drain."""
    if service is None:
        return Rank0WeightSync(None)
    return Rank0WeightSync(lambda source, **kw: service.sync_from(source, **kw))


class EngineWeightSync(Protocol):
    """One engine's weight transport on the rank holding it; coroutines on the engine's event loop.
    ``next_version`` (None: one more than the engine's) is the version the next ``update`` gives the
    engine, set once by a resumed run so the numbering continues; ``update`` clears it."""

    next_version: int | None

    async def start(self) -> None:
        """Connect (join a process group, read the servers' weight version); once, before ``update``."""
        ...

    async def offload(self) -> None:
        """Before a training phase: pause generation and release the engine's memory (a no-op
        where the engine does not share the trainer's devices); the next ``update`` resumes."""
        ...

    async def update(self, buckets: Iterable[Bucket]) -> int:
        """Pause the engine (unless ``offload`` did), load every bucket, flush, resume; returns the engine's new weight version.

        Generation is resumed on failure too, and the error re-raised.
        """
        ...

    async def close(self) -> None: ...


FLATTENED = "flattened_bucket"  # sglang 0.5.23 load_format: one uint8 broadcast per bucket (see flatten)
WEIGHTS_TAG = "weights"  # resumed before the load; the other tags after it (sglang 0.5.23 weight_updater.py)


def buckets_of(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *,
               stage: int = 0) -> Iterator[Bucket]:
    """Group a stream of named tensors into buckets of at most ``bucket_bytes`` (one tensor may exceed it)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    tensors, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if tensors and size + nbytes > bucket_bytes:
            yield stage, tensors
            tensors, size = [], 0
        tensors.append((name, tensor))
        size += nbytes
    if tensors:
        yield stage, tensors


def check_bucket(bucket: Bucket) -> Tensors:
    """The bucket's tensors; ValueError for a bucket that is not ``(stage, [(name, tensor), ...])``."""
    import torch

    if not (isinstance(bucket, tuple) and len(bucket) == 2 and isinstance(bucket[0], int)):
        raise ValueError(f"weight sync: a bucket is (stage, [(name, tensor), ...]), got {type(bucket).__name__}")
    stage, tensors = bucket
    if not tensors:
        raise ValueError(f"weight sync: an empty bucket (stage {stage})")
    for name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight sync: {name} is a {type(tensor).__name__}, not a torch.Tensor")
    return tensors


def drain(buckets: Iterable[Bucket]) -> None:
    """Take part in a collective export without an engine (every rank but the one holding it)."""
    for _ in buckets:
        pass


def flatten(tensors: Tensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bucket as one uint8 tensor, SGLang's flattened-bucket layout: each tensor's bytes in
    order (``srt/weight_sync/tensor_bucket.py`` ``FlattenedTensorBucket``; the receiver allocates
    it with ``FlattenedTensorBucket.empty(names, dtypes, shapes)`` and views each tensor back).
    ValueError for a tensor whose offset is not a multiple of its element size (``empty`` refuses it).
    ``out``: a uint8 buffer of at least the bucket's bytes to write several tensors into (the
    result is its first bytes); a lone tensor is returned as a view of itself either way."""
    import torch

    offset, parts = 0, []
    for name, tensor in tensors:
        if offset % tensor.element_size():
            raise ValueError(f"flattened bucket: {name} ({tensor.dtype}) would start at byte {offset}, "
                             f"not a multiple of {tensor.element_size()}")
        parts.append(tensor.contiguous().reshape(-1).view(torch.uint8))
        offset += parts[-1].numel()
    if len(parts) == 1:
        return parts[0]
    if out is None:
        return torch.cat(parts)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < offset:
        raise ValueError(f"flattened bucket: out must be a 1-d uint8 tensor of at least {offset} bytes")
    return torch.cat(parts, out=out[:offset])


def kept_bytes(slots: list, index: int, nbytes: int) -> torch.Tensor:
    """``slots[index]`` when it is a uint8 buffer of at least ``nbytes``, else a new one put there
    (the old one freed first): memory kept between buckets and syncs on the CPU, where no caching
    allocator hands a freed block to the next bucket and a fresh buffer faults in every page."""
    import torch

    if slots[index] is None or slots[index].numel() < nbytes:
        slots[index] = None
        slots[index] = torch.empty(nbytes, dtype=torch.uint8)
    return slots[index]
