"""Simulate one SimpleTIR training phase at cluster scale in the three async modes (off /
one_step / full) and print step time, engine idle and trainer idle side by side.

What is measured and what is assumed:

* **Measured here**: the shape of multi-turn trajectories -- model tokens per turn, turns per
  trajectory and the sandbox latency of each tool call -- read from ``megatron-tir eval --out``
  records (or a run's ``rollouts/step_N.jsonl.gz`` dumps, the same format) of a real rollout on
  this machine (``--trajectories``; the default file, 40 smollm2-cpu trajectories of the
  arithmetic task with their text stripped, was written by the command in its ``.cmd`` companion). Token counts are scaled by ``--length-scale``
  (the recipe's budget over the measured run's budget) so the *distribution's shape* (its long
  tail) is kept while its size matches a 16K-token run; tool latencies are used as measured.
* **Assumed** (printed at the start, each a flag): the engines' decode rate (per sequence and
  per server at saturation), the learner's training rate (from the planner's 6 * N FLOPs per
  token at an MFU), the weight-sync time, the share of sampled groups the filters keep.

The admission and staleness rules are the trainer's own (:class:`StalenessBound`): in
``full`` mode a group starts only while the bound admits it and a group whose oldest token is
more than ``eta`` versions old is dropped at consumption. ``one_step`` generates round N + 1
while round N trains, with the sync between rounds (generation drained before the push);
``off`` does rollout, train, sync one after another.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_tir.rollout.staleness import StalenessBound  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_TRAJ = HERE / "data" / "smollm2_arithmetic_trajectories.jsonl"  # 256-token budget (.cmd)


@dataclass(slots=True)
class Shape:
    phases: list[tuple[str, float]]  # ("gen", tokens) | ("tool", seconds), in order
    tokens: float


def load_shapes(path: Path, length_scale: float) -> list[Shape]:
    if not path.is_file():
        raise SystemExit(f"sim_async: no trajectory records at {path} (write them with megatron-tir eval --out)")
    shapes = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        phases: list[tuple[str, float]] = []
        for turn in rec.get("turns", []):
            phases.append(("gen", max(1.0, turn.get("model_tokens", 0) * length_scale)))
            tool = turn.get("tool")
            if tool and tool.get("latency_s") is not None:
                phases.append(("tool", float(tool["latency_s"])))
        if phases:
            shapes.append(Shape(phases, sum(v for k, v in phases if k == "gen")))
    if not shapes:
        raise SystemExit(f"{path}: no trajectories with turns")
    return shapes


GEN, TOOL = 0, 1


class Pool:
    """All trajectories of the run as numpy arrays (one row each): the shape they replay, the
    phase they are in, the work left in it, their group."""

    def __init__(self, shapes: list[Shape]):
        P = max(len(s.phases) for s in shapes)
        self.kind = np.full((len(shapes), P), -1)
        self.amount = np.zeros((len(shapes), P))
        for k, s in enumerate(shapes):
            for j, (what, v) in enumerate(s.phases):
                self.kind[k, j], self.amount[k, j] = (GEN if what == "gen" else TOOL), v
        self.nph = np.array([len(s.phases) for s in shapes])
        self.shape = np.zeros(0, dtype=int)
        self.i = np.zeros(0, dtype=int)
        self.left = np.zeros(0)
        self.group = np.zeros(0, dtype=int)
        self.active = np.zeros(0, dtype=bool)
        self.started = np.zeros(0, dtype=bool)  # admitted to the engines (the driver's max_in_flight)

    def add(self, shape_ids: np.ndarray, group_ids: np.ndarray) -> None:
        keep = self.active  # finished rows are dropped so the arrays stay the size of the work in flight
        self.shape = np.concatenate([self.shape[keep], shape_ids])
        self.i = np.concatenate([self.i[keep], np.zeros(len(shape_ids), dtype=int)])
        self.left = np.concatenate([self.left[keep], self.amount[shape_ids, 0]])
        self.group = np.concatenate([self.group[keep], group_ids])
        self.active = np.concatenate([self.active[keep], np.ones(len(shape_ids), dtype=bool)])
        self.started = np.concatenate([self.started[keep], np.zeros(len(shape_ids), dtype=bool)])

    def admit(self, max_in_flight: int) -> None:
        free = max_in_flight - int((self.active & self.started).sum())
        if free > 0:
            waiting = np.flatnonzero(self.active & ~self.started)[:free]
            self.started[waiting] = True

    def generating(self) -> int:
        return int((self.active & self.started & (self.kind[self.shape, self.i] == GEN)).sum())

    def advance(self, gen_step: float, dt: float) -> np.ndarray:
        """Decode ``gen_step`` tokens per generating row and run tools for ``dt``; the groups of
        the rows that completed (one entry per row)."""
        k = self.kind[self.shape, self.i]
        run = self.active & self.started
        self.left[run & (k == GEN)] -= gen_step
        self.left[run & (k == TOOL)] -= dt
        while True:
            step = run & (self.left <= 0) & (self.i + 1 < self.nph[self.shape])
            if not step.any():
                break
            self.i[step] += 1
            self.left[step] += self.amount[self.shape[step], self.i[step]]
        done = run & (self.left <= 0)
        self.active[done] = False
        return self.group[done]


def simulate(mode: str, a, shapes: list[Shape]) -> dict:
    """Time-stepped (``a.dt``) replay of ``a.steps`` updates; the step time is the mean
    interval between updates after the first (the pipeline's steady state)."""
    rng = np.random.default_rng(a.seed)
    sample = round(a.train_groups / a.keep_share)  # groups sampled per update
    mean_tokens = sum(s.tokens for s in shapes) / len(shapes)
    train_s = (a.train_groups * a.samples * mean_tokens * a.epochs * 6 * a.params
               / (a.gpus * a.peak_flops * a.mfu))
    # AReaL's rule counts accepted groups against the train batch; a group the filters reject
    # frees its slot without being accepted
    bound = StalenessBound(batch=a.train_groups, max_staleness=a.eta)
    pool = Pool(shapes)
    t, version, next_group, round_left, dropped = 0.0, 0, 0, 0, 0
    left: dict[int, int] = {}
    born: dict[int, int] = {}
    kept: list[tuple[int, int]] = []  # finished groups the filters kept: (group, version at start)
    training_until = sync_until = None  # None: not training / not syncing
    updates: list[float] = []
    engine_busy = trainer_busy = 0.0

    def start_groups(n: int) -> None:
        nonlocal next_group, round_left
        groups = np.repeat(np.arange(next_group, next_group + n), a.samples)
        for g in range(next_group, next_group + n):
            left[g], born[g] = a.samples, version
        pool.add(rng.integers(0, len(shapes), size=len(groups)), groups)
        next_group += n
        round_left += n

    if mode != "full":
        start_groups(sample)
    while len(updates) < a.steps:
        if mode == "full":
            n = 0
            while bound.try_admit(version):
                n += 1
            if n:
                start_groups(n)
        syncing = sync_until is not None and t < sync_until
        pool.admit(a.max_in_flight)
        n_gen = pool.generating()
        rate = 0.0 if syncing or not n_gen else min(a.seq_tok_s, a.server_tok_s * a.servers / n_gen)
        engine_busy += a.dt if n_gen and not syncing else 0.0
        for g in pool.advance(rate * a.dt, a.dt).tolist():
            left[g] -= 1
            if left[g] == 0:
                round_left -= 1
                if mode != "full":
                    kept.append((g, born[g]))
                elif rng.random() < a.keep_share:
                    bound.finished()
                    kept.append((g, born[g]))
                else:
                    bound.abandoned()
        if training_until is not None:
            trainer_busy += a.dt
            if t >= training_until:
                training_until = None
                version += 1
                updates.append(t)
                if mode in ("off", "full"):
                    sync_until = t + a.sync_s  # off: then the next round; full: partial rollouts resume
        if sync_until is not None and t >= sync_until:
            sync_until = None
            if mode == "off":
                start_groups(sample)
        if training_until is None and sync_until is None:
            if mode == "full":
                fresh = [(g, v) for g, v in kept if bound.fresh_enough(v, version)]
                dropped += len(kept) - len(fresh)
                kept = fresh
                if len(kept) >= a.train_groups:
                    kept = kept[a.train_groups:]
                    training_until = t + train_s
            elif round_left == 0 and kept:
                kept = []
                if mode == "one_step" and updates:
                    # the round generated during the last update is in: push the new weights first
                    sync_until = t + a.sync_s
                    training_until = sync_until + train_s
                else:
                    training_until = t + train_s
                if mode == "one_step":
                    start_groups(sample)  # round N + 1 generates while round N trains
        t += a.dt
    gaps = [y - x for x, y in zip(updates, updates[1:])] or updates
    return {"mode": mode, "step_s": sum(gaps) / len(gaps), "engine_idle": 1 - engine_busy / t,
            "trainer_idle": 1 - trainer_busy / t, "dropped_groups": dropped, "train_s": train_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=Path, default=DEFAULT_TRAJ)
    p.add_argument("--length-scale", type=float, default=16384 / 256,
                   help="recipe budget / measured budget (the default file's: 256 tokens)")
    p.add_argument("--train-groups", type=int, default=512)
    p.add_argument("--keep-share", type=float, default=0.4, help="share of sampled groups the filters keep")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--servers", type=int, default=2, help="SGLang servers (TP=8 each)")
    p.add_argument("--seq-tok-s", type=float, default=40.0, help="decode tokens/s of one sequence")
    p.add_argument("--server-tok-s", type=float, default=25000.0, help="decode tokens/s of a saturated server")
    p.add_argument("--params", type=float, default=32.8e9)
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--peak-flops", type=float, default=989e12, help="bf16 dense peak per GPU (H100)")
    p.add_argument("--mfu", type=float, default=0.25)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--sync-s", type=float, default=2.5)
    p.add_argument("--max-in-flight", type=int, default=4096, help="trajectories decoding or in tools at once")
    p.add_argument("--eta", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dt", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    shapes = load_shapes(a.trajectories, a.length_scale)
    lens = sorted(s.tokens for s in shapes)
    print(f"== sim_async: {len(shapes)} measured trajectories from {a.trajectories.name}, scaled x{a.length_scale:.1f}: "
          f"model tokens p50 {lens[len(lens) // 2]:.0f}, max {lens[-1]:.0f}")
    print(f"   assumed: {a.servers} servers, {a.seq_tok_s:g} tok/s per sequence, {a.server_tok_s:g} tok/s per "
          f"saturated server; learner 6*{a.params:.3g} FLOPs/token on {a.gpus} GPUs x {a.peak_flops:.3g} at "
          f"MFU {a.mfu}; {a.epochs:g} epoch(s); sync {a.sync_s} s; filters keep {a.keep_share:.0%} of groups; "
          f"<= {a.max_in_flight} trajectories in flight; eta {a.eta}")
    rows = [simulate(m, a, shapes) for m in ("off", "one_step", "full")]
    base = rows[0]["step_s"]
    print("mode     | step s | vs off | engine idle | trainer idle | dropped groups")
    for r in rows:
        print(f"{r['mode']:<8} | {r['step_s']:6.0f} | {base / r['step_s']:5.2f}x | {r['engine_idle']:11.0%} | "
              f"{r['trainer_idle']:12.0%} | {r['dropped_groups']}")
    print(f"== one_step {base / rows[1]['step_s']:.2f}x off, full {base / rows[2]['step_s']:.2f}x off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
