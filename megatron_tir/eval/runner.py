"""Evaluate a model with TIR rollouts: k samples per problem, rewards, metrics, per-sample JSONL.

``run_eval(EvalConfig(...))`` evaluates one or several datasets in one run (one engine, one
sandbox, all problems in flight together), checks everything the user gave (data, model, engine and
rollout settings) before anything slow starts, opens the sandbox and checks that it
runs a program, builds the engine (:mod:`megatron_tir.rollout.factory`) and checks that
it answers, runs every trajectory through :class:`~megatron_tir.rollout.TIRRollout` with
a progress bar, writes one JSON line per trajectory as it finishes, and returns the
metrics of :mod:`megatron_tir.eval.metrics` over everything plus the per-dataset and
per-data-source rows of :mod:`megatron_tir.eval.report` (printed as one table; written as
JSON beside ``out``: ``samples.jsonl`` -> ``samples.metrics.json``). When infrastructure (engine aborts, sandbox
failures) ended more than ``max_infra_failure_share`` of the trajectories, it raises
:class:`~megatron_tir.rollout.factory.InfrastructureError` instead: such metrics would
describe the cluster, not the model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_tir.finite import check_finite
from megatron_tir.eval.metrics import EvalMetrics, compute_metrics
from megatron_tir.observe.dumps import trajectory_record
from megatron_tir.rollout.batch import Group, flatten
from megatron_tir.rollout.driver import RolloutConfig
from megatron_tir.rollout.trajectory import INFRA_STATUSES
from megatron_tir.rollout.event_loop import EventLoopThread
from megatron_tir.rollout.factory import (
    EngineConfig,
    InfrastructureError,
    SandboxConfig,
    engine_settings,
    open_rollout_parts,
    resolve_model_dir,
)

log = logging.getLogger(__name__)


# Where the eval's rollout defaults differ from RolloutConfig's: 4 samples and 512 response
# tokens, moderate for CPU (the papers use 16K-24K on GPUs).
EVAL_ROLLOUT_DEFAULTS = {"n_samples": 4, "max_response_tokens": 512}


def _eval_rollout() -> RolloutConfig:
    return RolloutConfig(**EVAL_ROLLOUT_DEFAULTS)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    # each: aime24 | aime25 | math500 | math_train | a verl parquet file | a generated task (arithmetic, ...)
    data: tuple[str, ...]
    limit: int | None = None  # the first M problems of each dataset (a generated task: M held-out problems)
    out: str | None = None  # per-sample JSONL
    out_tokens: bool = False  # the per-sample records carry token ids and the loss mask (megatron-tir sft reads them)
    # More trajectories than this share ended by an engine abort or a sandbox failure: the
    # eval fails (exit 1) instead of reporting metrics.
    max_infra_failure_share: float = 0.05
    probe_timeout_s: float = 120.0  # the start-up checks of the sandbox and the engine
    engine: EngineConfig = field(default_factory=EngineConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    rollout: RolloutConfig = field(default_factory=_eval_rollout)  # rollout.n_samples is k

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            self.data = (self.data,)
        self.data = tuple(self.data)
        if not self.data or any(not str(d).strip() for d in self.data):
            raise ValueError(f"data must name at least one dataset, got {self.data!r}")
        if len(set(self.data)) != len(self.data):
            raise ValueError(f"data names a dataset twice: {', '.join(self.data)}")
        check_finite(self)  # every float setting, sections included (megatron_tir.finite)
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if not 0 <= self.max_infra_failure_share <= 1:
            raise ValueError(f"max_infra_failure_share must be in [0, 1], got {self.max_infra_failure_share}")
        if not self.probe_timeout_s > 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {self.probe_timeout_s}")
        if self.out_tokens and self.out is None:
            raise ValueError("out_tokens needs out (the per-sample file that carries them)")
        if self.out is not None and Path(self.out).is_dir():
            raise ValueError(f"out {self.out} is a directory; give a .jsonl file path")

    @property
    def k(self) -> int:
        return self.rollout.n_samples


def check_infrastructure(groups: list[Group], max_share: float) -> None:
    """:class:`InfrastructureError` when infrastructure ended more than ``max_share`` of the trajectories."""
    trajs = flatten(groups)
    failed = [t for t in trajs if t.status in INFRA_STATUSES]
    if len(failed) <= max_share * len(trajs):
        return
    counts = Counter(t.status.value for t in failed)
    first = failed[0].turns[-1].reason if failed[0].turns else ""
    if failed[0].turns and failed[0].turns[-1].tool is not None:
        first = failed[0].turns[-1].tool.result.message or first
    raise InfrastructureError(
        f"{len(failed)} of {len(trajs)} trajectories were ended by infrastructure failures "
        f"({', '.join(f'{k}={v}' for k, v in sorted(counts.items()))}), more than max_infra_failure_share="
        f"{max_share:g}; the metrics would not describe the model (first: {first})")


@dataclass(kw_only=True, slots=True)
class EvalResult:
    metrics: EvalMetrics  # over every dataset together
    rows: list[dict]  # megatron_tir.eval.report.report_rows: per dataset, per data source
    groups: list[Group]


def _json_safe(value):
    """NaN (a share of nothing) as null, so the file is strict JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def metrics_path(out: str | os.PathLike) -> Path:
    """Where the report's JSON goes: beside the per-sample file (``x.jsonl`` -> ``x.metrics.json``)."""
    out = Path(out)
    return out.with_name(f"{out.stem if out.suffix else out.name}.metrics.json")


def run_eval(cfg: EvalConfig, *, progress: bool = True) -> EvalResult:
    from megatron_tir.data.generated import load_eval_problems
    from megatron_tir.eval.report import report_rows
    from megatron_tir.rollout import TIRRollout

    # Everything the user typed is checked before anything slow starts.
    per_dataset = [(name, load_eval_problems(name, limit=cfg.limit)) for name in cfg.data]
    problems = [p for _, ps in per_dataset for p in ps]
    model_dir = resolve_model_dir(cfg.engine)
    settings = engine_settings(cfg.engine, model_dir)
    out_path = Path(cfg.out) if cfg.out else None
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        # written beside it and renamed once every trajectory is done: an existing file survives a failed eval
        tmp_path = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")

    with contextlib.ExitStack() as stack:
        if out_path is not None:
            stack.callback(tmp_path.unlink, missing_ok=True)
        # the same assembly and start-up checks as the trainer's rollout service, on one event-loop thread
        runner = stack.enter_context(EventLoopThread(name="eval-loop"))
        parts = open_rollout_parts(stack, runner.run, engine_cfg=cfg.engine, sandbox_cfg=cfg.sandbox,
                                   model_dir=model_dir, tools=cfg.rollout.tools, settings=settings,
                                   probe_timeout_s=cfg.probe_timeout_s)
        tokenizer = parts.tokenizer
        sink = stack.enter_context(open(tmp_path, "w")) if out_path else None
        bar = None
        if progress:
            from tqdm import tqdm

            bar = stack.enter_context(tqdm(total=len(problems) * cfg.k, desc=f"eval {'+'.join(cfg.data)}", unit="traj",
                                           disable=None))  # a bar on a terminal only
        seen = {"n": 0, "reward": 0.0, "void": 0}

        def on_done(traj) -> None:
            seen["n"] += 1
            seen["reward"] += traj.reward or 0.0
            seen["void"] += traj.has_void_turn
            if sink is not None:
                # the record format of training's rollout dumps
                rec = trajectory_record(traj, tokenizer, include_ids=cfg.out_tokens)
                rec["split"] = "eval"
                rec["question"] = problems[traj.group_id].messages[-1]["content"]  # group ids: problem indices
                sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
                sink.flush()
            if bar is not None:
                bar.set_postfix(reward=f"{seen['reward'] / seen['n']:.3f}", void=f"{seen['void'] / seen['n']:.2f}")
                bar.update(1)

        groups = runner.run(TIRRollout(parts.engine, tokenizer, parts.sandbox, cfg.rollout,
                                       verifier=parts.verifier).run(problems, on_done=on_done))
        if sink is not None:
            sink.close()
            os.replace(tmp_path, out_path)
    check_infrastructure(groups, cfg.max_infra_failure_share)
    metrics = compute_metrics(groups, cfg.k)
    spans, start = [], 0
    for name, ps in per_dataset:
        spans.append((name, groups[start:start + len(ps)]))
        start += len(ps)
    rows = report_rows(spans)
    if out_path is not None:
        from megatron_tir.config_io import to_dict

        report = {"config": to_dict(cfg), "rows": rows,
                  "overall": {"k": metrics.k, "problems": metrics.problems, "avg_at_k": metrics.avg_at_k,
                              "pass_at_k": metrics.pass_at_k, "tir": metrics.tir, "diagnostics": metrics.diagnostics,
                              "status_counts": metrics.status_counts}}
        metrics_path(out_path).write_text(json.dumps(_json_safe(report), indent=1) + "\n")
    log.info("avg@%d = %.4f over %d problems", cfg.k, metrics.avg_at_k, metrics.problems)
    return EvalResult(metrics=metrics, rows=rows, groups=groups)
