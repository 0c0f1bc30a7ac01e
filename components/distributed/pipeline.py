"""Pipeline parallelism over ``torch.distributed.pipelining``: a Hugging Face causal LM cut into
stages at its decoder layers, one stage per rank of the mesh's ``pp`` dimension (or several, looped,
under the interleaved schedule).

The first stage holds the embedding, the last the final norm and ``lm_head``; the decoder layers are
shared out with the embedding and the head each weighed as one more layer. A stage is the whole
model with what it does not hold removed: its parameters keep their original names
(``model.layers.5.mlp.up_proj.weight``), so TP plans, FSDP, DCP checkpoints and resumes across
layouts see the names they always see. The step's micro-batches are the schedule's (GPipe, 1F1B,
interleaved 1F1B); the loss is each micro-batch's token sum over the global token count (grads
are not scaled again by the number of micro-batches), computed on the last stage.
"""

import copy
import fnmatch
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from components.distributed.replicas.flat_buffers import local_tensor
from components.distributed.tp_plan import cross_entropy_sum

# torch.distributed.pipelining's schedule classes by name: one stage per rank, or several
SINGLE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
MULTI = {"interleaved_1f1b": "ScheduleInterleaved1F1B"}


STAGE_PARTS = ("layers", "embed_tokens", "norm")  # what keep_stage shares out or drops
# What a decoder's own forward multiplies its input embeddings by (Granite's and its MoE kin's),
# and the value that makes it a no-op: the embeddings are scaled once, by the first stage.
EMBEDDING_SCALES = {"embedding_multiplier": 1.0}
NOT_PER_LAYER = ("architectures",)  # config lists that may have as many entries as layers


def stage_structure_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot be cut into stages (None when it can): its decoder (``get_decoder()``)
    must hold its layers as ``layers``, and no parameters beside them, ``embed_tokens`` and
    ``norm``, which every stage would otherwise run (OPT's ``embed_positions``, added again to
    each stage's input); nor may it change a later stage's input otherwise
    (:func:`embedding_side_problem`)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        return "its decoder holds no layers list (layers)"
    beside = [
        name
        for name, child in decoder.named_children()
        if name not in STAGE_PARTS and any(True for _ in child.parameters())
    ]
    if beside:
        return f"{', '.join(beside)} beside its decoder layers, embedding and final norm (norm)"
    return embedding_side_problem(model)


def skip_embedding_scale(decoder: nn.Module) -> None:
    """Make ``decoder`` (a stage's, not the first's) pass the hidden states it is handed to its
    first layer as they are: its own scale of the input embeddings (:data:`EMBEDDING_SCALES`)
    set to the value that does nothing (multiplying by 1.0 is exact)."""
    for name, neutral in EMBEDDING_SCALES.items():
        if hasattr(decoder, name):
            setattr(decoder, name, neutral)


def decoder_output(model: nn.Module, **inputs):
    """A stage without the head: its decoder's output (``last_hidden_state``), without what the
    model's own forward does after the head (Cohere's logit scale, Granite's logit scaling, Gemma
    2's softcapping), which belongs to the last stage alone. Bound as such a stage's forward, so
    the model's hooks (FSDP's) still run around it."""
    return model.get_decoder()(**inputs)


def end_at_hidden_states(model: nn.Module) -> None:
    """Make ``model`` (a stage that does not hold the head) run :func:`decoder_output`."""
    model.forward = types.MethodType(decoder_output, model)


def embedding_side_problem(model: nn.Module) -> str | None:
    """Why a stage after the first would change the hidden states it is handed before its first
    layer (None when it would not): ``model``'s decoder (a meta model's is enough) as a middle
    stage without layers runs it (:func:`stage_view`: no embedding, no final norm, its embedding
    scale neutral), on random hidden states; what comes out must be what went in, else every
    stage would apply it again."""
    width = model.get_input_embeddings().weight.shape[-1]
    hidden = torch.randn(1, 4, width)
    try:
        passed_on = _layerless_stage(model, last=False)(hidden)  # a middle stage
        last = _layerless_stage(model, last=True)  # a last stage: its final norm runs once
        final_norm_runs = []
        last.decoder.norm.register_forward_hook(lambda *_: final_norm_runs.append(1))
        last(hidden)
    except Exception as error:  # noqa: BLE001 - the refusal says what the decoder raised
        said = f"{type(error).__name__}: {error}".splitlines()[0]
        return f"its decoder does not run on the hidden states of an earlier stage ({said})"
    if not torch.equal(passed_on, hidden):
        return "its decoder's forward changes the input embeddings before its first layer"
    if len(final_norm_runs) > 1:  # NanoChat's weightless RMSNorm: the middle stage cannot tell
        return "its final norm also runs on the input embeddings, before its first layer"
    return None


@dataclass(frozen=True, kw_only=True)
class _LayerlessStage:
    """A stage's decoder without layers (a copy, its few buffers allocated), run on hidden
    states."""

    decoder: nn.Module

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1])[None]
        with torch.no_grad():
            out = self.decoder(inputs_embeds=hidden, position_ids=positions, use_cache=False)
        return out.last_hidden_state


def _layerless_stage(model: nn.Module, last: bool) -> _LayerlessStage:
    stage = stage_view(model, range(0), first=False, last=last)
    return _LayerlessStage(decoder=copy.deepcopy(stage.get_decoder()).to_empty(device="cpu"))


def stage_config(config, layers: list[int]):
    """``config`` as a decoder running only ``layers`` must read it: a copy whose per-layer lists
    (one entry per decoder layer: ``layer_types``, ``layer_rope_theta``, ...) hold those layers'
    entries, in order, since a decoder's forward reads them by the layer's position in its list
    (``config.layer_types[i]``: Gemma 2 and 3, Cohere 2 and some 50 more types). The layers
    themselves keep the whole config: they read it by their own index."""
    staged = copy.copy(config)
    for name, value in vars(config).items():
        per_layer = isinstance(value, list | tuple) and len(value) == config.num_hidden_layers
        if per_layer and name not in NOT_PER_LAYER and not name.endswith("_token_id"):
            setattr(staged, name, type(value)(value[index] for index in layers))
    return staged


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The decoder layers of each of ``stages`` stages, in order: ``num_layers + 2`` units (the
    embedding, the layers, the norm and head) shared out as evenly as they go, the first stages
    taking one more when they do not divide; the embedding is the first stage's, the head the
    last's.

    Raises:
        ValueError: fewer units than stages.
    """
    units = num_layers + 2
    if units < stages:
        raise ValueError(
            f"{stages} pipeline stages need at least {stages - 2} decoder layers, the model has "
            f"{num_layers}"
        )
    sizes = [units // stages + (stage < units % stages) for stage in range(stages)]
    bounds = [sum(sizes[:stage]) for stage in range(stages + 1)]
    return [
        range(max(start - 1, 0), min(end - 1, num_layers))
        for start, end in zip(bounds, bounds[1:], strict=False)
    ]


class StageLayers(nn.ModuleList):
    """A stage's decoder layers, named by their indices in the whole model (``5``, ``6``), read by
    position (``[0]`` is the stage's first)."""

    def __getitem__(self, index):
        if isinstance(index, slice):
            return super().__getitem__(index)
        return list(self._modules.values())[index]


def keep_stage(model: nn.Module, layers: list[int], first: bool, last: bool) -> nn.Module:
    """Remove from ``model`` (in place) what a rank's stages do not hold: the decoder layers not in
    ``layers``, the embedding unless ``first``, the final norm and ``lm_head`` unless ``last`` (each
    then an identity). The kept layers keep their indices as names. The model's own forward runs
    the last stage (``inputs_embeds`` in, the logits out); the others run the decoder alone
    (:func:`end_at_hidden_states`), and those after the first skip its embedding scale."""
    decoder = model.get_decoder()
    kept = StageLayers()
    for index in layers:
        kept.add_module(str(index), decoder.layers[index])
    decoder.layers = kept
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = nn.Identity()
        model.lm_head = nn.Identity()
    _run_as_stage(model, decoder, layers, first, last)
    return model


def _run_as_stage(model: nn.Module, decoder: nn.Module, layers, first: bool, last: bool) -> None:
    """What makes ``model`` (or a view of it) with ``decoder`` compute its stage and no more: the
    decoder reads its ``layers``' per-layer settings (:func:`stage_config`), skips its embedding
    scale unless ``first``, and unless ``last`` the model ends at the hidden states."""
    decoder.config = stage_config(model.config, list(layers))
    if not first:
        skip_embedding_scale(decoder)
    if not last:
        end_at_hidden_states(model)


class StageModule(nn.Module):
    """What a pipeline stage calls: the (kept) model's forward on token ids (the first stage) or
    hidden states, with the step's ``position_ids``, under the precision's ``compute`` context; the
    logits, or the hidden states for the next stage. Checkpoints save the model itself, never
    this wrapper (whose names carry a ``model.`` prefix)."""

    def __init__(
        self,
        model: nn.Module,
        first: bool,
        last: bool,
        compute: Callable[[], AbstractContextManager],
    ):
        super().__init__()
        self.model, self.last = model, last
        self.inputs, self.compute = ("input_ids" if first else "inputs_embeds"), compute

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        with self.compute():
            outputs = self.model(
                **{self.inputs: inputs}, position_ids=position_ids, use_cache=False
            )
        return outputs.logits if self.last else outputs.last_hidden_state


class Pipeline:
    """This rank's stage of a pipelined model and its schedule: :meth:`forward_backward` runs one
    step's micro-batches through every stage and accumulates the gradients; called as the recipe's
    step function (``run``, ``plan``, ``step``), on ``run.data``'s batches of ``step``."""

    def __init__(
        self,
        modules: dict[int, nn.Module],
        stages: int,
        group: ProcessGroup,
        schedule: str,
        micro_batches: int,
        compute: Callable[[], AbstractContextManager],
        mesh: DeviceMesh,
        tied: "TiedEmbedding | None" = None,
    ):
        """``modules``: this rank's stages (index -> the module that runs it) of ``stages``;
        ``tied``: the embedding the first and the last stage share, on their ranks."""
        from torch.distributed import pipelining  # asks for CUDA when imported: in the ranks only

        self.first, self.last, self.group = 0 in modules, stages - 1 in modules, group
        self.compute, self.sums, self.global_tokens = compute, [], 1
        self.micro_batches, self.tied = micro_batches, tied
        # a DTensor sent between stages (sequence-parallel activations) names its mesh by its dims
        get_mesh = lambda names, _layout: mesh[names]  # noqa: E731
        self.stages = [
            pipelining.PipelineStage(
                StageModule(module, index == 0, index == stages - 1, compute),
                index,
                stages,
                next(module.parameters()).device,
                group=group,
                get_mesh=get_mesh,
            )
            for index, module in modules.items()
        ]
        # the loss on every stage: torch reads "no loss" as "no backward"
        if schedule in MULTI:
            schedule_class, stages_ = getattr(pipelining, MULTI[schedule]), self.stages
        else:
            schedule_class, stages_ = getattr(pipelining, SINGLE[schedule]), self.stages[0]
        self.schedule = schedule_class(stages_, micro_batches, self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss (the last stage's): its token sum over the step's global count,
        the sum kept for the step's readout."""
        with self.compute():
            loss_sum = cross_entropy_sum(logits, labels, False)
        whole = loss_sum.full_tensor() if isinstance(loss_sum, DTensor) else loss_sum
        self.sums.append(whole.detach().to(torch.float64))
        return loss_sum / self.global_tokens

    def __call__(self, run, plan, step: int) -> torch.Tensor:
        """The step function: step ``step``'s micro-batches of ``run.data`` (a ``StepBatches``),
        stacked, through :meth:`forward_backward`. ``plan``: unused, the signature's."""
        stacked = _stacked(run.data.batches_for_step(step))
        tensors = [tensor.to(run.device) for tensor in stacked.values()]
        return self.forward_backward(*tensors, run.data.labels_in_step(step))

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        global_tokens: int,
    ) -> torch.Tensor:
        """One step: ``input_ids``, ``labels`` and ``position_ids`` are the step's micro-batches
        stacked (the schedule splits them back, in order); ``global_tokens`` the labelled tokens
        of the global batch. Returns the step's summed token loss (float64), the same on every
        stage (one sum over the ``pp`` group)."""
        self.sums, self.global_tokens = [], global_tokens
        inputs = (input_ids,) if self.first else ()
        target = labels if self.last else None
        # return_outputs=False: else the last stage keeps every micro-batch's logits to the end
        with loss_parallel():  # the backward of a vocab-parallel loss runs inside it too
            self.schedule.step(
                *inputs, target=target, position_ids=position_ids, return_outputs=False
            )
        loss_sum = torch.zeros((), dtype=torch.float64, device=input_ids.device)
        if self.sums:  # the first step's shape inference runs the loss once more, first
            loss_sum += torch.stack(self.sums[-self.micro_batches :]).sum()
        dist.all_reduce(loss_sum, group=self.group)  # the last stage's, on every stage
        if self.tied is not None:
            self.tied.sum_gradient()
        return loss_sum

    def after_update(self) -> None:
        """After the optimizer step: the last stage's copy of a tied embedding takes the first's
        updated weight."""
        if self.tied is not None and self.tied.weight.requires_grad:  # frozen: never changes
            self.tied.share_weight()

    def evaluate(self, batches: list, rows: int, pad_id: int) -> torch.Tensor:
        """The summed token loss (float64, the same on every stage) of ``batches``: this dp rank's
        validation micro-batches (``input_ids``, ``labels``, ``position_ids``, every one
        ``train.seq_len`` long), forward only, through the schedule in rounds of its micro-batches.
        The stages exchange activations of the training shape, so a short micro-batch is filled to
        ``rows`` rows and the last round to a whole one with unlabelled rows of ``pad_id``, which
        add nothing to the loss."""
        device = batches[0].input_ids.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, len(batches), self.micro_batches):
            chosen = batches[start : start + self.micro_batches]
            filled = _filled_rows(chosen, rows * self.micro_batches, pad_id)
            self.sums, self.global_tokens = [], 1
            inputs = (filled["input_ids"],) if self.first else ()
            target = filled["labels"] if self.last else None
            with loss_parallel():
                self.schedule.eval(*inputs, target=target, position_ids=filled["position_ids"])
            if self.sums:
                loss_sum += torch.stack(self.sums).sum()
        dist.all_reduce(loss_sum, group=self.group)
        return loss_sum


def _stacked(batches: list) -> dict[str, torch.Tensor]:
    """``batches``' ``input_ids``, ``labels`` and ``position_ids``, each stacked in order (the
    schedule splits them back into micro-batches)."""
    names = ("input_ids", "labels", "position_ids")
    return {name: torch.cat([getattr(batch, name) for batch in batches]) for name in names}


def _filled_rows(batches: list, rows: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``batches``' tensors stacked and filled to ``rows`` rows: ``pad_id`` tokens, no labels
    (-100), positions from 0."""
    stacked = _stacked(batches)
    missing, width = rows - stacked["input_ids"].shape[0], stacked["input_ids"].shape[1]
    if missing == 0:
        return stacked
    like = stacked["input_ids"]
    fill = {
        "input_ids": torch.full((missing, width), pad_id, dtype=like.dtype, device=like.device),
        "labels": torch.full((missing, width), -100, dtype=like.dtype, device=like.device),
        "position_ids": torch.arange(width, device=like.device).expand(missing, width),
    }
    return {name: torch.cat([stacked[name], fill[name].to(stacked[name].dtype)]) for name in fill}


def every_stage(held: tuple[list, list, dict], group: ProcessGroup) -> tuple[list, list, dict]:
    """What each rank of the ``pp`` ``group`` holds of something small (a LoRA adapter's module
    names, expert weight names and whole tensors), joined: the lists concatenated in stage order,
    the dicts merged, tensors on the CPU. Collective over ``group``."""
    names, experts, state = held
    mine = (names, experts, {key: tensor.cpu() for key, tensor in state.items()})
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    joined: tuple[list, list, dict] = ([], [], {})
    for stage_names, stage_experts, stage_state in gathered:
        joined[0].extend(stage_names)
        joined[1].extend(stage_experts)
        joined[2].update(stage_state)
    return joined


class TiedEmbedding:
    """The embedding a model ties to its head (``tie_word_embeddings``), held by the first stage
    as ``embed_tokens.weight`` and by the last as ``lm_head.weight``: one weight, used twice. Its
    gradient is the sum of both stages' parts, owned by the first stage (the last stage's copy
    keeps none, so the grad norm counts it once and the optimizer leaves that copy alone), and the
    first stage's weight is copied to the last after building and after each update (frozen under
    ``peft=lora``: after building alone, no gradient to sum). Each pair of
    first and last ranks (the same coordinates on every other dimension) has a group of two."""

    def __init__(self, weight: torch.Tensor, first: bool, group: ProcessGroup, source: int):
        self.weight, self.first, self.group, self.source = weight, first, group, source
        self.share_weight()

    @staticmethod
    def of(model: nn.Module, mesh: DeviceMesh, first: bool, last: bool) -> "TiedEmbedding | None":
        """This rank's part of the model's tied embedding: None when it does not tie them or
        this rank holds neither end (or both: one process, nothing to share)."""
        if not getattr(model.config, "tie_word_embeddings", False) or first == last:
            return None
        ranks = mesh["pp"].mesh.tolist()  # this rank's pipeline, stage by stage
        group = dist.new_group([ranks[0], ranks[-1]], use_local_synchronization=True)
        weight = model.get_decoder().embed_tokens.weight if first else model.lm_head.weight
        return TiedEmbedding(weight, first, group, ranks[0])

    @torch.no_grad()
    def sum_gradient(self) -> None:
        weight = self.weight
        if not weight.requires_grad:  # frozen (peft=lora): no gradient on either stage
            return
        if isinstance(weight.grad, DTensor) and weight.grad.placements != weight.placements:
            # a vocab-parallel embedding's gradient comes whole: its own rows, as the head's
            weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
        dist.all_reduce(local_tensor(weight.grad), group=self.group)
        if not self.first:
            weight.grad = None

    @torch.no_grad()
    def share_weight(self) -> None:
        dist.broadcast(local_tensor(self.weight), src=self.source, group=self.group)


def rank_stages(rank: int, ranks: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank ``rank`` of ``ranks`` holds: ``rank``, ``rank + ranks``, ... (the
    looped order of interleaved schedules)."""
    return [rank + ranks * round_ for round_ in range(stages_per_rank)]


def rank_share(
    rank: int, ranks: int, stages_per_rank: int, num_layers: int
) -> tuple[list[int], bool, bool]:
    """What pipeline rank ``rank`` of ``ranks`` holds of a model of ``num_layers`` decoder layers:
    its layers (of all its :func:`rank_stages`), whether it holds the embedding (the first stage)
    and whether the norm and head (the last)."""
    stages, count = rank_stages(rank, ranks, stages_per_rank), ranks * stages_per_rank
    cut = stage_layers(num_layers, count)
    return [layer for stage in stages for layer in cut[stage]], 0 in stages, count - 1 in stages


def keep_rank_stage(model: nn.Module, mesh: DeviceMesh, stages_per_rank: int = 1) -> nn.Module:
    """:func:`keep_stage` for this rank's stages (its coordinate on ``mesh["pp"]``)."""
    rank, ranks = mesh["pp"].get_local_rank(), mesh["pp"].size()
    layers, first, last = rank_share(rank, ranks, stages_per_rank, len(model.get_decoder().layers))
    return keep_stage(model, layers, first=first, last=last)


def stage_view(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """One of a rank's several stages: a shallow copy of the kept ``model`` (and its decoder) that
    runs only ``layers`` (the embedding if ``first``, the norm and head if ``last``), its modules
    and parameters the model's own, shared."""
    decoder = model.get_decoder()
    view, inner = copy.copy(model), copy.copy(decoder)
    view._modules, inner._modules = dict(model._modules), dict(decoder._modules)
    view.__dict__.pop("forward", None)  # the kept model's own, bound to it (end_at_hidden_states)
    kept = StageLayers()
    for index in layers:
        kept.add_module(str(index), decoder.layers._modules[str(index)])
    inner._modules["layers"] = kept
    inner._modules["embed_tokens"] = decoder.embed_tokens if first else None
    inner._modules["norm"] = decoder.norm if last else nn.Identity()
    view._modules["lm_head"] = model.lm_head if last else nn.Identity()
    view._modules[next(n for n, m in model.named_children() if m is decoder)] = inner
    _run_as_stage(view, inner, layers, first, last)
    return view


def build_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    compute: Callable[[], AbstractContextManager],
    data,
    schedule: str,
    stages_per_rank: int = 1,
) -> Pipeline | None:
    """This rank's :class:`Pipeline` over ``mesh["pp"]``, ``model`` its kept (and parallelised)
    stages (each then run by a :func:`stage_view` of it when there are several), ``data`` the run's
    ``StepBatches`` (their micro-batches per step are the schedule's); None when the mesh has no
    ``pp`` dimension."""
    if "pp" not in (mesh.mesh_dim_names or ()):
        return None
    pp = mesh["pp"]
    stages = rank_stages(pp.get_local_rank(), pp.size(), stages_per_rank)
    count = pp.size() * stages_per_rank
    modules = {stages[0]: model}
    if stages_per_rank > 1:
        cut = stage_layers(int(model.config.num_hidden_layers), count)
        modules = {i: stage_view(model, cut[i], i == 0, i == count - 1) for i in stages}
    first, last = stages[0] == 0, stages[-1] == count - 1
    tied = TiedEmbedding.of(model, mesh, first, last)
    where = (count, pp.get_group(), schedule, data.micro_batches_per_step, compute, mesh)
    return Pipeline(modules, *where, tied)


def stage_plan(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """The entries of a TP ``plan`` (pattern -> style) that name a module this stage holds: the
    embedding's only on the first stage, the norm's and the head's only on the last."""
    names = [name for name, module in model.named_modules() if not isinstance(module, nn.Identity)]
    return {pattern: style for pattern, style in plan.items() if fnmatch.filter(names, pattern)}
