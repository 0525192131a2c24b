"""The fake SGLang server's routed experts (``return_routed_experts``), held to sglang 0.5.23
(paths under ``sglang/srt/`` of the pinned wheel, lines as read there):

* the request: ``return_routed_experts`` and ``routed_experts_start_len`` are fields of
  ``managers/io_struct.py:264-268`` ``GenerateReqInput``, the body ``/generate`` is parsed into; its
  JSON contract (``sglang/api/v1/api_types.py:275``, ``decode_GenerateRequest``) types
  ``routed_experts_start_len`` as an i64 and ignores keys it does not name, so both are accepted;
* admission (``managers/scheduler.py:3300-3318``): a ``routed_experts_start_len`` below 0 or above
  the prompt's length finishes the request with an abort of status 400, which the HTTP server
  answers as a 400 error (``managers/tokenizer_manager.py:1918`` raises ValueError,
  ``entrypoints/http_server.py:988-990`` ``_create_error_response``);
* capture (``state_capturer/routed_experts.py:50``): only a server launched with
  ``--enable-return-routed-experts`` (``arg_groups/fields/exec_.py:158``) has a capturer; without
  it ``managers/scheduler_components/batch_result_processor.py:136`` collects nothing and the answer
  has no key;
* the answer (``batch_result_processor.py:136-177``, ``managers/detokenizer_manager.py:466``,
  ``managers/tokenizer_manager.py:2602-2609``): ``meta_info.routed_experts``, the base64 of int32
  ``[seqlen - 1 - start, layers, k]`` logical expert ids of positions start .. seqlen - 2 of
  prompt + output, each row the router's top-k in descending score (``layers/moe/topk.py:2574``
  captures ``topk_ids`` before any logical-to-physical remap).

The ids come from the served model's own router: a transformers forward of the sequence with
``output_router_logits`` (the LocalEngine's model, with whatever weights the server was sent).
"""

from __future__ import annotations

import base64

import torch


def start_len_problem(start: int, prompt_tokens: int) -> str | None:
    """The scheduler's refusal of a ``routed_experts_start_len`` (its messages), or None."""
    if start < 0:
        return f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative routed_experts_start_len."
    if start > prompt_tokens:
        return (f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller routed_experts_start_len.")
    return None


def routed_experts_b64(model, input_ids: list[int], output_ids: list[int], start: int) -> str:
    """``meta_info.routed_experts`` of a request: positions ``start .. len(input + output) - 2``."""
    seq = list(input_ids) + list(output_ids)
    forwarded = seq[:-1]
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(torch.tensor([forwarded], device=model.device), output_router_logits=True).router_logits
    ids = torch.stack([lg.float().topk(k, dim=-1).indices for lg in logits], dim=1)  # [positions, layers, k]
    return base64.b64encode(ids[start:].to(torch.int32).cpu().numpy().tobytes()).decode("utf-8")
