"""The ``/generate`` wire format of SGLang 0.5.x (``sglang/srt/entrypoints/http_server.py``).

Request: ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``,
``top_k``, ``stop``, ``stop_token_ids``, ``no_stop_trim: true``, ``skip_special_tokens:
false``, ``sampling_seed``), ``return_logprob: true`` and a ``rid``. The server stops on
the EOS ids it derives from the model's config and tokenizer only
(``srt/configs/model_config.py``), so the client's own EOS ids travel as
``stop_token_ids``. (``sampling_seed`` takes effect only on servers started with
``--enable-deterministic-inference``.)

Answer: ``output_ids`` are the sampled ids; ``meta_info.output_token_logprobs`` holds
``[logprob, token_id, text|null]`` per id; ``meta_info.finish_reason`` is ``{"type":
"stop", "matched": str|int}`` (an int is the stop/EOS id that ended it), ``{"type":
"length", ...}`` or ``{"type": "abort", ...}``; ``meta_info.cached_tokens`` is the
prompt prefix served from the radix cache; ``meta_info.weight_versions`` says which
version sampled which output tokens and ``meta_info.weight_version`` is the last of them
(``srt/utils/weight_versions.py``: ``compute_weight_version_spans`` covers every output
token, ``add_weight_versions_to_meta_info``); they become ``Generation.versions``, one int
per token (:func:`parse_weight_version`). SGLang's default sampler returns ``log(softmax(logits / T))`` of the
sampled token before top-k / top-p (greedy: at T = 1) -- the local engine's convention.

Routed experts (MoE, ``SamplingParams.routed_experts_from`` = s): the request carries
``return_routed_experts: true`` and ``routed_experts_start_len: s`` (``srt/managers/io_struct.py:264-268``
``GenerateReqInput``; the scheduler aborts the request with a 400 when s is below 0 or above the
prompt's length, ``srt/managers/scheduler.py:3300-3318``); the answer's ``meta_info.routed_experts``
is the base64 of an int32 array ``[prompt + output - 1 - s, layers, k]`` of logical expert ids,
positions s .. prompt + output - 2 (``managers/scheduler_components/batch_result_processor.py:136``
``_maybe_collect_routed_experts``, ``managers/detokenizer_manager.py:466``,
``state_capturer/routed_experts.py:166`` ``extract_routed_experts_from_meta_info``). A server
started without ``--enable-return-routed-experts`` has no capturer (``routed_experts.py:50``) and
leaves the key out: refused here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from megatron_tir.rollout.engines.base import FinishReason, Generation, SamplingParams

NO_ROUTED_EXPERTS = ("meta_info.routed_experts missing: launch the servers with --enable-return-routed-experts "
                     "(SGLang answers without them otherwise)")


class SGLangError(RuntimeError):
    """An SGLang server answered something unusable, or no server could take the request."""


LAUNCH_WEIGHT_VERSION = "default"  # srt/arg_groups/fields/serving.py: --weight-version's default


def parse_weight_version(value: Any, *, where: str = "weight_version") -> int:
    """A server's weight version as an int: ``"default"`` (the launch value) is 0, else a
    non-negative decimal string (the versions this trainer sets); SGLangError otherwise."""
    if value == LAUNCH_WEIGHT_VERSION:
        return 0
    if isinstance(value, str) and value.isdigit() and value.isascii():
        return int(value)
    raise SGLangError(f"{where}: weight version {value!r} is neither {LAUNCH_WEIGHT_VERSION!r} nor a "
                      "non-negative integer (the versions this trainer's weight sync sets)")


def build_generate_request(prompt_ids: Sequence[int], params: SamplingParams, *, rid: str,
                           stop_token_ids: Iterable[int] = ()) -> dict[str, Any]:
    """The JSON body of ``POST /generate`` for one prompt."""
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "no_stop_trim": True,  # keep the stop string's tokens: the trainer trains what was sampled
        "skip_special_tokens": False,
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    stop_ids = sorted({int(t) for t in stop_token_ids})
    if stop_ids:
        sampling["stop_token_ids"] = stop_ids
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    body = {"rid": rid, "input_ids": [int(t) for t in prompt_ids], "sampling_params": sampling,
            "return_logprob": True}
    if params.routed_experts_from is not None:
        body |= {"return_routed_experts": True, "routed_experts_start_len": params.routed_experts_from}
    return body


def _weight_spans(value: Any, n_tokens: int, bad) -> list[dict[str, Any]]:
    """``meta_info.weight_versions`` as ``[{"version", "start", "end"}]`` (objects or [v, s, e] arrays)."""
    if not isinstance(value, list):
        raise bad(f"meta_info.weight_versions is not a list: {value!r}")
    spans = []
    for span in value:
        if isinstance(span, dict):
            version, start, end = span.get("version"), span.get("start"), span.get("end")
        elif isinstance(span, list) and len(span) == 3:
            version, start, end = span
        else:
            raise bad(f"meta_info.weight_versions entry is not {{version, start, end}}: {span!r}")
        if not (isinstance(version, str) and isinstance(start, int) and isinstance(end, int)
                and 0 <= start <= end <= n_tokens):
            raise bad(f"meta_info.weight_versions entry out of range for {n_tokens} tokens: {span!r}")
        spans.append({"version": version, "start": start, "end": end})
    return spans


def parse_generate_response(body: Any, *, prompt_tokens: int, eos_token_ids: Iterable[int],
                            server: str = "", routed_experts_from: int | None = None) -> Generation:
    """A ``/generate`` JSON answer -> Generation; SGLangError naming the broken field otherwise.
    ``routed_experts_from``: the request asked for the routed experts from that position on."""
    where = f"SGLang {server} /generate" if server else "SGLang /generate"

    def bad(what: str) -> SGLangError:
        return SGLangError(f"{where}: {what}")

    if not isinstance(body, dict):
        raise bad(f"expected a JSON object, got {type(body).__name__}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("no meta_info object")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise bad("meta_info.output_token_logprobs missing (was return_logprob dropped?)")
    logprobs, logprob_ids = [], []
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 3):
            raise bad(f"output_token_logprobs[{i}] is not [logprob, token_id, text]: {entry!r}")
        logprob, token_id = entry[0], entry[1]
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or math.isnan(logprob):
            raise bad(f"output_token_logprobs[{i}] has no log-prob: {entry!r}")
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise bad(f"output_token_logprobs[{i}] has a non-integer token id: {entry!r}")
        logprobs.append(float(logprob))
        logprob_ids.append(token_id)
    output_ids = body.get("output_ids", logprob_ids)
    if not (isinstance(output_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in output_ids)):
        raise bad(f"output_ids is not a list of token ids: {output_ids!r}")
    if output_ids != logprob_ids:
        raise bad(f"output_ids ({len(output_ids)}) and output_token_logprobs ({len(logprob_ids)}) disagree")

    reason = meta.get("finish_reason")
    if not isinstance(reason, dict) or not isinstance(reason.get("type"), str):
        raise bad(f"meta_info.finish_reason is not an object with a type: {reason!r}")
    kind, matched_stop, extra = reason["type"], None, {}
    if kind == "stop":
        matched = reason.get("matched")
        if isinstance(matched, str):
            finish, matched_stop = FinishReason.STOP, matched
        elif isinstance(matched, int) and not isinstance(matched, bool):
            finish = FinishReason.EOS
            if matched not in set(eos_token_ids):
                extra["matched_token_id"] = matched  # a stop token the server knows as EOS
        elif isinstance(matched, list) and matched and all(isinstance(t, int) for t in matched):
            finish, extra["matched_token_ids"] = FinishReason.EOS, matched
        else:
            raise bad(f"finish_reason stop has no usable 'matched': {reason!r}")
    elif kind == "length":
        finish = FinishReason.LENGTH
    elif kind == "abort":
        finish = FinishReason.ABORT
        extra["abort_message"] = reason.get("message")
    else:
        raise bad(f"unknown finish_reason type {kind!r}")

    meta_out: dict[str, Any] = {"server": server, **extra}
    for key in ("weight_version", "cached_tokens", "e2e_latency", "id"):
        if meta.get(key) is not None:
            meta_out[key] = meta[key]
    if meta.get("weight_versions"):
        meta_out["weight_versions"] = _weight_spans(meta["weight_versions"], len(output_ids), bad)
    versions = _token_versions(meta_out, len(output_ids), bad)
    if isinstance(meta.get("prompt_tokens"), int) and meta["prompt_tokens"] != prompt_tokens:
        raise bad(f"prompt_tokens {meta['prompt_tokens']} != the {prompt_tokens} ids sent")
    routed = None
    if routed_experts_from is not None and not (finish is FinishReason.ABORT and "routed_experts" not in meta):
        routed = _routed_experts(meta.get("routed_experts"), prompt_tokens + len(output_ids) - 1 - routed_experts_from,
                                 bad)
    return Generation(token_ids=list(output_ids), logprobs=logprobs, finish_reason=finish,
                      matched_stop=matched_stop, prompt_tokens=prompt_tokens, meta=meta_out, versions=versions,
                      routed_experts=routed)


def _routed_experts(value: Any, rows: int, bad):
    """``meta_info.routed_experts`` -> an int32 tensor ``[rows, layers x k]``."""
    import base64

    import numpy as np
    import torch

    if value is None:
        raise bad(NO_ROUTED_EXPERTS)
    if not isinstance(value, str):
        raise bad(f"meta_info.routed_experts is not a base64 string: {type(value).__name__}")
    try:
        flat = np.frombuffer(base64.b64decode(value, validate=True), dtype=np.int32)
    except ValueError as exc:
        raise bad(f"meta_info.routed_experts is not base64 of int32s: {exc}") from None
    if rows < 0 or (rows == 0 and flat.size) or (rows and (flat.size == 0 or flat.size % rows)):
        raise bad(f"meta_info.routed_experts has {flat.size} ids, not a whole number per each of {rows} positions")
    return torch.from_numpy(flat.copy()).view(rows, -1 if rows else 0)


def _token_versions(meta: dict[str, Any], n_tokens: int, bad) -> list[int]:
    """One version per output token from the spans (which must cover them all, in order), or
    from ``weight_version`` when no span is given; SGLangError when neither says."""
    spans = meta.get("weight_versions")
    if not spans:
        if "weight_version" not in meta:
            raise bad("meta_info has no weight_version (SGLang 0.5.23 reports one with every answer)")
        return [parse_weight_version(meta["weight_version"], where="meta_info.weight_version")] * n_tokens
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions):
            raise bad(f"meta_info.weight_versions do not cover the {n_tokens} tokens in order: {spans}")
        versions += [parse_weight_version(span["version"], where="meta_info.weight_versions")] * (
            span["end"] - span["start"])
    if len(versions) != n_tokens:
        raise bad(f"meta_info.weight_versions do not cover the {n_tokens} tokens in order: {spans}")
    return versions


def error_message(body: Any) -> str:
    """The human part of an SGLang error answer ({"error": {"message"}}, {"detail"}, or text)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err:
            return str(err)
        if body.get("detail"):
            return str(body["detail"])
        if body.get("message"):
            return str(body["message"])
    return str(body)[:500]
