"""Curves a person reads: one PNG per concern, a dashboard of the main panels, several runs overlaid.

Every axis has a title, a y-label with its unit and integer steps on x; one metric per axis
(loss and grad norm apart); train (solid) and held-out (dashed) together where both exist;
the step where the turn schedule switched the budget is marked on every panel; ``smooth=N``
adds an N-step moving average (the raw curve stays, lighter). With several runs each run has
its colour and the legend names it (e.g. the Table-2 modes side by side).

:func:`build_figures` returns the matplotlib figures (tests read their titles and labels);
:func:`plot_runs` writes them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_tir.observe.metrics_file import read_metrics

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
STATUSES = ("completed", "max_turns", "truncated", "void", "tool_failed", "aborted")
GROUP_RULES = ("kept", "zero_std", "accuracy", "no_counted_rows")
PHASES = ("rollout", "logprobs", "train", "sync", "eval", "checkpoint")


class Run:
    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.name = Path(run_dir).name or str(run_dir)
        self.rows = read_metrics(run_dir)
        if not self.rows:
            raise ValueError(f"{run_dir}: metrics.jsonl is empty")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in self.rows if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [float(p[1]) for p in pts]

    def keys(self, pattern: str) -> list[str]:
        rx = re.compile(pattern)
        return sorted({k for r in self.rows for k in r if rx.fullmatch(k)}, key=_natural)

    def budget_switches(self) -> list[int]:
        steps, turns = self.series("budget/max_turns")
        _, tokens = self.series("budget/max_response_tokens")
        pairs = list(zip(turns, tokens)) if len(tokens) == len(turns) else [(t, 0) for t in turns]
        return [s for i, s in enumerate(steps) if i and pairs[i] != pairs[i - 1]]


def _natural(key: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", key)]


def moving_average(values: Sequence[float], n: int) -> list[float]:
    """Trailing mean over the last ``n`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def _style_axis(ax, title: str, ylabel: str, runs: Sequence[Run]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    steps = [r["step"] for run in runs for r in run.rows]
    lo, hi = min(steps), max(steps)
    ax.set_xlim(lo - 0.5, hi + 0.5)  # every panel spans the run's steps, a single step included
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    try:
        ax.ticklabel_format(axis="y", useOffset=False)  # plain values, no "1e-6 + offset" corner label
    except AttributeError:  # a non-scalar formatter
        pass
    ax.grid(alpha=0.3)
    marked = False
    for run in runs:
        for s in run.budget_switches():
            ax.axvline(s, color="grey", linestyle=":", linewidth=1, label=None if marked else "budget switch")
            marked = True
    handles, labels = ax.get_legend_handles_labels()
    if len(runs) > 1 and handles:  # one entry per run (its colour) and one per series (its line style)
        handles, labels = _run_and_series_legend(handles, labels)
    if handles:
        ax.legend(handles, labels, fontsize=8, framealpha=0.7, ncol=2 if len(handles) > 4 else 1)


def _run_and_series_legend(handles, labels) -> tuple[list, list[str]]:
    """Entries ``run: series`` of every run x series pair -> one per run plus one per series."""
    from matplotlib.lines import Line2D

    runs, series = {}, {}
    for h, label in zip(handles, labels):
        run, sep, name = label.partition(": ")
        if not sep:  # a marker of its own (the budget switch)
            series.setdefault(label, h)
            continue
        runs.setdefault(run, Line2D([], [], color=h.get_color(), linewidth=2))
        series.setdefault(name, Line2D([], [], color="grey", linestyle=h.get_linestyle()))
    return [*runs.values(), *series.values()], [*runs, *series]


def _lines(ax, runs: Sequence[Run], keys: Sequence[tuple[str, str]], smooth: int) -> bool:
    drawn = False
    for ri, run in enumerate(runs):
        color = COLORS[ri % len(COLORS)]
        for ki, (key, label) in enumerate(keys):
            x, y = run.series(key)
            if not x:
                continue
            style = "--" if key.startswith("eval/") else ("-", "-.", ":", (0, (5, 1)))[ki % 4]
            name = f"{run.name}: {label}" if len(runs) > 1 else label
            kw = {"color": color} if len(runs) > 1 else {}
            if smooth > 1:
                ax.plot(x, y, linestyle=style, alpha=0.3, marker="o", markersize=2, **kw)
                ax.plot(x, moving_average(y, smooth), linestyle=style, label=f"{name} ({smooth}-step mean)", **kw)
            else:
                ax.plot(x, y, linestyle=style, marker="o", markersize=3, label=name, **kw)
            drawn = True
    return drawn


def _stacked(ax, run: Run, keys: Sequence[tuple[str, str]]) -> bool:
    """Stacked bars: each step's counts of ``keys`` as shares of their sum."""
    steps = sorted({r["step"] for r in run.rows if any(isinstance(r.get(k), (int, float)) for k, _ in keys)})
    if not steps:
        return False
    by_step = {r["step"]: r for r in run.rows}
    values = [[float(by_step[s].get(k) or 0.0) for s in steps] for k, _ in keys]
    totals = [sum(col) or 1.0 for col in zip(*values)]
    bottom = [0.0] * len(steps)
    for (_, label), row in zip(keys, values):
        shares = [v / t for v, t in zip(row, totals)]
        if any(shares):
            ax.bar(steps, shares, bottom=bottom, width=0.8, label=label, alpha=0.85)
            bottom = [b + x for b, x in zip(bottom, shares)]
    ax.set_ylim(0, 1)
    return True


Panel = Callable[["object", Sequence[Run], int], bool]


def _panel(title: str, ylabel: str, keys: Sequence[tuple[str, str]]) -> tuple[str, str, Panel]:
    return title, ylabel, lambda ax, runs, smooth: _lines(ax, runs, keys, smooth)


def _turn_panel(title: str, ylabel: str, pattern: str, label: str) -> tuple[str, str, Panel]:
    def draw(ax, runs, smooth):
        keys = sorted({k for r in runs for k in r.keys(pattern)}, key=_natural)
        return _lines(ax, runs, [(k, label.format(k.rsplit("_", 1)[-1])) for k in keys], smooth)
    return title, ylabel, draw


def _stack_panel(title: str, keys: Sequence[tuple[str, str]]) -> tuple[str, str, Panel]:
    return title, "share of the step (0-1)", lambda ax, runs, smooth: len(runs) == 1 and _stacked(ax, runs[0], keys)


PANELS: dict[str, tuple[str, str, Panel]] = {
    "reward": _panel("Reward: train rollouts and held-out", "mean reward (0-1)",
                     [("rollout/reward", "train"), ("eval/reward", "held-out")]),
    "response_length": _panel("Response length (model + feedback tokens)", "tokens per trajectory",
                              [("rollout/mean_response_tokens", "mean"), ("rollout/response_tokens_p90", "p90"),
                               ("rollout/response_tokens_max", "max"), ("eval/mean_response_tokens", "held-out mean")]),
    "budget_hits": _panel("Trajectories cut by the token budget", "share of trajectories (0-1)",
                          [("rollout/budget_hit_share", "train"), ("eval/budget_hit_share", "held-out")]),
    "void": _panel("Void trajectories (SimpleTIR: excluded from the loss)", "share of trajectories (0-1)",
                   [("rollout/void_trajectory_ratio", "train"), ("eval/void_trajectory_ratio", "held-out")]),
    "status": _stack_panel("How trajectories ended (train)", [(f"rollout/status_{s}", s) for s in STATUSES]),
    "groups": _stack_panel("Group filter (dynamic sampling)", [(f"filter/groups_{r}", r) for r in GROUP_RULES]),
    "logprob_per_turn": _turn_panel("Token log-prob per turn (SimpleTIR Fig. 3)", "mean log-prob (nats)",
                                    r"rollout/logprob_turn_\d+", "turn {}"),
    "low_prob_per_turn": _turn_panel("Tokens with p < 1e-3 per turn", "share of model tokens (0-1)",
                                     r"rollout/low_prob_share_turn_\d+", "turn {}"),
    "entropy_per_turn": _turn_panel("Policy entropy per turn", "entropy (nats per token)",
                                    r"train/entropy_turn_\d+", "turn {}"),
    "ratio_per_turn": _turn_panel("Max importance ratio per turn (SimpleTIR Fig. 5)", "ratio pi/pi_old",
                                  r"train/ratio_max_turn_\d+", "turn {}"),
    "loss": _panel("Policy loss", "loss (per token)", [("train/loss", "loss")]),
    "grad_norm": _panel("Gradient norm before clipping", "L2 norm", [("train/grad_norm", "grad norm"),
                                                                     ("train/grad_norm_ma", "moving average")]),
    "ppo_kl": _panel("Approximate KL, learner vs old policy (ppo_kl)", "nats per token", [("train/ppo_kl", "ppo_kl")]),
    "code_proportion": _panel("Code proportion (ZeroTIR)", "share of responses with code (0-1)",
                              [("rollout/code_proportion", "train"), ("eval/code_proportion", "held-out")]),
    "code_count": _panel("Code count (ZeroTIR)", "python blocks per response",
                         [("rollout/code_count", "train"), ("eval/code_count", "held-out")]),
    "code_in_correct": _panel("Code in correct (ZeroTIR)", "share of responses correct with code (0-1)",
                              [("rollout/code_in_correct", "train"), ("eval/code_in_correct", "held-out")]),
    "repeat_score": _panel("Avg repeat score (ZeroTIR)", "repeatness (0-1)",
                           [("rollout/avg_repeat_score", "train"), ("eval/avg_repeat_score", "held-out")]),
    "patterns": _panel("Reasoning patterns of correct trajectories", "share of correct (0-1)",
                       [("rollout/pattern_error_correction", "error correction"),
                        ("rollout/pattern_progressive_reasoning", "progressive reasoning"),
                        ("rollout/pattern_cross_checking", "cross-checking")]),
    "timing": _panel("Step time by phase", "seconds", [(f"time/{p}", p) for p in PHASES]),
    "throughput": _panel("Throughput", "tokens per second", [("perf/generation_tokens_per_s", "generation"),
                                                             ("perf/train_tokens_per_s", "training")]),
}
DASHBOARD = ("reward", "response_length", "void", "status", "logprob_per_turn", "grad_norm", "code_proportion",
             "ratio_per_turn", "timing")


def build_figures(run_dirs: Sequence[str | os.PathLike], *, smooth: int = 0) -> dict[str, object]:
    """``{file name: matplotlib Figure}``: one figure per panel that has data, and ``dashboard.png``."""
    from matplotlib.figure import Figure  # no pyplot: no global figure registry, no GUI backend

    if smooth < 0:
        raise ValueError(f"smooth must be >= 0, got {smooth}")
    runs = [Run(d) for d in run_dirs]
    figures = {}
    for name, (title, ylabel, draw) in PANELS.items():
        fig = Figure(figsize=(6.4, 3.6))
        ax = fig.subplots()
        if draw(ax, runs, smooth):
            _style_axis(ax, title, ylabel, runs)
            fig.tight_layout()
            figures[f"{name}.png"] = fig
    shown = [name for name in DASHBOARD if f"{name}.png" in figures]  # panels with data: no blank cell in the grid
    cols = 3
    rows = max(1, (len(shown) + cols - 1) // cols)
    fig = Figure(figsize=(15, 10 * rows / 3))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, name in zip(axes.flat, shown):
        title, ylabel, draw = PANELS[name]
        draw(ax, runs, smooth)
        _style_axis(ax, title, ylabel, runs)
    for ax in list(axes.flat)[len(shown):]:  # the last row's empty cells
        ax.set_axis_off()
    fig.suptitle(" vs ".join(r.name for r in runs) + " -- megatron-tir")
    fig.tight_layout()
    figures["dashboard.png"] = fig
    return figures


def plot_runs(run_dirs: Sequence[str | os.PathLike], *, out_dir: str | os.PathLike | None = None,
              smooth: int = 0) -> list[Path]:
    """Write :func:`build_figures` as PNGs; the files written."""
    if not run_dirs:
        raise ValueError("plot needs at least one run directory")
    figures = build_figures(run_dirs, smooth=smooth)
    out = Path(out_dir) if out_dir else (Path(run_dirs[0]) / "plots" if len(run_dirs) == 1 else Path("plots-compare"))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=100)
        written.append(out / name)
    return written
