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
  ``infrastructure: tool_failed | aborted``, ``no model tokens``.

The same rules the update uses decide these (:func:`megatron_tir.train.batch.plan_update`
on the kept groups, :func:`megatron_tir.train.batch.filter_groups` on the others), so a
dump says exactly what happened. Token ids, loss mask and engine log-probs are added with
``trainer.log.dump_tokens=true``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from megatron_tir.rollout.batch import Group
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


def _void_reason(t: Trajectory) -> str:
    return f"void: {t.void_reason or 'a void turn'}"


def row_fates(sampled: Sequence[Group], kept: Sequence[Group], *, mode: str, advantage: str,
              overlong: str, low_prob_fraction: float, drop_zero_std: bool, accuracy_lo: float,
              accuracy_hi: float, stale: Sequence[Group] = ()) -> dict[tuple[int, int], dict]:
    """``(group_id, sample_index) -> update record`` for every sampled trajectory (see the module docstring);
    ``stale``: the sampled groups ``trainer.async=full`` dropped for staleness."""
    from megatron_tir.rl import MODES
    from megatron_tir.train.batch import filter_groups, plan_update, to_tensors

    fates: dict[tuple[int, int], dict] = {}
    kept_ids, stale_ids = {id(g) for g in kept}, {id(g) for g in stale}
    for g in sampled:
        if id(g) in kept_ids:
            continue
        if id(g) in stale_ids:
            for t in g.trajectories:
                fates[(t.group_id, t.sample_index)] = {"in_stats": False, "in_loss": False, "advantage": None,
                                                       "dropped_by": "stale: older than trainer.async.max_staleness"}
            continue
        _, removed = filter_groups([g], drop_zero_std=drop_zero_std, accuracy_lo=accuracy_lo,
                                   accuracy_hi=accuracy_hi)
        rule = next((k for k, v in removed.items() if v), "surplus")
        for t in g.trajectories:
            fates[(t.group_id, t.sample_index)] = {"in_stats": False, "in_loss": False, "advantage": None,
                                                   "dropped_by": f"group filter: {rule}"}
    if not kept:
        return fates
    rt = to_tensors(kept, pad_id=0)
    gae = advantage == "gae"  # GAE's advantages come from the critic's values: the dump records none
    plan = plan_update(rt, mode=mode, advantage=None if gae else advantage, overlong=overlong, mini_batches=1)
    drop_void = MODES[mode].drop_void
    trajs = [t for g in kept for t in g.trajectories]
    for b, t in enumerate(trajs):
        in_loss = bool(plan.trained_B[b])
        why = None
        if not in_loss:
            if t.status in (FinishStatus.TOOL_FAILED, FinishStatus.ABORTED):
                why = f"infrastructure: {t.status.value}"
            elif t.void and drop_void:
                why = _void_reason(t)
            elif t.status is FinishStatus.TRUNCATED and overlong == "mask":
                why = "over-long"
            else:
                why = "no model tokens"
        fates[(t.group_id, t.sample_index)] = {"in_stats": bool(plan.stats_B[b]), "in_loss": in_loss,
                                               "advantage": None if gae else float(plan.advantages_B[b]),
                                               "dropped_by": why}
    return fates


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
