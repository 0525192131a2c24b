"""GPU checks run by tests/gpu/run_on_device.sh on a lent GPU (one H200): results as JSON.

    python tests/gpu/device_checks.py --out OUT/device_checks.json

1. ``update_policy``: the trainer's whole update (old log-probs, two PPO epochs, the max-ratio
   all-reduce) on a single NCCL rank, tiny Qwen2 in bf16 with megatron-core's local layer spec.
2. bf16 log-prob parity: the learner's log-probs against transformers' in bf16 (and float32).
3. Activation bytes of one transformer layer shaped as one TP rank of Qwen2.5-7B (TP 4) and
   Qwen2.5-32B (TP 8) at the recipes' token budget, without and with full recomputation, beside
   the capacity planner's figure for the same layer (``megatron_tir.launch.plan``).
4. Throughput: forward+backward tokens/s of those layers (-> MFU) and of the tiny learner's step.

5. With Transformer Engine: the TE layer spec's module names and ``_extra_state`` in the learner's
   state dict, and FP8 GEMMs on every micro-batch shape the planner pads for FP8 + sequence parallelism
   at TP 2/4/8, fed as one rank's local shard (``LayerNormLinear`` checks it), on one GPU; the old
   ``lcm(TP, 16)`` padding is shown refused.
6. Loss-path memory: peak bytes of the vocab-parallel log-prob (forward + backward) per logit element
   against the planner's ``logits_bytes_per_elem``.

Each check is independent: a failure is recorded with its error and the others still run.
Without a GPU the script says so and exits 1. ``--imports-only`` (the CPU ``--check`` of
run_on_device.sh) imports what every check imports and loads the carried tiny model, on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "megatron_tir" / "train"),
                str(ROOT / "tests" / "megatron_tir" / "policy"), str(ROOT / "tests" / "gpu")]

LAYER_CASES = (  # (recipe model, TP, tokens of a micro-batch): the SimpleTIR recipes' layouts
    ("Qwen2.5-7B", 4, 32768),
    ("Qwen2.5-32B", 8, 32768),
)


def _te_imports() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: the TE variant is skipped (recorded in env.txt)
        return False
    return True


def check_update_policy() -> dict:
    from crafted_rollouts import C, group

    from megatron_tir.policy.learner import Learner
    from megatron_tir.train.config import apply_overrides
    from megatron_tir.train.recipes import tiny_cpu
    from megatron_tir.train.algorithm import build_algorithm
    from megatron_tir.train.batch import StepRollouts

    cfg = apply_overrides(tiny_cpu(), ["learner.dtype=bfloat16", "trainer.ppo.epochs=2",
                                       "trainer.loss.entropy_coef=0"])
    learner = Learner(cfg.learner)
    assert next(learner._model.parameters()).is_cuda
    groups = [group(0, (C, 1.0, (-0.5, -1.0, -2.0)), (C, 0.0, (-0.7, -0.2, -1.5))),
              group(1, (C, 1.0, (-0.1, -3.0, -0.4)), (C, 0.0, (-1.1, -0.9, -2.2)))]
    t0 = time.perf_counter()
    metrics = build_algorithm(cfg, learner).update(1, StepRollouts.of_groups(groups, cfg), {}).metrics
    keep = ("train/optimizer_steps", "train/max_ratio", "train/grad_norm", "train/loss", "train/skipped_steps")
    out = {k: metrics.get(k) for k in keep} | {"seconds": time.perf_counter() - t0}
    assert metrics["train/optimizer_steps"] == 2 and metrics["train/skipped_steps"] == 0
    return out


def _hf_logprobs(hf_dir, tokens_BT, attention_mask_BT, dtype) -> torch.Tensor:
    """transformers' per-token log-probs (as the learner's columns) with the model in ``dtype`` on the GPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).cuda().eval()
    out = torch.zeros(tokens_BT.shape)
    with torch.no_grad():
        for b in range(tokens_BT.shape[0]):
            idx = attention_mask_BT[b].nonzero().flatten()
            s, e = int(idx[0]), int(idx[-1]) + 1
            ids = tokens_BT[b:b + 1, s:e].cuda()
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            out[b, s + 1:e] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0].cpu()
    return out


def check_logprob_parity() -> dict:
    from learner_testing import make_batch

    from megatron_tir.model_sources import resolve_model
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig

    out = {}
    batch = make_batch(1, rows=4, length=64, vocab=49152)
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 5e-2)):
        learner = Learner(LearnerConfig(model="tiny-qwen2", dtype=dtype, lr=1e-5))
        lp = learner.logprobs(batch.tokens_BT, batch.attention_mask_BT)
        ref = _hf_logprobs(resolve_model("tiny-qwen2"), batch.tokens_BT, batch.attention_mask_BT,
                           getattr(torch, dtype))
        diff = float((lp - ref).abs().max())
        out[dtype] = {"max_abs_diff": diff, "tolerance": tol, "ok": diff <= tol}
        del learner
    assert all(v["ok"] for v in out.values()), out
    return out


def _layer(model: str, tp: int, recompute: str | None):
    """A two-layer TransformerBlock with one TP rank's shapes (heads, KV heads and FFN / TP) at TP=1."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_tir.launch.model_facts import model_spec
    from megatron_tir.policy.build import layer_spec

    spec = model_spec(model)
    rank = spec.__class__(**{**spec.to_dict(), "num_attention_heads": spec.num_attention_heads // tp,
                             "num_query_groups": spec.num_query_groups // tp,
                             "ffn_hidden_size": spec.ffn_hidden_size // tp, "num_layers": 2, "dtype": "bfloat16"})
    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    config = rank.transformer_config(tp=1, pp=1, kv_channels=spec.head_dim, **kw)
    block = TransformerBlock(config, layer_spec(rank, use_te=False), post_layer_norm=False).cuda()
    return block, spec, rank


def check_layer_activations() -> list[dict]:
    from megatron_tir.launch.plan import ModelShape, layer_activation_elems

    rows = []
    for model, tp, tokens in LAYER_CASES:
        for recompute in (None, "full"):
            block, spec, rank = _layer(model, tp, recompute)
            block.train()
            x = torch.randn(tokens, 1, spec.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            y = block(hidden_states=x, attention_mask=None)
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()  # saved for backward
            y.float().sum().backward()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            planner = layer_activation_elems(ModelShape.of(spec), tp=tp, sp=False, recompute=recompute) * 2
            flops = 6 * 2 * ModelShape.of(spec).layer_params / tp * tokens * (4 / 3 if recompute else 1)
            rows.append({"model": model, "tp": tp, "tokens": tokens, "recompute": recompute,
                         "measured_bytes_per_token_per_layer": kept / tokens / 2,
                         "planner_bytes_per_token_per_layer": planner,
                         "ratio_planner_over_measured": planner / (kept / tokens / 2),
                         "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
                         "fwd_bwd_tokens_per_s_per_layer": tokens / seconds * 2,
                         "tflops": flops / seconds / 1e12})
            del block, x, y
            torch.cuda.empty_cache()
    return rows


def check_learner_throughput() -> dict:
    from learner_testing import make_batch

    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.losses import TokenLoss
    from megatron_tir.rl import LossConfig, PolicyLoss

    learner = Learner(LearnerConfig(model="tiny-qwen2", dtype="bfloat16", lr=1e-5, max_tokens_per_microbatch=8192))
    batch = make_batch(2, rows=32, length=1024, vocab=49152)
    batch.extras.update(old_logprobs_BT=torch.zeros(batch.tokens_BT.shape),
                        advantages_BT=batch.extras["advantages"].unsqueeze(1).expand_as(batch.loss_mask_BT).clone())
    loss = TokenLoss(token_loss=PolicyLoss(LossConfig()), temperature=1.0, with_entropy=False)
    learner.train_step(batch, loss)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 3
    for _ in range(steps):
        learner.train_step(batch, loss)
    torch.cuda.synchronize()
    tokens = int(batch.attention_mask_BT.sum()) * steps
    return {"model": "tiny-qwen2", "tokens_per_s": tokens / (time.perf_counter() - t0)}


def check_te_fp8_shapes() -> dict:
    """TE spec names and ``_extra_state`` (learner on TE), and FP8 GEMMs on the planned FP8 + SP shapes."""
    import math

    import transformer_engine.pytorch as te

    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.microbatch import plan_microbatches

    learner = Learner(LearnerConfig(model="tiny-qwen2", dtype="bfloat16", lr=1e-5))
    names = sorted({type(m).__name__ for m in learner._model.modules() if type(m).__module__.startswith(
        ("megatron.core.extensions.transformer_engine", "transformer_engine"))})
    extra = [k for k in learner._model.state_dict() if k.endswith("_extra_state")]
    assert names and extra, (names, extra[:3])
    del learner
    fp8 = getattr(te, "autocast", None) or te.fp8_autocast  # TE >= 2.8 names it autocast
    hidden = 256
    layer = te.LayerNormLinear(hidden, 512, params_dtype=torch.bfloat16).cuda()
    attn = torch.zeros(6, 700, dtype=torch.bool)
    for b, n in enumerate((700, 333, 129, 64, 17, 1)):
        attn[b, :n] = True
    shapes, refused_old = [], {}
    for tp in (2, 4, 8):
        pad = LearnerConfig(tp=tp, sequence_parallel=True, fp8="e4m3").pad_multiple
        for mb in plan_microbatches(attn, max_tokens=1024, pad_to=pad):
            x = torch.randn(mb.length // tp, len(mb.rows), hidden, device="cuda", dtype=torch.bfloat16)
            with fp8(enabled=True):
                layer(x)  # raises if TE refuses the local shard (utils.py assert_dim_for_fp8_exec)
            shapes.append((tp, len(mb.rows), mb.length))
        old = math.lcm(tp, 16)
        try:
            with fp8(enabled=True):
                layer(torch.randn(old // tp, 1, hidden, device="cuda", dtype=torch.bfloat16))
            refused_old[tp] = False
        except (ValueError, AssertionError, RuntimeError):
            refused_old[tp] = True
    assert refused_old[4] and refused_old[8], refused_old  # lcm(TP, 16) / TP = 4 and 2 rows of a shard: not % 8
    return {"te_module_names": names, "extra_state_keys": len(extra), "fp8_sp_shapes_ok": shapes,
            "old_padding_refused": refused_old}


def check_loss_path_memory() -> dict:
    """Peak of the vocab-parallel log-prob forward + backward per logit element vs the planner."""
    from megatron_tir.launch.plan import logits_bytes_per_elem
    from megatron_tir.policy.vocab_parallel import token_logprobs

    rows = []
    for tokens, vocab in ((4096, 49152), (8192, 152064 // 4)):  # tiny-qwen2's vocab; Qwen2.5's at TP 4
        logits = torch.randn(tokens, 1, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (tokens, 1), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        token_logprobs(logits, target, 1.0).sum().backward()
        torch.cuda.synchronize()
        measured = (torch.cuda.max_memory_allocated() - before) / (tokens * vocab)
        planner = logits_bytes_per_elem(2) - 2  # the logits themselves are counted before `before`
        rows.append({"tokens": tokens, "vocab_per_rank": vocab, "measured_bytes_per_elem": measured,
                     "planner_bytes_per_elem_beyond_logits": planner, "ratio_measured_over_planner": measured / planner})
        del logits, target
        torch.cuda.empty_cache()
    return {"rows": rows}


def imports_only() -> int:
    """CPU: import what every check imports, then load the carried tiny model (transformers and the learner)."""
    import importlib

    for name in ("crafted_rollouts", "learner_testing", "megatron_tir.policy.learner", "megatron_tir.train.config",
                 "megatron_tir.train.loop", "megatron_tir.train.run", "megatron_tir.model_sources",
                 "megatron_tir.policy.losses", "megatron_tir.rl", "megatron_tir.launch.plan",
                 "megatron_tir.launch.model_facts", "megatron_tir.policy.build", "megatron_tir.policy.microbatch",
                 "megatron_tir.policy.vocab_parallel", "megatron_tir.policy.parallel", "megatron_tir.policy.weights",
                 "megatron_tir.rollout.sync.sglang", "megatron.core.transformer.transformer_block", "transformers",
                 "safetensors", "tqdm", "zmq", "msgspec", "aiohttp", "psutil", "nccl_sync_check"):
        importlib.import_module(name)
    from transformers import AutoModelForCausalLM

    from megatron_tir.model_sources import resolve_model
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel

    hf_dir = resolve_model("tiny-qwen2")
    AutoModelForCausalLM.from_pretrained(hf_dir)
    init_parallel(1, 1)
    learner = Learner(LearnerConfig(model="tiny-qwen2", lr=1e-5))
    tokens = torch.randint(0, 49152, (2, 16))
    lp = learner.logprobs(tokens, torch.ones_like(tokens, dtype=torch.bool))
    assert lp.shape == (2, 16) and torch.isfinite(lp).all()
    print(f"imports ok; tiny-qwen2 from {hf_dir} loaded by transformers and the learner", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--imports-only", action="store_true", help="CPU: imports and the tiny model only")
    args = p.parse_args()
    if args.imports_only:
        return imports_only()
    if args.out is None:
        p.error("--out is required")
    if not torch.cuda.is_available():
        print("device_checks: no CUDA GPU", file=sys.stderr)
        return 1
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(1, 1, backend="nccl")
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    te_checks = (("te_fp8_sp_shapes", check_te_fp8_shapes),) if _te_imports() else ()
    for name, fn in (("update_policy_nccl_bf16", check_update_policy), ("logprob_parity", check_logprob_parity),
                     *te_checks, ("loss_path_memory", check_loss_path_memory),
                     ("layer_activations", check_layer_activations), ("learner_throughput", check_learner_throughput)):
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": True, "result": fn()}
        except Exception as exc:  # noqa: BLE001 - recorded, the next check runs
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-4000:]}
        results[name]["seconds"] = time.perf_counter() - t0
        print(f"{name}: {'ok' if results[name]['ok'] else results[name]['error']} "
              f"({results[name]['seconds']:.1f} s)", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(v["ok"] for k, v in results.items() if isinstance(v, dict) and "ok" in v) else 1


if __name__ == "__main__":
    sys.exit(main())
