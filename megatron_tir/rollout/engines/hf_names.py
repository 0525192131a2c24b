"""An HF model's tensors under the names its checkpoint files (and SGLang's loaders) use.

transformers 5 holds a Qwen3-MoE layer's experts fused in memory (``mlp.experts.gate_up_proj``
``[E, 2f, h]``: each expert's gate rows then its up rows; ``mlp.experts.down_proj`` ``[E, h, f]``)
while ``save_pretrained`` writes, and the weight sync sends, one tensor per expert
(``mlp.experts.{e}.gate_proj.weight`` ...). ``file_named_tensors`` gives the state dict plus a
view per expert tensor into the fused ones, so an in-place copy under a file name lands in the
model.
"""

from __future__ import annotations

import torch

_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def file_named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (tensors sharing the model's storage) and, for fused experts, each
    expert's tensors under its file name (views of the fused tensor)."""
    named = dict(model.state_dict())
    for name, tensor in list(named.items()):
        if name.endswith(_FUSED[0]) and tensor.dim() == 3:
            prefix, f = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                named[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :f]
                named[f"{prefix}{e}.up_proj.weight"] = tensor[e, f:]
        elif name.endswith(_FUSED[1]) and tensor.dim() == 3:
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                named[f"{prefix}{e}.down_proj.weight"] = tensor[e]
    return named
