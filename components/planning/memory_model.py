"""Per-rank memory of a training step, from the parallel model's local shards and the batch
geometry.

- ``params``, ``grads``, ``optimizer``: exact, the bytes of this rank's local shards of the model as
  the recipe builds it (on the meta device), of its gradients and of AdamW's moments (or SGD's).
- ``activations``: what autograd saves for backward in one micro-batch, per decoder layer, counted
  from the tensors a Hugging Face Llama-style block keeps (with ``full`` activation checkpointing,
  each layer's input and one recomputed layer).
- ``buffers``: the step's transients (logits, autocast copies, FSDP's unsharded layers, the TP
  replica sync's buffer, AdamW's temporaries).
- ``total``: the peak, not the sum (backward frees activations as it fills gradients), plus
  ``runtime``, the process itself. Checked against measured peaks in BENCHMARKS.md.

Design notes: docs/design-notes.md
"""

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from components.distributed.replicas.flat_buffers import MAX_FLAT_BUFFER_BYTES
from components.planning.flops import head_dim, is_sparse_layer

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What a plan may change to make a run fit."""

    tp: int
    dp: int
    ep: int
    micro_batch_size: int
    activation_checkpointing: str  # none | full | selective


@dataclass(frozen=True, kw_only=True)
class Step:
    """What does not change between layouts: the sequence, the precision and the optimizer."""

    seq_len: int
    global_batch_size: int
    precision: str  # fp32 | bf16-mixed | bf16
    sequence_parallel: bool
    optimizer_moments: int  # 2 for Adam(W), 1 for SGD with momentum, 0 without
    device_type: str  # cuda | cpu: AdamW's temporaries, the runtime
    runtime_gib: float  # the process itself (CPU), 0 on CUDA


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """GiB on the busiest rank (rank 0: FSDP gives the last ranks the shorter shards)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    runtime: float
    total: float
    detail: dict  # each buffer and activation term, GiB

    def as_dict(self) -> dict:
        return asdict(self)


def optimizer_moments(target: str, options: dict) -> int:
    """State tensors per parameter of the optimizer class ``target`` (a dotted path)."""
    name = target.rpartition(".")[2].lower()
    if name == "sgd":
        return 1 if options.get("momentum", 0) else 0
    return 1 if name in ("adagrad", "rmsprop", "adafactor") else 2  # Adam, AdamW, ... : two moments


def _local(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


def _tp_replicated(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is whole on every TP rank (a norm; the vocabulary's fallback)."""
    if not isinstance(parameter, DTensor):
        return True
    names = parameter.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return True
    return not parameter.placements[names.index("tp")].is_shard()


def _state(model: nn.Module, layout: Layout) -> dict[str, float]:
    """Bytes of the local shards: all of them, one decoder layer's unsharded over dp, the matmul
    weights (autocast copies), the TP-replicated ones (the replica sync) and the largest tensor."""
    params = list(model.parameters())
    local = [_local(p) for p in params]
    total = sum(t.numel() * t.element_size() for t in local)
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    layer = max((sum(_local(p).numel() for p in block.parameters()) for block in layers), default=0)
    embedding = model.get_input_embeddings().weight
    pairs = list(zip(params, local, strict=True))
    matmul = sum(t.numel() for p, t in pairs if t.dim() >= 2 and p is not embedding)
    replicated = sum(t.numel() * t.element_size() for p, t in pairs if _tp_replicated(p))
    return {
        "bytes": total,
        "element": local[0].element_size() if local else 4,
        "layer_numel": layer * layout.dp,  # FSDP all-gathers a layer over dp
        "matmul_numel": matmul if layout.dp == 1 else 0,  # autocast copies: only without FSDP
        "replicated_bytes": replicated,
        "largest_bytes": max((t.numel() * t.element_size() for t in local), default=0),
    }


def _layer_rows(config, layout: Layout, step: Step, index: int) -> tuple[float, float]:
    """(bytes per token decoder layer ``index`` saves without checkpointing, bytes of its input)."""
    tp, sp = layout.tp, step.sequence_parallel
    compute = 4 if step.precision == "fp32" else 2
    autocast = step.precision == "bf16-mixed" and layout.dp == 1  # fp32 weights, bf16 matmuls
    residual = 4 if step.precision == "fp32" or autocast else 2
    autocast_copies = autocast and tp == 1  # each projection casts its own copy of the input
    hidden, dim = config.hidden_size, head_dim(config)
    q = config.num_attention_heads * dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * dim
    norm_rows = hidden * residual * (2 / tp if sp else 2)  # input and normalised output, per norm
    attention_in = hidden * compute * (3 if autocast_copies else 1)
    attention = (2 * (q + kv) + kv + 2 * q) * compute / tp + 4 * config.num_attention_heads / tp
    if is_sparse_layer(config, index):
        top_k = getattr(config, "num_experts_per_tok", 1)
        inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        mlp_in = hidden * compute * (1 + 2 * top_k / layout.ep)  # input; routed rows and outputs
        mlp = 4 * inner * compute * top_k / layout.ep
    else:
        mlp_in = hidden * compute * (2 if autocast_copies else 1)
        mlp = 4 * config.intermediate_size * compute / tp
    saved = 2 * norm_rows + attention_in + attention + mlp_in + mlp
    return saved, hidden * residual / (tp if sp else 1)


def _activations(config, layout: Layout, step: Step) -> dict[str, float]:
    tokens = layout.micro_batch_size * step.seq_len
    rows = [_layer_rows(config, layout, step, i) for i in range(config.num_hidden_layers)]
    mode = layout.activation_checkpointing
    if mode == "none":
        layers, recompute = sum(saved for saved, _ in rows), 0.0
    else:
        kept = 0.0 if mode == "full" else 0.5  # selective keeps the matmul and attention outputs
        layers = sum(block_input + kept * saved for saved, block_input in rows)
        recompute = max(saved for saved, _ in rows)  # one layer recomputed at a time in backward
    residual = 4 if step.precision != "bf16" else 2
    ends = 3 * config.hidden_size * residual / (layout.tp if step.sequence_parallel else 1)
    return {
        "layers": tokens * layers,
        "recompute": tokens * recompute,
        "embedding_and_norm": tokens * ends,
    }


def _buffers(config, layout: Layout, step: Step, state: dict) -> dict[str, float]:
    tokens = layout.micro_batch_size * step.seq_len
    compute = 4 if step.precision == "fp32" else 2
    vocab_share = layout.tp if config.vocab_size % layout.tp == 0 else 1
    logits = tokens * config.vocab_size / vocab_share * (compute + 4 + (4 if compute != 4 else 0))
    fsdp = unsharded = 0.0
    if layout.dp > 1:
        gathered = 2 if step.precision != "fp32" else 4
        fsdp = 2 * state["layer_numel"] * (gathered + 4)  # two layers' parameters, fp32 grads
        if step.global_batch_size > layout.micro_batch_size * layout.dp:  # micro-batches accumulate
            unsharded = state["bytes"] / state["element"] * layout.dp * 4
    moments = state["bytes"] * step.optimizer_moments / 2
    temporaries = moments if step.device_type == "cuda" else 2 * state["largest_bytes"]
    return {
        "logits": logits,
        "autocast_weight_copies": 2 * state["matmul_numel"] * (step.precision == "bf16-mixed"),
        "fsdp_layers": fsdp,
        "fsdp_unsharded_accumulated_grads": unsharded,
        "replica_sync": min(MAX_FLAT_BUFFER_BYTES, state["replicated_bytes"]) * (layout.tp > 1),
        "optimizer_step": temporaries,
    }


def estimate_memory(model: nn.Module, config, layout: Layout, step: Step) -> MemoryEstimate:
    """Per-rank memory of a training step of ``model``, the parallel meta model of ``layout``."""
    state = _state(model, layout)
    params = grads = state["bytes"]
    optimizer = params * step.optimizer_moments
    act, buf = _activations(config, layout, step), _buffers(config, layout, step, state)
    fsdp = buf["fsdp_layers"] + buf["fsdp_unsharded_accumulated_grads"]
    forward_end = sum(act.values()) - act["recompute"] + buf["logits"] + fsdp
    forward_end += buf["autocast_weight_copies"]
    checkpointed = layout.activation_checkpointing != "none"
    backward_end = grads + act["recompute"] + act["layers"] * checkpointed + buf["replica_sync"]
    backward_end += fsdp
    optimizer_step = grads + buf["optimizer_step"]
    peak = params + optimizer + max(forward_end, backward_end, optimizer_step)
    gib = {name: value / GIB for name, value in {**act, **buf}.items()}
    return MemoryEstimate(
        params=params / GIB,
        grads=grads / GIB,
        optimizer=optimizer / GIB,
        activations=sum(act.values()) / GIB,
        buffers=sum(buf.values()) / GIB,
        runtime=step.runtime_gib,
        total=peak / GIB + step.runtime_gib,
        detail=gib,
    )
