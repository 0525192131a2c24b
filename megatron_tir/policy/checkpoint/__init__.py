"""Checkpoints of the policy: the on-disk layout (``layout``), HF safetensors I/O (``hf_io``),
the in-process torch_dist writer (``dist_writer``) and save/load of a live GPTModel
(``megatron_io``). Conversion and resharding build on these in ``checkpoints_tools``."""
