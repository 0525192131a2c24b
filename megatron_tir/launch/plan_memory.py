"""The capacity planner's memory model of one trainer GPU (``plan.plan_run`` uses it per stage).

Per pipeline stage and GPU: the policy's parameters, float32 gradient buffers and Adam state;
the activations of one micro-batch at the token budget and how many micro-batches 1F1B keeps in
flight; the loss path on the last stage (logits, log-softmax, the entropy); and, when the recipe
has them, a critic (a second full learner: the policy's backbone with a value head, its own
gradients and optimizer) and a frozen reference (parameters only). The formulas and their
checks against measurement are in ``launch/README.md`` ("Capacity planner").

MoE (Qwen3-MoE: every layer's MLP is ``experts`` experts of width ``moe_ffn``, ``topk`` per token,
a router ``[experts, hidden]`` that megatron-core keeps whole on every rank): a GPU holds
``experts / ep`` experts, each split ``etp``-way (megatron-core's expert tensor parallelism; the
trainer runs ``etp = tp``); the distributed optimizer shards the expert parameters over the
expert-data-parallel ranks (``tp * dp / (ep * etp)`` of a stage) and the rest over DP. A layer's
saved activations hold, per token of the micro-batch (``n = tokens / seq_split`` on a rank), the
router logits, the ``n * topk * etp`` token copies its experts receive (all-to-all over EP, then
all-gathered over ETP), their fc1 and SwiGLU outputs (``3 moe_ffn / etp`` each) and the expert
outputs the combine weighs by the router probabilities; the all-to-all dispatcher's send and
receive buffers of one layer (forward and backward) are ``dispatch_bytes`` (an estimate from the
shapes, not measured). Throughput uses the active parameters (``topk`` experts a token).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3
# the entropy diagnostic's float32 temporaries per chunk (z, z - max, exp, their product), no autograd
ENTROPY_DIAGNOSTIC_BYTES_PER_CHUNK_ELEM = 16


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    experts: int = 0  # MoE: routed experts per layer (0: dense)
    moe_ffn: int = 0  # MoE: an expert's width
    topk: int = 0  # MoE: experts per token

    @classmethod
    def of(cls, spec) -> ModelShape:
        return cls(layers=spec.num_layers, hidden=spec.hidden_size, ffn=spec.ffn_hidden_size,
                   heads=spec.num_attention_heads, kv_heads=spec.num_query_groups, head_dim=spec.head_dim,
                   vocab=spec.vocab_size, tied=spec.tie_word_embeddings, qkv_bias=spec.qkv_bias,
                   experts=spec.num_experts, moe_ffn=spec.moe_ffn_hidden_size, topk=spec.moe_router_topk)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """A layer's attention (projections, QKV bias) and its two RMSNorm weights."""
        h = self.hidden
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attn + bias + 2 * h

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts

    @property
    def expert_params(self) -> int:
        """One expert's SwiGLU MLP (fc1: gate and up, fc2)."""
        return 3 * self.hidden * self.moe_ffn

    @property
    def layer_params(self) -> int:
        if self.is_moe:
            return self.attention_params + self.router_params + self.experts * self.expert_params
        return self.attention_params + 3 * self.hidden * self.ffn

    @property
    def active_layer_params(self) -> int:
        """What one token computes with in a layer (MoE: its ``topk`` experts)."""
        if self.is_moe:
            return self.attention_params + self.router_params + self.topk * self.expert_params
        return self.layer_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        out = 0 if self.tied else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + out + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token computes with (the throughput model's; ``total_params`` for a dense model)."""
        return self.total_params - self.layers * (self.layer_params - self.active_layer_params)


def layer_activation_elems(m: ModelShape, *, tp: int, sp: bool, recompute: str | None,
                           etp: int | None = None) -> float:
    """Elements one transformer layer keeps for backward, per token, on one TP rank.

    Without recomputation (megatron-core's layer with fused / flash attention, no dropout):
    the two norms' inputs and outputs (4h, split over TP only with sequence parallelism),
    Q, K, V after rotary ((q + 2 kv) / tp), the attention output (q / tp, also the output
    projection's input; plus its softmax statistics, negligible), the MLP's fc1 output and its
    SwiGLU output (3 ffn / tp). Full recomputation keeps only the layer's input (h, / tp with
    sequence parallelism). Selective recomputation (core attention) saves the attention
    scores, which fused attention never stores: counted as no saving. An MoE layer's MLP: see the
    module docstring (``etp``: expert tensor parallelism, None: ``tp``).
    """
    seq_split = tp if sp else 1
    if recompute == "full":
        return m.hidden / seq_split
    attention = 4 * m.hidden / seq_split + (m.q_dim + 2 * m.kv_dim) / tp + m.q_dim / tp
    if not m.is_moe:
        return attention + 3 * m.ffn / tp
    etp = tp if etp is None else etp
    copies = m.topk * etp / seq_split  # token copies a rank's experts receive, per token of the micro-batch
    return (attention + m.experts / seq_split + copies * (m.hidden + 3 * m.moe_ffn / etp)
            + m.topk * m.hidden / seq_split)


def dispatch_elems(m: ModelShape, *, tp: int, sp: bool) -> float:
    """Elements per token of the all-to-all dispatcher's buffers of one MoE layer on one rank: the
    permuted copies sent and received, in forward and again (their gradients) in backward."""
    return 4 * m.topk * m.hidden / (tp if sp else 1) if m.is_moe else 0.0


def logits_bytes_per_elem(activation_bytes: int, *, temperature: float = 1.0, entropy_grad: bool = False) -> int:
    """Peak bytes of the loss path per logit element of one TP rank (``policy.losses.TokenLoss``),
    as measured on CPU (``tests/launch/test_plan_loss_memory.py``: a real forward + backward).

    The output layer's logits (``a`` bytes); megatron-core's vocab-parallel cross entropy takes a
    float32 copy (none for float32 logits at temperature 1: it works in place on them) and turns
    it into the softmax in place, and in backward into its own gradient in place; the gradient the
    output layer receives is a tensor of the logits' dtype (``a``). Dividing bf16 logits by a
    temperature other than 1 goes through a float32 cast first (a second float32 tensor while the
    forward runs). So: bf16 8 (T = 1) / 10; float32 8 / 12. The entropy diagnostic (coefficient 0)
    runs without autograd in chunks (``ENTROPY_DIAGNOSTIC_BYTES_PER_CHUNK_ELEM`` per chunk
    element, counted apart); an entropy bonus (``entropy_grad``) keeps ``exp`` and ``z - max``
    (float32) for backward and adds the gradient of that branch: 12 more, measured in both dtypes."""
    a = activation_bytes
    copy = 4 if a != 4 or temperature != 1 else 0
    forward = a + copy + (4 if a != 4 and temperature != 1 else 0)
    backward = a + copy + a
    return max(forward, backward) + (12 if entropy_grad else 0)


@dataclass(kw_only=True, slots=True)
class StagePlan:
    stage: int
    params: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # one micro-batch at the token budget
    in_flight: int  # micro-batches whose activations 1F1B holds at once on this stage
    recompute_bytes: float  # full recomputation: one layer's activations rebuilt during backward
    logits_bytes: float  # last stage only: the loss path (and the entropy diagnostic's chunk)
    critic_bytes: float = 0.0  # the critic's parameters, gradients and optimizer state (trainer.ppo.advantage=gae)
    critic_weight_bytes: float = 0.0  # of which its parameters
    reference_bytes: float = 0.0  # the frozen reference's parameters (a KL term)
    expert_params: int = 0  # MoE: of ``params``, this GPU's share of its stage's experts
    dispatch_bytes: float = 0.0  # MoE: the all-to-all dispatcher's buffers of one layer

    @property
    def static_bytes(self) -> float:
        """The policy's own parameters, gradient buffers and optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> float:
        """Training peak. The critic's step and the policy's run one after the other on the same
        micro-batch budget (the critic's activations are the policy's backbone's, its output one
        value per token), so only their static state adds up; the reference is forward-only."""
        return (self.static_bytes + self.critic_bytes + self.reference_bytes
                + self.in_flight * self.activation_bytes + self.recompute_bytes + self.logits_bytes
                + self.dispatch_bytes)

    @property
    def weight_bytes(self) -> float:
        """What a colocated rank keeps while the engines generate (``policy.memory.TrainingMemory``
        offloads gradient buffers and optimizer state and empties the allocator's cache; the
        weights of every learner stay)."""
        return self.param_bytes + self.critic_weight_bytes + self.reference_bytes


def stage_expert_params(m: ModelShape, *, pp: int, ep: int, etp: int) -> float:
    """MoE: expert parameters of one GPU of a stage (its ``experts / ep`` experts, split ``etp``-way)."""
    return m.layers // pp * m.experts / ep * m.expert_params / etp if m.is_moe else 0.0


def stage_params(m: ModelShape, *, tp: int, pp: int, stage: int, head: str = "lm", ep: int = 1,
                 etp: int | None = None) -> float:
    """Parameters of one GPU of pipeline stage ``stage``: its layers over TP, the embedding on
    stage 0, the final norm and the head on the last (``lm``: the vocab-parallel output layer,
    none when tied at PP 1; ``value``: the critic's replicated ``Linear(hidden, 1)``). MoE: the
    attention over TP, the router whole, the experts over EP and ETP (``etp`` None: ``tp``)."""
    if m.is_moe:
        etp = tp if etp is None else etp
        params = (m.layers // pp * (m.attention_params / tp + m.router_params)
                  + stage_expert_params(m, pp=pp, ep=ep, etp=etp))
    else:
        params = m.layers // pp * m.layer_params / tp
    if stage == 0:
        params += m.embedding_params / tp
    if stage == pp - 1:
        params += m.hidden
        if head == "value":
            params += m.hidden
        elif not m.tied or pp > 1:
            params += m.embedding_params / tp
    return params


def optimizer_bytes_per_param(param_bytes: int, dp: int, distributed_optimizer: bool) -> float:
    """Adam's m and v in float32, plus a float32 main copy of 16-bit parameters, sharded over DP
    by the distributed optimizer."""
    return (12 if param_bytes == 2 else 8) / (dp if distributed_optimizer else 1)


def learner_stages(m: ModelShape, *, tp: int, pp: int, dp: int, tokens: int, dtype: str, sp: bool,
                   recompute: str | None, distributed_optimizer: bool, micro_batches: int | None = None,
                   temperature: float = 1.0, entropy: str = "none", critic: bool = False,
                   reference: bool = False, entropy_chunk_elems: int | None = None, ep: int = 1,
                   etp: int | None = None) -> list[StagePlan]:
    """Per pipeline stage (one GPU of it): the learner's memory at a micro-batch of ``tokens`` tokens.

    ``entropy``: ``none`` (no entropy), ``diagnostic`` (computed without autograd in chunks of
    ``entropy_chunk_elems`` elements: the trainer's default) or ``grad`` (an entropy bonus in the
    loss). ``critic``: a second learner of the same layout with a value head; ``reference``: a
    frozen copy of the policy's parameters. MoE: experts over ``ep`` x ``etp`` (None: ``tp``), their
    optimizer state over the ``tp * dp / (ep * etp)`` expert-data-parallel ranks."""
    if entropy not in ("none", "diagnostic", "grad"):
        raise ValueError(f"entropy must be none, diagnostic or grad, got {entropy!r}")
    if entropy_chunk_elems is None:
        from megatron_tir.policy.losses import ENTROPY_CHUNK_ELEMS

        entropy_chunk_elems = ENTROPY_CHUNK_ELEMS
    etp = tp if etp is None else etp
    if m.is_moe and (tp * dp) % (ep * etp):
        raise ValueError(f"ep*etp = {ep * etp} does not divide the {tp * dp} ranks of a pipeline stage")
    pbytes = abytes = 2 if dtype == "bfloat16" else 4
    # megatron-core keeps float32 gradient buffers (grad_reduce_in_fp32)
    per_param = pbytes + 4 + optimizer_bytes_per_param(pbytes, dp, distributed_optimizer)
    expert_opt = optimizer_bytes_per_param(pbytes, tp * dp // (ep * etp), distributed_optimizer)
    per_layer = layer_activation_elems(m, tp=tp, sp=sp, recompute=recompute, etp=etp)
    full_layer = layer_activation_elems(m, tp=tp, sp=sp, recompute=None, etp=etp)
    layers = m.layers // pp
    loss_elem = logits_bytes_per_elem(abytes, temperature=temperature, entropy_grad=entropy == "grad")
    out = []
    for stage in range(pp):
        last = stage == pp - 1
        params = stage_params(m, tp=tp, pp=pp, stage=stage, ep=ep, etp=etp)
        experts = stage_expert_params(m, pp=pp, ep=ep, etp=etp)
        optimizer = (params - experts) * (per_param - pbytes - 4) + experts * expert_opt
        act = tokens * layers * per_layer * abytes
        logits = 0.0
        if last:
            act += tokens * 2 * m.hidden / (tp if sp else 1) * abytes  # the final norm's input and output
            elems = tokens * m.vocab / tp
            logits = elems * loss_elem
            if entropy == "diagnostic":
                logits += min(elems, entropy_chunk_elems) * ENTROPY_DIAGNOSTIC_BYTES_PER_CHUNK_ELEM
        in_flight = min(pp - stage, micro_batches) if micro_batches else pp - stage
        critic_params = stage_params(m, tp=tp, pp=pp, stage=stage, head="value", ep=ep, etp=etp) if critic else 0.0
        critic_static = critic_params * (pbytes + 4) + (optimizer * critic_params / params if critic else 0.0)
        out.append(StagePlan(
            stage=stage, params=round(params), param_bytes=params * pbytes, grad_bytes=params * 4,
            optimizer_bytes=optimizer, activation_bytes=act, in_flight=in_flight,
            recompute_bytes=tokens * full_layer * abytes if recompute == "full" else 0.0, logits_bytes=logits,
            critic_bytes=critic_static, critic_weight_bytes=critic_params * pbytes,
            reference_bytes=params * pbytes if reference else 0.0, expert_params=round(experts),
            dispatch_bytes=tokens * dispatch_elems(m, tp=tp, sp=sp) * abytes))
    return out
