"""Policy weights in and out of a live (TP x PP) GPTModel, in HF names, with the one key map.

``load_hf_weights`` fills this rank's GPTModel stage straight from an HF directory (no
converted copy on disk): for each entry of the model's own sharded state dict, the
Megatron tensor is made from the HF tensors (``keymap.to_megatron``) and this rank's
slice of it (global offset and local shape from the sharded entry; a SwiGLU ``linear_fc1``
is the factory of its gate and up halves) is copied into the parameter.

``hf_buckets`` is the other way, for weight sync: stage by stage, the stage's first TP
rank of data-parallel replica 0 gathers each parameter's TP shards (``all_gather`` over the
TP group), splits it into HF tensors (``keymap.to_hf``) and sends them to global rank 0
(gloo/nccl point-to-point) unless it is rank 0; rank 0 yields ``(stage, tensors)``
buckets of about ``bucket_bytes`` (a bucket holds one stage's tensors). A collective: every rank must exhaust the iterator; only rank 0 gets
tensors. Tensors of rank 0's own stage at TP=1 are views of the live parameters (no copy):
use them before the next optimizer step.

MoE experts live on their expert-parallel rank (the replicas of a stage split them): each
expert's tensors are gathered over the expert-tensor-parallel group of the ranks that hold it
(expert data-parallel replica 0) and sent to the stage's sender -- the stage's first rank,
itself the holder of expert-parallel rank 0's experts, whose expert-parallel group lists the
other holders -- which passes them on as its own (``_expert_tensor``).

``stage_buckets`` is the per-stage export (nothing goes to rank 0): the same gathers, but each
stage's sender (its first TP rank of replica 0) yields its own stage's buckets, cut as
``bucket_layout`` says -- a pure function of the model spec that the rank announcing the
buckets to the servers computes without the tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar
from pathlib import Path

import torch

from megatron_tir.policy import keymap
from megatron_tir.policy.checkpoint.hf_io import HFReader
from megatron_tir.policy.checkpoint.layout import MODEL_PREFIX
from megatron_tir.policy.spec import ModelSpec

log = logging.getLogger(__name__)

T = TypeVar("T")

_LAYERS = "decoder.layers."


def _global_name(local: str, layer_offset: int, spec: ModelSpec, expert_offset: int = 0) -> str:
    """A stage's state-dict name (local layer and expert index; local or TE layer spec) -> the key
    map's name (global layer and expert index, local spec's names); a tied output layer (on the
    last stage) is the embedding."""
    if local.startswith(_LAYERS):
        i, rest = local.removeprefix(_LAYERS).split(".", 1)
        return keymap.expert_offset(keymap.local_name(f"{_LAYERS}{int(i) + layer_offset}.{rest}"), expert_offset)
    if local == "output_layer.weight" and spec.tie_word_embeddings:
        return "embedding.word_embeddings.weight"
    return local


def _layer_offset(model) -> int:
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def _expert_offset(spec: ModelSpec) -> int:
    """The global index of this rank's first expert (its expert-parallel rank's share)."""
    if not spec.is_moe:
        return 0
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (spec.num_experts // ep)


@torch.no_grad()
def load_hf_weights(model, hf_dir: Path, spec: ModelSpec, *, skip: tuple[str, ...] = ()) -> None:
    """Copy this rank's slices of the HF weights in ``hf_dir`` into ``model`` (a GPTModel stage);
    parameters named in ``skip`` (a critic's value head) keep their own values."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    plans = {p.megatron: p for p in keymap.plan(spec)}
    params = model.state_dict(keep_vars=True)
    layer_offset, expert_offset = _layer_offset(model), _expert_offset(spec)
    reader = HFReader(Path(hf_dir))
    cached: tuple[str, torch.Tensor] | None = None
    try:
        for name, entry in model.sharded_state_dict(prefix=MODEL_PREFIX).items():
            if isinstance(entry, ShardedObject) or name.removeprefix(MODEL_PREFIX) in skip:
                continue
            leaves = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
            parts = []
            mname = _global_name(name.removeprefix(MODEL_PREFIX), layer_offset, spec, expert_offset)
            for leaf in leaves:
                if cached is None or cached[0] != mname:
                    if mname not in plans:
                        raise AssertionError(f"{mname} is not in the {spec.family} key map")
                    p = plans[mname]
                    reader.release()
                    cached = (mname, keymap.to_megatron(p, [reader.get(n) for n in p.hf], spec))
                offsets = tuple(leaf.global_offset)[leaf.prepend_axis_num:]
                parts.append(cached[1][tuple(slice(o, o + s) for o, s in zip(offsets, leaf.local_shape))])
            local = entry.merge_fn(parts) if isinstance(entry, ShardedTensorFactory) else parts[0]
            target = params[name.removeprefix(MODEL_PREFIX)]
            if tuple(local.shape) != tuple(target.shape):
                raise AssertionError(f"{name}: HF slice {tuple(local.shape)} vs parameter {tuple(target.shape)}")
            target.data.copy_(local)
    finally:
        reader.close()


def stage_plans(spec: ModelSpec, stage: int, pp: int) -> list[keymap.TensorPlan]:
    """The key-map entries held by pipeline stage ``stage`` of ``pp`` (uniform layer split), in order."""
    per_stage = spec.num_layers // pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    out = []
    for p in keymap.plan(spec):
        if p.megatron.startswith(_LAYERS):
            keep = int(p.megatron.split(".")[2]) in layers
        elif p.megatron.startswith("embedding."):
            keep = stage == 0
        else:  # final norm, output layer
            keep = stage == pp - 1
        if keep:
            out.append(p)
    return out


def _is_expert(name: str) -> bool:
    return ".mlp.experts.local_experts." in name


def _gather_tp(param: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
    """The full tensor of a (possibly TP-sharded) parameter; collective over the TP group (an
    expert's: the expert-tensor-parallel group)."""
    from megatron.core import parallel_state

    expert = _is_expert(name)
    tp = (parallel_state.get_expert_tensor_parallel_world_size() if expert
          else parallel_state.get_tensor_model_parallel_world_size())
    data = param.detach()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return data
    group = (parallel_state.get_expert_tensor_parallel_group() if expert
             else parallel_state.get_tensor_model_parallel_group())
    shards = [torch.empty_like(data) for _ in range(tp)]
    torch.distributed.all_gather(shards, data.contiguous(), group=group)
    if gated and name.endswith("linear_fc1.weight"):  # each shard is [gate_r; up_r]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=param.partition_dim)


def _holds_experts(spec: ModelSpec) -> bool:
    """This rank holds experts that the export reads: an MoE model's expert data-parallel replica 0."""
    from megatron.core import parallel_state

    return spec.is_moe and parallel_state.get_expert_data_parallel_rank() == 0


def _expert_tensor(p: keymap.TensorPlan, params: dict, local_names: dict, spec: ModelSpec,
                   stage_sender: bool) -> torch.Tensor | None:
    """Expert tensor ``p`` (the key map's name, global expert index) in full on the stage's sender
    (received from its holder unless the sender holds it), None on other ranks; the holding ranks
    (expert data-parallel replica 0 of its expert-parallel rank) gather it over their
    expert-tensor-parallel group. Called by the stage's sender and its expert holders, in plan order."""
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    owner = int(p.megatron.split(".")[6]) // (spec.num_experts // ep)  # decoder.layers.i.mlp.experts.local_experts.e
    holders = torch.distributed.get_process_group_ranks(parallel_state.get_expert_model_parallel_group())
    full = None
    if _holds_experts(spec) and parallel_state.get_expert_model_parallel_rank() == owner:
        full = _gather_tp(params[local_names[p.megatron]], p.megatron, gated=True)
        if parallel_state.get_expert_tensor_parallel_rank() != 0:
            return None
        if not stage_sender:
            torch.distributed.send(full.contiguous(), dst=holders[0])
            return None
        return full
    if stage_sender:
        full = torch.empty(p.megatron_shape, dtype=next(iter(params.values())).dtype,
                           device=next(iter(params.values())).device)
        torch.distributed.recv(full, src=holders[owner])
    return full


def _bucketed(items: Iterable[tuple[str, T]], nbytes: Callable[[T], int],
              bucket_bytes: int) -> Iterator[list[tuple[str, T]]]:
    """The one bucket rule (the exports' and ``bucket_layout``'s): ``items`` in order, a bucket
    closes once it holds ``bucket_bytes`` (one item may overshoot it); what is left is the last
    bucket. Lazy: a bucket is yielded before the next item is pulled (the exports gather there)."""
    bucket: list[tuple[str, T]] = []
    size = 0
    for name, item in items:
        bucket.append((name, item))
        size += nbytes(item)
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _local_names(model, spec: ModelSpec) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The stage's parameters, and the key map's name -> the stage's own name (either layer spec)."""
    params = dict(model.named_parameters())
    layer_offset, expert_offset = _layer_offset(model), _expert_offset(spec)
    return params, {_global_name(n, layer_offset, spec, expert_offset): n for n in params
                    if n != "output_layer.weight" or not spec.tie_word_embeddings}


def hf_buckets(model, spec: ModelSpec, bucket_bytes: int) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
    """``(stage, [(HF name, full tensor), ...])`` buckets on global rank 0 (see the module docstring);
    collective."""
    from megatron.core import parallel_state

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    rank = torch.distributed.get_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    in_replica0 = parallel_state.get_data_parallel_rank() == 0
    is_sender_tp = parallel_state.get_tensor_model_parallel_rank() == 0
    senders = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    params, local_names = _local_names(model, spec)
    dtype = next(iter(params.values())).dtype
    device = next(iter(params.values())).device
    experts_here = _holds_experts(spec)

    def stage_tensors(stage: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: the stage's HF tensors (its own, or received from the stage's sender); the
        stage's gathering ranks: the gathers (and the sender's sends to rank 0), nothing yielded."""
        gathering = in_replica0 and my_stage == stage
        for p in stage_plans(spec, stage, pp):
            tensors: list[torch.Tensor] | None = None
            if my_stage == stage and _is_expert(p.megatron) and (gathering or experts_here):
                full = _expert_tensor(p, params, local_names, spec, stage_sender=gathering and is_sender_tp)
                if not (gathering and is_sender_tp):
                    continue
                tensors = keymap.to_hf(p, full, spec)
                if rank != 0:
                    for t in tensors:
                        torch.distributed.send(t.contiguous(), dst=0)
                    continue
            elif gathering:
                full = _gather_tp(params[local_names[p.megatron]], p.megatron, gated=True)  # (the key map's name)
                tensors = keymap.to_hf(p, full, spec)
                if is_sender_tp and rank != 0:
                    for t in tensors:
                        torch.distributed.send(t.contiguous(), dst=0)
                    continue
                if not is_sender_tp:
                    continue
            if rank == 0:
                if tensors is None:  # another stage's: receive it
                    tensors = [torch.empty(s, dtype=dtype, device=device) for s in p.hf_shapes]
                    for t in tensors:
                        torch.distributed.recv(t, src=senders[stage])
                yield from zip(p.hf, tensors)

    for stage in range(pp):
        if rank != 0 and not ((in_replica0 or experts_here) and my_stage == stage):
            continue
        for bucket in _bucketed(stage_tensors(stage), _tensor_bytes, bucket_bytes):
            yield stage, bucket


def bucket_layout(spec: ModelSpec, pp: int, bucket_bytes: int,
                  element_size: int) -> list[list[list[tuple[str, tuple[int, ...]]]]]:
    """Per pipeline stage, its buckets as ``[(HF name, shape), ...]`` in send order: what
    ``stage_buckets`` yields on each stage's sender, without the tensors (the same rule, ``_bucketed``)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    return [list(_bucketed(((name, tuple(shape)) for p in stage_plans(spec, stage, pp)
                            for name, shape in zip(p.hf, p.hf_shapes)),
                           lambda shape: element_size * int(torch.Size(shape).numel()), bucket_bytes))
            for stage in range(pp)]


def is_stage_sender() -> bool:
    """This rank sends its pipeline stage's weights: the stage's first TP rank of replica 0."""
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def stage_buckets(model, spec: ModelSpec,
                  bucket_bytes: int) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
    """This rank's stage's ``(stage, [(HF name, full tensor), ...])`` buckets on the stage's sender
    (cut as ``bucket_layout``); its TP peers in replica 0 take part in the gathers and get nothing,
    and so do an MoE model's expert holders in other replicas (their experts' gathers and sends);
    other replicas do nothing. Collective over the stage's TP group (and its expert holders): those
    ranks exhaust it together."""
    from megatron.core import parallel_state

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    in_replica0 = parallel_state.get_data_parallel_rank() == 0
    if not in_replica0 and not _holds_experts(spec):
        return
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    sender = in_replica0 and parallel_state.get_tensor_model_parallel_rank() == 0
    params, local_names = _local_names(model, spec)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for p in stage_plans(spec, stage, pp):
            if _is_expert(p.megatron):
                full = _expert_tensor(p, params, local_names, spec, stage_sender=sender)
            elif in_replica0:
                full = _gather_tp(params[local_names[p.megatron]], p.megatron, gated=True)
            else:
                continue
            if sender:
                yield from zip(p.hf, keymap.to_hf(p, full, spec))

    for bucket in _bucketed(tensors(), _tensor_bytes, bucket_bytes):
        yield stage, bucket
