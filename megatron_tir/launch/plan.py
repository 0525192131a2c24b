"""The capacity planner: will a recipe fit a cluster file, and when is its first checkpoint?

``plan_run(cfg, cluster)`` computes, from the model's shape (``model_facts``), the recipe's
layout and budgets and the cluster file, per trainer pipeline stage and GPU: parameter,
gradient and optimizer bytes, activations of one micro-batch at the token budget, the
micro-batches 1F1B keeps in flight, logits and loss buffers, and the peak; per SGLang server:
weights and KV-cache room at its memory fraction; the weight-sync bytes per step; sandbox calls
per step and the slots that keep tool latency hidden; a step-time estimate and the time to the
first checkpoint. ``Plan.problems`` lists what does not work (a stage or server that does not
fit, a TP that does not divide the heads, a wall time shorter than the time to the first
checkpoint); ``check_plan`` raises them as one ``ValueError``. The formulas, their sources and
their check against measurement are in ``launch/README.md`` ("Capacity planner").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1024 ** 3


@dataclass(kw_only=True, slots=True, frozen=True)
class Assumptions:
    """What the planner assumes beyond the config and the cluster file (launch/README.md says why)."""

    usable_memory_share: float = 0.9  # of a GPU's memory: CUDA context, NCCL buffers, allocator fragmentation
    prompt_tokens: int = 256  # a SimpleTIR prompt (math problem + instructions)
    mean_response_share: float = 0.28  # mean response length / max_response_tokens (DESIGN.md: ~38M tokens / step)
    mfu: float = 0.25  # model FLOPs utilisation of the learner
    decode_k: float = 68_400.0  # SGLang decode tokens/s per server ~ decode_k * GPUs / params (billions)
    sandbox_call_s: float = 0.0115  # sandbox cost per call: `sandbox-cluster bench`, sympy+numpy, c=1 p50
    startup_s: float = 900.0  # job start to the first step: containers, weights, servers, warm-up
    checkpoint_s: float = 120.0  # writing a run checkpoint
    sync_link_bytes_s: float = 25e9  # one trainer GPU's NCCL broadcast to the servers (a 400 Gb/s NIC, about half)
    sync_call_s: float = 0.005  # one /update_weights_from_distributed round trip (HTTP + scheduler), per bucket
    sync_tensor_s: float = 5e-5  # one more NCCL broadcast call (the per-tensor format)
    sync_bucket_bytes: int = 256 << 20  # Learner.stage_buckets' default


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


# ----------------------------------------------------------------------------- the learner's memory


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


def logits_bytes_per_elem(activation_bytes: int) -> int:
    """Logits and loss buffers per logit element of one TP rank (``policy.vocab_parallel``): the output
    layer's logits (activation dtype), their float32 copy that megatron-core's vocab-parallel cross
    entropy turns into the softmax in place, its float32 gradient, and the gradient cast back to the
    activation dtype; in float32 the copy and the cast are the same tensors."""
    return activation_bytes + 4 + (4 + activation_bytes if activation_bytes != 4 else 0)


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
    logits_bytes: float  # last stage only

    @property
    def static_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> float:
        return self.static_bytes + self.in_flight * self.activation_bytes + self.recompute_bytes + self.logits_bytes


def learner_stages(m: ModelShape, *, tp: int, pp: int, dp: int, tokens: int, dtype: str, sp: bool,
                   recompute: str | None, distributed_optimizer: bool,
                   micro_batches: int | None = None) -> list[StagePlan]:
    """Per pipeline stage (one GPU of it): the learner's memory at a micro-batch of ``tokens`` tokens."""
    pbytes = abytes = 2 if dtype == "bfloat16" else 4
    # megatron-core keeps float32 gradient buffers (grad_reduce_in_fp32); Adam holds m and v in float32,
    # plus a float32 main copy of 16-bit parameters; the distributed optimizer shards them over DP
    opt_per_param = (12 if pbytes == 2 else 8) / (dp if distributed_optimizer else 1)
    per_layer = layer_activation_elems(m, tp=tp, sp=sp, recompute=recompute)
    full_layer = layer_activation_elems(m, tp=tp, sp=sp, recompute=None)
    layers = m.layers // pp
    out = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        params = layers * m.layer_params / tp
        if first:
            params += m.embedding_params / tp
        if last:
            params += m.hidden + (m.embedding_params / tp if not m.tied or pp > 1 else 0)
        act = tokens * layers * per_layer * abytes
        if last:
            act += tokens * 2 * m.hidden / (tp if sp else 1) * abytes  # the final norm's input and output
        in_flight = min(pp - stage, micro_batches) if micro_batches else pp - stage
        out.append(StagePlan(
            stage=stage, params=round(params), param_bytes=params * pbytes, grad_bytes=params * 4,
            optimizer_bytes=params * opt_per_param, activation_bytes=act, in_flight=in_flight,
            recompute_bytes=tokens * full_layer * abytes if recompute == "full" else 0.0,
            logits_bytes=tokens * m.vocab / tp * logits_bytes_per_elem(abytes) if last else 0.0))
    return out


# ----------------------------------------------------------------------------- the weight sync


def sync_time(model, *, pp: int, assume: Assumptions = Assumptions()) -> dict[str, float]:
    """Seconds of one bf16 weight sync of ``model`` (a name ``model_facts`` knows, or a ModelSpec)
    from a PP-``pp`` learner: ``per_stage_s`` with the trainer's scheme
    (``megatron_tir.rollout.sync.stages``: each stage's sender broadcasts its own flattened
    buckets; the servers take one bucket at a time, so the wire time is the model's bytes at one
    link's speed, plus a round trip per bucket; the TP gathers and the next bucket's
    flattening overlap the wire), and ``through_rank0_s`` with the previous one (the other
    stages' bytes first hop to rank 0 over the same kind of link, then one broadcast per tensor).
    The buckets are the learner's own (``policy.weights.bucket_layout``)."""
    from megatron_tir.policy.weights import bucket_layout

    spec = model
    if isinstance(model, str):
        from megatron_tir.launch.model_facts import model_spec

        spec = model_spec(model)
    if pp < 1 or spec.num_layers % pp:
        raise ValueError(f"pp={pp} does not divide the model's {spec.num_layers} layers")
    layout = bucket_layout(spec, pp, assume.sync_bucket_bytes, 2)
    stage_bytes = [2.0 * sum(math.prod(shape) for bucket in stage for _, shape in bucket) for stage in layout]
    nbytes = sum(stage_bytes)
    buckets = sum(len(stage) for stage in layout)
    tensors = sum(len(bucket) for stage in layout for bucket in stage)
    wire = nbytes / assume.sync_link_bytes_s
    per_stage = wire + buckets * assume.sync_call_s
    hop = sum(stage_bytes[1:]) / assume.sync_link_bytes_s
    through_rank0 = hop + wire + buckets * assume.sync_call_s + tensors * assume.sync_tensor_s
    return {"bytes": nbytes, "buckets": buckets, "tensors": tensors, "per_stage_s": round(per_stage, 2),
            "through_rank0_s": round(through_rank0, 2)}


# ----------------------------------------------------------------------------- the run


@dataclass(kw_only=True, slots=True)
class ServerPlan:
    tp: int
    count: int
    weight_bytes: float  # per GPU
    kv_room_bytes: float  # per GPU, at mem_fraction_static
    kv_bytes_per_token: float  # per GPU
    mem_fraction: float

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_room_bytes // self.kv_bytes_per_token))


@dataclass(kw_only=True, slots=True)
class Plan:
    model: str
    tp: int
    pp: int
    dp: int
    tokens: int
    gpu_memory_gib: float | None
    usable_bytes: float | None
    stages: list[StagePlan]
    server: ServerPlan | None
    sync_bytes: float  # bf16 weights sent to each server per step
    sync_s: float | None  # one weight sync, per-stage senders (sync_time)
    sandbox_calls: int  # per sampling round, upper bound
    sandbox_slots_needed: int
    sandbox_slots: int
    step_s: float | None
    generation_s: float | None
    train_s: float | None
    first_checkpoint_s: float | None
    wall_s: float
    problems: list[str] = field(default_factory=list)

    def table(self) -> str:
        g = lambda b: f"{b / GIB:7.1f}"  # noqa: E731
        lines = [f"model {self.model}: TP {self.tp} x PP {self.pp} x DP {self.dp}, micro-batch budget "
                 f"{self.tokens} tokens; GPU memory {self.gpu_memory_gib or '?'} GiB, usable "
                 f"{g(self.usable_bytes).strip() if self.usable_bytes else '?'} GiB",
                 "trainer, per GPU (GiB)",
                 "  stage  params(B)  weights    grads  optimizer  act/mb  in-flight  recompute  logits     peak"]
        for s in self.stages:
            lines.append(f"  {s.stage:5d}  {s.params / 1e9:9.3f}  {g(s.param_bytes)}  {g(s.grad_bytes)}  "
                         f"{g(s.optimizer_bytes)}    {g(s.activation_bytes)}  {s.in_flight:9d}    "
                         f"{g(s.recompute_bytes)}  {g(s.logits_bytes)}  {g(s.peak_bytes)}")
        if self.server is not None:
            sv = self.server
            lines += [f"sglang: {sv.count} server(s) of TP {sv.tp}, mem_fraction_static {sv.mem_fraction}, per GPU: "
                      f"weights {g(sv.weight_bytes).strip()} GiB, KV room {g(sv.kv_room_bytes).strip()} GiB = "
                      f"{sv.kv_tokens:,} tokens per server"]
        lines.append(f"weight sync: {self.sync_bytes / 1e9:.1f} GB (bf16) to each server per step")
        if self.sync_s is not None:
            lines.append(f"weight sync time: ~{self.sync_s:.1f} s per step (every pipeline stage sends its own)")
        lines.append(f"sandbox: <= {self.sandbox_calls:,} calls per sampling round; {self.sandbox_slots_needed} "
                     f"slots keep tool latency hidden, {self.sandbox_slots} available")
        if self.step_s is not None:
            lines.append(f"step: ~{self.step_s / 3600:.2f} h (generation {self.generation_s / 60:.0f} min, "
                         f"training {self.train_s / 60:.0f} min); first checkpoint after ~"
                         f"{self.first_checkpoint_s / 3600:.2f} h; wall time {self.wall_s / 3600:.2f} h")
        lines += [f"REFUSED: {p}" for p in self.problems] or ["fits"]
        return "\n".join(lines)


def _seconds(text: str) -> float:
    """Slurm time ``[D-]HH:MM:SS`` / ``MM:SS`` / ``MM`` -> seconds."""
    days, _, rest = text.rpartition("-")
    parts = [float(p) for p in rest.split(":")]
    if len(parts) == 1:
        parts = [0.0, parts[0], 0.0]
    elif len(parts) == 2:
        parts = [0.0, *parts]
    h, m, s = parts
    return (float(days) * 86400 if days else 0.0) + h * 3600 + m * 60 + s


def plan_run(cfg, cluster, *, assume: Assumptions = Assumptions(), spec=None) -> Plan:
    """The plan of ``cfg`` (a ``TrainConfig``) on ``cluster`` (a ``Cluster``); see the module docstring."""
    from megatron_tir.launch.model_facts import model_spec

    lc, rc, tc = cfg.learner, cfg.rollout, cfg.trainer
    spec = spec or model_spec(cfg.model)
    m = ModelShape.of(spec)
    problems: list[str] = []
    gpus = cluster.node.gpus_per_node
    world = cluster.trainer.nodes * gpus
    dp = max(1, world // (lc.tp * lc.pp))
    for what, n in (("attention heads", m.heads), ("key/value heads", m.kv_heads)):
        if n % lc.tp:
            problems.append(f"learner.tp={lc.tp} does not divide the model's {n} {what}")
    if m.layers % lc.pp:
        problems.append(f"learner.pp={lc.pp} does not divide the model's {m.layers} layers")
    stages = learner_stages(m, tp=lc.tp, pp=lc.pp, dp=dp, tokens=lc.max_tokens_per_microbatch, dtype=lc.dtype,
                            sp=lc.sequence_parallel, recompute=lc.recompute_granularity,
                            distributed_optimizer=lc.distributed_optimizer)
    mem_gib = cluster.node.gpu_memory_gib
    usable = mem_gib * GIB * assume.usable_memory_share if mem_gib else None
    if usable is not None:
        for s in stages:
            if s.peak_bytes > usable:
                problems.append(f"trainer stage {s.stage} needs {s.peak_bytes / GIB:.1f} GiB per GPU, more than the "
                                f"{usable / GIB:.1f} GiB usable of {mem_gib} GiB (sequence parallelism, activation "
                                f"recomputation or a smaller learner.max_tokens_per_microbatch)")
    # SGLang: heads split over the server's TP; KV heads split or replicated (sglang's
    # model_config.get_num_kv_heads: max(1, kv_heads // tp) when tp >= kv_heads and tp % kv_heads == 0)
    s_tp = cluster.sglang_tp
    if m.heads % s_tp:
        problems.append(f"sglang.tp={s_tp} does not divide the model's {m.heads} attention heads "
                        f"(divisors: {', '.join(str(d) for d in range(1, m.heads + 1) if m.heads % d == 0)})")
    elif m.kv_heads % s_tp and s_tp % m.kv_heads:
        problems.append(f"sglang.tp={s_tp} neither divides nor is a multiple of the model's {m.kv_heads} KV heads")
    colocated = cluster.sglang.colocated
    mem_fraction = cluster.sglang.mem_fraction_static or (0.5 if colocated else 0.85)
    servers = (cluster.trainer.nodes if colocated else cluster.sglang.nodes) * cluster.servers_per_node
    server = None
    if mem_gib:
        kv_per_gpu = max(1, m.kv_heads // s_tp)
        server = ServerPlan(tp=s_tp, count=servers, weight_bytes=m.total_params * 2 / s_tp,
                            kv_room_bytes=mem_fraction * mem_gib * GIB - m.total_params * 2 / s_tp,
                            kv_bytes_per_token=2 * m.layers * kv_per_gpu * m.head_dim * 2, mem_fraction=mem_fraction)
        longest = assume.prompt_tokens + rc.max_response_tokens
        if server.kv_tokens < longest:
            problems.append(f"an SGLang server of TP {s_tp} has KV room for {server.kv_tokens:,} tokens at "
                            f"mem_fraction_static {mem_fraction}, less than one {longest:,}-token trajectory")
    # sandbox: every model turn may run code (rollout.driver runs a code turn's block, the last turn's too)
    prompts_round = tc.sampling.prompts_per_round
    calls = prompts_round * rc.n_samples * (rc.max_turns if rc.tools else 0)
    mean_response = assume.mean_response_share * rc.max_response_tokens
    slots = cluster.sandbox.workers_per_node * max(1, cluster.sandbox.nodes)
    step_s = gen_s = train_s = first_s = None
    tflops = cluster.node.gpu_tflops
    slots_needed = 0
    if servers and tflops:
        params_b = m.total_params / 1e9
        server_tps = assume.decode_k * s_tp / params_b
        gen_s = prompts_round * rc.n_samples * mean_response / (servers * server_tps)
        # Little's law: in-flight trajectories alternate a turn of decoding and a tool call
        per_seq_tps = servers * server_tps / max(1, rc.max_in_flight)
        turn_s = mean_response / max(1, rc.max_turns) / per_seq_tps
        slots_needed = math.ceil(rc.max_in_flight * assume.sandbox_call_s / (assume.sandbox_call_s + turn_s)) \
            if calls else 0
        rows = tc.sampling.prompts_per_step * rc.n_samples
        tokens = rows * (assume.prompt_tokens + mean_response)
        passes = 6 * tc.ppo.epochs + (2 if tc.ppo.old_logprobs == "learner" else 0) \
            + (2 * tc.ppo.epochs if lc.recompute_granularity == "full" else 0)
        train_s = passes * m.total_params * tokens / (world * tflops * 1e12 * assume.mfu)
        step_s = gen_s + train_s
        ck = tc.checkpoint
        by_steps = ck.every * step_s if ck.every else tc.steps * step_s
        minutes = getattr(ck, "minutes", 0.0) or 0.0
        by_time = math.ceil(minutes * 60 / step_s) * step_s if minutes else math.inf
        first_s = assume.startup_s + min(by_steps, by_time) + assume.checkpoint_s
    wall_s = _seconds(cluster.time)
    sync_s = None if colocated or m.layers % lc.pp else sync_time(spec, pp=lc.pp, assume=assume)["per_stage_s"]
    if first_s is not None and first_s > wall_s:
        problems.append(f"the first checkpoint comes after ~{first_s / 3600:.1f} h (a step is ~{step_s / 3600:.2f} h), "
                        f"later than the wall time {cluster.time}: set trainer.checkpoint.minutes or "
                        f"trainer.checkpoint.every, or a longer time")
    return Plan(model=cfg.model, tp=lc.tp, pp=lc.pp, dp=dp, tokens=lc.max_tokens_per_microbatch,
                gpu_memory_gib=mem_gib, usable_bytes=usable, stages=stages, server=server,
                sync_bytes=m.total_params * 2, sync_s=sync_s, sandbox_calls=calls, sandbox_slots_needed=slots_needed,
                sandbox_slots=slots, step_s=step_s, generation_s=gen_s, train_s=train_s, first_checkpoint_s=first_s,
                wall_s=wall_s, problems=problems)


def check_plan(plan: Plan, *, where: str) -> None:
    if plan.problems:
        raise ValueError(f"{where}: " + "; ".join(plan.problems) + " (tir-launch plan prints the whole plan)")
