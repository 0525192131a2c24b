"""MoE routing of the learner's forward passes: recorded per token, replayed in a later pass.

Routing replay (slime ``--use-routing-replay``, NeMo-RL's router replay, arXiv 2507.18071): the
experts each token was routed to when the old log-probs were computed are reused in the policy
update, so that the importance ratio compares the same sub-networks. megatron-core 0.16 gives
every ``TopKRouter`` a ``RouterReplay`` (``moe_enable_routing_replay``) whose ``REPLAY_FORWARD``
action routes to given top-k indices (their probabilities renormalised from the router's own
scores, as its top-k would be); ``RoutingTap`` drives those per micro-batch through hooks on this
stage's routers, and keeps the per-token record:

* ``RoutingTap.recorded`` after a pass: ``[B, T, layers of this stage, k]`` int16 expert ids of
  each row's tokens (sorted ascending; -1 on padding), the same on every rank of the stage (one
  all-reduce over the data-parallel group when the rows were dealt over replicas).
* ``with tap.replaying(record):`` the passes inside route every token to ``record``'s experts (same
  ``[B, T]`` rows as the pass's batch).
* ``tap.changed_share`` after a pass with a reference record (the replayed one, or ``compare_to``):
  the share of (token, layer) pairs whose own top-k set -- what the router computes from its current
  weights, replayed or not -- differs from the reference's: the "top-k changed" metric.

Full activation recomputation: megatron-core runs a checkpointed layer's forward under ``no_grad``
and again, with grad, in backward (``tensor_parallel.random.CheckpointFunction``); the recomputation
replays the targets its forward used, first in first out per layer (what megatron-core's
``REPLAY_BACKWARD`` queue does), and neither records nor counts. It needs every layer of the stage
checkpointed (``recompute_method=uniform``, or ``block`` over all of them). Token dropping does not
arise: the learner's MoE is dropless (``moe.moe_config_kwargs``: no capacity factor, as transformers'
Qwen3-MoE), so the replayed top-k is the whole routing; a capacity factor would need the drop
decisions recorded too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class RoutingTap:
    """Hooks on one model stage's MoE routers (see the module docstring)."""

    def __init__(self, model, spec) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not self.routers or any(r.router_replay is None for r in self.routers):
            raise ValueError("routing needs an MoE model built with moe_enable_routing_replay=True")
        self.k = spec.moe_router_topk
        config = model.config
        self.recompute = getattr(config, "recompute_granularity", None) == "full"
        # every layer checkpointed: a layer's forward runs under no_grad, its recomputation with grad
        self.recompute_all = self.recompute and (config.recompute_method == "uniform"
                                                 or config.recompute_num_layers >= len(self.routers))
        self._again: dict[int, list[torch.Tensor]] = {}  # per layer: targets its recomputation replays
        self.micro_batch = None  # set by the learner before each micro-batch's forward
        self.recorded: torch.Tensor | None = None
        self.changed_share: float | None = None
        self.changed_pairs: tuple[int, int] = (0, 0)  # after a pass with a reference: (changed, compared) pairs
        # the model's (1-based) layer number of each of this stage's routers (a stage holds some layers under PP)
        self.layer_numbers = [r.layer_number for r in self.routers]
        self._replay: torch.Tensor | None = None
        self._reference: torch.Tensor | None = None
        self._shape: tuple[int, int] | None = None
        self._natural: dict[int, torch.Tensor] = {}
        self._changed = torch.zeros(2, dtype=torch.float64)  # changed pairs, pairs
        for layer, router in enumerate(self.routers):
            router.register_forward_pre_hook(self._before(layer))
            router.register_forward_hook(self._after(layer))

    # ------------------------------------------------------------------ the learner's calls

    def begin(self, attention_mask_BT: torch.Tensor) -> None:
        """A pass over the ``[B, T]`` batch starts."""
        b, t = attention_mask_BT.shape
        if self._replay is not None and tuple(self._replay.shape[:2]) != (b, t):
            raise ValueError(f"routing record of {tuple(self._replay.shape[:2])} rows x tokens does not fit the "
                             f"batch's {(b, t)}")
        self._shape = (b, t)
        self.recorded = torch.full((b, t, len(self.routers), self.k), -1, dtype=torch.int16)
        self._changed.zero_()

    def end(self, *, dealt: bool) -> None:
        """The pass ended; ``dealt``: its rows were dealt over the data-parallel replicas (gather them)."""
        from megatron.core import parallel_state

        if dealt and parallel_state.get_data_parallel_world_size() > 1:
            group = parallel_state.get_data_parallel_group()
            shifted = self.recorded.to(torch.int32) + 1  # each row is filled by one replica, 0 elsewhere
            torch.distributed.all_reduce(shifted, op=torch.distributed.ReduceOp.MAX, group=group)
            self.recorded = (shifted - 1).to(torch.int16)
            torch.distributed.all_reduce(self._changed, group=group)
        reference = self._replay if self._replay is not None else self._reference
        self.changed_share = (float(self._changed[0] / self._changed[1])
                              if reference is not None and self._changed[1] > 0 else None)
        self.changed_pairs = ((int(self._changed[0]), int(self._changed[1])) if reference is not None
                              else (0, 0))
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        self.micro_batch = None
        self._again.clear()

    @contextlib.contextmanager
    def replaying(self, record: torch.Tensor) -> Iterator[None]:
        """Passes inside route each token of the batch to ``record``'s experts."""
        if self.recompute and not self.recompute_all:
            raise ValueError("routing replay with full activation recomputation needs every layer recomputed "
                             "(learner.recompute_method=uniform)")
        self._check(record)
        self._replay = record
        try:
            yield
        finally:
            self._replay = None

    @contextlib.contextmanager
    def compare_to(self, record: torch.Tensor) -> Iterator[None]:
        """Passes inside route freely and report ``changed_share`` against ``record``."""
        self._check(record)
        self._reference = record
        try:
            yield
        finally:
            self._reference = None

    def _check(self, record: torch.Tensor) -> None:
        if record.dim() != 4 or tuple(record.shape[2:]) != (len(self.routers), self.k):
            raise ValueError(f"routing record must be [B, T, {len(self.routers)}, {self.k}], "
                             f"got {tuple(record.shape)}")

    # ------------------------------------------------------------------ hooks

    def _tokens(self, record_BTLK: torch.Tensor, layer: int, length: int) -> torch.Tensor:
        """The micro-batch's ``[L * b, k]`` slice of a record, in the router's token order (sequence major)."""
        mb = self.micro_batch
        out = torch.full((len(mb.rows), length, self.k), -1, dtype=torch.long)
        for i, (row, (start, end)) in enumerate(zip(mb.rows, mb.spans)):
            out[i, :end - start] = record_BTLK[row, start:end, layer]
        return out.transpose(0, 1).reshape(-1, self.k)

    def _before(self, layer: int):
        def hook(router, args):
            if self.micro_batch is None or self._shape is None:
                return None  # a forward outside the learner's passes: routed freely, not recorded
            if self._recomputing(router):  # the forward's targets again, in its order (free routing recomputes itself)
                if self._replay is not None:
                    router.router_replay.target_topk_idx = self._again[layer].pop(0)
                return None
            hidden = args[0]
            length = hidden.shape[0]
            logits = torch.nn.functional.linear(hidden.detach().reshape(-1, hidden.shape[-1]).float(),
                                                router.weight.detach().float())
            self._natural[layer] = logits.topk(self.k, dim=-1).indices.sort(dim=-1).values.cpu()
            if self._replay is not None:
                target = self._tokens(self._replay, layer, length).to(hidden.device)
                if (target < 0).any():  # padding: any expert (its output is masked); keep the own choice
                    own = self._natural[layer].to(hidden.device)
                    target = torch.where(target < 0, own, target)
                from megatron.core.transformer.moe.router_replay import RouterReplayAction

                router.router_replay.target_topk_idx = target
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                if self.recompute:
                    self._again.setdefault(layer, []).append(target)
            return None
        return hook

    def _recomputing(self, router) -> bool:
        """A checkpointed layer's recomputation in backward (megatron-core checkpoints in training only; the
        forward ran under no_grad)."""
        return self.recompute_all and router.training and torch.is_grad_enabled()

    def _after(self, layer: int):
        def hook(router, args, output):
            if self.micro_batch is None or self._shape is None or self._recomputing(router):
                return None
            _, routing_map = output  # [L * b, experts] bool: the experts the tokens were sent to
            used = routing_map.detach().nonzero()[:, 1].view(-1, self.k).cpu()
            length = args[0].shape[0]
            mb = self.micro_batch
            used_bLK = used.view(length, len(mb.rows), self.k).transpose(0, 1)
            natural_bLK = self._natural.pop(layer).view(length, len(mb.rows), self.k).transpose(0, 1)
            reference = self._replay if self._replay is not None else self._reference
            for i, (row, (start, end)) in enumerate(zip(mb.rows, mb.spans)):
                if not mb.weight:
                    continue  # a stand-in micro-batch (no rows of this rank)
                self.recorded[row, start:end, layer] = used_bLK[i, :end - start].to(torch.int16)
                if reference is not None:  # tokens the reference has no routing for (-1) are not compared
                    ref = reference[row, start:end, layer].to(torch.long).sort(dim=-1).values
                    known = (ref >= 0).all(dim=-1)
                    self._changed[0] += ((natural_bLK[i, :end - start] != ref).any(dim=-1) & known).sum().item()
                    self._changed[1] += known.sum().item()
            return None
        return hook


class UpdateRouting:
    """One update's routing replay on the policy's :class:`RoutingTap` (``trainer.ppo.routing_replay``).

    * ``none``: every pass routes freely; the top-k changed share of the update against the old pass.
    * ``old_pass``: the routing of the old-log-prob pass (the tap's record after it: ``[B, T, layers of
      this stage, k]`` of the update's rows) is replayed in every micro-batch of every policy-update step.
    * ``rollout``: the engine's routing, carried per token with the rows (``TrainRows.routed_experts_BTX``:
      ``[B, T, model layers x k]`` logical expert ids, -1 where the engine reported none: a token is then
      routed freely), replayed the same way; this stage's layers are picked by the routers' layer numbers.

    The record is keyed by the update's rows: ``mini_batch(select_B)`` hands the mini-batch's rows
    (``record[select_B]``, the rows ``train.batch.mini_batches`` selects, in their order) to the tap,
    which maps them onto the micro-batches by each micro-batch's rows and spans (``RoutingTap._tokens``);
    a pipeline stage replays its own layers. ``finish()``: ``routing/topk_changed_share`` -- the share
    of (token, layer) pairs whose router top-k in the update differs from the reference routing (the
    old pass's, or the rollout's), summed over every rank's pairs (one all-reduce; every rank calls it).
    """

    def __init__(self, tap: RoutingTap, mode: str) -> None:
        from megatron_tir.policy.moe import ROUTING_REPLAY_MODES

        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing replay must be one of {', '.join(ROUTING_REPLAY_MODES)}, got {mode!r}")
        self.tap, self.mode = tap, mode
        self._record: torch.Tensor | None = None
        self._counts = torch.zeros(2, dtype=torch.float64)  # changed pairs, compared pairs

    def start(self, *, old_pass: bool, rollout_BTX: torch.Tensor | None = None) -> None:
        """Call after the old-log-prob pass (``old_pass``: it ran on the policy, so the tap holds its
        record) with the rows' rollout routing where the mode is ``rollout``."""
        self._counts.zero_()
        if self.mode == "rollout":
            if rollout_BTX is None:
                raise ValueError("trainer.ppo.routing_replay=rollout, but the rows carry no rollout routing "
                                 "(the engine did not return routed experts)")
            self._record = self._stage_layers(rollout_BTX)
        else:
            self._record = self.tap.recorded if old_pass else None

    def _stage_layers(self, record_BTX: torch.Tensor) -> torch.Tensor:
        if record_BTX.dim() != 3 or record_BTX.shape[2] % self.tap.k:
            raise ValueError(f"rollout routing must be [B, T, layers x {self.tap.k}], got {tuple(record_BTX.shape)}")
        record_BTLK = record_BTX.view(*record_BTX.shape[:2], -1, self.tap.k)
        if max(self.tap.layer_numbers) > record_BTLK.shape[2]:
            raise ValueError(f"rollout routing has {record_BTLK.shape[2]} layers; this stage's routers reach layer "
                             f"{max(self.tap.layer_numbers)}")
        return record_BTLK[:, :, [n - 1 for n in self.tap.layer_numbers]]

    @contextlib.contextmanager
    def mini_batch(self, select_B: torch.Tensor) -> Iterator[None]:
        """The policy passes inside are of the update's rows ``select_B`` (a bool mask or indices)."""
        if self._record is None:
            yield
            return
        record = self._record[select_B]
        context = self.tap.compare_to(record) if self.mode == "none" else self.tap.replaying(record)
        self.tap.changed_pairs = (0, 0)  # stays so when no pass runs inside (a critic's warm-up step)
        with context:
            yield
        self._counts += torch.tensor(self.tap.changed_pairs, dtype=torch.float64)

    def finish(self) -> dict[str, float]:
        """The update's ``routing/topk_changed_share`` (every rank; nothing without a reference)."""
        if self._record is None:  # no old pass to compare with (the same on every rank: the config decides)
            return {}
        from megatron_tir.policy.parallel import collective_device

        counts = self._counts.to(collective_device())
        torch.distributed.all_reduce(counts)
        self._record = None
        return {"routing/topk_changed_share": float(counts[0] / counts[1])} if counts[1] > 0 else {}


def update_routing(policy, mode: str) -> UpdateRouting | None:
    """The update's routing of ``policy`` (a ``Learner``): None for a dense model, where only ``none`` is
    accepted."""
    tap = getattr(policy, "routing", None)
    if tap is None:
        if mode != "none":
            raise ValueError(f"trainer.ppo.routing_replay={mode} needs an MoE policy (a dense model routes nothing)")
        return None
    return UpdateRouting(tap, mode)
