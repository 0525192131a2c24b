"""Time the per-stage sender's NCCL path on the device with a Qwen2.5-7B-sized bucket set (bf16).

    python tests/gpu/nccl_sync_check.py --out $OUT/nccl_sync.json

The buckets are the learner's own layout for Qwen2.5-7B at PP 1 (``bucket_layout``, 256 MiB,
random bf16 tensors on the GPU); ``StageSender.send`` flattens each (SGLang's flattened-bucket
layout) and broadcasts it on an NCCL group built the way the servers' side builds theirs
(``join_process_group``). With two or more GPUs, a second process on GPU 1 receives every
bucket (a real cross-device broadcast); with one GPU, NCCL refuses two ranks on one device
("Duplicate GPU detected"), so the group has one rank and the time is the flattening plus
NCCL's own call on the device -- the JSON says which (``ranks``). Baseline: one
device-to-device ``copy_`` of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp

BUCKET_BYTES = 256 << 20


def layout():
    from megatron_tir.launch.model_facts import model_spec
    from megatron_tir.policy.weights import bucket_layout

    return bucket_layout(model_spec("Qwen2.5-7B"), 1, BUCKET_BYTES, 2)[0]


def receive(rank: int, port: int, world: int) -> None:
    from megatron_tir.rollout.sync.sglang import join_process_group

    torch.cuda.set_device(rank)
    group = join_process_group(master_address="127.0.0.1", master_port=port, world_size=world, rank=rank,
                               group_name="nccl-check", backend="nccl", timeout_s=120)
    for _ in range(2):  # warm-up, timed
        for bucket in layout():
            buffer = torch.empty(sum(2 * torch.Size(s).numel() for _, s in bucket), dtype=torch.uint8, device="cuda")
            torch.distributed.broadcast(buffer, src=0, group=group)
    torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.sync.stages import StageSender

    world = 2 if torch.cuda.device_count() >= 2 else 1
    port = free_port()
    peer = mp.get_context("spawn").Process(target=receive, args=(1, port, world)) if world == 2 else None
    if peer is not None:
        peer.start()
    torch.cuda.set_device(0)
    buckets = [(0, [(n, torch.randn(s, dtype=torch.bfloat16, device="cuda")) for n, s in b]) for b in layout()]
    nbytes = sum(t.numel() * 2 for _, b in buckets for _, t in b)
    sender = StageSender(backend="nccl", timeout_s=120)
    sender.group = sender.join(address="127.0.0.1", port=port, world_size=world, group_name="nccl-check").result(120)
    times = []
    for _ in range(2):  # warm-up, timed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sender.send(buckets, flattened=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    flat = torch.cat([t.reshape(-1) for _, b in buckets for _, t in b])
    dst = torch.empty_like(flat)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(flat)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    if peer is not None:
        peer.join(120)
    result = {"ranks": world, "bytes": nbytes, "buckets": len(buckets), "sync_s": round(times[-1], 4),
              "sync_GB/s": round(nbytes / times[-1] / 1e9, 2), "copy_s": round(copy_s, 4),
              "copy_GB/s": round(nbytes / copy_s / 1e9, 2), "sync_vs_copy": round(copy_s / times[-1], 3),
              "what": "cross-device broadcast" if world == 2 else "one rank: flatten + NCCL call, no wire"}
    print(json.dumps(result))
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
