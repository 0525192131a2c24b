"""``trainer.async=one_step`` end to end on tiny-cpu: step N + 1's rollouts run while step N trains
and the sync waits for them, so every token trained at step N >= 2 was sampled by the weights of
step N - 2's update (version N - 2), one version behind the learner's (N - 1 updates done);
step 1 is on-policy (nothing to overlap with yet). ``off`` is on-policy at every step.

``full`` (eta = 1): no trained token is more than one version behind, and a run killed mid-way and
resumed trains no prompt twice and loses none (by prompt position, from the rollout dumps). The
interruptions themselves are forced in test_group_producer.py (a real engine, syncs mid-generation)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time

import pytest
from test_train_e2e import ENV, PY, ROOT, check_ok, cli, metrics, state

from megatron_tir.observe.dumps import dump_path, read_dump


@pytest.mark.parametrize("mode", ["one_step", "off"])
def test_one_step_trains_every_token_exactly_one_version_behind(tmp_path, mode):
    run = tmp_path / "run"
    check_ok(cli("train", "--recipe", "tiny-cpu", "--set", "trainer.steps=3", "--set", f"trainer.async={mode}",
                 "--set", "data.eval_size=0", "--set", "trainer.checkpoint.every=0", "--out", str(run)))
    m = metrics(run)
    assert sorted(m) == [1, 2, 3]
    for step in (1, 2, 3):
        r = m[step]
        assert r["train/optimizer_steps"] == 1 and r["train/skipped_steps"] == 0  # every step updates and syncs
        lag = 0 if step == 1 or mode == "off" else 1
        sampled_by = step - 1 - lag  # the learner has done step - 1 updates when it trains step's rows
        assert r["train/weight_version_min"] == r["train/weight_version_max"] == sampled_by, (step, r)
        assert r["train/weight_version_lag_mean"] == r["train/weight_version_lag_max"] == lag
        assert r[f"train/weight_version_lag_share_{lag}"] == 1.0  # the staleness histogram: one bin
        waited = r["time/rollout_wait"] + r.get("time/drain", 0.0)
        assert 0 < r["train/trainer_idle_share"] <= 1
        assert r["train/trainer_idle_share"] == pytest.approx(min(1.0, waited / r["time/step"]))
        assert ("time/drain" in r) == (mode == "one_step" and step < 3)  # the last step runs nothing ahead
        if mode == "one_step":  # the decoupled objective's metrics (the weight is the engine's vs the learner's)
            assert math.isfinite(r["offpolicy/kl"]) and r["offpolicy/weight_max"] > 0
        else:
            assert not any(k.startswith("offpolicy/") for k in r)
    assert state(run)["data_position"] == 6  # the prompts of a step never trained are not counted consumed
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["trainer"]["asynchrony"]["mode"] == mode


def _full(run, *extra):
    return ("--set", "trainer.async=full", "--set", "trainer.async.max_staleness=1", "--set", "data.eval_size=0",
            "--set", "trainer.log.dump_every=1", "--out", str(run), *extra)


def _check_lag(m: dict, steps) -> None:
    for step in steps:
        r = m[step]
        assert r["train/optimizer_steps"] == 1, (step, r)
        assert r["train/weight_version_lag_max"] <= 1, (step, r)  # versions restart on a resume; the lag does not
        assert r["filter/groups_stale"] == 0 and "rollout/interrupted_share" in r
        assert 0 <= r["rollout/engine_idle_share"] <= 1 and 0 <= r["train/trainer_idle_share"] <= 1


@pytest.mark.slow  # ~1.5 min: a run killed after its second checkpoint, then resumed
def test_full_killed_and_resumed_trains_no_prompt_twice_and_loses_none(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([PY, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu", "--set", "trainer.steps=40",
                             "--set", "trainer.checkpoint.every=1", *_full(run)], env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "latest").exists() or state(run)["step"] < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)  # mid-run: groups in flight, maybe some finished and not yet taken
        proc.wait(60)
    finally:
        proc.kill()
    killed_at = state(run)["step"]
    p = cli("train", "--resume", str(run), "--set", f"trainer.steps={killed_at + 2}")
    check_ok(p)
    m = metrics(run)
    assert sorted(m) == list(range(1, killed_at + 3))
    _check_lag(m, m)
    final = state(run)
    consumed, trained = [], []
    for step in m:  # a resumed step rewrites the dump the killed run may have left for it
        rows = [r for r in read_dump(dump_path(run, step)) if r["split"] == "train"]
        consumed += sorted({r["group_id"] for r in rows})  # each group is reported at the step that consumed it
        trained += sorted({r["group_id"] for r in rows if r["update"]["in_loss"]})
    assert len(trained) == len(set(trained)) == 2 * len(m)  # two groups a step, none trained twice
    assert len(consumed) == len(set(consumed))  # none consumed twice
    # none lost: every position before the checkpoint's is consumed, and past it exactly those it lists
    assert set(consumed) == set(range(final["data_position"])) | set(final["data_consumed_ahead"])
    assert json.loads((run / "config.json").read_text())["trainer"]["asynchrony"]["max_staleness"] == 1


def test_full_with_held_out_evaluations_runs_and_evaluates_every_step(tmp_path):
    """Evaluations in ``full`` hold the producer's admission while they run (GroupProducer.hold,
    tested in test_group_producer.py) and release it: every step still trains within the bound."""
    run = tmp_path / "run"
    check_ok(cli("train", "--recipe", "tiny-cpu", "--set", "trainer.steps=2", "--set", "trainer.checkpoint.every=0",
                 "--set", "trainer.async=full", "--set", "trainer.async.max_staleness=1", "--set", "data.eval_size=2",
                 "--set", "trainer.eval_every=1", "--out", str(run)))
    m = metrics(run)
    assert sorted(m) == [0, 1, 2]  # step 0: the evaluation before training
    _check_lag(m, [1, 2])
    for step in m:
        assert "eval/reward" in m[step] and m[step]["time/eval"] > 0, m[step]
