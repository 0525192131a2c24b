# Source: a 1-step smollm2-cpu run on this machine (2 shared CPU cores), rollout dumps on:
#   megatron-tir train --recipe smollm2-cpu --set trainer.steps=1 --set data.eval_size=4 --out /tmp/observe_smollm2
# (arithmetic task, n=4, <= 3 turns, 256 response tokens, T=0.8; step_000000 = held-out eval at step 0,
#  step_000001 = the step's 32 train trajectories: 40 records, 75 turns, 42 tool calls).
# The records here are rollouts/step_*.jsonl.gz with the text stripped (turn shapes, tool latencies, status, reward):
python3 - <<'PY'
import glob, gzip, json
with open("bench/data/smollm2_arithmetic_trajectories.jsonl", "w") as out:
    for f in sorted(glob.glob("/tmp/observe_smollm2/rollouts/step_*.jsonl.gz")):
        for r in map(json.loads, gzip.open(f, "rt")):
            turns = [{k: t.get(k) for k in ("index", "kind", "finish_reason", "model_tokens", "feedback_tokens",
                                            "generation_s")}
                     | {"tool": t["tool"] and {"latency_s": t["tool"].get("latency_s")}} for t in r["turns"]]
            out.write(json.dumps({"step": int(f[-15:-9]), "group_id": r["group_id"], "sample_index": r["sample_index"],
                                  "status": r["status"], "reward": r["reward"], "prompt_tokens": r["prompt_tokens"],
                                  "model_tokens": r["model_tokens"], "turns": turns}) + "\n")
PY
