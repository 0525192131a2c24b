"""Save and load a learner: its model, optimizer and lr scheduler in one policy checkpoint.

``save_learner(learner, dir)`` writes the checkpoint layout of ``layout`` (the one
``tir-ckpt`` reads): the model under sharded keys ``model.*``, the optimizer under
``optimizer.*`` (megatron-core's own ``sharded_state_dict``, "fully_sharded_model_space" for
the distributed optimizer, so any TP/PP/DP loads it) and the scheduler in the common state,
then ``hf/`` and ``tir_ckpt.json`` (rank 0). A frozen learner (no optimizer) writes the model
only. ``load_learner`` restores all three. Both are collective (every rank of the job). The
run checkpoints (``megatron_tir.train.checkpoint``) hold one such directory per named
learner.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megatron_tir.policy.checkpoint.layout import (HF_FILES_DIR, MODEL_PREFIX, CheckpointMeta, copy_hf_files,
                                                   read_meta, resolve_checkpoint, write_meta)
from megatron_tir.policy.checkpoint.megatron_io import check_same_model, load_model_state, without_absent_extra_state

log = logging.getLogger(__name__)

SCHEDULER_KEY = "scheduler"


def _sharded_state(learner, *, is_loading: bool, ckpt: Path | None = None) -> dict:
    model_sd = learner.module.sharded_state_dict(prefix=MODEL_PREFIX)
    if ckpt is not None:  # loading: TE's _extra_state only where the checkpoint has it
        model_sd = without_absent_extra_state(model_sd, ckpt)
    if learner.optimizer is None:
        return {"model": model_sd}
    optimizer_sd = learner.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})
    return {"model": model_sd, "optimizer": optimizer_sd}


def save_learner(learner, directory: str | Path) -> None:
    """Model (+ optimizer + scheduler) of ``learner`` into the checkpoint ``directory`` (created,
    must be empty or absent). Collective."""
    from megatron.core import parallel_state

    from megatron_tir.policy.checkpoint.dist_writer import save_sharded

    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):  # every rank sees it: all raise, none waits
        raise ValueError(f"checkpoint directory {directory} exists and is not empty")
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state(learner, is_loading=False)
    if learner.scheduler is not None:
        state[SCHEDULER_KEY] = learner.scheduler.state_dict()
    save_sharded(state, directory)
    if torch.distributed.get_rank() == 0:
        copy_hf_files(learner.source.hf_files, directory / HF_FILES_DIR)
        write_meta(directory, CheckpointMeta(
            model_spec=learner.spec.to_dict(), hf_config=learner.source.hf_config, iteration=learner.step,
            source=str(learner.config.model), tp=parallel_state.get_tensor_model_parallel_world_size(),
            pp=parallel_state.get_pipeline_model_parallel_world_size()))
    torch.distributed.barrier()


def load_learner(learner, directory: str | Path) -> None:
    """Restore ``learner``'s model, optimizer and scheduler from ``directory`` (any TP/PP wrote it);
    a frozen learner takes the model only. Collective."""
    from megatron.core import dist_checkpointing

    directory = resolve_checkpoint(Path(directory))
    check_same_model(read_meta(directory), learner.spec, f"this learner ({learner.config.model})")
    if learner.optimizer is not None and SCHEDULER_KEY not in dist_checkpointing.load_common_state_dict(
            str(directory)):
        raise ValueError(f"{directory} has no optimizer/scheduler state (a converted model, not a learner "
                         f"checkpoint: use it as LearnerConfig.model instead)")
    loaded = dist_checkpointing.load(_sharded_state(learner, is_loading=True, ckpt=directory), str(directory))
    model_state = {k.removeprefix(MODEL_PREFIX): v for k, v in loaded["model"].items()}
    load_model_state(learner.module, model_state, directory)
    if learner.optimizer is not None:
        learner.optimizer.load_state_dict(loaded["optimizer"])
        learner.scheduler.num_steps = 0  # load_state_dict advances by the saved count from here
        learner.scheduler.load_state_dict(loaded[SCHEDULER_KEY])
    log.info("loaded %s into the learner (step %d)", directory, learner.step)


def _optimizers(optimizer) -> list:
    """The megatron optimizers inside ``optimizer`` (a ChainedOptimizer holds several)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _named_tensors(learner):
    """(name, tensor) of every weight of this rank's model, then of every main parameter and state
    tensor of its optimizer (Adam's ``exp_avg``, ``exp_avg_sq``; the fp32 main copies of the weights)."""
    names = {id(p): n for n, p in learner.module.named_parameters()}
    for name, p in learner.module.named_parameters():
        yield f"weight {name}", p
    if learner.optimizer is None:
        return
    for k, opt in enumerate(_optimizers(learner.optimizer)):
        inner = getattr(opt, "optimizer", opt)  # the torch optimizer holding the main parameters
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                where = names.get(id(p), f"main parameter {i} of param group {g}" + (f" (optimizer {k})" if k else ""))
                yield f"optimizer {where}", p
                for key, value in inner.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        yield f"optimizer state {key} of {where}", value


def first_nonfinite(learner) -> str | None:
    """The name of a tensor of ``learner`` (any rank's) holding NaN or inf -- a weight, an optimizer
    main parameter or an optimizer state tensor -- or None when all are finite. Collective (one
    gather of the names)."""
    mine = None
    with torch.no_grad():
        named = [(n, t) for n, t in _named_tensors(learner) if t.numel()]
        if named:  # one sum per tensor, one host read: a sum is non-finite iff an element is (or it overflows)
            sums = torch.stack([t.sum(dtype=torch.float32) for _, t in named]).cpu()
            for index in (~torch.isfinite(sums)).nonzero().flatten().tolist():
                name, t = named[index]
                if not bool(torch.isfinite(t).all()):  # (not a mere overflow of the sum)
                    mine = name
                    break
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return mine
    found: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, mine)
    return next((f"{n} (rank {r})" if len(found) > 1 else n for r, n in enumerate(found) if n is not None), None)
