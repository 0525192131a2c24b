"""A forward pass over all pipeline stages without megatron's schedules.

``forward_logits`` runs one micro-batch through this rank's GPTModel stage; stages pass
activations ``[S, B, H]`` to the next stage with ``torch.distributed`` send/recv over
megatron's pipeline group (works on gloo and nccl). Only the last stage returns logits.
Used by checkpoint verification; the trainer uses megatron's pipeline schedules instead.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def forward_logits(model, input_ids_BS: torch.Tensor) -> torch.Tensor | None:
    """Logits ``[B, S, V]`` (float32, gathered over TP if the model was built with
    ``parallel_output=False``) on the last pipeline stage; None on other stages."""
    from megatron.core import parallel_state

    model.eval()
    device = next(model.parameters()).device
    input_ids_BS = input_ids_BS.to(device)
    batch, seq = input_ids_BS.shape
    position_ids_BS = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    if not first:
        hidden_SBH = torch.empty(seq, batch, model.config.hidden_size, dtype=model.config.params_dtype,
                                 device=device)
        torch.distributed.recv(hidden_SBH, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden_SBH)
    out = model(input_ids=input_ids_BS, position_ids=position_ids_BS, attention_mask=None)
    if not last:
        torch.distributed.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return out.float()
