"""The CPU redirections still hit their targets, and forward+backward at TP=2 matches transformers."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from megatron_tir.policy import cpu_compat


def _check_target(patch) -> None:
    module = importlib.import_module(patch.module)
    cpu_compat.resolve(patch)  # AttributeError if the target moved
    original = cpu_compat.original(patch)
    source = inspect.getsource(module if patch.attribute == "torch" else original)
    assert patch.marker in source, f"{patch.module}.{patch.attribute} no longer contains {patch.marker!r}"


@pytest.mark.parametrize("patch", cpu_compat.PATCHES, ids=lambda p: f"{p.module}:{p.attribute}")
def test_patch_target_exists_and_still_needs_patching(patch):
    """Fails loudly when megatron-core moves or fixes a spot this module redirects."""
    _check_target(patch)


def test_patch_checks_still_pass_after_apply():
    cpu_compat.apply()
    for patch in cpu_compat.PATCHES:
        _check_target(patch)


def test_apply_is_idempotent_and_redirects():
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import mappings, random

    assert cpu_compat.apply() and cpu_compat.apply()
    assert mappings.torch.cuda.current_device() == "cpu"
    assert mappings.torch.Tensor is torch.Tensor  # everything else is the real torch
    assert fused_softmax.get_default_causal_mask(3).tolist() == [[False, True, True], [False, False, True],
                                                                  [False, False, False]]
    tracker = random.CudaRNGStatesTracker()
    tracker.add("x", 7)
    before = torch.get_rng_state()
    with tracker.fork("x"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3))


def _grads_rank(rank, world, hf_dir, ids_path, out_dir):
    from megatron_tir.policy.spec import spec_from_hf_dir
    from megatron_tir.policy.keymap import plan, to_megatron
    from megatron_tir.policy.checkpoint.hf_io import HFReader
    from megatron.core import parallel_state
    from megatron_tir.policy.build import build_gpt_model
    from megatron_tir.policy.parallel import init_parallel

    spec, _ = spec_from_hf_dir(hf_dir)
    init_parallel(2, 1)
    model = build_gpt_model(spec, parallel_output=False, perform_initialization=False)
    # Load weights straight from HF: full tensors, then this rank's TP slice via the model's shapes.
    reader, tp_rank = HFReader(hf_dir), parallel_state.get_tensor_model_parallel_rank()
    params = dict(model.named_parameters())
    for p in plan(spec):
        full = to_megatron(p, [reader.get(n) for n in p.hf], spec)
        param = params[p.megatron]
        dim = next((d for d in range(full.dim()) if full.shape[d] != param.shape[d]), None)
        if p.transform == "gate_up" and dim is not None:  # each rank holds [gate_r; up_r]
            gate, up = full.chunk(2)
            full = torch.cat([gate.chunk(2)[tp_rank], up.chunk(2)[tp_rank]])
        elif dim is not None:
            full = full.chunk(2, dim=dim)[tp_rank]
        param.data.copy_(full)
    ids = torch.load(ids_path)
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    torch.save({"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}},
               f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_forward_backward_tp2_matches_transformers(make_tiny_hf, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_tir.policy.parallel import run_ranks

    hf_dir = make_tiny_hf("llama", tie_word_embeddings=False)
    ids = torch.tensor([[1, 17, 400, 3, 99, 12, 5, 7]])
    torch.save(ids, tmp_path / "ids.pt")
    run_ranks(_grads_rank, 2, str(hf_dir), str(tmp_path / "ids.pt"), str(tmp_path))

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    logits = ref(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-5)
        # replicated over TP: the final norm; row-parallel: fc2 columns; vocab-parallel: embedding rows
        torch.testing.assert_close(got["decoder.final_layernorm.weight"], ref_grads["model.norm.weight"].grad,
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got["decoder.layers.1.mlp.linear_fc2.weight"],
                                   ref_grads["model.layers.1.mlp.down_proj.weight"].grad.chunk(2, dim=1)[rank],
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got["embedding.word_embeddings.weight"],
                                   ref_grads["model.embed_tokens.weight"].grad.chunk(2, dim=0)[rank],
                                   rtol=1e-4, atol=1e-6)


def _schedule_rank(rank, world, tp, pp, ckpt, batches_path, out_dir):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_tir.policy.checkpoint.layout import read_meta
    from megatron_tir.policy.checkpoint.megatron_io import load_model
    from megatron_tir.policy.build import build_gpt_model
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(tp, pp)
    model = build_gpt_model(read_meta(ckpt).spec, perform_initialization=False)
    load_model(model, ckpt)
    batches = torch.load(batches_path)

    def forward_step(data_iterator, model):
        inputs, labels = next(data_iterator)
        positions = torch.arange(inputs.shape[1]).unsqueeze(0)
        out = model(input_ids=inputs, position_ids=positions, attention_mask=None, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            # clone: the schedule divides the returned loss in place by num_microbatches
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=batches[0][0].shape[1], micro_batch_size=1, forward_only=False)
    stage, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    torch.save({"losses": [d["loss"] for d in losses],
                **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}},
               f"{out_dir}/tp{tp_rank}_pp{stage}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_schedule_forward_backward_matches_transformers(tp, pp, make_tiny_hf, tmp_path):
    """megatron's schedules (1F1B at PP=2, no pipelining at TP=2) on two gloo ranks:
    losses and gradients equal transformers'."""
    from transformers import AutoModelForCausalLM

    from checkpoints_tools.convert import hf_to_megatron
    from megatron_tir.policy.parallel import run_ranks

    hf_dir = make_tiny_hf("llama", tie_word_embeddings=False)
    ckpt = hf_to_megatron(hf_dir, tmp_path / "ckpt")
    torch.manual_seed(3)
    ids = torch.randint(0, 2000, (2, 10))
    batches = [(ids[i:i + 1, :-1], ids[i:i + 1, 1:]) for i in range(2)]  # two micro-batches
    torch.save(batches, tmp_path / "batches.pt")
    run_ranks(_schedule_rank, 2, tp, pp, str(ckpt), str(tmp_path / "batches.pt"), str(tmp_path))

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    losses = [torch.nn.functional.cross_entropy(ref(input_ids=x).logits[0], y[0]) for x, y in batches]
    (sum(losses) / len(losses)).backward()  # the schedule averages over micro-batches
    grads = {n: p.grad for n, p in ref.named_parameters()}
    close = dict(rtol=1e-4, atol=1e-6)
    if pp == 2:
        first, last = torch.load(tmp_path / "tp0_pp0.pt"), torch.load(tmp_path / "tp0_pp1.pt")
        torch.testing.assert_close(torch.stack(last["losses"]), torch.stack(losses).detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(first["embedding.word_embeddings.weight"], grads["model.embed_tokens.weight"],
                                   **close)
        torch.testing.assert_close(last["decoder.final_layernorm.weight"], grads["model.norm.weight"], **close)
        torch.testing.assert_close(last["output_layer.weight"], grads["lm_head.weight"], **close)
        # stage 1 holds global layer 1 as its local layer 0
        torch.testing.assert_close(last["decoder.layers.0.mlp.linear_fc2.weight"],
                                   grads["model.layers.1.mlp.down_proj.weight"], **close)
        return
    for rank in range(tp):
        got = torch.load(tmp_path / f"tp{rank}_pp0.pt")
        torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(losses).detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["decoder.final_layernorm.weight"], grads["model.norm.weight"], **close)
        torch.testing.assert_close(got["embedding.word_embeddings.weight"],
                                   grads["model.embed_tokens.weight"].chunk(tp)[rank], **close)
        torch.testing.assert_close(got["output_layer.weight"], grads["lm_head.weight"].chunk(tp)[rank], **close)
