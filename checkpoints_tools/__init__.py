"""HF <-> Megatron checkpoint conversion, TP/PP resharding and logit-parity checks (``tir-ckpt``).

Modules: ``keymap`` (one HF <-> Megatron table per family, with transforms), ``convert``
(streaming conversion both ways), ``layout`` (the on-disk checkpoint layout a training
run also writes), ``megatron_io`` (load/save a live parallel GPTModel), ``reshard``,
``verify``, ``hf_io`` / ``dist_reader`` (one-tensor-at-a-time I/O), ``launch`` (local
gloo ranks), ``cli``.
"""
