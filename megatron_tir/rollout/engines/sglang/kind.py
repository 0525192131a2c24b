"""The ``sglang`` engine kind: SGLang servers behind the HTTP client.

Weights: servers on GPUs of their own get them from every pipeline stage's sender
(:class:`~megatron_tir.rollout.sync.stages.StageWeightSync`, every rank); colocated servers from
rank 0 by CUDA IPC (:class:`~megatron_tir.rollout.sync.sglang.TensorWeightSync`, through
:class:`~megatron_tir.rollout.sync.base.Rank0WeightSync`). A launch starts ``sglang.launch_server``
per server (:func:`servers`). Its one line in :data:`megatron_tir.rollout.factory.ENGINE_KINDS` is
``"sglang": SGLANG``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_tir.rollout.engines.base import EngineKind, PauseMode, ServerPlan
from megatron_tir.rollout.sync.base import through_rank0

if TYPE_CHECKING:
    from megatron_tir.rollout.factory import EngineConfig


def check(cfg: EngineConfig) -> None:
    if not cfg.urls:
        raise ValueError("engine kind 'sglang' needs urls")


def settings(cfg: EngineConfig, model_dir: Path):
    """Loads nothing but the tokenizer (the EOS ids); waits for a restart as long as a load takes."""
    from transformers import AutoTokenizer

    from megatron_tir.rollout.engines.eos import resolve_eos_token_ids
    from megatron_tir.rollout.engines.sglang.client import SGLangEngineConfig, checkpoint_bytes, load_wait_s

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return SGLangEngineConfig(server_urls=cfg.urls, eos_token_ids=resolve_eos_token_ids(model_dir, tokenizer=tokenizer),
                              restart_timeout_s=load_wait_s(checkpoint_bytes(model_dir)))


def build(cfg: EngineConfig, settings, model_dir: Path):
    from transformers import AutoTokenizer

    from megatron_tir.rollout.engines.sglang.client import SGLangEngine

    return SGLangEngine(settings), AutoTokenizer.from_pretrained(model_dir)


def engine_sync(cfg: EngineConfig, engine, pause_mode: PauseMode):
    """Colocated: CUDA IPC from rank 0; servers of their own: None (every stage sends, :func:`weight_sync`)."""
    if not cfg.colocated:
        return None
    from megatron_tir.rollout.sync.sglang import TensorWeightSync

    return TensorWeightSync(engine, pause_mode=pause_mode)


def weight_sync(cfg: EngineConfig, service, pause_mode: PauseMode):
    if cfg.colocated:
        return through_rank0(cfg, service, pause_mode)
    import socket

    import torch

    from megatron_tir.rollout.sync.stages import StageWeightSync, StageWeightSyncConfig

    config = StageWeightSyncConfig(backend="nccl" if torch.cuda.is_available() else "gloo",
                                   address=socket.getfqdn(), pause_mode=pause_mode)
    sync = StageWeightSync(config, engine=None if service is None else service.engine,
                           submit=None if service is None else service.submit)
    sync.start()
    return sync


def servers(plan: ServerPlan) -> list[tuple[str, list[str]]]:
    """One ``sglang.launch_server`` per server (:class:`~megatron_tir.rollout.engines.sglang.server.SGLangServerConfig`)."""
    from megatron_tir.rollout.engines.sglang.server import SGLangServerConfig

    out = []
    for i in range(plan.count):
        server = SGLangServerConfig(model_path=plan.model_path, host=plan.host, port=plan.first_port + i,
                                    tp_size=plan.tp, ep_size=plan.ep, base_gpu_id=i * plan.tp,
                                    enable_return_routed_experts=plan.routed_experts,
                                    mem_fraction_static=plan.mem_fraction_static, colocated=plan.colocated,
                                    extra_args=tuple(plan.extra_args),
                                    launcher=(plan.python, "-m", "sglang.launch_server"))
        out.append((f"sglang-{server.port}", server.argv()))
    return out


SGLANG = EngineKind(check=check, where=lambda cfg: ", ".join(cfg.urls), settings=settings, build=build,
                    engine_sync=engine_sync, weight_sync=weight_sync, servers=servers,
                    routed_experts=True)  # meta_info.routed_experts (servers with --enable-return-routed-experts)
