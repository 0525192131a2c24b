"""The Megatron policy: what the model is, how it is built and split, its weights, and its learner.

Modules: ``spec`` (``ModelSpec`` from an HF config), ``build`` (this rank's GPTModel stage),
``parallel`` (process groups, local gloo ranks), ``cpu_compat`` (megatron-core without a GPU),
``keymap`` (the one HF <-> Megatron key map), ``checkpoint`` (on-disk layout, HF and torch_dist
I/O, model and learner save/load), ``weights`` (HF weights into and out of a live model),
``learner`` (``Learner``: head-agnostic forward passes and train steps, weight export) with
``learner_config`` (its config) and ``learner_contract`` (what a step takes and returns), ``losses`` (the policy's log-probs, entropy and losses from its logits,
and SFT's NLL), ``microbatch`` and ``vocab_parallel``.

Importing this package or a light submodule does not import megatron-core; the learner
and the model builder do.
"""

from importlib import import_module

# Resolved on first use (PEP 562), so that importing a light submodule (keymap, spec,
# checkpoint) does not import the learner and with it megatron-core.
_EXPORTS = {
    "Learner": "megatron_tir.policy.learner",
    "LearnerConfig": "megatron_tir.policy.learner_config",
    "LossFn": "megatron_tir.policy.learner_contract",
    "LossInputs": "megatron_tir.policy.learner_contract",
    "NLLLoss": "megatron_tir.policy.losses",
    "OutputFn": "megatron_tir.policy.learner_contract",
    "TokenLoss": "megatron_tir.policy.losses",
    "TokenLossFn": "megatron_tir.policy.learner_contract",
    "TokenOutputs": "megatron_tir.policy.losses",
    "StepResult": "megatron_tir.policy.learner_contract",
    "TrainBatch": "megatron_tir.policy.learner_contract",
    "ModelSpec": "megatron_tir.policy.spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
