"""Plots: every figure has a title and axis labels, integer steps, the budget switch marked; two runs overlay."""

from __future__ import annotations

import json

import pytest

from megatron_tir.cli import main
from megatron_tir.observe.plots import build_figures, moving_average


def _run(path, name_offset: float, switch_at: int | None = None):
    path.mkdir()
    rows = []
    for step in range(0, 6):
        turns = 10 if switch_at is not None and step >= switch_at else 5
        row = {"step": step, "eval/reward": 0.1 + name_offset + 0.01 * step, "budget/max_turns": turns,
               "budget/max_response_tokens": 1000 * turns}
        if step:
            row |= {"rollout/reward": 0.2 + name_offset + 0.02 * step, "train/loss": 0.5 - 0.01 * step,
                    "train/grad_norm": 1.0 + step, "rollout/logprob_turn_0": -0.5, "rollout/logprob_turn_1": -0.9,
                    "rollout/status_completed": 3.0, "rollout/status_void": 1.0, "time/rollout": 2.0,
                    "rollout/mean_response_tokens": 100.0 + step}
        rows.append(row)
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_every_figure_has_a_title_labels_and_integer_steps(tmp_path):
    from matplotlib.ticker import MaxNLocator

    figures = build_figures([_run(tmp_path / "a", 0.0, switch_at=3)], smooth=2)
    assert {"reward.png", "loss.png", "grad_norm.png", "logprob_per_turn.png", "status.png",
            "dashboard.png"} <= set(figures)
    for name, fig in figures.items():
        axes = [ax for ax in fig.axes if ax.axison]
        assert axes, name
        for ax in axes:
            assert ax.get_title() and ax.get_xlabel() == "step" and ax.get_ylabel(), (name, ax.get_title())
            assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
    reward = figures["reward.png"].axes[0]
    labels = reward.get_legend_handles_labels()[1]
    assert "train (2-step mean)" in labels and "held-out (2-step mean)" in labels and "budget switch" in labels
    assert [line.get_xdata()[0] for line in reward.get_lines() if line.get_linestyle() == ":"] == [3]
    assert figures["loss.png"].axes[0] is not figures["grad_norm.png"].axes[0]  # loss and grad norm apart
    turns = figures["logprob_per_turn.png"].axes[0].get_legend_handles_labels()[1]
    assert turns[:2] == ["turn 0 (2-step mean)", "turn 1 (2-step mean)"]


def test_two_runs_overlay(tmp_path, capsys):
    a, b = _run(tmp_path / "naive", 0.0), _run(tmp_path / "simpletir", 0.3)
    figures = build_figures([a, b])
    labels = figures["reward.png"].axes[0].get_legend_handles_labels()[1]
    assert {"naive: train", "naive: held-out", "simpletir: train", "simpletir: held-out"} <= set(labels)
    assert main(["plot", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "dashboard.png").stat().st_size > 10_000 and "reward.png" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "missing")]) == 2


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    with pytest.raises(ValueError):
        build_figures([], smooth=-1)
