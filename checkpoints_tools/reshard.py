"""Rewrite a checkpoint with an explicit TP x PP layout.

The torch_dist format loads at any layout, so resharding is only needed where files per
rank of a given layout must exist (e.g. a job that saves and loads with
``fully_parallel`` strategies, or to check a layout before a run). ``reshard`` starts
``tp*pp*ep`` gloo ranks (``ep``: an MoE model's experts over that many expert-parallel ranks); each builds its stage of the real GPTModel at the target layout,
loads its slices from the source with ``dist_checkpointing`` and saves them to the
output, so the output is also proof that the source loads at that layout.
"""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_tir.policy.parallel import run_ranks
from megatron_tir.policy.checkpoint.layout import HF_FILES_DIR, atomic_output_dir, read_meta, resolve_checkpoint

log = logging.getLogger(__name__)


def _reshard_rank(rank: int, world: int, src: str, dst: str, tp: int, pp: int, ep: int = 1) -> None:
    from megatron_tir.policy.checkpoint.megatron_io import load_model, save_model
    from megatron_tir.policy.build import build_gpt_model
    from megatron_tir.policy.parallel import init_parallel

    from tqdm import tqdm

    meta = read_meta(Path(src))
    init_parallel(tp, pp, ep=ep)
    # progress on rank 0, on a terminal only (as the conversions): build, load, save
    with tqdm(total=3, desc=f"reshard to tp={tp} pp={pp}", unit="phase", leave=False,
              disable=None if rank == 0 else True) as bar:
        model = build_gpt_model(meta.spec, perform_initialization=False)
        bar.update(1)
        load_model(model, Path(src))
        bar.update(1)
        save_model(model, Path(dst), spec=meta.spec, hf_config=meta.hf_config, hf_files=Path(src) / HF_FILES_DIR,
                   iteration=meta.iteration, source=meta.source or src)
        bar.update(1)


def reshard(ckpt: Path, out: Path, *, tp: int, pp: int, ep: int = 1) -> Path:
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    meta.spec.check_layout(tp, pp, ep)
    with atomic_output_dir(out) as tmp:
        run_ranks(_reshard_rank, tp * pp * ep, str(ckpt), str(tmp), tp, pp, ep)
    log.info("resharded %s (tp=%d pp=%d) -> %s (tp=%d pp=%d ep=%d)", ckpt, meta.tp, meta.pp, out, tp, pp, ep)
    return Path(out)
