"""The capacity planner: will a recipe fit a cluster file, and how many steps does a job get?

``plan_run(cfg, cluster)`` computes, from the model's shape (``model_facts``), the recipe's
layout and budgets and the cluster file, per trainer pipeline stage and GPU: parameter,
gradient and optimizer bytes, activations of one micro-batch at the token budget, the
micro-batches 1F1B keeps in flight, the loss path (logits, log-softmax, entropy), the critic and
the frozen reference when the recipe has them, and the peak (``plan_memory``); with colocated
engines also the generation phase (what a trainer rank keeps plus SGLang's share); per SGLang
server: weights and KV-cache room at its memory fraction; the weight-sync bytes per step;
sandbox calls per step and the slots that keep tool latency hidden (from measured TIR cells);
a step-time estimate, the steps one allocation completes and the time to the first checkpoint.
``Plan.problems`` lists what does not work (a stage or server that does not fit, a TP that does
not divide the heads, a layout start-up refuses); ``Plan.time_problems`` what does not finish
in the allocation (not one step and one checkpoint, or no checkpoint before the end), which
``--allow`` turns into warnings; ``check_plan`` raises them as one ``ValueError``. The formulas, their sources and
their check against measurement are in ``launch/README.md`` ("Capacity planner").
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from megatron_tir.launch.cluster import colocated_problem
from megatron_tir.launch.plan_memory import (  # noqa: F401  (re-exported: the planner's memory model)
    GIB,
    ModelShape,
    StagePlan,
    layer_activation_elems,
    learner_stages,
    logits_bytes_per_elem,
)
log = logging.getLogger(__name__)

# The latency of one TIR code cell in the sandbox cluster, over the 23 cells of bench/data/tir_cells.jsonl
# (sympy, numpy, brute force, sieves, DP, an error, a cell that runs into the 10 s limit), 3 rounds, one
# call at a time on 2 shared cores: `python bench/bench_cells.py --repeats 3 --out bench/data/tir_cells_latency.json`
# (2026-12-06; p50 0.048 s, p99 10.06 s: the time-out). The mean carries the time-out's share.
SANDBOX_CALL_MEAN_S = 0.610
SANDBOX_CALL_P90_S = 0.662


@dataclass(kw_only=True, slots=True, frozen=True)
class Assumptions:
    """What the planner assumes beyond the config and the cluster file (launch/README.md says why)."""

    usable_memory_share: float = 0.9  # of a GPU's memory: CUDA context, NCCL buffers, allocator fragmentation
    prompt_tokens: int = 256  # a SimpleTIR prompt (math problem + instructions)
    mean_response_share: float = 0.28  # mean response length / max_response_tokens (DESIGN.md: ~38M tokens / step)
    mfu: float = 0.25  # model FLOPs utilisation of the learner
    decode_k: float = 68_400.0  # SGLang decode tokens/s per server ~ decode_k * GPUs / params (billions)
    # one TIR code cell in the sandbox (client wall time; measured, see SANDBOX_CALL_MEAN_S)
    sandbox_call_s: float = SANDBOX_CALL_MEAN_S
    sandbox_call_p90_s: float = SANDBOX_CALL_P90_S
    startup_s: float = 900.0  # job start to the first step: containers, weights, servers, warm-up
    checkpoint_s: float = 120.0  # writing a run checkpoint
    sync_link_bytes_s: float = 25e9  # one trainer GPU's NCCL broadcast to the servers (a 400 Gb/s NIC, about half)
    sync_call_s: float = 0.005  # one /update_weights_from_distributed round trip (HTTP + scheduler), per bucket
    sync_tensor_s: float = 5e-5  # one more NCCL broadcast call (the per-tensor format)
    sync_bucket_bytes: int = 256 << 20  # Learner.stage_buckets' default


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
    shape: ModelShape
    ep: int = 1
    etp: int = 1
    gpu_memory_gib: float | None
    usable_bytes: float | None
    stages: list[StagePlan]
    server: ServerPlan | None
    colocated: bool
    generation_bytes: float | None  # colocated: per GPU while the engines generate (trainer's weights + SGLang's share)
    sync_bytes: float  # bf16 weights sent to each server per step
    sync_s: float | None  # one weight sync, per-stage senders (sync_time)
    sandbox_calls: int  # per sampling round, upper bound
    sandbox_call_s: float  # mean latency of a TIR cell (Assumptions)
    sandbox_call_p90_s: float
    sandbox_slots_needed: int
    sandbox_slots: int
    step_s: float | None
    generation_s: float | None
    train_s: float | None
    first_checkpoint_s: float | None
    steps_per_allocation: int | None  # steps a job completes before its time limit (start-up and one checkpoint out)
    wall_s: float
    problems: list[str] = field(default_factory=list)  # the run does not work
    time_problems: list[str] = field(default_factory=list)  # the allocation is too short (--allow: warnings)

    def table(self, *, allow: bool = False) -> str:
        g = lambda b: f"{b / GIB:7.1f}"  # noqa: E731
        lines = [f"model {self.model}: TP {self.tp} x PP {self.pp} x DP {self.dp}, micro-batch budget "
                 f"{self.tokens} tokens; GPU memory {self.gpu_memory_gib or '?'} GiB, usable "
                 f"{g(self.usable_bytes).strip() if self.usable_bytes else '?'} GiB",
                 "trainer, per GPU (GiB)",
                 "  stage  params(B)  weights    grads  optimizer  act/mb  in-flight  recompute  logits   critic"
                 "  reference     peak"]
        for s in self.stages:
            lines.append(f"  {s.stage:5d}  {s.params / 1e9:9.3f}  {g(s.param_bytes)}  {g(s.grad_bytes)}  "
                         f"{g(s.optimizer_bytes)}    {g(s.activation_bytes)}  {s.in_flight:9d}    "
                         f"{g(s.recompute_bytes)}  {g(s.logits_bytes)}  {g(s.critic_bytes)}    "
                         f"{g(s.reference_bytes)}  {g(s.peak_bytes)}")
        if self.shape.is_moe:
            m, s0 = self.shape, self.stages[0]
            lines.append(f"MoE: {m.experts // self.ep} of {m.experts} experts per GPU (EP {self.ep} x ETP {self.etp}), "
                         f"{s0.expert_params / 1e9:.3f} B of the {s0.params / 1e9:.3f} B params; the experts' optimizer "
                         f"state over {self.tp * self.dp // (self.ep * self.etp)} expert-DP ranks, the rest over DP "
                         f"{self.dp}; dispatcher buffers {g(s0.dispatch_bytes).strip()} GiB (in peak); "
                         f"{m.active_params / 1e9:.2f} B of {m.total_params / 1e9:.2f} B params active a token "
                         f"(throughput)")
        if self.server is not None:
            sv = self.server
            lines += [f"sglang: {sv.count} server(s) of TP {sv.tp}, mem_fraction_static {sv.mem_fraction}, per GPU: "
                      f"weights {g(sv.weight_bytes).strip()} GiB, KV room {g(sv.kv_room_bytes).strip()} GiB = "
                      f"{sv.kv_tokens:,} tokens per server"]
        if self.colocated and self.generation_bytes is not None:
            lines.append(f"colocated generation, per GPU: {g(self.generation_bytes).strip()} GiB (the trainer's weights "
                         f"{g(max(s.weight_bytes for s in self.stages)).strip()} GiB after offloading gradients and "
                         f"optimizer state + SGLang's mem_fraction_static)")
        lines.append(f"weight sync: {self.sync_bytes / 1e9:.1f} GB (bf16) to each server per step")
        if self.sync_s is not None:
            lines.append(f"weight sync time: ~{self.sync_s:.1f} s per step (every pipeline stage sends its own)")
        lines.append(f"sandbox: <= {self.sandbox_calls:,} calls per sampling round at {self.sandbox_call_s:.2f} s mean "
                     f"/ {self.sandbox_call_p90_s:.2f} s p90 per TIR cell (bench/bench_cells.py); "
                     f"{self.sandbox_slots_needed} slots keep tool latency hidden, {self.sandbox_slots} available")
        if self.step_s is not None:
            lines.append(f"step: ~{self.step_s / 3600:.2f} h (generation {self.generation_s / 60:.0f} min, "
                         f"training {self.train_s / 60:.0f} min); {self.steps_per_allocation} step(s) per "
                         f"allocation of {self.wall_s / 3600:.2f} h; first checkpoint after ~"
                         f"{self.first_checkpoint_s / 3600:.2f} h")
        lines += [f"REFUSED: {p}" for p in self.problems]
        lines += [f"{'WARNING (--allow)' if allow else 'REFUSED'}: {p}" for p in self.time_problems]
        if not self.refusals(allow=allow):
            lines.append("fits")
        return "\n".join(lines)

    def refusals(self, *, allow: bool = False) -> list[str]:
        """What refuses the run: every problem, and the time problems unless ``allow``."""
        return self.problems + ([] if allow else self.time_problems)


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
    time_problems: list[str] = []
    gpus = cluster.node.gpus_per_node
    world = cluster.trainer.nodes * gpus
    dp = max(1, world // (lc.tp * lc.pp))
    for what, n in (("attention heads", m.heads), ("key/value heads", m.kv_heads)):
        if n % lc.tp:
            problems.append(f"learner.tp={lc.tp} does not divide the model's {n} {what}")
    if m.layers % lc.pp:
        problems.append(f"learner.pp={lc.pp} does not divide the model's {m.layers} layers")
    ep, etp = (lc.ep, lc.tp) if m.is_moe else (1, lc.tp)  # the trainer runs expert tensor parallelism at tp
    if m.is_moe and m.experts % ep:
        problems.append(f"learner.ep={ep} does not divide the model's {m.experts} experts")
    if m.is_moe and (lc.tp * dp) % (ep * etp):
        problems.append(f"learner.ep x tp = {ep * etp} does not divide the {lc.tp * dp} ranks of a pipeline stage")
        ep = 1
    critic = tc.ppo.advantage == "gae"  # train.run builds these two exactly so
    reference = tc.loss.kl_coef > 0 or cfg.critic.kl_reward_coef > 0
    stages = learner_stages(m, tp=lc.tp, pp=lc.pp, dp=dp, tokens=lc.max_tokens_per_microbatch, dtype=lc.dtype,
                            sp=lc.sequence_parallel, recompute=lc.recompute_granularity,
                            distributed_optimizer=lc.distributed_optimizer, temperature=rc.temperature or 1.0,
                            entropy="grad" if tc.loss.entropy_coef > 0 else "diagnostic", critic=critic,
                            reference=reference, ep=ep, etp=etp)
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
    if m.is_moe and m.experts % cluster.sglang.ep:
        problems.append(f"sglang.ep={cluster.sglang.ep} does not divide the model's {m.experts} experts")
    colocated = cluster.sglang.colocated
    problems += [p for p in [colocated_problem(cluster)] if p]
    mem_fraction = cluster.sglang.mem_fraction_static or (0.5 if colocated else 0.85)
    servers = (cluster.trainer.nodes if colocated else cluster.sglang.nodes) * cluster.servers_per_node
    server = generation = None
    if mem_gib:
        kv_per_gpu = max(1, m.kv_heads // s_tp)
        server = ServerPlan(tp=s_tp, count=servers, weight_bytes=m.total_params * 2 / s_tp,
                            kv_room_bytes=mem_fraction * mem_gib * GIB - m.total_params * 2 / s_tp,
                            kv_bytes_per_token=2 * m.layers * kv_per_gpu * m.head_dim * 2, mem_fraction=mem_fraction)
        longest = assume.prompt_tokens + rc.max_response_tokens
        if server.kv_tokens < longest:
            problems.append(f"an SGLang server of TP {s_tp} has KV room for {server.kv_tokens:,} tokens at "
                            f"mem_fraction_static {mem_fraction}, less than one {longest:,}-token trajectory")
        if colocated:  # generation: the server's static share beside what the trainer keeps (policy.memory)
            kept = max(s.weight_bytes for s in stages)
            generation = kept + mem_fraction * mem_gib * GIB
            if generation > usable:
                problems.append(f"colocated generation needs {generation / GIB:.1f} GiB per GPU (the trainer keeps "
                                f"{kept / GIB:.1f} GiB of weights + SGLang's mem_fraction_static {mem_fraction} of "
                                f"{mem_gib} GiB), more than the {usable / GIB:.1f} GiB usable (lower "
                                f"sglang.mem_fraction_static)")
    # sandbox: every model turn may run code (rollout.driver runs a code turn's block, the last turn's too)
    prompts_round = tc.sampling.prompts_per_round
    calls = prompts_round * rc.n_samples * (rc.max_turns if rc.tools else 0)
    mean_response = assume.mean_response_share * rc.max_response_tokens
    slots = cluster.sandbox.workers_per_node * max(1, cluster.sandbox.nodes)
    step_s = gen_s = train_s = first_s = steps_per_job = None
    tflops = cluster.node.gpu_tflops
    slots_needed = 0
    wall_s = _seconds(cluster.time)
    if servers and tflops:
        params_b = m.active_params / 1e9  # MoE: a token computes with its topk experts only
        server_tps = assume.decode_k * s_tp / params_b
        gen_s = prompts_round * rc.n_samples * mean_response / (servers * server_tps)
        # Little's law: in-flight trajectories alternate a turn of decoding and a tool call
        per_seq_tps = servers * server_tps / max(1, rc.max_in_flight)
        turn_s = mean_response / max(1, rc.max_turns) / per_seq_tps
        c = assume.sandbox_call_s
        slots_needed = math.ceil(rc.max_in_flight * c / (c + turn_s)) if calls else 0
        rows = tc.sampling.prompts_per_step * rc.n_samples
        tokens = rows * (assume.prompt_tokens + mean_response)
        passes = 6 * tc.ppo.epochs + (2 if tc.ppo.old_logprobs == "learner" else 0) \
            + (2 * tc.ppo.epochs if lc.recompute_granularity == "full" else 0)
        if critic:  # the critic: a forward for the old values, forward + backward per epoch
            passes += 2 + 6 * tc.ppo.epochs
        if reference:
            passes += 2
        train_s = passes * m.active_params * tokens / (world * tflops * 1e12 * assume.mfu)
        step_s = gen_s + train_s
        ck = tc.checkpoint
        by_steps = ck.every * step_s if ck.every else tc.steps * step_s
        minutes = getattr(ck, "minutes", 0.0) or 0.0
        by_time = math.ceil(minutes * 60 / step_s) * step_s if minutes else math.inf
        first_s = assume.startup_s + min(by_steps, by_time) + assume.checkpoint_s
        steps_per_job = max(0, math.floor((wall_s - assume.startup_s - assume.checkpoint_s) / step_s))
        if steps_per_job < 1:
            time_problems.append(f"a {cluster.time} allocation cannot finish one step and one checkpoint (start-up "
                                 f"~{assume.startup_s / 60:.0f} min + a step ~{step_s / 3600:.2f} h + a checkpoint "
                                 f"~{assume.checkpoint_s / 60:.0f} min): a longer time, or a smaller step "
                                 f"(trainer.sampling.prompts_per_step, rollout.max_response_tokens)")
    sync_s = None if colocated or m.layers % lc.pp else sync_time(spec, pp=lc.pp, assume=assume)["per_stage_s"]
    if first_s is not None and first_s > wall_s and steps_per_job:
        time_problems.append(f"the first checkpoint comes after ~{first_s / 3600:.1f} h (a step is ~"
                             f"{step_s / 3600:.2f} h), later than the wall time {cluster.time}: set "
                             f"trainer.checkpoint.minutes or trainer.checkpoint.every, or a longer time")
    return Plan(model=cfg.model, tp=lc.tp, pp=lc.pp, dp=dp, ep=ep, etp=etp, shape=m,
                tokens=lc.max_tokens_per_microbatch,
                gpu_memory_gib=mem_gib, usable_bytes=usable, stages=stages, server=server, colocated=colocated,
                generation_bytes=generation, sync_bytes=m.total_params * 2, sync_s=sync_s, sandbox_calls=calls,
                sandbox_call_s=assume.sandbox_call_s, sandbox_call_p90_s=assume.sandbox_call_p90_s,
                sandbox_slots_needed=slots_needed, sandbox_slots=slots, step_s=step_s, generation_s=gen_s,
                train_s=train_s, first_checkpoint_s=first_s, steps_per_allocation=steps_per_job, wall_s=wall_s,
                problems=problems, time_problems=time_problems)


def check_plan(plan: Plan, *, where: str, allow: bool = False) -> None:
    """ValueError with every refusal (``allow``: the time problems are logged as warnings instead)."""
    refusals = plan.refusals(allow=allow)
    if refusals:
        raise ValueError(f"{where}: " + "; ".join(refusals) + " (tir-launch plan prints the whole plan)")
    for problem in plan.time_problems:
        log.warning("%s: %s (--allow)", where, problem)
