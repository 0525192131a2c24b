"""The device-check mode on the trainer's update: every collective on the device, no host read per micro-batch."""

from __future__ import annotations

import pytest
import torch
from crafted_rollouts import C, group
from device_check import DeviceCheckError

from megatron_tir.train.batch import StepRollouts
from megatron_tir.train.config import apply_overrides
from megatron_tir.train.recipes import tiny_cpu


@pytest.fixture(scope="module")
def parallel_1x1():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


def test_the_mode_refuses_a_host_tensor_collective(parallel_1x1, device_check):
    with pytest.raises(DeviceCheckError, match="all_reduce of a host tensor"):
        torch.distributed.all_reduce(torch.tensor(0.5), op=torch.distributed.ReduceOp.MAX)
    on_device = torch.zeros((), device=torch.device("cpu")) + torch.tensor(2.0)  # a device input: on the device
    torch.distributed.all_reduce(on_device, op=torch.distributed.ReduceOp.MAX)
    assert float(on_device) == 2.0


def test_the_mode_refuses_a_host_read_inside_the_schedule(parallel_1x1, device_check):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    weight = torch.nn.Parameter(torch.ones(3, device=torch.device("cpu")))

    def forward_step(data_iterator, model):
        out = weight * next(data_iterator)

        def loss_func(x):
            if x.any():  # a host read of a device tensor: the GPU waits here on every micro-batch
                pass
            return x.sum(), {}
        return out, loss_func

    from megatron.core import ModelParallelConfig
    from megatron.core.enums import ModelType

    model = torch.nn.Linear(1, 1)
    model.config, model.model_type = ModelParallelConfig(), ModelType.encoder_or_decoder
    model.set_input_tensor = lambda tensor: None
    with pytest.raises(DeviceCheckError, match="host synchronisation"):
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([torch.ones(3)]),
                                    model=[model], num_microbatches=1, seq_length=3,
                                    micro_batch_size=1, forward_only=True)


def test_update_policy_runs_in_the_device_check_mode(parallel_1x1, device_check):
    """The whole update (old log-probs, PPO steps, the max-ratio all-reduce) as a GPU run's collectives see it."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.train.algorithm import build_algorithm

    cfg = apply_overrides(tiny_cpu(), ["trainer.ppo.epochs=2", "trainer.loss.entropy_coef=0"])
    learner = Learner(cfg.learner)
    groups = [group(0, (C, 1.0, (-0.5, -1.0, -2.0)), (C, 0.0, (-0.7, -0.2, -1.5))),
              group(1, (C, 1.0, (-0.1, -3.0, -0.4)), (C, 0.0, (-1.1, -0.9, -2.2)))]
    metrics = build_algorithm(cfg, learner).update(1, StepRollouts.of_groups(groups, cfg), {}).metrics
    assert device_check.violations == []
    assert metrics["train/optimizer_steps"] == 2.0
    # epoch 1 starts at ratio 1 (old log-probs are the learner's); epoch 2 moved: the max ratio is > 1
    assert metrics["train/max_ratio"] > 1.0
