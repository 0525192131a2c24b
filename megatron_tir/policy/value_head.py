"""A critic is the policy's GPTModel with a one-output value head (slime's critic, ZeroTIR's PPO).

``attach_value_head(model)`` replaces the last stage's vocab-parallel output layer with a
replicated fp32 ``Linear(hidden, 1)`` (zero-initialised, so every value starts at 0): the
model's output becomes ``[b, s, 1]`` values instead of logits. The layer keeps the output
layer's call contract inside megatron-core's ``GPTModel._postprocess`` (``layer(hidden,
weight=..., runtime_gather_output=...) -> (output, bias)``), so the schedules, DDP and the
distributed optimizer see an ordinary model. Its weight is the same on every tensor-parallel
rank (not marked ``tensor_model_parallel``: grad norm counts it once), and under sequence
parallelism the hidden states are gathered along the sequence first.

The backbone is loaded from the policy's weights (an HF directory or a checkpoint), without
the LM head; the model must be built with untied embeddings (a value head has nothing to tie).
"""

from __future__ import annotations

import torch

VALUE_HEAD_KEY = "output_layer.weight"  # where the value head's weight sits in the state dict


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=torch.float32))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_sbh: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output  # the tied-embedding weight and the vocab gather do not apply
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_sbh = gather_from_sequence_parallel_region(hidden_sbh, tensor_parallel_output_grad=True)
        return torch.nn.functional.linear(hidden_sbh.float(), self.weight), None


def attach_value_head(model) -> None:
    """Swap ``model``'s output layer for a :class:`ValueHead` (last pipeline stage only)."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        raise ValueError("a value head needs a model built with untied embeddings")
    if not getattr(model, "post_process", False):
        return  # not the last stage: nothing to swap
    config = model.config
    model.output_layer = ValueHead(config.hidden_size, sequence_parallel=config.sequence_parallel)
    if torch.cuda.is_available():
        model.output_layer.cuda()
