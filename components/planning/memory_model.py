"""Per-rank memory of a training step, from the parallel model's local shards and the batch
geometry.
- ``params``, ``grads``, ``optimizer``: exact, this rank's local shards (built on the meta device),
  their gradients and AdamW's moments (or SGD's).
- ``activations``: what autograd saves for backward in one micro-batch (``seq_len / cp`` tokens of
  a row), per decoder layer (``full`` checkpointing: each layer's input and one layer recomputed
  at a time), the final norm's and the head's; with a mask (cp > 1, packed rows) each layer's K and
  V over the whole sequence, repeated to every head, and its float mask. A pipeline rank
  (:class:`Stage`): its own layers, times the micro-batches in flight, and its output kept.
- ``buffers``: the step's transients (logits, autocast copies, fp8's float8 copies, gradients in
  flight, FSDP's unsharded layers, the replica sync's buffer, AdamW's temporaries).
- ``frozen``: a frozen model's shards (DPO's reference, distillation's teacher: :class:`Frozen`);
  its no_grad forward a phase of its own, a teacher's hidden states and logit chunks in the step's.
- ``total``: the largest of the step's phases (``phases``), plus ``runtime``; ``host``: what
  CPU offload keeps on the host on CUDA (``offload.py``). Design notes: docs/design-notes.md
"""

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.float8.float8_linear import Float8Linear

from components.distributed.chunked_loss import chunks_head
from components.distributed.layout import ParallelDims
from components.distributed.replicas.flat_buffers import MAX_FLAT_BUFFER_BYTES
from components.models.build import decoder_blocks
from components.models.qlora import local_shape, quantizable, stored_bytes
from components.planning.flops import head_dim, is_sparse_layer
from components.planning.offload import host_bytes, offloaded, staging_bytes

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What a plan may change to make a run fit: the parallel layout's degrees, the micro-batch,
    activation checkpointing."""

    dims: ParallelDims  # FSDP shards over dp_shard × cp; the world is pp × dp × cp × tp
    micro_batch_size: int
    activation_checkpointing: str  # none | full | selective


@dataclass(frozen=True, kw_only=True)
class Step:
    """What does not change between layouts: the sequence, the precision and the optimizer."""

    seq_len: int  # positions of the widest micro-batch: train.seq_len, or the data's longest row's
    global_batch_size: int
    precision: str  # fp32 | bf16-mixed | bf16 | fp8
    sequence_parallel: bool
    optimizer_moments: int  # 2 for Adam(W), 1 for SGD with momentum, 0 without
    # torchao's AdamW8bit / AdamW4bit: bits per moment value, values per fp32 scale; 0: the
    # parameter's dtype (torch's optimizers; torchao's _AdamW, bf16 with bf16 parameters)
    optimizer_bits: int = 0
    optimizer_block: int = 0
    device_type: str  # cuda | cpu: AdamW's temporaries, the runtime
    runtime_gib: float  # the process itself (CPU), 0 on CUDA
    loss_chunk_tokens: int  # train.loss_chunk_tokens: tokens per head + loss chunk; 0: unchunked
    packing: bool = False  # train.packing: transformers then builds a document mask (cp=1 too)
    fp8_recipe: str = "tensorwise"  # with fp8: tensorwise all-gathers float8 weights under FSDP
    nf4_base: bool = False  # peft=qlora: the adapted linears' weights in NF4, sharded by FSDP
    pp_schedule: str = "1f1b"  # with pp > 1: gpipe | 1f1b | interleaved_1f1b
    pp_stages_per_rank: int = 1
    rows_per_sample: int = 1  # rows a micro-batch holds per sample: DPO's pairs are 2
    # train.cpu_offload: FSDP at dp=1 too; on CUDA its shards, their gradients and the optimizer
    # in host memory (components/planning/offload.py)
    cpu_offload: bool = False


@dataclass(frozen=True, kw_only=True)
class Frozen:
    """A frozen model run forward under ``no_grad`` before the trained one on each micro-batch:
    DPO's reference (``model`` None: the trained model itself with its adapters off, peft=lora,
    no weights of its own) or distillation's teacher, whose last hidden states live on through
    the trained model's step (``keeps_hidden``: the KL reads them chunk by chunk, forward and
    backward). ``model``: its parallel meta model; ``config``: its Hugging Face config."""

    model: nn.Module | None
    config: Any
    keeps_hidden: bool


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One pipeline rank's share of the model and of the schedule."""

    layers: tuple[int, ...]  # its decoder layers' indices (its embedding: seen on its model)
    last: bool  # holds the final norm and lm_head
    in_flight: float = 1.0  # micro-batches' activations held at once at its peak
    grads_held: bool = False  # its gradients exist at that peak (1F1B's steady state)
    pipelined: bool = False  # a stage of a pipeline (else the whole model of a pp=1 run)


def whole_model(config) -> Stage:
    """The whole model as one stage: pp=1."""
    return Stage(layers=tuple(range(config.num_hidden_layers)), last=True)


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """GiB on the busiest rank (rank 0: FSDP gives the last ranks the shorter shards)."""

    params: float
    grads: float
    optimizer: float
    frozen: float  # a frozen second model's weights (:class:`Frozen`), 0 without one
    activations: float
    buffers: float
    runtime: float
    total: float
    detail: dict  # each buffer and activation term, GiB
    phases: dict  # GiB above params + optimizer at each phase of the step
    host: float = 0.0  # train.cpu_offload on CUDA: the host memory of this rank's shards
    host_detail: dict = field(default_factory=dict)  # its terms, GiB

    def as_dict(self) -> dict:
        return asdict(self)


def optimizer_moments(target: str, options: dict) -> int:
    """State tensors per parameter of the optimizer class ``target`` (a dotted path)."""
    name = target.rpartition(".")[2].lower()
    if name == "sgd":
        return 1 if options.get("momentum", 0) else 0
    return 1 if name in ("adagrad", "rmsprop", "adafactor") else 2  # Adam, AdamW, ... : two moments


QUANTIZED_STATE = {"AdamW8bit": 8, "AdamW4bit": 4}  # torchao.optim's classes: bits per value
QUANTIZED_MIN_NUMEL = 4096  # torchao (as bitsandbytes) quantizes a shard this large or larger


def optimizer_state_bits(target: str, options: dict) -> tuple[int, int]:
    """(bits per moment value, values per scale) of the optimizer class ``target`` (a dotted
    path): torchao's low-bit AdamW's, or (0, 0) for a moment in the parameter's dtype."""
    bits = QUANTIZED_STATE.get(target.rpartition(".")[2], 0)
    return (bits, options["block_size"]) if bits else (0, 0)


def moment_bytes(local: torch.Tensor, bits: int, block: int) -> int:
    """Bytes of one optimizer moment of the local shard ``local``: quantized (codes, an fp32 scale
    per ``block`` values, the fp32 code table) when torchao quantizes it, a tensor like it else."""
    numel = local.numel()
    if not bits or numel < QUANTIZED_MIN_NUMEL or numel % block:
        return numel * local.element_size()
    return numel * bits // 8 + numel // block * 4 + 2**bits * 4


def _data_parallel(layout: Layout) -> int:
    """The ranks the weights are data parallel over (FSDP is on above 1): dp × cp (the cp ranks
    hold the same weights)."""
    return layout.dims.data_parallel


def _fsdp(layout: Layout, step: Step) -> bool:
    """Whether FSDP wraps the model: over dp × cp above 1, and at any dp with offload."""
    return layout.dims.fsdp_wraps(step.cpu_offload)


def _sharding(layout: Layout) -> int:
    """The ranks FSDP shards the weights over: :func:`_data_parallel` less HSDP's replicas."""
    return _data_parallel(layout) // layout.dims.dp_replicate


def _masked(layout: Layout, step: Step) -> bool:
    """Whether attention gets a mask: cp's [seq/cp, seq] one, or transformers' over packed rows."""
    return layout.dims.cp > 1 or step.packing


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


def _nf4_weights(model: nn.Module, layout: Layout, step: Step) -> dict[int, tuple[int, ...]]:
    """With ``peft=qlora``: the NF4 weights, each (this rank's values, their bytes stored, the
    bytes held: FSDP's share of them, in whole tiles), by ``id`` of the parameter they stand for
    on the meta model (the module's NF4 tiles once quantized)."""
    if not step.nf4_base:
        return {}
    found = {}
    for _, module in quantizable(model):
        rows, cols = local_shape(module)
        weight = getattr(module, "weight", None)  # None: quantized, the module's NF4 tiles
        stands_for = weight if weight is not None else module.nf4.tiles
        element, values = stands_for.element_size(), rows * cols
        held = stored_bytes(values // _sharding(layout), element)
        found[id(stands_for)] = (values, stored_bytes(values, element), held)
    return found


def _state(model: nn.Module, layout: Layout, step: Step) -> dict[str, float]:
    """Bytes of the local shards: all of them (NF4 weights as stored), one decoder layer's
    (unsharded over dp: its numel), the matmul weights (autocast copies) and ``lm_head``'s; and of
    the trained ones alone (a frozen base has no gradients and no optimizer state): all, one
    layer's, the TP-replicated ones (the replica sync) and the largest tensor."""
    params = list(model.parameters())
    local = [_local(p) for p in params]
    nf4 = _nf4_weights(model, layout, step)
    pairs = list(zip(params, local, strict=True))
    total = sum(t.numel() * t.element_size() for p, t in pairs if id(p) not in nf4)
    total += sum(held for _, _, held in nf4.values())
    element = local[0].element_size() if local else 4
    layers = _decoder_layers(model)
    layer = max(
        (sum(_local(p).numel() for p in b.parameters() if id(p) not in nf4) for b in layers),
        default=0,
    )
    nf4_layer = max(
        (sum(nf4[id(p)][1] for p in b.parameters() if id(p) in nf4) for b in layers), default=0
    )
    layer_trained = max(
        (sum(_local(p).numel() for p in b.parameters() if p.requires_grad) for b in layers),
        default=0,
    )
    in_layers = {id(p) for block in layers for p in block.parameters()}
    root = sum(t.numel() for p, t in pairs if id(p) not in in_layers)
    embedding = getattr(model.get_input_embeddings(), "weight", None)  # None off the first stage
    head = getattr(model.get_output_embeddings(), "weight", None)  # None off the last
    head_weight = _local(head) if head is not None else None
    trained = [(p, t) for p, t in pairs if p.requires_grad]
    matmul = sum(
        t.numel() for p, t in pairs if t.dim() >= 2 and p is not embedding and id(p) not in nf4
    )
    replicated = sum(t.numel() * t.element_size() for p, t in trained if _tp_replicated(p))
    return {
        "bytes": total,
        "grad_bytes": sum(t.numel() * t.element_size() for _, t in trained),
        "moment_bytes": sum(
            moment_bytes(t, step.optimizer_bits, step.optimizer_block) for _, t in trained
        ),
        "element": element,
        "layer_grad_bytes": layer_trained * element,
        "layer_numel": layer * _sharding(layout),  # FSDP all-gathers a layer over its shards
        "nf4_layer_bytes": nf4_layer,  # its NF4 tiles too, gathered as stored
        # FSDP's root group (embedding, final norm, head), unsharded over dp like a layer
        "root_numel": root * _sharding(layout),
        "matmul_numel": 0 if _fsdp(layout, step) else matmul,  # autocast: without FSDP
        "head_numel": head_weight.numel() if head_weight is not None else 0,
        "head_trained": head is not None and head.requires_grad,  # frozen under LoRA
        "replicated_bytes": replicated,
        "largest_bytes": max((t.numel() * t.element_size() for _, t in trained), default=0),
        "nf4_largest_numel": max((numel for numel, _, _ in nf4.values()), default=0),
    }


_FP8_KEYS = ("fp8_numel", "fp8_largest_numel", "fp8_layer_numel")
_FROZEN_KEYS = (
    "frozen_weights",
    "frozen_on_host",
    "frozen_forward",
    "teacher_hidden",
    "teacher_logits",
)


def _gathered_in_fp8(layout: Layout, step: Step) -> bool:
    """fp8's tensorwise float8 all-gather, where FSDP gathers weights from other ranks
    (``ParallelDims.gathers_weights``, as the recipe's ``Fp8Options.data_parallel``)."""
    fp8 = step.precision == "fp8" and step.fp8_recipe == "tensorwise"
    return fp8 and layout.dims.gathers_weights


def _autocast(layout: Layout, step: Step) -> bool:
    """fp32 weights and bf16 matmuls under ``torch.autocast``: bf16-mixed (or fp8, whose other
    matmuls are bf16-mixed's) without FSDP (with it, FSDP's bf16 copies are the operands)."""
    return step.precision in ("bf16-mixed", "fp8") and not _fsdp(layout, step)


def _fp8_numel(model: nn.Module, layout: Layout) -> dict[str, float]:
    """The float8 linears' weights (elements on this rank): all of them, the largest and one
    layer's unsharded over dp (what a cast sees, what FSDP all-gathers)."""
    weights = [_local(m.weight).numel() for m in model.modules() if isinstance(m, Float8Linear)]
    layers = _decoder_layers(model)
    per_layer = [
        sum(_local(m.weight).numel() for m in block.modules() if isinstance(m, Float8Linear))
        for block in layers
    ]
    return {
        "fp8_numel": sum(weights),
        "fp8_largest_numel": max(weights, default=0) * _sharding(layout),
        "fp8_layer_numel": max(per_layer, default=0) * _sharding(layout),
    }


def _layer_rows(
    config, layout: Layout, step: Step, index: int, frozen_base: bool = False
) -> tuple[float, float, float]:
    """Bytes per (local) token of decoder layer ``index``: (what it saves without checkpointing,
    its input, the gradients in flight in its backward). ``frozen_base``: LoRA's and QLoRA's
    (:func:`_frozen_base`): the norms save no product for their weights' gradients, and no weight
    gradient appears in the backward (see ``in_flight``).

    With a mask (``_masked``) sdpa gets K and V over the whole sequence (cp's all-gather: ``cp``
    rows per local token) repeated to every head (transformers' ``repeat_kv``; the gathered ones
    are not kept), and aten turns the bool mask into a float one of the compute dtype per layer,
    [seq/cp, seq], saved by the kernel; without one, sdpa's ``enable_gqa`` keeps the KV heads."""
    tp, sp = layout.dims.tp, step.sequence_parallel
    compute = 4 if step.precision == "fp32" else 2
    autocast = _autocast(layout, step)  # fp32 weights, bf16 matmuls
    residual = 4 if step.precision == "fp32" or autocast else 2
    autocast_copies = autocast and tp == 1  # each projection casts its own copy of the input
    hidden, dim = config.hidden_size, head_dim(config)
    q = config.num_attention_heads * dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * dim
    # a norm saves its input and, for its weight's gradient, the normalised product (its output,
    # the next matmul's input, is counted there); a frozen norm saves its input alone
    norm_rows = hidden * residual * (1 if frozen_base else 2) / (tp if sp else 1)
    attention_in = hidden * compute * (3 if autocast_copies else 1)
    masked, cp = _masked(layout, step), layout.dims.cp
    keys = (q if masked else kv) * cp  # K's (and V's) row elements per local token
    mask = step.seq_len * compute if masked else 0  # the float mask's row, whole on every TP rank
    # sdpa keeps q (after rotary), k, v and its output (o_proj's input); fp32 log-sum-exp per head
    attention = 2 * (q + keys) * compute / tp + 4 * config.num_attention_heads / tp + mask
    if is_sparse_layer(config, index):
        top_k = getattr(config, "num_experts_per_tok", 1)
        inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        mlp_in = (
            hidden * compute * (1 + 2 * top_k / layout.dims.ep)
        )  # input; routed rows and outputs
        inner_rows = inner * top_k / layout.dims.ep
    else:
        mlp_in = hidden * compute * (2 if autocast_copies else 1)
        inner_rows = config.intermediate_size / tp
    saved = 2 * norm_rows + attention_in + attention + mlp_in + 4 * inner_rows * compute
    # the MLP's product: the gradients of its output and of its two inputs, while the saved input
    # of the down projection is freed; a trained base's weight gradients, written in the same
    # backward, take its place (measured: 8 MiB above the saved at a frozen base's product, where
    # 3 inner rows are 12, 2026-12-04)
    products = 2 if frozen_base else 3
    in_flight = products * inner_rows * compute + 2 * hidden * residual / (tp if sp else 1)
    # attention's backward: the gradients of its output, q, and K and V over the whole sequence
    in_flight = max(in_flight, 2 * (q + keys) * compute / tp)
    return saved, hidden * residual / (tp if sp else 1), in_flight


def _tokens(layout: Layout, step: Step) -> int:
    """Tokens of one micro-batch on this rank: cp splits every row."""
    return layout.micro_batch_size * step.rows_per_sample * step.seq_len // layout.dims.cp


def _activations(
    config, layout: Layout, step: Step, stage: Stage, frozen_base: bool
) -> dict[str, float]:
    """One micro-batch's, through ``stage``'s layers (``frozen_base``: :func:`_layer_rows`)."""
    tokens = _tokens(layout, step)
    rows = [_layer_rows(config, layout, step, i, frozen_base) for i in stage.layers]
    mode = layout.activation_checkpointing
    if mode == "none":
        layers, recompute = sum(saved for saved, _, _ in rows), 0.0
    else:
        kept = 0.0 if mode == "full" else 0.5  # selective keeps the matmul and attention outputs
        layers = sum(block_input + kept * saved for saved, block_input, _ in rows)
        recompute = max((saved for saved, _, _ in rows), default=0.0)  # one layer at a time
    compute = 4 if step.precision == "fp32" else 2
    residual = 4 if step.precision != "bf16" else 2
    shards = layout.dims.tp if step.sequence_parallel else 1
    final_norm = (1 if frozen_base else 2) * config.hidden_size * residual / shards
    # the head's input (whole sequence), the token ids (embedding, head), rotary's cos and sin
    ends = (final_norm + config.hidden_size * compute) * stage.last + 3 * 8 + 4
    ends += 2 * 4 * head_dim(config)
    # a pipeline stage's output (the next one's input, a block's), kept by torch's stage for its
    # backward
    block_output = _layer_rows(config, layout, step, 0)[1]
    output = block_output * (stage.pipelined and not stage.last)
    # the last stage's logits and fp32 log-probabilities, kept for the micro-batch's backward (the
    # one in hand is the buffers' ``logits``; GPipe holds every micro-batch's)
    vocab = _vocab_share(config, layout)
    logits = vocab * (compute + 4) * (stage.pipelined and stage.last)
    return {
        "layers": tokens * layers,
        "stage_output": tokens * output,
        "logits_held": tokens * logits,
        "recompute": tokens * recompute,
        "embedding_and_norm": tokens * ends,
        # the bool mask [seq/cp, seq] per row, built once per forward and handed to every layer
        "attention_mask": tokens * step.seq_len * _masked(layout, step),
        "in_flight": tokens * max((in_flight for _, _, in_flight in rows), default=0.0),
    }


def _loss(config, layout: Layout, step: Step, state: dict, chunked: bool) -> dict[str, float]:
    """The head and the loss: (the forward's transients, the backward's), bytes. Chunked: one chunk
    of logits (fp32, and its bf16 matmul output under bf16 compute), the head's weight cast to the
    compute dtype, and in backward the head's fp32 weight gradient (when it trains) and the hidden
    states' gradient;
    unchunked: the micro-batch's logits, their fp32 copy and their gradient. None without a head
    (a pipeline stage before the last)."""
    tokens = _tokens(layout, step) * (state["head_numel"] > 0)
    compute = 4 if step.precision == "fp32" else 2
    vocab = _vocab_share(config, layout)
    if not chunked:
        logits = tokens * vocab * (compute + 4 + (4 if compute != 4 else 0))
        return {"logits": logits, "head_backward": 0.0}
    rows = min(tokens, step.loss_chunk_tokens)
    cast = state["head_numel"] * compute * (compute != state["element"])
    logits = rows * vocab * (4 + (compute if compute != 4 else 0)) + cast
    gradients = state["head_numel"] * 4 * state["head_trained"]  # its weight's, when trained
    gradients += 2 * tokens * config.hidden_size * compute
    return {"logits": logits, "head_backward": gradients}


def _buffers(config, layout: Layout, step: Step, state: dict, stage: Stage) -> dict[str, float]:
    # the pipeline's loss is unchunked; its FSDP reduces each micro-batch's gradients (torch's
    # stage holds a StageModule, not the FSDP module, so it leaves FSDP's reduce on)
    chunked = bool(step.loss_chunk_tokens) and state["chunks_head"] and not stage.pipelined
    accumulates = step.global_batch_size > layout.micro_batch_size * layout.dims.dp
    fsdp = unsharded = 0.0
    fp8 = step.precision == "fp8"
    on_host = offloaded(step.cpu_offload, step.device_type)
    if _fsdp(layout, step):
        gathered = 2 if step.precision != "fp32" else 4
        fsdp = 2 * state["layer_numel"] * (gathered + 4)  # two layers' parameters, fp32 grads
        fsdp += 2 * state["nf4_layer_bytes"]
        # the root's parameters stay gathered from the forward's start to the backward's end
        # (FSDP2 does not reshard the root after forward)
        fsdp += state["root_numel"] * gathered
        if _gathered_in_fp8(layout, step):  # the float8 linears' weights gathered in fp8
            fsdp -= 2 * state["fp8_layer_numel"] * (gathered - 1)
        # micro-batches accumulate unsharded (offloaded: each reduced to the host's shards)
        if accumulates and not stage.pipelined and not step.cpu_offload:
            unsharded = state["grad_bytes"] / state["element"] * _sharding(layout) * 4
        fsdp += staging_bytes(state, _sharding(layout)) * on_host
    moments = state["grad_bytes"] * step.optimizer_moments / 2
    temporaries = moments if step.device_type == "cuda" else 2 * state["largest_bytes"]
    copies = state["matmul_numel"] - state["head_numel"] * chunked  # the chunked head casts its own
    copies -= state["fp8_numel"] * (_data_parallel(layout) == 1)  # cast to fp8 by the layer itself
    # fp8: a weight's float8 copy (1 byte) lives for one matmul; all-gathered in fp8 it is
    # FSDP's unsharded weight itself
    fp8_casts = state["fp8_largest_numel"] * (fp8 and not _gathered_in_fp8(layout, step))
    return {
        **_loss(config, layout, step, state, chunked),
        "autocast_weight_copies": 2 * copies * _autocast(layout, step),
        "fp8_weight_casts": fp8_casts,
        # QLoRA: the largest NF4 weight dequantized for one matmul, and its untiled copy (torchao's
        # int64 codes, 8 bytes a value, are freed before the matmul allocates its output)
        "nf4_dequantize": state["nf4_largest_numel"] * 2 * state["element"],
        "fsdp_layers": fsdp,
        "fsdp_unsharded_accumulated_grads": unsharded,
        "replica_sync": _replica_sync(layout, state) * (not on_host),
        "optimizer_step": temporaries * (not on_host),  # offloaded: the host CPU's step
    }


def _replica_sync(layout: Layout, state: dict) -> float:
    """The replica sync's flat buffer of the TP-replicated gradients (tp > 1)."""
    return min(MAX_FLAT_BUFFER_BYTES, state["replicated_bytes"]) * (layout.dims.tp > 1)


def _frozen(frozen: Frozen, layout: Layout, step: Step, trained: dict) -> dict[str, float]:
    """Bytes of a frozen model's share of the step (:class:`Frozen`): its weights; its no_grad
    forward's working set (its widest layer's input and transients, FSDP's two unsharded layers,
    the reference's head chunk: nothing is saved for a backward); a teacher's last hidden states
    and the teacher's side of each KL chunk (its fp32 logits, shifted and exponentiated copies),
    which live through the trained model's forward and the head's backward. ``trained``: the
    trained model's :func:`_state`, the reference of peft=lora (its own layers, gathered). With
    offload on CUDA its weights are the host's (the recipe offloads both models), each layer
    staged from there for its all-gather."""
    config, tokens = frozen.config, _tokens(layout, step)
    state = trained if frozen.model is None else _state(frozen.model, layout, step)
    rows = [_layer_rows(config, layout, step, i) for i in range(config.num_hidden_layers)]
    working = tokens * max(block_input + in_flight for _, block_input, in_flight in rows)
    compute = 4 if step.precision == "fp32" else 2
    gathered = 2 * (state["layer_numel"] * compute + state["nf4_layer_bytes"])
    on_host = offloaded(step.cpu_offload, step.device_type)
    fsdp = gathered * _fsdp(layout, step)
    fsdp += staging_bytes(state, _sharding(layout), backward=False) * on_host
    chunk = min(tokens, step.loss_chunk_tokens or tokens) * _vocab_share(config, layout)
    teacher = frozen.keeps_hidden
    weights = 0 if frozen.model is None else state["bytes"]
    return {
        "frozen_weights": weights * (not on_host),
        "frozen_on_host": weights * on_host,
        "frozen_forward": working + fsdp + chunk * (4 + compute) * (not teacher),
        "teacher_hidden": tokens * config.hidden_size * compute * teacher,
        "teacher_logits": chunk * 4 * 3 * teacher,
    }


def _peak(
    grads: float, state: dict, act: dict, buf: dict, layout: Layout, stage: Stage
) -> dict[str, float]:
    """Bytes above params + optimizer state at each phase of the step (its largest is the peak):
    a pipeline stage's with the micro-batches it holds at once (and its gradients, at 1F1B's
    steady state); a frozen model's forward (:func:`_frozen`, its terms in ``buf``) before the
    trained one's, after the gradients of the micro-batches before it."""
    fsdp = buf["fsdp_layers"] + buf["fsdp_unsharded_accumulated_grads"]
    # saved by the forward, for backward: every micro-batch in flight's
    kept = act["layers"] + act["embedding_and_norm"] + act["stage_output"] + act["logits_held"]
    one = kept / stage.in_flight  # one micro-batch's
    held = grads * stage.grads_held
    copies = buf["autocast_weight_copies"]  # in autocast's cache until the forward ends
    none = layout.activation_checkpointing == "none"
    saved_copies = copies if none else 0.0  # saved for backward only without checkpointing
    # one block's backward
    in_flight = buf["block_backward"] + act["recompute"] + buf["fp8_weight_casts"]
    in_flight += buf["nf4_dequantize"]
    layer_copies = copies / state["layers"] if state["layers"] and not none else 0.0
    # the bool mask: freed with the forward's inputs, or kept for the recompute by checkpointing
    mask = act["attention_mask"]
    backward = kept + saved_copies + (0.0 if none else mask)  # what the backward starts with
    first_block = held + backward + buf["head_backward"] + in_flight + layer_copies
    last_block = grads - state["layer_grad_bytes"] + in_flight + layer_copies + (not none) * mask
    last_block += (one / state["layers"] if state["layers"] else one) + kept - one
    forward = held + kept + mask + copies + buf["logits"] + fsdp + buf["fp8_weight_casts"]
    forward += buf["nf4_dequantize"]
    teacher = buf["teacher_hidden"] + buf["teacher_logits"]  # the KL's, through the head's backward
    frozen = buf["frozen_forward"] + (held or grads * state["accumulates"])
    return {
        **({"frozen_forward": frozen} if buf["frozen_forward"] else {}),
        "forward": forward + teacher,
        "head_backward": held + backward + buf["logits"] + buf["head_backward"] + fsdp + teacher,
        "first_block_backward": first_block + fsdp,
        "last_block_backward": last_block + fsdp,
        "after_backward": grads + buf["replica_sync"],
        "optimizer_step": grads + buf["optimizer_step"],
    }


def estimate_memory(
    model: nn.Module,
    config,
    layout: Layout,
    step: Step,
    stage: Stage | None = None,
    frozen: Frozen | None = None,
) -> MemoryEstimate:
    """Per-rank memory of a training step of ``model``, the parallel meta model of ``layout``:
    the whole model, or with ``stage`` one pipeline rank's; with ``frozen``, a frozen model run
    forward beside it (DPO's reference, distillation's teacher)."""
    stage = stage or whole_model(config)
    state = _state(model, layout, step)
    state["layers"], state["chunks_head"] = len(stage.layers), chunks_head(model)
    state["accumulates"] = step.global_batch_size > layout.micro_batch_size * layout.dims.dp
    fp8 = step.precision == "fp8"
    state |= _fp8_numel(model, layout) if fp8 else dict.fromkeys(_FP8_KEYS, 0)
    params, grads = state["bytes"], state["grad_bytes"]  # grads: of the trained parameters
    optimizer = state["moment_bytes"] * step.optimizer_moments
    host = {}
    if offloaded(step.cpu_offload, step.device_type):  # the shards' state on the host instead
        host = host_bytes(state, optimizer, _replica_sync(layout, state))
        params = grads = optimizer = state["layer_grad_bytes"] = 0
    act = _activations(config, layout, step, stage, _frozen_base(model))
    for name in ("layers", "stage_output", "embedding_and_norm", "attention_mask"):
        act[name] *= stage.in_flight
    act["logits_held"] *= stage.in_flight - 1
    buf = {**_buffers(config, layout, step, state, stage), "block_backward": act.pop("in_flight")}
    buf |= _frozen(frozen, layout, step, state) if frozen else dict.fromkeys(_FROZEN_KEYS, 0)
    weights, frozen_on_host = buf.pop("frozen_weights"), buf.pop("frozen_on_host")
    host |= {"frozen": frozen_on_host} if frozen_on_host else {}
    phases = _peak(grads, state, act, buf, layout, stage)
    peak = params + weights + optimizer + max(phases.values())
    gib = {name: value / GIB for name, value in {**act, **buf}.items()}
    return MemoryEstimate(
        params=params / GIB,
        grads=grads / GIB,
        optimizer=optimizer / GIB,
        frozen=weights / GIB,
        activations=sum(act.values()) / GIB,
        buffers=sum(buf.values()) / GIB,
        runtime=step.runtime_gib,
        total=peak / GIB + step.runtime_gib,
        detail=gib,
        phases={name: value / GIB for name, value in phases.items()},
        host=sum(host.values()) / GIB,
        host_detail={name: value / GIB for name, value in host.items()},
    )


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks (a pipeline stage's own), or none where none are found."""
    try:
        return decoder_blocks(model)
    except ValueError:
        return []


def _frozen_base(model: nn.Module) -> bool:
    """Whether the decoder blocks' own weights are frozen (peft=lora, peft=qlora): none of their
    vectors (norms' weights, biases) trains; the adapters are matrices."""
    vectors = [p for block in _decoder_layers(model) for p in block.parameters() if p.dim() == 1]
    return bool(vectors) and not any(p.requires_grad for p in vectors)


def _vocab_share(config, layout: Layout) -> float:
    """The vocabulary a rank's logits hold: a tp-th where tp divides it (vocab-parallel head)."""
    return config.vocab_size / (layout.dims.tp if config.vocab_size % layout.dims.tp == 0 else 1)
