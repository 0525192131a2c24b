"""A trainer rank's memory while colocated engines generate on its GPUs (slime / verl do the same).

Colocated SGLang servers release their memory (weights, KV cache, CUDA graphs) while the trainer
trains and take it back for generation. Their KV cache comes back at the weight sync
(``megatron_tir.rollout.sync.sglang.TensorWeightSync``: resume ``weights``, load, resume
``kv_cache`` + ``cuda_graph``), so before that every trainer rank must have given back what it
does not need while the engines generate:

* the gradient buffers (megatron-core ``DistributedDataParallel.offload_grad_buffers``: the
  buffers' storage resized to 0, their views kept; ``restore_grad_buffers`` reallocates and zeroes);
* the optimizer state and fp32 main parameters (``MegatronOptimizer.offload_to_cpu`` /
  ``restore_from_cpu``: moved to host memory and back);
* the caching allocator's free blocks (``torch.cuda.empty_cache``), which otherwise stay reserved
  for this process and are invisible to the server.

The weights themselves stay (the sync reads them). On a machine without CUDA the gradient buffers
are still freed (their storage is host memory), the optimizer state already lives in host memory
and there is no allocator cache: those two steps are skipped.

The loop calls ``release()`` after the update, before the weight sync, and ``reclaim()`` before the
next update, after the engine released its memory. Without colocated engines both do nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


class TrainingMemory:
    """Gives the trainable learners' gradient buffers and optimizer state back for generation, and takes them back."""

    def __init__(self, learners: Sequence, *, colocated: bool) -> None:
        self.learners = [lr for lr in learners if lr is not None and lr.optimizer is not None]  # frozen: nothing
        self.colocated = colocated
        self.released = False

    def release(self) -> None:
        """Before the engines resume their memory (collective in effect: every rank calls it)."""
        if not self.colocated or self.released:
            return
        cuda = torch.cuda.is_available()
        for learner in self.learners:
            learner.ddp.offload_grad_buffers(synchronize=cuda, empty_cache=False)
            if cuda:
                learner.optimizer.offload_to_cpu()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            log.info("training memory released for generation: %.1f GiB still reserved",
                     torch.cuda.memory_reserved() / 2**30)
        self.released = True

    def reclaim(self) -> None:
        """Before an update, after the engines released their memory."""
        if not self.released:
            return
        cuda = torch.cuda.is_available()
        for learner in self.learners:
            if cuda:
                learner.optimizer.restore_from_cpu()
            learner.ddp.restore_grad_buffers(synchronize=cuda)
        self.released = False
