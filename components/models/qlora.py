"""QLoRA: LoRA (``components/models/lora.py``) on a base whose adapted linears' weights are stored
as NF4 (torchao's ``NF4Tensor``), dequantized on the fly in forward and in backward (docs/lora.md).

A weight [out, in] is quantized in tiles of :data:`TILE` × :data:`TILE` values: each tile holds
2 × 2 NF4 blocks of :data:`SIDE` × :data:`SIDE` (64 values per absmax scale, QLoRA's count), and
its 4 scales share one double-quantization scale (the mean of all scales is the whole tensor's).
Row shards (colwise TP) and column shards (rowwise TP) are then sets of whole tiles, so
:func:`quantize_nf4` quantizes the whole tensor once and keeps this rank's tiles: the numbers do not
depend on tp. The output head keeps its dtype (the chunked loss reads its weight; tied heads are
the embedding), and so do the MoE experts' 3-D weights. Each rank's tiles are a frozen parameter
of an :class:`NF4Base`, which FSDP2 shards over dp in whole tiles like any frozen weight
(torchao's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``): a dp shard's blocks, as a TP
shard's, are the whole tensor's.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torchao.quantization import to_nf4
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

from components.distributed.tp_replicas import exclude_from_tp_replica_sync
from components.models.lora import LoRALinear, lora_modules

SIDE = 8  # an NF4 block: SIDE × SIDE values (64, QLoRA's block size) share an absmax scale
TILE = 2 * SIDE  # a tile: TILE × TILE values, 4 blocks whose scales share one scale
BLOCK, PER_TILE = SIDE * SIDE, TILE * TILE


def _tiled(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [rows, cols] as [tiles, TILE²]: tiles row-major, in each its blocks row-major,
    in each block its values row-major."""
    rows, cols = weight.shape
    blocks = weight.reshape(rows // TILE, 2, SIDE, cols // TILE, 2, SIDE)
    return blocks.permute(0, 3, 1, 4, 2, 5).reshape(-1, PER_TILE)


def _untiled(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The reverse of :func:`_tiled`."""
    blocks = tiles.reshape(rows // TILE, cols // TILE, 2, 2, SIDE, SIDE)
    return blocks.permute(0, 2, 4, 1, 3, 5).reshape(rows, cols)


@dataclass(frozen=True, kw_only=True)
class NF4Weight:
    """This rank's tiles of a weight (an ``NF4Tensor`` [tiles, TILE²] in tile order) and the shape
    they make, [rows, cols]."""

    data: torch.Tensor
    rows: int
    cols: int

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [rows, cols] in ``dtype``."""
        return _untiled(self.data.get_original_weight(), self.rows, self.cols).to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held but the shared code table's: the codes, the quantized scales, their scales
        and their mean."""
        inner = (self.data.quantized_data, self.data.quantized_scalers)
        inner += (self.data.quantization_factor, self.data.scaler_mean)
        return sum(t.numel() * t.element_size() for t in inner)


def nf4_problem(name: str, rows: int, cols: int) -> str | None:
    """Why the local weight [rows, cols] of the linear ``name`` cannot be stored in whole tiles."""
    if rows % TILE == 0 and cols % TILE == 0:
        return None
    return (
        f"peft=qlora stores {name}'s weight in NF4 tiles of {TILE} × {TILE}, and this rank's part "
        f"of it is [{rows}, {cols}]: use a tp that leaves multiples of {TILE}, or leave {name} "
        "out of peft.target_modules"
    )


def quantize_nf4(
    whole: torch.Tensor, split: int | None, parts: int, index: int, table: torch.Tensor | None
) -> NF4Weight:
    """``whole`` [out, in] quantized in tiles, and part ``index`` of ``parts`` along dimension
    ``split`` (0: rows, 1: columns; None: the whole) kept. ``table``: the NF4 code table to share
    (None: this tensor's own)."""
    rows, cols = whole.shape
    grid = (rows // TILE, cols // TILE)
    nf4 = to_nf4(_tiled(whole.detach()), BLOCK, PER_TILE // BLOCK)
    order = torch.arange(grid[0] * grid[1], device=whole.device).view(grid)
    if split is not None:
        order = order.chunk(parts, dim=split)[index]
        rows, cols = (rows // parts, cols) if split == 0 else (rows, cols // parts)
    kept = _tiles(nf4, order.flatten(), nf4.nf4 if table is None else table)
    return NF4Weight(data=kept, rows=rows, cols=cols)


def _tiles(nf4: NF4Tensor, kept: torch.Tensor, table: torch.Tensor) -> NF4Tensor:
    """A new ``NF4Tensor`` of the tiles ``kept`` of ``nf4`` (with the whole tensor's scale mean)."""
    blocks = PER_TILE // BLOCK  # per tile
    data = nf4.quantized_data.view(-1, PER_TILE // 2)[kept].flatten()  # two codes a byte
    scalers = nf4.quantized_scalers.view(-1, blocks)[kept].flatten()
    factor = nf4.quantization_factor[kept].contiguous()
    shape = torch.Size((len(kept), PER_TILE))
    meta = SubclassTensorArgs(shape, (PER_TILE, 1), 0, nf4.dtype, nf4.device, False)
    scales = (scalers, factor, nf4.scaler_mean)
    return NF4Tensor(meta, BLOCK, len(kept) * blocks, blocks, *scales, data, table)


class NF4Base(nn.Module):
    """A :class:`QLoRALinear`'s base weight: ``tiles``, a frozen parameter holding this rank's
    tiles (an ``NF4Tensor`` [tiles, TILE²], :class:`NF4Weight`'s ``data``), which FSDP shards
    over dp by whole tiles and gathers for each forward and backward, and the shape they make.
    Left out of checkpoints (a resume quantizes the base again, the same at any layout) and of
    the TP replica sync (each TP rank holds its own tiles)."""

    def __init__(self, weight: NF4Weight) -> None:
        super().__init__()
        self.tiles = nn.Parameter(weight.data, requires_grad=False)
        self.rows, self.cols = weight.rows, weight.cols
        exclude_from_tp_replica_sync(self)

    def weight(self) -> NF4Weight:
        """The weight as the module holds it now: whole within FSDP's forward and backward."""
        return NF4Weight(data=self.tiles, rows=self.rows, cols=self.cols)

    def whole(self) -> NF4Weight:
        """The weight with its tiles gathered over dp (collective under FSDP)."""
        tiles = self.tiles.full_tensor() if isinstance(self.tiles, DTensor) else self.tiles
        return NF4Weight(data=tiles, rows=self.rows, cols=self.cols)

    def local(self) -> NF4Weight:
        """This rank's shard of the tiles (all of them without FSDP); ``rows`` the whole's."""
        tiles = self.tiles.to_local() if isinstance(self.tiles, DTensor) else self.tiles
        return NF4Weight(data=tiles, rows=self.rows, cols=self.cols)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Nothing: the base is quantized again on resume, not saved."""

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        """Nothing to load (and nothing missing): see :meth:`_save_to_state_dict`."""


class NF4Linear(torch.autograd.Function):
    """``x @ Wᵀ`` with W dequantized from NF4 in forward and again in backward: nothing but the
    NF4 weight is kept for backward, and W gets no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
        ctx.weight = weight
        return torch.nn.functional.linear(x, weight.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.weight.dequantize(grad.dtype), None


class QLoRALinear(LoRALinear):
    """A :class:`LoRALinear` whose base weight is this rank's NF4 tiles (``nf4``, an
    :class:`NF4Base`; no ``weight``): the base output computed as the TP style would from the
    dequantized weight."""

    nf4: NF4Base

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.nf4.weight()
        if self._tp is None:
            out = NF4Linear.apply(x, weight)
        elif self._tp[1] == "rowwise":  # x sharded on features: a partial sum per rank
            local = NF4Linear.apply(x.to_local(), weight)
            out = DTensor.from_local(local, self._tp[0], (Partial(),), run_check=False)
        else:  # x replicated: this rank's output features
            local_x = x.to_local(grad_placements=(Partial(),)) if isinstance(x, DTensor) else x
            local = NF4Linear.apply(local_x, weight)
            out = DTensor.from_local(local, self._tp[0], (Shard(-1),), run_check=False)
        return out if self.bias is None else out + self.bias


def quantizable(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """The adapted linears whose base :func:`quantize_base` stores as NF4 (or has stored): all
    but the head."""
    head = model.get_output_embeddings()
    return [(name, module) for name, module in lora_modules(model) if module is not head]


def nf4_problems(model: nn.Module, styles: dict[str, str], tp: int, shards: int = 1) -> list[str]:
    """Why the adapted linears of ``model`` (converted by ``apply_lora``) cannot be stored in
    whole tiles at ``tp``, each split by its TP style in ``styles`` (none at tp=1), then by FSDP
    over ``shards`` ranks (``ParallelDims.fsdp_shards``) in whole tiles, as many on each; or
    that none would be NF4 (adapters on the head alone: plain LoRA under QLoRA's name)."""
    found, uneven = [], {}
    if lora_modules(model) and not quantizable(model):
        return [
            "peft=qlora stores no base in NF4 here: the adapted linears (peft.target_modules) are "
            "the output head's alone, whose weight QLoRA keeps in the run's precision; use "
            "peft=lora, or target other linears"
        ]
    for name, module in quantizable(model):
        rows, cols = module.out_features, module.in_features
        style = styles.get(name)
        if style == "rowwise":
            cols //= tp
        elif style is not None:
            rows //= tp
        if (problem := nf4_problem(name, rows, cols)) is not None:
            found.append(problem)
        elif (tiles := rows * cols // PER_TILE) % shards:
            uneven[name] = tiles
    return found + ([_uneven_shards(uneven, shards)] if uneven else [])


def _uneven_shards(tiles: dict[str, int], shards: int) -> str:
    """Why FSDP cannot shard the NF4 bases of ``tiles`` (name: this TP rank's tiles of it) over
    ``shards`` ranks."""
    named = ", ".join(f"{name} ({count})" for name, count in tiles.items())
    return (
        f"peft=qlora shards each NF4 base over FSDP's {shards} ranks (dp × cp) in whole tiles of "
        f"{TILE} × {TILE}, as many on each (torchao's NF4Tensor takes no uneven FSDP shards), and "
        f"{shards} does not divide the tiles of {named}: use a dp (× cp) that divides each count, "
        "or leave those layers out of peft.target_modules"
    )


@torch.no_grad()
def quantize_base(model: nn.Module) -> list[str]:
    """Store the base weight of each adapted linear but the head as NF4 (its parameter replaced
    by an :class:`NF4Base`), after the weights are loaded and split by TP and before FSDP; return
    their names. Collective under TP (the whole weight is gathered once, layer by layer, in name
    order)."""
    names, table = [], None
    for name, module in quantizable(model):
        weight = module.weight
        split, parts, index = None, 1, 0
        if isinstance(weight, DTensor):
            split = weight.placements[0].dim
            parts, index = weight.device_mesh.size(), weight.device_mesh.get_local_rank()
            weight = weight.full_tensor()
        nf4 = quantize_nf4(weight, split, parts, index, table)
        table = nf4.data.nf4  # one code table per rank
        del module.weight
        module.nf4 = NF4Base(nf4)
        module.__class__ = QLoRALinear
        names.append(name)
    return names


@torch.no_grad()
def dequantize_base(model: nn.Module) -> None:
    """The reverse of :func:`quantize_base` for an export: each NF4 base back to a frozen parameter
    of its dtype (as the TP style split it, whole over dp), so that the adapters can be merged
    into it. Collective under FSDP (each base's tiles gathered over dp, in name order)."""
    for _, module in lora_modules(model):
        if not isinstance(module, QLoRALinear):
            continue
        nf4 = module.nf4.whole()
        local = nf4.dequantize(nf4.data.dtype)
        if module._tp is not None:
            placement = Shard(1) if module._tp[1] == "rowwise" else Shard(0)
            local = DTensor.from_local(local, module._tp[0], (placement,), run_check=False)
        module.__class__ = LoRALinear
        del module.nf4
        module.weight = nn.Parameter(local, requires_grad=False)


def local_shape(module: LoRALinear) -> tuple[int, int]:
    """This rank's [rows, cols] of the adapted linear ``module``'s weight, as TP splits it."""
    rows, cols = module.out_features, module.in_features
    if module._tp is None:
        return rows, cols
    mesh, style, _ = module._tp
    return (rows, cols // mesh.size()) if style == "rowwise" else (rows // mesh.size(), cols)


def stored_bytes(values: int, element: int) -> int:
    """Bytes of ``values`` values of ``element`` bytes (whole tiles) stored in NF4 tiles: half a
    byte a value, an int8 scale per block, a scale per tile and the scales' mean in its dtype."""
    return values // 2 + values // BLOCK + (values // PER_TILE + 1) * element


def nf4_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the NF4 bases' tiles held on this rank, its shards of them under FSDP, each code
    table once; the bytes of the same values in bf16)."""
    weights = [m.nf4.local() for _, m in lora_modules(model) if isinstance(m, QLoRALinear)]
    tables = {w.data.nf4.data_ptr(): w.data.nf4 for w in weights}
    held = sum(w.nbytes for w in weights)
    held += sum(t.numel() * t.element_size() for t in tables.values())
    return held, sum(w.data.numel() * 2 for w in weights)
