"""The policy learner: this rank's part of the Megatron policy, its optimizer, and its weights.

``Learner(config)`` (every rank, after ``megatron_tir.policy.parallel.init_parallel``)
builds this rank's GPTModel stage (``build_gpt_model``), fills it from an HF directory or
a checkpoint, wraps it in megatron-core's ``DistributedDataParallel`` and makes the Adam
optimizer with ``get_megatron_optimizer`` (plain or distributed) and an
``OptimizerParamScheduler`` (linear warm-up, then constant or decaying lr).

* ``logprobs``: per-token log-probs (and entropy) of given ids, from vocab-parallel logits
  (``vocab_parallel``), through ``get_forward_backward_func()`` with ``forward_only``.
* ``train_step``: forward/backward of a caller's per-token loss over token-budget
  micro-batches (``microbatch``), aggregated so that the result does not depend on the
  micro-batch or data-parallel split, then one optimizer step (skipped, weights untouched,
  when any gradient is non-finite).
* ``save`` / ``load``: model + optimizer + scheduler in one dist checkpoint (the layout of
  ``megatron_tir.policy.checkpoint``, so ``tir-ckpt`` converts it too).
* ``hf_weights`` / ``sync_weights``: full HF-named tensors (``weights``) for the engines.

Every rank passes the same full batch and rows are dealt to the data-parallel replicas here,
or (``local_rows=True``) each replica passes the rows the caller dealt it.
On CPU the model is float32 (16-bit parameters need a GPU); FP8 needs Transformer Engine
and a GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_tir.policy.build import build_gpt_model, te_available
from megatron_tir.policy.checkpoint.layout import (HF_FILES_DIR, MODEL_PREFIX, CheckpointMeta,
                                                   copy_hf_files, read_meta, resolve_checkpoint, write_meta)
from megatron_tir.policy.learner_config import AGGREGATIONS, LearnerConfig, LossFn, StepResult, TrainBatch
from megatron_tir.policy.microbatch import MicroBatch, padding_share, plan_microbatches
from megatron_tir.policy.spec import ModelSpec, spec_from_hf_dir
from megatron_tir.policy.vocab_parallel import token_entropy, token_logprobs
from megatron_tir.policy.weights import hf_buckets, load_hf_weights

log = logging.getLogger(__name__)

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class _Source:
    spec: ModelSpec
    hf_config: dict
    hf_files: Path  # config + tokenizer (and, for an HF source, the weights)
    checkpoint: Path | None


def _resolve_source(model: str) -> _Source:
    from megatron_tir.model_sources import resolve_model

    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():  # a checkpoint or a run directory
        ckpt = resolve_checkpoint(path)
        meta = read_meta(ckpt)
        return _Source(spec=meta.spec, hf_config=meta.hf_config, hf_files=ckpt / HF_FILES_DIR, checkpoint=ckpt)
    hf_dir = resolve_model(model)
    spec, config = spec_from_hf_dir(hf_dir)
    return _Source(spec=spec, hf_config=config, hf_files=hf_dir, checkpoint=None)


def _shift_left(values_bL: torch.Tensor) -> torch.Tensor:
    """Column ``j`` <- column ``j - 1``, column 0 <- 0 (a prediction for token ``j`` sits at ``j - 1``)."""
    return torch.nn.functional.pad(values_bL[:, :-1], (1, 0))


class Learner:
    """See the module docstring. Attributes: ``tokenizer``, ``spec``, ``config``; ``step``, ``lr``."""

    def __init__(self, config: LearnerConfig) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
            finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from transformers import AutoTokenizer

        self.config = config
        on_gpu = torch.cuda.is_available()
        if config.dtype != "float32" and not on_gpu:
            raise ValueError(f"learner.dtype={config.dtype} needs a GPU (on CPU the learner trains in float32)")
        if config.fp8 is not None and not te_available():
            raise ValueError(f"learner.fp8={config.fp8} needs Transformer Engine and a GPU")
        if not parallel_state.model_parallel_is_initialized():
            raise ValueError("call megatron_tir.policy.parallel.init_parallel(tp, pp) before building a Learner")
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (config.tp, config.pp):
            raise ValueError(f"parallel state is tp={have[0]} pp={have[1]} but learner wants tp={config.tp} "
                             f"pp={config.pp}")
        source = _resolve_source(config.model)
        self.spec = dataclasses.replace(source.spec, dtype=config.dtype)
        self.spec.check_layout(config.tp, config.pp)
        self._source = source
        self.tokenizer = AutoTokenizer.from_pretrained(source.hf_files)

        # weights are loaded below; initialisation still runs, because it is what marks the
        # tensor-parallel parameters (``tensor_model_parallel``, ``partition_dim``) that grad norm,
        # clipping and weight export rely on
        overrides: dict = {"variable_seq_lengths": config.pp > 1}
        if config.pp > 1:  # stages exchange each micro-batch's shape; megatron-core refuses that with the
            overrides["moe_token_dispatcher_type"] = "alltoall"  # (unused here) allgather MoE dispatcher
        if config.fp8 is not None:
            overrides.update(fp8=config.fp8, fp8_recipe="delayed")  # megatron-core's format names
        model = build_gpt_model(self.spec, use_te=True if config.fp8 else None, **overrides)
        if source.checkpoint is not None:
            from megatron_tir.policy.checkpoint.megatron_io import load_model

            load_model(model, source.checkpoint)
        else:
            load_hf_weights(model, source.hf_files, self.spec)

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=config.distributed_optimizer)
        self._model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        self._optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
            clip_grad=config.grad_clip, bf16=config.dtype == "bfloat16", params_dtype=self.spec.torch_dtype,
            use_distributed_optimizer=config.distributed_optimizer), [self._model])
        decay_steps = config.lr_decay_steps or config.warmup_steps + 1
        self._scheduler = OptimizerParamScheduler(
            self._optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr,
            lr_warmup_steps=config.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=config.lr_decay_style,
            start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=decay_steps,
            wd_incr_style="constant")
        mc = model.config
        mc.no_sync_func = self._model.no_sync
        mc.finalize_model_grads_func = finalize_model_grads
        mc.grad_scale_func = self._optimizer.scale_loss
        self._forward_backward = None
        log.info("learner ready: %s (%s), tp=%d pp=%d dp=%d, %s optimizer", config.model, self.spec.family,
                 config.tp, config.pp, parallel_state.get_data_parallel_world_size(),
                 "distributed" if config.distributed_optimizer else "plain")

    # ------------------------------------------------------------------ properties

    @property
    def step(self) -> int:
        """Optimizer steps taken (skipped steps do not count)."""
        return int(self._scheduler.num_steps)

    @property
    def lr(self) -> float:
        """The lr the optimizer holds: the last step's (before any step: the scheduler's step-0 value)."""
        return float(self._optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ forward passes

    def _schedule(self):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if self._forward_backward is None:
            self._forward_backward = get_forward_backward_func()
        return self._forward_backward

    def _micro_batches(self, attention_mask_BT: torch.Tensor, local_rows: bool) -> list[MicroBatch]:
        """This rank's micro-batches: of all rows (dealt here), or of the rows the caller dealt it."""
        from megatron.core import parallel_state

        dealt = not local_rows and parallel_state.get_data_parallel_world_size() > 1
        return plan_microbatches(attention_mask_BT, max_tokens=self.config.max_tokens_per_microbatch,
                                 dp_rank=parallel_state.get_data_parallel_rank() if dealt else 0,
                                 dp_size=parallel_state.get_data_parallel_world_size() if dealt else 1)

    def _run(self, micro_batches: list[MicroBatch], tokens_BT: torch.Tensor, loss_for, *, forward_only: bool):
        """The schedule over ``micro_batches``; ``loss_for(mb)`` -> loss function of the model output."""
        device = next(self._model.parameters()).device
        items = [(mb, mb.pack(tokens_BT).to(device)) for mb in micro_batches]
        it = iter(items)

        def forward_step(data_iterator, model):
            mb, tokens_bL = next(data_iterator)
            position_ids_bL = torch.arange(tokens_bL.shape[1], device=device).expand_as(tokens_bL)
            return model(input_ids=tokens_bL, position_ids=position_ids_bL, attention_mask=None), loss_for(mb, tokens_bL)

        longest = max(mb.length for mb in micro_batches)
        return self._schedule()(forward_step_func=forward_step, data_iterator=it, model=[self._model],
                                num_microbatches=len(items), seq_length=longest,
                                micro_batch_size=max(len(mb.rows) for mb in micro_batches), forward_only=forward_only)

    @staticmethod
    def _check_batch(tokens_BT: torch.Tensor, attention_mask_BT: torch.Tensor, temperature: float) -> None:
        if tokens_BT.dim() != 2 or tuple(attention_mask_BT.shape) != tuple(tokens_BT.shape):
            raise ValueError(f"tokens_BT {tuple(tokens_BT.shape)} and attention_mask_BT "
                             f"{tuple(attention_mask_BT.shape)} must be the same [B, T] shape")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")

    def _check_vocab(self, tokens_BT: torch.Tensor) -> None:
        if tokens_BT.numel() and (int(tokens_BT.min()) < 0 or int(tokens_BT.max()) >= self.spec.vocab_size):
            raise ValueError(f"token ids outside the vocabulary [0, {self.spec.vocab_size})")

    @staticmethod
    def _gather_rows(out_BT: torch.Tensor, contributes: bool, local_rows: bool) -> torch.Tensor:
        """Every rank gets the full ``[B, T]``: each row is filled by one (last stage, TP rank 0) rank
        of the world, or (``local_rows``) of this rank's model-parallel group."""
        from megatron.core import parallel_state

        if not contributes:
            out_BT.zero_()
        torch.distributed.all_reduce(out_BT, group=parallel_state.get_model_parallel_group() if local_rows else None)
        return out_BT

    def logprobs(self, tokens_BT: torch.Tensor, attention_mask_BT: torch.Tensor, *, temperature: float = 1.0,
                 with_entropy: bool = False, local_rows: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` float32: column t = log p(token t | tokens < t) under ``logits / temperature``;
        0 at each row's first token and on padding. With ``with_entropy`` also the ``[B, T]``
        entropy of the distribution that predicted each token (same columns). Collective.
        ``local_rows``: the rows are this data-parallel replica's only (see ``train_step``)."""
        from megatron.core import parallel_state

        self._check_batch(tokens_BT, attention_mask_BT, temperature)
        self._check_vocab(tokens_BT)
        micro_batches = self._micro_batches(attention_mask_BT, local_rows)
        device = next(self._model.parameters()).device

        def loss_for(mb: MicroBatch, tokens_bL: torch.Tensor):
            def loss_func(logits_bLV):
                target_bL = torch.roll(tokens_bL, -1, dims=1)
                mask_bL = mb.mask().to(device)
                out = {}
                if with_entropy:
                    out["entropy"] = _shift_left(token_entropy(logits_bLV, temperature)) * mask_bL
                out["logprobs"] = _shift_left(token_logprobs(logits_bLV, target_bL, temperature)) * mask_bL
                return torch.zeros((), device=device), {k: v.float().cpu() for k, v in out.items()}
            return loss_func

        self._model.eval()
        with torch.no_grad():
            results = self._run(micro_batches, tokens_BT, loss_for, forward_only=True)
        contributes = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
        names = ["logprobs", "entropy"] if with_entropy else ["logprobs"]
        outs = {n: torch.zeros(tokens_BT.shape, dtype=torch.float32) for n in names}
        if contributes:
            for mb, res in zip(micro_batches, results):
                if mb.weight:
                    for n in names:
                        mb.unpack(res[n], outs[n])
        stacked = self._gather_rows(torch.stack([outs[n] for n in names]).to(device), contributes, local_rows).cpu()
        return (stacked[0], stacked[1]) if with_entropy else stacked[0]

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, aggregation: str = "token_mean",
                   temperature: float = 1.0, with_entropy: bool = False, local_rows: bool = False) -> StepResult:
        """Zero grads, forward/backward of ``loss_fn`` over micro-batches, one optimizer step. Collective.

        ``local_rows``: ``batch`` holds only this data-parallel replica's rows (the caller dealt
        them; every rank of a replica passes the same rows, at least one, loss mask 0 allowed);
        the aggregation's token / row count is summed over the replicas, so the update is the
        one of the whole mini-batch."""
        from megatron.core import parallel_state

        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
        self._check_batch(batch.tokens_BT, batch.attention_mask_BT, temperature)
        self._check_vocab(batch.tokens_BT)
        t0 = time.perf_counter()
        attn_BT = batch.attention_mask_BT.bool()
        loss_mask_BT = batch.loss_mask_BT.float() * attn_BT
        row_tokens_B = loss_mask_BT.sum(dim=1)
        # token_mean: each loss token weighs 1 / (loss tokens); seq_mean: 1 / (row's tokens x rows with tokens)
        per_token_BT = loss_mask_BT if aggregation == "token_mean" else loss_mask_BT / row_tokens_B.clamp(min=1.0)[:, None]
        total = float(row_tokens_B.sum()) if aggregation == "token_mean" else float((row_tokens_B > 0).sum())
        if local_rows and parallel_state.get_data_parallel_world_size() > 1:  # the count over every replica's rows
            count = torch.tensor([total], dtype=torch.float64, device=next(self._model.parameters()).device)
            torch.distributed.all_reduce(count, group=parallel_state.get_data_parallel_group())
            total = float(count.item())
        weight_BT = per_token_BT / max(total, 1.0)
        if total == 0:
            raise ValueError("loss_mask_BT selects no tokens: nothing to train on")
        micro_batches = self._micro_batches(attn_BT, local_rows)
        device = next(self._model.parameters()).device
        # the schedule divides each micro-batch's loss by their number and DDP averages over replicas
        scale = len(micro_batches) * parallel_state.get_data_parallel_world_size()

        def loss_for(mb: MicroBatch, tokens_bL: torch.Tensor):
            weight_bL = mb.pack(weight_BT).to(device) * mb.weight
            extras = {k: mb.pack(v).to(device) for k, v in batch.extras.items()}

            def loss_func(logits_bLV):
                target_bL = torch.roll(tokens_bL, -1, dims=1)
                entropy_bL = _shift_left(token_entropy(logits_bLV, temperature)) if with_entropy else None
                logp_bL = _shift_left(token_logprobs(logits_bLV, target_bL, temperature))  # may reuse the logits
                loss_bL, metrics = loss_fn(logp_bL, entropy_bL, extras)
                if tuple(loss_bL.shape) != tuple(logp_bL.shape):
                    raise ValueError(f"loss_fn returned a loss of shape {tuple(loss_bL.shape)}; "
                                     f"expected per-token {tuple(logp_bL.shape)}")
                loss = (loss_bL * weight_bL).sum()
                report = {"loss": loss.detach().clone()}
                for name, m_bL in metrics.items():
                    report[name] = (m_bL.detach().float() * weight_bL).sum()
                return loss * scale, report
            return loss_func

        self._model.train()
        self._model.zero_grad_buffer()
        self._optimizer.zero_grad()
        reports = self._run(micro_batches, batch.tokens_BT, loss_for, forward_only=False)
        t_fb = time.perf_counter()
        totals = self._sum_reports(reports)
        skipped = not self._grads_finite()
        if skipped:
            grad_norm, lr = float("nan"), self.lr
            log.warning("step skipped: non-finite gradients (loss %.4g)", totals.get("loss", float("nan")))
        else:
            self._scheduler.step(increment=1)
            lr = self.lr
            ok, grad_norm, _ = self._optimizer.step()
            assert ok, "optimizer reported an overflow after the finiteness check"
        t_opt = time.perf_counter()
        loss = totals.pop("loss", 0.0)
        return StepResult(loss=loss, grad_norm=float(grad_norm), skipped=skipped, lr=lr, metrics=totals,
                          timings={"forward_backward": t_fb - t0, "optimizer": t_opt - t_fb, "total": t_opt - t0},
                          padding_share=padding_share(micro_batches))

    @staticmethod
    def _sum_reports(reports: list[dict]) -> dict[str, float]:
        """Sum of the micro-batch reports of every data-parallel replica's last stage, on every rank."""
        from megatron.core import parallel_state

        mine: dict[str, float] = {}
        if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
            for report in reports:
                for name, value in report.items():
                    mine[name] = mine.get(name, 0.0) + float(value)
        gathered: list[dict[str, float] | None] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        totals: dict[str, float] = {}
        for part in gathered:
            for name, value in (part or {}).items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def _grads_finite(self) -> bool:
        """True when every gradient of every rank is finite (one flag all-reduced over the world)."""
        device = next(self._model.parameters()).device
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for buffer in self._model.buffers:  # a sum is non-finite iff an element is (or it overflows)
            if not torch.isfinite(buffer.grad_data.sum()):
                bad.fill_(1.0)
                break
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bool(bad.item())

    # ------------------------------------------------------------------ checkpoints

    def _sharded_state(self, *, is_loading: bool) -> dict:
        model_sd = self._model.module.sharded_state_dict(prefix=MODEL_PREFIX)
        optimizer_sd = self._optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})
        return {"model": model_sd, "optimizer": optimizer_sd}

    def save(self, directory: str | Path) -> None:
        """Model + optimizer + scheduler into the dist checkpoint ``directory`` (created). Collective."""
        from megatron.core import parallel_state

        from megatron_tir.policy.checkpoint.dist_writer import save_sharded

        directory = Path(directory)
        if directory.exists() and any(directory.iterdir()):  # every rank sees it: all raise, none waits
            raise ValueError(f"checkpoint directory {directory} exists and is not empty")
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        state = self._sharded_state(is_loading=False)
        state["scheduler"] = self._scheduler.state_dict()
        save_sharded(state, directory)
        if torch.distributed.get_rank() == 0:
            copy_hf_files(self._source.hf_files, directory / HF_FILES_DIR)
            write_meta(directory, CheckpointMeta(
                model_spec=self.spec.to_dict(), hf_config=self._source.hf_config, iteration=self.step,
                source=str(self.config.model), tp=parallel_state.get_tensor_model_parallel_world_size(),
                pp=parallel_state.get_pipeline_model_parallel_world_size()))
        torch.distributed.barrier()

    def load(self, directory: str | Path) -> None:
        """Restore model, optimizer and scheduler from ``directory`` (any TP/PP wrote it). Collective."""
        from megatron.core import dist_checkpointing

        directory = resolve_checkpoint(Path(directory))
        meta = read_meta(directory)
        a, b = meta.spec.to_dict(), self.spec.to_dict()
        diffs = [f"{k} {a[k]} vs {b[k]}" for k in a if k != "dtype" and a[k] != b[k]]
        if diffs:
            raise ValueError(f"checkpoint {directory} holds a different model: {', '.join(diffs[:3])}")
        if "scheduler" not in dist_checkpointing.load_common_state_dict(str(directory)):
            raise ValueError(f"{directory} has no optimizer/scheduler state (a converted model, not a learner "
                             f"checkpoint: use it as LearnerConfig.model instead)")
        loaded = dist_checkpointing.load(self._sharded_state(is_loading=True), str(directory))
        model_state = {k.removeprefix(MODEL_PREFIX): v for k, v in loaded["model"].items()}
        self._model.module.load_state_dict(model_state, strict=True)
        self._optimizer.load_state_dict(loaded["optimizer"])
        self._scheduler.num_steps = 0  # load_state_dict advances by the saved count from here
        self._scheduler.load_state_dict(loaded["scheduler"])

    # ------------------------------------------------------------------ weights for the engines

    def hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of full HF-named tensors, on global rank 0 (other ranks: nothing, but they must
        exhaust the iterator: it is collective). See ``megatron_tir.policy.weights``."""
        return hf_buckets(self._model.module, self.spec, bucket_bytes)

    def sync_weights(self, engine, *, bucket_bytes: int = 256 << 20,
                     loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Send the current weights to ``engine`` (global rank 0; None elsewhere). Collective.

        ``engine`` decides the transport: a ``LocalEngine`` gets them through
        ``update_weights``; for SGLang pass the connected ``megatron_tir.policy.weight_sync``
        object (``DistributedWeightSync`` over NCCL, ``TensorWeightSync`` when colocated), whose
        ``send(buckets, weight_version=str(step))`` pauses the servers, loads the buckets as they
        are exported and resumes. Both are coroutines: they run on ``loop`` (the event loop the
        engine lives on) or on a fresh one when ``loop`` is None; from inside a running loop use
        ``await sync_weights_async``.
        """
        coro = self.sync_weights_async(engine, bucket_bytes=bucket_bytes)
        if loop is not None:
            loop.run_until_complete(coro)
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(coro)
            return
        coro.close()
        raise ValueError("sync_weights called inside a running event loop: use await learner.sync_weights_async")

    async def sync_weights_async(self, engine, *, bucket_bytes: int = 256 << 20) -> None:
        """``sync_weights`` for callers inside the engine's event loop (the collectives block it)."""
        from megatron_tir.rollout.engines.local import LocalEngine

        is_rank0 = torch.distributed.get_rank() == 0
        if is_rank0 and engine is None:
            raise ValueError("sync_weights needs the engine on global rank 0")
        buckets = self.hf_weights(bucket_bytes)
        if not is_rank0:
            for _ in buckets:
                pass
            return
        if isinstance(engine, LocalEngine):
            named = [item for bucket in buckets for item in bucket]
            await engine.update_weights(named)
            return
        send = getattr(engine, "send", None)
        if send is None:
            for _ in buckets:  # keep the collective going on the other ranks
                pass
            raise ValueError(f"sync_weights: {type(engine).__name__} is neither a LocalEngine nor a weight sync "
                             f"(megatron_tir.policy.weight_sync.DistributedWeightSync / TensorWeightSync)")
        await send(buckets, weight_version=str(self.step))
