"""The training run's typed configuration, its recipes, and ``--set key=value`` overrides.

``TrainConfig`` has one section per component; every default lives in the section's
dataclass (the component's own config where one exists: ``LearnerConfig``, ``RolloutConfig``,
``EngineConfig``, ``SandboxConfig``, ``LossConfig``). A recipe is a function returning a
``TrainConfig`` that differs from the defaults only where it says so. Keys are dotted paths
(``trainer.steps``, ``rollout.max_turns``, ``trainer.loss.clip_high``); values are parsed
by the field's type (``null`` for None, ``true``/``false``, comma-separated tuples); the
section's ``__post_init__`` validates the result. Any error names the key.

The top-level ``model`` is the one place the policy is named: ``learner.model`` and
``engine.model`` follow it. ``trainer.mode`` decides ``rollout.void_turn`` (stop or continue
at a void turn, see :mod:`megatron_tir.rl.rows`); ``rollout.tools=false`` is the text-only
baseline with the same loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_tir import config_io
from megatron_tir.finite import check_finite
from megatron_tir.import_path import is_import_path
from megatron_tir.observe.config import LogConfig
from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.moe import ROUTING_REPLAY_MODES
from megatron_tir.reward import RewardConfig
from megatron_tir.rl import MODES, OVERLONG, LossConfig, needs_values
from megatron_tir.rl.correction import ASYNC_ALIASES, CorrectionConfig
from megatron_tir.rollout.driver import RolloutConfig
from megatron_tir.rollout.factory import EngineConfig, SandboxConfig, engine_kind
from megatron_tir.train.sampling import SAMPLING_STRATEGIES
from megatron_tir.train.critic_update import CriticConfig
from megatron_tir.train.turn_schedule import TurnScheduleConfig

DERIVED_KEYS = ("learner.model", "engine.model")  # set from TrainConfig.model
DECIDED_BY = {"rollout.void_turn": "trainer.mode", "rollout.routed_experts": "trainer.ppo.routing_replay"}  # key -> the key that decides it (TrainConfig.__post_init__)
ALGORITHM_NAMES = ("auto", "policy_gradient", "critic_ppo")  # megatron_tir.train.algorithm.ALGORITHMS, and auto
OLD_LOGPROBS = ("learner", "engine")
ASYNC_MODES = ("off", "one_step", "full")
ASYNC_KEY = "trainer.async"  # the CLI spelling of trainer.asynchrony (``async`` is a Python keyword)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Training and held-out prompts: which set, how many held-out prompts and how they are sampled."""
    # "arithmetic" | "tir_mix" (generated: megatron_tir.data.tasks) | aime24 | math500 | math_train | a parquet file
    train: str = "arithmetic"
    eval: str = "arithmetic"  # held-out prompts: a generated task draws its held-out split
    eval_size: int = 16  # held-out prompts per evaluation (0: no evaluation)
    eval_samples: int = 1  # samples per held-out prompt
    eval_temperature: float | None = None  # None: the rollout temperature
    eval_top_p: float | None = None  # None: the rollout top_p (SimpleTIR evaluates at 0.7)
    shuffle_seed: int = 0  # order of the training prompts
    arithmetic_digits: int = 4  # operand digits of the generated task
    arithmetic_terms: int = 2  # operands of the generated arithmetic task

    def __post_init__(self) -> None:
        if self.eval_size < 0 or self.eval_samples < 1:
            raise ValueError("eval_size must be >= 0 and eval_samples >= 1")
        if self.eval_top_p is not None and not 0 < self.eval_top_p <= 1:
            raise ValueError(f"eval_top_p must be in (0, 1] (or null), got {self.eval_top_p}")
        if self.arithmetic_digits < 1 or self.arithmetic_terms < 2:
            raise ValueError("arithmetic_digits must be >= 1 and arithmetic_terms >= 2")


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """What one step samples: the train batch in prompts, and dynamic sampling to fill it."""
    prompts_per_step: int = 8  # the train batch, in prompts (groups)
    sample_prompts: int | None = None  # prompts sampled per round (dynamic sampling); None: prompts_per_step
    max_rounds: int = 1  # rounds of sampling to fill the train batch before training on what there is
    # "rounds": keep the first prompts_per_step passing groups of up to max_rounds rounds;
    # "oversample": one round, a random pick, a short batch filled by repeats (SimpleTIR's release)
    strategy: str = "rounds"

    def __post_init__(self) -> None:
        if self.strategy not in SAMPLING_STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(SAMPLING_STRATEGIES)}, got {self.strategy!r}")
        for name in ("prompts_per_step", "max_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sample_prompts is not None and self.sample_prompts < self.prompts_per_step:
            raise ValueError(f"sample_prompts ({self.sample_prompts}) must be >= prompts_per_step "
                             f"({self.prompts_per_step})")

    @property
    def prompts_per_round(self) -> int:
        return self.sample_prompts or self.prompts_per_step


@dataclass(kw_only=True, slots=True)
class FilterConfig:
    """Which groups, rows and tokens the update keeps (the mode's filters are in ``trainer.mode``)."""
    drop_zero_std: bool = True  # group filter: groups whose rewards all agree carry no signal
    accuracy_lo: float = 0.0  # group filter: keep groups with accuracy in [lo, hi]
    accuracy_hi: float = 1.0  # see accuracy_lo
    overlong: str = "mask"  # truncated rows: "mask" (no loss) | "keep" | "drop" (no loss, not in the statistics)
    min_group_rows: int = 1  # group filter: groups with fewer counted rows are dropped (release: 4 with "drop")
    low_prob_fraction: float = 0.02  # mode low_prob_filter: share of each row's tokens masked
    high_ratio_bound: float = 5.0  # mode high_ratio_filter: tokens with ratio above it get no loss
    # row filter (ZeroTIR's --use_eval_filter): rows whose response's repeat score (ZeroTIR's repeatness,
    # megatron_tir.observe.zerotir) exceeds it leave the loss (they stay in the group statistics); None: off
    max_repeat_score: float | None = None
    drop_verifier_failures: bool = False  # row filter: rows whose answer check failed (time-out, error) leave the loss

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}")
        if not 0 <= self.accuracy_lo <= self.accuracy_hi <= 1:
            raise ValueError(f"need 0 <= accuracy_lo <= accuracy_hi <= 1, got [{self.accuracy_lo}, {self.accuracy_hi}]")
        if self.min_group_rows < 1:
            raise ValueError(f"min_group_rows must be >= 1, got {self.min_group_rows}")
        if not 0 <= self.low_prob_fraction < 1:
            raise ValueError(f"low_prob_fraction must be in [0, 1), got {self.low_prob_fraction}")
        if not self.high_ratio_bound > 1:
            raise ValueError(f"high_ratio_bound must be > 1, got {self.high_ratio_bound}")
        if self.max_repeat_score is not None and not 0 <= self.max_repeat_score <= 1:
            raise ValueError(f"max_repeat_score must be in [0, 1] (or null), got {self.max_repeat_score}")


@dataclass(kw_only=True, slots=True)
class PPOConfig:
    """Advantages and the update's passes over the batch."""
    advantage: str = "grpo"  # a name in megatron_tir.rl.ESTIMATOR_NAMES: grpo | dr_grpo | reinforce_pp | reinforce_pp_baseline | gae
    epochs: int = 1  # passes over the batch per step
    mini_batches: int = 1  # optimizer steps per epoch
    old_logprobs: str = "learner"  # learner | engine
    # MoE routing replay in the update (megatron_tir.policy.routing.UpdateRouting): none | old_pass (the experts
    # of the old-log-prob pass) | rollout (the engine's routed experts, SGLang); routing/topk_changed_share each step
    routing_replay: str = "none"
    # the update's Algorithm (megatron_tir.train.algorithm): auto (the estimator's family: critic_ppo for gae,
    # policy_gradient otherwise) | policy_gradient | critic_ppo | an import path module:Class of your own
    algorithm: str = "auto"

    def __post_init__(self) -> None:
        needs_values(self.advantage)  # ValueError naming the estimators
        if self.algorithm not in ALGORITHM_NAMES and not is_import_path(self.algorithm):
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHM_NAMES)} or an import path "
                             f"(module:Class), got {self.algorithm!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {', '.join(OLD_LOGPROBS)}, got {self.old_logprobs!r}")
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay must be one of {', '.join(ROUTING_REPLAY_MODES)}, "
                             f"got {self.routing_replay!r}")
        if self.routing_replay == "old_pass" and self.old_logprobs != "learner":
            raise ValueError("routing_replay=old_pass needs old_logprobs=learner (the old pass whose routing is replayed)")
        for name in ("epochs", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When run checkpoints are written and how many are kept."""
    every: int = 0  # steps between run checkpoints (0: only at the end)
    minutes: float = 0.0  # also after the first step that ends this long after the last checkpoint (0: off)
    keep_last: int = 2  # run checkpoints kept (older ones are deleted)
    strict_resume: bool = False  # --resume refuses a damaged newest checkpoint instead of falling back
    allow_unverified: bool = False  # --resume of a run none of whose checkpoints has a manifest (before manifests)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")
        if self.minutes < 0:
            raise ValueError(f"minutes must be >= 0, got {self.minutes}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")


@dataclass(kw_only=True, slots=True)
class StopConfig:
    """When the run stops because it cannot learn (exit 1 with the cause; nothing new is saved)."""
    # a step where more than this share of the trajectories was ended by infrastructure (engine, sandbox) stops
    infra_failure_share: float = 0.5
    steps_without_update: int = 3  # this many consecutive steps without an optimizer update

    def __post_init__(self) -> None:
        if not 0 <= self.infra_failure_share <= 1:
            raise ValueError(f"infra_failure_share must be in [0, 1], got {self.infra_failure_share}")
        if self.steps_without_update < 1:
            raise ValueError(f"steps_without_update must be >= 1, got {self.steps_without_update}")


@dataclass(kw_only=True, slots=True)
class AsyncConfig:
    """Asynchronous training (``--set trainer.async=MODE``, ``trainer.async.KEY=...``): ``off`` is
    synchronous (rollouts, update, sync, in turn). In the other modes the loss takes the decoupled
    objective: the PPO ratio against the learner's recompute at the start of the step (the proximal
    policy), times the detached weight of ``trainer.correction`` (:mod:`megatron_tir.rl.correction`;
    ``auto``: truncated IS ``pi_prox / pi_engine`` per token, the engine's log-probs of the tokens it
    sampled being the behaviour policy's)."""
    # off | one_step (rollouts of step N + 1 run while step N trains, the sync after they finish: every
    # group from one weight version, one behind the learner; step 1 is on-policy) | full (rollouts never stop:
    # groups admitted through the staleness bound, syncs retract requests in flight and they continue under the
    # new weights; megatron_tir.train.group_producer)
    mode: str = "off"
    max_staleness: int = 1  # full: eta, in policy versions (megatron_tir.rollout.staleness.StalenessBound)
    # deprecated, the former spelling of trainer.correction (what its auto mode is in one_step / full):
    # clamp (= tis: min(w, cap)) | mask (= mis: tokens with w > cap leave the loss) | off (= none), low 0
    correction: str = "clamp"
    cap: float = 2.0  # deprecated: C of the behaviour weight (trainer.correction.high)

    def __post_init__(self) -> None:
        if self.mode not in ASYNC_MODES:
            raise ValueError(f"mode must be one of {', '.join(ASYNC_MODES)}, got {self.mode!r}")
        if self.correction not in ASYNC_ALIASES:
            raise ValueError(f"correction must be one of {', '.join(ASYNC_ALIASES)}, got {self.correction!r}")
        if not self.cap >= 1:
            raise ValueError(f"cap must be >= 1, got {self.cap}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The training loop: steps, the TIR mode, sampling, filters, the update, checkpoints, logging."""
    steps: int = 10  # training steps of the run (a resumed run continues to this step)
    mode: str = "simpletir"  # naive | low_prob_filter | high_ratio_filter | stop_without_filter | simpletir
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    loss: LossConfig = field(default_factory=LossConfig)  # the PPO-style policy loss: clipping, KL, entropy, aggregation
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    turn_schedule: TurnScheduleConfig = field(default_factory=TurnScheduleConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    log: LogConfig = field(default_factory=LogConfig)  # trackers, rollout dumps, the per-step line
    asynchrony: AsyncConfig = field(default_factory=AsyncConfig)  # on the command line: trainer.async
    # the engine-vs-learner gap: importance weights / rejection of model tokens, and its metrics (every step)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    eval_every: int = 0  # steps between held-out evaluations (0: at the start and the end only)
    # consecutive steps with a skipped (non-finite gradients) optimizer step or non-finite weights
    # after one before the run stops (a non-finite model is never saved)
    stop_after_nonfinite: int = 3
    seed: int = 0  # torch seed of the trainer (the held-out rollouts use seed + 1)
    progress: bool = True  # progress bars during rollouts and held-out evaluation
    # the default process group's timeout (s): it bounds collectives where every rank does the same work (the
    # longest: a checkpoint's save); rank-0-only phases (rollouts, evaluation) wait through the hand-off instead
    collective_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        self.correction.check_async_alias(self.asynchrony.correction, self.asynchrony.cap)
        if self.correction.mode not in ("auto", "none") and self.ppo.old_logprobs != "learner":
            raise ValueError(f"correction.mode={self.correction.mode} needs ppo.old_logprobs=learner (with the "
                             f"engine's log-probs as the old ones there is no gap to correct)")
        if self.asynchrony.mode != "off" and self.ppo.old_logprobs != "learner":
            raise ValueError(f"trainer.async={self.asynchrony.mode} needs trainer.ppo.old_logprobs=learner (the "
                             f"proximal policy; the engine's log-probs are the behaviour policy's)")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.stop_after_nonfinite < 1:
            raise ValueError(f"stop_after_nonfinite must be >= 1, got {self.stop_after_nonfinite}")
        if self.ppo.mini_batches > self.sampling.prompts_per_step:
            raise ValueError(f"ppo.mini_batches ({self.ppo.mini_batches}) must be <= sampling.prompts_per_step "
                             f"({self.sampling.prompts_per_step})")
        if self.ppo.mini_batches > 1 and self.sampling.prompts_per_step % self.ppo.mini_batches:
            raise ValueError(f"sampling.prompts_per_step ({self.sampling.prompts_per_step}) must be a multiple of "
                             f"ppo.mini_batches ({self.ppo.mini_batches})")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: str = "smollm2"  # the policy to train: "smollm2" | "tiny-qwen2" | an HF directory | a run checkpoint
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # sampling trajectories: group size, turns, budgets, tools
    engine: EngineConfig = field(default_factory=EngineConfig)  # the generation engine: in-process (CPU) or SGLang servers
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where code runs: a local sandbox cluster or a broker
    reward: RewardConfig = field(default_factory=RewardConfig)  # the answer checker (math-verify workers)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # trainer.ppo.advantage=gae only

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be set")
        if self.critic.kl_reward_coef > 0 and not needs_values(self.trainer.ppo.advantage):
            raise ValueError("critic.kl_reward_coef (KL in the reward) needs trainer.ppo.advantage=gae; "
                             "trainer.loss.kl_coef is the KL loss for the other estimators")
        if self.trainer.asynchrony.mode != "off" and self.engine.colocated:  # one_step and full overlap the two
            raise ValueError(f"trainer.async={self.trainer.asynchrony.mode} cannot overlap with engine.colocated=true: "
                             f"generation and training share the GPUs (colocated engines free their memory for "
                             f"training; run the engines on their own GPUs, or trainer.async=off)")
        if self.trainer.ppo.routing_replay == "rollout" and not engine_kind(self.engine.kind).routed_experts:
            raise ValueError(f"trainer.ppo.routing_replay=rollout needs an engine that reports routed experts "
                             f"(engine.kind={self.engine.kind} does not; sglang does, its servers launched with "
                             f"--enable-return-routed-experts); use old_pass")
        check_finite(self)  # every float setting of every section, also when built in code (megatron_tir.finite)
        self.learner.model = self.model
        self.engine.model = self.model
        self.rollout.void_turn = MODES[self.trainer.mode].void_turn  # the mode decides (megatron_tir.rl.rows)
        self.rollout.routed_experts = self.trainer.ppo.routing_replay == "rollout"  # the trajectories carry them


# ----------------------------------------------------------------------------- recipes

def apply_overrides(cfg: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """``cfg`` with every ``key=value`` applied (a new config; :func:`megatron_tir.config_io.apply_overrides`).

    Keys another key decides are refused: ``learner.model`` / ``engine.model`` (the top-level
    ``model``) and ``rollout.void_turn`` (``trainer.mode``).
    """
    spelled = []
    for item in overrides:
        key, eq, text = item.partition("=")
        if key.strip() in DERIVED_KEYS:
            raise ValueError(f"{key.strip()} follows the top-level model; set model={text.strip()} instead")
        spelled.append(_async_key(key.strip()) + eq + text if eq else item)
    return config_io.apply_overrides(cfg, spelled, decided_by=DECIDED_BY)


def _async_key(key: str) -> str:
    """``trainer.async`` -> ``trainer.asynchrony.mode``; ``trainer.async.K`` -> ``trainer.asynchrony.K``."""
    if key == ASYNC_KEY:
        return "trainer.asynchrony.mode"
    if key.startswith(ASYNC_KEY + "."):
        return "trainer.asynchrony." + key[len(ASYNC_KEY) + 1:]
    return key


def to_dict(cfg: TrainConfig) -> dict:
    """A JSON-ready dict of the config (``config.json``)."""
    return config_io.to_dict(cfg)


def from_dict(data: dict) -> TrainConfig:
    """The inverse of :func:`to_dict` (a resolved ``config.json``); sections validate as they are built."""
    return config_io.build(TrainConfig, data)
