"""A learner: this rank's part of a Megatron model, its optimizer, and its weights.

``Learner(config)`` (every rank, after ``megatron_tir.policy.parallel.init_parallel``)
builds this rank's GPTModel stage (``build_gpt_model``), fills it from an HF directory or
a checkpoint, wraps it in megatron-core's ``DistributedDataParallel`` and makes the Adam
optimizer with ``get_megatron_optimizer`` (plain or distributed) and an
``OptimizerParamScheduler`` (linear warm-up, then constant or decaying lr).
``Learner(config, frozen=True)`` is forward-only (a reference policy): no DDP wrapper, no
gradient buffers, no optimizer, parameters without ``requires_grad``.

The learner does not know what its head's output means: ``forward`` and ``train_step`` hand
the model's output for each micro-batch to the caller's function (``OutputFn`` /
``LossFn``, see ``learner_contract``), which computes what it needs (the policy's log-probs
and entropy: ``megatron_tir.policy.losses``).

* ``forward``: per-token outputs of an ``OutputFn`` through ``get_forward_backward_func()``
  with ``forward_only``, gathered to ``[B, T]`` on every rank; ``logprobs`` is the policy's.
* ``train_step``: forward/backward of a ``LossFn``'s per-token loss over token-budget
  micro-batches (``microbatch``), aggregated so that the result does not depend on the
  micro-batch or data-parallel split, then one optimizer step (skipped, weights untouched,
  when any gradient is non-finite). Tokens a loss drops in the forward (``KEEP_METRIC`` 0)
  leave the denominator: see ``train_step``.
* ``named_hf_buckets``: full HF-named tensors (``weights``) by pipeline stage, for the
  engines' weight sync (``megatron_tir.rollout.sync``), which owns how they travel.

``LearnerConfig.head = "value"`` makes a critic: the same GPTModel with a one-output value
head (``megatron_tir.policy.value_head``), its backbone loaded from the policy's weights,
trained by a value loss (``megatron_tir.policy.losses.ValueLoss``); ``values`` reads it.

Checkpoints (model + optimizer + scheduler) are saved and loaded by
``megatron_tir.policy.checkpoint.learner_io``. Every rank passes the same full batch and rows
are dealt to the data-parallel replicas here, or (``local_rows=True``) each replica passes the
rows the caller dealt it (the trainer's hand-off). On CPU the model is float32 (16-bit
parameters need a GPU); FP8 needs Transformer Engine and a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import torch

from megatron_tir.policy.build import build_gpt_model, te_available
from megatron_tir.policy.routing import RoutingTap
from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.learner_contract import AGGREGATIONS, KEEP_METRIC, LossFn, LossInputs, OutputFn, StepResult, TrainBatch
from megatron_tir.policy.losses import TokenOutputs, ValueOutputs
from megatron_tir.policy.microbatch import MicroBatch, padding_share, plan_microbatches
from megatron_tir.policy.model_source import resolve_source
from megatron_tir.policy.parallel import collective_device
from megatron_tir.policy.value_head import VALUE_HEAD_KEY
from megatron_tir.policy.weights import bucket_layout, hf_buckets, load_hf_weights, stage_buckets

log = logging.getLogger(__name__)

# report keys of the learner's own (not metrics): what a micro-batch counts towards the aggregation's
# denominator after a loss's ``KEEP_METRIC`` (kept tokens / rows), or, without one, before it; and before
# it in any case (the stages that hold no loss mask learn the step's count from it)
_KEPT, _UNFILTERED, _TOTAL = "\0kept", "\0unfiltered", "\0total"

class Learner:
    """See the module docstring. Attributes: ``tokenizer``, ``spec``, ``config``, ``source``, ``frozen``;
    ``module`` (this rank's GPTModel stage), ``optimizer`` and ``scheduler`` (None when frozen);
    ``step``, ``lr``."""

    def __init__(self, config: LearnerConfig, *, frozen: bool = False) -> None:
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
        if config.sequence_parallel and not te_available():  # megatron-core's WrappedTorchNorm asserts the same
            raise ValueError("learner.sequence_parallel needs Transformer Engine's layer spec (a GPU with TE): "
                             "the local spec's torch norms do not support sequence parallelism")
        if not parallel_state.model_parallel_is_initialized():
            raise ValueError("call megatron_tir.policy.parallel.init_parallel(tp, pp) before building a Learner")
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (config.tp, config.pp, config.ep):
            raise ValueError(f"parallel state is tp={have[0]} pp={have[1]} ep={have[2]} but learner wants "
                             f"tp={config.tp} pp={config.pp} ep={config.ep}")
        source = resolve_source(config.model)
        self.spec = dataclasses.replace(source.spec, dtype=config.dtype)
        self.spec.check_layout(config.tp, config.pp, config.ep)
        if not self.spec.is_moe and (config.moe_aux_loss_coeff is not None or config.moe_z_loss_coeff):
            raise ValueError(f"learner.moe_aux_loss_coeff / moe_z_loss_coeff: {config.model} is not an MoE model")
        if self.spec.is_moe and config.tp > 1 and not config.sequence_parallel and not frozen:
            raise ValueError("learner.tp > 1 with an MoE model needs learner.sequence_parallel (megatron-core's MoE "
                             "layer refuses to train under TP without it; on CPU use learner.ep instead)")
        self.source = source
        self.frozen = frozen
        self.tokenizer = AutoTokenizer.from_pretrained(source.hf_files)

        # weights are loaded below; initialisation still runs, because it is what marks the
        # tensor-parallel parameters (``tensor_model_parallel``, ``partition_dim``) that grad norm,
        # clipping and weight export rely on
        overrides: dict = {"variable_seq_lengths": config.pp > 1}
        if config.pp > 1:  # stages exchange each micro-batch's shape; megatron-core refuses that with the
            overrides["moe_token_dispatcher_type"] = "alltoall"  # (unused here) allgather MoE dispatcher
        overrides.update(config.transformer_overrides())
        if self.spec.is_moe:  # each router keeps megatron-core's RouterReplay (policy.routing)
            overrides["moe_enable_routing_replay"] = True
        use_te = True if config.fp8 else te_available()
        self.value_head = config.head == "value"
        model = build_gpt_model(self.spec, use_te=use_te, value_head=self.value_head, **overrides)
        self.routing = RoutingTap(model, self.spec) if self.spec.is_moe else None  # MoE: record / replay routing
        skip = (VALUE_HEAD_KEY,) if self.value_head else ()  # a critic starts from the policy's backbone
        if source.checkpoint is not None:
            from megatron_tir.policy.checkpoint.megatron_io import load_model

            load_model(model, source.checkpoint, skip=skip)
        else:
            load_hf_weights(model, source.hf_files, self.spec, skip=skip)

        self.module = model
        self.optimizer = self.scheduler = None
        self._forward_backward = None
        if frozen:  # forward only: no DDP (no gradient buffers), no optimizer
            model.requires_grad_(False)
            model.eval()
            self._model = model
            log.info("frozen model ready: %s (%s), tp=%d pp=%d", config.model, self.spec.family, config.tp, config.pp)
            return
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=config.distributed_optimizer)
        self._model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
            clip_grad=config.grad_clip, bf16=config.dtype == "bfloat16", params_dtype=self.spec.torch_dtype,
            use_distributed_optimizer=config.distributed_optimizer), [self._model])
        decay_steps = config.lr_decay_steps or config.warmup_steps + 1
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr,
            lr_warmup_steps=config.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=config.lr_decay_style,
            start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=decay_steps,
            wd_incr_style="constant")
        mc = model.config
        mc.no_sync_func = self._model.no_sync
        mc.finalize_model_grads_func = finalize_model_grads
        mc.grad_scale_func = self.optimizer.scale_loss
        log.info("learner ready: %s (%s), tp=%d pp=%d dp=%d, %s optimizer", config.model, self.spec.family,
                 config.tp, config.pp, parallel_state.get_data_parallel_world_size(),
                 "distributed" if config.distributed_optimizer else "plain")

    # ------------------------------------------------------------------ properties

    @property
    def ddp(self):
        """The megatron-core ``DistributedDataParallel`` wrapper (its gradient buffers); None when frozen."""
        return None if self.frozen else self._model

    @property
    def step(self) -> int:
        """Optimizer steps taken (skipped steps do not count; 0 when frozen)."""
        return 0 if self.scheduler is None else int(self.scheduler.num_steps)

    @property
    def lr(self) -> float:
        """The lr the optimizer holds: the last step's (before any step: the scheduler's step-0 value)."""
        if self.optimizer is None:
            raise ValueError("a frozen learner has no optimizer (no lr)")
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ forward passes

    def _pipeline_schedule(self):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if self._forward_backward is None:
            self._forward_backward = get_forward_backward_func()
        return self._forward_backward

    def _micro_batches(self, attention_mask_BT: torch.Tensor, local_rows: bool = False) -> list[MicroBatch]:
        """This rank's micro-batches: of all rows (dealt here), or of the rows the caller dealt it."""
        from megatron.core import parallel_state

        dealt = not local_rows and parallel_state.get_data_parallel_world_size() > 1
        return plan_microbatches(attention_mask_BT, max_tokens=self.config.max_tokens_per_microbatch,
                                 pad_to=self.config.pad_multiple,
                                 dp_rank=parallel_state.get_data_parallel_rank() if dealt else 0,
                                 dp_size=parallel_state.get_data_parallel_world_size() if dealt else 1)

    def _run(self, micro_batches: list[MicroBatch], tokens_BT: torch.Tensor | None, loss_for, *, forward_only: bool,
             tick: Callable[[], None] | None = None):
        """The schedule over ``micro_batches``; ``loss_for(mb, inputs)`` -> loss function of the model output;
        ``tick()`` after each micro-batch's forward (a progress bar). ``tokens_BT`` None (a stage that
        does not read them): each micro-batch's ``input_ids`` are a zero-stride stand-in of its shape."""
        device = next(self._model.parameters()).device
        zero = torch.zeros((), dtype=torch.long, device=device)
        items = [(mb, mb.pack(tokens_BT).to(device) if tokens_BT is not None else zero.expand(len(mb.rows), mb.length))
                 for mb in micro_batches]
        it = iter(items)

        def forward_step(data_iterator, model):
            mb, tokens_bL = next(data_iterator)
            if self.routing is not None:
                self.routing.micro_batch = mb
            position_ids_bL = torch.arange(tokens_bL.shape[1], device=device).expand_as(tokens_bL)
            output = model(input_ids=tokens_bL, position_ids=position_ids_bL, attention_mask=None)
            if tick is not None:
                tick()
            return output, loss_for(mb, tokens_bL)

        longest = max(mb.length for mb in micro_batches)
        return self._pipeline_schedule()(forward_step_func=forward_step, data_iterator=it, model=[self._model],
                                num_microbatches=len(items), seq_length=longest,
                                micro_batch_size=max(len(mb.rows) for mb in micro_batches), forward_only=forward_only)

    def _routed(self, attention_mask_BT: torch.Tensor, local_rows: bool, run: Callable[[], list]) -> list:
        """``run()`` with an MoE model's routing recorded (and replayed inside ``routing.replaying``)."""
        if self.routing is None:
            return run()
        from megatron.core import parallel_state

        self.routing.begin(attention_mask_BT)
        out = run()
        self.routing.end(dealt=not local_rows and parallel_state.get_data_parallel_world_size() > 1)
        return out

    @staticmethod
    def _check_batch(tokens_BT: torch.Tensor | None, attention_mask_BT: torch.Tensor, *, local_rows: bool) -> None:
        from megatron.core import parallel_state

        if tokens_BT is None:  # only a stage that does not read them may leave them out (see train_step)
            if not local_rows or parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage():
                raise ValueError("tokens_BT is None, but this pipeline stage reads them (the first stage's "
                                 "embedding, the last stage's labels)")
            if attention_mask_BT.dim() != 2:
                raise ValueError(f"attention_mask_BT must be [B, T], got {tuple(attention_mask_BT.shape)}")
            return
        if tokens_BT.dim() != 2 or tuple(attention_mask_BT.shape) != tuple(tokens_BT.shape):
            raise ValueError(f"tokens_BT {tuple(tokens_BT.shape)} and attention_mask_BT "
                             f"{tuple(attention_mask_BT.shape)} must be the same [B, T] shape")

    def _check_vocab(self, tokens_BT: torch.Tensor | None) -> None:
        if tokens_BT is None:
            return
        if tokens_BT.numel() and (int(tokens_BT.min()) < 0 or int(tokens_BT.max()) >= self.spec.vocab_size):
            raise ValueError(f"token ids outside the vocabulary [0, {self.spec.vocab_size})")

    @staticmethod
    def _gather_rows(out_BT: torch.Tensor, contributes: bool, local_rows: bool) -> torch.Tensor:
        """The full ``[B, T]``: each row is filled by one (last stage, TP rank 0) rank of the world and
        every rank gets it, or (``local_rows``) by this replica's last stage's TP rank 0 and only that
        stage's TP ranks get it (the other stages do not read it)."""
        from megatron.core import parallel_state

        if not contributes:
            out_BT.zero_()
        if local_rows:
            if parallel_state.get_tensor_model_parallel_world_size() > 1:
                torch.distributed.all_reduce(out_BT, group=parallel_state.get_tensor_model_parallel_group())
        else:
            torch.distributed.all_reduce(out_BT)
        return out_BT

    def forward(self, tokens_BT: torch.Tensor | None, attention_mask_BT: torch.Tensor, output_fn: OutputFn,
                names: tuple[str, ...], *, local_rows: bool = False,
                tick: Callable[[], None] | None = None) -> dict[str, torch.Tensor | None]:
        """``{name: [B, T] float32}`` for each of ``names``: what ``output_fn(model output, inputs)``
        returns per token for each micro-batch (0 on padding), on every rank. Forward only. Collective.
        ``local_rows``: the rows are this data-parallel replica's only, as a stage reads them (see
        ``train_step``), and the outputs come back on the last pipeline stage only (None on the
        others: they do not read them); ``tick()`` is called after each micro-batch's forward (progress)."""
        from megatron.core import parallel_state

        self._check_batch(tokens_BT, attention_mask_BT, local_rows=local_rows)
        self._check_vocab(tokens_BT)
        micro_batches = self._micro_batches(attention_mask_BT, local_rows)
        device = next(self._model.parameters()).device

        def loss_for(mb: MicroBatch, tokens_bL: torch.Tensor):
            inputs = LossInputs(tokens_bL=tokens_bL, mask_bL=mb.mask().to(device), extras={})

            def loss_func(output):
                out = output_fn(output, inputs)
                missing = [n for n in names if n not in out]
                if missing:
                    raise ValueError(f"output_fn returned {sorted(out)}, not {missing}")
                return torch.zeros((), device=device), {n: out[n].float() for n in names}  # read after the loop
            return loss_func

        self._model.eval()
        with torch.no_grad():
            results = self._routed(attention_mask_BT, local_rows, lambda: self._run(
                micro_batches, tokens_BT, loss_for, forward_only=True, tick=tick))
        last = parallel_state.is_pipeline_last_stage()
        if local_rows and not last:
            return dict.fromkeys(names)
        contributes = last and parallel_state.get_tensor_model_parallel_rank() == 0
        outs = {n: torch.zeros(attention_mask_BT.shape, dtype=torch.float32, device=device) for n in names}
        if contributes:
            for mb, res in zip(micro_batches, results):
                if mb.weight:
                    for n in names:
                        mb.unpack(res[n], outs[n])
        stacked = self._gather_rows(torch.stack([outs[n] for n in names]), contributes, local_rows).cpu()  # one host read
        return dict(zip(names, stacked))

    def logprobs(self, tokens_BT: torch.Tensor | None, attention_mask_BT: torch.Tensor, *, temperature: float = 1.0,
                 with_entropy: bool = False, local_rows: bool = False,
                 tick: Callable[[], None] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The policy's ``[B, T]`` float32: column t = log p(token t | tokens < t) under ``logits /
        temperature``; 0 at each row's first token and on padding. With ``with_entropy`` also the
        ``[B, T]`` entropy of the distribution that predicted each token (same columns). Collective.
        ``local_rows``: as in ``forward`` (None past the last stage)."""
        if self.value_head:
            raise ValueError("a critic (learner.head=value) has no log-probs: use values()")
        output_fn = TokenOutputs(temperature=temperature, with_entropy=with_entropy)
        out = self.forward(tokens_BT, attention_mask_BT, output_fn, output_fn.names, local_rows=local_rows, tick=tick)
        return (out["logprobs"], out["entropy"]) if with_entropy else out["logprobs"]

    def values(self, tokens_BT: torch.Tensor | None, attention_mask_BT: torch.Tensor, *,
               local_rows: bool = False) -> torch.Tensor | None:
        """A critic's ``[B, T]`` float32 values, aligned as the log-probs: column t = V(tokens < t),
        the value of the state in which token t was sampled; 0 at each row's first token and on
        padding. Collective. ``local_rows``: as in ``forward``."""
        if not self.value_head:
            raise ValueError("values() needs a critic (learner.head=value)")
        return self.forward(tokens_BT, attention_mask_BT, ValueOutputs(), ValueOutputs.names,
                            local_rows=local_rows)["values"]

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, aggregation: str = "token_mean",
                   local_rows: bool = False) -> StepResult:
        """Zero grads, forward/backward of ``loss_fn(model output, inputs)`` over micro-batches, one
        optimizer step. ``loss_fn`` returns a per-token loss ``[b, L]`` and per-token metrics; the
        learner weights them by the loss mask under ``aggregation``. Collective.

        A per-token metric ``KEEP_METRIC`` (0/1, e.g. the high-ratio filter's, which depends on the
        current weights) removes the tokens it zeroes from the loss *and* the denominator, so the
        step equals one with them out of ``loss_mask_BT`` from the start: ``token_mean`` divides by
        the kept tokens, ``seq_mean`` each row by its kept tokens (a row lies in one micro-batch) and
        the mean by the rows with any. Those counts are known only after the forward passes: the
        weights start with the unfiltered denominator, the kept counts travel with the micro-batch
        reports (summed over micro-batches and data-parallel replicas, one gather per step), and the
        gradients -- linear in the weights -- are rescaled by ``unfiltered / kept`` before the
        optimizer step, hence before its gradient clipping (megatron-core's ``optimizer.step``
        clips, then steps). Metrics keep the unfiltered weights (``KEEP_METRIC``'s mean is the
        kept share); the reported loss is the filtered one. A step that keeps no token takes no
        optimizer step (weights, optimizer and lr schedule untouched; not counted as skipped). A
        loss mask that selects no token of the mini-batch (over every replica's rows under
        ``local_rows``) runs no forward either: every rank returns ``empty`` (not ``skipped``), the
        stages before the last learning the count from it (one all-reduce over the pipeline group).

        ``local_rows``: ``batch`` holds only this data-parallel replica's rows (the caller dealt
        them; every rank of a replica passes the same rows, at least one, loss mask 0 allowed);
        the aggregation's token / row count is summed over the replicas, so the update is the
        one of the whole mini-batch. A pipeline stage then needs only what it reads: past the first
        stage ``tokens_BT`` may be None (the embedding runs on the first stage), before the last
        ``loss_mask_BT`` may be None and ``extras`` empty (megatron-core runs the loss on the last
        stage only); the token / row count reaches those stages with the micro-batch reports."""
        from megatron.core import parallel_state

        if self.frozen:
            raise ValueError("a frozen learner does not train (it has no gradients and no optimizer)")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
        self._check_batch(batch.tokens_BT, batch.attention_mask_BT, local_rows=local_rows)
        self._check_vocab(batch.tokens_BT)
        if batch.loss_mask_BT is None and (not local_rows or parallel_state.is_pipeline_last_stage()):
            raise ValueError("loss_mask_BT is None, but this pipeline stage computes the loss (the last stage)")
        t0 = time.perf_counter()
        attn_BT = batch.attention_mask_BT.bool()
        micro_batches = self._micro_batches(attn_BT, local_rows)
        device = next(self._model.parameters()).device
        # the schedule divides each micro-batch's loss by their number and DDP averages over replicas
        scale = len(micro_batches) * parallel_state.get_data_parallel_world_size()
        if batch.loss_mask_BT is not None:
            loss_mask_BT = batch.loss_mask_BT.float() * attn_BT
            row_tokens_B = loss_mask_BT.sum(dim=1)
            # token_mean: each loss token weighs 1 / (loss tokens); seq_mean: 1 / (row's tokens x rows with tokens)
            per_token_BT = loss_mask_BT if aggregation == "token_mean" else loss_mask_BT / row_tokens_B.clamp(min=1.0)[:, None]
            total = float(row_tokens_B.sum()) if aggregation == "token_mean" else float((row_tokens_B > 0).sum())
            if local_rows and parallel_state.get_data_parallel_world_size() > 1:  # the count over every replica's rows
                count = torch.tensor([total], dtype=torch.float64, device=device)
                torch.distributed.all_reduce(count, group=parallel_state.get_data_parallel_group())
                total = float(count.item())
            weight_BT = per_token_BT / max(total, 1.0)
        if local_rows and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            total = _last_stage_count(total if batch.loss_mask_BT is not None else 0.0)
        if total == 0:  # every rank of the world knows it now: none enters the schedule
            return self._empty_step(t0)

        def loss_for(mb: MicroBatch, tokens_bL: torch.Tensor):
            if batch.loss_mask_BT is None:
                return _no_loss_here
            weight_bL = mb.pack(weight_BT).to(device) * mb.weight
            inputs = LossInputs(tokens_bL=tokens_bL, mask_bL=mb.mask().to(device),
                                extras={k: mb.pack(v).to(device) for k, v in batch.extras.items()})

            def loss_func(output):
                loss_bL, metrics = loss_fn(output, inputs)
                if tuple(loss_bL.shape) != tuple(tokens_bL.shape):
                    raise ValueError(f"loss_fn returned a loss of shape {tuple(loss_bL.shape)}; "
                                     f"expected per-token {tuple(tokens_bL.shape)}")
                keep_bL = metrics.get(KEEP_METRIC)
                mask_bL = mb.pack(loss_mask_BT).to(device) * mb.weight
                denominator = _denominator(mask_bL, aggregation)
                if keep_bL is None:
                    w_bL, counts = weight_bL, {_UNFILTERED: denominator}
                else:
                    w_bL, kept = _kept_weights(weight_bL, mask_bL, keep_bL.detach().float(), aggregation)
                    counts = {_KEPT: kept}
                counts[_TOTAL] = denominator
                loss = (loss_bL * w_bL).sum()
                report = {"loss": loss.detach().clone()} | counts
                for name, m_bL in metrics.items():
                    report[name] = (m_bL.detach().float() * weight_bL).sum()
                return loss * scale, report
            return loss_func

        self._model.train()
        self._model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._routed(batch.attention_mask_BT, local_rows,
                               lambda: self._run(micro_batches, batch.tokens_BT, loss_for, forward_only=False))
        t_fb = time.perf_counter()
        totals = self._sum_reports(reports)
        total = totals.pop(_TOTAL, 0.0)  # the same count as above, now on every stage
        unfiltered = totals.pop(_UNFILTERED, 0.0)
        kept = totals.pop(_KEPT, None)
        if kept is not None:  # a loss dropped tokens in the forward: their share leaves the denominator
            kept += unfiltered
            factor = total / kept if kept > 0 else 0.0
            if factor != 1.0:
                self._model.scale_gradients(factor)  # DDP's grad buffers, read by optimizer.step (clips after)
                totals["loss"] = totals.get("loss", 0.0) * factor
        skipped = not self._grads_finite()
        if kept is not None and kept <= 0 and not skipped:  # every token dropped: nothing to train on
            grad_norm, lr = 0.0, self.lr
            log.warning("no optimizer step: the loss kept none of the %d loss tokens", int(total))
        elif skipped:
            grad_norm, lr = float("nan"), self.lr
            log.warning("step skipped: non-finite gradients (loss %.4g)", totals.get("loss", float("nan")))
        else:
            self.scheduler.step(increment=1)
            lr = self.lr
            ok, grad_norm, _ = self.optimizer.step()
            assert ok, "optimizer reported an overflow after the finiteness check"
        weights_finite = self.weights_finite()
        if not weights_finite:  # every rank (an all-reduced flag): nothing may sync, evaluate or save them
            from megatron_tir.finite import NonFiniteTraining

            raise NonFiniteTraining(f"non-finite weights after optimizer step {self.step} (grad norm {grad_norm:.4g}, "
                                    f"{'skipped' if skipped else 'finite gradients'}): the run stops here; "
                                    f"the checkpoints hold only finite weights")
        t_opt = time.perf_counter()
        loss = totals.pop("loss", 0.0)
        return StepResult(loss=loss, grad_norm=float(grad_norm), skipped=skipped, lr=lr, metrics=totals,
                          timings={"forward_backward": t_fb - t0, "optimizer": t_opt - t_fb, "total": t_opt - t0},
                          padding_share=self._padding_share(micro_batches), weights_finite=weights_finite)

    def _empty_step(self, t0: float) -> StepResult:
        """The result of a mini-batch whose loss mask selects no token (e.g. the off-policy correction
        masked every one): no forward, no optimizer step (weights, optimizer and lr schedule untouched),
        ``empty``; every rank of the world takes this branch together (``train_step``'s count)."""
        log.warning("no optimizer step: the loss mask selects no token of the mini-batch")
        weights_finite = self.weights_finite()
        t = time.perf_counter() - t0
        return StepResult(loss=0.0, grad_norm=0.0, skipped=False, lr=self.lr, metrics={},
                          timings={"forward_backward": 0.0, "optimizer": 0.0, "total": t},
                          padding_share=0.0, weights_finite=weights_finite, empty=True)

    def _padding_share(self, micro_batches: list[MicroBatch]) -> float:
        """The padding share of every data-parallel replica's micro-batches of the step (each holds its own)."""
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_world_size() == 1:
            return padding_share(micro_batches)
        counts = torch.tensor([sum(mb.real_tokens for mb in micro_batches), sum(mb.padded_tokens for mb in micro_batches)],
                              dtype=torch.float64, device=next(self._model.parameters()).device)
        torch.distributed.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        real, padded = counts.tolist()
        return 1.0 - real / padded if padded else 0.0

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

    def weights_finite(self) -> bool:
        """True when every weight of every rank is finite. Collective: on the weights' device, one sum per
        contiguous parameter buffer (distributed optimizer) or per parameter, one flag all-reduced; one
        host read per call (once per optimizer step)."""
        device = next(self._model.parameters()).device
        ddp_buffers = getattr(self._model, "buffers", None)  # DDP's param buffers (a frozen learner has none)
        buffers = [b.param_data for b in ddp_buffers] if isinstance(ddp_buffers, list) else []
        tensors = buffers if buffers and all(t is not None for t in buffers) else list(self._model.parameters())
        sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])  # non-finite iff an element is (or overflow)
        bad = (~torch.isfinite(sums)).any().float().to(device)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bool(bad.item())

    # ------------------------------------------------------------------ weights for the engines

    def named_hf_buckets(self, bucket_bytes: int = 256 << 20) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """``(pipeline stage, [(HF name, full tensor), ...])`` buckets, on global rank 0 (other ranks:
        nothing, but they must exhaust the iterator: it is collective). See ``megatron_tir.policy.weights``."""
        if self.value_head:
            raise ValueError("a critic's weights do not go to the generation engines")
        return hf_buckets(self.module, self.spec, bucket_bytes)

    def stage_buckets(self, bucket_bytes: int = 256 << 20) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """This rank's stage's buckets, on the stage's sender only (nothing passes through rank 0);
        collective over the stage's TP group. See ``megatron_tir.policy.weights``."""
        if self.value_head:
            raise ValueError("a critic's weights do not go to the generation engines")
        return stage_buckets(self.module, self.spec, bucket_bytes)

    def bucket_layout(self, bucket_bytes: int = 256 << 20) -> list[list[list[tuple[str, tuple[int, ...]]]]]:
        """Per stage, the ``[(HF name, shape), ...]`` of each bucket ``stage_buckets`` yields there; and
        the dtype is ``weight_dtype``."""
        return bucket_layout(self.spec, self.config.pp, bucket_bytes, self.weight_dtype.itemsize)

    @property
    def weight_dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``named_hf_buckets`` without the stages."""
        return (tensors for _, tensors in self.named_hf_buckets(bucket_bytes))


def _last_stage_count(total: float) -> float:
    """The last pipeline stage's loss-token / row count (already summed over the data-parallel
    replicas) on every stage of this rank's pipeline: the stages before it hold no loss mask and pass
    0. One all-reduce (max) over the pipeline group, on the group's device."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    count = torch.tensor([total], dtype=torch.float64, device=collective_device(group))
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
    return float(count.item())


def _no_loss_here(output):
    raise AssertionError("megatron-core runs the loss on the last pipeline stage only")


def _denominator(mask_bL: torch.Tensor, aggregation: str) -> torch.Tensor:
    """What a micro-batch's rows count towards the aggregation's denominator: loss tokens (token_mean)
    or rows with any (seq_mean); ``mask_bL`` is 0 throughout on a stand-in micro-batch."""
    return mask_bL.sum() if aggregation == "token_mean" else (mask_bL.sum(1) > 0).float().sum()


def _kept_weights(weight_bL: torch.Tensor, mask_bL: torch.Tensor, keep_bL: torch.Tensor,
                  aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's loss weights with only the kept tokens, still over the unfiltered global
    denominator (``train_step`` rescales once the kept count is known), and its kept count: tokens
    (token_mean), or rows with any kept token (seq_mean, where each row's mean is renormalised here:
    a row lies in one micro-batch)."""
    if tuple(keep_bL.shape) != tuple(weight_bL.shape):
        raise ValueError(f"loss_fn's {KEEP_METRIC!r} has shape {tuple(keep_bL.shape)}; expected "
                         f"per-token {tuple(weight_bL.shape)}")
    kept_bL = mask_bL * keep_bL
    if aggregation == "token_mean":
        return weight_bL * keep_bL, kept_bL.sum()
    n_b, k_b = mask_bL.sum(1, keepdim=True), kept_bL.sum(1, keepdim=True)
    return weight_bL * keep_bL * n_b / torch.where(k_b > 0, k_b, 1.0), (k_b > 0).float().sum()
