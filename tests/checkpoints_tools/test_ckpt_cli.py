"""tir-ckpt on good and bad input: one clear error line, exit status, nothing left at --out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys


from checkpoints_tools.cli import EXIT_BAD_INPUT, EXIT_VERIFY_FAILED, main
from megatron_tir.policy.checkpoint.layout import META_NAME


def _fails(capsys, argv, message, out=None):
    capsys.readouterr()  # drop fixture output (model saving progress bars)
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_BAD_INPUT
    assert len(err) == 1 and err[0].startswith("tir-ckpt: error: "), err
    assert message in err[0], err[0]
    if out is not None:
        assert not out.exists()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]
    return err[0]


def _copy_hf(src, dst, **config_changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_architecture(capsys, make_tiny_hf, tmp_path):
    hf = _copy_hf(make_tiny_hf("llama"), tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    out = tmp_path / "out"
    _fails(capsys, ["hf-to-megatron", "--hf", str(hf), "--out", str(out)], "unsupported architecture", out)


def test_missing_files(capsys, make_tiny_hf, tmp_path):
    out = tmp_path / "out"
    _fails(capsys, ["hf-to-megatron", "--hf", str(tmp_path / "nope"), "--out", str(out)], "neither", out)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(make_tiny_hf("llama"), no_weights)
    (no_weights / "model.safetensors").unlink()
    _fails(capsys, ["hf-to-megatron", "--hf", str(no_weights), "--out", str(out)], "no *.safetensors", out)
    _fails(capsys, ["megatron-to-hf", "--ckpt", str(tmp_path / "nope"), "--out", str(out)], "does not exist", out)
    _fails(capsys, ["megatron-to-hf", "--ckpt", str(no_weights), "--out", str(out)], "not a checkpoint", out)


def test_missing_checkpoint_shard(capsys, make_tiny_hf, convert_once, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(convert_once(make_tiny_hf("llama")), ckpt)
    for shard in ckpt.glob("*.distcp"):
        shard.unlink()
    out = tmp_path / "out"
    _fails(capsys, ["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(out)], "distcp", out)


def test_tp_must_divide_heads_kv_heads_and_vocab(capsys, smollm2_dir, make_tiny_hf, tmp_path):
    out = tmp_path / "out"
    _fails(capsys, ["hf-to-megatron", "--hf", str(smollm2_dir), "--out", str(out), "--tp", "2"],
           "tp=2 does not divide the attention heads (9)", out)
    one_kv = make_tiny_hf("llama", num_kv_heads=1)
    _fails(capsys, ["hf-to-megatron", "--hf", str(one_kv), "--out", str(out), "--tp", "2"],
           "tp=2 does not divide the key/value heads (1)", out)
    odd_vocab = make_tiny_hf("qwen2", vocab_size=1001)
    _fails(capsys, ["hf-to-megatron", "--hf", str(odd_vocab), "--out", str(out), "--tp", "2"],
           "tp=2 does not divide the vocab size (1001)", out)
    _fails(capsys, ["hf-to-megatron", "--hf", str(one_kv), "--out", str(out), "--pp", "3"],
           "pp=3 does not divide the number of layers (2)", out)


def test_weights_of_another_model(capsys, make_tiny_hf, tmp_path):
    out = tmp_path / "out"
    wrong_shape = _copy_hf(make_tiny_hf("llama"), tmp_path / "wrong-shape", intermediate_size=96)
    _fails(capsys, ["hf-to-megatron", "--hf", str(wrong_shape), "--out", str(out)], "has shape [128, 64]", out)
    # Qwen2 weights (qkv bias) under a Llama config
    wrong_family = _copy_hf(make_tiny_hf("qwen2"), tmp_path / "wrong-family", model_type="llama",
                            architectures=["LlamaForCausalLM"])
    _fails(capsys, ["hf-to-megatron", "--hf", str(wrong_family), "--out", str(out)], "_proj.bias' is not part of a llama model", out)


def test_checkpoint_of_another_model(capsys, make_tiny_hf, convert_once, smollm2_ckpt, tmp_path):
    tiny = make_tiny_hf("llama")
    _fails(capsys, ["verify", "--hf", str(tiny), "--ckpt", str(smollm2_ckpt)], "different model")
    # metadata of one model over the tensors of another
    ckpt = tmp_path / "ckpt"
    shutil.copytree(convert_once(make_tiny_hf("qwen2", tie_word_embeddings=False)), ckpt)
    shutil.copy(smollm2_ckpt / META_NAME, ckpt / META_NAME)
    out = tmp_path / "out"
    _fails(capsys, ["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(out)], "does not match its metadata", out)


def test_existing_output_is_refused(capsys, make_tiny_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    _fails(capsys, ["hf-to-megatron", "--hf", str(make_tiny_hf("llama")), "--out", str(out)], "already exists")
    assert (out / "keep.txt").read_text() == "x"


def test_verify_ok_and_past_tolerance(capsys, make_tiny_hf, convert_once):
    hf = make_tiny_hf("qwen2", tie_word_embeddings=False)
    ckpt = convert_once(hf)
    capsys.readouterr()
    assert main(["verify", "--hf", str(hf), "--ckpt", str(ckpt)]) == 0
    assert "-> OK" in capsys.readouterr().out
    # the same architecture with other weights: logits past the tolerance (both sides may agree
    # exactly on the same weights, so a tiny --atol would not fail)
    other = convert_once(make_tiny_hf("qwen2", tie_word_embeddings=False, seed=1))
    capsys.readouterr()
    assert main(["verify", "--hf", str(hf), "--ckpt", str(other)]) == EXIT_VERIFY_FAILED
    assert "-> FAIL" in capsys.readouterr().out


def test_keymap_command(capsys):
    assert main(["keymap", "--family", "qwen2"]) == 0
    assert "self_attn.q_proj.bias" in capsys.readouterr().out


def test_console_script_exit_code(smollm2_dir, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "tir-ckpt")
    out = tmp_path / "out"
    proc = subprocess.run([exe, "hf-to-megatron", "--hf", str(smollm2_dir), "--out", str(out), "--tp", "2"],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == EXIT_BAD_INPUT
    assert proc.stderr.strip() == "tir-ckpt: error: tp=2 does not divide the attention heads (9)"
    assert not out.exists()


def test_log_level_is_global_and_checked(capsys):
    assert main(["--log-level", "warning", "keymap", "--family", "llama"]) == 0
    try:
        main(["--log-level", "loud", "keymap"])
    except SystemExit as e:
        assert e.code == EXIT_BAD_INPUT
    else:
        raise AssertionError("an unknown --log-level was accepted")
    assert "tir-ckpt: error: argument --log-level: invalid choice: 'loud'" in capsys.readouterr().err
