"""What a training run checks before anything slow starts (every rank, in ``prepare``).

Building the learner (megatron-core, the weights, the optimizer) and the rollout worker (the
engine, the sandbox cluster) takes from seconds to minutes; a mistake found after them also
leaves processes to tear down. So everything that can be checked from the config and the
files alone is checked first, each failure one ``ValueError`` line naming what is wrong:

* the model: it resolves (a named model, an HF directory with a readable ``config.json`` of a
  supported architecture, or a run/policy checkpoint's metadata) -- no weights are read;
* the layout: ``learner.tp`` x ``learner.pp`` against the heads, key/value heads, vocabulary,
  FFN and layers, and against ``WORLD_SIZE`` under torchrun;
* the data: the training and held-out sets resolve and have the verl schema (every row read);
* the sandbox and engine settings (their configs' own checks; a reachable address is probed
  later, when the worker starts).
"""

from __future__ import annotations

import os

from megatron_tir.train.config import TrainConfig


def model_spec(model: str):
    """The ModelSpec of ``model`` from its config files only (ValueError naming the model)."""
    from pathlib import Path

    from megatron_tir.policy.spec import spec_from_hf_dir

    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():  # a checkpoint or a run directory
        from megatron_tir.policy.checkpoint.layout import read_meta, resolve_checkpoint

        return read_meta(resolve_checkpoint(path)).spec
    from megatron_tir.model_sources import resolve_model

    spec, _ = spec_from_hf_dir(resolve_model(model))
    return spec


def check_start(cfg: TrainConfig, *, world_size: int | None = None) -> None:
    """ValueError (one line) for the first thing that would make the start fail."""
    spec = model_spec(cfg.model)
    tp, pp = cfg.learner.tp, cfg.learner.pp
    try:
        spec.check_layout(tp, pp)
    except ValueError as exc:
        raise ValueError(f"learner.tp={tp} learner.pp={pp} do not fit model {cfg.model}: {exc}") from None
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if world % (tp * pp):
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of learner.tp x learner.pp = {tp * pp}")
    from megatron_tir.train.data import held_out_problems, PromptStream

    PromptStream(cfg.data)  # reads and checks a dataset (the arithmetic task needs nothing)
    held_out_problems(cfg.data)
