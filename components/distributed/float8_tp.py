"""torchao's float8 tensor-parallel styles for modules that hold float8 linears (``train.precision=
fp8``, ``components.models.fp8``): the same sharding as the plain styles, with the activations cast
to fp8 *before* their collectives, so sequence parallelism all-gathers fp8 (one cast per block,
shared by q/k/v or gate/up) and each projection's output gradient is cast once.

torchao's styles take tensorwise scaling only; under ``rowwise`` the plain styles stay (bf16
collectives, torchtitan's choice too). So they do on the CPU: gloo cannot move float8 tensors
("Invalid scalar type" in the sequence-parallel all-gather).
"""

import sys

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


def _tensorwise(module: nn.Module) -> bool:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    granularity = getattr(getattr(module, "config", None), "cast_config_input", None)
    tensorwise = getattr(granularity, "scaling_granularity", None) is ScalingGranularity.TENSORWISE
    return isinstance(module, Float8Linear) and tensorwise


def float8_style(
    style: str, module: nn.Module, sequence_parallel: bool, mesh: DeviceMesh
) -> ParallelStyle | None:
    """torchao's float8 version of the plan's ``style`` for ``module``, or None (the plain style
    stays): ``colwise``/``rowwise`` on a tensorwise float8 linear, ``attention_input``/``mlp_input``
    on a module whose linears all are; never on a CPU ``mesh`` (gloo)."""
    if "torchao.float8.float8_linear" not in sys.modules:  # not imported: no float8 linear exists
        return None
    if mesh.device_type == "cpu":
        return None
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    tokens = Shard(1) if sequence_parallel else Replicate()
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if style in ("attention_input", "mlp_input") and linears and all(map(_tensorwise, linears)):
        if style == "mlp_input":
            return PrepareFloat8ModuleInput(
                input_layouts=(tokens,), desired_input_layouts=(Replicate(),)
            )
        return PrepareFloat8ModuleInput(
            input_kwarg_layouts={"hidden_states": tokens},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
    if style == "colwise" and _tensorwise(module):
        return Float8ColwiseParallel()
    if style == "rowwise" and _tensorwise(module):
        return Float8RowwiseParallel(output_layouts=tokens, use_local_output=not sequence_parallel)
    return None
