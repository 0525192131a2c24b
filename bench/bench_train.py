"""Training benchmark for the embedded default (``smollm2-cpu``): step time by phase, peak memory,
and the learning curve.

Runs ``megatron-tir train --recipe smollm2-cpu`` in this process (any ``--set`` overrides
pass through) into a fresh run directory, sampling this process's resident memory (the
learner and the in-process engine; the sandbox workers are separate processes and not
counted) every 0.2 s. Reported from the run's ``metrics.jsonl``:

* per step: wall seconds split into rollout / log-probs / train / sync / eval / checkpoint,
  and the peak resident memory during the step (targets: 8 prompts x 4 samples, <= 3
  turns, under 5 minutes and 8 GiB on 2 cores);
* the learning curve: held-out reward and code-use ratio at step 0 and at each
  evaluation, with the minutes since the start (target: held-out reward at least doubles
  within 30 minutes).

Step times depend on what else runs on the machine; say so when quoting them.

Run: ``python bench/bench_train.py --steps 12`` (``--set key=value`` for overrides,
``--out DIR`` to keep the run; ``--help``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

PHASES = ("rollout", "logprobs", "train", "sync", "eval", "checkpoint")


class MemorySampler:
    """(unix time, RSS bytes) of this process every ``interval_s``."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._proc.memory_info().rss))
            self._stop.wait(interval_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, t0: float, t1: float) -> int:
        return max((rss for t, rss in self.samples if t0 <= t <= t1), default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="smollm2-cpu")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from megatron_tir.train.cli import prepare
    from megatron_tir.observe.metrics_file import read_metrics
    from megatron_tir.train.run import run_training

    run_dir = Path(args.out or tempfile.mkdtemp(prefix="bench-train-"))
    ns = argparse.Namespace(recipe=args.recipe, resume=None, out=str(run_dir),
                            overrides=[f"trainer.steps={args.steps}", *args.overrides])
    cfg, run_dir, state = prepare(ns)
    start = time.time()
    with MemorySampler() as mem:
        run_training(cfg, run_dir, state, resume=False)
    rows = read_metrics(run_dir)
    r, t = cfg.rollout, cfg.trainer
    print(f"== bench_train: recipe {args.recipe}, {t.sampling.prompts_per_step} prompts x {r.n_samples} samples, "
          f"<= {r.max_turns} turns, {r.max_response_tokens} response tokens; run dir {run_dir}")
    print("step | " + " | ".join(f"{ph:>10}" for ph in PHASES) + " |  total s | peak RSS GiB | reward | code use")
    prev_t = start
    for row in rows:
        if row["step"] == 0:
            prev_t = row["time/unix"]
            continue
        total = row["time/unix"] - prev_t
        peak = mem.peak(prev_t, row["time/unix"]) / 2**30
        prev_t = row["time/unix"]
        cells = " | ".join(f"{row.get(f'time/{ph}') or 0.0:10.1f}" for ph in PHASES)
        print(f"{row['step']:4d} | {cells} | {total:8.1f} | {peak:12.2f} | {row.get('rollout/reward', 0):.3f}"
              f" | {row.get('rollout/code_trajectory_ratio') or 0:.3f}")
    print(f"peak RSS of the whole run: {max(rss for _, rss in mem.samples) / 2**30:.2f} GiB")
    print("\nlearning curve (held-out prompts):")
    print("step | minutes | eval reward | eval code use (trajectories with code) | eval code_use_ratio (SimpleTIR)")
    evals = [row for row in rows if row.get("eval/reward") is not None]
    for row in evals:
        print(f"{row['step']:4d} | {(row['time/unix'] - start) / 60:7.1f} | {row['eval/reward']:11.3f} | "
              f"{row.get('eval/code_trajectory_ratio') or 0:.3f} | {row.get('eval/code_use_ratio') or 0:.3f}")
    if len(evals) >= 2 and evals[0]["eval/reward"] > 0:
        print(f"held-out reward ratio end/start: {evals[-1]['eval/reward'] / evals[0]['eval/reward']:.2f}x")
    print(json.dumps({"run_dir": str(run_dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
