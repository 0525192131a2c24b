"""What a training run checks before anything slow starts (every rank, in ``prepare``).

Building the learner (megatron-core, the weights, the optimizer) and the rollout worker (the
engine, the sandbox cluster) takes from seconds to minutes; a mistake found after them also
leaves processes to tear down. So everything that can be checked from the config and the
files alone is checked first, each failure one ``ValueError`` line naming what is wrong:

* the model: it resolves (a named model, an HF directory with a readable ``config.json`` of a
  supported architecture, or a run/policy checkpoint's metadata) -- no weights are read;
* the layout (:func:`check_layout`, also ``sft``'s): ``learner.tp`` x ``learner.pp`` against the heads,
  key/value heads, vocabulary, FFN and layers (``learner.ep`` against the experts), and against
  ``WORLD_SIZE`` under torchrun;
* the data: the training and held-out sets resolve and have the verl schema (every row read),
  and every prompt of a dataset, rendered by the rollout protocol, leaves the response budget
  (the larger of ``rollout.max_response_tokens`` and a turn schedule's) inside the engine's
  context (the model's ``max_position_embeddings``): the error names the set and the row;
* the sandbox: a broker at ``sandbox.address`` answers (rank 0; a local cluster is started and
  probed later, with the engine);
* the checkpoint to resume (:func:`check_resume`): the newest intact step, every byte verified
  against its manifest on rank 0 (sizes on the others), the manifest rule of
  ``checkpoint_integrity`` applied -- before the learner is built, so "no intact checkpoint" is one
  line (non-finite values are found when the learner loads it, on every rank's share).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.train.config import TrainConfig

log = logging.getLogger(__name__)


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


def torchrun_world_size() -> int:
    """The ranks of the run: torchrun's ``WORLD_SIZE`` (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(model: str, learner: LearnerConfig, world_size: int):
    """The ModelSpec of ``model`` (config files only) once ``learner.tp`` x ``learner.pp`` (and ``learner.ep``)
    fit it and ``world_size`` ranks split into tp x pp groups; ValueError (one line) naming the settings
    otherwise. ``train`` (:func:`check_start`) and ``sft`` check their layout with it."""
    spec = model_spec(model)
    tp, pp, ep = learner.tp, learner.pp, learner.ep
    try:
        spec.check_layout(tp, pp, ep)
    except ValueError as exc:
        settings = f"learner.tp={tp} learner.pp={pp}" + (f" learner.ep={ep}" if ep != 1 else "")
        raise ValueError(f"{settings} do not fit model {model}: {exc}") from None
    if world_size % (tp * pp):
        raise ValueError(f"WORLD_SIZE={world_size} is not a multiple of learner.tp x learner.pp = {tp * pp}")
    return spec


def check_start(cfg: TrainConfig, *, world_size: int | None = None) -> None:
    """ValueError (one line) for the first thing that would make the start fail."""
    spec = check_layout(cfg.model, cfg.learner, torchrun_world_size() if world_size is None else world_size)
    from megatron_tir.data import load_problems
    from megatron_tir.train.data import ARITHMETIC, MIX, held_out_problems

    generated = (ARITHMETIC, MIX)  # generated tasks: nothing to read, short prompts by construction
    train = [] if cfg.data.train in generated else load_problems(cfg.data.train)  # every row read and checked
    held_out = held_out_problems(cfg.data)
    check_prompt_lengths(cfg, spec, {"data.train": train, "data.eval": [] if cfg.data.eval in generated else held_out})
    if _rank() == 0:
        check_sandbox_reachable(cfg)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def response_budget(cfg: TrainConfig) -> int:
    """The most response tokens a trajectory may get in this run (a turn schedule may raise the budget)."""
    schedule = cfg.trainer.turn_schedule
    scheduled = schedule.at_step is not None or schedule.on_plateau
    return max(cfg.rollout.max_response_tokens, schedule.max_response_tokens if scheduled else 0)


def _tokenizer_dir(model: str) -> Path:
    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():  # a checkpoint: its HF files (tokenizer)
        from megatron_tir.policy.checkpoint.layout import HF_FILES_DIR, resolve_checkpoint

        return resolve_checkpoint(path) / HF_FILES_DIR
    from megatron_tir.model_sources import resolve_model

    return resolve_model(model)


def check_prompt_lengths(cfg: TrainConfig, spec, datasets: dict) -> None:
    """ValueError naming the first row of ``datasets`` (name -> problems) whose prompt, rendered as the
    rollouts render it, leaves less than the response budget of the engine's context."""
    if not any(datasets.values()):
        return
    from transformers import AutoTokenizer

    context, budget = spec.max_position_embeddings, response_budget(cfg)
    room = context - budget
    if room < 1:
        raise ValueError(f"the response budget ({budget} tokens) leaves no room for a prompt in the engine's "
                         f"context ({context} tokens, max_position_embeddings of {cfg.model})")
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir(cfg.model))
    protocol = cfg.rollout.make_protocol()
    for name, problems in datasets.items():
        for problem in problems:
            n = len(protocol.prompt_ids(problem.messages, tokenizer))
            if n > room:
                raise ValueError(f"{name} row {problem.index}: the prompt is {n} tokens, more than the {room} the "
                                 f"engine's context ({context}) leaves beside the response budget ({budget}): "
                                 f"shorten or drop it, or lower rollout.max_response_tokens")


def check_sandbox_reachable(cfg: TrainConfig) -> None:
    """ValueError when rollouts use tools and no sandbox broker answers at ``sandbox.address``."""
    address = cfg.sandbox.address
    if address is None or not cfg.rollout.tools:
        return
    from sandbox_cluster import SandboxClient

    wait = cfg.sandbox.probe_timeout_s
    with SandboxClient(address) as client:
        try:
            status = client.status(timeout=wait)
        except TimeoutError:
            raise ValueError(f"sandbox.address={address}: no sandbox broker answered within {wait:g} s "
                             f"(sandbox.probe_timeout_s); start one (sandbox-cluster serve --bind {address}) "
                             f"or leave sandbox.address unset for a local cluster") from None
    if not status.workers:
        log.warning("the sandbox broker at %s has no worker yet: the rollouts wait for one", address)


def check_resume(run_dir: Path, cfg: TrainConfig) -> Path:
    """The step directory a resume of ``run_dir`` starts from: the newest intact one (rank 0 verifies
    every byte, the other ranks the sizes); ValueError (one line) when there is none or, under
    ``trainer.checkpoint.strict_resume``, when the newest is damaged."""
    from megatron_tir.policy.checkpoint.layout import CHECKPOINTS_DIR
    from megatron_tir.train import checkpoint_integrity as integrity

    ck = cfg.trainer.checkpoint
    return integrity.pick(Path(run_dir) / CHECKPOINTS_DIR, strict=ck.strict_resume, deep=_rank() == 0,
                          allow_unverified=ck.allow_unverified)
