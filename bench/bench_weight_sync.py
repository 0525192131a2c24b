"""Weight sync into N fake SGLang servers on CPU (gloo), at PP=1 and PP=2, in one run.

    python bench/bench_weight_sync.py [--servers 2] [--hidden 256] [--layers 8] [--reps 5]
                                      [--bucket-mb 16] [--threads 1]

The servers are the test suite's fake SGLang server processes
(``tests/megatron_tir/rollout/engines/fake_sglang.py``): SGLang's HTTP API, its own
``init_custom_process_group`` and ``FlattenedTensorBucket``, one group request at a time, and
a real load of every received tensor into the server's model. The model is a random Qwen2
(``--hidden``, ``--layers``, SmolLM2's 49K vocabulary, untied head, float32) written once.

Modes, each timed ``--reps`` times (median), interleaved, from a barrier to ``update``'s return
on rank 0 (the servers have loaded every tensor and resumed):

* ``per_stage``: ``StageWeightSync`` -- each stage's sender broadcasts its own stage's
  flattened buckets in its own group (the trainer's path);
* ``rank0``: the previous scheme -- every stage's tensors go point-to-point to rank 0
  (``Learner.named_hf_buckets``), which broadcasts them one tensor at a time
  (``DistributedWeightSync``, ``load_format=None``);
* ``rank0_flat``: the same hop through rank 0, but flattened buckets (separates the two effects);
* ``plain``: a plain copy of the same bytes over the same transport -- one gloo broadcast of
  one preallocated buffer of all the weights from one process to N bare receiver processes
  (no HTTP, no session, no conversion, no load); timed ``--reps`` times before the syncs and
  ``--reps`` times after them (after a warm-up each), the median of all.

Every sync pauses with ``retract`` (no request is in flight: an ``abort`` pause would add the
fake's 0.3 s abort drain to every sync, the same for every mode).

Ratios: ``per_stage`` bytes/s over ``plain`` bytes/s at each PP (target >= 0.8), and at PP=2
``per_stage`` time over ``rank0`` time (target <= 0.6), also over ``rank0_flat``. Then the
planner's sync-time estimate for 7B and 32B (``megatron_tir.launch.plan.sync_time``).
Prints one JSON line per measurement; the last line names both ratios. Timings on a shared
machine are noisy: compare the ratios, whose sides run interleaved in one process tree.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
FAKE_SERVER = ROOT / "tests" / "megatron_tir" / "rollout" / "engines" / "fake_sglang.py"
log = logging.getLogger("bench_weight_sync")


def write_model(out: Path, hidden: int, layers: int) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from megatron_tir.model_sources import TINY_QWEN2_CONFIG, materialize_smollm2

    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(materialize_smollm2())
    cfg = Qwen2Config(**(TINY_QWEN2_CONFIG | dict(hidden_size=hidden, num_hidden_layers=layers,
                                                  intermediate_size=4 * hidden, num_attention_heads=hidden // 64,
                                                  num_key_value_heads=max(1, hidden // 128))),
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def start_servers(model: Path, n: int, logs: Path):
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig

    servers = [SGLangServer(SGLangServerConfig(model_path=str(model), port=free_port(), random_seed=0,
                                               launcher=(sys.executable, str(FAKE_SERVER)),
                                               log_file=str(logs / f"server{i}.log"))).start() for i in range(n)]
    for s in servers:
        s.wait_healthy(timeout_s=300, poll_s=0.5)
    return servers


# ----------------------------------------------------------------------------- the plain copy


def receiver_main(address: str, port: int, rank: int, world: int, nbytes: int, reps: int) -> None:
    """A bare receiver: join the group, take ``reps`` broadcasts of ``nbytes`` (then a barrier each)."""
    from megatron_tir.rollout.sync.sglang import join_process_group

    torch.set_num_threads(1)
    group = join_process_group(master_address=address, master_port=port, world_size=world, rank=rank,
                               group_name="plain", backend="gloo", timeout_s=300)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(reps):
        torch.distributed.broadcast(buffer, src=0, group=group)
        torch.distributed.barrier(group=group)


def plain_copies(nbytes: int, n: int, reps: int) -> list[float]:
    """Seconds per broadcast of ``nbytes`` from this process to ``n`` receiver processes."""
    import concurrent.futures

    from megatron_tir.ports import free_port
    from megatron_tir.rollout.sync.sglang import join_process_group

    port = free_port()
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "--receiver", f"127.0.0.1:{port}:{i + 1}:{n + 1}:{nbytes}:{reps}"],
                              env=env) for i in range(n)]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            group = pool.submit(join_process_group, master_address="127.0.0.1", master_port=port, world_size=n + 1,
                                rank=0, group_name="plain", backend="gloo", timeout_s=300).result()
        buffer = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.distributed.broadcast(buffer, src=0, group=group)
            torch.distributed.barrier(group=group)
            times.append(time.perf_counter() - t0)
        torch.distributed.destroy_process_group(group)
        return times
    finally:
        for p in procs:
            p.wait(timeout=60)


# ----------------------------------------------------------------------------- the syncs (spawned ranks)


def bench_ranks(rank: int, world: int, model: str, urls: list[str], bucket_bytes: int, reps: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig
    from megatron_tir.rollout.event_loop import EventLoopThread
    from megatron_tir.rollout.sync import drain
    from megatron_tir.rollout.sync.sglang import DistributedWeightSync, DistributedWeightSyncConfig
    from megatron_tir.rollout.sync.stages import StageWeightSync, StageWeightSyncConfig

    init_parallel(1, world)
    learner = Learner(LearnerConfig(model=model, pp=world))
    loop = engine = None
    if rank == 0:
        loop = EventLoopThread()
        engine = SGLangEngine(SGLangEngineConfig(server_urls=tuple(urls), eos_token_ids=(0,),
                                                 health_check_interval_s=0, control_timeout_s=600))
        loop.run(engine.start())
    per_stage = StageWeightSync(StageWeightSyncConfig(backend="gloo", timeout_s=300, bucket_bytes=bucket_bytes,
                                                      address="127.0.0.1", pause_mode="retract"),
                                engine=engine, submit=None if loop is None else loop.submit)
    per_stage.start()
    rank0 = {}
    if rank == 0:
        for name, fmt in (("rank0", None), ("rank0_flat", "flattened_bucket")):
            rank0[name] = DistributedWeightSync(engine, DistributedWeightSyncConfig(
                master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=300,
                group_name=f"bench-{name}", load_format=fmt, pause_mode="retract"))
            loop.run(rank0[name].start())

    def run(mode: str) -> None:
        if mode == "per_stage":
            per_stage.update(learner)
        elif rank == 0:
            loop.run(rank0[mode].update(learner.named_hf_buckets(bucket_bytes)))
        else:
            drain(learner.named_hf_buckets(bucket_bytes))

    times: dict[str, list[float]] = {m: [] for m in ("per_stage", "rank0", "rank0_flat")}
    for mode in times:  # warm-up
        run(mode)
    for _ in range(reps):
        for mode in times:
            dist.barrier()
            t0 = time.perf_counter()
            run(mode)
            dist.barrier()
            times[mode].append(time.perf_counter() - t0)
    nbytes = sum(4 * torch.Size(s).numel() for stage in learner.bucket_layout(bucket_bytes)
                 for bucket in stage for _, s in bucket)
    per_stage.close()
    if rank == 0:
        for sync in rank0.values():
            loop.run(sync.close())
        loop.run(engine.close())
        loop.close()
        torch.save({"times": times, "bytes": nbytes, "buckets": [len(s) for s in learner.bucket_layout(bucket_bytes)]},
                   out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--receiver", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.receiver:
        address, port, rank, world, nbytes, reps = args.receiver.split(":")
        receiver_main(address, int(port), int(rank), int(world), int(nbytes), int(reps))
        return 0
    if args.servers < 1 or args.reps < 1 or args.layers % 2 or args.hidden % 128:
        print("bench_weight_sync: --servers/--reps >= 1, --layers even, --hidden a multiple of 128", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from megatron_tir.launch.plan import sync_time
    from megatron_tir.policy.parallel import run_ranks

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        tmp = Path(tmp)
        model = write_model(tmp / "model", args.hidden, args.layers)
        servers = start_servers(model, args.servers, tmp)
        try:
            nbytes = sum(t.numel() * t.element_size() for t in load_file(model / "model.safetensors").values())
            plain_times = plain_copies(nbytes, args.servers, args.reps + 1)[1:]  # before the syncs (servers idle)
            for pp in (1, 2):
                out = tmp / f"pp{pp}.pt"
                run_ranks(bench_ranks, pp, str(model), [s.url for s in servers], args.bucket_mb << 20, args.reps,
                          str(out))
                results[pp] = torch.load(out)
        finally:
            for s in servers:
                s.stop()
        if nbytes != results[1]["bytes"]:
            raise SystemExit(f"bench_weight_sync: the model file holds {nbytes} bytes, the syncs sent {results[1]['bytes']}")
        plain_times += plain_copies(nbytes, args.servers, args.reps + 1)[1:]  # and after them
        plain = statistics.median(plain_times)
    print(json.dumps({"part": "plain", "servers": args.servers, "bytes": nbytes, "s": round(plain, 4),
                      "GB/s": round(nbytes / plain / 1e9, 3), "runs_s": [round(t, 4) for t in plain_times]}))
    ratios = {}
    for pp, r in results.items():
        med = {m: statistics.median(t) for m, t in r["times"].items()}
        print(json.dumps({"part": f"pp{pp}", "servers": args.servers, "bytes": r["bytes"], "buckets": r["buckets"],
                          **{f"{m}_s": round(s, 4) for m, s in med.items()},
                          **{f"{m}_GB/s": round(r["bytes"] / s / 1e9, 3) for m, s in med.items()}}))
        ratios[f"pp{pp}_per_stage_vs_plain"] = round(plain / med["per_stage"], 3)
        if pp == 2:
            ratios["pp2_per_stage_vs_rank0"] = round(med["per_stage"] / med["rank0"], 3)
            ratios["pp2_per_stage_vs_rank0_flat"] = round(med["per_stage"] / med["rank0_flat"], 3)
    for name, pp in (("Qwen2.5-7B", 1), ("Qwen2.5-7B", 2), ("Qwen2.5-32B", 2)):  # the recipes: PP 1 and PP 2
        print(json.dumps({"part": "planner", "model": name, "pp": pp, **sync_time(name, pp=pp)}))
    print(json.dumps({"part": "ratios", **ratios,
                      "targets": "per_stage/plain bytes/s >= 0.8; pp2 per_stage/rank0 time <= 0.6"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
