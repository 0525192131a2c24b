"""The GRPO trainer: typed config and recipes (``config``), the loop (``loop``), run setup
(``run``), rank 0's rollouts (``rollouts``), the update batch (``batch``), run checkpoints
(``checkpoint``), metrics and plots (``metrics``), the turn schedule (``schedule``), prompts
(``data``) and the ``megatron-tir train`` / ``plot`` commands (``cli``)."""
