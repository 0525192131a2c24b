"""HF <-> Megatron checkpoint conversion, TP/PP resharding and logit-parity checks (``tir-ckpt``).

Modules: ``convert`` (streaming conversion both ways), ``reshard``, ``verify``,
``dist_reader`` (one-tensor-at-a-time reads of torch_dist files), ``cli``. What a training
run shares with them lives in ``megatron_tir.policy``: the key map (``keymap``), the
checkpoint layout, HF I/O, the torch_dist writer and model save/load (``checkpoint``), and
local gloo ranks (``parallel``).
"""
