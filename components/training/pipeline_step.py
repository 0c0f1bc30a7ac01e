"""The step function of a pipelined run (``train(run, plan, step_fn=pipelined_step)``): the step's
micro-batches stacked and handed to the rank's pipeline schedule, which splits them back."""

import torch


def pipelined_step(run, plan, step: int) -> torch.Tensor:
    """Forward and backward of step ``step``'s micro-batches through ``run.pipeline``
    (``components.distributed.pipeline.Pipeline``); the step's summed loss (float64), the same on
    every stage. ``plan``: unused, the step function's signature."""
    batches = run.data.batches_for_step(step)
    names = ("input_ids", "labels", "position_ids")
    stacked = [torch.cat([getattr(batch, name) for batch in batches]) for name in names]
    tensors = [tensor.to(run.device) for tensor in stacked]
    return run.pipeline.forward_backward(*tensors, run.data.labels_in_step(step))
