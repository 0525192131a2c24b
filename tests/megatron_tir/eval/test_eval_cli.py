"""``megatron-tir eval``: errors at the edge, the start-up probes, the infrastructure check,
and real runs end to end (real sandbox cluster, real math-verify; a tiny random model, or a
scripted engine that writes code and boxes answers)."""

import json

import pandas as pd
import pytest

from megatron_tir.cli import build_parser, main
from megatron_tir.eval import cli as eval_cli
from megatron_tir.eval.runner import EVAL_ROLLOUT_DEFAULTS, EvalConfig
from megatron_tir.rollout import RolloutConfig

from scripted_engine import ScriptedEngine
from megatron_tir.ports import free_port as _free_port


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def two_problems(tmp_path):
    data = tmp_path / "two.parquet"
    pd.DataFrame({
        "prompt": [[{"role": "user", "content": "What is 1+1?"}], [{"role": "user", "content": "What is 2+3?"}]],
        "reward_model": [{"ground_truth": "2"}, {"ground_truth": "5"}],
        "data_source": ["unit", "unit"],
    }).to_parquet(data)
    return data


# ------------------------------------------------------------------ flags -> one config


def test_flags_map_onto_one_eval_config():
    args = build_parser().parse_args([
        "eval", "--model", "smollm2", "--data", "aime24", "--k", "3", "--max-turns", "2", "--protocol", "simpletir",
        "--void-turn", "continue", "--tool-timeout", "5", "--engine", "sglang", "--sglang-url", "http://a:1",
        "--sglang-url", "http://b:2", "--sandbox", "tcp://h:5555", "--top-k", "20", "--limit", "7"])
    cfg = eval_cli.config_from_args(args)
    assert isinstance(cfg, EvalConfig) and isinstance(cfg.rollout, RolloutConfig)
    assert cfg.k == cfg.rollout.n_samples == 3 and cfg.rollout.max_turns == 2 and cfg.rollout.top_k == 20
    assert cfg.rollout.protocol == "simpletir" and cfg.rollout.void_turn == "continue"
    assert cfg.rollout.tool_timeout_s == 5.0 and cfg.limit == 7
    assert cfg.engine.kind == "sglang" and cfg.engine.urls == ("http://a:1", "http://b:2")
    assert cfg.sandbox.address == "tcp://h:5555"
    # a flag not given keeps the config's default
    cfg = eval_cli.config_from_args(build_parser().parse_args(["eval", "--model", "smollm2", "--data", "aime24"]))
    assert cfg.rollout == RolloutConfig(**EVAL_ROLLOUT_DEFAULTS) and cfg == EvalConfig(data="aime24")
    assert cfg.rollout.tools and cfg.out is None


def test_every_flag_names_a_config_field():
    cfg = EvalConfig(data="x")
    for dest, (section, name) in eval_cli.FLAG_FIELDS.items():
        owner = {"": cfg, "engine": cfg.engine, "sandbox": cfg.sandbox, "rollout": cfg.rollout,
                 "prompt": cfg.rollout.prompt}[section]
        assert hasattr(owner, name), (dest, section, name)


# ------------------------------------------------------------------------ bad input


def test_unknown_dataset_is_a_one_line_error(capsys):
    code, out, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", "aime2030", "--k", "1")
    assert code == 2
    assert err.strip().count("\n") == 0
    assert "megatron-tir: error: dataset 'aime2030' is neither a known name" in err


def test_bad_model_is_a_one_line_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "eval", "--model", str(tmp_path / "nope"), "--data", "aime24", "--limit", "1")
    assert code == 2 and "is neither 'smollm2' nor an existing directory" in err


def test_bad_parquet_column_is_named(capsys, tmp_path):
    path = tmp_path / "q.parquet"
    pd.DataFrame({"question": ["1+1"], "reward_model": [{"ground_truth": "2"}]}).to_parquet(path)
    code, _, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", str(path))
    assert code == 2 and "missing column(s) prompt" in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--engine", "sglang"], "engine kind 'sglang' needs urls"),
    (["--k", "0"], "n_samples must be >= 1, got 0"),
    (["--max-turns", "-1"], "max_turns must be >= 1, got -1"),
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--tool-timeout", "999"], "tool_timeout_s must be in (0, 300], got 999.0"),
    (["--protocol", "verl"], "protocol must be one of ['default', 'simpletir'], got 'verl'"),
    (["--protocol", "simpletir", "--prompt-mode", "chat"], "rollout.prompt settings apply to protocol 'default'"),
    (["--void-turn", "skip"], "void_turn must be one of ('stop', 'continue'), got 'skip'"),
    (["--sandbox", "localhost:5555"], "sandbox address must be tcp://, ipc:// or inproc://"),
    (["--max-infra-failure-share", "2"], "max_infra_failure_share must be in [0, 1], got 2.0"),
])
def test_bad_values_are_one_line_errors_from_the_config(capsys, flags, message):
    code, _, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", "aime24", *flags)
    assert code == 2 and err.startswith("megatron-tir: error: ") and message in err, err
    assert err.strip().count("\n") == 0


@pytest.mark.parametrize("flag", ["--temperature", "--top-p", "--tool-timeout", "--max-infra-failure-share",
                                  "--probe-timeout"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_float_flags_refuse_non_finite_values(capsys, flag, bad):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", "smollm2", "--data", "aime24", f"{flag}={bad}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}: '{bad}' is not a finite number" in err, err


def test_argparse_rejects_non_numbers():
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", "smollm2", "--data", "aime24", "--temperature", "x"])
    assert exc.value.code == 2


# ------------------------------------------------------------ infrastructure, not model



def test_no_sglang_server_fails_before_the_run(capsys, two_problems, tmp_path):
    out = tmp_path / "s.jsonl"
    out.write_text('{"earlier": "results"}\n')  # a failed eval leaves an existing --out file as it was
    code, stdout, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", str(two_problems), "--engine",
                                "sglang", "--sglang-url", f"http://127.0.0.1:{_free_port()}", "--no-tools",
                                "--k", "1", "--no-progress", "--probe-timeout", "30", "--out", str(out))
    assert code == 1 and "avg@" not in stdout
    # Exactly one error line (a logged warning about the dead server may precede it on stderr).
    errors = [line for line in err.splitlines() if line.startswith("megatron-tir:")]
    assert len(errors) == 1, err
    assert errors[0].startswith("megatron-tir: error: engine http://127.0.0.1:") and "did not answer" in errors[0], err
    assert out.read_text() == '{"earlier": "results"}\n'
    assert not list(tmp_path.glob(".s.jsonl.tmp-*"))  # no temp file left


def test_no_sandbox_broker_fails_before_the_engine_loads(capsys, two_problems, tmp_path):
    code, stdout, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", str(two_problems), "--sandbox",
                                f"ipc://{tmp_path}/nobody.sock", "--probe-timeout", "1", "--no-progress")
    assert code == 1 and "avg@" not in stdout
    assert f"megatron-tir: error: sandbox at ipc://{tmp_path}/nobody.sock did not run print(1) within 1 s" in err


# ------------------------------------------------------------------ end to end


def scripted(monkeypatch, script, **engine_kw):
    """Run the eval with a scripted engine in place of the built one (the rest is real)."""
    made = []

    def build_engine(cfg, *, model_dir=None, settings=None):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        made.append(ScriptedEngine(tok, script, **engine_kw))
        return made[0], tok

    monkeypatch.setattr("megatron_tir.rollout.factory.build_engine", build_engine)  # the shared assembly builds it
    return made


def solve(ctx: str) -> str:
    """Writes code for 1+1, then boxes its output; answers 2+3 wrongly without code."""
    if "What is 1+1?" in ctx:
        return "Let me compute.\n```python\nprint(1 + 1)\n```" if "print(1 + 1)\n```" not in ctx else \
            "So the answer is \\boxed{2}."
    return "It is \\boxed{6}."


@pytest.mark.parametrize("protocol", ["default", "simpletir"])
def test_eval_end_to_end_scripted_model_writes_code_and_answers(capsys, monkeypatch, two_problems, tmp_path,
                                                                protocol):
    scripted(monkeypatch, solve)
    out = tmp_path / "samples.jsonl"
    code, stdout, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", str(two_problems), "--k", "2",
                                "--protocol", protocol, "--out", str(out), "--no-progress")
    assert code == 0, err
    assert f"protocol {protocol} | k=2" in stdout
    assert "avg@2: 50.0%" in stdout and "pass@2: 50.0%" in stdout
    assert "void_turn_ratio: 0.0%" in stdout and "finish_ratio: 100.0%" in stdout
    assert "code_use_ratio: 25.0%" in stdout  # (1/2, 1/2, 0, 0) / 4
    assert "valid_code_ratio: 25.0%" in stdout and "correct_with_code: 100.0%" in stdout
    assert "num_turns: 1.50" in stdout and "status: completed=4" in stdout
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()),
                  key=lambda r: (r["group_id"], r["sample_index"]))
    assert [r["reward"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    assert [r["final_answer"] for r in rows] == ["2", "2", "6", "6"]
    assert [r["question"] for r in rows] == ["What is 1+1?"] * 2 + ["What is 2+3?"] * 2  # megatron-tir show prints it
    from megatron_tir.observe.show import render

    assert "question: What is 2+3?" in render(rows[2])
    first = rows[0]
    assert [t["kind"] for t in first["turns"]] == ["code", "answer"]
    assert first["turns"][0]["tool"]["result"]["stdout"] == "2\n"
    feedback = first["turns"][0]["tool"]["feedback"]
    if protocol == "simpletir":
        assert feedback == "\nCode execution result: 2\n\n" and "User Question:\nWhat is 1+1?" in first["prompt"]
    else:
        assert "Code Execution Result:" in feedback and first["prompt"].rstrip().endswith("Solution:")
    assert feedback in first["response"]


def test_infrastructure_failures_past_the_share_fail_the_eval(capsys, monkeypatch, two_problems):
    # call 0 is the start-up probe; a later call fails: one trajectory of four is aborted
    scripted(monkeypatch, solve, fail_on_call=2)
    code, stdout, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", str(two_problems), "--k", "2",
                                "--no-progress")
    assert code == 1 and "avg@" not in stdout
    assert "1 of 4 trajectories were ended by infrastructure failures (aborted=1), more than " \
           "max_infra_failure_share=0.05" in err
    assert "scripted server error" in err
    scripted(monkeypatch, solve, fail_on_call=2)
    code, stdout, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", str(two_problems), "--k", "2",
                                "--no-progress", "--max-infra-failure-share", "0.25")
    assert code == 0, err
    assert "infra_failure_ratio: 25.0%" in stdout and "void_turn_ratio: 0.0%" in stdout


def test_eval_end_to_end_tiny_model(capsys, tmp_path, make_tiny_hf, two_problems):
    out = tmp_path / "res" / "samples.jsonl"
    code, stdout, _ = run_cli(capsys, "eval", "--model", str(make_tiny_hf("llama")), "--data", str(two_problems),
                              "--k", "2", "--max-turns", "2", "--max-response-tokens", "12", "--out", str(out),
                              "--no-progress")
    assert code == 0, stdout
    assert "avg@2: 0.0%" in stdout and "pass@2: 0.0%" in stdout
    # a random model never closes a block nor boxes an answer in 12 tokens: every trajectory
    # ends on a void turn (which SimpleTIR's finish_ratio counts as finished)
    assert "void_turn_ratio: 100.0%" in stdout and "finish_ratio: 100.0%" in stdout
    assert "completed_ratio: 0.0%" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert sorted((r["group_id"], r["sample_index"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert r["reward"] == 0.0 and r["status"] == "void" and r["model_tokens"] <= 12
        assert r["prompt"].rstrip().endswith("Solution:") and isinstance(r["response"], str)
        assert r["turns"][0]["kind"] == "void" and r["turns"][0]["text"]
        assert r["ground_truth"] in ("2", "5")
