"""torchao's float8 tensor-parallel styles for modules that hold float8 linears (``train.precision=
fp8``, ``components.models.fp8``): the same sharding as the plain styles, with the activations cast
to fp8 *before* their collectives, so sequence parallelism all-gathers fp8 (one cast per block,
shared by q/k/v or gate/up) and each projection's output gradient is cast once.

torchao's styles take tensorwise scaling only; under ``rowwise`` the plain styles stay (bf16
collectives, torchtitan's choice too). Over gloo (the CPU) two of them cannot run under sequence
parallelism: their collective is an all-gather of float8 bytes (``PrepareFloat8ModuleInput``'s of
the block's input in forward, ``Float8RowwiseParallel``'s of the output gradient in backward), and
gloo has no float8 type ("Invalid scalar type"; PyTorch maps float8 to bytes for NCCL alone,
pytorch/pytorch#126556). There the plain styles stay for those two (the gathers in bf16, each
projection casting its own input); ``Float8ColwiseParallel`` always, and all three without sequence
parallelism, where their collectives are bf16 ones. On NCCL (CUDA) all three, everywhere.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)


def _tensorwise(module: nn.Module) -> bool:
    granularity = getattr(getattr(module, "config", None), "cast_config_input", None)
    tensorwise = getattr(granularity, "scaling_granularity", None) is ScalingGranularity.TENSORWISE
    return isinstance(module, Float8Linear) and tensorwise


def float8_style(
    style: str, module: nn.Module, sequence_parallel: bool, mesh: DeviceMesh
) -> ParallelStyle | None:
    """torchao's float8 version of the plan's ``style`` for ``module``, or None (the plain style
    stays): ``colwise``/``rowwise`` on a tensorwise float8 linear, ``attention_input``/``mlp_input``
    on a module whose linears all are; on a CPU ``mesh`` (gloo) under ``sequence_parallel`` only
    ``colwise`` (the others would all-gather float8)."""
    if style not in ("colwise", "rowwise", "attention_input", "mlp_input"):
        return None
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears or not all(type(m).__module__.startswith("torchao.") for m in linears):
        return None  # no float8 linear: every run but fp8's
    if not all(map(_tensorwise, linears)):
        return None
    if style == "colwise":
        return Float8ColwiseParallel()
    if sequence_parallel and mesh.device_type == "cpu":  # gloo cannot all-gather float8
        return None
    tokens = Shard(1) if sequence_parallel else Replicate()
    if style == "rowwise":
        return Float8RowwiseParallel(output_layouts=tokens, use_local_output=not sequence_parallel)
    if style == "mlp_input":
        return PrepareFloat8ModuleInput(
            input_layouts=(tokens,), desired_input_layouts=(Replicate(),)
        )
    return PrepareFloat8ModuleInput(
        input_kwarg_layouts={"hidden_states": tokens},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
    )
