"""The policy learner on CPU: train throughput, micro-batch padding, weight sync, peak memory.

    python bench/bench_learner.py [--model smollm2] [--rows 4] [--tokens 128] [--reps 3] [--threads 2]
                                  [--max-tokens 4096] [--parts throughput,padding,sync,memory]

* throughput: tokens/s of one forward+backward of a token-mean -log p loss over the same
  batch, through ``Learner.train_step`` (its ``forward_backward`` timing: megatron-core
  schedule, vocab-parallel cross-entropy) vs transformers' own forward+backward (full
  log-softmax). Median of ``--reps``; ratio = learner / transformers (target >= 0.9).
* padding: padding share of the token-budget micro-batches (``plan_microbatches``,
  4096 tokens) for 256 rows whose lengths follow an RL-like mix (prompt 80-400 tokens +
  a log-normal response, cut at 16K), vs padding every row to the longest.
* sync: bytes/s of ``LocalWeightSync.update(learner.named_hf_buckets())`` into a ``LocalEngine`` (export + the engine's
  checked ``update_weights``) vs a plain ``copy_`` of the same tensors into the engine's
  parameters. Median of ``--reps``; ratio = sync / copy (target >= 0.5).
* memory: peak RSS of a fresh process that builds the learner (TP=1, ``--max-tokens`` per
  micro-batch) and takes one train step on a ``--rows`` x ``--tokens`` batch (it decides
  the CPU recipe's token budget).

Prints one JSON line per part. Timings on a shared machine are noisy: compare the ratio,
whose two sides run back to back in the same process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch

log = logging.getLogger("bench_learner")


def _batch(vocab: int, rows: int, tokens: int, seed: int = 0):
    from megatron_tir.policy.learner_contract import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    mask = torch.ones(rows, tokens, dtype=torch.bool)
    return TrainBatch(tokens_BT=ids, attention_mask_BT=mask, loss_mask_BT=mask.float())


def _nll():
    from megatron_tir.policy.losses import NLLLoss

    return NLLLoss()


def _learner(model: str, **kw):
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(1, 1)
    return Learner(LearnerConfig(model=model, lr=1e-6, **kw))


def throughput(model: str, rows: int, tokens: int, reps: int) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_tir.model_sources import resolve_model

    learner = _learner(model, max_tokens_per_microbatch=rows * tokens)
    batch = _batch(learner.spec.vocab_size, rows, tokens)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32)
    hf.train()

    def hf_step() -> float:
        hf.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp = torch.log_softmax(hf(batch.tokens_BT).logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, batch.tokens_BT[:, 1:, None]).squeeze(-1)
        nll.mean().backward()
        return time.perf_counter() - t0

    ours, theirs = [], []
    for i in range(reps + 1):  # the first of each is a warm-up
        ours.append(learner.train_step(batch, _nll()).timings["forward_backward"])
        theirs.append(hf_step())
        log.info("rep %d: learner %.2f s, transformers %.2f s", i, ours[-1], theirs[-1])
    n = rows * tokens
    ours_s, theirs_s = statistics.median(ours[1:]), statistics.median(theirs[1:])
    return {"part": "throughput", "model": model, "batch": f"{rows}x{tokens}", "threads": torch.get_num_threads(),
            "learner_tokens_per_s": round(n / ours_s, 1), "transformers_tokens_per_s": round(n / theirs_s, 1),
            "ratio": round(theirs_s / ours_s, 3)}


def padding(max_tokens: int = 4096, rows: int = 256) -> dict:
    from megatron_tir.policy.microbatch import padding_share, plan_microbatches

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(80, 400, (rows,), generator=g)
    response = torch.exp(torch.randn(rows, generator=g) * 0.9 + 6.5).clamp(max=16384 - 400).long()
    lengths = prompt + response
    mask = torch.arange(int(lengths.max())).unsqueeze(0) < lengths.unsqueeze(1)
    mbs = plan_microbatches(mask, max_tokens=max_tokens)
    naive = 1.0 - float(lengths.sum()) / (rows * int(lengths.max()))
    return {"part": "padding", "rows": rows, "max_tokens_per_microbatch": max_tokens,
            "median_length": int(lengths.median()), "max_length": int(lengths.max()),
            "micro_batches": len(mbs), "padding_share": round(padding_share(mbs), 4),
            "padding_share_pad_to_longest": round(naive, 4)}


def sync(model: str, reps: int) -> dict:
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig
    from megatron_tir.rollout.sync.local import LocalWeightSync

    learner = _learner(model)
    named = [item for bucket in learner.hf_weights(256 << 20) for item in bucket]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)

    async def run() -> tuple[list[float], list[float]]:
        engine = LocalEngine(LocalEngineConfig(model=model))
        params = engine.model.state_dict()
        ours, plain = [], []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            await LocalWeightSync(engine).update(learner.named_hf_buckets())
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with torch.no_grad():
                for name, t in named:
                    params[name].copy_(t)
            plain.append(time.perf_counter() - t0)
        await engine.close()
        return ours[1:], plain[1:]

    ours, plain = asyncio.run(run())
    ours_s, plain_s = statistics.median(ours), statistics.median(plain)
    return {"part": "sync", "model": model, "bytes": nbytes, "sync_bytes_per_s": round(nbytes / ours_s),
            "copy_bytes_per_s": round(nbytes / plain_s), "ratio": round(plain_s / ours_s, 3)}


def memory_child(model: str, rows: int, tokens: int, max_tokens: int) -> dict:
    learner = _learner(model, max_tokens_per_microbatch=max_tokens)
    built_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    learner.train_step(_batch(learner.spec.vocab_size, rows, tokens), _nll())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"part": "memory", "model": model, "batch": f"{rows}x{tokens}",
            "max_tokens_per_microbatch": learner.config.max_tokens_per_microbatch,
            "peak_rss_after_build_mb": round(built_mb),
            "peak_rss_train_step_mb": round(peak_mb)}


def memory(model: str, rows: int, tokens: int, max_tokens: int) -> dict:
    """``memory_child`` in a fresh interpreter, so nothing else counts in its peak."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, __file__, "--model", model, "--rows", str(rows), "--tokens", str(tokens),
                          "--max-tokens", str(max_tokens), "--parts", "memory-child"], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4096, help="memory: token budget per micro-batch")
    parser.add_argument("--parts", default="throughput,padding,sync,memory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    for part in args.parts.split(","):
        if part == "throughput":
            result = throughput(args.model, args.rows, args.tokens, args.reps)
        elif part == "padding":
            result = padding()
        elif part == "sync":
            result = sync(args.model, args.reps)
        elif part == "memory":
            result = memory(args.model, args.rows, args.tokens, args.max_tokens)
        elif part == "memory-child":
            result = memory_child(args.model, args.rows, args.tokens, args.max_tokens)
        else:
            parser.error(f"unknown part {part!r}")
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
