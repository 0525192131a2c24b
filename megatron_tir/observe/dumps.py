"""Rollout dumps: a step's sampled and held-out trajectories, and what the update did with each.

``RUN_DIR/rollouts/step_NNNNNN.jsonl.gz``: one JSON line per trajectory, in the record
format of ``megatron-tir eval --out`` (:func:`trajectory_record`: ``Trajectory.to_json()``
plus the decoded ``prompt`` and ``response``), with ``step``, ``split`` (``train`` or
``eval``) and, for train rows, ``update``:

* ``in_stats`` -- the reward entered its group's statistics (advantages, group filter);
* ``in_loss`` -- its model tokens got gradient;
* ``advantage`` -- the row's advantage (GRPO; Reinforce++: the mean over its loss tokens),
  null for rows of groups the filter removed;
* ``dropped_by`` -- why not in the loss (null when it is): ``group filter: zero_std`` /
  ``accuracy`` / ``no_counted_rows`` (the rule of :func:`megatron_tir.rl.group_keep_G`),
  ``group filter: surplus`` (the group passed but the train batch was already full),
  ``stale: older than trainer.async.max_staleness`` (``trainer.async=full``),
  ``void: <reason>`` (SimpleTIR: a void turn), ``over-long`` (truncated, ``overlong=mask``),
  ``infrastructure: tool_failed | aborted``, ``eval filter: verifier_failed | repeats`` (the per-row
  eval filter, ``trainer.filters``), ``no model tokens``.

The trainer's decisions come in (:class:`~megatron_tir.rollout.batch.RowFate`, built by rank 0's
producer from what its dynamic sampling recorded and its update plan); this module only puts
them in words, so a dump says what happened. Token ids, loss mask
and engine log-probs are added with ``trainer.log.dump_tokens=true``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from megatron_tir.rollout.batch import Group, RowFate
from megatron_tir.rollout.trajectory import FinishStatus, Trajectory

DUMP_DIR = "rollouts"
_NAME = re.compile(r"step_(\d+)\.jsonl\.gz$")


def trajectory_record(t: Trajectory, tokenizer, *, include_ids: bool = False) -> dict:
    """The ``eval --out`` record of one trajectory."""
    rec = t.to_json(include_ids=include_ids)
    rec["prompt"] = tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
    rec["response"] = tokenizer.decode(t.response_ids, skip_special_tokens=False)
    return rec


def dump_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / DUMP_DIR / f"step_{step:06d}.jsonl.gz"


def dumped_steps(run_dir: str | os.PathLike) -> list[int]:
    d = Path(run_dir) / DUMP_DIR
    return sorted(int(m.group(1)) for p in d.glob("step_*.jsonl.gz") if (m := _NAME.search(p.name))) \
        if d.is_dir() else []


def write_dump(path: Path, records: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_dump(path: str | os.PathLike) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_records(path: str | os.PathLike) -> list[dict]:
    """A dump (``.jsonl.gz``) or an ``eval --out`` file (``.jsonl``); ValueError on anything else."""
    path = Path(path)
    try:
        if path.name.endswith(".gz"):
            return read_dump(path)
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSONL file of trajectory records ({exc})") from None


def _why_not_in_loss(t: Trajectory, fate: RowFate, *, drop_void: bool, overlong: str) -> str:
    if t.status in (FinishStatus.TOOL_FAILED, FinishStatus.ABORTED):
        return f"infrastructure: {t.status.value}"
    if t.void and drop_void:
        return f"void: {t.void_reason or 'a void turn'}"
    if t.status is FinishStatus.TRUNCATED and overlong == "mask":
        return "over-long"
    if fate.row_rule is not None:
        return f"eval filter: {fate.row_rule}"
    return "no model tokens"


def update_records(sampled: Sequence[Group], fates: Mapping[tuple[int, int], RowFate], *, drop_void: bool,
                   overlong: str) -> dict[tuple[int, int], dict]:
    """``(group_id, sample_index) -> update record`` (see the module docstring) of every sampled trajectory
    that has a fate; ``drop_void`` (the mode's) and ``overlong`` name the row rules that applied."""
    out = {}
    for t in (t for g in sampled for t in g.trajectories):
        fate = fates.get((t.group_id, t.sample_index))
        if fate is None:
            continue
        if fate.group_rule is not None:
            why = ("stale: older than trainer.async.max_staleness" if fate.group_rule == "stale"
                   else f"group filter: {fate.group_rule}")
        else:
            why = None if fate.in_loss else _why_not_in_loss(t, fate, drop_void=drop_void, overlong=overlong)
        out[(t.group_id, t.sample_index)] = {"in_stats": fate.in_stats, "in_loss": fate.in_loss,
                                             "advantage": fate.advantage, "dropped_by": why}
    return out


def step_records(step: int, split: str, groups: Sequence[Group], tokenizer, *, include_ids: bool,
                 fates: dict | None = None) -> list[dict]:
    out = []
    for g in groups:
        for t in g.trajectories:
            rec = trajectory_record(t, tokenizer, include_ids=include_ids)
            rec["step"], rec["split"] = step, split
            if g.problem is not None:
                rec["question"] = g.problem.messages[-1]["content"]
            if fates is not None:
                rec["update"] = fates.get((t.group_id, t.sample_index))
            out.append(rec)
    return out
