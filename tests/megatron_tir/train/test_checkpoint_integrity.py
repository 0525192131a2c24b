"""Run checkpoint integrity (issue 19), with the real learner (tiny-qwen2, TP=1 x PP=1 on gloo):

* every file kind of a run checkpoint, damaged or truncated in turn: the load falls back to the
  previous checkpoint naming the file (or refuses with ``strict``), and ``tir-ckpt`` refuses it in
  one line (exit 2);
* the manifest's checksums of the big files are computed while writing (nothing re-read);
* a non-finite weight injected after a step is never saved;
* a step without a manifest where the others have one is damaged; a run without any resumes only
  with ``allow_unverified``; skipped steps are renamed ``step_N.damaged``; a dangling ``latest`` is
  reported; a NaN in Adam's state is refused at resume; ``tir-ckpt`` refuses to export a NaN weight;
* a full disk during a save (a small tmpfs, as root): one line with the path and the space it
  needs, the partial directory gone, the previous checkpoint intact, resume works after space is freed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tir.policy.checkpoint import manifest
from megatron_tir.train import checkpoint_integrity as integrity
from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState

sys.path.insert(0, str(Path(__file__).parents[1] / "policy"))
from learner_testing import make_batch, ppo_loss  # noqa: E402

# each file kind of a run checkpoint (relative to step_N)
FILE_KINDS = ["policy/__0_0.distcp", "policy/.metadata", "policy/common.pt", "policy/metadata.json",
              "policy/tir_ckpt.json", "policy/hf/config.json", "trainer_state.json", "rng_rank0.pt"]


@pytest.fixture(scope="module")
def parallel_1x1():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


def _learner():
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig

    return Learner(LearnerConfig(model="tiny-qwen2", lr=1e-3, max_tokens_per_microbatch=64))


def _weights(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner._model.module.named_parameters()}


@pytest.fixture(scope="module")
def saved_run(parallel_1x1, tmp_path_factory):
    """A run directory with step_1 and step_2 (different weights), and the weights of each."""
    run = tmp_path_factory.mktemp("run")
    learner = _learner()
    ck = RunCheckpoints(run, keep_last=2)
    weights = {}
    for step in (1, 2):
        assert not learner.train_step(make_batch(step), ppo_loss).skipped
        ck.save({"policy": learner}, TrainerState(step=step, data_position=4 * step))
        weights[step] = _weights(learner)
    assert any(not torch.equal(weights[1][n], weights[2][n]) for n in weights[1])
    return run, weights, learner


def _damage(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "truncate":
        os.truncate(path, size // 2)
    else:  # overwrite a byte range in the middle with other bytes
        with open(path, "r+b") as f:
            start = size // 3
            f.seek(start)
            old = f.read(min(64, size - start))
            f.seek(start)
            f.write(bytes(b ^ 0x5A for b in old))


@pytest.fixture
def damaged_copy(saved_run, tmp_path):
    run, weights, learner = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, weights, learner


def test_the_manifest_lists_every_file_and_hashes_the_big_ones_while_writing(saved_run, tmp_path, monkeypatch):
    run, _, learner = saved_run
    step = run / "checkpoints" / "step_2"
    files = manifest.read_manifest(step)
    on_disk = sorted(p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()
                     and p.name != manifest.MANIFEST)
    assert sorted(files) == on_disk and set(FILE_KINDS) <= set(files)
    for rel, entry in files.items():
        assert (entry["size"], int(entry["crc32"], 16)) == manifest.file_crc32(step / rel), rel
    reread: list[str] = []
    real = manifest.file_crc32
    monkeypatch.setattr(manifest, "file_crc32", lambda p: reread.append(Path(p).name) or real(p))
    RunCheckpoints(tmp_path, keep_last=1).save({"policy": learner}, TrainerState(step=3))
    assert reread and not [name for name in reread if name.endswith(".distcp")], reread


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_damaged_file_makes_resume_fall_back_naming_it(damaged_copy, kind, how, caplog):
    run, weights, _ = damaged_copy
    _damage(run / "checkpoints" / "step_2" / kind, how)
    fresh = _learner()
    with caplog.at_level(logging.WARNING):
        state = RunCheckpoints(run, keep_last=2).load({"policy": fresh})
    assert state.step == 1 and state.data_position == 4
    got = _weights(fresh)
    assert all(torch.equal(got[n], weights[1][n]) for n in got)
    assert any(f"step_2: {kind} is" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_strict_resume_refuses_a_damaged_checkpoint_in_one_line(damaged_copy, kind):
    run, _, _ = damaged_copy
    _damage(run / "checkpoints" / "step_2" / kind, "corrupt")
    with pytest.raises(ValueError) as info:
        RunCheckpoints(run, keep_last=2).load({"policy": _learner()}, strict=True)
    text = str(info.value)
    assert f"step_2: {kind} is damaged" in text and "strict_resume" in text and "\n" not in text


@pytest.mark.parametrize("kind", [k for k in FILE_KINDS if k.startswith("policy/")])
def test_tir_ckpt_refuses_a_damaged_checkpoint_in_one_line(damaged_copy, kind, tmp_path, capsys):
    from checkpoints_tools.cli import main

    run, _, _ = damaged_copy
    _damage(run / "checkpoints" / "step_2" / kind, "truncate")
    code = main(["megatron-to-hf", "--ckpt", str(run / "checkpoints" / "step_2" / "policy"),
                 "--out", str(tmp_path / "hf")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("tir-ckpt: error: checkpoint ") and f"{kind.removeprefix('policy/')} is truncated" \
        in lines[0], lines[0]
    assert not (tmp_path / "hf").exists()


def test_an_intact_checkpoint_passes_tir_ckpt(saved_run, tmp_path):
    run, _, _ = saved_run
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "checkpoints_tools.cli", "megatron-to-hf", "--ckpt",
                           str(run / "checkpoints" / "step_2" / "policy"), "--out", str(tmp_path / "hf")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf" / "config.json").is_file()


def test_the_shallow_pick_skips_a_truncated_newest_checkpoint(damaged_copy, caplog):
    run, _, _ = damaged_copy
    _damage(run / "checkpoints" / "step_2" / "policy/__0_0.distcp", "truncate")
    with caplog.at_level(logging.WARNING):
        assert integrity.pick(run / "checkpoints", strict=False, deep=False).name == "step_1"
    assert "step_2: policy/__0_0.distcp is truncated" in caplog.text
    with pytest.raises(ValueError, match="step_2: policy/__0_0.distcp is truncated.*strict_resume"):
        integrity.pick(run / "checkpoints", strict=True, deep=False)


def test_a_non_finite_weight_after_a_step_is_never_saved(parallel_1x1, tmp_path, caplog):
    learner = _learner()
    ck = RunCheckpoints(tmp_path, keep_last=3)
    result = learner.train_step(make_batch(1), ppo_loss)
    assert result.weights_finite and learner.weights_finite()
    ck.save({"policy": learner}, TrainerState(step=1))
    with torch.no_grad():
        next(learner._model.module.parameters()).view(-1)[3] = float("nan")  # injected after the step
    assert not learner.weights_finite()
    with caplog.at_level(logging.ERROR):
        assert ck.save({"policy": learner}, TrainerState(step=2)) is None
    assert "step 2: the weights of policy are not finite: no checkpoint saved (the newest stays step_1)" in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]
    # the next step ends with non-finite weights (its gradients are too, so it is skipped): the run stops
    from megatron_tir.finite import NonFiniteTraining

    with pytest.raises(NonFiniteTraining, match="non-finite weights after optimizer step 1 .*skipped"):
        learner.train_step(make_batch(2), ppo_loss)
    assert ck.latest().name == "step_1"


def test_consecutive_non_finite_steps_stop_the_run_in_one_line():
    from megatron_tir.finite import NonFiniteTraining
    from megatron_tir.train.algorithm import StepStats
    from megatron_tir.train.loop import _check_finite_steps

    bad = StepStats(skipped=1, nonfinite_weights=0)
    n = _check_finite_steps(4, bad, 0, 3)
    n = _check_finite_steps(5, StepStats(skipped=0, nonfinite_weights=1), n, 3)
    assert n == 2 and _check_finite_steps(6, StepStats(skipped=0), n, 3) == 0  # a good step resets
    with pytest.raises(NonFiniteTraining) as info:
        _check_finite_steps(9, bad, 2, 3)
    assert "stopped at step 9: 3 consecutive steps with non-finite gradients" in str(info.value)


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("this container cannot mount a tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_during_a_save_is_one_line_and_leaves_the_previous_checkpoint(parallel_1x1, small_tmpfs):
    learner = _learner()
    learner.train_step(make_batch(1), ppo_loss)
    ck = RunCheckpoints(small_tmpfs, keep_last=2)
    first = ck.save({"policy": learner}, TrainerState(step=1, data_position=4))
    size = integrity.tree_bytes(first)
    # room for one checkpoint and a half: the second save runs out mid-write
    subprocess.run(["mount", "-o", f"remount,size={int(size * 1.5) + 65536}", str(small_tmpfs)], check=True)
    learner.train_step(make_batch(2), ppo_loss)
    with pytest.raises(integrity.DiskFullError) as info:
        ck.save({"policy": learner}, TrainerState(step=2, data_position=8))
    text = str(info.value)
    assert "\n" not in text and "no space left on device for checkpoint" in text
    assert str(small_tmpfs / "checkpoints" / "step_2") in text and "(the size of step_1)" in text
    assert sorted(p.name for p in (small_tmpfs / "checkpoints").iterdir()) == ["latest", "step_1"]
    assert integrity.problem(first, deep=True) is None
    # space freed: the save and a resume work
    subprocess.run(["mount", "-o", "remount,size=256m", str(small_tmpfs)], check=True)
    assert ck.save({"policy": learner}, TrainerState(step=2, data_position=8)).name == "step_2"
    expected = _weights(learner)
    fresh = _learner()
    assert ck.load({"policy": fresh}).step == 2
    assert all(torch.equal(p, expected[n]) for n, p in _weights(fresh).items())


def _two_rank_resume(rank: int, world: int, port: int, run: str, out: str) -> None:
    """Rank 0 saves the files of a duck-typed learner; both ranks load (sharing the hashing)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)

    def save(learner, directory):
        if rank == 0:
            Path(directory).mkdir(parents=True)
            for i in range(4):
                torch.save({"w": learner["w"] + i}, Path(directory) / f"part{i}.pt")
        torch.distributed.barrier()

    def load(learner, directory):
        learner["w"] = torch.load(Path(directory) / "part0.pt")["w"]

    ck = RunCheckpoints(run, keep_last=2, save_learner=save, load_learner=load)
    for step in (1, 2):
        ck.save({"policy": {"w": torch.full((8,), float(step))}}, TrainerState(step=step))
    torch.distributed.barrier()
    if rank == 0:  # damage the file only rank 1 hashes (files sorted: policy/part0..3, rng_rank*, state)
        order = sorted(manifest.read_manifest(Path(run) / "checkpoints" / "step_2"))
        victim = order[1]
        _damage(Path(run) / "checkpoints" / "step_2" / victim, "corrupt")
        Path(out, "victim").write_text(victim)
    torch.distributed.barrier()
    learner = {}
    state = ck.load({"policy": learner})
    Path(out, f"rank{rank}").write_text(json.dumps({"step": state.step, "w": learner["w"].tolist()}))
    torch.distributed.destroy_process_group()


def test_ranks_share_the_verification_and_fall_back_together(tmp_path):
    from megatron_tir.ports import free_port

    out = tmp_path / "out"
    out.mkdir()
    torch.multiprocessing.spawn(_two_rank_resume, args=(2, free_port(), str(tmp_path / "run"), str(out)), nprocs=2)
    assert (out / "victim").read_text() == "policy/part1.pt"  # index 1: hashed by rank 1 only
    for rank in (0, 1):
        got = json.loads((out / f"rank{rank}").read_text())
        assert got == {"step": 1, "w": [1.0] * 8}


# --------------------------------------------------------------------- issue 37: unverified / non-finite

def _inner_optimizers(learner):
    from megatron_tir.policy.checkpoint.learner_io import _optimizers

    return [getattr(o, "optimizer", o) for o in _optimizers(learner.optimizer)]


def test_a_step_that_lost_its_manifest_is_damaged_not_preferred(damaged_copy, caplog):
    run, weights, _ = damaged_copy
    step2 = run / "checkpoints" / "step_2"
    (step2 / manifest.MANIFEST).unlink()
    _damage(step2 / "policy/__0_0.distcp", "corrupt")  # random bytes nothing can detect without the manifest
    with caplog.at_level(logging.WARNING):
        assert integrity.pick(run / "checkpoints", strict=False, deep=False).name == "step_1"  # the CLI's pick
        fresh = _learner()
        state = RunCheckpoints(run, keep_last=2).load({"policy": fresh})
    assert state.step == 1
    assert all(torch.equal(p, weights[1][n]) for n, p in _weights(fresh).items())
    assert "step_2: manifest.json is missing" in caplog.text, caplog.text
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step_1", "step_2.damaged"], names
    os.rename(run / "checkpoints" / "step_2.damaged", step2)
    with pytest.raises(ValueError, match="step_2: manifest.json is missing.*strict_resume"):
        integrity.pick(run / "checkpoints", strict=True, deep=False)


def test_a_run_without_any_manifest_resumes_only_when_allowed(damaged_copy, caplog):
    run, weights, _ = damaged_copy
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step}" / manifest.MANIFEST).unlink()
    with pytest.raises(ValueError, match="has a manifest.json.*trainer.checkpoint.allow_unverified=true") as info:
        RunCheckpoints(run, keep_last=2).load({"policy": _learner()})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="allow_unverified"):
        integrity.pick(run / "checkpoints", strict=False, deep=False)
    fresh = _learner()
    with caplog.at_level(logging.WARNING):
        assert RunCheckpoints(run, keep_last=2).load({"policy": fresh}, allow_unverified=True).step == 2
    assert "without verification" in caplog.text
    assert all(torch.equal(p, weights[2][n]) for n, p in _weights(fresh).items())


def test_the_rerun_of_a_skipped_step_keeps_the_damaged_one(damaged_copy):
    run, _, _ = damaged_copy
    _damage(run / "checkpoints" / "step_2" / "trainer_state.json", "corrupt")
    fresh = _learner()
    ck = RunCheckpoints(run, keep_last=1)
    assert ck.load({"policy": fresh}).step == 1
    fresh.train_step(make_batch(2), ppo_loss)
    assert ck.save({"policy": fresh}, TrainerState(step=2, data_position=8)).name == "step_2"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step_2", "step_2.damaged"], names  # keep_last=1 prunes step_1, not the evidence
    assert integrity.problem(run / "checkpoints" / "step_2", deep=True) is None


def test_a_dangling_latest_is_reported(damaged_copy, caplog):
    run, _, _ = damaged_copy
    (run / "checkpoints" / "latest").write_text("step_7")
    with caplog.at_level(logging.WARNING):
        assert RunCheckpoints(run, keep_last=2).load({"policy": _learner()}).step == 2
    assert "latest names step_7, which does not exist; the newest complete step is step_2" in caplog.text


def test_nan_in_adam_state_is_refused_at_resume(parallel_1x1, tmp_path, caplog):
    learner = _learner()
    ck = RunCheckpoints(tmp_path, keep_last=3)
    learner.train_step(make_batch(1), ppo_loss)
    ck.save({"policy": learner}, TrainerState(step=1, data_position=4))
    expected = _weights(learner)
    learner.train_step(make_batch(2), ppo_loss)
    inner = _inner_optimizers(learner)[0]
    state = next(iter(inner.state.values()))
    state["exp_avg"].view(-1)[0] = float("nan")  # as a trainer that saved it would write it: manifest consistent
    assert learner.weights_finite()
    ck.save({"policy": learner}, TrainerState(step=2, data_position=8))
    assert integrity.problem(tmp_path / "checkpoints" / "step_2", deep=True) is None
    fresh = _learner()
    with caplog.at_level(logging.WARNING):
        assert ck.load({"policy": fresh}).step == 1
    assert "step_2: policy holds non-finite values (optimizer state exp_avg of" in caplog.text, caplog.text
    assert all(torch.equal(p, expected[n]) for n, p in _weights(fresh).items())
    assert all(torch.isfinite(t).all() for o in _inner_optimizers(fresh) for s in o.state.values()
               for t in s.values() if torch.is_tensor(t))
    assert (tmp_path / "checkpoints" / "step_2.damaged").is_dir()
    with pytest.raises(ValueError, match="optimizer state exp_avg .*strict_resume"):
        os.rename(tmp_path / "checkpoints" / "step_2.damaged", tmp_path / "checkpoints" / "step_2")
        ck.load({"policy": _learner()}, strict=True)


def test_finite_gradients_that_make_the_weights_non_finite_stop_the_step(parallel_1x1):
    from megatron_tir.finite import NonFiniteTraining

    learner = _learner()
    learner.train_step(make_batch(1), ppo_loss)
    inner = _inner_optimizers(learner)[0]
    next(iter(inner.state.values()))["exp_avg_sq"].view(-1)[0] = -1.0  # sqrt(<0): the update is NaN
    with pytest.raises(NonFiniteTraining, match="non-finite weights after optimizer step 2 .*finite gradients"):
        learner.train_step(make_batch(2), ppo_loss)


def test_tir_ckpt_refuses_to_export_a_nan_weight_naming_it(parallel_1x1, tmp_path, capsys):
    from checkpoints_tools.cli import main
    from megatron_tir.policy.checkpoint.learner_io import save_learner

    learner = _learner()
    learner.train_step(make_batch(1), ppo_loss)
    with torch.no_grad():
        dict(learner._model.module.named_parameters())["decoder.layers.1.mlp.linear_fc2.weight"].view(-1)[5] = \
            float("inf")
    save_learner(learner, tmp_path / "ckpt")  # (a run checkpoint would refuse it: a stand-in for one that has it)
    code = main(["megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "model.layers.1.mlp.down_proj.weight holds non-finite values" in lines[0], lines[0]
    assert not (tmp_path / "hf").exists()


def test_tir_ckpt_refuses_a_run_step_that_lost_its_manifest(damaged_copy, tmp_path, capsys):
    from checkpoints_tools.cli import main

    run, _, _ = damaged_copy
    (run / "checkpoints" / "step_2" / manifest.MANIFEST).unlink()
    code = main(["megatron-to-hf", "--ckpt", str(run / "checkpoints" / "step_2" / "policy"), "--out", str(tmp_path / "hf")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "step_2: manifest.json is missing" in lines[0], lines
    assert not (tmp_path / "hf").exists()
