"""The Megatron policy: what the model is, how it is built and split, its weights, and its learner.

Modules: ``spec`` (``ModelSpec`` from an HF config), ``build`` (this rank's GPTModel stage),
``parallel`` (process groups, local gloo ranks), ``cpu_compat`` (megatron-core without a GPU),
``keymap`` (the one HF <-> Megatron key map), ``checkpoint`` (on-disk layout, HF and torch_dist
I/O, model save/load), ``weights`` (HF weights into and out of a live model), ``learner``
(``Learner``: log-probs, train steps, checkpoints, weight sync) with ``learner_config``,
``microbatch`` and ``vocab_parallel``.

Import cost is small: megatron-core is imported only when a model is built.
"""

from megatron_tir.policy.learner import Learner
from megatron_tir.policy.learner_config import LearnerConfig, LossFn, StepResult, TrainBatch
from megatron_tir.policy.spec import ModelSpec

__all__ = ["Learner", "LearnerConfig", "LossFn", "ModelSpec", "StepResult", "TrainBatch"]
