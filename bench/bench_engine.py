"""Local engine throughput: sampled tokens per second vs. batch size (continuous batching).

    python bench/bench_engine.py [--model smollm2] [--requests 16] [--max-new-tokens 64] [--threads 2]

Each request is a distinct prompt sampled at T=1 with its own seed; all requests are
submitted at once and the engine batches up to --max-batch-size of them per step. Prints
one JSON line per batch size (and logs progress).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

log = logging.getLogger("bench_engine")

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Question: what is 12 * 7?\nAnswer:",
           "import numpy as np\n", "Once upon a time", "Let x = 3. Then x^2 ="]


async def measure(model: str, batch_size: int, requests: int, max_new_tokens: int, threads: int) -> dict:
    from megatron_tir.rollout.engines.base import SamplingParams
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

    engine = LocalEngine(LocalEngineConfig(model=model, max_batch_size=batch_size, torch_threads=threads))
    prompts = [engine.tokenizer(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))).input_ids
               for i in range(requests)]
    # min_new_tokens does not exist: count what was generated, whatever ended each request.
    params = [SamplingParams(max_new_tokens=max_new_tokens, seed=i) for i in range(requests)]
    await engine.generate(prompts[0], SamplingParams(max_new_tokens=2, seed=0))  # warm-up
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))
    seconds = time.perf_counter() - start
    await engine.close()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"model": model, "max_batch_size": batch_size, "requests": requests, "threads": threads,
            "generated_tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,4,16")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for size in (int(s) for s in args.batch_sizes.split(",")):
        log.info("batch size %d: %d requests x %d tokens", size, args.requests, args.max_new_tokens)
        result = asyncio.run(measure(args.model, size, args.requests, args.max_new_tokens, args.threads))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
