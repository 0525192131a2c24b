"""The capacity planner's memory model of one trainer GPU (``plan.plan_run`` uses it per stage).

Per pipeline stage and GPU: the policy's parameters, float32 gradient buffers and Adam state;
the activations of one micro-batch at the token budget and how many micro-batches 1F1B keeps in
flight; the loss path on the last stage (logits, log-softmax, the entropy); and, when the recipe
has them, a critic (a second full learner: the policy's backbone with a value head, its own
gradients and optimizer) and a frozen reference (parameters only). The formulas and their
checks against measurement are in ``launch/README.md`` ("Capacity planner").
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

    @classmethod
    def of(cls, spec) -> ModelShape:
        return cls(layers=spec.num_layers, hidden=spec.hidden_size, ffn=spec.ffn_hidden_size,
                   heads=spec.num_attention_heads, kv_heads=spec.num_query_groups, head_dim=spec.head_dim,
                   vocab=spec.vocab_size, tied=spec.tie_word_embeddings, qkv_bias=spec.qkv_bias)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attn + bias + 3 * h * self.ffn + 2 * h  # + the two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        out = 0 if self.tied else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + out + self.hidden


def layer_activation_elems(m: ModelShape, *, tp: int, sp: bool, recompute: str | None) -> float:
    """Elements one transformer layer keeps for backward, per token, on one TP rank.

    Without recomputation (megatron-core's layer with fused / flash attention, no dropout):
    the two norms' inputs and outputs (4h, split over TP only with sequence parallelism),
    Q, K, V after rotary ((q + 2 kv) / tp), the attention output (q / tp, also the output
    projection's input; plus its softmax statistics, negligible), the MLP's fc1 output and its
    SwiGLU output (3 ffn / tp). Full recomputation keeps only the layer's input (h, / tp with
    sequence parallelism). Selective recomputation (core attention) saves the attention
    scores, which fused attention never stores: counted as no saving.
    """
    seq_split = tp if sp else 1
    if recompute == "full":
        return m.hidden / seq_split
    return 4 * m.hidden / seq_split + (m.q_dim + 2 * m.kv_dim) / tp + m.q_dim / tp + 3 * m.ffn / tp


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
                + self.in_flight * self.activation_bytes + self.recompute_bytes + self.logits_bytes)

    @property
    def weight_bytes(self) -> float:
        """What a colocated rank keeps while the engines generate (``policy.memory.TrainingMemory``
        offloads gradient buffers and optimizer state and empties the allocator's cache; the
        weights of every learner stay)."""
        return self.param_bytes + self.critic_weight_bytes + self.reference_bytes


def stage_params(m: ModelShape, *, tp: int, pp: int, stage: int, head: str = "lm") -> float:
    """Parameters of one GPU of pipeline stage ``stage``: its layers over TP, the embedding on
    stage 0, the final norm and the head on the last (``lm``: the vocab-parallel output layer,
    none when tied at PP 1; ``value``: the critic's replicated ``Linear(hidden, 1)``)."""
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
                   reference: bool = False, entropy_chunk_elems: int | None = None) -> list[StagePlan]:
    """Per pipeline stage (one GPU of it): the learner's memory at a micro-batch of ``tokens`` tokens.

    ``entropy``: ``none`` (no entropy), ``diagnostic`` (computed without autograd in chunks of
    ``entropy_chunk_elems`` elements: the trainer's default) or ``grad`` (an entropy bonus in the
    loss). ``critic``: a second learner of the same layout with a value head; ``reference``: a
    frozen copy of the policy's parameters."""
    if entropy not in ("none", "diagnostic", "grad"):
        raise ValueError(f"entropy must be none, diagnostic or grad, got {entropy!r}")
    if entropy_chunk_elems is None:
        from megatron_tir.policy.losses import ENTROPY_CHUNK_ELEMS

        entropy_chunk_elems = ENTROPY_CHUNK_ELEMS
    pbytes = abytes = 2 if dtype == "bfloat16" else 4
    # megatron-core keeps float32 gradient buffers (grad_reduce_in_fp32)
    per_param = pbytes + 4 + optimizer_bytes_per_param(pbytes, dp, distributed_optimizer)
    per_layer = layer_activation_elems(m, tp=tp, sp=sp, recompute=recompute)
    full_layer = layer_activation_elems(m, tp=tp, sp=sp, recompute=None)
    layers = m.layers // pp
    loss_elem = logits_bytes_per_elem(abytes, temperature=temperature, entropy_grad=entropy == "grad")
    out = []
    for stage in range(pp):
        last = stage == pp - 1
        params = stage_params(m, tp=tp, pp=pp, stage=stage)
        act = tokens * layers * per_layer * abytes
        logits = 0.0
        if last:
            act += tokens * 2 * m.hidden / (tp if sp else 1) * abytes  # the final norm's input and output
            elems = tokens * m.vocab / tp
            logits = elems * loss_elem
            if entropy == "diagnostic":
                logits += min(elems, entropy_chunk_elems) * ENTROPY_DIAGNOSTIC_BYTES_PER_CHUNK_ELEM
        in_flight = min(pp - stage, micro_batches) if micro_batches else pp - stage
        critic_params = stage_params(m, tp=tp, pp=pp, stage=stage, head="value") if critic else 0.0
        out.append(StagePlan(
            stage=stage, params=round(params), param_bytes=params * pbytes, grad_bytes=params * 4,
            optimizer_bytes=params * (per_param - pbytes - 4), activation_bytes=act, in_flight=in_flight,
            recompute_bytes=tokens * full_layer * abytes if recompute == "full" else 0.0, logits_bytes=logits,
            critic_bytes=critic_params * per_param, critic_weight_bytes=critic_params * pbytes, reference_bytes=params * pbytes if reference else 0.0))
    return out
