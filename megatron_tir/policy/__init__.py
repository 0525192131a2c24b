"""The Megatron policy: a typed model spec from an HF config, the GPTModel builder, CPU shims.

Import cost is small: megatron-core is imported only when a model is built.
"""

from megatron_tir.policy.spec import ModelSpec

__all__ = ["ModelSpec"]
