"""``megatron-tir sft`` checks its layout with train's preflight (``megatron_tir.train.preflight.check_layout``):
learner.tp / pp that do not fit the model are one line naming the setting, exit 2, from the model's config files
alone -- before the data is read, before any process group or learner; a non-finite stop is one line from rank 0,
exit 1 (``megatron_tir.observe.ranks.stopped_on_every_rank``); ``--out`` reuses a directory holding only what an
sft run writes, the trackers' files included (train's list, less its rollout dumps)."""

from __future__ import annotations

import types

import pytest

import megatron_tir.sft.loop as sft_loop
from megatron_tir.cli import main
from megatron_tir.observe import ranks


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text("")  # never read here: every refusal below comes before load_data
    return str(path)


@pytest.fixture
def started(monkeypatch):
    """What run_sft was called with (reading the data, the process group, the learner all happen inside it)."""
    calls: list = []
    monkeypatch.setattr(sft_loop, "run_sft", lambda *a, **k: calls.append(a) or a[2])  # the state: done
    return calls


# tiny-qwen2 (megatron_tir.named_models): 4 attention heads, 2 key/value heads, 2 layers
@pytest.mark.parametrize("setting,world,message", [
    ("learner.tp=3", "3", "learner.tp=3 learner.pp=1 do not fit model tiny-qwen2: tp=3 does not divide the attention "
                          "heads (4)"),
    ("learner.tp=4", "4", "learner.tp=4 learner.pp=1 do not fit model tiny-qwen2: tp=4 does not divide the key/value "
                          "heads (2)"),
    ("learner.pp=3", "3", "learner.tp=1 learner.pp=3 do not fit model tiny-qwen2: pp=3 does not divide the number of "
                          "layers (2)"),
    ("learner.tp=2", "3", "WORLD_SIZE=3 is not a multiple of learner.tp x learner.pp = 2"),
])
def test_a_layout_that_does_not_fit_is_one_line_exit_2_before_anything_starts(tmp_path, data, started, capsys,
                                                                              monkeypatch, setting, world, message):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "run"
    code = main(["sft", "--recipe", "tiny-cpu-sft", "--data", data, "--set", setting, "--out", str(out)])
    assert (code, capsys.readouterr().err.splitlines()) == (2, [f"megatron-tir: error: {message}"])
    assert started == [] and not out.exists()


def test_a_layout_that_fits_starts(tmp_path, data, started, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    assert main(["sft", "--recipe", "tiny-cpu-sft", "--data", data, "--set", "learner.tp=2", "--set", "learner.pp=2",
                 "--out", str(tmp_path / "run")]) == 0
    assert len(started) == 1 and (started[0][0].learner.tp, started[0][0].learner.pp) == (2, 2)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_non_finite_stop_is_rank_0s_line_exit_1(tmp_path, data, capsys, monkeypatch, rank):
    """Every rank stops alike; rank 0 says it at once, another rank keeps quiet while it waits for torchrun to end
    it (as for bad input) and says it only if it is still running after the wait."""
    from megatron_tir.finite import NonFiniteTraining

    def stopped(*_a, **_k):
        raise NonFiniteTraining("non-finite weights after optimizer step 2 (grad norm nan, skipped): the run stops")

    waits: list = []
    monkeypatch.setattr(sft_loop, "run_sft", stopped)
    monkeypatch.setattr(ranks, "time", types.SimpleNamespace(sleep=lambda s: waits.append((s, capsys.readouterr()))))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = main(["sft", "--recipe", "tiny-cpu-sft", "--data", data, "--out", str(tmp_path / "run"),
                 "--set", "rows_per_step=2"])
    line = "megatron-tir: error: non-finite weights after optimizer step 2 (grad norm nan, skipped): the run stops"
    assert (code, capsys.readouterr().err.splitlines()) == (1, [line])
    if rank == "0":
        assert waits == []
    else:
        [(seconds, said)] = waits
        assert seconds == ranks.RANK0_FIRST_S and (said.out, said.err) == ("", "")


def test_out_reuses_a_directory_of_a_start_that_opened_trackers(tmp_path, data, started, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "run"  # a start that opened W&B and MLflow (offline) and stopped before its first checkpoint
    for d in ("wandb", "mlruns", "tb"):
        (run / d).mkdir(parents=True)
    for f in ("wandb_run_id", "mlflow_run_id", "metrics.jsonl", "train.log", "config.json"):
        (run / f).write_text("")
    assert main(["sft", "--recipe", "tiny-cpu-sft", "--data", data, "--out", str(run)]) == 0 and len(started) == 1


def test_sft_and_train_allow_the_same_run_entries_but_train_s_rollout_dumps():
    from megatron_tir.observe.dumps import DUMP_DIR
    from megatron_tir.sft import cli as sft_cli
    from megatron_tir.train import cli as train_cli

    assert set(sft_cli.RUN_ENTRIES) == set(train_cli.RUN_ENTRIES) - {DUMP_DIR}
