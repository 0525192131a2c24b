"""Benchmark: HF -> Megatron -> HF conversion of SmolLM2-135M vs a raw safetensors read + write.

Each side runs in its own subprocess (fresh interpreter) so peak RSS is its own, after
an ``os.sync()`` so no side pays for the previous side's pending writeback:

* ``raw``: ``safetensors.torch.load_file`` of the model, then ``save_file`` of the same tensors
  and an fsync (both conversion writers fsync: megatron-core's, and ours before the rename);
* ``hf-to-megatron`` and ``megatron-to-hf``: ``checkpoints_tools.convert`` (what ``tir-ckpt`` runs).

The three sides run ``--rounds`` times, interleaved (raw, hf-to-megatron, megatron-to-hf,
raw, ...), each time in a fresh process; the table shows the median of each figure (the
machine is shared, so single runs vary a lot). Reported per side: time of the operation
itself (imports excluded), the same operation
run a second time in the same process (one-time costs paid), process wall time,
peak RSS (VmHWM of the process; ``ru_maxrss`` of any helper process it forked, which
counts pages shared copy-on-write with the parent), and peak
RSS above the RSS right after imports (the memory the operation itself needed). Ratios:
conversion time vs raw read+write time (target <= 2x), peak RSS vs the model's bytes
(target <= 1.5x).

    python bench/bench_ckpt.py [--model smollm2|DIR] [--workdir DIR] [--rounds 3]
    python bench/bench_ckpt.py --synthetic-qwen2-1b   # a random ~0.9B-parameter bf16 Qwen2 (1.8 GB)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench_ckpt")


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    """This process's RSS high-water mark (VmHWM). Unlike ru_maxrss it is not inherited from
    the parent across fork+exec, so a big parent does not inflate the child's figure."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _phase(name: str, src: str, dst: str) -> dict:
    """Runs inside the subprocess: import, record RSS, run one side, report."""
    import torch  # noqa: F401  (both sides pay for torch)

    if name == "raw":
        from safetensors.torch import load_file, save_file

        def op(dst):
            files = sorted(Path(src).glob("*.safetensors"))
            os.makedirs(dst)
            for f in files:
                tensors = load_file(f)
                save_file(tensors, Path(dst) / f.name, metadata={"format": "pt"})
                del tensors
                with open(Path(dst) / f.name, "rb+") as fh:
                    os.fsync(fh.fileno())  # durable, like both conversion writers
    elif name == "hf-to-megatron":
        import megatron.core.dist_checkpointing  # noqa: F401  (imports are not the operation)
        import megatron.core.models.gpt  # noqa: F401

        from checkpoints_tools.convert import hf_to_megatron

        def op(dst):
            hf_to_megatron(src, Path(dst))
    elif name == "megatron-to-hf":
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401

        from checkpoints_tools.convert import megatron_to_hf

        def op(dst):
            megatron_to_hf(Path(src), Path(dst))
    else:
        raise ValueError(f"unknown phase {name!r}")
    rss_after_imports = _rss_bytes()
    t0 = time.perf_counter()
    op(dst)
    op_s = time.perf_counter() - t0
    # Once more in the same process, into another dir: one-time costs (process-group set-up,
    # first-use allocations and lazy imports) are paid already.
    t0 = time.perf_counter()
    op(dst + "-again")
    warm_s = time.perf_counter() - t0
    return {"op_s": op_s, "warm_s": warm_s, "rss_after_imports": rss_after_imports,
            "peak_rss": _peak_rss_bytes(),
            "children_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def _run_phase(name: str, src: Path, dst: Path) -> dict:
    os.sync()  # each side starts without the previous side's writeback pending
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--phase", name, "--src", str(src), "--dst", str(dst)],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["notes"] = [ln for ln in proc.stderr.splitlines() if "read + converted" in ln or "file to file" in ln]
    return result


def _synthetic_qwen2(dest: Path) -> Path:
    """A random untied Qwen2 with ~0.9B parameters in bfloat16 (to see how costs scale with size)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from megatron_tir.model_sources import materialize_smollm2

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=4, intermediate_size=5632, max_position_embeddings=2048,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(materialize_smollm2()).save_pretrained(dest)
    return dest


def _median(results: list[dict]) -> dict:
    """Per-key median of the numeric figures of several runs of one side (notes: all runs)."""
    out: dict = {"notes": [n for r in results for n in r["notes"]], "op_all": [r["op_s"] for r in results]}
    for key in results[0]:
        if key != "notes":
            out[key] = statistics.median(r[key] for r in results)
    return out


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--synthetic-qwen2-1b", action="store_true", help="benchmark a random 0.9B bf16 Qwen2")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--dst", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        logging.getLogger("checkpoints_tools").setLevel(logging.INFO)
        print(json.dumps(_phase(args.phase, args.src, args.dst)))
        return 0

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from megatron_tir.model_sources import resolve_model

    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.workdir))
    try:
        hf_dir = _synthetic_qwen2(work / "synthetic") if args.synthetic_qwen2_1b else resolve_model(args.model)
        model_bytes = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
        runs: dict[str, list[dict]] = {"raw": [], "hf-to-megatron": [], "megatron-to-hf": []}
        for r in range(args.rounds):
            rd = work / f"round{r}"
            rd.mkdir()
            runs["raw"].append(_run_phase("raw", hf_dir, rd / "raw"))
            runs["hf-to-megatron"].append(_run_phase("hf-to-megatron", hf_dir, rd / "megatron"))
            runs["megatron-to-hf"].append(_run_phase("megatron-to-hf", rd / "megatron", rd / "hf"))
            shutil.rmtree(rd, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    raw, h2m, m2h = (_median(runs[k]) for k in ("raw", "hf-to-megatron", "megatron-to-hf"))
    conv_op = h2m["op_s"] + m2h["op_s"]
    conv_warm = h2m["warm_s"] + m2h["warm_s"]
    conv_wall = h2m["wall_s"] + m2h["wall_s"]
    print(f"\nmodel: {'synthetic Qwen2 0.9B bf16' if args.synthetic_qwen2_1b else hf_dir} ({_mb(model_bytes)} of safetensors), "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}, median of {args.rounds} interleaved rounds\n")
    print("| side | op time | op time, 2nd run in process | process wall | peak RSS | peak RSS x model | RSS after imports | peak - imports "
          "| peak - imports x model | forked helper peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in (("raw read + write", raw), ("hf-to-megatron", h2m), ("megatron-to-hf", m2h)):
        work_rss = r["peak_rss"] - r["rss_after_imports"]
        print(f"| {name} | {r['op_s']:.2f} s | {r['warm_s']:.2f} s | {r['wall_s']:.2f} s | {_mb(r['peak_rss'])} | "
              f"{r['peak_rss'] / model_bytes:.2f} | {_mb(r['rss_after_imports'])} | {_mb(work_rss)} | "
              f"{work_rss / model_bytes:.2f} | {_mb(r['children_peak_rss'])} |")
    print()
    for name, r in (("raw read + write", raw), ("hf-to-megatron", h2m), ("megatron-to-hf", m2h)):
        print(f"{name} op time per round: {', '.join(f'{t:.2f}' for t in r['op_all'])} s")
    print(f"\nhf-to-megatron op {h2m['op_s']:.2f} s = {h2m['op_s'] / raw['op_s']:.2f}x raw read + write; "
          f"megatron-to-hf op {m2h['op_s']:.2f} s = {m2h['op_s'] / raw['op_s']:.2f}x "
          f"(each direction is one read + one write of the model, like the raw side)")
    print(f"HF -> Megatron -> HF op time {conv_op:.2f} s vs raw read + write {raw['op_s']:.2f} s: "
          f"{conv_op / raw['op_s']:.2f}x (target <= 2x; the round trip reads and writes the model twice); "
          f"process wall {conv_wall:.2f} s vs {raw['wall_s']:.2f} s: {conv_wall / raw['wall_s']:.2f}x; "
          f"2nd run in process {conv_warm:.2f} s vs {raw['warm_s']:.2f} s: {conv_warm / raw['warm_s']:.2f}x")
    print(f"HF -> Megatron -> HF op time {conv_op:.2f} s vs the same I/O done raw (two read + writes, "
          f"{2 * raw['op_s']:.2f} s): {conv_op / (2 * raw['op_s']):.2f}x")
    for note in dict.fromkeys(h2m["notes"] + m2h["notes"]):
        print(f"breakdown: {note}")
    worst = max(h2m["peak_rss"], m2h["peak_rss"])
    worst_work = max(h2m["peak_rss"] - h2m["rss_after_imports"], m2h["peak_rss"] - m2h["rss_after_imports"])
    print(f"conversion peak RSS {_mb(worst)} = {worst / model_bytes:.2f}x model bytes "
          f"({worst_work / model_bytes:.2f}x above the post-import RSS; target <= 1.5x); "
          f"raw read + write peak {raw['peak_rss'] / model_bytes:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
