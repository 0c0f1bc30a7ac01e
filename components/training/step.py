"""One micro-batch: forward, loss over possibly vocab-sharded logits, backward."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from components.distributed.tp_plan import cross_entropy_sum


def forward_backward(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, global_tokens: int) -> float:
    """Run one micro-batch and accumulate gradients; return its summed token loss (not normalised).

    The loss is divided by ``global_tokens`` (labelled tokens in the whole global batch, over every
    micro-batch and dp rank) before backward, so accumulated and dp-summed gradients equal the gradient
    of the global mean loss. Position ids are passed explicitly because under sequence parallelism the
    model sees only a shard of the sequence and would derive them from the shard's length. No attention
    mask is passed: padding is on the right and masked out of the labels, which causal attention allows.
    """
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    with loss_parallel():  # the backward of a vocab-parallel loss must run inside it too
        logits = model(input_ids=input_ids, position_ids=position_ids).logits
        loss_sum = cross_entropy_sum(logits, labels)
        (loss_sum / global_tokens).backward()
    loss_sum = loss_sum.full_tensor() if isinstance(loss_sum, DTensor) else loss_sum
    return loss_sum.item()
