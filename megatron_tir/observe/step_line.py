"""One line per training step, for a person reading a terminal or a Slurm log file.

    step 3/10 | reward 0.250 | held-out 0.312 | void 19% | resp tokens 212 mean, 256 max | rows 24/32 in loss
    | grad 0.84 | 41.2 s (rollout 30.1, logprobs 3.2, train 6.0, sync 0.4, eval 0.0, checkpoint 1.5)

(one line; wrapped here; the seconds are the step's wall time, ``time/step``, when known). The
evaluation before training gets its own line as soon as it ends (:func:`format_held_out_line`)::

    step 0 | held-out 0.107 | code use 0.82 | void 4% | resp tokens 180 mean | 35.2 s (eval)

Fields missing from a step's metrics are left out (no held-out
reward on a step without evaluation, no grad norm on a skipped update). Plain text: no
colours or escape codes, so the line reads the same in a file.
"""

from __future__ import annotations

import math

PHASES = ("rollout", "logprobs", "train", "sync", "eval", "checkpoint")


def _num(metrics: dict, key: str):
    v = metrics.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return v


def format_step_line(step: int, total: int, metrics: dict) -> str:
    parts = [f"step {step}/{total}"]
    if (v := _num(metrics, "rollout/reward")) is not None:
        parts.append(f"reward {v:.3f}")
    if (v := _num(metrics, "eval/reward")) is not None:
        parts.append(f"held-out {v:.3f}")
    if (v := _num(metrics, "rollout/void_trajectory_ratio")) is not None:
        parts.append(f"void {100 * v:.0f}%")
    mean, mx = _num(metrics, "rollout/mean_response_tokens"), _num(metrics, "rollout/response_tokens_max")
    if mean is not None:
        parts.append(f"resp tokens {mean:.0f} mean" + (f", {mx:.0f} max" if mx is not None else ""))
    rows, in_loss = _num(metrics, "filter/rows"), _num(metrics, "filter/rows_in_loss")
    if rows is not None and in_loss is not None:
        parts.append(f"rows {in_loss:.0f}/{rows:.0f} in loss")
    elif metrics.get("train/skipped_empty_batch"):
        parts.append("no update (no group passed the filters)")
    if (v := _num(metrics, "train/grad_norm")) is not None:
        parts.append(f"grad {v:.3g}" + (" SPIKE" if metrics.get("train/grad_norm_spike") else ""))
    phases = [(p, _num(metrics, f"time/{p}")) for p in PHASES]
    phases = [(p, v) for p, v in phases if v is not None]
    if phases:
        total_s = _num(metrics, "time/step") or sum(v for _, v in phases)
        parts.append(f"{total_s:.1f} s (" + ", ".join(f"{p} {v:.1f}" for p, v in phases) + ")")
    return " | ".join(parts)


def format_held_out_line(step: int, metrics: dict) -> str:
    """The line of a held-out evaluation on its own (``eval/*`` metrics; step 0: before training)."""
    parts = [f"step {step}"]
    if (v := _num(metrics, "eval/reward")) is not None:
        parts.append(f"held-out {v:.3f}")
    if (v := _num(metrics, "eval/code_use_ratio")) is not None:
        parts.append(f"code use {v:.2f}")
    if (v := _num(metrics, "eval/void_trajectory_ratio")) is not None:
        parts.append(f"void {100 * v:.0f}%")
    if (v := _num(metrics, "eval/mean_response_tokens")) is not None:
        parts.append(f"resp tokens {v:.0f} mean")
    if (v := _num(metrics, "time/eval")) is not None:
        parts.append(f"{v:.1f} s (eval)")
    return " | ".join(parts)
