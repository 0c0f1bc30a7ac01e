"""The tensor-parallel styles a plan names, as torch ``ParallelStyle`` objects: torch's own
(``colwise``, ``rowwise``, ``sequence_parallel``, ...), Hugging Face's (``rowwise_split_input``,
``all_reduce``, ``embedding_colwise``, ``mla_kv_a_proj``; aliases ``colwise_rep``,
``rowwise_rep``) and ours (``vocab_parallel``, ``local_heads``, ``local_params``, the replicated
ones). ``components/distributed/tp_plan.py`` resolves a plan to these names, checks it and applies
it; what each style does: docs/parallelism.md, docs/design-notes.md.
"""

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

VOCAB_STYLES = ("embedding_rowwise", "vocab_parallel", "colwise_gather_output")


class _GatherSequence(ParallelStyle):
    """A sublayer that needs whole tokens (an MoE block, or one the plan leaves replicated) inside a
    sequence-parallel model: every DTensor among its inputs, positional or keyword, is gathered
    into a plain replicated tensor; its output (a tuple's first item) goes back as sequence shards.
    Plan entries inside it take their styles without sequence parallelism."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_gather_inputs, with_kwargs=True)
        module.register_forward_hook(partial(_shard_output, device_mesh))
        return module


def _whole(value):
    if isinstance(value, DTensor):
        return value.redistribute(value.device_mesh, [Replicate()]).to_local()
    return value


def _gather_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(map(_whole, args)), {key: _whole(value) for key, value in kwargs.items()}


def _shard_output(mesh: DeviceMesh, module: nn.Module, args: tuple, output):
    def shards(tensor: torch.Tensor) -> DTensor:
        whole = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
        return whole.redistribute(mesh, [Shard(1)])

    return (shards(output[0]), *output[1:]) if isinstance(output, tuple) else shards(output)


HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


# The width of all heads together, which some attention code reshapes its output to (XGLM's).
HEADS_WIDTH = ("embed_dim",)


class _LocalHeads(ParallelStyle):
    """An attention module that reshapes by its own head counts (``self.num_heads``, not ``-1``)
    or the width of all its heads (``self.embed_dim``) over colwise q/k/v: each becomes this rank's
    share."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in (*HEAD_COUNTS, *HEADS_WIDTH):
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, name, value // device_mesh.size())
        return module


# Hugging Face style names that are one of ours under another name.
ALIASES = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}


class _MlaKvAProj(ParallelStyle):
    """HF's ``mla_kv_a_proj``: MLA's replicated ``kv_a_proj_with_mqa``, whose output ends in the
    rotary key part that goes to the attention of this rank's heads without passing a colwise
    projection (the rest does, through ``kv_b_proj``, which sums its input's gradient). That
    part's gradient is partial on each rank: summed over the TP ranks in the backward."""

    def __init__(self, rope_dim: int):
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_module, _inputs, output):
            passed, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], -1)
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False)
            return torch.cat([passed, rope.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(hook)
        return module


class _Owned(ParallelStyle):
    """A style whose module's plain-tensor output is a tensor of its own, not the view of a
    DTensor's storage that ``to_local`` returns: code that adds to it in place (Llama 4's MoE
    block adds its routed experts to the shared expert's output with ``add_``) is then allowed.

    ``settle`` (the embedding's): every output, DTensor or not, is copied, so the first decoder
    block's input is neither ``to_local``'s view (AOT autograd, torch 2.13, then hands a compiled
    block's input gradient to the redistribute before ``to_local`` as a plain tensor, which fails)
    nor a DTensor over a pending collective (an ``AsyncCollectiveTensor``, which a compiled block
    guards on: the next block, fed a compiled block's plain output, would compile again)."""

    def __init__(self, style: ParallelStyle, settle: bool = False):
        self.style, self.settle = style, settle
        self.output_layouts = style.output_layouts  # read by LoRA's parallelize_tp

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.style._apply(module, device_mesh)
        if self.settle:
            module.register_forward_hook(_settled_output)
        elif self.style.use_local_output:  # else the output is a DTensor, not a view of one
            module.register_forward_hook(_own_output)
        return module


def _own_output(module: nn.Module, args: tuple, output):
    # A local output that requires grad is ``to_local``'s view (its ``grad_fn`` says so too, but
    # reading ``grad_fn`` is a graph break under torch.compile; ``requires_grad`` is not).
    return output.clone() if output.requires_grad else output


class _Gathered(ParallelStyle):
    """A column-wise projection under sequence parallelism whose input may come as sequence shards
    (a plan without ``attention_input``/``mlp_input``, as Gemma 3's own): the shards are gathered
    explicitly before the projection. Left to the matmul's sharding propagation, the gather
    worked eagerly but was a data-dependent graph break under torch.compile."""

    def __init__(self, style: ParallelStyle):
        self.style = style
        self.output_layouts = style.output_layouts  # read by LoRA's parallelize_tp

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.style._apply(module, device_mesh)
        module.register_forward_pre_hook(_replicated_input, prepend=True)
        return module


def _replicated_input(module: nn.Module, args: tuple):
    first, *rest = args
    if isinstance(first, DTensor) and any(not p.is_replicate() for p in first.placements):
        first = first.redistribute(first.device_mesh, [Replicate()] * first.device_mesh.ndim)
    return (first, *rest)


def _settled_output(module: nn.Module, args: tuple, output):
    return output.clone()  # a DTensor's clone waits for its collective: a plain local tensor


class _LocalParams(ParallelStyle):
    """HF's ``local_params``: the module's forward sees its sharded parameters as this rank's
    slices (attention sinks of this rank's heads, beside local q/k/v), their gradients those
    slices' (no reduction). Every direct parameter of such a module is sharded (``_resolve``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_localize)
        module.register_forward_hook(_restore)
        return module


def _localize(module: nn.Module, args: tuple) -> None:
    shards = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    module._tp_shards = shards
    module._parameters.update({name: shard.to_local() for name, shard in shards.items()})


def _restore(module: nn.Module, args: tuple, output):
    module._parameters.update(module.__dict__.pop("_tp_shards", {}))
    return output


class _LocalParamsAllReduce(_LocalParams):
    """HF's ``all_reduce`` on a module whose own parameters the plan shards (Inkling's shared
    experts: 3-D gate/up split on their rows, down on its columns): the forward runs on this
    rank's slices (``local_params``) and sums the partial outputs over the TP ranks; each tensor
    input's gradient, partial on each rank (its slices' share), is summed in the backward."""

    def __init__(self, sequence_parallel: bool):
        self.tokens = Shard(1) if sequence_parallel else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_pre_hook(partial(_summed_backward, device_mesh), with_kwargs=True)
        module.register_forward_hook(partial(_summed_output, device_mesh, self.tokens))
        return module


def _summed_backward(mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict):
    def summed(value):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        return value.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    return tuple(map(summed, args)), {key: summed(value) for key, value in kwargs.items()}


def _summed_output(mesh: DeviceMesh, tokens, module: nn.Module, args: tuple, output):
    whole = DTensor.from_local(output, mesh, [Partial()], run_check=False).redistribute(
        mesh, [tokens]
    )
    return whole.to_local() if isinstance(tokens, Replicate) else whole


class _ReplicatedParameters(ParallelStyle):
    """Ours: a module whose own parameters meet sequence shards (Doge's residual scales on the
    decoder block) under sequence parallelism: they become Replicate DTensors, whose gradients,
    partial over the shards, are summed when they are finalised. Its children are untouched."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, _ in list(module.named_parameters(recurse=False)):
            _distribute_parameter(module, name, device_mesh, Replicate())
        return module


def _distribute_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    """Make the module's own parameter ``name`` a DTensor of ``placement`` on ``mesh`` (each rank
    keeps its part of its own data: nothing is sent)."""
    full = module._parameters[name]
    local = distribute_tensor(full.data, mesh, [placement], src_data_rank=None)
    module._parameters[name] = nn.Parameter(local, requires_grad=full.requires_grad)


class ShardParameter(ParallelStyle):
    """A plan entry naming a parameter: that parameter of the module becomes a DTensor sharded on
    ``dim`` (each rank reads only its slice when it loads)."""

    def __init__(self, parameter: str, dim: int):
        self.parameter, self.dim = parameter, dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_parameter(module, self.parameter, device_mesh, Shard(self.dim))
        return module


# HF's styles on a parameter, as the dimension they shard (of an ``ndim``-D parameter).
PARAMETER_STYLES = {
    "colwise": lambda ndim: max(ndim - 2, 0),
    "rowwise": lambda ndim: ndim - 1,
}
# HF's styles for experts (tensor parallelism inside every expert): the experts are split by
# expert parallelism instead, so a plan's entries for them are left out (``models.families``).
EXPERT_STYLES = ("moe_tp_experts", "packed_colwise", "packed_rowwise", "moe_identity_expert")


# Styles that do not depend on sequence parallelism or the config.
_PLAIN_STYLES = {
    "sequence_parallel": SequenceParallel,
    "gather_sequence": _GatherSequence,
    "local_heads": _LocalHeads,
    "local_params": _LocalParams,
    "sequence_parallel_parameters": _ReplicatedParameters,
    # ours: outputs per head from all heads (Doge's dt_proj), each rank keeps its heads'
    "rowwise_local_heads": lambda: RowwiseParallel(output_layouts=Shard(-1)),
}


def torch_style_of(name: str, sequence_parallel: bool, config=None) -> ParallelStyle | None:
    """The torch style for a style name; None for styles that only mark a replicated module.

    Under sequence parallelism activations between blocks are DTensors sharded on the sequence
    (``use_local_output=False``): HF code that reads ``hidden_states.shape`` (positions, the causal
    mask, the attention reshape) sees the global length, with any attention implementation."""
    tokens = Shard(1) if sequence_parallel else Replicate()
    local_output = not sequence_parallel  # under SP the outputs stay DTensors (see above)
    styles = {
        # Under SP the input arrives as a DTensor (gathered by the block's *_input style, or sharded
        # by a norm), redistributed to Replicate whatever ``input_layouts`` says.
        "colwise": lambda: _Gathered(ColwiseParallel()) if sequence_parallel else ColwiseParallel(),
        # One gather (SP) or one backward all-reduce (plain) per block instead of one per
        # projection: the block's input becomes a Replicate DTensor that q/k/v (or gate/up) share.
        "attention_input": lambda: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": tokens},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        ),
        "mlp_input": lambda: PrepareModuleInput(
            input_layouts=(tokens,), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        "rowwise": lambda: _Owned(
            RowwiseParallel(output_layouts=tokens, use_local_output=local_output)
        ),
        "embedding_rowwise": lambda: _Owned(
            RowwiseParallel(
                input_layouts=Replicate(), output_layouts=tokens, use_local_output=local_output
            ),
            settle=True,
        ),
        "vocab_parallel": lambda: ColwiseParallel(
            input_layouts=tokens, output_layouts=Shard(-1), use_local_output=False
        ),
        "colwise_gather_output": lambda: ColwiseParallel(
            input_layouts=tokens, output_layouts=Replicate()
        ),
        # HF's: a Linear whose input is whole on every rank (after a colwise_gather_output, where
        # the model slices or normalises the whole projection): each rank multiplies its slice of
        # the input by its rows, the partial outputs are summed. The backward all-gathers the
        # input's gradient slices, so what comes before sees the whole gradient, as at tp=1.
        "rowwise_split_input": lambda: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=tokens, use_local_output=local_output
        ),
        # HF's: a module whose output is partial over the TP ranks (a shared expert's sum of
        # rowwise outputs computed locally), summed in the forward; its gradient is replicated.
        "all_reduce": lambda: PrepareModuleOutput(
            output_layouts=(Partial(),),
            desired_output_layouts=(tokens,),
            use_local_output=local_output,
        ),
        # HF's: an embedding sharded over the hidden dimension, the vectors gathered
        "embedding_colwise": lambda: ColwiseParallel(
            input_layouts=Replicate(), output_layouts=tokens, use_local_output=local_output
        ),
        "mla_kv_a_proj": lambda: _MlaKvAProj(getattr(config, "qk_rope_head_dim", 0)),
        "local_params_all_reduce": lambda: _LocalParamsAllReduce(sequence_parallel),
        **dict.fromkeys(("replicated_with_grad_allreduce", "replicate"), lambda: None),
        **_PLAIN_STYLES,
    }
    name = ALIASES.get(name, name)
    _refuse_expert_style(name)
    if name not in styles:
        raise ValueError(f"unknown tensor-parallel style {name!r}; known: {sorted(styles)}")
    return styles[name]()


def _refuse_expert_style(name: str) -> None:
    if name in EXPERT_STYLES:
        raise ValueError(
            f"{name!r} is Hugging Face's tensor parallelism inside MoE experts, for experts only: "
            "experts are split by expert parallelism here (their plan entries are left out)"
        )
