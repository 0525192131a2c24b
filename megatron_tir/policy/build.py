"""How the policy is built and split: process groups and the megatron-core GPTModel.

``init_parallel(tp, pp)`` sets up torch.distributed (gloo without a GPU, nccl with one)
and megatron's model-parallel groups; ``build_gpt_model(spec, ...)`` builds this rank's
part of the GPTModel with the Transformer Engine layer spec when TE is importable on a
GPU, megatron-core's local spec otherwise. The CPU redirections of ``cpu_compat`` are
applied here, so callers never think about them.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket

import torch

from megatron_tir.policy import cpu_compat
from megatron_tir.policy.spec import ModelSpec

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def init_parallel(tp: int = 1, pp: int = 1, *, seed: int = 1234, backend: str | None = None,
                  timeout_s: float = 600.0) -> None:
    """torch.distributed + megatron model-parallel groups for ``tp`` x ``pp`` (x data parallel).

    Uses the usual env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); without it, a
    single-process group on a free local port. Idempotent for the same sizes; ValueError
    if groups of other sizes exist (checkpoint conversion, which builds a TP=1 meta model,
    therefore runs in its own process, not inside a parallel job).
    """
    from megatron.core import parallel_state, tensor_parallel

    cpu_compat.apply()
    if not torch.distributed.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend=backend,
                                             timeout=datetime.timedelta(seconds=timeout_s))
    world = torch.distributed.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp * pp}")
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have == (tp, pp):
            return
        raise ValueError(f"model parallelism is already initialized with tp={have[0]} pp={have[1]}, "
                         f"not tp={tp} pp={pp} (call destroy_parallel() first)")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def layer_spec(spec: ModelSpec, *, use_te: bool | None = None):
    """The transformer layer spec: Transformer Engine on a GPU with TE, megatron-core local otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = te_available()
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def build_gpt_model(spec: ModelSpec, *, pre_process: bool | None = None, post_process: bool | None = None,
                    parallel_output: bool = True, meta: bool = False, use_te: bool | None = None,
                    **config_overrides):
    """This rank's GPTModel for ``spec`` at the current TP/PP (``init_parallel`` first).

    ``meta=True`` builds it on the meta device (no memory, no init): enough for
    ``sharded_state_dict()`` key/shape templates, as checkpoint conversion uses it.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    if meta:
        config_overrides.setdefault("perform_initialization", False)
    config = spec.transformer_config(tp=tp, pp=pp, **config_overrides)
    ctx = torch.device("meta") if meta else contextlib.nullcontext()
    with ctx:
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(spec, use_te=use_te),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=spec.rotary_base,
        )
    if not meta and torch.cuda.is_available():
        model.cuda()
    return model
