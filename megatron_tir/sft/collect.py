"""Rejection sampling for a cold start: a model's correct multi-turn trajectories on training prompts.

``collect(cfg, prompts=N, out=FILE)`` draws the first ``N`` prompts of ``cfg.data.train`` after
``start`` (the training stream of ``megatron-tir train``: :class:`~megatron_tir.train.data.PromptStream`),
samples ``cfg.rollout.n_samples`` trajectories each with the run's rollout settings, engine, sandbox
and reward (math-verify, as in training: the same parts as the trainer's rollout service), and keeps a
trajectory when

* it is correct (reward > 0) and ``completed`` (an answer; not void, truncated, out of turns or ended
  by infrastructure),
* it called a tool at least ``min_tool_calls`` times (1: a multi-turn, tool-using trajectory),
* its response tokens differ from every kept trajectory of its prompt (exact duplicates are dropped),
* its prompt has fewer than ``max_per_prompt`` kept ones (None: no cap).

Each kept trajectory is one record in the rollout dump format with token ids (``prompt_ids``,
``response_ids``, ``loss_mask``, ``response_logprobs``: ``observe.dumps.trajectory_record``), plus
``split: "train"``, ``question`` and ``position`` (its prompt's place in the training stream); a
``.gz`` name writes gzip. ``megatron-tir sft --data FILE`` reads it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.rollout.trajectory import FinishStatus, Trajectory
from megatron_tir.train.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class CollectSummary:
    prompts: int
    sampled: int
    correct: int  # reward > 0, any status
    kept: int
    duplicates: int  # correct, completed, enough tool calls, but the same tokens as a kept one
    too_few_tool_calls: int  # correct and completed, fewer tool calls than min_tool_calls
    prompts_with_kept: int
    mean_tool_calls_kept: float
    accuracy: float  # correct / sampled

    def lines(self) -> list[str]:
        return [f"prompts {self.prompts}, trajectories {self.sampled}, correct {self.correct} "
                f"(accuracy {self.accuracy:.3f})",
                f"kept {self.kept} from {self.prompts_with_kept} prompts (mean tool calls {self.mean_tool_calls_kept:.2f}); "
                f"dropped: {self.duplicates} duplicates, {self.too_few_tool_calls} with too few tool calls"]


def tool_calls(t: Trajectory) -> int:
    return sum(turn.tool is not None for turn in t.turns)


def select(trajectories: list[Trajectory], *, min_tool_calls: int, max_per_prompt: int | None) -> tuple[
        list[Trajectory], dict[str, int]]:
    """The kept trajectories (see the module docstring), in order, and the counts of those dropped."""
    kept: list[Trajectory] = []
    seen: dict[int, set[tuple[int, ...]]] = {}
    counts = {"duplicates": 0, "too_few_tool_calls": 0, "capped": 0}
    for t in trajectories:
        if not t.correct or t.status is not FinishStatus.COMPLETED:
            continue
        if tool_calls(t) < min_tool_calls:
            counts["too_few_tool_calls"] += 1
            continue
        mine = seen.setdefault(t.group_id, set())
        key = tuple(t.response_ids)
        if key in mine:
            counts["duplicates"] += 1
            continue
        if max_per_prompt is not None and len(mine) >= max_per_prompt:
            counts["capped"] += 1
            continue
        mine.add(key)
        kept.append(t)
    return kept, counts


def collect(cfg: TrainConfig, *, prompts: int, out: str | os.PathLike, start: int = 0, min_tool_calls: int = 1,
            max_per_prompt: int | None = None, progress: bool = True) -> CollectSummary:
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.observe.dumps import trajectory_record
    from megatron_tir.rollout import TIRRollout
    from megatron_tir.rollout.event_loop import EventLoopThread
    from megatron_tir.rollout.factory import engine_settings, open_rollout_parts
    from megatron_tir.train.data import PromptStream

    if prompts < 1 or start < 0 or min_tool_calls < 0 or (max_per_prompt is not None and max_per_prompt < 1):
        raise ValueError("collect needs prompts >= 1, start >= 0, min_tool_calls >= 0 and max_per_prompt >= 1")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a .jsonl or .jsonl.gz file path")
    problems = PromptStream(cfg.data, position=start).take(prompts)  # before anything slow: data errors first
    model_dir = resolve_model(cfg.model)
    settings = engine_settings(cfg.engine, model_dir)
    with contextlib.ExitStack() as stack:
        runner = stack.enter_context(EventLoopThread(name="collect-loop"))
        parts = open_rollout_parts(stack, runner.run, engine_cfg=cfg.engine, sandbox_cfg=cfg.sandbox,
                                   reward_cfg=cfg.reward, model_dir=model_dir, tools=cfg.rollout.tools,
                                   settings=settings)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = stack.enter_context(tqdm(total=prompts * cfg.rollout.n_samples, desc="collect", unit="traj",
                                           disable=None))
        groups = runner.run(TIRRollout(parts.engine, parts.tokenizer, parts.sandbox, cfg.rollout,
                                       verifier=parts.verifier).run(
            problems, on_done=(lambda _t: bar.update(1)) if bar is not None else None))
        tokenizer = parts.tokenizer
    trajs = [t for g in groups for t in g.trajectories]
    kept, counts = select(trajs, min_tool_calls=min_tool_calls, max_per_prompt=max_per_prompt)
    records = []
    for t in kept:
        rec = trajectory_record(t, tokenizer, include_ids=True)
        rec["split"], rec["question"] = "train", problems[t.group_id].messages[-1]["content"]
        rec["position"] = start + t.group_id
        records.append(rec)
    _write(out, records)
    summary = CollectSummary(
        prompts=prompts, sampled=len(trajs), correct=sum(t.correct for t in trajs), kept=len(kept),
        duplicates=counts["duplicates"], too_few_tool_calls=counts["too_few_tool_calls"],
        prompts_with_kept=len({t.group_id for t in kept}),
        mean_tool_calls_kept=sum(map(tool_calls, kept)) / len(kept) if kept else 0.0,
        accuracy=sum(t.correct for t in trajs) / len(trajs) if trajs else 0.0)
    for line in summary.lines():
        log.info("collect: %s", line)
    return summary


def _write(out: Path, records: list[dict]) -> None:
    """All records into ``out`` at once (a temporary file renamed: an existing file survives a failure)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    opener = gzip.open if out.suffix == ".gz" else open
    try:
        with opener(tmp, "wt", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
