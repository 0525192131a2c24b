"""megatron-tir: multi-turn tool-integrated reasoning RL on Megatron-core (SimpleTIR / ZeroTIR)."""

__version__ = "0.1.0"
