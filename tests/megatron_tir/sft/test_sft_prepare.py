"""``megatron-tir sft``'s checks before anything slow (``megatron_tir.sft.cli.prepare``): the run directory of a
new run (``--out``) and of a resumed one (``--resume``), each refusal one line with its own words; the
rows-per-step layout against ``WORLD_SIZE`` (what torchrun sets) before the data is read or a process group
exists."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_tir.sft.cli import RunFinished, prepare
from megatron_tir.sft.config import tiny_cpu_sft, to_dict


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"recipe": "tiny-cpu-sft", "resume": None, "out": None, "model": None, "data": [],
                                 "overrides": [], **kw})


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text("")  # prepare checks that the file is there; its rows are read later (load_data)
    return str(path)


def _run(tmp_path, *, steps_done: int | None, config: dict | None = None):
    """A run directory with the tiny sft recipe's config and, when ``steps_done``, a checkpoint at that step."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(tiny_cpu_sft()) if config is None else config))
    if steps_done is not None:
        step = run / "checkpoints" / f"step_{steps_done}"
        step.mkdir(parents=True)
        (step / "trainer_state.json").write_text(json.dumps({"step": steps_done, "data_position": 4 * steps_done}))
    return run


def test_a_new_run_needs_out_and_a_resume_refuses_it(tmp_path, data):
    with pytest.raises(ValueError, match=r"^sft needs --out RUN_DIR \(or --resume RUN_DIR\)$"):
        prepare(_args(data=[data]))
    with pytest.raises(ValueError, match=r"^--out is only used for a new run \(a resumed run stays in its directory\)$"):
        prepare(_args(recipe=None, resume=str(tmp_path), out=str(tmp_path / "x"), data=[data]))


def test_out_refuses_a_run_with_checkpoints_and_foreign_directories_and_reuses_one_without(tmp_path, data):
    run = _run(tmp_path, steps_done=2)
    with pytest.raises(ValueError, match=rf"^--out {run} holds a run with checkpoints \(continue it with --resume"):
        prepare(_args(out=str(run), data=[data]))
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("")
    with pytest.raises(ValueError, match=r"is not a run directory \(it holds thesis\.tex\)$"):
        prepare(_args(out=str(home), data=[data]))
    started = tmp_path / "started"  # a start that failed before its first checkpoint: reused, started fresh
    started.mkdir()
    (started / "train.log").write_text("")
    (started / "config.json").write_text("{}")
    cfg, run_dir, state = prepare(_args(out=str(started), data=[data], overrides=["steps=5"]))
    assert run_dir == started and state.step == 0 and cfg.steps == 5 and state.config["steps"] == 5
    assert cfg.data == (data,)


def test_resume_refusals(tmp_path, data):
    with pytest.raises(ValueError, match=rf"^--resume {tmp_path}: no config\.json \(not a run directory\)$"):
        prepare(_args(recipe=None, resume=str(tmp_path)))
    run = _run(tmp_path, steps_done=None, config={"stepz": 3})
    with pytest.raises(ValueError, match=rf"^{run / 'config.json'}: not an sft run's config \(.*stepz"):
        prepare(_args(recipe=None, resume=str(run)))
    (run / "config.json").write_text(json.dumps(to_dict(tiny_cpu_sft())))
    with pytest.raises(ValueError) as err:  # sft's words (train's adds a hint about --recipe NAME --out)
        prepare(_args(recipe=None, resume=str(run)))
    assert str(err.value) == f"--resume {run}: the run has no checkpoint yet"


def test_resume_continues_from_the_latest_checkpoint_or_says_the_run_is_done(tmp_path, data):
    run = _run(tmp_path, steps_done=3)  # tiny-cpu-sft: 3 steps
    with pytest.raises(RunFinished, match=r"has done all its 3 steps: nothing to do \(continue it with --set steps=N"):
        prepare(_args(recipe=None, resume=str(run), data=[data]))
    cfg, run_dir, state = prepare(_args(recipe=None, resume=str(run), data=[data], overrides=["steps=5"]))
    assert run_dir == run and (state.step, state.data_position) == (3, 12) and cfg.steps == 5
    with pytest.raises(ValueError, match=r"^steps: 'x' is not an int"):  # the overrides' own words
        prepare(_args(recipe=None, resume=str(run), data=[data], overrides=["steps=x"]))


def test_the_layout_is_checked_against_world_size_before_the_data_is_read(tmp_path, data, monkeypatch):
    """Rows per step against torchrun's WORLD_SIZE (data-parallel replicas = WORLD_SIZE / (tp x pp)); the data
    file is empty, so only the layout can refuse here."""
    args = _args(out=str(tmp_path / "r"), data=[data], overrides=["rows_per_step=2"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"^rows_per_step=2 is fewer than the 4 data-parallel replicas$"):
        prepare(args)
    args.overrides += ["learner.tp=2"]  # 2 replicas of TP 2: one row each
    cfg, _, _ = prepare(args)
    assert (cfg.learner.tp, cfg.rows_per_step) == (2, 2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"^WORLD_SIZE=3 is not a multiple of learner.tp x learner.pp = 2$"):
        prepare(args)
    monkeypatch.delenv("WORLD_SIZE")  # one process: one replica
    assert prepare(_args(out=str(tmp_path / "r"), data=[data], overrides=["rows_per_step=1"]))[0].rows_per_step == 1
    assert not (tmp_path / "r").exists()
