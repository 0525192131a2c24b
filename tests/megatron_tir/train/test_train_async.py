"""``trainer.async=one_step`` end to end on tiny-cpu: step N + 1's rollouts run while step N trains
and the sync waits for them, so every token trained at step N >= 2 was sampled by the weights of
step N - 2's update (version N - 2), one version behind the learner's (N - 1 updates done);
step 1 is on-policy (nothing to overlap with yet). ``off`` is on-policy at every step."""

from __future__ import annotations

import json
import math

import pytest
from test_train_e2e import check_ok, cli, metrics, state


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
