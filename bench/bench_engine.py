"""Local engine throughput: the slot decoder vs the previous HF-forward decoder, against a measured roofline.

    python bench/bench_engine.py [--model smollm2] [--requests 16] [--max-new-tokens 64] [--threads 2]
                                 [--batch-sizes 1,4,16] [--rounds 2]

Each request is a distinct prompt sampled at T=1 with its own seed; all requests are
submitted at once and the engine batches up to ``max_batch_size`` of them per step. Every
run (below; ``hf``: the HF forward over a DynamicCache grown by concatenation, ``slot``: the
preallocated-slot decoder) takes the same requests, interleaved round by round (ABBA order)
so that load from other processes hits all of them; each figure is the median over rounds. Wall time includes
prefill and sampling, as a rollout sees it; tokens per CPU-second (process CPU time, all
threads) is printed too, as the figure a loaded machine distorts least.

The roofline is measured on the spot: memory bandwidth (a 256 MiB tensor copy, read +
write bytes per second, and a sum over the same tensor, read bytes per second: a decode
step only reads the weights, so the read rate bounds it; the issue's estimate took half
the copy rate, which this CPU's read rate exceeds ~2x) and the matmul rate of one
decode-shaped product (largest batch x hidden by hidden x intermediate, the MLP's up projection). A step at batch B cannot beat max(weight bytes / read rate,
2 * params * B / matmul rate); "of roofline" is tokens/s over B / that time.

Five runs (``VARIANTS``): ``hf-keep`` is the engine as it was before the slot decoder's work (the
HF forward, idle OpenMP teams kept), ``hf`` the same decoder with the teams released
(megatron_tir.rollout.engines.openmp), ``slot`` today's engine, ``slot-keep`` and ``slot-unpacked`` today's engine
without the release or without the oneDNN-packed weights; the summary divides ``slot`` by each.

Prints one JSON line per run as it ends, then the roofline, one line per (batch size,
decoder) with the medians and a summary line per batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time

import torch

log = logging.getLogger("bench_engine")

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Question: what is 12 * 7?\nAnswer:",
           "import numpy as np\n", "Once upon a time", "Let x = 3. Then x^2 ="]
# run name -> LocalEngineConfig fields. "hf-keep" is the engine as it was before this work (the HF
# forward, idle OpenMP teams kept); "hf" the same decoder with the teams released; "slot" today's
# engine; "slot-keep" and "slot-unpacked" today's engine without one of its two later changes.
VARIANTS = {"hf-keep": dict(decoder="hf", release_idle_threads=False),
            "hf": dict(decoder="hf"),
            "slot": dict(decoder="slot"),
            "slot-keep": dict(decoder="slot", release_idle_threads=False),
            "slot-unpacked": dict(decoder="slot", pack_weights=False)}
# summary key suffix -> the run "slot" is divided by
BASELINES = {"previous": "hf-keep", "hf": "hf", "slot_keep": "slot-keep", "slot_unpacked": "slot-unpacked"}


async def measure(model: str, variant: str, batch_size: int, requests: int, max_new_tokens: int, threads: int) -> dict:
    from megatron_tir.rollout.engines.base import SamplingParams
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

    engine = LocalEngine(LocalEngineConfig(model=model, max_batch_size=batch_size, torch_threads=threads,
                                           **VARIANTS[variant]))
    prompts = [engine.tokenizer(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))).input_ids
               for i in range(requests)]
    # min_new_tokens does not exist: count what was generated, whatever ended each request.
    params = [SamplingParams(max_new_tokens=max_new_tokens, seed=i) for i in range(requests)]
    await engine.generate(prompts[0], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    n_params = sum(p.numel() for p in engine.model.parameters())  # tied weights counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    await engine.close()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"model": model, "decoder": variant, "max_batch_size": batch_size, "requests": requests,
            "threads": threads, "generated_tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "tokens_per_cpu_s": round(tokens / cpu_seconds, 1), "params": n_params, "weight_bytes": weight_bytes}


def measure_roofline(hidden: int, intermediate: int, batch: int, repeats: int = 5) -> dict:
    """Copy bandwidth (read + write bytes/s), read bandwidth (bytes/s of a sum) and the matmul rate
    of a batch x hidden @ hidden x intermediate."""
    src = torch.randn(64 * 1024 * 1024 // 4 * 4)  # 256 MiB, far beyond the caches
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - t0)
    x = torch.randn(batch, hidden)
    w = torch.randn(intermediate, hidden)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    mm_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            torch.nn.functional.linear(x, w)
        mm_s.append((time.perf_counter() - t0) / 20)
    src.sum()
    read_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        read_s.append(time.perf_counter() - t0)
    copy_bytes = 2 * src.numel() * src.element_size()
    flops = 2 * batch * hidden * intermediate
    return {"copy_GBps": round(copy_bytes / min(copy_s) / 1e9, 1),
            "read_GBps": round(copy_bytes / 2 / min(read_s) / 1e9, 1),
            "matmul_GFLOPs": round(flops / min(mm_s) / 1e9, 1), "matmul_shape": [batch, hidden, intermediate]}


def roofline_tokens_per_s(batch: int, roof: dict, params: int, weight_bytes: int) -> float:
    read = max(roof["read_GBps"], roof["copy_GBps"] / 2)
    step_s = max(weight_bytes / (read * 1e9), 2 * params * batch / (roof["matmul_GFLOPs"] * 1e9))
    return batch / step_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    results: dict[tuple[int, str], list[dict]] = {}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for size in sizes:
            for variant in order:
                log.info("round %d, batch size %d, run %s: %d requests x %d tokens",
                         r, size, variant, args.requests, args.max_new_tokens)
                result = asyncio.run(measure(args.model, variant, size, args.requests, args.max_new_tokens,
                                             args.threads))
                results.setdefault((size, variant), []).append(result)
                sys.stdout.write(json.dumps({"round": r, **result}) + "\n")  # each run as it ends
                sys.stdout.flush()
    from transformers import AutoConfig

    from megatron_tir.model_sources import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(args.model))
    roof = measure_roofline(config.hidden_size, config.intermediate_size, max(sizes))
    sys.stdout.write(json.dumps({"roofline": roof}) + "\n")
    for size in sizes:
        speeds = {}
        for variant in VARIANTS:
            runs = results[(size, variant)]
            first = runs[0]
            speed = round(statistics.median(x["tokens_per_s"] for x in runs), 1)
            per_cpu = round(statistics.median(x["tokens_per_cpu_s"] for x in runs), 1)
            roof_tps = roofline_tokens_per_s(size, roof, first["params"], first["weight_bytes"])
            speeds[variant] = (speed, per_cpu)
            row = {k: first[k] for k in ("model", "decoder", "max_batch_size", "requests", "threads")}
            row.update(tokens_per_s=speed, tokens_per_s_rounds=[x["tokens_per_s"] for x in runs],
                       tokens_per_cpu_s=per_cpu,
                       roofline_tokens_per_s=round(roof_tps, 1), of_roofline=round(speed / roof_tps, 3))
            sys.stdout.write(json.dumps(row) + "\n")
        summary = {"max_batch_size": size}
        for name, base in BASELINES.items():
            summary[f"slot_over_{name}"] = round(speeds["slot"][0] / speeds[base][0], 2)
        summary["slot_over_hf_per_cpu_s"] = round(speeds["slot"][1] / speeds["hf"][1], 2)
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
