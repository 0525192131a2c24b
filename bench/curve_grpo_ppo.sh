#!/bin/sh
# GRPO against PPO with a masked critic (GAE, rms-normalised advantages) on smollm2-cpu, side by
# side: the arithmetic task, 3 steps, held-out reward (8 prompts) after every step, the same
# seeds; then one overlaid plot.  Usage: bench/curve_grpo_ppo.sh [OUT_DIR] [STEPS]
set -e
OUT=${1:-runs/grpo-vs-ppo}
STEPS=${2:-3}
BIN=${BIN:-$(dirname "$0")/../.venv/bin}
COMMON="--recipe smollm2-cpu --set trainer.steps=$STEPS --set data.eval_size=8 --set data.train=arithmetic
        --set data.eval=arithmetic --set trainer.eval_every=1"
rm -rf "$OUT/grpo" "$OUT/ppo"
"$BIN/megatron-tir" train $COMMON --out "$OUT/grpo"
"$BIN/megatron-tir" train $COMMON --set trainer.ppo.advantage=gae --set critic.lr=2e-5 --set critic.whiten=rms \
    --out "$OUT/ppo"
"$BIN/megatron-tir" plot "$OUT/grpo" "$OUT/ppo" --out "$OUT/plots"
"$BIN/python" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {name: {} for name in ("grpo", "ppo")}
for name, rows in runs.items():
    for line in (out / name / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["step"], {}).update(r)
print("| step | GRPO held-out | PPO held-out | GRPO train reward | PPO train reward | PPO value loss | PPO explained var. |")
print("| --- | --- | --- | --- | --- | --- | --- |")
fmt = lambda r, k: f"{r[k]:.3f}" if k in r else "-"
for step in sorted(set(runs["grpo"]) | set(runs["ppo"])):
    g, p = runs["grpo"].get(step, {}), runs["ppo"].get(step, {})
    print(f"| {step} | {fmt(g, 'eval/reward')} | {fmt(p, 'eval/reward')} | {fmt(g, 'rollout/reward')} | "
          f"{fmt(p, 'rollout/reward')} | {fmt(p, 'critic/value_loss')} | {fmt(p, 'critic/explained_variance')} |")
PY
