"""The learner in one process (TP=1): log-probs against transformers and the local engine,
micro-batch independence, skipped steps, save -> load, config errors."""

from __future__ import annotations

import asyncio

import pytest
import torch
from learner_testing import hf_logprobs, make_batch, ppo_loss, ppo_token_loss

from megatron_tir.policy.checkpoint.learner_io import load_learner, save_learner
from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.policy.losses import TokenLoss


def _learner(parallel_1x1, **kw):
    from megatron_tir.policy.learner import Learner

    return Learner(LearnerConfig(**{"model": "tiny-qwen2", "lr": 1e-4, **kw}))


@pytest.fixture(scope="module")
def tiny_learner(parallel_1x1):
    return _learner(parallel_1x1, max_tokens_per_microbatch=24)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_equal_transformers_tiny_qwen2(tiny_learner, temperature):
    from megatron_tir.model_sources import resolve_model

    batch = make_batch(1)
    lp, ent = tiny_learner.logprobs(batch.tokens_BT, batch.attention_mask_BT, temperature=temperature,
                                    with_entropy=True)
    ref_lp, ref_ent = hf_logprobs(resolve_model("tiny-qwen2"), batch.tokens_BT, batch.attention_mask_BT,
                                  temperature=temperature)
    print(f"parity tiny-qwen2 tp1 T={temperature}: max |logp - transformers| = {(lp - ref_lp).abs().max():.2e}")
    assert lp.dtype == torch.float32 and lp.shape == batch.tokens_BT.shape
    assert (lp - ref_lp).abs().max() <= 1e-4 and (ent - ref_ent).abs().max() <= 1e-4
    assert (lp[~batch.attention_mask_BT] == 0).all() and (lp[:, 0] == 0).all() and lp[1, 2] == 0  # row starts
    assert (lp[batch.attention_mask_BT] != 0).sum() == batch.attention_mask_BT.sum() - 4


def test_logprobs_equal_transformers_smollm2(parallel_1x1, smollm2_dir):
    learner = _learner(parallel_1x1, model="smollm2")
    ids = learner.tokenizer(["def f(x):\n    return x * 2\n", "The answer is \\boxed{42}."],
                            return_tensors="pt", padding=True)
    tokens, mask = ids.input_ids, ids.attention_mask.bool()
    lp = learner.logprobs(tokens, mask)
    ref, _ = hf_logprobs(smollm2_dir, tokens, mask)
    print(f"parity smollm2 tp1: max |logp - transformers| = {(lp - ref).abs().max():.2e}")
    assert (lp - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_local_engines_sampled_logprobs(tiny_learner, temperature):
    """Before any update the importance ratio of sampled tokens is 1 within 1e-4."""
    from megatron_tir.rollout.engines.base import SamplingParams
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

    prompt = tiny_learner.tokenizer("Compute 2 + 3 with python.").input_ids

    async def sample():
        engine = LocalEngine(LocalEngineConfig(model="tiny-qwen2", eos_token_ids=(0,)))
        try:
            return await asyncio.gather(*(engine.generate(prompt, SamplingParams(
                max_new_tokens=12, temperature=temperature, seed=s)) for s in range(3)))
        finally:
            await engine.close()

    gens = asyncio.run(sample())
    rows = [prompt + g.token_ids for g in gens]
    T = max(map(len, rows))
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = True
    lp = tiny_learner.logprobs(tokens, mask, temperature=temperature)
    for b, g in enumerate(gens):
        ours = lp[b, len(prompt):len(prompt) + len(g.token_ids)]
        ratio = torch.exp(ours - torch.tensor(g.logprobs))
        print(f"parity local engine T={temperature} row {b}: max |ratio - 1| = {(ratio - 1).abs().max():.2e}")
        assert (ratio - 1).abs().max() <= 1e-4, (b, ratio)


def _grads_and_step(learner, batch, aggregation, token_loss=ppo_token_loss, temperature=1.0, loss_fn=None):
    """One step's result and its gradients (DDP's main grads); the weights are put back. The loss is
    ``loss_fn`` or, by default, ``token_loss`` on log-probs and entropy at ``temperature``."""
    params = dict(learner.module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    if loss_fn is None:
        loss_fn = TokenLoss(token_loss=token_loss, temperature=temperature, with_entropy=True)
    result = learner.train_step(batch, loss_fn, aggregation=aggregation)
    grads = {n: p.main_grad.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        p.data.copy_(before[n])
    return result, grads


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_one_or_four_micro_batches_give_the_same_step(parallel_1x1, aggregation):
    batch = make_batch(2)
    one = _learner(parallel_1x1, max_tokens_per_microbatch=10_000)
    many = _learner(parallel_1x1, max_tokens_per_microbatch=16)
    r1, g1 = _grads_and_step(one, batch, aggregation)
    r4, g4 = _grads_and_step(many, batch, aggregation)
    assert r1.padding_share > r4.padding_share >= 0
    assert len(many._micro_batches(batch.attention_mask_BT)) == 4
    assert abs(r1.loss - r4.loss) <= 1e-6 and abs(r1.grad_norm - r4.grad_norm) <= 1e-5 * r1.grad_norm
    assert r1.metrics.keys() == {"ratio", "clipped"} and abs(r1.metrics["ratio"] - r4.metrics["ratio"]) <= 1e-6
    scale = max(g.abs().max().item() for g in g1.values())
    assert scale > 0 and max((g1[n] - g4[n]).abs().max().item() for n in g1) <= 1e-5 * scale


def test_aggregations_match_their_definitions(tiny_learner):
    """token_mean and seq_mean of the per-token loss -logp, computed by hand from the log-probs."""
    batch = make_batch(3)
    lp = tiny_learner.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    m = batch.loss_mask_BT
    token_mean = float((-lp * m).sum() / m.sum())
    seq_mean = float(((-lp * m).sum(1) / m.sum(1)).mean())
    for aggregation, want in (("token_mean", token_mean), ("seq_mean", seq_mean)):
        result, _ = _grads_and_step(tiny_learner, batch, aggregation, lambda lp, ent, extras: (-lp, {}))
        got = result.loss
        assert abs(got - want) <= 1e-5 * abs(want), (aggregation, got, want)


def test_non_finite_step_is_skipped_and_changes_nothing(parallel_1x1):
    learner = _learner(parallel_1x1)
    batch = make_batch(4)
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}

    def nan_loss(lp, ent, extras):
        return lp * float("nan"), {}

    result = learner.train_step(batch, TokenLoss(token_loss=nan_loss))
    assert result.skipped and learner.step == 0
    assert all(torch.equal(before[n], p) for n, p in learner.module.named_parameters())
    ok = learner.train_step(batch, ppo_loss)
    assert not ok.skipped and learner.step == 1 and ok.grad_norm > 0


def test_save_then_load_continues_bit_identically(parallel_1x1, tmp_path):
    batch, nxt = make_batch(5), make_batch(6)
    learner = _learner(parallel_1x1, lr=1e-3, warmup_steps=3)
    first = learner.train_step(batch, ppo_loss)
    save_learner(learner, tmp_path / "ckpt")
    lr_saved = learner.lr
    straight = [learner.train_step(nxt, ppo_loss), learner.train_step(batch, ppo_loss)]
    resumed = _learner(parallel_1x1, lr=1e-3, warmup_steps=3)
    load_learner(resumed, tmp_path / "ckpt")
    assert resumed.step == 1 and resumed.lr == lr_saved and first.lr == pytest.approx(1e-3 / 3)
    again = [resumed.train_step(nxt, ppo_loss), resumed.train_step(batch, ppo_loss)]
    for a, b in zip(straight, again):
        assert (a.loss, a.grad_norm, a.lr) == (b.loss, b.grad_norm, b.lr)
    assert all(torch.equal(p, q) for p, q in zip(learner.module.parameters(),
                                                 resumed.module.parameters()))
    # the checkpoint is also a model source (weights only)
    from_ckpt = _learner(parallel_1x1, model=str(tmp_path / "ckpt"))
    saved = learner  # weights after 3 steps differ from the checkpoint's (after 1)
    assert not torch.equal(next(from_ckpt.module.parameters()), next(saved.module.parameters()))
    assert from_ckpt.logprobs(batch.tokens_BT, batch.attention_mask_BT).abs().sum() > 0


def test_bad_config_and_input_are_one_line_errors(tiny_learner):
    with pytest.raises(ValueError, match="needs Transformer Engine and a GPU"):
        _learner(None, fp8="e4m3")
    with pytest.raises(ValueError, match="needs a GPU"):
        _learner(None, dtype="bfloat16")
    with pytest.raises(ValueError, match="parallel state is tp=1 pp=1"):
        _learner(None, tp=2)
    with pytest.raises(ValueError, match="fp8"):
        LearnerConfig(fp8="e5m2")
    with pytest.raises(ValueError, match="lr_decay_steps"):
        LearnerConfig(lr_decay_style="cosine")
    batch = make_batch(0)
    with pytest.raises(ValueError, match="aggregation"):
        tiny_learner.train_step(batch, ppo_loss, aggregation="sum")
    with pytest.raises(ValueError, match="temperature"):
        tiny_learner.logprobs(batch.tokens_BT, batch.attention_mask_BT, temperature=0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_learner.logprobs(batch.tokens_BT + 10**6, batch.attention_mask_BT)
    holes = batch.attention_mask_BT.clone()
    holes[0, 3] = False
    with pytest.raises(ValueError, match="contiguous"):
        tiny_learner.logprobs(batch.tokens_BT, holes)
    with pytest.raises(ValueError, match="extras"):
        TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT,
                   loss_mask_BT=batch.loss_mask_BT, extras={"x": torch.zeros(3)})


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grad_norm_equals_transformers(tiny_learner, temperature):
    """Loss -logp - 0.1 * entropy (token mean): the learner's grad norm equals transformers'."""
    from transformers import AutoModelForCausalLM

    from megatron_tir.model_sources import resolve_model

    batch = make_batch(8)
    result, _ = _grads_and_step(tiny_learner, batch, "token_mean", lambda lp, ent, extras: (-lp - 0.1 * ent, {}),
                                temperature=temperature)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32)
    m = batch.loss_mask_BT
    total = 0.0
    for b in range(batch.tokens_BT.shape[0]):
        idx = batch.attention_mask_BT[b].nonzero().flatten()
        s, e = int(idx[0]), int(idx[-1]) + 1
        logp = torch.log_softmax(hf(batch.tokens_BT[b:b + 1, s:e]).logits[0] / temperature, dim=-1)
        lp = logp[:-1].gather(1, batch.tokens_BT[b, s + 1:e, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)[:-1]
        total = total + ((-lp - 0.1 * ent) * m[b, s + 1:e]).sum()
    (total / m.sum()).backward()
    ref = torch.sqrt(sum((p.grad ** 2).sum() for p in hf.parameters() if p.grad is not None)).item()
    assert result.grad_norm == pytest.approx(ref, rel=1e-4)


def test_checkpoint_is_tir_ckpt_layout_and_bad_dirs_are_refused(parallel_1x1, tmp_path):
    from safetensors.torch import load_file

    from checkpoints_tools.convert import hf_to_megatron, megatron_to_hf
    from megatron_tir.model_sources import resolve_model

    learner = _learner(parallel_1x1, lr=1e-3)
    learner.train_step(make_batch(9), ppo_loss)
    save_learner(learner, tmp_path / "ckpt")
    hf = megatron_to_hf(tmp_path / "ckpt", tmp_path / "hf")  # tir-ckpt reads a learner checkpoint
    exported = load_file(hf / "model.safetensors")
    want = {n: t for bucket in learner.hf_weights(1 << 30) for n, t in bucket}
    assert exported.keys() == want.keys() and all(torch.equal(exported[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="exists and is not empty"):
        save_learner(learner, tmp_path / "ckpt")
    converted = hf_to_megatron(resolve_model("tiny-qwen2"), tmp_path / "converted")
    with pytest.raises(ValueError, match="no optimizer/scheduler state"):
        load_learner(learner, converted)


def test_grad_clip_0_steps_unclipped_and_reports_the_grad_norm(parallel_1x1):
    """learner.grad_clip=0 (no clipping) trains: megatron-core's optimizer still returns the norm, and
    the step equals one under a clip far above it; a clip below it changes the step (adam_eps=1 makes
    Adam's first step ~ lr * grad, so the clip shows in the update)."""
    batch = make_batch(9)
    steps, norms = {}, {}
    for clip in (0.0, 1e9, 1e-3):
        learner = _learner(parallel_1x1, lr=1.0, adam_eps=1.0, grad_clip=clip)
        before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
        result = learner.train_step(batch, ppo_loss)
        assert not result.skipped and learner.step == 1
        norms[clip] = result.grad_norm
        steps[clip] = {n: p.detach() - before[n] for n, p in learner.module.named_parameters()}
    assert norms[0.0] > 1e-3 and norms[0.0] == pytest.approx(norms[1e9], rel=1e-6) == norms[1e-3]
    biggest = max(s.abs().max().item() for s in steps[0.0].values())
    assert max((steps[0.0][n] - steps[1e9][n]).abs().max().item() for n in steps[0.0]) <= 1e-6 * biggest
    assert max((steps[0.0][n] - steps[1e-3][n]).abs().max().item() for n in steps[0.0]) > 0.1 * biggest


def test_a_stage_that_reads_tokens_or_the_loss_mask_refuses_a_batch_without_them(tiny_learner):
    """One stage (PP=1) is the first and the last: it reads both (only other stages may leave them out)."""
    batch = make_batch(10)
    with pytest.raises(ValueError, match="tokens_BT is None, but this pipeline stage reads them"):
        tiny_learner.logprobs(None, batch.attention_mask_BT, local_rows=True)
    no_mask = TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT, loss_mask_BT=None)
    with pytest.raises(ValueError, match="loss_mask_BT is None, but this pipeline stage computes the loss"):
        tiny_learner.train_step(no_mask, ppo_loss, local_rows=True)
