"""Evaluate a model with TIR rollouts: k samples per problem, rewards, metrics, per-sample JSONL.

``run_eval(EvalConfig(...))`` loads the problems, builds the engine (the local torch
engine, or SGLang servers), connects to a sandbox cluster (or starts a LocalCluster),
runs every trajectory through :class:`~megatron_tir.rollout.TIRRollout` with a progress
bar, writes one JSON line per trajectory as it finishes, and returns the metrics of
:mod:`megatron_tir.eval.metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.eval.metrics import EvalMetrics, compute_metrics
from megatron_tir.rollout.batch import Group

log = logging.getLogger(__name__)

ENGINES = ("local", "sglang")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    model: str  # "smollm2" or an HF model directory (SGLang: where the tokenizer is)
    data: str  # aime24 | aime25 | math500 | math_train | a parquet file
    k: int = 4
    limit: int | None = None  # first M problems
    max_turns: int = 5
    max_response_tokens: int = 512  # moderate for CPU; the papers use 16K-24K on GPUs
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    prompt_mode: str = "plain"  # plain | chat
    out: str | None = None  # per-sample JSONL
    sandbox: str | None = None  # broker address; None: start a LocalCluster
    sandbox_workers: int = 2
    tool_timeout_s: float = 10.0
    engine: str = "local"
    sglang_urls: tuple[str, ...] = ()
    batch_size: int = 8  # local engine: requests decoded together
    max_in_flight: int = 64

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "sglang" and not self.sglang_urls:
            raise ValueError("--engine sglang needs --sglang-url")
        if self.engine == "local" and self.sglang_urls:
            raise ValueError("--sglang-url is only used with --engine sglang")
        if self.sandbox_workers < 1:
            raise ValueError(f"--sandbox-workers must be >= 1, got {self.sandbox_workers}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.out is not None and Path(self.out).is_dir():
            raise ValueError(f"--out {self.out} is a directory; give a .jsonl file path")


def _build_engine(cfg: EvalConfig, model_dir: Path):
    if cfg.engine == "local":
        from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

        engine = LocalEngine(LocalEngineConfig(model=str(model_dir), max_batch_size=cfg.batch_size, seed=cfg.seed))
        return engine, engine.tokenizer
    from transformers import AutoTokenizer

    from megatron_tir.rollout.engines.eos import resolve_eos_token_ids
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = resolve_eos_token_ids(model_dir, tokenizer=tokenizer)
    return SGLangEngine(SGLangEngineConfig(server_urls=cfg.sglang_urls, eos_token_ids=eos)), tokenizer


def run_eval(cfg: EvalConfig, *, progress: bool = True) -> tuple[EvalMetrics, list[Group]]:
    from megatron_tir.data import load_problems
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.reward import MathVerifier
    from megatron_tir.rollout import ClusterSandbox, RolloutConfig, TIRRollout
    from megatron_tir.tir import PromptConfig

    # Everything the user typed is checked before anything slow starts.
    problems = load_problems(cfg.data, limit=cfg.limit)
    model_dir = resolve_model(cfg.model)
    rollout_cfg = RolloutConfig(n_samples=cfg.k, max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                                temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                                max_in_flight=cfg.max_in_flight, tool_timeout_s=cfg.tool_timeout_s,
                                prompt=PromptConfig(mode=cfg.prompt_mode))
    out_path = Path(cfg.out) if cfg.out else None
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)

    with contextlib.ExitStack() as stack:
        if cfg.sandbox:
            address = cfg.sandbox
        else:
            from sandbox_cluster import LocalCluster

            log.info("starting a local sandbox cluster with %d workers", cfg.sandbox_workers)
            address = stack.enter_context(LocalCluster(workers=cfg.sandbox_workers)).address
        sandbox = ClusterSandbox.connect(address)
        stack.callback(sandbox.close)
        verifier = stack.enter_context(MathVerifier())
        engine, tokenizer = _build_engine(cfg, model_dir)
        sink = stack.enter_context(open(out_path, "w")) if out_path else None
        bar = None
        if progress:
            from tqdm import tqdm

            bar = stack.enter_context(tqdm(total=len(problems) * cfg.k, desc=f"eval {cfg.data}", unit="traj"))
        seen = {"n": 0, "reward": 0.0, "void": 0}

        def on_done(traj) -> None:
            seen["n"] += 1
            seen["reward"] += traj.reward or 0.0
            seen["void"] += traj.void
            if sink is not None:
                rec = traj.to_json()
                rec["prompt"] = tokenizer.decode(traj.prompt_ids, skip_special_tokens=False)
                rec["response"] = tokenizer.decode(traj.response_ids, skip_special_tokens=False)
                sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
                sink.flush()
            if bar is not None:
                bar.set_postfix(reward=f"{seen['reward'] / seen['n']:.3f}", void=f"{seen['void'] / seen['n']:.2f}")
                bar.update(1)

        async def main() -> list[Group]:
            try:
                return await TIRRollout(engine, tokenizer, sandbox, rollout_cfg, verifier=verifier).run(
                    problems, on_done=on_done)
            finally:
                await engine.close()

        groups = asyncio.run(main())
    metrics = compute_metrics(groups, cfg.k)
    if not math.isnan(metrics.avg_at_k):
        log.info("avg@%d = %.4f over %d problems", cfg.k, metrics.avg_at_k, metrics.problems)
    return metrics, groups
