"""Asynchronous training side by side: ``trainer.async=off``, ``one_step`` and ``full`` in one run.

Each mode trains ``--steps`` steps of the same recipe from the same seed (``smollm2-cpu`` on the
arithmetic task by default; ``--set key=value`` passes through to every mode), one after the
other, as ``megatron-tir train`` subprocesses, with a held-out evaluation at every step (the
learning curve). Reported per mode, from the runs' ``metrics.jsonl``:

* throughput: trained trajectories (``filter/rows_in_loss``) per minute over the steps' wall time
  (``time/step``, their held-out evaluations included: the same work in every mode); beside it the
  sampled trajectories per minute (``rollout/trajectories``: the filters' luck left out) and the
  trained ones per minute without the evaluations (``time/step`` minus ``time/eval``; in
  ``one_step`` / ``full`` generation for the next step runs during the evaluation, which that
  figure credits to them);
* the engine idle share (no generation request in flight) and the trainer idle share (waiting for
  rollouts), means over the steps;
* the mean CPU cores the run kept busy (its process tree's user + system CPU seconds over its wall
  time): on a machine of ``C`` cores no overlap can make the same work faster than ``C /
  cores_busy(off)`` times (the ceiling, printed);
* held-out reward at step 0 and after every step.

Generation and training share the same cores here: the overlap can only fill what the other phase
leaves idle (the rollout's tail, when the engine decodes few sequences; the learner's serial parts).
One seed; step times depend on what else runs on the machine (say so when quoting them).

Run: ``python bench/bench_async.py --steps 3 --out runs/bench_async`` (``--modes``, ``--eta``,
``--set``; ``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

MODES = ("off", "one_step", "full")
DEFAULT_SETS = ("data.train=arithmetic", "data.eval=arithmetic", "data.eval_size=8", "trainer.checkpoint.every=0")


def run_mode(mode: str, *, recipe: str, steps: int, eta: int, sets: list[str], out: Path, seed: int) -> dict:
    run = out / mode
    cmd = [sys.executable, "-m", "megatron_tir.cli", "train", "--recipe", recipe, "--out", str(run),
           "--set", f"trainer.steps={steps}", "--set", f"trainer.async={mode}", "--set", "trainer.eval_every=1",
           "--set", f"trainer.seed={seed}"]
    if mode == "full":
        cmd += ["--set", f"trainer.async.max_staleness={eta}"]
    for s in sets:
        cmd += ["--set", s]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{mode}: exit {p.returncode}\n{p.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return summarize(run, mode, steps) | {"cores_busy": cpu / wall, "wall_s": wall}


def summarize(run: Path, mode: str, steps: int) -> dict:
    """What the tables report of one mode's run, from its ``metrics.jsonl``."""
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    trained = [rows[s] for s in range(1, steps + 1)]
    step_s = sum(r["time/step"] for r in trained)
    eval_s = sum(r.get("time/eval", 0.0) for r in trained)
    trajs = sum(r.get("filter/rows_in_loss", 0.0) for r in trained)
    sampled = sum(r.get("rollout/trajectories", 0.0) for r in trained)
    mean = lambda k: sum(r.get(k, 0.0) for r in trained) / len(trained)  # noqa: E731
    return {"mode": mode, "steps": steps, "trajectories": trajs, "sampled": sampled, "step_s": step_s,
            "eval_s": eval_s, "per_min": 60 * trajs / step_s, "per_min_without_eval": 60 * trajs / (step_s - eval_s),
            "sampled_per_min": 60 * sampled / step_s,
            "engine_idle": mean("rollout/engine_idle_share"), "trainer_idle": mean("train/trainer_idle_share"),
            "lag_max": max(r.get("train/weight_version_lag_max", 0.0) for r in trained),
            "interrupted": mean("rollout/interrupted_share"),
            "stale_groups": sum(r.get("filter/groups_stale", 0.0) for r in trained),
            "held_out": [rows[s].get("eval/reward") for s in range(0, steps + 1)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="smollm2-cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--eta", type=int, default=1, help="max_staleness of full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", type=Path, required=True, help="a directory for the runs (one per mode)")
    ap.add_argument("--report", action="store_true", help="print the tables of the runs already in --out")
    args = ap.parse_args(argv)
    if args.report:
        saved = json.loads((args.out / "bench_async.json").read_text())
        results = [summarize(args.out / r["mode"], r["mode"], r["steps"]) | {"cores_busy": r["cores_busy"],
                                                                            "wall_s": r["wall_s"]}
                   for r in saved["results"]]
        report(results, saved["sets"], args)
        return 0
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode {bad[0]!r} (modes: {', '.join(MODES)})")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.out.exists() and any(args.out.iterdir()):
        ap.error(f"{args.out} is not empty")
    sets = list(DEFAULT_SETS) + args.sets
    results = [run_mode(m, recipe=args.recipe, steps=args.steps, eta=args.eta, sets=sets, out=args.out,
                        seed=args.seed) for m in modes]
    (args.out / "bench_async.json").write_text(json.dumps({"sets": sets, "results": results}, indent=1))
    report(results, sets, args)
    return 0


def report(results: list[dict], sets: list[str], args) -> None:
    steps = results[0]["steps"]
    base = next((r for r in results if r["mode"] == "off"), None)
    print(f"{args.recipe}, {steps} steps per mode, one seed ({args.seed}); overrides: {' '.join(sets)}")
    print("| mode | trained traj/min | vs off | sampled traj/min | vs off | trained/min without eval | engine idle "
          "| trainer idle | lag max | interrupted | stale groups | cores busy |")
    print("| --- |" + " --- |" * 11)
    for r in results:
        vs = f"{r['per_min'] / base['per_min']:.2f}×" if base else "–"
        vs_s = f"{r['sampled_per_min'] / base['sampled_per_min']:.2f}×" if base else "–"
        print(f"| {r['mode']} | {r['per_min']:.2f} | {vs} | {r['sampled_per_min']:.2f} | {vs_s} "
              f"| {r['per_min_without_eval']:.2f} | {r['engine_idle']:.0%} | {r['trainer_idle']:.0%} "
              f"| {r['lag_max']:.0f} | {r['interrupted']:.0%} | {r['stale_groups']:.0f} | {r['cores_busy']:.2f} |")
    if base:
        cores = os.cpu_count() or 1
        print(f"ceiling of any overlap on {cores} cores: {cores / base['cores_busy']:.2f}× off "
              f"(off kept {base['cores_busy']:.2f} of {cores} cores busy)")
    print("held-out reward by step (0 = before training):")
    print("| mode | " + " | ".join(str(s) for s in range(steps + 1)) + " |")
    print("| --- |" + " --- |" * (steps + 1))
    for r in results:
        print(f"| {r['mode']} | " + " | ".join("–" if v is None else f"{v:.3f}" for v in r["held_out"]) + " |")


if __name__ == "__main__":
    sys.exit(main())
