"""The cold start before RL: ``collect`` (rejection sampling of correct multi-turn trajectories) and
``sft`` (fine-tuning on them through the RL learner, loss on model tokens only).

* :mod:`megatron_tir.sft.collect` -- a model's correct, tool-using, deduplicated trajectories on training prompts;
* :mod:`megatron_tir.sft.examples` -- trajectory files (records with token ids, or messages) as examples;
* :mod:`megatron_tir.sft.loop` -- the fine-tuning run (learner, checkpoints, metrics, resume);
* :mod:`megatron_tir.sft.config` -- its config and recipes; :mod:`megatron_tir.sft.cli` -- the two subcommands.
"""
